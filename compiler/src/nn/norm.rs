use super::{Layer, invalid_layer};
use crate::ir::{Init, Shape};
use crate::trace::Tensor;

/// Layer normalisation over the last axis (Keras `LayerNormalization`, PyTorch `LayerNorm`,
/// flax `LayerNorm`), composed from the DSL's ops: (x - mean) * rsqrt(var + eps), then times a
/// learned scale `gamma` (`scale`, on by default) and plus a learned offset `beta` (`center`, on
/// by default). Epsilon is 1e-3 by default, Keras's; PyTorch's is 1e-5 and flax's 1e-6: set it
/// when porting a model.
#[derive(Clone, Debug)]
pub struct LayerNorm {
    /// Added to the variance before the reciprocal square root (finite, >= 0; 1e-3 by default).
    pub epsilon: f32,
    /// A learned offset `beta` (Keras `center`; PyTorch `bias`).
    pub center: bool,
    /// A learned scale `gamma` (Keras `scale`; PyTorch `elementwise_affine`).
    pub scale: bool,
}

impl LayerNorm {
    /// Keras's defaults: epsilon 1e-3, with a learned scale and offset.
    pub fn new() -> Self {
        LayerNorm { epsilon: 1e-3, center: true, scale: true }
    }

    /// Sets epsilon (PyTorch's default is 1e-5).
    pub fn epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// Whether to learn the offset `beta` (`[last axis]`, zeros at first).
    pub fn center(mut self, center: bool) -> Self {
        self.center = center;
        self
    }

    /// Whether to learn the scale `gamma` (`[last axis]`, ones at first).
    pub fn scale(mut self, scale: bool) -> Self {
        self.scale = scale;
        self
    }
}

impl Default for LayerNorm {
    fn default() -> Self {
        Self::new()
    }
}

/// An epsilon mistake as a traced error naming the layer.
#[track_caller]
fn check_epsilon(x: &Tensor, kind: &'static str, epsilon: f32, default: &str) -> Option<Tensor> {
    if epsilon.is_finite() && epsilon >= 0.0 {
        return None;
    }
    Some(invalid_layer(
        x,
        kind,
        format!("epsilon is {epsilon}"),
        &format!("use a small finite epsilon >= 0 ({default})"),
    ))
}

impl Layer for LayerNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        if let Some(e) =
            check_epsilon(x, self.kind(), self.epsilon, "Keras's default is 1e-3, PyTorch's 1e-5")
        {
            return e;
        }
        let t = x.tracer();
        let d = x.dims().last().copied().unwrap_or(1);
        let centered = x - x.mean(-1, true);
        let var = centered.square().mean(-1, true);
        let mut y = centered * (var + self.epsilon).rsqrt();
        if self.scale {
            y = y * t.param("gamma", Shape::new([d]), Init::Constant(1.0));
        }
        if self.center {
            y = y + t.param("beta", Shape::new([d]), Init::Zeros);
        }
        y
    }

    fn kind(&self) -> &'static str {
        "layer_normalization"
    }
}

/// Root-mean-square normalisation over the last axis (Zhang & Sennrich 2019; Keras
/// `RMSNormalization`, PyTorch `RMSNorm`, flax `RMSNorm`): x * rsqrt(mean(x²) + eps) * gamma,
/// no centring and no offset. Epsilon is 1e-6 by default, Keras's and flax's.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    /// Added to the mean square before the reciprocal square root (finite, >= 0; 1e-6 by default).
    pub epsilon: f32,
    /// A learned scale `gamma` (on by default).
    pub scale: bool,
}

impl RmsNorm {
    /// Epsilon 1e-6, with a learned scale.
    pub fn new() -> Self {
        RmsNorm { epsilon: 1e-6, scale: true }
    }

    /// Sets epsilon.
    pub fn epsilon(mut self, epsilon: f32) -> Self {
        self.epsilon = epsilon;
        self
    }

    /// Whether to learn the scale `gamma` (`[last axis]`, ones at first).
    pub fn scale(mut self, scale: bool) -> Self {
        self.scale = scale;
        self
    }
}

impl Default for RmsNorm {
    fn default() -> Self {
        Self::new()
    }
}

impl Layer for RmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        if let Some(e) = check_epsilon(x, self.kind(), self.epsilon, "Keras's and flax's default is 1e-6") {
            return e;
        }
        let d = x.dims().last().copied().unwrap_or(1);
        let y = x * (x.square().mean(-1, true) + self.epsilon).rsqrt();
        if self.scale { y * x.tracer().param("gamma", Shape::new([d]), Init::Constant(1.0)) } else { y }
    }

    fn kind(&self) -> &'static str {
        "rms_normalization"
    }
}
