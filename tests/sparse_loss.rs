//! Sparse softmax cross-entropy: class ids as targets, the one-hot version's losses without its
//! one-hot tensor, and rows with the ignore index left out.

use kiln::compiler::ir::Op;
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;

fn model() -> Sequential {
    Sequential::new().add(Dense::new(32).relu()).add(Dense::new(10))
}

fn config(loss: Loss) -> TrainConfig {
    TrainConfig { loss, optimizer: Adam::new(1e-3).into(), metrics: vec![] }
}

fn data(rows: usize) -> (HostTensor, Vec<usize>) {
    let x: Vec<f32> = (0..rows * 20).map(|i| ((i * 31 % 23) as f32 - 11.0) / 11.0).collect();
    let labels: Vec<usize> = (0..rows).map(|r| (r * 7 + 3) % 10).collect();
    (HostTensor::new(Shape::new([rows, 20]), x).unwrap(), labels)
}

fn ids(labels: &[usize]) -> HostTensor {
    HostTensor::new(Shape::new([labels.len()]), labels.iter().map(|&l| l as f32).collect()).unwrap()
}

fn one_hot(labels: &[usize]) -> HostTensor {
    let mut v = vec![0.0; labels.len() * 10];
    for (r, &l) in labels.iter().enumerate() {
        v[r * 10 + l] = 1.0;
    }
    HostTensor::new(Shape::new([labels.len(), 10]), v).unwrap()
}

fn losses(loss: Loss, x: &HostTensor, y: &HostTensor, steps: usize) -> Vec<f32> {
    let mut trainer = Trainer::new(model(), config(loss), Device::cpu().backend(5).unwrap());
    (0..steps).map(|_| trainer.train_step(x, y).unwrap().loss).collect()
}

#[test]
fn sparse_labels_train_as_one_hot_labels_do() {
    let (x, labels) = data(64);
    let sparse = losses(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }, &x, &ids(&labels), 4);
    let dense = losses(Loss::SoftmaxCrossEntropy, &x, &one_hot(&labels), 4);
    for (a, b) in sparse.iter().zip(&dense) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{sparse:?} vs {dense:?}");
    }
    // [rows, 1] ids are accepted too.
    let column = HostTensor::new(Shape::new([64, 1]), ids(&labels).data().to_vec()).unwrap();
    assert_eq!(losses(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }, &x, &column, 1)[0], sparse[0]);
}

#[test]
fn no_one_hot_is_held() {
    // A language model's head: the logits [rows, vocab] are the step's largest tensors, and the
    // one-hot targets would be as large again.
    let head = || Sequential::new().add(Dense::new(16).relu()).add(Dense::new(2000));
    let (x, rows) = (Shape::new([64, 20]), 64);
    let plan = |loss: Loss, y: Shape| {
        compile(train_step_graph(&head(), &x, &y, &config(loss)).unwrap(), &CompileOptions::default())
            .unwrap()
    };
    let sparse = plan(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }, Shape::new([rows]));
    let dense = plan(Loss::SoftmaxCrossEntropy, Shape::new([rows, 2000]));
    // The [1, vocab] row of class indices and the label mask `ids == iota` are instructions of
    // every fused group that reads them (the loss's reduction, its gradient's), never buffers:
    // no [rows, vocab] buffer but the logits (and their gradient, written over them) is ever live.
    let one_hot_bytes = rows * 2000 * 4;
    let widest = |plan: &kiln::compiler::Plan| {
        (0..plan.steps.len())
            .map(|p| {
                plan.buffers
                    .iter()
                    .filter(|b| b.first_step <= p && p <= b.last_step && b.bytes >= one_hot_bytes)
                    .count()
            })
            .max()
            .unwrap_or(0)
    };
    assert_eq!(widest(&sparse), 1, "one [rows, vocab] buffer at a time");
    assert_eq!(widest(&dense), 2, "the one-hot targets beside the logits");
    // Without the one-hot the peak moves from the loss to the backward pass, where the hidden
    // layer's gradient [rows, 16] is made while the logits' gradient is still needed (by the
    // output layer's update, which must follow it): all of the one-hot is saved but that.
    let hidden_gradient = rows * 16 * 4;
    let (s, d) = (sparse.memory.arena_bytes, dense.memory.arena_bytes);
    assert!(s + one_hot_bytes <= d + hidden_gradient, "sparse arena {s} B, one-hot arena {d} B");
    assert!(!sparse.steps.iter().any(|st| matches!(st.op, Op::Iota { .. })), "the class-index row is fused");
}

#[test]
fn ignored_rows_count_for_nothing() {
    let (x, mut labels) = data(40);
    let kept: Vec<usize> = (0..40).filter(|r| r % 3 != 0).collect();
    for r in (0..40).filter(|r| r % 3 == 0) {
        labels[r] = 99;
    }
    let loss = Loss::SparseSoftmaxCrossEntropy { ignore_index: Some(99) };
    let with_ignored = losses(loss.clone(), &x, &ids(&labels), 1)[0];
    let xs: Vec<f32> = kept.iter().flat_map(|&r| x.data()[r * 20..(r + 1) * 20].to_vec()).collect();
    let x_kept = HostTensor::new(Shape::new([kept.len(), 20]), xs).unwrap();
    let l_kept: Vec<usize> = kept.iter().map(|&r| labels[r]).collect();
    let without = losses(loss, &x_kept, &ids(&l_kept), 1)[0];
    assert!((with_ignored - without).abs() <= 1e-6 * without.abs(), "{with_ignored} vs {without}");
}

#[test]
fn mismatched_ids_are_an_error() {
    let (x, labels) = data(8);
    let mut trainer = Trainer::new(
        model(),
        config(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }),
        Device::cpu().backend(0).unwrap(),
    );
    let e = trainer.train_step(&x, &one_hot(&labels)).unwrap_err().to_string();
    assert!(e.contains("logits [8, 10] and class ids [8, 10] do not match"), "{e}");
}

#[test]
fn sparse_accuracy_counts_as_the_one_hot_accuracy() {
    let (x, labels) = data(64);
    let run = |loss: Loss, metric: Metric, y: &HostTensor| {
        let config = TrainConfig { loss, optimizer: Adam::new(1e-3).into(), metrics: vec![metric] };
        let mut trainer = Trainer::new(model(), config, Device::cpu().backend(5).unwrap());
        trainer.train_step(&x, y).unwrap().metric("accuracy").unwrap()
    };
    let sparse = run(
        Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        Metric::SparseCategoricalAccuracy,
        &ids(&labels),
    );
    let dense = run(Loss::SoftmaxCrossEntropy, Metric::CategoricalAccuracy, &one_hot(&labels));
    assert_eq!(sparse, dense);
    assert!((0.0..=1.0).contains(&sparse));
}
