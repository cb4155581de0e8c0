use super::Layer;
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
