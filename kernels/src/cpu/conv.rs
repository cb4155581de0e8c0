//! 2-D convolution (NHWC activations, HWIO filters) and its two backprops, as strided GEMMs
//! without scratch memory (but a stride-1 input gradient's turned filter, `Flipped`, and the
//! filter gradient's tiles of patches, `Tiles`).
//!
//! There is no im2col buffer: kernels get no memory beyond their operands and output. Instead,
//! for one output row (n, oh) and one filter row kh, the input pixels seen by a run of output
//! columns form a strided matrix: row `ow` starts at input column ow·stride_w - pad_w, and the
//! KW·C values a full filter row reads there are contiguous. So
//!   out[n, oh, ow0.., :] += X(rows ow, stride stride_w·C; KW·C columns) · W[kh] (KW·C x F)
//! is one GEMM per (n, oh, kh) for the interior columns; near the left and right borders the
//! valid filter columns shrink to a sub-range lo..hi, and columns sharing a range share a call
//! (`ColumnGroup`). A border group holds a column or two, so it is batched the other way: one
//! GEMM per border column over a block of `ROW_BLOCK` output rows (input rows stride_h·W·C
//! apart). Filter rows that fall in the padding are skipped. Batching the borders halved the time
//! of a 3x3 SAME convolution with 3 input channels (4.8 -> 2.4 ms for 64x32x32x3 -> 16, one core).
//!
//! The two gradients go one filter tap (kh, kw) at a time (`TapPlan`): the output positions whose
//! tap lies inside the input form a box in (n, oh, ow), and both the positions and the input pixels
//! they read are affine in it, so the box is a strided matrix along its longest mergeable axis.
//! The input gradient adds dy(positions x F) · W[kh, kw]ᵀ into dx at those pixels: a tap's pixels
//! are distinct, so its calls never write one element twice and run in parallel, while the taps
//! follow each other in a fixed order. The filter gradient contracts x(pixels)ᵀ · dy(positions) into
//! dw[kh, kw], the taps in parallel. With SAME padding and stride 1 the centre tap is one GEMM over
//! the whole batch. Both gradients contract over only C or F channels, which keeps them 1.5-3x
//! slower than the forward pass (64x32x32x16, 3x3: about 5, 9 and 7 ms on one core; the per-row
//! version before `TapPlan` took 15 and 10 ms for the two gradients).

use super::CpuKernel;
use super::broadcast::Strided;
use super::matmul::Gemm;
use super::mixed_gemm::Matrix;
use super::par::{SendPtr, par_ranges};
use crate::geometry::Geom;
use kiln_compiler::ir::{DType, Shape, Window2d};
use rayon::prelude::*;
use std::slice;

/// Output columns ow0..ow0+count all read filter columns lo..hi (inside the input).
#[derive(Clone, Copy, Debug)]
struct ColumnGroup {
    ow0: usize,
    count: usize,
    lo: usize,
    hi: usize,
}

impl Geom {
    /// Valid filter indices of output position `o` along an axis: k with 0 <= o*s - p + k < extent.
    pub(super) fn taps(o: usize, s: usize, p: usize, k: usize, extent: usize) -> (usize, usize) {
        let start = (o * s) as isize - p as isize;
        let lo = (-start).clamp(0, k as isize) as usize;
        let hi = (extent as isize - start).clamp(0, k as isize) as usize;
        (lo, hi.max(lo))
    }

    fn row_taps(&self, oh: usize) -> (usize, usize) {
        Geom::taps(oh, self.sh, self.ph, self.kh, self.h)
    }

    fn column_groups(&self) -> Vec<ColumnGroup> {
        let mut groups: Vec<ColumnGroup> = Vec::new();
        for ow in 0..self.ow {
            let (lo, hi) = Geom::taps(ow, self.sw, self.pw, self.kw, self.w);
            match groups.last_mut() {
                Some(g) if g.lo == lo && g.hi == hi => g.count += 1,
                _ => groups.push(ColumnGroup { ow0: ow, count: 1, lo, hi }),
            }
        }
        groups.retain(|g| g.lo < g.hi);
        groups
    }

    /// Input column of output column `ow` under tap `kw` (valid by construction where used).
    fn iw(&self, ow: usize, kw: usize) -> usize {
        ow * self.sw + kw - self.pw
    }
}

// ---------------------------------------------------------------- forward

/// Output rows per forward task: border columns are batched over these rows.
const ROW_BLOCK: usize = 8;

pub(crate) struct Conv2d {
    g: Geom,
    groups: Vec<ColumnGroup>,
    /// Per filter row kh: the output rows whose tap kh lies inside the input.
    rows: Vec<(usize, usize)>,
    /// Few input channels: computed directly (`narrow_conv`), not by GEMMs.
    narrow: bool,
    desc: String,
}

pub(crate) fn conv2d(x: &Shape, w: &Shape, window: &Window2d, _out: &Shape) -> Box<dyn CpuKernel> {
    Box::new(conv2d_kernel(x, w, window))
}

/// The convolution of input `x` by filter `w` (shapes checked by `ir::infer`).
pub(crate) fn conv2d_kernel(x: &Shape, w: &Shape, window: &Window2d) -> Conv2d {
    Conv2d::of(Geom::new(x, window, w.dims()[3]))
}

impl Conv2d {
    fn of(g: Geom) -> Conv2d {
        let groups = g.column_groups();
        let rows = (0..g.kh)
            .map(|kh| {
                let valid: Vec<usize> =
                    (0..g.oh).filter(|&oh| (g.row_taps(oh).0..g.row_taps(oh).1).contains(&kh)).collect();
                valid.first().map_or((0, 0), |&a| (a, a + valid.len()))
            })
            .collect();
        let narrow =
            super::narrow_conv::applies(&g) && std::env::var_os("KILN_NARROW_CONV").is_none_or(|v| v != "0");
        let desc = format!("conv2d {}{}", g.text(), if narrow { " (direct, few channels in)" } else { "" });
        Conv2d { g, groups, rows, narrow, desc }
    }
}

