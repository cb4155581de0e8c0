//! Planned against eager memory for one model: the comparison the benchmark, the CLI and the
//! examples print. Everything here is measured: the plan's figures come from the plan, the eager
//! figures from TensorFlow's BFC allocator (allow_growth) and PyTorch's caching allocator
//! running the same graph op by op.

use crate::error::Result;
use crate::zoo::ZooModel;
use kiln_compiler::ir::{DType, Graph, Shape};
use kiln_compiler::step::{forward_graph_with, train_step_graph_with};
use kiln_compiler::{CompileOptions, Plan, Precision, compile, optimize};
use kiln_runtime::HostTensor;
use kiln_runtime::alloc::{
    Allocator, BfcAllocator, CachingAllocator, HostSource, RegionSource, VirtualSource,
};
use kiln_runtime::eager::{
    CpuEager, EagerExecutor, FrameworkExtras, MemorySample, Simulated, WorkspacePolicy,
};
use std::fmt::Write;
use std::time::Instant;

/// Inference, or one training step (forward, backward, Adam).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// A forward pass only (inference): the graph of `step::forward_graph`.
    Forward,
    /// One training step: forward, backward and the optimizer's updates (`step::train_step_graph`).
    Train,
}

impl Mode {
    /// The mode's name as tables and JSON print it: `forward` or `train`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Forward => "forward",
            Mode::Train => "train",
        }
    }

    /// The mode a command-line word names (`forward` or `inference`, `train` or `training`);
    /// `None` for any other word.
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "forward" | "inference" => Some(Mode::Forward),
            "train" | "training" => Some(Mode::Train),
            _ => None,
        }
    }
}

/// The device memory the eager allocators may grow to (an H200's 141 GB would change nothing:
/// no zoo model comes near the limit).
pub const EAGER_DEVICE_BYTES: usize = 80 << 30;

/// Eager calls per comparison: the first creates the optimizer state, the second runs warm.
pub const EAGER_CALLS: usize = 2;

