//! 2-D max and average pooling over NHWC tensors, and their gradients.
//!
//! Windows follow `Window2d::out_and_pad` (TensorFlow's SAME split). Average pooling divides by the
//! number of in-bounds elements (TensorFlow excludes padding). The max gradient routes each window's
//! dy to the first maximum in row-major window order, as TensorFlow does, and accumulates where
//! windows overlap. Every loop runs over a contiguous block of channels, so the inner loops are
//! vectorisable; gradients are computed per (image, channel block), which makes the tasks' outputs
//! disjoint even when windows overlap.

use super::math::max_nan;
use super::par::{SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use crate::geometry::Geom;
use kiln_compiler::ir::{PoolKind, Shape, Window2d};
use std::slice;

/// Channels handled together by one gradient task.
const CHANNELS: usize = 64;

impl Geom {
    /// In-bounds input range of output position `o` along an axis.
    fn range(o: usize, s: usize, p: usize, k: usize, extent: usize) -> (usize, usize) {
        let start = (o * s) as isize - p as isize;
        let lo = start.clamp(0, extent as isize) as usize;
        let hi = (start + k as isize).clamp(0, extent as isize) as usize;
        (lo, hi.max(lo))
    }

    /// In-bounds input rows and columns of the window of output (oh, ow).
    fn window(&self, oh: usize, ow: usize) -> ((usize, usize), (usize, usize)) {
        (
            Geom::range(oh, self.sh, self.ph, self.kh, self.h),
            Geom::range(ow, self.sw, self.pw, self.kw, self.w),
        )
    }
}

// ---------------------------------------------------------------- forward

struct Pool {
    kind: PoolKind,
    g: Geom,
    desc: String,
}

pub(crate) fn pool2d(
    kind: PoolKind,
    name: &str,
    x: &Shape,
    window: &Window2d,
    _out: &Shape,
) -> Box<dyn CpuKernel> {
    let g = Geom::pool(x, window);
    let desc = format!("{name} {}x{} stride {}x{} {}", g.kh, g.kw, g.sh, g.sw, shape_text(x));
    Box::new(Pool { kind, g, desc })
}

impl CpuKernel for Pool {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.g;
        let (x, o) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(output as *mut f32));
        let c = g.c;
        par_ranges(g.n * g.oh, g.ow * c * g.kh * g.kw, |s, e| {
            for r in s..e {
                let (n, oh) = (r / g.oh, r % g.oh);
                for ow in 0..g.ow {
                    // SAFETY: output pixel (n, oh, ow), owned by this task.
                    let out = unsafe { slice::from_raw_parts_mut(o.get().add((r * g.ow + ow) * c), c) };
                    let ((h0, h1), (w0, w1)) = g.window(oh, ow);
                    out.fill(match self.kind {
                        PoolKind::Max => f32::NEG_INFINITY,
                        PoolKind::Avg => 0.0,
                    });
                    for ih in h0..h1 {
                        for iw in w0..w1 {
                            // SAFETY: an in-bounds input pixel.
                            let v = unsafe {
                                slice::from_raw_parts(x.get().add(((n * g.h + ih) * g.w + iw) * c), c)
                            };
                            match self.kind {
                                PoolKind::Max => {
                                    out.iter_mut().zip(v).for_each(|(o, &v)| *o = max_nan(*o, v))
                                }
                                PoolKind::Avg => out.iter_mut().zip(v).for_each(|(o, &v)| *o += v),
                            }
                        }
                    }
                    if self.kind == PoolKind::Avg {
                        let scale = 1.0 / ((h1 - h0) * (w1 - w0)) as f32;
                        out.iter_mut().for_each(|o| *o *= scale);
                    }
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- gradient

struct PoolGrad {
    kind: PoolKind,
    g: Geom,
    /// Where dy is among the inputs: 1 after x for `Pool2dGrad`, 0 for `AvgPool2dGrad`, which
    /// has no x (average pooling's gradient reads only dy).
    dy_input: usize,
    desc: String,
}

pub(crate) fn pool2d_grad(
    kind: PoolKind,
    name: &str,
    x: &Shape,
    window: &Window2d,
    _dy: &Shape,
) -> Box<dyn CpuKernel> {
    let g = Geom::pool(x, window);
    let desc = format!("{name} {}x{} stride {}x{} {}", g.kh, g.kw, g.sh, g.sw, shape_text(x));
    Box::new(PoolGrad { kind, g, dy_input: 1, desc })
}

/// Average pooling's gradient from dy alone; `input` is the pooled input's shape.
pub(crate) fn avg_pool2d_grad(name: &str, input: &Shape, window: &Window2d) -> Box<dyn CpuKernel> {
    let g = Geom::pool(input, window);
    let desc = format!("{name} {}x{} stride {}x{} {} (from dy)", g.kh, g.kw, g.sh, g.sw, shape_text(input));
    Box::new(PoolGrad { kind: PoolKind::Avg, g, dy_input: 0, desc })
}

impl PoolGrad {
    /// dx for image n, channels c0..c0+w.
    ///
    /// # Safety
    /// `x`, `dy`, `dx` hold the tensors; no other thread writes these channels of image n.
    unsafe fn block(&self, x: *const f32, dy: *const f32, dx: *mut f32, n: usize, c0: usize, w: usize) {
        let g = &self.g;
        let c = g.c;
        let pixel = |ih: usize, iw: usize| ((n * g.h + ih) * g.w + iw) * c + c0;
        for p in 0..g.h * g.w {
            // SAFETY: channels c0..c0+w of pixel p of image n.
            unsafe { slice::from_raw_parts_mut(dx.add((n * g.h * g.w + p) * c + c0), w).fill(0.0) };
        }
        for oh in 0..g.oh {
            for ow in 0..g.ow {
                let ((h0, h1), (w0, w1)) = g.window(oh, ow);
                if h0 == h1 || w0 == w1 {
                    continue;
                }
                // SAFETY: dy pixel (n, oh, ow), channels c0..c0+w.
                let d = unsafe { slice::from_raw_parts(dy.add(((n * g.oh + oh) * g.ow + ow) * c + c0), w) };
                match self.kind {
                    PoolKind::Max => {
                        let mut best = [0f32; CHANNELS];
                        let mut at = [0usize; CHANNELS];
                        let first = pixel(h0, w0);
                        // SAFETY: the first in-bounds pixel of the window.
                        best[..w].copy_from_slice(unsafe { slice::from_raw_parts(x.add(first), w) });
                        at[..w].fill(first);
                        for ih in h0..h1 {
                            for iw in w0..w1 {
                                let p = pixel(ih, iw);
                                // SAFETY: an in-bounds pixel.
                                let v = unsafe { slice::from_raw_parts(x.add(p), w) };
                                for ((b, a), &v) in best[..w].iter_mut().zip(&mut at[..w]).zip(v) {
                                    if v > *b {
                                        *b = v;
                                        *a = p;
                                    }
                                }
                            }
                        }
                        for (j, (&a, &d)) in at[..w].iter().zip(d).enumerate() {
                            // SAFETY: a is a pixel of image n at channel c0; j < w.
                            unsafe { *dx.add(a + j) += d };
                        }
                    }
                    PoolKind::Avg => {
                        let scale = 1.0 / ((h1 - h0) * (w1 - w0)) as f32;
                        for ih in h0..h1 {
                            for iw in w0..w1 {
                                // SAFETY: an in-bounds pixel of image n, this task's channels.
                                let t = unsafe { slice::from_raw_parts_mut(dx.add(pixel(ih, iw)), w) };
                                t.iter_mut().zip(d).for_each(|(t, &d)| *t += d * scale);
                            }
                        }
                    }
                }
            }
        }
    }
}

impl CpuKernel for PoolGrad {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.g;
        // Average pooling never reads x: without an x input the pointer is null and unused.
        let x = if self.dy_input == 0 { std::ptr::null_mut() } else { inputs[0] as *mut f32 };
        let (x, dy) = (SendPtr::new(x), SendPtr::new(inputs[self.dy_input] as *mut f32));
        let dx = SendPtr::new(output as *mut f32);
        let blocks = g.c.div_ceil(CHANNELS);
        let cost = (g.h * g.w + g.oh * g.ow * g.kh * g.kw) * CHANNELS.min(g.c);
        par_ranges(g.n * blocks, cost, |s, e| {
            for t in s..e {
                let (n, b) = (t / blocks, t % blocks);
                let c0 = b * CHANNELS;
                // SAFETY: task t owns channels c0.. of image n.
                unsafe { self.block(x.get(), dy.get(), dx.get(), n, c0, CHANNELS.min(g.c - c0)) };
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
