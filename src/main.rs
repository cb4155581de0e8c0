//! The kiln command line. With no arguments: train the seed model on the best device present and
//! print its memory report.

use clap::{Parser, Subcommand};
use kiln::compare::{Mode, table};
use kiln::gpu_bench::Outcome;
use kiln::{Device, seed, zoo};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "kiln", version, about = "A graph-mode tensor compiler with static memory planning")]
struct Cli {
    /// Do not draw progress bars or print epochs as they end (the summary lists them instead).
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
    Seed {
        /// Train data-parallel on this many in-process ranks (each batch split over them, the
        /// gradients averaged inside the plan); the memory report is rank 0's.
        #[arg(long, default_value_t = 1)]
        ranks: usize,
        /// f32, or bf16 / f16 mixed precision (products in the half type, master weights f32).
        #[arg(long, default_value = "f32")]
        precision: String,
    },
    /// Train a zoo model data-parallel on RANKS in-process ranks (one CPU backend a thread, the
    /// gradients averaged inside the plan) and print how to launch ranks as processes with mpirun
    Ranks {
        /// How many ranks.
        #[arg(long, default_value_t = 2)]
        ranks: usize,
        /// The zoo model.
        #[arg(long, default_value = "mlp")]
        model: String,
        /// Training steps.
        #[arg(long, default_value_t = 5)]
        steps: usize,
        /// ZeRO stage: 0 (plain data parallelism), 1 (optimizer state sharded) or 2 (and the
        /// reduced gradients).
        #[arg(long, default_value_t = 0)]
        zero: usize,
    },
    /// Per-rank planned memory of a zoo model's data-parallel training step by ZeRO stage
    /// (0, 1, 2) for 1, 2, 4, ... ranks, from plans alone, beside ZeRO's formulas
    Zero {
        /// The zoo model.
        #[arg(long, default_value = "transformer")]
        model: String,
        /// The most ranks (powers of two up to it).
        #[arg(long, default_value_t = 64)]
        max_ranks: usize,
    },
    /// List the devices with their policies, limits, arenas and usage.
    Devices {
        /// A memory limit: DEVICE=SIZE (e.g. gpu:0=5000MB; units are 1024-based: 1MB = 1MiB). Repeatable.
        #[arg(long, value_name = "DEVICE=SIZE")]
        limit: Vec<String>,
        /// Memory growth on DEVICE. Repeatable.
        #[arg(long, value_name = "DEVICE")]
        growth: Vec<String>,
        /// Preallocate a fraction of DEVICE: DEVICE=F (e.g. gpu:0=0.75). Repeatable.
        #[arg(long, value_name = "DEVICE=F")]
        fraction: Vec<String>,
        /// Split DEVICE into logical devices: DEVICE=SIZE,SIZE,... (e.g. cpu:0=1GB,4GB,2GB). Repeatable.
        #[arg(long, value_name = "DEVICE=SIZES")]
        logical: Vec<String>,
        /// Train the seed model on every logical device first, so the table shows arenas and usage.
        #[arg(long)]
        seed: bool,
        /// Only these devices are visible (TensorFlow's set_visible_devices): comma-separated
        /// physical names, e.g. gpu:1 (the CPU is always visible; an empty list hides every GPU).
        #[arg(long, value_name = "DEVICES")]
        visible: Option<String>,
    },
    /// The GPU benchmark (as `cargo bench --bench gpu`), for machines with CUDA but no Rust toolchain.
    BenchGpu,
    /// kiln's NVRTC matmul alone on the GPU at each shape, in TFLOP/s (writes gemm.json).
    BenchGemm {
        /// Products M,K,N separated by ';' (default 4096,4096,4096).
        #[arg(long, default_value = "4096,4096,4096")]
        shapes: String,
        /// Timed runs per shape (the median is reported).
        #[arg(long, default_value_t = 50)]
        steps: usize,
        /// f32, or bf16 / f16: half factors on the tensor cores, f32 accumulation (the product
        /// timed without the casts around it).
        #[arg(long, default_value = "f32")]
        precision: String,
    },
    /// Train an ONNX model as a layer (MSE against targets of its output's shape, Adam) on random
    /// data or a batch from a safetensors or .npz file, on the best device present, and print its
    /// memory report.
    Train {
        /// The model file (.onnx).
        model: String,
        /// Batch size: every input's symbolic first axis.
        #[arg(long, default_value_t = 32)]
        batch: usize,
        /// Optimizer steps.
        #[arg(long, default_value_t = 20)]
        steps: usize,
        /// Size a symbolic dimension of the model's inputs: NAME=N. Repeatable.
        #[arg(long, value_name = "NAME=N")]
        dim: Vec<String>,
        /// A safetensors or NumPy .npz file holding one batch to train on instead of random data:
        /// a tensor per model input, named as the model's inputs (`x` for a model of one input),
        /// and the targets `y`; F32 (F16 and BF16 read as f32), I32, I64 or BOOL, as the inputs take.
        #[arg(long, value_name = "PATH")]
        data: Option<PathBuf>,
        /// Train on the CPU even where a GPU is present.
        #[arg(long)]
        cpu: bool,
        /// f32, or bf16 / f16 mixed precision (products in the half type, master weights f32).
        #[arg(long, default_value = "f32")]
        precision: String,
        /// After the steps, time N more, each alone, and print the median and spread of one
        /// step's wall time (the loss read back included, as every step reads it).
        #[arg(long, value_name = "N")]
        bench: Option<usize>,
    },
    /// Run an ONNX model's forward pass on inputs from .npz, .npy or safetensors files (or random
    /// ones), print its outputs and write them to a file; with --bench, time it.
    Run {
        /// The model file (.onnx).
        model: String,
        /// A .npz, .npy or safetensors file of inputs, each named as the model's input it feeds
        /// (an .npy file by its stem). Repeatable. Without one: floats uniform in [0, 1), ids 0.
        #[arg(long, value_name = "PATH")]
        input: Vec<PathBuf>,
        /// Write every output here, by name: .npz, .npy (one output) or .safetensors.
        #[arg(long, value_name = "PATH")]
        output: Option<PathBuf>,
        /// Batch size: every input's first axis (default: the file's).
        #[arg(long)]
        batch: Option<usize>,
        /// Size a symbolic dimension of the model's inputs: NAME=N. Repeatable.
        #[arg(long, value_name = "NAME=N")]
        dim: Vec<String>,
        /// CPU threads the kernels run on (default: RAYON_NUM_THREADS, or one per core).
        #[arg(long)]
        threads: Option<usize>,
        /// Time this many runs after two warm-up runs and print the median and spread.
        #[arg(long, value_name = "N")]
        bench: Option<usize>,
        /// Time each kernel over this many runs and print where the time goes: per op, and the
        /// slowest kernels (medians).
        #[arg(long, value_name = "N")]
        profile: Option<usize>,
        /// How many of the slowest kernels `--profile` lists.
        #[arg(long, value_name = "K", default_value_t = 15)]
        top: usize,
        /// Where to run: cpu, or gpu (the first visible CUDA device); default: the best present.
        #[arg(long)]
        device: Option<String>,
        /// f32, or bf16 / f16 mixed precision (products in the half type).
        #[arg(long, default_value = "f32")]
        precision: String,
    },
    /// Replay PyTorch's recorded allocation streams (scripts/peers/torch_stream.py) beside kiln's
    /// eager column and plans.
    TorchStream {
        /// The JSON file the script wrote (default: the recording in benches/data).
        file: Option<PathBuf>,
    },
    /// Plan a zoo model and compare it with eager execution (TensorFlow's BFC, PyTorch's caching allocator).
    Memory {
        /// A zoo model (seed-mlp, mlp, cnn, transformer) or an ONNX file.
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
        /// Size a symbolic dimension of an ONNX model's inputs: NAME=N. Repeatable.
        #[arg(long, value_name = "NAME=N")]
        dim: Vec<String>,
        /// A device and its memory, DEVICE=SIZE (e.g. gpu:0=24GB; 1024-based units), in order.
        /// Repeatable: says whether an ONNX model fits the first, and if not how to split it
        /// over them.
        #[arg(long, value_name = "DEVICE=SIZE")]
        device: Vec<String>,
        /// PyTorch's recorded allocation stream for the same step, same batch (a JSON file
        /// scripts/peers/torch_stream.py wrote; FILE:MODEL names one of several, a zoo model's
        /// own by default): replayed through the caching allocator, it is the eager figure the
        /// plan is compared with.
        #[arg(long, value_name = "FILE[:MODEL]")]
        pytorch_stream: Option<String>,
        /// f32, or bf16 / f16 mixed precision: products, convolutions and attention in the half
        /// type, reductions, softmax, norms, losses and the optimizer in f32, parameters and
        /// optimizer state f32 (kiln::compiler::autocast). Half-precision steps are planned; their
        /// eager columns replay the allocations without computing.
        #[arg(long, default_value = "f32")]
        precision: String,
    },
    /// Print this command-line reference as Markdown (the book's CLI chapter is its output).
    #[command(hide = true)]
    HelpMarkdown,
    /// Regenerate the documents' generated parts: docs/src/cli.md from the command line's own
    /// definition, and the results tables of README.md, docs/src/benchmarks.md and
    /// docs/src/precision.md from the newest
    /// records in benches/results. With --check, write nothing and fail where a file differs.
    #[command(hide = true)]
    RenderDocs {
        /// Fail (exit 1) where a generated part differs from the file instead of writing it.
        #[arg(long)]
        check: bool,
    },
}