/// One row of the memory benchmark (field names as documented in the README).
#[derive(Clone, Debug, serde::Serialize)]
pub struct Comparison {
    /// The model's name (a zoo name, or the name given to `compare_graph`).
    pub model: String,
    /// Whether the row is a forward pass or a training step.
    pub mode: Mode,
    /// The batch size: the first input's leading dimension.
    pub batch: usize,
    /// The sum of every intermediate buffer's aligned bytes, no reuse (DESIGN.md's naive), in bytes.
    pub naive_bytes: usize,
    /// The most bytes live at any one step of the chosen schedule: no arena of that schedule
    /// is smaller.
    pub lower_bound_bytes: usize,
    /// The planned arena's size in bytes (slots aligned to 64 bytes).
    pub arena_bytes: usize,
    /// Bytes that outlive a call: parameters, optimizer state, constants and io.
    pub persistent_bytes: usize,
    /// persistent + arena: every byte the plan holds, exact and unrounded.
    pub planned_total_bytes: usize,
    /// The plan's allocations (variable region, arena) each rounded to the device's 2 MiB
    /// granularity: counted as the allocators' reserved bytes are (`Plan::device_bytes`).
    pub device_bytes: usize,
    /// The peak bytes live tensors held under kiln's eager executor with the BFC allocator
    /// (TensorFlow's, allow_growth), over the last of `EAGER_CALLS` calls.
    pub eager_bfc_peak_in_use_bytes: usize,
    /// The peak bytes the BFC allocator held from the device in the same eager run (whole
    /// regions).
    pub eager_bfc_peak_reserved_bytes: usize,
    /// TensorFlow's fragmentation, (reserved - in use - largest free chunk) / (reserved - in
    /// use), at the BFC run's peak: the largest over the eager calls, 0 to 1.
    pub eager_bfc_fragmentation_at_peak: f64,
    /// The peak bytes live tensors held under kiln's eager executor with PyTorch's caching
    /// allocator model (no workspaces).
    pub eager_caching_peak_in_use_bytes: usize,
    /// The peak bytes the caching allocator held from the device in the same eager run (whole
    /// segments).
    pub eager_caching_peak_reserved_bytes: usize,
    /// The framework columns (`kiln_runtime::eager::framework`): kiln's eager op stream with
    /// what the framework adds on a GPU. PyTorch: caching allocator, a 32 MiB cuBLAS workspace
    /// per thread's handle and cuBLASLt's 1 MiB kept (the default, as measured with PyTorch 2.11
    /// on an H100) or cuBLAS's taken around each product, foreach Adam's temporaries.
    pub pytorch_caching_peak_reserved_bytes: usize,
    /// The PyTorch column's reserved peak with cuBLAS's workspace taken around each product
    /// instead of kept (`WorkspacePolicy::PerCall`), in bytes.
    pub pytorch_caching_per_call_workspace_peak_reserved_bytes: usize,
    /// PyTorch's own op stream for the step (`torch_stream`, the committed recording; zoo
    /// training steps at their default batch only) replayed through the caching model: alone,
    /// and with the default workspaces.
    pub pytorch_replayed: Option<crate::torch_stream::Replayed>,
    /// TensorFlow (allow_growth): BFC allocator with convolution scratch (im2col-sized).
    pub tensorflow_bfc_peak_reserved_bytes: usize,
    /// Wall time of `compile` (schedule search, liveness, placement) in ms: the median of up to
    /// `PLAN_TIMINGS` compiles.
    pub plan_ms: f64,
    /// The number of steps (kernel launches) in the plan.
    pub steps: usize,
    /// The placement heuristic whose arena won (`MemoryFigures::algorithm`).
    pub algorithm: String,
    /// JAX/XLA's buffer assignment for the same step (`peers`), when JAX could be had.
    pub xla_total_bytes: Option<usize>,
    /// The execution order that won, and every order tried with its planned total.
    pub schedule: String,
    /// Every execution order tried, by name, with its planned total in bytes.
    pub schedules: Vec<(String, usize)>,
    /// Whether the eager runs executed the kernels (else they replayed the allocations only).
    pub eager_executed: bool,
    /// The compiled plan the figures were read from (not serialised).
    #[serde(skip)]
    pub plan: Plan,
    /// BFC memory after every step of the last eager call.
    #[serde(skip)]
    pub bfc_samples: Vec<MemorySample>,
}

impl Comparison {
    /// arena / lower bound: how far the placement is from the best any placement of the schedule
    /// could do (1.0 is optimal).
    pub fn arena_over_bound(&self) -> f64 {
        crate::report::ratio(self.arena_bytes, self.lower_bound_bytes)
    }

    /// planned total / XLA's total for the same step, when measured.
    pub fn kiln_over_xla(&self) -> Option<f64> {
        self.xla_total_bytes.map(|x| crate::report::ratio(self.planned_total_bytes, x))
    }

    /// The plan's device bytes / the PyTorch column (default workspace policy).
    pub fn device_over_pytorch(&self) -> f64 {
        crate::report::ratio(self.device_bytes, self.pytorch_caching_peak_reserved_bytes)
    }

    /// The plan's device bytes / PyTorch's replayed stream with its default workspaces.
    pub fn device_over_replayed(&self) -> Option<f64> {
        self.pytorch_replayed.map(|r| crate::report::ratio(self.device_bytes, r.workspace_peak_reserved))
    }

    /// kiln's eager caching column / PyTorch's replayed stream (no workspaces): how faithful
    /// kiln's eager op stream is to PyTorch's, reserved and in use.
    pub fn eager_over_replayed(&self) -> Option<(f64, f64)> {
        self.pytorch_replayed.map(|r| {
            (
                crate::report::ratio(self.eager_caching_peak_reserved_bytes, r.peak_reserved),
                crate::report::ratio(self.eager_caching_peak_in_use_bytes, r.peak_in_use),
            )
        })
    }

