//! Unary, binary, scalar and select kernels against f64 references: ranks 0..4, odd sizes,
//! broadcasting both ways, sizes above the parallel threshold, and in-place execution.

mod common;
use common::*;
use kiln_compiler::ir::{BinaryOp, Op, ScalarOp, UnaryOp};

fn erf(x: f64) -> f64 {
    libm::erf(x)
}

fn unary_ref(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                0.0
            }
        }
        UnaryOp::Relu => x.max(0.0),
        UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Gelu => 0.5 * x * (1.0 + erf(x / 2f64.sqrt())),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + (gelu_tanh_u(x)).tanh()),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Square => x * x,
        UnaryOp::Reciprocal => 1.0 / x,
        UnaryOp::Erf => erf(x),
    }
}

/// u = √(2/π)·(x + 0.044715·x³) of GELU's tanh form.
fn gelu_tanh_u(x: f64) -> f64 {
    (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)
}

const UNARY: [UnaryOp; 15] = UnaryOp::ALL;

/// Inputs inside each op's domain.
fn unary_input(op: UnaryOp, dims: &[usize], seed: u64) -> T {
    let mut rng = Rng::new(seed);
    match op {
        UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Reciprocal => rng.tensor(dims, 0.1, 4.0),
        UnaryOp::Sign => {
            let n = dims.iter().product();
            T::new(dims, (0..n).map(|_| rng.below(3) as f32 - 1.0).collect())
        }
        _ => rng.tensor(dims, -4.0, 4.0),
    }
}

const SHAPES: [&[usize]; 6] = [&[], &[1], &[3], &[7, 33], &[2, 3, 4, 5], &[40_003]];

#[test]
fn unary_ops_match_reference() {
    for op in UNARY {
        for (i, dims) in SHAPES.iter().enumerate() {
            let x = unary_input(op, dims, i as u64 + 1);
            let got = run(&Op::Unary(op), &[&x]);
            assert_eq!(got.dims, x.dims);
            let want: Vec<f64> = x.data.iter().map(|&v| unary_ref(op, v as f64)).collect();
            assert_close(&got.data, &want, 2e-6);
            let in_place = run_aliased(&Op::Unary(op), &[&x], &[0]);
            assert_eq!(in_place.data, got.data, "{op:?} in place");
        }
    }
}

#[test]
fn sigmoid_and_gelu_are_stable_at_extremes() {
    let x = T::new(&[6], vec![-1000.0, -100.0, -30.0, 30.0, 100.0, 1000.0]);
    let s = run(&Op::Unary(UnaryOp::Sigmoid), &[&x]);
    assert_close(&s.data, &[0.0, 0.0, 9.357622968839299e-14, 1.0, 1.0, 1.0], 1e-6);
    assert!(s.data.iter().all(|v| v.is_finite()));
    let g = run(&Op::Unary(UnaryOp::Gelu), &[&x]);
    assert_close(&g.data, &[0.0, 0.0, 0.0, 30.0, 100.0, 1000.0], 1e-6);
    let sign = run(&Op::Unary(UnaryOp::Sign), &[&T::new(&[3], vec![0.0, -0.0, -3.0])]);
    assert_eq!(sign.data.iter().map(|v| *v == 0.0).collect::<Vec<_>>(), [true, true, false]);
}

fn binary_ref(op: BinaryOp, a: f64, b: f64) -> f64 {
    let f = |c: bool| if c { 1.0 } else { 0.0 };
    let cdf = |x: f64| 0.5 * (1.0 + erf(x / 2f64.sqrt()));
    let pdf = |x: f64| (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Maximum => a.max(b),
        BinaryOp::Minimum => a.min(b),
        BinaryOp::Greater => f(a > b),
        BinaryOp::GreaterEqual => f(a >= b),
        BinaryOp::Less => f(a < b),
        BinaryOp::LessEqual => f(a <= b),
        BinaryOp::Equal => f(a == b),
        BinaryOp::NotEqual => f(a != b),
        BinaryOp::ReluGrad => {
            if a > 0.0 {
                b
            } else {
                0.0
            }
        }
        BinaryOp::GeluGrad => b * (cdf(a) + a * pdf(a)),
        BinaryOp::GeluTanhGrad => {
            let t = gelu_tanh_u(a).tanh();
            let du = (2.0 / std::f64::consts::PI).sqrt() * (1.0 + 3.0 * 0.044715 * a * a);
            b * (0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * du)
        }
        BinaryOp::SigmoidGrad => b * a * (1.0 - a),
        BinaryOp::TanhGrad => b * (1.0 - a * a),
    }
}

