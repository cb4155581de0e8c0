use crate::trace::Tensor;

/// The nonlinearity a layer applies to its output.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    /// The identity: no activation (the default).
    #[default]
    Linear,
    /// `max(x, 0)`.
    Relu,
    /// The logistic sigmoid, 1 / (1 + e^-x).
    Sigmoid,
    /// The hyperbolic tangent.
    Tanh,
    /// Exact GELU, x·Φ(x) (Keras's and PyTorch's default).
    Gelu,
    /// GELU's tanh approximation (JAX's default): `Tensor::gelu_tanh`.
    GeluTanh,
    /// Softmax over the last axis.
    Softmax,
}

impl Activation {
    /// Traces the activation on `x` (`Linear` returns `x` itself, recording nothing).
    #[track_caller]
    pub fn apply(self, x: &Tensor) -> Tensor {
        match self {
            Activation::Linear => x.clone(),
            Activation::Relu => x.relu(),
            Activation::Sigmoid => x.sigmoid(),
            Activation::Tanh => x.tanh(),
            Activation::Gelu => x.gelu(),
            Activation::GeluTanh => x.gelu_tanh(),
            Activation::Softmax => x.softmax(-1),
        }
    }
}
