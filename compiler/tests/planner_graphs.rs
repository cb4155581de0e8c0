//! The planner's invariants over thousands of random graphs: `compile` validates every plan (no
//! two buffers live at one step overlap, every buffer inside the arena and live whenever it is
//! read or written, variables read before their update), and here we also check the figures'
//! order: lower bound <= arena <= naive.

use kiln_compiler::ir::{DType, Init, Shape, VarRole};
use kiln_compiler::optim::Optimizer;
use kiln_compiler::optim::Sgd;
use kiln_compiler::trace::{Tensor, Tracer};
use kiln_compiler::{CompileOptions, compile};
use proptest::prelude::*;

/// xorshift64*: a tiny deterministic generator for the graph's shape.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn random_graph(seed: u64, ops: usize) -> kiln_compiler::ir::Graph {
    let mut r = Rng(seed | 1);
    let t = Tracer::new(format!("random{seed}"));
    let shapes = [vec![4, 8], vec![8, 8], vec![8], vec![4, 1], vec![2, 4, 8], vec![8, 4]];
    let mut pool: Vec<Tensor> = Vec::new();
    for i in 0..1 + r.below(3) {
        pool.push(t.input(&format!("x{i}"), shapes[r.below(shapes.len())].clone()));
    }
    let mut params = Vec::new();
    for i in 0..r.below(3) {
        let p = t.variable(
            &format!("p{i}"),
            shapes[r.below(shapes.len())].clone(),
            DType::F32,
            VarRole::Parameter,
            Init::Zeros,
        );
        params.push(p.clone());
        pool.push(p);
    }
    for _ in 0..ops {
        let a = pool[r.below(pool.len())].clone();
        let b = pool[r.below(pool.len())].clone();
        let next = match r.below(10) {
            0 => a.relu(),
            1 => a.exp() * 0.5,
            2 if Shape::broadcast(a.shape(), b.shape()).is_some() => &a + &b,
            3 if Shape::broadcast(a.shape(), b.shape()).is_some() => &a * &b,
            4 if a.rank() >= 2 && b.rank() >= 2 && a.shape().back(1) == b.shape().back(2) => a.matmul(&b),
            5 if a.rank() >= 1 => a.sum(-1, r.below(2) == 0),
            6 => a.reshape([a.shape().numel()]),
            7 if a.rank() == 2 => a.t(),
            8 => a.softmax(-1),
            _ => a.sigmoid(),
        };
        if next.id().is_some() && next.rank() >= 1 {
            pool.push(next);
        }
    }
    for i in 0..1 + r.below(3) {
        let out = pool[pool.len() - 1 - r.below(pool.len().min(6))].clone();
        t.output(&format!("out{i}"), &out);
    }
    // Sometimes update a parameter in place with another value of its shape.
    if let Some(p) = params.first() {
        let same: Vec<&Tensor> = pool.iter().filter(|x| x.shape() == p.shape() && x.id() != p.id()).collect();
        if !same.is_empty() && r.below(2) == 0 {
            let g = same[r.below(same.len())];
            Optimizer::from(Sgd::new(0.1)).apply(&[(p.clone(), "p0".into(), g.clone())]);
        }
    }
    t.finish().expect("random graphs are well-typed")
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(3000))]
    #[test]
    fn random_graphs_plan_validly(seed in any::<u64>(), ops in 1usize..60) {
        let graph = random_graph(seed, ops);
        let plan = compile(graph, &CompileOptions::default()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let m = &plan.memory;
        prop_assert!(m.arena_bytes >= m.lower_bound_bytes, "arena {} < bound {}", m.arena_bytes, m.lower_bound_bytes);
        prop_assert!(m.arena_bytes <= m.naive_bytes, "arena {} > naive {}", m.arena_bytes, m.naive_bytes);
        prop_assert_eq!(m.arena_bytes % plan.alignment, 0);
    }
}
