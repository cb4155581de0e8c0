//! Batched matrix products: the tiled GEMM (`gemm`) with strided operand loads.
//!
//! A transposed operand is read in place through swapped strides, and the load mapping follows
//! its contiguous axis; each operand also declares its plain layout (`gemm::Plain`: leading
//! dimension, column offset, batch matrix size), so that the fast GEMM reads it as float4s
//! where the alignment allows. Batch axes broadcast (NumPy rules): each operand's matrix offset is a
//! baked expression of the batch index (0 for an operand without batch, `bz · size` for a full
//! batch, a div/mod decomposition when it broadcasts). As on the CPU, [B, M, K] @ [K, N] without
//! a transposed left operand folds the batch into M: one product of B·M rows, bigger tiles.
//! A product with K = 0 is a zero fill.

use super::codegen::{Code, Elems, broadcast_strides, header, idx_type, int, shape_text};
use super::elementwise::Map;
use super::gemm::{Gemm, Operand, Plain, Sink};
use super::{Arg, CudaKernel};
use kiln_compiler::ir::{Fused, FusedMatMul, Rows, Shape};

/// The element offset of operand batch matrices for output batch `bz`: sum over the output's
/// batch axes of coordinate x (operand batch stride), times the matrix size.
fn batch_offset(operand: &[usize], out: &[usize], size: usize) -> String {
    let count: usize = operand.iter().product();
    let total: usize = out.iter().product();
    if count == 1 {
        return "0".into();
    }
    if count == total {
        return format!("bz * {}", int(size));
    }
    let strides = broadcast_strides(operand, out);
    let mut inner = 1usize;
    let mut terms = Vec::new();
    for a in (0..out.len()).rev() {
        if strides[a] != 0 {
            let coord = if inner == 1 {
                format!("(bz % {})", out[a])
            } else {
                format!("(bz / {inner} % {})", out[a])
            };
            terms.push(format!("{coord} * {}", int(strides[a] as usize * size)));
        }
        inner *= out[a];
    }
    terms.reverse();
    terms.join(" + ")
}

pub(crate) fn matmul(
    label: &str,
    a: &Shape,
    b: &Shape,
    (ta, tb): (bool, bool),
    out: &Shape,
    scratch: usize,
    elems: &Elems,
) -> CudaKernel {
    product(label, (a, b), (ta, tb), out, None, (scratch, elems))
}

/// The GEMM a product of `a` (transposed with `ta`) and `b` into `out` runs: (M, N, K, batch).
/// [B, M, K] @ [K, N] without a transposed left operand folds the batch into M.
pub(crate) fn dims(a: &Shape, b: &Shape, ta: bool, out: &Shape) -> (usize, usize, usize, usize) {
    let r = out.rank();
    let (m, n) = (out.dims()[r - 2], out.dims()[r - 1]);
    let k = if ta { a.back(2) } else { a.back(1) };
    let batch: usize = out.dims()[..r - 2].iter().product();
    let a_batch: usize = a.dims()[..a.rank() - 2].iter().product();
    let b_batch: usize = b.dims()[..b.rank() - 2].iter().product();
    if b_batch == 1 && a_batch == batch && !ta { (m * batch, n, k, 1) } else { (m, n, k, batch) }
}

/// A product with an elementwise epilogue (`Fused::matmul`): the GEMM applies the program to
/// every product as it stores it, reading the op's other operands (`extra`, from operand 2 on)
/// beside it.
pub(crate) fn fused_matmul(
    label: &str,
    program: &Fused,
    m: &FusedMatMul,
    operands: &[&Shape],
    out: &Shape,
    scratch: usize,
    elems: &Elems,
) -> CudaKernel {
    product(
        label,
        (operands[0], operands[1]),
        (m.transpose_a, m.transpose_b),
        out,
        Some((program, &operands[2..])),
        (scratch, elems),
    )
}

