//! The CUDA source generator (`kiln_kernels::cuda`) over every op and many shapes, without a GPU:
//! every kernel generates, is deterministic, launches functions that its source defines with as
//! many pointer parameters as arguments, stays within CUDA's launch limits and covers its work.
//!
//! With `KILN_DUMP_CUDA=DIR` the test also writes, per case, `NAME.cu` (the source),
//! `NAME.launch` (one line per launch: function, grid, block, shared bytes, arguments as `iN`/`o`)
//! and, for cases small enough to run on the CPU, `NAME.inN` (operand N, raw little-endian f32)
//! and `NAME.expect` (the CPU kernel's output, or for effects `NAME.expectN`, operand N after the
//! update): what a GPU check or an NVRTC compile check needs.

use kiln_compiler::ir::fused::{FusedMatMul, FusedReduce, Inst, Ref};
use kiln_compiler::ir::{
    BinaryOp, DType, Fused, Op, Padding, PoolKind, ReduceOp, Rows, ScalarOp, Shape, Shard, UnaryOp, Window2d,
    infer,
};
use kiln_kernels::KernelError;
use kiln_kernels::cpu;
use kiln_kernels::cuda::{Arg, CudaKernel, generate, generate_with_scratch, scratch_bytes};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

mod cuda_host;

/// How an operand's test data is drawn.
#[derive(Clone, Copy, Debug)]
enum Data {
    /// Uniform in [lo, hi).
    Uniform(f32, f32),
    /// Uniform in [-2, 2) rounded to multiples of 0.5: many ties (max pooling's first maximum).
    Ties,
    /// Ids for a table of this many rows, with some out of range, negative and fractional.
    Ids(usize),
    Const(f32),
}

struct Case {
    name: String,
    op: Op,
    shapes: Vec<Shape>,
    data: Vec<Data>,
    /// Generated with the scratch it asks for (`scratch_bytes`) rather than none.
    scratch: bool,
}

fn case(name: impl Into<String>, op: Op, shapes: &[&[usize]]) -> Case {
    let shapes: Vec<Shape> = shapes.iter().map(|s| Shape::from(*s)).collect();
    let data = vec![Data::Uniform(-2.0, 2.0); shapes.len()];
    Case { name: name.into(), op, shapes, data, scratch: false }
}

impl Case {
    fn with(mut self, i: usize, d: Data) -> Case {
        self.data[i] = d;
        self
    }

    fn output(&self) -> Shape {
        let ops: Vec<(&Shape, DType)> = self.shapes.iter().map(|s| (s, DType::F32)).collect();
        infer(&self.op, &ops).unwrap_or_else(|e| panic!("{}: {}", self.name, e.message)).0
    }

    /// With the scratch the kernel asks for (split-K across blocks).
    fn split(mut self) -> Case {
        self.scratch = true;
        self
    }

    fn scratch_bytes(&self) -> usize {
        let ops: Vec<(&Shape, DType)> = self.shapes.iter().map(|s| (s, DType::F32)).collect();
        if self.scratch { scratch_bytes(&self.op, &ops, &self.output()) } else { 0 }
    }

    fn generate(&self) -> CudaKernel {
        let ops: Vec<(&Shape, DType)> = self.shapes.iter().map(|s| (s, DType::F32)).collect();
        let out = self.output();
        generate_with_scratch(&self.op, &ops, (&out, DType::F32), self.scratch_bytes())
            .unwrap_or_else(|e| panic!("{}: {e}", self.name))
    }
}

fn win(size: [usize; 2], stride: [usize; 2], padding: Padding) -> Window2d {
    Window2d::new(size, stride, padding)
}

const UNARY: [UnaryOp; 15] = UnaryOp::ALL;

const BINARY: [BinaryOp; 18] = [
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
    BinaryOp::ReluGrad,
    BinaryOp::GeluGrad,
    BinaryOp::GeluTanhGrad,
    BinaryOp::SigmoidGrad,
    BinaryOp::TanhGrad,
];

