//! Save what the gradient needs, no more: which forward values a training step keeps for its
//! backward pass, chosen by a minimum cut.
//!
//! Autodiff reads, in the backward pass, whatever forward values the rules name: a batch norm
//! composed of elementwise ops keeps its centred input `x - mean` (for the square's and the
//! product's gradients) and its normalised value (for the scale's gradient) beside the ReLU's
//! output; a SiLU keeps its input and its sigmoid. Each is as large as the activation. Every one
//! of them is a few elementwise ops away from a value that must be kept anyway or is cheaper to
//! keep: the convolution's output and two per-channel statistics. PyTorch's kernels encode
//! that by hand (cuDNN's batch norm keeps its input, a mean and an inverse deviation); this pass
//! derives it for any graph, as the min-cut partitioner of `torch.compile` (Chen et al.'s
//! checkpointing framed as a cut) does:
//!
//! - The forward graph is the operand-ancestors of the graph's outputs (the loss and metrics).
//!   Each forward node `v` becomes two network nodes, `in(v) -> out(v)`; cutting that edge
//!   means keeping `v` for the backward pass and costs its bytes. Every operand edge
//!   `out(o) -> in(v)` is uncuttable, and so is `out(v) -> sink` where a backward node reads
//!   `v`: everything the backward pass reads is either kept or recomputed from kept values.
//! - The source feeds `in(v)` without limit where `v` cannot be recomputed: products,
//!   convolutions, pooling gradients, attention, gathers, custom ops and collectives run once
//!   (keeping them is the only way the backward pass sees them). Sources (variables, inputs)
//!   and the graph's outputs are held anyway: keeping them costs nothing.
//! - A cheap op (elementwise, a layout copy, a reduction, a softmax, a pooling, a fill) may be
//!   recomputed: the source feeds `in(v)` with `lambda x Op::flops(v)` (plus one, so that a tie
//!   keeps rather than recomputes), what recomputing it costs. Nodes left on the sink side are
//!   recomputed in the backward pass.
//!
//! `lambda` starts at 0 (bytes alone) and is raised (doubling, then bisection) until the
//! recomputed FLOPs fit `CompileOptions::recompute_budget` of the step's own, the 2% the
//! default allows. The cut's nodes on the sink side that a backward node reads (and their
//! operands on the sink side) are cloned once each, `name (recomputed)`, and the backward
//! readers read the clones. The clones carry no anchor: every candidate order runs an op whose
//! operands are ready when nothing earlier is (program order: the clones are the newest nodes),
//! frees the most (memory order: a clone only allocates) or just before its reader (depth
//! first), so they run in the backward pass where they are read. A clone that reads a variable
//! runs before that variable's updates (control edges), so it reads the value the forward pass
//! read. The clones compute the same values with the same kernels, so results are the same bits.
//!
//! The rewrite runs before fusion, so a recomputed chain becomes one fused op like any other.

use crate::error::Result;
use crate::ir::{Graph, Node, NodeId, Op, OpClass};
use crate::remat::{node_flops, root};
use petgraph::graph::{DiGraph, NodeIndex};
use petgraph::visit::EdgeRef;
use std::collections::{HashMap, HashSet, VecDeque};

/// The default share of a training step's FLOPs that recomputation may add (2%).
pub const FLOPS_BUDGET: f64 = 0.02;

/// Graphs with more nodes than this are left as they are (each cut is a max-flow over twice the
/// forward pass's nodes).
pub const MAX_NODES: usize = 200_000;

/// At most this many cuts are tried while raising `lambda`.
const MAX_CUTS: usize = 24;

/// A capacity no cut can pay.
const INFINITE: u64 = 1 << 62;

/// What the rewrite did to a graph (`plan::RewriteFigures::saved_values`).
pub use crate::plan::SavedValuesFigures;

/// Keeps, of the forward values the backward pass reads, what the cut chooses, and recomputes
/// the rest in the backward pass within `budget` (a share of the step's FLOPs). A graph without
/// effects (no training step) or outputs is left as it is.
pub fn rewrite(graph: &mut Graph, budget: f64) -> Result<SavedValuesFigures> {
    if graph.effects().is_empty() || graph.outputs().is_empty() || graph.len() > MAX_NODES {
        return Ok(SavedValuesFigures::default());
    }
    let Some(forward) = Forward::of(graph) else { return Ok(SavedValuesFigures::default()) };
    let step_flops: u64 = graph.node_ids().map(|n| node_flops(graph, n)).sum();
    let allowed = (step_flops as f64 * budget) as u64;
    let before = forward.kept_bytes(graph, &HashSet::new());

    // lambda = 0: bytes alone; raise it until the recomputation fits the budget.
    let mut best = forward.cut(graph, 0);
    if best.flops > allowed {
        let mut low = 0u64;
        let mut high = 1u64;
        let mut tries = 1;
        let mut fitting = None;
        while tries < MAX_CUTS {
            tries += 1;
            let cut = forward.cut(graph, high);
            if cut.flops <= allowed {
                fitting = Some(cut);
                break;
            }
            low = high;
            high = high.saturating_mul(4);
        }
        while tries < MAX_CUTS && high - low > 1 {
            tries += 1;
            let mid = low + (high - low) / 2;
            let cut = forward.cut(graph, mid);
            if cut.flops <= allowed {
                fitting = Some(cut);
                high = mid;
            } else {
                low = mid;
            }
        }
        match fitting {
            Some(cut) => best = cut,
            None => return Ok(SavedValuesFigures::default()),
        }
    }
    if best.recompute.is_empty() {
        return Ok(SavedValuesFigures::default());
    }
    let after = forward.kept_bytes(graph, &best.recompute);
    if after >= before {
        return Ok(SavedValuesFigures::default());
    }
    let mut rewritten = graph.clone();
    let ops = apply(&mut rewritten, &forward, &best.recompute);
    if petgraph::algo::is_cyclic_directed(rewritten.petgraph()) {
        return Ok(SavedValuesFigures::default());
    }
    *graph = rewritten;
    Ok(SavedValuesFigures {
        recomputed_ops: ops,
        recomputed_flops: best.flops,
        step_flops,
        kept_bytes_before: before,
        kept_bytes_after: after,
    })
}

