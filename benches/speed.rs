//! `cargo bench --bench speed`: CPU training-step time of every zoo model, kiln fused (the
//! default) and unfused against JAX/XLA (jit, donated parameters; the peers environment of the
//! memory bench) and PyTorch eager and `torch.compile` (`scripts/peers/torch_speed.py`: PyPI's
//! wheel in `target/kiln/torch-venv`, or the interpreter `KILN_TORCH_PYTHON` names), side by side
//! in one run: 3 interleaved rounds (kiln fused, kiln unfused, JAX, PyTorch, every model) of 10
//! timed steps each after warm-up; the median of all of a side's steps is its figure. A peer that
//! cannot be had is "skipped". Writes `target/kiln/speed.json` and a table.

use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::report::{output_dir, render_table};
use kiln::runtime::{Backend, CpuBackend};
use kiln::zoo;
use std::collections::BTreeMap;
use std::time::Instant;

const ROUNDS: usize = 3;
const STEPS: usize = 10;

#[derive(serde::Serialize)]
struct Row {
    model: String,
    batch: usize,
    kiln_ms: f64,
    kiln_unfused_ms: f64,
    plan_steps: usize,
    plan_steps_unfused: usize,
    jax_ms: Option<f64>,
    kiln_over_jax: Option<f64>,
    torch_ms: Option<f64>,
    torch_compile_ms: Option<f64>,
    /// kiln / the fastest peer measured.
    kiln_over_fastest_peer: Option<f64>,
    kiln_steps: Vec<f64>,
    kiln_unfused_steps: Vec<f64>,
    jax_steps: Vec<f64>,
    torch_steps: Vec<f64>,
    torch_compile_steps: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models = zoo::all();
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();
    // Per model, the fused program then the unfused one.
    let mut programs = Vec::new();
    let mut plan_steps = Vec::new();
    for m in &models {
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?;
        for fuse in [true, false] {
            let plan = compile(graph.clone(), &CompileOptions::default().with_fusion(fuse))?;
            plan_steps.push(plan.steps.len());
            let mut backend = CpuBackend::new(0);
            let id = backend.load(plan)?;
            let (x, y) = m.batch_data(1)?;
            for _ in 0..2 {
                backend.call(id, &[("x", &x), ("y", &y)])?;
            }
            programs.push((backend, id, x, y));
        }
    }
    let mut kiln_steps: BTreeMap<(&str, bool), Vec<f64>> = BTreeMap::new();
    let mut jax_steps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut jax_ok = true;
    let mut torch_steps: BTreeMap<String, kiln::peers::TorchTimes> = BTreeMap::new();
    let mut torch_ok = true;
    for round in 0..ROUNDS {
        for (i, (backend, id, x, y)) in programs.iter_mut().enumerate() {
            let key = (models[i / 2].name, i % 2 == 0);
            for _ in 0..STEPS {
                let t = Instant::now();
                backend.call(*id, &[("x", &*x), ("y", &*y)])?;
                kiln_steps.entry(key).or_default().push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        if jax_ok {
            match kiln::peers::xla_step_times(&names, STEPS)? {
                Some(times) => times.into_iter().for_each(|(k, v)| jax_steps.entry(k).or_default().extend(v)),
                None => jax_ok = false,
            }
        }
        if torch_ok {
            match kiln::peers::torch_step_times(&names, STEPS, true)? {
                Some(times) => times.into_iter().for_each(|(k, v)| {
                    let t = torch_steps.entry(k).or_default();
                    t.eager_ms.extend(v.eager_ms);
                    t.compile_ms.extend(v.compile_ms);
                }),
                None => torch_ok = false,
            }
        }
        eprintln!("round {} of {ROUNDS} done", round + 1);
    }
    let rows: Vec<Row> = models
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let (k, u) = (&kiln_steps[&(m.name, true)], &kiln_steps[&(m.name, false)]);
            let j = jax_steps.get(m.name).cloned().unwrap_or_default();
            let (kiln_ms, jax_ms) = (median(k), (!j.is_empty()).then(|| median(&j)));
            let t = torch_steps.get(m.name).cloned().unwrap_or_default();
            let torch_ms = (!t.eager_ms.is_empty()).then(|| median(&t.eager_ms));
            let torch_compile_ms = (!t.compile_ms.is_empty()).then(|| median(&t.compile_ms));
            let fastest = [jax_ms, torch_ms, torch_compile_ms].into_iter().flatten().reduce(f64::min);
            Row {
                model: m.name.into(),
                batch: m.batch,
                kiln_ms,
                kiln_unfused_ms: median(u),
                plan_steps: plan_steps[2 * i],
                plan_steps_unfused: plan_steps[2 * i + 1],
                jax_ms,
                kiln_over_jax: jax_ms.map(|j| kiln_ms / j),
                torch_ms,
                torch_compile_ms,
                kiln_over_fastest_peer: fastest.map(|f| kiln_ms / f),
                kiln_steps: k.clone(),
                kiln_unfused_steps: u.clone(),
                jax_steps: j,
                torch_steps: t.eager_ms,
                torch_compile_steps: t.compile_ms,
            }
        })
        .collect();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.batch.to_string(),
                format!("{} / {}", r.plan_steps_unfused, r.plan_steps),
                format!("{:.3}", r.kiln_unfused_ms),
                format!("{:.3}", r.kiln_ms),
                format!("{:.2}", r.kiln_ms / r.kiln_unfused_ms),
                r.jax_ms.map_or("skipped".into(), |j| format!("{j:.3}")),
                r.kiln_over_jax.map_or("-".into(), |x| format!("{x:.2}")),
                r.torch_ms.map_or("skipped".into(), |t| format!("{t:.3}")),
                r.torch_compile_ms.map_or("skipped".into(), |t| format!("{t:.3}")),
                r.kiln_over_fastest_peer.map_or("-".into(), |x| format!("{x:.2}")),
            ]
        })
        .collect();
    println!(
        "{}",
        render_table(
            &[
                "model (train step)",
                "batch",
                "plan steps unfused / fused",
                "kiln unfused ms",
                "kiln ms",
                "fused/unfused",
                "JAX jit ms",
                "kiln/JAX",
                "PyTorch eager ms",
                "torch.compile ms",
                "kiln/fastest peer",
            ],
            &cells
        )
    );
    println!(
        "CPU, 2 cores; medians of {} steps per side in {ROUNDS} interleaved rounds; kiln: CpuBackend, default compile options (fused; unfused with fusion off); JAX: jit with donated parameters and Adam state, XLA CPU defaults; PyTorch: the idiomatic twins of scripts/peers/torch_stream.py, Adam(foreach=True), eager and torch.compile (model and opt.step, inductor C++), default threads.",
        ROUNDS * STEPS
    );
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    let json = dir.join("speed.json");
    std::fs::write(&json, serde_json::to_string_pretty(&rows)?)?;
    println!("wrote {}", json.display());
    Ok(())
}
