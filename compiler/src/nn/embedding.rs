use super::{Layer, invalid_layer};
use crate::ir::Init;
use crate::trace::Tensor;

/// Rows of a [vocab, dim] table looked up by integer ids (stored as f32); Keras `Embedding`,
/// initialised uniform in [-0.05, 0.05].
#[derive(Clone, Debug)]
pub struct Embedding {
    pub vocab: usize,
    pub dim: usize,
}

impl Embedding {
    pub fn new(vocab: usize, dim: usize) -> Self {
        Embedding { vocab, dim }
    }
}

impl Layer for Embedding {
    fn forward(&self, ids: &Tensor) -> Tensor {
        if self.vocab == 0 || self.dim == 0 {
            return invalid_layer(
                ids,
                self.kind(),
                format!("Embedding::new({}, {}) has an empty table", self.vocab, self.dim),
                "give the table at least one row (vocab) and one column (dim)",
            );
        }
        let table = ids.tracer().param(
            "embeddings",
            [self.vocab, self.dim],
            Init::Uniform { low: -0.05, high: 0.05 },
        );
        table.gather(ids)
    }

    fn kind(&self) -> &'static str {
        "embedding"
    }
}
