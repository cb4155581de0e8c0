//! Softmax and log-softmax along one axis, numerically stable (the maximum is subtracted first,
//! sums of exponentials accumulate in f64).
//!
//! The input is seen as [outer, n, inner] around the axis. With inner == 1 (the usual last axis)
//! each row is contiguous; otherwise a tile of up to `TILE` adjacent columns is normalised
//! together, with the maxima and sums on the stack. Softmax writes e^(x - max) into its output and
//! rescales it there, so it needs no scratch memory.
//!
//! f16 and bf16 input or output (`softmax`'s types): each row, or each tile of `TILE` columns
//! down the axis, is widened into a buffer of its thread, normalised there as above, and
//! rounded as it is stored (ties to even, as `Op::Cast`): the bits of the op widened.

use super::math::max_nan;
use super::par::{SendPtr, par_ranges};
use super::simd::multiversion;
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{DType, Shape};
use std::slice;

const TILE: usize = 64;

struct Softmax {
    log: bool,
    outer: usize,
    n: usize,
    inner: usize,
    /// The input's and output's types where either is f16 or bf16 (module doc).
    half: Option<[DType; 2]>,
    desc: String,
}

thread_local! {
    /// Each thread's widened row or tile and its f32 result (`Softmax::run_widened`).
    static SLAB: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The softmax (or, with `log`, log-softmax) of `x` along `axis`; `types` are the input's and
/// the output's (f32, f16 or bf16).
pub(crate) fn softmax(x: &Shape, axis: usize, log: bool, types: [DType; 2]) -> Box<dyn CpuKernel> {
    let dims = x.dims();
    let (outer, inner) = (dims[..axis].iter().product(), dims[axis + 1..].iter().product());
    let name = if log { "log_softmax" } else { "softmax" };
    let desc = format!("{name}[axis {axis}] {}", shape_text(x));
    let half = types.iter().any(|d| d.is_half()).then_some(types);
    Box::new(Softmax { log, outer, n: dims[axis], inner, half, desc })
}

/// Lanes of the row loops: independent accumulators, so that the compiler vectorises the max
/// and the sum (in a fixed order: the same bits on every run and thread count).
const LANES: usize = 8;

/// The largest element (NaN if any is NaN), over `LANES` running maxima.
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = max_nan(*m, v);
        }
    }
    let m = rest.iter().fold(f32::NEG_INFINITY, |m, &v| max_nan(m, v));
    lanes.iter().fold(m, |a, &b| max_nan(a, b))
}

