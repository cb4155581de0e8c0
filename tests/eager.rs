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
        let fwd = forward_graph(&model, &m.x_shape()).unwrap();
        check(
            &format!("{} forward", m.name),
            fwd,
            &[("x", &x)],
            BfcAllocator::new(HostSource::new(), 1 << 32),
        );
        let train = train_step_graph(&model, &m.x_shape(), &m.y_shape(), &m.config()).unwrap();
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
    let train = train_step_graph(&m.model(), &m.x_shape(), &m.y_shape(), &m.config()).unwrap();
    let s = kiln::compiler::optimize(train).unwrap();
    let mut eager = EagerExecutor::new(BfcAllocator::new(HostSource::new(), 1 << 30), 0, CpuEager);
    let run = eager.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap();
    // The eager executor runs the graph as it is: the plan to compare with is the untiled one.
    let options = CompileOptions { tile_updates: false, ..CompileOptions::default() };
    let plan = compile(s.graph.clone(), &options).unwrap();
    let variable_bytes: usize = plan.variables.iter().map(|v| v.bytes().div_ceil(256) * 256).sum();
    assert_eq!(run.stats.in_use, variable_bytes, "after a call only variables remain allocated");
    assert!(run.stats.peak_in_use > variable_bytes);
    assert_eq!(run.samples.len(), plan.steps.len(), "one memory sample per plan step");
}
