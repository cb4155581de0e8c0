//! `attention_rewrite`: graphs that compose attention (matmul, scale, mask, softmax, matmul)
//! compute the same values as one `Op::Attention` on the CPU backend, and a training step of a
//! model that composes attention differentiates the op (`AttentionGrad`), keeping no
//! `[.., S, T]` value between the passes.

use kiln::compiler::attention_rewrite::rewrite;
use kiln::compiler::ir::{Graph, Op};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::prelude::*;

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.node_ids().filter(|&n| f(&g.node(n).op)).count()
}

fn host(dims: &[usize], seed: u32) -> HostTensor {
    let n: usize = dims.iter().product();
    let data = (0..n).map(|i| (i as f32 * 0.7311 + seed as f32 * 1.37).sin() * 1.5).collect();
    HostTensor::new(dims.to_vec(), data).unwrap()
}

fn run(g: Graph, inputs: &[(&str, &HostTensor)]) -> Vec<(String, HostTensor)> {
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(g, &CompileOptions::default()).unwrap()).unwrap();
    cpu.call(id, inputs).unwrap()
}

/// Composed forms: k transposed by the product, k permuted with its heads, a scale after the
/// product or on q (a divisor too), a padding mask from an input.
#[test]
fn rewritten_attention_computes_the_composed_values() {
    let t = Tracer::new("composed");
    let q = t.input("q", [2, 3, 5, 8]);
    let k = t.input("k", [2, 3, 9, 8]);
    let v = t.input("v", [2, 3, 9, 8]);
    let keep = t.input("keep", [2, 1, 1, 9]);
    let mask = (keep - 1.0).mul(1e9);
    let a = (q.matmul_t(&k, false, true).div(2.0) + &mask).softmax(-1).matmul(&v);
    let kb = t.input("kb", [2, 9, 3, 8]);
    let b = (q.mul(0.3)).matmul(&kb.permute(&[0, 2, 3, 1])).softmax(-1).matmul(&v);
    t.output("a", &a);
    t.output("b", &b);
    let composed = t.finish().unwrap();
    let mut fused = composed.clone();
    assert_eq!(rewrite(&mut fused).unwrap(), 2);
    assert_eq!(count(&fused, |o| matches!(o, Op::Attention { .. })), 2);
    assert_eq!(count(&fused, |o| matches!(o, Op::Softmax { .. })), 0);
    let mut keep = host(&[2, 1, 1, 9], 0);
    for (i, x) in keep.data_mut().iter_mut().enumerate() {
        *x = if i % 4 == 3 { 0.0 } else { 1.0 };
    }
    let (q, k, v, kb) =
        (host(&[2, 3, 5, 8], 1), host(&[2, 3, 9, 8], 2), host(&[2, 3, 9, 8], 3), host(&[2, 9, 3, 8], 4));
    let inputs = [("q", &q), ("k", &k), ("v", &v), ("keep", &keep), ("kb", &kb)];
    let (want, got) = (run(composed, &inputs), run(fused, &inputs));
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        for (x, y) in w.data().iter().zip(g.data()) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{name}: {x} vs {y}");
        }
    }
}

/// Exported forms: a causal `where(mask, w, min)` then a padding bias (transformers' GPT-2), and
/// q and kᵀ each scaled by a constant's square root (PyTorch's SDPA decomposition, ViT's export).
#[test]
fn masked_selects_and_split_scales_compute_the_composed_values() {
    let t = Tracer::new("exported");
    let q = t.input("q", [2, 3, 6, 8]);
    let k = t.input("k", [2, 3, 6, 8]);
    let v = t.input("v", [2, 3, 6, 8]);
    let keep = t.input("keep", [2, 1, 1, 6]);
    let causal = t.causal_mask(6).reshape([1, 1, 6, 6]);
    let low = t.fill(f32::MIN, Shape::scalar());
    let w = q.matmul_t(&k, false, true).div(8f32.sqrt());
    let a = (causal.select(&w, &low) + &(keep - 1.0).mul(1e9)).softmax(-1).matmul(&v);
    let root = t.fill(0.125, Shape::scalar()).sqrt().sqrt();
    let b = (&q * &root).matmul(&(&k.permute(&[0, 1, 3, 2]) * &root)).softmax(-1).matmul(&v);
    t.output("a", &a);
    t.output("b", &b);
    let composed = t.finish().unwrap();
    let mut fused = composed.clone();
    assert_eq!(rewrite(&mut fused).unwrap(), 2);
    assert_eq!(count(&fused, |o| matches!(o, Op::Softmax { .. })), 0);
    let mut keep = host(&[2, 1, 1, 6], 0);
    for (i, x) in keep.data_mut().iter_mut().enumerate() {
        *x = if i % 5 == 4 { 0.0 } else { 1.0 };
    }
    let (q, k, v) = (host(&[2, 3, 6, 8], 1), host(&[2, 3, 6, 8], 2), host(&[2, 3, 6, 8], 3));
    let inputs = [("q", &q), ("k", &k), ("v", &v), ("keep", &keep)];
    let (want, got) = (run(composed, &inputs), run(fused, &inputs));
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        for (x, y) in w.data().iter().zip(g.data()) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{name}: {x} vs {y}");
        }
    }
}

