//! Dropout: in a training step, each element is zeroed with probability `rate` and the others
//! scaled by 1 / (1 - rate) (inverted dropout, as Keras and PyTorch do); at inference (predict,
//! evaluate) the layer is the identity.
//!
//! The mask comes from a deterministic generator in the plan, not the host: `Op::RandomUniform`
//! of a seed (the layer's scope, hashed) and a step counter (the variable `dropout/step`,
//! advanced once per training step), so a run is reproducible bit for bit on every backend, and
//! resuming from a checkpoint resumes the masks. The mask is never stored: the generator is
//! cheap, so fusion computes it inside the forward group and again inside the gradient's
//! (`fusion::split_cheap`), where PyTorch keeps a byte per element between the two.

use super::{Layer, invalid_layer};
use crate::ir::{DType, Init, Op, Shape, VarRole};
use crate::trace::Tensor;

/// The step counter every dropout layer of a model reads.
pub const STEP_KEY: &str = "dropout/step";

/// Inverted dropout (see the module's doc): zeroes elements with probability `rate` in training
/// steps, the identity at inference.
#[derive(Clone, Debug)]
pub struct Dropout {
    /// The probability that an element is zeroed, in `[0, 1)`; 0 makes the layer the identity.
    pub rate: f32,
}

impl Dropout {
    /// A dropout layer of the given rate (checked when the layer is traced).
    pub fn new(rate: f32) -> Self {
        Dropout { rate }
    }
}

/// FNV-1a of the layer's scope: a seed per layer, the same in every trace of the model.
fn seed_of(scope: &str) -> u64 {
    scope.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01B3))
}

/// Uniform values in [0, 1) of `shape`, new every training step: dropout's generator
/// (`Op::RandomUniform` of a seed from the scope and `name`, and the step counter `STEP_KEY`,
/// advanced once per step however many layers draw), for any op that draws (an imported
/// `RandomUniformLike`: stochastic depth).
pub fn uniform_per_step(t: &crate::trace::Tracer, shape: Shape, name: &str) -> Tensor {
    let first = t.with_graph(|g| g.variable(STEP_KEY).is_none());
    let step = t.tied_variable(STEP_KEY, Shape::scalar(), DType::F32, VarRole::Counter, Init::Zeros);
    if first {
        // Advanced after every reader of this step's value (effects are ordered after their
        // variable's readers).
        step.record(Op::AssignAdd { value: 1.0 }, &[&step]);
    }
    let scope = t.scope_path();
    let seed = if name.is_empty() { seed_of(&scope) } else { seed_of(&format!("{scope}/{name}")) };
    t.random_uniform(shape, seed, &step)
}

impl Layer for Dropout {
    fn forward(&self, x: &Tensor) -> Tensor {
        if !(0.0..1.0).contains(&self.rate) {
            return invalid_layer(
                x,
                self.kind(),
                format!("Dropout::new({}) is not a rate in [0, 1)", self.rate),
                "drop a fraction of the elements in [0, 1): 0.1 is common",
            );
        }
        let t = x.tracer();
        if !t.training() || self.rate == 0.0 {
            return x.clone();
        }
        let keep = uniform_per_step(&t, x.shape().clone(), "").ge(self.rate);
        x * &keep * (1.0 / (1.0 - self.rate))
    }

    fn kind(&self) -> &'static str {
        "dropout"
    }
}
