//! Rematerialization measured: a zoo training step compiled under a memory limit of its
//! persistent bytes plus a fraction of its unconstrained arena (`kiln_compiler::remat` recomputes
//! values to fit), trained beside the unconstrained plan from the same initial variables on the
//! CPU backend. Both runs' losses and final variables are compared bit for bit, and their step
//! times side by side (steps alternate between the two plans, so that a busy machine slows both
//! alike). The `remat` example prints one run; `cargo bench --bench remat` holds the goal.

use crate::error::Result;
use crate::zoo::ZooModel;
use kiln_compiler::plan::RematFigures;
use kiln_compiler::step::train_step_graph;
use kiln_compiler::{CompileOptions, Plan, compile};
use kiln_runtime::{Backend, CpuBackend, HostTensor};
use serde::Serialize;
use std::time::Instant;

/// One model under one limit, beside the unconstrained plan.
#[derive(Clone, Debug, Serialize)]
pub struct RematRun {
    /// The zoo model's name.
    pub model: String,
    /// The training step's batch size.
    pub batch: usize,
    /// The limit is persistent + `fraction` x the unconstrained arena.
    pub fraction: f64,
    /// The memory limit the limited plan was compiled under, in bytes.
    pub limit_bytes: usize,
    /// The unconstrained plan's persistent bytes (parameters, optimizer state, constants, io).
    pub persistent_bytes: usize,
    /// The unconstrained plan's arena, in bytes.
    pub free_arena_bytes: usize,
    /// The unconstrained plan's planned total (persistent + arena), in bytes.
    pub free_total_bytes: usize,
    /// The plan under the limit; `None` (with `error`) when nothing fits.
    pub limited_arena_bytes: Option<usize>,
    /// The limited plan's planned total in bytes; `None` when nothing fits.
    pub limited_total_bytes: Option<usize>,
    /// What rematerialization recomputed to fit (values, ops, FLOPs, bytes before and after);
    /// `None` when nothing fits or nothing had to be recomputed.
    pub remat: Option<RematFigures>,
    /// The compile error of the limited plan when nothing fits the limit; `None` when it compiled.
    pub error: Option<String>,
    /// Compile times (ms): without and with the limit.
    pub free_compile_ms: f64,
    /// The compile time under the limit, ms (the failed attempt's when nothing fits).
    pub limited_compile_ms: f64,
    /// Per step, both runs (empty when nothing fits).
    pub free_losses: Vec<f32>,
    /// The limited plan's loss at each step (empty when nothing fits).
    pub limited_losses: Vec<f32>,
    /// Losses and every variable after the last step equal bit for bit.
    pub bit_identical: bool,
    /// Median step times (ms) and their ratio.
    pub free_step_ms: f64,
    /// The limited plan's median step time, ms (0 when nothing fits).
    pub limited_step_ms: f64,
    /// limited / unconstrained median step time: the cost of recomputation (0 when nothing fits).
    pub step_time_ratio: f64,
}