const SCALAR: [(ScalarOp, f32); 17] = [
    (ScalarOp::Add, 0.1),
    (ScalarOp::Mul, -3.5),
    (ScalarOp::RSub, 1.0),
    (ScalarOp::RDiv, 2.0),
    (ScalarOp::Pow, 2.0),
    (ScalarOp::Pow, 0.5),
    (ScalarOp::Pow, -1.0),
    (ScalarOp::Pow, 0.0),
    (ScalarOp::Pow, 1.0),
    (ScalarOp::Pow, 3.0),
    (ScalarOp::Max, 0.25),
    (ScalarOp::Min, -0.3),
    (ScalarOp::Greater, 0.0),
    (ScalarOp::GreaterEqual, 0.5),
    (ScalarOp::Less, -1.0),
    (ScalarOp::LessEqual, 1.5),
    (ScalarOp::Equal, 0.5),
];

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    // ---- elementwise
    for u in UNARY {
        for (i, s) in [&[][..], &[7], &[3, 5], &[2, 3, 4, 5]].iter().enumerate() {
            v.push(case(format!("unary_{u:?}_{i}"), Op::Unary(u), &[s]));
        }
    }
    for b in BINARY {
        let grad = matches!(
            b,
            BinaryOp::ReluGrad
                | BinaryOp::GeluGrad
                | BinaryOp::GeluTanhGrad
                | BinaryOp::SigmoidGrad
                | BinaryOp::TanhGrad
        );
        let pairs: Vec<(&[usize], &[usize])> = if grad {
            vec![(&[7], &[7]), (&[4, 6], &[4, 6]), (&[], &[])]
        } else {
            vec![
                (&[7], &[7]),
                (&[4, 6], &[4, 6]),
                (&[32, 10], &[10]),
                (&[4, 1, 3], &[5, 1]),
                (&[], &[2, 3]),
                (&[2, 4], &[]),
                (&[3, 1, 5], &[2, 3, 4, 5]),
                (&[], &[]),
            ]
        };
        for (i, (x, y)) in pairs.into_iter().enumerate() {
            let mut c = case(format!("binary_{b:?}_{i}"), Op::Binary(b), &[x, y]);
            if b == BinaryOp::Pow {
                c = c.with(0, Data::Uniform(0.1, 2.0));
            }
            if matches!(b, BinaryOp::Equal | BinaryOp::NotEqual | BinaryOp::Maximum | BinaryOp::Minimum) {
                c = c.with(0, Data::Ties).with(1, Data::Ties);
            }
            v.push(c);
        }
    }
    for (j, (op, value)) in SCALAR.into_iter().enumerate() {
        for (i, s) in [&[][..], &[5, 3], &[4, 8]].iter().enumerate() {
            let mut c = case(format!("scalar_{op:?}_{j}_{i}"), Op::Scalar { op, value }, &[s]);
            if matches!(op, ScalarOp::Equal | ScalarOp::GreaterEqual | ScalarOp::LessEqual) {
                c = c.with(0, Data::Ties);
            }
            v.push(c);
        }
    }
    for (i, (c, a, b)) in [
        (&[2, 3][..], &[2, 3][..], &[2, 3][..]),
        (&[3, 1], &[1, 4], &[3, 4]),
        (&[], &[5], &[1]),
        (&[2, 1, 4], &[3, 1], &[4]),
    ]
    .into_iter()
    .enumerate()
    {
        v.push(case(format!("select_{i}"), Op::Select, &[c, a, b]).with(0, Data::Ties));
    }
    // ---- matmul
    let mm = |ta, tb| Op::MatMul { transpose_a: ta, transpose_b: tb };
    v.push(case("matmul_32x100x10", mm(false, false), &[&[32, 100], &[100, 10]]));
    v.push(case("matmul_ta", mm(true, false), &[&[100, 32], &[100, 10]]));
    v.push(case("matmul_tb", mm(false, true), &[&[32, 100], &[10, 100]]));
    v.push(case("matmul_ta_tb", mm(true, true), &[&[100, 32], &[10, 100]]));
    v.push(case("matmul_odd", mm(false, false), &[&[17, 33], &[33, 9]]));
    v.push(case("matmul_1x1", mm(false, false), &[&[1, 1], &[1, 1]]));
    v.push(case("matmul_mid", mm(false, false), &[&[130, 70], &[70, 260]]));
    v.push(case("matmul_big", mm(false, false), &[&[300, 64], &[64, 300]]));
    v.push(case("matmul_long_k", mm(true, false), &[&[3000, 64], &[3000, 20]]));
    v.push(case("matmul_kpar", mm(true, false), &[&[5000, 6], &[5000, 5]]));
    v.push(case("matmul_kpar_batch", mm(false, true), &[&[2, 3, 2100], &[2, 5, 2100]]));
    v.push(case("matmul_fold", mm(false, false), &[&[2, 32, 100], &[100, 10]]));
    v.push(case("matmul_batch", mm(false, true), &[&[3, 5, 7], &[3, 6, 7]]));
    v.push(case("matmul_bcast", mm(false, false), &[&[2, 1, 4, 5], &[3, 5, 6]]));
    v.push(case("matmul_bcast_t", mm(true, true), &[&[1, 3, 5, 4], &[2, 1, 6, 5]]));
    v.push(case("matmul_b_batch", mm(false, false), &[&[4, 5], &[3, 5, 6]]));
    v.push(case("matmul_k0", mm(false, false), &[&[3, 0], &[0, 4]]));
    // The fast GEMM's float4 loads (leading dimensions multiples of 4) and their fallbacks:
    // element loads where a leading dimension is not, element stores where N is not, edges
    // where M, N or K is not a multiple of the tile; transposed operands, broadcast batches.
    for (name, ta, tb, a, b) in [
        ("matmul_vec", false, false, vec![96, 64], vec![64, 136]),
        ("matmul_vec_ta", true, false, vec![64, 96], vec![64, 136]),
        ("matmul_vec_tb", false, true, vec![96, 64], vec![136, 64]),
        ("matmul_vec_ta_tb", true, true, vec![64, 96], vec![136, 64]),
        ("matmul_vec_k_odd", false, false, vec![96, 66], vec![66, 136]),
        ("matmul_vec_k_odd_tb", false, true, vec![96, 66], vec![136, 66]),
        ("matmul_vec_n_odd", false, false, vec![96, 64], vec![64, 130]),
        ("matmul_vec_m_odd_ta", true, false, vec![64, 98], vec![64, 136]),
        ("matmul_vec_m_edge", false, false, vec![93, 36], vec![36, 76]),
        ("matmul_vec_batch_bcast", false, false, vec![2, 1, 20, 12], vec![3, 12, 16]),
        ("matmul_vec_batch_bcast_t", true, true, vec![1, 3, 12, 20], vec![2, 1, 16, 12]),
        ("matmul_vec_batch_odd", false, false, vec![3, 5, 6], vec![3, 6, 7]),
        ("matmul_vec_m1", false, false, vec![1, 8], vec![8, 12]),
        ("matmul_vec_n1", false, false, vec![12, 8], vec![8, 1]),
        ("matmul_vec_k1", false, false, vec![12, 1], vec![1, 16]),
        ("matmul_vec_k1_t", true, true, vec![1, 12], vec![16, 1]),
        ("matmul_vec_k4", false, false, vec![5, 4], vec![4, 8]),
        ("matmul_vec_long_k", true, false, vec![600, 64], vec![600, 32]),
    ] {
        v.push(case(name, mm(ta, tb), &[&a, &b]));
    }
    // A product through an epilogue (bias add, then relu) with float4 operand loads.
    let bias_relu = Op::Fused(Fused {
        shape: Shape::from([40, 36]),
        insts: vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
        ],
        reduce: None,
        matmul: Some(FusedMatMul { transpose_a: false, transpose_b: false }),
        conv: None,
        epilogue: Vec::new(),
        epilogue_operands: 0,
    });
    v.push(case("matmul_vec_epilogue", bias_relu, &[&[40, 28], &[28, 36], &[36]]));
    // ---- layout
    v.push(case("fill_3x5", Op::Fill { value: 0.1, shape: Shape::from([3, 5]) }, &[]));
    v.push(case("fill_scalar", Op::Fill { value: -2.0, shape: Shape::scalar() }, &[]));
    v.push(case("fill_8", Op::Fill { value: f32::NEG_INFINITY, shape: Shape::from([8]) }, &[]));
    v.push(case("iota_3x5_0", Op::Iota { axis: 0, shape: Shape::from([3, 5]) }, &[]));
    v.push(case("iota_2x3x7_1", Op::Iota { axis: 1, shape: Shape::from([2, 3, 7]) }, &[]));
    v.push(case("iota_9_0", Op::Iota { axis: 0, shape: Shape::from([9]) }, &[]));
    v.push(case("copy_7", Op::Copy, &[&[7]]));
    v.push(case("copy_2x4", Op::Copy, &[&[2, 4]]));
    let perm = |p: &[usize]| Op::Permute { perm: p.to_vec() };
    v.push(case("permute_201", perm(&[2, 0, 1]), &[&[2, 3, 4]]));
    v.push(case("permute_10_tiled", perm(&[1, 0]), &[&[64, 48]]));
    v.push(case("permute_10_odd", perm(&[1, 0]), &[&[37, 53]]));
    v.push(case("permute_021_tiled", perm(&[0, 2, 1]), &[&[2, 40, 50]]));
    v.push(case("permute_nchw", perm(&[0, 3, 1, 2]), &[&[2, 5, 6, 3]]));
    v.push(case("permute_nhwc_tiled", perm(&[0, 2, 3, 1]), &[&[2, 20, 5, 6]]));
    v.push(case("permute_4d", perm(&[3, 1, 0, 2]), &[&[2, 3, 4, 5]]));
    v.push(case("permute_scalar", perm(&[]), &[&[]]));
    v.push(case("permute_identity", perm(&[0, 1]), &[&[3, 4]]));
    let bt = |s: &[usize]| Op::BroadcastTo { shape: Shape::from(s) };
    v.push(case("broadcast_3x1", bt(&[2, 3, 4]), &[&[3, 1]]));
    v.push(case("broadcast_scalar", bt(&[5]), &[&[]]));
    v.push(case("broadcast_row", bt(&[3, 4]), &[&[4]]));
    v.push(case("concat_0", Op::Concat { axis: 0 }, &[&[2, 3], &[4, 3]]));
    v.push(case("concat_1", Op::Concat { axis: 1 }, &[&[2, 3], &[2, 5], &[2, 1]]));
    v.push(case("concat_vec4", Op::Concat { axis: 1 }, &[&[2, 1, 4], &[2, 2, 4]]));
    v.push(case("concat_empty_part", Op::Concat { axis: 1 }, &[&[2, 0], &[2, 3]]));
    v.push(case("concat_single", Op::Concat { axis: 0 }, &[&[3]]));
    let many: Vec<&[usize]> = (0..40).map(|i| if i % 3 == 0 { &[3, 2][..] } else { &[3, 1][..] }).collect();
    v.push(case("concat_40", Op::Concat { axis: 1 }, &many));
    v.push(case("slice_1", Op::Slice { axis: 1, start: 2, len: 3 }, &[&[5, 6]]));
    v.push(case("slice_vec4", Op::Slice { axis: 1, start: 4, len: 4 }, &[&[4, 8]]));
    v.push(case("slice_0", Op::Slice { axis: 0, start: 1, len: 2 }, &[&[3, 4, 5]]));
    v.push(case("pad_1", Op::Pad { axis: 1, before: 2, after: 1 }, &[&[5, 6]]));
    v.push(case("pad_vec4", Op::Pad { axis: 1, before: 4, after: 4 }, &[&[2, 4]]));
    v.push(case("pad_after", Op::Pad { axis: 0, before: 0, after: 2 }, &[&[3, 2]]));
    v.push(case("pad_empty", Op::Pad { axis: 1, before: 1, after: 1 }, &[&[3, 0]]));
    // ---- reductions
    let reduces: Vec<(&[usize], Vec<usize>, bool)> = vec![
        (&[4, 5, 6], vec![1], true),
        (&[4, 5, 6], vec![0, 2], false),
        (&[32, 10], vec![1], false),
        (&[32, 10], vec![0], false),
        (&[1000, 3], vec![0], false),
        (&[3, 2000], vec![1], false),
        (&[20000], vec![0], false),
        (&[8, 4096], vec![0], true),
        // Kept innermost columns summed 32 at a time in registers, then the rest (45 = 32 + 13),
        // over several chunks of rows; a squeeze-and-excitation mean of NHWC over H and W.
        (&[300, 45], vec![0], false),
        (&[2, 30, 30, 72], vec![1, 2], true),
        (&[2, 3, 4, 5], vec![0, 2], true),
        (&[2, 3, 4, 5], vec![1, 3], false),
        (&[6, 1, 5], vec![1], false),
        (&[7], vec![], false),
        (&[5, 0], vec![1], false),
        (&[], vec![], false),
        (&[3, 4], vec![0, 1], false),
    ];
    for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
        for (i, (s, axes, keepdims)) in reduces.iter().enumerate() {
            let r = Op::Reduce { op, axes: axes.clone(), keepdims: *keepdims };
            v.push(case(format!("reduce_{op:?}_{i}"), r, &[s]));
        }
    }
    let soft: Vec<(&[usize], usize)> = vec![
        (&[4, 10], 1),
        (&[3, 5, 7], 1),
        (&[2, 3000], 1),
        (&[1, 20000], 1),
        (&[6, 1], 1),
        (&[5], 0),
        (&[4, 6], 0),
    ];
    for (i, (s, axis)) in soft.into_iter().enumerate() {
        v.push(case(format!("softmax_{i}"), Op::Softmax { axis }, &[s]).with(0, Data::Uniform(-8.0, 8.0)));
        v.push(
            case(format!("log_softmax_{i}"), Op::LogSoftmax { axis }, &[s]).with(0, Data::Uniform(-8.0, 8.0)),
        );
    }
    // ---- convolution
    let geoms: Vec<([usize; 4], Window2d, usize)> = vec![
        ([2, 7, 7, 3], win([3, 3], [1, 1], Padding::Same), 4),
        ([2, 7, 7, 3], win([3, 3], [2, 2], Padding::Same), 4),
        ([2, 8, 8, 3], win([3, 3], [2, 2], Padding::Same), 5),
        ([2, 7, 7, 3], win([3, 3], [1, 1], Padding::Valid), 4),
        ([1, 9, 8, 2], win([2, 3], [1, 2], Padding::Same), 3),
        ([1, 10, 11, 2], win([3, 2], [3, 3], Padding::Valid), 3),
        ([1, 10, 11, 2], win([3, 3], [3, 3], Padding::Same), 3),
        ([2, 5, 5, 4], win([1, 1], [1, 1], Padding::Valid), 6),
        ([1, 6, 6, 2], win([4, 4], [1, 1], Padding::Same), 2),
        ([4, 16, 16, 8], win([3, 3], [1, 1], Padding::Same), 16),
        ([8, 32, 32, 3], win([3, 3], [1, 1], Padding::Same), 4),
        ([4, 30, 30, 2], win([5, 5], [2, 2], Padding::Same), 3),
    ];
    for (i, (x, w, f)) in geoms.iter().enumerate() {
        let wshape = [w.size[0], w.size[1], x[3], *f];
        let out = infer(
            &Op::Conv2d { window: *w },
            &[(&Shape::from(*x), DType::F32), (&Shape::from(wshape), DType::F32)],
        )
        .unwrap()
        .0;
        let o = out.dims().to_vec();
        v.push(case(format!("conv2d_{i}"), Op::Conv2d { window: *w }, &[x, &wshape]));
        v.push(case(
            format!("conv2d_backprop_input_{i}"),
            Op::Conv2dBackpropInput { window: *w, input: Shape::from(*x) },
            &[&o, &wshape],
        ));
        v.push(case(
            format!("conv2d_backprop_filter_{i}"),
            Op::Conv2dBackpropFilter { window: *w },
            &[x, &o],
        ));
        v.push(case(
            format!("conv2d_backprop_input_relu_grad_{i}"),
            Op::Conv2dBackpropInputReluGrad { window: *w, input: Shape::from(*x) },
            &[&o, &wshape, x],
        ));
        v.push(case(
            format!("conv2d_backprop_input_residual_relu_grad_{i}"),
            Op::Conv2dBackpropInputReluGrad { window: *w, input: Shape::from(*x) },
            &[&o, &wshape, x, x],
        ));
        // Through epilogues (`Fused::conv`): bias and ReLU; bias, a residual of the output's
        // shape and tanh.
        let conv_then = |insts: Vec<Inst>| {
            Op::Fused(Fused {
                shape: out.clone(),
                insts,
                reduce: None,
                matmul: None,
                conv: Some(*w),
                epilogue: Vec::new(),
                epilogue_operands: 0,
            })
        };
        let bias_relu = conv_then(vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
        ]);
        v.push(case(format!("conv2d_bias_relu_{i}"), bias_relu, &[x, &wshape, &[*f]]));
        let residual = conv_then(vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Binary(BinaryOp::Add, Ref::Value(0), Ref::Operand(2)),
            Inst::Unary(UnaryOp::Tanh, Ref::Value(1)),
        ]);
        v.push(case(format!("conv2d_bias_residual_tanh_{i}"), residual, &[x, &wshape, &[*f], &o]));
    }
    // ---- pooling
    let pools: Vec<([usize; 4], Window2d)> = vec![
        ([2, 6, 6, 3], win([2, 2], [2, 2], Padding::Valid)),
        ([2, 7, 7, 3], win([2, 2], [2, 2], Padding::Valid)),
        ([1, 6, 6, 2], win([3, 3], [1, 1], Padding::Same)),
        ([1, 7, 7, 2], win([3, 3], [2, 2], Padding::Same)),
        ([2, 5, 8, 3], win([2, 3], [1, 2], Padding::Same)),
        ([1, 8, 8, 1], win([4, 4], [3, 3], Padding::Same)),
        // Windows that tile the input: max pooling's gradient a window per thread.
        ([2, 6, 8, 5], win([2, 2], [2, 2], Padding::Valid)),
        ([1, 6, 9, 3], win([3, 3], [3, 3], Padding::Same)),
    ];
    for (i, (x, w)) in pools.iter().enumerate() {
        for kind in [PoolKind::Max, PoolKind::Avg] {
            let p = Op::Pool2d { kind, window: *w };
            let out = infer(&p, &[(&Shape::from(*x), DType::F32)]).unwrap().0;
            let o = out.dims().to_vec();
            v.push(case(format!("pool_{kind:?}_{i}"), p, &[x]));
            let g = Op::Pool2dGrad { kind, window: *w };
            v.push(case(format!("pool_grad_{kind:?}_{i}"), g.clone(), &[x, &o]));
            v.push(case(format!("pool_grad_ties_{kind:?}_{i}"), g, &[x, &o]).with(0, Data::Ties));
            if kind == PoolKind::Avg {
                let from_dy = Op::AvgPool2dGrad { window: *w, input: Shape::from(*x) };
                v.push(case(format!("avg_pool_grad_from_dy_{i}"), from_dy, &[&o]));
            }
        }
    }
    // ---- embedding
    v.push(case("gather_vec4", Op::Gather, &[&[10, 4], &[3, 5]]).with(1, Data::Ids(10)));
    v.push(case("gather_row3", Op::Gather, &[&[7, 3], &[6]]).with(1, Data::Ids(7)));
    v.push(case("gather_1d", Op::Gather, &[&[5], &[2, 2]]).with(1, Data::Ids(5)));
    v.push(case("gather_3d", Op::Gather, &[&[6, 2, 3], &[4]]).with(1, Data::Ids(6)));
    v.push(
        case("gather_grad_vec4", Op::GatherGrad { vocab: 10 }, &[&[3, 5], &[3, 5, 4]]).with(0, Data::Ids(10)),
    );
    v.push(case("gather_grad_row3", Op::GatherGrad { vocab: 7 }, &[&[6], &[6, 3]]).with(0, Data::Ids(7)));
    v.push(case("gather_grad_repeat", Op::GatherGrad { vocab: 3 }, &[&[40], &[40, 2]]).with(0, Data::Ids(3)));
    // ---- optimizers
    let sgd = |lr, momentum, nesterov| Op::ApplySgd {
        lr,
        momentum,
        nesterov,
        rows: None,
        product: false,
        shard: None,
    };
    v.push(case("sgd_plain", sgd(0.01, 0.0, false), &[&[7], &[7]]));
    v.push(case("sgd_momentum", sgd(0.1, 0.9, false), &[&[3, 4], &[3, 4], &[3, 4]]));
    v.push(case("sgd_nesterov", sgd(0.05, 0.8, true), &[&[5], &[5], &[5]]));
    let adam = Op::ApplyAdam {
        lr: 0.001,
        beta1: 0.9,
        beta2: 0.999,
        epsilon: 1e-7,
        rows: None,
        product: false,
        shard: None,
    };
    v.push(
        case("adam", adam.clone(), &[&[5, 3], &[5, 3], &[5, 3], &[5, 3], &[]])
            .with(3, Data::Uniform(0.0, 1.0))
            .with(4, Data::Const(3.0)),
    );
    v.push(
        case("adam_first_step", adam.clone(), &[&[9], &[9], &[9], &[9], &[1]])
            .with(2, Data::Const(0.0))
            .with(3, Data::Const(0.0))
            .with(4, Data::Const(0.0)),
    );
    // ---- tiled updates: a block of rows of a weight gradient, and updates of a block of rows
    let rows = |start, len| Some(Rows { start, len });
    for (i, (a, b, start, len)) in
        [([7, 5], [7, 3], 0, 5), ([9, 11], [9, 6], 4, 3), ([33, 70], [33, 65], 61, 9)].into_iter().enumerate()
    {
        let op = Op::MatMulRows { rows: Rows { start, len } };
        v.push(case(format!("matmul_rows_{i}"), op, &[&a, &b]));
    }
    // Blocks of columns read as float4s (start and width multiples of 4), with a partial float4
    // at the block's edge (30 rows), and read element by element (start 6).
    for (name, start, len) in
        [("matmul_rows_vec", 8, 32), ("matmul_rows_vec_edge", 8, 30), ("matmul_rows_odd", 6, 30)]
    {
        v.push(case(name, Op::MatMulRows { rows: Rows { start, len } }, &[&[40, 72], &[40, 20]]));
    }
    let sgd_rows = |momentum, nesterov, r| Op::ApplySgd {
        lr: 0.05,
        momentum,
        nesterov,
        rows: r,
        product: false,
        shard: None,
    };
    v.push(case("sgd_rows", sgd_rows(0.0, false, rows(2, 3)), &[&[6, 4], &[3, 4]]));
    v.push(case("sgd_rows_momentum", sgd_rows(0.9, true, rows(1, 1)), &[&[3, 2, 2], &[1, 2, 2], &[3, 2, 2]]));
    v.push(
        case(
            "adam_rows",
            Op::ApplyAdam {
                lr: 0.01,
                beta1: 0.9,
                beta2: 0.999,
                epsilon: 1e-7,
                rows: rows(5, 4),
                product: false,
                shard: None,
            },
            &[&[9, 3], &[4, 3], &[9, 3], &[9, 3], &[]],
        )
        .with(3, Data::Uniform(0.0, 1.0))
        .with(4, Data::Const(2.0)),
    );
    // ---- ZeRO shards: a rank's range of the variable, its state the padded shard, its
    // gradient the shard's or the whole variable's (35 elements over 3 ranks: 12, 12, 11; 9
    // over 4: 3, 2, 2, 2)
    let shard = |op: Op, ranks, rank| match op {
        Op::ApplySgd { lr, momentum, nesterov, .. } => Op::ApplySgd {
            lr,
            momentum,
            nesterov,
            rows: None,
            product: false,
            shard: Some(Shard { ranks, rank }),
        },
        Op::ApplyAdam { lr, beta1, beta2, epsilon, .. } => Op::ApplyAdam {
            lr,
            beta1,
            beta2,
            epsilon,
            rows: None,
            product: false,
            shard: Some(Shard { ranks, rank }),
        },
        other => other,
    };
    v.push(case("sgd_shard_whole_grad", shard(sgd(0.1, 0.9, false), 3, 1), &[&[7, 5], &[7, 5], &[12]]));
    v.push(case("sgd_shard_own_grad", shard(sgd(0.05, 0.8, true), 3, 2), &[&[7, 5], &[12], &[12]]));
    v.push(case("sgd_shard_plain", shard(sgd(0.01, 0.0, false), 3, 2), &[&[35], &[12]]));
    for (name, rank, grad) in
        [("adam_shard_last", 3, 9), ("adam_shard_first", 0, 3), ("adam_shard_own", 1, 3)]
    {
        v.push(
            case(name, shard(adam.clone(), 4, rank), &[&[9], &[grad], &[3], &[3], &[]])
                .with(3, Data::Uniform(0.0, 1.0))
                .with(4, Data::Const(3.0)),
        );
    }
    // ---- product updates: the gradient aᵀ·b made by the update's own GEMM (tiled and
    // K-parallel shapes, one tile and many, SGD plain / momentum / Nesterov and Adam)
    let product = |op: Op| op.update_in(None, kiln_compiler::ir::Grad::Product);
    v.push(case("sgd_product", product(sgd(0.01, 0.0, false)), &[&[5, 3], &[7, 5], &[7, 3]]));
    v.push(case(
        "sgd_product_momentum",
        product(sgd(0.1, 0.9, false)),
        &[&[33, 17], &[40, 33], &[40, 17], &[33, 17]],
    ));
    v.push(case(
        "sgd_product_nesterov",
        product(sgd(0.05, 0.8, true)),
        &[&[4, 70], &[2, 4], &[2, 70], &[4, 70]],
    ));
    // Both factors read as float4s (R and C multiples of 4), the products stay per element.
    v.push(case(
        "sgd_product_vec",
        product(sgd(0.1, 0.9, false)),
        &[&[36, 20], &[40, 36], &[40, 20], &[36, 20]],
    ));
    let adam_product = product(adam.clone());
    for (i, (m, r, c)) in [(32, 100, 10), (3, 130, 70), (1500, 6, 5)].into_iter().enumerate() {
        v.push(
            case(
                format!("adam_product_{i}"),
                adam_product.clone(),
                &[&[r, c], &[m, r], &[m, c], &[r, c], &[r, c], &[]],
            )
            .with(4, Data::Uniform(0.0, 1.0))
            .with(5, Data::Const(3.0)),
        );
    }
    v.extend(split_cases(&adam_product));
    v.push(case("assign_add_counter", Op::AssignAdd { value: 1.0 }, &[&[1]]));
    for (i, (shape, step)) in
        [(vec![7usize], 0.0f32), (vec![5, 8], 3.0), (vec![2, 3, 4], 1e9), (vec![9], -2.0)]
            .into_iter()
            .enumerate()
    {
        let op = Op::RandomUniform { shape: Shape::from(shape.as_slice()), seed: 17 + i as u64 };
        v.push(case(format!("random_uniform_{i}"), op, &[&[]]).with(0, Data::Const(step)));
    }
    v.push(case("assign_add_10", Op::AssignAdd { value: -0.25 }, &[&[10]]));
    // ---- loss scaling: updates gated by a finite unscale factor or skipped by one that is not
    for (tag, gate) in [("finite", 0.25f32), ("nan", f32::NAN), ("inf", f32::INFINITY)] {
        v.push(
            case(format!("sgd_gated_{tag}"), sgd(0.01, 0.0, false), &[&[7], &[7], &[]])
                .with(2, Data::Const(gate)),
        );
        v.push(
            case(
                format!("sgd_momentum_gated_{tag}"),
                sgd(0.1, 0.9, true),
                &[&[3, 4], &[3, 4], &[3, 4], &[1]],
            )
            .with(3, Data::Const(gate)),
        );
        v.push(
            case(format!("adam_gated_{tag}"), adam.clone(), &[&[5, 3], &[5, 3], &[5, 3], &[5, 3], &[], &[]])
                .with(3, Data::Uniform(0.0, 1.0))
                .with(4, Data::Const(3.0))
                .with(5, Data::Const(gate)),
        );
        v.push(
            case(format!("assign_add_gated_{tag}"), Op::AssignAdd { value: 1.0 }, &[&[], &[]])
                .with(1, Data::Const(gate)),
        );
    }
    let update_scale = Op::UpdateLossScale { growth: 2.0, backoff: 0.5, interval: 2000 };
    for (tag, good, gate) in
        [("grows", 1999.0f32, 1.0 / 65536.0), ("counts", 5.0, 0.5), ("backs_off", 5.0, f32::NAN)]
    {
        v.push(
            case(format!("update_loss_scale_{tag}"), update_scale.clone(), &[&[], &[], &[]])
                .with(0, Data::Const(65536.0))
                .with(1, Data::Const(good))
                .with(2, Data::Const(gate)),
        );
    }
    // ---- empty outputs
    v.push(case("empty_unary", Op::Unary(UnaryOp::Exp), &[&[0, 3]]));
    v.push(case("empty_matmul", mm(false, false), &[&[0, 3], &[3, 4]]));
    v
}

