//! 2-D max and average pooling over NHWC tensors, and their gradients.
//!
//! Windows follow `Window2d::out_and_pad` (TensorFlow's SAME split). Average pooling divides by the
//! number of in-bounds elements (TensorFlow excludes padding). The max gradient routes each window's
//! dy to the first maximum in row-major window order, as TensorFlow does, and accumulates where
//! windows overlap. Every loop runs over a contiguous block of channels, so the inner loops are
//! vectorisable; gradients are computed per (image, channel block), which makes the tasks' outputs
//! disjoint even when windows overlap. Where max pooling's windows tile the input, its gradient
//! goes a window at a time and may be written over the input (`Op::may_write_over`).

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
    /// Max pooling's dx for image n, channels c0..c0+w, where the windows tile x (`Geom::tiles`):
    /// a window at a time, its x read before its dx is written (0.0 + dy at the first maximum,
    /// 0.0 elsewhere: the bits of `block`), so dx may be x's own buffer (`Op::may_write_over`).
    ///
    /// # Safety
    /// `x`, `dy`, `dx` hold the tensors (`dx` may be `x`); no other thread touches these channels
    /// of image n.
    unsafe fn tiled_max_block(
        &self,
        x: *const f32,
        dy: *const f32,
        dx: *mut f32,
        n: usize,
        c0: usize,
        w: usize,
    ) {
        let g = &self.g;
        let c = g.c;
        let pixel = |ih: usize, iw: usize| ((n * g.h + ih) * g.w + iw) * c + c0;
        let mut best = [0f32; CHANNELS];
        let mut at = [0usize; CHANNELS];
        for oh in 0..g.oh {
            for ow in 0..g.ow {
                let (h0, w0) = (oh * g.kh, ow * g.kw);
                let first = pixel(h0, w0);
                // Reads through raw pointers only, none held across the writes below.
                for (j, b) in best[..w].iter_mut().enumerate() {
                    // SAFETY: channel c0 + j of the window's first pixel.
                    *b = unsafe { *x.add(first + j) };
                }
                at[..w].fill(first);
                for ih in h0..h0 + g.kh {
                    for iw in w0..w0 + g.kw {
                        let p = pixel(ih, iw);
                        for j in 0..w {
                            // SAFETY: an in-bounds pixel of the window, this task's channels.
                            let v = unsafe { *x.add(p + j) };
                            if v > best[j] {
                                best[j] = v;
                                at[j] = p;
                            }
                        }
                    }
                }
                let d = ((n * g.oh + oh) * g.ow + ow) * c + c0;
                for ih in h0..h0 + g.kh {
                    for iw in w0..w0 + g.kw {
                        let p = pixel(ih, iw);
                        for (j, &a) in at[..w].iter().enumerate() {
                            // SAFETY: dy's pixel (n, oh, ow) and dx's pixel p, this task's
                            // channels; the window's x was read above.
                            unsafe { *dx.add(p + j) = if a == p { 0.0 + *dy.add(d + j) } else { 0.0 } };
                        }
                    }
                }
            }
        }
    }

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
        let tiled = self.kind == PoolKind::Max && self.dy_input == 1 && g.tiles();
        let cost = (g.h * g.w + g.oh * g.ow * g.kh * g.kw) * CHANNELS.min(g.c);
        par_ranges(g.n * blocks, cost, |s, e| {
            for t in s..e {
                let (n, b) = (t / blocks, t % blocks);
                let c0 = b * CHANNELS;
                let w = CHANNELS.min(g.c - c0);
                // SAFETY: task t owns channels c0.. of image n; dx is x's buffer only where the
                // windows tile x (`Op::may_write_over`), which the tiled kernel allows.
                if tiled {
                    unsafe { self.tiled_max_block(x.get(), dy.get(), dx.get(), n, c0, w) };
                } else {
                    unsafe { self.block(x.get(), dy.get(), dx.get(), n, c0, w) };
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
