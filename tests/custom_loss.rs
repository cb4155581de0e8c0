//! Custom losses (`Loss::custom`): any scalar computed from the model's output and the targets
//! trains as the built-in losses do, and a loss that is not a scalar is a clear error.

use kiln::prelude::*;
use kiln::zoo;

fn losses(loss: Loss, steps: usize) -> Vec<u32> {
    let config = TrainConfig { loss, optimizer: Adam::new(0.01).into(), metrics: vec![] };
    let mut trainer = Trainer::new(zoo::seed_mlp(), config, Device::cpu().backend(3).unwrap());
    let (x, y) = zoo::by_name("seed-mlp").unwrap().batch_data(4).unwrap();
    (0..steps).map(|_| trainer.train_step(&x, &y).unwrap().loss.to_bits()).collect()
}

#[test]
fn a_custom_loss_written_as_the_builtin_trains_bit_for_bit_as_it() {
    let mine = Loss::custom("my_mse", |p, y| (p - y).square().mean(.., false));
    assert_eq!(losses(mine, 5), losses(Loss::MeanSquaredError, 5));
}

#[test]
fn a_huber_loss_trains_down() {
    let huber = Loss::custom("huber", |p, y| {
        let d = (p - y).abs();
        (d.minimum(1.0).square().mul(0.5) + (&d - 1.0).relu()).mean(.., false)
    });
    assert_eq!(huber.name(), "huber");
    let config = TrainConfig { loss: huber, optimizer: Adam::new(0.01).into(), metrics: vec![] };
    let (x, y) = zoo::two_spirals(200, 0.05, 1).unwrap();
    let mut trainer = Trainer::new(zoo::spiral_mlp(), config, Device::cpu().backend(0).unwrap());
    let opts = FitOptions { epochs: 40, batch_size: 32, verbose: false, ..Default::default() };
    let history = trainer.fit(&x, &y, &opts).unwrap();
    let (first, last) = (history.epochs[0].loss, history.epochs.last().unwrap().loss);
    assert!(last < 0.8 * first, "huber loss {first} -> {last}");
}

#[test]
fn a_custom_loss_that_is_not_a_scalar_is_an_error_naming_it() {
    let rows = Loss::custom("per_row", |p, y| (p - y).square());
    let config = TrainConfig { loss: rows, optimizer: Adam::new(0.01).into(), metrics: vec![] };
    let mut trainer = Trainer::new(zoo::seed_mlp(), config, Device::cpu().backend(0).unwrap());
    let (x, y) = zoo::by_name("seed-mlp").unwrap().batch_data(4).unwrap();
    let e = trainer.train_step(&x, &y).unwrap_err().to_string();
    assert!(e.contains("the custom loss `per_row` returned [32, 1], not a scalar"), "{e}");
    assert!(e.contains(".mean(.., false)"), "{e}");
}
