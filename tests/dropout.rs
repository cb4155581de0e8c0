//! Dropout (`kiln::compiler::nn::Dropout`): inverted dropout in training steps from the plan's
//! own generator (`Op::RandomUniform`), the identity at inference, reproducible, new masks each
//! step, never stored, and the same bits fused and unfused.

use kiln::compiler::Plan;
use kiln::compiler::ir::Op;
use kiln::compiler::ir::fused::Inst;
use kiln::compiler::nn::Dropout;
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;

/// A trace of `Dropout(rate)` alone, as a training step traces it: x -> y, the counter advanced.
fn dropout_plan(rate: f32, shape: [usize; 2]) -> Plan {
    let t = Tracer::new("dropout");
    t.set_training(true);
    let x = t.input("x", shape);
    t.output("y", &Dropout::new(rate).forward(&x));
    compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()
}

fn ones(shape: [usize; 2]) -> HostTensor {
    HostTensor::new(Shape::new(shape), vec![1.0; shape[0] * shape[1]]).unwrap()
}

#[test]
fn training_drops_the_rate_and_scales_the_rest_with_new_masks_each_step() {
    let shape = [64, 100];
    let plan = dropout_plan(0.3, shape);
    let x = ones(shape);
    let mut cpu = CpuBackend::new(1);
    let id = cpu.load(plan.clone()).unwrap();
    let first = cpu.call(id, &[("x", &x)]).unwrap().remove(0).1;
    let second = cpu.call(id, &[("x", &x)]).unwrap().remove(0).1;
    let zeros = first.data().iter().filter(|&&v| v == 0.0).count() as f64 / 6400.0;
    assert!((zeros - 0.3).abs() < 0.03, "dropped {zeros}");
    assert!(first.data().iter().all(|&v| v == 0.0 || v == 1.0 / 0.7), "kept elements are scaled by 1/0.7");
    assert_ne!(first.data(), second.data(), "the step counter advanced");
    // A fresh backend (another seed for the initial values) draws the same first mask.
    let mut again = CpuBackend::new(99);
    let id = again.load(plan).unwrap();
    assert_eq!(again.call(id, &[("x", &x)]).unwrap().remove(0).1.data(), first.data());
}

#[test]
fn inference_is_the_identity_and_bad_rates_are_errors() {
    let t = Tracer::new("predict");
    let x = t.input("x", [3, 4]);
    let y = Dropout::new(0.5).forward(&x);
    assert_eq!(y.id(), x.id(), "outside a training step the layer passes its input through");
    let t = Tracer::new("bad");
    t.set_training(true);
    let x = t.input("x", [3, 4]);
    t.output("y", &Sequential::new().add(Dropout::new(1.0)).forward(&x));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("dropout") && e.contains("Dropout::new(1)"), "{e}");
}

#[test]
fn the_mask_is_never_stored_and_training_is_bitwise_fused_or_not() {
    let model = Sequential::new().add(Dense::new(64).relu()).add(Dropout::new(0.2)).add(Dense::new(5));
    let config =
        TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer: Adam::new(1e-2).into(), metrics: vec![] };
    let (xs, ys) = (Shape::new([16, 12]), Shape::new([16, 5]));
    let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
    let options =
        |fuse: bool| CompileOptions { tile_updates: false, ..CompileOptions::default() }.with_fusion(fuse);
    let fused = compile(graph.clone(), &options(true)).unwrap();
    let plain = compile(graph, &options(false)).unwrap();
    assert!(plain.steps.iter().any(|s| matches!(s.op, Op::RandomUniform { .. })));
    assert!(!fused.steps.iter().any(|s| matches!(s.op, Op::RandomUniform { .. })), "no mask buffer");
    let generators = fused
        .steps
        .iter()
        .filter(|s| matches!(&s.op, Op::Fused(f) if f.insts.iter().any(|i| matches!(i, Inst::Uniform(..)))))
        .count();
    assert!(generators >= 2, "the forward group and the gradient's draw the mask: {generators}");
    assert!(fused.variables.iter().any(|v| v.key == "dropout/step"));
    let x = HostTensor::new(xs.clone(), (0..16 * 12).map(|i| ((i * 37 % 19) as f32 - 9.0) / 9.0).collect())
        .unwrap();
    let mut y = HostTensor::zeros(ys).unwrap();
    for (r, row) in y.data_mut().chunks_mut(5).enumerate() {
        row[r % 5] = 1.0;
    }
    let run = |plan: &Plan| {
        let mut cpu = CpuBackend::new(4);
        let id = cpu.load(plan.clone()).unwrap();
        let losses: Vec<u32> = (0..4)
            .map(|_| cpu.call(id, &[("x", &x), ("y", &y)]).unwrap().remove(0).1.data()[0].to_bits())
            .collect();
        let vars: Vec<Vec<f32>> =
            plan.variables.iter().map(|v| cpu.read_variable(&v.key).unwrap().data().to_vec()).collect();
        (losses, vars)
    };
    let (a, va) = run(&fused);
    let (b, vb) = run(&plain);
    assert_eq!(a, b, "losses");
    assert_eq!(va, vb, "variables");
}
