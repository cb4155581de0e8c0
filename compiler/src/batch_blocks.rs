//! A forward pass computed a block of batch rows at a time, its intermediates block-sized.
//!
//! Elementwise fusion leaves a forward pass's peak where it is: a dense or convolutional layer
//! reads one whole activation while it writes the next, so the MLP's inference arena holds two
//! [256, 1024] activations and the cnn's two conv outputs, fused or not. But the rows of a
//! batch never meet in a forward pass until a loss or a statistic over the batch: every op from
//! the input to the logits computes row r of its output from row r of its batch operands and
//! from shared values (weights, biases, masks). So the chain can run a block of rows at a time,
//! each layer's block consumed by the next layer before the following block is made: the
//! fully fused MLP of tiny-cuda-nn and CUTLASS's back-to-back GEMMs keep such blocks in shared
//! memory for the same reason; the Ethos-U cascader and MCUNetV2's patch-based inference split
//! convolutional networks spatially to fit microcontrollers. Here the split is over the batch,
//! which works for any op that keeps rows apart, and the blocks are ordinary ops of the graph:
//!
//! - `region` finds the row-separable nodes: those whose output's axis 0 is the batch and whose
//!   operands are either row-separable themselves (or inputs of the batch, sliced per block)
//!   with their axis 0 aligned to the output's, or shared values broadcast along it (op by op
//!   in `rowwise`; any op not listed there ends the region, so a reduction over the batch, a
//!   loss's mean, a user's custom op and anything ordered by control edges stay whole);
//! - `split` copies the region once per block, on `Slice`s of the batch inputs, and joins each
//!   value that leaves the region (an output, or the operand of a node outside it) with one
//!   `Concat`; everything else is a block's and dies with it;
//! - `compile` plans the graph as it is and split into 2, 4 and 8 blocks (blocks of at least
//!   one row, and only where a block's products still reuse each shared factor element
//!   `MIN_REUSE` times), and keeps the plan with the smallest planned total: the graph as it
//!   is on a tie, and wherever the joins cost more than the blocks save (a transformer's
//!   forward pass, whose logits are its largest value). A memory limit the whole graph misses
//!   can be met by a split one.
//!
//! Only graphs without effects are split: in a training step every forward value feeds the
//! backward pass, so nearly every node leaves the region. The eager executor runs the graph
//! as traced, unsplit.
//!
//! Measured (`kiln memory <model> --mode forward`, the zoo at its default batches): see the
//! README's fusion section; the CPU time of the split plans is in `cargo bench --bench speed`.

use std::collections::{HashMap, HashSet};

use crate::error::{CompileError, Result};
use crate::ir::{DType, Graph, Node, NodeId, Op, Shape, infer};
use petgraph::algo::toposort;

/// The block counts `compile` tries.
pub const BLOCK_COUNTS: [usize; 4] = [2, 4, 8, 16];

/// Each block reads every shared factor of the region's products again (a dense layer's
/// weights, a convolution's filter) and packs it for its GEMM, so a block must use each such
/// weight this many times on average (the products' multiply-adds over their shared factors'
/// elements, per block). A dense layer uses each weight once per row, so its blocks keep 256
/// rows or more: the zoo's MLP forward pass (256 rows, CPU, 2 cores) took 5.1 ms whole,
/// 5.4-6.6 ms in 2 blocks of 128 rows, 7.0 ms in 4 and 7.6 ms in 8. A convolution uses each
/// filter weight at every output pixel, so its blocks can be a few images: the cnn's forward
/// pass (64 images of 32x32) took 21.1 ms whole, 21.4 ms in 4 blocks, 21.7 ms in 8 and 22.7 ms
/// in 16 (its dense head and filters allow 8).
pub const MIN_REUSE: u64 = 256;

/// What a region slices per block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sources {
    /// The graph's f32 inputs whose axis 0 is the batch (a forward pass).
    Inputs,
    /// Any f32 value outside the region whose axis 0 is the batch: an input, an embedding's
    /// rows, integer labels cast to f32 (a training step's forward graph, split before
    /// autodiff, `step::train_step_graph_in_blocks`). Slicing is right for any such operand:
    /// `rowwise` admits an op only where it computes output row r from row r of every operand
    /// that has the batch's rows.
    Values,
}

