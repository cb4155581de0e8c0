//! Softmax and log-softmax along one axis, numerically stable: the row maximum is subtracted
//! before exponentiating, and the sum of exponentials accumulates in f64, as on the CPU.
//!
//! The input is [outer, n, inner] around the axis.
//! - inner == 1 (the usual last axis): S threads per row, S = 1 for rows of at most 8 elements,
//!   a warp up to 1024, else 256 threads (1024 when few rows). Three passes over the row (max,
//!   sum, write); the row stays in L1/L2 between them. Results of the passes reach every thread
//!   of the row through an xor-butterfly (warp) and, across warps, a shared array that every
//!   thread combines in the same order, so all threads hold the same bits.
//! - inner > 1: a thread per column (outer x inner), walking the n elements with stride inner;
//!   adjacent threads read adjacent addresses.
//!
//! The formulas are the CPU's, which differ between its two paths: along a contiguous row
//! log-softmax is (x - max) - log(sum) and softmax e^(x - max) * f32(1 / sum); along a strided
//! column log-softmax is x - (max + log(sum)).

use super::codegen::{BLOCK, Code, Elems, grid_for, grid_loop, header, idx_type, int, params, shape_text};
use super::{Arg, CudaKernel, Launch, math};
use kiln_compiler::ir::Shape;

const NEG_INF: &str = "__int_as_float(0xff800000)";

pub(crate) fn softmax(label: &str, x: &Shape, axis: usize, log: bool, elems: &Elems) -> CudaKernel {
    let dims = x.dims();
    let (outer, n, inner): (usize, usize, usize) =
        (dims[..axis].iter().product(), dims[axis], dims[axis + 1..].iter().product());
    let name = if log { "log_softmax" } else { "softmax" };
    let describe = format!("{name}[axis {axis}] {}", shape_text(x));
    let ty = idx_type(x.numel());
    let mut c = Code::new();
    c.line(header(label, &[x], Some(x)));
    c.line(math::prelude("kiln_max_nan"));
    let fname = format!("kiln_{name}");
    c.line(format!("extern \"C\" __global__ void {fname}({}) {{", params(elems, 1, true, true)));
    let (launch, how) = if inner == 1 {
        rows(&mut c, (ty, elems), outer, n, log, &fname)
    } else {
        columns(&mut c, (ty, elems), outer, n, inner, log, &fname)
    };
    c.line("}");
    CudaKernel { source: c.finish(), launches: vec![launch], describe: format!("{describe} ({how})") }
}

fn row_slices(rows: usize, n: usize) -> usize {
    if n <= 8 {
        1
    } else if n <= 1024 {
        32
    } else if n >= 16384 && rows < 264 {
        1024
    } else {
        256
    }
}

/// Emits the all-reduce of variable `v` (type `t`) over the S threads of a row.
fn all_reduce(c: &mut Code, s: usize, v: &str, combine: impl Fn(&str, &str) -> String, shared: &str) {
    if s == 1 {
        return;
    }
    c.line("for (int d = 16; d > 0; d >>= 1) {");
    c.line(format!("{v} = {};", combine(v, &format!("__shfl_xor_sync(0xffffffffu, {v}, d)"))));
    c.line("}");
    if s > 32 {
        c.line(format!("if (slice % 32 == 0) {shared}[slice / 32] = {v};"));
        c.line("__syncthreads();");
        c.line(format!("{v} = {shared}[0];"));
        c.line(format!(
            "for (int w = 1; w < {}; ++w) {v} = {};",
            s / 32,
            combine(v, &format!("{shared}[w]"))
        ));
        c.line("__syncthreads();");
    }
}

