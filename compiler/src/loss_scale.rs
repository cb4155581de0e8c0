//! Dynamic loss scaling for f16 mixed precision, inside the plan.
//!
//! f16 keeps 5 exponent bits: a gradient below 2^-24 flushes to zero, one above 65,504
//! overflows. A training step in f16 therefore differentiates the loss times a scale S, so
//! that small gradients stay representable, and divides the gradients by S before the update;
//! where S was too large, a gradient is not finite and the step is skipped, and S shrinks.
//! This is PyTorch's `GradScaler` with its defaults (S starts at 2^16, halves after a step whose
//! gradients are not all finite, doubles after 2,000 finite steps in a row); bf16 has f32's
//! exponent range and needs none.
//!
//! GradScaler reads the overflow flag on the host (`scaler.step` syncs, or skips with a
//! device-side `_foreach` check and a host read of `found_inf`); here the whole decision is
//! part of the step's graph, so the plan runs with no host synchronisation:
//!
//! - the loss output stays the unscaled loss; autodiff differentiates `loss · scale`, a
//!   persistent one-element variable (`SCALE_KEY`);
//! - the gate, one f32 element, is `1/scale + Σ_g sum(g · 0)` over every parameter gradient:
//!   `g · 0` is 0 for a finite element and NaN for an infinite or NaN one, so the gate is the
//!   unscale factor 1/S when every gradient is finite and NaN otherwise (a sum of zeros never
//!   overflows, as a sum of the gradients themselves could);
//! - every optimizer update and Adam's step counter take the gate as their last operand
//!   (`Op::update_gate`): where it is not finite they change nothing, and otherwise an update
//!   multiplies its gradient by it as it reads it: unscaling costs no pass over the gradients;
//! - `Op::UpdateLossScale` updates the scale and the count of finite steps (`GOOD_STEPS_KEY`)
//!   from the gate, after every reader of the scale (`passes::effects`).
//!
//! Data parallelism (`data_parallel`, `zero`): the check reads the gradients the updates read,
//! averaged over the ranks (`redirect_checks`), the same bits on every rank, so every rank
//! skips the same steps and the weights stay identical; the gradients' buckets stay copy-free
//! (the check is no second reader of a gradient before its bucket). Under ZeRO stage 2 each
//! rank holds only its shard of the averaged gradient, so it checks its own gradients and the
//! checks' total is summed over the ranks (`agree_across_ranks`); of finite gradients whose
//! average overflows f32 (near 10^38) the update's is then not finite and goes unchecked.
//!
//! What it costs: the check reads every gradient once, and every update waits for the last
//! gradient, so the step holds all parameter gradients at once, as PyTorch does (its `.grad`
//! tensors persist until `step`); plain f32 and bf16 steps apply each update as soon as its
//! gradient is made. The updates also cannot compute their gradient's product themselves
//! (`product_updates`) or be tiled (`tiled_updates`): the check must read the stored gradient.

use crate::ir::{DType, Graph, Init, Node, Op, ReduceOp, Shape, VarRole};
use crate::trace::Tensor;

/// The name of the sum of every gradient's finite check (0, or NaN).
pub const NONFINITE_NAME: &str = "loss_scale/nonfinite";
/// The name of each gradient's `g · 0`, the check's reader of the gradient.
pub const CHECK_NAME: &str = "loss_scale/check";

/// The key of the loss scale variable (one f32 element, a `VarRole::Counter`).
pub const SCALE_KEY: &str = "loss_scale/scale";
/// The key of the count of finite steps since the scale last changed (one f32 element).
pub const GOOD_STEPS_KEY: &str = "loss_scale/good_steps";

/// The dynamic loss scale's schedule; `Default` is GradScaler's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale {
    /// The scale of the first step (2^16).
    pub init: f32,
    /// The factor the scale grows by after `interval` finite steps in a row (2).
    pub growth: f32,
    /// The factor the scale shrinks by after a step whose gradients are not all finite (0.5).
    pub backoff: f32,
    /// The finite steps in a row after which the scale grows (2,000).
    pub interval: u32,
}

impl Default for LossScale {
    fn default() -> Self {
        LossScale { init: 65536.0, growth: 2.0, backoff: 0.5, interval: 2000 }
    }
}