const BROADCASTING: [BinaryOp; 13] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Pow,
    BinaryOp::Maximum,
    BinaryOp::Minimum,
    BinaryOp::Greater,
    BinaryOp::GreaterEqual,
    BinaryOp::Less,
    BinaryOp::LessEqual,
    BinaryOp::Equal,
    BinaryOp::NotEqual,
];

const GRADS: [BinaryOp; 5] = [
    BinaryOp::ReluGrad,
    BinaryOp::GeluGrad,
    BinaryOp::GeluTanhGrad,
    BinaryOp::SigmoidGrad,
    BinaryOp::TanhGrad,
];

/// Operands for `op`: a positive base for pow, small integers for comparisons (so ties occur).
fn binary_inputs(op: BinaryOp, da: &[usize], db: &[usize], seed: u64) -> (T, T) {
    let mut rng = Rng::new(seed);
    let mut ints = |dims: &[usize]| {
        let n = dims.iter().product();
        T::new(dims, (0..n).map(|_| rng.below(3) as f32 - 1.0).collect())
    };
    match op {
        BinaryOp::Greater
        | BinaryOp::GreaterEqual
        | BinaryOp::Less
        | BinaryOp::LessEqual
        | BinaryOp::Equal
        | BinaryOp::NotEqual
        | BinaryOp::Maximum
        | BinaryOp::Minimum => (ints(da), ints(db)),
        BinaryOp::Pow => (rng.tensor(da, 0.1, 3.0), rng.tensor(db, -2.0, 2.0)),
        BinaryOp::Div => (rng.tensor(da, -2.0, 2.0), rng.tensor(db, 0.5, 2.0)),
        _ => (rng.tensor(da, -3.0, 3.0), rng.tensor(db, -3.0, 3.0)),
    }
}

fn binary_expected(op: BinaryOp, a: &T, b: &T, out: &[usize]) -> Vec<f64> {
    let n: usize = out.iter().product();
    (0..n)
        .map(|i| {
            let idx = unravel(i, out);
            let x = a.data[broadcast_index(&idx, &a.dims)] as f64;
            let y = b.data[broadcast_index(&idx, &b.dims)] as f64;
            binary_ref(op, x, y)
        })
        .collect()
}

const PAIRS: [(&[usize], &[usize]); 13] = [
    (&[], &[]),
    (&[], &[3]),
    (&[3], &[]),
    (&[1], &[1]),
    (&[7, 33], &[7, 33]),
    (&[4, 3], &[3]),
    (&[3], &[4, 3]),
    (&[32, 10], &[10]),
    (&[4, 1, 3], &[5, 1]),
    (&[1, 5], &[4, 1]),
    (&[2, 3, 4, 5], &[3, 1, 5]),
    (&[2, 1, 4, 1], &[1, 3, 1, 5]),
    (&[300, 1, 130], &[1, 2, 130]),
];

#[test]
fn binary_ops_broadcast_like_numpy() {
    for op in BROADCASTING {
        for (i, (da, db)) in PAIRS.iter().enumerate() {
            let (a, b) = binary_inputs(op, da, db, 10 + i as u64);
            let got = run(&Op::Binary(op), &[&a, &b]);
            let want = binary_expected(op, &a, &b, &got.dims);
            assert_close(&got.data, &want, 2e-6);
        }
    }
}

#[test]
fn gradient_helpers_match_reference() {
    for op in GRADS {
        for (i, dims) in SHAPES.iter().enumerate() {
            let (a, b) = binary_inputs(op, dims, dims, 50 + i as u64);
            let got = run(&Op::Binary(op), &[&a, &b]);
            assert_close(&got.data, &binary_expected(op, &a, &b, dims), 2e-6);
        }
    }
}

