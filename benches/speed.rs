//! `cargo bench --bench speed`: CPU training-step time of every zoo model, kiln against JAX/XLA
//! (jit, donated parameters; the peers environment of the memory bench), side by side in one
//! run: 3 interleaved rounds (kiln then JAX, every model) of 10 timed steps each after warm-up;
//! the median of all of a side's steps is its figure. PyTorch eager and torch.compile are not
//! measured here: their CPU wheels cannot be installed on the build machines (the PyPI wheel
//! needs CUDA's libraries to import). Writes `target/kiln/speed.json` and a table.

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
    jax_ms: Option<f64>,
    kiln_over_jax: Option<f64>,
    kiln_steps: Vec<f64>,
    jax_steps: Vec<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models = zoo::all();
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();
    let mut programs = Vec::new();
    for m in &models {
        let graph = train_step_graph(&m.model(), &m.x_shape(), &m.y_shape(), &m.config())?;
        let plan = compile(graph, &CompileOptions::default())?;
        let mut backend = CpuBackend::new(0);
        let id = backend.load(plan)?;
        let (x, y) = m.batch_data(1)?;
        for _ in 0..2 {
            backend.call(id, &[("x", &x), ("y", &y)])?;
        }
        programs.push((backend, id, x, y));
    }
    let mut kiln_steps: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let mut jax_steps: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let mut jax_ok = true;
    for round in 0..ROUNDS {
        for (m, (backend, id, x, y)) in models.iter().zip(&mut programs) {
            for _ in 0..STEPS {
                let t = Instant::now();
                backend.call(*id, &[("x", &*x), ("y", &*y)])?;
                kiln_steps.entry(m.name).or_default().push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        if jax_ok {
            match kiln::peers::xla_step_times(&names, STEPS)? {
                Some(times) => times.into_iter().for_each(|(k, v)| jax_steps.entry(k).or_default().extend(v)),
                None => jax_ok = false,
            }
        }
        eprintln!("round {} of {ROUNDS} done", round + 1);
    }
    let rows: Vec<Row> = models
        .iter()
        .map(|m| {
            let k = &kiln_steps[m.name];
            let j = jax_steps.get(m.name).cloned().unwrap_or_default();
            let (kiln_ms, jax_ms) = (median(k), (!j.is_empty()).then(|| median(&j)));
            Row {
                model: m.name.into(),
                batch: m.batch,
                kiln_ms,
                jax_ms,
                kiln_over_jax: jax_ms.map(|j| kiln_ms / j),
                kiln_steps: k.clone(),
                jax_steps: j,
            }
        })
        .collect();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.batch.to_string(),
                format!("{:.3}", r.kiln_ms),
                r.jax_ms.map_or("skipped".into(), |j| format!("{j:.3}")),
                r.kiln_over_jax.map_or("-".into(), |x| format!("{x:.2}")),
            ]
        })
        .collect();
    println!(
        "{}",
        render_table(&["model (train step)", "batch", "kiln ms", "JAX jit ms", "kiln/JAX"], &cells)
    );
    println!(
        "CPU, 2 cores; medians of {} steps per side in {ROUNDS} interleaved rounds; kiln: CpuBackend, default compile options (unfused); JAX: jit with donated parameters and Adam state, XLA CPU defaults; PyTorch: not measured (not installable here).",
        ROUNDS * STEPS
    );
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    let json = dir.join("speed.json");
    std::fs::write(&json, serde_json::to_string_pretty(&rows)?)?;
    println!("wrote {}", json.display());
    Ok(())
}
