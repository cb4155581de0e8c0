//! Gather and its gradient (repeated and out-of-range ids), the optimizer effects against values
//! computed by hand, and prepare's errors.

mod common;
use common::*;
use kiln_compiler::ir::{DType, Op, Rows, Shape, Window2d};
use kiln_kernels::KernelError;
use kiln_kernels::cpu::prepare;

#[test]
fn gather_rows_with_repeats_and_invalid_ids() {
    let table = T::new(&[4, 2], vec![0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]);
    let ids = T::new(&[2, 3], vec![3.0, 1.0, 3.0, -1.0, 4.0, 0.0]);
    let got = run(&Op::Gather, &[&table, &ids]);
    assert_eq!(got.dims, [2, 3, 2]);
    assert_eq!(got.data, [30.0, 31.0, 10.0, 11.0, 30.0, 31.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]);

    let dy = T::new(&[2, 3, 2], (1..=12).map(|v| v as f32).collect());
    let dt = run(&Op::GatherGrad { vocab: 4 }, &[&ids, &dy]);
    assert_eq!(dt.dims, [4, 2]);
    // Row 3 gets dy rows 0 and 2; ids -1 and 4 are skipped.
    assert_eq!(dt.data, [11.0, 12.0, 3.0, 4.0, 0.0, 0.0, 6.0, 8.0]);

    // Scalar ids, a rank-1 table, and a large gradient split across threads by columns.
    let t1 = T::new(&[3], vec![5.0, 6.0, 7.0]);
    assert_eq!(run(&Op::Gather, &[&t1, &T::new(&[], vec![2.0])]).data, [7.0]);
    let mut rng = Rng::new(3);
    let (vocab, row, count) = (50, 300, 400);
    let ids = T::new(&[count], (0..count).map(|_| rng.below(vocab + 5) as f32 - 2.0).collect());
    let dy = rand(&[count, row], 4);
    let got = run(&Op::GatherGrad { vocab }, &[&ids, &dy]);
    let mut want = vec![0.0f64; vocab * row];
    for (i, &id) in ids.data.iter().enumerate() {
        if id >= 0.0 && (id as usize) < vocab {
            for c in 0..row {
                want[id as usize * row + c] += dy.data[i * row + c] as f64;
            }
        }
    }
    assert_close(&got.data, &want, 1e-5);
}

#[test]
fn sgd_steps() {
    let var = T::new(&[3], vec![1.0, 2.0, 3.0]);
    let grad = T::new(&[3], vec![0.5, -1.0, 2.0]);
    let plain = run_effect(
        &Op::ApplySgd { lr: 0.1, momentum: 0.0, nesterov: false, rows: None, product: false, shard: None },
        &[&var, &grad],
    );
    assert_close(&plain[0].data, &[0.95, 2.1, 2.8], 1e-7);
    assert_eq!(plain[1], grad);

    // v = 0.9·[1, 1, 1] - 0.1·g = [0.85, 1.0, 0.7]; var += v; Nesterov: var += 0.9·v - 0.1·g.
    let vel = T::new(&[3], vec![1.0; 3]);
    let op =
        |nesterov| Op::ApplySgd { lr: 0.1, momentum: 0.9, nesterov, rows: None, product: false, shard: None };
    let m = run_effect(&op(false), &[&var, &grad, &vel]);
    assert_close(&m[2].data, &[0.85, 1.0, 0.7], 1e-7);
    assert_close(&m[0].data, &[1.85, 3.0, 3.7], 1e-7);
    let n = run_effect(&op(true), &[&var, &grad, &vel]);
    assert_close(&n[2].data, &[0.85, 1.0, 0.7], 1e-7);
    assert_close(&n[0].data, &[1.0 + 0.765 - 0.05, 2.0 + 0.9 + 0.1, 3.0 + 0.63 - 0.2], 1e-7);
}

