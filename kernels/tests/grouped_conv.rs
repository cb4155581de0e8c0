//! Grouped, depthwise and dilated convolutions (`Window2d::is_dense` false) and their two
//! gradients against direct f64 loops written from the definitions, over strides, SAME, VALID
//! and explicit asymmetric padding; the same references check the dense kernels and pooling with
//! explicit asymmetric padding. Also: the bits do not depend on the thread count, and the input
//! gradient through ReLU is the two ops apart, bit for bit.

mod common;
use common::*;
use kiln_compiler::ir::{BinaryOp, DType, Op, Padding, PoolKind, Shape, Window2d};

fn win(size: [usize; 2], stride: [usize; 2], padding: Padding) -> Window2d {
    Window2d::new(size, stride, padding)
}

fn explicit(before: [usize; 2], after: [usize; 2]) -> Padding {
    Padding::Explicit { before, after }
}

/// Calls f([n, oh, ow, ih, iw, kh, kw]) for every tap of every output position that reads
/// inside the input (the others read padding: zeros for a convolution, nothing for pooling).
fn for_taps(x: &[usize], w: &Window2d, mut f: impl FnMut([usize; 7])) {
    let (oh, ph) = w.out_and_pad(0, x[1]).unwrap();
    let (ow, pw) = w.out_and_pad(1, x[2]).unwrap();
    for n in 0..x[0] {
        for a in 0..oh {
            for b in 0..ow {
                for kh in 0..w.size[0] {
                    for kw in 0..w.size[1] {
                        let ih = (a * w.stride[0] + kh * w.dilation[0]) as isize - ph as isize;
                        let iw = (b * w.stride[1] + kw * w.dilation[1]) as isize - pw as isize;
                        if ih >= 0 && iw >= 0 && (ih as usize) < x[1] && (iw as usize) < x[2] {
                            f([n, a, b, ih as usize, iw as usize, kh, kw]);
                        }
                    }
                }
            }
        }
    }
}

/// Calls f(input channel, output channel, in-group channel) for every pair that meets: output
/// channel fo of group fo / (F/G) reads input channels g·(C/G) .. (g+1)·(C/G).
fn for_channels(c: usize, f: usize, groups: usize, mut body: impl FnMut(usize, usize, usize)) {
    let (cg, fg) = (c / groups, f / groups);
    for fo in 0..f {
        for ci in 0..cg {
            body((fo / fg) * cg + ci, fo, ci);
        }
    }
}

fn conv_ref(x: &T, filt: &T, w: &Window2d, out: &[usize]) -> Vec<f64> {
    let mut res = vec![0.0; out.iter().product()];
    for_taps(&x.dims, w, |[n, a, b, ih, iw, kh, kw]| {
        for_channels(x.dims[3], filt.dims[3], w.groups, |c, fo, ci| {
            res[ravel(&[n, a, b, fo], out)] +=
                x.at(&[n, ih, iw, c]) as f64 * filt.at(&[kh, kw, ci, fo]) as f64;
        });
    });
    res
}

fn backprop_input_ref(dy: &T, filt: &T, w: &Window2d, xd: &[usize]) -> Vec<f64> {
    let mut res = vec![0.0; xd.iter().product()];
    for_taps(xd, w, |[n, a, b, ih, iw, kh, kw]| {
        for_channels(xd[3], filt.dims[3], w.groups, |c, fo, ci| {
            res[ravel(&[n, ih, iw, c], xd)] +=
                dy.at(&[n, a, b, fo]) as f64 * filt.at(&[kh, kw, ci, fo]) as f64;
        });
    });
    res
}

fn backprop_filter_ref(x: &T, dy: &T, w: &Window2d) -> Vec<f64> {
    let (c, f) = (x.dims[3], dy.dims[3]);
    let wd = [w.size[0], w.size[1], c / w.groups, f];
    let mut res = vec![0.0; wd.iter().product()];
    for_taps(&x.dims, w, |[n, a, b, ih, iw, kh, kw]| {
        for_channels(c, f, w.groups, |ch, fo, ci| {
            res[ravel(&[kh, kw, ci, fo], &wd)] +=
                x.at(&[n, ih, iw, ch]) as f64 * dy.at(&[n, a, b, fo]) as f64;
        });
    });
    res
}

