//! The GPU benchmark (`cargo bench --bench gpu`, or `kiln bench-gpu` on a machine without a Rust
//! toolchain): per zoo model on a CUDA device, the time of one training step in graph mode (CUDA
//! events around the plan's launches, median of many steps) and in eager mode (op by op through
//! TensorFlow's BFC allocator on real device regions, median wall time per synchronised step),
//! kernel launches per step, and device memory: the plan's arena, the eager peak reserved, and the
//! driver's used memory. Writes `gpu.json` beside the other results.

use crate::compare::{Mode, graph_of};
use crate::report::{bytes, render_table};
use crate::zoo;
use kiln_compiler::{CompileOptions, compile};
use kiln_runtime::alloc::{Allocator, BfcAllocator};
use kiln_runtime::cuda::{CudaBackend, CudaEager, CudaSource, probe};
use kiln_runtime::eager::EagerExecutor;
use kiln_runtime::{Backend, HostTensor, ProgramId};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::time::Instant;

#[derive(serde::Serialize)]
struct Row {
    model: String,
    mode: &'static str,
    batch: usize,
    /// Median device time of one plan call, between CUDA events around its launches.
    graph_step_ms: f64,
    graph_step_ms_min: f64,
    eager_step_ms: f64,
    launches_per_step: usize,
    arena_bytes: usize,
    planned_total_bytes: usize,
    eager_bfc_peak_reserved_bytes: usize,
    driver_used_bytes: usize,
    kernels_compiled: usize,
    kernels_from_cache: usize,
    compile_seconds: f64,
    /// The launches that took most of one profiled call: (step label, kernel, ms).
    slowest_launches: Vec<(String, String, f64)>,
}

/// Timed plan calls per model and mode (after `WARMUP` untimed ones).
const STEPS: usize = 100;
const WARMUP: usize = 10;

use crate::report::median;

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
    /// "skipped: no CUDA device (`<reason>`)" for a skip, as every GPU test and benchmark says it.
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
        for mode in [Mode::Train, Mode::Forward] {
            rows.push(measure(&m, mode)?);
        }
    }
    let headers = [
        "model",
        "mode",
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
                r.mode.to_string(),
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
    let device = CudaBackend::new(0, 0)?.describe();
    println!("device: {device}");
    println!("{}", render_table(&headers, &cells));
    for r in &rows {
        let total: f64 = r.slowest_launches.iter().map(|l| l.2).sum();
        println!("{} {}: slowest launches of one profiled call ({total:.3} ms in these)", r.model, r.mode);
        for (label, kernel, ms) in &r.slowest_launches {
            println!("  {ms:8.3} ms  {label}: {kernel}");
        }
    }
    crate::results::write("gpu", &device, &rows)?;
    Ok(Outcome::Ran)
}

