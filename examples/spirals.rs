//! Training really works: a small MLP learns the two-spirals task (which no linear model can).
//!
//!     cargo run --release --example spirals

use kiln::prelude::*;
use kiln::zoo;

fn main() -> kiln::Result<()> {
    let (x, y) = zoo::two_spirals(500, 0.05, 3)?;
    let config = TrainConfig {
        loss: Loss::BinaryCrossEntropy,
        optimizer: Adam::new(0.01).into(),
        metrics: vec![Metric::BinaryAccuracy],
    };
    let mut trainer = Trainer::new(zoo::spiral_mlp(), config, Device::cpu().backend(0)?);
    let opts = FitOptions { epochs: 150, batch_size: 32, verbose: false, ..Default::default() };
    let history = trainer.fit(&x, &y, &opts)?;
    for (i, logs) in history.epochs.iter().enumerate().filter(|(i, _)| (i + 1) % 25 == 0) {
        println!("epoch {:>3}: {}", i + 1, kiln::runtime::trainer::format_logs(logs));
    }
    let pred = trainer.predict(&x)?;
    let correct = pred.data().iter().zip(y.data()).filter(|(p, t)| (**p > 0.5) == (**t > 0.5)).count();
    println!("accuracy on the training set: {:.1}%", 100.0 * correct as f64 / y.data().len() as f64);
    Ok(())
}
