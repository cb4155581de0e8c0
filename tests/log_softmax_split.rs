//! A log-softmax split into its row statistics in fused plans (`kiln_compiler::log_softmax_split`):
//! the same bits as the log-softmax kernel, no [rows, classes] result held for the gradient, and
//! left whole where a reader cannot recompute it.

use kiln::compiler::Plan;
use kiln::compiler::ir::{Op, Shape};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn run(plan: &Plan, feeds: &[(&str, &HostTensor)]) -> Vec<u32> {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let out = backend.call(id, feeds).unwrap();
    out.into_iter().flat_map(|(_, t)| t.data().iter().map(|v| v.to_bits()).collect::<Vec<_>>()).collect()
}

fn has_log_softmax(plan: &Plan) -> bool {
    plan.steps.iter().any(|s| matches!(s.op, Op::LogSoftmax { .. }))
}

/// Rows of every length class (one element, a few, more than a reduction's 4,096-element chunk),
/// with large and tiny logits: the split (max, then the fused sum of exp and its log, then the
/// result recomputed in its reader's group) gives the kernel's bits.
#[test]
fn the_split_computes_the_kernels_bits() {
    let mut rng = StdRng::seed_from_u64(5);
    for dims in [vec![3, 1], vec![4, 7], vec![2, 3, 129], vec![2, 5000], vec![1, 9000]] {
        let shape = Shape::new(dims.clone());
        let t = Tracer::new("split");
        let x = t.input("x", shape.clone());
        // Read by an elementwise op (splittable) and by a reduction.
        let y = x.log_softmax(-1);
        t.output("scaled", &(&y * 0.5));
        t.output("summed", &y.sum(-1, false));
        let graph = t.finish().unwrap();
        let fused = compile(graph.clone(), &CompileOptions::default()).unwrap();
        let plain = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
        assert!(!has_log_softmax(&fused), "{dims:?}: split in the fused plan");
        assert!(has_log_softmax(&plain), "{dims:?}: whole in the unfused plan");
        let scale = if dims[1] > 1000 { 80.0 } else { 8.0 };
        let data = HostTensor::from_fn(shape, |_| (rng.random::<f32>() - 0.5) * scale).unwrap();
        let feeds = [("x", &data)];
        assert_eq!(run(&fused, &feeds), run(&plain, &feeds), "{dims:?}: bits differ");
    }
}

/// A log-softmax read by a product, or that is an output, stays one op.
#[test]
fn readers_that_cannot_recompute_keep_it_whole() {
    let t = Tracer::new("whole");
    let x = t.input("x", Shape::new([4, 6]));
    let w = t.input("w", Shape::new([6, 3]));
    t.output("product", &x.log_softmax(-1).matmul(&w));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    assert!(has_log_softmax(&plan));

    let t = Tracer::new("output");
    let x = t.input("x", Shape::new([4, 6]));
    let y = x.log_softmax(-1);
    t.output("y", &y);
    t.output("twice", &(&y * 2.0));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    assert!(has_log_softmax(&plan));
}

/// A softmax cross-entropy head: the fused step holds the logits and two values per row, not the
/// log-softmax's [rows, classes] result beside them: at its peak the arena holds the one-hot
/// targets and the logits (two [rows, classes] buffers) and less than 64 KiB besides, where the
/// unfused step holds three.
#[test]
fn the_loss_holds_no_log_softmax() {
    let head = Sequential::new().add(Dense::new(16).relu()).add(Dense::new(2000));
    let (rows, classes) = (64, 2000);
    let graph = train_step_graph(
        &head,
        Shape::new([rows, 20]),
        Shape::new([rows, classes]),
        &TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer: Sgd::new(0.1).into(), metrics: vec![] },
    )
    .unwrap();
    let fused = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let plain = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
    assert!(!has_log_softmax(&fused));
    let (f, p, one) = (fused.memory.arena_bytes, plain.memory.arena_bytes, rows * classes * 4);
    assert!(f < 2 * one + (64 << 10), "fused arena {f} B");
    assert!(p >= 3 * one, "unfused arena {p} B");
}