/// The row-separable part of a graph.
#[derive(Clone, Debug)]
pub struct Region {
    /// The batch: axis 0 of every node of the region.
    pub batch: usize,
    /// The region's nodes in a topological order.
    pub nodes: Vec<NodeId>,
    /// Nodes of the region read outside it, or graph outputs: each is joined from its blocks.
    pub exits: Vec<NodeId>,
    /// Values outside the region that it reads by rows: sliced once per block.
    pub sources: Vec<NodeId>,
    /// Bytes of the region's values that never leave it: what the split makes block-sized.
    pub internal_bytes: usize,
    /// Elements of the shared factors of the region's products, read once per block, and the
    /// products' multiply-adds (`Op::flops` / 2).
    pub shared_factor_elements: u64,
    /// The region's products' multiply-adds (`Op::flops` / 2).
    pub product_macs: u64,
}

impl Region {
    /// The block counts worth planning: blocks of a row at least, each using every shared
    /// factor element `MIN_REUSE` times on average.
    pub fn block_counts(&self) -> Vec<usize> {
        BLOCK_COUNTS
            .into_iter()
            .filter(|&k| {
                k <= self.batch && self.product_macs >= MIN_REUSE * k as u64 * self.shared_factor_elements
            })
            .collect()
    }
}

/// The row-separable region of `graph`, if it has values that never leave it; `None` for a
/// graph with effects, no batch input, or nothing a split would shrink.
pub fn region(graph: &Graph) -> Option<Region> {
    if !graph.effects().is_empty() {
        return None;
    }
    let order = toposort(graph.petgraph(), None).ok()?;
    // The batch is axis 0 of some input: each input's leading size is tried, the region with
    // the most bytes to shrink kept (the first on a tie).
    let mut sizes: Vec<usize> =
        graph.inputs().into_iter().filter_map(|i| graph.node(i).shape.dims().first().copied()).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut best: Option<Region> = None;
    for batch in sizes.into_iter().filter(|&b| b >= 2) {
        if let Some(r) = region_of(graph, &order, batch, Sources::Inputs)
            && best.as_ref().is_none_or(|b| r.internal_bytes > b.internal_bytes)
        {
            best = Some(r);
        }
    }
    best
}

/// The row-separable region of an effect-free graph whose batch is `batch` rows, reading
/// `sources` by rows; `None` where nothing a split would shrink.
pub fn region_with(graph: &Graph, batch: usize, sources: Sources) -> Option<Region> {
    if !graph.effects().is_empty() || batch < 2 {
        return None;
    }
    let order = toposort(graph.petgraph(), None).ok()?;
    region_of(graph, &order, batch, sources)
}

/// The region whose nodes' axis 0 is `batch`.
fn region_of(graph: &Graph, order: &[NodeId], batch: usize, sources: Sources) -> Option<Region> {
    let outputs: HashSet<NodeId> = graph.outputs().iter().map(|(_, o)| *o).collect();
    // Values of any dtype may be computed in blocks (a metric's comparisons are boolean), but
    // only f32 ones can be joined (`Concat` computes in f32): a region whose exit is of another
    // dtype is computed again without that node, until every exit is f32.
    let mut excluded: HashSet<NodeId> = HashSet::new();
    let (inside, nodes) = loop {
        let mut inside: HashSet<NodeId> = HashSet::new();
        let mut nodes = Vec::new();
        for &n in order {
            if !excluded.contains(&n) && rowwise(graph, n, batch, &inside, sources) {
                inside.insert(n);
                nodes.push(n);
            }
        }
        let unjoinable: Vec<NodeId> = nodes
            .iter()
            .copied()
            .filter(|&n| graph.node(n).dtype != DType::F32)
            .filter(|&n| outputs.contains(&n) || graph.users(n).iter().any(|u| !inside.contains(u)))
            .collect();
        if unjoinable.is_empty() {
            break (inside, nodes);
        }
        excluded.extend(unjoinable);
    };
    let mut sources_read: Vec<NodeId> = Vec::new();
    for &n in &nodes {
        for o in graph.operands(n) {
            if !inside.contains(&o) && source(graph, o, batch, sources) && !sources_read.contains(&o) {
                sources_read.push(o);
            }
        }
    }
    let exits: Vec<NodeId> = nodes
        .iter()
        .copied()
        .filter(|&n| outputs.contains(&n) || graph.users(n).iter().any(|u| !inside.contains(u)))
        .collect();
    let internal_bytes =
        nodes.iter().filter(|n| !exits.contains(n)).map(|&n| graph.node(n).bytes()).sum::<usize>();
    let (mut shared_factor_elements, mut product_macs) = (0u64, 0u64);
    for &n in &nodes {
        if matches!(graph.node(n).op, Op::MatMul { .. } | Op::Conv2d { .. }) {
            let operands = graph.operands(n);
            let shapes: Vec<&Shape> = operands.iter().map(|&o| &graph.node(o).shape).collect();
            product_macs += graph.node(n).op.flops(&shapes, &graph.node(n).shape) / 2;
            shared_factor_elements += operands
                .iter()
                .filter(|&&o| !inside.contains(&o) && !source(graph, o, batch, sources))
                .map(|&o| graph.node(o).shape.numel() as u64)
                .sum::<u64>();
        }
    }
    (internal_bytes > 0).then_some(Region {
        batch,
        nodes,
        exits,
        sources: sources_read,
        internal_bytes,
        shared_factor_elements,
        product_macs,
    })
}

