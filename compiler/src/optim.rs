//! Optimizers as graph builders: each appends in-place update ops (effects) for every parameter,
//! with its state in persistent variables keyed `optimizer/<parameter>/<slot>`. Defaults follow Keras.

use crate::ir::{DType, Init, Op, Shape, VarRole};
use crate::trace::Tensor;

/// Stochastic gradient descent, optionally with (Nesterov) momentum, as Keras 3's `SGD`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// The step size each update multiplies the gradient (or the velocity) by.
    pub learning_rate: f32,
    /// The velocity's decay per step, in `[0, 1)`; 0 (the default) keeps no velocity variable.
    pub momentum: f32,
    /// Whether the update looks ahead along the velocity (Nesterov momentum); false by default.
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD at `learning_rate`: no momentum.
    pub fn new(learning_rate: f32) -> Self {
        Sgd { learning_rate, momentum: 0.0, nesterov: false }
    }

    /// Sets the momentum (a `velocity` slot per parameter when not 0).
    pub fn momentum(mut self, momentum: f32) -> Self {
        self.momentum = momentum;
        self
    }

    /// Turns on Nesterov momentum.
    pub fn nesterov(mut self) -> Self {
        self.nesterov = true;
        self
    }
}

/// Adam with Keras's defaults: beta_1 0.9, beta_2 0.999, epsilon 1e-7.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// The step size of each update.
    pub learning_rate: f32,
    /// The decay of the first-moment estimate `m` per step, in `[0, 1)`.
    pub beta_1: f32,
    /// The decay of the second-moment estimate `v` per step, in `[0, 1)`.
    pub beta_2: f32,
    /// Added to the square root of `v` in the update's denominator, for stability (above 0).
    pub epsilon: f32,
}

impl Adam {
    /// Adam at `learning_rate` with Keras's betas and epsilon.
    pub fn new(learning_rate: f32) -> Self {
        Adam { learning_rate, beta_1: 0.9, beta_2: 0.999, epsilon: 1e-7 }
    }
}

/// The optimizer of a training step: which update ops `apply` appends.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// Stochastic gradient descent.
    Sgd(Sgd),
    /// Adam (`m` and `v` slots per parameter and one shared step counter).
    Adam(Adam),
}

impl From<Sgd> for Optimizer {
    fn from(o: Sgd) -> Self {
        Optimizer::Sgd(o)
    }
}

impl From<Adam> for Optimizer {
    fn from(o: Adam) -> Self {
        Optimizer::Adam(o)
    }
}

/// The key of optimizer state `slot` for the parameter `key`.
pub fn slot_key(key: &str, slot: &str) -> String {
    format!("optimizer/{key}/{slot}")
}

/// The key of Adam's step counter (a scalar `VarRole::Counter`, advanced once per step).
pub const ITERATIONS_KEY: &str = "optimizer/iterations";

impl Optimizer {
    /// `"sgd"` or `"adam"`, for messages and reports.
    pub fn name(&self) -> &'static str {
        match self {
            Optimizer::Sgd(_) => "sgd",
            Optimizer::Adam(_) => "adam",
        }
    }

    /// Checks the hyperparameters: a finite learning rate above 0, momentum and betas in [0, 1),
    /// a finite epsilon above 0. The error names the optimizer, the value and what to use.
    pub fn check(&self) -> Result<(), String> {
        let positive = |name: &str, v: f32| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(format!("{self:?}: {name} is {v}, not a finite number above 0"))
            }
        };
        let unit = |name: &str, v: f32| {
            if (0.0..1.0).contains(&v) {
                Ok(())
            } else {
                Err(format!("{self:?}: {name} is {v}, outside [0, 1)"))
            }
        };
        match *self {
            Optimizer::Sgd(o) => {
                positive("the learning rate", o.learning_rate)?;
                unit("momentum", o.momentum)
            }
            Optimizer::Adam(o) => {
                positive("the learning rate", o.learning_rate)?;
                unit("beta_1", o.beta_1)?;
                unit("beta_2", o.beta_2)?;
                positive("epsilon", o.epsilon)
            }
        }
    }

    /// Appends one update per (parameter, gradient) pair and returns the effect nodes.
    pub fn apply(&self, updates: &[(Tensor, String, Tensor)]) -> Vec<Tensor> {
        self.apply_gated(updates, None)
    }

    /// `apply` with every update (and Adam's step counter) gated by `gate`, one f32 element
    /// (`Op::update_gate`): skipped where it is not finite, the gradient multiplied by it
    /// otherwise (loss scaling's unscale factor, `crate::loss_scale`).
    pub fn apply_gated(&self, updates: &[(Tensor, String, Tensor)], gate: Option<&Tensor>) -> Vec<Tensor> {
        let Some((first, _, _)) = updates.first() else { return vec![] };
        let gated = |operands: &[&Tensor]| -> Vec<Tensor> {
            operands.iter().map(|&t| t.clone()).chain(gate.cloned()).collect()
        };
        let record = |var: &Tensor, op: Op, operands: &[&Tensor]| {
            let operands = gated(operands);
            var.record(op, &operands.iter().collect::<Vec<_>>())
        };
        let tracer = first.tracer();
        let state = |key: &str, slot: &str, shape: &Shape| {
            tracer.variable(
                &slot_key(key, slot),
                shape.clone(),
                DType::F32,
                VarRole::OptimizerState,
                Init::Zeros,
            )
        };
        let mut effects = Vec::new();
        match *self {
            Optimizer::Sgd(o) => {
                let op = Op::ApplySgd {
                    lr: o.learning_rate,
                    momentum: o.momentum,
                    nesterov: o.nesterov,
                    rows: None,
                    product: false,
                    shard: None,
                };
                for (var, key, grad) in updates {
                    // State and update live on the variable's device.
                    let effect = tracer.on_device(var.device(), || {
                        if o.momentum != 0.0 {
                            let velocity = state(key, "velocity", var.shape());
                            record(var, op.clone(), &[var, grad, &velocity])
                        } else {
                            record(var, op.clone(), &[var, grad])
                        }
                    });
                    effects.push(effect);
                }
            }
            Optimizer::Adam(o) => {
                let iterations = tracer.variable(
                    ITERATIONS_KEY,
                    Shape::scalar(),
                    DType::F32,
                    VarRole::Counter,
                    Init::Zeros,
                );
                let op = Op::ApplyAdam {
                    lr: o.learning_rate,
                    beta1: o.beta_1,
                    beta2: o.beta_2,
                    epsilon: o.epsilon,
                    rows: None,
                    product: false,
                    shard: None,
                };
                for (var, key, grad) in updates {
                    effects.push(tracer.on_device(var.device(), || {
                        let (m, v) = (state(key, "m", var.shape()), state(key, "v", var.shape()));
                        record(var, op.clone(), &[var, grad, &m, &v, &iterations])
                    }));
                }
                effects.push(record(&iterations, Op::AssignAdd { value: 1.0 }, &[&iterations]));
            }
        }
        effects
    }
}
