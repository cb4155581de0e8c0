//! Rematerialization: a training step over its memory limit recomputes values instead of keeping
//! them, fits, and computes bit-identical losses and variables; a limit nothing can meet is still
//! an out-of-memory error, which says what rematerialization did.

use kiln::compiler::step::train_step_graph;
use kiln::compiler::validate::validate;
use kiln::prelude::*;
use kiln::zoo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Losses (as bits) of `steps` training steps from the same initial variables, and every
/// variable afterwards.
fn train(plan: &Plan, x: &HostTensor, y: &HostTensor, steps: usize) -> (Vec<u32>, Vec<HostTensor>) {
    let mut backend = CpuBackend::new(3);
    let id = backend.load(plan.clone()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let out = backend.call(id, &[("x", x), ("y", y)]).unwrap();
        losses.push(out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap().to_bits());
    }
    (losses, plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap()).collect())
}

/// Compile options without tiled updates: these tests hold rematerialization alone to
/// bit-identical results (tiled updates sum each gradient block in its own GEMM). Without a
/// limit, no recomputation either (`cheap_remat`, tested on its own below; `saved_values` in
/// tests/saved_values.rs).
fn untiled(limit: Option<usize>) -> CompileOptions {
    CompileOptions {
        tile_updates: false,
        cheap_remat: false,
        save_minimal: false,
        ..CompileOptions::device("cpu:0", limit)
    }
}

/// Without a limit, a training step recomputes what costs next to nothing (`cheap_remat`): the
/// transformer's layer-norm scalings, within the FLOP budget, a smaller arena, and the same bits
/// as the plan that keeps them. Not its GELU at a budget of 1/1000: a transcendental's polynomial
/// is 32 operations an element (`UnaryOp::flops_per_element`), 0.55 ms of a 42 ms CPU step.
#[test]
fn cheap_recomputation_shrinks_the_transformer_for_free() {
    let m = zoo::by_name("transformer").unwrap().with_batch(4);
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let keep = compile(graph.clone(), &untiled(None)).unwrap();
    let cheap = compile(graph, &untiled(None).with_cheap_remat(true).with_recompute_budget(0.001)).unwrap();
    let r = cheap.memory.remat.as_ref().expect("something recomputed");
    assert!(
        !r.recomputed.is_empty() && !r.recomputed.iter().any(|v| v.starts_with("gelu")),
        "{:?}",
        r.recomputed
    );
    let budget = kiln::compiler::cheap_remat::step_flops(&keep) as f64 * 0.001;
    assert!(r.recomputed_flops as f64 <= budget, "{} > {budget}", r.recomputed_flops);
    assert!(cheap.memory.arena_bytes < keep.memory.arena_bytes);
    assert!(cheap.devices.iter().all(|d| d.memory_limit.is_none()), "the search's limit is not the plan's");
    let (x, y) = m.batch_data(1).unwrap();
    assert_eq!(train(&cheap, &x, &y, 3), train(&keep, &x, &y, 3));
}

/// The recomputation budget is the caller's: at 1/100 of the step's FLOPs the transformer also
/// recomputes its GELU (at 1/1000 it does not), for a smaller arena and the same bits; a budget
/// that is not a share is refused, naming the option.
#[test]
fn a_larger_recompute_budget_takes_the_gelu_too() {
    let m = zoo::by_name("transformer").unwrap().with_batch(4);
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let base = untiled(None).with_cheap_remat(true).with_recompute_budget(0.001);
    let default = compile(graph.clone(), &base).unwrap();
    let more = compile(graph.clone(), &base.clone().with_recompute_budget(0.01)).unwrap();
    let r = more.memory.remat.as_ref().expect("something recomputed");
    assert!(r.recomputed.iter().any(|v| v.starts_with("gelu")), "{:?}", r.recomputed);
    assert!(more.memory.arena_bytes < default.memory.arena_bytes);
    let (x, y) = m.batch_data(1).unwrap();
    assert_eq!(train(&more, &x, &y, 2), train(&default, &x, &y, 2));
    for bad in [-0.1, f64::NAN] {
        let e = compile(graph.clone(), &base.clone().with_recompute_budget(bad)).unwrap_err().to_string();
        assert!(e.contains("recompute_budget"), "{e}");
    }
}

/// The limit: persistent bytes plus `fraction` of the unconstrained arena.
fn limit(free: &Plan, fraction: f64) -> usize {
    free.memory.persistent_bytes + (free.memory.arena_bytes as f64 * fraction) as usize
}

