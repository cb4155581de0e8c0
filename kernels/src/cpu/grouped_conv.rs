//! Grouped, depthwise and dilated 2-D convolution (any window that is not dense:
//! `Window2d::is_dense` false) and its two gradients, NHWC activations and HWIO filters
//! `[KH, KW, C/G, F]`, by direct loops over the channels rather than GEMMs.
//!
//! Why not the GEMM kernels of `conv`: a group contracts only C/G channels into F/G (one and a
//! multiplier for depthwise), so a GEMM per group would be a few dozen multiply-adds per call,
//! and a dense convolution over a block-diagonal filter would do G times the work (an imported
//! EfficientNet-B0 spent 958.8 GFLOP forward that way where the model has 2.2). Dilation breaks
//! the contiguity of a filter row's KW·C inputs that `conv`'s GEMMs rely on.
//!
//! Notation: Cg = C/G input channels and Fg = F/G output channels per group; output channel f
//! belongs to group f / Fg and reads input channels (f / Fg)·Cg .. (f / Fg + 1)·Cg.
//!
//! Loop orders. In NHWC the channels of a pixel are contiguous, and so is a filter row
//! W[kh, kw, ci, :] over all F output channels, so the innermost loops run over contiguous
//! channels and vectorise. Taps that fall in the padding are skipped (no padded copy, nothing in
//! the arena): per output row and column the in-input taps are listed at `prepare` (`TapList`),
//! and output columns with the same taps form runs (`Run`).
//! - Forward, one task per output row (n, oh): out[f] = Σ over the in-input taps (kh, kw), then
//!   the in-group channels ci, of x[(f / Fg)·Cg + ci] · W[kh, kw, ci, f]. With a fused
//!   elementwise epilogue (`fused::FusedConvKernel`), each task's rows in blocks of 256 KiB,
//!   each block through the epilogue as soon as it is made (`Sweep::run_then`).
//!   - Depthwise with multiplier 1 (Cg = Fg = 1): out[c] = Σ x[c] · W[kh, kw, 0, c], tiles of
//!     up to 8 pixels (4 without AVX-512) by 16 channels, then by 8, with their sums in
//!     registers over all taps (`depthwise_run`): one filter load for up to eight (four)
//!     multiply-adds, no stores until the end.
//!   - Fg a multiple of 4 (ResNeXt's groups, dilated dense convolutions): tiles of P output
//!     pixels of a run by FB output channels of one group, their P·FB sums in registers
//!     (`sweep_tile`): per tap and ci, one vector of FB filter values times P broadcast inputs,
//!     the register blocking of a GEMM micro-kernel without packing.
//!   - Otherwise (a depthwise multiplier, odd group widths), a pixel at a time: for each tap
//!     and ci, out[f] += x[(f / Fg)·Cg + ci] · W[kh, kw, ci, f] across all f (`grouped_axpy`).
//! - Input gradient in gather form, one task per row (n, ih) of dx: the taps whose output
//!   position (ih + ph - kh·dh) / sh is integral and inside dy (`TapList::gather`), and
//!   dx[c] = Σ over them, then j < Fg, of dy[(c / Cg)·Fg + j] · W'[kh, kw, j, c], with the filter
//!   rearranged to W'[kh, kw, j, c] = W[kh, kw, c % Cg, (c / Cg)·Fg + j]. This is the forward
//!   loop with the roles of C and F swapped (`Sweep`), by the same three paths (the tiles when
//!   Cg is a multiple of 4); with stride s a run holds every s-th column of dx. Each dx element
//!   is written by one task: no races, no atomics.
//! - Filter gradient, tasks (group of output rows, block of output channels): all F channels
//!   where a task's KH·KW·Cg·F sums fit in the L2 cache (`DW_FLOATS`), else `FILTER_BLOCK` (or
//!   whole groups); and as many row groups as make `TASKS` tasks, fixed by the shape, each
//!   summing into a partial gradient of its own, added in row-group order at the end. A task
//!   goes through its output rows in order, reading each input row once for all its taps
//!   (taps as tasks would stream x and dy from memory KH·KW times):
//!   - Fg a multiple of 4: per in-input tap and the span of output columns whose tap reads
//!     inside the input, the row's sums over the span of R in-group channels by FB output
//!     channels in registers (`filter_tile`: one vector of dy times R broadcast inputs per
//!     column), added to dW[kh, kw, ci, f].
//!   - Depthwise with multiplier 1: per output column, dy's pixel times each tap's input pixel
//!     across the task's channels, into the row's sums per tap (`depthwise_rows`), added to dW
//!     at the end of the row.
//!   - Otherwise a position at a time into dW (`grouped_axpy`).
//!
//! Memory outside the arena, the kernels' own like the GEMM's packing buffers: W' (the filter's
//! size; none for depthwise with multiplier 1, where W is W'), the filter gradient's partials
//! (row groups times the filter's size) and each worker's depthwise row sums (KH·KW·block), and
//! the ReLU-gradient kernel's row of dx per worker.
//!
//! Determinism: every output element is a sum in an order fixed by the shape (taps in (kh, kw)
//! order, then the in-group channels; for dW, row groups in order, of rows in order, of sums
//! over the row's columns), made by one task, so the bits do not depend on the thread count or
//! on scheduling (`tests/grouped_conv.rs` checks it).
//!
//! Measured (release, `cargo test -p kiln-kernels --release --test grouped_conv -- --ignored
//! --nocapture timings`: the fastest of 5 runs; the 2-core Xeon (Sapphire Rapids, AVX-512)
//! build machine, shared with other jobs, so the ranges over several runs), 3x3 SAME stride 1,
//! forward / input gradient / filter gradient:
//! - depthwise 32x56x56x144 (130 M multiply-adds): 13-17 / 15-20 / 20-23 ms on one core,
//!   7.4-8.1 / 8.3-9.2 / 10.6-11.5 ms on both. The forward as a dense convolution over the
//!   block-diagonal filter (144 times the work): 440-500 ms on one core. The filter gradient
//!   took 25 ms a block of 16 channels at a time, reading the pixels strided, and 195 ms a
//!   position at a time through `grouped_axpy`.
//! - ResNeXt-like 32x28x28x256, G = 32 (Cg = Fg = 8, 462 M multiply-adds): 28-35 / 29-35 /
//!   34-38 ms on one core, 14-16 / 14-17 / 16-18 ms on both; dense over the block-diagonal
//!   filter 370-440 ms on one core. A pixel at a time through `grouped_axpy` it took 259, 261
//!   and 619 ms on one core: the tiles are 9, 8 and 17 times as fast.
//! - dilated (2x2) dense 8x32x32x64 -> 64 (302 M): 9-11 / 11-15 / 9-10 ms on one core, 4.7-5.7
//!   on both.
//! - depthwise with multiplier 2, 32x56x56x72 -> 144 (260 M), the pixel-at-a-time path:
//!   72-78 / 100-114 / 84-93 ms on one core, 37-40 / 51-56 / 41-45 on both.

use super::CpuKernel;
use super::par::{PAR_MIN, SendPtr, par_chunks, par_ranges};
use super::simd::multiversion;
use crate::geometry::Geom;
use kiln_compiler::ir::{DType, Shape, Window2d};
use std::slice;
use std::sync::Mutex;

/// Output channels per filter-gradient task (whole groups where a group is narrower), so that a
/// pixel's block is a cache line or more.
const FILTER_BLOCK: usize = 16;

/// The filter gradient's tasks where the shape allows: channel blocks times groups of rows.
const TASKS: usize = 8;

/// The most floats of dW that one filter-gradient task sums into (128 KiB): wider gradients are
/// cut into channel blocks.
const DW_FLOATS: usize = 1 << 15;

// ---------------------------------------------------------------- geometry

/// For each position along one axis of the side that is written, the taps that reach it and the
/// position they pair with on the side that is read, in tap order: `at(o)` lists (k, i).
#[derive(Debug)]
struct TapList {
    /// `pairs[start[o]..start[o + 1]]` are position o's.
    start: Vec<usize>,
    pairs: Vec<(usize, usize)>,
}

