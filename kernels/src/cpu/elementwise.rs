//! Elementwise kernels: unary, binary (NumPy broadcasting), scalar and select.
//!
//! The output may be the very buffer of an operand of the output's shape (the planner reuses
//! buffers in place). Such an operand is always read with stride 1 at the output's own offsets, so
//! element i is read before element i is written and the result is the same; the row functions
//! below only have to avoid creating a `&mut [f32]` and a `&[f32]` over the same memory. They check
//! for aliasing per run and then use either one `&mut` slice (in place) or disjoint slices, which
//! keeps every loop vectorisable.
//!
//! Broadcasting uses `broadcast::Strided`, which collapses the fast cases (same shapes, a scalar
//! operand, a bias row) to one or two loops; the innermost run of a binary op reads each operand
//! with stride 0 or 1, so four loop shapes cover everything.

use super::broadcast::{Strided, broadcast_strides};
use super::math::{with_binary, with_scalar, with_unary};
use super::par::{SendPtr, par_ranges};
use super::simd::multiversion;
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{BinaryOp, ScalarOp, Shape, UnaryOp};
use std::slice;

// ---------------------------------------------------------------- runs

/// out[i] = f(x[i]) for i < n.
///
/// # Safety
/// `x` and `o` are valid for `n` elements and either equal or disjoint.
#[inline(always)]
unsafe fn map1(x: *const f32, o: *mut f32, n: usize, f: impl Fn(f32) -> f32) {
    if std::ptr::eq(x, o) {
        // SAFETY: in place: one mutable slice over the shared buffer.
        let o = unsafe { slice::from_raw_parts_mut(o, n) };
        for v in o {
            *v = f(*v);
        }
    } else {
        // SAFETY: disjoint buffers, each valid for n elements.
        let (x, o) = unsafe { (slice::from_raw_parts(x, n), slice::from_raw_parts_mut(o, n)) };
        for (v, &a) in o.iter_mut().zip(x) {
            *v = f(a);
        }
    }
}

/// out[i] = f(a[i * sa], b[i * sb]) for i < n, with sa, sb in {0, 1}.
///
/// # Safety
/// The pointers are valid for the elements read and written; an operand read with stride 1 either
/// is the output or is disjoint from it, and an operand read with stride 0 is disjoint from it.
#[inline(always)]
unsafe fn map2(
    a: *const f32,
    sa: isize,
    b: *const f32,
    sb: isize,
    o: *mut f32,
    n: usize,
    f: impl Fn(f32, f32) -> f32,
) {
    let oc = o as *const f32;
    // SAFETY (whole body): per the contract, slices are created only over disjoint memory, or as
    // a single mutable slice when an operand is the output.
    unsafe {
        match (sa, sb) {
            (1, 1) if a == oc && b == oc => {
                for v in slice::from_raw_parts_mut(o, n) {
                    *v = f(*v, *v);
                }
            }
            (1, 1) if a == oc => {
                let (o, b) = (slice::from_raw_parts_mut(o, n), slice::from_raw_parts(b, n));
                for (v, &y) in o.iter_mut().zip(b) {
                    *v = f(*v, y);
                }
            }
            (1, 1) if b == oc => {
                let (o, a) = (slice::from_raw_parts_mut(o, n), slice::from_raw_parts(a, n));
                for (v, &x) in o.iter_mut().zip(a) {
                    *v = f(x, *v);
                }
            }
            (1, 1) => {
                let o = slice::from_raw_parts_mut(o, n);
                let (a, b) = (slice::from_raw_parts(a, n), slice::from_raw_parts(b, n));
                for ((v, &x), &y) in o.iter_mut().zip(a).zip(b) {
                    *v = f(x, y);
                }
            }
            (1, 0) => {
                let y = *b;
                map1(a, o, n, |x| f(x, y));
            }
            (0, 1) => {
                let x = *a;
                map1(b, o, n, |y| f(x, y));
            }
            (0, 0) => {
                let v = f(*a, *b);
                slice::from_raw_parts_mut(o, n).fill(v);
            }
            _ => {
                for i in 0..n as isize {
                    *o.offset(i) = f(*a.offset(i * sa), *b.offset(i * sb));
                }
            }
        }
    }
}