#[test]
fn adam_steps() {
    let (lr, b1, b2, eps) = (0.01f32, 0.9f32, 0.999f32, 1e-7f32);
    let op =
        Op::ApplyAdam { lr, beta1: b1, beta2: b2, epsilon: eps, rows: None, product: false, shard: None };
    let var = T::new(&[2], vec![1.0, -2.0]);
    let grad = T::new(&[2], vec![0.5, -3.0]);
    let zeros = T::new(&[2], vec![0.0; 2]);
    let iters = T::new(&[], vec![0.0]);
    let out = run_effect(&op, &[&var, &grad, &zeros, &zeros, &iters]);
    // Step 1: m = 0.1·g, v = 0.001·g², alpha = lr·sqrt(0.001)/0.1, update = alpha·m/(sqrt(v)+eps)
    // which is lr·sign(g) up to epsilon.
    assert_close(&out[2].data, &[0.05, -0.3], 1e-6);
    assert_close(&out[3].data, &[0.00025, 0.009], 1e-6);
    assert_close(&out[0].data, &[0.99, -1.99], 1e-6);
    assert_eq!(out[4], iters, "adam does not advance the counter");

    // Step 3 from a hand-computed state: t = 3.
    let m = T::new(&[2], vec![0.2, -0.1]);
    let v = T::new(&[2], vec![0.01, 0.04]);
    let it = T::new(&[1], vec![2.0]);
    let out = run_effect(&op, &[&var, &grad, &m, &v, &it]);
    let (g, m0, v0) = ([0.5f64, -3.0], [0.2f64, -0.1], [0.01f64, 0.04]);
    let alpha = 0.01 * (1.0 - 0.999f64.powi(3)).sqrt() / (1.0 - 0.9f64.powi(3));
    for i in 0..2 {
        let m1 = m0[i] + (g[i] - m0[i]) * 0.1;
        let v1 = v0[i] + (g[i] * g[i] - v0[i]) * 0.001;
        let x1 = var.data[i] as f64 - alpha * m1 / (v1.sqrt() + 1e-7);
        assert_close(&out[2].data[i..=i], &[m1], 1e-6);
        assert_close(&out[3].data[i..=i], &[v1], 1e-6);
        assert_close(&out[0].data[i..=i], &[x1], 1e-6);
    }
}

/// A weight gradient's factors a[m, k] and b[m, n], their product aᵀ·b, a [k, n] variable, a
/// first moment, a non-negative second moment and an Adam counter at 4.
struct Weights {
    a: T,
    b: T,
    full: T,
    var: T,
    state: T,
    v0: T,
    iters: T,
}

fn weights(m: usize, k: usize, n: usize, seed: u64) -> Weights {
    let (a, b) = (rand(&[m, k], seed), rand(&[m, n], seed + 1));
    let full = run(&Op::MatMul { transpose_a: true, transpose_b: false }, &[&a, &b]);
    let state = rand(&[k, n], seed + 3);
    let v0 = T::new(&[k, n], state.data.iter().map(|x| x.abs()).collect());
    Weights { a, b, full, var: rand(&[k, n], seed + 2), state, v0, iters: T::new(&[], vec![4.0]) }
}

/// A tiled update: each block of rows, computed by `matmul_rows` and applied by a row-block
/// update, leaves the variable and its state exactly as one update from the whole gradient.
#[test]
fn tiled_updates_equal_one_update() {
    let (m, k, n) = (37, 70, 23);
    let Weights { a, b, full, var, state, v0, iters } = weights(m, k, n, 11);
    let adam = |rows| Op::ApplyAdam {
        lr: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-7,
        rows,
        product: false,
        shard: None,
    };
    let sgd =
        |rows| Op::ApplySgd { lr: 0.1, momentum: 0.9, nesterov: true, rows, product: false, shard: None };
    let whole_adam = run_effect(&adam(None), &[&var, &full, &state, &v0, &iters]);
    let whole_sgd = run_effect(&sgd(None), &[&var, &full, &state]);
    let (mut x, mut mm, mut vv) = (var.clone(), state.clone(), v0.clone());
    let (mut y, mut vel) = (var.clone(), state.clone());
    for (start, len) in [(0, 9), (9, 9), (18, 50), (68, 2)] {
        let rows = Rows { start, len };
        let block = run(&Op::MatMulRows { rows }, &[&a, &b]);
        assert_eq!(block.dims, [len, n]);
        assert_close(
            &block.data,
            &full.data[start * n..(start + len) * n].iter().map(|&v| v as f64).collect::<Vec<_>>(),
            1e-6,
        );
        let out = run_effect(&adam(Some(rows)), &[&x, &block, &mm, &vv, &iters]);
        (x, mm, vv) = (out[0].clone(), out[2].clone(), out[3].clone());
        let out = run_effect(&sgd(Some(rows)), &[&y, &block, &vel]);
        (y, vel) = (out[0].clone(), out[2].clone());
    }
    let close = |got: &T, want: &T| {
        assert_close(&got.data, &want.data.iter().map(|&v| v as f64).collect::<Vec<_>>(), 1e-6)
    };
    close(&x, &whole_adam[0]);
    close(&mm, &whole_adam[2]);
    close(&vv, &whole_adam[3]);
    close(&y, &whole_sgd[0]);
    close(&vel, &whole_sgd[2]);
}

