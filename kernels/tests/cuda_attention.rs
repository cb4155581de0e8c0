//! The CUDA kernels of fused attention (`cuda::attention`: `Op::Attention` and
//! `Op::AttentionGrad`) run on the host (`cuda_host`: the generated CUDA C compiled with the
//! system C++ compiler and launched with its own grid and block) and compared with a naive f64
//! reference written here, which materialises the scores and the softmax. The reference depends
//! on no kernel of this crate.
//!
//! Tolerances follow the f32 error of each quantity: a sum of n rounded terms is within about
//! n · 2^-24 · Σ|terms|, and a probability is off relatively by the error of its score
//! (the dot product's, (D + 4) · 2^-24 · scale · Σ|q·k|, plus the bias) and of the
//! exponential; each bound is then taken four times over.
//!
//! With NVRTC present (`.nvrtc/`, `KILN_NVRTC`; required under `KILN_REQUIRE_NVRTC=1`) every
//! kernel here, and some too large to run on the host (64-bit indices), is compiled to PTX for
//! sm_90.

// The reference indexes its [S, T] matrices as the formulas do.
#![allow(clippy::needless_range_loop)]

use kiln_compiler::ir::{DType, Op, Shape, infer};
use kiln_kernels::cuda::{Arg, CudaKernel, generate, scratch_bytes};

// The harness's comparisons with the CPU kernels are not used here.
#[allow(dead_code)]
mod cuda_host;

const EPS: f64 = 1.0 / (1u64 << 24) as f64;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Uniform in [-2, 2).
    fn data(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| -2.0 + 4.0 * self.next()).collect()
    }
}

/// An attention case: leading axes, S, T, D, the mask, and the bias's shape if any.
#[derive(Clone)]
struct Case {
    name: String,
    lead: Vec<usize>,
    s: usize,
    t: usize,
    d: usize,
    causal: bool,
    bias: Option<Vec<usize>>,
}

fn case(
    name: &str,
    lead: &[usize],
    s: usize,
    t: usize,
    d: usize,
    causal: bool,
    bias: Option<&[usize]>,
) -> Case {
    Case { name: name.into(), lead: lead.to_vec(), s, t, d, causal, bias: bias.map(|b| b.to_vec()) }
}

fn cases() -> Vec<Case> {
    vec![
        case("d1_causal", &[2], 7, 7, 1, true, None),
        case("d1_bias_b11t", &[2, 3], 5, 9, 1, false, Some(&[2, 1, 1, 9])),
        case("d8_bias_b11t", &[2, 3], 5, 9, 8, false, Some(&[2, 1, 1, 9])),
        case("d8_causal_s_lt_t_bias_st", &[2, 2], 6, 11, 8, true, Some(&[6, 11])),
        case("d8_causal_s_gt_t_masked_rows", &[3], 13, 5, 8, true, Some(&[1, 13, 5])),
        case("d8_decode_row", &[4], 1, 9, 8, true, None),
        case("d64_causal_tiles", &[2], 70, 70, 64, true, None),
        case("d64_bias_heads", &[2, 2], 33, 65, 64, false, Some(&[2, 1, 1, 65])),
        case("d64_causal_s_gt_t_bias", &[1, 2], 67, 40, 64, true, Some(&[1, 1, 67, 40])),
        case("d64_causal_s_lt_t", &[1], 29, 75, 64, true, Some(&[75])),
        case("d80_causal_bias_t", &[3], 19, 37, 80, true, Some(&[37])),
        case("d80_full_bias", &[2, 2], 9, 9, 80, false, Some(&[2, 2, 9, 9])),
        case("d128_causal", &[2], 40, 41, 128, true, None),
        case("d400_rows_gradient", &[2], 5, 6, 400, true, Some(&[5, 6])),
        case("d800_rows", &[1, 2], 4, 7, 800, false, Some(&[1, 2, 1, 7])),
        case("d800_rows_causal_masked", &[1], 6, 3, 800, true, None),
    ]
}

fn scale_of(d: usize) -> f32 {
    if d == 1 { 0.7 } else { 1.0 / (d as f32).sqrt() }
}

