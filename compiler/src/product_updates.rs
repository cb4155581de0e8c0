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
//!
//! In a mixed-precision step (`autocast`) a weight's gradient is its half copy's: the product
//! of half factors, summed in f32, rounded to the half type and widened to the f32 master
//! weight's type by the cast's gradient — a chain of the product and two casts (fused into one
//! op or not). It folds as a whole: the update reads the half factors, and its kernel rounds
//! each element of its tile to their type before applying it, the bits of the chain (the CPU
//! widens the factors a panel at a time as its products do, `Gemm::run_mixed`; the CUDA kernel
//! runs the tensor-core tile and rounds in the store). A transposed weight's gradient (a
//! permute of the rounded product, as torch.onnx writes `x·Wᵀ`) has its permute folded into
//! the product first (`transpose_operands`). Only where the backend computes products in half
//! (`HalfKernels::PRODUCTS`), and never an update gated on finite gradients (f16's loss
//! scaling reads every gradient before any update). Measured (`kiln memory --precision bf16`,
//! planned totals): the zoo's mlp 27,607,292 -> 26,960,124 B; the cnn, the transformer and the
//! real-scale steps (GPT-2, BERT-base, ViT-B/16, ResNet-50, EfficientNet-B0) are unchanged, their
//! peaks at the end of the forward pass, where no weight gradient lives yet.

use crate::error::Result;
use crate::ir::fused::{Inst, Ref};
use crate::ir::{DType, Grad, Graph, NodeId, Op};
use crate::widen::HalfKernels;

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
/// updates; returns how many. A product of half factors folds only where `kernels` compute
/// products in half (`HalfKernels::PRODUCTS`): the update reads the half factors themselves.
pub fn fold(graph: &mut Graph, selection: Selection, kernels: HalfKernels) -> Result<usize> {
    let candidates: Vec<(NodeId, Chain)> = graph
        .effects()
        .into_iter()
        .filter_map(|e| foldable(graph, e, kernels).map(|c| (e, c)))
        .filter(|(e, c)| selection == Selection::All || pays(graph, *e, c))
        .collect();
    for (effect, chain) in &candidates {
        replace(graph, *effect, chain);
    }
    Ok(candidates.len())
}

/// What an update's gradient is made of when it can be folded: the product `aᵀ·b` and the
/// nodes between it and the update, the gradient the update reads last. A product of half
/// factors is summed in f32 (`DType::accumulated`), rounded to the half type and widened back
/// to the f32 master weight's type (`autocast`: the half copy's gradient, as PyTorch's
/// autocast makes a weight's gradient): (product, rounding, widening), which a product update
/// whose factors are half computes (`ir::Grad::Product`). f32 factors: the product alone.
struct Chain {
    nodes: Vec<NodeId>,
}

impl Chain {
    fn product(&self) -> NodeId {
        self.nodes[0]
    }

    fn gradient(&self) -> NodeId {
        self.nodes[self.nodes.len() - 1]
    }
}

/// The gradient chain of `effect` when it can be folded.
fn foldable(graph: &Graph, effect: NodeId, kernels: HalfKernels) -> Option<Chain> {
    let node = graph.node(effect);
    if node.op.update_grad() != Some(Grad::Operand)
        || matches!(node.op, Op::ApplySgd { rows: Some(_), .. } | Op::ApplyAdam { rows: Some(_), .. })
        || node.op.update_gate(graph.operands(effect).len()).is_some()
    {
        return None;
    }
    let operands = graph.operands(effect);
    let (var, grad) = (*operands.first()?, *operands.get(1)?);
    let chain = chain(graph, grad, kernels)?;
    let only_read_onward = chain.nodes.windows(2).all(|w| graph.users(w[0]) == [w[1]]);
    let outputs = chain.nodes.iter().any(|n| graph.outputs().iter().any(|(_, o)| o == n));
    if !only_read_onward
        || graph.users(grad) != [effect]
        || outputs
        || chain.nodes.iter().any(|&n| graph.node(n).device != node.device)
    {
        return None;
    }
    let g = graph.node(chain.product());
    let factors = graph.operands(chain.product());
    let [a, b] = factors.as_slice() else { return None };
    let (sa, sb) = (&graph.node(*a).shape, &graph.node(*b).shape);
    let w = &graph.node(var).shape;
    let shapes = sa.rank() == 2 && sb.rank() == 2 && sa.dims()[0] > 0 && w.rank() == 2 && *w == g.shape;
    // The kernel reads the factors while it writes the variable and its state.
    let apart = factors_apart(graph, effect, &factors);
    let devices = factors.iter().all(|&f| graph.node(f).device == node.device);
    // The folded op runs where the chain ran: nothing the chain must precede may have to run
    // before the update.
    let acyclic = chain.nodes.iter().all(|&n| {
        graph
            .successors(n)
            .filter(|s| *s != effect && !chain.nodes.contains(s))
            .all(|s| !petgraph::algo::has_path_connecting(graph.petgraph(), s, effect, None))
    });
    (shapes && apart && devices && acyclic).then_some(chain)
}

