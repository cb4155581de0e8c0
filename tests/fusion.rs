//! Fusion (`kiln_compiler::fusion`): fused plans have fewer steps and no larger arenas, and
//! training with them computes the very bits the unfused plans compute, on every zoo model and on
//! random elementwise graphs.

use kiln::compiler::Plan;
use kiln::compiler::ir::{Op, Shape};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

fn options(fuse: bool) -> CompileOptions {
    // Tiling is a schedule choice that can differ between the two graphs; off, so that the same
    // products are computed and results can be compared bit for bit. Cheap recomputation (with
    // fusion only) adds steps of its own: off, so that the step counts below are fusion's.
    CompileOptions { tile_updates: false, cheap_remat: false, ..CompileOptions::default() }.with_fusion(fuse)
}

/// Every output of `steps` calls and every variable after them.
fn run(plan: &Plan, feeds: &[(&str, &HostTensor)], steps: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let mut outs = Vec::new();
    for _ in 0..steps {
        let mut out = backend.call(id, feeds).unwrap();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        outs.extend(out.into_iter().map(|(_, t)| t.data().to_vec()));
    }
    (outs, plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap().data().to_vec()).collect())
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter().map(|t| t.iter().map(|x| x.to_bits()).collect()).collect()
}

#[test]
fn every_zoo_step_is_fused_and_trains_bit_for_bit_as_unfused() {
    for m in zoo::all() {
        let m = m.with_batch(4);
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let fused = compile(graph.clone(), &options(true)).unwrap();
        let plain = compile(graph, &options(false)).unwrap();
        let name = m.name;
        assert!(fused.memory.rewrites.fused_groups > 0, "{name}: nothing fused");
        assert_eq!(plain.memory.rewrites.fused_groups, 0);
        assert_eq!(
            fused.steps.len() + fused.memory.rewrites.fused_ops - fused.memory.rewrites.fused_groups
                + fused.memory.product_updates
                + fused.memory.rewrites.conv_relu_grads,
            plain.steps.len() + fused.memory.rewrites.split_added_ops,
            "{name}: every fused op stands for the steps it replaced"
        );
        assert!(fused.steps.iter().any(|s| matches!(s.op, Op::Fused(_))));
        assert!(fused.render().contains("fused[v0 = "), "{name}: the dump shows the groups");
        // Every forward convolution carries its bias and activation as an epilogue.
        let convs = |p: &Plan| p.steps.iter().filter(|s| matches!(s.op, Op::Conv2d { .. })).count();
        let fused_convs =
            fused.steps.iter().filter(|s| matches!(&s.op, Op::Fused(f) if f.conv.is_some())).count();
        assert_eq!((convs(&fused), fused_convs), (0, convs(&plain)), "{name}: convolutions fused");
        if fused_convs > 0 {
            assert!(fused.render().contains("x0 = conv2d["), "{name}: the dump shows the convolution");
        }
        let (x, y) = m.batch_data(7).unwrap();
        let feeds = [("x", &x), ("y", &y)];
        let (a, va) = run(&fused, &feeds, 3);
        let (b, vb) = run(&plain, &feeds, 3);
        assert_eq!(bits(&a), bits(&b), "{name}: outputs differ");
        assert_eq!(bits(&va), bits(&vb), "{name}: variables differ");
    }
}

#[test]
fn fused_zoo_arenas_are_no_larger() {
    for m in zoo::all() {
        let graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let fused = compile(graph.clone(), &CompileOptions::default()).unwrap();
        let plain = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
        assert!(
            fused.memory.planned_total_bytes() <= plain.memory.planned_total_bytes(),
            "{}: fused {} > unfused {}",
            m.name,
            fused.memory.planned_total_bytes(),
            plain.memory.planned_total_bytes()
        );
        assert!(
            fused.memory.naive_bytes < plain.memory.naive_bytes,
            "{}: fused values are never made",
            m.name
        );
    }
}

