//! `cargo bench --bench transcendentals`: the CPU's elementwise transcendentals over 1M floats in
//! [-6, 6] (ln: (0, 12]), kiln's kernels (each op a plan of one step, `CpuBackend::profile`)
//! against the scalar kernels kiln had when the fast-kernels issue was filed (std's `exp`, `ln`,
//! `tanh` and libm's `erff` per element, the same formulas), both on the default rayon pool in
//! chunks of 16K elements, in interleaved rounds. Medians of 15 calls per round, the median over
//! the rounds; the ratio is the issue-time kernel's time over kiln's. The goal: every
//! transcendental at least 5x faster. Writes `target/kiln/transcendentals.json` and a table.
//!
//! kiln's kernels run on the widest vectors the CPU has (`KILN_SIMD=avx2` caps them at AVX2).

use kiln::compiler::ir::{BinaryOp, DType, DeviceId, Graph, Node, Op, Shape};
use kiln::prelude::*;
use kiln::report::{output_dir, render_table};
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use rayon::prelude::*;
use std::f32::consts::{FRAC_1_SQRT_2, PI};
use std::time::Instant;

const N: usize = 1 << 20;
const ROUNDS: usize = 5;
const CALLS: usize = 15;
const GOAL: f64 = 5.0;

/// The ops, and whether each is a goal of the issue.
const OPS: [(&str, bool); 8] = [
    ("relu", false),
    ("exp", true),
    ("ln", true),
    ("tanh", true),
    ("sigmoid", true),
    ("erf", true),
    ("gelu", true),
    ("gelu_grad", false),
];

/// The issue-time kernel of `name` over `x` (and `dy`) into `out`: one monomorphised loop per op
/// with the op inlined, as the issue-time `map1` was, on the rayon pool in 16K-element chunks.
fn scalar_kernel(name: &str, x: &[f32], dy: &[f32], out: &mut [f32]) {
    fn go(x: &[f32], dy: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Sync) {
        const CHUNK: usize = 16 * 1024;
        out.par_chunks_mut(CHUNK).zip(x.par_chunks(CHUNK)).zip(dy.par_chunks(CHUNK)).for_each(
            |((o, x), dy)| {
                for ((o, &x), &dy) in o.iter_mut().zip(x).zip(dy) {
                    *o = f(x, dy);
                }
            },
        );
    }
    match name {
        "relu" => go(x, dy, out, |x, _| if x < 0.0 { 0.0 } else { x }),
        "exp" => go(x, dy, out, |x, _| x.exp()),
        "ln" => go(x, dy, out, |x, _| x.ln()),
        "tanh" => go(x, dy, out, |x, _| x.tanh()),
        "sigmoid" => go(x, dy, out, |x, _| sigmoid(x)),
        "erf" => go(x, dy, out, |x, _| libm::erff(x)),
        "gelu" => go(x, dy, out, |x, _| x * normal_cdf(x)),
        _ => go(x, dy, out, |x, dy| dy * (normal_cdf(x) + x * (-0.5 * x * x).exp() / (2.0 * PI).sqrt())),
    }
}

fn sigmoid(x: f32) -> f32 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

fn normal_cdf(x: f32) -> f32 {
    0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2))
}