    /// eager BFC peak reserved / the plan's device bytes: how much more eager mode holds from
    /// the device, both sides counted in whole allocations.
    pub fn eager_reserved_over_device(&self) -> f64 {
        crate::report::ratio(self.eager_bfc_peak_reserved_bytes, self.device_bytes)
    }
}

/// The graph `compare` plans for `m` in `mode`: its forward pass at `m`'s input shape, or its
/// training step with `m`'s loss and optimizer.
pub fn graph_of(m: &ZooModel, mode: Mode) -> Result<Graph> {
    graph_at(m, mode, Precision::F32)
}

/// `graph_of` computed in `precision` (`kiln_compiler::autocast`).
pub fn graph_at(m: &ZooModel, mode: Mode, precision: Precision) -> Result<Graph> {
    let model = m.model();
    Ok(match mode {
        Mode::Forward => forward_graph_with(&model, m.x_shape(), precision)?,
        Mode::Train => train_step_graph_with(&model, m.x_shape(), m.y_shape(), &m.config(), 1, precision)?,
    })
}

/// Plans `m` in `mode` and runs it eagerly under both allocators. With `execute`, the eager runs
/// compute on host memory; otherwise they replay the same allocation sequence on virtual memory.
pub fn compare(m: &ZooModel, mode: Mode, execute: bool) -> Result<Comparison> {
    compare_at(m, mode, execute, Precision::F32)
}

/// `compare` of `m` computed in `precision`. The host kernels compute in f32 alone, so a
/// half-precision step's eager columns replay its allocations on virtual memory whatever
/// `execute` says.
pub fn compare_at(m: &ZooModel, mode: Mode, execute: bool, precision: Precision) -> Result<Comparison> {
    if m.batch == 0 {
        return Err(crate::Error::Runtime(kiln_runtime::RuntimeError::invalid(
            format!("{} with batch size 0: there is nothing to plan", m.name),
            "use a batch size of at least 1",
        )));
    }
    let graph = graph_at(m, mode, precision)?;
    let execute = execute && precision == Precision::F32;
    let (x, y) = m.batch_data(1)?;
    let feed: Vec<(&str, &HostTensor)> = match mode {
        Mode::Forward => vec![("x", &x)],
        Mode::Train => vec![("x", &x), ("y", &y)],
    };
    let mut row = compare_graph(m.name, graph, &feed, execute)?;
    // The recording is of the zoo's training steps at their default batches.
    if mode == Mode::Train && crate::zoo::by_name(m.name).is_some_and(|d| d.batch == m.batch) {
        row.pytorch_replayed = crate::torch_stream::committed_figures(m.name)?;
    }
    Ok(row)
}

/// Random inputs for every input of `graph` (f32 uniform in [0, 1): valid ids for an embedding,
/// as ids are floor-ed; i32 / i64 ids 0, bool masks true), seeded: what `compare_graph` needs to execute a model it knows nothing of.
pub fn feeds_for(graph: &Graph, seed: u64) -> Result<Vec<(String, HostTensor)>> {
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
    graph
        .inputs()
        .into_iter()
        .map(|n| {
            let node = graph.node(n);
            let name = match &node.op {
                kiln_compiler::ir::Op::Input { name, .. } => name.clone(),
                _ => unreachable!("Graph::inputs lists input nodes"),
            };
            Ok((name, random_input(&node.shape, node.dtype, &mut rng)?))
        })
        .collect()
}

/// An input of `shape` and `dtype` for a run without data: floats uniform in [0, 1) from
/// `rng`; exact inputs (ids, masks) id 0 / true, valid for any table.
pub fn random_input(shape: &Shape, dtype: DType, rng: &mut rand::rngs::StdRng) -> Result<HostTensor> {
    let n = shape.numel();
    Ok(match dtype {
        DType::I32 => HostTensor::from_i32(shape.clone(), vec![0; n])?,
        DType::I64 => HostTensor::from_i64(shape.clone(), vec![0; n])?,
        DType::Bool => HostTensor::from_bool(shape.clone(), vec![true; n])?,
        _ => HostTensor::new(
            shape.clone(),
            (0..n).map(|_| rand::RngExt::random_range(rng, 0.0f32..1.0)).collect(),
        )?,
    })
}

