//! `cargo bench --bench data_parallel`: data-parallel training steps on this machine, kiln's
//! ranks (in-process, `kiln::comm::local_group`: one `CpuBackend` per thread, the plan's
//! `AllReduce` steps between gradients and updates) against PyTorch DDP on gloo
//! (`scripts/peers/torch_ddp.py`, one process per rank) at 1 and 2 ranks, the zoo's batch split
//! over the ranks. Per model and rank count: rank 0's median step time over 2 interleaved rounds
//! of 10 steps, the gradient bytes all-reduced per step (from the plan: the operands of its
//! all-reduces), and the per-rank planned total; at 2 ranks also ZeRO stages 1 and 2 (each rank
//! its own specialisation of rank 0's plan, `zero::for_rank`; the zoo's own optimizer,
//! its state sharded); then each model's per-rank plans by ZeRO stage (`kiln::zero_table`) for 1
//! to 64 ranks; and the overlap table: 2 ranks at stage 0 with the collectives in line against
//! overlapping the steps after them, without and with a simulated 2 ms latency per collective.
//! Writes `target/kiln/data_parallel.json` and the tables; a peer that cannot be had is
//! "skipped".

use kiln::compiler::Plan;
use kiln::compiler::ir::Op;
use kiln::compiler::zero;
use kiln::prelude::*;
use kiln::report::{bytes, output_dir, render_table};
use kiln::runtime::{Backend, CpuBackend};
use kiln::zoo::{self, ZooModel};
use std::collections::BTreeMap;
use std::time::Instant;

const ROUNDS: usize = 2;
const STEPS: usize = 10;
const RANKS: [usize; 2] = [1, 2];
/// The (ranks, ZeRO stage) pairs timed.
const RUNS: [(usize, ZeroStage); 4] =
    [(1, ZeroStage::Off), (2, ZeroStage::Off), (2, ZeroStage::One), (2, ZeroStage::Two)];