impl TapList {
    /// Forward: for output position o, the taps k whose input position i = o·s + k·d - p lies in
    /// 0..extent.
    fn forward(out: usize, s: usize, p: usize, d: usize, k: usize, extent: usize) -> TapList {
        TapList::build(out, k, |o, t| {
            let i = (o * s + t * d) as isize - p as isize;
            (0..extent as isize).contains(&i).then_some(i as usize)
        })
    }

    /// Gather form of the input gradient: for input position i, the taps k whose output
    /// position (i + p - k·d) / s is integral and in 0..out.
    fn gather(extent: usize, s: usize, p: usize, d: usize, k: usize, out: usize) -> TapList {
        TapList::build(extent, k, |i, t| {
            let q = (i + p) as isize - (t * d) as isize;
            (q >= 0 && (q as usize).is_multiple_of(s) && (q as usize) / s < out).then_some(q as usize / s)
        })
    }

    fn build(len: usize, k: usize, pair: impl Fn(usize, usize) -> Option<usize>) -> TapList {
        let mut start = Vec::with_capacity(len + 1);
        let mut pairs = Vec::new();
        for o in 0..len {
            start.push(pairs.len());
            pairs.extend((0..k).filter_map(|t| pair(o, t).map(|i| (t, i))));
        }
        start.push(pairs.len());
        TapList { start, pairs }
    }

    #[inline(always)]
    fn at(&self, o: usize) -> &[(usize, usize)] {
        &self.pairs[self.start[o]..self.start[o + 1]]
    }
}

/// Output columns o0, o0 + step, ... (count of them) that read the same taps: tap kw of the
/// p-th reads source column `taps[..].1 + p·src_step`.
#[derive(Debug)]
struct Run {
    o0: usize,
    count: usize,
    /// (kw, source column of the first pixel).
    taps: Vec<(usize, usize)>,
}

/// The columns of `cols` (extent of them) as runs of every `step`-th column with the same taps,
/// whose source columns advance by `src_step` a pixel: forward, step 1 and src_step the stride;
/// gather form, step the stride and src_step 1.
fn column_runs(cols: &TapList, extent: usize, step: usize, src_step: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for first in 0..step.min(extent) {
        let mut current: Option<Run> = None;
        for o in (first..extent).step_by(step) {
            let taps = cols.at(o);
            match &mut current {
                Some(r)
                    if r.taps.len() == taps.len()
                        && r.taps
                            .iter()
                            .zip(taps)
                            .all(|(a, b)| a.0 == b.0 && a.1 + r.count * src_step == b.1) =>
                {
                    r.count += 1
                }
                _ => runs.extend(current.replace(Run { o0: o, count: 1, taps: taps.to_vec() })),
            }
        }
        runs.extend(current);
    }
    runs
}

// ---------------------------------------------------------------- the inner loops

/// dst[i] += xs[((f0 + i) / fg)·cg + ci] · src[i] for every i: a filter row (or dy's channels)
/// scaled by the one value of xs that each output channel's group reads. Runs of fg outputs
/// share the value; widths 1 (depthwise), 2, 4, 8 and 16 are compiled for their width.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn grouped_axpy(dst: &mut [f32], src: &[f32], xs: &[f32], f0: usize, fg: usize, cg: usize, ci: usize) {
    let len = dst.len();
    let src = &src[..len];
    if fg == 1 {
        if cg == 1 {
            let xs = &xs[f0..f0 + len];
            for ((d, &s), &x) in dst.iter_mut().zip(src).zip(xs) {
                *d += x * s;
            }
        } else {
            for (i, (d, &s)) in dst.iter_mut().zip(src).enumerate() {
                *d += xs[(f0 + i) * cg + ci] * s;
            }
        }
        return;
    }
    if f0.is_multiple_of(fg) && len.is_multiple_of(fg) {
        let g0 = f0 / fg;
        match fg {
            2 => return runs::<2>(dst, src, xs, g0, cg, ci),
            4 => return runs::<4>(dst, src, xs, g0, cg, ci),
            8 => return runs::<8>(dst, src, xs, g0, cg, ci),
            16 => return runs::<16>(dst, src, xs, g0, cg, ci),
            _ => {}
        }
    }
    // Any width and alignment: runs cut at the group boundaries.
    let mut i = 0;
    while i < len {
        let f = f0 + i;
        let end = ((f / fg + 1) * fg - f0).min(len);
        let x = xs[(f / fg) * cg + ci];
        for (d, &s) in dst[i..end].iter_mut().zip(&src[i..end]) {
            *d += x * s;
        }
        i = end;
    }
}

/// `grouped_axpy` over whole groups of `FG` outputs starting at group g0.
#[inline(always)]
fn runs<const FG: usize>(dst: &mut [f32], src: &[f32], xs: &[f32], g0: usize, cg: usize, ci: usize) {
    for (k, (d, s)) in dst.chunks_exact_mut(FG).zip(src.chunks_exact(FG)).enumerate() {
        let x = xs[(g0 + k) * cg + ci];
        for j in 0..FG {
            d[j] += x * s[j];
        }
    }
}

// ---------------------------------------------------------------- forward and input gradient

/// How a sweep computes a pixel's channels (`Sweep::new` picks one from the groups' widths).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// One input channel per output channel: `depthwise_run`.
    Depthwise,
    /// Tiles of pixels by 16, 8 or 4 output channels of a group: `sweep_tile`.
    Tile16,
    Tile8,
    Tile4,
    /// A pixel at a time through `grouped_axpy`.
    Pixel,
}

/// The output, a pixel per (row, column), each the sum over its taps' source pixels of a
/// channel-grouped product with a filter laid out `[KH·KW, inner, dst_c]`:
/// dst[c] = Σ src[(c / per_dst)·per_src + i] · filter[tap, i, c] over taps and i < inner. The
/// forward convolution reads x by W (inner = per_src = Cg, per_dst = Fg); the input gradient
/// reads dy by the rearranged W' (inner = per_src = Fg, per_dst = Cg).
#[derive(Debug)]
struct Sweep {
    n: usize,
    /// The operand read: x or dy, `[n, src_h, src_w, src_c]`.
    src_h: usize,
    src_w: usize,
    src_c: usize,
    /// The output written: y or dx, `[n, dst_h, dst_w, dst_c]`.
    dst_h: usize,
    dst_w: usize,
    dst_c: usize,
    /// The filter's taps (KH·KW) and columns (KW): tap = kh·KW + kw.
    taps: usize,
    kw: usize,
    inner: usize,
    per_dst: usize,
    per_src: usize,
    /// Per output row: (kh, source row).
    rows: TapList,
    /// The output columns, in runs that read the same taps.
    runs: Vec<Run>,
    /// Columns between a run's neighbouring output pixels.
    dst_step: usize,
    /// Columns between the source pixels that neighbouring pixels of a run read for one tap.
    src_step: usize,
    path: Path,
    /// Whether the CPU has 32 vector registers (AVX-512, `simd::width`): the depthwise tiles
    /// are then 8 pixels tall, else 4 (16 AVX2 registers hold 4 pixels' sums by 16 channels).
    wide: bool,
    /// Multiply-adds of one output row, for the thread hand-off.
    row_cost: usize,
}

impl Sweep {
    /// `dst_step`/`src_step`: 1 and the stride forward, the stride and 1 in gather form.
    #[allow(clippy::too_many_arguments)]
    fn new(
        n: usize,
        src: [usize; 3],
        dst: [usize; 3],
        [kh, kw]: [usize; 2],
        [inner, per_dst, per_src]: [usize; 3],
        rows: TapList,
        cols: TapList,
        [dst_step, src_step]: [usize; 2],
    ) -> Sweep {
        let path = if inner == 1 && per_dst == 1 && per_src == 1 {
            Path::Depthwise
        } else if per_dst.is_multiple_of(16) {
            Path::Tile16
        } else if per_dst.is_multiple_of(8) {
            Path::Tile8
        } else if per_dst.is_multiple_of(4) {
            Path::Tile4
        } else {
            Path::Pixel
        };
        let runs = column_runs(&cols, dst[1], dst_step, src_step);
        let taps_per_pixel = (rows.pairs.len() * cols.pairs.len()).div_ceil(dst[0] * dst[1]).max(1);
        Sweep {
            n,
            src_h: src[0],
            src_w: src[1],
            src_c: src[2],
            dst_h: dst[0],
            dst_w: dst[1],
            dst_c: dst[2],
            taps: kh * kw,
            kw,
            inner,
            per_dst,
            per_src,
            rows,
            runs,
            dst_step,
            src_step,
            path,
            wide: super::simd::width() == super::simd::Width::Avx512,
            row_cost: dst[1] * dst[2] * inner * taps_per_pixel,
        }
    }