fn product(
    label: &str,
    (a, b): (&Shape, &Shape),
    (ta, tb): (bool, bool),
    out: &Shape,
    epilogue: Option<(&Fused, &[&Shape])>,
    (scratch, elems): (usize, &Elems),
) -> CudaKernel {
    let r = out.rank();
    let (m, n) = (out.dims()[r - 2], out.dims()[r - 1]);
    let k = if ta { a.back(2) } else { a.back(1) };
    let out_batch = &out.dims()[..r - 2];
    let a_batch = &a.dims()[..a.rank() - 2];
    let b_batch = &b.dims()[..b.rank() - 2];
    let batch: usize = out_batch.iter().product();
    let t = |x: bool| if x { "ᵀ" } else { "" };
    let batch_text = if batch > 1 { format!("{batch}x") } else { String::new() };
    let describe =
        format!("matmul {batch_text}{m}x{k}x{n} ({}{} @ {}{})", shape_text(a), t(ta), shape_text(b), t(tb));
    let mut all = vec![a, b];
    all.extend(epilogue.map_or(&[][..], |(_, extra)| extra));
    let head = header(label, &all, Some(out));
    if k == 0 {
        let mut kernel = Map {
            name: "kiln_matmul",
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
        kernel.describe = format!("{describe} (K = 0: zeros)");
        return kernel;
    }
    let ty = idx_type(all.iter().map(|s| s.numel()).max().unwrap_or(0).max(out.numel()));
    let (gm, _, _, gbatch) = dims(a, b, ta, out);
    let fold = gbatch != batch;
    let a_load = if ta {
        format!("v = src[base + gk * {} + gr];", int(m))
    } else {
        format!("v = src[base + gr * {} + gk];", int(k))
    };
    let b_load = if tb {
        format!("v = src[base + gr * {} + gk];", int(k))
    } else {
        format!("v = src[base + gk * {} + gr];", int(n))
    };
    let (a_off, b_off) = if fold {
        ("0".to_string(), "0".to_string())
    } else {
        (batch_offset(a_batch, out_batch, m * k), batch_offset(b_batch, out_batch, k * n))
    };
    let gemm = Gemm {
        name: "kiln_matmul".into(),
        m: gm,
        n,
        k,
        batch: gbatch,
        a: Operand {
            k_contiguous: !ta,
            load: a_load,
            batch_offset: a_off,
            plain: Some(Plain { ld: if ta { m } else { k }, offset: 0, batch_granule: m * k }),
        },
        b: Operand {
            k_contiguous: tb,
            load: b_load,
            batch_offset: b_off,
            plain: Some(Plain { ld: if tb { k } else { n }, offset: 0, batch_granule: k * n }),
        },
        ty,
        args: [Arg::Input(0), Arg::Input(1)],
        sink: Sink::of(epilogue, out, (ty, elems)),
        scratch,
        elems: elems.clone(),
    };
    let mut c = Code::new();
    c.line(head);
    let (launches, tiling) = gemm.generate(&mut c);
    CudaKernel { source: c.finish(), launches, describe: format!("{describe} ({tiling})") }
}

/// a[:, rows]ᵀ · b for a[M, K], b[M, N] (checked by `ir::infer`): the tiled GEMM of
/// rows.len x M x N, loading the block of `a`'s columns in place (as a transposed operand, one
/// column offset added).
pub(crate) fn matmul_rows(
    label: &str,
    a: &Shape,
    b: &Shape,
    rows: Rows,
    out: &Shape,
    scratch: usize,
    elems: &Elems,
) -> CudaKernel {
    let (m_rows, k) = (a.dims()[0], a.dims()[1]);
    let n = b.dims()[1];
    let describe = format!(
        "matmul_rows {}x{m_rows}x{n} ({}ᵀ rows {}..{} @ {})",
        rows.len,
        shape_text(a),
        rows.start,
        rows.start + rows.len,
        shape_text(b)
    );
    let ty = idx_type(a.numel().max(b.numel()).max(out.numel()));
    let gemm = Gemm {
        name: "kiln_matmul_rows".into(),
        m: rows.len,
        n,
        k: m_rows,
        batch: 1,
        a: Operand {
            k_contiguous: false,
            load: format!("v = src[gk * {} + {} + gr];", int(k), int(rows.start)),
            batch_offset: "0".into(),
            plain: Some(Plain { ld: k, offset: rows.start, batch_granule: 0 }),
        },
        b: Operand {
            k_contiguous: false,
            load: format!("v = src[gk * {} + gr];", int(n)),
            batch_offset: "0".into(),
            plain: Some(Plain { ld: n, offset: 0, batch_granule: 0 }),
        },
        ty,
        args: [Arg::Input(0), Arg::Input(1)],
        sink: Sink::Output,
        scratch,
        elems: elems.clone(),
    };
    let mut c = Code::new();
    c.line(header(label, &[a, b], Some(out)));
    let (launches, tiling) = gemm.generate(&mut c);
    CudaKernel { source: c.finish(), launches, describe: format!("{describe} ({tiling})") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_offsets_broadcast() {
        assert_eq!(batch_offset(&[], &[4], 6), "0");
        assert_eq!(batch_offset(&[4], &[4], 6), "bz * 6");
        assert_eq!(batch_offset(&[1, 3], &[2, 3], 6), "(bz % 3) * 6");
        assert_eq!(batch_offset(&[2, 1], &[2, 3], 6), "(bz / 3 % 2) * 6");
    }
}
