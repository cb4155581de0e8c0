//! Transposes read in place (`kiln_compiler::transpose_operands`): a permute of the last two axes
//! feeding a product becomes the product's operand flag, so plans make no transposed copy, and
//! they compute what the plans with the copies computed (on the CPU within float rounding: the
//! gemm crate may sum a column-major operand's k in another order).

use kiln::compiler::ir::Op;
use kiln::compiler::step::train_step_graph;
use kiln::onnx::OnnxLayer;
use kiln::onnx::proto::*;
use kiln::prelude::*;
use kiln::zoo;
use prost::Message;

#[path = "common/onnx_proto.rs"]
mod onnx_proto;
use onnx_proto::*;

/// The rewrite alone: without the minimum cut (`saved_values`), which would recompute a
/// weight's transposed copy in the backward pass and change the copies counted here.
fn options(on: bool) -> CompileOptions {
    CompileOptions { save_minimal: false, ..CompileOptions::default() }.with_transpose_operands(on)
}

fn permutes(plan: &Plan) -> usize {
    plan.steps.iter().filter(|s| matches!(s.op, Op::Permute { .. })).count()
}

fn products(plan: &Plan) -> Vec<(bool, bool)> {
    plan.steps
        .iter()
        .filter_map(|s| match &s.op {
            Op::MatMul { transpose_a, transpose_b } => Some((*transpose_a, *transpose_b)),
            Op::Fused(f) => f.matmul.map(|m| (m.transpose_a, m.transpose_b)),
            _ => None,
        })
        .collect()
}

/// Every output of `steps` calls, sorted by name, and every variable after them, as bits;
/// `weights` written first.
fn run(
    plan: &Plan,
    weights: &[(String, HostTensor)],
    feeds: &[(&str, &HostTensor)],
    steps: usize,
) -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    for (key, value) in weights {
        backend.write_variable(key, value).unwrap();
    }
    let mut outs = Vec::new();
    for _ in 0..steps {
        let mut out = backend.call(id, feeds).unwrap();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        outs.extend(out.into_iter().map(|(_, t)| bits(t.data())));
    }
    let vars = plan.variables.iter().map(|v| bits(backend.read_variable(&v.key).unwrap().data())).collect();
    (outs, vars)
}

/// `got` within float rounding of `want` (the flagged GEMM reads an operand column-major, for
/// which the gemm crate may pick another microkernel and sum k in another order).
fn near(got: &(Vec<Vec<u32>>, Vec<Vec<u32>>), want: &(Vec<Vec<u32>>, Vec<Vec<u32>>), what: &str) {
    let floats = |v: &[Vec<u32>]| v.iter().flatten().map(|&b| f32::from_bits(b)).collect::<Vec<f32>>();
    for (g, w) in [(&got.0, &want.0), (&got.1, &want.1)] {
        let (g, w) = (floats(g), floats(w));
        assert_eq!(g.len(), w.len(), "{what}");
        for (a, b) in g.iter().zip(&w) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{what}: {a} vs {b}");
        }
    }
}

fn values(shape: &[usize], seed: usize) -> HostTensor {
    let n: usize = shape.iter().product();
    HostTensor::new(
        Shape::new(shape.to_vec()),
        (0..n).map(|i| (((i * 7 + seed) % 13) as f32 - 6.0) / 8.0).collect(),
    )
    .unwrap()
}

/// x · wᵀ with the transpose written as a permute of the stored [out, in] weight.
struct PermutedDense {
    units: usize,
}

impl Layer for PermutedDense {
    fn forward(&self, x: &Tensor) -> Tensor {
        let d = *x.shape().dims().last().unwrap();
        let w = x.tracer().param("w", [self.units, d], Init::GlorotUniform);
        x.matmul(&w.permute(&[1, 0])).tanh()
    }

    fn kind(&self) -> &'static str {
        "permuted_dense"
    }
}

#[test]
fn a_permuted_parameter_is_read_in_place_and_computes_the_same_values() {
    let t = Tracer::new("head");
    let x = t.input("x", [6, 4]);
    let w = t.param("w", [5, 4], Init::GlorotUniform);
    t.output("y", &x.matmul(&w.permute(&[1, 0])));
    let graph = t.finish().unwrap();
    let on = compile(graph.clone(), &options(true)).unwrap();
    let off = compile(graph, &options(false)).unwrap();
    assert_eq!((permutes(&on), permutes(&off)), (0, 1));
    assert_eq!(products(&on), [(false, true)]);
    assert_eq!(products(&off), [(false, false)]);
    let x = values(&[6, 4], 1);
    near(&run(&on, &[], &[("x", &x)], 1), &run(&off, &[], &[("x", &x)], 1), "head");
    assert!(on.memory.arena_bytes < off.memory.arena_bytes);
}

