use super::Layer;
use crate::trace::Tensor;

/// `x + inner(x)`: a residual connection around any layer.
pub struct Residual {
    inner: Box<dyn Layer>,
}

impl Residual {
    /// Wraps `inner`: the layer's output is `x + inner(x)`, which needs `inner` to keep `x`'s shape.
    pub fn new(inner: impl Layer + 'static) -> Self {
        Residual { inner: Box::new(inner) }
    }
}

impl Layer for Residual {
    fn forward(&self, x: &Tensor) -> Tensor {
        x + self.inner.forward(x)
    }

    fn kind(&self) -> &'static str {
        "residual"
    }
}