/// Checks the forward convolution and both gradients of one case against the references, and
/// the adjoint identities <conv(x, w), dy> = <x, dx> = <w, dw>.
fn check_case(i: usize, xd: [usize; 4], w: Window2d, f: usize) {
    let seed = 11 * i as u64;
    let x = rand(&xd, seed);
    let filt = rand(&[w.size[0], w.size[1], xd[3] / w.groups, f], seed + 1);
    let y = run(&Op::Conv2d { window: w }, &[&x, &filt]);
    let cg = xd[3] / w.groups;
    let tol = 1e-5 * ((w.size[0] * w.size[1] * cg) as f64).sqrt().max(1.0);
    assert_close(&y.data, &conv_ref(&x, &filt, &w, &y.dims), tol);

    let dy = rand(&y.dims, seed + 2);
    let dx = run(&Op::Conv2dBackpropInput { window: w, input: Shape::from(xd) }, &[&dy, &filt]);
    assert_eq!(dx.dims, xd, "case {i}");
    let fg = f / w.groups;
    let tol_dx = 1e-5 * ((w.size[0] * w.size[1] * fg) as f64).sqrt().max(1.0);
    assert_close(&dx.data, &backprop_input_ref(&dy, &filt, &w, &xd), tol_dx);

    let dw = run(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy]);
    assert_eq!(dw.dims, filt.dims, "case {i}");
    let terms = (y.dims[0] * y.dims[1] * y.dims[2]) as f64;
    assert_close(&dw.data, &backprop_filter_ref(&x, &dy, &w), 2e-5 * terms.sqrt());

    let (a, b, c) = (dot(&y.data, &dy.data), dot(&x.data, &dx.data), dot(&filt.data, &dw.data));
    let scale = 1e-4 * (1.0 + a.abs()) * (y.data.len() as f64).sqrt();
    assert!((a - b).abs() < scale && (a - c).abs() < scale, "case {i} {w:?}: {a} {b} {c}");
}