/// Training through a permuted weight: the forward product reads it through the flag, and its
/// gradient (hᵀ·g, then a transposed copy) is made as stored (gᵀ·h). Same losses and weights
/// within float rounding, fused or not.
#[test]
fn training_through_a_permuted_weight_gives_the_same_results() {
    let model = Sequential::new().add(Dense::new(8)).add(PermutedDense { units: 3 });
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(1e-2).into(), metrics: vec![] };
    let (xs, ys) = (Shape::new([16, 5]), Shape::new([16, 3]));
    let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
    let (x, y) = (values(&[16, 5], 2), values(&[16, 3], 5));
    for fuse in [true, false] {
        let on = compile(graph.clone(), &options(true).with_fusion(fuse)).unwrap();
        let off = compile(graph.clone(), &options(false).with_fusion(fuse)).unwrap();
        assert_eq!(permutes(&on), 0, "fuse {fuse}");
        assert_eq!(permutes(&off), 2, "fuse {fuse}: the weight's copy and its gradient's");
        assert!(on.memory.planned_total_bytes() <= off.memory.planned_total_bytes(), "fuse {fuse}");
        assert!(on.steps.len() < off.steps.len(), "fuse {fuse}");
        let feeds = [("x", &x), ("y", &y)];
        near(&run(&on, &[], &feeds, 4), &run(&off, &[], &feeds, 4), &format!("fuse {fuse}"));
    }
}

#[test]
fn a_batch_product_reads_a_swap_of_its_last_two_axes_in_place() {
    let t = Tracer::new("scores");
    let q = t.input("q", [2, 3, 7, 8]);
    let k = t.input("k", [2, 3, 7, 8]);
    let scores = q.matmul(&k.permute(&[0, 1, 3, 2]));
    t.output("y", &scores.softmax(-1).matmul(&k));
    let graph = t.finish().unwrap();
    let on = compile(graph.clone(), &options(true)).unwrap();
    let off = compile(graph, &options(false)).unwrap();
    assert_eq!(permutes(&on), 0);
    assert!(permutes(&off) >= 1);
    let (q, k) = (values(&[2, 3, 7, 8], 3), values(&[2, 3, 7, 8], 4));
    let feeds = [("q", &q), ("k", &k)];
    near(&run(&on, &[], &feeds, 1), &run(&off, &[], &feeds, 1), "scores");
}

#[test]
fn a_permute_with_another_reader_or_of_other_axes_stays() {
    let t = Tracer::new("kept");
    let x = t.input("x", [6, 4]);
    let w = t.param("w", [5, 4], Init::GlorotUniform);
    let wt = w.permute(&[1, 0]);
    t.output("y", &x.matmul(&wt));
    t.output("z", &wt.exp());
    let heads = t.input("h", [2, 7, 3, 8]);
    let k = t.input("k", [2, 3, 8, 7]);
    t.output("s", &heads.permute(&[0, 2, 1, 3]).matmul(&k));
    let graph = t.finish().unwrap();
    let on = compile(graph.clone(), &options(true)).unwrap();
    let off = compile(graph, &options(false)).unwrap();
    assert_eq!((permutes(&on), permutes(&off)), (2, 2));
    assert_eq!(products(&on), products(&off));
    assert_eq!(on.memory.arena_bytes, off.memory.arena_bytes);
}

/// No zoo plan changes for the worse: the zoo writes its transposes as flags already.
#[test]
fn zoo_training_plans_do_not_grow() {
    for m in zoo::all() {
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let on = compile(graph.clone(), &options(true)).unwrap();
        let off = compile(graph, &options(false)).unwrap();
        assert!(on.memory.planned_total_bytes() <= off.memory.planned_total_bytes(), "{}", m.name);
        assert!(on.steps.len() <= off.steps.len(), "{}", m.name);
    }
}

fn value(name: &str, elem: i32, dims: &[i64]) -> ValueInfoProto {
    let dim = dims.iter().map(|&d| Dimension { dim_value: Some(d), dim_param: None }).collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorType { elem_type: Some(elem), shape: Some(TensorShapeProto { dim }) }),
        }),
    }
}

