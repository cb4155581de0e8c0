//! Seed technique: a model split over devices of different sizes (the seed documents' 1 GB,
//! 4 GB and 2 GB GPUs). kiln splits the layers of a Sequential model so that every device's share
//! of the training step fits its limit, measuring each candidate with the compiler, and says how
//! it split them. `--run` also trains one step on the split (on CPU logical devices where there
//! is no GPU; it needs about 6 GB of memory).
//!
//!     cargo run --release --example split_model [-- --run]

use kiln::compiler::ir::Shape;
use kiln::examples;
use kiln::prelude::*;

fn model() -> Sequential {
    let mut m = Sequential::new();
    for _ in 0..24 {
        m.push(Dense::new(4096).relu());
    }
    m.push(Dense::new(1).sigmoid());
    m
}

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let target = examples::target(&config);
    let devices = config.set_logical_devices(&target, &[GB, 4 * GB, 2 * GB]).build()?;
    let names: Vec<String> =
        devices.logical().iter().filter(|d| d.physical == target).map(|d| d.name.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (x, y) = (Shape::from([1024, 4096]), Shape::from([1024, 1]));
    let cfg = kiln::zoo::seed_config();
    let whole =
        compile(kiln::compiler::step::train_step_graph(&model(), &x, &y, &cfg)?, &CompileOptions::default())?;
    println!(
        "24 x Dense(4096) at batch 1024, one training step, needs {:.2} GiB on one device",
        whole.memory.planned_total_bytes() as f64 / GB as f64
    );
    let options = devices.compile_options(&names)?;
    let split = split_sequential(&model(), &x, &y, &cfg, &options.devices, 256)?;
    println!("split over {}:\n{}", names.join(", "), split.describe());
    if std::env::args().any(|a| a == "--run") {
        let mut trainer =
            Trainer::new(Placed::new(model(), split.placement.clone()), cfg, devices.backend(&names, 0)?)
                .with_options(options);
        let xs = HostTensor::from_fn(x.clone(), |i| (i % 13) as f32 / 13.0)?;
        let ys = HostTensor::from_fn(y.clone(), |i| (i % 2) as f32)?;
        let logs = trainer.train_step(&xs, &ys)?;
        println!("one training step on the split: loss {:.4}", logs.loss);
        println!("{}", devices.table());
    }
    Ok(())
}