impl Conv2d {
    /// Output rows o0..o1 of image n into `dst` (row o0 first, rows OW·F floats apart).
    ///
    /// # Safety
    /// `x` and `w` hold the input and filter of this geometry; `dst` is valid for (o1 - o0) rows
    /// that no other thread touches and overlaps neither.
    unsafe fn rows(&self, x: *const f32, w: *const f32, n: usize, o0: usize, o1: usize, dst: *mut f32) {
        let g = &self.g;
        if self.narrow {
            // SAFETY: `narrow_conv::applies`; the caller's contract.
            return unsafe { super::narrow_conv::rows(g, x, w, n, o0, o1, dst) };
        }
        let row = g.ow * g.f;
        let out = |oh: usize, ow: usize| dst.wrapping_add((oh - o0) * row + ow * g.f);
        // SAFETY: the rows o0..o1 of dst (the caller's contract).
        unsafe { slice::from_raw_parts_mut(dst, (o1 - o0) * row).fill(0.0) };
        for kh in 0..g.kh {
            let (a, z) = (self.rows[kh].0.max(o0), self.rows[kh].1.min(o1));
            if a >= z {
                continue;
            }
            let ih = |oh: usize| oh * g.sh + kh - g.ph;
            for cg in &self.groups {
                let k = (cg.hi - cg.lo) * g.c;
                let wb = w.wrapping_add((kh * g.kw + cg.lo) * g.c * g.f);
                let xa =
                    |oh: usize, ow: usize| x.wrapping_add(((n * g.h + ih(oh)) * g.w + g.iw(ow, cg.lo)) * g.c);
                // SAFETY (both branches): the taps lo..hi of the group's columns read inside
                // input rows ih(a..z); filter rows exist; the output rows are the caller's.
                if cg.count < z - a {
                    // Few columns (a border): one GEMM per column over the rows a..z.
                    let gemm = Gemm {
                        m: z - a,
                        n: g.f,
                        k,
                        a: ((g.sh * g.w * g.c) as isize, 1),
                        b: (g.f as isize, 1),
                        out_rs: row as isize,
                    };
                    for ow in cg.ow0..cg.ow0 + cg.count {
                        // SAFETY: as stated above for both branches.
                        unsafe { gemm.run(xa(a, ow), wb, out(a, ow), true, false) };
                    }
                } else {
                    let gemm = Gemm {
                        m: cg.count,
                        n: g.f,
                        k,
                        a: ((g.sw * g.c) as isize, 1),
                        b: (g.f as isize, 1),
                        out_rs: g.f as isize,
                    };
                    for oh in a..z {
                        // SAFETY: as stated above for both branches.
                        unsafe { gemm.run(xa(oh, cg.ow0), wb, out(oh, cg.ow0), true, false) };
                    }
                }
            }
        }
    }

    /// The convolution with ReLU's gradient applied as it is stored: out = mask > 0 ? conv : 0,
    /// a block of `ROW_BLOCK` output rows at a time, each made in its worker thread's tile
    /// (ROW_BLOCK·OW·F floats) and then stored through the mask's same rows. `out` may be
    /// `mask`'s own buffer: a block reads only its rows of the mask, before it writes them.
    /// On the CPU the pair takes what the two ops took (the three input gradients of the zoo
    /// cnn's step: 17.3-18.5 ms fused, 16.6-18.1 ms apart, `examples/profile_cpu.rs`).
    ///
    /// `mask > 0 ? residual + conv : 0` (without `residual`, `mask > 0 ? conv : 0`), a block of
    /// output rows at a time through a tile.
    ///
    /// # Safety
    /// `x`, `w` as for `run`; `mask`, `residual` (when given) and `out` hold the output's shape;
    /// `out` overlaps neither `x` nor `w` (it may be `mask` or `residual`).
    unsafe fn run_relu_grad(
        &self,
        x: *const f32,
        w: *const f32,
        mask: *const f32,
        residual: Option<*const f32>,
        out: *mut f32,
    ) {
        let g = &self.g;
        let row = g.ow * g.f;
        let blocks = g.oh.div_ceil(ROW_BLOCK);
        let cost = ROW_BLOCK.min(g.oh) * row * g.kh * g.kw * g.c;
        let (x, w, mask, o) = (
            SendPtr::new(x as *mut f32),
            SendPtr::new(w as *mut f32),
            SendPtr::new(mask as *mut f32),
            SendPtr::new(out),
        );
        let residual = residual.map(|r| SendPtr::new(r as *mut f32));
        thread_local! {
            /// Each worker's tile, kept between calls (`rows` zeroes what it uses).
            static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        par_ranges(g.n * blocks, cost, |s, e| {
            TILE.with_borrow_mut(|tile| {
                tile.resize(tile.len().max(ROW_BLOCK.min(g.oh) * row), 0.0);
                for t in s..e {
                    let (n, b) = (t / blocks, t % blocks);
                    let (o0, o1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(g.oh));
                    let at = (n * g.oh + o0) * row;
                    let len = (o1 - o0) * row;
                    // SAFETY: the tile holds ROW_BLOCK rows and is this task's; rows o0..o1 of
                    // image n of the mask, the residual and the output are this task's, read
                    // (mask, residual) before written (out), chunk by chunk.
                    unsafe {
                        self.rows(x.get(), w.get(), n, o0, o1, tile.as_mut_ptr());
                        // In chunks through stack buffers: the mask's and the residual's chunks
                        // are copied out before the output's is written (either may be its
                        // buffer), and the select vectorises.
                        let (mut m, mut r) = ([0f32; 64], [0f32; 64]);
                        for c0 in (0..len).step_by(64) {
                            let k = 64.min(len - c0);
                            std::ptr::copy_nonoverlapping(mask.get().add(at + c0), m.as_mut_ptr(), k);
                            let tile = &tile[c0..c0 + k];
                            match residual {
                                Some(res) => {
                                    std::ptr::copy_nonoverlapping(res.get().add(at + c0), r.as_mut_ptr(), k);
                                    for ((m, &v), &r) in m[..k].iter_mut().zip(tile).zip(&r[..k]) {
                                        *m = if *m > 0.0 { r + v } else { 0.0 };
                                    }
                                }
                                None => {
                                    for (m, &v) in m[..k].iter_mut().zip(tile) {
                                        *m = if *m > 0.0 { v } else { 0.0 };
                                    }
                                }
                            }
                            std::ptr::copy_nonoverlapping(m.as_ptr(), o.get().add(at + c0), k);
                        }
                    }
                }
            })
        });
    }
}

impl Conv2d {
    /// The convolution of `x` by `w` into `out`, a block of `ROW_BLOCK` output rows of an image
    /// per task (a pointwise one: a block of pixels across the batch, `pointwise_then`); after
    /// each block, on the same thread while the block is in its cache, `then(at, len)` with the
    /// block's element range of the output (`Fused::conv`'s epilogue).
    ///
    /// # Safety
    /// `x`, `w` and `out` hold this geometry's input, filter and output; `out` overlaps neither
    /// factor; `then` touches only its range of the output (and what it reads elsewhere).
    pub(crate) unsafe fn run_then(
        &self,
        x: *const f32,
        w: *const f32,
        out: *mut f32,
        then: &(dyn Fn(usize, usize) + Sync),
    ) {
        let g = &self.g;
        let (x, w) = (SendPtr::new(x as *mut f32), SendPtr::new(w as *mut f32));
        let o = SendPtr::new(out);
        if self.pointwise() {
            // SAFETY: forwarded contract.
            return unsafe { self.pointwise_then(x, w, o, then) };
        }
        let row = g.ow * g.f;
        let blocks = g.oh.div_ceil(ROW_BLOCK);
        let cost = ROW_BLOCK.min(g.oh) * row * g.kh * g.kw * g.c;
        par_ranges(g.n * blocks, cost, |s, e| {
            for t in s..e {
                let (n, b) = (t / blocks, t % blocks);
                let (o0, o1) = (b * ROW_BLOCK, ((b + 1) * ROW_BLOCK).min(g.oh));
                let at = (n * g.oh + o0) * row;
                // SAFETY: output rows o0..o1 of image n belong to this task.
                unsafe { self.rows(x.get(), w.get(), n, o0, o1, o.get().wrapping_add(at)) };
                then(at, (o1 - o0) * row);
            }
        });
    }

