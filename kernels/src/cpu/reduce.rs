//! Reductions (sum, mean, max) over any set of axes.
//!
//! `prepare` drops size-1 axes and merges adjacent axes of the same kind (kept or reduced), so the
//! input becomes alternating groups. Two loop shapes then cover every case, chosen by the innermost
//! group:
//! - reduced innermost (`Rows`): every output is a sum of contiguous rows, one per combination of
//!   the other reduced groups; a softmax-style [N, C] -> [N] is one row per output.
//! - kept innermost (`Columns`): outputs are computed a tile of up to `TILE` adjacent outputs at a
//!   time, adding whole input rows into stack accumulators; a bias gradient [N, C] -> [C] is this.
//!
//! Sums accumulate in f64. The order of every sum is fixed by the shape alone: rows are summed in
//! chunks of `ROW_CHUNK` elements with 8 lanes each, columns in chunks of rows of the outermost
//! reduced group; chunk results are combined in order. Parallel runs compute the same chunks on
//! other threads, so results are bitwise independent of the thread count.

use super::broadcast::contiguous_strides;
use super::math::max_nan;
use super::par::{PAR_MIN, SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{ReduceOp, Shape};
use rayon::prelude::*;
use std::slice;

/// Elements per chunk of a row sum.
const ROW_CHUNK: usize = 4096;
/// The most elements a reduction asks of its `Source` at once (a row chunk; a column tile is
/// smaller).
pub(crate) const SOURCE_MAX: usize = ROW_CHUNK;

/// Where a reduction's input elements come from: memory, or a fused elementwise program
/// evaluated on demand (`fused::FusedReduceKernel`). The reduction asks for at most
/// `SOURCE_MAX` contiguous elements at a time, always the same pieces in the same order, so the
/// result does not depend on the source.
pub(crate) trait Source: Sync {
    /// `f` of the `len` input elements from offset `off` (row-major in the input's shape).
    fn with<T>(&self, off: usize, len: usize, f: impl FnOnce(&[f32]) -> T) -> T;

    /// Whether asking for narrower pieces costs nothing (the input is in memory), so that a
    /// `Columns` reduction may sum `SUB_COLS` columns at a time in registers. A computed source
    /// evaluates its program once per piece, so it is asked for whole tiles.
    const NARROW_PIECES: bool = false;
}

/// The input as it is in memory.
struct Memory(SendPtr<f32>);

impl Source for Memory {
    const NARROW_PIECES: bool = true;

    #[inline(always)]
    fn with<T>(&self, off: usize, len: usize, f: impl FnOnce(&[f32]) -> T) -> T {
        // SAFETY: the reduction asks only for elements inside its input (offsets from its
        // shape), which `run`'s contract makes valid.
        f(unsafe { slice::from_raw_parts(self.0.get().add(off), len) })
    }
}
/// The column width that fixes how many rows form one partial sum of a `Columns` reduction
/// (`ROW_CHUNK / (min(len, CHUNK_COLS) * inner)` rows): part of every column's summation order.
const CHUNK_COLS: usize = 64;
/// Outputs computed together along a kept innermost axis. Wider than `CHUNK_COLS`: a column's
/// sum does not depend on how many neighbours are computed beside it, and a fused prologue is
/// evaluated once per row piece, so a [1024, 256] bias-style gradient takes 1,024 pieces of 256
/// instead of 4,096 of 64 (`examples/profile_cpu.rs -- transformer`: the layer norms' scale
/// gradients, each a reduction with a one-instruction prologue, 0.52 -> 0.17 ms).
const TILE: usize = 256;
/// Columns of a `Columns` reduction from memory summed together in registers over a chunk's
/// rows (8 AVX2 registers of f64: the reductions are built for the baseline). Summed into the tile's partials in memory instead, each
/// row's add waited on the previous row's store. EfficientNet-B0's 16 squeeze-and-excitation
/// means at batch 2 (NHWC [2, H, W, C] over H and W, C = 32 to 1152; `kiln run --profile 20`,
/// each kernel timed alone, one core of the 2-core AMD EPYC): 0.59-0.62 -> 0.45 ms, the one
/// over 2x112x112x32 0.143 -> 0.067 ms (onnxruntime's 16: 0.24 ms). The whole forward pass did
/// not move beyond the machine's noise (four interleaved rounds, 0.95-1.05).
const SUB_COLS: usize = 32;
/// Chunk partial results computed in parallel per batch (the stack array of partials).
const PAR_BATCH: usize = 64;

/// One reduction: an accumulator type, its identity, how values enter and how partials combine.
trait Reducer {
    type Acc: Copy + Send + Sync;
    const ZERO: Self::Acc;
    fn add(acc: Self::Acc, v: f32) -> Self::Acc;
    fn combine(a: Self::Acc, b: Self::Acc) -> Self::Acc;
    fn finish(acc: Self::Acc, count: usize) -> f32;
}

struct Sum;
struct Mean;
struct Max;

impl Reducer for Sum {
    type Acc = f64;
    const ZERO: f64 = 0.0;
    #[inline(always)]
    fn add(acc: f64, v: f32) -> f64 {
        acc + v as f64
    }
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        a + b
    }
    #[inline(always)]
    fn finish(acc: f64, _count: usize) -> f32 {
        acc as f32
    }
}

