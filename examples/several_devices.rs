//! Seed technique: different memory limits on several devices (on a machine with GPUs of
//! different sizes, one `memory_limit` per GPU). Each device gets plans that fit its own limit;
//! the same model may fit one device and not another, and kiln says so before running.
//!
//!     cargo run --release --example several_devices

use kiln::compare::{Mode, graph_of};
use kiln::prelude::*;
use kiln::{examples, zoo};

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let gpus: Vec<String> = config
        .physical()
        .iter()
        .filter(|p| p.kind == kiln::runtime::devices::Kind::Gpu)
        .map(|p| p.name.clone())
        .collect();
    let limits = [256 * MB, 1024 * MB];
    let devices = if gpus.len() >= 2 {
        println!("using {} and {}", gpus[0], gpus[1]);
        config.set_memory_limit(&gpus[0], limits[0]).set_memory_limit(&gpus[1], limits[1]).build()?
    } else {
        // One device only: two logical devices of it stand in for two devices of different sizes.
        let target = examples::target(&config);
        config.set_logical_devices(&target, &limits).build()?
    };
    let names: Vec<String> =
        devices.logical().iter().filter(|d| d.budget.limit.is_some()).map(|d| d.name.clone()).collect();
    let cnn = zoo::by_name("cnn").expect("in the zoo").with_batch(512);
    for name in &names {
        let mut trainer = examples::seed_trainer(&devices, &[name])?;
        println!("seed model on {name}: {}", examples::train_seed(&mut trainer)?);
        match compile(graph_of(&cnn, Mode::Train)?, &devices.compile_options(&[name])?) {
            Ok(plan) => println!(
                "  the CNN at batch 512 fits {name}: {} B planned",
                plan.memory.planned_total_bytes()
            ),
            Err(e) => println!(
                "  the CNN at batch 512 does not fit {name}: {}",
                e.to_string().lines().next().unwrap_or("")
            ),
        }
    }
    println!("{}", devices.table());
    Ok(())
}
