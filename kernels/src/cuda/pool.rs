//! 2-D max and average pooling over NHWC tensors, and their gradients, one thread per element.
//!
//! Windows follow `Window2d::out_and_pad` (TensorFlow's SAME split, or `Padding::Explicit`'s
//! pads, asymmetric ones included: only the padding before enters the index arithmetic, the
//! padding after is implied by the output extent). Each window is clipped to the input, so a
//! maximum never sees the padding (as if it were -inf) and average pooling divides by the number
//! of in-bounds elements, as 1 / count times the sum (the CPU's rounding).
//!
//! - forward: a thread per output element (n, oh, ow, c) walks its window in row-major order;
//!   c is innermost, so a warp reads 32 adjacent channels.
//! - gradient: a thread per input element gathers from the windows that contain it (output rows
//!   ceil((ih + ph - kh + 1) / sh) ..= (ih + ph) / sh, likewise columns), in row-major window
//!   order, which is the order in which the CPU adds into it. No atomics, and the result is
//!   bitwise the CPU's. For max, the thread recomputes each containing window's first maximum
//!   (strictly greater replaces, as TensorFlow routes gradients) and takes that window's dy when
//!   the maximum is its own element: (windows containing it) x (window size) reads, 4 for the
//!   usual 2x2 stride-2 pool, 81 for 3x3 stride 1.

use super::codegen::{BLOCK, Code, Elems, grid_for, grid_loop, header, idx_type, int, params, shape_text};
use super::{Arg, CudaKernel, Launch, math};
use crate::geometry::Geom;
use kiln_compiler::ir::{PoolKind, Shape, Window2d};

impl Geom {
    /// Emits the in-bounds window rows h0..h1 and columns w0..w1 of output (oh, ow).
    fn emit_window(&self, c: &mut Code, oh: &str, ow: &str) {
        for (v, o, s, p, k, e) in
            [("h", oh, self.sh, self.ph, self.kh, self.h), ("w", ow, self.sw, self.pw, self.kw, self.w)]
        {
            c.line(format!("const int {v}s = {o} * {s} - {p};"));
            c.line(format!("const int {v}0 = {v}s < 0 ? 0 : {v}s;"));
            c.line(format!("const int {v}1 = {v}s + {k} > {e} ? {e} : {v}s + {k};"));
        }
    }

    /// `best`, `bh`, `bw`: the first maximum of x (`in0`) over rows h0..h1 and columns w0..w1
    /// of image `n_` at channel `c_`, in row-major order (strictly greater replaces, as
    /// TensorFlow routes gradients).
    fn emit_first_max(&self, c: &mut Code) {
        c.line("// the window's first maximum, in row-major order");
        c.line(format!("float best = in0[{}];", self.pixel("n_", "h0", "w0")));
        c.line("int bh = h0, bw = w0;");
        c.line("for (int ih = h0; ih < h1; ++ih) {");
        c.line("for (int iw = w0; iw < w1; ++iw) {");
        c.line(format!("const float v = in0[{}];", self.pixel("n_", "ih", "iw")));
        c.line("if (v > best) {");
        c.line("best = v; bh = ih; bw = iw;");
        c.line("}");
        c.line("}");
        c.line("}");
    }

    fn pixel(&self, n: &str, ih: &str, iw: &str) -> String {
        format!("(({n} * {} + {ih}) * {} + {iw}) * {} + c_", int(self.h), int(self.w), int(self.c))
    }
}