    /// Whether the convolution is a 1x1 window without padding: a pixel's outputs are its input
    /// pixel's C values times the C x F filter, and the whole batch is one [N·OH·OW, C] @ [C, F]
    /// product.
    fn pointwise(&self) -> bool {
        let g = &self.g;
        (g.kh, g.kw, g.ph, g.pw) == (1, 1, 0, 0)
    }

    /// Whether a pointwise convolution reads every input pixel in order (stride 1): its input is
    /// then the product's left factor as it lies; with a stride, each block's pixels are
    /// gathered first.
    fn dense_pixels(&self) -> bool {
        let g = &self.g;
        (g.sh, g.sw) == (1, 1) && (g.oh, g.ow) == (g.h, g.w)
    }

    /// `run_then` of a pointwise convolution (`pointwise`): blocks of pixels across the whole
    /// batch, each one GEMM that writes its output rows (the sums of `rows`, which adds each
    /// filter row's product to zeros: the same bits but for the sign of a zero sum), then `then`
    /// on them while they are in cache. Writing instead of adding to zeros spares a pass over
    /// the block and the micro-kernel's reads of it: EfficientNet-B0's 16 -> 96 at 112x112 with
    /// its SiLU 1.43-1.45 -> 1.32-1.40 ms, 24 -> 144 at 56x56 0.59 -> 0.52-0.56 ms (`--profile
    /// 20`, one core). Blocks hold `POINTWISE_TILE` outputs or `POINTWISE_ROWS` pixels, whichever is
    /// more, and are cut smaller only to give every thread one.
    ///
    /// Why: `rows` made one GEMM per output row, so a 1x1 convolution at 7x7 was 14 products of
    /// 7 rows, each packing the whole filter again, and one at 112x112 224 products. Measured
    /// on one core of the 2-core AMD EPYC with AVX-512, batch-2 inference exports: EfficientNet-B0's
    /// 320 -> 1,280 at 7x7 0.522 -> 0.416 ms and 1,152 -> 320 0.445 -> 0.374 ms (`kiln run
    /// --profile 20`); whole passes (`kiln run --bench 20`, three interleaved rounds, per-row ->
    /// pointwise) EfficientNet-B0 17.8-17.9 -> 16.0-16.4 ms, MobileNetV3-small 3.6-4.1 ->
    /// 3.2-3.6 ms, ResNet-50 84.9-85.4 -> 81.9-84.6 ms. Strided (ResNet-50's projections, their
    /// pixels gathered per block): 1,024 -> 2,048 at 14x14 -> 7x7 3.41 -> 2.30 ms, 512 -> 1,024
    /// at 28x28 -> 14x14 2.38 -> 2.02 ms (`--profile 20`).
    ///
    /// # Safety
    /// As `run_then`.
    unsafe fn pointwise_then(
        &self,
        x: SendPtr<f32>,
        w: SendPtr<f32>,
        o: SendPtr<f32>,
        then: &(dyn Fn(usize, usize) + Sync),
    ) {
        let g = &self.g;
        let pixels = g.n * g.oh * g.ow;
        let threads = rayon::current_num_threads();
        if threads > 1
            && pixels * g.c * g.f >= super::matmul::SERIAL_MACS
            && g.f > pixels
            && g.f >= 32 * threads
        {
            // SAFETY: the caller's contract.
            return unsafe { self.pointwise_columns(x, w, o, then, threads) };
        }
        let mut block = (POINTWISE_TILE / g.f.max(1)).max(POINTWISE_ROWS);
        if threads > 1 && pixels * g.c * g.f >= super::matmul::SERIAL_MACS {
            // Not below `POINTWISE_MIN` pixels: each block packs the whole filter again.
            block = block.min(pixels.div_ceil(threads).max(POINTWISE_MIN)).clamp(1, pixels.max(1));
            // Then as many blocks as a multiple of the threads, of equal size: 392 pixels (14x14,
            // batch 2) in blocks of 128 were 128 + 128 on one thread and 128 + 8 on the other,
            // and ResNet-50's 1x1 convolutions at 14x14 ran 1.53-1.55 times as fast on two
            // threads as on one (`kiln run --profile 10`).
            let blocks = pixels.div_ceil(block);
            if blocks > 1 {
                block = pixels.div_ceil(blocks.next_multiple_of(threads)).max(1);
            }
        }
        let block = block.clamp(1, pixels.max(1));
        let blocks = pixels.div_ceil(block);
        par_ranges(blocks, block * g.c * g.f, |s, e| {
            for t in s..e {
                let (p0, p1) = (t * block, ((t + 1) * block).min(pixels));
                let gemm = Gemm {
                    m: p1 - p0,
                    n: g.f,
                    k: g.c,
                    a: (g.c as isize, 1),
                    b: (g.f as isize, 1),
                    out_rs: g.f as isize,
                };
                // SAFETY: this task alone writes output pixels p0..p1 of the [N·OH·OW, F] output
                // (the caller's tensor).
                let dst = unsafe { o.get().add(p0 * g.f) };
                if self.dense_pixels() {
                    // SAFETY: pixels p0..p1 of the [N·H·W, C] input; the output rows as above.
                    unsafe { gemm.run(x.get().add(p0 * g.c), w.get(), dst, false, false) };
                } else {
                    PIXELS.with_borrow_mut(|gathered| {
                        gathered.clear();
                        // SAFETY: the caller's contract: x holds the input.
                        unsafe { self.gather_pixels(x, p0, p1, gathered) };
                        // SAFETY: the gathered pixels are (p1 - p0) x C, row-major; the output
                        // rows as above.
                        unsafe { gemm.run(gathered.as_ptr(), w.get(), dst, false, false) };
                    });
                }
                then(p0 * g.f, (p1 - p0) * g.f);
            }
        });
    }

