//! The normalisation layers' options and the tanh GELU, by value: what each framework's layer of
//! that name computes.

use kiln::compiler::nn::{LayerNorm, RmsNorm};
use kiln::prelude::*;

fn run(name: &str, x: &HostTensor, f: impl Fn(&Tensor) -> Tensor) -> (HostTensor, usize) {
    let t = Tracer::new(name);
    let input = t.input("x", x.shape().clone());
    t.output("y", &f(&input));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    let variables = plan.variables.len();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    let out = cpu.call(id, &[("x", x)]).unwrap();
    (out.into_iter().next().unwrap().1, variables)
}

fn rows() -> HostTensor {
    HostTensor::new(
        Shape::from([3, 5].as_slice()),
        vec![1.0, -2.0, 0.5, 3.0, -0.25, 10.0, 11.0, 12.0, 13.0, 14.0, -1.0, 0.0, 1.0, 0.0, -1.0],
    )
    .unwrap()
}

#[test]
fn rms_norm_scales_each_row_to_unit_mean_square() {
    let x = rows();
    let (y, variables) = run("rms", &x, |x| RmsNorm::new().forward(x));
    assert_eq!(variables, 1, "gamma only");
    for (xr, yr) in x.data().chunks(5).zip(y.data().chunks(5)) {
        let ms: f64 = xr.iter().map(|v| f64::from(*v).powi(2)).sum::<f64>() / 5.0;
        for (a, b) in xr.iter().zip(yr) {
            let want = f64::from(*a) / (ms + 1e-6).sqrt();
            assert!((f64::from(*b) - want).abs() < 1e-5, "{b} vs {want}");
        }
    }
    let (_, none) = run("rms plain", &x, |x| RmsNorm::new().scale(false).forward(x));
    assert_eq!(none, 0);
}

#[test]
fn layer_norm_options_declare_only_what_they_learn() {
    let x = rows();
    for (center, scale, expected) in [(true, true, 2), (true, false, 1), (false, true, 1), (false, false, 0)]
    {
        let (y, variables) =
            run("ln", &x, |x| LayerNorm::new().center(center).scale(scale).epsilon(1e-5).forward(x));
        assert_eq!(variables, expected, "center {center}, scale {scale}");
        // gamma 1 and beta 0 at initialisation: every row has mean 0 and variance ~1.
        for yr in y.data().chunks(5) {
            let mean: f32 = yr.iter().sum::<f32>() / 5.0;
            let var: f32 = yr.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / 5.0;
            assert!(mean.abs() < 1e-5 && (var - 1.0).abs() < 1e-3, "mean {mean}, var {var}");
        }
    }
}

#[test]
fn tanh_gelu_is_jaxs_approximation() {
    let x = rows();
    let (y, _) = run("gelu_tanh", &x, |x| x.gelu_tanh());
    let (exact, _) = run("gelu", &x, |x| x.gelu());
    for ((a, b), e) in x.data().iter().zip(y.data()).zip(exact.data()) {
        let a = f64::from(*a);
        let want =
            0.5 * a * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (a + 0.044715 * a.powi(3))).tanh());
        assert!((f64::from(*b) - want).abs() < 1e-5, "gelu_tanh({a}) = {b}, want {want}");
        // Within the approximation's known error of the exact GELU.
        assert!((b - e).abs() < 1e-3);
    }
}

#[test]
fn iota_tril_and_the_causal_mask() {
    let x = HostTensor::new(Shape::from([2, 3, 4].as_slice()), (1..=24).map(|v| v as f32).collect()).unwrap();
    for k in [-1isize, 0, 1] {
        let (y, _) = run("tril", &x, |x| x.tril(k));
        for (i, (a, b)) in x.data().iter().zip(y.data()).enumerate() {
            let (r, c) = ((i / 4) % 3, i % 4);
            let kept = c as isize - r as isize <= k;
            assert_eq!(*b, if kept { *a } else { 0.0 }, "k {k} at ({r}, {c})");
        }
    }
    let (mask, _) = run("mask", &x, |x| {
        let t = x.tracer();
        // The mask (a constant of the plan) added to nothing: 0 * x keeps an input in the graph.
        t.causal_mask(4).reshape([1, 4, 4]).broadcast_to([2, 4, 4]).slice(1, 0, 3) + x.mul(0.0)
    });
    for (i, v) in mask.data().iter().enumerate() {
        let (r, c) = ((i / 4) % 3, i % 4);
        assert_eq!(*v, if c <= r { 1.0 } else { 0.0 });
    }
}

