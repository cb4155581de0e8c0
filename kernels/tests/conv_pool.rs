//! Convolution, its two backprops and pooling against direct f64 loops, for stride 1 and 2, SAME
//! and VALID, non-square windows and strides; the backprops are also checked as adjoints:
//! <conv(x, w), dy> = <x, backprop_input(dy, w)> = <w, backprop_filter(x, dy)>.

mod common;
use common::*;
use kiln_compiler::ir::{DType, Op, Padding, PoolKind, Shape, Window2d};

fn win(size: [usize; 2], stride: [usize; 2], padding: Padding) -> Window2d {
    Window2d::new(size, stride, padding)
}

/// For each output position along an axis, the input position of tap 0 (may be negative).
fn starts(w: &Window2d, axis: usize, input: usize) -> (usize, isize) {
    let (out, pad) = w.out_and_pad(axis, input).unwrap();
    (out, pad as isize)
}

/// Calls f(n, oh, ow, ih, iw, kh, kw) for every in-bounds tap.
fn for_taps(x: &[usize], w: &Window2d, mut f: impl FnMut([usize; 7])) {
    let (oh, ph) = starts(w, 0, x[1]);
    let (ow, pw) = starts(w, 1, x[2]);
    for n in 0..x[0] {
        for a in 0..oh {
            for b in 0..ow {
                for kh in 0..w.size[0] {
                    for kw in 0..w.size[1] {
                        let ih = (a * w.stride[0] + kh) as isize - ph;
                        let iw = (b * w.stride[1] + kw) as isize - pw;
                        if ih >= 0 && iw >= 0 && (ih as usize) < x[1] && (iw as usize) < x[2] {
                            f([n, a, b, ih as usize, iw as usize, kh, kw]);
                        }
                    }
                }
            }
        }
    }
}

fn conv_ref(x: &T, f: &T, w: &Window2d, out: &[usize]) -> Vec<f64> {
    let (c, fo) = (x.dims[3], f.dims[3]);
    let mut res = vec![0.0; out.iter().product()];
    for_taps(&x.dims, w, |[n, a, b, ih, iw, kh, kw]| {
        for ci in 0..c {
            for fi in 0..fo {
                res[ravel(&[n, a, b, fi], out)] +=
                    x.at(&[n, ih, iw, ci]) as f64 * f.at(&[kh, kw, ci, fi]) as f64;
            }
        }
    });
    res
}

fn backprop_input_ref(dy: &T, f: &T, w: &Window2d, xd: &[usize]) -> Vec<f64> {
    let (c, fo) = (xd[3], f.dims[3]);
    let mut res = vec![0.0; xd.iter().product()];
    for_taps(xd, w, |[n, a, b, ih, iw, kh, kw]| {
        for ci in 0..c {
            for fi in 0..fo {
                res[ravel(&[n, ih, iw, ci], xd)] +=
                    dy.at(&[n, a, b, fi]) as f64 * f.at(&[kh, kw, ci, fi]) as f64;
            }
        }
    });
    res
}

fn backprop_filter_ref(x: &T, dy: &T, w: &Window2d) -> Vec<f64> {
    let (c, fo) = (x.dims[3], dy.dims[3]);
    let wd = [w.size[0], w.size[1], c, fo];
    let mut res = vec![0.0; wd.iter().product()];
    for_taps(&x.dims, w, |[n, a, b, ih, iw, kh, kw]| {
        for ci in 0..c {
            for fi in 0..fo {
                res[ravel(&[kh, kw, ci, fi], &wd)] +=
                    x.at(&[n, ih, iw, ci]) as f64 * dy.at(&[n, a, b, fi]) as f64;
            }
        }
    });
    res
}