/// (input dims, window, output channels): every one not dense.
fn grouped_cases() -> Vec<([usize; 4], Window2d, usize)> {
    let mut v = Vec::new();
    let s = Padding::Same;
    let paddings = [Padding::Same, Padding::Valid, explicit([0, 1], [2, 0]), explicit([1, 0], [0, 1])];
    for (p, padding) in paddings.into_iter().enumerate() {
        let stride = [1 + p % 2, 1 + p % 2];
        // Depthwise, multiplier 1 and 2.
        v.push(([2, 7, 9, 8], win([3, 3], stride, padding).grouped(8), 8));
        v.push(([2, 6, 5, 6], win([3, 3], stride, padding).grouped(6), 12));
        // Grouped: C=8 G=2 F=4, C=12 G=3 F=6.
        v.push(([2, 7, 7, 8], win([3, 3], stride, padding).grouped(2), 4));
        v.push(([1, 9, 8, 12], win([3, 3], stride, padding).grouped(3), 6));
        // Dilated dense, and dilated and grouped.
        v.push(([2, 11, 10, 3], win([3, 3], stride, padding).dilated([2, 2]), 5));
        v.push(([1, 12, 13, 8], win([3, 3], stride, padding).dilated([2, 2]).grouped(4), 8));
        // 1x1 and 5x5 windows.
        v.push(([2, 5, 6, 16], win([1, 1], stride, Padding::Valid).grouped(4), 8));
        v.push(([1, 9, 11, 10], win([5, 5], stride, padding).grouped(10), 20));
    }
    // The other strides and groupings, one padding each.
    v.push(([1, 5, 5, 16], win([1, 1], [2, 2], s).grouped(16), 16));
    v.push(([1, 10, 9, 10], win([5, 5], [1, 1], explicit([2, 1], [1, 2])).grouped(5), 5));
    // Depthwise over 144 and 83 channels: the blocks of 16 channels and the rest.
    v.push(([2, 9, 7, 144], win([3, 3], [1, 1], s).grouped(144), 144));
    v.push(([1, 6, 7, 83], win([3, 3], [2, 2], explicit([0, 0], [1, 1])).grouped(83), 83));
    // Depthwise with a block of 8 channels after the 16s (29 = 16 + 8 + 5, 24 = 16 + 8), over
    // runs of every length from 1 to 8 pixels and past (rows of 13 and 12 columns, 5x5 SAME).
    v.push(([2, 9, 13, 29], win([3, 3], [1, 1], s).grouped(29), 29));
    v.push(([1, 7, 12, 24], win([5, 5], [1, 1], s).grouped(24), 24));
    v.push(([1, 11, 12, 24], win([5, 5], [2, 2], s).grouped(24), 24));
    // ResNeXt-like (Cg = Fg = 8), Fg = 16, Fg = 3 (no compiled width), Fg = 4.
    v.push(([2, 6, 6, 32], win([3, 3], [1, 1], s).grouped(4), 32));
    v.push(([1, 5, 5, 8], win([3, 3], [1, 1], Padding::Valid).grouped(2), 32));
    v.push(([2, 5, 4, 4], win([3, 3], [2, 1], s).grouped(2), 6));
    v.push(([1, 7, 6, 6], win([2, 3], [1, 1], s).grouped(3), 12));
    // Rows wide enough for the register tiles of 6 and 8 pixels, forward and in gather form
    // (stride 2: every other column of dx), by 16, 8 and 4 channels of a group.
    v.push(([2, 5, 19, 32], win([3, 3], [1, 1], s).grouped(4), 32));
    v.push(([1, 6, 23, 16], win([3, 3], [2, 2], explicit([0, 0], [1, 1])).grouped(2), 32));
    v.push(([1, 9, 21, 16], win([3, 3], [1, 1], s).dilated([2, 2]), 32));
    v.push(([2, 7, 20, 12], win([3, 3], [1, 1], Padding::Valid).grouped(3), 12));
    v.push(([1, 8, 17, 24], win([5, 5], [2, 2], explicit([2, 3], [1, 0])).dilated([1, 2]).grouped(3), 36));
    // Filter gradients too wide for one task's sums: blocks of 16 channels (and a rest of 4).
    v.push(([1, 3, 4, 3700], win([3, 3], [1, 1], s).grouped(3700), 3700));
    v.push(([1, 7, 9, 64], win([3, 3], [1, 1], s).dilated([2, 2]), 64));
    // Uneven dilation and stride, stride 3, a dilated depthwise window.
    v.push(([2, 9, 10, 4], win([3, 2], [1, 2], s).dilated([2, 1]), 3));
    v.push(([1, 13, 11, 6], win([3, 3], [3, 3], explicit([2, 0], [0, 3])).dilated([3, 2]).grouped(2), 4));
    v.push(([2, 8, 8, 16], win([3, 3], [1, 1], s).dilated([2, 2]).grouped(16), 16));
    v.push(([1, 3, 4, 2], win([3, 3], [1, 1], s).dilated([2, 3]), 2));
    for (_, w, _) in &v {
        assert!(!w.is_dense());
    }
    v
}

#[test]
fn grouped_depthwise_and_dilated_convolutions_match_direct_loops() {
    for (i, (xd, w, f)) in grouped_cases().into_iter().enumerate() {
        check_case(i, xd, w, f);
    }
}

