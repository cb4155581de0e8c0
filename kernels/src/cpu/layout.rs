//! Data-movement kernels: fill, copy, permute, broadcast_to, concat, slice, pad.
//!
//! All of them write a contiguous output and are parallelised over output element ranges (the
//! result never depends on how the range is cut). The moving kernels (copy, permute,
//! broadcast_to, concat, slice, pad) move elements of 4 bytes (f32) or 2 (f16 and bf16: a
//! mixed-precision step's activations move at their own size, `Elem`); their zeros are both
//! types' +0.0, all bits clear. Permute and broadcast_to read through a
//! `broadcast::Strided` walk; concat, slice and pad see the output as rows (everything from the
//! axis inwards) made of segments, each copied from an operand or zero-filled.

use super::broadcast::{Strided, broadcast_strides, contiguous_strides};
use super::par::{SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{DType, Shape};
use std::marker::PhantomData;
use std::ptr;

/// An element the moving kernels move: its bits, whatever the type (f32, or u16 for f16 and
/// bf16).
pub(crate) trait Elem: std::marker::Copy + Send + Sync + 'static {
    /// The type's +0.0: all bits clear.
    const ZERO: Self;
}

impl Elem for f32 {
    const ZERO: f32 = 0.0;
}

impl Elem for u16 {
    const ZERO: u16 = 0;
}

/// `build::<u16>()` for a 2-byte type (f16, bf16), else `build::<f32>()`: the moving kernels of
/// `dtype`'s elements (`check` admits f32, f16 and bf16).
macro_rules! by_size {
    ($dtype:expr, $build:ident($($arg:expr),*)) => {
        if $dtype.size_bytes() == 2 { $build::<u16>($($arg),*) } else { $build::<f32>($($arg),*) }
    };
}

/// Copies `n` elements between disjoint buffers.
///
/// # Safety
/// `src` and `dst` are valid for `n` elements and do not overlap.
#[inline(always)]
unsafe fn copy<T: Elem>(src: *const T, dst: *mut T, n: usize) {
    // SAFETY: forwarded contract.
    unsafe { ptr::copy_nonoverlapping(src, dst, n) }
}

/// # Safety
/// `dst` is valid for `n` elements.
#[inline(always)]
unsafe fn fill_raw<T: Elem>(dst: *mut T, n: usize, value: T) {
    // SAFETY: forwarded contract.
    unsafe { std::slice::from_raw_parts_mut(dst, n).fill(value) }
}

/// Calls `f(row, lo, hi)` for the parts of rows of `row_len` elements that cover `start..end`.
#[inline]
fn rows_in_range(row_len: usize, start: usize, end: usize, mut f: impl FnMut(usize, usize, usize)) {
    let mut i = start;
    while i < end {
        let (r, lo) = (i / row_len, i % row_len);
        let hi = (lo + end - i).min(row_len);
        f(r, lo, hi);
        i += hi - lo;
    }
}

// ---------------------------------------------------------------- nothing, fill, copy

/// The kernel of an op that writes no element: runs nothing (and reads no pointer).
pub(crate) struct Nothing(pub(crate) String);

impl CpuKernel for Nothing {
    unsafe fn run(&self, _inputs: &[*mut u8], _output: *mut u8) {}

    fn describe(&self) -> String {
        self.0.clone()
    }
}

/// Every element `value` (its bits, of either element size).
struct Fill<T> {
    value: T,
    n: usize,
    desc: String,
}

pub(crate) fn fill(value: f32, out: &Shape) -> Box<dyn CpuKernel> {
    Box::new(Fill { value, n: out.numel(), desc: format!("fill[{value}] {}", shape_text(out)) })
}

/// `value` in every element of an output of `dtype`: f32, or f16 and bf16 (its bits there,
/// rounded as `Op::Cast` rounds; an empty reduction's NaN or -inf too).
pub(crate) fn fill_typed(value: f32, out: &Shape, dtype: DType) -> Box<dyn CpuKernel> {
    if !dtype.is_half() {
        return fill(value, out);
    }
    let mut bits = [0u16];
    super::cast::narrow_slice(dtype, &[value], &mut bits);
    let desc = format!("fill[{value}] {dtype}{}", shape_text(out));
    Box::new(Fill { value: bits[0], n: out.numel(), desc })
}