/// Reference values and tolerances per element.
struct Want {
    v: Vec<f64>,
    tol: Vec<f64>,
}

/// Operands and the reference of one case.
struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    bias: Option<Vec<f32>>,
    /// The forward's output as f32 (the gradient's o), and do.
    o: Vec<f32>,
    dout: Vec<f32>,
    fwd: Want,
    grad: Want,
}

/// The bias's element for (bh, i, j): right-aligned broadcasting over (lead..., S, T).
fn bias_at(c: &Case, b: &[f32], bh: usize, i: usize, j: usize) -> f64 {
    let dims = c.bias.as_ref().unwrap();
    let mut full = c.lead.clone();
    full.extend([c.s, c.t]);
    let mut coord = vec![0; full.len()];
    let mut rest = bh;
    for a in (0..c.lead.len()).rev() {
        coord[a] = rest % c.lead[a];
        rest /= c.lead[a];
    }
    coord[full.len() - 2] = i;
    coord[full.len() - 1] = j;
    let off = full.len() - dims.len();
    let mut idx = 0;
    for (a, &e) in dims.iter().enumerate() {
        idx = idx * e + if e == 1 { 0 } else { coord[off + a] };
    }
    b[idx] as f64
}

fn reference(c: &Case) -> Data {
    let (s, t, d) = (c.s, c.t, c.d);
    let bh: usize = c.lead.iter().product();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c.name.len() as u64 * 7919 + (s * 31 + t * 17 + d) as u64));
    let q = rng.data(bh * s * d);
    let k = rng.data(bh * t * d);
    let v = rng.data(bh * t * d);
    let bias = c.bias.as_ref().map(|b| rng.data(b.iter().product()));
    let dout = rng.data(bh * s * d);
    let scale = scale_of(d) as f64;
    let off = t as i64 - s as i64;
    let rows = s + 2 * t;
    let mut fwd = Want { v: vec![0.0; bh * s * d], tol: vec![0.0; bh * s * d] };
    let mut grad = Want { v: vec![0.0; bh * rows * d], tol: vec![0.0; bh * rows * d] };
    let mut o = vec![0f32; bh * s * d];
    for b in 0..bh {
        let qr = |i: usize| &q[(b * s + i) * d..(b * s + i + 1) * d];
        let kr = |j: usize| &k[(b * t + j) * d..(b * t + j + 1) * d];
        let vr = |j: usize| &v[(b * t + j) * d..(b * t + j + 1) * d];
        // Probabilities and, per row, the error of its scores (in units of 2^-24).
        let mut p = vec![vec![0f64; t]; s];
        let mut err = vec![0f64; s];
        for i in 0..s {
            let mut sc = vec![0f64; t];
            let mut mag = vec![0f64; t];
            for j in 0..t {
                let dot: f64 = qr(i).iter().zip(kr(j)).map(|(&a, &b)| a as f64 * b as f64).sum();
                let abs: f64 = qr(i).iter().zip(kr(j)).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let bv = bias.as_ref().map_or(0.0, |bb| bias_at(c, bb, b, i, j));
                sc[j] = scale * dot + bv;
                mag[j] = (d as f64 + 4.0) * (scale * abs + bv.abs());
                if c.causal && j as i64 > i as i64 + off {
                    // As f32 does it: -1e9 absorbs the score's low bits.
                    sc[j] = (sc[j] as f32 + -1e9f32) as f64;
                }
            }
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|&x| (x - m).exp()).sum();
            for j in 0..t {
                p[i][j] = (sc[j] - m).exp() / z;
                if p[i][j] > 1e-30 {
                    err[i] = err[i].max(mag[j] + 8.0 * (1.0 + (sc[j] - m).abs()));
                }
            }
        }
        let e_all = err.iter().cloned().fold(0.0, f64::max);
        for i in 0..s {
            for x in 0..d {
                let (mut val, mut abs) = (0.0, 0.0);
                for j in 0..t {
                    val += p[i][j] * vr(j)[x] as f64;
                    abs += p[i][j] * (vr(j)[x] as f64).abs();
                }
                let e = (b * s + i) * d + x;
                fwd.v[e] = val;
                fwd.tol[e] = 4.0 * EPS * (t as f64 + 8.0 + 2.0 * err[i]) * abs + 1e-30;
                o[e] = val as f32;
            }
        }
        let dr = |i: usize| &dout[(b * s + i) * d..(b * s + i + 1) * d];
        let orow = |i: usize| &o[(b * s + i) * d..(b * s + i + 1) * d];
        // dS and the bound on its error (absolute), per (i, j).
        let mut ds = vec![vec![0f64; t]; s];
        let mut ds_err = vec![vec![0f64; t]; s];
        for i in 0..s {
            let di: f64 = dr(i).iter().zip(orow(i)).map(|(&a, &b)| a as f64 * b as f64).sum();
            let di_abs: f64 = dr(i).iter().zip(orow(i)).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            for j in 0..t {
                let dp: f64 = dr(i).iter().zip(vr(j)).map(|(&a, &b)| a as f64 * b as f64).sum();
                let dp_abs: f64 = dr(i).iter().zip(vr(j)).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                ds[i][j] = p[i][j] * (dp - di);
                ds_err[i][j] = EPS
                    * (p[i][j]
                        * ((d as f64 + 4.0) * (dp_abs + di_abs) + (2.0 * e_all + 8.0) * (dp - di).abs())
                        + (s + t + 8) as f64 * ds[i][j].abs());
            }
        }
        let base = b * rows * d;
        for x in 0..d {
            for i in 0..s {
                let (mut val, mut tol) = (0.0, 0.0);
                for j in 0..t {
                    val += ds[i][j] * kr(j)[x] as f64;
                    tol += ds_err[i][j] * (kr(j)[x] as f64).abs();
                }
                grad.v[base + i * d + x] = scale * val;
                grad.tol[base + i * d + x] = 4.0 * scale * tol + 1e-30;
            }
            for j in 0..t {
                let (mut dk, mut dk_tol, mut dv, mut dv_abs) = (0.0, 0.0, 0.0, 0.0);
                for i in 0..s {
                    dk += ds[i][j] * qr(i)[x] as f64;
                    dk_tol += ds_err[i][j] * (qr(i)[x] as f64).abs();
                    dv += p[i][j] * dr(i)[x] as f64;
                    dv_abs += p[i][j] * (dr(i)[x] as f64).abs();
                }
                grad.v[base + (s + j) * d + x] = scale * dk;
                grad.tol[base + (s + j) * d + x] = 4.0 * scale * dk_tol + 1e-30;
                grad.v[base + (s + t + j) * d + x] = dv;
                grad.tol[base + (s + t + j) * d + x] =
                    4.0 * EPS * (s as f64 + 8.0 + 2.0 * e_all) * dv_abs + 1e-30;
            }
        }
    }
    Data { q, k, v, bias, o, dout, fwd, grad }
}

