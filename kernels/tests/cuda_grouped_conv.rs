//! The CUDA kernels of convolutions over non-dense windows (`cuda::grouped_conv`: grouped,
//! depthwise, dilated, any stride and padding, `Padding::Explicit` asymmetric pads included),
//! and the dense convolution and pooling kernels under asymmetric explicit pads, run on the host
//! (`cuda_host`: the generated CUDA C compiled with the system C++ compiler and launched with its
//! own grid and block) and compared with a naive scalar reference written here: direct loops
//! over the definitions (the gradients as the adjoints of the forward loop), in f64, with its
//! own output extents and pads. The reference depends on no kernel of this crate, so these tests
//! do not lean on the CPU kernels.
//!
//! An element passes when it is within the worst-case error of an f32 sum in any order of its
//! terms: (terms + 3) · 2^-24 · Σ|terms| (exactly equal where that is 0, as a maximum).
//!
//! With NVRTC present (`.nvrtc/`, `KILN_NVRTC`; required under `KILN_REQUIRE_NVRTC=1`) every
//! kernel here, and some too large to run on the host (64-bit indices), is compiled to PTX for
//! sm_90.

use kiln_compiler::ir::fused::{Inst, Ref};
use kiln_compiler::ir::{BinaryOp, DType, Fused, Op, Padding, PoolKind, Shape, UnaryOp, Window2d, infer};
use kiln_kernels::cuda::{Arg, CudaKernel, generate, generate_with_scratch, scratch_bytes};

// The harness's comparisons with the CPU kernels are not used here.
#[allow(dead_code)]
mod cuda_host;

// ---------------------------------------------------------------- reference geometry

/// A window over an NHWC input, with the output extents and pads before computed here.
#[derive(Clone, Debug)]
struct Geo {
    n: usize,
    h: usize,
    w: usize,
    c: usize,
    f: usize,
    k: [usize; 2],
    s: [usize; 2],
    d: [usize; 2],
    groups: usize,
    out: [usize; 2],
    pad: [usize; 2],
}

impl Geo {
    fn new(x: [usize; 4], window: &Window2d, f: usize) -> Geo {
        let mut out = [0; 2];
        let mut pad = [0; 2];
        for a in 0..2 {
            let input = x[1 + a];
            let (k, s, d) = (window.size[a], window.stride[a], window.dilation[a]);
            let span = (k - 1) * d + 1;
            (out[a], pad[a]) = match window.padding {
                Padding::Valid => ((input - span) / s + 1, 0),
                Padding::Same => {
                    let o = input.div_ceil(s);
                    (o, ((o - 1) * s + span).saturating_sub(input) / 2)
                }
                Padding::Explicit { before, after } => {
                    ((input + before[a] + after[a] - span) / s + 1, before[a])
                }
            };
        }
        Geo {
            n: x[0],
            h: x[1],
            w: x[2],
            c: x[3],
            f,
            k: window.size,
            s: window.stride,
            d: window.dilation,
            groups: window.groups,
            out,
            pad,
        }
    }

    fn x_shape(&self) -> [usize; 4] {
        [self.n, self.h, self.w, self.c]
    }

    fn w_shape(&self) -> [usize; 4] {
        [self.k[0], self.k[1], self.c / self.groups, self.f]
    }

    fn y_shape(&self) -> [usize; 4] {
        [self.n, self.out[0], self.out[1], self.f]
    }

    /// The input index tap `k` of output `o` reads along `axis`, if inside the input.
    fn input_at(&self, axis: usize, o: usize, k: usize) -> Option<usize> {
        let extent = [self.h, self.w][axis];
        let i = (o * self.s[axis] + k * self.d[axis]) as isize - self.pad[axis] as isize;
        (i >= 0 && (i as usize) < extent).then_some(i as usize)
    }

