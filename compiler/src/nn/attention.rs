use super::{Dense, Layer, invalid_layer};
use crate::trace::Tensor;

/// Multi-head scaled dot-product self-attention over `[batch, seq, model]` inputs, composed from
/// the DSL's ops: projections, a split into heads (reshape + permute), softmax(q·kᵀ/√d)·v (one
/// `Op::Attention`, which never stores the scores), a merge
/// of the heads and an output projection (Keras `MultiHeadAttention` with query = key = value).
/// With `causal`, a position attends to itself and the positions before it only (a decoder's
/// self-attention, Keras's `use_causal_mask`): the masked scores get -1e9 before the softmax, so
/// their weights are exactly 0. Without `use_bias` the four projections have no bias (Keras's
/// `use_bias=False`, PyTorch's `bias=False`).
#[derive(Clone, Debug)]
pub struct MultiHeadAttention {
    /// The number of heads; it must divide the model width (the input's last axis).
    pub heads: usize,
    /// Whether each position attends only to itself and the positions before it.
    pub causal: bool,
    /// Whether the query, key, value and output projections have biases.
    pub use_bias: bool,
}

impl MultiHeadAttention {
    /// Attention with `heads` heads, not causal, with biases.
    pub fn new(heads: usize) -> Self {
        MultiHeadAttention { heads, causal: false, use_bias: true }
    }

    /// Sets whether the attention is causal (a decoder's).
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets whether the four projections have biases.
    pub fn use_bias(mut self, use_bias: bool) -> Self {
        self.use_bias = use_bias;
        self
    }

    fn dense(&self, units: usize) -> Dense {
        let d = Dense::new(units);
        if self.use_bias { d } else { d.without_bias() }
    }
}

impl Layer for MultiHeadAttention {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.attend(x, None)
    }

    fn kind(&self) -> &'static str {
        "multi_head_attention"
    }
}

impl MultiHeadAttention {
    /// Self-attention over `x` `[batch, seq, model]` where `padding`, when given, is `[batch, seq]`
    /// with 1.0 (or true, or any nonzero id) at real tokens and 0.0 (false) at padding: no query attends to a padded key (Keras's
    /// `attention_mask` from a padding mask, PyTorch's `key_padding_mask` inverted). The mask is
    /// added to the scores as -1e9 where a key is padding, with the causal mask when `causal`;
    /// a row whose keys are all padding attends uniformly (its softmax sees equal scores). Call
    /// it from a model's own layer (`impl Layer`), which receives the mask beside its input.
    #[track_caller]
    pub fn attend(&self, x: &Tensor, padding: Option<&Tensor>) -> Tensor {
        x.tracer().attributed_to(std::panic::Location::caller(), || self.attend_here(x, padding))
    }

    fn attend_here(&self, x: &Tensor, padding: Option<&Tensor>) -> Tensor {
        let t = x.tracer();
        let (b, s, d) = match x.dims() {
            [b, s, d] => (*b, *s, *d),
            _ => {
                return invalid_layer(
                    x,
                    self.kind(),
                    format!("expects [batch, seq, model] input, got {}", x.shape()),
                    "reshape the input to rank 3",
                );
            }
        };
        let h = self.heads;
        if h == 0 {
            return invalid_layer(
                x,
                self.kind(),
                "MultiHeadAttention::new(0) has no heads".into(),
                "give the layer at least one head",
            );
        }
        if d == 0 || d % h != 0 {
            return invalid_layer(
                x,
                self.kind(),
                format!("model width {d} is not a positive multiple of {h} heads"),
                "choose a head count that divides the model width (the input's last axis)",
            );
        }
        let dh = d / h;
        let project = |name: &str| t.scope(name, || self.dense(d).forward(x));
        let split = |p: Tensor| p.reshape([b, s, h, dh]).permute(&[0, 2, 1, 3]);
        let (q, k, v) = (split(project("query")), split(project("key")), split(project("value")));
        let mut bias = None;
        if let Some(keep) = padding {
            if keep.dims() != [b, s] {
                return invalid_layer(
                    x,
                    self.kind(),
                    format!("the padding mask has shape {} but the input {}", keep.shape(), x.shape()),
                    "give a [batch, seq] mask of 1.0 at tokens and 0.0 at padding",
                );
            }
            // Over the keys: [b, 1, 1, s], broadcast over heads and queries: 0 at tokens, -1e9
            // at padding. A bool or integer mask (true / nonzero at tokens) is read as 1.0 / 0.0.
            let keep = keep.cast(crate::ir::DType::F32).ne(0.0);
            bias = Some((keep.reshape([b, 1, 1, s]) - 1.0).mul(1e9));
        }
        // One op (`Op::Attention`): the [b, h, s, s] scores and probabilities are never stored,
        // and the causal mask (-1e9 on hidden scores) is the op's own.
        let scale = 1.0 / (dh as f32).sqrt();
        let context = q.attention(&k, &v, bias.as_ref(), scale, self.causal);
        let merged = context.permute(&[0, 2, 1, 3]).reshape([b, s, d]);
        t.scope("output", || self.dense(d).forward(&merged))
    }
}