/// The sum of `x` in f64, over `LANES` running sums.
#[inline(always)]
fn row_sum(x: &[f32]) -> f64 {
    let mut lanes = [0f64; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest: f64 = chunks.remainder().iter().map(|&v| v as f64).sum();
    for c in chunks {
        for (s, &v) in lanes.iter_mut().zip(c) {
            *s += v as f64;
        }
    }
    lanes.iter().sum::<f64>() + rest
}

/// One contiguous row: e^(x - max) written to the output first (a vectorised pass), summed by
/// lanes, then rescaled (softmax) or replaced by (x - max) - ln(sum) (log-softmax). Measured on
/// the transformer's training step (`examples/profile_cpu.rs`): its 8x128x1000 log-softmax 3.84 ->
/// 1.07 ms and 8x4x128x128 softmax 1.96 -> 0.62 ms (before: one element at a time into one
/// running f64 sum, which the compiler cannot vectorise).
#[inline(always)]
fn row(x: &[f32], o: &mut [f32], log: bool) {
    let m = row_max(x);
    for (o, &v) in o.iter_mut().zip(x) {
        *o = super::vmath::exp_nonpositive(v - m);
    }
    if log {
        // The row's log-sum as the reduction and the elementwise `ln` compute it: the split form
        // of fused plans (`kiln_compiler::log_softmax_split`) gives the same bits.
        let lse = super::vmath::ln(super::reduce::row_sum(o));
        for (o, &v) in o.iter_mut().zip(x) {
            *o = (v - m) - lse;
        }
    } else {
        let sum = row_sum(o);
        let scale = (1.0 / sum) as f32;
        for o in o.iter_mut() {
            *o *= scale;
        }
    }
}

impl Softmax {
    /// Columns i0..i0+w of outer block q (inner > 1).
    ///
    /// # Safety
    /// `x` and `o` hold the whole tensor.
    #[inline(always)]
    unsafe fn tile(&self, x: *const f32, o: *mut f32, q: usize, i0: usize, w: usize) {
        let (n, inner) = (self.n, self.inner);
        let base = q * n * inner + i0;
        // SAFETY: rows r < n of the block, w <= inner - i0 elements from column i0.
        let xr = |r: usize| unsafe { slice::from_raw_parts(x.add(base + r * inner), w) };
        // SAFETY: as above, in the output, which does not overlap the input.
        let or = |r: usize| unsafe { slice::from_raw_parts_mut(o.add(base + r * inner), w) };
        let mut max = [f32::NEG_INFINITY; TILE];
        for r in 0..n {
            for (m, &v) in max[..w].iter_mut().zip(xr(r)) {
                *m = max_nan(*m, v);
            }
        }
        let mut sum = [0f64; TILE];
        for r in 0..n {
            if self.log {
                for ((s, &m), &v) in sum[..w].iter_mut().zip(&max[..w]).zip(xr(r)) {
                    *s += super::vmath::exp_nonpositive(v - m) as f64;
                }
            } else {
                for (((s, &m), &v), o) in sum[..w].iter_mut().zip(&max[..w]).zip(xr(r)).zip(or(r)) {
                    *o = super::vmath::exp_nonpositive(v - m);
                    *s += *o as f64;
                }
            }
        }
        let mut k = [0f32; TILE];
        for ((k, &s), &m) in k[..w].iter_mut().zip(&sum[..w]).zip(&max[..w]) {
            *k = if self.log { m + s.ln() as f32 } else { (1.0 / s) as f32 };
        }
        for r in 0..n {
            if self.log {
                for ((o, &v), &k) in or(r).iter_mut().zip(xr(r)).zip(&k[..w]) {
                    *o = v - k;
                }
            } else {
                for (o, &k) in or(r).iter_mut().zip(&k[..w]) {
                    *o *= k;
                }
            }
        }
    }
}

multiversion! {
    /// `row` on the widest vectors the CPU has (`simd`).
    unsafe fn row_dispatch / row_at(x: &[f32], o: &mut [f32], log: bool) => row;
}

multiversion! {
    /// `Softmax::tile` on the widest vectors the CPU has (`simd`).
    unsafe fn tile_dispatch / tile_at(kernel: &Softmax, x: *const f32, o: *mut f32, q: usize, i0: usize, w: usize)
        => Softmax::tile;
}

impl Softmax {
    /// `run` with a half input or output: unit u (a row, or a tile of columns of an outer
    /// block) widened into the thread's buffer `[n, w]`, normalised as a tensor of one outer
    /// block and `w` columns, and stored in the output's type.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn run_widened(&self, x: *mut u8, o: *mut u8, [tx, to]: [DType; 2]) {
        let (x, o) = (SendPtr::new(x), SendPtr::new(o));
        let (n, inner) = (self.n, self.inner);
        let tiles = inner.div_ceil(TILE);
        let unit = |u: usize, buf: &mut Vec<f32>| {
            let (q, i0) = (u / tiles, (u % tiles) * TILE);
            let w = TILE.min(inner - i0);
            buf.resize(2 * n * w, 0.0);
            let (xs, os) = buf.split_at_mut(n * w);
            let at = |r: usize, c: usize| (q * n + r) * inner + i0 + c;
            for r in 0..n {
                for c in 0..w {
                    // SAFETY: element (q, r, i0 + c) lies inside the input.
                    xs[r * w + c] = unsafe { super::cast::read(x.get(), at(r, c), tx) }.float();
                }
            }
            // SAFETY: the slab is one outer block of n rows and w columns, the thread's own.
            unsafe {
                if inner == 1 {
                    row_dispatch(xs, os, self.log);
                } else {
                    let slab = Softmax { outer: 1, inner: w, half: None, desc: String::new(), ..*self };
                    tile_dispatch(&slab, xs.as_ptr(), os.as_mut_ptr(), 0, 0, w);
                }
            }
            for r in 0..n {
                for c in 0..w {
                    let v = super::cast::Scalar::F(os[r * w + c]);
                    // SAFETY: element (q, r, i0 + c) lies inside the output; units own disjoint
                    // elements.
                    unsafe { super::cast::write(o.get(), at(r, c), to, v) };
                }
            }
        };
        par_ranges(self.outer * tiles, n * TILE.min(inner), |s, e| {
            SLAB.with(|cell| match cell.try_borrow_mut() {
                Ok(mut buf) => (s..e).for_each(|u| unit(u, &mut buf)),
                Err(_) => (s..e).for_each(|u| unit(u, &mut Vec::new())),
            })
        });
    }
}

