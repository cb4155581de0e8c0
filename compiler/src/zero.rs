//! Sharded optimizer state (ZeRO stages 1 and 2, as DeepSpeed names them): in a data-parallel
//! step each rank keeps and updates only its shard of every variable's optimizer state, then
//! the ranks gather the updated weights, so the state's memory is divided by the rank count.
//!
//! The rewrite of the single-rank training step, for every optimizer update of a variable W of
//! n elements (`Shard::range`: rank r owns a contiguous run of about n/N elements; every rank
//! stores `Shard::padded(n)` elements, so that all ranks' plans have one shape):
//!
//! - stage 1: the gradient is all-reduced whole, in the buckets of plain data parallelism
//!   (`data_parallel::all_reduce_gradients`: one `Op::AllReduce` per bucket, in place), and the
//!   update reads its shard at its offset;
//! - stage 2: the gradient is reduce-scattered (`Op::ReduceScatter`): each rank receives just
//!   its shard of the mean gradient, and the whole local gradient dies there;
//! - the update (`ApplyAdam`/`ApplySgd` with `shard`) writes W's shard from the state's shard
//!   (Adam's m and v, SGD's velocity: variables of `padded(n)` elements now);
//! - `Op::AllGather` then writes every rank's shard into every rank's W, in place (its scratch
//!   holds the rank's own shard meanwhile), so every rank holds the same bits of W again.
//!
//! Being ops of the graph, the collectives are planned like any other step: the reduce-scatter's
//! output and the all-gather's scratch are arena buffers, each collective sits where the planner
//! put it (a gradient's as soon as the gradient is complete), and the per-rank arena and
//! variables are known before anything runs. `kiln zero` prints them for N = 1..64 from plans
//! alone.
//!
//! What kiln's figures show against ZeRO's formulas (params + grads + optimizer/N for stage 1,
//! params + (grads + optimizer)/N for stage 2): kiln's gradients are not a persistent buffer but
//! arena values, live from the backward step that makes them to the update that reads them, so
//! "grads" is whatever the planner finds live at the peak. Stage 1 keeps each whole gradient
//! until its update; stage 2 frees it at the reduce-scatter, keeping a 1/N shard to the update.
//!
//! Every rank compiles the plan of rank 0 (`shard_optimizer_state` with rank 0) and specialises
//! it (`for_rank`): the ranks' plans are then one schedule, so the collectives come in the same
//! order everywhere, and they differ only in the ranks written in the collectives and updates,
//! which the fingerprint the ranks compare before the first collective leaves out.

use crate::error::{CompileError, Result};
use crate::ir::{Graph, Node, NodeId, Op, ReduceOp, Shape, Shard, VarRole};
use crate::plan::Plan;

/// How much of a data-parallel step's state is sharded over the ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ZeroStage {
    /// Plain data parallelism: every rank holds and updates everything (`data_parallel`).
    #[default]
    Off,
    /// The optimizer state sharded; gradients all-reduced whole.
    One,
    /// The optimizer state and the reduced gradients sharded (reduce-scatter).
    Two,
}

impl ZeroStage {
    /// The stage from its number (0, 1 or 2).
    pub fn from_number(n: usize) -> Option<ZeroStage> {
        match n {
            0 => Some(ZeroStage::Off),
            1 => Some(ZeroStage::One),
            2 => Some(ZeroStage::Two),
            _ => None,
        }
    }

    /// The stage's number: 0, 1 or 2.
    pub fn number(self) -> usize {
        match self {
            ZeroStage::Off => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
        }
    }
}

/// What `shard_optimizer_state` changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sharding {
    /// Updates made sharded (one all-gather each).
    pub updates: usize,
    /// The optimizer state's bytes before (whole) and after (this rank's padded shards).
    pub state_bytes_whole: usize,
    /// The optimizer state's bytes after sharding: this rank's padded shards.
    pub state_bytes_sharded: usize,
}

