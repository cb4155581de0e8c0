//! Mixed precision (`kiln_compiler::autocast`): the policy table on traced training steps, the
//! graph's interface and master weights kept in f32, casts fused, and every zoo step planned at
//! its half size.

use kiln::compiler::autocast::{Rule, rule};
use kiln::compiler::ir::fused::Inst;
use kiln::compiler::ir::{DType, Graph, Op};
use kiln::compiler::step::{forward_graph_with, train_step_graph_with};
use kiln::compiler::validate::validate;
use kiln::compiler::{CompileOptions, Precision, compile};
use kiln::zoo;

fn step(name: &str, precision: Precision) -> Graph {
    let m = zoo::by_name(name).unwrap();
    train_step_graph_with(&m.model(), m.x_shape(), m.y_shape(), &m.config(), 1, precision).unwrap()
}

fn operand_types(g: &Graph, n: kiln::compiler::ir::NodeId) -> Vec<DType> {
    g.operands(n).iter().map(|&o| g.node(o).dtype).collect()
}

#[test]
fn products_compute_in_half_and_the_rest_as_the_table_says() {
    for (name, precision, half) in
        [("transformer", Precision::BF16, DType::BF16), ("cnn", Precision::F16, DType::F16)]
    {
        let g = step(name, precision);
        let mut products = 0;
        for n in g.node_ids() {
            let node = g.node(n);
            let floats: Vec<DType> = operand_types(&g, n).into_iter().filter(|d| d.is_float()).collect();
            match &node.op {
                // Forward products and their gradients alike read half values.
                Op::MatMul { .. } | Op::Conv2d { .. } | Op::Attention { .. } | Op::AttentionGrad { .. } => {
                    products += 1;
                    assert!(
                        floats.iter().all(|&d| d == half),
                        "{name}: {} reads {floats:?}",
                        node.describe()
                    );
                    // A product accumulates and stores f32; attention stores its half output.
                    let stored = if matches!(node.op, Op::MatMul { .. } | Op::Conv2d { .. }) {
                        DType::F32
                    } else {
                        half
                    };
                    assert_eq!(node.dtype, stored, "{name}: {}", node.describe());
                }
                Op::Softmax { .. } | Op::LogSoftmax { .. } => {
                    assert_eq!(floats, [DType::F32], "{name}: {}", node.describe());
                }
                // The optimizer reads f32 parameters, gradients and state.
                Op::ApplyAdam { .. } | Op::ApplySgd { .. } => {
                    assert!(
                        floats.iter().all(|&d| d == DType::F32),
                        "{name}: {} reads {floats:?}",
                        node.describe()
                    );
                }
                Op::Variable { dtype, .. } => assert_eq!(*dtype, DType::F32, "{name}: master weights"),
                _ => {}
            }
        }
        assert!(products > 0, "{name}: no products");
        // The interface keeps its traced types.
        for (out, id) in g.outputs() {
            assert_eq!(g.node(*id).dtype, DType::F32, "{name}: output {out}");
        }
    }
}

#[test]
fn the_table_names_products_reductions_and_sources() {
    assert_eq!(rule(&Op::MatMul { transpose_a: false, transpose_b: false }), Rule::Half);
    assert_eq!(rule(&Op::Softmax { axis: 1 }), Rule::F32);
    assert_eq!(
        rule(&Op::Reduce { op: kiln::compiler::ir::ReduceOp::Sum, axes: vec![0], keepdims: false }),
        Rule::F32
    );
    assert_eq!(rule(&Op::Unary(kiln::compiler::ir::UnaryOp::Relu)), Rule::Follow);
    assert_eq!(rule(&Op::Unary(kiln::compiler::ir::UnaryOp::Exp)), Rule::F32);
    assert_eq!(rule(&Op::Cast { to: DType::F32 }), Rule::Keep);
}

#[test]
fn f32_precision_changes_nothing() {
    let m = zoo::by_name("cnn").unwrap();
    let plain =
        kiln::compiler::step::train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    let same = step("cnn", Precision::F32);
    assert_eq!(kiln::compiler::ir::dump(&plain), kiln::compiler::ir::dump(&same));
}

