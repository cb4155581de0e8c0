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
use crate::ir::{Graph, Node, NodeId, Op, ReduceOp, Shape};
use crate::liveness::VIEW_ALIGN;

/// The default gradient bucket: at most this many bytes of gradients reduced by one collective.
/// Measured (the zoo's training steps at half their batch, per-rank arena in bytes, one
/// collective per gradient / buckets of 256 KiB / 1 MiB / 4 MiB / 25 MiB): seed-mlp 11,200 /
/// 11,328 at every cap; mlp 5,243,008 up to 4 MiB, 8,910,080 at 25 MiB; cnn 14,041,216 /
/// 14,041,728 / 14,041,728 / 14,046,912 / 14,046,912; transformer 14,596,288 up to 1 MiB,
/// 14,600,256 at 4 MiB, 14,074,048 at 25 MiB. Collectives per step at 1 MiB: 1, 5, 3 and 7
/// (from 4, 6, 12 and 21). PyTorch DDP's 25 MiB holds all of the mlp's gradients until its
/// last one is made (+70%) and reduces everything at the end of the backward pass; 1 MiB (the
/// size of DDP's first bucket) costs at most 512 B on the zoo and starts reducing the last
/// layers' gradients while the backward pass goes on.
pub const BUCKET_BYTES: usize = 1 << 20;

/// What `all_reduce_gradients_in_buckets` made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Buckets {
    /// The updates whose gradients are reduced.
    pub gradients: usize,
    /// Each bucket's bytes (its gradients', with the padding that aligns each to
    /// `liveness::VIEW_ALIGN`), in the order the gradients are made; a gradient alone in its
    /// bucket is reduced where it lies, unpadded (its own bytes).
    pub sizes: Vec<usize>,
}

/// Inserts the mean over the ranks between every optimizer update of `graph` and its gradient
/// operand, in buckets of `BUCKET_BYTES`; returns how many gradients.
pub fn all_reduce_gradients(graph: &mut Graph) -> Result<usize> {
    Ok(all_reduce_gradients_in_buckets(graph, BUCKET_BYTES)?.gradients)
}