/// (input dims, window, output channels)
fn conv_cases() -> Vec<([usize; 4], Window2d, usize)> {
    let mut v = Vec::new();
    for padding in [Padding::Same, Padding::Valid] {
        v.push(([2, 5, 7, 3], win([3, 3], [1, 1], padding), 4));
        v.push(([2, 7, 6, 3], win([3, 3], [2, 2], padding), 5));
        v.push(([1, 6, 9, 2], win([2, 3], [2, 1], padding), 3));
        v.push(([3, 8, 7, 1], win([1, 4], [1, 3], padding), 2));
        v.push(([1, 5, 5, 2], win([1, 1], [2, 2], padding), 3));
        v.push(([1, 9, 8, 2], win([2, 2], [3, 3], padding), 2));
        v.push(([1, 4, 4, 3], win([4, 4], [1, 1], padding), 1));
        v.push(([1, 3, 3, 2], win([5, 5], [1, 2], Padding::Same), 2));
        v.push(([4, 16, 16, 8], win([3, 3], [1, 1], padding), 16));
        v.push(([2, 17, 15, 5], win([5, 3], [2, 2], padding), 7));
    }
    v
}

#[test]
fn conv2d_and_backprops_match_direct_loops() {
    for (i, (xd, w, f)) in conv_cases().into_iter().enumerate() {
        let x = rand(&xd, 3 * i as u64);
        let filt = rand(&[w.size[0], w.size[1], xd[3], f], 3 * i as u64 + 1);
        let y = run(&Op::Conv2d { window: w }, &[&x, &filt]);
        let tol = 1e-5 * ((w.size[0] * w.size[1] * xd[3]) as f64).sqrt();
        assert_close(&y.data, &conv_ref(&x, &filt, &w, &y.dims), tol);

        let dy = rand(&y.dims, 3 * i as u64 + 2);
        let dx = run(&Op::Conv2dBackpropInput { window: w, input: Shape::from(xd) }, &[&dy, &filt]);
        assert_eq!(dx.dims, xd);
        assert_close(&dx.data, &backprop_input_ref(&dy, &filt, &w, &xd), tol * 3.0);

        let dw = run(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy]);
        assert_eq!(dw.dims, filt.dims);
        let terms = (y.dims[0] * y.dims[1] * y.dims[2]) as f64;
        assert_close(&dw.data, &backprop_filter_ref(&x, &dy, &w), 1e-5 * terms.sqrt());

        // Adjoints.
        let (a, b, c) = (dot(&y.data, &dy.data), dot(&x.data, &dx.data), dot(&filt.data, &dw.data));
        let scale = 1e-4 * (1.0 + a.abs()) * (y.data.len() as f64).sqrt();
        assert!((a - b).abs() < scale && (a - c).abs() < scale, "case {i}: {a} {b} {c}");
    }
}

fn pool_ref(kind: PoolKind, x: &T, w: &Window2d, out: &[usize]) -> Vec<f64> {
    let c = x.dims[3];
    let init = if kind == PoolKind::Max { f64::NEG_INFINITY } else { 0.0 };
    let mut res = vec![init; out.iter().product()];
    let mut count = vec![0.0; res.len()];
    for_taps(&x.dims, w, |[n, a, b, ih, iw, _, _]| {
        for ci in 0..c {
            let o = ravel(&[n, a, b, ci], out);
            let v = x.at(&[n, ih, iw, ci]) as f64;
            res[o] = if kind == PoolKind::Max { res[o].max(v) } else { res[o] + v };
            count[o] += 1.0;
        }
    });
    if kind == PoolKind::Avg {
        res.iter_mut().zip(&count).for_each(|(r, c)| *r /= c);
    }
    res
}

fn pool_grad_ref(kind: PoolKind, x: &T, dy: &T, w: &Window2d) -> Vec<f64> {
    let c = x.dims[3];
    let mut dx = vec![0.0; x.data.len()];
    // Window contents per output element, in row-major window order.
    let mut windows: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
    for_taps(&x.dims, w, |[n, a, b, ih, iw, _, _]| {
        for ci in 0..c {
            windows
                .entry(ravel(&[n, a, b, ci], &dy.dims))
                .or_default()
                .push(ravel(&[n, ih, iw, ci], &x.dims));
        }
    });
    for (o, members) in windows {
        let g = dy.data[o] as f64;
        match kind {
            PoolKind::Max => {
                let mut best = members[0];
                for &m in &members {
                    if x.data[m] > x.data[best] {
                        best = m;
                    }
                }
                dx[best] += g;
            }
            PoolKind::Avg => members.iter().for_each(|&m| dx[m] += g / members.len() as f64),
        }
    }
    dx
}

