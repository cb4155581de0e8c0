//! Models the zoo does not have, at odd sizes, for tests that hold a capability on models it was
//! not tuned on: a residual conv net (strided and 1x1 convolutions, max and average pools), a
//! GPT-style decoder (tied embedding, RMSNorm, causal attention without biases, tanh-GELU,
//! dropout, a sparse loss with an ignored id), an autoencoder (tanh, sigmoid, exact GELU, MSE,
//! SGD with momentum), a narrow MLP (binary cross-entropy, Nesterov) and a softmax inside a
//! network (LayerNorm without centring, on 3-D inputs).

#![allow(dead_code)]

use kiln::compiler::nn::*;
use kiln::prelude::*;
use kiln::runtime::HostTensor;

pub struct Unseen {
    pub name: &'static str,
    pub model: Sequential,
    pub x: Shape,
    pub y: Shape,
    pub config: TrainConfig,
    /// Token ids below this for x (and y, for a sparse loss), else uniform in [-1, 1).
    x_ids: Option<usize>,
    y_data: Target,
}

#[derive(Clone, Copy)]
enum Target {
    Uniform,
    OneHot,
    Ids(usize),
    Binary,
}

pub fn all() -> Vec<Unseen> {
    let adam = |lr: f32| -> Optimizer { Adam::new(lr).into() };
    let mut v = Vec::new();
    let block =
        Sequential::new().add(Conv2D::new(8, [3, 3]).same().relu()).add(Conv2D::new(8, [3, 3]).same());
    v.push(Unseen {
        name: "residual-cnn",
        model: Sequential::new()
            .add(Conv2D::new(8, [3, 3]).same().relu())
            .add(Residual::new(block))
            .add(Conv2D::new(12, [3, 3]).stride([2, 2]).activation(Activation::Tanh))
            .add(Pool2D::max([2, 2]))
            .add(Conv2D::new(6, [1, 1]).activation(Activation::Sigmoid))
            .add(Pool2D::avg([2, 2]).stride([1, 1]))
            .add(Flatten)
            .add(Dense::new(7)),
        x: Shape::from([5, 11, 13, 3]),
        y: Shape::from([5, 7]),
        config: TrainConfig {
            loss: Loss::SoftmaxCrossEntropy,
            optimizer: adam(1e-2),
            metrics: vec![Metric::CategoricalAccuracy],
        },
        x_ids: None,
        y_data: Target::OneHot,
    });
    let (vocab, d, seq) = (37, 24, 9);
    let mut gpt =
        Sequential::new().add(Embedding::new(vocab, d).tied("tok")).add(PositionEmbedding::new(seq));
    for _ in 0..2 {
        let attention = MultiHeadAttention::new(3).causal(true).use_bias(false);
        gpt.push(Residual::new(Sequential::new().add(RmsNorm::new()).add(attention)));
        gpt.push(Residual::new(
            Sequential::new()
                .add(LayerNorm::new().epsilon(1e-5))
                .add(Dense::new(4 * d).activation(Activation::GeluTanh))
                .add(Dropout::new(0.1))
                .add(Dense::new(d)),
        ));
    }
    v.push(Unseen {
        name: "gpt-style",
        model: gpt.add(RmsNorm::new()).add(TiedOutput::new("tok", vocab)),
        x: Shape::from([3, seq]),
        y: Shape::from([3, seq]),
        config: TrainConfig {
            loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: Some(0) },
            optimizer: adam(1e-2),
            metrics: vec![Metric::SparseCategoricalAccuracy],
        },
        x_ids: Some(vocab),
        y_data: Target::Ids(vocab),
    });
    v.push(Unseen {
        name: "autoencoder",
        model: Sequential::new()
            .add(Dense::new(17).activation(Activation::Tanh))
            .add(Dense::new(5).sigmoid())
            .add(Dense::new(17).activation(Activation::Gelu))
            .add(Dense::new(33)),
        x: Shape::from([5, 33]),
        y: Shape::from([5, 33]),
        config: TrainConfig {
            loss: Loss::MeanSquaredError,
            optimizer: Sgd::new(0.05).momentum(0.9).into(),
            metrics: vec![],
        },
        x_ids: None,
        y_data: Target::Uniform,
    });
    v.push(Unseen {
        name: "narrow-mlp",
        model: Sequential::new()
            .add(Dense::new(53).relu())
            .add(Dense::new(7).activation(Activation::GeluTanh))
            .add(Dense::new(1).sigmoid()),
        x: Shape::from([13, 37]),
        y: Shape::from([13, 1]),
        config: TrainConfig {
            loss: Loss::BinaryCrossEntropy,
            optimizer: Sgd::new(0.1).momentum(0.5).nesterov().into(),
            metrics: vec![Metric::BinaryAccuracy],
        },
        x_ids: None,
        y_data: Target::Binary,
    });
    v.push(Unseen {
        name: "softmax-inside",
        model: Sequential::new()
            .add(Dense::new(19).activation(Activation::Softmax))
            .add(LayerNorm::new().center(false))
            .add(Dense::new(4)),
        x: Shape::from([6, 2, 11]),
        y: Shape::from([6, 2, 4]),
        config: TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer: adam(1e-2), metrics: vec![] },
        x_ids: None,
        y_data: Target::OneHot,
    });
    v
}

/// A deterministic stream of floats in [0, 1) (xorshift).
fn stream(seed: u64) -> impl FnMut() -> f32 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}

impl Unseen {
    /// One batch of inputs and targets.
    pub fn batch(&self, seed: u64) -> (HostTensor, HostTensor) {
        let ids = |n: usize, next: &mut dyn FnMut() -> f32| (next() * n as f32).floor().min(n as f32 - 1.0);
        let mut next = stream(seed);
        let x = HostTensor::from_fn(self.x.clone(), |_| match self.x_ids {
            Some(n) => ids(n, &mut next),
            None => next() * 2.0 - 1.0,
        })
        .unwrap();
        let mut next = stream(seed + 1);
        let classes = self.y.dims().last().copied().unwrap_or(1);
        let hot: Vec<usize> = (0..self.y.numel() / classes)
            .map(|_| ((next() * classes as f32) as usize).min(classes - 1))
            .collect();
        let y = HostTensor::from_fn(self.y.clone(), |k| match self.y_data {
            Target::Uniform => next() * 2.0 - 1.0,
            Target::OneHot => f32::from(u8::from(hot[k / classes] == k % classes)),
            Target::Ids(n) => ids(n, &mut next),
            Target::Binary => f32::from(u8::from(next() < 0.5)),
        })
        .unwrap();
        (x, y)
    }
}
