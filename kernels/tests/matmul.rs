//! Matrix products against an f64 reference: transposes, batch axes with broadcasting, odd and
//! large sizes (serial, per-batch and per-GEMM threading).

mod common;
use common::*;
use kiln_compiler::ir::Op;

/// The batch dims of `dims` (all but the last two).
fn batch(dims: &[usize]) -> &[usize] {
    &dims[..dims.len() - 2]
}

fn matmul_ref(a: &T, b: &T, ta: bool, tb: bool, out: &[usize]) -> Vec<f64> {
    let r = out.len();
    let (m, n) = (out[r - 2], out[r - 1]);
    let k = if ta { a.dims[a.dims.len() - 2] } else { a.dims[a.dims.len() - 1] };
    let ob = &out[..r - 2];
    let nb: usize = ob.iter().product();
    let (ab, bb) = (batch(&a.dims), batch(&b.dims));
    let mut res = vec![0.0; nb * m * n];
    for bi in 0..nb {
        let idx = unravel(bi, ob);
        let ao = broadcast_index(&idx, ab) * m * k;
        let bo = broadcast_index(&idx, bb) * k * n;
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0;
                for p in 0..k {
                    let x = a.data[ao + if ta { p * m + i } else { i * k + p }] as f64;
                    let y = b.data[bo + if tb { j * k + p } else { p * n + j }] as f64;
                    s += x * y;
                }
                res[(bi * m + i) * n + j] = s;
            }
        }
    }
    res
}

/// Operand dims for an (m, k) x (k, n) product with the given transposes and batch dims.
fn operands(
    (m, k, n): (usize, usize, usize),
    ta: bool,
    tb: bool,
    ba: &[usize],
    bb: &[usize],
    seed: u64,
) -> (T, T) {
    let mut da = ba.to_vec();
    da.extend(if ta { [k, m] } else { [m, k] });
    let mut db = bb.to_vec();
    db.extend(if tb { [n, k] } else { [k, n] });
    (rand(&da, seed), rand(&db, seed + 1))
}

fn check(m: usize, k: usize, n: usize, ba: &[usize], bb: &[usize]) {
    for ta in [false, true] {
        for tb in [false, true] {
            let (a, b) = operands((m, k, n), ta, tb, ba, bb, (m * 31 + k * 7 + n) as u64);
            let op = Op::MatMul { transpose_a: ta, transpose_b: tb };
            let got = run(&op, &[&a, &b]);
            let want = matmul_ref(&a, &b, ta, tb, &got.dims);
            assert_close(&got.data, &want, 1e-5 * (k as f64).sqrt().max(1.0));
        }
    }
}

#[test]
fn small_and_odd_sizes() {
    for (m, k, n) in [(1, 1, 1), (1, 7, 1), (3, 1, 5), (7, 33, 3), (32, 100, 10), (33, 17, 65)] {
        check(m, k, n, &[], &[]);
    }
}

#[test]
fn batched_with_broadcast() {
    check(32, 100, 10, &[2], &[]); // folds into one GEMM
    check(5, 6, 7, &[], &[3]);
    check(3, 4, 6, &[2, 1], &[5]);
    check(4, 3, 2, &[1, 3], &[2, 1]);
    check(6, 5, 4, &[2, 3], &[2, 3]);
    check(2, 3, 4, &[1], &[1]);
    check(64, 32, 64, &[8, 4], &[8, 4]); // per-batch threads
}

#[test]
fn large_products_use_the_pool() {
    check(130, 257, 190, &[], &[]);
    let (a, b) = operands((128, 64, 128), false, true, &[8, 4], &[8, 4], 9);
    let op = Op::MatMul { transpose_a: false, transpose_b: true };
    let got = run(&op, &[&a, &b]);
    assert_eq!(got.dims, [8, 4, 128, 128]);
    assert_close(&got.data, &matmul_ref(&a, &b, false, true, &got.dims), 1e-4);
}

/// A weight read transposed at a row stride of a multiple of 4 KiB (K = 1,024, 2,048): copied to
/// row-major panels, the copy cut in bands among the threads; the reference's values and the
/// same bits on 1, 2 and 3 threads.
#[test]
fn a_transposed_operand_at_an_aliasing_stride_gives_the_same_bits_on_any_thread_count() {
    for (i, (m, k, n)) in [(200, 1024, 96), (64, 2048, 1100)].into_iter().enumerate() {
        let (a, b) = operands((m, k, n), false, true, &[], &[], 20 + i as u64);
        let op = Op::MatMul { transpose_a: false, transpose_b: true };
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| run(&op, &[&a, &b]))
        };
        let one = on(1);
        assert_close(&one.data, &matmul_ref(&a, &b, false, true, &one.dims), 1e-4);
        assert!(one == on(2) && one == on(3), "case {i}: the thread count changed the bits");
    }
}

