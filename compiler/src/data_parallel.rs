//! Data parallelism: a training step that runs on every rank of a group, each on its shard of
//! the batch, with the gradients averaged across the ranks before the optimizer applies them.
//!
//! The step is the single-rank training step (`step::train_step_graph` at the per-rank batch)
//! with one `Op::AllReduce { op: Mean }` between each weight gradient and its update. Being ops
//! of the graph, the collectives get what every other value gets: their buffers are the
//! gradients' own (reduced in place, `Op::may_write_over`), planned in the arena and checked
//! before anything runs, and their place in the schedule is the planner's, each issued where
//! its gradient is complete, while the rest of the backward pass is still to run. The averaged
//! gradient is the same bits on every rank (the communicator adds in rank order), so every rank
//! applies the same update and the weights stay bitwise identical (`tests/data_parallel.rs`).
//!
//! With equal shards the average of the ranks' mean gradients is the mean gradient of the whole
//! batch, up to float summation order: N ranks at batch B/N train the weights one rank trains at
//! batch B. A batch that N does not divide is padded to equal shards by the `Trainer`
//! (repeating its first rows, as PyTorch's `DistributedSampler` pads), so every rank runs one
//! plan and the average stays the mean over the padded batch.
//!
//! An update that computes its gradient product itself (`product_updates`) or a block of rows at
//! a time (`tiled_updates`) cannot be used here: the gradient must exist to be reduced. Both
//! rewrites look for the gradient's product as the update's operand, which is now the
//! all-reduce, so they leave these updates alone.

use crate::error::Result;
use crate::ir::{Graph, Node, NodeId, Op, ReduceOp};

/// Inserts an all-reduce (mean over the ranks) between every optimizer update of `graph` and
/// its gradient operand; returns how many.
pub fn all_reduce_gradients(graph: &mut Graph) -> Result<usize> {
    let updates: Vec<_> = graph
        .node_ids()
        .filter(|&n| {
            matches!(
                graph.node(n).op,
                Op::ApplySgd { product: false, .. } | Op::ApplyAdam { product: false, .. }
            )
        })
        .collect();
    for &u in &updates {
        let grad = graph.operands(u)[1];
        let name = graph.node(grad).name.clone().unwrap_or_else(|| graph.node(grad).op.name().into());
        let r = mean_over_ranks(graph, grad, format!("{name}/all_reduce"));
        graph.replace_operand(u, 1, r);
    }
    Ok(updates.len())
}

/// A new node: `of`'s mean over the ranks, named `name`, on `of`'s device.
fn mean_over_ranks(graph: &mut Graph, of: NodeId, name: String) -> NodeId {
    let node = graph.node(of);
    let reduced = Node {
        op: Op::AllReduce { op: ReduceOp::Mean },
        shape: node.shape.clone(),
        dtype: node.dtype,
        device: node.device,
        name: Some(name),
        origin: node.origin,
    };
    graph.add(reduced, &[of])
}

/// Makes each of the scalar outputs `names` (the loss, the metrics) its mean over the ranks, so
/// that every rank reports the whole batch's figures (with equal shards); returns how many.
pub fn all_reduce_outputs(graph: &mut Graph, names: &[&str]) -> Result<usize> {
    let mut n = 0;
    for name in names {
        let Some(out) = graph.output(name) else { continue };
        let r = mean_over_ranks(graph, out, format!("{name}/all_reduce"));
        graph.set_output(*name, r);
        n += 1;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Shape;
    use crate::losses::Loss;
    use crate::nn::Dense;
    use crate::optim::{Adam, Optimizer};
    use crate::step::{TrainConfig, train_step_graph};

    #[test]
    fn every_update_reads_an_all_reduced_gradient() {
        let model = Dense::new(2);
        let cfg = TrainConfig {
            optimizer: Optimizer::Adam(Adam::new(1e-3)),
            loss: Loss::MeanSquaredError,
            metrics: Vec::new(),
        };
        let mut g = train_step_graph(&model, Shape::from([4, 3]), Shape::from([4, 2]), &cfg).unwrap();
        let n = all_reduce_gradients(&mut g).unwrap();
        assert_eq!(n, 2, "kernel and bias");
        for u in g.effects() {
            if matches!(g.node(u).op, Op::ApplyAdam { .. }) {
                let grad = g.operands(u)[1];
                assert_eq!(g.node(grad).op, Op::AllReduce { op: ReduceOp::Mean });
            }
        }
    }
}
