//! Guard mode: canaries after every slot, checked after every step (`kiln::runtime::guard`).
//! A planted kernel that writes one f32 past its output is named by step, op and buffer; honest
//! kernels compute exactly what they compute without guard mode; guard off changes no plan.

mod common;

use kiln::compiler::ir::Graph;
use kiln::compiler::step::train_step_graph;
use kiln::kernels::cpu::{self as cpu_kernels, CpuKernel};
use kiln::prelude::*;
use kiln::runtime::RuntimeError;
use kiln::zoo;

const SEED: u64 = 7;

fn affine() -> Graph {
    let t = Tracer::new("affine");
    let x = t.input("x", [4, 3]);
    let w = t.param("w", [3, 2], Init::GlorotUniform);
    t.output("y", &(x.matmul(&w) + 1.0).relu());
    t.finish().unwrap()
}

fn x() -> HostTensor {
    HostTensor::new(Shape::new([4, 3]), (0..12).map(|i| i as f32 * 0.25 - 1.0).collect()).unwrap()
}

/// The honest kernel of a step, then one more f32 written just past its output buffer.
struct OneTooMany {
    honest: Box<dyn CpuKernel>,
    buffer_bytes: usize,
}

impl CpuKernel for OneTooMany {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: the caller's contract for the honest kernel; the extra f32 lands in guard
        // mode's canary after the output buffer (the test plans are compiled with guard on).
        unsafe {
            self.honest.run(inputs, output);
            (output.add(self.buffer_bytes) as *mut f32).write_unaligned(42.0);
        }
    }

    fn describe(&self) -> String {
        format!("{} + one f32 too many", self.honest.describe())
    }
}

/// Plants `OneTooMany` at `step` of a loaded program.
fn plant(backend: &mut CpuBackend, id: usize, plan: &Plan, step: usize) {
    let s = &plan.steps[step];
    let ins: Vec<_> = s.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
    let o = s.output.expect("a step that writes a value");
    let honest = cpu_kernels::prepare(&s.op, &ins, (&plan.values[o].shape, plan.values[o].dtype)).unwrap();
    let buffer_bytes = plan.buffers[plan.values[o].buffer].bytes;
    backend.replace_kernel(id, step, Box::new(OneTooMany { honest, buffer_bytes })).unwrap();
}

/// The first step writing an intermediate value, and the first writing a graph output (both in
/// the arena: `compile` plans inputs and outputs there too).
fn steps_writing(plan: &Plan) -> (usize, usize) {
    let is_output = |v: usize| plan.outputs.iter().any(|b| b.value == v);
    let find = |output: bool| {
        plan.steps.iter().position(|s| s.output.is_some_and(|o| is_output(o) == output)).expect("such a step")
    };
    (find(false), find(true))
}

#[test]
fn a_kernel_writing_past_its_output_is_named() {
    // Unfused, so that the affine map has a step writing an intermediate (fused, it is one step).
    let plan = compile(affine(), &CompileOptions::default().with_guard(true).with_fusion(false)).unwrap();
    assert_eq!(plan.guard_bytes, kiln::compiler::guard::GUARD_BYTES);
    let (intermediate, output) = steps_writing(&plan);
    for (step, region) in [(intermediate, "arena of device 0"), (output, "arena of device 0")] {
        let mut backend = CpuBackend::new(SEED);
        let id = backend.load(plan.clone()).unwrap();
        // The honest program runs, twice (canaries refilled each run).
        backend.call(id, &[("x", &x())]).unwrap();
        backend.call(id, &[("x", &x())]).unwrap();
        plant(&mut backend, id, &plan, step);
        let err = backend.call(id, &[("x", &x())]).unwrap_err();
        let message = err.to_string();
        eprintln!("{message}");
        let s = &plan.steps[step];
        let out = plan.values[s.output.unwrap()].buffer;
        match err {
            RuntimeError::GuardOverrun(o) => {
                assert_eq!(o.step, step, "{message}");
                assert_eq!(o.kernel, s.label);
                assert_eq!(o.buffer, out);
                assert_eq!(o.slot, plan.buffers[out].label);
                assert_eq!(o.region, region);
                assert_eq!(o.offset, o.canary_start, "the first byte past the buffer");
                assert_eq!(o.canary_start, o.slot_offset + plan.buffers[out].bytes);
            }
            other => panic!("expected a guard overrun, got {other}"),
        }
        assert!(message.contains(&format!("step {step} ({}", s.label)), "{message}");
        assert!(message.contains(&plan.buffers[out].label), "{message}");
        assert!(message.contains("out of bounds"), "{message}");
    }
}

