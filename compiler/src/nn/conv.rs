use super::{Activation, Layer, invalid_layer};
use crate::ir::{Init, Padding, Shape, Window2d};
use crate::trace::Tensor;

/// 2-D convolution over NHWC inputs with an HWIO kernel `[kh, kw, in, filters]` (Keras `Conv2D`).
#[derive(Clone, Debug)]
pub struct Conv2D {
    /// The number of output channels (the kernel's last axis; at least 1).
    pub filters: usize,
    /// The kernel's window `[height, width]`, in elements.
    pub kernel: [usize; 2],
    /// The step between windows `[along height, along width]`; `[1, 1]` by default.
    pub stride: [usize; 2],
    /// `Padding::Valid` (none, the default), `Padding::Same` (output size `ceil(in / stride)`)
    /// or `Padding::Explicit` (asymmetric pads before and after).
    pub padding: Padding,
    /// The step between the kernel's taps `[along height, along width]`; `[1, 1]` by default.
    pub dilation: [usize; 2],
    /// Channel groups: the input's and the filters' channels split into this many groups, each
    /// convolved on its own (1 by default; the input's channels for a depthwise convolution).
    pub groups: usize,
    /// The activation applied after the bias (`Activation::Linear` by default: none).
    pub activation: Activation,
    /// Whether a bias `[filters]` (zeros at first) is added; true by default.
    pub use_bias: bool,
    /// The layer's scope name instead of the derived one (`conv2d`, `conv2d_1`, ...); `None`: derived.
    pub name: Option<String>,
}

impl Conv2D {
    /// A convolution of `filters` output channels over a `kernel` window: stride 1, valid padding,
    /// a bias, no activation, Glorot-uniform kernel.
    pub fn new(filters: usize, kernel: [usize; 2]) -> Self {
        Conv2D {
            filters,
            kernel,
            stride: [1, 1],
            padding: Padding::Valid,
            dilation: [1, 1],
            groups: 1,
            activation: Activation::Linear,
            use_bias: true,
            name: None,
        }
    }

    /// Sets the dilation: taps `[dh, dw]` input elements apart (an atrous convolution).
    pub fn dilation(mut self, dilation: [usize; 2]) -> Self {
        self.dilation = dilation;
        self
    }

    /// Splits the channels into `groups` groups convolved on their own (ResNeXt's grouped
    /// convolution); the kernel is `[kh, kw, in / groups, filters]`.
    pub fn groups(mut self, groups: usize) -> Self {
        self.groups = groups;
        self
    }

    /// Sets the stride `[along height, along width]`.
    pub fn stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: Padding) -> Self {
        self.padding = padding;
        self
    }

    /// `Padding::Same`: output height and width are the input's divided by the stride, rounded up.
    pub fn same(self) -> Self {
        self.padding(Padding::Same)
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

    /// Names the layer's scope `name` in place of the derived one (variables `name/kernel`, ...).
    pub fn named(mut self, name: &str) -> Self {
        self.name = Some(name.to_string());
        self
    }
}

/// The window options of a convolution or pooling layer, checked before any op is recorded.
fn window_problem(what: &str, window: [usize; 2], stride: [usize; 2]) -> Option<String> {
    if window.contains(&0) {
        return Some(format!("the {what} {window:?} has a zero side"));
    }
    if stride.contains(&0) {
        return Some(format!("the stride {stride:?} has a zero side"));
    }
    None
}

impl Layer for Conv2D {
    fn forward(&self, x: &Tensor) -> Tensor {
        if self.filters == 0 {
            return invalid_layer(
                x,
                self.kind(),
                format!("Conv2D::new(0, {:?}) has no filters", self.kernel),
                "give the layer at least one filter",
            );
        }
        if let Some(why) = window_problem("kernel", self.kernel, self.stride) {
            return invalid_layer(x, self.kind(), why, "kernel sizes and strides are at least 1");
        }
        if self.dilation.contains(&0) {
            return invalid_layer(
                x,
                self.kind(),
                format!("the dilation {:?} has a zero side", self.dilation),
                "dilations are at least 1",
            );
        }
        let t = x.tracer();
        let channels = x.dims().last().copied().unwrap_or(1);
        let g = self.groups;
        if g == 0 || !channels.is_multiple_of(g) || !self.filters.is_multiple_of(g) {
            return invalid_layer(
                x,
                self.kind(),
                format!("{g} groups over {channels} input channels and {} filters", self.filters),
                "give a group count that divides both the input's channels and the filters",
            );
        }
        let kernel = t.param(
            "kernel",
            [self.kernel[0], self.kernel[1], channels / g, self.filters],
            Init::GlorotUniform,
        );
        let window = Window2d::new(self.kernel, self.stride, self.padding).dilated(self.dilation).grouped(g);
        let mut y = x.conv2d_window(&kernel, window);
        if self.use_bias {
            y = y + t.param("bias", Shape::new([self.filters]), Init::Zeros);
        }
        self.activation.apply(&y)
    }

    fn kind(&self) -> &'static str {
        "conv2d"
    }

    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }
}