/// At most how many times `compare_graph` compiles a graph to time its plan (the median is
/// reported): as many as take under 0.1 s in all.
pub const PLAN_TIMINGS: usize = 3;

/// `compare` for any traced graph (a user's own model, not only the zoo's): plans it and runs it
/// eagerly under every allocator, fed with `feed` (every input of the graph; `feeds_for` makes
/// random ones). A graph with updates is a training step, else a forward pass; the batch is the
/// first input's leading dimension.
pub fn compare_graph(
    name: &str,
    graph: Graph,
    feed: &[(&str, &HostTensor)],
    execute: bool,
) -> Result<Comparison> {
    let mode = if graph.effects().is_empty() { Mode::Forward } else { Mode::Train };
    let batch =
        graph.inputs().first().and_then(|&n| graph.node(n).shape.dims().first().copied()).unwrap_or(1);
    // Plan time: the median of up to three compiles while they take under 0.1 s in all (one
    // zoo compile varied by a third on a shared 2-core machine; a real-scale one, a few tenths
    // of a second, is timed once), the first plan kept (every compile gives the same plan).
    let mut times = Vec::with_capacity(PLAN_TIMINGS);
    let mut first = None;
    while times.len() < PLAN_TIMINGS && times.iter().sum::<f64>() < 100.0 {
        let start = Instant::now();
        let plan = compile(graph.clone(), &CompileOptions::default())?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        first.get_or_insert(plan);
    }
    let plan = first.expect("one compile at least");
    times.sort_by(f64::total_cmp);
    // The median; of two, the faster (the slower is what cut the timing short).
    let plan_ms = times[(times.len() - 1) / 2];
    let scheduled = optimize(graph)?;
    let eager_with = |alloc: Box<dyn Allocator>,
                      extras: FrameworkExtras,
                      execute: bool|
     -> Result<(kiln_runtime::alloc::AllocatorStats, f64, Vec<MemorySample>)> {
        let mut ex = if execute {
            EagerExecutor::new(alloc, 1, CpuEager)
        } else {
            EagerExecutor::new(alloc, 1, Simulated)
        }
        .with_extras(extras);
        let mut frag: f64 = 0.0;
        let mut last = None;
        for _ in 0..EAGER_CALLS {
            let run = ex.run(&scheduled.graph, &scheduled.order, feed)?;
            frag = frag.max(run.fragmentation_at_peak);
            last = Some(run);
        }
        let run = last.expect("at least one call");
        Ok((run.stats, frag, run.samples))
    };
    let eager = |alloc: Box<dyn Allocator>| eager_with(alloc, FrameworkExtras::default(), execute);
    let source = || -> Box<dyn RegionSource> {
        if execute { Box::new(HostSource::new()) } else { Box::new(VirtualSource::new()) }
    };
    let (bfc, bfc_frag, samples) = eager(Box::new(BfcAllocator::new(source(), EAGER_DEVICE_BYTES)))?;
    let (caching, _, _) = eager(Box::new(CachingAllocator::new(source(), Some(EAGER_DEVICE_BYTES))))?;
    // The framework columns replay the allocations (sizes and lifetimes do not depend on values).
    let virtual_caching = || Box::new(CachingAllocator::new(VirtualSource::new(), Some(EAGER_DEVICE_BYTES)));
    let (pytorch, _, _) =
        eager_with(virtual_caching(), FrameworkExtras::pytorch(WorkspacePolicy::Persistent), false)?;
    let (pytorch_per_call, _, _) =
        eager_with(virtual_caching(), FrameworkExtras::pytorch(WorkspacePolicy::PerCall), false)?;
    let (tensorflow, _, _) = eager_with(
        Box::new(BfcAllocator::new(VirtualSource::new(), EAGER_DEVICE_BYTES)),
        FrameworkExtras::tensorflow(),
        false,
    )?;

    let mem = &plan.memory;
    Ok(Comparison {
        model: name.to_string(),
        mode,
        batch,
        naive_bytes: mem.naive_bytes,
        lower_bound_bytes: mem.lower_bound_bytes,
        arena_bytes: mem.arena_bytes,
        persistent_bytes: mem.persistent_bytes,
        planned_total_bytes: mem.planned_total_bytes(),
        device_bytes: plan.device_bytes(kiln_compiler::plan::DEVICE_GRANULARITY),
        eager_bfc_peak_in_use_bytes: bfc.peak_in_use,
        eager_bfc_peak_reserved_bytes: bfc.peak_reserved,
        eager_bfc_fragmentation_at_peak: bfc_frag,
        eager_caching_peak_in_use_bytes: caching.peak_in_use,
        eager_caching_peak_reserved_bytes: caching.peak_reserved,
        pytorch_caching_peak_reserved_bytes: pytorch.peak_reserved,
        pytorch_caching_per_call_workspace_peak_reserved_bytes: pytorch_per_call.peak_reserved,
        pytorch_replayed: None,
        tensorflow_bfc_peak_reserved_bytes: tensorflow.peak_reserved,
        plan_ms,
        steps: plan.steps.len(),
        algorithm: mem.algorithm.clone(),
        xla_total_bytes: None,
        schedule: mem.schedule.clone(),
        schedules: mem.schedules.clone(),
        eager_executed: execute,
        plan,
        bfc_samples: samples,
    })
}