#[test]
fn a_forward_pass_returns_its_traced_type() {
    let m = zoo::by_name("mlp").unwrap();
    let g = forward_graph_with(&m.model(), m.x_shape(), Precision::BF16).unwrap();
    let y = g.output("y").unwrap();
    assert_eq!(g.node(y).dtype, DType::F32);
    assert!(g.node_ids().any(|n| g.node(n).dtype == DType::BF16));
}

/// Every zoo training step plans in bf16 and f16: the plan validates, its products are half,
/// no cast is a step of its own where its producer could take it (a fused group's last
/// instruction), and where activations outweigh the weights' half copies, it keeps less for the
/// backward pass than f32.
#[test]
fn every_zoo_step_plans_in_half_precision() {
    for m in zoo::all() {
        let f32_plan = compile(step(m.name, Precision::F32), &CompileOptions::default()).unwrap();
        for precision in [Precision::BF16, Precision::F16] {
            let plan = compile(step(m.name, precision), &CompileOptions::default()).unwrap();
            validate(&plan).unwrap();
            let half = if precision == Precision::BF16 { DType::BF16 } else { DType::F16 };
            assert!(plan.values.iter().any(|v| v.dtype == half), "{} {precision}", m.name);
            let readers = |value: usize| plan.steps.iter().filter(|s| s.inputs.contains(&value)).count();
            for s in &plan.steps {
                let Op::Cast { .. } = s.op else { continue };
                let x = s.inputs[0];
                let producer = plan.steps.iter().find(|p| p.output == Some(x));
                let fusable =
                    producer.is_some_and(|p| matches!(p.op, Op::Fused(_) | Op::Unary(_) | Op::Binary(_)));
                assert!(
                    !(fusable && readers(x) == 1 && plan.outputs.iter().all(|o| o.value != x)),
                    "{} {precision}: {} casts the value of {} alone",
                    m.name,
                    s.label,
                    producer.unwrap().label
                );
            }
            // Where activations outweigh the weights' half copies, half values are kept.
            let kept = |p: &kiln::compiler::Plan| {
                p.memory.rewrites.saved_values.as_ref().map(|s| s.kept_bytes_after)
            };
            if matches!(m.name, "cnn" | "transformer") {
                assert!(
                    kept(&plan) < kept(&f32_plan),
                    "{} {precision}: {:?} >= {:?}",
                    m.name,
                    kept(&plan),
                    kept(&f32_plan)
                );
            }
            // Casts fused into groups store the group's type.
            for s in &plan.steps {
                if let Op::Fused(f) = &s.op
                    && f.insts.iter().any(|i| matches!(i, Inst::Cast(..)))
                {
                    let out = s.output.map(|o| plan.values[o].dtype);
                    assert!(out.is_some_and(|d| d.is_float()), "{}: {}", m.name, s.label);
                }
            }
        }
    }
}

#[test]
fn precisions_parse_from_the_command_line_names() {
    assert_eq!("bf16".parse::<Precision>().unwrap(), Precision::BF16);
    assert_eq!("f16".parse::<Precision>().unwrap(), Precision::F16);
    assert_eq!("f32".parse::<Precision>().unwrap(), Precision::F32);
    let err = "int8".parse::<Precision>().unwrap_err();
    assert!(err.contains("f32, bf16 or f16"), "{err}");
}

/// Every zoo model trains in bf16 and f16 on the host: its plan reads half values through f32
/// copies (`widen`), the losses are finite and within a few percent of f32's from the same
/// weights and batches, and the master weights move.
#[test]
fn the_zoo_trains_in_half_precision_on_the_host() {
    use kiln::prelude::*;
    for m in zoo::all() {
        let batch = m.batch.min(8);
        let m = m.with_batch(batch);
        let batches: Vec<_> = (0..3).map(|i| m.batch_data(i).unwrap()).collect();
        let losses = |precision: Precision| -> Vec<f32> {
            let mut t = Trainer::new(m.model(), m.config(), Device::cpu().backend(0).unwrap())
                .with_precision(precision);
            batches.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss).collect()
        };
        let full = losses(Precision::F32);
        for precision in [Precision::BF16, Precision::F16] {
            let mixed = losses(precision);
            // Rounded products: not f32's bits.
            assert_ne!(mixed, full, "{} {precision}: the step computed in f32", m.name);
            for (a, b) in full.iter().zip(&mixed) {
                assert!(b.is_finite(), "{} {precision}: {mixed:?}", m.name);
                assert!(
                    (a - b).abs() <= 0.05 * a.abs().max(1.0),
                    "{} {precision}: {mixed:?} against f32 {full:?}",
                    m.name
                );
            }
        }
    }
}

