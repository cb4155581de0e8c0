//! The GPU benchmark (`cargo bench --bench gpu`, or `kiln bench-gpu` on a machine without a Rust
//! toolchain): per zoo model on a CUDA device, the time of one training step in graph mode (CUDA
//! events around the plan's launches, median of many steps) and in eager mode (op by op through
//! TensorFlow's BFC allocator on real device regions, median wall time per synchronised step),
//! kernel launches per step, and device memory: the plan's arena, the eager peak reserved, and the
//! driver's used memory. Writes `gpu.json` beside the other results.

use crate::compare::{Mode, graph_of};
use crate::report::{bytes, output_dir, render_table};
use crate::zoo;
use kiln_compiler::{CompileOptions, compile};
use kiln_runtime::Backend;
use kiln_runtime::alloc::{Allocator, BfcAllocator};
use kiln_runtime::cuda::{CudaBackend, CudaEager, CudaSource, probe};
use kiln_runtime::eager::EagerExecutor;
use std::time::Instant;

#[derive(serde::Serialize)]
struct Row {
    model: String,
    batch: usize,
    graph_step_ms: f64,
    eager_step_ms: f64,
    launches_per_step: usize,
    arena_bytes: usize,
    planned_total_bytes: usize,
    eager_bfc_peak_reserved_bytes: usize,
    driver_used_bytes: usize,
    kernels_compiled: usize,
    kernels_from_cache: usize,
    compile_seconds: f64,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// What `run` did. A skip is not a success or a failure by itself: the caller decides. `kiln
/// bench-gpu` is asked for explicitly, so a skip there fails (status 2); `cargo bench --bench
/// gpu` runs with every other benchmark, also on CI machines without a GPU, so a skip there
/// passes unless `KILN_REQUIRE_GPU=1`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The benchmark ran, printed its table and wrote `gpu.json`.
    Ran,
    /// No usable CUDA device; the reason (driver missing, no device, NVRTC missing, ...).
    Skipped(String),
}

impl Outcome {
    /// "skipped: no CUDA device (<reason>)" for a skip, as every GPU test and benchmark says it.
    pub fn skip_message(&self) -> Option<String> {
        match self {
            Outcome::Ran => None,
            Outcome::Skipped(why) => Some(format!("skipped: no CUDA device ({why})")),
        }
    }
}

/// Runs the GPU benchmark, prints its table and writes `gpu.json`; where there is no usable
/// CUDA device it runs nothing and returns `Outcome::Skipped` with the reason.
pub fn run() -> Result<Outcome, Box<dyn std::error::Error>> {
    let p = probe();
    if let Err(why) = p.usable() {
        return Ok(Outcome::Skipped(why.to_string()));
    }
    let mut rows = Vec::new();
    for m in zoo::all() {
        let mut gpu = CudaBackend::new(0, 1)?;
        let plan = compile(graph_of(&m, Mode::Train)?, &CompileOptions::default())?;
        let (x, y) = m.batch_data(1)?;
        let id = gpu.load(plan.clone())?;
        // A run consumes its inputs (they live in the arena): feed before each one, untimed.
        let feed = |gpu: &mut CudaBackend| -> kiln_runtime::Result<()> {
            gpu.set_input(id, "x", x.shape(), x.data())?;
            gpu.set_input(id, "y", y.shape(), y.data())?;
            Ok(())
        };
        for _ in 0..5 {
            feed(&mut gpu)?;
            gpu.run(id)?;
        }
        // Wall time of a run to its completion (the driver seam has no events: the emulated
        // device has no clock of its own).
        let mut times = Vec::new();
        for _ in 0..50 {
            feed(&mut gpu)?;
            gpu.synchronize()?;
            let start = Instant::now();
            gpu.run(id)?;
            gpu.synchronize()?;
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let (free, total) = gpu.mem_info()?;
        let stats = gpu.compile_stats();

        // Eager: the same step, op by op, through BFC on cuMemAlloc'd regions.
        let scheduled = kiln_compiler::optimize(graph_of(&m, Mode::Train)?)?;
        let source = CudaSource::new(&gpu);
        let mut eager = EagerExecutor::new(BfcAllocator::new(source, total), 1, CudaEager::new(&gpu));
        let feed = [("x", &x), ("y", &y)];
        for _ in 0..3 {
            eager.run(&scheduled.graph, &scheduled.order, &feed)?;
        }
        let mut eager_times = Vec::new();
        for _ in 0..10 {
            let t = Instant::now();
            eager.run(&scheduled.graph, &scheduled.order, &feed)?;
            eager_times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let reserved = eager.allocator().stats().peak_reserved;
        rows.push(Row {
            model: m.name.to_string(),
            batch: m.batch,
            graph_step_ms: median(times),
            eager_step_ms: median(eager_times),
            launches_per_step: gpu.launches(id),
            arena_bytes: plan.memory.arena_bytes,
            planned_total_bytes: plan.memory.planned_total_bytes(),
            eager_bfc_peak_reserved_bytes: reserved,
            driver_used_bytes: total - free,
            kernels_compiled: stats.compiled,
            kernels_from_cache: stats.from_memory + stats.from_disk,
            compile_seconds: stats.compile_seconds,
        });
    }
    let headers = [
        "model",
        "batch",
        "graph ms/step",
        "eager ms/step",
        "launches",
        "arena",
        "planned total",
        "eager reserved",
        "driver used",
        "compiled",
        "cached",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.batch.to_string(),
                format!("{:.3}", r.graph_step_ms),
                format!("{:.3}", r.eager_step_ms),
                r.launches_per_step.to_string(),
                bytes(r.arena_bytes),
                bytes(r.planned_total_bytes),
                bytes(r.eager_bfc_peak_reserved_bytes),
                bytes(r.driver_used_bytes),
                r.kernels_compiled.to_string(),
                r.kernels_from_cache.to_string(),
            ]
        })
        .collect();
    println!("device: {}", CudaBackend::new(0, 0)?.describe());
    println!("{}", render_table(&headers, &cells));
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("gpu.json"), serde_json::to_string_pretty(&rows)?)?;
    println!("wrote {}", dir.join("gpu.json").display());
    Ok(Outcome::Ran)
}