    /// Calls `visit(y, x, w)` with the linear indices of every product of the convolution:
    /// output element y reads input element x times filter element w.
    fn products(&self, mut visit: impl FnMut(usize, usize, usize)) {
        let (cg, fg) = (self.c / self.groups, self.f / self.groups);
        let [oh_n, ow_n] = self.out;
        for n in 0..self.n {
            for oh in 0..oh_n {
                for ow in 0..ow_n {
                    for f in 0..self.f {
                        let y = ((n * oh_n + oh) * ow_n + ow) * self.f + f;
                        for kh in 0..self.k[0] {
                            let Some(ih) = self.input_at(0, oh, kh) else { continue };
                            for kw in 0..self.k[1] {
                                let Some(iw) = self.input_at(1, ow, kw) else { continue };
                                for ci in 0..cg {
                                    let c = f / fg * cg + ci;
                                    let x = ((n * self.h + ih) * self.w + iw) * self.c + c;
                                    let w = ((kh * self.k[1] + kw) * cg + ci) * self.f + f;
                                    visit(y, x, w);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Reference values: the exact value (f64), the sum of the magnitudes of its terms and their
/// count, per element.
#[derive(Clone)]
struct Want {
    v: Vec<f64>,
    abs: Vec<f64>,
    terms: Vec<usize>,
}

impl Want {
    fn zeros(len: usize) -> Want {
        Want { v: vec![0.0; len], abs: vec![0.0; len], terms: vec![0; len] }
    }

    fn add(&mut self, i: usize, t: f64) {
        self.v[i] += t;
        self.abs[i] += t.abs();
        self.terms[i] += 1;
    }
}

fn conv_ref(g: &Geo, x: &[f32], w: &[f32]) -> Want {
    let mut r = Want::zeros(g.y_shape().iter().product());
    g.products(|yi, xi, wi| r.add(yi, x[xi] as f64 * w[wi] as f64));
    r
}

fn input_grad_ref(g: &Geo, dy: &[f32], w: &[f32]) -> Want {
    let mut r = Want::zeros(g.x_shape().iter().product());
    g.products(|yi, xi, wi| r.add(xi, dy[yi] as f64 * w[wi] as f64));
    r
}

fn filter_grad_ref(g: &Geo, x: &[f32], dy: &[f32]) -> Want {
    let mut r = Want::zeros(g.w_shape().iter().product());
    g.products(|yi, xi, wi| r.add(wi, x[xi] as f64 * dy[yi] as f64));
    r
}

/// relu_grad(y, dx) and, with a residual r, relu_grad(y, r + dx): dx where y > 0, else 0.
fn relu_grad_ref(dx: &Want, y: &[f32], r: Option<&[f32]>) -> Want {
    let mut out = Want::zeros(y.len());
    for i in 0..y.len() {
        if y[i] > 0.0 {
            let extra = r.map_or(0.0, |r| r[i] as f64);
            out.v[i] = dx.v[i] + extra;
            out.abs[i] = dx.abs[i] + extra.abs();
            out.terms[i] = dx.terms[i] + usize::from(r.is_some());
        }
    }
    out
}

/// relu(conv + bias[f]).
fn bias_relu_ref(conv: &Want, bias: &[f32]) -> Want {
    let mut out = conv.clone();
    for i in 0..out.v.len() {
        let b = bias[i % bias.len()] as f64;
        out.v[i] = (conv.v[i] + b).max(0.0);
        out.abs[i] += b.abs();
        out.terms[i] += 1;
    }
    out
}

/// Pooling of x `[N, H, W, C]`: per output element, the in-bounds input elements of its
/// window, in row-major order.
fn pool_windows(g: &Geo) -> Vec<Vec<usize>> {
    let [oh_n, ow_n] = g.out;
    let mut v = Vec::new();
    for n in 0..g.n {
        for oh in 0..oh_n {
            for ow in 0..ow_n {
                for c in 0..g.c {
                    let mut win = Vec::new();
                    for kh in 0..g.k[0] {
                        let Some(ih) = g.input_at(0, oh, kh) else { continue };
                        for kw in 0..g.k[1] {
                            let Some(iw) = g.input_at(1, ow, kw) else { continue };
                            win.push(((n * g.h + ih) * g.w + iw) * g.c + c);
                        }
                    }
                    assert!(!win.is_empty(), "a window of padding only");
                    v.push(win);
                }
            }
        }
    }
    v
}

/// Max (padding never wins: -inf) or average (over the in-bounds elements only) pooling.
fn pool_ref(kind: PoolKind, g: &Geo, x: &[f32]) -> Want {
    let wins = pool_windows(g);
    let mut r = Want::zeros(wins.len());
    for (o, win) in wins.iter().enumerate() {
        match kind {
            // Exact: no rounding, so no tolerance (abs stays 0).
            PoolKind::Max => r.v[o] = win.iter().map(|&i| x[i] as f64).fold(f64::NEG_INFINITY, f64::max),
            PoolKind::Avg => {
                let n = win.len() as f64;
                for &i in win {
                    r.add(o, x[i] as f64 / n);
                }
            }
        }
    }
    r
}

/// Pooling's gradient by definition: each window's dy to its first maximum (strictly greater
/// replaces, row-major), or spread evenly over its in-bounds elements.
fn pool_grad_ref(kind: PoolKind, g: &Geo, x: &[f32], dy: &[f32]) -> Want {
    let wins = pool_windows(g);
    let mut r = Want::zeros(g.x_shape().iter().product());
    for (o, win) in wins.iter().enumerate() {
        match kind {
            PoolKind::Max => {
                let mut best = win[0];
                for &i in &win[1..] {
                    if x[i] > x[best] {
                        best = i;
                    }
                }
                r.add(best, dy[o] as f64);
            }
            PoolKind::Avg => {
                for &i in win {
                    r.add(i, dy[o] as f64 / win.len() as f64);
                }
            }
        }
    }
    r
}

// ---------------------------------------------------------------- cases

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f32 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        (x >> 40) as f32 / (1u64 << 24) as f32
    }

    fn pick(&mut self, n: usize) -> usize {
        ((self.next() * n as f32) as usize).min(n - 1)
    }

    /// Uniform in [-2, 2).
    fn data(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| -2.0 + 4.0 * self.next()).collect()
    }

    /// Multiples of 0.5 in [-2, 2]: many ties.
    fn ties(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| ((-2.0 + 4.0 * self.next()) * 2.0).round() / 2.0).collect()
    }
}

/// One kernel to run on the host and what it must give.
struct Run {
    name: String,
    op: Op,
    operands: Vec<Vec<f32>>,
    shapes: Vec<Shape>,
    kernel: CudaKernel,
    want: Want,
    scratch: usize,
}

fn shape(d: [usize; 4]) -> Shape {
    Shape::from(d)
}

/// Generates `op` over `shapes`, with the scratch it asks for when `split`; checks the output
/// shape against `infer`.
fn kernel_of(op: &Op, shapes: &[Shape], out: &Shape, split: bool) -> (CudaKernel, usize) {
    let ops: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
    let inferred = infer(op, &ops).unwrap_or_else(|e| panic!("{}: {}", op.label(), e.message)).0;
    assert_eq!(&inferred, out, "{}: the reference's output shape", op.label());
    let scratch = if split { scratch_bytes(op, &ops, out) } else { 0 };
    let k = generate_with_scratch(op, &ops, (out, DType::F32), scratch).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(k, generate_with_scratch(op, &ops, (out, DType::F32), scratch).unwrap(), "deterministic");
    (k, scratch)
}

fn run_of(name: String, op: Op, operands: Vec<Vec<f32>>, shapes: Vec<Shape>, out: &Shape, want: Want) -> Run {
    let (kernel, scratch) = kernel_of(&op, &shapes, out, false);
    Run { name, op, operands, shapes, kernel, want, scratch }
}

/// A convolution to test: input shape, window, filter count.
struct ConvCase {
    name: String,
    x: [usize; 4],
    window: Window2d,
    f: usize,
}

fn conv(name: &str, x: [usize; 4], window: Window2d, f: usize) -> ConvCase {
    ConvCase { name: name.into(), x, window, f }
}

fn win(k: [usize; 2], s: [usize; 2], padding: Padding) -> Window2d {
    Window2d::new(k, s, padding)
}

fn explicit(before: [usize; 2], after: [usize; 2]) -> Padding {
    Padding::Explicit { before, after }
}

/// The non-dense convolutions of the fixed cases.
fn grouped_cases() -> Vec<ConvCase> {
    let same = Padding::Same;
    let valid = Padding::Valid;
    vec![
        conv("depthwise_m1_s1_same", [2, 7, 7, 4], win([3, 3], [1, 1], same).grouped(4), 4),
        conv("depthwise_m2_s2_same", [2, 7, 7, 4], win([3, 3], [2, 2], same).grouped(4), 8),
        conv("depthwise_m2_s1_valid", [1, 6, 5, 3], win([3, 3], [1, 1], valid).grouped(3), 6),
        conv(
            "depthwise_m1_s2_explicit",
            [2, 6, 7, 4],
            win([3, 3], [2, 2], explicit([1, 0], [0, 2])).grouped(4),
            4,
        ),
        conv("depthwise_m1_wide", [2, 8, 8, 64], win([3, 3], [1, 1], same).grouped(64), 64),
        conv("grouped_c8_g2_f4_same", [2, 6, 6, 8], win([3, 3], [1, 1], same).grouped(2), 4),
        conv("grouped_c8_g2_f4_s2_valid", [1, 7, 7, 8], win([3, 3], [2, 2], valid).grouped(2), 4),
        conv(
            "grouped_c12_g3_f6_explicit",
            [2, 5, 6, 12],
            win([3, 3], [1, 1], explicit([0, 1], [2, 0])).grouped(3),
            6,
        ),
        conv("grouped_c12_g3_f6_s2_same", [1, 8, 8, 12], win([3, 2], [2, 2], same).grouped(3), 6),
        conv("grouped_1x1_s2", [2, 5, 5, 6], win([1, 1], [2, 2], valid).grouped(2), 4),
        conv("grouped_many_filters", [1, 6, 6, 64], win([3, 3], [1, 1], same).grouped(2), 64),
        conv("grouped_ragged_tile", [1, 5, 5, 40], win([3, 3], [1, 1], same).grouped(2), 40),
        conv("dilated_d2_same", [2, 9, 9, 3], win([3, 3], [1, 1], same).dilated([2, 2]), 5),
        conv("dilated_d2_s2_valid", [1, 11, 10, 2], win([3, 3], [2, 2], valid).dilated([2, 2]), 3),
        conv(
            "dilated_2x1_explicit",
            [2, 8, 9, 3],
            win([3, 3], [1, 1], explicit([2, 1], [1, 0])).dilated([2, 1]),
            4,
        ),
        conv("dilated_grouped_same", [2, 9, 9, 8], win([3, 3], [1, 1], same).dilated([2, 2]).grouped(2), 4),
        conv(
            "dilated_grouped_s2_explicit",
            [1, 10, 10, 6],
            win([3, 3], [2, 2], explicit([1, 2], [2, 1])).dilated([2, 2]).grouped(3),
            6,
        ),
        conv("dilated_depthwise_m2", [2, 8, 8, 4], win([3, 3], [1, 1], same).dilated([2, 2]).grouped(4), 8),
    ]
}

/// Dense convolutions with asymmetric explicit pads: the implicit GEMMs of `conv`.
fn dense_explicit_cases() -> Vec<ConvCase> {
    vec![
        conv("dense_explicit_s1", [2, 7, 7, 3], win([3, 3], [1, 1], explicit([1, 0], [0, 2])), 4),
        conv("dense_explicit_s2", [2, 8, 7, 3], win([3, 3], [2, 2], explicit([2, 0], [0, 1])), 5),
        conv("dense_explicit_2x3", [1, 9, 8, 2], win([2, 3], [1, 2], explicit([0, 2], [1, 0])), 3),
        conv("dense_explicit_4x4_s3", [1, 6, 6, 4], win([4, 4], [3, 3], explicit([3, 0], [0, 3])), 2),
        conv("dense_explicit_long", [4, 16, 16, 3], win([3, 3], [1, 1], explicit([0, 1], [1, 0])), 8),
    ]
}

/// Random non-dense convolutions (fixed seed), each valid under `infer`.
fn random_cases() -> Vec<ConvCase> {
    let mut r = Rng(0xD11A_7ED5_0000_6A11);
    let mut v = Vec::new();
    while v.len() < 24 {
        let groups = 1 + r.pick(4);
        let (cg, fg) = (1 + r.pick(3), 1 + r.pick(3));
        let x = [1 + r.pick(3), 1 + r.pick(10), 1 + r.pick(10), groups * cg];
        let k = [1 + r.pick(4), 1 + r.pick(4)];
        let mut d = [1 + r.pick(3), 1 + r.pick(3)];
        if groups == 1 && d == [1, 1] {
            d[r.pick(2)] = 2;
        }
        let span = [(k[0] - 1) * d[0] + 1, (k[1] - 1) * d[1] + 1];
        let padding = match r.pick(3) {
            0 => Padding::Same,
            1 => Padding::Valid,
            _ => explicit([r.pick(span[0]), r.pick(span[1])], [r.pick(span[0]), r.pick(span[1])]),
        };
        let w = win(k, [1 + r.pick(3), 1 + r.pick(3)], padding).dilated(d).grouped(groups);
        let f = groups * fg;
        let ws = Shape::from([k[0], k[1], cg, f]);
        let ok = infer(&Op::Conv2d { window: w }, &[(&shape(x), DType::F32), (&ws, DType::F32)]).is_ok();
        if ok {
            v.push(conv(&format!("random_{}", v.len()), x, w, f));
        }
    }
    v
}

/// Every kernel of a convolution case: forward, input gradient (plain, through ReLU, with a
/// residual), filter gradient, and with `fused` a forward through bias and ReLU.
fn conv_runs(cc: &ConvCase, fused: bool, split: bool) -> Vec<Run> {
    let g = Geo::new(cc.x, &cc.window, cc.f);
    let (xs, ws, ys) = (shape(g.x_shape()), shape(g.w_shape()), shape(g.y_shape()));
    let mut rng =
        Rng(0x9E37_79B9_7F4A_7C15 ^ (cc.name.len() as u64 * 7919 + cc.x.iter().sum::<usize>() as u64));
    let x = rng.data(xs.numel());
    let w = rng.data(ws.numel());
    let dy = rng.data(ys.numel());
    let y = rng.data(xs.numel());
    let res = rng.data(xs.numel());
    let bias = rng.data(cc.f);
    let window = cc.window;
    let mut v = Vec::new();
    let mut push = |suffix: &str,
                    op: Op,
                    operands: Vec<Vec<f32>>,
                    shapes: Vec<Shape>,
                    out: &Shape,
                    want: Want| {
        let (kernel, scratch) = kernel_of(&op, &shapes, out, split);
        v.push(Run { name: format!("{}_{suffix}", cc.name), op, operands, shapes, kernel, want, scratch });
    };
    let fwd = conv_ref(&g, &x, &w);
    push(
        "conv2d",
        Op::Conv2d { window },
        vec![x.clone(), w.clone()],
        vec![xs.clone(), ws.clone()],
        &ys,
        fwd.clone(),
    );
    let dx = input_grad_ref(&g, &dy, &w);
    let input = xs.clone();
    push(
        "backprop_input",
        Op::Conv2dBackpropInput { window, input: input.clone() },
        vec![dy.clone(), w.clone()],
        vec![ys.clone(), ws.clone()],
        &xs,
        dx.clone(),
    );
    push(
        "backprop_filter",
        Op::Conv2dBackpropFilter { window },
        vec![x.clone(), dy.clone()],
        vec![xs.clone(), ys.clone()],
        &ws,
        filter_grad_ref(&g, &x, &dy),
    );
    if fused {
        push(
            "backprop_input_relu_grad",
            Op::Conv2dBackpropInputReluGrad { window, input: input.clone() },
            vec![dy.clone(), w.clone(), y.clone()],
            vec![ys.clone(), ws.clone(), xs.clone()],
            &xs,
            relu_grad_ref(&dx, &y, None),
        );
        push(
            "backprop_input_residual_relu_grad",
            Op::Conv2dBackpropInputReluGrad { window, input },
            vec![dy.clone(), w.clone(), y.clone(), res.clone()],
            vec![ys.clone(), ws.clone(), xs.clone(), xs.clone()],
            &xs,
            relu_grad_ref(&dx, &y, Some(&res)),
        );
        let program = Fused {
            shape: ys.clone(),
            insts: vec![
                Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
                Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
            ],
            reduce: None,
            matmul: None,
            conv: Some(window),
            epilogue: Vec::new(),
            epilogue_operands: 0,
        };
        push(
            "bias_relu",
            Op::Fused(program),
            vec![x, w, bias.clone()],
            vec![xs, ws, Shape::from([cc.f])],
            &ys,
            bias_relu_ref(&fwd, &bias),
        );
    }
    v
}

/// Max and average pooling with asymmetric explicit pads, forward and gradients.
fn pool_runs() -> Vec<Run> {
    let cases: Vec<(&str, [usize; 4], Window2d)> = vec![
        ("pool_explicit_2x2_s2", [2, 6, 6, 3], win([2, 2], [2, 2], explicit([1, 0], [0, 1]))),
        ("pool_explicit_3x3_s2", [1, 7, 7, 2], win([3, 3], [2, 2], explicit([2, 0], [0, 2]))),
        ("pool_explicit_3x2_s1", [2, 5, 8, 3], win([3, 2], [1, 1], explicit([0, 1], [2, 0]))),
        ("pool_explicit_4x4_s3", [1, 8, 8, 1], win([4, 4], [3, 3], explicit([3, 1], [0, 2]))),
        // Windows that tile the input, an unused pad after: max's gradient a window per thread.
        ("pool_explicit_tiles", [1, 6, 6, 2], win([2, 2], [2, 2], explicit([0, 0], [0, 1]))),
    ];
    let mut v = Vec::new();
    for (name, x, window) in cases {
        let g = Geo::new(x, &window, x[3]);
        let (xs, ys) = (shape(x), shape(g.y_shape()));
        let mut rng = Rng(0x5EED ^ (name.len() as u64 * 31 + x.iter().sum::<usize>() as u64));
        let data = rng.data(xs.numel());
        let ties = rng.ties(xs.numel());
        let dy = rng.data(ys.numel());
        for kind in [PoolKind::Max, PoolKind::Avg] {
            let k = format!("{kind:?}").to_lowercase();
            let op = Op::Pool2d { kind, window };
            let want = pool_ref(kind, &g, &data);
            v.push(run_of(format!("{name}_{k}"), op, vec![data.clone()], vec![xs.clone()], &ys, want));
            for (label, xv) in [("", &data), ("_ties", &ties)] {
                let op = Op::Pool2dGrad { kind, window };
                let want = pool_grad_ref(kind, &g, xv, &dy);
                let operands = vec![xv.clone(), dy.clone()];
                v.push(run_of(
                    format!("{name}_{k}_grad{label}"),
                    op,
                    operands,
                    vec![xs.clone(), ys.clone()],
                    &xs,
                    want,
                ));
            }
            if kind == PoolKind::Avg {
                let op = Op::AvgPool2dGrad { window, input: xs.clone() };
                let want = pool_grad_ref(kind, &g, &data, &dy);
                v.push(run_of(
                    format!("{name}_avg_grad_from_dy"),
                    op,
                    vec![dy.clone()],
                    vec![ys.clone()],
                    &xs,
                    want,
                ));
            }
        }
    }
    v
}

/// The kernel with a grid of `blocks` blocks: the grid- and block-stride loops of the direct
/// kernels must cover their work from any grid.
fn with_grid(mut r: Run, blocks: u32) -> Run {
    r.name += &format!("_grid{blocks}");
    for l in &mut r.kernel.launches {
        l.grid = [blocks, 1, 1];
    }
    r
}

/// |got - want| within (terms + 3) · 2^-24 · Σ|terms|: the error bound of an f32 sum of that
/// many rounded products in any order (exact where the bound is 0).
fn compare(got: &[f32], want: &Want) -> Result<f64, String> {
    if got.len() != want.v.len() {
        return Err(format!("{} elements, expected {}", got.len(), want.v.len()));
    }
    let mut worst: f64 = 0.0;
    for (i, &g) in got.iter().enumerate() {
        let tol = (want.terms[i] + 3) as f64 * f64::powi(2.0, -24) * want.abs[i];
        let err = (g as f64 - want.v[i]).abs();
        if err.is_nan() || err > tol {
            return Err(format!(
                "element {i}: {g} on the host, {} expected (tolerance {tol:e}, {} terms)",
                want.v[i], want.terms[i]
            ));
        }
        if tol > 0.0 {
            worst = worst.max(err / tol);
        }
    }
    Ok(worst)
}

fn host_run(runs: Vec<Run>) -> Vec<String> {
    let cases: Vec<cuda_host::HostCase> = runs
        .iter()
        .map(|r| cuda_host::HostCase {
            name: r.name.clone(),
            kernel: r.kernel.clone(),
            operands: r.operands.clone(),
            output_len: r.want.v.len(),
            scratch_len: r.scratch / 4,
        })
        .collect();
    let results = cuda_host::run(cases).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    let mut worst: f64 = 0.0;
    for (r, res) in runs.iter().zip(&results) {
        match compare(&res.output, &r.want) {
            Ok(w) => worst = worst.max(w),
            Err(e) => failures.push(format!("{} ({}): {e}", r.name, r.kernel.describe)),
        }
        assert_eq!(res.operands, r.operands, "{}: operands are read only", r.name);
    }
    eprintln!(
        "{} kernels matched the reference: largest error {:.3} of the bound",
        runs.len() - failures.len(),
        worst
    );
    failures
}

fn skip_without_compiler() -> bool {
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped: {why}");
        return true;
    }
    false
}

/// Checks the launches of a non-dense window's kernel: one launch of 256-thread blocks over
/// (x, w) or (x, dy) and the output, no scratch asked for or used.
fn check_direct(r: &Run) {
    let ops: Vec<(&Shape, DType)> = r.shapes.iter().map(|s| (s, DType::F32)).collect();
    let out = infer(&r.op, &ops).unwrap().0;
    assert_eq!(scratch_bytes(&r.op, &ops, &out), 0, "{}: no scratch", r.name);
    assert_eq!(generate(&r.op, &ops, (&out, DType::F32)).unwrap(), r.kernel, "{}", r.name);
    assert_eq!(r.kernel.launches.len(), 1, "{}", r.name);
    let l = &r.kernel.launches[0];
    assert_eq!(l.block, [256, 1, 1], "{}", r.name);
    assert!(l.grid[0] >= 1 && l.grid[0] <= 1 << 16, "{}: grid {:?}", r.name, l.grid);
    assert!(!l.args.contains(&Arg::Scratch), "{}", r.name);
    assert!(r.kernel.describe.contains("direct"), "{}: {}", r.name, r.kernel.describe);
    assert!(l.function.ends_with("_grouped"), "{}: {}", r.name, l.function);
    assert!(r.kernel.source.starts_with("// kiln: ") && !r.kernel.source.contains("#include"));
    assert!(!r.kernel.source.contains("atomic"), "{}: deterministic, no atomics", r.name);
}

#[test]
fn non_dense_convolutions_run_on_the_host_and_match_the_reference() {
    if skip_without_compiler() {
        return;
    }
    let mut runs = Vec::new();
    for cc in grouped_cases() {
        let case_runs = conv_runs(&cc, true, true);
        for r in &case_runs {
            check_direct(r);
        }
        runs.extend(case_runs);
    }
    for cc in random_cases() {
        runs.extend(conv_runs(&cc, false, false));
    }
    // From a grid of 1 and 3 blocks: every thread and block takes several elements and tiles.
    for cc in [&grouped_cases()[1], &grouped_cases()[7], &grouped_cases()[16]] {
        for r in conv_runs(cc, true, false) {
            runs.push(with_grid(r, 1));
        }
        for r in conv_runs(cc, false, false) {
            runs.push(with_grid(r, 3));
        }
    }
    let n = runs.len();
    let failures = host_run(runs);
    assert!(
        failures.is_empty(),
        "{} of {n} kernels differ from the reference:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn dense_convolutions_and_pooling_with_asymmetric_pads_match_the_reference() {
    if skip_without_compiler() {
        return;
    }
    let mut runs = Vec::new();
    for cc in dense_explicit_cases() {
        runs.extend(conv_runs(&cc, true, false));
        // With the scratch they ask for: split-K over the long contractions.
        runs.extend(conv_runs(&cc, false, true).into_iter().filter(|r| r.scratch > 0).map(|mut r| {
            r.name += "_split";
            r
        }));
    }
    assert!(runs.iter().any(|r| r.name.ends_with("_split")), "some case splits K");
    for r in &runs {
        assert!(!r.kernel.describe.contains("direct"), "{}: dense windows stay on the GEMMs", r.name);
    }
    runs.extend(pool_runs());
    let n = runs.len();
    let failures = host_run(runs);
    assert!(
        failures.is_empty(),
        "{} of {n} kernels differ from the reference:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn filter_gradient_tiles_and_index_types() {
    // Depthwise: few dw elements, narrow tiles (many blocks); many filters: full-warp tiles.
    let runs = conv_runs(&grouped_cases()[4], false, false);
    let bf = runs.iter().find(|r| r.name.ends_with("backprop_filter")).unwrap();
    assert!(bf.kernel.describe.contains("tiles of 2 channels x 128 rows"), "{}", bf.kernel.describe);
    assert_eq!(bf.kernel.launches[0].grid, [288, 1, 1]);
    let runs = conv_runs(&grouped_cases()[10], false, false);
    let bf = runs.iter().find(|r| r.name.ends_with("backprop_filter")).unwrap();
    assert!(bf.kernel.describe.contains("tiles of 32 channels x 8 rows"), "{}", bf.kernel.describe);
    for k in large_kernels() {
        assert!(k.source.contains("long long"), "{}: 64-bit indices", k.describe);
    }
    let k = many_tiles();
    assert_eq!(k.launches[0].grid, [1 << 16, 1, 1], "{}", k.describe);
    assert!(k.source.contains("tile += (int)gridDim.x"), "{}", k.source);
    let small = &grouped_cases()[0];
    for r in conv_runs(small, true, false) {
        assert!(!r.kernel.source.contains("long long"), "{}", r.name);
    }
}

/// Kernels too large to run on the host: 2^30-element activations (64-bit indices).
fn large_kernels() -> Vec<CudaKernel> {
    let mut v = Vec::new();
    let big = [
        ("depthwise_large", [64usize, 256, 256, 256], win([3, 3], [1, 1], Padding::Same).grouped(256), 256),
        (
            "dilated_grouped_large",
            [16, 256, 256, 1024],
            win([3, 3], [2, 2], explicit([2, 1], [1, 2])).dilated([2, 2]).grouped(4),
            64,
        ),
    ];
    for (_, x, window, f) in big {
        let g = Geo::new(x, &window, f);
        let (xs, ws, ys) = (shape(g.x_shape()), shape(g.w_shape()), shape(g.y_shape()));
        v.push(kernel_of(&Op::Conv2d { window }, &[xs.clone(), ws.clone()], &ys, false).0);
        let input = Op::Conv2dBackpropInput { window, input: xs.clone() };
        v.push(kernel_of(&input, &[ys.clone(), ws.clone()], &xs, false).0);
        let relu = Op::Conv2dBackpropInputReluGrad { window, input: xs.clone() };
        v.push(kernel_of(&relu, &[ys.clone(), ws.clone(), xs.clone(), xs.clone()], &xs, false).0);
        v.push(kernel_of(&Op::Conv2dBackpropFilter { window }, &[xs, ys], &ws, false).0);
    }
    v
}

/// A filter gradient of more tiles than a grid has blocks (the block-stride loop): a dilated
/// 5x5 over 1024 channels into 1024 filters, 25 * 1024 * 32 = 819200 tiles of 32 channels.
fn many_tiles() -> CudaKernel {
    let window = win([5, 5], [1, 1], Padding::Same).dilated([2, 2]);
    let g = Geo::new([1, 8, 8, 1024], &window, 1024);
    let (xs, ws, ys) = (shape(g.x_shape()), shape(g.w_shape()), shape(g.y_shape()));
    kernel_of(&Op::Conv2dBackpropFilter { window }, &[xs, ys], &ws, false).0
}

/// Every kernel of these tests compiles with NVRTC to PTX for sm_90 (skipped without NVRTC,
/// unless `KILN_REQUIRE_NVRTC=1`).
#[test]
fn every_kernel_here_compiles_with_nvrtc() {
    use kiln_runtime::cuda::{NvrtcCompiler, probe};
    let nvrtc = match probe::nvrtc() {
        Ok(info) => {
            eprintln!("NVRTC {}.{} from {}", info.version.0, info.version.1, info.location);
            NvrtcCompiler::new((9, 0)).expect("NVRTC loads").with_disk_cache(None)
        }
        Err(e) => {
            if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}");
            }
            eprintln!("skipped: no NVRTC ({e})");
            return;
        }
    };
    let mut kernels: Vec<CudaKernel> = Vec::new();
    for cc in grouped_cases().iter().chain(&random_cases()).chain(&dense_explicit_cases()) {
        kernels.extend(conv_runs(cc, true, true).into_iter().map(|r| r.kernel));
    }
    kernels.extend(pool_runs().into_iter().map(|r| r.kernel));
    kernels.extend(large_kernels());
    kernels.push(many_tiles());
    let mut seen = std::collections::HashSet::new();
    kernels.retain(|k| seen.insert(k.source.clone()));
    let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
    let ptx = nvrtc.compile_all(&sources).unwrap_or_else(|e| panic!("{e}"));
    for (k, p) in kernels.iter().zip(&ptx) {
        assert!(p.contains(".target sm_90"), "{}: PTX not for sm_90", k.describe);
        for l in &k.launches {
            assert!(
                p.contains(&format!(".entry {}", l.function)),
                "{}: no entry `{}`",
                k.describe,
                l.function
            );
        }
    }
    let direct = kernels.iter().filter(|k| k.describe.contains("direct")).count();
    eprintln!("{} kernels ({direct} direct) compiled to PTX for sm_90", kernels.len());
}
