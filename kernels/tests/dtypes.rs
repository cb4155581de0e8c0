//! Stored dtypes in the kernels: `cast` between f32, f16, bf16, i32, i64 and bool, and gathers indexed by
//! i32 and i64 ids, on the CPU against hand-written expectations, and the generated CUDA
//! kernels built for the host against the CPU, bit for bit (every byte of every output).

use kiln_compiler::ir::{DType, Op, Shape};
use kiln_kernels::cpu;
use kiln_kernels::cuda::generate;

#[allow(dead_code)] // the harness serves several test files; this one uses part of it
mod cuda_host;

/// Values as the bytes of a `dtype` buffer.
fn encode(values: &[f64], dtype: DType) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&v| match dtype {
            DType::I32 => (v as i32).to_le_bytes().to_vec(),
            DType::I64 => (v as i64).to_le_bytes().to_vec(),
            DType::Bool => vec![u8::from(v != 0.0)],
            DType::F16 => half::f16::from_f64(v).to_bits().to_le_bytes().to_vec(),
            DType::BF16 => half::bf16::from_f64(v).to_bits().to_le_bytes().to_vec(),
            DType::F32 => (v as f32).to_le_bytes().to_vec(),
        })
        .collect()
}

/// Bytes in whole f32 words (the host runner's unit), zero-padded.
fn words(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            f32::from_bits(u32::from_le_bytes(w))
        })
        .collect()
}

fn unwords(w: &[f32], len: usize) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_bits().to_le_bytes()).take(len).collect()
}

/// Runs `op` on the CPU over operand byte buffers (8-byte aligned copies) and returns the
/// output's bytes.
fn cpu_run(op: &Op, operands: &[(&Shape, DType, Vec<u8>)], out: (&Shape, DType)) -> Vec<u8> {
    let types: Vec<(&Shape, DType)> = operands.iter().map(|(s, d, _)| (*s, *d)).collect();
    let kernel = cpu::prepare(op, &types, out).unwrap_or_else(|e| panic!("{e}"));
    let mut bufs: Vec<Vec<u64>> = operands
        .iter()
        .map(|(_, _, b)| {
            let mut w = vec![0u64; b.len().div_ceil(8)];
            bytemuck::cast_slice_mut::<u64, u8>(&mut w)[..b.len()].copy_from_slice(b);
            w
        })
        .collect();
    let bytes = out.0.numel() * out.1.size_bytes();
    let mut o = vec![0u64; bytes.div_ceil(8)];
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    // SAFETY: each buffer holds its operand's bytes, 8-byte aligned; the output its bytes.
    unsafe { kernel.run(&ptrs, o.as_mut_ptr() as *mut u8) };
    bytemuck::cast_slice::<u64, u8>(&o)[..bytes].to_vec()
}

const ALL: [DType; 6] = [DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64, DType::Bool];

/// Values that exercise every rule: truncation toward zero, NaN, saturation, wrap-around of
/// large integers, negative zero, bools.
fn samples(from: DType) -> Vec<f64> {
    match from {
        // And the half types' edges: f16's largest finite value and the tie above it, its
        // subnormals, ties to even in both, infinities.
        DType::F32 => vec![
            0.0,
            -0.0,
            1.9,
            -1.9,
            2.5,
            f64::NAN,
            3e9,
            -3e9,
            1e20,
            -1e20,
            16777217.0,
            0.5,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            3e-8,
            2.9802322387695312e-8,
            -1e-7,
            6.1e-5,
            1.00390625,
            1.01171875,
            -1.0009765625,
            f64::INFINITY,
            f64::NEG_INFINITY,
            1e-40,
        ],
        DType::F16 => vec![0.0, -0.0, 1.5, -2.25, 65504.0, 6e-8, -3e-5, f64::INFINITY, f64::NAN, 1000.5],
        DType::BF16 => vec![0.0, -0.0, 1.5, -2.25, 3e38, 1e-39, -7.5, f64::NEG_INFINITY, f64::NAN, 1000.0],
        DType::I32 => vec![0.0, 1.0, -1.0, 2147483647.0, -2147483648.0, 16777217.0, 7.0, 0.0],
        DType::I64 => vec![0.0, 1.0, -1.0, 4294967297.0, -4294967297.0, 9007199254740993.0, 5.0, 0.0],
        _ => vec![0.0, 1.0, 1.0, 0.0, 1.0],
    }
}

