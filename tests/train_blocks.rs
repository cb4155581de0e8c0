//! A training step in blocks of batch rows (`step::train_step_graph_in_blocks`): the forward
//! pass and the loss split before autodiff, each block's values block-sized, each weight
//! gradient summed over the blocks. Losses and weights are the whole step's within float
//! rounding; the arena shrinks with the blocks where activations dominate it.

use kiln::compiler::Plan;
use kiln::compiler::ir::{DType, Op, VarRole};
use kiln::compiler::nn::{Embedding, LayerNorm, MultiHeadAttention, PositionEmbedding, Residual};
use kiln::compiler::step::{InputSpec, train_step_graph_in_blocks};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};

fn head() -> Sequential {
    Sequential::new().add(Dense::new(16).relu()).add(Dense::new(2000))
}

/// A byte-level GPT of width `dim` over `seq` positions: `examples/gpt.rs`'s model at dim 64,
/// seq 64.
fn gpt_of(dim: usize, seq: usize) -> Sequential {
    let mut m = Sequential::new().add(Embedding::new(256, dim)).add(PositionEmbedding::new(seq));
    for _ in 0..2 {
        let attention = Sequential::new()
            .add(LayerNorm::new().epsilon(1e-5))
            .add(MultiHeadAttention::new(4).causal(true));
        let mlp = Sequential::new()
            .add(LayerNorm::new().epsilon(1e-5))
            .add(Dense::new(4 * dim).activation(Activation::GeluTanh))
            .add(Dense::new(dim));
        m = m.add(Residual::new(attention)).add(Residual::new(mlp));
    }
    m.add(LayerNorm::new().epsilon(1e-5)).add(Dense::new(256))
}

fn gpt() -> Sequential {
    gpt_of(32, 32)
}

fn config(loss: Loss) -> TrainConfig {
    TrainConfig { loss, optimizer: Adam::new(1e-3).into(), metrics: vec![] }
}

fn plan(model: &Sequential, x: InputSpec, y: InputSpec, loss: Loss, blocks: usize) -> Plan {
    compile(
        train_step_graph_in_blocks(model, x, y, &config(loss), blocks).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap()
}

/// `steps` training steps of `plan` from the same initial variables: the losses and the final
/// weights.
fn train(plan: &Plan, x: &HostTensor, y: &HostTensor, steps: usize) -> (Vec<f32>, Vec<(String, HostTensor)>) {
    let mut b = CpuBackend::new(7);
    let id = b.load(plan.clone()).unwrap();
    let losses = (0..steps)
        .map(|_| {
            let out = b.call(id, &[("x", x), ("y", y)]).unwrap();
            out.iter().find(|(n, _)| n == "loss").unwrap().1.data()[0]
        })
        .collect();
    let mut weights: Vec<(String, HostTensor)> = plan
        .variables
        .iter()
        .filter(|v| v.role == VarRole::Parameter)
        .map(|v| (v.key.clone(), b.read_variable(&v.key).unwrap()))
        .collect();
    weights.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, weights)
}

fn close(a: &[f32], b: &[f32], rel: f32) -> bool {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
    a.iter().zip(b).all(|(x, y)| (x - y).abs() <= rel * scale)
}