/// The forward pass and what the backward pass reads of it.
struct Forward {
    /// Forward nodes in a topological order (operands first).
    nodes: Vec<NodeId>,
    index: HashMap<NodeId, usize>,
    /// Forward nodes a backward node reads, with those readers.
    read_late: HashMap<NodeId, Vec<NodeId>>,
}

impl Forward {
    fn of(g: &Graph) -> Option<Forward> {
        // Operand-ancestors of the outputs; effects are never forward nodes.
        let mut seen: HashSet<NodeId> = HashSet::new();
        let mut stack: Vec<NodeId> = g.outputs().iter().map(|(_, o)| *o).collect();
        while let Some(n) = stack.pop() {
            if g.node(n).op.is_effect() || !seen.insert(n) {
                continue;
            }
            stack.extend(g.operands(n));
        }
        let order = petgraph::algo::toposort(g.petgraph(), None).ok()?;
        let nodes: Vec<NodeId> = order.into_iter().filter(|n| seen.contains(n)).collect();
        let index = nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut read_late: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        for &n in &nodes {
            for u in g.users(n) {
                if !seen.contains(&u) && !g.node(u).op.is_effect() {
                    let readers = read_late.entry(n).or_default();
                    if !readers.contains(&u) {
                        readers.push(u);
                    }
                }
            }
        }
        Some(Forward { nodes, index, read_late })
    }

    /// The bytes held for the backward pass when the nodes of `recompute` are recomputed: each
    /// kept value read late, or read by a recomputed node, that has storage of its own.
    fn kept_bytes(&self, g: &Graph, recompute: &HashSet<NodeId>) -> usize {
        let mut kept: HashSet<NodeId> = HashSet::new();
        let mut visit: Vec<NodeId> = self.read_late.keys().copied().collect();
        let mut seen: HashSet<NodeId> = HashSet::new();
        while let Some(n) = visit.pop() {
            if !seen.insert(n) {
                continue;
            }
            if recompute.contains(&n) {
                visit.extend(g.operands(n));
            } else {
                kept.insert(root(g, n));
            }
        }
        kept.iter().filter(|&&n| !is_held_anyway(g, n)).map(|&n| g.node(n).bytes()).sum()
    }