#[test]
fn causal_attention_never_reads_later_positions() {
    use kiln::compiler::nn::MultiHeadAttention;
    let (b, s, d) = (2, 5, 8);
    let base: Vec<f32> = (0..b * s * d).map(|i| ((i * 37 % 17) as f32 - 8.0) / 8.0).collect();
    let mut later = base.clone();
    // Change only the last position of every sequence.
    for batch in 0..b {
        for j in 0..d {
            later[(batch * s + s - 1) * d + j] += 3.0;
        }
    }
    let attend = |data: Vec<f32>, causal: bool| {
        let x = HostTensor::new(Shape::from([b, s, d].as_slice()), data).unwrap();
        run("mha", &x, |x| MultiHeadAttention::new(2).causal(causal).forward(x)).0
    };
    let (a, c) = (attend(base.clone(), true), attend(later.clone(), true));
    for batch in 0..b {
        for pos in 0..s - 1 {
            let at = (batch * s + pos) * d;
            assert_eq!(a.data()[at..at + d], c.data()[at..at + d], "position {pos} read a later one");
        }
    }
    // Without the mask the earlier positions do see the change.
    let (a, c) = (attend(base, false), attend(later, false));
    assert_ne!(a.data()[..d], c.data()[..d]);
}

#[test]
fn attention_without_bias_declares_only_the_four_kernels() {
    use kiln::compiler::nn::MultiHeadAttention;
    let x = HostTensor::new(Shape::from([1, 3, 8].as_slice()), (0..24).map(|v| v as f32 / 24.0).collect())
        .unwrap();
    let (_, with) = run("mha", &x, |x| MultiHeadAttention::new(2).forward(x));
    let (_, without) = run("mha", &x, |x| MultiHeadAttention::new(2).use_bias(false).forward(x));
    assert_eq!((with, without), (8, 4));
}

/// A position embedding adds row t of its table to position t of every sequence: identical
/// inputs at two positions come out different, the same position in two sequences the same;
/// the table is declared [max_len, d] whatever the sequence, and a sequence longer than it is an
/// error naming the layer.
#[test]
fn position_embeddings_tell_positions_apart() {
    use kiln::compiler::nn::PositionEmbedding;
    let x = HostTensor::new(Shape::new([2, 3, 4]), vec![0.5; 24]).unwrap();
    let (y, variables) = run("positions", &x, |x| PositionEmbedding::new(8).forward(x));
    assert_eq!(variables, 1);
    let d = y.data();
    assert_ne!(&d[0..4], &d[4..8], "positions 0 and 1 differ");
    assert_eq!(&d[0..12], &d[12..24], "both sequences get the same positions");
    let t = Tracer::new("too_long");
    let input = t.input("x", [2, 9, 4]);
    t.output("y", &Sequential::new().add(PositionEmbedding::new(8)).forward(&input));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("position_embedding") && e.contains("9 positions"), "{e}");
    let t = Tracer::new("declared");
    let input = t.input("x", [1, 5, 4]);
    t.output("y", &PositionEmbedding::new(8).forward(&input));
    let g = t.finish().unwrap();
    assert!(g.variables().iter().any(|&v| g.node(v).shape == Shape::new([8, 4])));
}

