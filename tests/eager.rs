//! The eager executor computes what the planned run computes, on every zoo model, forward and
//! training step, with its memory from TensorFlow's BFC or PyTorch's caching allocator.

use kiln::compiler::ir::{Graph, VarRole};
use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::alloc::{Allocator, BfcAllocator, CachingAllocator, HostSource};
use kiln::runtime::eager::{CpuEager, EagerExecutor};
use kiln::zoo;

const SEED: u64 = 11;

fn max_diff(a: &HostTensor, b: &HostTensor) -> f32 {
    a.max_abs_diff(b)
}

/// Runs `graph` twice planned and twice eagerly; outputs of both calls and every variable after
/// them must agree within 1e-6.
fn check<A: Allocator>(name: &str, graph: Graph, feed: &[(&str, &HostTensor)], allocator: A) {
    let plan = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let mut planned = CpuBackend::new(SEED);
    let id = planned.load(plan.clone()).unwrap();
    let scheduled = kiln::compiler::optimize(graph).unwrap();
    let mut eager = EagerExecutor::new(allocator, SEED, CpuEager);
    for call in 0..2 {
        let p = planned.call(id, feed).unwrap();
        let e = eager.run(&scheduled.graph, &scheduled.order, feed).unwrap();
        assert_eq!(p.len(), e.outputs.len());
        for ((pn, pt), (en, et)) in p.iter().zip(&e.outputs) {
            assert_eq!(pn, en);
            let d = max_diff(pt, et);
            assert!(d <= 1e-6, "{name} call {call}: output {pn} differs by {d}");
        }
    }
    for v in &plan.variables {
        let p = planned.read_variable(&v.key).unwrap();
        let e = eager.read_variable(&v.key, &v.shape).unwrap().unwrap();
        let d = max_diff(&p, &e);
        assert!(d <= 1e-6, "{name}: variable {} differs by {d}", v.key);
    }
    let updated = plan.variables.iter().filter(|v| v.role == VarRole::Parameter).count();
    assert!(updated > 0);
}

#[test]
fn eager_equals_planned_on_every_zoo_model() {
    for m in zoo::all() {
        // Small batches keep the test quick; the benchmark runs the zoo's real sizes.
        let m = m.clone().with_batch(if m.name == "transformer" { 1 } else { 2 });
        let (x, y) = m.batch_data(5).unwrap();
        let model = m.model();
        let fwd = forward_graph(&model, m.x_shape()).unwrap();
        check(
            &format!("{} forward", m.name),
            fwd,
            &[("x", &x)],
            BfcAllocator::new(HostSource::new(), 1 << 32),
        );
        let train = train_step_graph(&model, m.x_shape(), m.y_shape(), &m.config()).unwrap();
        check(
            &format!("{} train (bfc)", m.name),
            train.clone(),
            &[("x", &x), ("y", &y)],
            BfcAllocator::new(HostSource::new(), 1 << 32),
        );
        check(
            &format!("{} train (caching)", m.name),
            train,
            &[("x", &x), ("y", &y)],
            CachingAllocator::new(HostSource::new(), None),
        );
    }
}

#[test]
fn eager_frees_everything_but_variables() {
    let m = zoo::by_name("seed-mlp").unwrap();
    let (x, y) = m.batch_data(1).unwrap();
    let train = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let s = kiln::compiler::optimize(train).unwrap();
    let mut eager = EagerExecutor::new(BfcAllocator::new(HostSource::new(), 1 << 30), 0, CpuEager);
    let run = eager.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap();
    // The eager executor runs the graph as it is: the plan to compare with is the untiled,
    // unfused one.
    let options = CompileOptions { tile_updates: false, save_minimal: false, ..CompileOptions::default() }
        .with_fusion(false);
    let plan = compile(s.graph.clone(), &options).unwrap();
    let variable_bytes: usize = plan.variables.iter().map(|v| v.bytes().div_ceil(256) * 256).sum();
    assert_eq!(run.stats.in_use, variable_bytes, "after a call only variables remain allocated");
    assert!(run.stats.peak_in_use > variable_bytes);
    assert_eq!(run.samples.len(), plan.steps.len(), "one memory sample per plan step");
}

