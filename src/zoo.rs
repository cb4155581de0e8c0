//! The model zoo: models the examples, tests and benchmarks build by name and batch size.
//!
//! | name | model | batch |
//! |---|---|---|
//! | `seed-mlp` | 100 -> 10 relu -> 1 sigmoid, binary cross-entropy, Adam(0.01) | 32 |
//! | `mlp` | 784 -> 1024 relu -> 1024 relu -> 10, softmax cross-entropy, Adam(1e-3) | 256 |
//! | `cnn` | 32x32x3: (3x3 conv 32 relu) x2, max-pool, (3x3 conv 64 relu) x2, max-pool, dense 128 relu, dense 10 | 64 |
//! | `transformer` | embedding 1000x256, one pre-LN block (4 heads, GELU MLP 1024), LN, dense 1000; sequence 128 | 8 |

use crate::error::{Error, Result};
use kiln_compiler::ir::{Padding, Shape};
use kiln_compiler::losses::{Loss, Metric};
use kiln_compiler::nn::{
    Activation, Conv2D, Dense, Embedding, Flatten, LayerNorm, MultiHeadAttention, Pool2D, Residual,
    Sequential,
};
use kiln_compiler::optim::Adam;
use kiln_compiler::step::TrainConfig;
use kiln_runtime::{HostTensor, RuntimeError};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// How a zoo model's inputs or targets are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Data {
    /// Uniform in [0, 1).
    Uniform,
    /// 0.0 or 1.0 per element.
    Binary,
    /// One-hot rows over the last axis.
    OneHot,
    /// Integer ids in [0, n) stored as f32.
    Ids(usize),
}

/// A zoo entry: everything needed to build, compile and feed the model.
#[derive(Clone, Debug)]
pub struct ZooModel {
    /// The model's name (`seed-mlp`, `mlp`, `cnn`, `transformer`), as [`by_name`] finds it.
    pub name: &'static str,
    /// The batch size its shapes and data are made for.
    pub batch: usize,
    /// Input and target shapes without the batch axis.
    pub x: Vec<usize>,
    /// The target's shape without the batch axis (`[10]` for ten classes).
    pub y: Vec<usize>,
    /// How [`ZooModel::batch_data`] draws the inputs.
    pub x_data: Data,
    /// How [`ZooModel::batch_data`] draws the targets.
    pub y_data: Data,
    build: fn() -> Sequential,
    config: fn() -> TrainConfig,
}

impl ZooModel {
    /// Builds the model's layers (a fresh `Sequential` each call).
    pub fn model(&self) -> Sequential {
        (self.build)()
    }

    /// The model's loss, optimizer and metrics for a training step.
    pub fn config(&self) -> TrainConfig {
        (self.config)()
    }

    /// The same model at another batch size.
    pub fn with_batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// The input's shape with the batch axis first: `[batch, x...]`.
    pub fn x_shape(&self) -> Shape {
        batched(self.batch, &self.x)
    }

    /// The target's shape with the batch axis first: `[batch, y...]`.
    pub fn y_shape(&self) -> Shape {
        batched(self.batch, &self.y)
    }

    /// One batch of inputs and targets; an error when the batch does not fit in host memory or
    /// a `Data` cannot be drawn (`Ids(0)`, one-hot rows of no classes).
    pub fn batch_data(&self, seed: u64) -> Result<(HostTensor, HostTensor)> {
        let mut rng = StdRng::seed_from_u64(seed);
        let x = draw(&self.x_shape(), self.x_data, &mut rng)?;
        let y = draw(&self.y_shape(), self.y_data, &mut rng)?;
        Ok((x, y))
    }
}

fn batched(batch: usize, dims: &[usize]) -> Shape {
    let mut d = vec![batch];
    d.extend_from_slice(dims);
    Shape::new(d)
}

fn draw(shape: &Shape, data: Data, rng: &mut StdRng) -> Result<HostTensor> {
    let empty = shape.checked_numel() == Some(0);
    Ok(match data {
        Data::Uniform => HostTensor::from_fn(shape.clone(), |_| rng.random::<f32>())?,
        Data::Binary => HostTensor::from_fn(shape.clone(), |_| if rng.random::<bool>() { 1.0 } else { 0.0 })?,
        Data::Ids(0) if !empty => return Err(no_data(shape, data, "there are no ids to draw from")),
        Data::Ids(n) => HostTensor::from_fn(shape.clone(), |_| rng.random_range(0..n) as f32)?,
        Data::OneHot => {
            let classes = shape.dims().last().copied().unwrap_or(1);
            if classes == 0 && !empty {
                return Err(no_data(shape, data, "one-hot rows need at least one class"));
            }
            let mut t = HostTensor::zeros(shape.clone())?;
            for row in t.data_mut().chunks_mut(classes.max(1)) {
                row[rng.random_range(0..row.len())] = 1.0;
            }
            t
        }
    })
}

fn no_data(shape: &Shape, data: Data, why: &str) -> Error {
    Error::Runtime(RuntimeError::invalid(
        format!("cannot draw {data:?} data of shape {shape}: {why}"),
        "give Data::Ids a positive count, and one-hot targets a last axis of at least 1",
    ))
}

