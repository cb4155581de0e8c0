//! The training effects: SGD (plain, momentum, Nesterov), Adam and assign_add, Keras 3 semantics.
//! They produce no tensor (the output pointer is null) and update their variable operands in place.
//!
//! - SGD: var -= lr·g; with momentum: v = momentum·v - lr·g, then var += v, or with Nesterov
//!   var += momentum·v - lr·g.
//! - Adam: t = iterations + 1; α = lr·√(1-β2^t)/(1-β1^t); m += (g-m)(1-β1); v += (g²-v)(1-β2);
//!   var -= α·m/(√v + ε). The iteration counter is read, not incremented (an assign_add does that).
//! - assign_add: every element += value.
//! - update_loss_scale: GradScaler's scale update (`ir::Op::UpdateLossScale`).
//!
//! A gated update (`ir::Op::update_gate`) reads its gate first: where it is not finite the
//! kernel returns without writing, and otherwise the gradient is multiplied by it as it is read
//! (the ungated multiply by 1 changes no bit).
//!
//! A tiled update (`rows`) writes a block of rows: the variable and its state are read and
//! written from that block's first element on, the gradient holds just the block.
//!
//! A product update (`ir::Grad::Product`) computes its gradient aᵀ·b itself, in blocks of rows,
//! each into a tile of at most 256 KiB (as a fused product written over its operand does,
//! `fused`) and applied from there: the same GEMM on fewer rows, so the results are bitwise
//! those of the whole product stored and then applied. Blocks run in parallel, one thread and
//! one tile each. Half factors (a mixed-precision step's) are widened a panel at a time
//! (`Gemm::run_mixed`) and each element of the tile rounded to their type before it is applied:
//! the bits of the half product stored, widened by a cast and applied.