#[test]
fn zoo_steps_fit_by_recomputing_and_compute_the_same() {
    // The transformer fits in half its arena, the cnn in 0.7 of its own: its fused arena is
    // already what the backward pass must hold (input gradients written over their activations,
    // `conv_relu_grad`), and two recomputed 32x32 activations are a quarter of it each (at 0.65,
    // the fraction before that fusion, recomputation now reaches 11.46 MiB of 11.44).
    for (name, batch, fraction) in [("transformer", 8, 0.5), ("cnn", 16, 0.7)] {
        let m = zoo::by_name(name).unwrap().with_batch(batch);
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let free = compile(graph.clone(), &untiled(None)).unwrap();
        assert!(free.memory.remat.is_none());
        let limit = limit(&free, fraction);
        let limited = compile(graph.clone(), &untiled(Some(limit))).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(limited.memory.planned_total_bytes() <= limit, "{name}");
        validate(&limited).unwrap();
        let r = limited.memory.remat.as_ref().expect("remat figures");
        assert!(!r.recomputed.is_empty() && r.recomputed_ops >= r.recomputed.len() && r.recomputed_flops > 0);
        // Remat starts from the smallest of the graphs the search planned that it can make fit
        // (the one without a limit, or one whose updates take their gradients otherwise).
        assert!(r.bytes_before >= free.memory.planned_total_bytes(), "{name}");
        assert_eq!(r.bytes_after, limited.memory.planned_total_bytes(), "{name}");
        assert!(r.bytes_saved() >= free.memory.planned_total_bytes() - limit, "{name}");
        assert!(limited.render().contains("rematerialization:"), "{name}");
        assert!(!free.render().contains("rematerialization"), "{name}");
        let (x, y) = m.batch_data(1).unwrap();
        assert_eq!(train(&free, &x, &y, 3), train(&limited, &x, &y, 3), "{name}: remat changed a result");

        // Below the persistent bytes nothing can fit: the report says why remat cannot help.
        let e = compile(graph, &untiled(Some(free.memory.persistent_bytes / 2))).unwrap_err().to_string();
        assert!(e.contains("out of memory") && e.contains("rematerialization: not attempted"), "{e}");
    }
}

#[test]
fn a_limit_remat_cannot_reach_says_what_it_reached() {
    // The mlp's first weight gradient (784 x 1024) with its operands is more than half its arena.
    let m = zoo::by_name("mlp").unwrap();
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let free = compile(graph.clone(), &untiled(None)).unwrap();
    let e =
        compile(graph, &CompileOptions::device("cpu:0", Some(limit(&free, 0.3)))).unwrap_err().to_string();
    assert!(e.contains("out of memory") && e.contains("rematerialization: "), "{e}");
    assert!(e.contains("read and written by the op at the peak"), "{e}");
}

#[test]
fn random_mlps_under_limits_validate_and_match() {
    let mut rng = StdRng::seed_from_u64(11);
    let activations = [Activation::Relu, Activation::Tanh, Activation::Gelu, Activation::Sigmoid];
    let mut fitted = 0;
    for case in 0..12 {
        // Batches large enough that activations, not weight gradients, fill the arena.
        let depth = rng.random_range(2..=6);
        let batch = rng.random_range(256..=1024);
        let features = rng.random_range(4..=64);
        let classes = rng.random_range(2..=12);
        let mut model = Sequential::new();
        for _ in 0..depth {
            let act = activations[rng.random_range(0..activations.len())];
            model = model.add(Dense::new(rng.random_range(16..=192)).activation(act));
        }
        model = model.add(Dense::new(classes));
        let optimizer: Optimizer =
            if rng.random::<bool>() { Adam::new(1e-3).into() } else { Sgd::new(0.05).momentum(0.9).into() };
        let config = TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer, metrics: vec![] };
        let (xs, ys) = (Shape::new([batch, features]), Shape::new([batch, classes]));
        let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
        let free = compile(graph.clone(), &untiled(None)).unwrap();
        let x = HostTensor::from_fn(xs.clone(), |_| rng.random::<f32>() - 0.5).unwrap();
        let mut y = HostTensor::zeros(ys.clone()).unwrap();
        for row in y.data_mut().chunks_mut(classes) {
            row[rng.random_range(0..classes)] = 1.0;
        }
        let expected = train(&free, &x, &y, 2);
        for fraction in [0.7, 0.85] {
            let limit = limit(&free, fraction);
            let what = format!("case {case}: depth {depth}, batch {batch}, fraction {fraction}");
            match compile(graph.clone(), &untiled(Some(limit))) {
                Ok(plan) => {
                    validate(&plan).unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert!(plan.memory.planned_total_bytes() <= limit, "{what}");
                    assert!(plan.memory.remat.is_some(), "{what}");
                    assert_eq!(train(&plan, &x, &y, 2), expected, "{what}: remat changed a result");
                    fitted += 1;
                }
                Err(e) => {
                    let e = e.to_string();
                    assert!(e.contains("out of memory") && e.contains("rematerialization"), "{what}: {e}");
                }
            }
        }
    }
    assert!(fitted >= 12, "only {fitted} of 24 limits were met");
}
