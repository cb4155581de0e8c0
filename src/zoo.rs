//! The model zoo: models the examples, tests and benchmarks build by name.

use kiln_compiler::losses::{Loss, Metric};
use kiln_compiler::nn::{Dense, Sequential};
use kiln_compiler::optim::Adam;
use kiln_compiler::step::TrainConfig;

/// The seed documents' model: Dense(10, relu) -> Dense(1, sigmoid) on 100 features.
pub fn seed_mlp() -> Sequential {
    Sequential::new().add(Dense::new(10).relu()).add(Dense::new(1).sigmoid())
}

/// Its training configuration: binary cross-entropy, Adam(0.01), accuracy.
pub fn seed_config() -> TrainConfig {
    TrainConfig {
        loss: Loss::BinaryCrossEntropy,
        optimizer: Adam::new(0.01).into(),
        metrics: vec![Metric::BinaryAccuracy],
    }
}

/// Two interleaved spirals in the plane, `n` points per class, labels 0/1 in [2n, 1]: a classic
/// task that a linear model cannot learn and a small MLP can.
pub fn two_spirals(n: usize, noise: f32, seed: u64) -> (kiln_runtime::HostTensor, kiln_runtime::HostTensor) {
    use rand::rngs::StdRng;
    use rand::{RngExt, SeedableRng};
    let mut rng = StdRng::seed_from_u64(seed);
    let mut x = Vec::with_capacity(4 * n);
    let mut y = Vec::with_capacity(2 * n);
    for i in 0..n {
        // Angle from 0.25 to 3 turns; radius grows with the angle.
        let t = 0.25 + 2.75 * (i as f32 / n as f32);
        let angle = t * std::f32::consts::TAU;
        let r = t / 3.0;
        for (label, sign) in [(0.0, 1.0), (1.0, -1.0)] {
            let jitter = |rng: &mut StdRng| noise * (rng.random::<f32>() - 0.5);
            x.push(sign * r * angle.cos() + jitter(&mut rng));
            x.push(sign * r * angle.sin() + jitter(&mut rng));
            y.push(label);
        }
    }
    let x = kiln_runtime::HostTensor::new([2 * n, 2], x).expect("2n x 2 points");
    let y = kiln_runtime::HostTensor::new([2 * n, 1], y).expect("2n labels");
    (x, y)
}

/// A model that separates the two spirals: 2 -> 64 tanh -> 64 tanh -> 1 sigmoid.
pub fn spiral_mlp() -> Sequential {
    use kiln_compiler::nn::Activation;
    Sequential::new()
        .add(Dense::new(64).activation(Activation::Tanh))
        .add(Dense::new(64).activation(Activation::Tanh))
        .add(Dense::new(1).sigmoid())
}