    /// `pointwise_then` where the filter has more output channels than the product has
    /// pixels (a batch's last stages): each thread one block of the filter's columns across
    /// all pixels, then `then` on blocks of pixels. Cut by pixels, every thread packed the
    /// whole filter again (ResNet-50's 2,048 x 512 and 512 x 2,048 at 7x7, 4 MiB each), and
    /// those convolutions ran 1.6 times as fast on two threads as on one (`kiln run --profile
    /// 10`, batch 2). Each sum is the crate's over the whole depth, as in `pointwise_then`: the
    /// same bits.
    ///
    /// # Safety
    /// As `run_then`.
    unsafe fn pointwise_columns(
        &self,
        x: SendPtr<f32>,
        w: SendPtr<f32>,
        o: SendPtr<f32>,
        then: &(dyn Fn(usize, usize) + Sync),
        threads: usize,
    ) {
        let g = &self.g;
        let pixels = g.n * g.oh * g.ow;
        // A strided window's input pixels, gathered once for all the column blocks.
        let mut gathered = Vec::new();
        if !self.dense_pixels() {
            // SAFETY: the caller's contract: x holds the input.
            unsafe { self.gather_pixels(x, 0, pixels, &mut gathered) };
        }
        let src = SendPtr::new(if self.dense_pixels() { x.get() } else { gathered.as_ptr() as *mut f32 });
        // Blocks of whole vectors of columns, one per thread.
        let nb = g.f.div_ceil(threads).next_multiple_of(16);
        (0..g.f.div_ceil(nb)).into_par_iter().for_each(|t| {
            let (j0, j1) = (t * nb, ((t + 1) * nb).min(g.f));
            let gemm = Gemm {
                m: pixels,
                n: j1 - j0,
                k: g.c,
                a: (g.c as isize, 1),
                b: (g.f as isize, 1),
                out_rs: g.f as isize,
            };
            // SAFETY: the [pixels, C] input (or its gathered pixels) by filter columns j0..j1 of
            // the [C, F] filter into output columns j0..j1 of the [pixels, F] output, which this
            // task alone writes.
            unsafe { gemm.run(src.get(), w.get().add(j0), o.get().add(j0), false, false) };
        });
        let block = pixels.div_ceil(threads);
        par_ranges(threads, block * g.f, |s, e| {
            for t in s..e {
                let (p0, p1) = (t * block, ((t + 1) * block).min(pixels));
                if p0 < p1 {
                    then(p0 * g.f, (p1 - p0) * g.f);
                }
            }
        });
    }

    /// Appends to `out` the input pixels that output pixels p0..p1 (across the batch) of a
    /// strided pointwise convolution read, C floats each.
    ///
    /// # Safety
    /// `x` holds the convolution's input.
    unsafe fn gather_pixels(&self, x: SendPtr<f32>, p0: usize, p1: usize, out: &mut Vec<f32>) {
        let g = &self.g;
        out.reserve((p1 - p0) * g.c);
        for p in p0..p1 {
            let (n, oh, ow) = (p / (g.oh * g.ow), p / g.ow % g.oh, p % g.ow);
            let at = ((n * g.h + oh * g.sh) * g.w + ow * g.sw) * g.c;
            // SAFETY: output pixel (n, oh, ow) of an unpadded 1x1 window reads input pixel
            // (n, oh·sh, ow·sw), inside the input (`ir::infer`), which x holds.
            out.extend_from_slice(unsafe { slice::from_raw_parts(x.get().add(at), g.c) });
        }
    }