// ---------------------------------------------------------------- unary

pub(crate) struct Unary {
    op: UnaryOp,
    n: usize,
    desc: String,
}

pub(crate) fn unary(op: UnaryOp, name: &str, x: &Shape) -> Box<dyn CpuKernel> {
    Box::new(Unary { op, n: x.numel(), desc: format!("{name} {}", shape_text(x)) })
}

/// # Safety
/// As `map1`.
#[inline(always)]
unsafe fn unary_run(op: UnaryOp, x: *const f32, o: *mut f32, n: usize) {
    // SAFETY: forwarded contract.
    with_unary!(op, |f| unsafe { map1(x, o, n, f) })
}

multiversion! {
    /// `unary_run` on the widest vectors the CPU has (`simd`).
    unsafe fn unary_dispatch / unary_at(op: UnaryOp, x: *const f32, o: *mut f32, n: usize) => unary_run;
}

impl CpuKernel for Unary {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, o) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(output as *mut f32));
        par_ranges(self.n, 1, |s, e| {
            // SAFETY: run's contract: x and o hold n elements and are equal or disjoint; ranges
            // handed to different threads are disjoint.
            unsafe { unary_dispatch(self.op, x.get().add(s), o.get().add(s), e - s) }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- scalar

pub(crate) struct Scalar {
    op: ScalarOp,
    c: f32,
    n: usize,
    desc: String,
}

pub(crate) fn scalar(op: ScalarOp, c: f32, name: &str, x: &Shape) -> Box<dyn CpuKernel> {
    Box::new(Scalar { op, c, n: x.numel(), desc: format!("{name}[{c}] {}", shape_text(x)) })
}

/// # Safety
/// As `map1`.
#[inline(always)]
unsafe fn scalar_run(op: ScalarOp, c: f32, x: *const f32, o: *mut f32, n: usize) {
    // SAFETY: forwarded contract.
    with_scalar!(op, c, |f| unsafe { map1(x, o, n, f) })
}

impl CpuKernel for Scalar {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, o) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(output as *mut f32));
        par_ranges(self.n, 1, |s, e| {
            // SAFETY: as in Unary::run.
            unsafe { scalar_run(self.op, self.c, x.get().add(s), o.get().add(s), e - s) }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- binary

pub(crate) struct Binary {
    op: BinaryOp,
    walk: Strided<2>,
    inner: [isize; 2],
    desc: String,
}

pub(crate) fn binary(op: BinaryOp, name: &str, a: &Shape, b: &Shape, out: &Shape) -> Box<dyn CpuKernel> {
    let (sa, sb) = (broadcast_strides(a.dims(), out.dims()), broadcast_strides(b.dims(), out.dims()));
    let walk = Strided::new(out.dims(), [&sa, &sb]);
    let inner = walk.inner_strides();
    let desc = format!("{name} {} {}", shape_text(a), shape_text(b));
    Box::new(Binary { op, walk, inner, desc })
}

impl Binary {
    /// The walk with the op's function inlined into every run.
    ///
    /// # Safety
    /// As `CpuKernel::run`.
    #[inline(always)]
    unsafe fn go(&self, inputs: &[*mut u8], output: *mut u8, f: impl Fn(f32, f32) -> f32 + Copy + Sync) {
        let a = SendPtr::new(inputs[0] as *mut f32);
        let b = SendPtr::new(inputs[1] as *mut f32);
        let o = SendPtr::new(output as *mut f32);
        let [sa, sb] = self.inner;
        par_ranges(self.walk.numel(), 1, |s, e| {
            self.walk.for_each_run(s, e, &mut |oo, [ia, ib], n| {
                // SAFETY: the walk stays inside every operand (strides from their shapes); an
                // operand aliasing the output has the output's shape, so it is read at the
                // output's offsets with stride 1; threads write disjoint output ranges.
                unsafe { map2(a.get().offset(ia), sa, b.get().offset(ib), sb, o.get().add(oo), n, f) }
            });
        });
    }
}

/// GeluGrad or GeluTanhGrad (`op`; any other op computes GeluTanhGrad) over contiguous
/// operands: `derivative_blocks` with the op's derivative.
///
/// # Safety
/// As `derivative_blocks`.
#[inline(always)]
pub(crate) unsafe fn gelu_grad_blocks(op: BinaryOp, x: *const f32, dy: *const f32, o: *mut f32, n: usize) {
    // SAFETY: forwarded contract.
    unsafe {
        if op == BinaryOp::GeluGrad {
            derivative_blocks(x, dy, o, n, super::math::gelu_derivative)
        } else {
            derivative_blocks(x, dy, o, n, super::math::gelu_tanh_derivative)
        }
    }
}

/// Whether `gelu_grad_blocks` computes `op`.
pub(crate) fn is_gelu_grad(op: BinaryOp) -> bool {
    matches!(op, BinaryOp::GeluGrad | BinaryOp::GeluTanhGrad)
}

/// A GELU gradient over contiguous operands, a block at a time: the derivative of the block's inputs into
/// a stack block (a loop of one input, which the compiler vectorises as it does the unary GELU),
/// then the products with the upstream gradient: the same arithmetic as `dy * gelu'(x)`, so the
/// same bits, where the two-input loop stays scalar (a 1M-element GeluGrad step, the call's copies
/// included: 14.7 -> 4.0 ms, a Mul of the same size 2.0 ms).
///
/// # Safety
/// As `map2` with both strides 1.
#[inline(always)]
unsafe fn derivative_blocks(
    x: *const f32,
    dy: *const f32,
    o: *mut f32,
    n: usize,
    derivative: impl Fn(f32) -> f32,
) {
    const BLOCK: usize = 256;
    let mut d = [0f32; BLOCK];
    let mut s = 0;
    while s < n {
        let m = BLOCK.min(n - s);
        // SAFETY: elements s..s+m of every operand; x and dy are read (into `d` and `g`) before
        // the output block, which may be either of them, is written.
        unsafe {
            let xs = slice::from_raw_parts(x.add(s), m);
            for (v, &x) in d[..m].iter_mut().zip(xs) {
                *v = derivative(x);
            }
            for (j, &dv) in d[..m].iter().enumerate() {
                let g = *dy.add(s + j);
                *o.add(s + j) = g * dv;
            }
        }
        s += m;
    }
}

multiversion! {
    /// `gelu_grad_blocks` on the widest vectors the CPU has (`simd`).
    pub(crate) unsafe fn gelu_grad_dispatch / gelu_grad_at(
        op: BinaryOp, x: *const f32, dy: *const f32, o: *mut f32, n: usize
    ) => gelu_grad_blocks;
}

impl CpuKernel for Binary {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        if is_gelu_grad(self.op) && self.inner == [1, 1] {
            let (x, dy) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
            let o = SendPtr::new(output as *mut f32);
            par_ranges(self.walk.numel(), 1, |s, e| {
                self.walk.for_each_run(s, e, &mut |oo, [ia, ib], n| {
                    let (x, dy, o) =
                        (x.get().wrapping_offset(ia), dy.get().wrapping_offset(ib), o.get().wrapping_add(oo));
                    // SAFETY: as in `go` (contiguous runs of both operands).
                    unsafe { gelu_grad_dispatch(self.op, x, dy, o, n) }
                });
            });
            return;
        }
        // SAFETY: run's contract, forwarded.
        with_binary!(self.op, |f| unsafe { self.go(inputs, output, f) })
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

// ---------------------------------------------------------------- select

pub(crate) struct Select {
    walk: Strided<3>,
    inner: [isize; 3],
    desc: String,
}

pub(crate) fn select(c: &Shape, a: &Shape, b: &Shape, out: &Shape) -> Box<dyn CpuKernel> {
    let s = [c, a, b].map(|x| broadcast_strides(x.dims(), out.dims()));
    let walk = Strided::new(out.dims(), [&s[0], &s[1], &s[2]]);
    let inner = walk.inner_strides();
    let desc = format!("select {} {} {}", shape_text(c), shape_text(a), shape_text(b));
    Box::new(Select { walk, inner, desc })
}

impl CpuKernel for Select {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let [c, a, b] = [0, 1, 2].map(|i| SendPtr::new(inputs[i] as *mut f32));
        let o = SendPtr::new(output as *mut f32);
        let [sc, sa, sb] = self.inner;
        par_ranges(self.walk.numel(), 1, |s, e| {
            self.walk.for_each_run(s, e, &mut |oo, [ic, ia, ib], n| {
                let (c, a, b) = (c.get(), a.get(), b.get());
                let o = o.get();
                // SAFETY: as in Binary::run. Raw reads and writes only: element i of an operand
                // that is the output is read before element i is written.
                unsafe {
                    let (c, a, b, o) = (c.offset(ic), a.offset(ia), b.offset(ib), o.add(oo));
                    for i in 0..n as isize {
                        let v = if *c.offset(i * sc) != 0.0 { *a.offset(i * sa) } else { *b.offset(i * sb) };
                        *o.offset(i) = v;
                    }
                }
            });
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::simd::Width;
    use super::*;

    /// Every unary op.
    pub(crate) fn unary_ops() -> Vec<UnaryOp> {
        UnaryOp::ALL.to_vec()
    }

    /// An odd number of values over every range the transcendentals branch on, with the
    /// special values (signed zeros, infinities, NaN, subnormals, the overflow edges).
    pub(crate) fn inputs() -> Vec<f32> {
        let mut x: Vec<f32> = (0..4099).map(|i| -40.0 + 80.0 * i as f32 / 4098.0).collect();
        x.extend((0..517).map(|i| (i as f32 * 0.731).sin() * 3.0));
        x.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-40,
            -1e-40,
            88.7,
            89.0,
            -103.9,
            -104.0,
            f32::MAX,
            f32::MIN,
        ]);
        x
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    /// Each width the CPU has computes the baseline's bits, for every unary op and both GELU
    /// gradients, in place and not.
    #[test]
    fn every_width_computes_the_baseline_bits() {
        let x = inputs();
        let dy: Vec<f32> = (0..x.len()).map(|i| (i as f32 * 0.37).cos()).collect();
        let run = |w: Width, op: UnaryOp, in_place: bool| {
            let mut o = vec![0.0f32; x.len()];
            // SAFETY: x and o hold x.len() elements, disjoint (or o alone, in place); `w` is
            // one of `Width::available()`.
            unsafe {
                if in_place {
                    o.copy_from_slice(&x);
                    unary_at(w, op, o.as_ptr(), o.as_mut_ptr(), o.len());
                } else {
                    unary_at(w, op, x.as_ptr(), o.as_mut_ptr(), o.len());
                }
            }
            o
        };
        let widths = Width::available();
        assert!(widths.contains(&Width::Baseline));
        for op in unary_ops() {
            let base = run(Width::Baseline, op, false);
            for &w in &widths {
                for in_place in [false, true] {
                    assert!(
                        same_bits(&run(w, op, in_place), &base),
                        "{op:?} at {w:?} (in place: {in_place})"
                    );
                }
            }
        }
        for op in [BinaryOp::GeluGrad, BinaryOp::GeluTanhGrad] {
            let run = |w: Width| {
                let mut o = vec![0.0f32; x.len()];
                // SAFETY: three disjoint buffers of x.len() elements; `w` is available.
                unsafe { gelu_grad_at(w, op, x.as_ptr(), dy.as_ptr(), o.as_mut_ptr(), o.len()) };
                o
            };
            let base = run(Width::Baseline);
            for &w in &widths {
                assert!(same_bits(&run(w), &base), "{op:?} at {w:?}");
            }
        }
    }
}