impl CpuKernel for Softmax {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        if let Some(types) = self.half {
            // SAFETY: forwarded contract.
            return unsafe { self.run_widened(inputs[0], output, types) };
        }
        let (x, o) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(output as *mut f32));
        let (n, inner) = (self.n, self.inner);
        if inner == 1 {
            par_ranges(self.outer, n, |s, e| {
                for q in s..e {
                    // SAFETY: row q of the input and of the (disjoint) output; threads take
                    // disjoint rows.
                    let (xr, or) = unsafe {
                        (
                            slice::from_raw_parts(x.get().add(q * n), n),
                            slice::from_raw_parts_mut(o.get().add(q * n), n),
                        )
                    };
                    // SAFETY: `row` is safe; any width `simd::width()` chose is supported.
                    unsafe { row_dispatch(xr, or, self.log) };
                }
            });
        } else {
            let tiles = inner.div_ceil(TILE);
            par_ranges(self.outer * tiles, n * TILE.min(inner), |s, e| {
                for u in s..e {
                    let (q, t) = (u / tiles, u % tiles);
                    let i0 = t * TILE;
                    // SAFETY: in bounds; units own disjoint columns of the output.
                    unsafe { tile_dispatch(self, x.get(), o.get(), q, i0, TILE.min(inner - i0)) };
                }
            });
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::super::simd::Width;
    use super::*;

    /// Softmax and log-softmax rows and column tiles compute the baseline's bits at every width
    /// the CPU has.
    #[test]
    fn every_width_computes_the_baseline_bits() {
        let x: Vec<f32> = (0..3 * 77 * 5).map(|i| (i as f32 * 0.913).sin() * 20.0).collect();
        for log in [false, true] {
            let row = |w: Width| {
                let mut o = vec![0.0f32; x.len()];
                // SAFETY: safe function; `w` is available.
                unsafe { row_at(w, &x, &mut o, log) };
                o
            };
            let kernel = Softmax { log, outer: 3, n: 77, inner: 5, half: None, desc: String::new() };
            let tile = |w: Width| {
                let mut o = vec![0.0f32; x.len()];
                for q in 0..3 {
                    // SAFETY: x and o hold the whole [3, 77, 5] tensor; `w` is available.
                    unsafe { tile_at(w, &kernel, x.as_ptr(), o.as_mut_ptr(), q, 0, 5) };
                }
                o
            };
            let (row0, tile0) = (row(Width::Baseline), tile(Width::Baseline));
            for w in Width::available() {
                assert!(
                    row(w).iter().zip(&row0).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "row, {w:?}, log {log}"
                );
                assert!(
                    tile(w).iter().zip(&tile0).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "tile, {w:?}, log {log}"
                );
            }
        }
    }
}
