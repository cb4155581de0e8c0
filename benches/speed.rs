//! `cargo bench --bench speed`: CPU time of every zoo model's training step and forward pass,
//! kiln fused (the default) and unfused against JAX/XLA (jit, donated parameters for training;
//! the peers environment of the memory bench) and PyTorch eager and `torch.compile`
//! (`scripts/peers/torch_speed.py`: PyPI's wheel in `target/kiln/torch-venv`, or the interpreter
//! `KILN_TORCH_PYTHON` names), side by side in one run: 5 interleaved rounds (every kiln program,
//! JAX, PyTorch, every model and mode) of 10 timed calls each after warm-up; the median of all of
//! a side's calls is its figure. The build machines' speed drifts by up to 40% over minutes, so
//! each ratio to the fastest peer is also taken round by round, from the sides' medians of that
//! round (measured within a minute of each other), and the median of those is reported beside
//! the ratio of the overall medians. Forward passes are also timed fused over the whole batch
//! (`CompileOptions::batch_blocks` off), so that what running them in blocks of rows
//! (`kiln_compiler::batch_blocks`) costs shows beside what it saves. A peer that cannot be had
//! is "skipped". Writes `target/kiln/speed.json` and a table per mode.

use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::report::{output_dir, render_table};
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo;
use std::collections::BTreeMap;
use std::time::Instant;

const ROUNDS: usize = 5;
const STEPS: usize = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
enum Mode {
    Train,
    Forward,
}

/// How kiln compiled a program.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    /// The default options.
    Fused,
    /// Fusion on, batch blocks off (forward passes only).
    Whole,
    Unfused,
}

impl Variant {
    fn options(self) -> CompileOptions {
        match self {
            Variant::Fused => CompileOptions::default().with_fusion(true).with_batch_blocks(true),
            Variant::Whole => CompileOptions::default().with_fusion(true).with_batch_blocks(false),
            Variant::Unfused => CompileOptions::default().with_fusion(false),
        }
    }
}

#[derive(serde::Serialize)]
struct Row {
    model: String,
    mode: Mode,
    batch: usize,
    kiln_ms: f64,
    kiln_unfused_ms: f64,
    /// Forward passes: fused over the whole batch (no batch blocks).
    kiln_whole_ms: Option<f64>,
    plan_steps: usize,
    plan_steps_unfused: usize,
    /// The blocks of rows the default plan runs a forward pass in (0: whole), and the arenas.
    batch_blocks: usize,
    arena_bytes: usize,
    arena_bytes_whole: Option<usize>,
    arena_bytes_unfused: usize,
    jax_ms: Option<f64>,
    kiln_over_jax: Option<f64>,
    torch_ms: Option<f64>,
    torch_compile_ms: Option<f64>,
    /// kiln / the fastest peer measured.
    kiln_over_fastest_peer: Option<f64>,
    /// The median over rounds of kiln / the fastest peer, each round's from its own medians.
    kiln_over_fastest_peer_by_round: Option<f64>,
    kiln_steps: Vec<f64>,
    kiln_unfused_steps: Vec<f64>,
    kiln_whole_steps: Vec<f64>,
    jax_steps: Vec<f64>,
    torch_steps: Vec<f64>,
    torch_compile_steps: Vec<f64>,
}

