//! Product updates: an optimizer update computes its own weight gradient, which is never stored.
//!
//! A dense layer's weight gradient `aᵀ·b` (activations against deltas) is read by its optimizer
//! update alone. Stored, it is a whole weight-sized buffer at the training peak (tiled updates,
//! `tiled_updates`, cut that to a quarter of a weight). Here the update takes the two factors in
//! the gradient's place (`ir::Grad::Product`), and its kernel makes the gradient a tile at a
//! time and applies each tile as it goes: the CPU kernel in blocks of rows, each into a tile of
//! at most 256 KiB per thread (the size of the GEMM's own packing buffers, outside the arena as
//! they are), the CUDA kernel as the GEMM's store, each product handed to Adam's (or SGD's) arithmetic in
//! registers. No launch is added: the product and the update were two kernels and are one.
//!
//! It is fusion (a producer folded into its only consumer), and only done with fusion on
//! (`CompileOptions::fuse`). Folding is not always smaller: a folded update keeps its factors
//! until every reader of the old weight has run, and where one of those readers would have
//! written over the activation (relu's gradient, `Op::may_write_over`) the activation costs its
//! bytes again. So the schedule search plans the graph as it is, with tiled updates, with every
//! update folded (`Selection::All`) and with the folds that pay (`Selection::Paying`, the rest
//! tiled), and keeps the smallest. The results are the unfused ones: the CPU's blocks are the
//! same GEMM on fewer rows (every element's sum runs over the same k in the same order;
//! `tests/product_updates.rs` trains bitwise as the unfused plan), and a CUDA thread applies the
//! value it would have stored.
//!
//! An update is folded when its gradient is a `MatMul` with a transposed first factor of two
//! matrices, read by the update alone and not an output, on the update's device, with a
//! non-empty contraction, neither factor is (a view of) something the update writes, and the
//! merged op closes no cycle. Measured (2-core build machine, 64-byte slots; kiln planned total
//! / XLA's, `cargo bench --bench peers`): seed-mlp train 27,488 -> 27,232 B (0.855 -> 0.847: the
//! first layer folded, the 10 -> 1 layer tiled), mlp 27.12 -> 26.32 MB (0.830 -> 0.806: its
//! arena 4.75 -> 3.96 MB, every weight gradient gone from it), res-mlp 0.924 -> 0.919; plan
//! steps seed-mlp 27 -> 20, mlp 47 -> 26. CPU step time unchanged (`cargo bench --bench speed`:
//! mlp fused/unfused 0.99): the blocks run in parallel, one thread each.

use crate::error::Result;
use crate::ir::{Grad, Graph, NodeId, Op};

/// Which updates `fold` folds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Selection {
    /// Every update it can.
    All,
    /// Those where folding cannot cost more than it saves. A folded update keeps its first
    /// factor (the layer's input activation) until every reader of the old weight has run; when
    /// one of those readers may write over that activation (the input gradient's fused product,
    /// which applies relu's gradient to it, `Op::may_write_over`), it no longer can, and the
    /// activation costs its bytes again. Such an update is folded only when its gradient is at
    /// least as large as the activation.
    Paying,
}

/// Folds the updates `selection` picks among those whose gradient is a lone `aᵀ·b` into product
/// updates; returns how many.
pub fn fold(graph: &mut Graph, selection: Selection) -> Result<usize> {
    let candidates: Vec<(NodeId, NodeId)> = graph
        .effects()
        .into_iter()
        .filter_map(|e| foldable(graph, e).map(|g| (e, g)))
        .filter(|&(e, g)| selection == Selection::All || pays(graph, e, g))
        .collect();
    for &(effect, grad) in &candidates {
        replace(graph, effect, grad);
    }
    Ok(candidates.len())
}

