//! Snapshots of what kiln prints: IR dumps, plans, and error messages. A change to any of them
//! shows up in review as a diff of these files (tests/snapshots/).

use kiln::compiler::ir::dump;
use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::compiler::{CompileOptions, compile, optimize};
use kiln::prelude::*;
use kiln::zoo;

fn seed() -> kiln::zoo::ZooModel {
    zoo::by_name("seed-mlp").unwrap()
}

#[test]
fn seed_forward_graph() {
    let m = seed();
    insta::assert_snapshot!(dump(&forward_graph(&m.model(), m.x_shape()).unwrap()));
}

#[test]
fn seed_training_graph_after_passes() {
    let m = seed();
    let g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    insta::assert_snapshot!(dump(&optimize(g).unwrap().graph));
}

#[test]
fn seed_training_plan() {
    let m = seed();
    let g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    insta::assert_snapshot!(compile(g, &CompileOptions::default()).unwrap().render());
}

#[test]
fn attention_forward_graph() {
    let t = Tracer::new("attention");
    let x = t.input("x", [2, 8, 16]);
    let y = t.scope("mha", || kiln::compiler::nn::MultiHeadAttention::new(4).forward(&x));
    t.output("y", &y);
    insta::assert_snapshot!(dump(&t.finish().unwrap()));
}

#[test]
fn shape_error_message() {
    let t = Tracer::new("bad");
    let x = t.input("x", [32, 100]);
    let model = Sequential::new().add(Dense::new(10).relu()).add(|h: &Tensor| {
        let w = h.tracer().param("w", [100, 1], Init::GlorotUniform);
        h.matmul(&w)
    });
    let y = model.forward(&x);
    t.output("y", &y);
    insta::assert_snapshot!(t.finish().unwrap_err().to_string());
}

#[test]
fn loss_shape_error_message() {
    let m = seed();
    let e = train_step_graph(&m.model(), m.x_shape(), kiln::compiler::ir::Shape::from([32]), &m.config())
        .unwrap_err();
    insta::assert_snapshot!(e.to_string());
}