/// Rewrites the single-rank training step `graph` into rank `shard.rank`'s step of a
/// data-parallel run over `shard.ranks` ranks with the optimizer state sharded (`stage` One or
/// Two; `Off` inserts plain all-reduces, as `data_parallel::all_reduce_gradients` does).
/// Updates that are tiled or compute their gradient's product are refused: run this before
/// `compile` (whose rewrites leave updates of a collective's output alone).
pub fn shard_optimizer_state(graph: &mut Graph, stage: ZeroStage, shard: Shard) -> Result<Sharding> {
    if shard.ranks == 0 || shard.rank >= shard.ranks {
        return Err(CompileError::invalid(
            format!("ZeRO: rank {} of {} ranks is not a rank of the group", shard.rank, shard.ranks),
            "shard over one rank or more, with a rank below the rank count",
        ));
    }
    if stage == ZeroStage::Off {
        crate::data_parallel::all_reduce_gradients(graph)?;
        return Ok(Sharding::default());
    }
    let updates: Vec<NodeId> = graph
        .node_ids()
        .filter(|&n| matches!(graph.node(n).op, Op::ApplySgd { .. } | Op::ApplyAdam { .. }))
        .collect();
    if stage == ZeroStage::One {
        // Whole gradients, reduced as plain data parallelism reduces them: in buckets.
        crate::data_parallel::all_reduce_gradients(graph)?;
    } else {
        // Stage 2's reduce-scattered gradients: each rank checks its own, and the ranks agree
        // on f16 loss scaling's check.
        crate::loss_scale::agree_across_ranks(graph);
    }
    let mut out = Sharding::default();
    for u in updates {
        let node = graph.node(u).clone();
        let (rows, product) = match node.op {
            Op::ApplySgd { rows, product, .. } | Op::ApplyAdam { rows, product, .. } => (rows, product),
            _ => unreachable!("filtered above"),
        };
        if rows.is_some() || product {
            return Err(CompileError::invalid(
                format!("ZeRO: the update `{}` is tiled or computes its gradient's product", node.op.label()),
                "shard the optimizer state of the traced training step, before `compile` rewrites its updates",
            ));
        }
        let operands = graph.operands(u);
        let (var, grad) = (operands[0], operands[1]);
        let n = graph.node(var).shape.numel();
        let part = Shape::new(vec![shard.padded(n)]);
        let name = graph.node(grad).name.clone().unwrap_or_else(|| graph.node(grad).op.name().into());
        // Stage 1's gradients were all-reduced in buckets above.
        if stage == ZeroStage::Two {
            let op = Op::ReduceScatter { op: ReduceOp::Mean, shard };
            let gnode = graph.node(grad).clone();
            let name = Some(format!("{name}/reduce_scatter"));
            let reduced = graph.add(Node { op, shape: part.clone(), name, ..gnode }, &[grad]);
            graph.replace_operand(u, 1, reduced);
        }
        let state = match node.op {
            Op::ApplyAdam { .. } => 2..4,
            // An f16 step's gate (`Op::update_gate`) is no state.
            _ => 2..node.op.update_gate(operands.len()).unwrap_or(operands.len()),
        };
        for &s in &operands[state] {
            out.state_bytes_whole += graph.node(s).bytes();
            shard_state(graph, s, &part)?;
            out.state_bytes_sharded += graph.node(s).bytes();
        }
        match &mut graph.node_mut(u).op {
            Op::ApplySgd { shard: s, .. } | Op::ApplyAdam { shard: s, .. } => *s = Some(shard),
            _ => unreachable!("filtered above"),
        }
        let vnode = graph.node(var).clone();
        let vname = vnode.name.clone().unwrap_or_else(|| "variable".into());
        let gather = graph.add(
            Node {
                op: Op::AllGather { shard },
                shape: Shape::scalar(),
                name: Some(format!("{vname}/all_gather")),
                ..vnode
            },
            &[var],
        );
        graph.add_control(u, gather);
        out.updates += 1;
    }
    Ok(out)
}

/// Makes the optimizer-state variable `s` hold just a shard: `part` elements.
fn shard_state(graph: &mut Graph, s: NodeId, part: &Shape) -> Result<()> {
    let node = graph.node_mut(s);
    match &mut node.op {
        Op::Variable { shape, role: VarRole::OptimizerState, .. } => {
            *shape = part.clone();
            node.shape = part.clone();
            Ok(())
        }
        other => Err(CompileError::invalid(
            format!(
                "ZeRO: an update's state operand is `{}`, not an optimizer-state variable",
                other.label()
            ),
            "shard the optimizer state of a training step built by `train_step_graph`",
        )),
    }
}