/// Long contractions into few outputs, generated with the scratch they ask for: split-K across
/// blocks (a partial kernel, then the sum in split order through the product's sink). Small
/// enough to run on the host; `split_k_is_chosen_for_long_contractions` checks they split.
fn split_cases(adam_product: &Op) -> Vec<Case> {
    let mut v = Vec::new();
    let mm = |ta, tb| Op::MatMul { transpose_a: ta, transpose_b: tb };
    // A weight gradient over many rows; K not a multiple of any chunk; a batch of them.
    v.push(case("split_matmul_t", mm(true, false), &[&[1536, 20], &[1536, 12]]).split());
    v.push(case("split_matmul_odd_k", mm(true, true), &[&[1999, 9], &[5, 1999]]).split());
    v.push(case("split_matmul_batched", mm(true, false), &[&[3, 1024, 8], &[3, 1024, 6]]).split());
    v.push(case("split_matmul_plain", mm(false, false), &[&[6, 3000], &[3000, 7]]).split());
    // A filter gradient: 3x3 over 4x16x16 positions.
    let w = win([3, 3], [1, 1], Padding::Same);
    v.push(
        case(
            "split_conv2d_backprop_filter",
            Op::Conv2dBackpropFilter { window: w },
            &[&[4, 16, 16, 3], &[4, 16, 16, 8]],
        )
        .split(),
    );
    // Through an epilogue: relu(aᵀ·b + bias).
    let f = Fused {
        shape: Shape::from([16, 10]),
        insts: vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
        ],
        reduce: None,
        matmul: Some(FusedMatMul { transpose_a: true, transpose_b: false }),
        conv: None,
        epilogue: Vec::new(),
        epilogue_operands: 0,
    };
    v.push(case("split_fused_matmul", Op::Fused(f), &[&[2048, 16], &[2048, 10], &[10]]).split());
    // A convolution of few outputs over a long K through an epilogue: relu(conv + bias).
    let f = Fused {
        shape: Shape::from([1, 4, 4, 3]),
        insts: vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
        ],
        reduce: None,
        matmul: None,
        conv: Some(w),
        epilogue: Vec::new(),
        epilogue_operands: 0,
    };
    let split_conv =
        case("split_fused_conv2d", Op::Fused(f), &[&[1, 4, 4, 256], &[3, 3, 256, 3], &[3]]).split();
    assert!(split_conv.scratch_bytes() > 0, "the case splits K");
    v.push(split_conv);
    // Column reductions into few outputs: the reduced extent split across blocks.
    let red = |op, axes: &[usize]| Op::Reduce { op, axes: axes.to_vec(), keepdims: false };
    v.push(case("split_reduce_sum", red(ReduceOp::Sum, &[0]), &[&[8192, 20]]).split());
    v.push(
        case("split_reduce_max", red(ReduceOp::Max, &[0, 1]), &[&[4, 4096, 5]]).with(0, Data::Ties).split(),
    );
    v.push(case("split_reduce_mean", red(ReduceOp::Mean, &[0]), &[&[3000, 3, 7]]).split());
    // A fused bias gradient with an epilogue: relu(sum over rows of x * y) * z.
    let f = Fused {
        shape: Shape::from([4096, 33]),
        insts: vec![Inst::Binary(BinaryOp::Mul, Ref::Operand(0), Ref::Operand(1))],
        reduce: Some(FusedReduce { op: ReduceOp::Sum, axes: vec![0], keepdims: false }),
        matmul: None,
        conv: None,
        epilogue: vec![
            Inst::Unary(UnaryOp::Relu, Ref::Operand(0)),
            Inst::Binary(BinaryOp::Mul, Ref::Value(0), Ref::Operand(1)),
        ],
        epilogue_operands: 1,
    };
    v.push(case("split_fused_reduce", Op::Fused(f), &[&[4096, 33], &[4096, 1], &[33]]).split());
    // An update that computes its own gradient: Adam's arithmetic in the sum's kernel.
    v.push(
        case(
            "split_adam_product",
            adam_product.clone(),
            &[&[12, 10], &[2048, 12], &[2048, 10], &[12, 10], &[12, 10], &[]],
        )
        .with(4, Data::Uniform(0.0, 1.0))
        .with(5, Data::Const(3.0))
        .split(),
    );
    v
}

