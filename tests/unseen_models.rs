//! The compiler's rewrites on models the zoo does not have (`common/unseen.rs`): fused plans
//! train the unfused plans' bits and plan no larger, the default search keeps its smallest plan,
//! and forward passes (split into blocks of rows where that plans smaller) compute the unsplit
//! unfused bits.

#[path = "common/unseen.rs"]
mod unseen;

use kiln::compiler::Plan;
use kiln::compiler::ir::Op;
use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};

/// Every output of `steps` calls and every variable after them, as bits.
fn run(plan: &Plan, feeds: &[(&str, &HostTensor)], steps: usize) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let bits = |t: &HostTensor| t.data().iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let mut outs = Vec::new();
    for _ in 0..steps {
        let mut out = backend.call(id, feeds).unwrap();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        outs.extend(out.iter().map(|(_, t)| bits(t)));
    }
    (outs, plan.variables.iter().map(|v| bits(&backend.read_variable(&v.key).unwrap())).collect())
}

#[test]
fn unseen_models_train_fused_bit_for_bit_as_unfused_and_plan_no_larger() {
    for m in unseen::all() {
        let name = m.name;
        let graph = train_step_graph(&m.model, m.x.clone(), m.y.clone(), &m.config).unwrap();
        // Tiling and cheap recomputation off in the pair compared bit for bit (tiling is a
        // schedule choice that may differ between the two graphs); the default plan as well.
        let options = CompileOptions { tile_updates: false, cheap_remat: false, ..CompileOptions::default() };
        let fused = compile(graph.clone(), &options.clone().with_fusion(true)).unwrap();
        let plain = compile(graph.clone(), &options.with_fusion(false)).unwrap();
        let default = compile(graph, &CompileOptions::default()).unwrap();
        assert!(fused.steps.len() < plain.steps.len(), "{name}: {} fused steps", fused.steps.len());
        assert!(
            fused.memory.arena_bytes <= plain.memory.arena_bytes,
            "{name}: fused arena {} > unfused {}",
            fused.memory.arena_bytes,
            plain.memory.arena_bytes
        );
        let (x, y) = m.batch(7);
        let feeds = [("x", &x), ("y", &y)];
        let (b, vb) = run(&plain, &feeds, 3);
        for (what, plan) in [("fused", &fused), ("default", &default)] {
            let (a, va) = run(plan, &feeds, 3);
            assert_eq!(a, b, "{name}: {what} outputs differ from unfused");
            assert_eq!(va, vb, "{name}: {what} variables differ from unfused");
        }
    }
}

/// The residual conv net's block input gradient: relu_grad(y, r + dx) is one op written over
/// y or r, never a buffer of its own (`conv_relu_grad`), which takes the training step's peak
/// below the unfused plan's.
#[test]
fn a_residual_blocks_input_gradient_is_one_op_and_the_arena_shrinks() {
    let m = unseen::all().into_iter().find(|m| m.name == "residual-cnn").unwrap();
    let graph = train_step_graph(&m.model, m.x.clone(), m.y.clone(), &m.config).unwrap();
    let fused = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let plain = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
    let residual = fused
        .steps
        .iter()
        .filter(|s| matches!(s.op, Op::Conv2dBackpropInputReluGrad { .. }) && s.inputs.len() == 4)
        .count();
    assert_eq!(residual, 1, "{}", fused.render());
    assert!(
        fused.memory.arena_bytes < plain.memory.arena_bytes,
        "fused {} against unfused {}",
        fused.memory.arena_bytes,
        plain.memory.arena_bytes
    );
}

/// Tiled updates are one more graph the search plans, never instead of one: with them on, no
/// training step plans larger than with them off (a narrow MLP once did, 8,128 B against 6,848,
/// when tiling replaced the graph with some product updates).
#[test]
fn the_search_keeps_its_smallest_plan() {
    for m in unseen::all() {
        let graph = train_step_graph(&m.model, m.x.clone(), m.y.clone(), &m.config).unwrap();
        let total = |tile_updates: bool| {
            let options = CompileOptions { tile_updates, ..CompileOptions::default() };
            compile(graph.clone(), &options).unwrap().memory.planned_total_bytes()
        };
        let (on, off) = (total(true), total(false));
        assert!(on <= off, "{}: {on} B with tiled updates, {off} B without", m.name);
    }
}

#[test]
fn unseen_forward_passes_compute_the_unfused_bits() {
    for m in unseen::all() {
        let graph = forward_graph(&m.model, m.x.clone()).unwrap();
        let default = compile(graph.clone(), &CompileOptions::default()).unwrap();
        let plain = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
        assert!(default.memory.arena_bytes <= plain.memory.arena_bytes, "{}", m.name);
        let (x, _) = m.batch(3);
        assert_eq!(run(&default, &[("x", &x)], 1), run(&plain, &[("x", &x)], 1), "{}", m.name);
    }
}