const VOCAB: usize = 512;
const WIDTH: usize = 64;
const BATCH: usize = 4;
const SEQ: usize = 32;

/// GPT-2's tied head as torch.onnx writes it: ids -> Gather(table) -> Tanh -> MatMul with
/// Transpose(table): logits over the vocabulary read from the embedding table itself; untied,
/// the head is a Linear's weight `head` [vocab, d] of its own, transposed the same way.
fn head(tied: bool) -> Vec<u8> {
    let table: Vec<f32> = (0..VOCAB * WIDTH).map(|i| (((i * 37) % 101) as f32 - 50.0) / 400.0).collect();
    let perm =
        AttributeProto { name: Some("perm".into()), ints: vec![1, 0], r#type: Some(7), ..Default::default() };
    ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some("tied".into()),
            node: vec![
                node("Gather", "wte", &["table", "ids"], &["h"], vec![]),
                node("Tanh", "act", &["h"], &["a"], vec![]),
                node("Transpose", "head_t", &[if tied { "table" } else { "head" }], &["table_t"], vec![perm]),
                node("MatMul", "head", &["a", "table_t"], &["logits"], vec![]),
            ],
            initializer: ["table", "head"][..if tied { 1 } else { 2 }]
                .iter()
                .map(|name| TensorProto {
                    name: Some(name.to_string()),
                    dims: vec![VOCAB as i64, WIDTH as i64],
                    data_type: Some(FLOAT),
                    raw_data: Some(table.iter().flat_map(|v| v.to_le_bytes()).collect()),
                    ..Default::default()
                })
                .collect(),
            input: vec![value("ids", INT64, &[BATCH as i64, SEQ as i64])],
            output: vec![value("logits", FLOAT, &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
    }
    .encode_to_vec()
}

/// The tied head's plans make no transposed copy of the table (neither for the head nor for its
/// gradient): the forward arena loses the copy; the training arena is smaller, though by little,
/// since at its peak the logits' gradient meets the table's gradient, as large as the copy was
/// (and the copy had died by then). It trains to the same losses and table on the CPU (compared
/// within float rounding; this one is bit for bit).
#[test]
fn an_onnx_tied_head_reads_its_table_as_stored() {
    let layer = OnnxLayer::new(&head(true)).unwrap();
    // Inference: the [d, vocab] copy was held from its making to the head.
    let xs = InputSpec::new([BATCH, SEQ], DType::I64);
    let forward = kiln::compiler::step::forward_graph(&layer, xs).unwrap();
    let on = compile(forward.clone(), &options(true)).unwrap();
    let off = compile(forward, &options(false)).unwrap();
    assert_eq!((permutes(&on), permutes(&off)), (0, 1));
    assert!(on.memory.arena_bytes + VOCAB * WIDTH * 4 <= off.memory.arena_bytes);
    eprintln!("tied head forward arena {} -> {} B", off.memory.arena_bytes, on.memory.arena_bytes);
    let weights = layer.weights.clone();
    let config = TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(1e-2).into(),
        metrics: vec![],
    };
    let xs = InputSpec::new([BATCH, SEQ], DType::I64);
    let graph = train_step_graph(&layer, xs.clone(), Shape::new([BATCH, SEQ]), &config).unwrap();
    let on = compile(graph.clone(), &options(true)).unwrap();
    let off = compile(graph, &options(false)).unwrap();
    assert_eq!(permutes(&off), 2, "the head's copy of the table and its gradient's");
    assert_eq!(permutes(&on), 0, "no transposed copy");
    if std::env::var("DUMP").is_ok() {
        eprintln!("OFF\n{}\nON\n{}", off.render(), on.render());
    }
    assert!(
        on.memory.arena_bytes < off.memory.arena_bytes,
        "arena {} -> {}",
        off.memory.arena_bytes,
        on.memory.arena_bytes
    );
    assert!(on.steps.len() < off.steps.len());
    eprintln!(
        "tied head training arena {} -> {} B, planned total {} -> {} B, steps {} -> {}",
        off.memory.arena_bytes,
        on.memory.arena_bytes,
        off.memory.planned_total_bytes(),
        on.memory.planned_total_bytes(),
        off.steps.len(),
        on.steps.len()
    );
    let ids: Vec<i64> = (0..BATCH * SEQ).map(|i| ((i * 131 + 7) % VOCAB) as i64).collect();
    let labels: Vec<f32> = (0..BATCH * SEQ).map(|i| ((i * 17 + 3) % VOCAB) as f32).collect();
    let x = HostTensor::from_i64(Shape::new([BATCH, SEQ]), ids).unwrap();
    let y = HostTensor::new(Shape::new([BATCH, SEQ]), labels).unwrap();
    let feeds = [("x", &x), ("y", &y)];
    let (a, va) = run(&on, &weights, &feeds, 3);
    let (b, vb) = run(&off, &weights, &feeds, 3);
    let floats = |v: &[Vec<u32>]| v.iter().flatten().map(|&b| f32::from_bits(b)).collect::<Vec<f32>>();
    for (what, got, want) in [("losses", floats(&a), floats(&b)), ("variables", floats(&va), floats(&vb))] {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}: {g} vs {w}");
        }
    }
    eprintln!("bitwise losses {} variables {}", a == b, va == vb);

    // The table's gradient gᵀ·h + the gather's gradient as one product with the sum as its
    // epilogue, written over the gather's gradient (`fusion::Products::Waiting`): planned beside
    // the graph with them apart, the smaller kept; asked for by name, it trains the same.
    let tried = |mark: bool| on.memory.schedules.iter().any(|(name, _)| name.ends_with("+waiting") == mark);
    assert!(tried(true) && tried(false), "{:?}", on.memory.schedules);
    let smallest = on.memory.schedules.iter().map(|(_, t)| *t).min().unwrap();
    assert_eq!(on.memory.planned_total_bytes(), smallest, "{:?}", on.memory.schedules);
    let order = on.memory.schedule.trim_end_matches("+waiting");
    let waiting = CompileOptions { schedule: Some(format!("{order}+waiting")), ..options(true) };
    let graph = train_step_graph(&layer, xs, Shape::new([BATCH, SEQ]), &config).unwrap();
    let fused = compile(graph, &waiting).unwrap();
    assert!(fused.memory.schedule.ends_with("+waiting"), "{}", fused.memory.schedule);
    let waits = |plan: &Plan| {
        plan.steps
            .iter()
            .filter(|s| matches!(&s.op, Op::Fused(f) if f.matmul.is_some_and(|m| m.transpose_a)))
            .count()
    };
    assert!(waits(&fused) > waits(&on), "{}", fused.render());
    let (c, vc) = run(&fused, &weights, &feeds, 3);
    for (what, got, want) in [("losses", floats(&c), floats(&b)), ("variables", floats(&vc), floats(&vb))] {
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}, fused: {g} vs {w}");
        }
    }
}

