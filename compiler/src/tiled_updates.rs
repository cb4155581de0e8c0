//! Tiled updates: a weight gradient that only its optimizer update reads is never whole.
//!
//! With updates as early as legal, what is left at a dense network's training peak is one
//! weight gradient beside the activations and deltas its product reads: on the zoo's `mlp`
//! (784 -> 1024 -> 1024 -> 10, batch 256), the first layer's 3.2 MB gradient `xᵀ·dz` is 45% of
//! the 7.2 MB arena at the peak. XLA's buffer assignment keeps such a gradient whole too.
//!
//! This rewrite splits every update `update(W, aᵀ·b)` whose gradient has no other reader into
//! blocks of rows: `g_i = a[:, rows_i]ᵀ · b` (`Op::MatMulRows`, reading the block of `a` in place,
//! no copy) then `update_i(W[rows_i], g_i)` (the update's `rows`), chained so that block i + 1 is
//! computed after block i is applied: one block is live at a time. A block is a quarter of the
//! gradient (`BLOCKS`), at least one alignment unit; a gradient that would be one block stays
//! whole. Four blocks keep most of the saving (mlp arena 4.75 MB; 16 blocks reach 4.21 MB) for
//! three more launches per layer.
//!
//! The results are the untiled ones up to the products' summation order: each block is its own
//! GEMM, whose k-blocking may differ from the whole product's in the last bit
//! (`CompileOptions::tile_updates` off gives bitwise the untiled results).
//!
//! The rewrite is one candidate of the search (`compile`): the graph is planned with and
//! without it and the smaller planned total is kept, so it is used only where it saves memory;
//! under a memory limit rematerialization tries both graphs. Measured (2-core build machine,
//! 256-byte alignment), kiln planned total / XLA's: `mlp` train 0.905 -> 0.830 (29.55 -> 27.12
//! MB), `seed-mlp` 0.962 -> 0.890; the `cnn` and `transformer` keep their untiled plans (their
//! peaks are not at a weight gradient).

use crate::error::Result;
use crate::ir::{Grad, Graph, Node, NodeId, Op, Rows, Shape};

/// A gradient is cut into at most about this many blocks of rows.
pub const BLOCKS: usize = 4;

/// The graph with its updates tiled, and how many were.
pub struct Tiled {
    /// The graph with the tiled updates in place of the whole ones.
    pub graph: Graph,
    /// How many updates were tiled.
    pub updates: usize,
}

/// Tiles every update whose gradient is a product `aᵀ·b` of two matrices (`MatMul` with a
/// transposed left operand, the shape of every dense layer's weight gradient, batch axes
/// folded) read by the update alone; None when there is none. `alignment` is the plan's slot
/// alignment: a block is at least that many bytes, since a smaller one would not save more.
pub fn tile(graph: &Graph, alignment: usize) -> Result<Option<Tiled>> {
    let candidates: Vec<(NodeId, NodeId)> = graph
        .effects()
        .into_iter()
        .filter_map(|e| tileable(graph, e).map(|g| (e, g)))
        .filter(|&(_, g)| rows_per_block(graph.node(g), alignment) < graph.node(g).shape.dims()[0])
        .collect();
    if candidates.is_empty() {
        return Ok(None);
    }
    let mut g = graph.clone();
    for &(effect, grad) in &candidates {
        split(&mut g, effect, grad, alignment);
    }
    Ok(Some(Tiled { graph: g, updates: candidates.len() }))
}

/// The gradient node of `effect` when the update can be tiled.
fn tileable(graph: &Graph, effect: NodeId) -> Option<NodeId> {
    let node = graph.node(effect);
    if !matches!(
        node.op,
        Op::ApplyAdam { rows: None, product: false, .. } | Op::ApplySgd { rows: None, product: false, .. }
    ) {
        return None;
    }
    let operands = graph.operands(effect);
    let (var, grad) = (*operands.first()?, *operands.get(1)?);
    let g = graph.node(grad);
    let product = matches!(g.op, Op::MatMul { transpose_a: true, transpose_b: false });
    let only_reader = graph.users(grad) == [effect] && !graph.outputs().iter().any(|(_, o)| *o == grad);
    let ab = graph.operands(grad);
    let matrices = ab.len() == 2 && ab.iter().all(|&x| graph.node(x).shape.rank() == 2);
    let w = &graph.node(var).shape;
    let same_device = ab.iter().all(|&x| graph.node(x).device == node.device) && g.device == node.device;
    // Each block's product reads the factors after the blocks before it were applied.
    let apart = crate::product_updates::factors_apart(graph, effect, &ab);
    (product
        && only_reader
        && matrices
        && same_device
        && apart
        && w.rank() == 2
        && *w == g.shape
        && w.dims()[0] >= 2)
        .then_some(grad)
}

/// The rows in each block of the gradient `product`: about 1/`BLOCKS` of it, at least one
/// alignment unit and one row.
fn rows_per_block(product: &Node, alignment: usize) -> usize {
    let (rows, cols) = (product.shape.dims()[0], product.shape.dims()[1]);
    let row_bytes = (cols * product.dtype.size_bytes()).max(1);
    let block_bytes = (rows * row_bytes / BLOCKS).max(alignment);
    (block_bytes / row_bytes).clamp(1, rows)
}

