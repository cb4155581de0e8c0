//! The tiled GEMM under both variants (`KILN_GEMM_VARIANT=base|fast`) and under forced tiles
//! (`KILN_GEMM_TILE`), run on the host (`cuda_host`) against the CPU kernels: the tiles the cost
//! model never picks for shapes small enough to run on the host (128x128 with 8x8 per thread,
//! deep or odd K tiles) and every path of the fast kernel (float4 loads and their element
//! fallbacks, partial float4s at an edge, threads without a float4 of a small tile, float4
//! output stores, the epilogue and update sinks, transposed and broadcast operands, M, N or
//! K = 1).
//!
//! The variables are read when a kernel is generated, so this file holds one test (its own
//! process, no other thread generating kernels meanwhile) that sets them around each
//! generation.

use kiln_compiler::ir::fused::{FusedMatMul, Inst, Ref};
use kiln_compiler::ir::{BinaryOp, DType, Fused, Grad, Op, Rows, Shape, UnaryOp, infer};
use kiln_kernels::cpu;
use kiln_kernels::cuda::{CudaKernel, generate, generate_with_scratch, scratch_bytes};

mod cuda_host;

struct Case {
    name: String,
    op: Op,
    shapes: Vec<Shape>,
}

fn output(op: &Op, shapes: &[Shape]) -> Shape {
    let ops: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
    infer(op, &ops).unwrap_or_else(|e| panic!("{op:?}: {}", e.message)).0
}

/// relu(A·B + bias) over an output of `shape`, A transposed with `ta`: a product with an
/// epilogue.
fn bias_relu(shape: [usize; 2], ta: bool) -> Op {
    Op::Fused(Fused {
        shape: Shape::from(shape),
        insts: vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
        ],
        reduce: None,
        matmul: Some(FusedMatMul { transpose_a: ta, transpose_b: false }),
        conv: None,
        epilogue: Vec::new(),
        epilogue_operands: 0,
    })
}

/// The products: shapes around one or a few 128 x 128 tiles, K a multiple of 8 but not of 16
/// (or odd), leading dimensions multiples of 4 or not.
fn cases() -> Vec<Case> {
    let mm = |ta, tb| Op::MatMul { transpose_a: ta, transpose_b: tb };
    let mut v: Vec<(String, Op, Vec<Vec<usize>>)> = vec![
        ("plain".into(), mm(false, false), vec![vec![200, 72], vec![72, 260]]),
        ("ta".into(), mm(true, false), vec![vec![68, 200], vec![68, 260]]),
        ("tb".into(), mm(false, true), vec![vec![200, 68], vec![260, 68]]),
        ("ta_tb".into(), mm(true, true), vec![vec![72, 200], vec![260, 72]]),
        ("odd".into(), mm(false, false), vec![vec![131, 37], vec![37, 129]]),
        ("odd_t".into(), mm(true, true), vec![vec![37, 131], vec![129, 37]]),
        ("k_odd".into(), mm(false, false), vec![vec![140, 45], vec![45, 136]]),
        ("n_odd".into(), mm(false, false), vec![vec![140, 48], vec![48, 138]]),
        ("batch_bcast".into(), mm(false, false), vec![vec![2, 1, 72, 40], vec![3, 40, 132]]),
        ("batch_bcast_t".into(), mm(true, true), vec![vec![1, 3, 40, 72], vec![2, 1, 132, 40]]),
        ("fold".into(), mm(false, false), vec![vec![3, 50, 24], vec![24, 140]]),
        ("m1".into(), mm(false, false), vec![vec![1, 16], vec![16, 140]]),
        ("n1".into(), mm(false, false), vec![vec![140, 16], vec![16, 1]]),
        ("k1".into(), mm(false, false), vec![vec![140, 1], vec![1, 140]]),
        ("k1_t".into(), mm(true, true), vec![vec![1, 140], vec![140, 1]]),
        (
            "rows_vec_edge".into(),
            Op::MatMulRows { rows: Rows { start: 4, len: 130 } },
            vec![vec![72, 200], vec![72, 36]],
        ),
        (
            "rows_odd".into(),
            Op::MatMulRows { rows: Rows { start: 3, len: 130 } },
            vec![vec![72, 200], vec![72, 36]],
        ),
    ];
    v.push(("epilogue".into(), bias_relu([200, 260], false), vec![vec![200, 72], vec![72, 260], vec![260]]));
    let sgd =
        Op::ApplySgd { lr: 0.1, momentum: 0.9, nesterov: false, rows: None, product: false, shard: None };
    let sgd = sgd.update_in(None, Grad::Product);
    v.push(("sgd_product".into(), sgd, vec![vec![136, 132], vec![40, 136], vec![40, 132], vec![136, 132]]));
    v.into_iter()
        .map(|(name, op, shapes)| Case {
            name,
            op,
            shapes: shapes.iter().map(|s| Shape::from(s.as_slice())).collect(),
        })
        .collect()
}