#[test]
fn gelu_grad_is_the_derivative_of_gelu() {
    let x = T::new(&[7], vec![-3.0, -1.5, -0.3, 0.0, 0.4, 1.1, 2.9]);
    let ones = T::new(&[7], vec![1.0; 7]);
    let g = run(&Op::Binary(BinaryOp::GeluGrad), &[&x, &ones]);
    let h = 1e-3f64;
    let gelu = |v: f64| 0.5 * v * (1.0 + erf(v / 2f64.sqrt()));
    let fd: Vec<f64> =
        x.data.iter().map(|&v| (gelu(v as f64 + h) - gelu(v as f64 - h)) / (2.0 * h)).collect();
    assert_close(&g.data, &fd, 1e-5);
}

#[test]
fn binary_ops_run_in_place() {
    let cases: [(&[usize], &[usize]); 5] =
        [(&[7, 33], &[7, 33]), (&[4, 3], &[3]), (&[5], &[]), (&[50_000], &[50_000]), (&[300, 130], &[130])];
    for op in [BinaryOp::Sub, BinaryOp::Div, BinaryOp::Maximum, BinaryOp::Greater] {
        for (i, (da, db)) in cases.iter().enumerate() {
            let (a, b) = binary_inputs(op, da, db, 70 + i as u64);
            let fresh = run(&Op::Binary(op), &[&a, &b]);
            let left = run_aliased(&Op::Binary(op), &[&a, &b], &[0]);
            assert_eq!(left.data, fresh.data, "{op:?} {da:?} {db:?} into a");
            // The same operands swapped: the output aliases the second operand.
            let swapped = run(&Op::Binary(op), &[&b, &a]);
            let right = run_aliased(&Op::Binary(op), &[&b, &a], &[1]);
            assert_eq!(right.data, swapped.data, "{op:?} {db:?} {da:?} into b");
        }
    }
    // x * x with the output on the one shared buffer.
    for dims in [&[7usize, 33][..], &[50_000]] {
        let x = rand(dims, 3);
        let sq = run_aliased(&Op::Binary(BinaryOp::Mul), &[&x, &x], &[0, 1]);
        let want: Vec<f64> = x.data.iter().map(|&v| v as f64 * v as f64).collect();
        assert_close(&sq.data, &want, 1e-6);
    }
}

fn scalar_ref(op: ScalarOp, x: f64, c: f64) -> f64 {
    let f = |b: bool| if b { 1.0 } else { 0.0 };
    match op {
        ScalarOp::Add => x + c,
        ScalarOp::Mul => x * c,
        ScalarOp::RSub => c - x,
        ScalarOp::RDiv => c / x,
        ScalarOp::Pow => x.powf(c),
        ScalarOp::Max => x.max(c),
        ScalarOp::Min => x.min(c),
        ScalarOp::Greater => f(x > c),
        ScalarOp::GreaterEqual => f(x >= c),
        ScalarOp::Less => f(x < c),
        ScalarOp::LessEqual => f(x <= c),
        ScalarOp::Equal => f(x == c),
    }
}

#[test]
fn scalar_ops_match_reference() {
    let ops = [
        (ScalarOp::Add, 1.5),
        (ScalarOp::Mul, -0.25),
        (ScalarOp::RSub, 1.0),
        (ScalarOp::RDiv, 2.0),
        (ScalarOp::Pow, 2.0),
        (ScalarOp::Pow, 0.5),
        (ScalarOp::Pow, 3.0),
        (ScalarOp::Pow, -1.0),
        (ScalarOp::Pow, 0.0),
        (ScalarOp::Pow, 1.0),
        (ScalarOp::Pow, -1.5),
        (ScalarOp::Max, 0.0),
        (ScalarOp::Min, 0.5),
        (ScalarOp::Greater, 0.0),
        (ScalarOp::GreaterEqual, 0.0),
        (ScalarOp::Less, 1.0),
        (ScalarOp::LessEqual, 1.0),
        (ScalarOp::Equal, 0.0),
    ];
    for (op, c) in ops {
        for (i, dims) in SHAPES.iter().enumerate() {
            let mut rng = Rng::new(90 + i as u64);
            let n: usize = dims.iter().product();
            let x = match op {
                ScalarOp::Pow | ScalarOp::RDiv => rng.tensor(dims, 0.2, 3.0),
                _ => T::new(dims, (0..n).map(|_| (rng.below(7) as f32 - 3.0) / 2.0).collect()),
            };
            let o = Op::Scalar { op, value: c };
            let got = run(&o, &[&x]);
            let want: Vec<f64> = x.data.iter().map(|&v| scalar_ref(op, v as f64, c as f64)).collect();
            assert_close(&got.data, &want, 2e-6);
            assert_eq!(run_aliased(&o, &[&x], &[0]).data, got.data, "{op:?} {c} in place");
        }
    }
    // x^2 and x^0.5 are exact.
    let x = rand(&[33], 5);
    let sq = run(&Op::Scalar { op: ScalarOp::Pow, value: 2.0 }, &[&x]);
    assert!(sq.data.iter().zip(&x.data).all(|(s, v)| *s == v * v));
    let pos = Rng::new(6).tensor(&[33], 0.0, 9.0);
    let rt = run(&Op::Scalar { op: ScalarOp::Pow, value: 0.5 }, &[&pos]);
    assert!(rt.data.iter().zip(&pos.data).all(|(s, v)| *s == v.sqrt()));
}

