use super::{Layer, invalid_layer};
use crate::ir::{Init, Shape};
use crate::trace::Tensor;

/// Layer normalisation over the last axis with a learned scale and offset (Keras
/// `LayerNormalization`, epsilon 1e-3 by default), composed from the DSL's ops:
/// (x - mean) * rsqrt(var + eps) * gamma + beta.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    pub epsilon: f32,
}

impl LayerNorm {
    pub fn new() -> Self {
        LayerNorm { epsilon: 1e-3 }
    }

    pub fn epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }
}

impl Default for LayerNorm {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer for LayerNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        if !(self.epsilon.is_finite() && self.epsilon >= 0.0) {
            return invalid_layer(
                x,
                self.kind(),
                format!("epsilon is {}", self.epsilon),
                "use a small finite epsilon >= 0 (Keras's default is 1e-3)",
            );
        }
        let t = x.tracer();
        let d = x.dims().last().copied().unwrap_or(1);
        let gamma = t.param("gamma", Shape::new([d]), Init::Constant(1.0));
        let beta = t.param("beta", Shape::new([d]), Init::Zeros);
        let centered = x - x.mean(-1, true);
        let var = centered.square().mean(-1, true);
        centered * (var + self.epsilon).rsqrt() * gamma + beta
    }

    fn kind(&self) -> &'static str {
        "layer_normalization"
    }
}