    fn filter_len(&self) -> usize {
        self.taps * self.inner * self.dst_c
    }
}

/// Depthwise with multiplier 1 (inner = per_dst = per_src = 1), the pixels of `run`: tiles of
/// 8 pixels (4 without AVX-512: `Sweep::wide`) by 16 channels, their sums in registers
/// (`depthwise_tile`), so that each tap's filter vector is loaded once for 8 (or 4)
/// multiply-adds; a run's last pixels in one shorter tile; then a block of 8 channels the same
/// way where 8 or more are left; the channels left after that (fewer than 8) a pixel at a time
/// (`depthwise_rest`). The taps' offsets are listed once per run and bounds-checked once. Each
/// channel's sum runs over the taps in order, one FMA each: the same bits whichever path
/// computes it.
///
/// The block of 8 channels and the shorter tiles: before, the last 8 channels of MobileNetV3's
/// 72, 88 and 120 went a pixel at a time, and a run's last 1-3 (AVX-512) pixels one at a time,
/// with a filter load for each multiply-add. `depthwise_timings`, same machine and method:
/// 3x3 stride 2 over 2x56x56x72 0.098 -> 0.051 ms, 3x3 over 2x28x28x88 0.113 -> 0.063 ms, 5x5
/// over 2x14x14x120 0.088 -> 0.050 ms, over 2x7x7x576 0.078 -> 0.062 ms, over 2x14x14x672
/// 0.222 -> 0.200 ms; MobileNetV3-small's forward pass at batch 2 (`kiln run --bench 20`, one
/// thread, four interleaved rounds) 0.91-0.99 of its time before, EfficientNet-B0's 0.97-0.99.
///
/// Why: a pixel at a time loaded a filter vector for every input vector (two loads a
/// multiply-add) and recomputed each tap's offsets with checks. One core of the 2-core AMD EPYC
/// (AVX-512), `depthwise_timings` in `tests/grouped_conv.rs`, before -> after: 3x3 over
/// 2x112x112x32 0.615 -> 0.185 ms, 3x3 over 2x56x56x144 0.465 -> 0.209 ms, 5x5 over
/// 2x28x28x240 0.469 -> 0.214 ms, 5x5 over 2x14x14x672 0.364 -> 0.212 ms, 3x3 stride 2 over
/// 2x112x112x96 0.390 -> 0.181 ms (2.0-3.3 times as fast); EfficientNet-B0's 17 standalone
/// convolutions at batch 2 (`kiln run --profile 10`) 4.34 -> 2.76 ms.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn depthwise_run(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    image: usize,
    rows: &[(usize, usize)],
    run: &Run,
    row: &mut [f32],
    taps: &mut Vec<(usize, usize)>,
) {
    const LANES: usize = 16;
    let c = s.dst_c;
    let xs = s.src_step * c;
    // Per tap in order: the offsets of its first pixel's source and of its filter row.
    taps.clear();
    for &(kh, ih) in rows {
        taps.extend(
            run.taps.iter().map(|&(kw, sc)| (((image + ih) * s.src_w + sc) * c, (kh * s.kw + kw) * c)),
        );
    }
    // Checked once per run, so that the tiles read without checks.
    let span = run.count.saturating_sub(1) * xs + c;
    assert!(taps.iter().all(|&(x, w)| x + span <= src.len() && w + c <= filter.len()));
    // Channel blocks of 16, then one of 8 (most widths that are not a multiple of 16 are one
    // of 8: MobileNetV3's 72, 88 and 120), then the rest a pixel at a time.
    let blocked = c - c % LANES;
    let half = if c - blocked >= LANES / 2 { blocked + LANES / 2 } else { blocked };
    let tall = if s.wide { 8 } else { 4 };
    let mut p0 = 0;
    while p0 < run.count {
        // Tiles of `tall` pixels, the run's last ones in one shorter tile.
        let p = tall.min(run.count - p0);
        for c0 in (0..blocked).step_by(LANES) {
            // SAFETY: p0 + p <= count and c0 + LANES <= c, with the assert above.
            unsafe { depthwise_tiles::<LANES>(p, s, src, filter, taps, xs, run, p0, c0, row) };
        }
        if half > blocked {
            // SAFETY: p0 + p <= count and blocked + LANES / 2 = half <= c, as above.
            unsafe { depthwise_tiles::<{ LANES / 2 }>(p, s, src, filter, taps, xs, run, p0, blocked, row) };
        }
        p0 += p;
    }
    if half < c {
        (0..run.count).for_each(|p| depthwise_rest(s, src, filter, image, rows, run, p, half, row));
    }
}

/// `depthwise_tile` for a tile of `p` pixels (1 to 8), each height compiled for itself.
///
/// # Safety
/// As `depthwise_tile` with P = p.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_tiles<const B: usize>(
    p: usize,
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    taps: &[(usize, usize)],
    xs: usize,
    run: &Run,
    p0: usize,
    c0: usize,
    row: &mut [f32],
) {
    // SAFETY: the caller's contract, for each height.
    unsafe {
        match p {
            8 => depthwise_tile::<8, B>(s, src, filter, taps, xs, run, p0, c0, row),
            7 => depthwise_tile::<7, B>(s, src, filter, taps, xs, run, p0, c0, row),
            6 => depthwise_tile::<6, B>(s, src, filter, taps, xs, run, p0, c0, row),
            5 => depthwise_tile::<5, B>(s, src, filter, taps, xs, run, p0, c0, row),
            4 => depthwise_tile::<4, B>(s, src, filter, taps, xs, run, p0, c0, row),
            3 => depthwise_tile::<3, B>(s, src, filter, taps, xs, run, p0, c0, row),
            2 => depthwise_tile::<2, B>(s, src, filter, taps, xs, run, p0, c0, row),
            _ => depthwise_tile::<1, B>(s, src, filter, taps, xs, run, p0, c0, row),
        }
    }
}

/// Pixels p0..p0 + P of a run by channels c0..c0 + B (depthwise, multiplier 1): acc[p][j] = Σ
/// over `taps` in order of src[tap's source + p·xs + c0 + j] · filter[tap's row + c0 + j], in
/// registers, then stored. The pixels' sums are named one by one (`mac` on each): as a loop over
/// P, the compiler vectorised across the pixels, with gathers, and the kernel ran 10 times
/// slower.
///
/// # Safety
/// For every tap (x, w): x + (p0 + P - 1)·xs + c0 + B <= src.len() and w + c0 + B <=
/// filter.len().
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn depthwise_tile<const P: usize, const B: usize>(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    taps: &[(usize, usize)],
    xs: usize,
    run: &Run,
    p0: usize,
    c0: usize,
    row: &mut [f32],
) {
    const { assert!(P >= 1 && P <= 8) };
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; B], [0f32; B], [0f32; B], [0f32; B]);
    let (mut a4, mut a5, mut a6, mut a7) = ([0f32; B], [0f32; B], [0f32; B], [0f32; B]);
    let (x, f) = (src.as_ptr(), filter.as_ptr());
    for &(xo, wo) in taps {
        let (xo, wo) = (xo + p0 * xs + c0, wo + c0);
        // SAFETY: the caller's contract bounds every load.
        unsafe {
            let load = |at: usize| x.add(at).cast::<[f32; B]>().read_unaligned();
            let w = f.add(wo).cast::<[f32; B]>().read_unaligned();
            mac(&mut a0, &load(xo), &w);
            if P > 1 {
                mac(&mut a1, &load(xo + xs), &w);
            }
            if P > 2 {
                mac(&mut a2, &load(xo + 2 * xs), &w);
            }
            if P > 3 {
                mac(&mut a3, &load(xo + 3 * xs), &w);
            }
            if P > 4 {
                mac(&mut a4, &load(xo + 4 * xs), &w);
            }
            if P > 5 {
                mac(&mut a5, &load(xo + 5 * xs), &w);
            }
            if P > 6 {
                mac(&mut a6, &load(xo + 6 * xs), &w);
            }
            if P > 7 {
                mac(&mut a7, &load(xo + 7 * xs), &w);
            }
        }
    }
    for (p, acc) in [a0, a1, a2, a3, a4, a5, a6, a7].iter().take(P).enumerate() {
        let o = (run.o0 + (p0 + p) * s.dst_step) * s.dst_c + c0;
        row[o..o + B].copy_from_slice(acc);
    }
}

