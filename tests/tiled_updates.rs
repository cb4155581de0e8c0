//! Tiled updates (`kiln_compiler::tiled_updates`): the plan the search keeps, and training with
//! it computes what the untiled plan computes, up to the GEMM's summation order.

mod common;

use kiln::compiler::Plan;
use kiln::compiler::ir::Shape;
use kiln::compiler::losses::Loss;
use kiln::compiler::optim::{Adam, Optimizer, Sgd};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Fusion off: with it, updates may compute their own gradients (`product_updates`), which
/// leaves nothing to tile.
fn tiled() -> CompileOptions {
    CompileOptions::default().with_fusion(false)
}

fn untiled() -> CompileOptions {
    CompileOptions { tile_updates: false, ..tiled() }
}

/// Losses of `steps` training steps and every variable after them.
fn train(plan: &Plan, x: &HostTensor, y: &HostTensor, steps: usize) -> (Vec<f32>, Vec<HostTensor>) {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let losses = (0..steps)
        .map(|_| {
            let out = backend.call(id, &[("x", x), ("y", y)]).unwrap();
            out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap()
        })
        .collect();
    (losses, plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap()).collect())
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs().max(y.abs())), "{what}[{i}]: {x} vs {y}");
    }
}

#[test]
fn the_mlp_step_is_tiled_smaller_and_trains_the_same() {
    let m = zoo::by_name("mlp").unwrap();
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let tiled = compile(graph.clone(), &tiled()).unwrap();
    let plain = compile(graph, &untiled()).unwrap();
    assert_eq!(tiled.memory.tiled_updates, 3, "the three dense kernels");
    assert!(tiled.memory.schedule.ends_with("+tiled"));
    assert_eq!(plain.memory.tiled_updates, 0);
    // The first layer's 3.2 MB gradient was at the untiled peak; a quarter of it is now.
    assert!(
        tiled.memory.planned_total_bytes() + (2 << 20) < plain.memory.planned_total_bytes(),
        "tiled {} vs untiled {}",
        tiled.memory.planned_total_bytes(),
        plain.memory.planned_total_bytes()
    );
    assert!(tiled.memory.schedules.iter().any(|(n, _)| n.ends_with("+tiled")));
    assert!(tiled.memory.schedules.iter().any(|(n, _)| !n.ends_with("+tiled")));
    let (x, y) = m.with_batch(256).batch_data(3).unwrap();
    let (a, va) = train(&tiled, &x, &y, 3);
    let (b, vb) = train(&plain, &x, &y, 3);
    assert_close(&a, &b, "losses");
    for ((ta, tb), v) in va.iter().zip(&vb).zip(&tiled.variables) {
        assert_close(ta.data(), tb.data(), &v.key);
    }
}

#[test]
fn random_dense_steps_train_the_same_tiled() {
    let mut rng = StdRng::seed_from_u64(5);
    let mut tiled_kept = 0;
    for case in 0..10 {
        let common::DenseCase { model, depth, batch, features, classes } = common::random_dense(&mut rng);
        let optimizer: Optimizer = match rng.random_range(0..3) {
            0 => Adam::new(1e-3).into(),
            1 => Sgd::new(0.05).momentum(0.9).nesterov().into(),
            _ => Sgd::new(0.1).into(),
        };
        let config = TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer, metrics: vec![] };
        let (xs, ys) = (Shape::new([batch, features]), Shape::new([batch, classes]));
        let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
        let tiled = compile(graph.clone(), &tiled()).unwrap();
        let plain = compile(graph, &untiled()).unwrap();
        let what = format!("case {case}: depth {depth}, batch {batch}, features {features}, {optimizer:?}");
        assert!(tiled.memory.planned_total_bytes() <= plain.memory.planned_total_bytes(), "{what}");
        tiled_kept += usize::from(tiled.memory.tiled_updates > 0);
        let x = HostTensor::from_fn(xs.clone(), |_| rng.random::<f32>() - 0.5).unwrap();
        let mut y = HostTensor::zeros(ys.clone()).unwrap();
        for row in y.data_mut().chunks_mut(classes) {
            row[rng.random_range(0..classes)] = 1.0;
        }
        let (a, va) = train(&tiled, &x, &y, 2);
        let (b, vb) = train(&plain, &x, &y, 2);
        assert_close(&a, &b, &what);
        for ((ta, tb), v) in va.iter().zip(&vb).zip(&tiled.variables) {
            assert_close(ta.data(), tb.data(), &format!("{what}: {}", v.key));
        }
    }
    assert!(tiled_kept >= 3, "the search kept tiled updates in only {tiled_kept} of 10 steps");
}

/// The tiled graph itself, run by the reference interpreter (every value in its own buffer),
/// computes bitwise what its plan computes: the blocks' reads and writes of the variable and its
/// state are ordered right.
#[test]
fn the_reference_interpreter_agrees_with_the_tiled_plan() {
    use kiln::compiler::{schedule, tiled_updates};
    let m = zoo::by_name("mlp").unwrap().with_batch(16);
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let scheduled = kiln::compiler::optimize(graph).unwrap();
    let tiled = tiled_updates::tile(&scheduled.graph, 256).unwrap().expect("the mlp's updates tile");
    let order = schedule::schedule(&tiled.graph).unwrap();
    let plan = compile(tiled.graph.clone(), &untiled()).unwrap();
    let (x, y) = m.batch_data(2).unwrap();
    common::assert_plan_matches_reference(&tiled.graph, &order, &plan, &[("x", &x), ("y", &y)], 2);
}
