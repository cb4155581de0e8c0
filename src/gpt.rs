//! The GPT of `examples/gpt.rs`, shared with the tests that hold its numerics (its held-out
//! loss in bf16 mixed precision against f32's, its gradients against PyTorch's autocast): a
//! byte-level language model of `LAYERS` pre-LN blocks of causal multi-head attention and a
//! tanh-GELU MLP between token and position embeddings and a head over the 256 bytes, trained
//! with the sparse cross-entropy on i32 ids and Adam(3e-3).

use crate::error::Result;
use kiln_compiler::ir::Shape;
use kiln_compiler::losses::{Loss, Metric};
use kiln_compiler::nn::{
    Activation, Dense, Embedding, LayerNorm, MultiHeadAttention, PositionEmbedding, Residual, Sequential,
};
use kiln_compiler::optim::Adam;
use kiln_compiler::step::TrainConfig;
use kiln_runtime::HostTensor;

/// Every byte is a token.
pub const VOCAB: usize = 256;
/// The window the model reads (and the position table's length).
pub const SEQ: usize = 64;
/// The model's width.
pub const DIM: usize = 64;
/// Attention heads per block.
pub const HEADS: usize = 4;
/// Transformer blocks.
pub const LAYERS: usize = 2;
/// Windows per training step.
pub const BATCH: usize = 16;

/// The model: ids `[batch, SEQ]` to logits `[batch, SEQ, VOCAB]`.
pub fn model() -> Sequential {
    let mut m = Sequential::new().add(Embedding::new(VOCAB, DIM)).add(PositionEmbedding::new(SEQ));
    for _ in 0..LAYERS {
        let attention = Sequential::new()
            .add(LayerNorm::new().epsilon(1e-5))
            .add(MultiHeadAttention::new(HEADS).causal(true));
        let mlp = Sequential::new()
            .add(LayerNorm::new().epsilon(1e-5))
            .add(Dense::new(4 * DIM).activation(Activation::GeluTanh))
            .add(Dense::new(DIM));
        m = m.add(Residual::new(attention)).add(Residual::new(mlp));
    }
    m.add(LayerNorm::new().epsilon(1e-5)).add(Dense::new(VOCAB))
}

/// Sparse softmax cross-entropy on the next byte's id, Adam(3e-3), next-byte accuracy.
pub fn config() -> TrainConfig {
    TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(3e-3).into(),
        metrics: vec![Metric::SparseCategoricalAccuracy],
    }
}

/// The windows of `SEQ` ids from `text` at `offsets` and the windows one byte later (the
/// targets), as i32 ids `[offsets.len(), SEQ]`. Each offset leaves `SEQ + 1` bytes of text.
pub fn windows(text: &[u8], offsets: &[usize]) -> Result<(HostTensor, HostTensor)> {
    if let Some(&o) = offsets.iter().find(|&&o| o + SEQ + 1 > text.len()) {
        return Err(kiln_runtime::RuntimeError::invalid(
            format!(
                "gpt::windows: offset {o} leaves fewer than {} of the text's {} bytes",
                SEQ + 1,
                text.len()
            ),
            "take offsets below text.len() - SEQ - 1",
        )
        .into());
    }
    let take = |shift: usize| -> Vec<i32> {
        offsets.iter().flat_map(|&o| text[o + shift..o + shift + SEQ].iter().map(|&b| i32::from(b))).collect()
    };
    let shape = Shape::new([offsets.len(), SEQ]);
    Ok((HostTensor::from_i32(shape.clone(), take(0))?, HostTensor::from_i32(shape, take(1))?))
}

/// The repository's text (`examples/data/shakespeare.txt`: 200 KB of Shakespeare's plays).
pub fn shakespeare() -> Result<Vec<u8>> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/data/shakespeare.txt");
    std::fs::read(path).map_err(|e| {
        kiln_runtime::RuntimeError::invalid(
            format!("cannot read {path}: {e}"),
            "run from a checkout of the repository, where examples/data is",
        )
        .into()
    })
}
