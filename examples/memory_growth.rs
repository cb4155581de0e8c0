//! Seed technique: `tf.config.experimental.set_memory_growth(gpu, True)`.
//!
//! With growth, kiln takes memory only when needed and exactly: one allocation per device when a
//! plan is loaded, for the variables it declares first, its io region and its arena. The eager
//! baseline grows too (TensorFlow's BFC with allow_growth: regions of 2,
//! 4, 8, ... MiB). Without growth, the device is taken whole up front.
//!
//!     cargo run --release --example memory_growth

use kiln::compare::{Mode, graph_of};
use kiln::prelude::*;
use kiln::runtime::eager::{CpuEager, EagerExecutor};
use kiln::{examples, zoo};

fn main() -> kiln::Result<()> {
    let config = DeviceConfig::detect();
    let target = examples::target(&config);
    let devices = config.set_memory_growth(&target, true).build()?;
    let name = devices.logical()[if target == "cpu:0" { 0 } else { 1 }].name.clone();
    let mut trainer = examples::seed_trainer(&devices, &[&name])?;
    let (x, y) = zoo::by_name("seed-mlp").expect("in the zoo").batch_data(0)?;
    trainer.train_program(x.shape(), y.shape())?;
    let before = devices.memory_info(&name)?.planned;
    println!(
        "after compiling and loading the plan: arenas {} B, io {} B, variables {} B, reserved {} B (one allocation)",
        before.arenas, before.io, before.variables, before.reserved
    );
    trainer.train_step(&x, &y)?;
    let after = devices.memory_info(&name)?.planned;
    println!("after the first step:                 reserved {} B (steps allocate nothing)", after.reserved);
    println!("trained: {}", examples::train_seed(&mut trainer)?);
    println!("{}", devices.table());

    // The eager baseline with allow_growth on the same device: how its pool grew.
    let m = zoo::by_name("mlp").expect("in the zoo");
    let s = kiln::compiler::optimize(graph_of(&m, Mode::Train)?)?;
    if name.starts_with("cpu") {
        let mut eager = EagerExecutor::new(devices.eager_allocator(&name)?, 0, CpuEager);
        let (x, y) = m.batch_data(0)?;
        eager.run(&s.graph, &s.order, &[("x", &x), ("y", &y)])?;
        let st = eager.allocator().stats();
        println!(
            "eager mlp training step with growth: {} regions, {} B reserved for a peak of {} B in use",
            st.num_regions, st.reserved, st.peak_in_use
        );
        let plan = compile(graph_of(&m, Mode::Train)?, &CompileOptions::default())?;
        println!("the same step planned: {} B (persistent + arena)", plan.memory.planned_total_bytes());
    }
    Ok(())
}
