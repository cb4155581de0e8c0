//! The kiln command line. With no arguments: train the seed model on the best device present and
//! print its memory report.

use clap::{Parser, Subcommand};
use kiln::compare::{Mode, compare, table};
use kiln::{Device, seed, zoo};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "kiln", version, about = "A graph-mode tensor compiler with static memory planning")]
struct Cli {
    /// Do not draw progress bars or per-epoch lines.
    #[arg(long)]
    quiet: bool,
    /// Also write a picture of the seed model's training plan beside the eager allocator (SVG).
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train the seed model and print the memory report (the default).
    Seed,
    /// Plan a zoo model and compare it with eager execution (TensorFlow's BFC, PyTorch's caching allocator).
    Memory {
        /// A zoo model: seed-mlp, mlp, cnn, transformer.
        model: String,
        /// forward or train.
        #[arg(long, default_value = "train")]
        mode: String,
        /// Batch size (default: the zoo's).
        #[arg(long)]
        batch: Option<usize>,
        /// Write the plan's picture here (SVG).
        #[arg(long, value_name = "PATH")]
        svg: Option<PathBuf>,
        /// Print every step of the plan.
        #[arg(long)]
        steps: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Seed) {
        Command::Seed => run_seed(!cli.quiet, cli.svg.as_deref()),
        Command::Memory { model, mode, batch, svg, steps } => {
            memory(&model, &mode, batch, svg.as_deref(), steps)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn memory(name: &str, mode: &str, batch: Option<usize>, svg: Option<&Path>, steps: bool) -> kiln::Result<()> {
    let names: Vec<&str> = zoo::all().iter().map(|m| m.name).collect();
    let Some(mut m) = zoo::by_name(name) else {
        return Err(invalid(format!("no zoo model `{name}`"), format!("choose one of {names:?}")));
    };
    let Some(mode) = Mode::parse(mode) else {
        return Err(invalid(format!("no mode `{mode}`"), "choose forward or train".into()));
    };
    if let Some(b) = batch {
        m = m.with_batch(b);
    }
    let row = compare(&m, mode, true)?;
    if steps {
        println!("{}", row.plan.render());
    }
    println!("{}", table(std::slice::from_ref(&row)));
    if let Some(path) = svg {
        let title = format!("{} {} (batch {})", m.name, mode.name(), m.batch);
        std::fs::write(path, kiln::svg::plan_svg(&row.plan, Some(&row.bfc_samples), &title))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn invalid(what: String, help: String) -> kiln::Error {
    kiln::Error::Runtime(kiln::runtime::RuntimeError::invalid(what, help))
}

fn run_seed(verbose: bool, svg: Option<&Path>) -> kiln::Result<()> {
    let (device, why) = Device::best();
    println!("kiln: training the seed model on {device} ({why})");
    let start = Instant::now();
    let run = seed::run(&device, verbose)?;
    print!("{}", seed::summary(&run, start.elapsed()));
    if let Some(path) = svg {
        seed::write_svg(path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
