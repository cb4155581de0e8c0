//! The training effects: SGD (plain, momentum, Nesterov), Adam and assign_add, Keras 3 semantics.
//! They produce no tensor (the output pointer is null) and update their variable operands in place.
//!
//! - SGD: var -= lr·g; with momentum: v = momentum·v - lr·g, then var += v, or with Nesterov
//!   var += momentum·v - lr·g.
//! - Adam: t = iterations + 1; α = lr·√(1-β2^t)/(1-β1^t); m += (g-m)(1-β1); v += (g²-v)(1-β2);
//!   var -= α·m/(√v + ε). The iteration counter is read, not incremented (an assign_add does that).
//! - assign_add: every element += value.
//!
//! A tiled update (`rows`) writes a block of rows: the variable and its state are read and
//! written from that block's first element on, the gradient holds just the block.

use super::par::{SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{Rows, Shape};
use std::slice;

/// # Safety
/// `p` is valid for `s..e` and no other live reference covers that range.
#[inline(always)]
unsafe fn part<'a>(p: SendPtr<f32>, s: usize, e: usize) -> &'a mut [f32] {
    // SAFETY: forwarded contract.
    unsafe { slice::from_raw_parts_mut(p.get().add(s), e - s) }
}

struct Sgd {
    lr: f32,
    momentum: f32,
    nesterov: bool,
    offset: usize,
    n: usize,
    desc: String,
}

/// `rows` was checked against `var` by `ir::infer`.
pub(crate) fn sgd(
    lr: f32,
    momentum: f32,
    nesterov: bool,
    var: &Shape,
    rows: Option<Rows>,
) -> Box<dyn CpuKernel> {
    let (offset, n, part) = Rows::span(rows, var);
    let desc = format!(
        "apply_sgd[lr {lr}, momentum {momentum}{}] {}{part}",
        if nesterov { ", nesterov" } else { "" },
        shape_text(var)
    );
    Box::new(Sgd { lr, momentum, nesterov, offset, n, desc })
}

impl CpuKernel for Sgd {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        // SAFETY (offsets): the variable and its state hold offset + n elements (`rows` checked
        // against the variable's shape by `ir::infer`); the gradient holds n.
        let at = |i: usize| SendPtr::new(unsafe { (inputs[i] as *mut f32).add(self.offset) });
        let (var, grad) = (at(0), SendPtr::new(inputs[1] as *mut f32));
        let velocity = (self.momentum != 0.0).then(|| at(2));
        let (lr, mu) = (self.lr, self.momentum);
        par_ranges(self.n, 3, |s, e| {
            // SAFETY: var, grad and velocity are distinct buffers of n elements; tasks take
            // disjoint ranges.
            let (x, g) = unsafe { (part(var, s, e), part(grad, s, e)) };
            match velocity {
                None => x.iter_mut().zip(g.iter()).for_each(|(x, &g)| *x -= lr * g),
                Some(v) => {
                    // SAFETY: as above.
                    let v = unsafe { part(v, s, e) };
                    for ((x, &g), v) in x.iter_mut().zip(g.iter()).zip(v) {
                        *v = mu * *v - lr * g;
                        *x += if self.nesterov { mu * *v - lr * g } else { *v };
                    }
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct Adam {
    lr: f32,
    beta1: f32,
    beta2: f32,
    epsilon: f32,
    offset: usize,
    n: usize,
    desc: String,
}

/// `rows` was checked against `var` by `ir::infer`.
pub(crate) fn adam(
    lr: f32,
    beta1: f32,
    beta2: f32,
    epsilon: f32,
    var: &Shape,
    rows: Option<Rows>,
) -> Box<dyn CpuKernel> {
    let (offset, n, part) = Rows::span(rows, var);
    let desc = format!(
        "apply_adam[lr {lr}, beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}] {}{part}",
        shape_text(var)
    );
    Box::new(Adam { lr, beta1, beta2, epsilon, offset, n, desc })
}

impl CpuKernel for Adam {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        // SAFETY (offsets): the variable and its state hold offset + n elements (`rows` checked
        // against the variable's shape by `ir::infer`); the gradient holds n.
        let at = |i: usize| SendPtr::new(unsafe { (inputs[i] as *mut f32).add(self.offset) });
        let [var, m, v] = [0, 2, 3].map(at);
        let grad = SendPtr::new(inputs[1] as *mut f32);
        // SAFETY: the counter holds one element.
        let t = unsafe { *(inputs[4] as *const f32) } as f64 + 1.0;
        let (b1, b2) = (self.beta1 as f64, self.beta2 as f64);
        let alpha = (self.lr as f64 * (1.0 - b2.powf(t)).sqrt() / (1.0 - b1.powf(t))) as f32;
        let (one_b1, one_b2, eps) = (1.0 - self.beta1, 1.0 - self.beta2, self.epsilon);
        par_ranges(self.n, 6, |s, e| {
            // SAFETY: var, grad, m and v are distinct buffers of n elements; tasks take disjoint
            // ranges.
            let (x, g, m, v) = unsafe { (part(var, s, e), part(grad, s, e), part(m, s, e), part(v, s, e)) };
            for (((x, &g), m), v) in x.iter_mut().zip(g.iter()).zip(m).zip(v) {
                *m += (g - *m) * one_b1;
                *v += (g * g - *v) * one_b2;
                *x -= alpha * *m / (v.sqrt() + eps);
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct AssignAdd {
    value: f32,
    n: usize,
    desc: String,
}

pub(crate) fn assign_add(value: f32, var: &Shape) -> Box<dyn CpuKernel> {
    Box::new(AssignAdd { value, n: var.numel(), desc: format!("assign_add[{value}] {}", shape_text(var)) })
}

impl CpuKernel for AssignAdd {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        let var = SendPtr::new(inputs[0] as *mut f32);
        // SAFETY: the variable holds n elements; tasks take disjoint ranges.
        par_ranges(self.n, 1, |s, e| unsafe { part(var, s, e) }.iter_mut().for_each(|x| *x += self.value));
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