impl Reducer for Mean {
    type Acc = f64;
    const ZERO: f64 = 0.0;
    #[inline(always)]
    fn add(acc: f64, v: f32) -> f64 {
        acc + v as f64
    }
    #[inline(always)]
    fn combine(a: f64, b: f64) -> f64 {
        a + b
    }
    #[inline(always)]
    fn finish(acc: f64, count: usize) -> f32 {
        (acc / count as f64) as f32
    }
}

impl Reducer for Max {
    type Acc = f32;
    const ZERO: f32 = f32::NEG_INFINITY;
    #[inline(always)]
    fn add(acc: f32, v: f32) -> f32 {
        max_nan(acc, v)
    }
    #[inline(always)]
    fn combine(a: f32, b: f32) -> f32 {
        max_nan(a, b)
    }
    #[inline(always)]
    fn finish(acc: f32, _count: usize) -> f32 {
        acc
    }
}

/// One chunk of a contiguous row, 8 lanes.
#[inline(always)]
fn row_chunk<R: Reducer>(p: &[f32]) -> R::Acc {
    let mut lanes = [R::ZERO; 8];
    let mut chunks = p.chunks_exact(8);
    for c in &mut chunks {
        for j in 0..8 {
            lanes[j] = R::add(lanes[j], c[j]);
        }
    }
    let mut acc = R::ZERO;
    for l in lanes {
        acc = R::combine(acc, l);
    }
    for &v in chunks.remainder() {
        acc = R::add(acc, v);
    }
    acc
}

/// A contiguous row of `len` elements from `off`, in `ROW_CHUNK` chunks combined in order.
#[inline]
fn row<R: Reducer>(src: &impl Source, off: usize, len: usize) -> R::Acc {
    (0..len)
        .step_by(ROW_CHUNK)
        .fold(R::ZERO, |acc, c| R::combine(acc, src.with(off + c, ROW_CHUNK.min(len - c), row_chunk::<R>)))
}

/// A row held as a slice.
struct Slice<'a>(&'a [f32]);

impl Source for Slice<'_> {
    #[inline(always)]
    fn with<T>(&self, off: usize, len: usize, f: impl FnOnce(&[f32]) -> T) -> T {
        f(&self.0[off..off + len])
    }
}

/// The sum of a contiguous row exactly as the `Sum` reduction computes it (the same chunks,
/// lanes and order, rounded to f32 at the end): the log-softmax kernel's row sum, so that a
/// log-softmax split into its statistics (`kiln_compiler::log_softmax_split`) computes its bits.
pub(crate) fn row_sum(x: &[f32]) -> f32 {
    Sum::finish(row::<Sum>(&Slice(x), 0, x.len()), x.len())
}

/// `row`, with the chunks computed on the rayon pool: the same result.
fn row_parallel<R: Reducer>(src: &impl Source, off: usize, len: usize) -> R::Acc {
    let chunks = len.div_ceil(ROW_CHUNK);
    let mut acc = R::ZERO;
    for b0 in (0..chunks).step_by(PAR_BATCH) {
        let mut partial = [R::ZERO; PAR_BATCH];
        let n = PAR_BATCH.min(chunks - b0);
        partial[..n].par_iter_mut().enumerate().for_each(|(j, s)| {
            let c = (b0 + j) * ROW_CHUNK;
            *s = src.with(off + c, ROW_CHUNK.min(len - c), row_chunk::<R>);
        });
        for &s in &partial[..n] {
            acc = R::combine(acc, s);
        }
    }
    acc
}