/// The sparse loss against the one-hot one, on the GPT example's model and batch (16 x 64 bytes,
/// width 64, accuracy metrics as the example has), whole and in 2, 4 and 8 blocks of rows: the
/// sparse plan is smaller at every block count, and whole it saves most of the one-hot targets'
/// bytes. Not all of them: kiln's one-hot loss is fused as well, so the targets themselves are
/// all it adds, and the head's product writes the difference of the probabilities and the
/// targets over the targets' own buffer (a product's epilogue writes over its operand at any
/// rank), which the one-hot plan then has instead of a buffer of its own. In blocks the one-hot
/// targets are sliced per block and die with them, so the difference shrinks (at the recompute
/// budget of 1/1000, measured 2026-11-28: whole 10,314,112 vs 11,047,104 B, saving 732,992 of
/// 1,048,576; 2 blocks 9,798,656 vs 10,782,720; 4: 9,798,656 vs 10,818,560; 8: 9,667,584 vs
/// 10,779,136).
#[test]
fn the_sparse_loss_plans_smaller_than_the_one_hot_at_every_block_count() {
    let (batch, seq, vocab) = (16, 64, 256);
    let x = InputSpec::new(Shape::new([batch, seq]), DType::I32);
    let sparse = InputSpec::new(Shape::new([batch, seq]), DType::I32);
    let dense = InputSpec::from(Shape::new([batch, seq, vocab]));
    let one_hot = batch * seq * vocab * 4;
    let arenas = |y: &InputSpec, loss: Loss, metric: Metric| -> Vec<usize> {
        [1, 2, 4, 8]
            .into_iter()
            .map(|k| {
                let cfg = TrainConfig { metrics: vec![metric], ..config(loss.clone()) };
                let graph =
                    train_step_graph_in_blocks(&gpt_of(64, seq), x.clone(), y.clone(), &cfg, k).unwrap();
                // Blocks against the whole step as planned without the minimum cut
                // (`saved_values`), which on its own keeps less than blocks save here, and with
                // cheap recomputation's budget of 1/1000 that these figures were measured at.
                let options = CompileOptions { save_minimal: false, ..CompileOptions::default() }
                    .with_recompute_budget(0.001);
                let arena = compile(graph, &options).unwrap().memory.arena_bytes;
                eprintln!("{}: {k} blocks, arena {arena} B", loss.name());
                arena
            })
            .collect()
    };
    let s = arenas(
        &sparse,
        Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        Metric::SparseCategoricalAccuracy,
    );
    let d = arenas(&dense, Loss::SoftmaxCrossEntropy, Metric::CategoricalAccuracy);
    for (k, (s, d)) in [1, 2, 4, 8].iter().zip(s.iter().zip(&d)) {
        assert!(s < d, "{k} blocks: sparse {s} B >= one-hot {d} B");
    }
    assert!(s[0] + one_hot * 6 / 10 <= d[0], "whole: sparse {} B, one-hot {} B", s[0], d[0]);
    assert!(s[1..].iter().min() < s.first(), "blocks make the sparse plan smaller");
}

#[test]
fn blocked_steps_train_as_the_whole_step_does() {
    let (rows, vocab) = (64, 2000);
    let xs = HostTensor::from_fn([rows, 20], |i| ((i * 31 % 23) as f32 - 11.0) / 11.0).unwrap();
    let ids = HostTensor::from_fn([rows], |r| ((r * 7 + 3) % vocab) as f32).unwrap();
    let loss = Loss::SparseSoftmaxCrossEntropy { ignore_index: None };
    let x = InputSpec::from(Shape::new([rows, 20]));
    let y = InputSpec::from(Shape::new([rows]));
    let (whole_losses, whole_weights) =
        train(&plan(&head(), x.clone(), y.clone(), loss.clone(), 1), &xs, &ids, 4);
    for k in [2, 3, 8] {
        let p = plan(&head(), x.clone(), y.clone(), loss.clone(), k);
        let slices = p.steps.iter().filter(|s| matches!(s.op, Op::Slice { axis: 0, .. })).count();
        assert!(slices >= k, "blocks {k}: x sliced once per block ({slices} slices)");
        let (losses, weights) = train(&p, &xs, &ids, 4);
        assert!(close(&losses, &whole_losses, 1e-5), "blocks {k}: {losses:?} vs {whole_losses:?}");
        for ((key, w), (_, v)) in weights.iter().zip(&whole_weights) {
            assert!(close(w.data(), v.data(), 1e-5), "blocks {k}: weight {key}");
        }
    }
}