#[test]
fn empty_contraction_gives_zeros() {
    let (a, b) = (T::new(&[3, 0], vec![]), T::new(&[0, 4], vec![]));
    let got = run(&Op::MatMul { transpose_a: false, transpose_b: false }, &[&a, &b]);
    assert_eq!(got.data, vec![0.0; 12]);
}

/// A product with an epilogue written over an epilogue operand (`Op::may_write_over`: any
/// rank, either factor transposed) gives the bits it gives into a buffer of its own: batches
/// folded into the rows and not, broadcast factors, outputs wider than a tile's rows (blocks of
/// columns, the epilogue a row at a time), operands broadcast along rows, columns and batches.
#[test]
fn a_product_written_over_its_epilogue_operand_gives_its_own_bits() {
    use kiln_compiler::ir::fused::{FusedMatMul, Inst, Ref};
    use kiln_compiler::ir::{BinaryOp, Fused, Shape, UnaryOp};
    // (m, k, n), a's batch, b's batch, the broadcast operand's dims.
    type Case = ((usize, usize, usize), &'static [usize], &'static [usize], &'static [usize]);
    let cases: [Case; 8] = [
        ((7, 5, 9), &[], &[], &[9]),
        ((33, 17, 70), &[3], &[], &[70]),
        ((5, 8, 3000), &[2], &[], &[1]),
        ((20, 12, 9000), &[2], &[], &[2, 20, 1]),
        ((6, 4, 11), &[2, 3], &[3], &[2, 1, 6, 1]),
        ((9, 6, 5), &[4], &[4], &[9, 5]),
        ((3, 64, 70000), &[], &[], &[70000]),
        ((150, 3, 700), &[2], &[1], &[2, 1, 1]),
    ];
    for (i, &((m, k, n), ba, bb, extra)) in cases.iter().enumerate() {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a, b) = operands((m, k, n), ta, tb, ba, bb, 100 + i as u64);
            let out = out_shape(&Op::MatMul { transpose_a: ta, transpose_b: tb }, &[&a, &b]);
            let (over, other) = (rand(out.dims(), 7 + i as u64), rand(extra, 8 + i as u64));
            // gelu(A·B * over + other) - over
            let op = Op::Fused(Fused {
                matmul: Some(FusedMatMul { transpose_a: ta, transpose_b: tb }),
                ..Fused::elementwise(
                    Shape::from(out.dims()),
                    vec![
                        Inst::Binary(BinaryOp::Mul, Ref::Operand(0), Ref::Operand(1)),
                        Inst::Binary(BinaryOp::Add, Ref::Value(0), Ref::Operand(2)),
                        Inst::Unary(UnaryOp::Gelu, Ref::Value(1)),
                        Inst::Binary(BinaryOp::Sub, Ref::Value(2), Ref::Operand(1)),
                    ],
                )
            });
            assert!(op.may_write_over(2, &out) && !op.may_write_over(0, &out) && !op.may_write_over(1, &out));
            let apart = run(&op, &[&a, &b, &over, &other]);
            let product = run(&Op::MatMul { transpose_a: ta, transpose_b: tb }, &[&a, &b]);
            let want: Vec<f32> = (0..out.numel())
                .map(|e| {
                    let x =
                        product.data[e] * over.data[e] + other.data[broadcast_index_of(e, out.dims(), extra)];
                    let g = run(&Op::Unary(UnaryOp::Gelu), &[&T::new(&[1], vec![x])]).data[0];
                    g - over.data[e]
                })
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let case = format!("case {i} ta {ta} tb {tb}");
            assert_eq!(bits(&apart.data), bits(&want), "{case}: fused against product then epilogue");
            let (kernel, _) = kernel(&op, &[&a, &b, &over, &other]);
            let mut bufs = [a.data.clone(), b.data.clone(), over.data.clone(), other.data.clone()];
            let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
            // SAFETY: buffers sized from the shapes, distinct allocations; the output is operand
            // 2's buffer, which has the output's shape and which the op allows (asserted above).
            unsafe { kernel.run(&ptrs, ptrs[2]) };
            assert_eq!(bits(&bufs[2]), bits(&apart.data), "{case}: written over operand 2");
        }
    }
}

/// The flat index into an operand of `dims`, broadcast to `out`, of output element `e`.
fn broadcast_index_of(e: usize, out: &[usize], dims: &[usize]) -> usize {
    broadcast_index(&unravel(e, out), dims)
}