#[test]
fn pooling_and_gradients_match_direct_loops() {
    let mut cases = Vec::new();
    for padding in [Padding::Same, Padding::Valid] {
        cases.push(([2, 5, 7, 3], win([2, 2], [2, 2], padding)));
        cases.push(([1, 7, 7, 2], win([3, 3], [2, 2], padding)));
        cases.push(([2, 6, 5, 4], win([3, 3], [1, 1], padding)));
        cases.push(([1, 8, 9, 3], win([2, 3], [1, 2], padding)));
        cases.push(([1, 5, 5, 1], win([1, 1], [2, 2], padding)));
        cases.push(([2, 16, 16, 70], win([3, 3], [2, 2], padding)));
        // Windows that tile the input: the gradient's window-at-a-time path.
        cases.push(([2, 6, 8, 70], win([2, 2], [2, 2], padding)));
        cases.push(([1, 6, 9, 3], win([3, 3], [3, 3], padding)));
    }
    for (i, (xd, w)) in cases.into_iter().enumerate() {
        let x = rand(&xd, 40 + i as u64);
        for kind in [PoolKind::Max, PoolKind::Avg] {
            let y = run(&Op::Pool2d { kind, window: w }, &[&x]);
            assert_close(&y.data, &pool_ref(kind, &x, &w, &y.dims), 1e-6);
            let dy = rand(&y.dims, 80 + i as u64);
            let dx = run(&Op::Pool2dGrad { kind, window: w }, &[&x, &dy]);
            assert_eq!(dx.dims, xd);
            assert_close(&dx.data, &pool_grad_ref(kind, &x, &dy, &w), 1e-6);
            if kind == PoolKind::Avg {
                // From dy and the input's shape alone: the same values, bit for bit.
                let from_dy = run(&Op::AvgPool2dGrad { window: w, input: Shape::from(xd) }, &[&dy]);
                assert_eq!(from_dy, dx);
            }
            // Pool gradients are adjoint to pooling's linearisation: <pool'(x)·dx, dy> = <dx, grad>.
            if kind == PoolKind::Avg {
                let probe = rand(&xd, 99);
                let py = run(&Op::Pool2d { kind, window: w }, &[&probe]);
                let (a, b) = (dot(&py.data, &dy.data), dot(&probe.data, &dx.data));
                assert!((a - b).abs() < 1e-4 * (1.0 + a.abs()), "{a} {b}");
            }
        }
    }
}