#[test]
fn dense_convolutions_with_explicit_asymmetric_padding_match_direct_loops() {
    // ResNet's and EfficientNet's explicit (0, 0, 1, 1) padding before stride-2 convolutions,
    // and the other asymmetric pads, through every dense path: the GEMM forward, the turned
    // convolution (stride 1) and the tap-by-tap input gradient (stride 2), and the filter
    // gradient tap by tap and in tiles (the two large cases).
    let cases = [
        ([2, 7, 8, 3], win([3, 3], [2, 2], explicit([0, 0], [1, 1])), 4),
        ([2, 8, 8, 3], win([3, 3], [2, 2], explicit([0, 0], [1, 1])), 4),
        ([2, 7, 6, 3], win([3, 3], [1, 1], explicit([0, 1], [2, 0])), 5),
        ([1, 9, 7, 2], win([3, 3], [2, 2], explicit([0, 1], [2, 0])), 3),
        ([2, 6, 9, 4], win([3, 3], [2, 2], explicit([1, 0], [0, 1])), 3),
        ([1, 5, 5, 3], win([3, 3], [1, 1], explicit([1, 0], [0, 1])), 2),
        ([1, 8, 7, 2], win([5, 3], [1, 2], explicit([4, 0], [0, 2])), 3),
        ([1, 6, 6, 2], win([2, 2], [2, 2], explicit([1, 1], [0, 0])), 2),
        ([4, 50, 50, 3], win([3, 3], [1, 1], explicit([0, 2], [2, 0])), 4),
        ([2, 16, 16, 64], win([3, 3], [1, 1], explicit([0, 1], [2, 1])), 8),
    ];
    for (i, (xd, w, f)) in cases.into_iter().enumerate() {
        assert!(w.is_dense());
        check_case(100 + i, xd, w, f);
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn grouped_kernels_do_not_depend_on_the_thread_count() {
    let cases = [
        ([4, 16, 16, 64], win([3, 3], [1, 1], Padding::Same).grouped(64), 64),
        ([4, 14, 14, 96], win([3, 3], [2, 2], explicit([0, 0], [1, 1])).grouped(96), 192),
        ([4, 12, 12, 32], win([3, 3], [1, 1], Padding::Same).grouped(4), 32),
        ([2, 16, 16, 16], win([3, 3], [1, 1], Padding::Same).dilated([2, 2]), 24),
    ];
    for (xd, w, f) in cases {
        let x = rand(&xd, 1);
        let filt = rand(&[3, 3, xd[3] / w.groups, f], 2);
        let y_dims = out_shape(&Op::Conv2d { window: w }, &[&x, &filt]);
        let dy = rand(y_dims.dims(), 3);
        let act = rand(&xd, 4);
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let input = x.shape();
                [
                    run(&Op::Conv2d { window: w }, &[&x, &filt]),
                    run(&Op::Conv2dBackpropInput { window: w, input: input.clone() }, &[&dy, &filt]),
                    run(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy]),
                    run(&Op::Conv2dBackpropInputReluGrad { window: w, input }, &[&dy, &filt, &act]),
                ]
                .map(|t| bits(&t.data))
            })
        };
        let one = on(1);
        // Twice on each pool: the same bits every run, whatever the scheduling.
        for threads in [1, 2, 3, 8] {
            assert!(one == on(threads), "{w:?}: {threads} threads");
        }
    }
}

#[test]
fn a_grouped_convolutions_input_gradient_through_relu_is_the_ops_apart_bit_for_bit() {
    // `conv_relu_grad` makes the op for dense windows only, but the kernel takes any window:
    // relu_grad(y, dx), and relu_grad(y, r + dx), written over y or r where the stride is 1.
    for (i, (xd, w, f)) in grouped_cases().into_iter().enumerate() {
        let filt = rand(&[w.size[0], w.size[1], xd[3] / w.groups, f], 5 * i as u64 + 1);
        let y_dims = out_shape(&Op::Conv2d { window: w }, &[&rand(&xd, 0), &filt]);
        let dy = rand(y_dims.dims(), 5 * i as u64 + 2);
        let act = rand(&xd, 5 * i as u64 + 3);
        let res = rand(&xd, 5 * i as u64 + 4);
        let input = Shape::from(xd);
        let dx = run(&Op::Conv2dBackpropInput { window: w, input: input.clone() }, &[&dy, &filt]);
        let op = Op::Conv2dBackpropInputReluGrad { window: w, input: input.clone() };
        let apart = run(&Op::Binary(BinaryOp::ReluGrad), &[&act, &dx]);
        assert_eq!(bits(&run(&op, &[&dy, &filt, &act]).data), bits(&apart.data), "case {i}");
        let sum = run(&Op::Binary(BinaryOp::Add), &[&res, &dx]);
        let apart_r = run(&Op::Binary(BinaryOp::ReluGrad), &[&act, &sum]);
        assert_eq!(bits(&run(&op, &[&dy, &filt, &act, &res]).data), bits(&apart_r.data), "case {i} residual");
        if !op.may_write_over(2, &input) {
            continue;
        }
        let shapes = [y_dims.clone(), Shape::from(filt.dims.clone()), input.clone(), input.clone()];
        let types: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
        for (operands, over, want) in [(3, 2, &apart), (4, 2, &apart_r), (4, 3, &apart_r)] {
            let k = kiln_kernels::cpu::prepare(&op, &types[..operands], (&input, DType::F32)).unwrap();
            let mut bufs = [dy.data.clone(), filt.data.clone(), act.data.clone(), res.data.clone()];
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
            // SAFETY: buffers of the operands' shapes; the output is y's or r's own buffer, which
            // the op allows (`may_write_over`, checked above).
            unsafe { k.run(&ptrs[..operands], ptrs[over]) };
            assert_eq!(bits(&bufs[over]), bits(&want.data), "case {i} written over operand {over}");
        }
    }
}

