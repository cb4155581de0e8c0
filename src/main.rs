//! The kiln command line. With no arguments: train the seed model on the best device present and
//! print its memory report.

use clap::{Parser, Subcommand};
use kiln::{Device, seed};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "kiln", version, about = "A graph-mode tensor compiler with static memory planning")]
struct Cli {
    /// Do not draw progress bars or per-epoch lines.
    #[arg(long)]
    quiet: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train the seed model and print the memory report (the default).
    Seed,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Seed) {
        Command::Seed => run_seed(!cli.quiet),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run_seed(verbose: bool) -> kiln::Result<()> {
    let (device, why) = Device::best();
    println!("kiln: training the seed model on {device:?} ({why})");
    let start = Instant::now();
    let run = seed::run(&device, verbose)?;
    print!("{}", seed::summary(&run, start.elapsed()));
    Ok(())
}