/// The plan's buffers by the element type of the value that first takes each, most bytes
/// first: `bf16 12.5 MB in 40 buffers, f32 3.1 MB in 12 buffers` (a view shares its operand's
/// buffer): what a mixed-precision plan holds at which size, before arena reuse.
pub fn buffers_by_dtype(plan: &Plan) -> String {
    let mut by: std::collections::BTreeMap<&'static str, (usize, usize)> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for v in &plan.values {
        if let (true, Some(b)) = (seen.insert(v.buffer), plan.buffers.get(v.buffer)) {
            let e = by.entry(v.dtype.name()).or_default();
            e.0 += b.bytes;
            e.1 += 1;
        }
    }
    let mut rows: Vec<_> = by.into_iter().collect();
    rows.sort_by_key(|(_, (bytes, _))| std::cmp::Reverse(*bytes));
    rows.iter()
        .map(|(name, (bytes, n))| format!("{name} {} in {n} buffers", crate::report::bytes(*bytes)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The comparison table, one row per model and mode.
pub fn table(rows: &[Comparison]) -> String {
    use crate::report::bytes;
    let headers = [
        "model",
        "mode",
        "batch",
        "naive",
        "lower bound",
        "arena",
        "arena/bound",
        "persistent",
        "planned total",
        "device bytes",
        "eager BFC in-use",
        "eager BFC reserved",
        "eager caching reserved",
        "frag@peak",
        "BFC reserved/device",
        "XLA total",
        "kiln/XLA",
        "schedule",
        "plan ms",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.mode.name().to_string(),
                r.batch.to_string(),
                bytes(r.naive_bytes),
                bytes(r.lower_bound_bytes),
                bytes(r.arena_bytes),
                format!("{:.3}", r.arena_over_bound()),
                bytes(r.persistent_bytes),
                bytes(r.planned_total_bytes),
                bytes(r.device_bytes),
                bytes(r.eager_bfc_peak_in_use_bytes),
                bytes(r.eager_bfc_peak_reserved_bytes),
                bytes(r.eager_caching_peak_reserved_bytes),
                format!("{:.3}", r.eager_bfc_fragmentation_at_peak),
                format!("{:.3}", r.eager_reserved_over_device()),
                r.xla_total_bytes.map_or("-".into(), bytes),
                r.kiln_over_xla().map_or("-".into(), |x| format!("{x:.3}")),
                r.schedule.clone(),
                format!("{:.2}", r.plan_ms),
            ]
        })
        .collect();
    let mut out = crate::report::render_table(&headers, &cells);
    out.push_str("planned total by schedule (the smallest is kept):\n");
    for r in rows {
        let tried: Vec<String> = r.schedules.iter().map(|(n, b)| format!("{n} {}", bytes(*b))).collect();
        let _ = writeln!(out, "  {} {}: {}", r.model, r.mode.name(), tried.join(", "));
    }
    for r in rows {
        if let Some(s) = &r.plan.memory.rewrites.saved_values {
            let _ = writeln!(
                out,
                "{} {}: kept for the backward pass {} -> {}, {} ops recomputed ({}, {:.2}% of the step)",
                r.model,
                r.mode.name(),
                bytes(s.kept_bytes_before),
                bytes(s.kept_bytes_after),
                s.recomputed_ops,
                kiln_compiler::plan::human_flops(s.recomputed_flops),
                100.0 * s.recomputed_flops as f64 / s.step_flops.max(1) as f64
            );
        }
        if let Some(m) = &r.plan.memory.remat {
            let _ = writeln!(out, "{} {}: {}", r.model, r.mode.name(), m.summary());
        }
    }
    out
}