/// acc[j] += x[j] · w[j], rounded once: one FMA where the build has it (x86-64-v3,
/// `.cargo/config.toml`), else the same bits from a library call, slower.
#[inline(always)]
fn mac<const B: usize>(acc: &mut [f32; B], x: &[f32; B], w: &[f32; B]) {
    for j in 0..B {
        acc[j] = x[j].mul_add(w[j], acc[j]);
    }
}

/// Depthwise with multiplier 1, pixel p of `run`, channels c0.. (the last, fewer than a block):
/// out[c] = Σ over the taps in order of src_pixel[c] · filter[tap, c], summed in the output.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn depthwise_rest(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    image: usize,
    rows: &[(usize, usize)],
    run: &Run,
    p: usize,
    c0: usize,
    row: &mut [f32],
) {
    let c = s.dst_c;
    let at = (run.o0 + p * s.dst_step) * c;
    let out = &mut row[at + c0..at + c];
    let shift = p * s.src_step;
    out.fill(0.0);
    for &(kh, ih) in rows {
        for &(kw, sc) in &run.taps {
            let (p, t) = (((image + ih) * s.src_w + sc + shift) * c + c0, (kh * s.kw + kw) * c + c0);
            for ((o, &x), &w) in out.iter_mut().zip(&src[p..p + c - c0]).zip(&filter[t..t + c - c0]) {
                *o = x.mul_add(w, *o);
            }
        }
    }
}

/// Pixels p0..p0 + P of `run` by output channels c0..c0 + FB (of group c0 / per_dst; FB divides
/// per_dst): acc[p][j] = Σ over the taps, then i < inner, of src[pixel p, (c0 / per_dst)·per_src
/// + i] · filter[tap, i, c0 + j], in registers, then stored.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn sweep_tile<const P: usize, const FB: usize>(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    image: usize,
    rows: &[(usize, usize)],
    run: &Run,
    p0: usize,
    c0: usize,
    row: &mut [f32],
) {
    let xs = s.src_step * s.src_c;
    let channel = (c0 / s.per_dst) * s.per_src;
    let mut acc = [[0f32; FB]; P];
    for &(kh, ih) in rows {
        for &(kw, sc) in &run.taps {
            let xo = ((image + ih) * s.src_w + sc + p0 * s.src_step) * s.src_c + channel;
            let wo = (kh * s.kw + kw) * s.inner * s.dst_c + c0;
            // Checked once per tap, so that the loops below read without checks.
            assert!(
                xo + (P - 1) * xs + s.inner <= src.len() && wo + (s.inner - 1) * s.dst_c + FB <= filter.len()
            );
            for i in 0..s.inner {
                // SAFETY: wo + i·dst_c + FB <= filter.len(), asserted above (i < inner).
                let w = unsafe { filter.as_ptr().add(wo + i * s.dst_c).cast::<[f32; FB]>().read_unaligned() };
                for (p, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: xo + p·xs + i < src.len(), asserted above (p < P, i < inner).
                    let x = unsafe { *src.get_unchecked(xo + p * xs + i) };
                    for j in 0..FB {
                        acc[j] += x * w[j];
                    }
                }
            }
        }
    }
    for (p, acc) in acc.iter().enumerate() {
        let o = (run.o0 + (p0 + p) * s.dst_step) * s.dst_c + c0;
        row[o..o + FB].copy_from_slice(acc);
    }
}

/// A run's pixels, P at a time (then one at a time) by FB channels at a time.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn sweep_tiles<const P: usize, const FB: usize>(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    image: usize,
    rows: &[(usize, usize)],
    run: &Run,
    row: &mut [f32],
) {
    let mut p0 = 0;
    while p0 + P <= run.count {
        for c0 in (0..s.dst_c).step_by(FB) {
            sweep_tile::<P, FB>(s, src, filter, image, rows, run, p0, c0, row);
        }
        p0 += P;
    }
    for p0 in p0..run.count {
        for c0 in (0..s.dst_c).step_by(FB) {
            sweep_tile::<1, FB>(s, src, filter, image, rows, run, p0, c0, row);
        }
    }
}

/// Pixel p of `run`, any grouping: for each tap and i < inner, the filter row scaled by the
/// source value of each output channel's group.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn sweep_pixel(
    s: &Sweep,
    src: &[f32],
    filter: &[f32],
    image: usize,
    rows: &[(usize, usize)],
    run: &Run,
    p: usize,
    row: &mut [f32],
) {
    let at = (run.o0 + p * s.dst_step) * s.dst_c;
    let out = &mut row[at..at + s.dst_c];
    out.fill(0.0);
    for &(kh, ih) in rows {
        for &(kw, sc) in &run.taps {
            let at = ((image + ih) * s.src_w + sc + p * s.src_step) * s.src_c;
            let px = &src[at..at + s.src_c];
            let tap = (kh * s.kw + kw) * s.inner;
            for i in 0..s.inner {
                let w = &filter[(tap + i) * s.dst_c..(tap + i + 1) * s.dst_c];
                grouped_axpy(out, w, px, 0, s.per_dst, s.per_src, i);
            }
        }
    }
}

/// Output rows r0..r1 (of the n·dst_h rows) into `dst`, row r0 first.
///
/// # Safety
/// `src` and `filter` hold the sweep's source (n·src_h·src_w·src_c floats) and filter
/// (`filter_len`); `dst` is valid for (r1 - r0)·dst_w·dst_c floats that no other thread touches
/// and overlaps neither.
#[inline(always)]
unsafe fn sweep_rows(s: &Sweep, src: *const f32, filter: *const f32, r0: usize, r1: usize, dst: *mut f32) {
    let len = s.dst_w * s.dst_c;
    // SAFETY: the caller's contract.
    let (src, filter, dst) = unsafe {
        (
            slice::from_raw_parts(src, s.n * s.src_h * s.src_w * s.src_c),
            slice::from_raw_parts(filter, s.filter_len()),
            slice::from_raw_parts_mut(dst, (r1 - r0) * len),
        )
    };
    let mut taps = Vec::new();
    for (r, row) in (r0..r1).zip(dst.chunks_exact_mut(len)) {
        let (n, oh) = (r / s.dst_h, r % s.dst_h);
        let image = n * s.src_h;
        let rows = s.rows.at(oh);
        for run in &s.runs {
            // Tiles of at most 64 sums: the compiler keeps them in registers (with 12 pixels by
            // 8 channels it kept them in memory, and the ResNeXt-like forward took 7 times as
            // long).
            match s.path {
                Path::Depthwise => depthwise_run(s, src, filter, image, rows, run, row, &mut taps),
                Path::Tile16 => sweep_tiles::<4, 16>(s, src, filter, image, rows, run, row),
                Path::Tile8 => sweep_tiles::<8, 8>(s, src, filter, image, rows, run, row),
                Path::Tile4 => sweep_tiles::<8, 4>(s, src, filter, image, rows, run, row),
                Path::Pixel => {
                    (0..run.count).for_each(|p| sweep_pixel(s, src, filter, image, rows, run, p, row))
                }
            }
        }
    }
}

multiversion! {
    /// `sweep_rows` on the widest vectors the CPU has (`simd`).
    unsafe fn sweep_dispatch / sweep_at(
        s: &Sweep, src: *const f32, filter: *const f32, r0: usize, r1: usize, dst: *mut f32
    ) => sweep_rows;
}