pub(crate) fn pool2d(
    kind: PoolKind,
    name: &str,
    label: &str,
    x: &Shape,
    window: &Window2d,
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let g = Geom::pool(x, window);
    let ty = idx_type(x.numel());
    let work = out.numel();
    let fname = format!("kiln_{name}");
    let mut c = Code::new();
    c.line(header(label, &[x], Some(out)));
    if kind == PoolKind::Max {
        c.line(math::prelude("kiln_max_nan"));
    }
    c.line(format!("extern \"C\" __global__ void {fname}({}) {{", params(elems, 1, true, true)));
    c.line(grid_loop(ty, "e", work));
    c.line(format!("const int c_ = (int)(e % {});", g.c));
    c.line(format!("{ty} q = e / {};", g.c));
    c.line(format!("const int ow_ = (int)(q % {}); q /= {};", g.ow, g.ow));
    c.line(format!("const int oh_ = (int)(q % {});", g.oh));
    c.line(format!("const {ty} n_ = q / {};", g.oh));
    g.emit_window(&mut c, "oh_", "ow_");
    match kind {
        PoolKind::Max => c.line("float acc = __int_as_float(0xff800000);"),
        PoolKind::Avg => c.line("float acc = 0.0f;"),
    };
    c.line("for (int ih = h0; ih < h1; ++ih) {");
    c.line("for (int iw = w0; iw < w1; ++iw) {");
    c.line(format!("const float v = in0[{}];", g.pixel("n_", "ih", "iw")));
    match kind {
        PoolKind::Max => c.line("acc = kiln_max_nan(acc, v);"),
        PoolKind::Avg => c.line("acc += v;"),
    };
    c.line("}");
    c.line("}");
    if kind == PoolKind::Avg {
        c.line("acc *= 1.0f / (float)((h1 - h0) * (w1 - w0));");
    }
    c.line("out[e] = acc;");
    c.line("}");
    c.line("}");
    one_launch(
        c,
        fname,
        work,
        vec![Arg::Input(0), Arg::Output],
        format!("{name} {} {}", g.text(), shape_text(x)),
    )
}

pub(crate) fn pool2d_grad(
    kind: PoolKind,
    name: &str,
    label: &str,
    x: &Shape,
    window: &Window2d,
    dy: &Shape,
    elems: &Elems,
) -> CudaKernel {
    grad(kind, name, label, (x, dy), window, true, elems)
}

/// Average pooling's gradient from dy alone (`Op::AvgPool2dGrad`): `input` is the pooled
/// input's shape, dy the only operand.
pub(crate) fn avg_pool2d_grad(
    name: &str,
    label: &str,
    input: &Shape,
    window: &Window2d,
    dy: &Shape,
    elems: &Elems,
) -> CudaKernel {
    grad(PoolKind::Avg, name, label, (input, dy), window, false, elems)
}

/// dx over x's shape; with `with_x` the operands are (x, dy), else (dy) and the kind is Avg.
fn grad(
    kind: PoolKind,
    name: &str,
    label: &str,
    (x, dy): (&Shape, &Shape),
    window: &Window2d,
    with_x: bool,
    elems: &Elems,
) -> CudaKernel {
    let dy_in = if with_x { "in1" } else { "in0" };
    let g = Geom::pool(x, window);
    if kind == PoolKind::Max && with_x && g.tiles() {
        return max_grad_tiled(name, label, (x, dy), &g, elems);
    }
    let ty = idx_type(x.numel().max(dy.numel()));
    let work = x.numel();
    let fname = format!("kiln_{name}");
    let mut c = Code::new();
    let operands: Vec<&Shape> = if with_x { vec![x, dy] } else { vec![dy] };
    c.line(header(label, &operands, Some(x)));
    c.line(format!("extern \"C\" __global__ void {fname}({}) {{", params(elems, operands.len(), true, true)));
    c.line(grid_loop(ty, "e", work));
    c.line(format!("const int c_ = (int)(e % {});", g.c));
    c.line(format!("{ty} q = e / {};", g.c));
    c.line(format!("const int iw_ = (int)(q % {}); q /= {};", g.w, g.w));
    c.line(format!("const int ih_ = (int)(q % {});", g.h));
    c.line(format!("const {ty} n_ = q / {};", g.h));
    c.line("// the output rows and columns whose windows contain (ih_, iw_)");
    for (v, i, p, k, s, o) in [("oh", "ih_", g.ph, g.kh, g.sh, g.oh), ("ow", "iw_", g.pw, g.kw, g.sw, g.ow)] {
        let shift = p as isize - k as isize + 1;
        let sign = if shift < 0 { '-' } else { '+' };
        c.line(format!("const int {v}t = {i} {sign} {};", shift.unsigned_abs()));
        c.line(format!("const int {v}_lo = {v}t <= 0 ? 0 : ({v}t + {}) / {s};", s - 1));
        c.line(format!("const int {v}u = ({i} + {p}) / {s};"));
        c.line(format!("const int {v}_hi = {v}u > {} ? {} : {v}u;", o - 1, o - 1));
    }
    c.line("float acc = 0.0f;");
    c.line("for (int oh = oh_lo; oh <= oh_hi; ++oh) {");
    c.line("for (int ow = ow_lo; ow <= ow_hi; ++ow) {");
    g.emit_window(&mut c, "oh", "ow");
    c.line(format!(
        "const float d = {dy_in}[(({} * n_ + oh) * {} + ow) * {} + c_];",
        int(g.oh),
        int(g.ow),
        int(g.c)
    ));
    match kind {
        PoolKind::Max => {
            g.emit_first_max(&mut c);
            c.line("if (bh == ih_ && bw == iw_) acc += d;");
        }
        PoolKind::Avg => {
            c.line("acc += __fmul_rn(d, 1.0f / (float)((h1 - h0) * (w1 - w0)));");
        }
    }
    c.line("}");
    c.line("}");
    c.line("out[e] = acc;");
    c.line("}");
    c.line("}");
    one_launch(
        c,
        fname,
        work,
        (0..operands.len()).map(Arg::Input).chain([Arg::Output]).collect(),
        format!("{name} {} {} (gather over windows)", g.text(), shape_text(x)),
    )
}

