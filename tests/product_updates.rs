//! Product updates (`kiln_compiler::product_updates`): an optimizer update that computes its own
//! weight gradient aᵀ·b. The plans that keep them are smaller, and training with them computes
//! bitwise what the plan without them (unfused, untiled) computes.

mod common;

use kiln::compiler::Plan;
use kiln::compiler::ir::{DType, DeviceId, Graph, Init, Node, Op, Shape, VarRole};
use kiln::compiler::losses::Loss;
use kiln::compiler::optim::{Adam, Optimizer, Sgd};
use kiln::compiler::product_updates::{Selection, fold};
use kiln::compiler::step::{TrainConfig, train_step_graph, train_step_graph_with};
use kiln::compiler::widen::HalfKernels;
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Neither fused nor tiled: every gradient stored whole, then applied.
fn plain() -> CompileOptions {
    CompileOptions { tile_updates: false, ..CompileOptions::default() }.with_fusion(false)
}

/// Losses of `steps` training steps and every variable after them.
fn train(plan: &Plan, feeds: &[(&str, &HostTensor)], steps: usize) -> (Vec<f32>, Vec<HostTensor>) {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let losses = (0..steps)
        .map(|_| {
            let out = backend.call(id, feeds).unwrap();
            out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap()
        })
        .collect();
    (losses, plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap()).collect())
}

fn assert_same_training(a: &Plan, b: &Plan, feeds: &[(&str, &HostTensor)], steps: usize, what: &str) {
    let (la, va) = train(a, feeds, steps);
    let (lb, vb) = train(b, feeds, steps);
    assert_eq!(la, lb, "{what}: losses");
    for ((ta, tb), v) in va.iter().zip(&vb).zip(&a.variables) {
        assert_eq!(ta.data(), tb.data(), "{what}: {}", v.key);
    }
}

#[test]
fn the_mlp_keeps_product_updates_smaller_and_trains_bitwise_the_same() {
    let m = zoo::by_name("mlp").unwrap();
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let folded = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let tiled = compile(graph.clone(), &CompileOptions::default().with_fusion(false)).unwrap();
    let unfused = compile(graph, &plain()).unwrap();
    assert!(folded.memory.product_updates >= 2, "{}", folded.memory.schedule);
    assert!(folded.memory.schedule.contains("product"), "{}", folded.memory.schedule);
    assert!(folded.memory.schedules.iter().any(|(n, _)| n.ends_with("+tiled")));
    // The first layer's 3.2 MB gradient was whole at the unfused peak, a quarter of it tiled,
    // and none of it now.
    let total = |p: &Plan| p.memory.planned_total_bytes();
    assert!(total(&folded) + (512 << 10) < total(&tiled), "{} vs tiled {}", total(&folded), total(&tiled));
    assert!(total(&tiled) < total(&unfused));
    // Each folded update replaces a product and an update.
    let updates =
        |p: &Plan| p.steps.iter().filter(|s| matches!(s.op, Op::ApplyAdam { product: true, .. })).count();
    assert_eq!(updates(&folded), folded.memory.product_updates);
    let (x, y) = m.with_batch(256).batch_data(3).unwrap();
    assert_same_training(&folded, &unfused, &[("x", &x), ("y", &y)], 3, "mlp");
}

/// Features uniform in [-0.5, 0.5) and one-hot targets of `classes` columns.
fn random_batch(rng: &mut StdRng, xs: &Shape, ys: &Shape, classes: usize) -> (HostTensor, HostTensor) {
    let x = HostTensor::from_fn(xs.clone(), |_| rng.random::<f32>() - 0.5).unwrap();
    let mut y = HostTensor::zeros(ys.clone()).unwrap();
    for row in y.data_mut().chunks_mut(classes) {
        row[rng.random_range(0..classes)] = 1.0;
    }
    (x, y)
}

/// Every update folded (`Selection::All`) on random dense networks with each optimizer: the
/// plan of the folded graph trains bitwise as the unfused one.
#[test]
fn random_dense_steps_train_bitwise_with_every_update_folded() {
    let mut rng = StdRng::seed_from_u64(11);
    for case in 0..8 {
        let common::DenseCase { model, depth, batch, features, classes } = common::random_dense(&mut rng);
        let optimizer: Optimizer = match case % 4 {
            0 => Adam::new(1e-3).into(),
            1 => Sgd::new(0.05).momentum(0.9).nesterov().into(),
            2 => Sgd::new(0.05).momentum(0.8).into(),
            _ => Sgd::new(0.1).into(),
        };
        let config = TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer, metrics: vec![] };
        let (xs, ys) = (Shape::new([batch, features]), Shape::new([batch, classes]));
        let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
        let mut scheduled = kiln::compiler::optimize(graph.clone()).unwrap().graph;
        let n = fold(&mut scheduled, Selection::All, HalfKernels::ALL).unwrap();
        assert_eq!(n, depth + 1, "case {case}: every dense kernel's update folds");
        let folded = compile(scheduled, &plain()).unwrap();
        let unfused = compile(graph, &plain()).unwrap();
        let (x, y) = random_batch(&mut rng, &xs, &ys, classes);
        let what = format!("case {case}: depth {depth}, batch {batch}, features {features}, {optimizer:?}");
        assert_same_training(&folded, &unfused, &[("x", &x), ("y", &y)], 2, &what);
    }
}