impl Sweep {
    /// The whole output, a row per unit of `par_ranges`.
    ///
    /// # Safety
    /// As `sweep_rows` for all rows: `dst` holds n·dst_h·dst_w·dst_c floats and overlaps neither
    /// `src` nor `filter`.
    unsafe fn run(&self, src: *const f32, filter: *const f32, dst: *mut f32) {
        let (src, filter, dst) =
            (SendPtr::new(src as *mut f32), SendPtr::new(filter as *mut f32), SendPtr::new(dst));
        let row = self.dst_w * self.dst_c;
        par_ranges(self.n * self.dst_h, self.row_cost, |a, b| {
            // SAFETY: rows a..b of dst are this task's; src and filter are read only.
            unsafe { sweep_dispatch(self, src.get(), filter.get(), a, b, dst.get().add(a * row)) }
        });
    }

    /// `run`, and after each block of rows, on the same thread while the block is in its cache,
    /// `then(at, len)` with the block's element range of `dst`. Blocks hold about
    /// `EPILOGUE_BLOCK` elements (a row at least).
    ///
    /// # Safety
    /// As `run`; `then` touches only its range of `dst` (and what it reads elsewhere).
    unsafe fn run_then(
        &self,
        src: *const f32,
        filter: *const f32,
        dst: *mut f32,
        then: &(dyn Fn(usize, usize) + Sync),
    ) {
        let (src, filter, dst) =
            (SendPtr::new(src as *mut f32), SendPtr::new(filter as *mut f32), SendPtr::new(dst));
        let row = self.dst_w * self.dst_c;
        let rows = (EPILOGUE_BLOCK / row.max(1)).max(1);
        par_ranges(self.n * self.dst_h, self.row_cost, |a, b| {
            for r0 in (a..b).step_by(rows) {
                let r1 = (r0 + rows).min(b);
                // SAFETY: rows r0..r1 of dst are this task's; src and filter are read only.
                unsafe { sweep_dispatch(self, src.get(), filter.get(), r0, r1, dst.get().add(r0 * row)) };
                then(r0 * row, (r1 - r0) * row);
            }
        });
    }
}

/// Output elements per block of a convolution with an epilogue (`Sweep::run_then`): 256 KiB of
/// floats, in L2 when the epilogue reads them back.
const EPILOGUE_BLOCK: usize = 1 << 16;

/// The forward convolution of a non-dense window.
pub(crate) struct Conv2d {
    sweep: Sweep,
    desc: String,
}

impl Conv2d {
    /// The convolution of `x` by `w` into `out`, then `then(at, len)` on each block of the
    /// output as it is made (`Sweep::run_then`; `fused::FusedConvKernel`'s epilogue).
    ///
    /// # Safety
    /// `x`, `w` and `out` hold this convolution's input, filter and output; `out` overlaps
    /// neither factor; `then` touches only its range of the output (and what it reads elsewhere).
    pub(crate) unsafe fn run_then(
        &self,
        x: *const f32,
        w: *const f32,
        out: *mut f32,
        then: &(dyn Fn(usize, usize) + Sync),
    ) {
        // SAFETY: forwarded contract.
        unsafe { self.sweep.run_then(x, w, out, then) }
    }

    pub(crate) fn text(&self) -> &str {
        &self.desc
    }
}

/// The convolution of `x` `[N, H, W, C]` by `w` `[KH, KW, C/G, F]` over a non-dense `window`
/// (shapes checked by `ir::infer`).
pub(crate) fn conv2d(x: &Shape, w: &Shape, window: &Window2d) -> Box<dyn CpuKernel> {
    Box::new(conv2d_kernel(x, w, window))
}

/// `conv2d`'s kernel, unboxed.
pub(crate) fn conv2d_kernel(x: &Shape, w: &Shape, window: &Window2d) -> Conv2d {
    let g = Geom::new(x, window, w.dims()[3]);
    let (cg, fg) = (g.c / g.groups, g.f / g.groups);
    let sweep = Sweep::new(
        g.n,
        [g.h, g.w, g.c],
        [g.oh, g.ow, g.f],
        [g.kh, g.kw],
        [cg, fg, cg],
        TapList::forward(g.oh, g.sh, g.ph, g.dh, g.kh, g.h),
        TapList::forward(g.ow, g.sw, g.pw, g.dw, g.kw, g.w),
        [1, g.sw],
    );
    Conv2d { sweep, desc: format!("conv2d {}", g.text()) }
}

impl CpuKernel for Conv2d {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: run's contract: x, W and y hold the sweep's source, filter and output, and a
        // convolution's output never overlaps its operands.
        unsafe { self.sweep.run(inputs[0] as *const f32, inputs[1] as *const f32, output as *mut f32) }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// The input gradient of a non-dense window, in gather form (`Sweep` over dy by W').
struct BackpropInput {
    sweep: Sweep,
    /// Cg and Fg, for rearranging the filter.
    cg: usize,
    fg: usize,
    /// W'[tap, j, c] = W[tap, c % Cg, (c / Cg)·Fg + j], rewritten every run; unused (W is
    /// already W') for depthwise with multiplier 1.
    filter: Mutex<Vec<f32>>,
    desc: String,
}

/// The input gradient dx `[N, H, W, C]` of a non-dense convolution from dy `[N, OH, OW, F]` and
/// the filter `[KH, KW, C/G, F]` (shapes checked by `ir::infer`).
pub(crate) fn backprop_input(dy: &Shape, w: &Shape, window: &Window2d, dx: &Shape) -> Box<dyn CpuKernel> {
    Box::new(backprop_input_kernel(dy, w, window, dx))
}

fn backprop_input_kernel(dy: &Shape, w: &Shape, window: &Window2d, dx: &Shape) -> BackpropInput {
    let g = Geom::new(dx, window, w.dims()[3]);
    debug_assert_eq!(dy.dims(), [g.n, g.oh, g.ow, g.f]);
    let (cg, fg) = (g.c / g.groups, g.f / g.groups);
    let sweep = Sweep::new(
        g.n,
        [g.oh, g.ow, g.f],
        [g.h, g.w, g.c],
        [g.kh, g.kw],
        [fg, cg, fg],
        TapList::gather(g.h, g.sh, g.ph, g.dh, g.kh, g.oh),
        TapList::gather(g.w, g.sw, g.pw, g.dw, g.kw, g.ow),
        [g.sw, 1],
    );
    let desc = format!("conv2d_backprop_input {}", g.text());
    BackpropInput { sweep, cg, fg, filter: Mutex::new(Vec::new()), desc }
}

impl BackpropInput {
    /// W' in the kernel's buffer.
    ///
    /// # Safety
    /// `w` holds the filter, KH·KW·Cg·F floats.
    unsafe fn rearranged(&self, w: *const f32) -> std::sync::MutexGuard<'_, Vec<f32>> {
        let (cg, fg, c, f) = (self.cg, self.fg, self.sweep.dst_c, self.sweep.src_c);
        let len = self.sweep.filter_len();
        let mut filter = self.filter.lock().unwrap_or_else(|e| e.into_inner());
        filter.resize(len, 0.0);
        // SAFETY: KH·KW·Fg·C = KH·KW·Cg·F floats (the caller's contract).
        let w = unsafe { slice::from_raw_parts(w, len) };
        for (dst, src) in filter.chunks_exact_mut(fg * c).zip(w.chunks_exact(cg * f)) {
            for (j, row) in dst.chunks_exact_mut(c).enumerate() {
                for (ch, v) in row.iter_mut().enumerate() {
                    *v = src[(ch % cg) * f + (ch / cg) * fg + j];
                }
            }
        }
        filter
    }

    /// Whether W is W' already (Cg = Fg = 1).
    fn turned(&self) -> bool {
        self.cg == 1 && self.fg == 1
    }
}

