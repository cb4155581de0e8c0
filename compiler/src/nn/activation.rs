use crate::trace::Tensor;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    #[default]
    Linear,
    Relu,
    Sigmoid,
    Tanh,
    /// Exact GELU, x·Φ(x) (Keras's and PyTorch's default).
    Gelu,
    /// GELU's tanh approximation (JAX's default): `Tensor::gelu_tanh`.
    GeluTanh,
    /// Softmax over the last axis.
    Softmax,
}

impl Activation {
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
