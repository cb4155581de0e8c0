//! Test support: run a kernel on host vectors, random tensors, index helpers and comparisons.
//! References in the test files compute in f64 with plain loops.
#![allow(dead_code)]

use kiln_compiler::ir::{DType, Op, Shape, infer};
use kiln_kernels::cpu::{CpuKernel, prepare};

/// A host tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct T {
    pub dims: Vec<usize>,
    pub data: Vec<f32>,
}

impl T {
    pub fn new(dims: &[usize], data: Vec<f32>) -> T {
        assert_eq!(dims.iter().product::<usize>(), data.len());
        T { dims: dims.to_vec(), data }
    }

    pub fn shape(&self) -> Shape {
        Shape::from(self.dims.as_slice())
    }

    /// Element at a multi-index.
    pub fn at(&self, idx: &[usize]) -> f32 {
        self.data[ravel(idx, &self.dims)]
    }
}

/// A small deterministic generator (xorshift), so tests need no extra dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let u = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * u
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn tensor(&mut self, dims: &[usize], lo: f32, hi: f32) -> T {
        let n = dims.iter().product();
        T::new(dims, (0..n).map(|_| self.uniform(lo, hi)).collect())
    }
}

/// A random tensor with values in [-2, 2).
pub fn rand(dims: &[usize], seed: u64) -> T {
    Rng::new(seed).tensor(dims, -2.0, 2.0)
}

pub fn row_major(dims: &[usize]) -> Vec<usize> {
    let mut s = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * dims[i + 1];
    }
    s
}

pub fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    assert_eq!(idx.len(), dims.len());
    idx.iter().zip(row_major(dims)).map(|(i, s)| i * s).sum()
}

pub fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for a in (0..dims.len()).rev() {
        idx[a] = i % dims[a];
        i /= dims[a];
    }
    idx
}

/// Index into an operand of `dims` broadcast to an output index (NumPy rules).
pub fn broadcast_index(out_idx: &[usize], dims: &[usize]) -> usize {
    let off = out_idx.len() - dims.len();
    let idx: Vec<usize> =
        dims.iter().enumerate().map(|(a, &d)| if d == 1 { 0 } else { out_idx[off + a] }).collect();
    ravel(&idx, dims)
}

/// The output shape `infer` gives.
pub fn out_shape(op: &Op, inputs: &[&T]) -> Shape {
    let shapes: Vec<Shape> = inputs.iter().map(|t| t.shape()).collect();
    let ops: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
    infer(op, &ops).expect("valid operands").0
}

pub fn kernel(op: &Op, inputs: &[&T]) -> (Box<dyn CpuKernel>, Shape) {
    let shapes: Vec<Shape> = inputs.iter().map(|t| t.shape()).collect();
    let ops: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = out_shape(op, inputs);
    let k = prepare(op, &ops, (&out, DType::F32)).unwrap_or_else(|e| panic!("prepare {op}: {e}"));
    (k, out)
}

/// Runs `op` on copies of `inputs` into a NaN-filled output (so unwritten elements show).
pub fn run(op: &Op, inputs: &[&T]) -> T {
    let (k, out) = kernel(op, inputs);
    let mut bufs: Vec<Vec<f32>> = inputs.iter().map(|t| t.data.clone()).collect();
    let mut o = vec![f32::NAN; out.numel()];
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    // SAFETY: buffers sized from the shapes, distinct allocations.
    unsafe { k.run(&ptrs, o.as_mut_ptr() as *mut u8) };
    for (b, t) in bufs.iter().zip(inputs) {
        assert_eq!(b, &t.data, "{op} modified an operand");
    }
    T::new(out.dims(), o)
}

/// Runs an elementwise `op` in place: the output buffer is operand `alias`'s buffer (listed in
/// `aliases`, all of which share that buffer).
pub fn run_aliased(op: &Op, inputs: &[&T], aliases: &[usize]) -> T {
    let (k, out) = kernel(op, inputs);
    let mut bufs: Vec<Vec<f32>> = inputs.iter().map(|t| t.data.clone()).collect();
    let mut ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    let shared = ptrs[aliases[0]];
    for &a in aliases {
        assert_eq!(inputs[a].dims, out.dims());
        assert_eq!(inputs[a].data, inputs[aliases[0]].data);
        ptrs[a] = shared;
    }
    // SAFETY: the shared buffer has the output's shape; the others are distinct allocations.
    unsafe { k.run(&ptrs, shared) };
    T::new(out.dims(), bufs[aliases[0]].clone())
}

/// Runs an effect op; returns the operands after the update.
pub fn run_effect(op: &Op, inputs: &[&T]) -> Vec<T> {
    let (k, _) = kernel(op, inputs);
    let mut bufs: Vec<Vec<f32>> = inputs.iter().map(|t| t.data.clone()).collect();
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    // SAFETY: distinct buffers sized from the shapes; effects have no output.
    unsafe { k.run(&ptrs, std::ptr::null_mut()) };
    bufs.into_iter().zip(inputs).map(|(b, t)| T::new(&t.dims, b)).collect()
}

/// |got - want| <= tol·(1 + |want|) elementwise; NaN matches NaN.
#[track_caller]
pub fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g.is_nan() && w.is_nan())
            || (g.is_infinite() && w.is_infinite() && (g > 0.0) == (w > 0.0))
            || ((g as f64) - w).abs() <= tol * (1.0 + w.abs());
        assert!(ok, "element {i}: got {g}, want {w} (tol {tol})");
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}