/// Long contractions into few outputs, small enough for the host: split-K across blocks.
fn split_cases() -> Vec<Case> {
    let mm = |ta, tb| Op::MatMul { transpose_a: ta, transpose_b: tb };
    let mut v: Vec<(String, Op, Vec<Vec<usize>>)> = vec![
        ("split_plain".into(), mm(false, false), vec![vec![8, 1600], vec![1600, 12]]),
        ("split_ta".into(), mm(true, false), vec![vec![1536, 20], vec![1536, 12]]),
        ("split_odd".into(), mm(true, true), vec![vec![1201, 9], vec![7, 1201]]),
        ("split_batch".into(), mm(true, false), vec![vec![2, 1024, 8], vec![2, 1024, 12]]),
    ];
    v.push((
        "split_epilogue".into(),
        bias_relu([16, 12], true),
        vec![vec![1536, 16], vec![1536, 12], vec![12]],
    ));
    let sgd =
        Op::ApplySgd { lr: 0.1, momentum: 0.9, nesterov: false, rows: None, product: false, shard: None };
    let sgd = sgd.update_in(None, Grad::Product);
    v.push(("split_sgd".into(), sgd, vec![vec![12, 8], vec![1536, 12], vec![1536, 8], vec![12, 8]]));
    v.into_iter()
        .map(|(name, op, shapes)| Case {
            name,
            op,
            shapes: shapes.iter().map(|s| Shape::from(s.as_slice())).collect(),
        })
        .collect()
}

/// The kernel of `c` under `variant` with the scratch it asks for (`split` forces a count),
/// and that scratch's bytes.
fn generate_split(c: &Case, variant: &str, split: Option<&str>) -> (CudaKernel, usize) {
    set("KILN_GEMM_VARIANT", Some(variant));
    set("KILN_GEMM_SPLIT", split);
    let ops: Vec<(&Shape, DType)> = c.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = output(&c.op, &c.shapes);
    let scratch = scratch_bytes(&c.op, &ops, &out);
    let k = generate_with_scratch(&c.op, &ops, (&out, DType::F32), scratch)
        .unwrap_or_else(|e| panic!("{}: {e}", c.name));
    set("KILN_GEMM_VARIANT", None);
    set("KILN_GEMM_SPLIT", None);
    (k, scratch)
}

/// The operands (deterministic per case) and what the CPU kernel makes of them: the operands
/// after the run (an update changes some) and the output.
fn reference(c: &Case, seed: u64) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>) {
    let mut x = seed | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    };
    let inputs: Vec<Vec<f32>> = c.shapes.iter().map(|s| (0..s.numel()).map(|_| next()).collect()).collect();
    let mut bufs = inputs.clone();
    let ops: Vec<(&Shape, DType)> = c.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = output(&c.op, &c.shapes);
    let kernel = cpu::prepare(&c.op, &ops, (&out, DType::F32)).expect("cpu kernel");
    let effect = c.op.is_effect();
    let mut o = vec![f32::NAN; if effect { 0 } else { out.numel() }];
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    let optr = if effect { std::ptr::null_mut() } else { o.as_mut_ptr() as *mut u8 };
    // SAFETY: buffers sized from the shapes, distinct allocations; effects get a null output.
    unsafe { kernel.run(&ptrs, optr) };
    (inputs, bufs, o)
}

/// Sets (or removes) an environment variable.
fn set(name: &str, value: Option<&str>) {
    // SAFETY: this test binary runs one test, and nothing else in it reads or writes the
    // environment while it does.
    unsafe {
        match value {
            Some(v) => std::env::set_var(name, v),
            None => std::env::remove_var(name),
        }
    }
}

fn generate_with(c: &Case, variant: &str, tile: Option<&str>) -> CudaKernel {
    set("KILN_GEMM_VARIANT", Some(variant));
    set("KILN_GEMM_TILE", tile);
    let ops: Vec<(&Shape, DType)> = c.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = output(&c.op, &c.shapes);
    let k = generate(&c.op, &ops, (&out, DType::F32)).unwrap_or_else(|e| panic!("{}: {e}", c.name));
    set("KILN_GEMM_VARIANT", None);
    set("KILN_GEMM_TILE", None);
    k
}