use super::cast::round_to;
use super::matmul::{Gemm, SERIAL_MACS};
use super::mixed_gemm::Matrix;
use super::par::{SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{DType, Grad, Rows, Shape, Shard};
use rayon::prelude::*;
use std::slice;
use std::sync::Mutex;

/// Output elements in a tile of the tiled updates: 256 KiB, about what the GEMM's own packing
/// buffers take, outside the arena like them.
const TILE_FLOATS: usize = 1 << 16;

/// # Safety
/// `p` is valid for `s..e` and no other live reference covers that range.
#[inline(always)]
unsafe fn part<'a>(p: SendPtr<f32>, s: usize, e: usize) -> &'a mut [f32] {
    // SAFETY: forwarded contract.
    unsafe { slice::from_raw_parts_mut(p.get().add(s), e - s) }
}

/// An update's arithmetic, applied to a run of elements.
enum Rule {
    Sgd { lr: f32, momentum: f32, nesterov: bool },
    Adam { lr: f32, beta1: f32, beta2: f32, epsilon: f32 },
}

/// Where a run of an update reads and writes: the variable and the state at the run's first
/// element, the gradient's n elements, and Adam's step size.
#[derive(Clone, Copy)]
struct Run {
    var: SendPtr<f32>,
    grad: SendPtr<f32>,
    state: [SendPtr<f32>; 2],
    alpha: f32,
    /// The factor each gradient element is multiplied by as it is read (a gate's; 1 ungated).
    unscale: f32,
}

impl Rule {
    /// Adam's step size α = lr·√(1-β2^t)/(1-β1^t) for the counter's value (t = counter + 1), in
    /// f64 as Keras computes it; 0 for SGD.
    fn alpha(&self, counter: f32) -> f32 {
        match *self {
            Rule::Sgd { .. } => 0.0,
            Rule::Adam { lr, beta1, beta2, .. } => {
                let (t, b1, b2) = (counter as f64 + 1.0, beta1 as f64, beta2 as f64);
                (lr as f64 * (1.0 - b2.powf(t)).sqrt() / (1.0 - b1.powf(t))) as f32
            }
        }
    }

    /// # Safety
    /// `run`'s pointers are valid for `n` elements each (the state ones the rule reads), the
    /// variable's and the state's distinct from each other and from the gradient's.
    unsafe fn apply(&self, run: Run, n: usize, parallel: bool) {
        let body = |s: usize, e: usize| match *self {
            Rule::Sgd { lr, momentum, nesterov } => {
                // SAFETY: the contract above; callers take disjoint ranges.
                let (x, g) = unsafe { (part(run.var, s, e), part(run.grad, s, e)) };
                let unscale = run.unscale;
                if momentum == 0.0 {
                    x.iter_mut().zip(g.iter()).for_each(|(x, &g)| *x -= lr * (g * unscale));
                    return;
                }
                // SAFETY: as above (SGD with momentum has its velocity).
                let v = unsafe { part(run.state[0], s, e) };
                for ((x, &g), v) in x.iter_mut().zip(g.iter()).zip(v) {
                    let g = g * unscale;
                    *v = momentum * *v - lr * g;
                    *x += if nesterov { momentum * *v - lr * g } else { *v };
                }
            }
            Rule::Adam { beta1, beta2, epsilon, .. } => {
                let (one_b1, one_b2, alpha, unscale) = (1.0 - beta1, 1.0 - beta2, run.alpha, run.unscale);
                // SAFETY: as above (Adam has m and v).
                let (x, g, m, v) = unsafe {
                    (
                        part(run.var, s, e),
                        part(run.grad, s, e),
                        part(run.state[0], s, e),
                        part(run.state[1], s, e),
                    )
                };
                for (((x, &g), m), v) in x.iter_mut().zip(g.iter()).zip(m).zip(v) {
                    let g = g * unscale;
                    *m += (g - *m) * one_b1;
                    *v += (g * g - *v) * one_b2;
                    *x -= alpha * *m / (v.sqrt() + epsilon);
                }
            }
        };
        let cost = match self {
            Rule::Sgd { .. } => 3,
            Rule::Adam { .. } => 6,
        };
        if parallel {
            par_ranges(n, cost, body);
        } else {
            body(0, n);
        }
    }
}

/// The gradient of a product update (`ir::Grad::Product`): aᵀ·b for a[M, R], b[M, C], made
/// `block` rows at a time into the kernel's tile; of half factors, summed in f32 and each
/// element rounded to their type (the half copy's gradient, widened).
struct Product {
    /// The factors' type: f32, or the half type the gradient is rounded to.
    factors: DType,
    /// One whole block's GEMM: block rows of aᵀ (columns of a, read in place) by b.
    gemm: Gemm,
    rows: usize,
    parallel: bool,
    /// Tiles of `gemm.m` x `gemm.n` floats, one per block being made at once.
    tiles: Mutex<Vec<Vec<f32>>>,
}

impl Product {
    fn take_tile(&self) -> Vec<f32> {
        self.tiles.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default()
    }

    fn give_back(&self, tile: Vec<f32>) {
        self.tiles.lock().unwrap_or_else(|e| e.into_inner()).push(tile);
    }
}

/// An optimizer update: its rule over `n` elements from element `offset` of the variable (a
/// tiled update's block, or a rank's shard), from a stored gradient (read from `grad_offset`)
/// or one it computes (`product`), with the state read from `state_offset` (a tiled update's
/// `offset`; 0 for a shard, whose state holds just the shard).
struct Update {
    rule: Rule,
    offset: usize,
    grad_offset: usize,
    state_offset: usize,
    n: usize,
    product: Option<Product>,
    /// Operand index of the first state tensor (`ir::Grad::state_start`).
    state_start: usize,
    /// Operand index of the gate (`ir::Op::update_gate`), where the update has one.
    gate: Option<usize>,
    desc: String,
}

/// Where an update writes and from what: (rows, the factors' type where the gradient is a
/// product, shard, gate operand) of the op.
pub(crate) type At = (Option<Rows>, Option<DType>, Option<Shard>, Option<usize>);

/// The gate's factor for a run: None where the gate is not finite (the update is skipped), 1
/// for an ungated update.
///
/// # Safety
/// `gate`, where given, indexes an input holding one f32 (`ir::infer` checked).
unsafe fn unscale(inputs: &[*mut u8], gate: Option<usize>) -> Option<f32> {
    match gate {
        // SAFETY: the contract above.
        Some(i) => Some(unsafe { *(inputs[i] as *const f32) }).filter(|g| g.is_finite()),
        None => Some(1.0),
    }
}

/// `rows` was checked against `var` (and a product's factors against it) by `ir::infer`.
pub(crate) fn sgd(lr: f32, momentum: f32, nesterov: bool, shapes: &[&Shape], at: At) -> Box<dyn CpuKernel> {
    let desc = format!("apply_sgd[lr {lr}, momentum {momentum}{}]", if nesterov { ", nesterov" } else { "" });
    update(Rule::Sgd { lr, momentum, nesterov }, desc, shapes, at)
}

/// `rows` was checked against `var` (and a product's factors against it) by `ir::infer`.
pub(crate) fn adam(hyper: [f32; 4], shapes: &[&Shape], at: At) -> Box<dyn CpuKernel> {
    let [lr, beta1, beta2, epsilon] = hyper;
    let desc = format!("apply_adam[lr {lr}, beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}]");
    update(Rule::Adam { lr, beta1, beta2, epsilon }, desc, shapes, at)
}

fn update(rule: Rule, name: String, shapes: &[&Shape], at: At) -> Box<dyn CpuKernel> {
    let (rows, product, shard, gate) = at;
    let var = shapes[0];
    let (offset, n, part) = Rows::span(rows, var);
    // A shard (`ir::infer` checked: no rows, no product, the state of the padded shard's shape,
    // the gradient the shard's or the variable's): the variable from the shard's first element,
    // the state from 0, the gradient from the shard's offset when it is the whole gradient.
    let (offset, grad_offset, state_offset, n, part) = match shard {
        Some(sh) => {
            let r = sh.range(var.numel());
            // (Where the shard's padded length is the variable's, both readings agree: then the
            // group has one rank, or the variable one element, and every other shard is empty.)
            let grad_offset = if shapes[1] == var { r.start } else { 0 };
            (
                r.start,
                grad_offset,
                0,
                r.len(),
                format!(" shard {} of {} ({}..{})", sh.rank, sh.ranks, r.start, r.end),
            )
        }
        None => (offset, 0, offset, n, part),
    };
    let grad = if product.is_some() { Grad::Product } else { Grad::Operand };
    let product = product.map(|factors| {
        let (m, r, c) = (shapes[1].dims()[0], var.dims()[0], var.dims()[1]);
        // At most a tile's rows; as many blocks as a multiple of the pool's threads, so that
        // the blocks made in parallel share the threads evenly.
        let most = (TILE_FLOATS / c.max(1)).clamp(1, r.max(1));
        let threads = rayon::current_num_threads().max(1);
        let blocks = r.div_ceil(most);
        let blocks = if blocks > 1 { blocks.div_ceil(threads) * threads } else { 1 };
        let block = r.div_ceil(blocks).clamp(1, most);
        Product {
            factors,
            gemm: Gemm { m: block, n: c, k: m, a: (1, r as isize), b: (c as isize, 1), out_rs: c as isize },
            rows: r,
            // Below the threshold the whole product would run on one thread (`matmul`): so do
            // the blocks, one after the other; above it they run in parallel (`run`).
            parallel: r * c * m >= SERIAL_MACS,
            tiles: Mutex::new(Vec::new()),
        }
    });
    let from = match &product {
        Some(p) => format!(
            " from {}ᵀ @ {} in blocks of {} rows",
            shape_text(shapes[1]),
            shape_text(shapes[2]),
            p.gemm.m
        ),
        None => String::new(),
    };
    let gated = if gate.is_some() { " gated" } else { "" };
    let desc = format!("{name} {}{part}{from}{gated}", shape_text(var));
    Box::new(Update {
        rule,
        offset,
        grad_offset,
        state_offset,
        n,
        product,
        state_start: grad.state_start(),
        gate,
        desc,
    })
}

impl CpuKernel for Update {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        // SAFETY (offsets): the variable holds offset + n elements and the state state_offset + n
        // (`rows` and `shard` checked against the variable's shape by `ir::infer`: a tiled
        // update's state is the variable's shape, a shard's holds the padded shard, n or more);
        // a stored gradient holds grad_offset + n (the block's or shard's n from 0, or the whole
        // variable's gradient read from the shard's offset).
        // A slot past the update's operands (SGD's second state slot, SGD without momentum's
        // first) is null, and so is one that would be the gate.
        let at = |i: usize, offset: usize| {
            SendPtr::new(
                inputs
                    .get(i)
                    .filter(|_| Some(i) != self.gate)
                    .map_or(std::ptr::null_mut(), |&p| unsafe { (p as *mut f32).add(offset) }),
            )
        };
        // SAFETY: `ir::infer` checked that a gate holds one f32.
        let Some(unscale) = (unsafe { unscale(inputs, self.gate) }) else { return };
        let state = [at(self.state_start, self.state_offset), at(self.state_start + 1, self.state_offset)];
        let alpha = match self.rule {
            // SAFETY: Adam's counter (after m and v) holds one element.
            Rule::Adam { .. } => self.rule.alpha(unsafe { *(inputs[self.state_start + 2] as *const f32) }),
            Rule::Sgd { .. } => 0.0,
        };
        let var = at(0, self.offset);
        let Some(p) = &self.product else {
            let grad = at(1, self.grad_offset);
            // SAFETY: var, grad and the state are distinct buffers of n elements from `at`.
            unsafe { self.rule.apply(Run { var, grad, state, alpha, unscale }, self.n, true) };
            return;
        };
        let (block, cols) = (p.gemm.m, p.gemm.n);
        let (a, b) = (SendPtr::new(inputs[1]), SendPtr::new(inputs[2]));
        let blocks = p.rows.div_ceil(block);
        // Block i: rows i·block.. of the gradient into `tile`, then applied; GEMM and update on
        // the rayon pool when `parallel`.
        let one = |i: usize, tile: &mut Vec<f32>, parallel: bool| {
            let r0 = i * block;
            let rows = block.min(p.rows - r0);
            tile.resize(block * cols, 0.0);
            let shift = |x: SendPtr<f32>| {
                // SAFETY: r0 < R, so r0 · C is inside the variable and its state.
                SendPtr::new(if x.get().is_null() { x.get() } else { unsafe { x.get().add(r0 * cols) } })
            };
            let run = Run {
                var: shift(var),
                grad: SendPtr::new(tile.as_mut_ptr()),
                state: state.map(shift),
                alpha,
                unscale,
            };
            // SAFETY: columns r0..r0 + rows of a[M, R] (strides (1, R) as rows of aᵀ) and b[M, C]
            // are valid, elements of the type both hold (`ir::infer` checked the factors against
            // the variable [R, C], and their one type, `p.factors` from the step); the tile
            // holds block x C floats and belongs to this block alone. The update then runs over
            // this block's rows x C elements of the variable and state, which no other block
            // touches (distinct variables, neither a factor: `product_updates` folds no update
            // that writes its own factor).
            unsafe {
                let (a, b) =
                    (Matrix::new(a.get(), p.factors).at(r0 as isize), Matrix::new(b.get(), p.factors));
                Gemm { m: rows, ..p.gemm }.run_mixed(a, b, Matrix::F32(tile.as_mut_ptr()), false, parallel);
                if p.factors.is_half() {
                    tile[..rows * cols].iter_mut().for_each(|g| *g = round_to(p.factors, *g));
                }
                self.rule.apply(run, rows * cols, parallel);
            }
        };
        if blocks == 1 || !p.parallel {
            let mut tile = p.take_tile();
            (0..blocks).for_each(|i| one(i, &mut tile, p.parallel));
            p.give_back(tile);
        } else {
            // Blocks in parallel, each GEMM and update on one thread: a block's GEMM on the
            // pool would cost as much in hand-offs and repacking as it gains (measured on the
            // mlp's 784x1024 gradient: 5.3 ms in 13 pooled blocks, against 3.2 ms for the stored
            // product and update).
            (0..blocks).into_par_iter().for_each(|i| {
                let mut tile = p.take_tile();
                one(i, &mut tile, false);
                p.give_back(tile);
            });
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct AssignAdd {
    value: f32,
    n: usize,
    gate: Option<usize>,
    desc: String,
}

pub(crate) fn assign_add(value: f32, var: &Shape, gate: Option<usize>) -> Box<dyn CpuKernel> {
    let gated = if gate.is_some() { " gated" } else { "" };
    Box::new(AssignAdd {
        value,
        n: var.numel(),
        gate,
        desc: format!("assign_add[{value}] {}{gated}", shape_text(var)),
    })
}

impl CpuKernel for AssignAdd {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        // SAFETY: `ir::infer` checked that a gate holds one f32.
        if unsafe { unscale(inputs, self.gate) }.is_none() {
            return;
        }
        let var = SendPtr::new(inputs[0] as *mut f32);
        // SAFETY: the variable holds n elements; tasks take disjoint ranges.
        par_ranges(self.n, 1, |s, e| unsafe { part(var, s, e) }.iter_mut().for_each(|x| *x += self.value));
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct UpdateLossScale {
    growth: f32,
    backoff: f32,
    interval: u32,
}

pub(crate) fn update_loss_scale(growth: f32, backoff: f32, interval: u32) -> Box<dyn CpuKernel> {
    Box::new(UpdateLossScale { growth, backoff, interval })
}

/// GradScaler's update of (scale, good steps) from the step's gate: the CPU's and the CUDA
/// kernel's arithmetic (`cuda::optim::update_loss_scale`).
pub(crate) fn loss_scale_after(
    scale: f32,
    good: f32,
    gate: f32,
    growth: f32,
    backoff: f32,
    interval: u32,
) -> (f32, f32) {
    if !gate.is_finite() {
        return (scale * backoff, 0.0);
    }
    let good = good + 1.0;
    if good >= interval as f32 {
        let grown = scale * growth;
        (if grown.is_finite() { grown } else { scale }, 0.0)
    } else {
        (scale, good)
    }
}

impl CpuKernel for UpdateLossScale {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        let [scale, good, gate] = [0, 1, 2].map(|i| inputs[i] as *mut f32);
        // SAFETY: the three operands hold one f32 each (`ir::infer` checked); scale and good
        // steps are distinct variables, the gate a value.
        unsafe {
            let (s, g) = loss_scale_after(*scale, *good, *gate, self.growth, self.backoff, self.interval);
            *scale = s;
            *good = g;
        }
    }

    fn describe(&self) -> String {
        format!(
            "update_loss_scale[growth {}, backoff {}, interval {}]",
            self.growth, self.backoff, self.interval
        )
    }
}