/// The median over rounds of kiln's median over the fastest peer's median in that round: each
/// side's calls come `STEPS` to a round, in round order. `None` without a peer with every round.
fn per_round_ratio(kiln: &[f64], peers: &[&Vec<f64>]) -> Option<f64> {
    let rounds = kiln.len() / STEPS;
    let ratios: Vec<f64> = (0..rounds)
        .filter_map(|r| {
            let of = |v: &[f64]| v.get(r * STEPS..(r + 1) * STEPS).map(median);
            let fastest =
                peers.iter().filter(|p| p.len() == kiln.len()).filter_map(|p| of(p)).reduce(f64::min)?;
            Some(of(kiln)? / fastest)
        })
        .collect();
    (!ratios.is_empty()).then(|| median(&ratios))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// One compiled program, loaded and warmed up, with its inputs.
struct Program {
    model: &'static str,
    mode: Mode,
    variant: Variant,
    backend: CpuBackend,
    id: kiln::runtime::ProgramId,
    feeds: Vec<(&'static str, HostTensor)>,
    steps: usize,
    arena: usize,
    blocks: usize,
}

impl Program {
    fn call(&mut self) -> Result<(), Box<dyn std::error::Error>> {
        let feeds: Vec<(&str, &HostTensor)> = self.feeds.iter().map(|(n, t)| (*n, t)).collect();
        self.backend.call(self.id, &feeds)?;
        Ok(())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models = zoo::all();
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();
    let mut programs = Vec::new();
    for m in &models {
        let (x, y) = m.batch_data(1)?;
        for mode in [Mode::Train, Mode::Forward] {
            let graph = match mode {
                Mode::Train => train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?,
                Mode::Forward => forward_graph(&m.model(), m.x_shape())?,
            };
            let variants: &[Variant] = match mode {
                Mode::Train => &[Variant::Fused, Variant::Unfused],
                Mode::Forward => &[Variant::Fused, Variant::Whole, Variant::Unfused],
            };
            for &variant in variants {
                let plan = compile(graph.clone(), &variant.options())?;
                let (steps, arena, blocks) =
                    (plan.steps.len(), plan.memory.arena_bytes, plan.memory.batch_blocks);
                let mut backend = CpuBackend::new(0);
                let id = backend.load(plan)?;
                let feeds = match mode {
                    Mode::Train => vec![("x", x.clone()), ("y", y.clone())],
                    Mode::Forward => vec![("x", x.clone())],
                };
                let mut p =
                    Program { model: m.name, mode, variant, backend, id, feeds, steps, arena, blocks };
                for _ in 0..2 {
                    p.call()?;
                }
                programs.push(p);
            }
        }
    }
    let mut kiln_steps: BTreeMap<(&str, Mode, Variant), Vec<f64>> = BTreeMap::new();
    let mut jax: BTreeMap<String, kiln::peers::JaxTimes> = BTreeMap::new();
    let mut jax_ok = true;
    let mut torch: BTreeMap<String, kiln::peers::TorchTimes> = BTreeMap::new();
    let mut torch_ok = true;
    for round in 0..ROUNDS {
        for p in programs.iter_mut() {
            for _ in 0..STEPS {
                let t = Instant::now();
                p.call()?;
                kiln_steps
                    .entry((p.model, p.mode, p.variant))
                    .or_default()
                    .push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
        if jax_ok {
            match kiln::peers::xla_step_times(&names, STEPS)? {
                Some(times) => times.into_iter().for_each(|(k, v)| {
                    let t = jax.entry(k).or_default();
                    t.train_ms.extend(v.train_ms);
                    t.forward_ms.extend(v.forward_ms);
                }),
                None => jax_ok = false,
            }
        }
        if torch_ok {
            match kiln::peers::torch_step_times(&names, STEPS, true)? {
                Some(times) => times.into_iter().for_each(|(k, v)| {
                    let t = torch.entry(k).or_default();
                    t.eager_ms.extend(v.eager_ms);
                    t.compile_ms.extend(v.compile_ms);
                    t.forward_eager_ms.extend(v.forward_eager_ms);
                    t.forward_compile_ms.extend(v.forward_compile_ms);
                }),
                None => torch_ok = false,
            }
        }
        eprintln!("round {} of {ROUNDS} done", round + 1);
    }
    let program = |model: &str, mode: Mode, variant: Variant| {
        programs.iter().find(|p| p.model == model && p.mode == mode && p.variant == variant)
    };
    let mut rows = Vec::new();
    for mode in [Mode::Train, Mode::Forward] {
        for m in &models {
            let side = |v: Variant| kiln_steps.get(&(m.name, mode, v)).cloned().unwrap_or_default();
            let (k, u, w) = (side(Variant::Fused), side(Variant::Unfused), side(Variant::Whole));
            let (fused, unfused) =
                (program(m.name, mode, Variant::Fused), program(m.name, mode, Variant::Unfused));
            let (Some(fused), Some(unfused)) = (fused, unfused) else { continue };
            let whole = program(m.name, mode, Variant::Whole);
            let j = jax.get(m.name).cloned().unwrap_or_default();
            let j = match mode {
                Mode::Train => j.train_ms,
                Mode::Forward => j.forward_ms,
            };
            let t = torch.get(m.name).cloned().unwrap_or_default();
            let (te, tc) = match mode {
                Mode::Train => (t.eager_ms, t.compile_ms),
                Mode::Forward => (t.forward_eager_ms, t.forward_compile_ms),
            };
            let some = |v: &Vec<f64>| (!v.is_empty()).then(|| median(v));
            let kiln_ms = median(&k);
            let (jax_ms, torch_ms, torch_compile_ms) = (some(&j), some(&te), some(&tc));
            let fastest = [jax_ms, torch_ms, torch_compile_ms].into_iter().flatten().reduce(f64::min);
            let by_round = per_round_ratio(&k, &[&j, &te, &tc]);
            rows.push(Row {
                model: m.name.into(),
                mode,
                batch: m.batch,
                kiln_ms,
                kiln_unfused_ms: median(&u),
                kiln_whole_ms: some(&w),
                plan_steps: fused.steps,
                plan_steps_unfused: unfused.steps,
                batch_blocks: fused.blocks,
                arena_bytes: fused.arena,
                arena_bytes_whole: whole.map(|p| p.arena),
                arena_bytes_unfused: unfused.arena,
                jax_ms,
                kiln_over_jax: jax_ms.map(|j| kiln_ms / j),
                torch_ms,
                torch_compile_ms,
                kiln_over_fastest_peer: fastest.map(|f| kiln_ms / f),
                kiln_over_fastest_peer_by_round: by_round,
                kiln_steps: k,
                kiln_unfused_steps: u,
                kiln_whole_steps: w,
                jax_steps: j,
                torch_steps: te,
                torch_compile_steps: tc,
            });
        }
    }
    let ms = |v: Option<f64>| v.map_or("skipped".into(), |t| format!("{t:.3}"));
    let ratio = |v: Option<f64>| v.map_or("-".into(), |x| format!("{x:.2}"));
    for mode in [Mode::Train, Mode::Forward] {
        let cells: Vec<Vec<String>> = rows
            .iter()
            .filter(|r| r.mode == mode)
            .map(|r| {
                let mut row = vec![
                    r.model.clone(),
                    r.batch.to_string(),
                    format!("{} / {}", r.plan_steps_unfused, r.plan_steps),
                    format!("{:.3}", r.kiln_unfused_ms),
                ];
                if mode == Mode::Forward {
                    row.push(ms(r.kiln_whole_ms));
                    row.push(if r.batch_blocks > 0 { r.batch_blocks.to_string() } else { "whole".into() });
                    row.push(format!(
                        "{} / {} / {}",
                        kiln::report::bytes(r.arena_bytes_unfused),
                        r.arena_bytes_whole.map_or("-".into(), kiln::report::bytes),
                        kiln::report::bytes(r.arena_bytes)
                    ));
                }
                row.extend([
                    format!("{:.3}", r.kiln_ms),
                    format!("{:.2}", r.kiln_ms / r.kiln_unfused_ms),
                    ms(r.jax_ms),
                    ratio(r.kiln_over_jax),
                    ms(r.torch_ms),
                    ms(r.torch_compile_ms),
                    ratio(r.kiln_over_fastest_peer),
                    ratio(r.kiln_over_fastest_peer_by_round),
                ]);
                row
            })
            .collect();
        let mut header = vec![
            if mode == Mode::Train { "model (train step)" } else { "model (forward pass)" },
            "batch",
            "plan steps unfused / fused",
            "kiln unfused ms",
        ];
        if mode == Mode::Forward {
            header.extend(["kiln fused whole-batch ms", "row blocks", "arena unfused / whole / blocks"]);
        }
        header.extend([
            "kiln ms",
            "fused/unfused",
            "JAX jit ms",
            "kiln/JAX",
            "PyTorch eager ms",
            "torch.compile ms",
            "kiln/fastest peer",
            "by round",
        ]);
        println!("{}", render_table(&header, &cells));
    }
    println!(
        "CPU, 2 cores; medians of {} calls per side in {ROUNDS} interleaved rounds (\"by round\": the median over the rounds of kiln / the fastest peer, each round's from that round's medians); kiln: CpuBackend, default compile options (fused, forward passes in blocks of batch rows where that plans smaller; unfused with fusion off; whole-batch with fusion on and batch blocks off); JAX: jit (training: donated parameters and Adam state), XLA CPU defaults; PyTorch: the idiomatic twins of scripts/peers/torch_stream.py, Adam(foreach=True), eager and torch.compile (model and opt.step, inductor C++), forward passes under no_grad, default threads.",
        ROUNDS * STEPS
    );
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    kiln::results::write("speed", "cpu", &rows)?;
    Ok(())
}
