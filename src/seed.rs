//! The seed run: the seed documents' model trained on 1000 random rows of 100 features with
//! random 0/1 labels, 5 epochs of batch 32 (the last batch of each epoch has 8 rows).

use crate::device::Device;
use crate::error::Result;
use crate::report::{PlanMemory, table};
use crate::zoo;
use kiln_compiler::Precision;
use kiln_runtime::{FitOptions, History, HostTensor, Trainer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// The number of rows (samples) in the seed run's data set.
pub const ROWS: usize = 1000;
/// The number of input features per row (the seed model's input width).
pub const FEATURES: usize = 100;

/// Uniform [0, 1) inputs and random 0/1 labels, as `np.random.random` and `np.random.randint(2)`.
pub fn data(seed: u64) -> (HostTensor, HostTensor) {
    let mut rng = StdRng::seed_from_u64(seed);
    // Fixed sizes (400 KB): the allocation is not the caller's to get wrong.
    let x = HostTensor::from_fn([ROWS, FEATURES], |_| rng.random::<f32>()).expect("1000 x 100 floats");
    let y = HostTensor::from_fn([ROWS, 1], |_| if rng.random::<bool>() { 1.0 } else { 0.0 })
        .expect("1000 floats");
    (x, y)
}

/// The result of a seed run: the trainer (with its plans) and the per-epoch history.
pub struct SeedRun {
    /// The trainer after the run: its plans (one per batch shape), backend and compile time.
    pub trainer: Trainer,
    /// The loss and metrics logged at the end of each epoch.
    pub history: History,
    /// Whether `fit` printed each epoch's line as it ended (then [`summary`] does not repeat
    /// them).
    pub epochs_printed: bool,
}

/// Trains the seed model on `device`; `verbose` draws progress bars and epoch lines.
pub fn run(device: &Device, verbose: bool) -> Result<SeedRun> {
    run_in(device, verbose, Precision::F32)
}

/// `run` computing in `precision` (`kiln_compiler::autocast`; master weights f32).
pub fn run_in(device: &Device, verbose: bool, precision: Precision) -> Result<SeedRun> {
    let (x, y) = data(42);
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), device.backend(7)?).with_precision(precision);
    let opts =
        FitOptions { epochs: 5, batch_size: 32, shuffle: true, seed: 1, verbose, stop_on_non_finite: false };
    let history = trainer.fit(&x, &y, &opts)?;
    Ok(SeedRun { trainer, history, epochs_printed: verbose })
}

/// Trains the seed model data-parallel on `ranks` in-process ranks on `device` (each rank a
/// backend of its own and a thread, every batch split over the ranks by the `Trainer`, the
/// gradients averaged inside the plan): rank 0's run, and whether every rank ended with
/// bitwise the same weights. `verbose` draws rank 0's progress.
pub fn run_ranks(device: &Device, ranks: usize, verbose: bool) -> Result<(SeedRun, bool)> {
    run_ranks_in(device, ranks, verbose, Precision::F32)
}

/// `run_ranks` computing in `precision`.
pub fn run_ranks_in(
    device: &Device,
    ranks: usize,
    verbose: bool,
    precision: Precision,
) -> Result<(SeedRun, bool)> {
    let (x, y) = data(42);
    let train = |rank: usize, comm: kiln_comm::LocalComm| -> Result<(SeedRun, Vec<u32>)> {
        let mut trainer = Trainer::new(zoo::seed_mlp(), zoo::seed_config(), device.rank_backend(7, comm)?)
            .with_precision(precision);
        let opts = FitOptions {
            epochs: 5,
            batch_size: 32,
            shuffle: true,
            seed: 1,
            verbose: verbose && rank == 0,
            stop_on_non_finite: false,
        };
        let history = trainer.fit(&x, &y, &opts)?;
        let mut bits = Vec::new();
        for v in trainer.plans()[0].variables.iter().filter(|v| !v.key.starts_with("optimizer/")) {
            bits.extend(trainer.backend().read_variable(&v.key)?.data().iter().map(|w| w.to_bits()));
        }
        Ok((SeedRun { trainer, history, epochs_printed: verbose && rank == 0 }, bits))
    };
    let mut comms = kiln_comm::local_group(ranks.max(1));
    let first = comms.remove(0);
    // Rank 0 on this thread (its trainer, which holds the backend, is returned), the others on
    // threads of their own; a rank that fails drops its communicator, which ends the others'
    // collectives with an error instead of a hang.
    std::thread::scope(|scope| {
        let others: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(i, comm)| {
                let train = &train;
                scope.spawn(move || train(i + 1, comm).map(|(_, bits)| bits))
            })
            .collect();
        let mine = train(0, first);
        let theirs: Vec<Result<Vec<u32>>> =
            others.into_iter().map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect();
        let (run, bits) = mine?;
        let theirs = theirs.into_iter().collect::<Result<Vec<_>>>()?;
        let same = theirs.iter().all(|b| *b == bits);
        Ok((run, same))
    })
}

/// The run's epochs (unless `fit` printed them already: one line per epoch either way), timing
/// and memory report, as `cargo run --release` prints them.
pub fn summary(run: &SeedRun, elapsed: std::time::Duration) -> String {
    let mut s = String::new();
    if !run.epochs_printed {
        for (i, logs) in run.history.epochs.iter().enumerate() {
            s.push_str(&format!("epoch {}: {}\n", i + 1, kiln_runtime::trainer::format_logs(logs)));
        }
    }
    s.push_str(&format!(
        "trained in {:.1} ms (compile {:.2} ms) on {}\n",
        elapsed.as_secs_f64() * 1e3,
        run.trainer.compile_time().as_secs_f64() * 1e3,
        run.trainer.backend().describe()
    ));
    if let Some(r) = run.trainer.backend().report() {
        s.push_str(&format!("{r}\n"));
    }
    let rows: Vec<PlanMemory> = run.trainer.plans().into_iter().map(PlanMemory::of).collect();
    s.push_str(&format!(
        "\nmemory report (bytes; persistent = parameters + optimizer state + io; device = the plan's one allocation (variable region, io region and arena) at 2 MiB granules, as if the plan were loaded alone (a later plan of the model finds the variables in place); one plan per input shape)\n{}",
        table(&rows)
    ));
    s
}

/// Writes the picture of the seed model's training plan (batch 32) beside the eager BFC
/// allocator running the same step.
pub fn write_svg(path: &std::path::Path) -> Result<()> {
    let m = zoo::by_name("seed-mlp").expect("the seed model is in the zoo");
    let row = crate::compare::compare(&m, crate::compare::Mode::Train, true)?;
    let svg = crate::svg::plan_svg(&row.plan, Some(&row.bfc_samples), "seed-mlp train (batch 32)");
    std::fs::write(path, svg)?;
    Ok(())
}