/// Max pooling's gradient where the windows tile x: a thread per window and channel finds the
/// window's first maximum, then writes the window's dx (0.0 + dy at the maximum, 0.0 elsewhere:
/// the bits of the gather kernel and the CPU's). Each thread reads its window's x before writing
/// its dx, and no two windows share an element, so dx may be x's own buffer (`Op::may_write_over`):
/// the pointers are not `__restrict__`.
fn max_grad_tiled(name: &str, label: &str, (x, dy): (&Shape, &Shape), g: &Geom, elems: &Elems) -> CudaKernel {
    let ty = idx_type(x.numel().max(dy.numel()));
    let work = dy.numel();
    let fname = format!("kiln_{name}");
    let mut c = Code::new();
    c.line(header(label, &[x, dy], Some(x)));
    c.line(format!("extern \"C\" __global__ void {fname}({}) {{", params(elems, 2, true, false)));
    c.line(grid_loop(ty, "e", work));
    c.line(format!("const int c_ = (int)(e % {});", g.c));
    c.line(format!("{ty} q = e / {};", g.c));
    c.line(format!("const int ow = (int)(q % {}); q /= {};", g.ow, g.ow));
    c.line(format!("const int oh = (int)(q % {});", g.oh));
    c.line(format!("const {ty} n_ = q / {};", g.oh));
    c.line("const float d = in1[e];");
    c.line(format!("const int h0 = oh * {}, w0 = ow * {};", g.kh, g.kw));
    c.line(format!("const int h1 = h0 + {}, w1 = w0 + {};", g.kh, g.kw));
    g.emit_first_max(&mut c);
    c.line("for (int ih = h0; ih < h1; ++ih) {");
    c.line("for (int iw = w0; iw < w1; ++iw) {");
    c.line(format!("out[{}] = (ih == bh && iw == bw) ? 0.0f + d : 0.0f;", g.pixel("n_", "ih", "iw")));
    c.line("}");
    c.line("}");
    c.line("}");
    c.line("}");
    one_launch(
        c,
        fname,
        work,
        vec![Arg::Input(0), Arg::Input(1), Arg::Output],
        format!("{name} {} {} (a window per thread)", g.text(), shape_text(x)),
    )
}

/// A kernel of one launch, `BLOCK` threads a block and enough blocks for `work` elements.
fn one_launch(c: Code, function: String, work: usize, args: Vec<Arg>, describe: String) -> CudaKernel {
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function,
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args,
        }],
        describe,
    }
}
