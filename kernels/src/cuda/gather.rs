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
use super::codegen::{BLOCK, Code, Elems, flt, grid_for, grid_loop, header, idx_type, int, shape_text};
use super::{Arg, CudaKernel, Launch, half};
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
/// output of `out`'s.
fn params_typed(first: &str, second: &str, out: &str) -> String {
    format!("const {first}* __restrict__ in0, const {second}* __restrict__ in1, {out}* __restrict__ out")
}

pub(crate) fn gather(
    label: &str,
    table: &Shape,
    (ids, id_type): (&Shape, DType),
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let vocab = table.dims()[0];
    let row: usize = table.dims()[1..].iter().product();
    let count = ids.numel();
    let ty = idx_type(table.numel().max(out.numel()));
    let w = if row.is_multiple_of(4) { 4 } else { 1 };
    // Rows move as they are: four f32 as a float4, four halves as a uint2.
    let elem = elems.output();
    let (t, zero) = match (w, elem) {
        (4, "float") => ("float4", "make_float4(0.0f, 0.0f, 0.0f, 0.0f)".to_string()),
        (4, _) => ("uint2", "make_uint2(0u, 0u)".to_string()),
        (_, "float") => ("float", "0.0f".to_string()),
        (_, e) => (e, format!("{e}{{0}}")),
    };
    let rw = row / w;
    let work = count * rw;
    let mut c = Code::new();
    c.line(header(label, &[table, ids], Some(out)));
    c.line(format!(
        "extern \"C\" __global__ void kiln_gather({}) {{",
        params_typed(elems.input(0), c_type(id_type), elem)
    ));
    c.line(format!("const {t}* table = reinterpret_cast<const {t}*>(in0);"));
    c.line(format!("{t}* outv = reinterpret_cast<{t}*>(out);"));
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
            if w == 4 { format!(" ({t})") } else { String::new() }
        ),
    }
}

/// The scratch bytes of a gradient into a half table: the f32 table the additions go to.
pub(crate) fn scratch_wanted(out: &Shape, out_half: bool) -> usize {
    if out_half { out.numel() * 4 } else { 0 }
}

pub(crate) fn gather_grad(
    label: &str,
    (ids, id_type): (&Shape, DType),
    dy: &Shape,
    (vocab, out): (usize, &Shape),
    (scratch, elems): (usize, &Elems),
) -> Result<CudaKernel, String> {
    let row: usize = out.dims()[1..].iter().product();
    let count = ids.numel();
    let numel = out.numel();
    let ty = idx_type(numel.max(dy.numel()));
    let w = if numel.is_multiple_of(4) { 4 } else { 1 };
    // A half table's gradient is added up in f32 in the scratch, then narrowed: the additions
    // round as the f32 gradient's, and the result once.
    let staged = !elems.output_f32();
    let need = scratch_wanted(out, staged);
    if let Some(help) =
        half::short_of_scratch(&format!("adds its {} gradient up", elems.output()), need, scratch)
    {
        return Err(help);
    }
    let sum = if staged { Arg::Scratch } else { Arg::Output };
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
        args: vec![sum],
    }];
    let work = count * row;
    if work > 0 {
        c.blank();
        c.line(format!(
            "extern \"C\" __global__ void kiln_gather_grad_scatter({}) {{",
            params_typed(c_type(id_type), elems.input(1), "float")
        ));
        c.line(grid_loop(ty, "e", work));
        c.line(format!("const {ty} i = e / {}; const {ty} col = e % {};", int(row), int(row)));
        c.line(format!("const {} id = in0[i];", c_type(id_type)));
        let (cond, r) = row_of("id", id_type, vocab, ty);
        c.line(format!("if ({cond}) atomicAdd(out + {r} * {} + col, (float)in1[e]);", int(row)));
        c.line("}");
        c.line("}");
        launches.push(Launch {
            function: "kiln_gather_grad_scatter".into(),
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Input(1), sum],
        });
    }
    if staged {
        launches.push(half::narrow(&mut c, "kiln_gather_grad_narrow", numel, elems.output()));
    }
    Ok(CudaKernel {
        source: c.finish(),
        launches,
        describe: format!(
            "gather_grad[vocab {vocab}] {}{} -> {} (atomics{})",
            id_note(id_type),
            shape_text(ids),
            shape_text(out),
            if staged { ", f32 in scratch" } else { "" }
        ),
    })
}

/// The ids' dtype in a kernel's description: nothing for f32 ids (the descriptions of f32 plans
/// stay as they were), else the dtype before the shape.
pub(crate) fn id_note(dtype: DType) -> String {
    if dtype == DType::F32 { String::new() } else { dtype.to_string() }
}