/// The reference interpreter (every value in its own buffer) runs the folded graph to the bits
/// of its plan: the folded updates' reads of the factors and writes of the state are ordered.
#[test]
fn the_reference_interpreter_agrees_with_the_folded_plan() {
    use kiln::compiler::schedule;
    let m = zoo::by_name("mlp").unwrap().with_batch(16);
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let mut g = kiln::compiler::optimize(graph).unwrap().graph;
    assert_eq!(fold(&mut g, Selection::All, HalfKernels::ALL).unwrap(), 3);
    let order = schedule::schedule(&g).unwrap();
    let plan = compile(g.clone(), &plain()).unwrap();
    let (x, y) = m.batch_data(2).unwrap();
    common::assert_plan_matches_reference(&g, &order, &plan, &[("x", &x), ("y", &y)], 2);
}

/// An update whose gradient reads the variable it writes (here wᵀ·x) is never folded: its
/// kernel would read the weight while writing it.
#[test]
fn an_update_that_writes_its_own_factor_is_not_folded() {
    let mut g = Graph::new("self");
    let s = Shape::new([4, 4]);
    let node = |op: Op, shape: &Shape| Node {
        op,
        shape: shape.clone(),
        dtype: DType::F32,
        device: DeviceId(0),
        name: None,
        origin: None,
    };
    let var = Op::Variable {
        key: "w".into(),
        shape: s.clone(),
        dtype: DType::F32,
        role: VarRole::Parameter,
        init: Init::Zeros,
    };
    let w = g.add(node(var, &s), &[]);
    let x = g.add(node(Op::Input { name: "x".into(), shape: s.clone(), dtype: DType::F32 }, &s), &[]);
    let grad = g.add(node(Op::MatMul { transpose_a: true, transpose_b: false }, &s), &[w, x]);
    let sgd =
        Op::ApplySgd { lr: 0.1, momentum: 0.0, nesterov: false, rows: None, product: false, shard: None };
    g.add(node(sgd, &Shape::scalar()), &[w, grad]);
    assert_eq!(fold(&mut g, Selection::All, HalfKernels::ALL).unwrap(), 0);
}

/// Mixed precision: a weight's gradient is its half copy's, the product of half factors rounded
/// to the half type and widened to the f32 master weight's (`autocast`). The update folds the
/// product with both casts, reads the half factors and rounds each element itself: every dense
/// layer's update folds, and the plan trains bitwise as the unfused one. An f16 step gates its
/// updates on finite gradients (its loss scaling reads every gradient first) and a backend
/// without half products would read the factors widened: neither folds.
#[test]
fn mixed_precision_updates_fold_their_half_gradients_and_train_bitwise_the_same() {
    let mut rng = StdRng::seed_from_u64(5);
    for case in 0..4 {
        let common::DenseCase { model, depth, batch, features, classes } = common::random_dense(&mut rng);
        let optimizer: Optimizer =
            if case % 2 == 0 { Adam::new(1e-3).into() } else { Sgd::new(0.05).momentum(0.9).into() };
        let config = TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer, metrics: vec![] };
        let (xs, ys) = (Shape::new([batch, features]), Shape::new([batch, classes]));
        let step = |precision| train_step_graph_with(&model, &xs, &ys, &config, 1, precision).unwrap();
        let graph = step(Precision::BF16);
        let optimized = kiln::compiler::optimize(graph.clone()).unwrap().graph;
        let folds = |kernels| fold(&mut optimized.clone(), Selection::All, kernels).unwrap();
        assert_eq!(folds(HalfKernels::NONE), 0, "case {case}: no half products, no folds");
        let f16 = kiln::compiler::optimize(step(Precision::F16)).unwrap().graph;
        assert_eq!(fold(&mut f16.clone(), Selection::All, HalfKernels::ALL).unwrap(), 0, "case {case}: f16");
        let mut scheduled = optimized;
        assert_eq!(fold(&mut scheduled, Selection::All, HalfKernels::ALL).unwrap(), depth + 1, "case {case}");
        let half_factors = scheduled.node_ids().any(|n| {
            matches!(
                scheduled.node(n).op,
                Op::ApplyAdam { product: true, .. } | Op::ApplySgd { product: true, .. }
            ) && scheduled.operands(n)[1..3].iter().all(|&f| scheduled.node(f).dtype == DType::BF16)
        });
        assert!(half_factors, "case {case}: the folded updates read bf16 factors");
        let folded = compile(scheduled, &plain()).unwrap();
        let unfused = compile(graph, &plain()).unwrap();
        let (x, y) = random_batch(&mut rng, &xs, &ys, classes);
        let what = format!("bf16 case {case}: depth {depth}, batch {batch}, features {features}");
        assert_same_training(&folded, &unfused, &[("x", &x), ("y", &y)], 2, &what);
    }
    // Compiled as any plan is: the search keeps product updates where they plan smaller.
    let m = zoo::by_name("mlp").unwrap();
    let graph =
        train_step_graph_with(&m.model(), m.x_shape(), m.y_shape(), &m.config(), 1, Precision::BF16).unwrap();
    let folded = compile(graph.clone(), &CompileOptions::default()).unwrap();
    assert!(folded.memory.product_updates >= 2, "{}", folded.memory.schedule);
    let (x, y) = m.with_batch(256).batch_data(3).unwrap();
    assert_same_training(&folded, &compile(graph, &plain()).unwrap(), &[("x", &x), ("y", &y)], 2, "mlp bf16");
}