/// What the framework columns assume, printed beside them.
pub const FRAMEWORK_ASSUMPTIONS: &str = "assumptions:
- device bytes: the plan's one allocation on the device (its variable region, io region and
  arena, as the backends load it under memory growth), rounded up to 2 MiB (the CUDA driver's
  granularity); eager columns: the allocator's reserved peak, whole segments.
- kiln's eager columns run kiln's op stream for the step (kiln's ops, each result freed after
  its last reader), variables made as frameworks make them: parameters at build, all optimizer
  state at the first update; two calls, the second measured.
- PyTorch replayed: PyTorch 2.15's own ATen op stream for the same step (idiomatic modules,
  Adam(foreach=True), two steps, a fresh batch each), captured on the CPU below autograd
  (scripts/peers/torch_stream.py, committed in benches/data/torch_stream.json) and replayed
  through kiln's caching-allocator model; CPU kernels differ from CUDA ones only inside ops
  (attention: CPU flash vs CUDA memory-efficient, both saving output and log-sum-exp).
- PyTorch workspaces (H100, compute capability 9): a 32 MiB cuBLAS workspace per thread's
  handle (forward; backward, which autograd runs on its own thread) and cuBLASLt's 1 MiB, from
  the caching allocator, kept from their first product (the default: with it the replay gives
  PyTorch 2.11's measured H100 peaks for seed-mlp to the byte, allocated 68,199,424 and
  reserved 69,206,016); \"+ws per call\": cuBLAS's taken around each product instead. cuDNN
  convolution workspaces are not counted (the cnn's real reserved peak, 346 MB, includes them).
- TensorFlow (allow_growth): convolution scratch from the BFC allocator around every
  convolution and gradient, sized as the explicit-GEMM algorithm's im2col buffer
  (N*OH*OW*KH*KW*C floats); cuDNN's autotuner may pick another algorithm (up to 4 GiB of
  workspace). With growth off TensorFlow reserves the device's free memory less 1,800 MiB
  (compute capability 9; 1,536 MiB on 8) whatever the model: 78.2 GiB of an 80 GiB H100.