    /// The minimum cut at `lambda` (capacity units per FLOP; a byte is `BYTE` units).
    fn cut(&self, g: &Graph, lambda: u64) -> Cut {
        const BYTE: u64 = 16;
        let n = self.nodes.len();
        let mut net: DiGraph<(), u64, u32> = DiGraph::with_capacity(2 * n + 2, 6 * n);
        for _ in 0..2 * n + 2 {
            net.add_node(());
        }
        let (source, sink) = (NodeIndex::new(2 * n), NodeIndex::new(2 * n + 1));
        let inn = |i: usize| NodeIndex::new(2 * i);
        let out = |i: usize| NodeIndex::new(2 * i + 1);
        let outputs: HashSet<NodeId> = g.outputs().iter().map(|(_, o)| *o).collect();
        for (i, &v) in self.nodes.iter().enumerate() {
            let node = g.node(v);
            let keep = if is_held_anyway(g, v) || outputs.contains(&v) {
                0
            } else if node.op.class() == OpClass::View {
                INFINITE
            } else {
                (node.bytes() as u64).saturating_mul(BYTE).min(INFINITE)
            };
            net.add_edge(inn(i), out(i), keep);
            let recompute = if cheap(node) && !outputs.contains(&v) {
                lambda.saturating_mul(node_flops(g, v)).saturating_add(1).min(INFINITE)
            } else {
                INFINITE
            };
            net.add_edge(source, inn(i), recompute);
            for o in g.operands(v) {
                if let Some(&j) = self.index.get(&o) {
                    net.add_edge(out(j), inn(i), INFINITE);
                }
            }
            if self.read_late.contains_key(&v) {
                net.add_edge(out(i), sink, INFINITE);
            }
        }
        let (_, flows) = petgraph::algo::dinics(&net, source, sink);
        // The source side: reachable from the source in the residual network.
        let mut reached = vec![false; net.node_count()];
        reached[source.index()] = true;
        let mut queue = VecDeque::from([source]);
        while let Some(a) = queue.pop_front() {
            for e in net.edges_directed(a, petgraph::Direction::Outgoing) {
                let b = e.target();
                if !reached[b.index()] && flows[e.id().index()] < *e.weight() {
                    reached[b.index()] = true;
                    queue.push_back(b);
                }
            }
            for e in net.edges_directed(a, petgraph::Direction::Incoming) {
                let b = e.source();
                if !reached[b.index()] && flows[e.id().index()] > 0 {
                    reached[b.index()] = true;
                    queue.push_back(b);
                }
            }
        }
        // Recomputed: the nodes on the sink side that the backward pass needs.
        let mut recompute = HashSet::new();
        let mut stack: Vec<NodeId> =
            self.read_late.keys().copied().filter(|v| !reached[inn(self.index[v]).index()]).collect();
        while let Some(v) = stack.pop() {
            if !recompute.insert(v) {
                continue;
            }
            for o in g.operands(v) {
                if self.index.get(&o).is_some_and(|&j| !reached[inn(j).index()]) {
                    stack.push(o);
                }
            }
        }
        // A view of a kept value is read as it is: no clone.
        for &v in &self.nodes {
            if recompute.contains(&v)
                && g.node(v).op.class() == OpClass::View
                && g.operands(v).first().is_none_or(|o| !recompute.contains(o))
            {
                recompute.remove(&v);
            }
        }
        let flops = recompute.iter().map(|&v| node_flops(g, v)).sum();
        Cut { recompute, flops }
    }
}

struct Cut {
    recompute: HashSet<NodeId>,
    flops: u64,
}

/// Clones the nodes of `recompute` (operands first) and points their backward readers at the
/// clones; a clone reading a variable runs before the variable's updates. Returns the ops added
/// that compute (views aside).
fn apply(g: &mut Graph, forward: &Forward, recompute: &HashSet<NodeId>) -> usize {
    let mut writers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for e in g.effects() {
        for o in g.operands(e) {
            let r = root(g, o);
            if matches!(g.node(r).op, Op::Variable { .. }) {
                writers.entry(r).or_default().push(e);
            }
        }
    }
    let mut clone_of: HashMap<NodeId, NodeId> = HashMap::new();
    let mut ops = 0;
    for &v in forward.nodes.iter().filter(|v| recompute.contains(v)) {
        let node = g.node(v).clone();
        let operands: Vec<NodeId> =
            g.operands(v).into_iter().map(|o| clone_of.get(&o).copied().unwrap_or(o)).collect();
        let view = node.op.class() == OpClass::View;
        let name = match node.name.as_deref() {
            Some(n) if view || n.ends_with(" (recomputed)") => n.to_string(),
            Some(n) => format!("{n} (recomputed)"),
            None if view => node.op.name().to_string(),
            None => format!("{} (recomputed)", node.op.name()),
        };
        let clone = g.add(Node { name: Some(name), ..node }, &operands);
        if !view {
            ops += 1;
        }
        for o in g.operands(v) {
            if let Some(es) = writers.get(&root(g, o)) {
                for &e in es {
                    g.add_control(clone, e);
                }
            }
        }
        clone_of.insert(v, clone);
    }
    for (&v, readers) in &forward.read_late {
        let Some(&clone) = clone_of.get(&v) else { continue };
        for &u in readers {
            for (i, o) in g.operands(u).into_iter().enumerate() {
                if o == v {
                    g.replace_operand(u, i, clone);
                }
            }
        }
    }
    ops
}

/// Ops whose recomputation is cheap next to what keeping their output costs: elementwise ops,
/// layout copies, reductions, softmaxes, pooling, fills and counter-based random values.
/// Products, convolutions and their gradients, attention, gathers, custom ops, collectives,
/// sources and effects are never recomputed here.
fn cheap(node: &Node) -> bool {
    match node.op.class() {
        OpClass::Elementwise | OpClass::View => true,
        OpClass::Source | OpClass::Effect => false,
        OpClass::Compute => matches!(
            node.op,
            Op::Fill { .. }
                | Op::Iota { .. }
                | Op::RandomUniform { .. }
                | Op::Permute { .. }
                | Op::BroadcastTo { .. }
                | Op::Copy
                | Op::Cast { .. }
                | Op::Concat { .. }
                | Op::Slice { .. }
                | Op::Pad { .. }
                | Op::Reduce { .. }
                | Op::Softmax { .. }
                | Op::LogSoftmax { .. }
                | Op::Pool2d { .. }
        ),
    }
}

/// Values held whatever the backward pass reads: sources (variables, inputs).
fn is_held_anyway(g: &Graph, n: NodeId) -> bool {
    g.node(root(g, n)).op.class() == OpClass::Source
}