/// Every zoo model at its default batch size.
pub fn all() -> Vec<ZooModel> {
    vec![
        ZooModel {
            name: "seed-mlp",
            batch: 32,
            x: vec![100],
            y: vec![1],
            x_data: Data::Uniform,
            y_data: Data::Binary,
            build: seed_mlp,
            config: seed_config,
        },
        ZooModel {
            name: "mlp",
            batch: 256,
            x: vec![784],
            y: vec![10],
            x_data: Data::Uniform,
            y_data: Data::OneHot,
            build: mlp,
            config: classifier_config,
        },
        ZooModel {
            name: "cnn",
            batch: 64,
            x: vec![32, 32, 3],
            y: vec![10],
            x_data: Data::Uniform,
            y_data: Data::OneHot,
            build: cnn,
            config: classifier_config,
        },
        ZooModel {
            name: "transformer",
            batch: 8,
            x: vec![TRANSFORMER_SEQ],
            y: vec![TRANSFORMER_SEQ, TRANSFORMER_VOCAB],
            x_data: Data::Ids(TRANSFORMER_VOCAB),
            y_data: Data::OneHot,
            build: transformer,
            config: classifier_config,
        },
    ]
}

/// The zoo model called `name`.
pub fn by_name(name: &str) -> Option<ZooModel> {
    all().into_iter().find(|m| m.name == name)
}

/// `transformer`'s sequence length in tokens (its input is `[batch, 128]` token ids).
pub const TRANSFORMER_SEQ: usize = 128;
/// `transformer`'s vocabulary size: embedding rows, id range and output logits per token.
pub const TRANSFORMER_VOCAB: usize = 1000;
/// `transformer`'s model width (embedding size; the MLP is 4x wider).
pub const TRANSFORMER_MODEL: usize = 256;

/// Softmax cross-entropy on logits, Adam(1e-3), accuracy.
pub fn classifier_config() -> TrainConfig {
    TrainConfig {
        loss: Loss::SoftmaxCrossEntropy,
        optimizer: Adam::new(1e-3).into(),
        metrics: vec![Metric::CategoricalAccuracy],
    }
}

/// 784 -> 1024 relu -> 1024 relu -> 10 logits.
pub fn mlp() -> Sequential {
    Sequential::new().add(Dense::new(1024).relu()).add(Dense::new(1024).relu()).add(Dense::new(10))
}

/// A CIFAR-style CNN on 32x32x3 images, producing 10 logits.
pub fn cnn() -> Sequential {
    let conv = |f: usize| Conv2D::new(f, [3, 3]).padding(Padding::Same).relu();
    Sequential::new()
        .add(conv(32))
        .add(conv(32))
        .add(Pool2D::max([2, 2]))
        .add(conv(64))
        .add(conv(64))
        .add(Pool2D::max([2, 2]))
        .add(Flatten)
        .add(Dense::new(128).relu())
        .add(Dense::new(10))
}

/// Token ids -> embedding -> one pre-LN transformer block -> LN -> logits over the vocabulary.
pub fn transformer() -> Sequential {
    let d = TRANSFORMER_MODEL;
    let attention = Sequential::new().add(LayerNorm::new().epsilon(1e-5)).add(MultiHeadAttention::new(4));
    let mlp = Sequential::new()
        .add(LayerNorm::new().epsilon(1e-5))
        .add(Dense::new(1024).activation(Activation::Gelu))
        .add(Dense::new(d));
    Sequential::new()
        .add(Embedding::new(TRANSFORMER_VOCAB, d))
        .add(Residual::new(attention))
        .add(Residual::new(mlp))
        .add(LayerNorm::new().epsilon(1e-5))
        .add(Dense::new(TRANSFORMER_VOCAB))
}

/// The seed documents' model: Dense(10, relu) -> Dense(1, sigmoid) on 100 features.
pub fn seed_mlp() -> Sequential {
    Sequential::new().add(Dense::new(10).relu()).add(Dense::new(1).sigmoid())
}

/// Its training configuration: binary cross-entropy, Adam(0.01), accuracy.
pub fn seed_config() -> TrainConfig {
    TrainConfig {
        loss: Loss::BinaryCrossEntropy,
        optimizer: Adam::new(0.01).into(),
        metrics: vec![Metric::BinaryAccuracy],
    }
}

/// Two interleaved spirals in the plane, `n` points per class, labels 0/1 in [2n, 1]: a classic
/// task that a linear model cannot learn and a small MLP can.
/// An error when `4n` points overflow or do not fit in host memory.
pub fn two_spirals(n: usize, noise: f32, seed: u64) -> Result<(HostTensor, HostTensor)> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (Some(rows), Some(coords)) = (n.checked_mul(2), n.checked_mul(4)) else {
        return Err(Error::Runtime(RuntimeError::invalid(
            format!("two_spirals({n}, ..): 4 x {n} coordinates overflow a usize"),
            "ask for fewer points",
        )));
    };
    let (mut x, mut y) = (Vec::new(), Vec::new());
    x.try_reserve_exact(coords).and_then(|()| y.try_reserve_exact(rows)).map_err(|e| {
        Error::Runtime(RuntimeError::invalid(
            format!("two_spirals({n}, ..): {rows} points do not fit in host memory ({e})"),
            "ask for fewer points",
        ))
    })?;
    for i in 0..n {
        // Angle from 0.25 to 3 turns; radius grows with the angle.
        let t = 0.25 + 2.75 * (i as f32 / n as f32);
        let angle = t * std::f32::consts::TAU;
        let r = t / 3.0;
        for (label, sign) in [(0.0, 1.0), (1.0, -1.0)] {
            let jitter = |rng: &mut StdRng| noise * (rng.random::<f32>() - 0.5);
            x.push(sign * r * angle.cos() + jitter(&mut rng));
            x.push(sign * r * angle.sin() + jitter(&mut rng));
            y.push(label);
        }
    }
    Ok((HostTensor::new([rows, 2], x)?, HostTensor::new([rows, 1], y)?))
}

/// A model that separates the two spirals: 2 -> 64 relu -> 64 relu -> 1 sigmoid.
pub fn spiral_mlp() -> Sequential {
    Sequential::new().add(Dense::new(64).relu()).add(Dense::new(64).relu()).add(Dense::new(1).sigmoid())
}