// ---------------------------------------------------------------- pooling, explicit padding

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
fn pooling_with_explicit_asymmetric_padding_matches_direct_loops() {
    let cases = [
        ([2, 7, 8, 3], win([3, 3], [2, 2], explicit([0, 0], [1, 1]))),
        ([2, 8, 8, 3], win([3, 3], [2, 2], explicit([0, 0], [1, 1]))),
        ([1, 7, 6, 2], win([3, 3], [1, 1], explicit([0, 1], [2, 0]))),
        ([2, 9, 7, 70], win([3, 3], [2, 2], explicit([1, 0], [0, 1]))),
        ([1, 5, 5, 1], win([2, 2], [2, 2], explicit([1, 1], [0, 0]))),
        ([1, 4, 4, 2], win([2, 2], [2, 2], explicit([0, 0], [1, 1]))),
        ([1, 6, 5, 4], win([3, 2], [1, 2], explicit([2, 1], [1, 0]))),
    ];
    for (i, (xd, w)) in cases.into_iter().enumerate() {
        // All negative: a padded zero would win any maximum it took part in.
        let x = Rng::new(200 + i as u64).tensor(&xd, -3.0, -1.0);
        for kind in [PoolKind::Max, PoolKind::Avg] {
            let y = run(&Op::Pool2d { kind, window: w }, &[&x]);
            assert_close(&y.data, &pool_ref(kind, &x, &w, &y.dims), 1e-6);
            assert!(y.data.iter().all(|&v| v < -0.99), "case {i} {kind:?}: padding was counted");
            let dy = rand(&y.dims, 300 + i as u64);
            let dx = run(&Op::Pool2dGrad { kind, window: w }, &[&x, &dy]);
            assert_close(&dx.data, &pool_grad_ref(kind, &x, &dy, &w), 1e-6);
            if kind == PoolKind::Avg {
                let from_dy = run(&Op::AvgPool2dGrad { window: w, input: Shape::from(xd) }, &[&dy]);
                assert_eq!(from_dy, dx, "case {i}");
            }
        }
    }
}

// ---------------------------------------------------------------- timings

/// The fastest of `reps` runs of `op` on `threads` threads, in milliseconds (the least disturbed
/// by other work on a shared machine), after one run that warms the caches and the pool.
fn time_op(op: &Op, inputs: &[&T], threads: usize, reps: usize) -> f64 {
    let (k, out) = kernel(op, inputs);
    let mut bufs: Vec<Vec<f32>> = inputs.iter().map(|t| t.data.clone()).collect();
    // Addresses, which cross into the pool's thread.
    let addrs: Vec<usize> = bufs.iter_mut().map(|b| b.as_mut_ptr() as usize).collect();
    let mut o = vec![0f32; out.numel()];
    let o = o.as_mut_ptr() as usize;
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let ms: Vec<f64> = (0..reps + 1)
        .map(|_| {
            let t = std::time::Instant::now();
            pool.install(|| {
                let ptrs: Vec<*mut u8> = addrs.iter().map(|&a| a as *mut u8).collect();
                // SAFETY: buffers sized from the shapes, distinct allocations, alive here.
                unsafe { k.run(&ptrs, o as *mut u8) }
            });
            t.elapsed().as_secs_f64() * 1e3
        })
        .skip(1)
        .collect();
    ms.into_iter().fold(f64::INFINITY, f64::min)
}

