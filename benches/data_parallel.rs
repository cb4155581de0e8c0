//! `cargo bench --bench data_parallel`: data-parallel training steps on this machine, kiln's
//! ranks (in-process, `kiln::comm::local_group`: one `CpuBackend` per thread, the plan's
//! `AllReduce` steps between gradients and updates) against PyTorch DDP on gloo
//! (`scripts/peers/torch_ddp.py`, one process per rank) at 1 and 2 ranks, the zoo's batch split
//! over the ranks. Per model and rank count: rank 0's median step time over 2 interleaved rounds
//! of 10 steps, the gradient bytes all-reduced per step (from the plan: the operands of its
//! all-reduces), and the per-rank planned total; then each model's per-rank plans by ZeRO stage
//! (`kiln::zero_table`) for 1 to 64 ranks. Writes `target/kiln/data_parallel.json` and the
//! tables; a peer that cannot be had is "skipped".

use kiln::compiler::Plan;
use kiln::compiler::data_parallel::all_reduce_gradients;
use kiln::compiler::ir::Op;
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::report::{bytes, output_dir, render_table};
use kiln::runtime::{Backend, CpuBackend};
use kiln::zoo::{self, ZooModel};
use std::collections::BTreeMap;
use std::time::Instant;

const ROUNDS: usize = 2;
const STEPS: usize = 10;
const RANKS: [usize; 2] = [1, 2];

#[derive(serde::Serialize)]
struct Row {
    model: String,
    ranks: usize,
    batch_per_rank: usize,
    kiln_ms: f64,
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

fn plan(m: &ZooModel, ranks: usize) -> Result<Plan, Box<dyn std::error::Error>> {
    let shard = m.clone().with_batch(m.batch / ranks);
    let mut graph = train_step_graph(&shard.model(), shard.x_shape(), shard.y_shape(), &shard.config())?;
    if ranks > 1 {
        all_reduce_gradients(&mut graph)?;
    }
    Ok(compile(graph, &CompileOptions::default())?)
}

/// Rank 0's time of each of `STEPS` steps (after 2 warm-up steps), `ranks` ranks on threads.
fn time_kiln(m: &ZooModel, plan: &Plan, ranks: usize) -> Result<Vec<f64>, String> {
    let (x, y) = m.batch_data(1).map_err(|e| e.to_string())?;
    let shard = m.batch / ranks;
    let mut all = kiln::comm::run_local_ranks(ranks, |r, comm| -> Result<Vec<f64>, String> {
        let rows = r * shard..(r + 1) * shard;
        let x = x.rows(rows.clone()).map_err(|e| e.to_string())?;
        let y = y.rows(rows).map_err(|e| e.to_string())?;
        let mut backend = CpuBackend::new(3);
        if ranks > 1 {
            backend = backend.with_communicator(comm);
        }
        let id = backend.load(plan.clone()).map_err(|e| e.to_string())?;
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
        for r in RANKS {
            plans.insert((m.name, r), plan(m, r)?);
        }
    }
    let mut kiln_times: BTreeMap<(&str, usize), Vec<f64>> = BTreeMap::new();
    let mut ddp: BTreeMap<(String, usize), (Vec<f64>, usize)> = BTreeMap::new();
    let mut ddp_ok = true;
    for round in 0..ROUNDS {
        for m in &models {
            for r in RANKS {
                let t = time_kiln(m, &plans[&(m.name, r)], r)?;
                kiln_times.entry((m.name, r)).or_default().extend(t);
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
        for r in RANKS {
            let p = &plans[&(m.name, r)];
            let reduces: Vec<_> = p.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).collect();
            let reduced: usize = reduces
                .iter()
                .map(|s| p.values[s.inputs[0]].shape.numel() * p.values[s.inputs[0]].dtype.size_bytes())
                .sum();
            let k = &kiln_times[&(m.name, r)];
            let d = ddp.get(&(m.name.to_string(), r));
            out.push(Row {
                model: m.name.into(),
                ranks: r,
                batch_per_rank: m.batch / r,
                kiln_ms: median(k),
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
            vec![
                r.model.clone(),
                r.ranks.to_string(),
                r.batch_per_rank.to_string(),
                format!("{:.2}", r.kiln_ms),
                r.ddp_ms.map_or("skipped".into(), |d| format!("{d:.2}")),
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
                "batch/rank",
                "kiln ms/step",
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
        "CPU, 2 cores; rank 0's median of {} steps in {ROUNDS} interleaved rounds. kiln: ranks are threads of one process sharing its rayon pool, each gradient all-reduced by its own AllReduce step (no buckets yet), rank-order sums (kiln-comm's local engine); PyTorch: one process per rank with cores/ranks threads, DDP's 25 MiB buckets over gloo on 127.0.0.1, Adam(foreach=True). Bytes a step: the gradients reduced, per rank (what each engine moves on the wire depends on its algorithm). 1 rank: no collectives on either side.",
        ROUNDS * STEPS
    );
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
    let json = dir.join("data_parallel.json");
    let report = serde_json::json!({ "steps": out, "zero": zero });
    std::fs::write(&json, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", json.display());
    Ok(())
}