#[test]
fn split_k_is_chosen_for_long_contractions() {
    let cases = split_cases(
        &Op::ApplyAdam {
            lr: 0.001,
            beta1: 0.9,
            beta2: 0.999,
            epsilon: 1e-7,
            rows: None,
            product: false,
            shard: None,
        }
        .update_in(None, kiln_compiler::ir::Grad::Product),
    );
    for c in cases {
        let k = c.generate();
        assert!(c.scratch_bytes() > 0, "{}: no scratch asked for", c.name);
        assert_eq!(k.launches.len(), 2, "{}: {}", c.name, k.describe);
        assert!(k.launches[0].args.contains(&Arg::Scratch) && k.launches[1].args[0] == Arg::Scratch);
        assert!(k.describe.contains("across"), "{}", k.describe);
        let threads: u32 =
            k.launches.iter().map(|l| l.grid.iter().product::<u32>() * l.block.iter().product::<u32>()).sum();
        assert!(threads <= 1 << 15, "{}: {threads} threads, too many to run on the host", c.name);
        // Without scratch, the same op runs in one launch and never names any.
        let plain = Case { scratch: false, ..c }.generate();
        assert!(plain.launches.iter().all(|l| !l.args.contains(&Arg::Scratch)));
    }
}

/// Random geometries (fixed seed): convolutions, pooling, reductions, permutes, broadcasts,
/// softmax, matmul and the row ops, each valid under `infer`.
fn random_cases() -> Vec<Case> {
    let mut r = Rng(0x5EED_CAFE_F00D_1234);
    let mut v = Vec::new();
    let valid = |op: &Op, shapes: &[Vec<usize>]| {
        let s: Vec<Shape> = shapes.iter().map(|d| Shape::from(d.as_slice())).collect();
        let ops: Vec<(&Shape, DType)> = s.iter().map(|x| (x, DType::F32)).collect();
        infer(op, &ops).ok().map(|o| o.0.dims().to_vec())
    };
    let push = |v: &mut Vec<Case>, name: String, op: Op, shapes: &[Vec<usize>]| {
        let refs: Vec<&[usize]> = shapes.iter().map(|d| d.as_slice()).collect();
        v.push(case(name, op, &refs));
    };
    let mut convs = 0;
    while convs < 40 {
        let x = vec![1 + r.pick(3), 1 + r.pick(12), 1 + r.pick(12), 1 + r.pick(5)];
        let w = win(
            [1 + r.pick(5), 1 + r.pick(5)],
            [1 + r.pick(3), 1 + r.pick(3)],
            if r.pick(2) == 0 { Padding::Same } else { Padding::Valid },
        );
        let ws = vec![w.size[0], w.size[1], x[3], 1 + r.pick(5)];
        let Some(o) = valid(&Op::Conv2d { window: w }, &[x.clone(), ws.clone()]) else { continue };
        let i = convs;
        push(&mut v, format!("rand_conv2d_{i}"), Op::Conv2d { window: w }, &[x.clone(), ws.clone()]);
        let bi = Op::Conv2dBackpropInput { window: w, input: Shape::from(x.as_slice()) };
        push(&mut v, format!("rand_conv2d_backprop_input_{i}"), bi, &[o.clone(), ws]);
        let bf = Op::Conv2dBackpropFilter { window: w };
        push(&mut v, format!("rand_conv2d_backprop_filter_{i}"), bf, &[x, o]);
        convs += 1;
    }
    let mut pools = 0;
    while pools < 20 {
        let x = vec![1 + r.pick(2), 1 + r.pick(10), 1 + r.pick(10), 1 + r.pick(4)];
        let w = win(
            [1 + r.pick(4), 1 + r.pick(4)],
            [1 + r.pick(3), 1 + r.pick(3)],
            if r.pick(2) == 0 { Padding::Same } else { Padding::Valid },
        );
        let kind = if r.pick(2) == 0 { PoolKind::Max } else { PoolKind::Avg };
        let Some(o) = valid(&Op::Pool2d { kind, window: w }, std::slice::from_ref(&x)) else { continue };
        let i = pools;
        push(&mut v, format!("rand_pool_{i}"), Op::Pool2d { kind, window: w }, std::slice::from_ref(&x));
        let g = Op::Pool2dGrad { kind, window: w };
        let mut c = case(format!("rand_pool_grad_{i}"), g, &[&x, &o]);
        if r.pick(2) == 0 {
            c = c.with(0, Data::Ties);
        }
        v.push(c);
        pools += 1;
    }
    for i in 0..30 {
        let rank = r.pick(5);
        let dims: Vec<usize> = (0..rank).map(|_| 1 + r.pick(6)).collect();
        let axes: Vec<usize> = (0..rank).filter(|_| r.pick(2) == 0).collect();
        let op = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max][r.pick(3)];
        push(&mut v, format!("rand_reduce_{i}"), Op::Reduce { op, axes, keepdims: r.pick(2) == 0 }, &[dims]);
    }
    for i in 0..20 {
        let rank = 1 + r.pick(4);
        let dims: Vec<usize> =
            (0..rank).map(|_| if r.pick(3) == 0 { 16 + r.pick(25) } else { 1 + r.pick(5) }).collect();
        let mut perm: Vec<usize> = (0..rank).collect();
        for j in (1..rank).rev() {
            perm.swap(j, r.pick(j + 1));
        }
        push(&mut v, format!("rand_permute_{i}"), Op::Permute { perm }, &[dims]);
    }
    for i in 0..30 {
        let rank = r.pick(5);
        let out: Vec<usize> = (0..rank).map(|_| 1 + r.pick(5)).collect();
        let (a, b) = (r.operand(&out), r.operand(&out));
        let op = Op::Binary([BinaryOp::Add, BinaryOp::Mul, BinaryOp::Sub, BinaryOp::Maximum][r.pick(4)]);
        if valid(&op, &[a.clone(), b.clone()]).is_some() {
            push(&mut v, format!("rand_binary_{i}"), op, &[a, b]);
        }
        let c = r.operand(&out);
        if valid(&Op::Select, &[c.clone(), out.clone(), out.clone()]).is_some() {
            push(&mut v, format!("rand_select_{i}"), Op::Select, &[c, out.clone(), out.clone()]);
        }
        if !out.is_empty() {
            let src = r.operand(&out);
            let op = Op::BroadcastTo { shape: Shape::from(out.as_slice()) };
            push(&mut v, format!("rand_broadcast_{i}"), op, &[src]);
        }
    }
    for i in 0..12 {
        let rank = 1 + r.pick(3);
        let dims: Vec<usize> = (0..rank).map(|_| 1 + r.pick(40)).collect();
        let axis = r.pick(rank);
        let op = if r.pick(2) == 0 { Op::Softmax { axis } } else { Op::LogSoftmax { axis } };
        push(&mut v, format!("rand_softmax_{i}"), op, &[dims]);
    }
    for i in 0..16 {
        let (m, n, k) = (1 + r.pick(70), 1 + r.pick(70), 1 + r.pick(70));
        let (ta, tb) = (r.pick(2) == 0, r.pick(2) == 0);
        let batch: Vec<usize> = (0..r.pick(3)).map(|_| 1 + r.pick(3)).collect();
        let bcast = |b: &[usize], drop: usize| -> Vec<usize> { b[drop.min(b.len())..].to_vec() };
        let mut a = bcast(&batch, r.pick(2));
        let mut bb = bcast(&batch, r.pick(2));
        if !a.is_empty() && r.pick(2) == 0 {
            a[0] = 1;
        }
        a.extend(if ta { [k, m] } else { [m, k] });
        bb.extend(if tb { [n, k] } else { [k, n] });
        let op = Op::MatMul { transpose_a: ta, transpose_b: tb };
        if valid(&op, &[a.clone(), bb.clone()]).is_some() {
            push(&mut v, format!("rand_matmul_{i}"), op, &[a, bb]);
        }
    }
    for i in 0..12 {
        let rank = 1 + r.pick(3);
        let dims: Vec<usize> = (0..rank).map(|_| 1 + r.pick(6)).collect();
        let axis = r.pick(rank);
        let mut other = dims.clone();
        other[axis] = r.pick(4);
        push(&mut v, format!("rand_concat_{i}"), Op::Concat { axis }, &[dims.clone(), other]);
        let start = r.pick(dims[axis]);
        let len = 1 + r.pick(dims[axis] - start);
        push(&mut v, format!("rand_slice_{i}"), Op::Slice { axis, start, len }, std::slice::from_ref(&dims));
        let pad = Op::Pad { axis, before: r.pick(3), after: r.pick(3) };
        push(&mut v, format!("rand_pad_{i}"), pad, &[dims]);
    }
    for i in 0..80 {
        let (op, shapes) = random_fused(&mut r);
        push(&mut v, format!("rand_fused_{i}"), op, &shapes);
    }
    v
}