#[test]
fn max_pool_grad_routes_ties_to_the_first_maximum() {
    let x = T::new(&[1, 4, 4, 1], vec![0.0; 16]);
    let w = win([2, 2], [2, 2], Padding::Valid);
    let dy = T::new(&[1, 2, 2, 1], vec![1.0, 2.0, 3.0, 4.0]);
    let dx = run(&Op::Pool2dGrad { kind: PoolKind::Max, window: w }, &[&x, &dy]);
    #[rustfmt::skip]
    let want = [1.0, 0.0, 2.0, 0.0,
                0.0, 0.0, 0.0, 0.0,
                3.0, 0.0, 4.0, 0.0,
                0.0, 0.0, 0.0, 0.0];
    assert_eq!(dx.data, want);
    // Overlapping SAME windows on a constant input: each window's first in-bounds element.
    let x = T::new(&[1, 3, 3, 1], vec![1.0; 9]);
    let w = win([3, 3], [1, 1], Padding::Same);
    let dy = T::new(&[1, 3, 3, 1], vec![1.0; 9]);
    let dx = run(&Op::Pool2dGrad { kind: PoolKind::Max, window: w }, &[&x, &dy]);
    assert_eq!(dx.data, [4.0, 2.0, 0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
}

fn conv_case(xd: [usize; 4], w: Window2d, f: usize, seed: u64) {
    let x = rand(&xd, seed);
    let filt = rand(&[w.size[0], w.size[1], xd[3], f], seed + 1);
    let y = run(&Op::Conv2d { window: w }, &[&x, &filt]);
    assert_close(&y.data, &conv_ref(&x, &filt, &w, &y.dims), 1e-4);
    let dy = rand(&y.dims, seed + 2);
    let dx = run(&Op::Conv2dBackpropInput { window: w, input: Shape::from(xd) }, &[&dy, &filt]);
    assert_close(&dx.data, &backprop_input_ref(&dy, &filt, &w, &xd), 1e-4);
    let dw = run(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy]);
    assert_close(&dw.data, &backprop_filter_ref(&x, &dy, &w), 1e-4);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(120))]
    #[test]
    fn conv_random_geometries(
        n in 1usize..3, h in 1usize..9, wd in 1usize..9, c in 1usize..4, f in 1usize..4,
        kh in 1usize..5, kw in 1usize..5, sh in 1usize..4, sw in 1usize..4, same: bool, seed: u64,
    ) {
        let w = win([kh, kw], [sh, sw], if same { Padding::Same } else { Padding::Valid });
        proptest::prop_assume!(w.out_and_pad(0, h).is_some_and(|o| o.0 > 0));
        proptest::prop_assume!(w.out_and_pad(1, wd).is_some_and(|o| o.0 > 0));
        conv_case([n, h, wd, c], w, f, seed);
    }
}

#[test]
fn conv_gradients_do_not_depend_on_the_thread_count() {
    let w = win([3, 3], [1, 1], Padding::Same);
    let x = rand(&[8, 16, 16, 8], 1);
    let filt = rand(&[3, 3, 8, 16], 2);
    let dy = rand(&[8, 16, 16, 16], 3);
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let y = run(&Op::Conv2d { window: w }, &[&x, &filt]);
            let dx = run(&Op::Conv2dBackpropInput { window: w, input: x.shape() }, &[&dy, &filt]);
            let dw = run(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy]);
            (y, dx, dw)
        })
    };
    let one = on(1);
    assert!(one == on(3) && one == on(8));
}

/// 1x1 convolutions cut by pixels (more pixels than filters: equal blocks, a multiple of the
/// threads) and by filter columns (more filters than pixels), stride 1 and 2: the direct loops'
/// values, and the same bits on 1, 2 and 3 threads.
#[test]
fn pointwise_convolutions_match_direct_loops_on_any_thread_count() {
    let cases = [
        ([2, 14, 14, 24], [1, 1], 40),
        ([2, 7, 7, 64], [1, 1], 256),
        ([2, 14, 14, 48], [2, 2], 200),
        ([1, 9, 11, 32], [1, 1], 72),
    ];
    for (i, (xd, stride, f)) in cases.into_iter().enumerate() {
        let w = win([1, 1], stride, Padding::Valid);
        let x = rand(&xd, 40 + i as u64);
        let filt = rand(&[1, 1, xd[3], f], 50 + i as u64);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(&Op::Conv2d { window: w }, &[&x, &filt]))
        };
        let one = on(1);
        assert_close(&one.data, &conv_ref(&x, &filt, &w, &one.dims), 1e-5 * (xd[3] as f64).sqrt());
        assert!(one == on(2) && one == on(3), "case {i}: the thread count changed the bits");
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(120))]
    #[test]
    fn pool_random_geometries(
        n in 1usize..3, h in 1usize..9, wd in 1usize..9, c in 1usize..4,
        kh in 1usize..5, kw in 1usize..5, sh in 1usize..4, sw in 1usize..4, same: bool, seed: u64,
    ) {
        let w = win([kh, kw], [sh, sw], if same { Padding::Same } else { Padding::Valid });
        proptest::prop_assume!(w.out_and_pad(0, h).is_some_and(|o| o.0 > 0));
        proptest::prop_assume!(w.out_and_pad(1, wd).is_some_and(|o| o.0 > 0));
        let x = rand(&[n, h, wd, c], seed);
        for kind in [PoolKind::Max, PoolKind::Avg] {
            let y = run(&Op::Pool2d { kind, window: w }, &[&x]);
            assert_close(&y.data, &pool_ref(kind, &x, &w, &y.dims), 1e-6);
            let dy = rand(&y.dims, seed ^ 1);
            let dx = run(&Op::Pool2dGrad { kind, window: w }, &[&x, &dy]);
            assert_close(&dx.data, &pool_grad_ref(kind, &x, &dy, &w), 1e-6);
            if kind == PoolKind::Avg {
                let input = Shape::from([n, h, wd, c]);
                proptest::prop_assert_eq!(run(&Op::AvgPool2dGrad { window: w, input }, &[&dy]), dx);
            }
        }
    }
}

