//! Seed technique: virtual (logical) devices, `tf.config.set_logical_device_configuration(gpu,
//! [LogicalDeviceConfiguration(memory_limit=1024)] * 2)`: one physical device split into two,
//! each with its own limit and its own arenas, each training its own model.
//!
//!     cargo run --release --example virtual_devices

use kiln::examples;
use kiln::prelude::*;

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let target = examples::target(&config);
    let devices = config.set_logical_devices(&target, &[1024 * MB, 1024 * MB]).build()?;
    println!(
        "{} physical device(s), {} logical device(s):",
        devices.physical().len(),
        devices.logical().len()
    );
    for d in devices.logical() {
        println!("  {} on {} (limit {:?} B)", d.name, d.physical, d.budget.limit);
    }
    let split: Vec<String> =
        devices.logical().iter().filter(|d| d.physical == target).map(|d| d.name.clone()).collect();
    for name in &split {
        let mut trainer = examples::seed_trainer(&devices, &[name])?;
        println!("seed model on {name}: {}", examples::train_seed(&mut trainer)?);
    }
    println!("{}", devices.table());
    Ok(())
}
