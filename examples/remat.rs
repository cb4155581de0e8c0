//! Rematerialization: a zoo training step compiled under a memory limit of its persistent bytes
//! plus a fraction of its unconstrained arena, trained beside the unconstrained plan: the losses
//! and variables must be bit-identical; prints the figures and the step-time overhead.
//!
//! `cargo run --release --example remat [-- MODEL FRACTION]` (default: cnn 0.5).

use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::zoo;
use std::time::Instant;

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("cnn", String::as_str);
    let fraction: f64 = args.get(1).and_then(|f| f.parse().ok()).unwrap_or(0.5);
    let m = zoo::by_name(name).ok_or_else(|| {
        kiln::runtime::RuntimeError::invalid(
            format!("no zoo model {name:?}"),
            "name one of seed-mlp, mlp, cnn, transformer",
        )
    })?;
    let graph = train_step_graph(&m.model(), &m.x_shape(), &m.y_shape(), &m.config())?;
    let free = compile(graph.clone(), &CompileOptions::default())?;
    let limit = free.memory.persistent_bytes + (free.memory.arena_bytes as f64 * fraction) as usize;
    println!(
        "{name} training step: unconstrained planned total {} B (persistent {} B + arena {} B); limit {} B (persistent + {fraction} x arena)",
        free.memory.planned_total_bytes(),
        free.memory.persistent_bytes,
        free.memory.arena_bytes,
        limit
    );
    let limited = match compile(graph, &CompileOptions::device("device 0", Some(limit))) {
        Ok(p) => p,
        Err(e) => {
            println!("does not fit:\n{e}");
            return Ok(());
        }
    };
    let r = limited.memory.remat.clone().unwrap_or_default();
    println!(
        "under the limit: planned total {} B (arena {} B), {} values recomputed, {} FLOPs a step",
        limited.memory.planned_total_bytes(),
        limited.memory.arena_bytes,
        r.recomputed.len(),
        r.recomputed_flops
    );
    let (x, y) = m.batch_data(1)?;
    let mut runs = Vec::new();
    for plan in [free, limited] {
        let mut backend = CpuBackend::new(7);
        let id = backend.load(plan.clone())?;
        let mut losses = Vec::new();
        let mut times = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let out = backend.call(id, &[("x", &x), ("y", &y)])?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
            losses
                .push(out.iter().find(|(n, _)| n == "loss").and_then(|(_, t)| t.item()).unwrap_or(f32::NAN));
        }
        times.sort_by(f64::total_cmp);
        let vars: Vec<HostTensor> =
            plan.variables.iter().map(|v| backend.read_variable(&v.key)).collect::<Result<_, _>>()?;
        runs.push((losses, times[times.len() / 2], vars));
    }
    let (free_run, limited_run) = (&runs[0], &runs[1]);
    println!("losses unconstrained: {:?}", free_run.0);
    println!("losses under limit:   {:?}", limited_run.0);
    let identical = free_run.0.iter().zip(&limited_run.0).all(|(a, b)| a.to_bits() == b.to_bits())
        && free_run.2 == limited_run.2;
    println!("bit-identical losses and variables: {identical}");
    println!(
        "median step time: {:.2} ms unconstrained, {:.2} ms under the limit ({:.2}x)",
        free_run.1,
        limited_run.1,
        limited_run.1 / free_run.1
    );
    Ok(())
}