/// Inserts the mean over the ranks between every optimizer update of `graph` and its gradient,
/// the gradients laid out in buckets of at most `bucket_bytes` (0: one collective per gradient;
/// a gradient larger than the cap is a bucket of its own), filled in the order the backward pass
/// makes them, as DDP fills its buckets.
///
/// A bucket is a concatenation of its flattened gradients, reduced in place by one
/// `AllReduce`, each update reading its gradient back as a slice. The planner writes every
/// gradient at its offset inside the bucket and reads each slice where it lies (`liveness`'s
/// views), so a bucket is one arena buffer, contiguous, that costs no copy and no second
/// buffer, and its collective can run as soon as its last gradient is made. A gradient whose
/// bytes are not a multiple of `VIEW_ALIGN` is zero-padded to one (a copy of that gradient
/// alone: biases of odd widths), so that the next one starts aligned.
pub fn all_reduce_gradients_in_buckets(graph: &mut Graph, bucket_bytes: usize) -> Result<Buckets> {
    let updates: Vec<NodeId> = graph
        .node_ids()
        .filter(|&n| {
            matches!(
                graph.node(n).op,
                Op::ApplySgd { product: false, .. } | Op::ApplyAdam { product: false, .. }
            )
        })
        .collect();
    // The order the backward pass makes the gradients in (the last layer's first): by their
    // depth, the longest chain of ops from the graph's sources to each (a topological order
    // alone may visit the layers in any order).
    let order = petgraph::algo::toposort(graph.petgraph(), None)
        .map_err(|_| crate::error::CompileError::Internal("the training step has a cycle".into()))?;
    let mut depth: std::collections::HashMap<NodeId, usize> = std::collections::HashMap::new();
    for &n in &order {
        let d = graph.predecessors(n).map(|p| depth.get(&p).map_or(0, |d| d + 1)).max().unwrap_or(0);
        depth.insert(n, d);
    }
    let mut by_order: Vec<(usize, NodeId, NodeId)> =
        updates.iter().map(|&u| (depth[&graph.operands(u)[1]], u, graph.operands(u)[1])).collect();
    by_order.sort_unstable();
    let padded = |graph: &Graph, g: NodeId| graph.node(g).bytes().next_multiple_of(VIEW_ALIGN);
    let mut buckets: Vec<Vec<(NodeId, NodeId)>> = Vec::new();
    let mut size = 0;
    for &(_, u, g) in &by_order {
        let bytes = padded(graph, g);
        let joins = buckets.last().is_some_and(|b| {
            let first = graph.node(b[0].1);
            let node = graph.node(g);
            size + bytes <= bucket_bytes && node.device == first.device && node.dtype == first.dtype
        });
        if joins {
            buckets.last_mut().expect("joins only a bucket").push((u, g));
            size += bytes;
        } else {
            buckets.push(vec![(u, g)]);
            size = bytes;
        }
    }
    let mut out = Buckets { gradients: updates.len(), sizes: Vec::new() };
    for (k, bucket) in buckets.iter().enumerate() {
        if let [(u, g)] = bucket[..] {
            let name = graph.node(g).name.clone().unwrap_or_else(|| graph.node(g).op.name().into());
            let r = mean_over_ranks(graph, g, format!("{name}/all_reduce"));
            graph.replace_operand(u, 1, r);
            // f16 loss scaling checks what the update reads: the same bits on every rank.
            crate::loss_scale::redirect_checks(graph, g, r);
            out.sizes.push(graph.node(g).bytes());
            continue;
        }
        let mut pieces = Vec::with_capacity(bucket.len());
        let mut at = 0;
        for &(_, g) in bucket {
            let node = graph.node(g).clone();
            let (n, size) = (node.shape.numel(), node.dtype.size_bytes());
            let flat = graph.add(
                Node {
                    op: Op::Reshape { shape: Shape::new(vec![n]) },
                    shape: Shape::new(vec![n]),
                    ..node.clone()
                },
                &[g],
            );
            let pad = (padded(graph, g) - node.bytes()) / size;
            let piece = if pad == 0 {
                flat
            } else {
                let shape = Shape::new(vec![n + pad]);
                let op = Op::Pad { axis: 0, before: 0, after: pad };
                graph.add(Node { op, shape, ..node.clone() }, &[flat])
            };
            pieces.push((piece, at, n));
            at += n + pad;
        }
        let first = graph.node(bucket[0].1).clone();
        let shape = Shape::new(vec![at]);
        let name = format!("bucket {k}");
        let concat = graph.add(
            Node {
                op: Op::Concat { axis: 0 },
                shape: shape.clone(),
                name: Some(name.clone()),
                ..first.clone()
            },
            &pieces.iter().map(|p| p.0).collect::<Vec<_>>(),
        );
        let reduced = mean_over_ranks(graph, concat, format!("{name}/all_reduce"));
        for (&(u, g), &(_, start, len)) in bucket.iter().zip(&pieces) {
            let node = graph.node(g).clone();
            let gname = node.name.clone().unwrap_or_else(|| node.op.name().into());
            let slice = graph.add(
                Node {
                    op: Op::Slice { axis: 0, start, len },
                    shape: Shape::new(vec![len]),
                    name: Some(format!("{gname}/from {name}")),
                    ..node.clone()
                },
                &[reduced],
            );
            let back = graph.add(
                Node {
                    op: Op::Reshape { shape: node.shape.clone() },
                    name: Some(format!("{gname}/from {name}")),
                    ..node
                },
                &[slice],
            );
            graph.replace_operand(u, 1, back);
            crate::loss_scale::redirect_checks(graph, g, back);
        }
        out.sizes.push(at * first.dtype.size_bytes());
    }
    Ok(out)
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

    fn step() -> Graph {
        let model = crate::nn::Sequential::new().add(Dense::new(5)).add(Dense::new(2));
        let cfg = TrainConfig {
            optimizer: Optimizer::Adam(Adam::new(1e-3)),
            loss: Loss::MeanSquaredError,
            metrics: Vec::new(),
        };
        train_step_graph(&model, Shape::from([4, 3]), Shape::from([4, 2]), &cfg).unwrap()
    }

    #[test]
    fn every_update_reads_an_all_reduced_gradient() {
        let mut g = step();
        let b = all_reduce_gradients_in_buckets(&mut g, 0).unwrap();
        assert_eq!(b.gradients, 4, "two kernels and two biases");
        assert_eq!(b.sizes.len(), 4, "one collective each");
        for u in g.effects() {
            if matches!(g.node(u).op, Op::ApplyAdam { .. }) {
                let grad = g.operands(u)[1];
                assert_eq!(g.node(grad).op, Op::AllReduce { op: ReduceOp::Mean });
            }
        }
    }

    #[test]
    fn buckets_hold_the_gradients_in_the_order_they_are_made_each_aligned() {
        let mut g = step();
        let b = all_reduce_gradients_in_buckets(&mut g, BUCKET_BYTES).unwrap();
        // 3x5 + 5 + 5x2 + 2 floats, each padded to 16 bytes: 64 + 32 + 48 + 16.
        assert_eq!(b.sizes, [160]);
        let concat = g.node_ids().find(|&n| matches!(g.node(n).op, Op::Concat { .. })).unwrap();
        let pieces: Vec<usize> = g.operands(concat).iter().map(|&p| g.node(p).shape.numel()).collect();
        // By depth: the last layer's kernel gradient first, then the first layer's, then the
        // biases' (a sum and a reshape deep); the odd sizes are padded (`Pad`).
        assert_eq!(pieces.iter().map(|n| n * 4).collect::<Vec<_>>(), [48, 64, 16, 32]);
        for u in g.effects() {
            if matches!(g.node(u).op, Op::ApplyAdam { .. }) {
                // reshape(slice(all_reduce(concat)))
                let slice = g.operands(g.operands(u)[1])[0];
                assert!(matches!(g.node(slice).op, Op::Slice { axis: 0, .. }));
                let reduced = g.operands(slice)[0];
                assert_eq!(g.node(reduced).op, Op::AllReduce { op: ReduceOp::Mean });
                assert_eq!(g.operands(reduced), [concat]);
            }
        }
        // A cap below one gradient: each is its own bucket.
        let mut g = step();
        assert_eq!(all_reduce_gradients_in_buckets(&mut g, 8).unwrap().sizes.len(), 4);
    }
}