/// An untied head whose Linear weight is exported as Transpose(weight): its gradient, made as
/// stored, is read by its update alone, which now computes it tile by tile (`product_updates`)
/// where the [d, vocab] gradient and its [vocab, d] copy were both made.
#[test]
fn an_onnx_transposed_linear_weight_is_updated_from_its_gradient_product() {
    let layer = OnnxLayer::new(&head(false)).unwrap();
    let weights = layer.weights.clone();
    let config = TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(1e-2).into(),
        metrics: vec![],
    };
    let xs = InputSpec::new([BATCH, SEQ], DType::I64);
    let graph = train_step_graph(&layer, xs, Shape::new([BATCH, SEQ]), &config).unwrap();
    let on = compile(graph.clone(), &options(true)).unwrap();
    let off = compile(graph, &options(false)).unwrap();
    assert_eq!((permutes(&on), permutes(&off)), (0, 2));
    assert!(on.memory.product_updates > off.memory.product_updates);
    assert!(on.memory.arena_bytes < off.memory.arena_bytes);
    eprintln!(
        "untied head training arena {} -> {} B, steps {} -> {}",
        off.memory.arena_bytes,
        on.memory.arena_bytes,
        off.steps.len(),
        on.steps.len()
    );
    let ids: Vec<i64> = (0..BATCH * SEQ).map(|i| ((i * 131 + 7) % VOCAB) as i64).collect();
    let labels: Vec<f32> = (0..BATCH * SEQ).map(|i| ((i * 17 + 3) % VOCAB) as f32).collect();
    let x = HostTensor::from_i64(Shape::new([BATCH, SEQ]), ids).unwrap();
    let y = HostTensor::new(Shape::new([BATCH, SEQ]), labels).unwrap();
    let feeds = [("x", &x), ("y", &y)];
    near(&run(&on, &weights, &feeds, 3), &run(&off, &weights, &feeds, 3), "untied head");
}