- forward passes: kiln plans the row-separable part in blocks of batch rows where that plans
  smaller (schedule \"+blocksN\"; the cnn: 8 blocks of 8 images), an op stream of its own; the
  eager columns and XLA run the whole batch at once. With KILN_BATCH_BLOCKS=0 kiln plans the
  whole batch too (the cnn's forward pass: planned total 19,142,312 B, kiln / XLA 0.960).";

/// The framework columns beside kiln's own eager columns and the plan's device bytes.
pub fn framework_table(rows: &[Comparison]) -> String {
    use crate::report::bytes;
    let headers = [
        "model",
        "mode",
        "device bytes",
        "kiln eager caching",
        "PyTorch replayed",
        "kiln eager/replayed",
        "PyTorch replayed +ws",
        "PyTorch caching (kiln stream +ws)",
        "+ws per call",
        "kiln eager BFC",
        "TensorFlow BFC (growth)",
        "device/PyTorch replayed +ws",
        "TF BFC/device",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.model.clone(),
                r.mode.name().to_string(),
                bytes(r.device_bytes),
                bytes(r.eager_caching_peak_reserved_bytes),
                r.pytorch_replayed.map_or("-".into(), |p| bytes(p.peak_reserved)),
                r.eager_over_replayed()
                    .map_or("-".into(), |(res, used)| format!("{res:.3} ({used:.3} in use)")),
                r.pytorch_replayed.map_or("-".into(), |p| bytes(p.workspace_peak_reserved)),
                bytes(r.pytorch_caching_peak_reserved_bytes),
                bytes(r.pytorch_caching_per_call_workspace_peak_reserved_bytes),
                bytes(r.eager_bfc_peak_reserved_bytes),
                bytes(r.tensorflow_bfc_peak_reserved_bytes),
                r.device_over_replayed().map_or("-".into(), |x| format!("{x:.3}")),
                format!("{:.3}", crate::report::ratio(r.tensorflow_bfc_peak_reserved_bytes, r.device_bytes)),
            ]
        })
        .collect();
    crate::report::render_table(&headers, &cells)
}

/// The most milliseconds a zoo training step may take to compile (`Goals`).
pub const PLAN_MS_GOAL: f64 = 20.0;

/// The goals the memory benchmark holds, each with its measured figure.
pub struct Goals {
    /// max over rows of arena / lower bound (goal: <= 1.02).
    pub worst_arena_over_bound: f64,
    /// rows whose planned total exceeds the eager BFC in-use peak (goal: none).
    pub planned_above_eager_in_use: Vec<String>,
    /// geometric mean over training steps of eager BFC reserved / device bytes (goal: >= 1.5).
    pub train_reserved_ratio_geomean: f64,
    /// max over training steps of device bytes / PyTorch's replayed stream with its default
    /// workspaces (goal: <= 0.6), with its model (kiln's stream with PyTorch's extras where no
    /// recording covers the step).
    pub worst_device_over_pytorch: (f64, String),
    /// kiln eager caching reserved / PyTorch replayed reserved farthest from 1 over recorded
    /// training steps (goal: within 10%), with its model and the in-use ratio there.
    pub worst_eager_fidelity: Option<(f64, String, f64)>,
    /// kiln / XLA over training steps where XLA was measured: the worst (goal <= 0.85) with its
    /// model, and the geometric mean (goal <= 0.75).
    pub train_kiln_over_xla: Option<(f64, String, f64)>,
    /// The longest compile of a training step, in ms, with its model (goal: <= `PLAN_MS_GOAL`;
    /// NaN without a training step).
    pub worst_train_plan_ms: (f64, String),
}

fn geomean(values: &[f64]) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        (values.iter().map(|v| v.ln()).sum::<f64>() / values.len() as f64).exp()
    }
}