fn shapes(c: &Case) -> (Shape, Shape, Option<Shape>) {
    let with = |a: usize, b: usize| {
        let mut v = c.lead.clone();
        v.extend([a, b]);
        Shape::new(v)
    };
    (with(c.s, c.d), with(c.t, c.d), c.bias.as_ref().map(|b| Shape::new(b.clone())))
}

/// One kernel to run on the host and what it must give.
struct Run {
    name: String,
    op: Op,
    operands: Vec<Vec<f32>>,
    shapes: Vec<Shape>,
    kernel: CudaKernel,
    want: Want,
}

fn kernel_of(op: &Op, shapes: &[Shape]) -> (CudaKernel, Shape) {
    let ops: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = infer(op, &ops).unwrap_or_else(|e| panic!("{}: {}", op.label(), e.message)).0;
    assert_eq!(scratch_bytes(op, &ops, &out), 0, "{}: no scratch", op.label());
    let k = generate(op, &ops, (&out, DType::F32)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(k, generate(op, &ops, (&out, DType::F32)).unwrap(), "deterministic");
    (k, out)
}

/// The forward and gradient runs of a case.
fn runs_of(c: &Case) -> Vec<Run> {
    let data = reference(c);
    let (qs, ks, bs) = shapes(c);
    let scale = scale_of(c.d);
    let mut operands = vec![data.q.clone(), data.k.clone(), data.v.clone()];
    let mut sh = vec![qs.clone(), ks.clone(), ks.clone()];
    let mut gops = vec![data.q, data.k, data.v, data.o, data.dout];
    let mut gsh = vec![qs.clone(), ks.clone(), ks, qs.clone(), qs];
    if let (Some(b), Some(s)) = (data.bias, bs) {
        operands.push(b.clone());
        sh.push(s.clone());
        gops.push(b);
        gsh.push(s);
    }
    let fop = Op::Attention { scale, causal: c.causal };
    let gop = Op::AttentionGrad { scale, causal: c.causal };
    let (fk, _) = kernel_of(&fop, &sh);
    let (gk, _) = kernel_of(&gop, &gsh);
    vec![
        Run { name: format!("{}_fwd", c.name), op: fop, operands, shapes: sh, kernel: fk, want: data.fwd },
        Run {
            name: format!("{}_grad", c.name),
            op: gop,
            operands: gops,
            shapes: gsh,
            kernel: gk,
            want: data.grad,
        },
    ]
}

/// The kernel with a grid of `blocks` blocks: the block-stride loops must cover every tile.
fn with_grid(mut r: Run, blocks: u32) -> Run {
    r.name += &format!("_grid{blocks}");
    for l in &mut r.kernel.launches {
        l.grid = [blocks, 1, 1];
    }
    r
}

fn compare(got: &[f32], want: &Want) -> Result<f64, String> {
    if got.len() != want.v.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.v.len()));
    }
    let mut worst: f64 = 0.0;
    for (i, &g) in got.iter().enumerate() {
        let err = (g as f64 - want.v[i]).abs();
        if err.is_nan() || err > want.tol[i] {
            return Err(format!(
                "element {i}: {g} on the host, {} expected (tolerance {:e})",
                want.v[i], want.tol[i]
            ));
        }
        worst = worst.max(err / want.tol[i]);
    }
    Ok(worst)
}

