//! 2-D convolution (NHWC activations, HWIO filters) and its two gradients, all three as implicit
//! GEMMs on the kernels of `gemm`: the "im2col" matrix is never built, its elements are gathered
//! (with zero padding) by the loaders, so no scratch memory is needed.
//!
//! - forward: out[N·OH·OW, F] = X[N·OH·OW, KH·KW·C] · W[KH·KW·C, F]; the filter is that matrix
//!   already, X(m, k) is x[n, oh·sh - ph + kh, ow·sw - pw + kw, c] or 0 in the padding.
//! - input gradient: dx[N·H·W, C] = dY[N·H·W, KH·KW·F] · Wᵀ; dY(m, k) is dy[n, oh, ow, f] with
//!   oh = (ih + ph - kh) / sh where that division is exact and lands inside the output, else 0.
//!   Each dx element is one dot product: no atomics, deterministic. With stride s, all but
//!   1/s² of those products are zeros; the gradient of a strided convolution costs s² times more
//!   arithmetic than needed, which keeps the kernel simple.
//! - filter gradient: dw[KH·KW·C, F] = Xᵀ[KH·KW·C, N·OH·OW] · dY[N·OH·OW, F]: K is the whole
//!   batch of output positions and the output small, which is what the K-parallel GEMM is for
//!   (every block reduces its outputs over all positions; deterministic, see `gemm`).
//!
//! Dense windows only (one group, taps next to each other): `grouped_conv` has the kernels of
//! grouped, depthwise and dilated convolutions, and `cuda::generate` routes them there.
//!
//! Padding follows `Window2d::out_and_pad` (TensorFlow's SAME split, or `Padding::Explicit`'s
//! pads), as the CPU kernels do. Only the padding before (ph, pw) enters the index arithmetic;
//! the padding after is implied by the output extent (OH, OW), and the loaders test each index
//! against 0 and the input's extent (`Geom::inside`, the input gradient's conditions), so
//! asymmetric pads (before != after, either side 0) need nothing more. The bounds checks that a
//! geometry cannot fail are left out of the source.

use super::codegen::{Code, Elems, header, idx_type, int};
use super::elementwise::Map;
use super::gemm::{Epilogue, Gemm, Operand, Sink};
use super::{Arg, CudaKernel};
use crate::geometry::Geom;
use kiln_compiler::ir::fused::{Fused, Inst, Ref};
use kiln_compiler::ir::{BinaryOp, Shape, Window2d};

impl Geom {
    /// Conditions under which input row `ih` / column `iw` (of output position and tap) is
    /// inside the input, "" when it always is.
    fn inside(&self) -> String {
        let mut conds = Vec::new();
        for (var, pad, out, stride, k, extent) in [
            ("ih", self.ph, self.oh, self.sh, self.kh, self.h),
            ("iw", self.pw, self.ow, self.sw, self.kw, self.w),
        ] {
            if pad > 0 {
                conds.push(format!("{var} >= 0"));
            }
            if (out - 1) * stride + k > extent + pad {
                conds.push(format!("{var} < {extent}"));
            }
        }
        conds.join(" && ")
    }
}

/// Coordinates of linear index `var` over `dims` (outer first), as expressions.
fn coords(var: &str, dims: &[usize]) -> Vec<String> {
    (0..dims.len())
        .map(|a| {
            if dims[a] == 1 {
                return "0".to_string();
            }
            let inner: usize = dims[a + 1..].iter().product();
            let base = if inner == 1 { var.to_string() } else { format!("{var} / {}", int(inner)) };
            match (a, inner) {
                (0, _) => base,
                (_, 1) => format!("{base} % {}", dims[a]),
                _ => format!("({base}) % {}", dims[a]),
            }
        })
        .collect()
}

/// `const T name = expr;` for each (name, expr).
fn lets(ty: &str, names: &[&str], exprs: &[String]) -> String {
    names.iter().zip(exprs).map(|(n, e)| format!("const {ty} {n} = {e};")).collect::<Vec<_>>().join("\n")
}