/// Random chains of elementwise ops over operands of broadcasting shapes, some values read
/// several times, some outputs in the middle of chains, some reduced: fused and unfused plans
/// give the same bits.
#[test]
fn random_elementwise_graphs_fuse_to_the_same_bits() {
    let mut rng = StdRng::seed_from_u64(11);
    let mut fused_somewhere = 0;
    for case in 0..120 {
        let t = Tracer::new("random");
        let rank = rng.random_range(1..=3);
        let full: Vec<usize> = (0..rank).map(|_| rng.random_range(1..=9)).collect();
        let mut feeds: Vec<(String, HostTensor)> = Vec::new();
        let mut pool: Vec<Tensor> = Vec::new();
        for i in 0..rng.random_range(1..=4) {
            // An operand of the full shape, or one with some axes of size 1 or dropped.
            let mut dims = full.clone();
            if rng.random_range(0..2) == 0 {
                for d in dims.iter_mut() {
                    if rng.random_range(0..2) == 0 {
                        *d = 1;
                    }
                }
            }
            let drop = rng.random_range(0..=dims.len().min(1));
            let dims = dims[drop..].to_vec();
            let name = format!("x{i}");
            let shape = Shape::new(dims);
            feeds.push((
                name.clone(),
                HostTensor::from_fn(shape.clone(), |_| rng.random::<f32>() * 4.0 - 2.0).unwrap(),
            ));
            pool.push(t.input(&name, shape));
        }
        let mut outputs = 0;
        for _ in 0..rng.random_range(2..=12) {
            let a = pool[rng.random_range(0..pool.len())].clone();
            let b = pool[rng.random_range(0..pool.len())].clone();
            let v = match rng.random_range(0..12) {
                0 => &a + &b,
                1 => &a * &b,
                2 => &a - &b,
                3 => a.sigmoid(),
                4 => a.tanh(),
                5 => a.relu(),
                6 => &a * 0.5 + 1.0,
                7 => a.maximum(&b),
                8 => a.gt(&b).select(&a, &b),
                9 => a.exp(),
                10 => a.square(),
                _ => a.abs().sqrt(),
            };
            if rng.random_range(0..5) == 0 {
                t.output(&format!("mid{outputs}"), &v);
                outputs += 1;
            }
            // Reductions of chains: fused with the chain as their prologue when they read it alone.
            if v.rank() > 0 && rng.random_range(0..4) == 0 {
                let axis = rng.random_range(0..v.rank()) as isize;
                let keep = rng.random_range(0..2) == 0;
                let r = match rng.random_range(0..3) {
                    0 => v.sum(vec![axis], keep),
                    1 => v.mean(vec![axis], keep),
                    _ => v.max(vec![axis], keep),
                };
                // Half of them go on elementwise: an epilogue of the reduction.
                let r = if rng.random_range(0..2) == 0 { (&r * 0.5 + 1.0).abs().sqrt() } else { r };
                t.output(&format!("reduced{outputs}"), &r);
                outputs += 1;
            }
            pool.push(v);
        }
        t.output("y", pool.last().unwrap());
        let graph = t.finish().unwrap();
        let fused = compile(graph.clone(), &options(true)).unwrap();
        let plain = compile(graph, &options(false)).unwrap();
        fused_somewhere += usize::from(fused.memory.rewrites.fused_groups > 0);
        let feeds: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let (a, _) = run(&fused, &feeds, 1);
        let (b, _) = run(&plain, &feeds, 1);
        assert_eq!(bits(&a), bits(&b), "case {case}: {}", fused.render());
    }
    assert!(fused_somewhere >= 60, "only {fused_somewhere} of 120 graphs had a group");
}

