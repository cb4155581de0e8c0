use super::{Activation, Layer, invalid_layer};
use crate::ir::{Init, Shape};
use crate::trace::Tensor;

/// `activation(x · kernel + bias)` over the last axis of `x`; kernel [in, units], bias [units].
#[derive(Clone, Debug)]
pub struct Dense {
    pub units: usize,
    pub activation: Activation,
    pub use_bias: bool,
    pub kernel_init: Init,
    pub name: Option<String>,
}

impl Dense {
    pub fn new(units: usize) -> Self {
        Dense {
            units,
            activation: Activation::Linear,
            use_bias: true,
            kernel_init: Init::GlorotUniform,
            name: None,
        }
    }

    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    pub fn relu(self) -> Self {
        self.activation(Activation::Relu)
    }

    pub fn sigmoid(self) -> Self {
        self.activation(Activation::Sigmoid)
    }

    pub fn without_bias(mut self) -> Self {
        self.use_bias = false;
        self
    }

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