/// Compiles `m`'s training step without and with the limit and, when it fits, trains both for
/// `steps` steps on the same batch.
pub fn run(m: &ZooModel, fraction: f64, steps: usize) -> Result<RematRun> {
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?;
    let t = Instant::now();
    let free = compile(graph.clone(), &CompileOptions::device("cpu:0", None))?;
    let free_compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let persistent = free.memory.persistent_bytes;
    let limit = persistent + (free.memory.arena_bytes as f64 * fraction) as usize;
    let t = Instant::now();
    let limited = compile(graph, &CompileOptions::device("cpu:0", Some(limit)));
    let limited_compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut out = RematRun {
        model: m.name.to_string(),
        batch: m.batch,
        fraction,
        limit_bytes: limit,
        persistent_bytes: persistent,
        free_arena_bytes: free.memory.arena_bytes,
        free_total_bytes: free.memory.planned_total_bytes(),
        limited_arena_bytes: None,
        limited_total_bytes: None,
        remat: None,
        error: None,
        free_compile_ms,
        limited_compile_ms,
        free_losses: Vec::new(),
        limited_losses: Vec::new(),
        bit_identical: false,
        free_step_ms: 0.0,
        limited_step_ms: 0.0,
        step_time_ratio: 0.0,
    };
    let limited = match limited {
        Ok(p) => p,
        Err(e) => {
            out.error = Some(e.to_string());
            return Ok(out);
        }
    };
    out.limited_arena_bytes = Some(limited.memory.arena_bytes);
    out.limited_total_bytes = Some(limited.memory.planned_total_bytes());
    out.remat = limited.memory.remat.clone();

    let (x, y) = m.batch_data(1)?;
    let mut a = Trainee::load(&free)?;
    let mut b = Trainee::load(&limited)?;
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for i in 0..steps {
        // Alternate which plan runs first, so that neither always follows the other.
        if i % 2 == 0 {
            ta.push(a.step(&x, &y)?);
            tb.push(b.step(&x, &y)?);
        } else {
            tb.push(b.step(&x, &y)?);
            ta.push(a.step(&x, &y)?);
        }
    }
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
    let vars_equal = a
        .variables()?
        .iter()
        .zip(b.variables()?.iter())
        .all(|(p, q)| p.shape() == q.shape() && bits(p.data()) == bits(q.data()))
        && free.variables.len() == limited.variables.len();
    out.bit_identical = bits(&a.losses) == bits(&b.losses) && vars_equal;
    out.free_step_ms = median(&mut ta);
    out.limited_step_ms = median(&mut tb);
    out.step_time_ratio = out.limited_step_ms / out.free_step_ms;
    out.free_losses = a.losses;
    out.limited_losses = b.losses;
    Ok(out)
}

/// One plan on its own CPU backend (seeded alike, so both start from the same variables).
struct Trainee {
    backend: CpuBackend,
    id: kiln_runtime::ProgramId,
    keys: Vec<String>,
    losses: Vec<f32>,
}

impl Trainee {
    fn load(plan: &Plan) -> Result<Self> {
        let mut backend = CpuBackend::new(7);
        let id = backend.load(plan.clone())?;
        let keys = plan.variables.iter().map(|v| v.key.clone()).collect();
        Ok(Trainee { backend, id, keys, losses: Vec::new() })
    }

    /// Runs one step; returns its wall time (ms).
    fn step(&mut self, x: &HostTensor, y: &HostTensor) -> Result<f64> {
        let t = Instant::now();
        let out = self.backend.call(self.id, &[("x", x), ("y", y)])?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        self.losses
            .push(out.iter().find(|(n, _)| n == "loss").and_then(|(_, t)| t.item()).unwrap_or(f32::NAN));
        Ok(ms)
    }

    fn variables(&self) -> Result<Vec<HostTensor>> {
        Ok(self.keys.iter().map(|k| self.backend.read_variable(k)).collect::<std::result::Result<_, _>>()?)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// The smallest fraction of its unconstrained arena (in steps of 0.05, scanning down from 0.95)
/// under which `m`'s training step still compiles, with that plan's arena, and the unconstrained
/// arena; `None` when not even 0.95 fits.
pub fn smallest_fraction(m: &ZooModel) -> Result<Option<(f64, usize, usize)>> {
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?;
    let free = compile(graph.clone(), &CompileOptions::device("cpu:0", None))?;
    let mut best = None;
    for i in (1..20).rev() {
        let fraction = i as f64 * 0.05;
        let limit = free.memory.persistent_bytes + (free.memory.arena_bytes as f64 * fraction) as usize;
        match compile(graph.clone(), &CompileOptions::device("cpu:0", Some(limit))) {
            Ok(p) => best = Some((fraction, p.memory.arena_bytes, free.memory.arena_bytes)),
            Err(_) => break,
        }
    }
    Ok(best)
}
