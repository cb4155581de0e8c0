//! Mutated plans at the backend's door: a `Plan` is plain data, so a backend must reject one that
//! breaks its invariants, or run it correctly, and never crash.
//!
//! Each case takes a compiled zoo training step and changes one thing. Layout mutations (offsets,
//! sizes, lifetimes, regions, alignment) keep the computation: when the backend accepts such a plan,
//! its outputs and variables must equal the original plan's. Structural mutations (indices, shapes,
//! dtypes, ops, step order) may change what is computed: the backend must reject them or run them
//! without crashing. Mutations that validation must always reject are counted separately and
//! asserted rejected.

use kiln::compiler::ir::{DType, Op, Shape, UnaryOp};
use kiln::compiler::plan::{Plan, Storage};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::zoo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const SEED: u64 = 3;

/// Loads `plan` on a fresh CPU backend and runs one training step; the outputs and variables.
fn run(plan: Plan, feed: &[(&str, &HostTensor)]) -> kiln::runtime::Result<Vec<(String, HostTensor)>> {
    let mut backend = CpuBackend::new(SEED);
    let keys: Vec<(String, Shape)> =
        plan.variables.iter().map(|v| (v.key.clone(), v.shape.clone())).collect();
    let id = backend.load(plan)?;
    let mut out = backend.call(id, feed)?;
    for (key, _) in keys {
        out.push((key.clone(), backend.read_variable(&key)?));
    }
    Ok(out)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    /// Keeps the computation: accepted means identical results.
    Layout,
    /// May change the computation: rejected, or run without crashing.
    Structural,
    /// Breaks an invariant every plan must keep: must be rejected.
    Invalid,
}

fn pick(r: &mut StdRng, n: usize) -> usize {
    r.random_range(0..n.max(1))
}

fn wild(r: &mut StdRng, v: usize) -> usize {
    match r.random_range(0..6) {
        0 => 0,
        1 => v.wrapping_add(r.random_range(1..1024)),
        2 => v.saturating_sub(r.random_range(1..1024)),
        3 => usize::MAX - r.random_range(0..4096),
        4 => v.wrapping_mul(2),
        _ => r.random_range(0..1 << 20),
    }
}

/// Applies one random mutation; says what kind it is.
fn mutate(plan: &mut Plan, r: &mut StdRng) -> (Kind, String) {
    let nb = plan.buffers.len();
    let nv = plan.values.len();
    let ns = plan.steps.len();
    match r.random_range(0..21) {
        0 => {
            let b = pick(r, nb);
            if let Storage::Arena { offset, .. } | Storage::Io { offset, .. } = &mut plan.buffers[b].storage {
                *offset = wild(r, *offset);
            }
            (Kind::Layout, format!("buffer {b} offset"))
        }
        1 => {
            let b = pick(r, nb);
            plan.buffers[b].bytes = wild(r, plan.buffers[b].bytes);
            (Kind::Layout, format!("buffer {b} bytes"))
        }
        2 => {
            let b = pick(r, nb);
            plan.buffers[b].first_step = wild(r, plan.buffers[b].first_step);
            (Kind::Layout, format!("buffer {b} first step"))
        }
        3 => {
            let b = pick(r, nb);
            plan.buffers[b].last_step = wild(r, plan.buffers[b].last_step);
            (Kind::Layout, format!("buffer {b} last step"))
        }
        4 => {
            let d = pick(r, plan.devices.len());
            let m = &mut plan.devices[d].memory;
            m.arena_bytes = wild(r, m.arena_bytes);
            (Kind::Layout, "arena bytes".into())
        }
        5 => {
            let d = pick(r, plan.devices.len());
            let m = &mut plan.devices[d].memory;
            m.io_bytes = wild(r, m.io_bytes);
            (Kind::Layout, "io bytes".into())
        }
        6 => {
            plan.alignment = [0, 1, 2, 3, 8, 100, 1 << 40, usize::MAX][pick(r, 8)];
            (Kind::Layout, format!("alignment {}", plan.alignment))
        }
        7 => {
            let b = pick(r, nb);
            plan.buffers[b].storage = match r.random_range(0..3) {
                0 => Storage::Arena { device: wild(r, 0), offset: 0 },
                1 => Storage::Io { device: pick(r, 2), offset: wild(r, 0) },
                _ => Storage::Variable { index: wild(r, 0) },
            };
            (Kind::Structural, format!("buffer {b} storage"))
        }
        8 => {
            let v = pick(r, nv);
            plan.values[v].buffer = if r.random_range(0..2) == 0 { pick(r, nb) } else { wild(r, nb) };
            (Kind::Structural, format!("value {v} buffer"))
        }
        9 => {
            let v = pick(r, nv);
            let mut dims = plan.values[v].shape.dims().to_vec();
            if dims.is_empty() {
                dims.push(2);
            } else {
                let i = pick(r, dims.len());
                dims[i] = wild(r, dims[i]);
            }
            plan.values[v].shape = Shape::new(dims);
            (Kind::Structural, format!("value {v} shape"))
        }
        10 => {
            let v = pick(r, nv);
            plan.values[v].dtype = DType::F16;
            (Kind::Invalid, format!("value {v} dtype"))
        }
        11 => {
            let s = pick(r, ns);
            if let Some(i) = (!plan.steps[s].inputs.is_empty()).then(|| pick(r, plan.steps[s].inputs.len())) {
                plan.steps[s].inputs[i] = if r.random_range(0..2) == 0 { pick(r, nv) } else { wild(r, nv) };
            }
            (Kind::Structural, format!("step {s} operand"))
        }
        12 => {
            let s = pick(r, ns);
            plan.steps[s].output = match plan.steps[s].output {
                Some(_) if r.random_range(0..2) == 0 => None,
                _ => Some(pick(r, nv)),
            };
            (Kind::Structural, format!("step {s} output"))
        }
        13 => {
            let s = pick(r, ns);
            plan.steps[s].in_place = !plan.steps[s].in_place;
            (Kind::Structural, format!("step {s} in-place flag"))
        }
        14 => {
            let s = pick(r, ns);
            plan.steps[s].op = match r.random_range(0..4) {
                0 => Op::Unary(UnaryOp::Relu),
                1 => Op::Copy,
                2 => Op::Reshape { shape: Shape::new([wild(r, 4)]) },
                _ => Op::Input { name: "x".into(), shape: Shape::new([2]), dtype: DType::F32 },
            };
            (Kind::Structural, format!("step {s} op"))
        }
        15 => {
            let (a, b) = (pick(r, ns), pick(r, ns));
            plan.steps.swap(a, b);
            (Kind::Structural, format!("steps {a} and {b} swapped"))
        }
        16 => {
            let s = pick(r, ns);
            plan.steps.remove(s);
            (Kind::Structural, format!("step {s} removed"))
        }
        17 => {
            let s = pick(r, ns);
            plan.steps[s].device = wild(r, 1);
            (Kind::Structural, format!("step {s} device"))
        }
        18 => {
            let list = if r.random_range(0..2) == 0 { &mut plan.inputs } else { &mut plan.outputs };
            let i = pick(r, list.len());
            list[i].value = wild(r, list[i].value);
            (Kind::Structural, "binding value".into())
        }
        19 => {
            // A value moved inside its buffer (or past it): what a gradient bucket's pieces and
            // slices are (`liveness`'s views).
            let v = pick(r, nv);
            plan.values[v].offset = [4, 8, 16, 64, wild(r, 16)][pick(r, 5)];
            (Kind::Structural, format!("value {v} offset"))
        }
        _ => {
            if plan.variables.is_empty() {
                return (Kind::Layout, "nothing".into());
            }
            let v = pick(r, plan.variables.len());
            let mut dims = plan.variables[v].shape.dims().to_vec();
            dims.push(wild(r, 3));
            plan.variables[v].shape = Shape::new(dims);
            (Kind::Structural, format!("variable {v} shape"))
        }
    }
}