fn rows(
    c: &mut Code,
    (ty, elems): (&str, &Elems),
    outer: usize,
    n: usize,
    log: bool,
    fname: &str,
) -> (Launch, String) {
    let s = row_slices(outer, n);
    let per_block = if s >= 256 { 1 } else { 256 / s };
    let groups = outer.div_ceil(per_block);
    if s > 32 {
        c.line(format!("__shared__ float wmax[{}];", s / 32));
        c.line(format!("__shared__ double wsum[{}];", s / 32));
    }
    if s > 1 {
        c.line(format!("const int slice = threadIdx.x % {s};"));
    }
    let o = if per_block > 1 {
        c.line(format!("const int lane = threadIdx.x / {s};"));
        format!("group * {per_block} + lane")
    } else {
        "group".to_string()
    };
    c.line(format!("for ({ty} group = blockIdx.x; group < {}; group += gridDim.x) {{", int(groups)));
    c.line(format!("const {ty} o = {o};"));
    c.line(format!("const bool active = o < {};", int(outer)));
    c.line(format!("const {}* x = in0 + (active ? o : 0) * {};", elems.input(0), int(n)));
    c.line(format!("{}* y = out + (active ? o : 0) * {};", elems.output(), int(n)));
    let (start, step) =
        if s == 1 { ("0".to_string(), "++j".to_string()) } else { ("slice".into(), format!("j += {s}")) };
    let each = format!("for ({ty} j = {start}; active && j < {}; {step}) {{", int(n));
    c.line(format!("float m = {NEG_INF};"));
    c.line(&each);
    c.line("m = kiln_max_nan(m, x[j]);");
    c.line("}");
    all_reduce(c, s, "m", |a, b| format!("kiln_max_nan({a}, {b})"), "wmax");
    c.line("double sum = 0.0;");
    c.line(&each);
    c.line("sum += (double)expf(x[j] - m);");
    c.line("}");
    all_reduce(c, s, "sum", |a, b| format!("{a} + {b}"), "wsum");
    if log {
        c.line("const float lse = (float)log(sum);");
        c.line(&each);
        c.line("y[j] = (x[j] - m) - lse;");
    } else {
        c.line("const float scale = (float)(1.0 / sum);");
        c.line(&each);
        c.line("y[j] = expf(x[j] - m) * scale;");
    }
    c.line("}");
    c.line("}");
    let launch = Launch {
        function: fname.into(),
        grid: grid_for(groups, 1),
        block: [(s * per_block) as u32, 1, 1],
        shared_bytes: 0,
        args: vec![Arg::Input(0), Arg::Output],
    };
    (launch, format!("{s} threads per row"))
}

fn columns(
    c: &mut Code,
    (ty, elems): (&str, &Elems),
    outer: usize,
    n: usize,
    inner: usize,
    log: bool,
    fname: &str,
) -> (Launch, String) {
    let work = outer * inner;
    c.line(grid_loop(ty, "o", work));
    c.line(format!("const {ty} base = (o / {}) * {} + o % {};", int(inner), int(n * inner), int(inner)));
    c.line(format!("const {}* x = in0 + base;", elems.input(0)));
    c.line(format!("{}* y = out + base;", elems.output()));
    let each = format!("for ({ty} r = 0; r < {}; r += {}) {{", int(n * inner), int(inner));
    c.line(format!("float m = {NEG_INF};"));
    c.line(&each);
    c.line("m = kiln_max_nan(m, x[r]);");
    c.line("}");
    c.line("double sum = 0.0;");
    c.line(&each);
    c.line("sum += (double)expf(x[r] - m);");
    c.line("}");
    if log {
        c.line("const float k = m + (float)log(sum);");
        c.line(&each);
        c.line("y[r] = x[r] - k;");
    } else {
        c.line("const float k = (float)(1.0 / sum);");
        c.line(&each);
        c.line("y[r] = expf(x[r] - m) * k;");
    }
    c.line("}");
    c.line("}");
    let launch = Launch {
        function: fname.into(),
        grid: grid_for(work, BLOCK),
        block: [BLOCK, 1, 1],
        shared_bytes: 0,
        args: vec![Arg::Input(0), Arg::Output],
    };
    (launch, "a thread per column".into())
}