#[test]
fn optimizers_on_large_variables() {
    let n = 100_003;
    let var = rand(&[n], 1);
    let grad = rand(&[n], 2);
    let vel = rand(&[n], 3);
    let out = run_effect(
        &Op::ApplySgd { lr: 0.5, momentum: 0.5, nesterov: false, rows: None, product: false, shard: None },
        &[&var, &grad, &vel],
    );
    for i in (0..n).step_by(997) {
        let v = 0.5 * vel.data[i] as f64 - 0.5 * grad.data[i] as f64;
        assert_close(&out[2].data[i..=i], &[v], 1e-6);
        assert_close(&out[0].data[i..=i], &[var.data[i] as f64 + v], 1e-6);
    }
    let step = run_effect(&Op::AssignAdd { value: 1.0 }, &[&T::new(&[], vec![41.0])]);
    assert_eq!(step[0].data, [42.0]);
    let big = run_effect(&Op::AssignAdd { value: -0.5 }, &[&var]);
    assert!(big[0].data.iter().zip(&var.data).all(|(a, b)| *a == b - 0.5));
}

/// Loss scaling's gate (`Op::update_gate`): a finite gate multiplies the gradient, one that is
/// not finite leaves every operand as it was; the scale backs off, counts and grows as
/// GradScaler's.
#[test]
fn gated_updates_and_the_loss_scale() {
    let var = T::new(&[3], vec![1.0, 2.0, 3.0]);
    let grad = T::new(&[3], vec![0.5, -1.0, 2.0]);
    let sgd =
        Op::ApplySgd { lr: 0.1, momentum: 0.0, nesterov: false, rows: None, product: false, shard: None };
    let plain = run_effect(&sgd, &[&var, &T::new(&[3], vec![0.25, -0.5, 1.0])]);
    let gated = run_effect(&sgd, &[&var, &grad, &T::new(&[], vec![0.5])]);
    assert_eq!(gated[0], plain[0], "the gradient is multiplied by the gate");
    let adam = Op::ApplyAdam {
        lr: 0.1,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-7,
        rows: None,
        product: false,
        shard: None,
    };
    let state = T::new(&[3], vec![0.1, 0.2, 0.3]);
    for gate in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let skipped = run_effect(
            &adam,
            &[&var, &grad, &state, &state, &T::new(&[], vec![4.0]), &T::new(&[], vec![gate])],
        );
        assert_eq!((&skipped[0], &skipped[2], &skipped[3]), (&var, &state, &state), "gate {gate}");
        let counter =
            run_effect(&Op::AssignAdd { value: 1.0 }, &[&T::new(&[], vec![4.0]), &T::new(&[], vec![gate])]);
        assert_eq!(counter[0].data, [4.0], "gate {gate}");
    }
    let counter =
        run_effect(&Op::AssignAdd { value: 1.0 }, &[&T::new(&[], vec![4.0]), &T::new(&[], vec![0.5])]);
    assert_eq!(counter[0].data, [5.0]);

    let op = Op::UpdateLossScale { growth: 2.0, backoff: 0.5, interval: 3 };
    let one = |v: f32| T::new(&[], vec![v]);
    let mut scale = (65536.0f32, 0.0f32);
    let mut seen = Vec::new();
    for gate in [f32::NAN, 1.0, 1.0, 1.0, 1.0, f32::INFINITY, 1.0] {
        let out = run_effect(&op, &[&one(scale.0), &one(scale.1), &one(gate)]);
        scale = (out[0].data[0], out[1].data[0]);
        seen.push(scale);
    }
    assert_eq!(
        seen,
        [
            (32768.0, 0.0),
            (32768.0, 1.0),
            (32768.0, 2.0),
            (65536.0, 0.0),
            (65536.0, 1.0),
            (32768.0, 0.0),
            (32768.0, 1.0)
        ]
    );
    // Growth that would overflow keeps the scale.
    let out = run_effect(&op, &[&one(f32::MAX), &one(2.0), &one(1.0)]);
    assert_eq!((out[0].data[0], out[1].data[0]), (f32::MAX, 0.0));
}

