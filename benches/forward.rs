//! `cargo bench --bench forward`: kiln's forward pass against onnxruntime's CPU provider on the
//! real-scale architectures (`scripts/realscale/models.py`: torchvision's ResNet-50,
//! EfficientNet-B0, MobileNetV3-small and ViT-B/16, transformers' GPT-2 small and BERT-base on
//! 256 tokens; random weights), exported for inference at batch 2 (`export.py --eval`: opset 17,
//! batch norm with its running statistics, dropout off).
//!
//! Both run the same file on the same inputs (floats uniform in [0, 1), ids uniform in
//! [0, 1000), masks 1), written once to an .npz: kiln through `kiln::onnx::runner::Runner` (as
//! `kiln run` does), onnxruntime through `scripts/peers/ort_forward.py` (every graph
//! optimisation on, its default). Each round times kiln's runs, then onnxruntime's (each after a
//! warm-up: two runs, and for kiln at least 100 ms of them, as onnxruntime loads the model
//! just before its own), and the ratio of their medians; the table shows the median of the rounds' ratios
//! and each side's median time, with the largest difference of the outputs relative to
//! onnxruntime's largest magnitude. Threads: each count of `KILN_FORWARD_THREADS` (`1,2` by
//! default) on both sides, kiln's runs inside a rayon pool of that many threads and
//! onnxruntime's intra-op pool (one inter-op thread).
//!
//! `KILN_FORWARD_MODELS=resnet50,gpt2` picks models, `KILN_FORWARD_ROUNDS` (3) and
//! `KILN_FORWARD_RUNS` (3) size the rounds. Exports are kept under target/kiln/realscale; the
//! interpreters are `kiln::peers::realscale_python` (the export) and `kiln::peers::ort_python`.

use kiln::onnx::runner::{Runner, RunnerOptions};
use kiln::onnx::tensors;
use kiln::prelude::*;
use kiln::report::{env_count, median};
use rand::{RngExt, SeedableRng};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;

const MODELS: [&str; 6] = ["resnet50", "efficientnet_b0", "mobilenet_v3_small", "vit_b_16", "gpt2", "bert"];
const BATCH: usize = 2;
/// The least time kiln's runs warm up for in each round (and at least two runs).
const WARM_UP: std::time::Duration = std::time::Duration::from_millis(100);

#[derive(Serialize)]
struct Row {
    model: String,
    batch: usize,
    threads: usize,
    kiln_ms: f64,
    ort_ms: f64,
    /// kiln / onnxruntime, the median of the rounds' ratios.
    ratio: f64,
    rounds: Vec<f64>,
    /// The largest |kiln - onnxruntime| over onnxruntime's largest magnitude, over every output.
    difference: f64,
    ort_version: String,
}

/// A job and its result crossing to a pool thread while this one waits for it (`install`
/// blocks): the runner it uses (its backend is not `Send`) is used by one thread at a time.
struct Blocking<T>(T);
// SAFETY: `ThreadPool::install` runs the job on one pool thread and returns only when it has
// finished; the caller does nothing meanwhile, so nothing the job borrows is shared.
unsafe impl<T> Send for Blocking<T> {}

