//! Embedding lookup (rows of a table by ids: i32, i64, or f32 holding whole numbers) and its
//! gradient (scatter-add).
//!
//! An id is valid when 0 <= id < V (fractional f32 ids truncate toward zero, NaN is invalid); an
//! invalid id gathers a zero row and adds nothing to the gradient, as the CPU kernels do.
//! - gather: a thread per output element (per float4 when the row length is a multiple of 4).
//! - gather_grad: two launches, a zero fill of the table gradient, then a thread per element of
//!   dy that `atomicAdd`s it into its row. Where ids repeat, the additions happen in an
//!   unspecified order, so repeated ids give results that vary in the last bits from run to run
//!   (the CPU adds in id order); everything else is exact.

use super::cast::c_type;
use super::codegen::{BLOCK, Code, flt, grid_for, grid_loop, header, idx_type, int, shape_text};
use super::{Arg, CudaKernel, Launch};
use kiln_compiler::ir::{DType, Shape};

/// The row index of id `id` (a variable of `dtype`) in a table of `vocab` rows, as a condition
/// and a row expression.
fn row_of(id: &str, dtype: DType, vocab: usize, ty: &str) -> (String, String) {
    if matches!(dtype, DType::I32 | DType::I64) {
        return (format!("{id} >= 0 && {id} < {}LL", vocab), format!("(({ty}){id})"));
    }
    let cond = format!("{id} >= 0.0f && {id} < {}", flt(vocab as f32));
    let row = format!("(({ty}){id} < {last} ? ({ty}){id} : {last})", last = int(vocab.saturating_sub(1)));
    (cond, row)
}

/// Two read-only operands (the first of `first`'s C type, the second of `second`'s) and the
/// float output.
fn params_typed(first: &str, second: &str) -> String {
    format!("const {first}* __restrict__ in0, const {second}* __restrict__ in1, float* __restrict__ out")
}

pub(crate) fn gather(label: &str, table: &Shape, (ids, id_type): (&Shape, DType), out: &Shape) -> CudaKernel {
    let vocab = table.dims()[0];
    let row: usize = table.dims()[1..].iter().product();
    let count = ids.numel();
    let ty = idx_type(table.numel().max(out.numel()));
    let w = if row.is_multiple_of(4) { 4 } else { 1 };
    let (t, zero) =
        if w == 4 { ("float4", "make_float4(0.0f, 0.0f, 0.0f, 0.0f)") } else { ("float", "0.0f") };
    let rw = row / w;
    let work = count * rw;
    let mut c = Code::new();
    c.line(header(label, &[table, ids], Some(out)));
    c.line(format!(
        "extern \"C\" __global__ void kiln_gather({}) {{",
        params_typed("float", c_type(id_type))
    ));
    if w == 4 {
        c.line("const float4* table = reinterpret_cast<const float4*>(in0);");
        c.line("float4* outv = reinterpret_cast<float4*>(out);");
    } else {
        c.line("const float* table = in0;");
        c.line("float* outv = out;");
    }
    c.line(grid_loop(ty, "e", work));
    c.line(format!("const {ty} i = e / {}; const {ty} col = e % {};", int(rw), int(rw)));
    c.line(format!("const {} id = in1[i];", c_type(id_type)));
    let (cond, r) = row_of("id", id_type, vocab, ty);
    c.line(format!("{t} v = {zero};"));
    c.line(format!("if ({cond}) v = table[{r} * {} + col];", int(rw)));
    c.line("outv[e] = v;");
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: "kiln_gather".into(),
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Input(1), Arg::Output],
        }],
        describe: format!(
            "gather {} by {}{}{}",
            shape_text(table),
            id_note(id_type),
            shape_text(ids),
            if w == 4 { " (float4)" } else { "" }
        ),
    }
}

pub(crate) fn gather_grad(
    label: &str,
    (ids, id_type): (&Shape, DType),
    dy: &Shape,
    vocab: usize,
    out: &Shape,
) -> CudaKernel {
    let row: usize = out.dims()[1..].iter().product();
    let count = ids.numel();
    let numel = out.numel();
    let ty = idx_type(numel.max(dy.numel()));
    let w = if numel.is_multiple_of(4) { 4 } else { 1 };
    let mut c = Code::new();
    c.line(header(label, &[ids, dy], Some(out)));
    c.line("extern \"C\" __global__ void kiln_gather_grad_zero(float* __restrict__ out) {");
    if w == 4 {
        c.line("float4* outv = reinterpret_cast<float4*>(out);");
        c.line(grid_loop(ty, "e", numel / 4));
        c.line("outv[e] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);");
    } else {
        c.line(grid_loop(ty, "e", numel));
        c.line("out[e] = 0.0f;");
    }
    c.line("}");
    c.line("}");
    let mut launches = vec![Launch {
        function: "kiln_gather_grad_zero".into(),
        grid: grid_for(numel / w, BLOCK),
        block: [BLOCK, 1, 1],
        shared_bytes: 0,
        args: vec![Arg::Output],
    }];
    let work = count * row;
    if work > 0 {
        c.blank();
        c.line(format!(
            "extern \"C\" __global__ void kiln_gather_grad_scatter({}) {{",
            params_typed(c_type(id_type), "float")
        ));
        c.line(grid_loop(ty, "e", work));
        c.line(format!("const {ty} i = e / {}; const {ty} col = e % {};", int(row), int(row)));
        c.line(format!("const {} id = in0[i];", c_type(id_type)));
        let (cond, r) = row_of("id", id_type, vocab, ty);
        c.line(format!("if ({cond}) atomicAdd(out + {r} * {} + col, in1[e]);", int(row)));
        c.line("}");
        c.line("}");
        launches.push(Launch {
            function: "kiln_gather_grad_scatter".into(),
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Input(1), Arg::Output],
        });
    }
    CudaKernel {
        source: c.finish(),
        launches,
        describe: format!(
            "gather_grad[vocab {vocab}] {}{} -> {} (atomics)",
            id_note(id_type),
            shape_text(ids),
            shape_text(out)
        ),
    }
}

/// The ids' dtype in a kernel's description: nothing for f32 ids (the descriptions of f32 plans
/// stay as they were), else the dtype before the shape.
pub(crate) fn id_note(dtype: DType) -> String {
    if dtype == DType::F32 { String::new() } else { dtype.to_string() }
}