/// A random fused elementwise program (`ir::fused`) over 1 to 4 operands that broadcast to its
/// shape, with 1 to 12 instructions, every operand read, half of them reduced.
fn random_fused(r: &mut Rng) -> (Op, Vec<Vec<usize>>) {
    let rank = 1 + r.pick(3);
    let out: Vec<usize> = (0..rank).map(|_| 1 + r.pick(7)).collect();
    let k = 1 + r.pick(4);
    let shapes: Vec<Vec<usize>> = (0..k).map(|_| r.operand(&out)).collect();
    let insts = random_program(r, k, rank);
    // Half of them reduce their values: a reduction with an elementwise prologue.
    let reduce = (r.pick(2) == 0).then(|| {
        let mut axes: Vec<usize> = (0..rank).filter(|_| r.pick(2) == 0).collect();
        if axes.is_empty() {
            axes.push(rank - 1);
        }
        let op = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max][r.pick(3)];
        FusedReduce { op, axes, keepdims: r.pick(2) == 0 }
    });
    let mut op = Fused {
        shape: Shape::from(out.as_slice()),
        insts,
        reduce,
        matmul: None,
        conv: None,
        epilogue: Vec::new(),
        epilogue_operands: 0,
    };
    let mut shapes = shapes;
    // Half of the reductions over an axis longer than 1 go on through an epilogue.
    if let Some(red) = &op.reduce
        && red.axes.iter().any(|&a| out[a] > 1)
        && r.pick(2) == 0
    {
        let reduced = infer(&red.op(), &[(&op.shape, DType::F32)]).unwrap().0;
        let extra = r.pick(3);
        op.epilogue = random_program(r, extra + 1, reduced.rank());
        op.epilogue_operands = extra;
        shapes.extend((0..extra).map(|_| r.operand(reduced.dims())));
    }
    // A quarter without a reduction compute operand 0 as a product first (a matmul epilogue).
    if op.reduce.is_none() && rank >= 2 && r.pick(2) == 0 {
        let (m, n) = (out[rank - 2], out[rank - 1]);
        let k = 1 + r.pick(40);
        let (ta, tb) = (r.pick(2) == 0, r.pick(2) == 0);
        let mut a: Vec<usize> = out[..rank - 2].to_vec();
        a.extend(if ta { [k, m] } else { [m, k] });
        let b: Vec<usize> = if tb { vec![n, k] } else { vec![k, n] };
        op.matmul = Some(FusedMatMul { transpose_a: ta, transpose_b: tb });
        // A product's epilogue has no iota (`Fused::check`): constants instead.
        // A random value's step ref stays read (every operand is).
        for inst in &mut op.insts {
            *inst = match *inst {
                Inst::Uniform(_, step) => Inst::Scalar(ScalarOp::Mul, 0.5, step),
                Inst::Iota(_) => Inst::Const(0.5),
                other => other,
            };
        }
        shapes.splice(0..1, [a, b]);
    }
    (Op::Fused(op), shapes)
}

