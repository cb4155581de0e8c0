//! Keras-like layers built on the DSL's ops. A layer declares its parameters when it is first
//! called, from the shape of its input, inside a name scope that `Sequential` gives it
//! (`dense/kernel`, `dense_1/kernel`, ...), so retracing with another batch size finds the same
//! variables.

mod activation;
mod attention;
mod conv;
mod dense;
mod embedding;
mod norm;
mod residual;
mod sequential;

pub use activation::Activation;
pub use attention::MultiHeadAttention;
pub use conv::{Conv2D, Flatten, Pool2D};
pub use dense::Dense;
pub use embedding::Embedding;
pub use norm::LayerNorm;
pub use residual::Residual;
pub use sequential::Sequential;

use crate::trace::Tensor;

/// A model or a piece of one: a function from one tensor to another that may declare parameters.
pub trait Layer {
    fn forward(&self, x: &Tensor) -> Tensor;

    /// The name scope `Sequential` derives (Keras style: `dense`, `dense_1`, ...).
    fn kind(&self) -> &'static str;

    /// An explicit scope name, if the user gave one.
    fn name(&self) -> Option<&str> {
        None
    }
}

/// Any `Fn(&Tensor) -> Tensor` is a layer without parameters of its own.
impl<F: Fn(&Tensor) -> Tensor> Layer for F {
    fn forward(&self, x: &Tensor) -> Tensor {
        self(x)
    }

    fn kind(&self) -> &'static str {
        "lambda"
    }
}
