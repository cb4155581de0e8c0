//! Per-step scratch: memory a step's kernel may use while it runs and never after, planned in
//! the arena like any buffer (TensorFlow Lite's per-node temporaries).
//!
//! Why: a kernel without scratch must reduce every output inside one thread block, which
//! starves the GPU when the outputs are few and the contraction long. A filter gradient of the
//! cnn (288 x 32 outputs contracted over 65,536 positions) ran in 36 blocks of 132 SMs and took
//! 1.02 of the cnn's 2.61 ms training step on an H100 (2026-11-25). With scratch, the product is
//! split over K across blocks, each writing a partial tile, and a second launch adds the partials
//! in a fixed order: as deterministic as before, with a planned buffer instead of atomics or a
//! workspace the backend would allocate behind the plan's back.
//!
//! A custom op may declare scratch of its own (`CustomOp::scratch`), which every plan gives it.
//! For the built-in ops the compiler does not know the kernels, so the bytes come from a
//! `ScratchRule` that the backend supplies (`CompileOptions::scratch`; `kiln_kernels::cuda::SCRATCH` for the CUDA
//! kernels): a plain function of the op and its shapes. A step with scratch gets a buffer live
//! at that step alone (`liveness`), named by `plan::Step::scratch`; the kernel is handed its
//! size and uses at most that (a plan compiled without a rule runs with kernels that use none).
//! Scratch counts in every figure like any other buffer: the arena, the lower bound, the naive
//! sum, device limits.

use crate::ir::{DType, Graph, NodeId, Op, OpClass, Shape};
use std::collections::HashMap;

/// How many scratch bytes a kernel of `op` over operands of these shapes and dtypes, writing
/// `output`, would use (0: none). Must be a pure function of its arguments.
pub type ScratchBytes = fn(op: &Op, operands: &[(&Shape, DType)], output: &Shape) -> usize;

/// A backend's scratch needs, with a name for messages and dumps, and what else the compiler
/// must know of the target it plans for.
#[derive(Clone, Copy)]
pub struct ScratchRule {
    /// The rule's name for messages and dumps (e.g. the backend's).
    pub name: &'static str,
    /// The scratch bytes a kernel of a given op and shapes uses.
    pub bytes: ScratchBytes,
    /// Whether a forward pass runs in blocks of batch rows (`batch_blocks`) only where the whole
    /// graph misses its memory limit, rather than wherever a split plans smaller. A GPU wants
    /// every launch as large as the batch makes it: on an H200 each split made every zoo forward
    /// pass slower (cnn 0.192 ms whole, 0.249 in 2 blocks, 0.319 in 4, 0.503 in 8; mlp 0.063,
    /// 0.101, 0.196, 0.268), for a few MB of arena on a device of 141 GB.
    pub blocks_only_to_fit: bool,
}

impl std::fmt::Debug for ScratchRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ScratchRule({})", self.name)
    }
}

impl PartialEq for ScratchRule {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && std::ptr::fn_addr_eq(self.bytes, other.bytes)
    }
}

/// The scratch bytes of every step of `graph` that asks for some: what `rule` asks for, and on
/// every backend what a custom op declares (`CustomOp::scratch`), the larger of the two.
pub fn of_graph(graph: &Graph, rule: Option<&ScratchRule>) -> Scratch {
    let mut bytes = HashMap::new();
    for n in graph.node_ids() {
        let node = graph.node(n);
        // Without a rule only custom ops can ask (a 100k-node graph is walked in microseconds).
        if matches!(node.op.class(), OpClass::Source | OpClass::View)
            || (rule.is_none() && !matches!(node.op, Op::Custom { .. } | Op::AllGather { .. }))
        {
            continue;
        }
        let operands: Vec<(&Shape, DType)> = graph
            .operands(n)
            .into_iter()
            .map(|o| {
                let o = graph.node(o);
                (&o.shape, o.dtype)
            })
            .collect();
        let asked = rule.map_or(0, |r| (r.bytes)(&node.op, &operands, &node.shape));
        let b = asked.max(declared(&node.op, &operands, &node.shape));
        if b > 0 {
            bytes.insert(n, b);
        }
    }
    Scratch { bytes }
}

/// The scratch a step needs on every backend: a custom op's declared scratch
/// (`CustomOp::scratch`), and an all-gather's copy of its rank's shard (the communicator reads
/// the shard from there while it writes every rank's shard into the variable).
pub fn declared(op: &Op, operands: &[(&Shape, DType)], output: &Shape) -> usize {
    match op {
        Op::AllGather { shard } => {
            operands.first().map_or(0, |(s, d)| shard.padded(s.numel()).saturating_mul(d.size_bytes()))
        }
        _ => crate::custom::declared_scratch(op, operands, output),
    }
}

/// Scratch bytes by step node; steps not named have none.
#[derive(Clone, Debug, Default)]
pub struct Scratch {
    bytes: HashMap<NodeId, usize>,
}

impl Scratch {
    /// No step has scratch.
    pub fn none() -> Self {
        Scratch::default()
    }

    /// The scratch bytes of step `n` (0 when it has none).
    pub fn bytes(&self, n: NodeId) -> usize {
        self.bytes.get(&n).copied().unwrap_or(0)
    }

    /// Whether no step has scratch.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}