fn skip_without_compiler() -> bool {
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped: {why}");
        return true;
    }
    false
}

fn check_launches(r: &Run) {
    let k = &r.kernel;
    let grad = matches!(r.op, Op::AttentionGrad { .. });
    assert_eq!(k.launches.len(), if grad { 3 } else { 1 }, "{}", r.name);
    for l in &k.launches {
        assert_eq!(l.block, [256, 1, 1], "{}", r.name);
        assert!(l.grid[0] >= 1 && l.grid[0] <= 1 << 16, "{}: grid {:?}", r.name, l.grid);
        assert_eq!(l.args.len(), r.shapes.len() + 1, "{}", r.name);
        assert!(!l.args.contains(&Arg::Scratch), "{}", r.name);
        assert_eq!(l.shared_bytes, 0);
    }
    assert!(k.source.starts_with("// kiln: ") && !k.source.contains("#include"));
    assert!(!k.source.contains("atomic"), "{}: deterministic, no atomics", r.name);
}

#[test]
fn attention_kernels_run_on_the_host_and_match_the_reference() {
    if skip_without_compiler() {
        return;
    }
    let mut runs = Vec::new();
    for c in cases() {
        for r in runs_of(&c) {
            check_launches(&r);
            let grad = matches!(r.op, Op::AttentionGrad { .. });
            let rows = c.d > 760 || (grad && c.d > 380);
            let how = if rows { "a warp per" } else { "flash" };
            assert!(r.kernel.describe.contains(how), "{}: {}", r.name, r.kernel.describe);
            eprintln!("{}: {}", r.name, r.kernel.describe);
            runs.push(r);
        }
    }
    // From a grid of 1 and 3 blocks: every block takes several tiles (rows).
    for (i, blocks) in [(6, 1), (8, 3), (4, 1), (14, 3), (15, 1)] {
        for r in runs_of(&cases()[i]) {
            runs.push(with_grid(r, blocks));
        }
    }
    let cases: Vec<cuda_host::HostCase> = runs
        .iter()
        .map(|r| cuda_host::HostCase {
            name: r.name.clone(),
            kernel: r.kernel.clone(),
            operands: r.operands.clone(),
            output_len: r.want.v.len(),
            scratch_len: 0,
        })
        .collect();
    let results = cuda_host::run(cases).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    let mut worst: f64 = 0.0;
    for (r, res) in runs.iter().zip(&results) {
        match compare(&res.output, &r.want) {
            Ok(w) => worst = worst.max(w),
            Err(e) => failures.push(format!("{} ({}): {e}", r.name, r.kernel.describe)),
        }
        assert_eq!(res.operands, r.operands, "{}: operands are read only", r.name);
    }
    eprintln!(
        "{} kernels matched the reference: largest error {worst:.3} of the bound",
        runs.len() - failures.len()
    );
    assert!(
        failures.is_empty(),
        "{} of {} kernels differ:\n{}",
        failures.len(),
        runs.len(),
        failures.join("\n")
    );
}

