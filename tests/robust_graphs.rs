//! Random graphs run by every executor: the planned CPU backend, the eager executor under
//! TensorFlow's BFC and PyTorch's caching allocator, and the plain reference interpreter (no
//! arena, no reuse). They run the same kernels, so all four must agree exactly, on every output
//! and, for training steps, on every variable after each step.
//!
//! The generator favours what broke before: operands repeated within one op (`x * x`,
//! `concat([a, a, b])`, `a @ a`, `select(c, a, a)`), views of views, chains of elementwise ops
//! that run in place, outputs that later ops also read, and training steps whose updates write
//! variables that the next step reads again.

use kiln::compiler::ir::{Graph, Shape, VarRole};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::alloc::{Allocator, BfcAllocator, CachingAllocator, HostSource};
use kiln::runtime::eager::{CpuEager, EagerExecutor};
use kiln::runtime::reference::ReferenceInterpreter;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

const SEED: u64 = 5;

fn pick<'a>(r: &mut StdRng, pool: &'a [Tensor]) -> &'a Tensor {
    &pool[r.random_range(0..pool.len())]
}

/// A random forward graph of about `ops` ops over 1-3 inputs; the feeds to run it with.
fn random_graph(seed: u64, ops: usize) -> (Graph, Vec<(String, HostTensor)>) {
    let mut r = StdRng::seed_from_u64(seed);
    let t = Tracer::new(format!("g{seed}"));
    let (rows, cols) = (r.random_range(1..5usize), r.random_range(1..5usize));
    let mut pool: Vec<Tensor> = Vec::new();
    let mut feeds = Vec::new();
    for i in 0..r.random_range(1..4usize) {
        let name = format!("x{i}");
        let shape = if r.random_range(0..3) == 0 { Shape::from([cols]) } else { Shape::from([rows, cols]) };
        let data = HostTensor::from_fn(shape.clone(), |k| ((k * 7 + i * 3) % 11) as f32 * 0.2 - 1.0).unwrap();
        pool.push(t.input(&name, shape));
        feeds.push((name, data));
    }
    if r.random_range(0..2) == 0 {
        pool.push(t.param("w", [cols, cols], Init::GlorotUniform));
    }
    for _ in 0..ops {
        let a = pick(&mut r, &pool).clone();
        let b = pick(&mut r, &pool).clone();
        let same = a.shape() == b.shape();
        let square = a.rank() == 2 && a.dims()[0] == a.dims()[1];
        let next = match r.random_range(0..22) {
            0 => &a * &a,
            1 => &a + &a,
            2 if same => &a - &b,
            3 => a.concat(&[&a, &a], 0),
            4 if same => a.concat(&[&a, &b], -1),
            5 if square => a.matmul(&a),
            6 if a.rank() == 2 && b.rank() == 2 && a.dims()[1] == b.dims()[0] => a.matmul(&b),
            7 => a.gt(0.0).select(&a, &a),
            8 => a.reshape([a.shape().numel()]).reshape(a.shape().clone()),
            9 => a.relu().tanh().sigmoid(),
            10 => (&a * 0.5 + 1.0).abs().sqrt(),
            11 if a.rank() >= 1 => a.sum(-1, r.random_range(0..2) == 0),
            12 if a.rank() >= 1 => a.softmax(-1),
            13 if a.rank() == 2 => a.t(),
            14 if a.rank() == 2 => a.copy().t().copy(),
            15 if a.rank() >= 1 && a.dims()[a.rank() - 1] > 1 => a.slice(-1, 1, a.dims()[a.rank() - 1] - 1),
            16 if a.rank() >= 1 => a.pad(-1, 1, 0),
            17 if a.rank() >= 1 => a.max(-1, true),
            18 if a.rank() >= 1 => a.mean(-1, false),
            19 if Shape::broadcast(a.shape(), b.shape()).is_some() => &a * &b + &a,
            20 => a.exp().log(),
            _ => a.neg(),
        };
        // Scalars (full reductions) end a chain: concat and slice need an axis.
        if next.id().is_some() && next.rank() >= 1 {
            pool.push(next);
        }
    }
    // Several outputs: the last value, and a few earlier ones that later ops also read.
    let last = pool.len() - 1;
    t.output("out", &pool[last]);
    for i in 0..r.random_range(0..3usize) {
        let k = r.random_range(0..pool.len());
        t.output(&format!("early{i}"), &pool[k].copy());
    }
    (t.finish().expect("random graphs are well-typed"), feeds)
}

fn eager<A: Allocator>(allocator: A) -> EagerExecutor<A> {
    EagerExecutor::new(allocator, SEED, CpuEager)
}