/// `cargo test -p kiln-kernels --release --test grouped_conv -- --ignored --nocapture timings`:
/// the numbers quoted in `cpu/grouped_conv.rs`.
#[test]
#[ignore]
fn timings() {
    let same = win([3, 3], [1, 1], Padding::Same);
    // (name, input, window, output channels, whether to time the dense equivalent)
    let cases = [
        ("depthwise 3x3 32x56x56x144", [32, 56, 56, 144], same.grouped(144), 144, true),
        ("grouped 3x3 32x28x28x256 G=32", [32, 28, 28, 256], same.grouped(32), 256, true),
        ("depthwise x2 3x3 32x56x56x72 -> 144", [32, 56, 56, 72], same.grouped(72), 144, false),
        ("dilated 3x3 d2 8x32x32x64 -> 64", [8, 32, 32, 64], same.dilated([2, 2]), 64, false),
    ];
    for (name, xd, w, f, dense) in cases {
        let x = rand(&xd, 1);
        let filt = rand(&[3, 3, xd[3] / w.groups, f], 2);
        let dy = rand(out_shape(&Op::Conv2d { window: w }, &[&x, &filt]).dims(), 3);
        for threads in [1, 2] {
            let fwd = time_op(&Op::Conv2d { window: w }, &[&x, &filt], threads, 5);
            let input = Op::Conv2dBackpropInput { window: w, input: x.shape() };
            let bwd_in = time_op(&input, &[&dy, &filt], threads, 5);
            let bwd_w = time_op(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy], threads, 5);
            println!(
                "{name}, {threads} thread(s): forward {fwd:.1} ms, input gradient {bwd_in:.1} ms, filter gradient {bwd_w:.1} ms"
            );
        }
        if dense {
            // The same convolution as a dense one over the block-diagonal filter.
            let full = rand(&[3, 3, xd[3], f], 4);
            let ms = time_op(&Op::Conv2d { window: same }, &[&x, &full], 1, 1);
            println!("{name}: dense over the block-diagonal filter, 1 thread: forward {ms:.1} ms");
        }
    }
}

/// `cargo test -p kiln-kernels --release --test grouped_conv -- --ignored --nocapture
/// depthwise_timings`: the depthwise forward on EfficientNet-B0's and MobileNet's shapes at batch
/// 1-2, one thread, the fastest of 200 runs, every buffer 64-byte aligned as the arena's are (the
/// figures quoted in `cpu/grouped_conv.rs`, `depthwise_run`).
#[test]
#[ignore]
fn depthwise_timings() {
    /// `data` copied to a 64-byte boundary inside a larger buffer, and that boundary's address.
    fn aligned(data: &[f32]) -> (Vec<f32>, usize) {
        let mut v = vec![0f32; data.len() + 16];
        let off = (64 - v.as_ptr() as usize % 64) % 64 / 4;
        v[off..off + data.len()].copy_from_slice(data);
        let at = v.as_mut_ptr() as usize + off * 4;
        (v, at)
    }
    let shapes = [
        ([1, 28, 28, 96], 3, 1),
        ([2, 14, 14, 672], 5, 1),
        ([2, 56, 56, 144], 3, 1),
        ([2, 112, 112, 32], 3, 1),
        ([2, 28, 28, 240], 5, 1),
        ([2, 112, 112, 96], 3, 2),
        // Channels not a multiple of 16 and small maps (MobileNetV3-small's).
        ([2, 56, 56, 72], 3, 2),
        ([2, 28, 28, 88], 3, 1),
        ([2, 14, 14, 120], 5, 1),
        ([2, 7, 7, 576], 5, 1),
    ];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    for (xd, k, s) in shapes {
        let w = win([k, k], [s, s], Padding::Same).grouped(xd[3]);
        let (x, filt) = (rand(&xd, 1), rand(&[k, k, 1, xd[3]], 2));
        let (kern, out) = kernel(&Op::Conv2d { window: w }, &[&x, &filt]);
        let ((_xb, xa), (_fb, fa), (_ob, oa)) =
            (aligned(&x.data), aligned(&filt.data), aligned(&vec![0.0; out.numel()]));
        let best = (0..200)
            .map(|_| {
                let t = std::time::Instant::now();
                pool.install(|| {
                    let ptrs = [xa as *mut u8, fa as *mut u8];
                    // SAFETY: buffers sized from the shapes, distinct allocations, alive here.
                    unsafe { kern.run(&ptrs, oa as *mut u8) }
                });
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min);
        let macs = out.numel() * k * k;
        println!(
            "depthwise {k}x{k} stride {s} over {xd:?}: {best:.3} ms, {:.1} GMAC/s",
            macs as f64 / best / 1e6
        );
    }
}
