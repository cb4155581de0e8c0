use super::{Layer, invalid_layer};
use crate::ir::Init;
use crate::trace::Tensor;

/// Rows of a `[vocab, dim]` table looked up by integer ids (i32, i64, or whole f32s); Keras `Embedding`,
/// initialised uniform in `[-0.05, 0.05]`.
#[derive(Clone, Debug)]
pub struct Embedding {
    /// The table's rows: ids run from 0 to `vocab - 1`.
    pub vocab: usize,
    /// The width of each row: the size of the output's new last axis.
    pub dim: usize,
    /// The key of a table shared with other layers (`tied`), if any.
    pub tied: Option<String>,
}

impl Embedding {
    /// A table of `vocab` rows of `dim` values, the layer's own (`embeddings` in its scope).
    pub fn new(vocab: usize, dim: usize) -> Self {
        Embedding { vocab, dim, tied: None }
    }

    /// The table is the parameter `key` (no scope), shared with every layer that names it: a
    /// language model's output head reading it transposed (`TiedOutput`), as GPT-2 ties `wte`.
    pub fn tied(mut self, key: &str) -> Self {
        self.tied = Some(key.to_string());
        self
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
        let init = Init::Uniform { low: -0.05, high: 0.05 };
        let table = match &self.tied {
            Some(key) => ids.tracer().tied_param(key, [self.vocab, self.dim], init),
            None => ids.tracer().param("embeddings", [self.vocab, self.dim], init),
        };
        table.gather(ids)
    }

    fn kind(&self) -> &'static str {
        "embedding"
    }
}

/// A learned position embedding added to a sequence (GPT-2's `wpe`): `x[.., T, d]` plus the
/// first T rows of a `[max_len, d]` table, initialised uniform in `[-0.05, 0.05]`. Without it a
/// causal attention stack cannot tell positions apart. A sequence longer than `max_len` is an
/// error naming the layer.
#[derive(Clone, Debug)]
pub struct PositionEmbedding {
    /// The most positions the table holds (its rows); a longer sequence is an error.
    pub max_len: usize,
}

impl PositionEmbedding {
    /// A table for sequences of up to `max_len` positions (`positions` in the layer's scope).
    pub fn new(max_len: usize) -> Self {
        PositionEmbedding { max_len }
    }
}

impl Layer for PositionEmbedding {
    fn forward(&self, x: &Tensor) -> Tensor {
        let dims = x.shape().dims().to_vec();
        if dims.len() < 2 {
            return invalid_layer(
                x,
                self.kind(),
                format!("its input {} has no [positions, features] axes", x.shape()),
                "feed a sequence [batch, positions, features] (an Embedding's output)",
            );
        }
        let (len, dim) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        if len > self.max_len || self.max_len == 0 {
            return invalid_layer(
                x,
                self.kind(),
                format!(
                    "PositionEmbedding::new({}) cannot place a sequence of {len} positions",
                    self.max_len
                ),
                "give max_len at least the longest sequence the model sees",
            );
        }
        let table =
            x.tracer().param("positions", [self.max_len, dim], Init::Uniform { low: -0.05, high: 0.05 });
        let rows = if len == self.max_len { table } else { table.slice(0, 0, len) };
        x + &rows
    }

    fn kind(&self) -> &'static str {
        "position_embedding"
    }
}

/// An output head that reads a tied embedding table transposed: `x[.., d] @ table[vocab, d]ᵀ`
/// gives logits over the vocabulary with no weights of its own (GPT-2's head). The table is the
/// parameter `key` (`Embedding::tied`); declared here first, it is made here.
#[derive(Clone, Debug)]
pub struct TiedOutput {
    /// The key of the embedding table this head reads (an `Embedding::tied` key, no scope).
    pub key: String,
    /// The table's rows: the size of the logits' last axis.
    pub vocab: usize,
}

impl TiedOutput {
    /// A head reading the table `key` of `vocab` rows (its width is the input's last axis).
    pub fn new(key: &str, vocab: usize) -> Self {
        TiedOutput { key: key.to_string(), vocab }
    }
}

impl Layer for TiedOutput {
    fn forward(&self, x: &Tensor) -> Tensor {
        let Some(&dim) = x.shape().dims().last() else {
            return invalid_layer(
                x,
                self.kind(),
                "its input is a scalar".into(),
                "feed features [.., d] (the last block's output)",
            );
        };
        let table =
            x.tracer().tied_param(&self.key, [self.vocab, dim], Init::Uniform { low: -0.05, high: 0.05 });
        x.matmul_t(&table, false, true)
    }

    fn kind(&self) -> &'static str {
        "tied_output"
    }
}