#[test]
fn guard_mode_changes_no_result() {
    let m = zoo::by_name("seed-mlp").unwrap().with_batch(8);
    let (x, y) = m.batch_data(3).unwrap();
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let run = |guard: bool| {
        let plan = compile(graph.clone(), &CompileOptions::default().with_guard(guard)).unwrap();
        assert_eq!(plan.guard_bytes > 0, guard);
        let mut backend = CpuBackend::new(SEED);
        let id = backend.load(plan.clone()).unwrap();
        let mut outputs = Vec::new();
        for _ in 0..3 {
            outputs.push(backend.call(id, &[("x", &x), ("y", &y)]).unwrap());
        }
        let variables: Vec<HostTensor> =
            plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap()).collect();
        (plan, outputs, variables)
    };
    let (plain, out_plain, vars_plain) = run(false);
    let (guarded, out_guarded, vars_guarded) = run(true);
    // Bit for bit: the same kernels on the same values, only the offsets differ.
    assert_eq!(out_plain.len(), out_guarded.len());
    for (a, b) in out_plain.iter().zip(&out_guarded) {
        for ((na, ta), (nb, tb)) in a.iter().zip(b) {
            assert_eq!(na, nb);
            assert_eq!(ta.data(), tb.data(), "output {na}");
        }
    }
    for (a, b) in vars_plain.iter().zip(&vars_guarded) {
        assert_eq!(a.data(), b.data());
    }
    // The same steps and buffers; the canaries are in the arena figure only.
    assert_eq!(plain.steps, guarded.steps);
    assert_eq!(plain.buffers.len(), guarded.buffers.len());
    for (a, b) in plain.buffers.iter().zip(&guarded.buffers) {
        assert_eq!(
            (a.bytes, a.first_step, a.last_step, &a.label),
            (b.bytes, b.first_step, b.last_step, &b.label)
        );
    }
    let (p, g) = (&plain.memory, &guarded.memory);
    assert_eq!((p.lower_bound_bytes, p.naive_bytes), (g.lower_bound_bytes, g.naive_bytes));
    assert!(g.arena_bytes > p.arena_bytes && g.io_bytes == p.io_bytes);
    assert!(guarded.render().contains("guard mode: 256 B canary after every slot"));
}

#[test]
fn guard_off_is_the_plan_of_before() {
    let off = CompileOptions::default().with_guard(false);
    assert_eq!(off.guard_bytes, 0);
    if std::env::var("KILN_GUARD").is_err() {
        assert_eq!(CompileOptions::default().guard_bytes, 0, "guard mode is off unless KILN_GUARD=1");
    }
    let plan = compile(affine(), &off).unwrap();
    assert_eq!(plan.guard_bytes, 0);
    assert!(!plan.render().contains("guard"));
    assert!(plan.memory.arena_bytes <= plan.memory.naive_bytes);
    // A plan serialised before guard mode existed (no `guard_bytes` field) loads as guard off.
    let mut json: serde_json::Value = serde_json::to_value(&plan).unwrap();
    json.as_object_mut().unwrap().remove("guard_bytes");
    let old: Plan = serde_json::from_value(json).unwrap();
    assert_eq!(old, plan);
    // A backend runs it without canaries.
    let mut backend = CpuBackend::new(SEED);
    let id = backend.load(plan).unwrap();
    backend.call(id, &[("x", &x())]).unwrap();
}

#[test]
fn a_guarded_plan_whose_canaries_do_not_fit_is_refused_at_load() {
    let mut plan = compile(affine(), &CompileOptions::default().with_guard(true)).unwrap();
    plan.guard_bytes *= 64; // the slots were placed for 256-byte canaries
    let err = CpuBackend::new(SEED).load(plan).unwrap_err();
    assert!(matches!(err, RuntimeError::InvalidPlan { .. }), "{err}");
    let too_big = CompileOptions { guard_bytes: 4 << 20, ..CompileOptions::default() };
    let err = compile(affine(), &too_big).unwrap_err().to_string();
    assert!(err.contains("guard_bytes"), "{err}");
}

/// Every zoo training step under guard mode on a fresh backend from `backend` (variables are
/// keyed by name, so each model gets its own): kiln's own kernels write nothing past any slot.
fn zoo_runs_clean_under_guard(backend: impl Fn() -> Option<Box<dyn Backend>>) {
    for m in zoo::all() {
        let Some(mut backend) = backend() else { return };
        let m = m.clone().with_batch(if m.name == "transformer" { 1 } else { 2 });
        let (x, y) = m.batch_data(4).unwrap();
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let plan = compile(graph, &CompileOptions::default().with_guard(true)).unwrap();
        let id = backend.load(plan).unwrap();
        for call in 0..2 {
            let out = backend.call(id, &[("x", &x), ("y", &y)]).unwrap_or_else(|e| panic!("{}: {e}", m.name));
            for (name, t) in out {
                assert!(t.data().iter().all(|v| v.is_finite()), "{} call {call}: {name} not finite", m.name);
            }
        }
    }
}