/// The shard of every collective and sharded update of `plan`.
fn shards_mut(plan: &mut Plan) -> impl Iterator<Item = &mut Shard> {
    plan.steps.iter_mut().filter_map(|s| s.op.shard_mut())
}

/// Specialises a plan compiled for one rank (`shard_optimizer_state`) to rank `rank`: the same
/// steps, buffers and shapes, with `rank` in every shard. Refused where `rank` is not a rank of
/// the plan's group.
pub fn for_rank(mut plan: Plan, rank: usize) -> Result<Plan> {
    for shard in shards_mut(&mut plan) {
        if rank >= shard.ranks {
            return Err(CompileError::invalid(
                format!("ZeRO: rank {rank} is not a rank of the plan's group of {}", shard.ranks),
                "specialise the plan to a rank below the rank count it was sharded for",
            ));
        }
        shard.rank = rank;
    }
    Ok(plan)
}

/// The plan with every shard's rank set to 0: what the ranks of one run must agree on.
pub fn rank_neutral(plan: &Plan) -> Plan {
    let mut p = plan.clone();
    shards_mut(&mut p).for_each(|s| s.rank = 0);
    p
}

/// The group size a plan's shards were made for, if it has any.
pub fn sharded_ranks(plan: &Plan) -> Option<usize> {
    plan.steps.iter().find_map(|s| s.op.shard()).map(|s| s.ranks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::losses::Loss;
    use crate::nn::{Dense, Sequential};
    use crate::optim::{Adam, Optimizer};
    use crate::step::{TrainConfig, train_step_graph};

    fn step() -> Graph {
        let model = Sequential::new().add(Dense::new(5).relu()).add(Dense::new(3));
        let cfg = TrainConfig {
            optimizer: Optimizer::Adam(Adam::new(1e-3)),
            loss: Loss::MeanSquaredError,
            metrics: Vec::new(),
        };
        train_step_graph(&model, Shape::from([4, 7]), Shape::from([4, 3]), &cfg).unwrap()
    }

    #[test]
    fn stage_two_shards_state_and_gradients() {
        let mut g = step();
        let s = shard_optimizer_state(&mut g, ZeroStage::Two, Shard { ranks: 3, rank: 0 }).unwrap();
        assert_eq!(s.updates, 4, "two kernels, two biases");
        // Adam's m and v of [7,5], [5], [5,3], [3]: 35 + 5 + 15 + 3 = 58 floats each, whole;
        // sharded over 3 ranks: 12 + 2 + 5 + 1 = 20.
        assert_eq!((s.state_bytes_whole, s.state_bytes_sharded), (2 * 58 * 4, 2 * 20 * 4));
        let mut gathers = 0;
        for u in g.effects() {
            match g.node(u).op {
                Op::ApplyAdam { shard, .. } => {
                    assert_eq!(shard, Some(Shard { ranks: 3, rank: 0 }));
                    let grad = g.operands(u)[1];
                    assert!(matches!(g.node(grad).op, Op::ReduceScatter { op: ReduceOp::Mean, .. }));
                    assert!(
                        g.control_successors(u).iter().any(|&c| matches!(g.node(c).op, Op::AllGather { .. }))
                    );
                }
                Op::AllGather { .. } => gathers += 1,
                _ => {}
            }
        }
        assert_eq!(gathers, 4);
    }

    #[test]
    fn shards_cover_every_element_once() {
        for ranks in 1..=6 {
            for n in 0..=20 {
                let mut next = 0;
                for rank in 0..ranks {
                    let r = Shard { ranks, rank }.range(n);
                    assert_eq!(r.start, next);
                    assert!(r.len() <= Shard { ranks, rank }.padded(n));
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn a_rank_outside_the_group_is_refused() {
        let e = shard_optimizer_state(&mut step(), ZeroStage::One, Shard { ranks: 2, rank: 2 }).unwrap_err();
        assert!(e.to_string().contains("rank 2 of 2"), "{e}");
    }
}
