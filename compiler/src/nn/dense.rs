use super::{Activation, Layer, invalid_layer};
use crate::ir::{Init, Shape};
use crate::trace::Tensor;

/// `activation(x · kernel + bias)` over the last axis of `x`; kernel `[in, units]`, bias `[units]`.
#[derive(Clone, Debug)]
pub struct Dense {
    /// The output width: the size of the result's last axis (at least 1).
    pub units: usize,
    /// The activation applied after the bias (`Activation::Linear` by default: none).
    pub activation: Activation,
    /// Whether a bias `[units]` (zeros at first) is added; true by default.
    pub use_bias: bool,
    /// How the kernel variable is initialised (`Init::GlorotUniform` by default).
    pub kernel_init: Init,
    /// The layer's scope name instead of the derived one (`dense`, `dense_1`, ...); `None`: derived.
    pub name: Option<String>,
}

impl Dense {
    /// A layer of `units` outputs: linear, with a bias, Glorot-uniform kernel.
    pub fn new(units: usize) -> Self {
        Dense {
            units,
            activation: Activation::Linear,
            use_bias: true,
            kernel_init: Init::GlorotUniform,
            name: None,
        }
    }

    /// Sets the activation applied to the output.
    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Applies ReLU to the output.
    pub fn relu(self) -> Self {
        self.activation(Activation::Relu)
    }

    /// Applies the logistic sigmoid to the output.
    pub fn sigmoid(self) -> Self {
        self.activation(Activation::Sigmoid)
    }

    /// Drops the bias: the layer is `activation(x · kernel)`.
    pub fn without_bias(mut self) -> Self {
        self.use_bias = false;
        self
    }

    /// Names the layer's scope `name` in place of the derived one (variables `name/kernel`, ...).
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }
}

impl Layer for Dense {
    fn forward(&self, x: &Tensor) -> Tensor {
        if self.units == 0 {
            return invalid_layer(
                x,
                self.kind(),
                "Dense::new(0) has no units".into(),
                "give the layer at least one unit",
            );
        }
        let t = x.tracer();
        let input = x.dims().last().copied().unwrap_or(1);
        let kernel = t.param("kernel", [input, self.units], self.kernel_init);
        let mut y = x.matmul(&kernel);
        if self.use_bias {
            y = y + t.param("bias", Shape::new([self.units]), Init::Zeros);
        }
        self.activation.apply(&y)
    }

    fn kind(&self) -> &'static str {
        "dense"
    }

    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}