#[test]
fn a_language_models_step_in_blocks_matches_and_plans_smaller() {
    // At batch 8 the whole step plans smaller than any split (1,284,288 B against 1,292,480 B
    // in 4 blocks), since the head's product writes the logits' gradient over a value it reads;
    // at 16 the activations blocks save outweigh what splitting adds.
    let (batch, seq) = (16, 32);
    let ids = |shift: usize| {
        HostTensor::from_i32(
            Shape::new([batch, seq]),
            (0..batch * seq).map(|i| ((i * 37 + shift * 11) % 256) as i32).collect(),
        )
        .unwrap()
    };
    let (xs, ys) = (ids(0), ids(1));
    let spec = InputSpec::new(Shape::new([batch, seq]), DType::I32);
    let loss = Loss::SparseSoftmaxCrossEntropy { ignore_index: None };
    let whole = plan(&gpt(), spec.clone(), spec.clone(), loss.clone(), 1);
    let (whole_losses, whole_weights) = train(&whole, &xs, &ys, 3);
    let mut best = whole.memory.arena_bytes;
    for k in [2, 4] {
        let p = plan(&gpt(), spec.clone(), spec.clone(), loss.clone(), k);
        eprintln!(
            "blocks {k}: arena {} B (whole {} B), {} steps (whole {})",
            p.memory.arena_bytes,
            whole.memory.arena_bytes,
            p.steps.len(),
            whole.steps.len()
        );
        best = best.min(p.memory.arena_bytes);
        let (losses, weights) = train(&p, &xs, &ys, 3);
        assert!(close(&losses, &whole_losses, 1e-5), "blocks {k}: {losses:?} vs {whole_losses:?}");
        for ((key, w), (_, v)) in weights.iter().zip(&whole_weights) {
            // The keys' bias has no gradient in exact arithmetic (it adds q·b to every score of
            // a row, which the softmax cancels): its rounding noise, normalised by Adam, is all
            // its update, in either summation order.
            if !key.ends_with("key/bias") {
                assert!(close(w.data(), v.data(), 1e-4), "blocks {k}: weight {key}");
            }
        }
    }
    assert!(best < whole.memory.arena_bytes, "blocks plan smaller: {best} vs {}", whole.memory.arena_bytes);
}

#[test]
fn impossible_block_counts_are_refused() {
    let x = InputSpec::from(Shape::new([4, 20]));
    for k in [0, 5] {
        let e = train_step_graph_in_blocks(
            &head(),
            x.clone(),
            Shape::new([4]),
            &config(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }),
            k,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(&format!("{k} blocks of a batch of 4 rows")), "{e}");
    }
}

#[test]
fn a_trainer_in_row_blocks_trains_as_the_whole_step_does() {
    let xs = HostTensor::from_fn([10, 20], |i| ((i * 31 % 23) as f32 - 11.0) / 11.0).unwrap();
    let ids = HostTensor::from_fn([10], |r| ((r * 7 + 3) % 2000) as f32).unwrap();
    let loss = || config(Loss::SparseSoftmaxCrossEntropy { ignore_index: None });
    let run = |blocks: usize| {
        let mut t = Trainer::new(head(), loss(), Device::cpu().backend(3).unwrap()).with_row_blocks(blocks);
        // Batches of 4 rows and a last one of 2, fewer rows than blocks: one block per row there.
        let opts = FitOptions { epochs: 2, batch_size: 4, verbose: false, ..Default::default() };
        let h = t.fit(&xs, &ids, &opts).unwrap();
        (
            h.epochs.iter().map(|e| e.loss).collect::<Vec<f32>>(),
            t.plans().iter().map(|p| p.steps.len()).collect::<Vec<_>>(),
        )
    };
    let (whole, whole_steps) = run(1);
    let (blocked, blocked_steps) = run(3);
    assert!(close(&blocked, &whole, 1e-5), "{blocked:?} vs {whole:?}");
    assert!(
        blocked_steps.iter().zip(&whole_steps).all(|(b, w)| b > w),
        "{blocked_steps:?} vs {whole_steps:?}"
    );
}