/// The one-op plan of `name`.
fn graph(name: &str) -> Result<Graph> {
    let shape = Shape::new([N]);
    if name == "gelu_grad" {
        let node = |op: Op| Node {
            op,
            shape: shape.clone(),
            dtype: DType::F32,
            device: DeviceId(0),
            name: None,
            origin: None,
        };
        let input = |n: &str| Op::Input { name: n.into(), shape: shape.clone(), dtype: DType::F32 };
        let mut g = Graph::new(name);
        let x = g.add(node(input("x")), &[]);
        let dy = g.add(node(input("dy")), &[]);
        let y = g.add(node(Op::Binary(BinaryOp::GeluGrad)), &[x, dy]);
        g.set_output("y", y);
        return Ok(g);
    }
    let t = Tracer::new(name);
    let x = t.input("x", [N]);
    let y = match name {
        "relu" => x.relu(),
        "exp" => x.exp(),
        "ln" => x.log(),
        "tanh" => x.tanh(),
        "sigmoid" => x.sigmoid(),
        "erf" => x.erf(),
        _ => x.gelu(),
    };
    t.output("y", &y);
    Ok(t.finish()?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The inputs of one distribution: x, ln's positive x, and dy.
struct Inputs {
    name: &'static str,
    x: Vec<f32>,
    positive: Vec<f32>,
    dy: Vec<f32>,
}

impl Inputs {
    /// Evenly spaced over [-6, 6] (ln: (0, 12]): every branch of the scalar kernels, in order.
    fn uniform() -> Inputs {
        Inputs {
            name: "uniform [-6, 6]",
            x: (0..N).map(|i| -6.0 + 12.0 * i as f32 / N as f32).collect(),
            positive: (0..N).map(|i| 12.0 * (i + 1) as f32 / N as f32).collect(),
            dy: (0..N).map(|i| (i as f32 * 0.37).sin()).collect(),
        }
    }

    /// Standard normal in random order, as activations are (ln: e^x): the scalar kernels' fast
    /// branches (erff below |0.84|), unpredictably taken.
    fn normal() -> Inputs {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut uniform = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let x: Vec<f32> = (0..N)
            .map(|_| ((-2.0 * uniform().ln()).sqrt() * (std::f64::consts::TAU * uniform()).cos()) as f32)
            .collect();
        Inputs {
            name: "normal",
            positive: x.iter().map(|v| v.exp()).collect(),
            dy: (0..N).map(|i| (i as f32 * 0.37).sin()).collect(),
            x,
        }
    }

    fn x(&self, op: &str) -> &[f32] {
        if op == "ln" { &self.positive } else { &self.x }
    }
}

/// kiln's and the scalar kernel's median over the rounds, ms, per op (in `OPS` order).
fn measure(
    backend: &mut CpuBackend,
    inputs: &Inputs,
) -> std::result::Result<Vec<(f64, f64)>, Box<dyn std::error::Error>> {
    let tensor = |v: &[f32]| HostTensor::new([N], v.to_vec());
    let dy = tensor(&inputs.dy)?;
    let mut plans = Vec::new();
    for (name, _) in OPS {
        let id = backend.load(compile(graph(name)?, &CompileOptions::default())?)?;
        let x = tensor(inputs.x(name))?;
        let feeds: Vec<(&str, &HostTensor)> =
            if name == "gelu_grad" { vec![("x", &x), ("dy", &dy)] } else { vec![("x", &x)] };
        backend.call(id, &feeds)?;
        plans.push(id);
    }
    let mut out = vec![0f32; N];
    let mut kiln = vec![Vec::new(); OPS.len()];
    let mut scalar = vec![Vec::new(); OPS.len()];
    for _ in 0..ROUNDS {
        for (j, ((name, _), &id)) in OPS.iter().zip(&plans).enumerate() {
            let rows = backend.profile(id, CALLS)?;
            kiln[j].push(rows.iter().map(|r| r.1).sum::<u64>() as f64 / 1e6);
            let times = (0..CALLS)
                .map(|_| {
                    let start = Instant::now();
                    scalar_kernel(name, inputs.x(name), &inputs.dy, &mut out);
                    std::hint::black_box(&out);
                    start.elapsed().as_secs_f64() * 1e3
                })
                .collect();
            scalar[j].push(median(times));
        }
    }
    Ok(kiln.into_iter().zip(scalar).map(|(k, s)| (median(k), median(s))).collect())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut backend = CpuBackend::new(0);
    let sets = [Inputs::uniform(), Inputs::normal()];
    let mut figures = Vec::new();
    for inputs in &sets {
        figures.push(measure(&mut backend, inputs)?);
    }
    let width = std::env::var("KILN_SIMD").unwrap_or_else(|_| "widest".into());
    let mut cells = Vec::new();
    let mut json = Vec::new();
    let mut missed = Vec::new();
    for (j, (name, goal)) in OPS.into_iter().enumerate() {
        let mut row = vec![name.to_string()];
        let mut met = true;
        for (inputs, figures) in sets.iter().zip(&figures) {
            let (k, s) = figures[j];
            let ratio = s / k;
            met &= ratio >= GOAL;
            row.extend([format!("{s:.3}"), format!("{k:.3}"), format!("{ratio:.1}x")]);
            json.push(serde_json::json!({
                "op": name, "inputs": inputs.name, "issue_time_scalar_ms": s, "kiln_ms": k, "speedup": ratio, "goal": goal,
            }));
        }
        if goal && !met {
            missed.push(name);
        }
        row.push(if !goal {
            "-".into()
        } else if met {
            "met".into()
        } else {
            "MISSED".into()
        });
        cells.push(row);
    }
    let header = [
        "op (1M floats)",
        "uniform: issue-time ms",
        "kiln ms",
        "speedup",
        "normal: issue-time ms",
        "kiln ms",
        "speedup",
        "goal >= 5x",
    ];
    println!("{}", render_table(&header, &cells));
    println!(
        "{} threads; medians of {CALLS} calls in each of {ROUNDS} interleaved rounds, then the median over the rounds; inputs uniform over [-6, 6] (ln: (0, 12]) in order, and standard normal in random order (ln: e^x); kiln's vectors: {width} (KILN_SIMD).",
        rayon::current_num_threads()
    );
    if missed.is_empty() {
        println!(
            "goal met: every transcendental at least {GOAL}x the issue-time scalar kernel on both inputs"
        );
    } else {
        println!("goal MISSED: {} below {GOAL}x", missed.join(", "));
    }
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    kiln::results::write("transcendentals", "cpu", &serde_json::json!({ "width": width, "rows": json }))?;
    Ok(())
}