#[test]
fn mutated_plans_are_rejected_or_run_correctly() {
    let (mut tried, mut rejected, mut accepted_layout, mut must_reject) = (0, 0, 0, 0);
    for m in zoo::all() {
        let m = m.clone().with_batch(2);
        let (x, y) = m.batch_data(1).unwrap();
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let plan = compile(graph, &CompileOptions::default()).unwrap();
        let feed = [("x", &x), ("y", &y)];
        let reference = run(plan.clone(), &feed).expect("the compiled plan runs");
        let mut r = StdRng::seed_from_u64(0x5eed ^ m.name.len() as u64);
        let cases = if m.name == "transformer" || m.name == "cnn" { 300 } else { 500 };
        for case in 0..cases {
            let mut mutated = plan.clone();
            let (kind, what) = mutate(&mut mutated, &mut r);
            let changed = mutated != plan;
            tried += 1;
            match run(mutated, &feed) {
                Err(_) => rejected += 1,
                Ok(out) => {
                    assert!(kind != Kind::Invalid || !changed, "{} case {case}: accepted {what}", m.name);
                    if kind == Kind::Layout {
                        accepted_layout += 1;
                        for ((n, a), (_, b)) in out.iter().zip(&reference) {
                            assert_eq!(a, b, "{} case {case} ({what}): {n} differs", m.name);
                        }
                    }
                }
            }
            if kind == Kind::Invalid && changed {
                must_reject += 1;
            }
        }
    }
    eprintln!(
        "mutated plans: {tried} tried, {rejected} rejected, {accepted_layout} layout mutations accepted with identical results, {must_reject} invalid ones all rejected"
    );
    assert!(rejected > tried / 3, "validation rejected only {rejected} of {tried}");
}

/// Rejection names the invariant: a buffer moved past its region, two live buffers overlapping.
#[test]
fn rejection_says_what_is_wrong() {
    let m = zoo::by_name("seed-mlp").expect("the seed model is in the zoo");
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let plan = compile(graph, &CompileOptions::default()).unwrap();

    let mut past = plan.clone();
    let b = past.buffers.iter().position(|b| matches!(b.storage, Storage::Arena { .. })).unwrap();
    if let Storage::Arena { offset, .. } = &mut past.buffers[b].storage {
        *offset = plan.devices[0].memory.arena_bytes;
    }
    let e = CpuBackend::new(0).load(past).unwrap_err().to_string();
    assert!(e.contains("is invalid") && e.contains("past the arena"), "{e}");

    let mut small = plan.clone();
    let v = small.steps.iter().find_map(|s| s.output).unwrap();
    let b = small.values[v].buffer;
    small.buffers[b].bytes /= 2;
    let e = CpuBackend::new(0).load(small).unwrap_err().to_string();
    assert!(e.contains("does not fit its buffer"), "{e}");
}