/// 1 to 12 random elementwise instructions over `k` operands, every operand read; over a
/// program of rank `rank` > 0 some are iotas along its axes and constants (fused sources).
fn random_program(r: &mut Rng, k: usize, rank: usize) -> Vec<Inst> {
    let unary = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::Square,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
    ];
    let binary = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Maximum,
        BinaryOp::Greater,
        BinaryOp::ReluGrad,
        BinaryOp::SigmoidGrad,
        BinaryOp::TanhGrad,
        BinaryOp::GeluGrad,
        BinaryOp::GeluTanhGrad,
    ];
    let mut insts: Vec<Inst> = Vec::new();
    let pick_ref = |r: &mut Rng, n: usize| {
        let j = r.pick(k + n);
        if j < k { Ref::Operand(j as u32) } else { Ref::Value((j - k) as u32) }
    };
    for _ in 0..1 + r.pick(8) {
        let n = insts.len();
        let (a, b, c) = (pick_ref(r, n), pick_ref(r, n), pick_ref(r, n));
        // Mixed precision's rounding inside a program (`Inst::Cast`).
        if r.pick(6) == 0 {
            insts.push(Inst::Cast(if r.pick(2) == 0 { DType::BF16 } else { DType::F16 }, a));
            continue;
        }
        insts.push(match r.pick(if rank > 0 { 6 } else { 4 }) {
            4 if r.pick(2) == 0 => Inst::Uniform(r.pick(1000) as u64, a),
            4 => Inst::Iota(r.pick(rank) as u32),
            5 => Inst::Const(-1.0 + r.pick(5) as f32 * 0.75),
            0 => Inst::Unary(unary[r.pick(unary.len())], a),
            1 => Inst::Binary(binary[r.pick(binary.len())], a, b),
            2 => Inst::Scalar(
                if r.pick(2) == 0 { ScalarOp::Add } else { ScalarOp::Mul },
                -1.5 + r.pick(7) as f32 * 0.5,
                a,
            ),
            _ => Inst::Select(a, b, c),
        });
    }
    for j in 0..k {
        let read = insts.iter().flat_map(|i| i.refs()).any(|x| x == Ref::Operand(j as u32));
        if !read {
            let last = Ref::Value(insts.len() as u32 - 1);
            insts.push(Inst::Binary(BinaryOp::Add, last, Ref::Operand(j as u32)));
        }
    }
    // Stored as f32, as the operands are: a last rounding to half is read back exactly.
    if let Some(&Inst::Cast(_, _)) = insts.last() {
        insts.push(Inst::Cast(DType::F32, Ref::Value(insts.len() as u32 - 1)));
    }
    insts
}

/// Cases too large to run on the CPU: generated and compiled only (64-bit indices, big grids).
fn large_cases() -> Vec<Case> {
    let big = 1usize << 31;
    vec![
        case("large_unary", Op::Unary(UnaryOp::Relu), &[&[big + 3]]),
        case("large_binary", Op::Binary(BinaryOp::Add), &[&[1 << 16, 1 << 15], &[1 << 15]]),
        case(
            "large_reduce_rows",
            Op::Reduce { op: ReduceOp::Sum, axes: vec![1], keepdims: false },
            &[&[1 << 16, 1 << 15]],
        ),
        case(
            "large_reduce_cols",
            Op::Reduce { op: ReduceOp::Max, axes: vec![0], keepdims: false },
            &[&[1 << 16, 1 << 15]],
        ),
        case("large_softmax", Op::Softmax { axis: 1 }, &[&[1 << 16, 1 << 15]]),
        case("large_permute", Op::Permute { perm: vec![1, 0] }, &[&[1 << 16, 1 << 15]]),
        case("large_gather", Op::Gather, &[&[1 << 16, 1 << 15], &[64]]),
        case(
            "large_matmul",
            Op::MatMul { transpose_a: false, transpose_b: false },
            &[&[1 << 16, 1 << 15], &[1 << 15, 64]],
        ),
        case("large_concat", Op::Concat { axis: 0 }, &[&[1 << 30], &[1 << 30]]),
        case(
            "large_conv",
            Op::Conv2d { window: win([3, 3], [1, 1], Padding::Same) },
            &[&[64, 256, 256, 256], &[3, 3, 256, 8]],
        ),
        case(
            "large_adam",
            Op::ApplyAdam {
                lr: 0.1,
                beta1: 0.9,
                beta2: 0.99,
                epsilon: 1e-8,
                rows: None,
                product: false,
                shard: None,
            },
            &[&[big], &[big], &[big], &[big], &[]],
        ),
    ]
}

/// Convolutions over non-dense windows (`cuda::grouped_conv`: groups, depthwise, dilation,
/// asymmetric explicit pads), every op of each: generated and checked here; their values are
/// compared with a scalar reference on the host by `cuda_grouped_conv.rs`.
fn non_dense_cases() -> Vec<Case> {
    let mut v = Vec::new();
    let explicit = Padding::Explicit { before: [1, 0], after: [0, 2] };
    let geoms: Vec<([usize; 4], Window2d, usize)> = vec![
        ([2, 7, 7, 4], win([3, 3], [1, 1], Padding::Same).grouped(4), 8),
        ([2, 6, 7, 12], win([3, 3], [2, 2], explicit).grouped(3), 6),
        ([1, 9, 9, 3], win([3, 3], [1, 1], Padding::Valid).dilated([2, 2]), 5),
        ([2, 9, 8, 8], win([3, 2], [2, 1], Padding::Same).dilated([2, 3]).grouped(2), 4),
    ];
    for (i, (x, w, f)) in geoms.iter().enumerate() {
        let wshape = [w.size[0], w.size[1], x[3] / w.groups, *f];
        let out = infer(
            &Op::Conv2d { window: *w },
            &[(&Shape::from(*x), DType::F32), (&Shape::from(wshape), DType::F32)],
        )
        .unwrap()
        .0;
        let o = out.dims().to_vec();
        let input = Shape::from(*x);
        v.push(case(format!("non_dense_conv2d_{i}"), Op::Conv2d { window: *w }, &[x, &wshape]));
        let bi = Op::Conv2dBackpropInput { window: *w, input: input.clone() };
        v.push(case(format!("non_dense_conv2d_backprop_input_{i}"), bi, &[&o, &wshape]));
        let bf = Op::Conv2dBackpropFilter { window: *w };
        v.push(case(format!("non_dense_conv2d_backprop_filter_{i}"), bf, &[x, &o]));
        let rg = Op::Conv2dBackpropInputReluGrad { window: *w, input };
        v.push(case(format!("non_dense_conv2d_backprop_input_relu_grad_{i}"), rg.clone(), &[&o, &wshape, x]));
        v.push(case(
            format!("non_dense_conv2d_backprop_input_residual_relu_grad_{i}"),
            rg,
            &[&o, &wshape, x, x],
        ));
        let fused = Op::Fused(Fused {
            shape: out.clone(),
            insts: vec![
                Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
                Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
            ],
            reduce: None,
            matmul: None,
            conv: Some(*w),
            epilogue: Vec::new(),
            epilogue_operands: 0,
        });
        v.push(case(format!("non_dense_conv2d_bias_relu_{i}"), fused, &[x, &wshape, &[*f]]));
    }
    for c in &mut v {
        // No scratch: `split` asks for what the kernel wants, which is none.
        assert_eq!(c.scratch_bytes(), 0, "{}", c.name);
        c.scratch = true;
    }
    v
}

/// The products `kiln bench-gemm` measures (M x K x N: 4096³ and the zoo's): generated and
/// compiled only (and dumped, for register checks with ptxas).
fn bench_cases() -> Vec<Case> {
    let shapes = [
        (4096, 4096, 4096),
        (256, 784, 1024),
        (256, 1024, 1024),
        (256, 1024, 10),
        (64, 4096, 128),
        (1024, 256, 256),
        (1024, 256, 1024),
        (1024, 1024, 256),
        (1024, 256, 1000),
    ];
    shapes
        .into_iter()
        .map(|(m, k, n)| {
            case(
                format!("bench_matmul_{m}x{k}x{n}"),
                Op::MatMul { transpose_a: false, transpose_b: false },
                &[&[m, k], &[k, n]],
            )
        })
        .collect()
}