/// A fused mixed-precision plan computes the unfused plan's bits: each half instruction (and a
/// half product read by its epilogue) rounds to its type as the unfused op stores it.
#[test]
fn fused_half_plans_compute_the_unfused_bits() {
    use kiln::prelude::*;
    for name in ["mlp", "cnn", "transformer"] {
        let m = zoo::by_name(name).unwrap().with_batch(4);
        let graph = kiln::compare::graph_at(&m, kiln::compare::Mode::Train, Precision::BF16).unwrap();
        let (x, y) = m.batch_data(3).unwrap();
        let run = |fuse: bool| {
            let mut options = CompileOptions::default().with_half_kernels(false).with_fusion(fuse);
            options.tile_updates = false;
            let plan = compile(graph.clone(), &options).unwrap();
            let mut cpu = kiln::runtime::CpuBackend::new(9);
            let id = cpu.load(plan.clone()).unwrap();
            let mut out = cpu.call(id, &[("x", &x), ("y", &y)]).unwrap();
            out.sort_by(|a, b| a.0.cmp(&b.0));
            let mut bits: Vec<u32> =
                out.iter().flat_map(|(_, t)| t.data().iter().map(|v| v.to_bits())).collect();
            for v in plan.variables.iter().filter(|v| !v.key.starts_with("optimizer/")) {
                bits.extend(cpu.read_variable(&v.key).unwrap().data().iter().map(|w| w.to_bits()));
            }
            bits
        };
        assert!(run(true) == run(false), "{name}: fused and unfused bf16 steps differ");
    }
}

/// The GPT example's model trained the same steps on the same windows from the same weights in
/// f32 and in bf16 mixed precision: the held-out loss in bf16 is within 2% of f32's.
#[test]
fn the_gpt_example_keeps_its_held_out_loss_in_bf16() {
    use kiln::gpt::{self, BATCH, SEQ};
    use kiln::prelude::{CpuBackend, Trainer};
    let text = gpt::shakespeare().unwrap();
    let split = text.len() * 9 / 10;
    let (train, held) = (&text[..split], &text[split..]);
    let held_offsets: Vec<usize> = (0..held.len() - SEQ - 1).step_by(4 * SEQ).collect();
    let (hx, hy) = gpt::windows(held, &held_offsets).unwrap();
    let steps = 120;
    let mut losses = Vec::new();
    for precision in [Precision::F32, Precision::BF16] {
        let mut trainer =
            Trainer::new(gpt::model(), gpt::config(), Box::new(CpuBackend::new(5))).with_precision(precision);
        let before = trainer.evaluate(&hx, &hy, 64).unwrap().loss;
        for step in 0..steps {
            // The same windows for both runs: offsets from the step number alone.
            let offsets: Vec<usize> =
                (0..BATCH).map(|r| (step * 7919 + r * 104_729) % (train.len() - SEQ - 1)).collect();
            let (x, y) = gpt::windows(train, &offsets).unwrap();
            trainer.train_step(&x, &y).unwrap();
        }
        let after = trainer.evaluate(&hx, &hy, 64).unwrap().loss;
        assert!(after < before - 1.0, "{precision}: held-out loss {before} -> {after} after {steps} steps");
        losses.push(after);
    }
    let (f32_loss, bf16_loss) = (losses[0], losses[1]);
    let gap = (bf16_loss - f32_loss).abs() / f32_loss;
    println!(
        "held-out loss after {steps} steps: f32 {f32_loss:.4}, bf16 {bf16_loss:.4} ({:.2}%)",
        100.0 * gap
    );
    assert!(gap <= 0.02, "bf16 held-out loss {bf16_loss} is {:.2}% from f32's {f32_loss}", 100.0 * gap);
}