#[test]
fn select_broadcasts_all_three_operands() {
    let cases: [[&[usize]; 3]; 7] = [
        [&[], &[], &[]],
        [&[5], &[5], &[5]],
        [&[4, 1], &[3], &[]],
        [&[3], &[4, 3], &[4, 1]],
        [&[2, 1, 4], &[3, 1], &[1, 1, 4]],
        [&[7, 33], &[7, 33], &[7, 33]],
        [&[300, 1], &[1, 130], &[300, 130]],
    ];
    for (i, [dc, da, db]) in cases.iter().enumerate() {
        let mut rng = Rng::new(200 + i as u64);
        let nc: usize = dc.iter().product();
        let c = T::new(dc, (0..nc).map(|_| rng.below(2) as f32 * rng.uniform(0.5, 2.0)).collect());
        let (a, b) = (rng.tensor(da, -1.0, 1.0), rng.tensor(db, -1.0, 1.0));
        let op = Op::Select;
        let got = run(&op, &[&c, &a, &b]);
        let want: Vec<f64> = (0..got.data.len())
            .map(|j| {
                let idx = unravel(j, &got.dims);
                let cond = c.data[broadcast_index(&idx, &c.dims)];
                let v = if cond != 0.0 { &a } else { &b };
                v.data[broadcast_index(&idx, &v.dims)] as f64
            })
            .collect();
        assert_close(&got.data, &want, 0.0);
        for alias in 0..3 {
            let ops = [&c, &a, &b];
            if ops[alias].dims == got.dims {
                assert_eq!(run_aliased(&op, &ops, &[alias]).data, got.data, "case {i} into operand {alias}");
            }
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
    #[test]
    fn binary_random_broadcasts(
        out in proptest::collection::vec(1usize..5, 0..5),
        keep_a in proptest::collection::vec(proptest::bool::ANY, 4),
        keep_b in proptest::collection::vec(proptest::bool::ANY, 4),
        drop_a in 0usize..5,
        drop_b in 0usize..5,
        seed: u64,
    ) {
        // Each operand: a suffix of the output's axes, each kept or set to 1.
        let operand = |keep: &[bool], drop: usize| -> Vec<usize> {
            let skip = drop.min(out.len());
            out[skip..].iter().zip(keep).map(|(&d, &k)| if k { d } else { 1 }).collect()
        };
        let (da, db) = (operand(&keep_a, drop_a), operand(&keep_b, drop_b));
        for op in [BinaryOp::Sub, BinaryOp::Maximum] {
            let (a, b) = binary_inputs(op, &da, &db, seed);
            let got = run(&Op::Binary(op), &[&a, &b]);
            assert_close(&got.data, &binary_expected(op, &a, &b, &got.dims), 1e-6);
            if a.dims == got.dims {
                proptest::prop_assert_eq!(&run_aliased(&Op::Binary(op), &[&a, &b], &[0]).data, &got.data);
            }
            if b.dims == got.dims {
                proptest::prop_assert_eq!(&run_aliased(&Op::Binary(op), &[&a, &b], &[1]).data, &got.data);
            }
        }
    }
}
