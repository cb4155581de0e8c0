//! `activation_rewrite`: graphs that compose GELU (erf or tanh form, as exporters write them)
//! compute the same values as one `UnaryOp::Gelu` / `GeluTanh` on the CPU backend, forms that
//! are not GELU stay composed, and a training step through a composed GELU differentiates the
//! one op (`GeluGrad`).

use kiln::compiler::activation_rewrite::rewrite;
use kiln::compiler::ir::{BinaryOp, Graph, Op, UnaryOp};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::prelude::*;

fn count(g: &Graph, f: impl Fn(&Op) -> bool) -> usize {
    g.node_ids().filter(|&n| f(&g.node(n).op)).count()
}

fn host(dims: &[usize], seed: u32) -> HostTensor {
    let n: usize = dims.iter().product();
    let data = (0..n).map(|i| (i as f32 * 0.7311 + seed as f32 * 1.37).sin() * 4.0).collect();
    HostTensor::new(dims.to_vec(), data).unwrap()
}

fn run(g: Graph, inputs: &[(&str, &HostTensor)]) -> Vec<(String, HostTensor)> {
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(g, &CompileOptions::default()).unwrap()).unwrap();
    cpu.call(id, inputs).unwrap()
}

fn same(want: &[(String, HostTensor)], got: &[(String, HostTensor)]) {
    for ((name, w), (_, g)) in want.iter().zip(got) {
        for (x, y) in w.data().iter().zip(g.data()) {
            assert!((x - y).abs() <= 2e-6 * (1.0 + x.abs()), "{name}: {x} vs {y}");
        }
    }
}

/// The exported forms become one op each and compute the composed values: PyTorch's opset-17
/// `nn.GELU` (x / √2 by a constant tensor, erf, + 1, · x, · 0.5), the factor 0.5 on x or on the
/// sum, scalar ops; GPT-2's `gelu_new` with `x ^ 3` and with `x · x · x`.
#[test]
fn composed_gelu_becomes_one_op_with_the_same_values() {
    let t = Tracer::new("composed");
    let x = t.input("x", [3, 50]);
    let root2 = t.fill(std::f32::consts::SQRT_2, Shape::scalar());
    let one = t.fill(1.0, Shape::scalar());
    let half = t.fill(0.5, Shape::scalar());
    let a = (&x * &(x.div(&root2).erf() + &one)) * &half;
    let b = x.mul(0.5) * (x.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + 1.0);
    let c = (x.div(std::f32::consts::SQRT_2).erf().add(1.0).mul(0.5)) * &x;
    let k = (2.0 / std::f32::consts::PI).sqrt();
    let d = x.mul(0.5) * (((&x + &x.pow(3.0).mul(0.044715)).mul(k)).tanh() + 1.0);
    let e = (&x * &((((&x * &x) * &x).mul(0.044715) + &x).mul(k).tanh() + 1.0)).mul(0.5);
    for (name, v) in [("a", &a), ("b", &b), ("c", &c), ("d", &d), ("e", &e)] {
        t.output(name, v);
    }
    let composed = t.finish().unwrap();
    let mut one_op = composed.clone();
    assert_eq!(rewrite(&mut one_op).unwrap(), 5);
    assert_eq!(count(&one_op, |o| matches!(o, Op::Unary(UnaryOp::Gelu))), 3);
    assert_eq!(count(&one_op, |o| matches!(o, Op::Unary(UnaryOp::GeluTanh))), 2);
    assert_eq!(count(&one_op, |o| matches!(o, Op::Unary(UnaryOp::Erf | UnaryOp::Tanh))), 0);
    let x = host(&[3, 50], 1);
    same(&run(composed, &[("x", &x)]), &run(one_op, &[("x", &x)]));
}

/// Not GELU, or GELU whose intermediate something else reads: left as written.
#[test]
fn other_forms_stay_composed() {
    let t = Tracer::new("other");
    let x = t.input("x", [4, 6]);
    let y = t.input("y", [4, 6]);
    // Another constant, another operand, an intermediate read twice, a broadcast x.
    let a = x.mul(0.5) * (x.mul(0.6).erf() + 1.0);
    let b = y.mul(0.5) * (x.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + 1.0);
    let s = x.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + 1.0;
    let c = x.mul(0.5) * &s + &s;
    let r = t.input("r", [1, 6]);
    let d = (r.mul(0.5)) * (x.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + 1.0);
    // A one-element 1 of higher rank: the result is [1, 4, 6], not x's shape.
    let e = x.mul(0.5) * (x.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + &t.fill(1.0, Shape::new([1, 1, 1])));
    // Tanh forms: another coefficient, a square for the cube, the cube of another input.
    let k = (2.0 / std::f32::consts::PI).sqrt();
    let f = x.mul(0.5) * ((&x + &x.pow(3.0).mul(0.04)).mul(k).tanh() + 1.0);
    let g2 = x.mul(0.5) * ((&x + &(&x * &x).mul(0.044715)).mul(k).tanh() + 1.0);
    let h = x.mul(0.5) * ((&x + &y.pow(3.0).mul(0.044715)).mul(k).tanh() + 1.0);
    for (name, v) in [("a", &a), ("b", &b), ("c", &c), ("d", &d), ("e", &e), ("f", &f), ("g", &g2), ("h", &h)]
    {
        t.output(name, v);
    }
    let mut g = t.finish().unwrap();
    assert_eq!(rewrite(&mut g).unwrap(), 0);
    assert_eq!(count(&g, |o| matches!(o, Op::Unary(UnaryOp::Gelu | UnaryOp::GeluTanh))), 0);
}

/// A training step through a composed GELU: its gradient is one `GeluGrad` op (`GeluTanhGrad`
/// for the tanh form), and no erf or tanh is left to keep for the backward pass.
#[test]
fn a_training_step_differentiates_the_one_op() {
    /// A dense layer then a composed GELU: the tanh form or the erf form.
    struct Composed(bool);
    impl Layer for Composed {
        fn kind(&self) -> &'static str {
            "composed_gelu"
        }
        fn forward(&self, x: &Tensor) -> Tensor {
            let w = x.tracer().param("w", [8, 8], Init::Constant(0.1));
            let h = x.matmul(&w);
            let sum = if self.0 {
                let k = (2.0 / std::f32::consts::PI).sqrt();
                (&h + &h.pow(3.0).mul(0.044715)).mul(k).tanh() + 1.0
            } else {
                h.mul(std::f32::consts::FRAC_1_SQRT_2).erf() + 1.0
            };
            h.mul(0.5) * sum
        }
    }
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Sgd::new(0.1).into(), metrics: vec![] };
    let g = train_step_graph(&Composed(false), Shape::new([4, 8]), Shape::new([4, 8]), &config).unwrap();
    assert_eq!(count(&g, |o| matches!(o, Op::Unary(UnaryOp::Erf))), 0);
    assert_eq!(count(&g, |o| matches!(o, Op::Unary(UnaryOp::Gelu))), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::Binary(BinaryOp::GeluGrad))), 1);
    let g = train_step_graph(&Composed(true), Shape::new([4, 8]), Shape::new([4, 8]), &config).unwrap();
    assert_eq!(count(&g, |o| matches!(o, Op::Unary(UnaryOp::Tanh))), 0);
    assert_eq!(count(&g, |o| matches!(o, Op::Unary(UnaryOp::GeluTanh))), 1);
    assert_eq!(count(&g, |o| matches!(o, Op::Binary(BinaryOp::GeluTanhGrad))), 1);
}