impl CpuKernel for BackpropInput {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (dy, w, dx) = (inputs[0] as *const f32, inputs[1] as *const f32, output as *mut f32);
        if self.turned() {
            // SAFETY: run's contract: dy, W and dx of this geometry, dx overlapping neither;
            // W is W' when Cg = Fg = 1.
            return unsafe { self.sweep.run(dy, w, dx) };
        }
        // SAFETY: run's contract: inputs[1] holds the filter.
        let filter = unsafe { self.rearranged(w) };
        // SAFETY: run's contract for dy and dx (dx overlapping neither); the buffer is this
        // kernel's, of `filter_len` floats.
        unsafe { self.sweep.run(dy, filter.as_ptr(), dx) }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// ReLU's gradient of a non-dense convolution's input gradient (`Op::Conv2dBackpropInputReluGrad`,
/// which `conv_relu_grad` makes for dense windows only): y > 0 ? dx : 0, or with a residual
/// gradient r, y > 0 ? r + dx : 0, the bits of the ops apart. A row of dx at a time in the
/// worker's tile, then stored through the same rows of y (and r): a row reads its y and r before
/// it writes them, so the output may be y's or r's buffer, as `Op::may_write_over` allows with
/// stride 1.
struct BackpropInputReluGrad {
    input: BackpropInput,
    residual: bool,
    desc: String,
}

/// The kernel of `Op::Conv2dBackpropInputReluGrad` over a non-dense window; `residual`: whether
/// a fourth operand r is added before the mask.
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
        let s = &self.input.sweep;
        let (dy, w) = (inputs[0] as *const f32, inputs[1] as *const f32);
        let rearranged;
        let filter = if self.input.turned() {
            w
        } else {
            // SAFETY: run's contract: inputs[1] holds the filter.
            rearranged = unsafe { self.input.rearranged(w) };
            rearranged.as_ptr()
        };
        let (dy, filter) = (SendPtr::new(dy as *mut f32), SendPtr::new(filter as *mut f32));
        let y = SendPtr::new(inputs[2] as *mut f32);
        let r = self.residual.then(|| SendPtr::new(inputs[3] as *mut f32));
        let o = SendPtr::new(output as *mut f32);
        let row = s.dst_w * s.dst_c;
        thread_local! {
            /// Each worker's row of dx, kept between calls.
            static TILE: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        par_ranges(s.n * s.dst_h, s.row_cost, |a, b| {
            TILE.with_borrow_mut(|tile| {
                tile.resize(tile.len().max(row), 0.0);
                for t in a..b {
                    // SAFETY: the tile holds a row and is this thread's; dy and the filter are
                    // read only (the output overlaps neither: run's contract).
                    unsafe { sweep_dispatch(s, dy.get(), filter.get(), t, t + 1, tile.as_mut_ptr()) };
                    let at = t * row;
                    for (i, &d) in tile[..row].iter().enumerate() {
                        // SAFETY: row t of y, r and the output is this task's; each element is
                        // read from y (and r) before the output's same element is written,
                        // through raw pointers, so the output may be y's or r's buffer.
                        unsafe {
                            let m = *y.get().add(at + i);
                            let v = match r {
                                Some(r) => *r.get().add(at + i) + d,
                                None => d,
                            };
                            *o.get().add(at + i) = if m > 0.0 { v } else { 0.0 };
                        }
                    }
                }
            })
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- filter gradient

/// How the filter gradient sums a row's products (`backprop_filter` picks one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FilterPath {
    /// Cg = Fg = 1: `depthwise_rows`.
    Depthwise,
    /// R in-group channels by FB output channels of a group (R divides Cg, FB divides Fg):
    /// `filter_tile`.
    Tile { r: usize, fb: usize },
    /// A position at a time through `grouped_axpy`.
    Position,
}

/// The filter gradient of a non-dense window: a task per group of output rows and block of
/// output channels.
struct BackpropFilter {
    g: Geom,
    cg: usize,
    fg: usize,
    /// The forward taps per output row and column: (kh, ih) and (kw, iw).
    rows: TapList,
    cols: TapList,
    /// Per filter column kw: the output columns whose tap kw reads inside the input.
    spans: Vec<(usize, usize)>,
    /// Output channels per task.
    block: usize,
    /// Groups of output rows, each summed by its own tasks into a partial gradient of its own
    /// (1: straight into dW).
    row_groups: usize,
    /// The partial gradients (row_groups of them) where there are several.
    partials: Mutex<Vec<f32>>,
    path: FilterPath,
    /// With f16 or bf16 values: the types of x, dy and dW, and this kernel on one image, which
    /// each task runs on its rows image by image over widened copies (`run_widened`).
    half: Option<([DType; 3], Box<BackpropFilter>)>,
    desc: String,
}

/// The filter gradient dW `[KH, KW, C/G, F]` of a non-dense convolution from x and dy (shapes
/// checked by `ir::infer`), of the given types (x, dy, dW: f32, f16 or bf16).
///
/// Half values: each task sums the rows it sums in f32 (the same rows, channels and order), an
/// image at a time, from the image's x and dy widened into buffers of its thread; a half dW is
/// summed in the kernel's f32 buffer and rounded once. So the bits are those of the op widened.
pub(crate) fn backprop_filter(
    x: &Shape,
    dy: &Shape,
    window: &Window2d,
    types: [DType; 3],
) -> Box<dyn CpuKernel> {
    let mut kernel = filter_kernel(x, dy, window);
    if types.iter().any(|d| d.is_half()) {
        let image = |s: &Shape| {
            let mut dims = s.dims().to_vec();
            dims[0] = 1;
            Shape::from(dims.as_slice())
        };
        kernel.half = Some((types, Box::new(filter_kernel(&image(x), &image(dy), window))));
    }
    Box::new(kernel)
}

fn filter_kernel(x: &Shape, dy: &Shape, window: &Window2d) -> BackpropFilter {
    let g = Geom::new(x, window, dy.dims()[3]);
    let (cg, fg) = (g.c / g.groups, g.f / g.groups);
    let path = if cg == 1 && fg == 1 {
        FilterPath::Depthwise
    } else if fg.is_multiple_of(4) {
        let fb = [16, 8, 4].into_iter().find(|b| fg.is_multiple_of(*b)).expect("fg % 4 == 0");
        // R·FB <= 64 sums, which the compiler keeps in registers (see `sweep_rows`).
        let r = [8, 4, 2, 1].into_iter().find(|r| cg.is_multiple_of(*r) && r * fb <= 64).expect("1 divides");
        FilterPath::Tile { r, fb }
    } else {
        FilterPath::Position
    };
    // All channels where their gradient fits in the L2 cache (`DW_FLOATS`); else blocks of
    // whole groups where a group is narrower than a block, a tile's width where it is wider.
    let block = match path {
        _ if g.kh * g.kw * cg * g.f <= DW_FLOATS => g.f,
        FilterPath::Tile { fb, .. } if fg >= FILTER_BLOCK => fb,
        _ if fg < FILTER_BLOCK => FILTER_BLOCK.div_ceil(fg) * fg,
        _ => FILTER_BLOCK,
    };
    let blocks = g.f.div_ceil(block);
    let work = g.n * g.oh * g.ow * g.kh * g.kw * cg * g.f;
    let row_groups = if work < PAR_MIN { 1 } else { TASKS.div_ceil(blocks).clamp(1, TASKS).min(g.n * g.oh) };
    let cols = TapList::forward(g.ow, g.sw, g.pw, g.dw, g.kw, g.w);
    let spans = (0..g.kw)
        .map(|kw| {
            let valid: Vec<usize> = (0..g.ow).filter(|&ow| cols.at(ow).iter().any(|t| t.0 == kw)).collect();
            let span = valid.first().map_or((0, 0), |&a| (a, a + valid.len()));
            // `filter_tile` reads every column of the span: it must have no gap.
            assert!(valid.iter().enumerate().all(|(i, &ow)| ow == span.0 + i), "a contiguous span");
            span
        })
        .collect();
    let desc = format!("conv2d_backprop_filter {}", g.text());
    BackpropFilter {
        rows: TapList::forward(g.oh, g.sh, g.ph, g.dh, g.kh, g.h),
        cols,
        spans,
        block: block.min(g.f),
        row_groups,
        partials: Mutex::new(Vec::new()),
        path,
        half: None,
        g,
        cg,
        fg,
        desc,
    }
}

/// Channels f0..f1 of every row of dW (KH·KW·Cg rows of F): the part of dW that one task owns
/// while other tasks write the other channels, handed out a row segment at a time.
struct Part {
    dw: *mut f32,
    rows: usize,
    f: usize,
    f0: usize,
    f1: usize,
}

impl Part {
    /// # Safety
    /// `dw` holds rows·f floats, and no other thread touches channels f0..f1 of any row while
    /// the part lives.
    unsafe fn new(dw: *mut f32, rows: usize, f: usize, f0: usize, f1: usize) -> Part {
        Part { dw, rows, f, f0, f1 }
    }

    /// Channels a..a + len of row q, inside the part (checked).
    #[inline(always)]
    fn segment(&mut self, q: usize, a: usize, len: usize) -> &mut [f32] {
        assert!(q < self.rows && a >= self.f0 && a + len <= self.f1);
        // SAFETY: inside the part (asserted above), which is this task's (`Part::new`); the
        // borrow of self keeps one segment alive at a time.
        unsafe { slice::from_raw_parts_mut(self.dw.add(q * self.f + a), len) }
    }
}

/// Output row (n, oh), tap (kh, kw) reading input row ih over the output columns ow0..ow1,
/// in-group channels ci0..ci0 + R by output channels f0..f0 + FB of one group: the row's sums
/// acc[r][j] = Σ over the columns of x[(f0 / Fg)·Cg + ci0 + r] · dy[f0 + j], in registers, then
/// added to dW[kh, kw, ci0 + r, f0 + j].
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn filter_tile<const R: usize, const FB: usize>(
    k: &BackpropFilter,
    x: &[f32],
    dy: &[f32],
    [n, oh, ih]: [usize; 3],
    [kh, kw]: [usize; 2],
    [ow0, ow1]: [usize; 2],
    [ci0, f0]: [usize; 2],
    part: &mut Part,
) {
    let g = &k.g;
    let iw0 = ow0 * g.sw + kw * g.dw - g.pw;
    let xo = ((n * g.h + ih) * g.w + iw0) * g.c + (f0 / k.fg) * k.cg + ci0;
    let yo = ((n * g.oh + oh) * g.ow + ow0) * g.f + f0;
    let (xs, ys) = (g.sw * g.c, g.f);
    let count = ow1 - ow0;
    // Checked once, so that the loop below reads without checks (offsets grow with the column).
    assert!(count > 0 && xo + (count - 1) * xs + R <= x.len() && yo + (count - 1) * ys + FB <= dy.len());
    let mut acc = [[0f32; FB]; R];
    for q in 0..count {
        // SAFETY: q < count: inside dy (asserted above).
        let dv = unsafe { dy.as_ptr().add(yo + q * ys).cast::<[f32; FB]>().read_unaligned() };
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: q < count and r < R: inside x (asserted above).
            let xv = unsafe { *x.get_unchecked(xo + q * xs + r) };
            for j in 0..FB {
                acc[j] += xv * dv[j];
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        let dst = part.segment((kh * g.kw + kw) * k.cg + ci0 + r, f0, FB);
        for (d, &a) in dst.iter_mut().zip(acc) {
            *d += a;
        }
    }
}

/// A task's channels by tiles: for each output row in order, each of its in-input taps and
/// each tile of channels (`filter_tile`).
#[inline(always)]
fn filter_tiles<const R: usize, const FB: usize>(
    k: &BackpropFilter,
    x: &[f32],
    dy: &[f32],
    [r0, r1]: [usize; 2],
    part: &mut Part,
) {
    let g = &k.g;
    let (f0, f1) = (part.f0, part.f1);
    for r in r0..r1 {
        let (n, oh) = (r / g.oh, r % g.oh);
        for &(kh, ih) in k.rows.at(oh) {
            for (kw, &(a, b)) in k.spans.iter().enumerate() {
                if a == b {
                    continue;
                }
                for fs in (f0..f1).step_by(FB) {
                    for ci0 in (0..k.cg).step_by(R) {
                        filter_tile::<R, FB>(k, x, dy, [n, oh, ih], [kh, kw], [a, b], [ci0, fs], part);
                    }
                }
            }
        }
    }
}

/// Depthwise (Cg = Fg = 1), a task's channels f0..f1 by rows: for each output row in order,
/// its sums per tap in `sums` (KH·KW·(f1 - f0) floats, in the L1 cache), for each output column
/// in order sums[tap][c] += x[pixel of the tap][c] · dy[column][c] across the channels, then
/// added to dW[kh, kw, 0, f0..f1]. The pixels are read whole and in order: a block of channels
/// at a time read them strided (a cache line of every pixel), from memory once per block, and
/// took 25 ms rather than 20-23 for the 32x56x56x144 gradient on one core.
#[inline(always)]
fn depthwise_rows(
    k: &BackpropFilter,
    x: &[f32],
    dy: &[f32],
    [r0, r1]: [usize; 2],
    sums: &mut [f32],
    part: &mut Part,
) {
    let g = &k.g;
    let (f0, f1) = (part.f0, part.f1);
    let len = f1 - f0;
    let sums = &mut sums[..g.kh * g.kw * len];
    for r in r0..r1 {
        let (n, oh) = (r / g.oh, r % g.oh);
        let rows = k.rows.at(oh);
        sums.fill(0.0);
        for ow in 0..g.ow {
            let yo = ((n * g.oh + oh) * g.ow + ow) * g.f;
            let dv = &dy[yo + f0..yo + f1];
            let cols = k.cols.at(ow);
            for &(kh, ih) in rows {
                for &(kw, iw) in cols {
                    let xo = ((n * g.h + ih) * g.w + iw) * g.c;
                    let tap = kh * g.kw + kw;
                    let sum = &mut sums[tap * len..(tap + 1) * len];
                    for ((s, &a), &b) in sum.iter_mut().zip(&x[xo + f0..xo + f1]).zip(dv) {
                        *s += a * b;
                    }
                }
            }
        }
        for &(kh, _) in rows {
            for kw in 0..g.kw {
                let tap = kh * g.kw + kw;
                for (d, &s) in part.segment(tap, f0, len).iter_mut().zip(&sums[tap * len..(tap + 1) * len]) {
                    *d += s;
                }
            }
        }
    }
}

/// A task's channels a position at a time (any grouping): for each output position in (n, oh,
/// ow) order and each in-input tap, dW[kh, kw, ci, f0..f1] += x[(f / Fg)·Cg + ci] · dy[f0..f1].
#[inline(always)]
fn filter_positions(k: &BackpropFilter, x: &[f32], dy: &[f32], [r0, r1]: [usize; 2], part: &mut Part) {
    let g = &k.g;
    let (f0, f1) = (part.f0, part.f1);
    for r in r0..r1 {
        let (n, oh) = (r / g.oh, r % g.oh);
        {
            let rows = k.rows.at(oh);
            for ow in 0..g.ow {
                let pos = ((n * g.oh + oh) * g.ow + ow) * g.f;
                let d = &dy[pos + f0..pos + f1];
                for &(kh, ih) in rows {
                    for &(kw, iw) in k.cols.at(ow) {
                        let p = ((n * g.h + ih) * g.w + iw) * g.c;
                        let px = &x[p..p + g.c];
                        let tap = (kh * g.kw + kw) * k.cg;
                        for ci in 0..k.cg {
                            grouped_axpy(part.segment(tap + ci, f0, f1 - f0), d, px, f0, k.fg, k.cg, ci);
                        }
                    }
                }
            }
        }
    }
}

/// Channels f0..f1 of a gradient over the output rows r0..r1 (of the n·OH rows) into `dw` (dW
/// itself or a partial of its shape): zeroed (with `zero`), then the sums of the kernel's path
/// added.
///
/// # Safety
/// `x` and `dy` hold the tensors of `k.g`; `dw` holds KH·KW·Cg·F floats, whose channels f0..f1
/// no other thread touches; `sums` (read only by the depthwise path) holds KH·KW·(f1 - f0)
/// floats that no other thread touches and overlaps nothing else.
#[inline(always)]
unsafe fn filter_block(
    k: &BackpropFilter,
    x: *const f32,
    dy: *const f32,
    dw: *mut f32,
    sums: *mut f32,
    f: [usize; 2],
    (rows, zero): ([usize; 2], bool),
) {
    let g = &k.g;
    let [f0, f1] = f;
    let dw_rows = g.kh * g.kw * k.cg;
    // SAFETY: the caller's contract.
    let (x, dy, mut part) = unsafe {
        (
            slice::from_raw_parts(x, g.n * g.h * g.w * g.c),
            slice::from_raw_parts(dy, g.n * g.oh * g.ow * g.f),
            Part::new(dw, dw_rows, g.f, f0, f1),
        )
    };
    if zero {
        for q in 0..dw_rows {
            part.segment(q, f0, f1 - f0).fill(0.0);
        }
    }
    let part = &mut part;
    match k.path {
        FilterPath::Depthwise => {
            // SAFETY: the caller's contract.
            let sums = unsafe { slice::from_raw_parts_mut(sums, g.kh * g.kw * (f1 - f0)) };
            depthwise_rows(k, x, dy, rows, sums, part)
        }
        FilterPath::Tile { r, fb } => match (r, fb) {
            (8, 8) => filter_tiles::<8, 8>(k, x, dy, rows, part),
            (8, 4) => filter_tiles::<8, 4>(k, x, dy, rows, part),
            (4, 16) => filter_tiles::<4, 16>(k, x, dy, rows, part),
            (4, 8) => filter_tiles::<4, 8>(k, x, dy, rows, part),
            (4, 4) => filter_tiles::<4, 4>(k, x, dy, rows, part),
            (2, 16) => filter_tiles::<2, 16>(k, x, dy, rows, part),
            (2, 8) => filter_tiles::<2, 8>(k, x, dy, rows, part),
            (2, 4) => filter_tiles::<2, 4>(k, x, dy, rows, part),
            (_, 16) => filter_tiles::<1, 16>(k, x, dy, rows, part),
            (_, 8) => filter_tiles::<1, 8>(k, x, dy, rows, part),
            _ => filter_tiles::<1, 4>(k, x, dy, rows, part),
        },
        FilterPath::Position => filter_positions(k, x, dy, rows, part),
    }
}

multiversion! {
    /// `filter_block` on the widest vectors the CPU has (`simd`).
    unsafe fn filter_dispatch / filter_at(
        k: &BackpropFilter, x: *const f32, dy: *const f32, dw: *mut f32, sums: *mut f32,
        f: [usize; 2], rows: ([usize; 2], bool)
    ) => filter_block;
}

impl BackpropFilter {
    /// One task's rows r (of the n·OH output rows) and channels f with half x or dy: for each
    /// image the rows cross, in order, the image of x and dy widened into the thread's buffers
    /// and `one` (this kernel on one image) summing the image's rows into `target`, zeroed
    /// before the first (the f32 task's sums, row by row in the same order).
    ///
    /// # Safety
    /// As `filter_block` for this kernel's tensors: `inputs` are x and dy, of `types`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_widened(
        &self,
        one: &BackpropFilter,
        inputs: [*mut u8; 2],
        [tx, tdy, _]: [DType; 3],
        target: *mut f32,
        sums: &mut [f32],
        f: [usize; 2],
        [r0, r1]: [usize; 2],
    ) {
        let g = &self.g;
        let (xi, yi) = (g.h * g.w * g.c, g.oh * g.ow * g.f);
        super::buffers::with(|bufs| {
            let (xb, yb) = (&mut bufs.images, &mut bufs.gradients);
            // Rows a..b of one image (rows of `one`), summed into the target, zeroed first with
            // `zero`.
            let mut sum = |xb: &[f32], yb: &[f32], rows: [usize; 2], zero: bool| {
                // SAFETY: the buffers are one image of x and dy, `one`'s geometry; the target and
                // sums are the task's (the contract).
                unsafe {
                    filter_dispatch(one, xb.as_ptr(), yb.as_ptr(), target, sums.as_mut_ptr(), f, (rows, zero))
                }
            };
            if r0 == r1 {
                // No rows: the task's channels are zero, as the f32 task leaves them.
                return sum(xb, yb, [0, 0], true);
            }
            let mut r = r0;
            while r < r1 {
                let n = r / g.oh;
                let end = r1.min((n + 1) * g.oh);
                for (buf, p, t, len) in [(&mut *xb, inputs[0], tx, xi), (&mut *yb, inputs[1], tdy, yi)] {
                    buf.resize(len, 0.0);
                    // SAFETY: image n of the tensor, len elements of its type.
                    unsafe { super::cast::widen_into(p, t, n * len, buf) };
                }
                sum(xb, yb, [r - n * g.oh, end - n * g.oh], r == r0);
                r = end;
            }
        })
    }
}

impl CpuKernel for BackpropFilter {
    /// Tasks (row group q, channel block b), each summing its rows into its channels of dW
    /// (one row group) or of partial q; then dW = Σ partials in q order, element by element.
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let g = &self.g;
        let (x, dy) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
        let len = g.kh * g.kw * self.cg * g.f;
        // A half dW is summed in f32 after the partials, then rounded.
        let half_dw = self.half.as_ref().map(|(t, _)| t[2]).filter(|d| d.is_half());
        let mut wide_dw = Vec::new();
        let dw = match half_dw {
            Some(_) => {
                wide_dw.resize(len, 0.0f32);
                SendPtr::new(wide_dw.as_mut_ptr())
            }
            None => SendPtr::new(output as *mut f32),
        };
        let blocks = g.f.div_ceil(self.block);
        let (groups, rows) = (self.row_groups, g.n * g.oh);
        let work = rows * g.ow * g.kh * g.kw * self.cg * g.f;
        let mut partials = self.partials.lock().unwrap_or_else(|e| e.into_inner());
        let target = if groups == 1 {
            dw
        } else {
            partials.resize(groups * len, 0.0);
            SendPtr::new(partials.as_mut_ptr())
        };
        thread_local! {
            /// Each worker's depthwise row sums (`depthwise_rows`), kept between calls.
            static SUMS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
        }
        let sums_len = if self.path == FilterPath::Depthwise { g.kh * g.kw * self.block } else { 0 };
        par_chunks(groups * blocks, 1, work, |a, b| {
            SUMS.with_borrow_mut(|sums| {
                sums.resize(sums.len().max(sums_len), 0.0);
                for t in a..b {
                    let (q, block) = (t / blocks, t % blocks);
                    let f = [block * self.block, ((block + 1) * self.block).min(g.f)];
                    let r = [rows * q / groups, rows * (q + 1) / groups];
                    // SAFETY: run's contract (x, dy and dW of this geometry, dW overlapping
                    // neither); the target (dW, or partial q of the kernel's buffer, len floats
                    // each) is this task's in channels f; the sums are this thread's and hold
                    // KH·KW·block floats.
                    unsafe {
                        let target = target.get().add(q * len);
                        match &self.half {
                            Some((types, one)) => self.rows_widened(
                                one,
                                [x.get() as *mut u8, dy.get() as *mut u8],
                                *types,
                                target,
                                sums,
                                f,
                                r,
                            ),
                            None => filter_dispatch(
                                self,
                                x.get(),
                                dy.get(),
                                target,
                                sums.as_mut_ptr(),
                                f,
                                (r, true),
                            ),
                        }
                    };
                }
            })
        });
        let round = |wide: &[f32]| {
            if let Some(t) = half_dw {
                // SAFETY: dW holds len elements of its half type (run's contract).
                let out = unsafe { slice::from_raw_parts_mut(output as *mut u16, len) };
                super::cast::narrow_slice(t, wide, out);
            }
        };
        if groups == 1 {
            return round(&wide_dw);
        }
        let partials = &partials[..groups * len];
        par_ranges(len, groups, |a, b| {
            // SAFETY: elements a..b of dW are this task's (run's contract: dW holds len floats).
            let out = unsafe { slice::from_raw_parts_mut(dw.get().add(a), b - a) };
            out.copy_from_slice(&partials[a..b]);
            for q in 1..groups {
                for (o, &p) in out.iter_mut().zip(&partials[q * len + a..q * len + b]) {
                    *o += p;
                }
            }
        });
        round(&wide_dw);
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
