//! Keras-like layers built on the DSL's ops. A layer declares its parameters when it is first
//! called, from the shape of its input, inside a name scope that `Sequential` gives it
//! (`dense/kernel`, `dense_1/kernel`, ...), so retracing with another batch size finds the same
//! variables.

mod activation;
mod attention;
mod conv;
mod dense;
mod dropout;
mod embedding;
mod norm;
mod residual;
mod sequential;

pub use activation::Activation;
pub use attention::MultiHeadAttention;
pub use conv::{Conv2D, DepthwiseConv2D, Flatten, Pool2D};
pub use dense::Dense;
pub use dropout::{Dropout, uniform_per_step};
pub use embedding::{Embedding, PositionEmbedding, TiedOutput};
pub use norm::{LayerNorm, RmsNorm};
pub use residual::Residual;
pub use sequential::Sequential;

use crate::trace::Tensor;

/// A model or a piece of one: a function from one tensor to another that may declare parameters.
pub trait Layer {
    /// Traces the layer on `x` and returns its output, declaring the layer's variables on first use.
    /// Errors name the caller's line (every implementation is `#[track_caller]`).
    #[track_caller]
    fn forward(&self, x: &Tensor) -> Tensor;

    /// The name scope `Sequential` derives (Keras style: `dense`, `dense_1`, ...).
    fn kind(&self) -> &'static str;

    /// An explicit scope name, if the user gave one.
    fn name(&self) -> Option<&str> {
        None
    }
}

/// Records that a layer's options are unusable (zero units, a zero-size window, ...) and returns
/// a poisoned tensor: `finish` reports the error, naming the layer by its scope (`dense_1`) and
/// kind, the option and its value.
#[track_caller]
pub(crate) fn invalid_layer(x: &Tensor, kind: &str, what: String, help: &str) -> Tensor {
    let t = x.tracer();
    let scope = t.scope_path();
    let layer = if scope.is_empty() { format!("layer {kind}") } else { format!("layer `{scope}` ({kind})") };
    t.report(kind, format!("{layer}: {what}"), &[x], help)
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
