//! Synthetic interval sets with the lifetimes real schedules have, for tests, benches and reports.
//!
//! They are written as op lists ([`OpTrace`]): each op runs at its own step, reads some buffers and
//! writes new ones, and a buffer lives from the op that writes it to the last op that reads it, as
//! the liveness pass computes. The training steps save forward activations for the backward pass
//! (nested lifetimes around the forward/backward turn), with short-lived temporaries and parameter
//! gradients between them: the pattern that makes a planner quadratic if it scans conflicts.
//! Sizes are f32 tensors. Nothing here is random except [`random_mix`], which takes a seed.

use super::Interval;

const F32: usize = 4;

/// Records ops in schedule order and yields each buffer's live interval.
#[derive(Clone, Debug, Default)]
pub struct OpTrace {
    /// Per buffer: bytes, the step that writes it, the last step that reads it.
    buffers: Vec<(usize, usize, usize)>,
    step: usize,
}

/// A buffer written by an [`OpTrace`] op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf(usize);

impl OpTrace {
    /// An empty trace: the first op runs at step 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// One op at the next step: reads `inputs`, writes one buffer per entry of `outputs` (bytes).
    pub fn op(&mut self, inputs: &[Buf], outputs: &[usize]) -> Vec<Buf> {
        let step = self.step;
        self.step += 1;
        for b in inputs {
            self.buffers[b.0].2 = step;
        }
        outputs
            .iter()
            .map(|&bytes| {
                self.buffers.push((bytes, step, step));
                Buf(self.buffers.len() - 1)
            })
            .collect()
    }

    /// An op with one output.
    pub fn op1(&mut self, inputs: &[Buf], bytes: usize) -> Buf {
        self.op(inputs, &[bytes])[0]
    }

    /// The intervals, one per buffer in creation order.
    pub fn intervals(&self) -> Vec<Interval> {
        self.buffers.iter().map(|&(bytes, start, end)| Interval { bytes, start, end }).collect()
    }
}

/// An inference chain: op `i` reads buffer `i - 1` and writes buffer `i`. Two slots suffice.
pub fn chain(ops: usize, bytes: usize) -> Vec<Interval> {
    let mut t = OpTrace::new();
    let mut x = t.op1(&[], bytes);
    for _ in 1..ops {
        x = t.op1(&[x], bytes);
    }
    t.intervals()
}

/// One SGD training step of an MLP (`dims[0]` inputs, then one dense + bias + ReLU layer per
/// further entry) on a batch: forward, loss, backward, and an update right after each gradient.
pub fn mlp_training(batch: usize, dims: &[usize]) -> Vec<Interval> {
    assert!(dims.len() >= 2, "an MLP needs an input width and at least one layer");
    let act = |d: usize| batch * d * F32;
    let mut t = OpTrace::new();
    let mut a = t.op1(&[], act(dims[0]));
    let mut saved = Vec::new(); // (layer input, relu output)
    for w in dims.windows(2) {
        let h = t.op1(&[a], act(w[1]));
        let z = t.op1(&[h], act(w[1]));
        let r = t.op1(&[z], act(w[1]));
        saved.push((a, r));
        a = r;
    }
    let loss = t.op(&[a], &[F32, act(*dims.last().unwrap())]);
    let mut da = loss[1];
    for (w, &(input, relu)) in dims.windows(2).zip(&saved).rev() {
        let dz = t.op1(&[da, relu], act(w[1]));
        let db = t.op1(&[dz], w[1] * F32);
        t.op(&[db], &[]);
        let dw = t.op1(&[input, dz], w[0] * w[1] * F32);
        t.op(&[dw], &[]);
        da = t.op1(&[dz], act(w[0]));
    }
    t.op(&[da, loss[0]], &[]);
    t.intervals()
}

/// Sizes of a pre-norm transformer block's training step.
#[derive(Clone, Copy, Debug)]
pub struct TransformerDims {
    /// Sequences per batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// The model width (features per token).
    pub model: usize,
    /// Attention heads (the probabilities are `heads * seq^2` per sequence).
    pub heads: usize,
    /// Transformer blocks in the stack.
    pub layers: usize,
    /// Weight gradients live until one optimizer op after the backward pass (as with gradient
    /// accumulation or a fused multi-tensor update) instead of being consumed right away.
    pub deferred_updates: bool,
}

