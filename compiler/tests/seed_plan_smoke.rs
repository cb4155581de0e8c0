use kiln_compiler::ir::Shape;
use kiln_compiler::losses::{Loss, Metric};
use kiln_compiler::nn::{Dense, Sequential};
use kiln_compiler::optim::Adam;
use kiln_compiler::step::{TrainConfig, train_step_graph};
use kiln_compiler::{CompileOptions, compile, ir};

#[test]
fn seed_train_plan() {
    let model = Sequential::new().add(Dense::new(10).relu()).add(Dense::new(1).sigmoid());
    let cfg = TrainConfig {
        loss: Loss::BinaryCrossEntropy,
        optimizer: Adam::new(0.01).into(),
        metrics: vec![Metric::BinaryAccuracy],
    };
    let g = train_step_graph(&model, Shape::from([32, 100]), Shape::from([32, 1]), &cfg).unwrap();
    println!("{}", ir::dump(&g));
    let plan = compile(g, &CompileOptions::default()).unwrap();
    println!("{}", plan.render());
}