impl<T: Elem> CpuKernel for Fill<T> {
    unsafe fn run(&self, _inputs: &[*mut u8], output: *mut u8) {
        let o = SendPtr::new(output as *mut T);
        // SAFETY: the output holds n elements; chunks are disjoint.
        par_ranges(self.n, 1, |s, e| unsafe { fill_raw(o.get().add(s), e - s, self.value) });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct Iota {
    n: usize,
    stride: usize,
    dim: usize,
    desc: String,
}

/// Every element its index along `axis`, as a float.
struct RandomUniform {
    n: usize,
    seed: u64,
    desc: String,
}

/// `Op::RandomUniform`: element i is `ir::uniform(seed, step, i)`.
pub(crate) fn random_uniform(seed: u64, out: &Shape) -> Box<dyn CpuKernel> {
    Box::new(RandomUniform {
        n: out.numel(),
        seed,
        desc: format!("random_uniform[seed {seed}] {}", shape_text(out)),
    })
}

impl CpuKernel for RandomUniform {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: the step operand holds one element (`ir::infer`), the output n.
        let step = unsafe { *(inputs[0] as *const f32) };
        let out = SendPtr::new(output as *mut f32);
        par_ranges(self.n, 8, |s, e| {
            // SAFETY: tasks take disjoint ranges of the output's n elements.
            let o = unsafe { std::slice::from_raw_parts_mut(out.get().add(s), e - s) };
            for (i, v) in o.iter_mut().enumerate() {
                *v = kiln_compiler::ir::uniform(self.seed, step, (s + i) as u64);
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

pub(crate) fn iota(axis: usize, out: &Shape) -> Box<dyn CpuKernel> {
    let dims = out.dims();
    Box::new(Iota {
        n: out.numel(),
        stride: dims[axis + 1..].iter().product::<usize>().max(1),
        dim: dims[axis].max(1),
        desc: format!("iota[axis {axis}] {}", shape_text(out)),
    })
}

impl CpuKernel for Iota {
    unsafe fn run(&self, _inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: the output holds n elements.
        let out = unsafe { std::slice::from_raw_parts_mut(output as *mut f32, self.n) };
        for (i, o) in out.iter_mut().enumerate() {
            *o = ((i / self.stride) % self.dim) as f32;
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct Copy<T> {
    n: usize,
    desc: String,
    elem: PhantomData<T>,
}

pub(crate) fn copy_kernel(x: &Shape, dtype: DType) -> Box<dyn CpuKernel> {
    fn build<T: Elem>(x: &Shape) -> Box<dyn CpuKernel> {
        Box::new(Copy::<T> { n: x.numel(), desc: format!("copy {}", shape_text(x)), elem: PhantomData })
    }
    by_size!(dtype, build(x))
}

impl<T: Elem> CpuKernel for Copy<T> {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, o) = (SendPtr::new(inputs[0] as *mut T), SendPtr::new(output as *mut T));
        // SAFETY: both hold n elements and do not overlap; chunks are disjoint.
        par_ranges(self.n, 1, |s, e| unsafe { copy(x.get().add(s), o.get().add(s), e - s) });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- permute, broadcast_to

/// Output = the operand read through `walk` (a permutation or a broadcast).
struct Restride<T> {
    walk: Strided<1>,
    inner: isize,
    desc: String,
    elem: PhantomData<T>,
}

pub(crate) fn permute(x: &Shape, perm: &[usize], out: &Shape, dtype: DType) -> Box<dyn CpuKernel> {
    fn build<T: Elem>(x: &Shape, perm: &[usize], out: &Shape) -> Box<dyn CpuKernel> {
        let xs = contiguous_strides(x.dims());
        let strides: Vec<isize> = perm.iter().map(|&p| xs[p] as isize).collect();
        let walk = Strided::new(out.dims(), [&strides]);
        let [inner] = walk.inner_strides();
        let desc = format!("permute{perm:?} {}", shape_text(x));
        if inner != 1
            && let Some(t) = Transpose::<T>::new(&walk, &desc)
        {
            return Box::new(t);
        }
        Box::new(Restride::<T> { walk, inner, desc, elem: PhantomData })
    }
    by_size!(dtype, build(x, perm, out))
}

pub(crate) fn broadcast_to(x: &Shape, out: &Shape, dtype: DType) -> Box<dyn CpuKernel> {
    fn build<T: Elem>(x: &Shape, out: &Shape) -> Box<dyn CpuKernel> {
        let strides = broadcast_strides(x.dims(), out.dims());
        let walk = Strided::new(out.dims(), [&strides]);
        let [inner] = walk.inner_strides();
        let desc = format!("broadcast_to {} -> {}", shape_text(x), shape_text(out));
        Box::new(Restride::<T> { walk, inner, desc, elem: PhantomData })
    }
    by_size!(dtype, build(x, out))
}

impl<T: Elem> CpuKernel for Restride<T> {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, o) = (SendPtr::new(inputs[0] as *mut T), SendPtr::new(output as *mut T));
        let s = self.inner;
        par_ranges(self.walk.numel(), 1, |start, end| {
            self.walk.for_each_run(start, end, &mut |oo, [xo], n| {
                // SAFETY: the walk stays inside the operand; output runs are disjoint.
                unsafe {
                    let (src, dst) = (x.get().offset(xo), o.get().add(oo));
                    match s {
                        0 => fill_raw(dst, n, *src),
                        1 => copy(src, dst, n),
                        _ => {
                            for i in 0..n {
                                *dst.add(i) = *src.offset(i as isize * s);
                            }
                        }
                    }
                }
            });
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// Side of the square tiles a transposing permute copies at a time.
const TILE: usize = 32;

/// A permute that moves the input's contiguous axis away from the innermost position: copied in
/// TILE x TILE tiles so that both the reads and the writes stay in cache (a row-by-row strided
/// gather of a 1024x1024 transpose is several times slower).
struct Transpose<T> {
    /// The other axes: (extent, output stride, input stride), outer first.
    outer: Vec<(usize, usize, isize)>,
    /// The output axis read contiguously: (extent, output stride).
    p: (usize, usize),
    /// The innermost output axis: (extent, input stride).
    l: (usize, isize),
    /// Rows (indices of `p`) a tile copies: `TILE`, or about TILE x TILE / 3 where it
    /// interleaves three planes (`interleaves`).
    rows: usize,
    tiles: (usize, usize),
    tasks: usize,
    desc: String,
    elem: PhantomData<T>,
}

impl<T: Elem> Transpose<T> {
    fn new(walk: &Strided<1>, desc: &str) -> Option<Transpose<T>> {
        let axes = walk.axes();
        let dims: Vec<usize> = axes.iter().map(|a| a.0).collect();
        let out_strides = contiguous_strides(&dims);
        let last = axes.len() - 1;
        let p = axes[..last].iter().position(|a| a.1 == [1])?;
        let outer =
            (0..last).filter(|&i| i != p).map(|i| (axes[i].0, out_strides[i], axes[i].1[0])).collect();
        let (pd, ld) = (axes[p].0, axes[last].0);
        // An image's NCHW -> NHWC permute has 3 channels innermost, its output rows contiguous:
        // it interleaves three planes (`interleave3`, which the compiler vectorises) in tiles of
        // about TILE x TILE elements. As 32 x 3 tiles of strided scalar copies, MobileNetV3-small's
        // input permute (2x3x224x224) took 0.13-0.26 ms, now 0.04-0.06 ms (`kiln run --profile
        // 100`, one core; its whole pass 0.94-1.03 of its time, six alternating pairs).
        let pos = out_strides[p];
        let rows = if Self::interleaves(pos, ld) { (TILE * TILE).div_ceil(ld) } else { TILE };
        let tiles = (pd.div_ceil(rows), ld.div_ceil(TILE));
        let tasks = walk.numel().checked_div(pd * ld).unwrap_or(0) * tiles.0 * tiles.1;
        let desc = desc.to_string();
        let (p, l) = ((pd, pos), (ld, axes[last].1[0]));
        Some(Transpose { outer, p, l, rows, tiles, tasks, desc, elem: PhantomData })
    }

    /// Whether a tile interleaves three input planes into contiguous output rows.
    fn interleaves(pos: usize, ld: usize) -> bool {
        ld == 3 && pos == ld
    }
}

impl<T: Elem> CpuKernel for Transpose<T> {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, o) = (SendPtr::new(inputs[0] as *mut T), SendPtr::new(output as *mut T));
        let ((pd, pos), (ld, lis)) = (self.p, self.l);
        par_ranges(self.tasks, self.rows * TILE.min(ld), |s, e| {
            for t in s..e {
                let (tl, tp, mut q) =
                    (t % self.tiles.1, (t / self.tiles.1) % self.tiles.0, t / (self.tiles.0 * self.tiles.1));
                let (mut oo, mut io) = (0usize, 0isize);
                for &(d, os, is) in self.outer.iter().rev() {
                    oo += (q % d) * os;
                    io += (q % d) as isize * is;
                    q /= d;
                }
                let (j0, j1) = (tl * TILE, ((tl + 1) * TILE).min(ld));
                let (i0, i1) = (tp * self.rows, ((tp + 1) * self.rows).min(pd));
                if Self::interleaves(pos, ld) {
                    // SAFETY: rows i0..i1 of the three input planes and of the output (contiguous,
                    // pos == ld) lie inside both tensors; this task's rows are its own.
                    unsafe {
                        let n = i1 - i0;
                        let dst = std::slice::from_raw_parts_mut(o.get().add(oo + i0 * pos), n * 3);
                        let plane = |j: usize| {
                            std::slice::from_raw_parts(x.get().offset(io + i0 as isize + j as isize * lis), n)
                        };
                        interleave3(dst, plane(0), plane(1), plane(2));
                    }
                    continue;
                }
                for i in i0..i1 {
                    // SAFETY: indices inside both tensors (strides from their shapes); tiles of
                    // different tasks are disjoint parts of the output.
                    unsafe {
                        let dst = o.get().add(oo + i * pos);
                        let src = x.get().offset(io + i as isize);
                        for j in j0..j1 {
                            *dst.add(j) = *src.offset(j as isize * lis);
                        }
                    }
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// dst = a0 b0 c0 a1 b1 c1 ...: three planes into the rows of a three-channel NHWC tensor.
fn interleave3<T: std::marker::Copy>(dst: &mut [T], a: &[T], b: &[T], c: &[T]) {
    for (((d, &a), &b), &c) in dst.chunks_exact_mut(3).zip(a).zip(b).zip(c) {
        d[0] = a;
        d[1] = b;
        d[2] = c;
    }
}

// ---------------------------------------------------------------- concat, slice, pad

/// Splits a shape at `axis`: (rows before the axis, elements per index of the axis).
fn split(dims: &[usize], axis: usize) -> (usize, usize) {
    (dims[..axis].iter().product(), dims[axis + 1..].iter().product())
}

struct Concat<T> {
    /// Per operand: (offset in an output row, elements per row).
    segments: Vec<(usize, usize)>,
    row: usize,
    n: usize,
    desc: String,
    elem: PhantomData<T>,
}

pub(crate) fn concat(xs: &[&Shape], axis: usize, out: &Shape, dtype: DType) -> Box<dyn CpuKernel> {
    fn build<T: Elem>(xs: &[&Shape], axis: usize, out: &Shape) -> Box<dyn CpuKernel> {
        let (_, inner) = split(out.dims(), axis);
        let mut segments = Vec::with_capacity(xs.len());
        let mut offset = 0;
        for x in xs {
            let len = x.dims()[axis] * inner;
            segments.push((offset, len));
            offset += len;
        }
        let parts: Vec<String> = xs.iter().map(|x| shape_text(x)).collect();
        let desc = format!("concat[axis {axis}] {}", parts.join(" "));
        Box::new(Concat::<T> { segments, row: offset, n: out.numel(), desc, elem: PhantomData })
    }
    by_size!(dtype, build(xs, axis, out))
}

impl<T: Elem> CpuKernel for Concat<T> {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        if self.row == 0 {
            return;
        }
        let (ins, o) = (SendPtr::new(inputs.as_ptr() as *mut *mut u8), SendPtr::new(output as *mut T));
        let count = inputs.len();
        par_ranges(self.n, 1, |s, e| {
            rows_in_range(self.row, s, e, |r, lo, hi| {
                for (j, &(off, len)) in self.segments.iter().enumerate().take(count) {
                    let (a, b) = (lo.max(off), hi.min(off + len));
                    if a < b {
                        // SAFETY: operand j holds rows * len elements; rows of the output are
                        // row elements long; the ranges of different chunks are disjoint.
                        unsafe {
                            let src = (*ins.get().add(j) as *const T).add(r * len + a - off);
                            copy(src, o.get().add(r * self.row + a), b - a);
                        }
                    }
                }
            });
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// Slice and pad: each output row is [zeros, a window of the operand's row, zeros].
struct Window<T> {
    /// Elements per operand row and per output row.
    in_row: usize,
    out_row: usize,
    /// The copied part: output row positions begin..end come from operand row position src.
    begin: usize,
    end: usize,
    src: usize,
    n: usize,
    desc: String,
    elem: PhantomData<T>,
}

/// A `Window` of `dtype`'s elements: `[in_row, out_row, begin, end, src, n]`.
fn window(dims: [usize; 6], desc: String, dtype: DType) -> Box<dyn CpuKernel> {
    fn build<T: Elem>(dims: [usize; 6], desc: String) -> Box<dyn CpuKernel> {
        let [in_row, out_row, begin, end, src, n] = dims;
        Box::new(Window::<T> { in_row, out_row, begin, end, src, n, desc, elem: PhantomData })
    }
    by_size!(dtype, build(dims, desc))
}

pub(crate) fn slice(x: &Shape, axis: usize, start: usize, len: usize, dtype: DType) -> Box<dyn CpuKernel> {
    let (rows, inner) = split(x.dims(), axis);
    let in_row = x.dims()[axis] * inner;
    let out_row = len * inner;
    let desc = format!("slice[axis {axis}, {start}..{}] {}", start + len, shape_text(x));
    window([in_row, out_row, 0, out_row, start * inner, rows * out_row], desc, dtype)
}

pub(crate) fn pad(x: &Shape, axis: usize, before: usize, after: usize, dtype: DType) -> Box<dyn CpuKernel> {
    let (rows, inner) = split(x.dims(), axis);
    let in_row = x.dims()[axis] * inner;
    let out_row = (x.dims()[axis] + before + after) * inner;
    let begin = before * inner;
    let desc = format!("pad[axis {axis}, {before}+{after}] {}", shape_text(x));
    window([in_row, out_row, begin, begin + in_row, 0, rows * out_row], desc, dtype)
}

impl<T: Elem> CpuKernel for Window<T> {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        if self.out_row == 0 {
            return;
        }
        let (x, o) = (SendPtr::new(inputs[0] as *mut T), SendPtr::new(output as *mut T));
        par_ranges(self.n, 1, |s, e| {
            rows_in_range(self.out_row, s, e, |r, lo, hi| {
                let dst = |p: usize| o.get().wrapping_add(r * self.out_row + p);
                // SAFETY: positions stay inside row r of the output and, for the copied part,
                // inside row r of the operand; chunks are disjoint.
                unsafe {
                    let (a, b) = (lo.max(self.begin), hi.min(self.end));
                    if a < b {
                        let src = x.get().add(r * self.in_row + self.src + a - self.begin);
                        copy(src, dst(a), b - a);
                    }
                    if lo < self.begin.min(hi) {
                        fill_raw(dst(lo), self.begin.min(hi) - lo, T::ZERO);
                    }
                    let z = lo.max(self.end);
                    if z < hi {
                        fill_raw(dst(z), hi - z, T::ZERO);
                    }
                }
            });
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