/// Reads x at (n_, ih, iw, c_) when inside, into v.
fn read_x(g: &Geom, ty: &str) -> String {
    let inside = g.inside();
    let read = format!("v = src[((n_ * {} + ih) * {} + iw) * {} + c_];", int(g.h), int(g.w), int(g.c));
    let at = |o: &str, s: usize, k: &str, p: usize| {
        let scaled = if s == 1 { o.to_string() } else { format!("{o} * {s}") };
        if p == 0 { format!("{scaled} + {k}") } else { format!("{scaled} + {k} - {p}") }
    };
    let mut s = format!(
        "const {ty} ih = {};\nconst {ty} iw = {};\n",
        at("oh_", g.sh, "kh_", g.ph),
        at("ow_", g.sw, "kw_", g.pw)
    );
    if inside.is_empty() {
        s.push_str(&read);
    } else {
        s.push_str(&format!("if ({inside}) {read}"));
    }
    s
}

fn zeros(name: &str, head: String, describe: String, out: &Shape, elems: &Elems) -> CudaKernel {
    let mut k = Map {
        name,
        header: head,
        describe: describe.clone(),
        out: out.dims(),
        strides: Vec::new(),
        max_operand: out.numel(),
        expr: "0.0f".into(),
        in_place: false,
        elems: elems.select(&[]),
        ..Default::default()
    }
    .generate();
    k.describe = format!("{describe} (empty contraction: zeros)");
    k
}

fn finish(head: String, gemm: Gemm, describe: String) -> CudaKernel {
    let mut c = Code::new();
    c.line(head);
    let (launches, tiling) = gemm.generate(&mut c);
    CudaKernel { source: c.finish(), launches, describe: format!("{describe} ({tiling})") }
}

/// The implicit GEMM's (M, N, K) of each convolution kernel.
pub(crate) fn forward_dims(g: &Geom) -> (usize, usize, usize) {
    (g.n * g.oh * g.ow, g.f, g.kh * g.kw * g.c)
}

pub(crate) fn backprop_input_dims(g: &Geom) -> (usize, usize, usize) {
    (g.n * g.h * g.w, g.c, g.kh * g.kw * g.f)
}

pub(crate) fn backprop_filter_dims(g: &Geom) -> (usize, usize, usize) {
    (g.kh * g.kw * g.c, g.f, g.n * g.oh * g.ow)
}

pub(crate) fn conv2d(
    label: &str,
    x: &Shape,
    w: &Shape,
    window: &Window2d,
    out: &Shape,
    (scratch, elems): (usize, &Elems),
) -> CudaKernel {
    conv2d_then(label, (x, w), window, out, (scratch, elems), None)
}

/// A convolution with an elementwise epilogue (`Fused::conv`): the GEMM applies the program to
/// every output element as it stores it, reading the op's other operands (`extra`, from operand
/// 2 on) beside it.
pub(crate) fn fused_conv2d(
    label: &str,
    program: &Fused,
    window: &Window2d,
    operands: &[&Shape],
    out: &Shape,
    (scratch, elems): (usize, &Elems),
) -> CudaKernel {
    conv2d_then(
        label,
        (operands[0], operands[1]),
        window,
        out,
        (scratch, elems),
        Some((program, &operands[2..])),
    )
}

fn conv2d_then(
    label: &str,
    (x, w): (&Shape, &Shape),
    window: &Window2d,
    out: &Shape,
    (scratch, elems): (usize, &Elems),
    epilogue: Option<(&Fused, &[&Shape])>,
) -> CudaKernel {
    let g = Geom::new(x, window, w.dims()[3]);
    debug_assert!(g.is_dense(), "non-dense windows go to grouped_conv");
    let mut all = vec![x, w];
    all.extend(epilogue.map_or(&[][..], |(_, extra)| extra));
    let head = header(label, &all, Some(out));
    let describe = match epilogue {
        Some((program, _)) => format!("conv2d {} then fused({} ops)", g.text(), program.insts.len()),
        None => format!("conv2d {}", g.text()),
    };
    let (m, n, k) = forward_dims(&g);
    // (A fused convolution's factors are never empty: `ir::infer` refuses them.)
    if k == 0 {
        return zeros("kiln_conv2d", head, describe, out, elems);
    }
    let ty = idx_type(all.iter().map(|s| s.numel()).max().unwrap_or(0).max(out.numel()));
    let mut a_load = lets(ty, &["n_", "oh_", "ow_"], &coords("gr", &[g.n, g.oh, g.ow]));
    a_load.push('\n');
    a_load.push_str(&lets(ty, &["kh_", "kw_", "c_"], &coords("gk", &[g.kh, g.kw, g.c])));
    a_load.push('\n');
    a_load.push_str(&read_x(&g, ty));
    let b_load = format!("v = src[gk * {} + gr];", int(g.f));
    let gemm = Gemm {
        name: "kiln_conv2d".into(),
        m,
        n,
        k,
        batch: 1,
        a: Operand { k_contiguous: true, load: a_load, batch_offset: "0".into(), plain: None },
        b: Operand { k_contiguous: false, load: b_load, batch_offset: "0".into(), plain: None },
        ty,
        args: [Arg::Input(0), Arg::Input(1)],
        sink: Sink::of(epilogue, out, (ty, elems)),
        scratch,
        elems: elems.clone(),
    };
    finish(head, gemm, describe)
}

