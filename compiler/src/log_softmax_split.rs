//! A log-softmax over the last axis, split into its row statistics so that its readers recompute
//! it: `log_softmax(x) = (x - max) - ln(sum(exp(x - max)))`, with `max` and the log-sum a value
//! per row ([.., 1]) and the [.., classes] result an elementwise chain that each reader's fused
//! group computes as it goes (XLA and JAX differentiate `log_softmax` this way, keeping the logits
//! and the per-row statistics rather than the result).
//!
//! Why: the log-softmax's result was a [rows, classes] buffer made in the forward pass and held
//! until its gradient (`g - exp(y) * sum(g)`) read it, beside the logits it was computed from,
//! which the forward pass still had live: at the loss both were in the arena, with the targets.
//! Split, the logits are kept instead of the result (the same size, one buffer instead of two
//! where they overlapped), the loss sums `y * ((x - max) - lse)` without storing it, and the
//! gradient recomputes `exp((x - max) - lse)`. Measured (`kiln memory transformer`): the zoo
//! transformer's training arena 36,421,696 -> 32,342,144 B (its peak was the loss, where the
//! targets, the logits and the log-softmax of [8, 128, 1000] were all live), 117 plan steps
//! before and after (the row maximum is its accuracy metric's); a 2,000-class head at 64 rows with one-hot targets 1,545,216 -> 1,034,112 B.
//!
//! The split computes the very bits of the log-softmax kernel (`kiln_kernels::cpu::softmax`
//! computes the row's log-sum as this split does: the reduction's sum of `exp(x - max)` rounded
//! to f32, then the elementwise `ln`), so fused plans train bit for bit as unfused ones on the
//! CPU. Only last-axis log-softmaxes whose every reader can take the recomputation into its fused
//! group (elementwise ops and reductions) are split; one read by a product, an output, or ordered
//! by control edges stays one op. Plans only: the eager executor runs the log-softmax as one op,
//! as frameworks do.

use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Node, NodeId, Op, ReduceOp, UnaryOp};

/// What the split did to a graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SplitFigures {
    /// Log-softmaxes split.
    pub split: usize,
    /// Ops added (net): the statistics and one recomputation per reader, less the op itself.
    pub added_ops: usize,
}

/// Splits every eligible log-softmax of `graph`.
pub fn split(graph: &mut Graph) -> Result<SplitFigures> {
    let candidates: Vec<NodeId> = graph.node_ids().filter(|&n| eligible(graph, n)).collect();
    let before = graph.node_ids().count();
    for &n in &candidates {
        split_one(graph, n);
    }
    Ok(SplitFigures { split: candidates.len(), added_ops: graph.node_ids().count() - before })
}

/// Readers that take a recomputed operand into their fused group.
fn recomputes(node: &Node) -> bool {
    matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Select | Op::Reduce { .. })
}

fn eligible(graph: &Graph, n: NodeId) -> bool {
    let node = graph.node(n);
    let Op::LogSoftmax { axis } = node.op else { return false };
    let users = graph.users(n);
    axis + 1 == node.shape.rank()
        && node.dtype == crate::ir::DType::F32
        && !users.is_empty()
        && !graph.outputs().iter().any(|(_, o)| *o == n)
        && graph.control_predecessors(n).is_empty()
        && graph.control_successors(n).is_empty()
        && users.iter().all(|&u| recomputes(graph.node(u)))
}

fn split_one(graph: &mut Graph, n: NodeId) {
    let node = graph.node(n).clone();
    let Op::LogSoftmax { axis } = node.op else { return };
    let x = graph.operands(n)[0];
    let mut row = node.shape.dims().to_vec();
    row[axis] = 1;
    let row = crate::ir::Shape::new(row);
    let make = |graph: &mut Graph, op: Op, shape: &crate::ir::Shape, operands: &[NodeId]| {
        graph.add(Node { op, shape: shape.clone(), ..node.clone() }, operands)
    };
    let reduce = |op| Op::Reduce { op, axes: vec![axis], keepdims: true };
    // The row maximum an accuracy metric already takes of the same logits serves both.
    let existing = graph.users(x).into_iter().find(|&u| {
        let n = graph.node(u);
        n.op == reduce(ReduceOp::Max) && n.device == node.device && graph.control_predecessors(u).is_empty()
    });
    let max = match existing {
        Some(m) => m,
        None => make(graph, reduce(ReduceOp::Max), &row, &[x]),
    };
    let shifted = make(graph, Op::Binary(BinaryOp::Sub), &node.shape, &[x, max]);
    let exp = make(graph, Op::Unary(UnaryOp::Exp), &node.shape, &[shifted]);
    let sum = make(graph, reduce(ReduceOp::Sum), &row, &[exp]);
    let lse = make(graph, Op::Unary(UnaryOp::Log), &row, &[sum]);
    // One copy of the result per reader, so each reader's group computes it.
    for u in graph.users(n) {
        for (i, o) in graph.operands(u).into_iter().enumerate() {
            if o == n {
                let shifted = make(graph, Op::Binary(BinaryOp::Sub), &node.shape, &[x, max]);
                let result = make(graph, Op::Binary(BinaryOp::Sub), &node.shape, &[shifted, lse]);
                graph.replace_operand(u, i, result);
            }
        }
    }
    graph.remove(n);
}