#[test]
fn prepare_rejects_what_it_cannot_run() {
    let s = Shape::from([2, 3]);
    let f32s = |n: usize| vec![(&s, DType::F32); n];
    // Sources and views have no kernel.
    for op in [
        Op::Reshape { shape: Shape::from([6]) },
        Op::Input { name: "x".into(), shape: s.clone(), dtype: DType::F32 },
    ] {
        let inputs = if matches!(op, Op::Reshape { .. }) { f32s(1) } else { vec![] };
        let out = if matches!(op, Op::Reshape { .. }) { Shape::from([6]) } else { s.clone() };
        let e = prepare(&op, &inputs, (&out, DType::F32)).err().expect("no kernel");
        assert!(matches!(e, KernelError::Unsupported { .. }), "{e}");
        assert!(e.to_string().contains(op.name()), "{e}");
    }
    // Other dtypes: integers anywhere but ids, half values where the kernels compute f32.
    let relu = Op::Unary(kiln_compiler::ir::UnaryOp::Relu);
    let e = prepare(&relu, &[(&s, DType::I32)], (&s, DType::I32)).err().expect("i32");
    assert!(matches!(e, KernelError::Unsupported { dtype: DType::I32, .. }), "{e}");
    prepare(&relu, &[(&s, DType::F16)], (&s, DType::F16)).expect("an elementwise op computes in half");
    // An optimizer update keeps f32 master weights: no half operand.
    let sgd =
        Op::ApplySgd { lr: 0.1, momentum: 0.0, nesterov: false, rows: None, product: false, shard: None };
    let e = prepare(&sgd, &[(&s, DType::F16), (&s, DType::F16)], (&s, DType::F32)).err().expect("f16 update");
    assert!(matches!(e, KernelError::Unsupported { dtype: DType::F16, .. }), "{e}");
    assert!(e.to_string().contains("ops read and write f16 and bf16 too"), "{e}");
    // Shapes inconsistent with infer: bad operands, or a wrong declared output.
    let mm = Op::MatMul { transpose_a: false, transpose_b: false };
    let e = prepare(&mm, &f32s(2), (&s, DType::F32)).err().expect("3 vs 2");
    assert!(matches!(e, KernelError::Shape { .. }) && e.to_string().contains("matmul"), "{e}");
    let wrong = Shape::from([3, 2]);
    let e = prepare(&relu, &f32s(1), (&wrong, DType::F32)).err().expect("wrong output");
    assert!(matches!(e, KernelError::Shape { .. }) && e.to_string().contains("[3, 2]"), "{e}");
    let conv = Op::Conv2d { window: Window2d::new([3, 3], [1, 1], kiln_compiler::ir::Padding::Valid) };
    let x = Shape::from([1, 2, 2, 1]);
    let w = Shape::from([3, 3, 1, 1]);
    let e = prepare(&conv, &[(&x, DType::F32), (&w, DType::F32)], (&x, DType::F32)).err().expect("too small");
    assert!(matches!(e, KernelError::Shape { .. }), "{e}");
}

#[test]
fn kernels_describe_themselves() {
    let (a, b) = (rand(&[32, 100], 1), rand(&[100, 10], 2));
    let (k, _) = kernel(&Op::MatMul { transpose_a: false, transpose_b: false }, &[&a, &b]);
    assert!(k.describe().starts_with("matmul 32x100x10"), "{}", k.describe());
    let (k, _) = kernel(&Op::Unary(kiln_compiler::ir::UnaryOp::Relu), &[&rand(&[32, 10], 3)]);
    assert_eq!(k.describe(), "relu 32x10");
}

/// A product update (`Grad::Product`): the update computes its gradient aᵀ·b block by block and
/// leaves the variable and its state bitwise as the stored product then the update do, for one
/// block and for several (a gradient over the 256 KiB tile), short and long contractions.
#[test]
fn product_updates_equal_the_product_then_the_update() {
    use kiln_compiler::ir::Grad;
    for (case, (m, k, n)) in [(37, 70, 23), (5, 300, 500), (700, 260, 300), (1, 1, 1)].into_iter().enumerate()
    {
        let Weights { a, b, full, var, state, v0, iters } = weights(m, k, n, 21 + 10 * case as u64);
        let adam = Op::ApplyAdam {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
            rows: None,
            product: false,
            shard: None,
        };
        let want = run_effect(&adam, &[&var, &full, &state, &v0, &iters]);
        let got = run_effect(&adam.update_in(None, Grad::Product), &[&var, &a, &b, &state, &v0, &iters]);
        for (w, g) in [(0, 0), (2, 3), (3, 4)] {
            assert_eq!(got[g].data, want[w].data, "adam {m}x{k}x{n}: operand {w}");
        }
        for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
            let sgd = Op::ApplySgd { lr: 0.1, momentum, nesterov, rows: None, product: false, shard: None };
            let (with, without): (Vec<&T>, Vec<&T>) = if momentum != 0.0 {
                (vec![&var, &a, &b, &state], vec![&var, &full, &state])
            } else {
                (vec![&var, &a, &b], vec![&var, &full])
            };
            let want = run_effect(&sgd, &without);
            let got = run_effect(&sgd.update_in(None, Grad::Product), &with);
            assert_eq!(got[0].data, want[0].data, "sgd {momentum} {nesterov} {m}x{k}x{n}");
            if momentum != 0.0 {
                assert_eq!(got[3].data, want[2].data, "sgd velocity {m}x{k}x{n}");
            }
        }
    }
}