#[test]
fn max_pool_grad_written_over_its_input_where_windows_tile_it() {
    // `Op::may_write_over` lets the plan put dx in x's buffer exactly where the windows tile x.
    for (xd, w, tiles) in [
        ([2, 6, 8, 70], win([2, 2], [2, 2], Padding::Valid), true),
        ([1, 6, 9, 3], win([3, 3], [3, 3], Padding::Same), true),
        ([1, 7, 8, 3], win([2, 2], [2, 2], Padding::Valid), false),
        ([1, 6, 6, 3], win([3, 3], [2, 2], Padding::Same), false),
        ([1, 6, 6, 3], win([2, 2], [1, 1], Padding::Valid), false),
    ] {
        let op = Op::Pool2dGrad { kind: PoolKind::Max, window: w };
        assert_eq!(op.may_write_over(0, &Shape::from(xd)), tiles, "{xd:?} {w:?}");
        assert!(!op.may_write_over(1, &Shape::from(xd)));
        if !tiles {
            continue;
        }
        for x in [rand(&xd, 7), ties(&xd)] {
            let y = run(&Op::Pool2d { kind: PoolKind::Max, window: w }, &[&x]);
            let dy = rand(&y.dims, 8);
            let apart = run(&op, &[&x, &dy]);
            let over = run_aliased_first(&op, &x, &dy);
            assert_eq!(
                apart.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                over.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{xd:?}: the same bits in place"
            );
        }
    }
}

/// Values on a coarse grid: many ties, each routed to the window's first maximum.
fn ties(dims: &[usize]) -> T {
    let n: usize = dims.iter().product();
    T::new(dims, (0..n).map(|i| ((i * 7) % 3) as f32).collect())
}

/// Runs a two-operand op with its output written over its first operand's buffer.
fn run_aliased_first(op: &Op, a: &T, b: &T) -> T {
    let shapes = [Shape::new(a.dims.clone()), Shape::new(b.dims.clone())];
    let k = kiln_kernels::cpu::prepare(
        op,
        &[(&shapes[0], DType::F32), (&shapes[1], DType::F32)],
        (&shapes[0], DType::F32),
    )
    .unwrap();
    let (mut x, mut y) = (a.data.clone(), b.data.clone());
    let ptrs = [x.as_mut_ptr() as *mut u8, y.as_mut_ptr() as *mut u8];
    // SAFETY: buffers sized from the shapes; the output is the first operand's buffer, which the
    // op allows (`may_write_over`, checked by the caller).
    unsafe { k.run(&ptrs, ptrs[0]) };
    T::new(&a.dims, x)
}

