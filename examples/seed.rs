//! The seed documents' model, trained the way `cargo run --release` does:
//! Dense(10, relu) -> Dense(1, sigmoid), Adam(0.01), binary cross-entropy, 1000x100 random inputs
//! with random labels, 5 epochs of batch 32; then the memory report of both plans (batch 32 and
//! the last batch of 8).
//!
//!     cargo run --release --example seed [-- --svg PATH]

use kiln::{Device, seed};
use std::time::Instant;

fn main() -> kiln::Result<()> {
    let (device, why) = Device::best();
    println!("training the seed model on {device} ({why})");
    let start = Instant::now();
    let run = seed::run(&device, true)?;
    print!("{}", seed::summary(&run, start.elapsed()));
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--svg") {
        let path =
            args.get(i + 1).map(std::path::PathBuf::from).unwrap_or_else(|| "seed-mlp-train.svg".into());
        seed::write_svg(&path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