/// A product of tensors a user cast to half is half, as PyTorch's product of bf16 tensors is:
/// its f32 accumulation rounded once (`DType::accumulated` is the op's own type).
#[test]
fn a_product_of_half_tensors_is_half() {
    use kiln::prelude::{Init, Tracer};
    let t = Tracer::new("half");
    let x = t.input("x", [4, 3]).cast(DType::BF16);
    let w = t.param("w", [3, 2], Init::GlorotUniform).cast(DType::BF16);
    let b = t.param("b", [2], Init::Zeros).cast(DType::BF16);
    let y = x.matmul(&w) + b;
    assert_eq!(y.dtype(), DType::BF16);
    t.output("y", &y.cast(DType::F32));
    let g = t.finish().unwrap();
    let product = g.node_ids().find(|&n| matches!(g.node(n).op, Op::MatMul { .. })).unwrap();
    assert_eq!(g.node(product).dtype, DType::F32, "accumulated in f32, then cast");
    compile(g, &CompileOptions::default()).unwrap();
}

/// A batch norm stores its output in its input's type (`Tensor::cast_like`, as an imported
/// BatchNormalization ends): in bf16 the normalised convolution, the residual add and the ReLU
/// after it are half, as PyTorch's batch norm, add and ReLU on half tensors store them; in f32
/// the `cast_like` is nothing.
#[test]
fn a_batch_norm_stores_its_input_type_and_the_residual_stream_stays_half() {
    use kiln::compiler::ir::{BinaryOp, Init, Padding, UnaryOp};
    use kiln::compiler::trace::{Tensor, Tracer};
    let trace = || {
        let t = Tracer::new("residual block");
        let x = t.input("x", [2, 6, 6, 4]);
        let norm = |v: &Tensor, name: &str| {
            let mean = v.mean([0, 1, 2], true);
            let centred = v.clone() - &mean;
            let inv = (centred.square().mean([0, 1, 2], true) + 1e-5).rsqrt();
            let gamma = t.param(&format!("{name}/gamma"), [4], Init::Constant(1.0));
            (centred * &inv * &gamma).cast_like(v)
        };
        let w1 = t.param("w1", [3, 3, 4, 4], Init::GlorotUniform);
        let w2 = t.param("w2", [3, 3, 4, 4], Init::GlorotUniform);
        let a = norm(&x.conv2d(&w1, [1, 1], Padding::Same), "bn1").relu();
        let b = norm(&a.conv2d(&w2, [1, 1], Padding::Same), "bn2");
        let y = (b + &a).relu();
        let w3 = t.param("w3", [1, 1, 4, 2], Init::GlorotUniform);
        t.output("y", &y.conv2d(&w3, [1, 1], Padding::Same).sum(.., false));
        t.finish().unwrap()
    };
    let mut f32_graph = trace();
    kiln::compiler::autocast::apply(&mut f32_graph, Precision::F32).unwrap();
    assert!(
        f32_graph.node_ids().all(|n| !matches!(f32_graph.node(n).op, Op::CastLike | Op::Cast { .. })),
        "f32: no cast"
    );
    let mut g = trace();
    kiln::compiler::autocast::apply(&mut g, Precision::BF16).unwrap();
    let dtypes = |pick: fn(&Op) -> bool| -> Vec<DType> {
        g.node_ids().filter(|&n| pick(&g.node(n).op)).map(|n| g.node(n).dtype).collect()
    };
    assert_eq!(dtypes(|op| *op == Op::Unary(UnaryOp::Relu)), [DType::BF16, DType::BF16], "both ReLUs");
    let adds = dtypes(|op| *op == Op::Binary(BinaryOp::Add));
    assert_eq!(adds.iter().filter(|&&d| d == DType::BF16).count(), 1, "the residual add in half: {adds:?}");
    assert!(g.node_ids().all(|n| g.node(n).op != Op::CastLike), "resolved");
}