/// Self-attention composed by hand from parameters.
struct Composed;

impl Layer for Composed {
    fn forward(&self, x: &Tensor) -> Tensor {
        let t = x.tracer();
        let w = |name: &str| t.param(name, [8, 8], Init::GlorotUniform);
        let (q, k, v) = (x.matmul(&w("q")), x.matmul(&w("k")), x.matmul(&w("v")));
        let causal = (t.causal_mask(6) - 1.0).mul(1e9);
        (q.matmul_t(&k, false, true).mul(0.35) + &causal).softmax(-1).matmul(&v)
    }

    fn kind(&self) -> &'static str {
        "composed_attention"
    }
}

#[test]
fn a_training_step_differentiates_the_rewritten_op() {
    let config = TrainConfig {
        loss: Loss::MeanSquaredError,
        optimizer: Optimizer::Sgd(Sgd::new(0.1)),
        metrics: vec![],
    };
    let g = train_step_graph(
        &Composed,
        Shape::from([2, 6, 8].as_slice()),
        Shape::from([2, 6, 8].as_slice()),
        &config,
    )
    .unwrap();
    assert_eq!(count(&g, |o| matches!(o, Op::Attention { .. })), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::AttentionGrad { .. })), 1);
    // The composed gradient of the bias (a mask here) is dead code once optimised.
    let optimised = kiln::compiler::optimize(g.clone()).unwrap().graph;
    assert_eq!(count(&optimised, |o| matches!(o, Op::Softmax { .. })), 0);
    assert_eq!(count(&optimised, |o| matches!(o, Op::AttentionGrad { .. })), 1);
    // The step runs.
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(g, &CompileOptions::default()).unwrap()).unwrap();
    let (x, y) = (host(&[2, 6, 8], 5), host(&[2, 6, 8], 6));
    let out = cpu.call(id, &[("x", &x), ("y", &y)]).unwrap();
    assert!(out.iter().all(|(_, t)| t.data().iter().all(|v| v.is_finite())));
}

/// CPU time of attention's forward and backward at b=4, h=12, s=256, d=64, one op against the
/// composed form: `cargo test --release --test attention_rewrite -- --ignored --nocapture`.
#[test]
#[ignore]
fn time_forward_and_backward() {
    let dims = [4usize, 12, 256, 64];
    let build = |fused: bool, causal: bool| {
        let t = Tracer::new("timing");
        let (q, k, v, w) = (t.input("q", dims), t.input("k", dims), t.input("v", dims), t.input("w", dims));
        let o = if fused {
            q.attention(&k, &v, None, 0.125, causal)
        } else if causal {
            let mask = (t.causal_mask(256) - 1.0).mul(1e9);
            (q.matmul_t(&k, false, true).mul(0.125) + &mask).softmax(-1).matmul(&v)
        } else {
            q.matmul_t(&k, false, true).mul(0.125).softmax(-1).matmul(&v)
        };
        let loss = (&o * &w).sum(.., false);
        t.output("loss", &loss);
        let g = t.finish().unwrap();
        let ids: Vec<_> = ["q", "k", "v"].iter().map(|n| g.input(n).unwrap()).collect();
        let loss = g.output("loss").unwrap();
        let (mut g, grads) = kiln::compiler::autodiff::gradients(g, loss, &ids).unwrap();
        for (name, d) in ["dq", "dk", "dv"].iter().zip(grads) {
            g.set_output(*name, d.unwrap());
        }
        g
    };
    let inputs: Vec<HostTensor> = (0..4).map(|i| host(&dims, i)).collect();
    let feeds: Vec<(&str, &HostTensor)> = ["q", "k", "v", "w"].into_iter().zip(&inputs).collect();
    for (fused, causal) in [(true, true), (false, true), (true, false), (false, false)] {
        let mut cpu = CpuBackend::new(0);
        let id = cpu.load(compile(build(fused, causal), &CompileOptions::default()).unwrap()).unwrap();
        cpu.call(id, &feeds).unwrap();
        let best = (0..5)
            .map(|_| {
                let start = std::time::Instant::now();
                cpu.call(id, &feeds).unwrap();
                start.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min);
        let form = if fused { "attention op" } else { "composed" };
        println!("{form}, causal {causal}: forward + backward {best:.1} ms");
    }
}
