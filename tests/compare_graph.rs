//! `kiln::compare::compare_graph`: any traced model, not only the zoo's, gets the planned-vs-eager
//! comparison, and a zoo model compared as a plain graph gives the zoo comparison's figures.

use kiln::compare::{Mode, compare, compare_graph, feeds_for, graph_of};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::zoo;

#[test]
fn a_users_own_training_step_is_compared_with_eager_execution() {
    let model = Sequential::new()
        .add(Dense::new(48).activation(Activation::Gelu))
        .add(Dense::new(24).activation(Activation::Tanh))
        .add(Dense::new(5));
    let config =
        TrainConfig { loss: Loss::SoftmaxCrossEntropy, optimizer: Adam::new(1e-3).into(), metrics: vec![] };
    let graph = train_step_graph(&model, Shape::new([20, 13]), Shape::new([20, 5]), &config).unwrap();
    let feeds = feeds_for(&graph, 1).unwrap();
    let feed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let row = compare_graph("mine", graph, &feed, true).unwrap();
    assert_eq!((row.model.as_str(), row.mode, row.batch), ("mine", Mode::Train, 20));
    assert!(row.eager_executed);
    assert!(row.arena_bytes >= row.lower_bound_bytes && row.lower_bound_bytes > 0);
    assert!(row.planned_total_bytes <= row.eager_bfc_peak_in_use_bytes, "{row:?}");
    assert!(row.eager_bfc_peak_reserved_bytes >= row.eager_bfc_peak_in_use_bytes);
    assert!(kiln::compare::table(&[row]).contains("mine"));
}

#[test]
fn a_traced_forward_graph_is_a_forward_comparison() {
    let t = Tracer::new("affine");
    let x = t.input("x", [7, 30]);
    let w = t.param("w", [30, 9], Init::GlorotUniform);
    t.output("y", &(x.matmul(&w) + 1.0).relu().softmax(-1));
    let graph = t.finish().unwrap();
    let feeds = feeds_for(&graph, 2).unwrap();
    assert_eq!(feeds.len(), 1);
    assert!(feeds[0].1.data().iter().all(|v| (0.0..1.0).contains(v)));
    let feed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let row = compare_graph("affine", graph, &feed, false).unwrap();
    assert_eq!((row.mode, row.batch), (Mode::Forward, 7));
}

#[test]
fn a_zoo_model_as_a_plain_graph_gives_the_zoo_figures() {
    let m = zoo::by_name("mlp").unwrap().with_batch(16);
    let zoo_row = compare(&m, Mode::Train, false).unwrap();
    let graph = graph_of(&m, Mode::Train).unwrap();
    let (x, y) = m.batch_data(1).unwrap();
    let row = compare_graph("mlp", graph, &[("x", &x), ("y", &y)], false).unwrap();
    assert_eq!(row.planned_total_bytes, zoo_row.planned_total_bytes);
    assert_eq!(row.eager_bfc_peak_reserved_bytes, zoo_row.eager_bfc_peak_reserved_bytes);
    assert_eq!(row.eager_caching_peak_reserved_bytes, zoo_row.eager_caching_peak_reserved_bytes);
    assert_eq!(row.batch, 16);
}