/// A value the region may slice per block where it reads it: f32 with the batch as axis 0, and
/// an input unless `sources` admits any value. (An integer or boolean value, ids or a mask, is
/// read whole: `Slice` computes in f32.)
fn source(graph: &Graph, n: NodeId, batch: usize, sources: Sources) -> bool {
    let node = graph.node(n);
    (sources == Sources::Values || matches!(node.op, Op::Input { .. }))
        && node.dtype == DType::F32
        && node.shape.dims().first() == Some(&batch)
}

/// Whether row r of `n`'s output is computed from row r of its batch operands (nodes of the
/// region so far, `inside`, or `source`s) and from whole shared values alone.
fn rowwise(graph: &Graph, n: NodeId, batch: usize, inside: &HashSet<NodeId>, sources: Sources) -> bool {
    let node = graph.node(n);
    let out = &node.shape;
    if out.dims().first() != Some(&batch)
        || node.op.class() == crate::ir::OpClass::Source
        || !graph.control_predecessors(n).is_empty()
        || !graph.control_successors(n).is_empty()
    {
        return false;
    }
    let operands = graph.operands(n);
    let rows = |o: &NodeId| inside.contains(o) || source(graph, *o, batch, sources);
    if !operands.iter().any(rows) {
        return false;
    }
    let shape = |o: &NodeId| &graph.node(*o).shape;
    // Axis 0 of the operand is axis 0 of the output (NumPy broadcasting aligns trailing axes).
    let aligned = |o: &NodeId| shape(o).rank() == out.rank() && shape(o).dims()[0] == batch;
    // The operand is the same for every row: broadcast along the output's axis 0.
    let broadcast = |o: &NodeId| shape(o).rank() < out.rank() || shape(o).dims()[0] == 1;
    let elementwise = || operands.iter().all(|o| if rows(o) { aligned(o) } else { broadcast(o) });
    let one = || operands.len() == 1 && rows(&operands[0]);
    match &node.op {
        Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Select | Op::Cast { .. } | Op::Copy => {
            elementwise()
        }
        // A 2-D product's rows are the first factor's (untransposed); the second is shared. With
        // batch axes, axis 0 is a batch axis of every factor of the output's rank.
        Op::MatMul { transpose_a, .. } => match operands[..] {
            [a, b] if out.rank() == 2 => rows(&a) && !transpose_a && aligned(&a) && !rows(&b),
            [_, _] => elementwise(),
            _ => false,
        },
        Op::Reshape { .. } | Op::Slice { .. } | Op::Pad { .. } if !one() => false,
        Op::Reshape { .. } => shape(&operands[0]).dims()[0] == batch,
        Op::Slice { axis, .. } | Op::Pad { axis, .. } => *axis != 0,
        Op::Permute { perm } => one() && perm.first() == Some(&0),
        Op::BroadcastTo { .. } => one() && aligned(&operands[0]),
        Op::Concat { axis } => *axis != 0 && operands.iter().all(|o| rows(o) && aligned(o)),
        // Axis 0 kept: the output's axis 0 is the operand's, with or without the reduced axes.
        Op::Reduce { axes, .. } => {
            one() && !axes.contains(&0) && shape(&operands[0]).dims().first() == Some(&batch)
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => one() && *axis != 0,
        Op::Conv2d { .. } => matches!(operands[..], [x, w] if rows(&x) && aligned(&x) && !rows(&w)),
        Op::Pool2d { .. } => one() && aligned(&operands[0]),
        Op::Gather => {
            matches!(operands[..], [table, ids] if rows(&ids) && !rows(&table) && shape(&ids).dims().first() == Some(&batch))
        }
        _ => false,
    }
}

/// The rows of each of `blocks` blocks of `batch`: as equal as can be, the larger first.
pub fn block_rows(batch: usize, blocks: usize) -> Vec<(usize, usize)> {
    let (base, extra) = (batch / blocks, batch % blocks);
    let mut start = 0;
    (0..blocks)
        .map(|i| {
            let len = base + usize::from(i < extra);
            start += len;
            (start - len, len)
        })
        .collect()
}

/// `graph` with its region computed in `blocks` blocks of rows, one after another.
pub fn split(graph: &Graph, region: &Region, blocks: usize) -> Result<Graph> {
    let mut g = graph.clone();
    let inside: HashSet<NodeId> = region.nodes.iter().copied().collect();
    let sources: HashSet<NodeId> = region.sources.iter().copied().collect();
    let mut copies: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for (start, len) in block_rows(region.batch, blocks) {
        let mut block: HashMap<NodeId, NodeId> = HashMap::new();
        for &n in &region.nodes {
            let mut operands = Vec::new();
            for o in graph.operands(n) {
                let id = if inside.contains(&o) {
                    block[&o]
                } else if sources.contains(&o) {
                    match block.get(&o) {
                        Some(&s) => s,
                        None => {
                            let s = add(
                                &mut g,
                                graph.node(o),
                                Op::Slice { axis: 0, start, len },
                                &[o],
                                start,
                                len,
                            )?;
                            block.insert(o, s);
                            s
                        }
                    }
                } else {
                    o
                };
                operands.push(id);
            }
            let op = with_rows(&graph.node(n).op, len);
            let id = add(&mut g, graph.node(n), op, &operands, start, len)?;
            block.insert(n, id);
            copies.entry(n).or_default().push(id);
        }
    }
    for &e in &region.exits {
        let node = graph.node(e);
        let joined = g.add(Node { op: Op::Concat { axis: 0 }, ..node.clone() }, &copies[&e]);
        g.replace_uses(e, joined);
    }
    for &n in region.nodes.iter().rev() {
        g.remove(n);
    }
    Ok(g)
}

/// `op` with the batch in its shape parameters replaced by `rows`.
fn with_rows(op: &Op, rows: usize) -> Op {
    let rowed = |shape: &Shape| {
        let mut dims = shape.dims().to_vec();
        dims[0] = rows;
        Shape::new(dims)
    };
    match op {
        Op::Reshape { shape } => Op::Reshape { shape: rowed(shape) },
        Op::BroadcastTo { shape } => Op::BroadcastTo { shape: rowed(shape) },
        op => op.clone(),
    }
}

/// Adds `op` over `operands` as a block of rows `start..start + len` of `like`: its shape and
/// dtype inferred, its device and origin `like`'s, its name marked with the rows.
fn add(g: &mut Graph, like: &Node, op: Op, operands: &[NodeId], start: usize, len: usize) -> Result<NodeId> {
    let shapes: Vec<(Shape, crate::ir::DType)> =
        operands.iter().map(|&o| (g.node(o).shape.clone(), g.node(o).dtype)).collect();
    let refs: Vec<(&Shape, crate::ir::DType)> = shapes.iter().map(|(s, d)| (s, *d)).collect();
    let (shape, dtype) = infer(&op, &refs).map_err(|e| {
        CompileError::Internal(format!(
            "batch_blocks: rows {start}..{} of {}: {e:?}",
            start + len,
            like.describe()
        ))
    })?;
    let name = Some(format!(
        "{}[{start}..{}]",
        like.name.clone().unwrap_or_else(|| like.op.name().to_string()),
        start + len
    ));
    Ok(g.add(Node { op, shape, dtype, device: like.device, name, origin: like.origin }, operands))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, UnaryOp};

    /// x[rows, 4] -> relu(x · w + b) -> · w2 -> sum over the batch.
    fn mlp(with_total: bool) -> Graph {
        mlp_of(64, with_total)
    }

    fn mlp_of(rows: usize, with_total: bool) -> Graph {
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[rows, 4]);
        let w = g.add_input("w", &[4, 8]);
        let b = g.add_input("b", &[8]);
        let w2 = g.add_input("w2", &[8, 3]);
        let h = g.add_f32(Op::MatMul { transpose_a: false, transpose_b: false }, &[rows, 8], &[x, w]);
        let h = g.add_f32(Op::Binary(BinaryOp::Add), &[rows, 8], &[h, b]);
        let h = g.add_f32(Op::Unary(UnaryOp::Relu), &[rows, 8], &[h]);
        let y = g.add_f32(Op::MatMul { transpose_a: false, transpose_b: false }, &[rows, 3], &[h, w2]);
        g.set_output("y", y);
        if with_total {
            let op = Op::Reduce { op: crate::ir::ReduceOp::Sum, axes: vec![0, 1], keepdims: false };
            let t = g.add_f32(op, &[], &[y]);
            g.set_output("total", t);
        }
        g
    }

    #[test]
    fn rows_split_as_evenly_as_they_can() {
        assert_eq!(block_rows(10, 4), vec![(0, 3), (3, 3), (6, 2), (8, 2)]);
        assert_eq!(block_rows(64, 2), vec![(0, 32), (32, 32)]);
    }

    #[test]
    fn the_chain_is_the_region_and_the_reduction_ends_it() {
        let g = mlp(true);
        let r = region(&g).expect("a region");
        assert_eq!(r.batch, 64);
        assert_eq!(r.nodes.len(), 4, "matmul, add, relu, matmul");
        assert_eq!(r.exits.len(), 1, "the logits: an output and the sum's operand");
        assert_eq!(r.internal_bytes, 3 * 64 * 8 * 4);
        assert_eq!(r.shared_factor_elements, 4 * 8 + 8 * 3, "the products' weights, not x");
    }

    #[test]
    fn blocks_are_as_many_as_the_weights_rereads_allow() {
        // Each weight is used once per row: blocks of 256 rows at least.
        let counts = |rows| region(&mlp_of(rows, false)).unwrap().block_counts();
        assert_eq!(counts(256), Vec::<usize>::new());
        assert_eq!(counts(512), vec![2]);
        assert_eq!(counts(2048), vec![2, 4, 8]);
        assert_eq!(counts(4096), vec![2, 4, 8, 16]);
    }

    #[test]
    fn a_split_graph_slices_the_input_and_joins_the_exit() {
        let g = mlp(true);
        let r = region(&g).unwrap();
        let s = split(&g, &r, 4).unwrap();
        let y = s.output("y").unwrap();
        assert_eq!(s.node(y).op, Op::Concat { axis: 0 });
        assert_eq!(s.node(y).shape, Shape::new(vec![64, 3]));
        assert_eq!(s.operands(y).len(), 4);
        let total = s.output("total").unwrap();
        assert_eq!(s.operands(total), vec![y], "the sum reads the joined logits");
        let slices = s.node_ids().filter(|&n| matches!(s.node(n).op, Op::Slice { .. })).count();
        assert_eq!(slices, 4, "x is sliced once per block; the weights are shared");
        assert_eq!(s.len(), g.len() - 4 + 4 * 4 + 4 + 1);
        crate::passes::default_pipeline().run(&mut s.clone()).unwrap();
    }

    #[test]
    fn a_per_row_statistic_without_kept_axes_stays_in_the_region() {
        // A metric's shape: a comparison per element, summed over each row's classes
        // (`keepdims` false), then averaged over the batch outside the region.
        let mut g = mlp(false);
        let y = g.output("y").unwrap();
        let hit = g.add_f32(Op::Binary(BinaryOp::GreaterEqual), &[64, 3], &[y, y]);
        let op = Op::Reduce { op: crate::ir::ReduceOp::Sum, axes: vec![1], keepdims: false };
        let per_row = g.add_f32(op, &[64], &[hit]);
        let op = Op::Reduce { op: crate::ir::ReduceOp::Mean, axes: vec![0], keepdims: false };
        let rate = g.add_f32(op, &[], &[per_row]);
        g.set_output("rate", rate);
        let r = region(&g).unwrap();
        assert!(r.nodes.contains(&hit) && r.nodes.contains(&per_row));
        assert!(r.exits.contains(&per_row), "the [rows] sums are joined, not the [rows, classes] hits");
        assert!(!r.exits.contains(&hit));
    }

    #[test]
    fn graphs_with_effects_or_nothing_internal_are_left_alone() {
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[64, 4]);
        let y = g.add_f32(Op::Unary(UnaryOp::Relu), &[64, 4], &[x]);
        g.set_output("y", y);
        assert!(region(&g).is_none(), "the one value is an output");
        // A transposed first factor sums over the batch: not row-separable.
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[64, 4]);
        let h = g.add_f32(Op::Unary(UnaryOp::Relu), &[64, 4], &[x]);
        let gram = g.add_f32(Op::MatMul { transpose_a: true, transpose_b: false }, &[4, 4], &[h, h]);
        g.set_output("gram", gram);
        assert!(region(&g).is_none(), "relu's output is read whole by the product");
        assert!(!rowwise(&g, gram, 64, &[h].into_iter().collect(), Sources::Inputs));
    }
}