    pub(crate) fn text(&self) -> &str {
        &self.desc
    }
}

thread_local! {
    /// Each worker's gathered input pixels of a strided pointwise convolution, kept between
    /// calls.
    static PIXELS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Outputs per block of a pointwise convolution (`Conv2d::pointwise_then`): 256 KiB, in L2 for
/// the epilogue.
const POINTWISE_TILE: usize = 1 << 16;
/// Pixels per block at least, so that a wide filter's GEMM still runs tall blocks.
const POINTWISE_ROWS: usize = 128;
/// Pixels per block at least when blocks are cut to give every thread one.
const POINTWISE_MIN: usize = 32;

impl CpuKernel for Conv2d {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: run's contract: the operands and the output hold this geometry's tensors,
        // and a convolution never writes over its factors.
        unsafe {
            self.run_then(inputs[0] as *const f32, inputs[1] as *const f32, output as *mut f32, &|_, _| {})
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- gradients, one filter tap at a time

/// The output positions (n, oh, ow) whose filter tap (kh, kw) reads inside the input, as a loop
/// nest for GEMM calls. Positions and input pixels are both affine in (n, oh, ow), so axes merge
/// wherever both stay contiguous (`Strided`): with SAME padding and a stride dividing the input,
/// the centre tap is one run over the whole batch. The longest remaining axis becomes the GEMM's
/// row (or contraction) dimension and the others are looped over, one call each.
#[derive(Clone, Debug)]
struct TapPlan {
    /// Offset of the tap's filter matrix W[kh, kw] (C x F).
    w: usize,
    /// The GEMM axis: (extent, output-position stride, input-pixel stride).
    run: (usize, isize, isize),
    /// The looped axes, same layout, outer first.
    outer: Vec<(usize, isize, isize)>,
    /// First output position (units of F elements) and first input pixel (units of C).
    pos: usize,
    pix: usize,
    calls: usize,
}

impl TapPlan {
    /// `None` when the tap reads only padding.
    fn new(g: &Geom, kh: usize, kw: usize) -> Option<TapPlan> {
        let valid = |o: usize, s: usize, p: usize, k: usize, extent: usize| {
            let i = (o * s + k) as isize - p as isize;
            (0..extent as isize).contains(&i)
        };
        let rows: Vec<usize> = (0..g.oh).filter(|&oh| valid(oh, g.sh, g.ph, kh, g.h)).collect();
        let cols: Vec<usize> = (0..g.ow).filter(|&ow| valid(ow, g.sw, g.pw, kw, g.w)).collect();
        let (&a, &b) = (rows.first()?, cols.first()?);
        if g.n == 0 {
            return None;
        }
        let dims = [g.n, rows.len(), cols.len()];
        let pos = [(g.oh * g.ow) as isize, g.ow as isize, 1];
        let pix = [(g.h * g.w) as isize, (g.sh * g.w) as isize, g.sw as isize];
        let axes: Vec<(usize, isize, isize)> =
            Strided::<2>::new(&dims, [&pos, &pix]).axes().into_iter().map(|(d, [p, x])| (d, p, x)).collect();
        let longest = (0..axes.len()).max_by_key(|&i| axes[i].0).expect("one axis");
        let mut outer = axes.clone();
        let run = outer.remove(longest);
        Some(TapPlan {
            w: (kh * g.kw + kw) * g.c * g.f,
            run,
            calls: outer.iter().map(|a| a.0).product(),
            outer,
            pos: a * g.ow + b,
            pix: (a * g.sh + kh - g.ph) * g.w + b * g.sw + kw - g.pw,
        })
    }

    /// (first output position, first input pixel) of call `q`.
    fn call(&self, mut q: usize) -> (usize, usize) {
        let (mut pos, mut pix) = (self.pos as isize, self.pix as isize);
        for &(d, ps, xs) in self.outer.iter().rev() {
            pos += (q % d) as isize * ps;
            pix += (q % d) as isize * xs;
            q /= d;
        }
        (pos as usize, pix as usize)
    }
}

fn tap_plans(g: &Geom) -> Vec<Option<TapPlan>> {
    (0..g.kh * g.kw).map(|t| TapPlan::new(g, t / g.kw, t % g.kw)).collect()
}

/// Multiply-adds from which one GEMM call uses the rayon pool itself.
const GEMM_PARALLEL_MACS: usize = 1 << 20;

struct BackpropInput {
    g: Geom,
    taps: Vec<Option<TapPlan>>,
    /// With stride 1: the forward convolution of dy that gives dx (`Flipped`).
    flipped: Option<Flipped>,
    desc: String,
}

/// With stride 1 the input gradient is a forward convolution: dx[h, w, c] = Σ dy[h + ph - kh,
/// w + pw - kw, f] · W[kh, kw, c, f] is the convolution of dy by the filter turned half a turn
/// with its channel axes swapped (W'[kh, kw, f, c] = W[KH-1-kh, KW-1-kw, c, f]), padded KH-1-ph
/// before. The forward kernel contracts KW·F values per GEMM row and writes each output row
/// once, where the tap-by-tap form contracts F values and adds every tap into all of dx
/// (`examples/profile_cpu.rs -- cnn`: its 64x32x32x32 3x3 input gradient 15.2 -> 6.2 ms, the
/// 64-channel one 6.8 -> 6.3 ms, as fast as the forward convolutions). W' lives in the
/// kernel's own buffer (KH·KW·C·F floats, 36 KiB for 3x3x32x32), outside the arena like the
/// GEMM's packing buffers.
struct Flipped {
    conv: Conv2d,
    filter: std::sync::Mutex<Vec<f32>>,
}

pub(crate) fn backprop_input(dy: &Shape, w: &Shape, window: &Window2d, dx: &Shape) -> Box<dyn CpuKernel> {
    Box::new(backprop_input_kernel(dy, w, window, dx))
}

fn backprop_input_kernel(dy: &Shape, w: &Shape, window: &Window2d, dx: &Shape) -> BackpropInput {
    let g = Geom::new(dx, window, w.dims()[3]);
    debug_assert_eq!(dy.dims(), [g.n, g.oh, g.ow, g.f]);
    let desc = format!("conv2d_backprop_input {}", g.text());
    let flipped = (g.sh == 1 && g.sw == 1 && g.ph < g.kh && g.pw < g.kw).then(|| Flipped {
        conv: Conv2d::of(Geom {
            h: g.oh,
            w: g.ow,
            c: g.f,
            oh: g.h,
            ow: g.w,
            f: g.c,
            ph: g.kh - 1 - g.ph,
            pw: g.kw - 1 - g.pw,
            ..g.clone()
        }),
        filter: std::sync::Mutex::new(Vec::new()),
    });
    // The tap-by-tap plans only where the turned convolution does not apply.
    let taps = if flipped.is_some() { Vec::new() } else { tap_plans(&g) };
    BackpropInput { g, taps, flipped, desc }
}

impl Flipped {
    /// The turned filter of `w` ([KH, KW, C, F] -> [KH, KW, F, C], half a turn), in the kernel's
    /// buffer: per tap, the mirrored tap's C x F matrix transposed in 8 x 8 tiles
    /// (`matmul::transpose_into`). An element at a time, with four integer divisions each to
    /// find its source, the turn took 12% of EfficientNet-B0's training step at batch 2 (perf,
    /// one core of the 2-core AMD EPYC): every step turns every stride-1 filter once.
    ///
    /// # Safety
    /// `w` holds KH·KW·C·F floats.
    unsafe fn turn(&self, g: &Geom, w: *const f32) -> std::sync::MutexGuard<'_, Vec<f32>> {
        let mut filter = self.filter.lock().unwrap_or_else(|e| e.into_inner());
        let (kh, kw, c, f) = (g.kh, g.kw, g.c, g.f);
        filter.resize(kh * kw * c * f, 0.0);
        // (An empty filter has nothing to turn, and no chunks of c·f = 0.)
        for (tap, dst) in filter.chunks_exact_mut((c * f).max(1)).enumerate() {
            let (a, b) = (tap / kw, tap % kw);
            let from = ((kh - 1 - a) * kw + (kw - 1 - b)) * c * f;
            // SAFETY: tap `from / (c·f)` of w is c rows of f floats (the caller's contract);
            // dst holds f rows of c floats: dst[fo·c + ci] = w[from + ci·f + fo].
            unsafe { super::matmul::transpose_into(w.add(from), f, f, c, dst, c) };
        }
        filter
    }
}

/// ReLU's gradient of a convolution's input gradient (`Op::Conv2dBackpropInputReluGrad`:
/// (dy, w, y) -> y > 0 ? dx : 0, or with a residual gradient (dy, w, y, r) -> y > 0 ? r + dx :
/// 0). With stride 1, the turned convolution a block of rows at a time through the mask
/// (`Conv2d::run_relu_grad`), so that dx may be y's or r's own buffer; otherwise the input
/// gradient, then the mask over it (never in place: `Op::may_write_over`). The bits are the ops'
/// apart.
struct BackpropInputReluGrad {
    input: BackpropInput,
    residual: bool,
    desc: String,
}

pub(crate) fn backprop_input_relu_grad(
    dy: &Shape,
    w: &Shape,
    window: &Window2d,
    dx: &Shape,
    residual: bool,
) -> Box<dyn CpuKernel> {
    let input = backprop_input_kernel(dy, w, window, dx);
    let desc = format!("{}{} then relu_grad", input.desc, if residual { " plus a residual" } else { "" });
    Box::new(BackpropInputReluGrad { input, residual, desc })
}

impl CpuKernel for BackpropInputReluGrad {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.input.g;
        let (dy, w, y) = (inputs[0] as *const f32, inputs[1] as *const f32, inputs[2] as *const f32);
        let residual = self.residual.then(|| inputs[3] as *const f32);
        if let Some(flipped) = &self.input.flipped {
            // SAFETY: run's contract: the filter, dy, y, r and dx of this geometry; dx overlaps
            // neither dy nor the kernel's turned filter, and may be y or r (a block reads its
            // rows of both before writing them).
            return unsafe {
                let filter = flipped.turn(g, w);
                flipped.conv.run_relu_grad(dy, filter.as_ptr(), y, residual, output as *mut f32)
            };
        }
        let n = g.n * g.h * g.w * g.c;
        // SAFETY: dx overlaps neither y nor r here (`Op::may_write_over` allows it with stride 1
        // only); all hold n floats.
        unsafe {
            self.input.run(&inputs[..2], output);
            let dx = slice::from_raw_parts_mut(output as *mut f32, n);
            let y = slice::from_raw_parts(y, n);
            match residual {
                Some(r) => {
                    let r = slice::from_raw_parts(r, n);
                    dx.iter_mut()
                        .zip(y)
                        .zip(r)
                        .for_each(|((d, &m), &r)| *d = if m > 0.0 { r + *d } else { 0.0 });
                }
                None => dx.iter_mut().zip(y).for_each(|(d, &m)| *d = if m > 0.0 { *d } else { 0.0 }),
            }
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

impl CpuKernel for BackpropInput {
    /// With stride 1, the forward convolution of dy by the turned filter (`Flipped`). Otherwise
    /// dx = 0, then for each tap in order: dx[pixels of the tap's positions] += dy[positions] ·
    /// W[kh, kw]ᵀ. A tap's positions map to distinct pixels, so its calls run in parallel.
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.g;
        if let Some(flipped) = &self.flipped {
            // SAFETY: inputs[1] is the filter, KH·KW·C·F floats (run's contract).
            let filter = unsafe { flipped.turn(g, inputs[1] as *const f32) };
            // SAFETY: dy is the turned convolution's input ([N, OH, OW, F]), the buffer its
            // filter ([KH, KW, F, C]) and dx its output ([N, H, W, C]): the geometry `Flipped`
            // was made with; the buffer is this kernel's and overlaps nothing.
            return unsafe { flipped.conv.run(&[inputs[0], filter.as_ptr() as *mut u8], output) };
        }
        let (dy, w) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
        let dx = SendPtr::new(output as *mut f32);
        let n = g.n * g.h * g.w * g.c;
        // SAFETY: dx holds n elements; chunks are disjoint.
        par_ranges(n, 1, |s, e| unsafe { slice::from_raw_parts_mut(dx.get().add(s), e - s).fill(0.0) });
        for t in self.taps.iter().flatten() {
            let gemm = Gemm {
                m: t.run.0,
                n: g.c,
                k: g.f,
                a: (t.run.1 * g.f as isize, 1),
                b: (1, g.f as isize),
                out_rs: t.run.2 * g.c as isize,
            };
            let macs = gemm.m * gemm.n * gemm.k;
            let one = |q: usize, parallel: bool| {
                let (pos, pix) = t.call(q);
                // SAFETY: dy rows are valid output positions, dx rows the distinct pixels the
                // tap reads from them; W[kh, kw] is read transposed. Calls of one tap write
                // disjoint pixels.
                unsafe {
                    gemm.run(
                        dy.get().add(pos * g.f),
                        w.get().add(t.w),
                        dx.get().add(pix * g.c),
                        true,
                        parallel,
                    )
                }
            };
            if t.calls < 4 {
                (0..t.calls).for_each(|q| one(q, macs >= GEMM_PARALLEL_MACS));
            } else {
                par_ranges(t.calls, macs, |s, e| (s..e).for_each(|q| one(q, false)));
            }
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct BackpropFilter {
    g: Geom,
    taps: Vec<Option<TapPlan>>,
    /// Tiles of im2col patches, where a tile holds rows enough (`Tiles`).
    tiles: Option<Tiles>,
    /// The types of x, dy and dw (f32, f16 or bf16): half x and dy are widened as the GEMMs
    /// read them (`Gemm::run_mixed`) or as the patches are gathered; a half dw is summed in the
    /// kernel's f32 buffer and rounded once.
    types: [DType; 3],
    desc: String,
}

pub(crate) fn backprop_filter(
    x: &Shape,
    dy: &Shape,
    window: &Window2d,
    _dw: &Shape,
    types: [DType; 3],
) -> Box<dyn CpuKernel> {
    let g = Geom::new(x, window, dy.dims()[3]);
    let desc = format!("conv2d_backprop_filter {}", g.text());
    // Tiles of at least 32 positions, and enough positions to fill the groups; else tap by tap.
    let tiles = Some(Tiles::new(&g)).filter(|t| t.t >= 32 && g.n * g.oh * g.ow >= TILE_GROUPS * t.t);
    let taps = if tiles.is_some() { Vec::new() } else { tap_plans(&g) };
    Box::new(BackpropFilter { g, taps, tiles, types, desc })
}

impl BackpropFilter {
    /// dw[kh, kw] = Σ over the tap's positions of x[pixel]ᵀ · dy[position], contracted by GEMM.
    ///
    /// # Safety
    /// `x`, `dy` and `dw` hold the tensors; no other thread writes tap `t` of dw.
    unsafe fn tap(&self, x: *mut u8, dy: *mut u8, dw: *mut f32, t: usize) {
        let g = &self.g;
        let size = g.c * g.f;
        let dst = dw.wrapping_add(t * size);
        // SAFETY: filter tap t of dw.
        unsafe { slice::from_raw_parts_mut(dst, size).fill(0.0) };
        let Some(p) = &self.taps[t] else { return };
        let gemm = Gemm {
            m: g.c,
            n: g.f,
            k: p.run.0,
            a: (1, p.run.2 * g.c as isize),
            b: (p.run.1 * g.f as isize, 1),
            out_rs: g.f as isize,
        };
        let [tx, tdy, _] = self.types;
        for q in 0..p.calls {
            let (pos, pix) = p.call(q);
            // SAFETY: pixels and positions of this tap, inside x and dy; dst is this tap's.
            unsafe {
                let (a, b) = (
                    Matrix::new(x, tx).at((pix * g.c) as isize),
                    Matrix::new(dy, tdy).at((pos * g.f) as isize),
                );
                gemm.run_mixed(a, b, Matrix::F32(dst), true, false)
            };
        }
    }
}

/// The filter gradient over tiles of output positions (`Tiles`): for each tile, its input
/// patches laid out as rows of KH·KW·C values (im2col, one tile at a time), and dw += patchesᵀ ·
/// dy[tile]: one GEMM contracting the tile's positions into all KH·KW·C x F values at once,
/// where the tap-by-tap form makes KH·KW GEMMs of C x F outputs each. The positions are split
/// into `TILE_GROUPS` fixed groups, each summed over its tiles in order into a partial of its
/// own, and the partials are added in group order, so the bits do not depend on the threads.
/// Measured (`examples/profile_cpu.rs -- cnn`, 3x3 SAME, batch 64): 64x32x32x32 13.0 -> 8.2 ms,
/// 64x16x16x64 9.1 -> 7.5, 64x16x16x32 -> 64 5.2 -> 4.1, 64x32x32x3 3.2 -> 2.1. The buffers
/// (four groups of a 256 KiB tile and a KH·KW·C x F partial) are the kernel's, outside the arena
/// like the GEMM's packing buffers: 1.6 MiB at the most for these layers.
const TILE_GROUPS: usize = 4;
/// Floats of one tile's patches (256 KiB).
const PATCH_FLOATS: usize = 1 << 16;

struct Tiles {
    /// Positions per tile and KH·KW·C.
    t: usize,
    kk: usize,
    /// Per group: the patch tile, then its partial gradient (KK x F).
    buffers: std::sync::Mutex<Vec<f32>>,
}

impl Tiles {
    fn new(g: &Geom) -> Tiles {
        let kk = g.kh * g.kw * g.c;
        Tiles { t: (PATCH_FLOATS / kk.max(1)).max(1), kk, buffers: std::sync::Mutex::new(Vec::new()) }
    }

    /// # Safety
    /// `x`, `dy` and `dw` hold the tensors of `g`.
    unsafe fn run(
        &self,
        g: &Geom,
        (x, tx): (SendPtr<u8>, DType),
        (dy, tdy): (SendPtr<u8>, DType),
        dw: SendPtr<f32>,
    ) {
        let (t, kk, f) = (self.t, self.kk, g.f);
        let positions = g.n * g.oh * g.ow;
        let per_group = kk * t + kk * f;
        let mut buffers = self.buffers.lock().unwrap_or_else(|e| e.into_inner());
        buffers.resize(TILE_GROUPS * per_group, 0.0);
        let base = SendPtr::new(buffers.as_mut_ptr());
        let group = |q: usize| {
            let (p0, p1) = (positions * q / TILE_GROUPS, positions * (q + 1) / TILE_GROUPS);
            // SAFETY: group q's own part of the buffers (per_group floats).
            let mine = unsafe { slice::from_raw_parts_mut(base.get().add(q * per_group), per_group) };
            let (patches, partial) = mine.split_at_mut(kk * t);
            partial.fill(0.0);
            let mut start = p0;
            while start < p1 {
                let rows = t.min(p1 - start);
                for r in 0..rows {
                    let p = start + r;
                    let (n, oh, ow) = (p / (g.oh * g.ow), p / g.ow % g.oh, p % g.ow);
                    let row = &mut patches[r * kk..(r + 1) * kk];
                    for kh in 0..g.kh {
                        let ih = (oh * g.sh + kh) as isize - g.ph as isize;
                        for kw in 0..g.kw {
                            let iw = (ow * g.sw + kw) as isize - g.pw as isize;
                            let dst = &mut row[(kh * g.kw + kw) * g.c..(kh * g.kw + kw + 1) * g.c];
                            if (0..g.h as isize).contains(&ih) && (0..g.w as isize).contains(&iw) {
                                let at = ((n * g.h + ih as usize) * g.w + iw as usize) * g.c;
                                // SAFETY: pixel (n, ih, iw) is inside x (elements of its type).
                                match tx {
                                    DType::F16 | DType::BF16 => super::cast::widen_slice(
                                        tx,
                                        unsafe {
                                            slice::from_raw_parts((x.get() as *const u16).add(at), g.c)
                                        },
                                        dst,
                                    ),
                                    _ => dst.copy_from_slice(unsafe {
                                        slice::from_raw_parts((x.get() as *const f32).add(at), g.c)
                                    }),
                                }
                            } else {
                                dst.fill(0.0);
                            }
                        }
                    }
                }
                let gemm = Gemm {
                    m: kk,
                    n: f,
                    k: rows,
                    a: (1, kk as isize),
                    b: (f as isize, 1),
                    out_rs: f as isize,
                };
                // SAFETY: the patches are rows x KK floats read transposed, dy's rows start..start
                // + rows are F floats each, the partial is KK x F: all this group's or inputs.
                unsafe {
                    let b = Matrix::new(dy.get(), tdy).at((start * f) as isize);
                    gemm.run_mixed(
                        Matrix::F32(patches.as_mut_ptr()),
                        b,
                        Matrix::F32(partial.as_mut_ptr()),
                        true,
                        false,
                    )
                };
                start += rows;
            }
        };
        if positions * kk * f < super::par::PAR_MIN || rayon::current_num_threads() == 1 {
            (0..TILE_GROUPS).for_each(group);
        } else {
            (0..TILE_GROUPS).into_par_iter().for_each(group);
        }
        // SAFETY: dw holds KK x F floats; the partials are the buffers' (no task runs now).
        let out = unsafe { slice::from_raw_parts_mut(dw.get(), kk * f) };
        out.fill(0.0);
        for q in 0..TILE_GROUPS {
            let partial = &buffers[q * per_group + kk * t..(q + 1) * per_group];
            for (o, &v) in out.iter_mut().zip(partial) {
                *o += v;
            }
        }
    }
}

impl CpuKernel for BackpropFilter {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.g;
        let [tx, tdy, tdw] = self.types;
        let (x, dy) = (SendPtr::new(inputs[0]), SendPtr::new(inputs[1]));
        // A half dw is summed in the thread's f32 buffer (`buffers`), then rounded.
        let half_dw = tdw.is_half();
        super::buffers::with(|b| {
            let wide = &mut b.sums;
            let len = g.kh * g.kw * g.c * g.f;
            let dw = if half_dw {
                wide.resize(len, 0.0);
                SendPtr::new(wide.as_mut_ptr())
            } else {
                SendPtr::new(output as *mut f32)
            };
            if let Some(tiles) = &self.tiles {
                // SAFETY: run's contract: the operands and the output have g's shapes.
                unsafe { tiles.run(g, (x, tx), (dy, tdy), dw) };
            } else {
                let taps = g.kh * g.kw;
                // SAFETY: each task writes its own filter tap.
                let one = |t: usize| unsafe { self.tap(x.get(), dy.get(), dw.get(), t) };
                let work = g.n * g.oh * g.ow * g.c * g.f * taps;
                if work < super::par::PAR_MIN || rayon::current_num_threads() == 1 {
                    (0..taps).for_each(one);
                } else {
                    (0..taps).into_par_iter().for_each(one);
                }
            }
            if half_dw {
                // SAFETY: the output holds len elements of its half type.
                super::cast::narrow_slice(tdw, wide, unsafe {
                    slice::from_raw_parts_mut(output as *mut u16, len)
                });
            }
        })
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
