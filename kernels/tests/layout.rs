//! Fill, copy, permute, broadcast_to, concat, slice and pad against index-by-index references.

mod common;
use common::*;
use kiln_compiler::ir::{Op, Shape};

#[test]
fn iota_counts_along_its_axis() {
    for (dims, axis) in
        [(&[5][..], 0), (&[3, 4][..], 0), (&[3, 4][..], 1), (&[2, 3, 70_001][..], 2), (&[2, 3, 5][..], 1)]
    {
        let f = run(&Op::Iota { shape: Shape::from(dims), axis }, &[]);
        let stride: usize = dims[axis + 1..].iter().product();
        for (i, v) in f.data.iter().enumerate() {
            assert_eq!(*v, ((i / stride) % dims[axis]) as f32, "{dims:?} axis {axis} at {i}");
        }
    }
}

#[test]
fn fill_and_copy() {
    for dims in [&[][..], &[1], &[3, 7], &[70_001]] {
        let f = run(&Op::Fill { value: 2.5, shape: Shape::from(dims) }, &[]);
        assert_eq!(f.dims, dims);
        assert!(f.data.iter().all(|&v| v == 2.5));
        let x = rand(dims, 1);
        assert_eq!(run(&Op::Copy, &[&x]), x);
    }
}

fn permute_ref(x: &T, perm: &[usize]) -> T {
    let dims: Vec<usize> = perm.iter().map(|&p| x.dims[p]).collect();
    let n = x.data.len();
    let data = (0..n)
        .map(|i| {
            let o = unravel(i, &dims);
            let mut src = vec![0; dims.len()];
            for (a, &p) in perm.iter().enumerate() {
                src[p] = o[a];
            }
            x.at(&src)
        })
        .collect();
    T::new(&dims, data)
}

#[test]
fn permute_matches_reference() {
    // The last four: NCHW -> NHWC of 3 channels (the interleaving path; one partial tile, and
    // several tiles with a partial last), 2 and 5 channels (tiles taller than 32 rows).
    let cases: [(&[usize], &[usize]); 13] = [
        (&[], &[]),
        (&[5], &[0]),
        (&[3, 7], &[1, 0]),
        (&[1, 7], &[1, 0]),
        (&[2, 3, 4], &[2, 0, 1]),
        (&[2, 3, 4], &[0, 2, 1]),
        (&[2, 3, 4, 5], &[0, 2, 1, 3]),
        (&[2, 3, 4, 5], &[3, 2, 1, 0]),
        (&[33, 40, 31], &[1, 2, 0]),
        (&[2, 3, 17, 19], &[0, 2, 3, 1]),
        (&[2, 3, 40, 30], &[0, 2, 3, 1]),
        (&[3, 2, 50, 13], &[0, 2, 3, 1]),
        (&[2, 5, 9, 40], &[0, 2, 3, 1]),
    ];
    for (i, (dims, perm)) in cases.iter().enumerate() {
        let x = rand(dims, i as u64);
        let got = run(&Op::Permute { perm: perm.to_vec() }, &[&x]);
        assert_eq!(got, permute_ref(&x, perm), "{dims:?} {perm:?}");
    }
}

#[test]
fn broadcast_to_materialises() {
    let cases: [(&[usize], &[usize]); 7] = [
        (&[], &[]),
        (&[], &[3, 2]),
        (&[1], &[5]),
        (&[3], &[4, 3]),
        (&[4, 1], &[2, 4, 3]),
        (&[2, 1, 3, 1], &[2, 5, 3, 7]),
        (&[1, 130], &[300, 130]),
    ];
    for (i, (from, to)) in cases.iter().enumerate() {
        let x = rand(from, i as u64);
        let got = run(&Op::BroadcastTo { shape: Shape::from(*to) }, &[&x]);
        assert_eq!(got.dims, *to);
        for (j, &v) in got.data.iter().enumerate() {
            assert_eq!(v, x.data[broadcast_index(&unravel(j, to), from)]);
        }
    }
}