#[test]
fn casts_follow_rusts_as_on_the_cpu() {
    let f = |v: f64| v as f32;
    let cases: Vec<(DType, DType, Vec<f64>, Vec<u8>)> = vec![
        (DType::F32, DType::I32, vec![1.9, -1.9, f64::NAN, 3e9, -3e9], {
            [1i32, -1, 0, i32::MAX, i32::MIN].iter().flat_map(|v| v.to_le_bytes()).collect()
        }),
        (DType::F32, DType::Bool, vec![0.0, -0.0, 0.5, f64::NAN], vec![0, 0, 1, 1]),
        (
            DType::I64,
            DType::I32,
            vec![4294967297.0, -1.0],
            [1i32, -1].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (
            DType::Bool,
            DType::F32,
            vec![1.0, 0.0],
            [1.0f32, 0.0].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
        (DType::I32, DType::F32, vec![16777217.0], f(16777216.0).to_le_bytes().to_vec()),
        // f32 -> half rounds to nearest, ties to even; f16 overflows from 65520, keeps
        // subnormals down to 2^-24.
        (DType::F32, DType::F16, vec![65520.0, 65519.0, 3e-8, -1.0009765625], {
            [0x7c00u16, 0x7bff, 0x0001, 0xbc01].iter().flat_map(|v| v.to_le_bytes()).collect()
        }),
        (DType::F32, DType::BF16, vec![1.00390625, 1.01171875, -0.0], {
            [0x3f80u16, 0x3f82, 0x8000].iter().flat_map(|v| v.to_le_bytes()).collect()
        }),
        (
            DType::BF16,
            DType::I32,
            vec![-2.5, 300.0],
            [-2i32, 300].iter().flat_map(|v| v.to_le_bytes()).collect(),
        ),
    ];
    for (from, to, values, expect) in cases {
        let s = Shape::from([values.len()]);
        let got = cpu_run(&Op::Cast { to }, &[(&s, from, encode(&values, from))], (&s, to));
        assert_eq!(got, expect, "{from} -> {to} of {values:?}");
    }
}

#[test]
fn integer_ids_gather_the_rows_f32_ids_gather() {
    let table = Shape::from([5, 3]);
    let tv: Vec<f64> = (0..15).map(|i| i as f64 * 0.5).collect();
    let ids = Shape::from([4]);
    let want = cpu_run(
        &Op::Gather,
        &[
            (&table, DType::F32, encode(&tv, DType::F32)),
            (&ids, DType::F32, encode(&[4.0, 0.0, 2.0, 4.0], DType::F32)),
        ],
        (&Shape::from([4, 3]), DType::F32),
    );
    for d in [DType::I32, DType::I64] {
        let got = cpu_run(
            &Op::Gather,
            &[(&table, DType::F32, encode(&tv, DType::F32)), (&ids, d, encode(&[4.0, 0.0, 2.0, 4.0], d))],
            (&Shape::from([4, 3]), DType::F32),
        );
        assert_eq!(got, want, "{d} ids");
        // An id outside the table is refused before the kernel runs.
        let types = [(&table, DType::F32), (&ids, d)];
        let k = cpu::prepare(&Op::Gather, &types, (&Shape::from([4, 3]), DType::F32)).unwrap();
        let mut t = encode(&tv, DType::F32);
        let mut bad = encode(&[1.0, 5.0, 0.0, -1.0], d);
        let e = unsafe { k.check_operands(&[t.as_mut_ptr(), bad.as_mut_ptr()]) }.unwrap_err();
        assert!(e.contains("id 5 at position 1"), "{e}");
    }
    // Bool ids and integer arithmetic are refused by the checks, naming the dtype.
    let e = cpu::prepare(
        &Op::Gather,
        &[(&table, DType::F32), (&ids, DType::Bool)],
        (&Shape::from([4, 3]), DType::F32),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("bool"), "{e}");
    let e = generate(&Op::Unary(kiln_compiler::ir::UnaryOp::Exp), &[(&ids, DType::I32)], (&ids, DType::I32))
        .err()
        .unwrap();
    assert!(e.to_string().contains("i32"), "{e}");
}

/// Every cast pair and both integer id types, as generated CUDA built for the host: the same
/// bytes as the CPU's.
#[test]
fn cuda_casts_and_integer_gathers_match_the_cpu_on_the_host() {
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let mut runs = Vec::new();
    let mut expected = Vec::new();
    for from in ALL {
        for to in ALL {
            if from == to {
                continue;
            }
            let values = samples(from);
            let s = Shape::from([values.len()]);
            let input = encode(&values, from);
            let want = cpu_run(&Op::Cast { to }, &[(&s, from, input.clone())], (&s, to));
            let kernel = generate(&Op::Cast { to }, &[(&s, from)], (&s, to)).unwrap();
            runs.push(cuda_host::HostCase {
                name: format!("cast_{from}_{to}"),
                kernel,
                operands: vec![words(&input)],
                output_len: want.len().div_ceil(4),
                scratch_len: 0,
            });
            expected.push(want);
        }
    }
    let table = Shape::from([6, 4]);
    let tv: Vec<f64> = (0..24).map(|i| i as f64 - 3.5).collect();
    for d in [DType::I32, DType::I64] {
        let ids = Shape::from([5]);
        // Out-of-range ids gather zero rows on CUDA, as the CPU's `run` does.
        let idv = encode(&[5.0, 0.0, -1.0, 2.0, 6.0], d);
        let out = Shape::from([5, 4]);
        let want = cpu_run(
            &Op::Gather,
            &[(&table, DType::F32, encode(&tv, DType::F32)), (&ids, d, idv.clone())],
            (&out, DType::F32),
        );
        let kernel = generate(&Op::Gather, &[(&table, DType::F32), (&ids, d)], (&out, DType::F32)).unwrap();
        runs.push(cuda_host::HostCase {
            name: format!("gather_{d}"),
            kernel,
            operands: vec![words(&encode(&tv, DType::F32)), words(&idv)],
            output_len: want.len() / 4,
            scratch_len: 0,
        });
        expected.push(want);
        let dy: Vec<f64> = (0..20).map(|i| i as f64 * 0.25).collect();
        let grad = Op::GatherGrad { vocab: 6 };
        let want = cpu_run(
            &grad,
            &[(&ids, d, idv.clone()), (&out, DType::F32, encode(&dy, DType::F32))],
            (&table, DType::F32),
        );
        let kernel = generate(&grad, &[(&ids, d), (&out, DType::F32)], (&table, DType::F32)).unwrap();
        runs.push(cuda_host::HostCase {
            name: format!("gather_grad_{d}"),
            kernel,
            operands: vec![words(&idv), words(&encode(&dy, DType::F32))],
            output_len: want.len() / 4,
            scratch_len: 0,
        });
        expected.push(want);
    }
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    let results = cuda_host::run(runs).unwrap_or_else(|e| panic!("{e}"));
    for ((name, r), want) in names.iter().zip(&results).zip(&expected) {
        assert_eq!(&unwords(&r.output, want.len()), want, "{name}");
    }
}