#[derive(serde::Serialize)]
struct Row {
    model: String,
    ranks: usize,
    zero_stage: usize,
    batch_per_rank: usize,
    kiln_ms: f64,
    /// Collectives of each kind a step: all-reduces, reduce-scatters, all-gathers.
    collectives: [usize; 3],
    all_reduces: usize,
    all_reduced_bytes: usize,
    planned_total_per_rank: usize,
    ddp_ms: Option<f64>,
    ddp_grad_bytes: Option<usize>,
    kiln_steps: Vec<f64>,
    ddp_steps: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Rank 0's plan for `ranks` ranks at `stage` (stage 0: every gradient all-reduced).
fn plan(m: &ZooModel, ranks: usize, stage: ZeroStage) -> Result<Plan, Box<dyn std::error::Error>> {
    Ok(kiln::zero_table::plan(&m.clone().with_batch(m.batch / ranks), stage, ranks)?)
}

/// Rank 0's time of each of `STEPS` steps (after 2 warm-up steps), `ranks` ranks on threads.
fn time_kiln(m: &ZooModel, plan: &Plan, ranks: usize) -> Result<Vec<f64>, String> {
    time_kiln_with(m, plan, ranks, std::time::Duration::ZERO, true)
}

/// `time_kiln` with `latency` added to every collective (`LocalComm::set_latency`) and the
/// collectives overlapping the steps after them or not (`CpuBackend::set_overlap`).
fn time_kiln_with(
    m: &ZooModel,
    plan: &Plan,
    ranks: usize,
    latency: std::time::Duration,
    overlap: bool,
) -> Result<Vec<f64>, String> {
    let (x, y) = m.batch_data(1).map_err(|e| e.to_string())?;
    let shard = m.batch / ranks;
    let mut all = kiln::comm::run_local_ranks(ranks, |r, mut comm| -> Result<Vec<f64>, String> {
        comm.set_latency(latency);
        let rows = r * shard..(r + 1) * shard;
        let x = x.rows(rows.clone()).map_err(|e| e.to_string())?;
        let y = y.rows(rows).map_err(|e| e.to_string())?;
        let mut backend = CpuBackend::new(3);
        if ranks > 1 {
            backend = backend.with_communicator(comm);
        }
        backend.set_overlap(overlap);
        let plan = zero::for_rank(plan.clone(), r).map_err(|e| e.to_string())?;
        let id = backend.load(plan).map_err(|e| e.to_string())?;
        let mut times = Vec::new();
        for i in 0..STEPS + 2 {
            let t = Instant::now();
            backend.call(id, &[("x", &x), ("y", &y)]).map_err(|e| e.to_string())?;
            if i >= 2 {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        Ok(times)
    });
    all.swap_remove(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models: Vec<ZooModel> =
        ["mlp", "cnn", "transformer"].iter().filter_map(|n| zoo::by_name(n)).collect();
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();
    let mut plans = BTreeMap::new();
    for m in &models {
        for (r, stage) in RUNS {
            plans.insert((m.name, r, stage.number()), plan(m, r, stage)?);
        }
    }
    let mut kiln_times: BTreeMap<(&str, usize, usize), Vec<f64>> = BTreeMap::new();
    let mut ddp: BTreeMap<(String, usize), (Vec<f64>, usize)> = BTreeMap::new();
    let mut ddp_ok = true;
    for round in 0..ROUNDS {
        for m in &models {
            for (r, stage) in RUNS {
                let t = time_kiln(m, &plans[&(m.name, r, stage.number())], r)?;
                kiln_times.entry((m.name, r, stage.number())).or_default().extend(t);
            }
        }
        if ddp_ok {
            match kiln::peers::torch_ddp_times(&names, &RANKS, STEPS)? {
                Some(times) => {
                    for (model, by_ranks) in times {
                        for (r, t) in by_ranks {
                            let e = ddp.entry((model.clone(), r.parse()?)).or_default();
                            e.0.extend(t.step_ms);
                            e.1 = t.grad_bytes;
                        }
                    }
                }
                None => ddp_ok = false,
            }
        }
        eprintln!("round {} of {ROUNDS} done", round + 1);
    }
    let mut out = Vec::new();
    for m in &models {
        for (r, stage) in RUNS {
            let p = &plans[&(m.name, r, stage.number())];
            let count = |f: fn(&Op) -> bool| p.steps.iter().filter(|s| f(&s.op)).count();
            let collectives = [
                count(|o| matches!(o, Op::AllReduce { .. })),
                count(|o| matches!(o, Op::ReduceScatter { .. })),
                count(|o| matches!(o, Op::AllGather { .. })),
            ];
            let reduces: Vec<_> = p.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).collect();
            let reduced: usize = reduces
                .iter()
                .map(|s| p.values[s.inputs[0]].shape.numel() * p.values[s.inputs[0]].dtype.size_bytes())
                .sum();
            let k = &kiln_times[&(m.name, r, stage.number())];
            // DDP is plain data parallelism: beside stage 0 only.
            let d = ddp.get(&(m.name.to_string(), r)).filter(|_| stage == ZeroStage::Off);
            out.push(Row {
                model: m.name.into(),
                ranks: r,
                zero_stage: stage.number(),
                batch_per_rank: m.batch / r,
                kiln_ms: median(k),
                collectives,
                all_reduces: reduces.len(),
                all_reduced_bytes: reduced,
                planned_total_per_rank: p.memory.planned_total_bytes(),
                ddp_ms: d.filter(|d| !d.0.is_empty()).map(|d| median(&d.0)),
                ddp_grad_bytes: d.map(|d| d.1),
                kiln_steps: k.clone(),
                ddp_steps: d.map(|d| d.0.clone()).unwrap_or_default(),
            });
        }
    }
    let cells: Vec<Vec<String>> = out
        .iter()
        .map(|r| {
            let plain = out
                .iter()
                .find(|o| o.model == r.model && o.ranks == r.ranks && o.zero_stage == 0)
                .map_or(f64::NAN, |o| o.kiln_ms);
            vec![
                r.model.clone(),
                r.ranks.to_string(),
                r.zero_stage.to_string(),
                r.batch_per_rank.to_string(),
                format!("{:.2}", r.kiln_ms),
                format!("{:.2}", r.kiln_ms / plain),
                format!("{} / {} / {}", r.collectives[0], r.collectives[1], r.collectives[2]),
                match (r.ddp_ms, r.zero_stage) {
                    (Some(d), _) => format!("{d:.2}"),
                    (None, 0) => "skipped".into(),
                    (None, _) => "-".into(),
                },
                r.ddp_ms.map_or("-".into(), |d| format!("{:.2}", r.kiln_ms / d)),
                format!("{} / {}", r.all_reduces, bytes(r.all_reduced_bytes)),
                r.ddp_grad_bytes.filter(|_| r.ranks > 1).map_or("-".into(), bytes),
                bytes(r.planned_total_per_rank),
            ]
        })
        .collect();
    println!(
        "{}",
        render_table(
            &[
                "model",
                "ranks",
                "ZeRO stage",
                "batch/rank",
                "kiln ms/step",
                "/ stage 0",
                "all-reduce / reduce-scatter / all-gather",
                "PyTorch DDP ms/step",
                "kiln/DDP",
                "kiln all-reduces / bytes a step",
                "DDP bytes a step",
                "kiln planned total/rank",
            ],
            &cells
        )
    );
    println!(
        "CPU, 2 cores; rank 0's median of {} steps in {ROUNDS} interleaved rounds. kiln: ranks are threads of one process sharing its rayon pool, the gradients all-reduced in buckets of at most 1 MiB (`data_parallel::BUCKET_BYTES`), one AllReduce step each, rank-order sums (kiln-comm's local engine); PyTorch: one process per rank with cores/ranks threads, DDP's 25 MiB buckets over gloo on 127.0.0.1, Adam(foreach=True). Bytes a step: the gradients all-reduced, per rank (what each engine moves on the wire depends on its algorithm). 1 rank: no collectives on either side. ZeRO stages 1 and 2 (kiln only; DDP beside stage 0): each rank updates its shard of every parameter and all-gathers it, stage 1 after all-reducing the whole gradient, stage 2 after reduce-scattering it; '/ stage 0' is the time over plain data parallelism's at the same rank count.",
        ROUNDS * STEPS
    );
    let overlap = overlap_table(&models, &plans)?;
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    // Per-rank planned memory by ZeRO stage for 1..64 ranks, from plans alone.
    let mut zero = BTreeMap::new();
    for m in &models {
        let rows = kiln::zero_table::rows(m, &[1, 2, 4, 8, 16, 32, 64])?;
        println!(
            "{}: per-rank plans by ZeRO stage (`kiln zero --model {}`)\n{}",
            m.name,
            m.name,
            kiln::zero_table::render(&rows)
        );
        zero.insert(m.name, rows);
    }
    let report = serde_json::json!({ "steps": out, "zero": zero, "overlap": overlap });
    kiln::results::write("data_parallel", "cpu", &report)?;
    Ok(())
}

/// Simulated network latencies per collective for the overlap table, microseconds.
const LATENCIES_US: [u64; 2] = [0, 2000];

#[derive(serde::Serialize)]
struct OverlapRow {
    model: String,
    latency_us: u64,
    schedule: String,
    in_line_ms: f64,
    overlapped_ms: f64,
}

/// 2 ranks at ZeRO stage 0: each collective in line against overlapping the steps after it
/// (`CpuBackend::set_overlap`), without and with a simulated latency per collective
/// (`LocalComm::set_latency`), in interleaved rounds.
fn overlap_table(
    models: &[ZooModel],
    plans: &BTreeMap<(&str, usize, usize), Plan>,
) -> Result<Vec<OverlapRow>, Box<dyn std::error::Error>> {
    let mut times: BTreeMap<(&str, u64, bool), Vec<f64>> = BTreeMap::new();
    for _ in 0..ROUNDS + 1 {
        for m in models {
            let plan = &plans[&(m.name, 2, 0)];
            for latency in LATENCIES_US {
                for on in [false, true] {
                    let t = time_kiln_with(m, plan, 2, std::time::Duration::from_micros(latency), on)?;
                    times.entry((m.name, latency, on)).or_default().extend(t);
                }
            }
        }
    }
    let mut rows = Vec::new();
    for m in models {
        for latency in LATENCIES_US {
            rows.push(OverlapRow {
                model: m.name.into(),
                latency_us: latency,
                schedule: plans[&(m.name, 2, 0)].memory.schedule.clone(),
                in_line_ms: median(&times[&(m.name, latency, false)]),
                overlapped_ms: median(&times[&(m.name, latency, true)]),
            });
        }
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.schedule.clone(),
                format!("{:.1}", r.latency_us as f64 / 1e3),
                format!("{:.2}", r.in_line_ms),
                format!("{:.2}", r.overlapped_ms),
                format!("{:.2}", r.overlapped_ms / r.in_line_ms),
            ]
        })
        .collect();
    println!(
        "{}",
        render_table(
            &[
                "model (2 ranks, stage 0)",
                "schedule",
                "latency ms",
                "in line ms",
                "overlapped ms",
                "overlapped / in line"
            ],
            &cells
        )
    );
    println!(
        "Collectives in line against overlapping the steps after them (a communication thread; a step waits only for collectives whose bytes it touches), rank 0's median of {} steps in {} interleaved rounds; latency: a sleep added to each collective once all ranks arrived (`LocalComm::set_latency`), standing in for a network's per-message latency. A schedule ending in +overlap defers each bucket's updates past the next collective (chosen only where that plans no larger); the others consume each bucket at once, leaving nothing to overlap but what follows before its first reader.",
        (ROUNDS + 1) * STEPS,
        ROUNDS + 1
    );
    Ok(rows)
}