/// A dense layer's backward step writes relu's gradient over the activation it reads
/// (`Op::may_write_over`): the CPU makes that product in blocks of rows (here 93 of 700
/// columns, three whole blocks and one of 21), and every block computes the bits of the whole
/// unfused product.
#[test]
fn a_product_written_over_its_epilogue_operand_computes_the_unfused_bits() {
    use kiln::compiler::autodiff::gradients;
    for (k, n, transpose) in [(60, 700, true), (1, 700, true), (50, 131, false)] {
        let t = Tracer::new("dense backward");
        let x = t.input("x", [300, 200]);
        let w1 = t.input("w1", [200, n]);
        let w2 = t.input("w2", if transpose { [k, n] } else { [n, k] });
        let r = t.input("r", [300, k]);
        let s = t.input("s", [300, 1]);
        let h = x.matmul(&w1).relu();
        let y = if transpose { h.matmul_t(&w2, false, true) } else { h.matmul(&w2) };
        let loss = (&(&y * &r) * &s).sum(.., false);
        t.output("loss", &loss);
        let graph = t.finish().unwrap();
        let (mut graph, grads) = gradients(graph, loss.id().unwrap(), &[x.id().unwrap()]).unwrap();
        graph.set_output("dx", grads[0].unwrap());
        let fused = compile(graph.clone(), &options(true)).unwrap();
        let plain = compile(graph, &options(false)).unwrap();
        let written_over =
            fused.steps.iter().any(|s| matches!(&s.op, Op::Fused(f) if f.matmul.is_some()) && s.in_place);
        assert!(written_over, "k={k}: no product was planned over its epilogue operand:\n{}", fused.render());
        let mut rng = StdRng::seed_from_u64(k as u64);
        let mut draw = |dims: &[usize]| {
            let shape = Shape::from(dims);
            let data = (0..shape.numel()).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            HostTensor::new(shape, data).unwrap()
        };
        let feeds = [
            draw(&[300, 200]),
            draw(&[200, n]),
            draw(&if transpose { [k, n] } else { [n, k] }),
            draw(&[300, k]),
            draw(&[300, 1]),
        ];
        let names = ["x", "w1", "w2", "r", "s"];
        let feeds: Vec<(&str, &HostTensor)> = names.iter().copied().zip(feeds.iter()).collect();
        let (a, _) = run(&fused, &feeds, 1);
        let (b, _) = run(&plain, &feeds, 1);
        assert_eq!(bits(&a), bits(&b), "k={k}: outputs differ");
    }
}

/// A causal language model with the sparse loss: the class-index row and the label mask
/// `ids == iota` are instructions of the fused groups that read them (copied into each), never
/// buffers, and training computes the unfused bits. (The causal mask is the attention op's own
/// flag, without iotas.)
#[test]
fn iotas_and_label_masks_fuse_into_their_readers_and_train_the_same_bits() {
    use kiln::compiler::nn::{Embedding, MultiHeadAttention};
    let (batch, seq, vocab) = (2, 6, 11);
    let model = Sequential::new()
        .add(Embedding::new(vocab, 8))
        .add(MultiHeadAttention::new(2).causal(true))
        .add(Dense::new(vocab));
    let config = TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(1e-2).into(),
        metrics: vec![Metric::SparseCategoricalAccuracy],
    };
    let (xs, ys) = (Shape::new([batch, seq]), Shape::new([batch, seq]));
    let graph = train_step_graph(&model, &xs, &ys, &config).unwrap();
    let fused = compile(graph.clone(), &options(true)).unwrap();
    let plain = compile(graph, &options(false)).unwrap();
    let iotas = |p: &Plan| p.steps.iter().filter(|s| matches!(s.op, Op::Iota { .. })).count();
    assert!(iotas(&plain) >= 1, "the unfused plan makes its iotas");
    assert_eq!(iotas(&fused), 0, "every iota is an instruction");
    let label_masks = fused
        .steps
        .iter()
        .filter(|s| matches!(&s.op, Op::Fused(f) if f.insts.iter().any(|i| matches!(i, kiln::compiler::ir::fused::Inst::Iota(_)))))
        .count();
    assert!(label_masks >= 3, "loss, its gradient and the accuracy compare as they go: {label_masks}");
    assert!(fused.memory.arena_bytes < plain.memory.arena_bytes);
    let ids = |seed: usize| {
        HostTensor::new(xs.clone(), (0..batch * seq).map(|i| ((i * 7 + seed) % vocab) as f32).collect())
            .unwrap()
    };
    let (x, y) = (ids(1), ids(4));
    let feeds = [("x", &x), ("y", &y)];
    let (a, va) = run(&fused, &feeds, 3);
    let (b, vb) = run(&plain, &feeds, 3);
    assert_eq!(bits(&a), bits(&b), "outputs differ");
    assert_eq!(bits(&va), bits(&vb), "variables differ");
}