/// The command-line reference in Markdown, generated from the definitions above.
fn cli_markdown() -> String {
    let options = clap_markdown::MarkdownOptions::new()
        .title("CLI reference".to_string())
        .show_footer(false)
        .show_table_of_contents(true);
    clap_markdown::help_markdown_custom::<Cli>(&options)
}

/// Writes (or with `check`, compares) every generated part of the documents.
fn render_docs(check: bool) -> ExitCode {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tables = match kiln::results::render_all(&kiln::results::results_dir()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: reading benches/results: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut stale = Vec::new();
    let mut files: Vec<(PathBuf, Result<String, String>)> =
        vec![(root.join("docs/src/cli.md"), Ok(cli_markdown()))];
    for doc in ["README.md", "docs/src/benchmarks.md", "docs/src/precision.md"] {
        let path = root.join(doc);
        let rendered = std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: {e}", path.display()))
            .and_then(|text| kiln::results::render_into(&text, &tables).map_err(|e| format!("{doc}: {e}")));
        files.push((path, rendered));
    }
    for (path, rendered) in files {
        let rendered = match rendered {
            Ok(r) => r,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        if std::fs::read_to_string(&path).ok().as_deref() == Some(rendered.as_str()) {
            continue;
        }
        if check {
            stale.push(path.display().to_string());
        } else if let Err(e) = std::fs::write(&path, rendered) {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        } else {
            println!("wrote {}", path.display());
        }
    }
    if stale.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("out of date (run `cargo run --release -- render-docs`): {}", stale.join(", "));
        ExitCode::FAILURE
    }
}

/// The exit status of `kiln bench-gpu` when there is no usable CUDA device: the user asked for a
/// GPU benchmark and none ran. (`cargo bench --bench gpu` exits 0 instead: see benches/gpu.rs.)
const EXIT_SKIPPED: u8 = 2;

fn main() -> ExitCode {
    // A closed pipe (`kiln devices | head`) ends the process quietly, as for other command-line
    // tools, instead of `println!` panicking on EPIPE: Rust starts programs with SIGPIPE ignored.
    #[cfg(unix)]
    // SAFETY: restoring a signal's default disposition at the start of main, before any thread
    // is spawned, has no precondition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Seed { ranks: 1, precision: "f32".into() }) {
        Command::Seed { ranks, precision } => {
            precision_flag(&precision).and_then(|p| run_seed(!cli.quiet, cli.svg.as_deref(), ranks, p))
        }
        Command::Ranks { ranks, model, steps, zero } => run_ranks(ranks, &model, steps, zero),
        Command::Zero { model, max_ranks } => run_zero(&model, max_ranks),
        Command::Memory { model, mode, batch, svg, steps, dim, device, pytorch_stream, precision }
            if model.ends_with(".onnx") =>
        {
            let shown = Shown { svg: svg.as_deref(), steps, stream: pytorch_stream.as_deref() };
            precision_flag(&precision)
                .and_then(|p| memory_onnx(&model, &mode, batch, &dim, &shown, &device, p))
        }
        Command::Memory { device, .. } if !device.is_empty() => Err(invalid(
            "--device is read for ONNX models".into(),
            "split a zoo model with kiln::prelude::split_sequential (examples/split_model.rs)".into(),
        )),
        Command::Memory { model, mode, batch, svg, steps, pytorch_stream, precision, .. } => {
            let shown = Shown { svg: svg.as_deref(), steps, stream: pytorch_stream.as_deref() };
            precision_flag(&precision).and_then(|p| memory(&model, &mode, batch, &shown, p))
        }
        Command::BenchGpu => match kiln::gpu_bench::run() {
            Ok(Outcome::Ran) => Ok(()),
            Ok(skipped) => {
                eprintln!("{}", skipped.skip_message().unwrap_or_default());
                return ExitCode::from(EXIT_SKIPPED);
            }
            Err(e) => Err(invalid(e.to_string(), "see the message above".into())),
        },
        Command::BenchGemm { shapes, steps, precision } => {
            match parse_shapes(&shapes).and_then(|s| Ok((s, precision_flag(&precision)?))) {
                Err(e) => Err(e),
                Ok((shapes, precision)) => match kiln::gpu_bench::gemm(&shapes, steps.max(1), precision) {
                    Ok(Outcome::Ran) => Ok(()),
                    Ok(skipped) => {
                        eprintln!("{}", skipped.skip_message().unwrap_or_default());
                        return ExitCode::from(EXIT_SKIPPED);
                    }
                    Err(e) => Err(invalid(e.to_string(), "see the message above".into())),
                },
            }
        }
        Command::Devices { limit, growth, fraction, logical, seed, visible } => {
            devices(&limit, &growth, &fraction, &logical, seed, visible.as_deref())
        }
        Command::TorchStream { file } => torch_stream(file.as_deref()),
        Command::HelpMarkdown => {
            print!("{}", cli_markdown());
            Ok(())
        }
        Command::RenderDocs { check } => return render_docs(check),
        Command::Train { model, batch, steps, dim, data, cpu, precision, bench } => {
            precision_flag(&precision).and_then(|precision| {
                let args =
                    TrainArgs { batch, steps, dims: &dim, data: data.as_deref(), cpu, precision, bench };
                train_onnx(&model, args)
            })
        }
        Command::Run {
            model,
            input,
            output,
            batch,
            dim,
            threads,
            bench,
            profile,
            top,
            device,
            precision,
        } => precision_flag(&precision).and_then(|precision| {
            let run = RunArgs { input: &input, output: output.as_deref(), threads, bench, profile, top };
            run_onnx(&model, batch, &dim, device.as_deref(), precision, run)
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// PyTorch's recorded streams replayed (with its workspaces, kept as by default or taken per
/// product, and without), its real peaks when
/// the recording has them, kiln's eager caching column and the plan's device bytes, per recorded
/// zoo training step.
fn torch_stream(file: Option<&Path>) -> kiln::Result<()> {
    use kiln::report::{bytes, ratio, render_table};
    use kiln::runtime::eager::{FrameworkExtras, WorkspacePolicy};
    use kiln::torch_stream::{COMMITTED, Recording, replay};
    let json = match file {
        None => COMMITTED.to_string(),
        Some(file) => std::fs::read_to_string(file).map_err(|e| {
            kiln::Error::Runtime(kiln::runtime::RuntimeError::invalid(
                format!("cannot read {}: {e}", file.display()),
                "pass the JSON file scripts/peers/torch_stream.py wrote",
            ))
        })?,
    };
    let rec = Recording::parse(&json)?;
    if let Some(why) = rec.skipped {
        println!("skipped: {why}");
        return Ok(());
    }
    let mut rows = Vec::new();
    for (name, stream) in &rec.models {
        let plain = replay(stream, &FrameworkExtras::default())?;
        let with = replay(stream, &FrameworkExtras::pytorch(WorkspacePolicy::Persistent))?;
        let per_call = replay(stream, &FrameworkExtras::pytorch(WorkspacePolicy::PerCall))?;
        let Some(m) = kiln::zoo::by_name(name) else { continue };
        let c = kiln::compare::compare(&m, kiln::compare::Mode::Train, false)?;
        rows.push(vec![
            name.clone(),
            stream.capture.clone().unwrap_or_else(|| "cuda".into()),
            stream.max_memory_reserved.map_or("-".into(), bytes),
            bytes(with.peak_reserved),
            bytes(per_call.peak_reserved),
            bytes(plain.peak_reserved),
            bytes(plain.peak_in_use),
            bytes(c.eager_caching_peak_in_use_bytes),
            bytes(c.eager_caching_peak_reserved_bytes),
            bytes(c.device_bytes),
            format!("{:.3}", ratio(c.eager_caching_peak_reserved_bytes, plain.peak_reserved)),
            format!("{:.3}", ratio(c.device_bytes, with.peak_reserved)),
        ]);
    }
    let headers = [
        "model (train)",
        "capture",
        "PyTorch reserved",
        "replayed +ws reserved",
        "+ws per call",
        "replayed reserved",
        "replayed in use",
        "kiln eager in use",
        "kiln eager reserved",
        "kiln device bytes",
        "kiln eager/replayed",
        "device/replayed+ws",
    ];
    println!("PyTorch {} on {}:", rec.torch.as_deref().unwrap_or("?"), rec.device.as_deref().unwrap_or("?"));
    println!("{}", render_table(&headers, &rows));
    Ok(())
}

/// What `kiln memory` prints besides its table.
struct Shown<'a> {
    /// Where to write the plan's picture.
    svg: Option<&'a Path>,
    /// Whether to print every step.
    steps: bool,
    /// PyTorch's recorded stream for the step, `FILE[:MODEL]`.
    stream: Option<&'a str>,
}

/// A recorded stream (`--pytorch-stream`) replayed: where it is, the model it is of, and its
/// figures.
struct Recorded {
    path: String,
    name: String,
    replayed: kiln::torch_stream::Replayed,
}

/// The stream `arg` (`FILE` or `FILE:MODEL`) names, read and replayed before anything is
/// planned, so that a mistyped path is named at once. A recording is of a training step
/// (`mode`); a zoo model's stream is looked up by its name (`zoo`, its batch the recording's
/// only at the zoo's default) unless `FILE:MODEL` names one.
fn recorded(arg: &str, mode: Mode, zoo: Option<(&str, bool)>) -> kiln::Result<Recorded> {
    if mode != Mode::Train {
        return Err(invalid(
            format!("--pytorch-stream {arg}: a recorded stream is of a training step"),
            "pass --mode train".into(),
        ));
    }
    let (path, model) = match arg.rsplit_once(':') {
        Some((file, model)) if !Path::new(arg).exists() && Path::new(file).exists() => {
            (file, (!model.is_empty()).then_some(model))
        }
        _ => (arg, None),
    };
    let model = match (model, zoo) {
        (Some(m), _) => Some(m),
        (None, Some((name, true))) => Some(name),
        (None, Some((name, false))) => {
            return Err(invalid(
                format!("--pytorch-stream {arg}: {name} is planned at a batch of its own, not the zoo's"),
                format!("name the recording's model, {arg}:{name}, if it was recorded at that batch"),
            ));
        }
        (None, None) => None,
    };
    let (name, stream) = kiln::torch_stream::load(Path::new(path), model)?;
    let replayed = kiln::torch_stream::figures(&stream)?;
    Ok(Recorded { path: path.to_string(), name, replayed })
}

/// The table of `row`, with PyTorch's recorded stream (`--pytorch-stream`) replayed beside it
/// where one is given: a recorded stream is PyTorch's own op stream, where the eager columns
/// are kiln's op stream under PyTorch's allocator, which differs from it at real scale (kiln's
/// ops keep what its own kernels keep).
fn print_memory(row: &mut kiln::compare::Comparison, recorded: Option<Recorded>) {
    let Some(Recorded { path, name, replayed }) = recorded else {
        println!("{}", table(std::slice::from_ref(row)));
        return;
    };
    row.pytorch_replayed = Some(replayed);
    println!("{}", table(std::slice::from_ref(row)));
    println!(
        "eager: PyTorch's recorded stream ({path}, {name}) replayed through the caching allocator: reserved {} B \
         ({} B with cuBLAS's workspaces), in use {} B; device bytes / replayed with workspaces {:.3}; \
         kiln's own eager stream (the eager caching column) / replayed {:.3}",
        kiln::report::bytes(replayed.peak_reserved),
        kiln::report::bytes(replayed.workspace_peak_reserved),
        kiln::report::bytes(replayed.peak_in_use),
        row.device_over_replayed().unwrap_or(f64::NAN),
        row.eager_over_replayed().map_or(f64::NAN, |(reserved, _)| reserved),
    );
}

/// `--precision`'s value, or an error naming it.
fn precision_flag(value: &str) -> kiln::Result<kiln::compiler::Precision> {
    value.parse().map_err(|why: String| {
        invalid(format!("--precision {value}: {why}"), "pass --precision f32, bf16 or f16".into())
    })
}

/// " in bf16 mixed precision" for a half precision, nothing for f32.
fn in_precision(precision: kiln::compiler::Precision) -> String {
    if precision == kiln::compiler::Precision::F32 {
        String::new()
    } else {
        format!(" in {precision} mixed precision (master weights f32)")
    }
}

/// The line under a mixed-precision plan's table: the precision and its buffers by type.
fn print_precision(plan: &kiln::compiler::Plan, precision: kiln::compiler::Precision) {
    if precision != kiln::compiler::Precision::F32 {
        println!("precision {precision} (master weights f32): {}", kiln::compare::buffers_by_dtype(plan));
    }
}

fn memory(
    name: &str,
    mode: &str,
    batch: Option<usize>,
    shown: &Shown,
    precision: kiln::compiler::Precision,
) -> kiln::Result<()> {
    let Shown { svg, steps, .. } = *shown;
    let names: Vec<&str> = zoo::all().iter().map(|m| m.name).collect();
    let Some(mut m) = zoo::by_name(name) else {
        return Err(invalid(format!("no zoo model `{name}`"), format!("choose one of {names:?}")));
    };
    let Some(mode) = Mode::parse(mode) else {
        return Err(invalid(format!("no mode `{mode}`"), "choose forward or train".into()));
    };
    if let Some(b) = batch {
        if b == 0 {
            return Err(invalid(
                "--batch 0: a batch needs at least one row".into(),
                "pass --batch 1 or more".into(),
            ));
        }
        m = m.with_batch(b);
    }
    let default_batch = zoo::by_name(name).is_some_and(|d| d.batch == m.batch);
    let stream = shown.stream.map(|arg| recorded(arg, mode, Some((m.name, default_batch)))).transpose()?;
    let mut row = kiln::compare::compare_at(&m, mode, true, precision)?;
    if steps {
        println!("{}", row.plan.render());
    }
    print_memory(&mut row, stream);
    print_precision(&row.plan, precision);
    if let Some(path) = svg {
        let title = format!("{} {} (batch {})", m.name, mode.name(), m.batch);
        std::fs::write(path, kiln::svg::plan_svg(&row.plan, Some(&row.bfc_samples), &title))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// `kiln memory model.onnx`: the imported model's forward pass, or a training step of it (MSE
/// against targets of its output's shape, Adam), planned and compared with eager execution.
/// `--batch N` sizes every input's symbolic first axis, `--dim NAME=N` any symbolic axis.
fn memory_onnx(
    path: &str,
    mode: &str,
    batch: Option<usize>,
    dims: &[String],
    shown: &Shown,
    devices: &[String],
    precision: kiln::compiler::Precision,
) -> kiln::Result<()> {
    let Shown { svg, steps, .. } = *shown;
    let Some(mode) = Mode::parse(mode) else {
        return Err(invalid(format!("no mode `{mode}`"), "choose forward or train".into()));
    };
    let file = read_model(path)?;
    // The flags are checked before the file is decoded, so that a mistyped one is named first.
    kiln::onnx::train::flags(batch, dims)?;
    let mut specs = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let Some((name, size)) = d.split_once('=') else {
            return Err(invalid(format!("--device {d}"), "write DEVICE=SIZE, e.g. gpu:0=24GB".into()));
        };
        let bytes = kiln::runtime::devices::parse_bytes(size).map_err(|e| in_flag("--device", d, e))?;
        specs.push(kiln::compiler::device::DeviceSpec::new(i as u32, name).with_limit(bytes));
    }
    let stream = shown.stream.map(|arg| recorded(arg, mode, None)).transpose()?;
    // Read once: decoded, checked, its external data mapped from the file's directory.
    let model = kiln::onnx::OnnxModel::from_bytes_at(&file, path)?;
    let sizes = kiln::onnx::train::sizes(&model, batch, dims)?;
    let graph = match mode {
        Mode::Forward => {
            let mut graph = model.import(&sizes)?.graph;
            kiln::compiler::step::prepare_forward(&mut graph, precision)?;
            graph
        }
        // A training step of the model as a layer, with a mean-squared-error loss against
        // targets of its output's shape and Adam: what a fine-tuning step holds in memory. A
        // model of several inputs (ids, masks) is the layer `kiln train` trains: its inputs
        // packed into one batch.
        Mode::Train => {
            let (x, y) = kiln::onnx::train::specs(&model, &sizes)?;
            let layer = model.clone().into_packed_layer(&sizes)?;
            let config = kiln::onnx::train::fine_tuning();
            kiln::compiler::step::train_step_graph_with(&layer, x, &y, &config, 1, precision)?
        }
    };
    let feeds = kiln::compare::feeds_for(&graph, 1)?;
    let feed: Vec<(&str, &kiln::runtime::HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    // The eager allocators replay the op stream's allocations on virtual memory: the figures
    // do not depend on values, and a VGG-19 training step at batch 32 is not run on the host.
    let mut row = kiln::compare::compare_graph(path, graph, &feed, false)?;
    if steps {
        println!("{}", row.plan.render());
    }
    print_memory(&mut row, stream);
    print_precision(&row.plan, precision);
    if let Some(out) = svg {
        let title = format!("{path} {} (batch {})", mode.name(), row.batch);
        std::fs::write(out, kiln::svg::plan_svg(&row.plan, Some(&row.bfc_samples), &title))?;
        println!("wrote {}", out.display());
    }
    if !specs.is_empty() {
        print!("{}", kiln::onnx::train::fit(&model, &sizes, mode == Mode::Train, &specs)?);
    }
    Ok(())
}

/// The bytes of the model file at `path`, or an error naming it. They are read into a
/// `kiln::onnx::OnnxModel` with `from_bytes_at(&bytes, path)`, which reads the file's external
/// data from its directory.
fn read_model(path: &str) -> kiln::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        invalid(format!("cannot read the model {path}: {e}"), "check the path to the .onnx file".into())
    })
}

/// What `kiln run` reads, writes and times.
struct RunArgs<'a> {
    input: &'a [PathBuf],
    output: Option<&'a Path>,
    threads: Option<usize>,
    bench: Option<usize>,
    profile: Option<usize>,
    top: usize,
}

/// `kiln run model.onnx`: the forward pass on inputs from files (`kiln::onnx::runner`).
fn run_onnx(
    path: &str,
    batch: Option<usize>,
    dims: &[String],
    device: Option<&str>,
    precision: kiln::compiler::Precision,
    args: RunArgs,
) -> kiln::Result<()> {
    use kiln::onnx::runner::{Runner, RunnerOptions};
    let bad = |what: String, help: &str| invalid(what, help.to_string());
    kiln::onnx::train::flags(batch, dims)?;
    for (flag, n) in [("--bench", args.bench), ("--profile", args.profile)] {
        if n == Some(0) {
            return Err(bad(format!("{flag} 0 times no run"), &format!("pass {flag} N with N at least 1")));
        }
    }
    if let Some(n) = args.threads {
        if n == 0 {
            return Err(bad("--threads 0 runs nothing".into(), "pass --threads N with N at least 1"));
        }
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().map_err(|e| {
            bad(format!("cannot start {n} threads: {e}"), "pass fewer threads, or none (one per core)")
        })?;
    }
    let (device, why) = match device {
        None => kiln::Device::best(),
        Some("cpu") => (kiln::Device::cpu(), "--device cpu".to_string()),
        Some("gpu" | "cuda") => match kiln::Device::best() {
            (d @ kiln::Device::Cuda(_), why) => (d, why),
            (_, why) => return Err(bad(format!("--device gpu: {why}"), "run on the CPU (--device cpu)")),
        },
        Some(other) => {
            return Err(bad(format!("unknown device `{other}`"), "pass --device cpu or --device gpu"));
        }
    };
    let mut feeds = std::collections::BTreeMap::new();
    for file in args.input {
        for (name, t) in kiln::onnx::tensors::read(file)? {
            if feeds.insert(name.clone(), t).is_some() {
                return Err(bad(format!("input `{name}` is in two --input files"), "pass each input once"));
            }
        }
    }
    let options =
        RunnerOptions { batch, dims: dims.to_vec(), device: device.clone(), precision, ..Default::default() };
    let started = std::time::Instant::now();
    let mut runner = Runner::open(path, &options)?;
    println!(
        "kiln: {path} on {} ({why}){}, loaded in {:.2} s",
        runner.describe(),
        in_precision(precision),
        started.elapsed().as_secs_f64()
    );
    for i in runner.inputs() {
        println!("  input  {} {} {}", i.name, i.dtype, i.shape);
    }
    let feeds: Vec<(String, kiln::runtime::HostTensor)> =
        if args.input.is_empty() { runner.random_inputs(0)? } else { feeds.into_iter().collect() };
    let fed: Vec<(&str, &kiln::runtime::HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    // Checked and converted once: the runs time the model alone.
    let feeds = runner.prepare(&fed)?;
    let fed: Vec<(&str, &kiln::runtime::HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let outputs = runner.run(&fed)?;
    for (name, t) in &outputs {
        println!("  output {name} {} {}: {}", t.dtype(), t.shape(), summary(t));
    }
    if let Some(out) = args.output {
        kiln::onnx::tensors::write(out, &outputs)?;
        println!("wrote {}", out.display());
    }
    if let Some(n) = args.bench {
        runner.run(&fed)?;
        print_times(n, "runs", || runner.run(&fed).map(drop))?;
    }
    if let Some(n) = args.profile {
        runner.run(&fed)?;
        print_profile(&runner.profile(&fed, n)?, n, args.top);
    }
    Ok(())
}

/// Times `n` calls of `once`, each alone, and prints the median and spread of their wall times.
fn print_times(n: usize, what: &str, mut once: impl FnMut() -> kiln::Result<()>) -> kiln::Result<()> {
    let mut ms = Vec::with_capacity(n);
    for _ in 0..n {
        let t = std::time::Instant::now();
        once()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
    println!(
        "{n} {what}: median {:.3} ms, min {:.3}, max {:.3}, p10-p90 {:.3}-{:.3} ms",
        at(0.5),
        ms[0],
        ms[ms.len() - 1],
        at(0.1),
        at(0.9)
    );
    Ok(())
}

/// Where a profiled run's time went: per op (kernels, milliseconds, share), then the slowest
/// kernels with the model lines they came from.
fn print_profile(rows: &[kiln::runtime::StepTime], runs: usize, top: usize) {
    let total: f64 = rows.iter().map(|r| r.ms).sum();
    let mut ops: Vec<(&str, usize, f64)> = Vec::new();
    for r in rows {
        match ops.iter_mut().find(|o| o.0 == r.op) {
            Some(o) => (o.1, o.2) = (o.1 + 1, o.2 + r.ms),
            None => ops.push((&r.op, 1, r.ms)),
        }
    }
    ops.sort_by(|a, b| b.2.total_cmp(&a.2));
    println!(
        "profile: {} kernels, {total:.3} ms in all (medians of {runs} runs, each kernel timed alone)",
        rows.len()
    );
    let share = |ms: f64| if total > 0.0 { 100.0 * ms / total } else { 0.0 };
    for (op, count, ms) in &ops {
        println!("  {ms:10.3} ms {:5.1}%  {count:5} x {op}", share(*ms));
    }
    let mut slowest: Vec<&kiln::runtime::StepTime> = rows.iter().collect();
    slowest.sort_by(|a, b| b.ms.total_cmp(&a.ms));
    println!("slowest kernels:");
    for r in slowest.iter().take(top) {
        println!("  {:10.3} ms {:5.1}%  step {:4} {} ({})", r.ms, share(r.ms), r.step, r.kernel, r.label);
    }
}

/// The first values of `t`, and its mean.
fn summary(t: &kiln::runtime::HostTensor) -> String {
    let data = t.data();
    let first: Vec<String> = data.iter().take(4).map(|v| format!("{v:.6}")).collect();
    let mean = data.iter().map(|&v| f64::from(v)).sum::<f64>() / data.len().max(1) as f64;
    format!("[{}{}] mean {mean:.6}", first.join(", "), if data.len() > 4 { ", ..." } else { "" })
}

/// `kiln train`'s flags.
struct TrainArgs<'a> {
    batch: usize,
    steps: usize,
    dims: &'a [String],
    data: Option<&'a Path>,
    cpu: bool,
    precision: kiln::compiler::Precision,
    bench: Option<usize>,
}

/// `kiln train model.onnx`: the imported model trained as a layer (`kiln::onnx::train`).
fn train_onnx(path: &str, args: TrainArgs) -> kiln::Result<()> {
    let TrainArgs { batch, steps, dims, data, cpu, precision, bench } = args;
    if bench == Some(0) {
        return Err(invalid("--bench 0 times no step".into(), "pass --bench N with N at least 1".into()));
    }
    let bytes = read_model(path)?;
    // The flags and the data are checked before the file is decoded.
    kiln::onnx::train::flags(Some(batch), dims)?;
    // One tensor per model input, named as the model's inputs (`x` for a model of one), and `y`.
    let data = data.map(kiln::onnx::train::read_data).transpose()?;
    // Read once: decoded, checked, its external data mapped from the file's directory.
    let model = kiln::onnx::OnnxModel::from_bytes_at(&bytes, path)?;
    let sizes = kiln::onnx::train::sizes(&model, Some(batch), dims)?;
    let (device, why) = if cpu { (Device::cpu(), "--cpu".to_string()) } else { Device::best() };
    println!("kiln: training {path} on {device} ({why}){}", in_precision(precision));
    let mut run = kiln::onnx::train::train_in(&model, &sizes, steps, &device, data, precision, |i, loss| {
        println!("step {:>4}: loss {loss:.6}", i + 1);
    })?;
    print!("{}", kiln::onnx::train::summary(&run));
    if let Some(n) = bench {
        print_times(n, "more steps", || run.step().map(drop))?;
    }
    Ok(())
}

fn devices(
    limit: &[String],
    growth: &[String],
    fraction: &[String],
    logical: &[String],
    seed: bool,
    visible: Option<&str>,
) -> kiln::Result<()> {
    use kiln::runtime::devices::{DeviceConfig, parse_bytes};
    if let Some(v) = visible {
        let names: Vec<&str> = v.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
        kiln::runtime::visible::set_visible_devices(&names)?;
    }
    let pair = |s: &str| -> kiln::Result<(String, String)> {
        s.split_once('=')
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .ok_or_else(|| invalid(format!("`{s}` is not DEVICE=VALUE"), "write e.g. gpu:0=5000MB".into()))
    };
    let mut config = DeviceConfig::detect();
    for l in limit {
        let (d, v) = pair(l)?;
        config = config.set_memory_limit(&d, parse_bytes(&v).map_err(|e| in_flag("--limit", l, e))?);
    }
    for d in growth {
        config = config.set_memory_growth(d, true);
    }
    for f in fraction {
        let (d, v) = pair(f)?;
        let f = v
            .parse::<f64>()
            .map_err(|_| invalid(format!("`{v}` is not a fraction"), "write e.g. 0.75".into()))?;
        config = config.set_memory_fraction(&d, f);
    }
    for l in logical {
        let (d, v) = pair(l)?;
        let sizes = v
            .split(',')
            .map(|size| parse_bytes(size).map_err(|e| in_flag("--logical", l, e)))
            .collect::<kiln::Result<Vec<_>>>()?;
        config = config.set_logical_devices(&d, &sizes);
    }
    if !config.has_gpu() {
        println!("no CUDA device: {}", kiln::Device::best().1);
    }
    println!("CUDA: {}", kiln::runtime::cuda::probe().versions());
    let devices = config.build()?;
    if seed {
        let (x, y) = seed::data(42);
        for d in devices.logical() {
            let names = [d.name.as_str()];
            let backend = devices.backend(&names, 7)?;
            let mut trainer = kiln::runtime::Trainer::new(zoo::seed_mlp(), zoo::seed_config(), backend)
                .with_options(devices.compile_options(&names)?);
            let opts =
                kiln::runtime::FitOptions { epochs: 5, batch_size: 32, verbose: false, ..Default::default() };
            let h = trainer.fit(&x, &y, &opts)?;
            let last = h.epochs.last().map(kiln::runtime::trainer::format_logs).unwrap_or_default();
            println!("seed model on {}: {last}", d.name);
        }
    }
    print!("{}", devices.table());
    Ok(())
}

/// A mistake in the value of `flag`: the message starts with the flag and its argument.
fn in_flag(flag: &str, arg: &str, e: kiln::runtime::RuntimeError) -> kiln::Error {
    match e {
        kiln::runtime::RuntimeError::Invalid { what, help } => invalid(format!("{flag} {arg}: {what}"), help),
        other => other.into(),
    }
}

/// One rank's losses, weights' bits and planned total.
type RankRun = (Vec<f32>, Vec<u32>, usize);

/// `kiln ranks`: a zoo model's training step on `ranks` in-process ranks through the `Trainer`,
/// every rank given the same batches; checks that the ranks' weights stay bitwise identical.
fn zoo_model(name: &str) -> kiln::Result<zoo::ZooModel> {
    let names: Vec<&str> = zoo::all().iter().map(|m| m.name).collect();
    zoo::by_name(name)
        .ok_or_else(|| invalid(format!("no zoo model `{name}`"), format!("choose one of {names:?}")))
}

fn run_zero(name: &str, max_ranks: usize) -> kiln::Result<()> {
    let m = zoo_model(name)?;
    if max_ranks == 0 || max_ranks > 4096 {
        return Err(invalid(format!("--max-ranks {max_ranks}"), "give 1 to 4096 ranks".into()));
    }
    let ranks: Vec<usize> =
        std::iter::successors(Some(1usize), |n| Some(n * 2)).take_while(|&n| n <= max_ranks).collect();
    println!(
        "{name}: one rank's training step with {} rows per rank, planned for each ZeRO stage (0: plain data parallelism, 1: optimizer state sharded, 2: and the reduced gradients)",
        m.batch
    );
    println!("{}", kiln::zero_table::render(&kiln::zero_table::rows(&m, &ranks)?));
    println!(
        "persistent: kiln's parameters and optimizer state, held between steps; ZeRO model states: the ZeRO paper's parameters + gradients + optimizer state (stage 0), + optimizer/N (1), + (gradients + optimizer)/N (2), activations not included; kiln keeps no gradient buffer (its gradients are arena values, live from their backward step to their update, inside the arena with the activations); sent: ring-algorithm bytes (all-reduce 2(N-1)/N, reduce-scatter and all-gather (N-1)/N of the buffer)"
    );
    Ok(())
}

fn run_ranks(ranks: usize, name: &str, steps: usize, zero: usize) -> kiln::Result<()> {
    let m = zoo_model(name)?;
    let stage = kiln::compiler::zero::ZeroStage::from_number(zero)
        .ok_or_else(|| invalid(format!("--zero {zero}"), "use ZeRO stage 0, 1 or 2".into()))?;
    if ranks == 0 || ranks > m.batch {
        return Err(invalid(
            format!("{ranks} ranks for {name}'s batch of {}", m.batch),
            "use 1 to as many ranks as the batch has rows".into(),
        ));
    }
    let batches: Vec<_> = (0..steps as u64).map(|i| m.batch_data(20 + i)).collect::<kiln::Result<_>>()?;
    // A batch the rank count does not divide is padded by repeating its first rows (`Trainer`).
    let per_rank = m.batch.div_ceil(ranks);
    let padded =
        if m.batch % ranks == 0 { String::new() } else { format!(" (padded to {})", per_rank * ranks) };
    println!("{name}: {ranks} ranks x {per_rank} rows of each batch of {}{padded}, {steps} steps", m.batch);
    let results = kiln::comm::run_local_ranks(ranks, |_, comm| -> kiln::Result<RankRun> {
        let backend = Box::new(kiln::runtime::CpuBackend::new(1).with_communicator(comm));
        let mut t = kiln::runtime::Trainer::new(m.model(), m.config(), backend).with_zero_stage(stage);
        let mut losses = Vec::new();
        for (x, y) in &batches {
            losses.push(t.train_step(x, y)?.loss);
        }
        let plan = t.plans()[0].clone();
        let weights = plan
            .variables
            .iter()
            .filter(|v| !v.key.starts_with("optimizer/"))
            .map(|v| t.backend().read_variable(&v.key))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let bits = weights.iter().flat_map(|w| w.data().iter().map(|v| v.to_bits())).collect();
        Ok((losses, bits, plan.memory.planned_total_bytes()))
    });
    let results = results.into_iter().collect::<kiln::Result<Vec<_>>>()?;
    for (i, loss) in results[0].0.iter().enumerate() {
        println!("step {i}: loss {loss:.6} (the whole batch's, the same on every rank)");
    }
    let same = results.iter().all(|r| r.1 == results[0].1);
    println!("weights bitwise identical on all {ranks} ranks: {same}");
    // Per-rank memory: the plan one rank runs here against one process on the whole batch.
    let mut rows = Vec::new();
    for (n, m) in [(1, m.clone()), (ranks, m.clone().with_batch(per_rank))] {
        let mut graph =
            kiln::compiler::step::train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?;
        if n > 1 {
            let shard = kiln::compiler::ir::Shard { ranks: n, rank: 0 };
            kiln::compiler::zero::shard_optimizer_state(&mut graph, stage, shard)?;
        }
        let plan = kiln::compiler::compile(graph, &kiln::compiler::CompileOptions::default())?;
        let reduces: Vec<_> = plan.steps.iter().filter(|s| s.op.is_collective()).collect();
        let reduced: usize = reduces
            .iter()
            .map(|s| plan.values[s.inputs[0]].shape.numel() * plan.values[s.inputs[0]].dtype.size_bytes())
            .sum();
        let b = kiln::report::bytes;
        rows.push(vec![
            n.to_string(),
            m.batch.to_string(),
            b(plan.memory.arena_bytes),
            b(plan.memory.planned_total_bytes()),
            b(plan.device_bytes(kiln::compiler::plan::DEVICE_GRANULARITY)),
            format!("{} / {}", reduces.len(), b(reduced)),
        ]);
    }
    println!(
        "{}",
        kiln::report::render_table(
            &[
                "ranks",
                "batch/rank",
                "arena",
                "planned total/rank",
                "device bytes/rank",
                "collectives / bytes a step"
            ],
            &rows
        )
    );
    println!(
        "as processes, one rank each (OpenMPI: bash scripts/setup-mpi.sh):\n  cargo build --release --features mpi --example mpi_train\n  mpirun -np {ranks} target/release/examples/mpi_train"
    );
    if !same {
        return Err(invalid("the ranks' weights differ".into(), "report this as a bug".into()));
    }
    Ok(())
}

fn invalid(what: String, help: String) -> kiln::Error {
    kiln::Error::Runtime(kiln::runtime::RuntimeError::invalid(what, help))
}

fn run_seed(
    verbose: bool,
    svg: Option<&Path>,
    ranks: usize,
    precision: kiln::compiler::Precision,
) -> kiln::Result<()> {
    let (device, why) = Device::best();
    if ranks == 0 || ranks > 32 {
        return Err(invalid(
            format!("--ranks {ranks}"),
            "give 1 to 32 ranks (each takes its share of the seed model's batches of 32)".into(),
        ));
    }
    let start = Instant::now();
    let run = if ranks == 1 {
        println!("kiln: training the seed model on {device} ({why}){}", in_precision(precision));
        seed::run_in(&device, verbose, precision)?
    } else {
        println!(
            "kiln: training the seed model on {ranks} in-process ranks on {device} ({why}){}",
            in_precision(precision)
        );
        let (run, same) = seed::run_ranks_in(&device, ranks, verbose, precision)?;
        println!("weights bitwise identical on all {ranks} ranks: {same}");
        if !same {
            return Err(invalid(
                "the ranks' weights differ".into(),
                "report this: data parallelism must keep every rank's weights the same".into(),
            ));
        }
        run
    };
    print!("{}", seed::summary(&run, start.elapsed()));
    if let Some(path) = svg {
        seed::write_svg(path)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// "M,K,N;M,K,N..." as products, each dimension a positive integer.
fn parse_shapes(text: &str) -> kiln::Result<Vec<(usize, usize, usize)>> {
    text.split(';')
        .filter(|s| !s.trim().is_empty())
        .map(|s| {
            let dims: Vec<usize> =
                s.split(',').filter_map(|d| d.trim().parse().ok()).filter(|&d| d > 0).collect();
            match dims[..] {
                [m, k, n] if s.split(',').count() == 3 => Ok((m, k, n)),
                _ => Err(invalid(
                    format!("bench-gemm: `{s}` is not a product M,K,N of three positive integers"),
                    "write --shapes 4096,4096,4096;256,784,1024".into(),
                )),
            }
        })
        .collect()
}