/// (name, pointer parameter count) of every kernel function the source defines.
fn functions(src: &str) -> Vec<(String, usize)> {
    let key = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(i) = rest.find(key) {
        let mut s = &rest[i + key.len()..];
        if let Some(t) = s.strip_prefix("__launch_bounds__(") {
            s = t[t.find(')').expect("closing parenthesis") + 1..].trim_start();
        }
        let open = s.find('(').expect("parameter list");
        let close = open + s[open..].find(')').expect("end of parameter list");
        let list = &s[open + 1..close];
        let params: Vec<&str> = list.split(',').map(str::trim).filter(|p| !p.is_empty()).collect();
        for p in &params {
            // f32 tensors; a reduction's scratch holds f64 partial sums.
            let pointer = p.contains("float*") || p.contains("double* __restrict__ part");
            assert!(pointer, "parameter `{p}` of {} is not a float pointer", &s[..open]);
        }
        out.push((s[..open].trim().to_string(), params.len()));
        rest = &s[close..];
    }
    out
}

/// Checks the structure of one generated kernel.
fn check(c: &Case, k: &CudaKernel) {
    let name = &c.name;
    assert!(k.source.starts_with("// kiln: "), "{name}: no header line");
    assert!(!k.source.contains("#include"), "{name}: sources are standalone");
    assert!(!k.describe.is_empty());
    let defined: BTreeMap<String, usize> = functions(&k.source).into_iter().collect();
    let effect = c.op.is_effect();
    let out = c.output();
    let written = if effect { c.shapes[0].numel() } else { out.numel() };
    assert_eq!(k.launches.is_empty(), written == 0, "{name}: launches iff something is written");
    let mut writes_output = false;
    for l in &k.launches {
        let params =
            defined.get(&l.function).unwrap_or_else(|| panic!("{name}: `{}` is not defined", l.function));
        assert_eq!(*params, l.args.len(), "{name}: `{}` parameters vs arguments", l.function);
        for a in &l.args {
            match a {
                Arg::Input(i) => assert!(*i < c.shapes.len(), "{name}: operand {i} does not exist"),
                Arg::Output => writes_output = true,
                Arg::Scratch => assert!(c.scratch_bytes() > 0, "{name}: scratch it was not given"),
            }
        }
        let threads: u32 = l.block.iter().product();
        assert!((32..=1024).contains(&threads) && threads.is_multiple_of(32), "{name}: block {:?}", l.block);
        assert!(l.block[2] <= 64);
        assert!(l.grid.iter().all(|&g| g >= 1), "{name}: empty grid {:?}", l.grid);
        assert!(
            l.grid[0] <= i32::MAX as u32 && l.grid[1] <= 65535 && l.grid[2] <= 65535,
            "{name}: grid {:?}",
            l.grid
        );
        assert_eq!(l.shared_bytes, 0, "{name}: static shared memory only");
    }
    if !k.launches.is_empty() {
        assert_eq!(writes_output, !effect, "{name}: the output argument");
    }
    if c.op.class() == kiln_compiler::ir::OpClass::Elementwise {
        assert!(!k.source.contains("__restrict__"), "{name}: elementwise kernels may run in place");
    }
    // Shared arrays within 48 KiB.
    for decl in k.source.lines().filter_map(|l| l.trim().strip_prefix("__shared__ ")) {
        let size = if decl.starts_with("double") { 8 } else { 4 };
        let elems: usize = decl
            .split('[')
            .skip(1)
            .map(|d| d[..d.find(']').expect("array extent")].parse::<usize>().expect("literal extent"))
            .product();
        assert!(elems * size <= 48 * 1024, "{name}: shared array `{decl}`");
    }
    // One thread per element: the grid covers the elements (per float4 where vectorised).
    let per_element = matches!(
        c.op,
        Op::Unary(_)
            | Op::Binary(_)
            | Op::Scalar { .. }
            | Op::Select
            | Op::Fill { .. }
            | Op::Iota { .. }
            | Op::Copy
            | Op::Pool2d { .. }
    ) || matches!(
        c.op,
        Op::Pool2dGrad { .. } | Op::BroadcastTo { .. } | Op::Slice { .. } | Op::Pad { .. }
    );
    if per_element && written > 0 {
        let l = &k.launches[0];
        let threads = l.grid[0] as usize * l.block[0] as usize;
        let vector = if k.describe.contains("float4") { 4 } else { 1 };
        // Max pooling's gradient where the windows tile x: a thread per window.
        let per = match &c.op {
            Op::Pool2dGrad { window, .. } if k.describe.contains("a window per thread") => {
                window.size[0] * window.size[1]
            }
            _ => vector,
        };
        let need = written.div_ceil(per).min(65536 * 256);
        assert!(threads >= need, "{name}: {threads} threads for {need} elements");
    }
}

#[test]
fn every_op_generates_valid_launches() {
    let all = cases();
    let mut names = std::collections::HashSet::new();
    for c in all
        .iter()
        .chain(&random_cases())
        .chain(&large_cases())
        .chain(&bench_cases())
        .chain(&non_dense_cases())
    {
        assert!(names.insert(c.name.clone()), "duplicate case {}", c.name);
        let k = c.generate();
        check(c, &k);
        assert_eq!(k, c.generate(), "{}: generation is deterministic", c.name);
    }
    assert!(all.len() > 300, "{} cases", all.len());
}

#[test]
fn every_computing_op_is_covered() {
    let names: std::collections::HashSet<&str> =
        cases().iter().chain(random_cases().iter()).map(|c| c.op.name()).collect();
    for n in [
        "fused",
        "fill",
        "neg",
        "abs",
        "sign",
        "relu",
        "sigmoid",
        "tanh",
        "gelu",
        "exp",
        "log",
        "sqrt",
        "rsqrt",
        "square",
        "reciprocal",
        "add",
        "pow",
        "relu_grad",
        "gelu_grad",
        "sigmoid_grad",
        "tanh_grad",
        "add_scalar",
        "select",
        "matmul",
        "permute",
        "broadcast_to",
        "copy",
        "concat",
        "slice",
        "pad",
        "reduce_sum",
        "reduce_mean",
        "reduce_max",
        "softmax",
        "log_softmax",
        "conv2d",
        "conv2d_backprop_input",
        "conv2d_backprop_filter",
        "max_pool2d",
        "avg_pool2d",
        "max_pool2d_grad",
        "avg_pool2d_grad",
        "gather",
        "gather_grad",
        "apply_sgd",
        "apply_adam",
        "assign_add",
    ] {
        assert!(names.contains(n), "no case for {n}");
    }
}

#[test]
fn large_tensors_use_64_bit_indices() {
    for c in large_cases() {
        let k = c.generate();
        assert!(k.source.contains("long long"), "{}: 64-bit indices", c.name);
    }
    let small = case("small", Op::Unary(UnaryOp::Relu), &[&[1000]]).generate();
    assert!(!small.source.contains("long long"));
}

#[test]
fn in_place_and_vector_paths() {
    let same = case("same", Op::Binary(BinaryOp::Add), &[&[4, 6], &[4, 6]]).generate();
    assert!(same.source.contains("float4") && same.describe.contains("float4"), "{}", same.source);
    let bias = case("bias", Op::Binary(BinaryOp::Add), &[&[32, 10], &[10]]).generate();
    assert!(bias.describe.contains("strided"), "{}", bias.describe);
    let odd = case("odd", Op::Unary(UnaryOp::Exp), &[&[7]]).generate();
    assert!(!odd.source.contains("float4"));
    let scalar = case("scalar", Op::Binary(BinaryOp::Mul), &[&[8], &[]]).generate();
    assert!(scalar.source.contains("const float b = in1[0];"), "{}", scalar.source);
}

#[test]
fn constants_are_exact() {
    let k = case("s", Op::Scalar { op: ScalarOp::Mul, value: 0.1 }, &[&[3]]).generate();
    assert!(k.source.contains("0x1.99999ap-4f"), "{}", k.source);
    let k = case("f", Op::Fill { value: f32::NAN, shape: Shape::from([2]) }, &[]).generate();
    assert!(k.source.contains("__int_as_float(0x7fc00000)"), "{}", k.source);
}

#[test]
fn concat_splits_many_operands_into_launches() {
    let many: Vec<&[usize]> = (0..70).map(|_| &[2, 1][..]).collect();
    let k = case("c", Op::Concat { axis: 1 }, &many).generate();
    assert_eq!(k.launches.len(), 3);
    let args: Vec<Arg> =
        k.launches.iter().flat_map(|l| l.args.iter().copied()).filter(|a| *a != Arg::Output).collect();
    assert_eq!(args, (0..70).map(Arg::Input).collect::<Vec<_>>());
}

#[test]
fn matmul_tiles_depend_on_the_shape() {
    let small = case("s", Op::MatMul { transpose_a: false, transpose_b: false }, &[&[32, 100], &[100, 10]])
        .generate();
    let big =
        case("b", Op::MatMul { transpose_a: false, transpose_b: false }, &[&[2048, 2048], &[2048, 2048]])
            .generate();
    assert_ne!(small.launches[0].block, [0; 3]);
    assert!(small.describe.contains("tile 16x16"), "{}", small.describe);
    assert!(
        ["tile 128x128", "tile 128x64", "tile 64x128", "tile 64x64"].iter().any(|t| big.describe.contains(t)),
        "{}",
        big.describe
    );
    assert!(big.source.contains("__launch_bounds__"));
    let long_k = case("k", Op::MatMul { transpose_a: true, transpose_b: false }, &[&[8192, 32], &[8192, 32]])
        .generate();
    assert!(long_k.describe.contains("K-parallel"), "{}", long_k.describe);
    let mid_k = case("k", Op::MatMul { transpose_a: true, transpose_b: false }, &[&[900, 144], &[900, 32]])
        .generate();
    assert!(mid_k.describe.contains("split-K"), "{}", mid_k.describe);
}

