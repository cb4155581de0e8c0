//! A small GPT trained on real English text, byte by byte: `cargo run --release --example gpt`.
//!
//! The text: a path if one is given (`cargo run --release --example gpt -- path/to/any.txt`);
//! else the King James Bible (public domain, 4.3 MB of English) where Debian's `bible-kjv`
//! package is installed (`sudo apt-get install bible-kjv`: its `bible` program prints the text,
//! the verse references are dropped); else `examples/data/shakespeare.txt` in the repository
//! (200 KB of Shakespeare's plays, public domain, from the tinyshakespeare corpus). A byte-level
//! tokenizer (every byte its own token, 256 of them), 90% of the text to train on and the last
//! 10% held out. The model: token and position embeddings, `LAYERS` pre-LN blocks of causal
//! multi-head attention and a tanh-GELU MLP, a final layer norm and a head over the 256 bytes,
//! trained with the sparse cross-entropy on the ids (i32 token ids in, no one-hot anywhere) and
//! Adam.
//!
//! It trains for `KILN_GPT_SECONDS` seconds (90 by default) with a progress bar (loss and
//! tokens/s), evaluates the held-out loss against the unigram baseline (the entropy of the
//! training text's byte frequencies: what a model that ignores context can reach), samples text,
//! saves a checkpoint and loads it into a fresh trainer (which must give the same held-out loss,
//! bit for bit), and prints the planned-vs-eager memory report of its training step, then the
//! step's arena computed in 2, 4 and 8 blocks of batch rows (`Trainer::with_row_blocks`;
//! `KILN_GPT_BLOCKS=4` trains that way). `KILN_GPT_PRECISION=bf16` (or `f16`) trains in mixed
//! precision (`Trainer::with_precision`: products in the half type, master weights and Adam's
//! state f32) and reports that step's memory.

use indicatif::{ProgressBar, ProgressStyle};
use kiln::compiler::ir::DType;
use kiln::compiler::step::{InputSpec, train_step_graph_with};
use kiln::gpt::{BATCH, SEQ, VOCAB, config, model, windows};
use kiln::prelude::*;
use kiln::runtime::RuntimeError;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::time::{Duration, Instant};

/// The entropy (nats per byte) of `text`'s byte frequencies: the loss of the best model that
/// ignores context.
fn unigram_nats(text: &[u8]) -> f64 {
    let mut counts = [0usize; VOCAB];
    text.iter().for_each(|&b| counts[b as usize] += 1);
    let n = text.len() as f64;
    counts.iter().filter(|&&c| c > 0).map(|&c| -(c as f64 / n) * (c as f64 / n).ln()).sum()
}

/// `count` bytes generated after `prompt` (at least `SEQ` bytes), sampling each from the model's
/// distribution at temperature 0.8.
fn sample(trainer: &mut Trainer, prompt: &[u8], count: usize, rng: &mut StdRng) -> Result<String> {
    let mut text = prompt.to_vec();
    for _ in 0..count {
        let window: Vec<i32> = text[text.len() - SEQ..].iter().map(|&b| i32::from(b)).collect();
        let logits = trainer.predict(&HostTensor::from_i32(Shape::new([1, SEQ]), window)?)?;
        let last = &logits.data()[(SEQ - 1) * VOCAB..SEQ * VOCAB];
        let top = last.iter().fold(f32::MIN, |a, &b| a.max(b));
        let weights: Vec<f64> = last.iter().map(|&l| (((l - top) / 0.8) as f64).exp()).collect();
        let mut pick = rng.random::<f64>() * weights.iter().sum::<f64>();
        let mut next = VOCAB - 1;
        for (b, w) in weights.iter().enumerate() {
            if pick < *w {
                next = b;
                break;
            }
            pick -= w;
        }
        text.push(next as u8);
    }
    Ok(String::from_utf8_lossy(&text[prompt.len()..]).into_owned())
}