/// The gradient node of `effect` when it can be folded.
fn foldable(graph: &Graph, effect: NodeId) -> Option<NodeId> {
    let node = graph.node(effect);
    if node.op.update_grad() != Some(Grad::Operand)
        || matches!(node.op, Op::ApplySgd { rows: Some(_), .. } | Op::ApplyAdam { rows: Some(_), .. })
    {
        return None;
    }
    let operands = graph.operands(effect);
    let (var, grad) = (*operands.first()?, *operands.get(1)?);
    let g = graph.node(grad);
    if !matches!(g.op, Op::MatMul { transpose_a: true, transpose_b: false })
        || graph.users(grad) != [effect]
        || graph.outputs().iter().any(|(_, o)| *o == grad)
        || g.device != node.device
    {
        return None;
    }
    let factors = graph.operands(grad);
    let [a, b] = factors.as_slice() else { return None };
    let (sa, sb) = (&graph.node(*a).shape, &graph.node(*b).shape);
    let w = &graph.node(var).shape;
    let shapes = sa.rank() == 2 && sb.rank() == 2 && sa.dims()[0] > 0 && w.rank() == 2 && *w == g.shape;
    // The kernel reads the factors while it writes the variable and its state.
    let apart = factors_apart(graph, effect, &factors);
    let devices = factors.iter().all(|&f| graph.node(f).device == node.device);
    // The folded op runs where both ran: nothing the product must precede may have to run
    // before the update.
    let acyclic = graph
        .successors(grad)
        .filter(|&s| s != effect)
        .all(|s| !petgraph::algo::has_path_connecting(graph.petgraph(), s, effect, None));
    (shapes && apart && devices && acyclic).then_some(grad)
}

/// Whether folding `effect` with its gradient `grad` saves at least what it may cost
/// (`Selection::Paying`).
fn pays(graph: &Graph, effect: NodeId, grad: NodeId) -> bool {
    let Some(&a) = graph.operands(grad).first() else { return false };
    let readers_of_old = graph.control_predecessors(effect);
    let writes_over_a = |u: NodeId| {
        let node = graph.node(u);
        graph.operands(u).iter().enumerate().any(|(i, &o)| o == a && node.op.may_write_over(i, &node.shape))
    };
    let held = graph.users(a).into_iter().any(|u| readers_of_old.contains(&u) && writes_over_a(u));
    !held || graph.node(grad).bytes() >= graph.node(a).bytes()
}

/// The node whose buffer `id` is: through reshapes (views) to their source.
/// Whether none of `factors` is (a reshape of) something the update `effect` writes: a kernel
/// that reads them while it writes the variable a block at a time (a product update, tiled
/// updates) would read rows it already changed.
pub(crate) fn factors_apart(graph: &Graph, effect: NodeId, factors: &[NodeId]) -> bool {
    let operands = graph.operands(effect);
    let written: Vec<NodeId> = graph
        .node(effect)
        .op
        .mutated_operands()
        .iter()
        .filter_map(|&i| operands.get(i))
        .map(|&n| root(graph, n))
        .collect();
    factors.iter().all(|&f| !written.contains(&root(graph, f)))
}

fn root(graph: &Graph, mut id: NodeId) -> NodeId {
    while matches!(graph.node(id).op, Op::Reshape { .. }) {
        match graph.operands(id).first() {
            Some(&src) => id = src,
            None => break,
        }
    }
    id
}

/// Makes `effect` a product update reading `grad`'s factors, and removes `grad`, whose
/// ordering (control) edges the update takes. The update is changed in place rather than
/// replaced: removing a node walks the edge lists of its neighbours, and the iteration counter
/// every Adam update reads has thousands (a 100k-node graph folded 4,688 updates in 345 ms
/// that way, 3 ms this way).
fn replace(graph: &mut Graph, effect: NodeId, grad: NodeId) {
    let operands = graph.operands(effect);
    let factors = graph.operands(grad);
    let before = graph.control_predecessors(grad);
    let after: Vec<NodeId> = graph.successors(grad).filter(|&s| s != effect).collect();
    let mut reads = vec![operands[0]];
    reads.extend(&factors);
    reads.extend(&operands[2..]);
    graph.set_operands(effect, &reads);
    graph.remove(grad);
    let op = graph.node(effect).op.update_in(None, Grad::Product);
    graph.node_mut(effect).op = op;
    for p in before {
        graph.add_control(p, effect);
    }
    for s in after {
        graph.add_control(effect, s);
    }
}
