use crate::trace::Tensor;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activation {
    #[default]
    Linear,
    Relu,
    Sigmoid,
    Tanh,
    Gelu,
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
            Activation::Softmax => x.softmax(-1),
        }
    }
}
