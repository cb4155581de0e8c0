//! `cargo bench --bench training`: one training step of the real-scale architectures on the
//! CPU, kiln against PyTorch eager and `torch.compile` on the same machine in one run.
//!
//! The models are those of `scripts/realscale/models.py` (torchvision's ResNet-50,
//! EfficientNet-B0, MobileNetV3-small and ViT-B/16, transformers' GPT-2 small and BERT-base on
//! 256 tokens; random weights, dropout off) at batch `KILN_TRAINING_BATCH` (2: the batches
//! they train at, 4 to 32, take seconds to tens of seconds a step on one core; the batch is the
//! same on both sides). The step is the same on both sides: the
//! model's output against a standard-normal target of its shape by mean squared error, the
//! gradients, and Adam (lr 1e-3, eps 1e-7). kiln trains the training-mode ONNX export
//! (`scripts/realscale/export.py --batch B`: batch norm on batch statistics) as `kiln train`
//! does (`kiln::onnx::train::train_in`); PyTorch trains the module the export was made from
//! (`scripts/peers/torch_speed.py --realscale`: `Adam(foreach=True)`,
//! `zero_grad(set_to_none=True)`), eagerly and compiled (inductor's C++ backend, the model and
//! `opt.step`).
//!
//! Each round times `KILN_TRAINING_STEPS` (3) of kiln's steps, then as many of PyTorch's eager
//! steps in a fresh process (its import, model build and 3 warm-up steps untimed); the table
//! shows the median of the rounds' ratios of medians (`KILN_TRAINING_ROUNDS`, 2). The compiled
//! steps are timed once, after the rounds (compilation takes minutes and is not timed);
//! `KILN_TRAINING_COMPILE=0` skips them. Threads: `KILN_TRAINING_THREADS` (1) on both sides,
//! kiln's rayon pool and `torch.set_num_threads`. `KILN_TRAINING_MODELS=resnet50,gpt2` picks
//! models. Exports are kept under target/kiln/realscale.

use kiln::prelude::*;
use kiln::report::{env_count, median};
use serde::Serialize;
use std::time::Instant;

const MODELS: [&str; 6] = ["resnet50", "efficientnet_b0", "mobilenet_v3_small", "vit_b_16", "gpt2", "bert"];

#[derive(Serialize)]
struct Row {
    model: String,
    batch: usize,
    threads: usize,
    kiln_ms: f64,
    torch_eager_ms: f64,
    /// kiln / PyTorch eager, the median of the rounds' ratios.
    over_eager: f64,
    rounds: Vec<f64>,
    torch_compile_ms: Option<f64>,
    over_compile: Option<f64>,
    /// Why the compiled column is empty, where it is.
    compile_note: Option<String>,
    torch_version: String,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batch = env_count("KILN_TRAINING_BATCH", 2);
    let steps = env_count("KILN_TRAINING_STEPS", 3);
    let rounds = env_count("KILN_TRAINING_ROUNDS", 2);
    let threads = env_count("KILN_TRAINING_THREADS", 1);
    let compiled = std::env::var("KILN_TRAINING_COMPILE").map_or(true, |v| v != "0");
    let models: Vec<String> = match std::env::var("KILN_TRAINING_MODELS") {
        Ok(list) => list.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect(),
        Err(_) => MODELS.iter().map(|s| s.to_string()).collect(),
    };
    let python = match kiln::peers::realscale_python() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: {why}");
            return Ok(());
        }
    };
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global()?;
    let dir = kiln::report::output_dir().join("realscale");
    let mut rows = Vec::new();
    for name in &models {
        let path = kiln::peers::realscale_export(&python, &dir, name, batch, false)?;
        let started = Instant::now();
        let model = kiln::onnx::OnnxModel::open(&path)?;
        let sizes = kiln::onnx::train::sizes(&model, None, &[])?;
        // Two untimed steps: compilation, weight loading and the first touch of the arena.
        let mut run =
            kiln::onnx::train::train_in(&model, &sizes, 2, &Device::cpu(), None, Precision::F32, |_, _| {})?;
        println!("{name}: compiled and stepped twice in {:.1} s", started.elapsed().as_secs_f64());
        let (mut ratios, mut kiln_all, mut eager_all, mut version) =
            (Vec::new(), Vec::new(), Vec::new(), String::new());
        for _ in 0..rounds {
            let mut kiln_ms = Vec::with_capacity(steps);
            for _ in 0..steps {
                let start = Instant::now();
                run.step()?;
                kiln_ms.push(start.elapsed().as_secs_f64() * 1e3);
            }
            let torch = kiln::peers::realscale_torch_step_times(&python, name, batch, steps, threads, false)?;
            version = torch.version;
            ratios.push(median(kiln_ms.clone()) / median(torch.ms.clone()));
            kiln_all.extend(kiln_ms);
            eager_all.extend(torch.ms);
        }
        let (kiln_ms, eager_ms) = (median(kiln_all), median(eager_all));
        let (mut compile_ms, mut compile_note) = (None, None);
        if compiled {
            match kiln::peers::realscale_torch_step_times(&python, name, batch, steps, threads, true) {
                Ok(t) => compile_ms = Some(median(t.ms)),
                Err(e) => compile_note = Some(e.to_string().lines().last().unwrap_or_default().to_string()),
            }
        }
        let over_eager = median(ratios.clone());
        println!(
            "{name}: kiln {kiln_ms:.1} ms, PyTorch eager {eager_ms:.1} ms ({over_eager:.2}x){}",
            compile_ms.map_or(String::new(), |c| format!(", torch.compile {c:.1} ms ({:.2}x)", kiln_ms / c))
        );
        rows.push(Row {
            model: name.clone(),
            batch,
            threads,
            kiln_ms,
            torch_eager_ms: eager_ms,
            over_eager,
            rounds: ratios,
            torch_compile_ms: compile_ms,
            over_compile: compile_ms.map(|c| kiln_ms / c),
            compile_note,
            torch_version: version,
        });
    }
    println!(
        "\n| model, batch | threads | kiln ms | PyTorch eager ms | kiln / eager | per round | torch.compile ms | kiln / compile |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let by: Vec<String> = r.rounds.iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "| {}, {} | {} | {:.1} | {:.1} | {:.2} | {} | {} | {} |",
            r.model,
            r.batch,
            r.threads,
            r.kiln_ms,
            r.torch_eager_ms,
            r.over_eager,
            by.join(" "),
            r.torch_compile_ms.map_or("-".into(), |c| format!("{c:.1}")),
            r.over_compile
                .map_or_else(|| r.compile_note.clone().unwrap_or("-".into()), |x| format!("{x:.2}")),
        );
    }
    kiln::results::write("training", "cpu", &rows)?;
    Ok(())
}