/// What a convolution's input gradient goes through before it is stored.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum InputGradient {
    /// Nothing (`Op::Conv2dBackpropInput`, operands (dy, w)).
    Plain,
    /// ReLU's gradient (`Op::Conv2dBackpropInputReluGrad`, operands (dy, w, y)): `y > 0 ? dx : 0`.
    ReluGrad,
    /// A residual gradient's sum, then ReLU's gradient (operands (dy, w, y, r)):
    /// `y > 0 ? r + dx : 0`.
    ResidualReluGrad,
}

/// The epilogue that takes an input gradient element `x0` (at linear index `i` of dx) through
/// `then`, reading y (and r) from the launch arguments `Input(2)` (and `Input(3)`): None for
/// `InputGradient::Plain`. Shared with the direct kernels of non-dense windows (`grouped_conv`).
///
/// `elems` are the op's types (y is its operand 2, r its operand 3).
pub(crate) fn input_gradient_epilogue(
    then: InputGradient,
    dx: &Shape,
    (ty, elems): (&str, &Elems),
) -> Option<Epilogue> {
    // Program operand j >= 1 is the op's operand j + 1.
    let elems = &elems.shifted(1);
    match then {
        InputGradient::Plain => None,
        InputGradient::ReluGrad => {
            let program = Fused::elementwise(
                dx.clone(),
                vec![Inst::Binary(BinaryOp::ReluGrad, Ref::Operand(1), Ref::Operand(0))],
            );
            Some(Epilogue {
                definition: super::elementwise::epilogue_function(&program, &[dx, dx], (ty, elems), ""),
                extra: vec![Arg::Input(2)],
            })
        }
        InputGradient::ResidualReluGrad => {
            // x0 the product, x1 y, x2 r: relu_grad(y, r + dx).
            let program = Fused::elementwise(
                dx.clone(),
                vec![
                    Inst::Binary(BinaryOp::Add, Ref::Operand(2), Ref::Operand(0)),
                    Inst::Binary(BinaryOp::ReluGrad, Ref::Operand(1), Ref::Value(0)),
                ],
            );
            Some(Epilogue {
                definition: super::elementwise::epilogue_function(&program, &[dx, dx, dx], (ty, elems), ""),
                extra: vec![Arg::Input(2), Arg::Input(3)],
            })
        }
    }
}