#[test]
fn every_variant_and_forced_tile_matches_the_cpu() {
    // (variant, forced tile): the model's tiles under both variants, then tiles forced: the
    // fast variant's 8x8 tiles (BK 8 and 16; 32, whose two stages would not fit in 48 KiB: one
    // stage), 8x4 and 4x8 ones, BK 4 and 12 (one float4 or
    // three along k), BK 2 (element loads of a k-contiguous operand), 2x2 (no float4 reads of
    // the micro-tile), and the base kernel's 8x8.
    let configs: [(&str, Option<&str>); 14] = [
        ("base", None),
        ("fast", None),
        ("fast", Some("128x128x8x8x8")),
        ("fast", Some("64x64x16x4x4")),
        ("fast", Some("128x128x16x8x8")),
        ("fast", Some("128x128x32x8x8")),
        ("fast", Some("128x64x8x8x4")),
        ("fast", Some("64x128x16x4x8")),
        ("fast", Some("64x64x4x4x4")),
        ("fast", Some("64x64x12x4x4")),
        ("fast", Some("64x32x2x4x2")),
        ("fast", Some("32x32x16x2x2")),
        ("base", Some("128x128x8x8x8")),
        ("base", Some("64x64x16x4x4")),
    ];
    let all = cases();
    let mut runs = Vec::new();
    let mut references = Vec::new();
    for (variant, tile) in configs {
        for (i, c) in all.iter().enumerate() {
            let kernel = generate_with(c, variant, tile);
            let name = format!("{}-{variant}-{}", c.name, tile.unwrap_or("model"));
            if let Some(t) = tile {
                // Every forced tile fits these shapes (16 x 16 threads, within the limits).
                let dims: Vec<&str> = t.split('x').collect();
                let want =
                    format!("tile {}x{}x{}, {}x{} per thread", dims[0], dims[1], dims[2], dims[3], dims[4]);
                assert!(kernel.describe.contains(&want), "{name}: {}", kernel.describe);
            }
            let fast = variant == "fast" && kernel.describe.contains("tile ");
            assert_eq!(kernel.describe.contains("shared stage"), fast, "{name}: {}", kernel.describe);
            let one_stage = tile == Some("128x128x32x8x8");
            assert_eq!(kernel.describe.contains("1 shared stage"), one_stage, "{name}: {}", kernel.describe);
            let (inputs, after, out) = reference(c, 0x9E37_79B9_7F4A_7C15 ^ (i as u64 * 7919));
            runs.push(cuda_host::HostCase {
                name: name.clone(),
                kernel,
                operands: inputs.clone(),
                output_len: out.len(),
                scratch_len: 0,
            });
            references.push((name, c, inputs, after, out));
        }
    }
    // Split-K across blocks (with the scratch each asks for) under both variants: the model's
    // splits and 4 forced, over long contractions of every operand layout and sink.
    let long = split_cases();
    for variant in ["base", "fast"] {
        for split in [None, Some("4")] {
            for (i, c) in long.iter().enumerate() {
                let (kernel, scratch) = generate_split(c, variant, split);
                let name = format!("{}-{variant}-split{}", c.name, split.unwrap_or("model"));
                assert!(kernel.describe.contains("K split across"), "{name}: {}", kernel.describe);
                let (inputs, after, out) = reference(c, 0x51ED ^ (i as u64 * 104_729));
                runs.push(cuda_host::HostCase {
                    name: name.clone(),
                    kernel,
                    operands: inputs.clone(),
                    output_len: out.len(),
                    scratch_len: scratch / 4,
                });
                references.push((name, c, inputs, after, out));
            }
        }
    }
    // The fast variant reads the plain operands as float4s where it may, and not elsewhere.
    let fast_plain = &runs[all.len()..2 * all.len()];
    for r in fast_plain {
        let d = &r.kernel.describe;
        let both = ["plain-", "ta-", "tb-", "ta_tb-", "batch_bcast", "epilogue-", "sgd_product-"];
        if both.iter().any(|p| r.name.starts_with(p)) {
            assert!(d.contains("float4 loads of A and B"), "{}: {d}", r.name);
        }
        if r.name.starts_with("odd") {
            assert!(!d.contains("float4"), "{}: {d}", r.name);
        }
    }
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped the host runs: {why}");
        return;
    }
    let ran = runs.len();
    let results = cuda_host::run(runs).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for (r, (name, c, before, after, out)) in results.iter().zip(&references) {
        let check = if c.op.is_effect() {
            cuda_host::check_effect(&c.op, before, &r.operands, after)
        } else {
            cuda_host::close(&r.output, out, cuda_host::tolerance(&c.op))
        };
        if let Err(e) = check {
            failures.push(format!("{name}: {e}"));
        }
    }
    // Both variants sum every product in the same order (per thread in K order, split-K
    // groups in group order): under the same tile their results are the same bits.
    let output = |name: &str| &results[references.iter().position(|r| r.0 == name).expect("run")];
    let mut same = 0;
    for c in &all {
        for tile in ["128x128x8x8x8", "64x64x16x4x4"] {
            let (base, fast) =
                (output(&format!("{}-base-{tile}", c.name)), output(&format!("{}-fast-{tile}", c.name)));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            if c.op.is_effect() {
                for (b, f) in base.operands.iter().zip(&fast.operands) {
                    assert_eq!(bits(b), bits(f), "{} under {tile}: the variants' updates differ", c.name);
                }
            } else {
                assert_eq!(
                    bits(&base.output),
                    bits(&fast.output),
                    "{} under {tile}: the variants differ",
                    c.name
                );
            }
            same += 1;
        }
    }
    assert_eq!(same, 2 * all.len());
    eprintln!("{ran} GEMM kernels ran on the host");
    assert!(failures.is_empty(), "{} kernels differ from the CPU:\n{}", failures.len(), failures.join("\n"));
    tf32_products_match_the_cpu_within_tf32_rounding();
}