/// Calls `f(offset)` for every index combination of `axes` (extent, stride), row-major.
fn for_each_offset(axes: &[(usize, usize)], base: usize, f: &mut impl FnMut(usize)) {
    match axes.split_first() {
        None => f(base),
        Some((&(d, s), rest)) => {
            for i in 0..d {
                for_each_offset(rest, base + i * s, f);
            }
        }
    }
}

/// Input offset of output `o` given the kept groups (extent, input stride), outer first.
#[inline]
fn kept_offset(kept: &[(usize, usize)], mut o: usize) -> usize {
    let mut base = 0;
    for &(d, s) in kept.iter().rev() {
        base += (o % d) * s;
        o /= d;
    }
    base
}

enum Kind {
    /// No axis of size > 1 is reduced: the output is the input.
    Copy,
    /// The innermost group (`len` elements, contiguous) is reduced.
    Rows { len: usize },
    /// The innermost group (`len` elements, contiguous) is kept; `chunk` rows of the outermost
    /// reduced group form one partial sum.
    Columns { len: usize, chunk: usize },
}

pub(crate) struct Reduce {
    op: ReduceOp,
    kind: Kind,
    /// Kept groups (extent, input stride), outer first, excluding a kept innermost group.
    kept: Vec<(usize, usize)>,
    /// Reduced groups, outer first, excluding a reduced innermost group.
    reduced: Vec<(usize, usize)>,
    /// Outputs, and the number of inputs reduced into each.
    outputs: usize,
    count: usize,
    desc: String,
}

pub(crate) fn reduce(op: ReduceOp, name: &str, x: &Shape, axes: &[usize]) -> Box<dyn CpuKernel> {
    Box::new(prepare(op, name, x, axes))
}

/// The reduction of `x` over `axes`, with its loops laid out.
pub(crate) fn prepare(op: ReduceOp, name: &str, x: &Shape, axes: &[usize]) -> Reduce {
    // Merge adjacent axes of one kind, dropping size-1 axes.
    let mut groups: Vec<(usize, bool)> = Vec::new();
    for (i, &d) in x.dims().iter().enumerate() {
        let r = axes.contains(&i);
        match groups.last_mut() {
            _ if d == 1 => {}
            Some((gd, gr)) if *gr == r => *gd *= d,
            _ => groups.push((d, r)),
        }
    }
    let dims: Vec<usize> = groups.iter().map(|g| g.0).collect();
    let strides = contiguous_strides(&dims);
    let mut kept = Vec::new();
    let mut reduced = Vec::new();
    for (&(d, r), &s) in groups.iter().zip(&strides) {
        if r { reduced.push((d, s)) } else { kept.push((d, s)) }
    }
    let outputs: usize = kept.iter().map(|g| g.0).product();
    let count: usize = reduced.iter().map(|g| g.0).product();
    let kind = match groups.last() {
        _ if reduced.is_empty() => Kind::Copy,
        Some(&(len, true)) => {
            reduced.pop();
            Kind::Rows { len }
        }
        Some(&(len, false)) => {
            kept.pop();
            let inner: usize = reduced[1..].iter().map(|g| g.0).product();
            Kind::Columns { len, chunk: (ROW_CHUNK / (len.min(CHUNK_COLS) * inner).max(1)).max(1) }
        }
        None => Kind::Copy,
    };
    let desc = format!("{name}{axes:?} {}", shape_text(x));
    Reduce { op, kind, kept, reduced, outputs, count, desc }
}

impl Reduce {
    /// The reduction of what `src` holds into `o`.
    ///
    /// # Safety
    /// `src` gives the input's elements, `o` holds the output.
    pub(crate) unsafe fn run_from(&self, src: &impl Source, o: *mut f32) {
        // SAFETY: forwarded contract.
        unsafe {
            match self.op {
                ReduceOp::Sum => self.run_with::<Sum, _>(src, o),
                ReduceOp::Mean => self.run_with::<Mean, _>(src, o),
                ReduceOp::Max => self.run_with::<Max, _>(src, o),
            }
        }
    }