/// Runs `graph` `calls` times on every executor; every output (and variable) must be identical.
fn check_all(name: &str, graph: Graph, feeds: &[(String, HostTensor)], calls: usize) {
    let feed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let plan = compile(graph.clone(), &CompileOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut planned = CpuBackend::new(SEED);
    let id = planned.load(plan.clone()).unwrap();
    let scheduled = kiln::compiler::optimize(graph).unwrap();
    let (g, order) = (&scheduled.graph, &scheduled.order);
    let mut bfc = eager(BfcAllocator::new(HostSource::new(), 1 << 30));
    let mut caching = eager(CachingAllocator::new(HostSource::new(), None));
    let mut reference = ReferenceInterpreter::new(SEED);
    for call in 0..calls {
        let expected = reference.run(g, order, &feed).unwrap_or_else(|e| panic!("{name}: {e}"));
        let runs = [
            ("planned", planned.call(id, &feed).unwrap()),
            ("eager BFC", bfc.run(g, order, &feed).unwrap().outputs),
            ("eager caching", caching.run(g, order, &feed).unwrap().outputs),
        ];
        for (who, outputs) in &runs {
            assert_eq!(outputs.len(), expected.len(), "{name} call {call}: {who}");
            for ((n, got), (_, want)) in outputs.iter().zip(&expected) {
                let same = got.shape() == want.shape()
                    && got
                        .data()
                        .iter()
                        .zip(want.data())
                        .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()));
                assert!(
                    same,
                    "{name} call {call}: {who} output {n} differs from the reference:\n{got:?}\n{want:?}"
                );
            }
        }
        // Everything but the persistent variables was returned to the allocators.
        let persistent: usize = plan.variables.iter().map(|v| v.bytes()).sum();
        assert!(
            bfc.allocator().stats().in_use <= persistent.div_ceil(256) * 256 + 256 * plan.variables.len()
        );
        assert!(
            caching.allocator().stats().in_use <= persistent.div_ceil(512) * 512 + 512 * plan.variables.len()
        );
    }
    for v in &plan.variables {
        let want = reference.read_variable(&v.key, &v.shape).expect("the reference made every variable");
        let got = [
            planned.read_variable(&v.key).unwrap(),
            bfc.read_variable(&v.key, &v.shape).unwrap().unwrap(),
            caching.read_variable(&v.key, &v.shape).unwrap().unwrap(),
        ];
        for g in got {
            assert_eq!(g, want, "{name}: variable {} differs", v.key);
        }
    }
}

#[test]
fn random_forward_graphs_agree_on_every_executor() {
    let cases = 5000;
    for seed in 0..cases {
        let (graph, feeds) = random_graph(seed, 4 + (seed as usize % 40));
        check_all(&format!("graph {seed}"), graph, &feeds, 2);
    }
    eprintln!("random forward graphs: {cases}, planned, eager (BFC, caching) and reference agree on all");
}

#[test]
fn random_training_steps_agree_on_every_executor() {
    let cases = 400;
    for seed in 0..cases {
        let mut r = StdRng::seed_from_u64(1000 + seed);
        let mut model = Sequential::new();
        for _ in 0..r.random_range(1..4) {
            let units = r.random_range(1..9usize);
            model = model.add(match r.random_range(0..3) {
                0 => Dense::new(units).relu(),
                1 => Dense::new(units).sigmoid(),
                _ => Dense::new(units),
            });
        }
        let (batch, features, classes) =
            (r.random_range(1..6usize), r.random_range(1..7usize), r.random_range(2..5usize));
        model = model.add(Dense::new(classes));
        let optimizer: Optimizer =
            if r.random_range(0..2) == 0 { Adam::new(0.05).into() } else { Sgd::new(0.1).into() };
        let config = TrainConfig {
            loss: Loss::SoftmaxCrossEntropy,
            optimizer,
            metrics: vec![Metric::CategoricalAccuracy],
        };
        let graph =
            train_step_graph(&model, Shape::from([batch, features]), Shape::from([batch, classes]), &config)
                .unwrap();
        let x = HostTensor::from_fn([batch, features], |k| (k % 5) as f32 * 0.3 - 0.6).unwrap();
        let y = HostTensor::from_fn([batch, classes], |k| {
            if k % classes == (k / classes) % classes { 1.0 } else { 0.0 }
        })
        .unwrap();
        let feeds = vec![("x".to_string(), x), ("y".to_string(), y)];
        let updated = graph.variables().len();
        assert!(updated > 0);
        check_all(&format!("training step {seed}"), graph, &feeds, 3);
    }
    eprintln!(
        "random training steps: {cases} models x 3 steps, every output and variable identical on all executors"
    );
    let _ = VarRole::Parameter;
}
