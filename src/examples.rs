//! What the seed-technique examples share: the device to demonstrate on, and a seed training run
//! on given logical devices.

use crate::error::Result;
use crate::{seed, zoo};
use kiln_runtime::devices::{DeviceConfig, Devices};
use kiln_runtime::trainer::{FitOptions, Trainer};

/// The physical device the examples configure: the first GPU, or the CPU where there is none
/// (and the examples say so).
pub fn target(config: &DeviceConfig) -> String {
    match config.physical().iter().find(|p| p.kind == kiln_runtime::devices::Kind::Gpu) {
        Some(gpu) => {
            println!("using {} ({})", gpu.name, gpu.description);
            gpu.name.clone()
        }
        None => {
            println!("no CUDA device ({}): running on CPU logical devices", crate::Device::best().1);
            "cpu:0".into()
        }
    }
}

/// A trainer for the seed model on logical devices `names` of `devices`.
pub fn seed_trainer(devices: &Devices, names: &[&str]) -> Result<Trainer> {
    let backend = devices.backend(names, 7)?;
    Ok(Trainer::new(zoo::seed_mlp(), zoo::seed_config(), backend)
        .with_options(devices.compile_options(names)?))
}

/// Trains the seed model (5 epochs of the seed data, quietly); returns the last epoch's line.
pub fn train_seed(trainer: &mut Trainer) -> Result<String> {
    let (x, y) = seed::data(42);
    let opts = FitOptions { epochs: 5, batch_size: 32, verbose: false, ..Default::default() };
    let h = trainer.fit(&x, &y, &opts)?;
    Ok(h.epochs.last().map(kiln_runtime::trainer::format_logs).unwrap_or_default())
}