/// The scaled loss a training step differentiates, and the scale variable it was multiplied by.
pub struct Scaled {
    /// `loss · scale`, what autodiff differentiates.
    pub loss: Tensor,
    /// The scale variable.
    pub scale: Tensor,
}

impl LossScale {
    /// Declares the scale and multiplies `loss` by it (on the loss's device).
    pub fn scale(&self, loss: &Tensor) -> Scaled {
        let t = loss.tracer();
        let scale = t.on_device(loss.device(), || {
            t.variable(SCALE_KEY, Shape::scalar(), DType::F32, VarRole::Counter, Init::Constant(self.init))
        });
        let scaled = t.on_device(loss.device(), || loss.mul(&scale).named("loss_scale/scaled_loss"));
        Scaled { loss: scaled, scale }
    }

    /// The gate of the updates of `grads`: 1/scale where every gradient is finite, NaN where
    /// one is not; and the effect that updates the scale and the good-step count from it.
    pub fn gate(&self, scale: &Tensor, grads: &[&Tensor]) -> Tensor {
        let t = scale.tracer();
        // Each gradient checked where it is (a model placed over devices copies one scalar per
        // gradient to the scale's device, not the gradient).
        let checks: Vec<Tensor> = grads
            .iter()
            .map(|g| {
                t.on_device(g.device(), || {
                    let zeros = g.mul(0.0).named(CHECK_NAME);
                    if zeros.shape().rank() == 0 { zeros } else { zeros.sum(.., false) }
                })
            })
            .collect();
        t.on_device(scale.device(), || {
            let mut total: Option<Tensor> = None;
            for s in checks {
                total = Some(match total {
                    Some(t) => t.add(&s),
                    None => s,
                });
            }
            let inverse = scale.reciprocal();
            let gate = match total {
                Some(total) => inverse.add(total.named(NONFINITE_NAME)),
                None => inverse,
            }
            .named("loss_scale/gate");
            let good = t.variable(GOOD_STEPS_KEY, Shape::scalar(), DType::F32, VarRole::Counter, Init::Zeros);
            let op =
                Op::UpdateLossScale { growth: self.growth, backoff: self.backoff, interval: self.interval };
            scale.record(op, &[scale, &good, &gate]);
            gate
        })
    }
}

/// Makes the ranks of a data-parallel step agree on skipping it: the total of the gradients'
/// finite checks (`NONFINITE_NAME`) is summed over the ranks before the gate reads it, 0 where
/// every rank's gradients are finite and NaN where one is not. Returns whether the step has a
/// check; a check already summed is left as it is.
pub fn agree_across_ranks(graph: &mut Graph) -> bool {
    let Some(total) = graph.node_ids().find(|&n| {
        graph.node(n).name.as_deref() == Some(NONFINITE_NAME)
            && !matches!(graph.node(n).op, Op::AllReduce { .. })
    }) else {
        return false;
    };
    let users = graph.users(total);
    if users.iter().any(|&u| matches!(graph.node(u).op, Op::AllReduce { .. })) {
        return true;
    }
    let node = graph.node(total).clone();
    let summed = graph.add(
        Node { op: Op::AllReduce { op: ReduceOp::Sum }, name: Some(NONFINITE_NAME.into()), ..node },
        &[total],
    );
    for u in users {
        if let Some(i) = graph.operands(u).iter().position(|&o| o == total) {
            graph.replace_operand(u, i, summed);
        }
    }
    true
}

/// After `data_parallel` pointed `update` at the averaged gradient `averaged` in place of its own
/// gradient `grad`: the finite check of `grad` (`CHECK_NAME`) reads the averaged one too, so
/// that every rank checks the same bits.
pub fn redirect_checks(graph: &mut Graph, grad: crate::ir::NodeId, averaged: crate::ir::NodeId) {
    for u in graph.users(grad) {
        if graph.node(u).name.as_deref() == Some(CHECK_NAME)
            && graph.node(u).shape == graph.node(averaged).shape
            && let Some(i) = graph.operands(u).iter().position(|&o| o == grad)
        {
            graph.replace_operand(u, i, averaged);
        }
    }
}