/// Depthwise 2-D convolution over NHWC inputs (Keras `DepthwiseConv2D`): each input channel
/// convolved with its own `multiplier` filters, a convolution of as many groups as channels
/// (kernel `[kh, kw, 1, channels·multiplier]`, output channel c·multiplier + j from input
/// channel c), as MobileNet and EfficientNet use it.
#[derive(Clone, Debug)]
pub struct DepthwiseConv2D {
    /// The kernel's window `[height, width]`, in elements.
    pub kernel: [usize; 2],
    /// Output channels per input channel (Keras' `depth_multiplier`); 1 by default.
    pub multiplier: usize,
    /// The step between windows; `[1, 1]` by default.
    pub stride: [usize; 2],
    /// The padding; `Padding::Valid` by default.
    pub padding: Padding,
    /// The step between the kernel's taps; `[1, 1]` by default.
    pub dilation: [usize; 2],
    /// The activation applied after the bias (none by default).
    pub activation: Activation,
    /// Whether a bias (zeros at first) is added; true by default.
    pub use_bias: bool,
}

impl DepthwiseConv2D {
    /// A depthwise convolution over a `kernel` window: multiplier 1, stride 1, valid padding, a
    /// bias, no activation.
    pub fn new(kernel: [usize; 2]) -> Self {
        DepthwiseConv2D {
            kernel,
            multiplier: 1,
            stride: [1, 1],
            padding: Padding::Valid,
            dilation: [1, 1],
            activation: Activation::Linear,
            use_bias: true,
        }
    }

    /// Sets the output channels per input channel.
    pub fn multiplier(mut self, multiplier: usize) -> Self {
        self.multiplier = multiplier;
        self
    }

    /// Sets the stride.
    pub fn stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: Padding) -> Self {
        self.padding = padding;
        self
    }

    /// `Padding::Same`.
    pub fn same(self) -> Self {
        self.padding(Padding::Same)
    }

    /// Sets the dilation.
    pub fn dilation(mut self, dilation: [usize; 2]) -> Self {
        self.dilation = dilation;
        self
    }

    /// Sets the activation applied to the output.
    pub fn activation(mut self, activation: Activation) -> Self {
        self.activation = activation;
        self
    }

    /// Leaves out the bias (a batch norm follows).
    pub fn without_bias(mut self) -> Self {
        self.use_bias = false;
        self
    }
}

impl Layer for DepthwiseConv2D {
    fn forward(&self, x: &Tensor) -> Tensor {
        if self.multiplier == 0 {
            return invalid_layer(
                x,
                self.kind(),
                "a multiplier of 0".into(),
                "give at least one filter per channel",
            );
        }
        let channels = x.dims().last().copied().unwrap_or(1);
        Conv2D {
            filters: channels.saturating_mul(self.multiplier),
            kernel: self.kernel,
            stride: self.stride,
            padding: self.padding,
            dilation: self.dilation,
            groups: channels,
            activation: self.activation,
            use_bias: self.use_bias,
            name: None,
        }
        .forward(x)
    }

    fn kind(&self) -> &'static str {
        "depthwise_conv2d"
    }
}

/// Max or average pooling over NHWC inputs (Keras `MaxPooling2D` / `AveragePooling2D`); the
/// stride defaults to the window.
#[derive(Clone, Debug)]
pub struct Pool2D {
    /// True for max pooling, false for average pooling.
    pub max: bool,
    /// The pooling window `[height, width]`, in elements.
    pub window: [usize; 2],
    /// The step between windows `[along height, along width]`; the window by default.
    pub stride: [usize; 2],
    /// `Padding::Valid` (the default), `Padding::Same` or `Padding::Explicit` (the pads are
    /// never the maximum and not counted by the average).
    pub padding: Padding,
}

impl Pool2D {
    /// Max pooling over `window`, stride the window, valid padding.
    pub fn max(window: [usize; 2]) -> Self {
        Pool2D { max: true, window, stride: window, padding: Padding::Valid }
    }

    /// Average pooling over `window`, stride the window, valid padding.
    pub fn avg(window: [usize; 2]) -> Self {
        Pool2D { max: false, window, stride: window, padding: Padding::Valid }
    }

    /// Sets the stride `[along height, along width]`.
    pub fn stride(mut self, stride: [usize; 2]) -> Self {
        self.stride = stride;
        self
    }

    /// Sets the padding.
    pub fn padding(mut self, padding: Padding) -> Self {
        self.padding = padding;
        self
    }
}

impl Layer for Pool2D {
    fn forward(&self, x: &Tensor) -> Tensor {
        if let Some(why) = window_problem("window", self.window, self.stride) {
            return invalid_layer(x, self.kind(), why, "pooling windows and strides are at least 1");
        }
        if self.max {
            x.max_pool2d(self.window, self.stride, self.padding)
        } else {
            x.avg_pool2d(self.window, self.stride, self.padding)
        }
    }

    fn kind(&self) -> &'static str {
        if self.max { "max_pooling2d" } else { "average_pooling2d" }
    }
}

/// `[N, ...]` -> `[N, product of the rest]` (a view, no copy).
#[derive(Clone, Copy, Debug, Default)]
pub struct Flatten;

impl Layer for Flatten {
    fn forward(&self, x: &Tensor) -> Tensor {
        x.flatten()
    }

    fn kind(&self) -> &'static str {
        "flatten"
    }
}
