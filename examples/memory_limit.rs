//! Seed technique: an explicit memory limit, `memory_limit=5000` (MB) on a device.
//!
//! Every plan is checked against the limit when it compiles: a model that fits trains; one that
//! does not fails before anything runs, with a report of what it needs and what would help.
//!
//!     cargo run --release --example memory_limit

use kiln::compare::{Mode, graph_of};
use kiln::prelude::*;
use kiln::{examples, zoo};

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let target = examples::target(&config);
    let devices = config.set_memory_limit(&target, 5000 * MB).build()?;
    let name = devices.logical().iter().find(|d| d.physical == target).expect("configured").name.clone();
    let mut trainer = examples::seed_trainer(&devices, &[&name])?;
    println!("seed model on {name} (limit 5000 MB): {}", examples::train_seed(&mut trainer)?);

    // The MLP of the zoo at a batch of 400,000 rows needs more than 5000 MB.
    let big = zoo::by_name("mlp").expect("in the zoo").with_batch(400_000);
    match compile(graph_of(&big, Mode::Train)?, &devices.compile_options(&[&name])?) {
        Ok(plan) => println!("unexpectedly fits: {} B", plan.memory.planned_total_bytes()),
        Err(e) => println!("\nthe MLP at batch 400,000 does not compile for {name}:\n{e}"),
    }
    Ok(())
}