/// Variables come when frameworks make them: every parameter at build, before any input, and
/// all optimizer state together at the first update, not while the forward pass runs.
#[test]
fn parameters_at_build_and_optimizer_state_at_the_first_update() {
    use kiln::runtime::alloc::VirtualSource;
    use kiln::runtime::eager::Simulated;
    let m = zoo::by_name("mlp").unwrap();
    let (x, y) = m.batch_data(1).unwrap();
    let train = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let s = kiln::compiler::optimize(train).unwrap();
    let bytes = |roles: &[VarRole]| -> usize {
        s.graph
            .variables()
            .into_iter()
            .filter(|&v| matches!(&s.graph.node(v).op, kiln::compiler::ir::Op::Variable { role, .. } if roles.contains(role)))
            .map(|v| s.graph.node(v).bytes().div_ceil(512) * 512)
            .sum()
    };
    let params = bytes(&[VarRole::Parameter]);
    let state = bytes(&[VarRole::OptimizerState, VarRole::Counter]);
    let mut eager = EagerExecutor::new(CachingAllocator::new(VirtualSource::new(), None), 0, Simulated);
    eager.build(&s.graph).unwrap();
    assert_eq!(eager.allocator().stats().in_use, params, "build makes the parameters alone");
    let run = eager.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap();
    // Before the first update only parameters and the step's own tensors exist.
    let first_update = s
        .order
        .iter()
        .filter(|&&n| {
            !matches!(
                s.graph.node(n).op.class(),
                kiln::compiler::ir::OpClass::Source | kiln::compiler::ir::OpClass::View
            )
        })
        .position(|&n| s.graph.node(n).op.is_effect())
        .unwrap();
    // (The mlp's activations and gradients never reach its 14.9 MB of optimizer state.)
    let before = run.samples[..first_update].iter().map(|s| s.in_use).max().unwrap();
    assert!(before < params + state, "optimizer state made before the first update: {before}");
    assert!(run.samples[first_update].in_use >= params + state, "all state at the first update");
    assert_eq!(run.stats.in_use, params + state, "after the call only variables remain");
}

/// PyTorch's extras: a 32 MiB cuBLAS workspace kept per thread's handle (forward, backward) or
/// taken per product, cuBLASLt's 1 MiB kept, foreach Adam's parameter-sized temporaries;
/// TensorFlow's convolution scratch.
#[test]
fn framework_extras_take_what_the_framework_takes() {
    use kiln::runtime::alloc::VirtualSource;
    use kiln::runtime::eager::framework::{CUBLAS_WORKSPACE_SM90, CUBLASLT_WORKSPACE};
    use kiln::runtime::eager::{FrameworkExtras, Simulated, WorkspacePolicy};
    let run = |name: &str, extras: FrameworkExtras, bfc: bool| {
        let m = zoo::by_name(name).unwrap();
        let (x, y) = m.batch_data(1).unwrap();
        let train = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let s = kiln::compiler::optimize(train).unwrap();
        let feed = [("x", &x), ("y", &y)];
        if bfc {
            let a = BfcAllocator::new(VirtualSource::new(), 1 << 36);
            let mut e = EagerExecutor::new(a, 0, Simulated).with_extras(extras);
            e.run(&s.graph, &s.order, &feed).unwrap().stats
        } else {
            let a = CachingAllocator::new(VirtualSource::new(), None);
            let mut e = EagerExecutor::new(a, 0, Simulated).with_extras(extras);
            e.run(&s.graph, &s.order, &feed).unwrap().stats
        }
    };
    let plain = run("seed-mlp", FrameworkExtras::default(), false);
    let per_call = run("seed-mlp", FrameworkExtras::pytorch(WorkspacePolicy::PerCall), false);
    let kept = run("seed-mlp", FrameworkExtras::pytorch(WorkspacePolicy::Persistent), false);
    let ws = CUBLAS_WORKSPACE_SM90 + CUBLASLT_WORKSPACE;
    assert!(per_call.peak_in_use >= ws && per_call.peak_in_use > plain.peak_in_use, "{per_call:?}");
    assert_eq!(per_call.in_use, plain.in_use + CUBLASLT_WORKSPACE, "per call: only cuBLASLt's is kept");
    assert_eq!(
        kept.in_use,
        plain.in_use + ws + CUBLAS_WORKSPACE_SM90,
        "kept: forward's, backward's, cuBLASLt's"
    );
    assert!(per_call.peak_reserved >= ws);
    // foreach Adam: the mlp's 7.45 MB of parameters once more at the optimizer step.
    let foreach = FrameworkExtras { foreach_optimizer_temporaries: true, ..Default::default() };
    let (with, without) = (run("mlp", foreach, false), run("mlp", FrameworkExtras::default(), false));
    assert!(with.peak_in_use > without.peak_in_use, "{} vs {}", with.peak_in_use, without.peak_in_use);
    assert_eq!(with.in_use, without.in_use, "the temporaries die after the last update");
    // TensorFlow: im2col scratch around the cnn's convolutions.
    let tf = run("cnn", FrameworkExtras::tensorflow(), true);
    let bfc = run("cnn", FrameworkExtras::default(), true);
    assert!(tf.peak_in_use > bfc.peak_in_use && tf.in_use == bfc.in_use);
}