/// One zoo model in one mode on a fresh backend: CUDA-event times of plan calls, the eager
/// executor's wall time on the same op stream, memory, and a per-launch profile.
fn measure(m: &zoo::ZooModel, mode: Mode) -> Result<Row, Box<dyn std::error::Error>> {
    let mut gpu = CudaBackend::new(0, 1)?;
    let plan = compile(graph_of(m, mode)?, &CompileOptions::default().with_scratch(gpu.scratch_rule()))?;
    let (x, y) = m.batch_data(1)?;
    let id = gpu.load(plan.clone())?;
    let inputs: Vec<(&str, &HostTensor)> = match mode {
        Mode::Train => vec![("x", &x), ("y", &y)],
        Mode::Forward => vec![("x", &x)],
    };
    let times = event_times(&mut gpu, id, &inputs, WARMUP, STEPS)?;
    feed(&mut gpu, id, &inputs)?;
    let mut profile = gpu.profile(id)?;
    profile.sort_by(|a, b| b.2.total_cmp(&a.2));
    profile.truncate(8);
    let (free, total) = gpu.mem_info()?;
    let stats = gpu.compile_stats();

    // Eager: the same op stream, op by op, through BFC on cuMemAlloc'd regions.
    let scheduled = kiln_compiler::optimize(graph_of(m, mode)?)?;
    let source = CudaSource::new(&gpu);
    let mut eager = EagerExecutor::new(BfcAllocator::new(source, total), 1, CudaEager::new(&gpu));
    for _ in 0..3 {
        eager.run(&scheduled.graph, &scheduled.order, &inputs)?;
    }
    let mut eager_times = Vec::new();
    for _ in 0..10 {
        gpu.synchronize()?;
        let t = Instant::now();
        eager.run(&scheduled.graph, &scheduled.order, &inputs)?;
        gpu.synchronize()?;
        eager_times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let reserved = eager.allocator().stats().peak_reserved;
    Ok(Row {
        model: m.name.to_string(),
        mode: mode.name(),
        batch: m.batch,
        graph_step_ms: median(times.clone()),
        graph_step_ms_min: times.iter().copied().fold(f64::INFINITY, f64::min),
        eager_step_ms: median(eager_times),
        launches_per_step: gpu.launches(id),
        arena_bytes: plan.memory.arena_bytes,
        planned_total_bytes: plan.memory.planned_total_bytes(),
        eager_bfc_peak_reserved_bytes: reserved,
        driver_used_bytes: total - free,
        kernels_compiled: stats.compiled,
        kernels_from_cache: stats.from_memory + stats.from_disk,
        compile_seconds: stats.compile_seconds,
        slowest_launches: profile,
    })
}

/// Copies `inputs` in: a run consumes its inputs (they live in the arena), so every run is fed,
/// outside the timed region.
fn feed(gpu: &mut CudaBackend, id: ProgramId, inputs: &[(&str, &HostTensor)]) -> kiln_runtime::Result<()> {
    inputs.iter().try_for_each(|(name, t)| gpu.set_input(id, name, t.shape(), t.data()))
}

/// `warmup` untimed calls, then the CUDA-event times (ms) of `steps` calls.
fn event_times(
    gpu: &mut CudaBackend,
    id: ProgramId,
    inputs: &[(&str, &HostTensor)],
    warmup: usize,
    steps: usize,
) -> kiln_runtime::Result<Vec<f64>> {
    for _ in 0..warmup {
        feed(gpu, id, inputs)?;
        gpu.run(id)?;
    }
    (0..steps)
        .map(|_| {
            feed(gpu, id, inputs)?;
            gpu.timed_run(id)
        })
        .collect()
}

/// One product of the GEMM benchmark.
#[derive(serde::Serialize)]
struct GemmRow {
    m: usize,
    k: usize,
    n: usize,
    ms: f64,
    tflops: f64,
    /// ||gpu - cpu|| / ||cpu||, against the CPU backend's product of the same inputs.
    rel_error: f64,
    kernel: String,
}

/// `kiln bench-gemm`: kiln's NVRTC matmul alone, as a one-op plan, at each (m, k, n): the median
/// of `steps` CUDA-event times, TFLOP/s = 2mkn / time, and the relative error against the CPU
/// backend. In bf16 or f16 (`precision`) the factors are cast to the half type in the plan and
/// the product (half factors on the tensor cores, a half result) is timed alone: the median of
/// `steps` per-step profiles of its launches. Writes `gemm.json` (`gemm-bf16.json`, ...).
pub fn gemm(
    shapes: &[(usize, usize, usize)],
    steps: usize,
    precision: kiln_compiler::Precision,
) -> Result<Outcome, Box<dyn std::error::Error>> {
    use kiln_compiler::trace::Tracer;
    use kiln_runtime::CpuBackend;
    let p = probe();
    if let Err(why) = p.usable() {
        return Ok(Outcome::Skipped(why.to_string()));
    }
    let mut rows = Vec::new();
    for &(m, k, n) in shapes {
        let t = Tracer::new("gemm");
        let a = t.input("a", [m, k]);
        let b = t.input("b", [k, n]);
        let half = match precision {
            kiln_compiler::Precision::Mixed(h) => Some(h.dtype()),
            kiln_compiler::Precision::F32 => None,
        };
        let c = match half {
            Some(h) => a.cast(h).matmul(&b.cast(h)).cast(kiln_compiler::ir::DType::F32),
            None => a.matmul(&b),
        };
        t.output("c", &c);
        let mut gpu = CudaBackend::new(0, 0)?;
        let plan = compile(t.finish()?, &CompileOptions::default().with_scratch(gpu.scratch_rule()))?;
        let mut rng = StdRng::seed_from_u64((m * 31 + k * 7 + n) as u64);
        let mut draw =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        let a = HostTensor::new(kiln_compiler::ir::Shape::new([m, k]), draw(m * k))?;
        let b = HostTensor::new(kiln_compiler::ir::Shape::new([k, n]), draw(k * n))?;
        let inputs = [("a", &a), ("b", &b)];
        let id = gpu.load(plan.clone())?;
        let ms = match half {
            None => median(event_times(&mut gpu, id, &inputs, 3, steps)?),
            // The product's launches alone, without the casts around them.
            Some(_) => {
                let mut times = Vec::with_capacity(steps);
                for run in 0..steps + 3 {
                    feed(&mut gpu, id, &inputs)?;
                    let product: f64 = gpu
                        .profile(id)?
                        .iter()
                        .filter(|(_, k, _)| k.starts_with("matmul"))
                        .map(|(_, _, ms)| ms)
                        .sum();
                    if run >= 3 {
                        times.push(product);
                    }
                }
                median(times)
            }
        };
        let out = gpu.output(id, "c")?;
        let mut cpu = CpuBackend::new(0);
        let cid = cpu.load(plan.clone())?;
        let reference = cpu.call(cid, &inputs)?.into_iter().find(|(name, _)| name == "c").map(|(_, t)| t);
        let reference = reference.ok_or("the product's plan has no output `c`")?;
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (g, c) in out.data().iter().zip(reference.data()) {
            num += f64::from(g - c).powi(2);
            den += f64::from(*c).powi(2);
        }
        feed(&mut gpu, id, &inputs)?;
        let kernel = gpu.profile(id)?.into_iter().map(|(_, k, _)| k).collect::<Vec<_>>().join(" + ");
        let row = GemmRow {
            m,
            k,
            n,
            ms,
            tflops: 2.0 * (m * k * n) as f64 / ms / 1e9,
            rel_error: (num / den.max(1e-300)).sqrt(),
            kernel,
        };
        println!(
            "kiln matmul {m}x{k}x{n}{}: {:.4} ms, {:.2} TFLOP/s, rel. error {:.2e} ({})",
            half.map_or(String::new(), |h| format!(" {h}")),
            row.ms,
            row.tflops,
            row.rel_error,
            row.kernel
        );
        rows.push(row);
    }
    let device = CudaBackend::new(0, 0)?.describe();
    let name = if precision == kiln_compiler::Precision::F32 {
        "gemm".to_string()
    } else {
        format!("gemm-{precision}")
    };
    crate::results::write(&name, &device, &rows)?;
    Ok(Outcome::Ran)
}