#[test]
fn zoo_training_steps_run_clean_under_guard_on_cpu() {
    zoo_runs_clean_under_guard(|| Some(Box::new(CpuBackend::new(SEED))));
}

/// The same with the NVRTC-compiled CUDA kernels; "skipped: no CUDA device" where there is none.
#[test]
fn gpu_zoo_training_steps_run_clean_under_guard() {
    zoo_runs_clean_under_guard(|| common::cuda_backend(SEED).map(|b| Box::new(b) as Box<dyn Backend>));
}

/// The cost of guard mode on the CPU: a zoo training step with and without it (the figure in
/// `kiln_runtime::guard`'s documentation), the two runs alternating so that the machine's other
/// load falls on both. Run with
/// `cargo test --release --test guard -- --ignored --nocapture guard_overhead`.
#[test]
#[ignore]
fn guard_overhead() {
    for name in ["seed-mlp", "mlp", "cnn", "transformer"] {
        let m = zoo::by_name(name).unwrap();
        let (x, y) = m.batch_data(1).unwrap();
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let load = |guard: bool| {
            let plan = compile(graph.clone(), &CompileOptions::default().with_guard(guard)).unwrap();
            let mut backend = CpuBackend::new(SEED);
            let id = backend.load(plan.clone()).unwrap();
            backend.set_input(id, "x", x.shape(), x.data()).unwrap();
            backend.set_input(id, "y", y.shape(), y.data()).unwrap();
            backend.run(id).unwrap();
            (backend, id, plan)
        };
        let (mut off, off_id, off_plan) = load(false);
        let (mut on, on_id, on_plan) = load(true);
        let canaries = kiln::runtime::guard::Guard::new(&on_plan).unwrap().canaries().len();
        let runs = if name == "seed-mlp" { 2000 } else { 30 };
        let (mut t_off, mut t_on) = (Vec::new(), Vec::new());
        let time = |b: &mut CpuBackend, id: usize| {
            let start = std::time::Instant::now();
            b.run(id).unwrap();
            start.elapsed().as_secs_f64() * 1e3
        };
        for _ in 0..runs {
            t_off.push(time(&mut off, off_id));
            t_on.push(time(&mut on, on_id));
        }
        let median = |t: &mut Vec<f64>| {
            t.sort_by(f64::total_cmp);
            (t[t.len() / 2], t[0])
        };
        let ((m_off, min_off), (m_on, min_on)) = (median(&mut t_off), median(&mut t_on));
        println!(
            "{name} train, batch {}: {} steps, {canaries} canaries: median {m_off:.3} ms without guard, {m_on:.3} ms with ({:+.1}%); min {min_off:.3} / {min_on:.3} ms ({:+.1}%); arena {} -> {} B",
            m.batch,
            on_plan.steps.len(),
            (m_on / m_off - 1.0) * 100.0,
            (min_on / min_off - 1.0) * 100.0,
            off_plan.memory.arena_bytes,
            on_plan.memory.arena_bytes,
        );
    }
}

/// A kernel that panics.
struct Panics;

impl CpuKernel for Panics {
    unsafe fn run(&self, _: &[*mut u8], _: *mut u8) {
        panic!("a planted kernel panics");
    }

    fn describe(&self) -> String {
        "panics".into()
    }
}

/// A run large enough to go on the rayon pool, with the pool's other worker kept awake for it,
/// passes a kernel's panic on to its caller instead of waiting for that worker forever.
#[test]
fn a_kernel_panicking_in_a_pooled_run_reaches_the_caller() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Two workers whatever the machine: the run goes to the pool, the other one spins.
        let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        tx.send(pool.install(planted_panic)).ok();
    });
    let panicked = rx.recv_timeout(std::time::Duration::from_secs(120)).expect("the run returned");
    assert!(panicked, "the planted panic reached the caller");
}

/// Whether a pooled run (a 256 x 256 x 256 product: over `POOLED_FLOPS`) whose kernel panics
/// passes the panic on to its caller.
fn planted_panic() -> bool {
    let t = Tracer::new("pooled");
    let a = t.input("a", [256, 256]);
    let w = t.param("w", [256, 256], Init::GlorotUniform);
    t.output("y", &a.matmul(&w).relu());
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    let mut backend = CpuBackend::new(SEED);
    let id = backend.load(plan).unwrap();
    backend.replace_kernel(id, 0, Box::new(Panics)).unwrap();
    let a = HostTensor::new(Shape::new([256, 256]), vec![0.5; 256 * 256]).unwrap();
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| backend.call(id, &[("a", &a)]))).is_err()
}