/// Inputs for `runner`'s model: floats uniform in [0, 1), ids uniform in [0, 1000), masks 1.
fn inputs(runner: &Runner) -> kiln::Result<Vec<(String, HostTensor)>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    runner
        .inputs()
        .iter()
        .map(|i| {
            let n = i.shape.numel();
            let t = match i.dtype {
                DType::F32 => {
                    HostTensor::new(i.shape.clone(), (0..n).map(|_| rng.random_range(0.0f32..1.0)).collect())?
                }
                _ if i.name.contains("mask") => HostTensor::from_i64(i.shape.clone(), vec![1; n])?,
                _ => HostTensor::from_i64(
                    i.shape.clone(),
                    (0..n).map(|_| rng.random_range(0..1000)).collect(),
                )?,
            };
            Ok((i.name.clone(), t))
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let counts: Vec<usize> = std::env::var("KILN_FORWARD_THREADS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .filter_map(|t| t.trim().parse().ok())
        .filter(|&t| t > 0)
        .collect();
    let rounds = env_count("KILN_FORWARD_ROUNDS", 3);
    let runs = env_count("KILN_FORWARD_RUNS", 3);
    // One pool per thread count: kiln's runs go inside it (`install`), its kernels' parallel
    // loops then split over that pool.
    let pools = counts
        .iter()
        .map(|&t| rayon::ThreadPoolBuilder::new().num_threads(t).build().map(|p| (t, p)))
        .collect::<Result<Vec<_>, _>>()?;
    let picked: Vec<String> = std::env::var("KILN_FORWARD_MODELS")
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_else(|_| MODELS.iter().map(|m| m.to_string()).collect());
    let (python, ort) = match (kiln::peers::realscale_python(), kiln::peers::ort_python()) {
        (Ok(p), Ok(o)) => (p, o),
        (Err(why), _) | (_, Err(why)) => {
            println!("skipped: {why}");
            return Ok(());
        }
    };
    let exports = kiln::report::output_dir().join("realscale");
    let dir = exports.join(format!("batch{BATCH}"));
    let mut rows = Vec::new();
    for name in MODELS.iter().filter(|m| picked.iter().any(|p| p == *m)) {
        let path = match kiln::peers::realscale_export(&python, &exports, name, BATCH, true) {
            Ok(p) => p,
            Err(why) => {
                println!("{name}: skipped: {why}");
                continue;
            }
        };
        let started = Instant::now();
        let mut runner = Runner::open(&path, &RunnerOptions::default())?;
        let fed = inputs(&runner)?;
        let feeds = dir.join(format!("{name}-inputs.npz"));
        let theirs = dir.join(format!("{name}-ort.npz"));
        tensors::write(&feeds, &fed)?;
        let fed: Vec<(&str, &HostTensor)> = fed.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let prepared = runner.prepare(&fed)?;
        let fed: Vec<(&str, &HostTensor)> = prepared.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let ours = runner.run(&fed)?;
        eprintln!("{name}: loaded and run once in {:.1} s", started.elapsed().as_secs_f64());
        let reference = |theirs: &Path| -> Result<f64, Box<dyn std::error::Error>> {
            let reference = tensors::read(theirs)?;
            let mut difference = 0.0f64;
            for (out, t) in &ours {
                let want =
                    reference.get(out).ok_or_else(|| format!("{name}: onnxruntime has no output {out}"))?;
                let scale = want.data().iter().fold(f32::MIN_POSITIVE, |m, v| m.max(v.abs()));
                let most = t.data().iter().zip(want.data()).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
                difference = difference.max(f64::from(most / scale));
            }
            Ok(difference)
        };
        for (threads, pool) in &pools {
            let threads = *threads;
            let (mut ratios, mut kiln_ms, mut ort_ms, mut version) =
                (Vec::new(), Vec::new(), Vec::new(), String::new());
            for _ in 0..rounds {
                let job = Blocking(|| -> kiln::Result<Vec<f64>> {
                    // Warmed up as onnxruntime's side is (the model loaded just before its two
                    // warm-up runs): two runs and at least `WARM_UP`, so that the pool is awake
                    // again after the pause the other side's runs made.
                    let warm = Instant::now();
                    for n in 0.. {
                        if n >= 2 && warm.elapsed() >= WARM_UP {
                            break;
                        }
                        runner.run(&fed)?;
                    }
                    let mut ms = Vec::new();
                    for _ in 0..runs {
                        let t = Instant::now();
                        runner.run(&fed)?;
                        ms.push(t.elapsed().as_secs_f64() * 1e3);
                    }
                    Ok(ms)
                });
                let ms = pool
                    .install(move || {
                        let mut job = job;
                        Blocking((job.0)())
                    })
                    .0?;
                let k = median(ms);
                let (v, theirs_ms) = kiln::peers::ort_forward(&ort, &path, (&feeds, &theirs), threads, runs)?;
                let o = median(theirs_ms);
                version = v;
                ratios.push(k / o);
                kiln_ms.push(k);
                ort_ms.push(o);
            }
            let row = Row {
                model: name.to_string(),
                batch: BATCH,
                threads,
                kiln_ms: median(kiln_ms),
                ort_ms: median(ort_ms),
                ratio: median(ratios.clone()),
                rounds: ratios,
                difference: reference(&theirs)?,
                ort_version: version,
            };
            eprintln!(
                "{name}, {threads} thread(s): kiln {:.1} ms, onnxruntime {:.1} ms, {:.2}x",
                row.kiln_ms, row.ort_ms, row.ratio
            );
            rows.push(row);
        }
    }
    println!(
        "| model, batch | threads | kiln ms | onnxruntime ms | kiln / onnxruntime | by round | outputs apart |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|");
    for r in &rows {
        let by: Vec<String> = r.rounds.iter().map(|x| format!("{x:.2}")).collect();
        println!(
            "| {}, {} | {} | {:.1} | {:.1} | {:.2} | {} | {:.1e} |",
            r.model,
            r.batch,
            r.threads,
            r.kiln_ms,
            r.ort_ms,
            r.ratio,
            by.join(" "),
            r.difference
        );
    }
    kiln::results::write("forward", "cpu", &rows)?;
    Ok(())
}