/// `grad` as a product update computes it: `aᵀ·b` of f32 factors, or of half factors rounded
/// to their type and widened to f32 (`Chain`): the product alone or fused with its casts
/// (`fusion`), and cast nodes after it.
fn chain(graph: &Graph, grad: NodeId, kernels: HalfKernels) -> Option<Chain> {
    let product = Op::MatMul { transpose_a: true, transpose_b: false };
    // From the gradient back to the product: the cast nodes, then the product's node.
    let mut nodes = vec![grad];
    let mut casts = Vec::new();
    let mut at = grad;
    while let Op::Cast { to } = graph.node(at).op {
        casts.push(to);
        let [below] = graph.operands(at)[..] else { return None };
        at = below;
        nodes.push(at);
    }
    nodes.reverse();
    casts.reverse();
    // The casts a fused product applies to its value, in order, before those of the nodes.
    let fused_casts = match &graph.node(at).op {
        op if *op == product => Vec::new(),
        Op::Fused(f)
            if f.product().as_ref() == Some(&product) && f.reduce.is_none() && f.epilogue.is_empty() =>
        {
            let mut own = Vec::new();
            for (j, inst) in f.insts.iter().enumerate() {
                let from = if j == 0 { Ref::Operand(0) } else { Ref::Value(j as u32 - 1) };
                match *inst {
                    Inst::Cast(to, r) if r == from => own.push(to),
                    _ => return None,
                }
            }
            own
        }
        _ => return None,
    };
    let factors: Vec<DType> = graph.operands(at).iter().map(|&f| graph.node(f).dtype).collect();
    let [fa, fb] = factors[..] else { return None };
    let all_casts: Vec<DType> = fused_casts.into_iter().chain(casts).collect();
    let computed = match all_casts[..] {
        [] => fa == DType::F32,
        [h, DType::F32] => h.is_half() && fa == h && kernels.contains(HalfKernels::PRODUCTS),
        _ => false,
    };
    (computed && fa == fb && graph.node(grad).dtype == DType::F32).then_some(Chain { nodes })
}

/// Whether folding `effect` with its gradient `chain` saves at least what it may cost
/// (`Selection::Paying`).
fn pays(graph: &Graph, effect: NodeId, chain: &Chain) -> bool {
    let Some(&a) = graph.operands(chain.product()).first() else { return false };
    let readers_of_old = graph.control_predecessors(effect);
    let writes_over_a = |u: NodeId| {
        let node = graph.node(u);
        graph.operands(u).iter().enumerate().any(|(i, &o)| o == a && node.op.may_write_over(i, &node.shape))
    };
    let held = graph.users(a).into_iter().any(|u| readers_of_old.contains(&u) && writes_over_a(u));
    !held || graph.node(chain.gradient()).bytes() >= graph.node(a).bytes()
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

/// Makes `effect` a product update reading the chain's factors, and removes the chain, whose
/// ordering (control) edges the update takes. The update is changed in place rather than
/// replaced: removing a node walks the edge lists of its neighbours, and the iteration counter
/// every Adam update reads has thousands (a 100k-node graph folded 4,688 updates in 345 ms
/// that way, 3 ms this way).
fn replace(graph: &mut Graph, effect: NodeId, chain: &Chain) {
    let operands = graph.operands(effect);
    let factors = graph.operands(chain.product());
    let mut before = Vec::new();
    let mut after = Vec::new();
    for &n in &chain.nodes {
        before.extend(graph.control_predecessors(n));
        after.extend(graph.successors(n).filter(|s| *s != effect && !chain.nodes.contains(s)));
    }
    before.retain(|p| !chain.nodes.contains(p));
    let mut reads = vec![operands[0]];
    reads.extend(&factors);
    reads.extend(&operands[2..]);
    graph.set_operands(effect, &reads);
    for &n in chain.nodes.iter().rev() {
        graph.remove(n);
    }
    let op = graph.node(effect).op.update_in(None, Grad::Product);
    graph.node_mut(effect).op = op;
    for p in before {
        graph.add_control(p, effect);
    }
    for s in after {
        graph.add_control(effect, s);
    }
}
