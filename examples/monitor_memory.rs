//! Seed technique: watching memory while training (nvidia-smi, `tf.config.experimental.
//! get_memory_info` / `reset_memory_stats`). Prints the device's current and peak bytes after
//! every epoch and, on a GPU, the driver's free and total memory.
//!
//!     cargo run --release --example monitor_memory

use kiln::prelude::*;
use kiln::{examples, seed};

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let target = examples::target(&config);
    let devices = config.set_memory_growth(&target, true).build()?;
    let name = devices.logical().iter().find(|d| d.physical == target).expect("configured").name.clone();
    let mut trainer = examples::seed_trainer(&devices, &[&name])?;
    let (x, y) = seed::data(42);
    for epoch in 1..=5 {
        let h = trainer.fit(
            &x,
            &y,
            &FitOptions { epochs: 1, batch_size: 32, verbose: false, seed: epoch, ..Default::default() },
        )?;
        let info = devices.memory_info(&name)?;
        let driver = info
            .driver
            .map_or(String::new(), |(free, total)| format!(", driver: {} of {} B free", free, total));
        println!(
            "epoch {epoch}: {} | {name}: current {} B, peak {} B{driver}",
            kiln::runtime::trainer::format_logs(&h.epochs[0]),
            info.planned.current,
            info.planned.peak
        );
        if epoch == 3 {
            devices.reset_memory_stats(&name)?;
            println!("  (peak reset)");
        }
    }
    Ok(())
}