    /// # Safety
    /// As `run_from`.
    unsafe fn run_with<R: Reducer, S: Source>(&self, src: &S, o: *mut f32) {
        let o = SendPtr::new(o);
        let work = self.outputs * self.count;
        match self.kind {
            Kind::Copy => {
                par_ranges(self.outputs, 1, |s, e| {
                    for i in s..e {
                        let v = src.with(i, 1, |v| R::finish(R::add(R::ZERO, v[0]), 1));
                        // SAFETY: input and output both hold `outputs` elements.
                        unsafe { *o.get().add(i) = v };
                    }
                });
            }
            Kind::Rows { len } => {
                if self.reduced.is_empty() && self.outputs < 16 && work >= PAR_MIN {
                    for i in 0..self.outputs {
                        let acc = row_parallel::<R>(src, kept_offset(&self.kept, i), len);
                        // SAFETY: i < outputs.
                        unsafe { *o.get().add(i) = R::finish(acc, self.count) };
                    }
                    return;
                }
                par_ranges(self.outputs, self.count, |s, e| {
                    for i in s..e {
                        let mut acc = R::ZERO;
                        for_each_offset(&self.reduced, kept_offset(&self.kept, i), &mut |off| {
                            acc = R::combine(acc, row::<R>(src, off, len));
                        });
                        // SAFETY: i < outputs; threads write disjoint outputs.
                        unsafe { *o.get().add(i) = R::finish(acc, self.count) };
                    }
                });
            }
            Kind::Columns { len, chunk } => {
                let tiles = len.div_ceil(TILE);
                let units = self.outputs / len * tiles;
                let (outer, rest) = self.reduced.split_first().expect("a reduced group");
                let chunks = outer.0.div_ceil(chunk);
                // Partial sum of chunk c for the tile starting at input offset `base`.
                // Every column's sum runs over the chunk's rows in order, whichever loop makes it.
                let partial = |base: usize, w: usize, c: usize| {
                    let mut part = [R::ZERO; TILE];
                    let rows = c * chunk..((c + 1) * chunk).min(outer.0);
                    let mut j0 = 0;
                    // One reduced group (NHWC's H and W merge into one): a plain loop over the
                    // rows, which keeps the sums in registers (`for_each_offset` recurses, is
                    // not inlined, and its closure's sums lived in memory).
                    while S::NARROW_PIECES && rest.is_empty() && j0 + SUB_COLS <= w {
                        let mut acc = [R::ZERO; SUB_COLS];
                        for r in rows.clone() {
                            src.with(base + r * outer.1 + j0, SUB_COLS, |v| {
                                for (a, &v) in acc.iter_mut().zip(&v[..SUB_COLS]) {
                                    *a = R::add(*a, v);
                                }
                            });
                        }
                        part[j0..j0 + SUB_COLS].copy_from_slice(&acc);
                        j0 += SUB_COLS;
                    }
                    if j0 < w {
                        for r in rows {
                            for_each_offset(rest, base + r * outer.1 + j0, &mut |off| {
                                src.with(off, w - j0, |v| {
                                    for (a, &v) in part[j0..w].iter_mut().zip(v) {
                                        *a = R::add(*a, v);
                                    }
                                });
                            });
                        }
                    }
                    part
                };
                let tile = |u: usize, parallel: bool| {
                    let (q, t) = (u / tiles, u % tiles);
                    let (i0, w) = (t * TILE, TILE.min(len - t * TILE));
                    let base = kept_offset(&self.kept, q) + i0;
                    let mut acc = [R::ZERO; TILE];
                    let mut add = |part: &[R::Acc; TILE]| {
                        for (a, &p) in acc[..w].iter_mut().zip(&part[..w]) {
                            *a = R::combine(*a, p);
                        }
                    };
                    if parallel {
                        // Partials in batches of 16 (32 KiB of f64 on the stack), added in order.
                        const PARTS: usize = 16;
                        for b0 in (0..chunks).step_by(PARTS) {
                            let n = PARTS.min(chunks - b0);
                            let mut parts = [[R::ZERO; TILE]; PARTS];
                            parts[..n]
                                .par_iter_mut()
                                .enumerate()
                                .for_each(|(j, p)| *p = partial(base, w, b0 + j));
                            parts[..n].iter().for_each(&mut add);
                        }
                    } else {
                        (0..chunks).for_each(|c| add(&partial(base, w, c)));
                    }
                    for (j, &a) in acc[..w].iter().enumerate() {
                        // SAFETY: output q * len + i0 + j < outputs; units write disjoint outputs.
                        unsafe { *o.get().add(q * len + i0 + j) = R::finish(a, self.count) };
                    }
                };
                if units < 8 && chunks > 1 && work >= PAR_MIN {
                    (0..units).for_each(|u| tile(u, true));
                } else {
                    par_ranges(units, work / units.max(1), |s, e| (s..e).for_each(|u| tile(u, false)));
                }
            }
        }
    }
}

impl CpuKernel for Reduce {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let x = Memory(SendPtr::new(inputs[0] as *mut f32));
        // SAFETY: run's contract.
        unsafe { self.run_from(&x, output as *mut f32) }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