#[test]
fn unsupported_ops_and_dtypes_are_errors() {
    let s = Shape::from([2, 3]);
    let f = (&s, DType::F32);
    for op in [
        Op::Input { name: "x".into(), shape: s.clone(), dtype: DType::F32 },
        Op::Reshape { shape: Shape::from([6]) },
    ] {
        let inputs: Vec<(&Shape, DType)> = if matches!(op, Op::Reshape { .. }) { vec![f] } else { vec![] };
        let out = Shape::from(if matches!(op, Op::Reshape { .. }) { vec![6] } else { vec![2, 3] });
        let e = generate(&op, &inputs, (&out, DType::F32)).unwrap_err();
        assert!(matches!(e, KernelError::Unsupported { .. }), "{e}");
    }
    let e = generate(&Op::Unary(UnaryOp::Exp), &[(&s, DType::I32)], (&s, DType::I32)).unwrap_err();
    assert!(matches!(e, KernelError::Unsupported { dtype: DType::I32, .. }), "{e}");
    // An op outside every family of `cuda::HALF_KERNELS` (a collective) reads f32 alone: on
    // half values it is an error that names the kernels' half families.
    let all_reduce = Op::AllReduce { op: ReduceOp::Sum };
    let e = generate(&all_reduce, &[(&s, DType::F16)], (&s, DType::F16)).unwrap_err();
    assert!(matches!(e, KernelError::Unsupported { dtype: DType::F16, .. }), "{e}");
    assert!(e.to_string().contains("grouped filter gradient ops read and write f16"), "{e}");
    let wrong = Shape::from([3, 2]);
    let e = generate(&Op::Unary(UnaryOp::Exp), &[f], (&wrong, DType::F32)).unwrap_err();
    assert!(matches!(e, KernelError::Shape { .. }), "{e}");
    let e = generate(&Op::Binary(BinaryOp::Add), &[f, (&Shape::from([4]), DType::F32)], (&s, DType::F32))
        .unwrap_err();
    assert!(e.to_string().contains("do not broadcast"), "{e}");
}

// ---------------------------------------------------------------- dump for GPU / NVRTC checks

struct Rng(u64);

impl Rng {
    /// Uniform in 0..n.
    fn pick(&mut self, n: usize) -> usize {
        ((self.next() * n as f32) as usize).min(n - 1)
    }

    /// A random operand shape that broadcasts to `out`: a suffix of its axes, some set to 1.
    fn operand(&mut self, out: &[usize]) -> Vec<usize> {
        let keep = self.pick(out.len() + 1);
        out[out.len() - keep..].iter().map(|&d| if self.pick(3) == 0 { 1 } else { d }).collect()
    }

    fn next(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 40) as f32 / (1u64 << 24) as f32
    }
}

fn draw(d: Data, n: usize, rng: &mut Rng) -> Vec<f32> {
    (0..n)
        .map(|i| match d {
            Data::Uniform(lo, hi) => lo + (hi - lo) * rng.next(),
            Data::Ties => ((-2.0 + 4.0 * rng.next()) * 2.0).round() / 2.0,
            Data::Const(c) => c,
            Data::Ids(v) => match i % 7 {
                5 => -1.0,
                6 => v as f32 + (i % 3) as f32,
                _ => (rng.next() * v as f32).floor() + if i % 2 == 0 { 0.25 } else { 0.0 },
            },
        })
        .collect()
}

fn bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_case(dir: &Path, c: &Case, k: &CudaKernel, run: bool) {
    std::fs::write(dir.join(format!("{}.cu", c.name)), &k.source).expect("write source");
    let mut launch = String::new();
    for l in &k.launches {
        let args: Vec<String> = l
            .args
            .iter()
            .map(|a| match a {
                Arg::Input(i) => format!("i{i}"),
                Arg::Output => "o".into(),
                Arg::Scratch => format!("s{}", c.scratch_bytes()),
            })
            .collect();
        let _ = writeln!(
            launch,
            "{} {} {} {} {} {} {} {} {}",
            l.function,
            l.grid[0],
            l.grid[1],
            l.grid[2],
            l.block[0],
            l.block[1],
            l.block[2],
            l.shared_bytes,
            args.join(" ")
        );
    }
    std::fs::write(dir.join(format!("{}.launch", c.name)), launch).expect("write launches");
    if !run {
        return;
    }
    let (inputs, after, o) = cpu_reference(c);
    for (i, b) in inputs.iter().enumerate() {
        std::fs::write(dir.join(format!("{}.in{i}", c.name)), bytes(b)).expect("write operand");
    }
    if c.op.is_effect() {
        for &i in c.op.mutated_operands() {
            std::fs::write(dir.join(format!("{}.expect{i}", c.name)), bytes(&after[i]))
                .expect("write result");
        }
    } else {
        std::fs::write(dir.join(format!("{}.expect", c.name)), bytes(&o)).expect("write result");
    }
}

/// The case's operands as drawn (deterministic per case name), and what the CPU kernel makes of
/// them: the operands after the run (effects update some in place) and the output.
fn cpu_reference(c: &Case) -> (Vec<Vec<f32>>, Vec<Vec<f32>>, Vec<f32>) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c.name.len() as u64 * 7919));
    let inputs: Vec<Vec<f32>> =
        c.shapes.iter().zip(&c.data).map(|(s, &d)| draw(d, s.numel(), &mut rng)).collect();
    let mut bufs = inputs.clone();
    let ops: Vec<(&Shape, DType)> = c.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = c.output();
    let kernel = cpu::prepare(&c.op, &ops, (&out, DType::F32)).expect("cpu kernel");
    let mut o = vec![f32::NAN; if c.op.is_effect() { 0 } else { out.numel() }];
    let ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    let optr = if c.op.is_effect() { std::ptr::null_mut() } else { o.as_mut_ptr() as *mut u8 };
    // SAFETY: buffers sized from the shapes, distinct allocations; effects get a null output.
    unsafe { kernel.run(&ptrs, optr) };
    (inputs, bufs, o)
}

/// Every generated kernel of every case (odd sizes, every op forward and backward, effects)
/// compiled with the system C++ compiler, launched on the host with its own grid and block, and
/// compared with the CPU kernel. Cases whose grid holds more than `MAX_THREADS` threads are left
/// to the device run (`KILN_DUMP_CUDA`); the test names how many.
#[test]
fn every_kernel_runs_on_the_host_and_matches_the_cpu() {
    const MAX_THREADS: usize = 1 << 15;
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let all: Vec<Case> = cases().into_iter().chain(random_cases()).collect();
    let total = all.len();
    let threads = |k: &CudaKernel| {
        k.launches
            .iter()
            .map(|l| l.grid.iter().product::<u32>() as usize * l.block.iter().product::<u32>() as usize)
            .sum::<usize>()
    };
    let mut runs = Vec::new();
    let mut references = Vec::new();
    for c in all {
        let k = c.generate();
        if k.launches.is_empty() || threads(&k) > MAX_THREADS {
            continue;
        }
        let (inputs, after, out) = cpu_reference(&c);
        runs.push(cuda_host::HostCase {
            name: c.name.clone(),
            kernel: k,
            operands: inputs.clone(),
            output_len: out.len(),
            scratch_len: c.scratch_bytes() / 4,
        });
        references.push((c, inputs, after, out));
    }
    let ran = runs.len();
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    let results = cuda_host::run(runs).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for ((name, r), (c, before, after, out)) in names.iter().zip(&results).zip(&references) {
        let check = if c.op.is_effect() {
            cuda_host::check_effect(&c.op, before, &r.operands, after)
        } else {
            cuda_host::close(&r.output, out, cuda_host::tolerance(&c.op))
        };
        if let Err(e) = check {
            failures.push(format!("{name}: {e}"));
        }
    }
    eprintln!(
        "{ran} of {total} kernels ran on the host ({} left to a device: over {MAX_THREADS} threads or no launch)",
        total - ran
    );
    assert!(failures.is_empty(), "{} kernels differ from the CPU:\n{}", failures.len(), failures.join("\n"));
    assert!(ran * 10 >= total * 9, "only {ran} of {total} kernels are small enough to run on the host");
}

#[test]
fn dump_for_device_checks() {
    let Ok(dir) = std::env::var("KILN_DUMP_CUDA") else { return };
    let dir = Path::new(&dir);
    std::fs::create_dir_all(dir).expect("dump directory");
    for c in cases().into_iter().chain(random_cases()) {
        write_case(dir, &c, &c.generate(), true);
    }
    for c in large_cases().into_iter().chain(bench_cases()) {
        write_case(dir, &c, &c.generate(), false);
    }
}

#[test]
fn a_bias_add_reads_like_handwritten_cuda() {
    let k = case("bias", Op::Binary(BinaryOp::Add), &[&[32, 10], &[10]]).generate();
    let want = r#"// kiln: add: [32, 10], [10] -> [32, 10]
__device__ __forceinline__ float kiln_op(float a, float b) {
    return a + b;
}

extern "C" __global__ void kiln_add(const float* in0, const float* in1, float* out) {
    for (int i = (int)(blockIdx.x * blockDim.x + threadIdx.x); i < 320; i += (int)(gridDim.x * blockDim.x)) {
        const int c1 = i % 10;
        const float a = in0[i];
        const float b = in1[c1];
        out[i] = kiln_op(a, b);
    }
}
"#;
    assert_eq!(k.source, want);
    assert_eq!(k.launches.len(), 1);
    assert_eq!(k.launches[0].grid, [2, 1, 1]);
    assert_eq!(k.launches[0].block, [256, 1, 1]);
    assert_eq!(k.launches[0].args, vec![Arg::Input(0), Arg::Input(1), Arg::Output]);
}
