//! Per-rank memory of a data-parallel training step by ZeRO stage and rank count, from plans
//! alone (`kiln zero`, `benches/data_parallel.rs`): each row is the plan rank 0 would run
//! (`kiln_compiler::zero`; every rank's plan has the same shapes), compiled with the default
//! options at a fixed batch per rank, as data parallelism scales.
//!
//! Beside kiln's planned figures, the "model states" of ZeRO's own accounting (the ZeRO paper's
//! formulas, in f32): parameters P, gradients G (as many bytes as the parameters: whole at
//! stages 0 and 1, 1/N at stage 2) and optimizer state O (whole at stage 0, 1/N from stage 1);
//! activations come on top, in ZeRO as in kiln. kiln has no persistent gradient buffer: its
//! gradients are arena values, live from the backward step that makes them to the update that
//! reads them, so kiln's persistent bytes (parameters and optimizer state) fall below ZeRO's
//! model states by G at stages 0 and 1 and G/N at stage 2, and what gradients are live at the
//! arena's peak is inside the arena figure with the activations.
//!
//! Communication: the bytes each rank sends per step under the ring algorithms every engine
//! uses for large buffers (an all-reduce of n bytes sends 2(N-1)/N·n, a reduce-scatter or an
//! all-gather (N-1)/N·n), so stage 0 and stage 2 move the same bytes, as the ZeRO paper says
//! (up to padding: stage 2's shards to a multiple of N elements, stage 0's bucketed gradients
//! to 16 bytes each, `data_parallel::all_reduce_gradients_in_buckets`).

use crate::Result;
use crate::zoo::ZooModel;
use kiln_compiler::ir::{Op, Shard, VarRole};
use kiln_compiler::step::train_step_graph;
use kiln_compiler::zero::{ZeroStage, shard_optimizer_state};
use kiln_compiler::{CompileOptions, Plan, compile};

/// One plan's per-rank figures, in bytes.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ZeroRow {
    /// The number of data-parallel ranks N.
    pub ranks: usize,
    /// The ZeRO stage: 0 (nothing sharded), 1 (optimizer state sharded) or 2 (optimizer state
    /// and gradients sharded).
    pub stage: usize,
    /// The rows of the batch each rank trains on (the model's batch; the global batch is N times
    /// it).
    pub batch_per_rank: usize,
    /// The parameters' bytes on one rank (whole at every stage).
    pub parameter_bytes: usize,
    /// The optimizer state's bytes on one rank (1/N of it, padded, from stage 1).
    pub optimizer_state_bytes: usize,
    /// The rank's planned arena: activations and the gradients live at its peak, among others.
    pub arena_bytes: usize,
    /// Parameters, optimizer state, io and arena: what one rank allocates.
    pub planned_total_bytes: usize,
    /// ZeRO's model states per rank for the same step (see the module's doc).
    pub zero_model_state_bytes: usize,
    /// Bytes each rank sends a step under the ring algorithms (see the module's doc).
    pub ring_bytes_sent: usize,
}

/// The plan of rank 0 of `ranks` at `stage` for `m`'s training step at its batch (per rank).
pub fn plan(m: &ZooModel, stage: ZeroStage, ranks: usize) -> Result<Plan> {
    let mut g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?;
    if ranks > 1 {
        shard_optimizer_state(&mut g, stage, Shard { ranks, rank: 0 })?;
    }
    Ok(compile(g, &CompileOptions::default())?)
}

fn ring_bytes_sent(plan: &Plan, ranks: usize) -> usize {
    plan.steps
        .iter()
        .filter(|s| s.op.is_collective())
        .map(|s| {
            let v = &plan.values[s.inputs[0]];
            let n = v.shape.numel() * v.dtype.size_bytes() * (ranks - 1) / ranks;
            match s.op {
                Op::AllReduce { .. } => 2 * n,
                Op::ReduceScatter { .. } | Op::AllGather { .. } => n,
                _ => 0,
            }
        })
        .sum()
}

/// The rows for every stage (0, 1, 2) at every rank count of `ranks`.
pub fn rows(m: &ZooModel, ranks: &[usize]) -> Result<Vec<ZeroRow>> {
    let one = plan(m, ZeroStage::Off, 1)?;
    let p = one.memory.parameter_bytes;
    let o = one.memory.optimizer_state_bytes;
    // Gradients: one per parameter, each as large as it.
    let g: usize = one.variables.iter().filter(|v| v.role == VarRole::Parameter).map(|v| v.bytes()).sum();
    let mut out = Vec::new();
    for &n in ranks {
        for stage in [ZeroStage::Off, ZeroStage::One, ZeroStage::Two] {
            if n == 1 && stage != ZeroStage::Off {
                continue;
            }
            let plan = plan(m, stage, n)?;
            let states = match stage {
                ZeroStage::Off => p + g + o,
                ZeroStage::One => p + g + o / n,
                ZeroStage::Two => p + (g + o) / n,
            };
            let mem = &plan.memory;
            out.push(ZeroRow {
                ranks: n,
                stage: stage.number(),
                batch_per_rank: m.batch,
                parameter_bytes: mem.parameter_bytes,
                optimizer_state_bytes: mem.optimizer_state_bytes,
                arena_bytes: mem.arena_bytes,
                planned_total_bytes: mem.planned_total_bytes(),
                zero_model_state_bytes: states,
                ring_bytes_sent: ring_bytes_sent(&plan, n),
            });
        }
    }
    Ok(out)
}

/// The rows as a table.
pub fn render(rows: &[ZeroRow]) -> String {
    let b = crate::report::bytes;
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.ranks.to_string(),
                r.stage.to_string(),
                b(r.parameter_bytes),
                b(r.optimizer_state_bytes),
                b(r.parameter_bytes + r.optimizer_state_bytes),
                b(r.zero_model_state_bytes),
                b(r.arena_bytes),
                b(r.planned_total_bytes),
                b(r.ring_bytes_sent),
            ]
        })
        .collect();
    crate::report::render_table(
        &[
            "ranks",
            "ZeRO stage",
            "parameters",
            "optimizer state/rank",
            "persistent/rank",
            "ZeRO model states/rank",
            "arena/rank",
            "planned total/rank",
            "sent/rank/step (ring)",
        ],
        &body,
    )
}