/// An embedding tied to its output head: one [vocab, d] table, read by the lookup and,
/// transposed, by the head; its update sums both uses' gradients, and training lowers the loss.
#[test]
fn a_tied_embedding_and_head_share_one_table_and_train() {
    use kiln::compiler::nn::{Embedding, TiedOutput};
    let (vocab, dim, rows, seq) = (13, 8, 4, 5);
    let model = || {
        Sequential::new()
            .add(Embedding::new(vocab, dim).tied("wte"))
            .add(Dense::new(dim).activation(Activation::Tanh))
            .add(TiedOutput::new("wte", vocab))
    };
    let config = TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(5e-2).into(),
        metrics: vec![],
    };
    let shape = Shape::new([rows, seq]);
    let graph = kiln::compiler::step::train_step_graph(&model(), &shape, &shape, &config).unwrap();
    use kiln::compiler::ir::{Op, VarRole};
    let tables: Vec<String> = graph
        .variables()
        .into_iter()
        .filter_map(|v| match &graph.node(v).op {
            Op::Variable { key, role: VarRole::Parameter, shape, .. }
                if *shape == Shape::new([vocab, dim]) =>
            {
                Some(key.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(tables, ["wte"], "one table, the parameter `wte` outside any scope");
    let ids = |k: usize| {
        HostTensor::new(shape.clone(), (0..rows * seq).map(|i| ((i * 5 + k) % vocab) as f32).collect())
            .unwrap()
    };
    let (x, y) = (ids(0), ids(1));
    let mut trainer = Trainer::new(model(), config, Device::cpu().backend(3).unwrap());
    let losses: Vec<f32> = (0..30).map(|_| trainer.train_step(&x, &y).unwrap().loss).collect();
    assert!(losses[29] < 0.5 * losses[0], "{losses:?}");
}

/// `one_hot`: a 1.0 at each id's class, zeros elsewhere and for ids outside the classes; the
/// comparison is fused into its reader, so no [rows, classes] tensor is stored for it.
#[test]
fn one_hot_rows_of_ids() {
    let ids = HostTensor::new(Shape::new([2, 3]), vec![0.0, 3.0, 1.0, 2.0, 7.0, -1.0]).unwrap();
    let (y, _) = run("one_hot", &ids, |x| x.one_hot(4) * 2.0);
    assert_eq!(y.shape(), &Shape::new([2, 3, 4]));
    let want: Vec<f32> = [0, 3, 1, 2, 9, 9]
        .iter()
        .flat_map(|&c| (0..4).map(move |k| if k == c { 2.0 } else { 0.0 }))
        .collect();
    assert_eq!(y.data(), want.as_slice());
    let t = Tracer::new("one_hot_plan");
    let x = t.input("x", [2, 3]);
    t.output("y", &(x.one_hot(4) * 2.0));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    assert_eq!(plan.steps.len(), 1, "one fused kernel: {}", plan.render());
}

/// A padding mask: no position reads a padded key, so what sits at padded positions never
/// changes the real positions' outputs; a mask of the wrong shape is an error naming the layer.
#[test]
fn padded_keys_are_never_read() {
    use kiln::compiler::nn::MultiHeadAttention;
    let (b, s, d) = (2, 5, 8);
    let keep: Vec<f32> = vec![1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0];
    let plan = {
        let t = Tracer::new("padded");
        let x = t.input("x", [b, s, d]);
        let mask = t.input("mask", [b, s]);
        t.output("y", &MultiHeadAttention::new(2).causal(false).attend(&x, Some(&mask)));
        compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()
    };
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    let mask = HostTensor::new(Shape::new([b, s]), keep.clone()).unwrap();
    let mut call = |data: Vec<f32>| {
        let x = HostTensor::new(Shape::new([b, s, d]), data).unwrap();
        cpu.call(id, &[("x", &x), ("mask", &mask)]).unwrap().remove(0).1
    };
    let base: Vec<f32> = (0..b * s * d).map(|i| ((i * 29 % 13) as f32 - 6.0) / 6.0).collect();
    let mut padded = base.clone();
    for pos in 3..5 {
        for j in 0..d {
            padded[pos * d + j] -= 5.0;
        }
    }
    let (a, c) = (call(base), call(padded));
    assert_eq!(a.data()[..3 * d], c.data()[..3 * d], "real positions read padding");
    assert_eq!(a.data()[s * d..], c.data()[s * d..], "the other sequence is untouched");
    let t = Tracer::new("bad_mask");
    let x = t.input("x", [b, s, d]);
    let mask = t.input("mask", [b, s + 1]);
    t.output("y", &MultiHeadAttention::new(2).attend(&x, Some(&mask)));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("multi_head_attention") && e.contains("padding mask"), "{e}");
}
