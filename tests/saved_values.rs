//! Save what the gradient needs (`saved_values`): a training step keeps, of the forward values
//! its backward pass reads, what a minimum cut chooses, recomputes the rest within the FLOP
//! budget, plans smaller, and computes the same bits as the step that keeps everything.

use kiln::compiler::ir::{Init, Shape};
use kiln::compiler::nn::{Activation, Dropout, Flatten, Layer};
use kiln::compiler::saved_values;
use kiln::compiler::step::train_step_graph;
use kiln::compiler::trace::Tensor;
use kiln::prelude::*;
use kiln::zoo;

/// Losses (as bits) of `steps` training steps, and every variable afterwards (as bits).
fn train(plan: &Plan, x: &HostTensor, y: &HostTensor, steps: usize) -> (Vec<u32>, Vec<Vec<u32>>) {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..steps {
        let out = backend.call(id, &[("x", x), ("y", y)]).unwrap();
        losses.push(out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap().to_bits());
    }
    let vars = plan
        .variables
        .iter()
        .map(|v| backend.read_variable(&v.key).unwrap().data().iter().map(|f| f.to_bits()).collect())
        .collect();
    (losses, vars)
}

/// Options that isolate the rewrite: no tiled updates (their GEMM blocks sum in another
/// order), no cheap recomputation under a searched limit.
fn options(save_minimal: bool) -> CompileOptions {
    CompileOptions {
        tile_updates: false,
        cheap_remat: false,
        save_minimal,
        ..CompileOptions::device("cpu:0", None)
    }
}

/// A convolution, a batch norm composed of the DSL's ops (the batch's statistics, a learned
/// scale and offset, as an ONNX training-mode BatchNormalization imports), then SiLU or ReLU.
struct ConvBn {
    filters: usize,
    silu: bool,
}

impl Layer for ConvBn {
    fn forward(&self, x: &Tensor) -> Tensor {
        let t = x.tracer();
        let c = x.dims()[3];
        let w = t.param("w", Shape::new([3, 3, c, self.filters]), Init::GlorotUniform);
        let h = x.conv2d(&w, [1, 1], Padding::Same);
        let mean = h.mean([0, 1, 2].as_slice(), true);
        let centred = &h - &mean;
        let var = centred.square().mean([0, 1, 2].as_slice(), true);
        let gamma = t.param("gamma", Shape::new([self.filters]), Init::Constant(1.0));
        let beta = t.param("beta", Shape::new([self.filters]), Init::Zeros);
        let y = centred * (var + 1e-5).rsqrt() * gamma + beta;
        if self.silu { &y * &y.sigmoid() } else { y.relu() }
    }

    fn kind(&self) -> &'static str {
        "conv_bn"
    }
}

fn conv_bn_net(silu: bool) -> Sequential {
    Sequential::new()
        .add(ConvBn { filters: 8, silu })
        .add(ConvBn { filters: 8, silu })
        .add(Dropout::new(0.25))
        .add(Flatten)
        .add(Dense::new(10).activation(Activation::Linear))
}

fn data(shape: &[usize], salt: u32) -> HostTensor {
    let n: usize = shape.iter().product();
    let values: Vec<f32> =
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ salt) % 1000) as f32 / 500.0 - 1.0).collect();
    HostTensor::new(Shape::new(shape.to_vec()), values).unwrap()
}

/// Conv + batch norm + ReLU or SiLU: the centred and normalised values and the sigmoid are
/// recomputed from the convolution's output and two per-channel statistics; the kept bytes fall
/// by more than half, the recomputation stays within 2% of the step's FLOPs, the arena shrinks,
/// and three steps of SGD with momentum (the scale and offset read by the recomputation are
/// updated in the same step) give the same bits.
#[test]
fn batch_norm_keeps_its_input_and_statistics_only() {
    for silu in [false, true] {
        let model = conv_bn_net(silu);
        let cfg = TrainConfig {
            loss: Loss::MeanSquaredError,
            optimizer: Sgd::new(0.05).momentum(0.9).into(),
            metrics: vec![],
        };
        let (xs, ys) = (Shape::new([4, 12, 12, 3]), Shape::new([4, 10]));
        let graph = train_step_graph(&model, xs.clone(), ys.clone(), &cfg).unwrap();
        let keep = compile(graph.clone(), &options(false)).unwrap();
        let cut = compile(graph, &options(true)).unwrap();
        assert!(keep.memory.rewrites.saved_values.is_none());
        let s = cut.memory.rewrites.saved_values.as_ref().expect("values recomputed");
        assert!(s.kept_bytes_after * 2 < s.kept_bytes_before, "silu {silu}: {s:?}");
        assert!(s.recomputed_flops as f64 <= s.step_flops as f64 * saved_values::FLOPS_BUDGET, "{s:?}");
        assert!(
            cut.memory.arena_bytes < keep.memory.arena_bytes,
            "silu {silu}: {} >= {}",
            cut.memory.arena_bytes,
            keep.memory.arena_bytes
        );
        let (x, y) = (data(xs.dims(), 7), data(ys.dims(), 11));
        assert_eq!(train(&cut, &x, &y, 3), train(&keep, &x, &y, 3), "silu {silu}");
    }
}

/// The zoo's transformer (layer norms, GELU, dropout-free attention, Adam): a smaller arena and
/// the same bits.
#[test]
fn the_transformer_trains_to_the_same_bits() {
    let m = zoo::by_name("transformer").unwrap().with_batch(2);
    let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let keep = compile(graph.clone(), &options(false)).unwrap();
    let cut = compile(graph, &options(true)).unwrap();
    assert!(cut.memory.rewrites.saved_values.is_some());
    assert!(cut.memory.arena_bytes < keep.memory.arena_bytes);
    let (x, y) = m.batch_data(1).unwrap();
    let run = |plan: &Plan| {
        let mut backend = CpuBackend::new(2);
        let id = backend.load(plan.clone()).unwrap();
        (0..2)
            .map(|_| {
                let out = backend.call(id, &[("x", &x), ("y", &y)]).unwrap();
                out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap().to_bits()
            })
            .collect::<Vec<u32>>()
    };
    assert_eq!(run(&cut), run(&keep));
}

/// A budget of zero recomputes nothing; inference graphs are left as they are.
#[test]
fn no_budget_and_no_backward_pass_leave_the_graph_alone() {
    let model = conv_bn_net(true);
    let cfg = TrainConfig { loss: Loss::MeanSquaredError, optimizer: Sgd::new(0.05).into(), metrics: vec![] };
    let mut graph = train_step_graph(&model, Shape::new([2, 8, 8, 3]), Shape::new([2, 10]), &cfg).unwrap();
    let before = graph.len();
    let figures = saved_values::rewrite(&mut graph, 0.0).unwrap();
    assert_eq!((figures.recomputed_ops, graph.len()), (0, before));
    let mut forward = kiln::compiler::step::forward_graph(&model, Shape::new([2, 8, 8, 3])).unwrap();
    let before = forward.len();
    saved_values::rewrite(&mut forward, saved_values::FLOPS_BUDGET).unwrap();
    assert_eq!(forward.len(), before);
}