impl Goals {
    /// Measures every goal over the benchmark's `rows` (a training-step goal over the `Train` rows
    /// only; NaN or `None` where no row measures it).
    pub fn of(rows: &[Comparison]) -> Self {
        let worst_arena_over_bound = rows.iter().map(Comparison::arena_over_bound).fold(1.0, f64::max);
        let planned_above_eager_in_use = rows
            .iter()
            .filter(|r| r.planned_total_bytes > r.eager_bfc_peak_in_use_bytes)
            .map(|r| format!("{} {}", r.model, r.mode.name()))
            .collect();
        let train: Vec<&Comparison> = rows.iter().filter(|r| r.mode == Mode::Train).collect();
        let reserved: Vec<f64> = train.iter().map(|r| r.eager_reserved_over_device()).collect();
        let worst_device_over_pytorch = train
            .iter()
            .map(|r| (r.device_over_replayed().unwrap_or_else(|| r.device_over_pytorch()), r.model.clone()))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((f64::NAN, String::new()));
        let xla: Vec<(f64, &str)> =
            train.iter().filter_map(|r| r.kiln_over_xla().map(|x| (x, r.model.as_str()))).collect();
        let train_kiln_over_xla =
            xla.iter().copied().max_by(|a, b| a.0.total_cmp(&b.0)).map(|(worst, m)| {
                (worst, m.to_string(), geomean(&xla.iter().map(|x| x.0).collect::<Vec<_>>()))
            });
        let worst_eager_fidelity = train
            .iter()
            .filter_map(|r| r.eager_over_replayed().map(|(res, used)| (res, r.model.clone(), used)))
            .max_by(|a, b| (a.0 - 1.0).abs().total_cmp(&(b.0 - 1.0).abs()));
        let worst_train_plan_ms = train
            .iter()
            .map(|r| (r.plan_ms, r.model.clone()))
            .max_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap_or((f64::NAN, String::new()));
        Goals {
            worst_train_plan_ms,
            worst_eager_fidelity,
            worst_arena_over_bound,
            planned_above_eager_in_use,
            train_reserved_ratio_geomean: geomean(&reserved),
            worst_device_over_pytorch,
            train_kiln_over_xla,
        }
    }

    /// One line per goal: its threshold, the measured figure and `met` or `MISSED` (kiln / XLA
    /// `skipped` when JAX could not be had).
    pub fn render(&self) -> String {
        let mark = |ok: bool| if ok { "met" } else { "MISSED" };
        let above = &self.planned_above_eager_in_use;
        let mut s = format!(
            "goal arena <= 1.02 x lower bound on every model: worst {:.3} ({})\n\
             goal planned total <= eager BFC in-use peak on every model: {} ({})\n\
             goal eager BFC reserved / device bytes >= 1.5 (geomean over training steps): {:.2} ({})\n",
            self.worst_arena_over_bound,
            mark(self.worst_arena_over_bound <= 1.02),
            if above.is_empty() { "all".to_string() } else { format!("exceeded on {}", above.join(", ")) },
            mark(above.is_empty()),
            self.train_reserved_ratio_geomean,
            mark(self.train_reserved_ratio_geomean >= 1.5),
        );
        let (worst, model) = &self.worst_device_over_pytorch;
        s += &format!(
            "goal device bytes <= 0.6 x PyTorch reserved (its replayed stream, default workspaces) on every training step: worst {worst:.3} ({model}) ({})\n",
            mark(*worst <= 0.6)
        );
        if let Some((ratio, model, used)) = &self.worst_eager_fidelity {
            s += &format!(
                "goal kiln eager caching reserved within 10% of PyTorch's replayed stream on every training step: worst {:+.1}% ({model}; in use there {used:.3}x) ({})\n",
                (ratio - 1.0) * 100.0,
                mark((ratio - 1.0).abs() <= 0.10)
            );
        }
        match &self.train_kiln_over_xla {
            Some((worst, model, mean)) => {
                s += &format!(
                    "goal kiln / XLA <= 0.85 on every training step: worst {worst:.3} ({model}) ({})\n\
                     goal kiln / XLA <= 0.75 (geomean over training steps): {mean:.3} ({})\n",
                    mark(*worst <= 0.85),
                    mark(*mean <= 0.75)
                );
            }
            None => s += "goal kiln / XLA: skipped (JAX could not be had)\n",
        }
        match &self.worst_train_plan_ms {
            (ms, model) if ms.is_finite() => {
                s += &format!(
                    "goal plan time <= {PLAN_MS_GOAL} ms on every training step: worst {ms:.1} ms ({model}) ({})\n",
                    mark(*ms <= PLAN_MS_GOAL)
                );
            }
            _ => s += "goal plan time: skipped (no training step)\n",
        }
        s
    }
}