/// The King James Bible as Debian's `bible-kjv` prints it, one verse a line without its
/// reference ("Ge1:1 In the beginning ..." -> "In the beginning ..."); None where the package
/// is not installed (or prints nothing).
fn packaged_text() -> Option<Vec<u8>> {
    let out = std::process::Command::new("bible").args(["-f", "gen1:1-rev22:21"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let mut text = Vec::with_capacity(out.stdout.len());
    for line in out.stdout.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
        let verse = line.iter().position(|&b| b == b' ').map_or(&line[..0], |i| &line[i + 1..]);
        text.extend_from_slice(verse);
        text.push(b'\n');
    }
    (text.len() > 1 << 20).then_some(text)
}

/// The text to learn and what to call it: the path given, else the packaged text, else the
/// repository's.
fn text() -> Result<(String, Vec<u8>)> {
    let path = match std::env::args().nth(1) {
        Some(path) => path,
        None => match packaged_text() {
            Some(text) => return Ok(("the King James Bible (Debian's bible-kjv)".into(), text)),
            None => return Ok(("examples/data/shakespeare.txt".into(), kiln::gpt::shakespeare()?)),
        },
    };
    let text = std::fs::read(&path).map_err(|e| {
        RuntimeError::invalid(
            format!("cannot read the text {path}: {e}"),
            "pass the path of a UTF-8 text file, or run from the repository so that examples/data is there",
        )
    })?;
    Ok((path, text))
}

fn main() -> Result<()> {
    let (path, text) = text()?;
    let seconds: u64 = std::env::var("KILN_GPT_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(90);
    let blocks: usize = std::env::var("KILN_GPT_BLOCKS").ok().and_then(|s| s.parse().ok()).unwrap_or(1);
    let precision: Precision = match std::env::var("KILN_GPT_PRECISION") {
        Ok(p) => p.parse().map_err(|why| {
            RuntimeError::invalid(format!("KILN_GPT_PRECISION={p}: {why}"), "set it to f32, bf16 or f16")
        })?,
        Err(_) => Precision::F32,
    };
    let split = text.len() * 9 / 10;
    let (train, held) = (&text[..split], &text[split..]);
    if held.len() < 2 * SEQ + 2 {
        return Err(RuntimeError::invalid(
            format!("the text {path} has {} bytes", text.len()),
            "give the example at least a few kilobytes of text",
        )
        .into());
    }
    let baseline = unigram_nats(train);
    println!(
        "text: {path}, {} bytes ({} to train on, {} held out); unigram baseline {baseline:.3} nats/byte",
        text.len(),
        train.len(),
        held.len()
    );

    let mut rng = StdRng::seed_from_u64(7);
    let (device, why) = Device::best();
    println!("device: {why}");
    let mut trainer =
        Trainer::new(model(), config(), device.backend(1)?).with_row_blocks(blocks).with_precision(precision);
    if blocks > 1 {
        println!("each step in {blocks} blocks of rows");
    }
    if precision != Precision::F32 {
        println!("{precision} mixed precision: products in {precision}, master weights and Adam's state f32");
    }
    // The held-out windows, every SEQ bytes.
    let held_offsets: Vec<usize> = (0..held.len() - SEQ - 1).step_by(SEQ).collect();
    let (hx, hy) = windows(held, &held_offsets)?;
    let before = trainer.evaluate(&hx, &hy, 64)?.loss;

    let bar = ProgressBar::new(seconds);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let start = Instant::now();
    let (mut steps, mut last) = (0usize, f32::NAN);
    while start.elapsed() < Duration::from_secs(seconds) {
        let offsets: Vec<usize> = (0..BATCH).map(|_| rng.random_range(0..train.len() - SEQ - 1)).collect();
        let (x, y) = windows(train, &offsets)?;
        last = trainer.train_step(&x, &y)?.loss;
        steps += 1;
        let elapsed = start.elapsed().as_secs_f64();
        bar.set_position(elapsed as u64);
        bar.set_message(format!(
            "step {steps}, loss {last:.3}, {:.0} tokens/s",
            (steps * BATCH * SEQ) as f64 / elapsed.max(1e-9)
        ));
    }
    bar.finish();
    let elapsed = start.elapsed().as_secs_f64();
    let after = trainer.evaluate(&hx, &hy, 64)?;
    println!(
        "trained {steps} steps of {BATCH}x{SEQ} bytes in {elapsed:.1} s ({:.0} tokens/s); last training loss {last:.3}",
        (steps * BATCH * SEQ) as f64 / elapsed
    );
    println!(
        "held-out loss {before:.3} -> {:.3} nats/byte (unigram baseline {baseline:.3}), next-byte accuracy {:.3}",
        after.loss,
        after.metric("accuracy").unwrap_or(f32::NAN)
    );

    let prompt = &held[..SEQ];
    println!(
        "\nsample after \"{}\":\n{}\n",
        String::from_utf8_lossy(prompt),
        sample(&mut trainer, prompt, 300, &mut rng)?
    );

    let checkpoint = std::env::temp_dir().join("kiln-gpt.safetensors");
    trainer.save(&checkpoint)?;
    let mut reloaded =
        Trainer::new(model(), config(), device.backend(2)?).with_row_blocks(blocks).with_precision(precision);
    let (x, y) = windows(train, &[0])?;
    reloaded.train_program(
        InputSpec::new(x.shape().clone(), x.dtype()),
        InputSpec::new(y.shape().clone(), y.dtype()),
    )?;
    reloaded.load(&checkpoint)?;
    let again = reloaded.evaluate(&hx, &hy, 64)?.loss;
    println!(
        "checkpoint {} ({} bytes) reloaded: held-out loss {again:.3} ({})",
        checkpoint.display(),
        std::fs::metadata(&checkpoint).map(|m| m.len()).unwrap_or(0),
        if again.to_bits() == after.loss.to_bits() { "bit-identical" } else { "DIFFERENT" }
    );

    let (bx, by) = windows(train, &(0..BATCH).map(|i| i * SEQ).collect::<Vec<_>>())?;
    let ids = |t: &HostTensor| InputSpec::new(t.shape().clone(), DType::I32);
    let graph = train_step_graph_with(&model(), ids(&bx), ids(&by), &config(), 1, precision)?;
    // The host's eager kernels compute in f32: a half step's eager columns replay its allocations.
    let execute = precision == Precision::F32;
    let row = kiln::compare::compare_graph("gpt", graph, &[("x", &bx), ("y", &by)], execute)?;
    println!(
        "memory of one training step, planned against eager execution:\n{}",
        kiln::compare::table(&[row])
    );
    let arenas: Vec<String> = [1, 2, 4, 8]
        .into_iter()
        .map(|k| {
            let graph = train_step_graph_with(&model(), ids(&bx), ids(&by), &config(), k, precision)?;
            let plan = compile(graph, &CompileOptions::default())?;
            Ok(format!("{k}: {}", kiln::report::bytes(plan.memory.arena_bytes)))
        })
        .collect::<Result<_>>()?;
    println!("the step's arena by blocks of batch rows: {}", arenas.join(", "));
    Ok(())
}