#[test]
fn a_convolutions_input_gradient_through_relu_is_the_two_ops_bit_for_bit() {
    // `Op::Conv2dBackpropInputReluGrad` = relu_grad(y, conv2d_backprop_input(dy, w)), written
    // over y where the stride is 1 (`Op::may_write_over`).
    for (i, (xd, w, f)) in conv_cases().into_iter().enumerate() {
        let filt = rand(&[w.size[0], w.size[1], xd[3], f], 5 * i as u64 + 1);
        let y_dims = run(&Op::Conv2d { window: w }, &[&rand(&xd, 0), &filt]).dims;
        let dy = rand(&y_dims, 5 * i as u64 + 2);
        let act = rand(&xd, 5 * i as u64 + 3);
        let input = Shape::from(xd);
        let dx = run(&Op::Conv2dBackpropInput { window: w, input: input.clone() }, &[&dy, &filt]);
        let apart = run(&Op::Binary(kiln_compiler::ir::BinaryOp::ReluGrad), &[&act, &dx]);
        let op = Op::Conv2dBackpropInputReluGrad { window: w, input: input.clone() };
        let fused = run(&op, &[&dy, &filt, &act]);
        let bits = |t: &T| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused), bits(&apart), "case {i}");
        assert_eq!(op.may_write_over(2, &input), w.stride == [1, 1], "case {i}");
        if w.stride == [1, 1] {
            let shapes = [Shape::from(y_dims.clone()), Shape::from(filt.dims.clone()), input.clone()];
            let k = kiln_kernels::cpu::prepare(
                &op,
                &[(&shapes[0], DType::F32), (&shapes[1], DType::F32), (&shapes[2], DType::F32)],
                (&input, DType::F32),
            )
            .unwrap();
            let (mut d, mut fl, mut y) = (dy.data.clone(), filt.data.clone(), act.data.clone());
            let ptrs = [d.as_mut_ptr() as *mut u8, fl.as_mut_ptr() as *mut u8, y.as_mut_ptr() as *mut u8];
            // SAFETY: buffers of the operands' shapes; the output is y's own buffer, which the op
            // allows with stride 1 (asserted above).
            unsafe { k.run(&ptrs, ptrs[2]) };
            assert_eq!(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), bits(&apart), "case {i} in place");
        }
    }
}

#[test]
fn a_convolutions_input_gradient_plus_a_residual_through_relu_is_the_three_ops_bit_for_bit() {
    // With a fourth operand r: relu_grad(y, r + conv2d_backprop_input(dy, w)), written over y or
    // over r where the stride is 1 (`Op::may_write_over`).
    for (i, (xd, w, f)) in conv_cases().into_iter().enumerate() {
        let filt = rand(&[w.size[0], w.size[1], xd[3], f], 7 * i as u64 + 1);
        let y_dims = run(&Op::Conv2d { window: w }, &[&rand(&xd, 0), &filt]).dims;
        let dy = rand(&y_dims, 7 * i as u64 + 2);
        let act = rand(&xd, 7 * i as u64 + 3);
        let res = rand(&xd, 7 * i as u64 + 4);
        let input = Shape::from(xd);
        let dx = run(&Op::Conv2dBackpropInput { window: w, input: input.clone() }, &[&dy, &filt]);
        let sum = run(&Op::Binary(kiln_compiler::ir::BinaryOp::Add), &[&res, &dx]);
        let apart = run(&Op::Binary(kiln_compiler::ir::BinaryOp::ReluGrad), &[&act, &sum]);
        let op = Op::Conv2dBackpropInputReluGrad { window: w, input: input.clone() };
        let fused = run(&op, &[&dy, &filt, &act, &res]);
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&fused.data), bits(&apart.data), "case {i}");
        assert_eq!(op.may_write_over(3, &input), w.stride == [1, 1], "case {i}");
        if w.stride != [1, 1] {
            continue;
        }
        let shapes =
            [Shape::from(y_dims.clone()), Shape::from(filt.dims.clone()), input.clone(), input.clone()];
        let types: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
        let k = kiln_kernels::cpu::prepare(&op, &types, (&input, DType::F32)).unwrap();
        for over in [2, 3] {
            let mut bufs = [dy.data.clone(), filt.data.clone(), act.data.clone(), res.data.clone()];
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
            // SAFETY: buffers of the operands' shapes; the output is y's or r's own buffer,
            // which the op allows with stride 1 (asserted above).
            unsafe { k.run(&ptrs, ptrs[over]) };
            assert_eq!(bits(&bufs[over]), bits(&apart.data), "case {i} written over operand {over}");
        }
    }
}