/// Replaces `effect` and its gradient `grad` by chained blocks.
fn split(g: &mut Graph, effect: NodeId, grad: NodeId, alignment: usize) {
    let (update, product) = (g.node(effect).clone(), g.node(grad).clone());
    let operands = g.operands(effect);
    let ab = g.operands(grad);
    let before = g.control_predecessors(effect);
    let after: Vec<NodeId> = g.successors(effect).collect();
    let (rows, cols) = (product.shape.dims()[0], product.shape.dims()[1]);
    let per_block = rows_per_block(&product, alignment);
    g.remove(effect);
    g.remove(grad);
    let mut previous: Option<NodeId> = None;
    for start in (0..rows).step_by(per_block) {
        let block = Rows { start, len: per_block.min(rows - start) };
        let shape = Shape::new(vec![block.len, cols]);
        let mm = g.add(Node { op: Op::MatMulRows { rows: block }, shape, ..product.clone() }, &ab);
        let op = update.op.update_in(Some(block), Grad::Operand);
        let mut reads = operands.clone();
        reads[1] = mm;
        let up = g.add(Node { op, ..update.clone() }, &reads);
        for &p in &before {
            g.add_control(p, up);
        }
        for &s in &after {
            g.add_control(up, s);
        }
        if let Some(p) = previous {
            g.add_control(p, mm);
        }
        previous = Some(up);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Init;
    use crate::nn::{Dense, Sequential};
    use crate::optim::Adam;
    use crate::passes::Pass;
    use crate::step::{TrainConfig, train_step_graph};

    fn mlp() -> Graph {
        let model = Sequential::new().add(Dense::new(64).relu()).add(Dense::new(3));
        let config = TrainConfig {
            loss: crate::losses::Loss::SoftmaxCrossEntropy,
            optimizer: Adam::new(0.01).into(),
            metrics: vec![],
        };
        let mut g = train_step_graph(&model, Shape::from([16, 40]), Shape::from([16, 3]), &config).unwrap();
        crate::passes::default_pipeline().run(&mut g).unwrap();
        g
    }

    #[test]
    fn dense_updates_are_tiled_in_chained_blocks() {
        let g = mlp();
        let t = tile(&g, 256).unwrap().expect("dense weight gradients are tiled");
        // The two kernels; the biases' gradients are sums, not products.
        assert_eq!(t.updates, 2);
        let blocks: Vec<NodeId> =
            t.graph.node_ids().filter(|&n| matches!(t.graph.node(n).op, Op::MatMulRows { .. })).collect();
        // 40x64 floats = 10,240 B in blocks of 2,560 B (10 rows of 64): 4 blocks; 64x3 = 768 B
        // in blocks of 256 B, the alignment (21 rows of 12 B, the last of 1): 4 blocks.
        assert_eq!(blocks.len(), 4 + 4);
        // A gradient of one alignment unit or less stays whole.
        assert!(tile(&g, 1 << 14).unwrap().is_none());
        // Every block's update reads it and has no other reader; blocks are chained.
        for &b in &blocks {
            let users = t.graph.users(b);
            assert_eq!(users.len(), 1);
            assert!(matches!(t.graph.node(users[0]).op, Op::ApplyAdam { rows: Some(_), .. }));
        }
        let chained = blocks.iter().filter(|&&b| !t.graph.control_predecessors(b).is_empty()).count();
        assert_eq!(chained, blocks.len() - 2, "all but each gradient's first block wait for the previous");
        // Every variable row is updated exactly once.
        let mut covered = std::collections::HashMap::<NodeId, usize>::new();
        for e in t.graph.effects() {
            if let Op::ApplyAdam { rows: Some(r), .. } = t.graph.node(e).op {
                *covered.entry(t.graph.operands(e)[0]).or_default() += r.len;
            }
        }
        for (var, n) in covered {
            assert_eq!(n, t.graph.node(var).shape.dims()[0]);
        }
        crate::passes::Verify.run(&mut t.graph.clone()).unwrap();
    }

    #[test]
    fn shared_gradients_and_other_products_are_left_alone() {
        let t = crate::trace::Tracer::new("shared");
        let x = t.input("x", [8, 6]);
        let w = t.param("w", [6, 6], Init::GlorotUniform);
        let y = x.matmul(&w);
        let g = x.matmul_t(&y, true, false);
        t.output("g", &g);
        let mut graph = t.finish().unwrap();
        crate::passes::default_pipeline().run(&mut graph).unwrap();
        assert!(tile(&graph, 256).unwrap().is_none(), "no update, nothing to tile");
    }

    /// A gradient whose factor is the variable it updates (wᵀ·w) is not tiled: each block's
    /// product would read rows the blocks before it had already changed.
    #[test]
    fn a_gradient_reading_its_own_variable_is_left_whole() {
        let t = crate::trace::Tracer::new("own");
        let w = t.param("w", [8, 8], Init::GlorotUniform);
        let g = w.matmul_t(&w, true, false);
        crate::optim::Optimizer::from(crate::optim::Sgd::new(0.1)).apply(&[(w.clone(), "w".into(), g)]);
        t.output("w", &w.reshape([64]));
        let mut graph = t.finish().unwrap();
        crate::passes::default_pipeline().run(&mut graph).unwrap();
        assert!(tile(&graph, 64).unwrap().is_none(), "wᵀ·w updating w stays whole");
    }
}