/// The TF32 tensor-core kernels (`KILN_TF32=1`), on the host through the header's equivalents of
/// `cvt.rna.tf32.f32` and `mma.sync.m16n8k8`: every product within 2^-9 of its sum of |terms|
/// (each operand rounded to 10 mantissa bits, the products summed in f32), and outside that
/// bound for f32 rounding alone it would be no test: the same kernels with operands that TF32
/// represents exactly (multiples of 1/8 below 4) must match the CPU to f32 rounding.
fn tf32_products_match_the_cpu_within_tf32_rounding() {
    let plain = |c: &Case| matches!(c.op, Op::MatMul { .. } | Op::MatMulRows { .. });
    let small: Vec<Case> = cases().into_iter().filter(|c| plain(c)).collect();
    let long: Vec<Case> = split_cases().into_iter().filter(|c| plain(c)).collect();
    let mut runs = Vec::new();
    let mut checks = Vec::new();
    for exact in [false, true] {
        for (i, c) in small.iter().chain(&long).enumerate() {
            set("KILN_TF32", Some("1"));
            let (kernel, scratch) = if i < small.len() {
                (generate_with(c, "fast", None), 0)
            } else {
                generate_split(c, "fast", None)
            };
            set("KILN_TF32", None);
            assert!(kernel.describe.contains("TF32 tensor cores"), "{}: {}", c.name, kernel.describe);
            assert!(kernel.source.contains("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"));
            let (mut inputs, _, _) = reference(c, 0x7F32 ^ (i as u64 * 31));
            if exact {
                for v in inputs.iter_mut().flatten() {
                    *v = (*v * 8.0).round() / 8.0;
                }
            }
            let (want, terms) = cpu_with_terms(c, &inputs);
            runs.push(cuda_host::HostCase {
                name: format!("{}-tf32{}", c.name, if exact { "-exact" } else { "" }),
                kernel,
                operands: inputs,
                output_len: want.len(),
                scratch_len: scratch / 4,
            });
            checks.push((exact, want, terms));
        }
    }
    if cuda_host::available().is_err() {
        return;
    }
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    let results = cuda_host::run(runs).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for ((name, r), (exact, want, terms)) in names.iter().zip(&results).zip(&checks) {
        for (j, ((&g, &w), &s)) in r.output.iter().zip(want).zip(terms).enumerate() {
            let tol = if *exact { 1e-6 * s + 1e-30 } else { s / 512.0 + 1e-30 };
            let within = (g - w).abs() <= tol; // false for a NaN
            if !within {
                failures
                    .push(format!("{name} element {j}: {g} on the host, {w} on the CPU (tolerance {tol})"));
                break;
            }
        }
    }
    eprintln!("{} TF32 GEMM kernels ran on the host", names.len());
    assert!(failures.is_empty(), "{} TF32 kernels differ:\n{}", failures.len(), failures.join("\n"));
}

/// The CPU's output of `c` on `inputs`, and its output on their magnitudes (the sum of |terms|
/// of every product).
fn cpu_with_terms(c: &Case, inputs: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>) {
    let ops: Vec<(&Shape, DType)> = c.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = output(&c.op, &c.shapes);
    let kernel = cpu::prepare(&c.op, &ops, (&out, DType::F32)).expect("cpu kernel");
    let run = |mut bufs: Vec<Vec<f32>>| {
        let mut o = vec![f32::NAN; out.numel()];
        let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
        // SAFETY: buffers sized from the shapes, distinct allocations.
        unsafe { kernel.run(&ptrs, o.as_mut_ptr() as *mut u8) };
        o
    };
    let abs: Vec<Vec<f32>> = inputs.iter().map(|v| v.iter().map(|x| x.abs()).collect()).collect();
    (run(inputs.to_vec()), run(abs))
}