/// The convolution's input gradient; through ReLU's gradient (and a residual gradient's sum)
/// the GEMM stores it through an epilogue (`gemm::Sink::Epilogue`), each element's y and r read
/// by the thread that stores it, so dx may be y's or r's own buffer.
pub(crate) fn backprop_input(
    label: &str,
    dy: &Shape,
    w: &Shape,
    window: &Window2d,
    dx: &Shape,
    (scratch, elems): (usize, &Elems),
    then: InputGradient,
) -> CudaKernel {
    let g = Geom::new(dx, window, w.dims()[3]);
    debug_assert!(g.is_dense(), "non-dense windows go to grouped_conv");
    let operands: Vec<&Shape> = match then {
        InputGradient::Plain => vec![dy, w],
        InputGradient::ReluGrad => vec![dy, w, dx],
        InputGradient::ResidualReluGrad => vec![dy, w, dx, dx],
    };
    let head = header(label, &operands, Some(dx));
    let describe = format!(
        "conv2d_backprop_input {}{}",
        g.text(),
        match then {
            InputGradient::Plain => "",
            InputGradient::ReluGrad => " then relu_grad",
            InputGradient::ResidualReluGrad => " plus a residual then relu_grad",
        }
    );
    let (m, n, k) = backprop_input_dims(&g);
    if k == 0 {
        // No tap reads the input: dx is 0, and so is its ReLU gradient.
        return zeros("kiln_conv2d_backprop_input", head, describe, dx, elems);
    }
    let ty = idx_type(dy.numel().max(w.numel()).max(dx.numel()));
    let mut a = lets(ty, &["n_", "ih_", "iw_"], &coords("gr", &[g.n, g.h, g.w]));
    a.push('\n');
    a.push_str(&lets(ty, &["kh_", "kw_", "f_"], &coords("gk", &[g.kh, g.kw, g.f])));
    a.push('\n');
    // th = oh * sh exactly, for an output row oh inside the output.
    let mut conds = Vec::new();
    let mut defs = Vec::new();
    for (t, i, kk, pad, stride, k_ext, extent, out_ext) in
        [("th", "ih_", "kh_", g.ph, g.sh, g.kh, g.h, g.oh), ("tw", "iw_", "kw_", g.pw, g.sw, g.kw, g.w, g.ow)]
    {
        defs.push(if pad > 0 {
            format!("const {ty} {t} = {i} + {pad} - {kk};")
        } else {
            format!("const {ty} {t} = {i} - {kk};")
        });
        if k_ext - 1 > pad {
            conds.push(format!("{t} >= 0"));
        }
        if stride > 1 {
            conds.push(format!("{t} % {stride} == 0"));
        }
        if extent - 1 + pad >= out_ext * stride {
            conds.push(format!("{t} < {}", out_ext * stride));
        }
    }
    a.push_str(&defs.join("\n"));
    a.push('\n');
    let oh = if g.sh > 1 { format!("th / {}", g.sh) } else { "th".into() };
    let ow = if g.sw > 1 { format!("tw / {}", g.sw) } else { "tw".into() };
    let read =
        format!("v = src[(((n_ * {}) + {oh}) * {} + {ow}) * {} + f_];", int(g.oh), int(g.ow), int(g.f));
    if conds.is_empty() {
        a.push_str(&read);
    } else {
        a.push_str(&format!("if ({}) {read}", conds.join(" && ")));
    }
    // B(k, c) = w[kh, kw, c, f] with k = (kh, kw, f).
    let b_load = format!("v = src[(gk / {f} * {} + gr) * {f} + gk % {f}];", int(g.c), f = int(g.f));
    let gemm = Gemm {
        name: "kiln_conv2d_backprop_input".into(),
        m,
        n,
        k,
        batch: 1,
        a: Operand { k_contiguous: true, load: a, batch_offset: "0".into(), plain: None },
        b: Operand { k_contiguous: true, load: b_load, batch_offset: "0".into(), plain: None },
        ty,
        args: [Arg::Input(0), Arg::Input(1)],
        sink: input_gradient_epilogue(then, dx, (ty, elems)).map_or(Sink::Output, Sink::Epilogue),
        scratch,
        elems: elems.clone(),
    };
    finish(head, gemm, describe)
}

pub(crate) fn backprop_filter(
    label: &str,
    x: &Shape,
    dy: &Shape,
    window: &Window2d,
    dw: &Shape,
    (scratch, elems): (usize, &Elems),
) -> CudaKernel {
    let g = Geom::new(x, window, dy.dims()[3]);
    debug_assert!(g.is_dense(), "non-dense windows go to grouped_conv");
    let head = header(label, &[x, dy], Some(dw));
    let describe = format!("conv2d_backprop_filter {}", g.text());
    let (m, n, k) = backprop_filter_dims(&g);
    if k == 0 {
        return zeros("kiln_conv2d_backprop_filter", head, describe, dw, elems);
    }
    let ty = idx_type(x.numel().max(dy.numel()).max(dw.numel()));
    let mut a_load = lets(ty, &["kh_", "kw_", "c_"], &coords("gr", &[g.kh, g.kw, g.c]));
    a_load.push('\n');
    a_load.push_str(&lets(ty, &["n_", "oh_", "ow_"], &coords("gk", &[g.n, g.oh, g.ow])));
    a_load.push('\n');
    a_load.push_str(&read_x(&g, ty));
    let b_load = format!("v = src[gk * {} + gr];", int(g.f));
    let gemm = Gemm {
        name: "kiln_conv2d_backprop_filter".into(),
        m,
        n,
        k,
        batch: 1,
        a: Operand { k_contiguous: false, load: a_load, batch_offset: "0".into(), plain: None },
        b: Operand { k_contiguous: false, load: b_load, batch_offset: "0".into(), plain: None },
        ty,
        args: [Arg::Input(0), Arg::Input(1)],
        sink: Sink::Output,
        scratch,
        elems: elems.clone(),
    };
    finish(head, gemm, describe)
}