/// One training step of a stack of pre-norm transformer blocks: per block nine activations are
/// saved for the backward pass (the attention probabilities among them, `heads * seq^2` per
/// sequence), and each weight gradient is consumed by its update right away or, with
/// `deferred_updates`, by one optimizer op at the end.
pub fn transformer_training(d: TransformerDims) -> Vec<Interval> {
    let tok = d.batch * d.seq;
    let x_bytes = tok * d.model * F32;
    let qkv_bytes = 3 * x_bytes;
    let hidden_bytes = 4 * x_bytes;
    let attn_bytes = d.batch * d.heads * d.seq * d.seq * F32;
    let (wqkv, wo, w1, w2) = (
        3 * d.model * d.model * F32,
        d.model * d.model * F32,
        4 * d.model * d.model * F32,
        4 * d.model * d.model * F32,
    );

    let mut t = OpTrace::new();
    let mut x = t.op1(&[], x_bytes); // embeddings
    struct Saved {
        x: Buf,
        ln1: Buf,
        qkv: Buf,
        probs: Buf,
        ctx: Buf,
        x1: Buf,
        ln2: Buf,
        fc1: Buf,
        gelu: Buf,
    }
    let mut saved = Vec::with_capacity(d.layers);
    for _ in 0..d.layers {
        let ln1 = t.op1(&[x], x_bytes);
        let qkv = t.op1(&[ln1], qkv_bytes);
        let scores = t.op1(&[qkv], attn_bytes);
        let probs = t.op1(&[scores], attn_bytes);
        let ctx = t.op1(&[probs, qkv], x_bytes);
        let proj = t.op1(&[ctx], x_bytes);
        let x1 = t.op1(&[x, proj], x_bytes);
        let ln2 = t.op1(&[x1], x_bytes);
        let fc1 = t.op1(&[ln2], hidden_bytes);
        let gelu = t.op1(&[fc1], hidden_bytes);
        let fc2 = t.op1(&[gelu], x_bytes);
        let x2 = t.op1(&[x1, fc2], x_bytes);
        saved.push(Saved { x, ln1, qkv, probs, ctx, x1, ln2, fc1, gelu });
        x = x2;
    }
    let loss = t.op(&[x], &[F32, x_bytes]);
    let mut dx2 = loss[1];
    let mut grads = Vec::new();
    let mut update = |t: &mut OpTrace, inputs: &[Buf], bytes: usize| {
        let g = t.op1(inputs, bytes);
        if d.deferred_updates {
            grads.push(g);
        } else {
            t.op(&[g], &[]);
        }
    };
    for s in saved.iter().rev() {
        let dgelu = t.op1(&[dx2], hidden_bytes);
        update(&mut t, &[s.gelu, dx2], w2);
        let dfc1 = t.op1(&[dgelu, s.fc1], hidden_bytes);
        update(&mut t, &[s.ln2, dfc1], w1);
        let dln2 = t.op1(&[dfc1], x_bytes);
        let dx1 = t.op1(&[dln2, s.x1, dx2], x_bytes);
        let dctx = t.op1(&[dx1], x_bytes);
        update(&mut t, &[s.ctx, dx1], wo);
        let dprobs = t.op1(&[dctx, s.qkv], attn_bytes);
        let dv = t.op1(&[s.probs, dctx], x_bytes);
        let dscores = t.op1(&[dprobs, s.probs], attn_bytes);
        let dq = t.op1(&[dscores, s.qkv], x_bytes);
        let dk = t.op1(&[dscores, s.qkv], x_bytes);
        let dqkv = t.op1(&[dq, dk, dv], qkv_bytes);
        update(&mut t, &[s.ln1, dqkv], wqkv);
        let dln1 = t.op1(&[dqkv], x_bytes);
        dx2 = t.op1(&[dln1, s.x, dx1], x_bytes);
    }
    t.op(&[dx2, loss[0]], &[]);
    t.op(&grads, &[]);
    t.intervals()
}

/// `n` intervals over about `n` steps: sizes log-uniform from 64 B to 8 MiB, 90% living 1 to 8
/// steps and 10% living up to `long` steps. Deterministic for a seed.
pub fn random_mix(n: usize, long: usize, seed: u64) -> Vec<Interval> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|i| {
            let bytes = 1usize << (6 + rng.below(17));
            let bytes = bytes + rng.below(bytes as u64) as usize;
            let start = i + rng.below(4) as usize;
            let life = if rng.below(10) == 0 { rng.below(long.max(1) as u64) } else { rng.below(8) };
            Interval { bytes, start, end: start + life as usize }
        })
        .collect()
}

/// A small, well-known generator (Steele, Lea and Flood's SplitMix64): enough for workloads.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform-ish in `0..m` (`m > 0`).
    fn below(&mut self, m: u64) -> u64 {
        self.next() % m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_lifetimes_touch() {
        let ivs = chain(3, 8);
        assert_eq!(ivs, vec![Interval::new(8, 0, 1), Interval::new(8, 1, 2), Interval::new(8, 2, 2)]);
    }

    #[test]
    fn mlp_saves_activations_until_backward() {
        let ivs = mlp_training(2, &[3, 5]);
        // input x (saved for dW), h, z, relu (saved for dZ), ...
        assert_eq!(ivs[0], Interval::new(2 * 3 * 4, 0, 8));
        assert_eq!(ivs[3], Interval::new(2 * 5 * 4, 3, 5));
        assert!(ivs.iter().all(|iv| iv.start <= iv.end));
    }

    #[test]
    fn transformer_size() {
        let d = TransformerDims { batch: 1, seq: 8, model: 16, heads: 2, layers: 3, deferred_updates: false };
        let ivs = transformer_training(d);
        assert_eq!(ivs.len(), 1 + 12 * 3 + 2 + 17 * 3);
        assert!(ivs.iter().all(|iv| iv.start <= iv.end));
        let deferred = transformer_training(TransformerDims { deferred_updates: true, ..d });
        assert_eq!(deferred.len(), ivs.len());
        let last = deferred.iter().map(|iv| iv.end).max().unwrap();
        assert_eq!(deferred.iter().filter(|iv| iv.end == last).count(), 4 * 3);
    }
}
