//! Runs generated CUDA C kernels on the host through the emulated CUDA device's library code
//! (`kiln_runtime::cuda::emulator::host`): every kernel is compiled with the system C++ compiler
//! against `cuda_host.h` (CUDA's built-ins mapped onto host threads), loaded as a shared library
//! and launched with its grid and block on host buffers. See the header for what this cannot
//! see. Cases are compiled into two translation units built in parallel (and cached on disk).

use kiln_compiler::ir::Op;
use kiln_kernels::cuda::{Arg, CudaKernel};
use kiln_runtime::cuda::emulator::host;
use std::ffi::c_void;

/// One kernel to run: its launches, the operands (read and, for effects, written in place) and
/// the output's element count (0 for effects).
pub struct HostCase {
    pub name: String,
    pub kernel: CudaKernel,
    pub operands: Vec<Vec<f32>>,
    pub output_len: usize,
    /// f32 elements of the step's scratch (`Arg::Scratch`), given NaN-filled: 0 for none.
    pub scratch_len: usize,
}

/// What a kernel left: its operands after the run and its output.
pub struct HostResult {
    pub operands: Vec<Vec<f32>>,
    pub output: Vec<f32>,
}

/// Whether the host run of `got` matches the CPU's `want`: NaN where NaN, infinities equal,
/// else within `tol` relative (transcendentals are libm's on both sides; sums may run in
/// another order: `tolerance`).
pub fn close(got: &[f32], want: &[f32], tol: f32) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.len()));
    }
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan())
            || g == w
            || (g.is_finite() && w.is_finite() && (g - w).abs() <= tol * w.abs().max(1.0));
        if !ok {
            return Err(format!("element {i}: {g} on the host, {w} on the CPU"));
        }
    }
    Ok(())
}

/// The relative tolerance for `op`: 1e-5, or 1e-4 where the kernel sums long rows in another
/// order than the CPU (products and convolutions split over K, reductions by warps).
pub fn tolerance(op: &Op) -> f32 {
    match op {
        Op::MatMul { .. }
        | Op::MatMulRows { .. }
        | Op::Conv2d { .. }
        | Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropInputReluGrad { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::GatherGrad { .. } => 1e-4,
        Op::Fused(f) if f.has_product() || f.reduce.is_some() => 1e-4,
        Op::ApplySgd { product: true, .. } | Op::ApplyAdam { product: true, .. } => 1e-4,
        _ => 1e-5,
    }
}

/// Whether an effect's operands after the host run (`got`) match the CPU's (`want`), from the
/// operands both started with (`before`): each mutated operand within `tolerance`, except a
/// product Adam update's. Its gradient is a product summed in another order, and Adam divides
/// each gradient element by its own magnitude: the moments are compared against their largest
/// magnitude (the product's error is relative to the sum of |terms|), and each weight element
/// within 1e-4 of itself plus up to two steps (2α) scaled by how uncertain its first moment is
/// (1e-4 of the largest moment over its own): a gradient that is rounding noise moves the weight
/// by a whole normalised step in whatever direction the noise has.
pub fn check_effect(op: &Op, before: &[Vec<f32>], got: &[Vec<f32>], want: &[Vec<f32>]) -> Result<(), String> {
    let Op::ApplyAdam { lr, beta1, beta2, product: true, .. } = *op else {
        let tol = tolerance(op);
        return op
            .mutated_operands()
            .iter()
            .try_for_each(|&i| close(&got[i], &want[i], tol).map_err(|e| format!("operand {i}: {e}")));
    };
    let largest = |x: &[f32]| x.iter().fold(f32::MIN_POSITIVE, |a, v| a.max(v.abs()));
    for i in [3, 4] {
        let scale = largest(&want[i]);
        if let Some(j) = (0..want[i].len()).find(|&j| (got[i][j] - want[i][j]).abs() > 1e-4 * scale) {
            return Err(format!(
                "operand {i} element {j}: {} on the host, {} on the CPU",
                got[i][j], want[i][j]
            ));
        }
    }
    let t = before[5][0] as f64 + 1.0;
    let alpha = (lr as f64 * (1.0 - (beta2 as f64).powf(t)).sqrt() / (1.0 - (beta1 as f64).powf(t))) as f32;
    let m_tol = 1e-4 * largest(&want[3]);
    for (j, ((&g, &w), &m)) in got[0].iter().zip(&want[0]).zip(&want[3]).enumerate() {
        let tol = 1e-4 * w.abs().max(1.0) + 2.0 * alpha * (m_tol / m.abs().max(1e-30)).min(1.0);
        if (g - w).abs() > tol {
            return Err(format!("operand 0 element {j}: {g} on the host, {w} on the CPU (tolerance {tol})"));
        }
    }
    Ok(())
}

/// Whether a C++20 compiler is present (CI has one; the test says so where not).
pub fn available() -> Result<(), String> {
    host::available()
}

/// Compiles and runs every case (the emulated device's host compilation, `host::compile`, on
/// plain host buffers); results in case order.
pub fn run(cases: Vec<HostCase>) -> Result<Vec<HostResult>, String> {
    let start = std::time::Instant::now();
    let kernels: Vec<&CudaKernel> = cases.iter().map(|c| &c.kernel).collect();
    let functions = host::compile(&kernels, &host::default_cache_dir(), 2)?;
    let compiled = start.elapsed().as_secs_f64();
    let mut results = Vec::with_capacity(cases.len());
    for (c, functions) in cases.iter().zip(functions) {
        if functions.len() != c.kernel.launches.len() {
            return Err(format!(
                "{}: {} functions for {} launches",
                c.name,
                functions.len(),
                c.kernel.launches.len()
            ));
        }
        let mut operands = c.operands.clone();
        let mut output = vec![f32::NAN; c.output_len];
        let mut scratch = vec![f32::NAN; c.scratch_len];
        for (l, f) in c.kernel.launches.iter().zip(&functions) {
            let mut args: Vec<*mut c_void> = l
                .args
                .iter()
                .map(|a| match a {
                    Arg::Input(k) => operands[*k].as_mut_ptr() as *mut c_void,
                    Arg::Output => output.as_mut_ptr() as *mut c_void,
                    Arg::Scratch => scratch.as_mut_ptr() as *mut c_void,
                })
                .collect();
            // SAFETY: every argument points to a host buffer of the element count the kernel
            // was generated for (the case's operand and output shapes, the scratch it was given).
            unsafe { f.launch(l.grid, l.block, &mut args) };
        }
        results.push(HostResult { operands, output });
    }
    eprintln!(
        "host CUDA: {} kernels compiled in {compiled:.1} s, run in {:.1} s",
        cases.len(),
        start.elapsed().as_secs_f64() - compiled
    );
    Ok(results)
}