/// Kernels too large to run on the host: 2^30-element operands (64-bit indices), and D = 128
/// and 256 over long sequences.
fn large_kernels() -> Vec<CudaKernel> {
    let mut v = Vec::new();
    for (lead, s, t, d, causal) in [
        (vec![32usize, 32], 16384usize, 16384usize, 64usize, true),
        (vec![4, 16], 4096, 4096, 128, false),
        (vec![2, 8], 2048, 2048, 256, true),
    ] {
        let mut q = lead.clone();
        q.extend([s, d]);
        let mut k = lead.clone();
        k.extend([t, d]);
        let (q, k) = (Shape::new(q), Shape::new(k));
        let scale = scale_of(d);
        v.push(kernel_of(&Op::Attention { scale, causal }, &[q.clone(), k.clone(), k.clone()]).0);
        let g = Op::AttentionGrad { scale, causal };
        v.push(kernel_of(&g, &[q.clone(), k.clone(), k, q.clone(), q, Shape::from([t])]).0);
    }
    v
}

#[test]
fn large_shapes_use_64_bit_indices_and_bounded_grids() {
    let v = large_kernels();
    assert!(v[0].source.contains("long long") && v[1].source.contains("long long"));
    assert!(!v[2].source.contains("long long"));
    for k in &v {
        for l in &k.launches {
            assert!(l.grid[0] <= 1 << 16, "{}", k.describe);
        }
    }
}

/// Every kernel of these tests compiles with NVRTC to PTX for sm_90 (skipped without NVRTC,
/// unless `KILN_REQUIRE_NVRTC=1`).
#[test]
fn every_attention_kernel_compiles_with_nvrtc() {
    use kiln_runtime::cuda::{NvrtcCompiler, probe};
    let nvrtc = match probe::nvrtc() {
        Ok(info) => {
            eprintln!("NVRTC {}.{} from {}", info.version.0, info.version.1, info.location);
            NvrtcCompiler::new((9, 0)).expect("NVRTC loads").with_disk_cache(None)
        }
        Err(e) => {
            if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}");
            }
            eprintln!("skipped: no NVRTC ({e})");
            return;
        }
    };
    let mut kernels: Vec<CudaKernel> = cases().iter().flat_map(runs_of).map(|r| r.kernel).collect();
    kernels.extend(large_kernels());
    let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
    let ptx = nvrtc.compile_all(&sources).unwrap_or_else(|e| panic!("{e}"));
    for (k, p) in kernels.iter().zip(&ptx) {
        assert!(p.contains(".target sm_90"), "{}: PTX not for sm_90", k.describe);
        for l in &k.launches {
            assert!(
                p.contains(&format!(".entry {}", l.function)),
                "{}: no entry `{}`",
                k.describe,
                l.function
            );
        }
    }
    eprintln!("{} attention kernels compiled to PTX for sm_90", kernels.len());
}