#[test]
fn concat_slice_pad_round_trip() {
    // Concat along every axis of rank-3 operands, three operands of different extents.
    let base = [3usize, 4, 5];
    for axis in 0..3 {
        let parts: Vec<T> = [1usize, 2, 3]
            .iter()
            .enumerate()
            .map(|(i, &e)| {
                let mut d = base.to_vec();
                d[axis] = e;
                rand(&d, 10 * axis as u64 + i as u64)
            })
            .collect();
        let refs: Vec<&T> = parts.iter().collect();
        let cat = run(&Op::Concat { axis }, &refs);
        let mut start = 0;
        for p in &parts {
            let len = p.dims[axis];
            // Each part is the slice of the concatenation.
            let s = run(&Op::Slice { axis, start, len }, &[&cat]);
            assert_eq!(&s, p, "axis {axis}");
            // Padding the part back gives the concatenation where it lies, zeros elsewhere.
            let after = cat.dims[axis] - start - len;
            let padded = run(&Op::Pad { axis, before: start, after }, &[p]);
            for (j, &v) in padded.data.iter().enumerate() {
                let idx = unravel(j, &padded.dims);
                let inside = (start..start + len).contains(&idx[axis]);
                assert_eq!(v, if inside { cat.data[j] } else { 0.0 });
            }
            start += len;
        }
    }
    // One operand, rank 1, and a large concatenation on the parallel path.
    let x = rand(&[7], 1);
    assert_eq!(run(&Op::Concat { axis: 0 }, &[&x]), x);
    let (a, b) = (rand(&[300, 70], 2), rand(&[300, 110], 3));
    let cat = run(&Op::Concat { axis: 1 }, &[&a, &b]);
    for r in 0..300 {
        assert_eq!(&cat.data[r * 180..r * 180 + 70], &a.data[r * 70..(r + 1) * 70]);
        assert_eq!(&cat.data[r * 180 + 70..(r + 1) * 180], &b.data[r * 110..(r + 1) * 110]);
    }
    let big = rand(&[50_000, 3], 4);
    let s = run(&Op::Slice { axis: 1, start: 1, len: 2 }, &[&big]);
    assert!((0..50_000).all(|r| s.data[2 * r..2 * r + 2] == big.data[3 * r + 1..3 * r + 3]));
    let p = run(&Op::Pad { axis: 0, before: 2, after: 1 }, &[&big]);
    assert!(p.data[..6].iter().all(|&v| v == 0.0) && p.data[p.data.len() - 3..].iter().all(|&v| v == 0.0));
    assert_eq!(&p.data[6..6 + big.data.len()], &big.data[..]);
}

#[test]
fn empty_tensors_run_without_touching_memory() {
    let e = T::new(&[0, 3], vec![]);
    let row = rand(&[3], 1);
    assert_eq!(run(&Op::Unary(kiln_compiler::ir::UnaryOp::Exp), &[&e]).dims, [0, 3]);
    assert_eq!(run(&Op::Binary(kiln_compiler::ir::BinaryOp::Add), &[&e, &row]).dims, [0, 3]);
    assert_eq!(run(&Op::Permute { perm: vec![1, 0] }, &[&e]).dims, [3, 0]);
    assert_eq!(run(&Op::Concat { axis: 0 }, &[&e, &e]).dims, [0, 3]);
    assert_eq!(run(&Op::Pad { axis: 1, before: 1, after: 0 }, &[&e]).dims, [0, 4]);
    assert_eq!(run(&Op::Softmax { axis: 1 }, &[&e]).dims, [0, 3]);
    let sum =
        run(&Op::Reduce { op: kiln_compiler::ir::ReduceOp::Sum, axes: vec![0], keepdims: false }, &[&e]);
    assert_eq!(sum.data, [0.0; 3]);
    let none =
        run(&Op::Reduce { op: kiln_compiler::ir::ReduceOp::Sum, axes: vec![1], keepdims: false }, &[&e]);
    assert_eq!(none.dims, [0]);
}
