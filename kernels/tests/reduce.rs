//! Reductions and softmax against f64 references: every axis subset of random shapes (proptest),
//! large inputs on the parallel paths, accuracy, and results independent of the thread count.

mod common;
use common::Rng;
use common::*;
use kiln_compiler::ir::{Op, ReduceOp};
use proptest::prelude::*;

fn reduce_ref(op: ReduceOp, x: &T, axes: &[usize], keepdims: bool) -> (Vec<usize>, Vec<f64>) {
    let kept: Vec<usize> = (0..x.dims.len()).filter(|a| !axes.contains(a)).collect();
    let kept_dims: Vec<usize> = kept.iter().map(|&a| x.dims[a]).collect();
    let n: usize = kept_dims.iter().product();
    let init = if op == ReduceOp::Max { f64::NEG_INFINITY } else { 0.0 };
    let mut acc = vec![init; n];
    let mut count = vec![0usize; n];
    for (i, &v) in x.data.iter().enumerate() {
        let idx = unravel(i, &x.dims);
        let k: Vec<usize> = kept.iter().map(|&a| idx[a]).collect();
        let o = ravel(&k, &kept_dims);
        acc[o] = if op == ReduceOp::Max { acc[o].max(v as f64) } else { acc[o] + v as f64 };
        count[o] += 1;
    }
    if op == ReduceOp::Mean {
        acc.iter_mut().zip(&count).for_each(|(a, &c)| *a /= c as f64);
    }
    let dims = (0..x.dims.len())
        .filter_map(|a| match (axes.contains(&a), keepdims) {
            (false, _) => Some(x.dims[a]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    (dims, acc)
}

fn check_reduce(op: ReduceOp, x: &T, axes: &[usize], keepdims: bool, tol: f64) {
    let got = run(&Op::Reduce { op, axes: axes.to_vec(), keepdims }, &[x]);
    let (dims, want) = reduce_ref(op, x, axes, keepdims);
    assert_eq!(got.dims, dims);
    assert_close(&got.data, &want, tol);
}

const OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max];

#[test]
fn reduce_every_axis_subset_of_rank_4() {
    let x = rand(&[3, 1, 5, 7], 1);
    for mask in 0..16usize {
        let axes: Vec<usize> = (0..4).filter(|a| mask >> a & 1 == 1).collect();
        for op in OPS {
            for keepdims in [false, true] {
                check_reduce(op, &x, &axes, keepdims, 1e-6);
            }
        }
    }
    let s = rand(&[], 2);
    check_reduce(ReduceOp::Sum, &s, &[], false, 0.0);
}

#[test]
fn reduce_large_inputs_on_every_path() {
    let cases: [(&[usize], &[usize]); 8] = [
        (&[1_000_003], &[0]),        // one long row, chunks in parallel
        (&[3, 70_001], &[1]),        // few long rows
        (&[70_001, 5], &[0]),        // few columns, row chunks in parallel
        (&[4_000, 130], &[0]),       // many column tiles
        (&[2, 40_000, 3], &[1]),     // kept outer and inner
        (&[50, 30, 40], &[0, 2]),    // non-contiguous axes, reduced innermost
        (&[50, 30, 40], &[1]),       // middle axis
        (&[30, 40, 50, 2], &[0, 2]), // non-contiguous axes, kept innermost
    ];
    for (i, (dims, axes)) in cases.iter().enumerate() {
        let x = rand(dims, 100 + i as u64);
        for op in OPS {
            check_reduce(op, &x, axes, false, 1e-6);
        }
    }
}

#[test]
fn sums_are_accurate_and_thread_count_independent() {
    // 2^24 + many ones: an f32 accumulator would lose every 1.
    let mut data = vec![1.0f32; 300_001];
    data[0] = 16_777_216.0;
    let x = T::new(&[300_001], data);
    let got = run(&Op::Reduce { op: ReduceOp::Sum, axes: vec![0], keepdims: false }, &[&x]);
    assert_eq!(got.data[0], 16_777_216.0 + 300_000.0);

    let cases: [(&[usize], &[usize]); 4] =
        [(&[1_000_003], &[0]), (&[70_001, 5], &[0]), (&[3, 70_001], &[1]), (&[30, 40, 50, 2], &[0, 2])];
    for (dims, axes) in cases {
        let x = rand(dims, 7);
        let op = Op::Reduce { op: ReduceOp::Mean, axes: axes.to_vec(), keepdims: true };
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(&op, &[&x]))
        };
        let one = on(1);
        assert_eq!(one, on(3), "{dims:?}");
        assert_eq!(one, on(8), "{dims:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn reduce_random_shapes(
        dims in prop::collection::vec(1usize..6, 0..5),
        mask in 0usize..32,
        op in 0usize..3,
        keepdims: bool,
        seed: u64,
    ) {
        let axes: Vec<usize> = (0..dims.len()).filter(|a| mask >> a & 1 == 1).collect();
        let x = rand(&dims, seed);
        check_reduce(OPS[op], &x, &axes, keepdims, 1e-6);
    }
}

fn softmax_ref(x: &T, axis: usize, log: bool) -> Vec<f64> {
    let d = &x.dims;
    (0..x.data.len())
        .map(|i| {
            let idx = unravel(i, d);
            let vals: Vec<f64> = (0..d[axis])
                .map(|j| {
                    let mut k = idx.clone();
                    k[axis] = j;
                    x.at(&k) as f64
                })
                .collect();
            let m = vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = vals.iter().map(|v| (v - m).exp()).sum();
            let v = x.data[i] as f64;
            if log { v - m - sum.ln() } else { (v - m).exp() / sum }
        })
        .collect()
}

#[test]
fn softmax_and_log_softmax_along_every_axis() {
    let shapes: [&[usize]; 6] = [&[1], &[7], &[4, 33], &[3, 1, 5], &[2, 3, 70, 2], &[300, 130]];
    for (i, dims) in shapes.iter().enumerate() {
        let x = Rng::new(i as u64).tensor(dims, -10.0, 10.0);
        for axis in 0..dims.len() {
            for log in [false, true] {
                let op = if log { Op::LogSoftmax { axis } } else { Op::Softmax { axis } };
                let got = run(&op, &[&x]);
                assert_close(&got.data, &softmax_ref(&x, axis, log), 2e-6);
            }
        }
    }
}

#[test]
fn softmax_is_stable_for_large_logits() {
    let x = T::new(&[2, 3], vec![1000.0, 999.0, -1000.0, -1000.0, -1001.0, -3000.0]);
    let s = run(&Op::Softmax { axis: 1 }, &[&x]);
    assert_close(&s.data, &softmax_ref(&x, 1, false), 1e-6);
    let l = run(&Op::LogSoftmax { axis: 1 }, &[&x]);
    assert_close(&l.data, &softmax_ref(&x, 1, true), 1e-6);
    assert!(l.data.iter().all(|v| v.is_finite()));
    let t = T::new(&[3, 2], vec![1000.0, -1000.0, 999.0, -1001.0, -1000.0, -3000.0]);
    let s0 = run(&Op::Softmax { axis: 0 }, &[&t]);
    assert_close(&s0.data, &softmax_ref(&t, 0, false), 1e-6);
}
