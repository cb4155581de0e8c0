//! Batched matrix products on the `gemm` crate.
//!
//! Operands are read in place through row and column strides, so a transposed operand costs
//! nothing. Batch axes broadcast (NumPy rules): `prepare` lists, for every output matrix, the
//! offsets of its two operand matrices. When the right operand has no batch and the left one is
//! a plain stack of row-major matrices ([B, M, K] @ [K, N], a dense layer on a sequence), the
//! batch folds into M and the product is one GEMM.
//!
//! Threads: products below `SERIAL_MACS` multiply-adds run on the calling thread
//! (`Parallelism::None`), since a rayon hand-off costs more than a 32x100x10 product; many
//! mid-sized batches run one per task; otherwise each GEMM uses the rayon pool.

use super::broadcast::broadcast_strides;
use super::par::SendPtr;
use super::{CpuKernel, shape_text};
use gemm::{Parallelism, gemm};
use kiln_compiler::ir::{Rows, Shape};
use rayon::prelude::*;

/// Products (all batches together) below this many multiply-adds stay on the calling thread.
pub(crate) const SERIAL_MACS: usize = 1 << 17;
/// Batches of at most this many multiply-adds each run one per rayon task.
const TASK_MACS: usize = 1 << 22;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Threads {
    Serial,
    PerBatch,
    PerGemm,
}

/// One row-major-output matrix product shape with operand strides.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    /// Element strides of the left operand (rows of A, columns of A) and the right one.
    pub a: (isize, isize),
    pub b: (isize, isize),
    /// Row stride of the output (columns are contiguous).
    pub out_rs: isize,
}

impl Gemm {
    /// out = A·B, or out += A·B with `accumulate`.
    ///
    /// # Safety
    /// The pointers are valid for the strided matrices; the output does not overlap the operands,
    /// and distinct output (row, column) pairs are distinct elements.
    #[inline]
    pub(crate) unsafe fn run(
        &self,
        a: *const f32,
        b: *const f32,
        out: *mut f32,
        accumulate: bool,
        parallel: bool,
    ) {
        let par = if parallel { Parallelism::Rayon(0) } else { Parallelism::None };
        // SAFETY: forwarded contract. gemm computes dst = alpha*dst + beta*lhs*rhs and does not
        // read dst when read_dst is false.
        unsafe {
            gemm(
                self.m,
                self.n,
                self.k,
                out,
                1,
                self.out_rs,
                accumulate,
                a,
                self.a.1,
                self.a.0,
                b,
                self.b.1,
                self.b.0,
                if accumulate { 1.0 } else { 0.0 },
                1.0,
                false,
                false,
                false,
                par,
            )
        }
    }
}

struct MatMul {
    g: Gemm,
    /// Per output matrix: element offsets of its A and B matrices.
    batches: Vec<(usize, usize)>,
    threads: Threads,
    desc: String,
}

pub(crate) fn matmul(a: &Shape, b: &Shape, ta: bool, tb: bool, out: &Shape) -> Box<dyn CpuKernel> {
    let r = out.rank();
    let (m, n) = (out.dims()[r - 2], out.dims()[r - 1]);
    let k = if ta { a.back(2) } else { a.back(1) };
    // Strides (row, column) of A as an m x k matrix and of B as k x n.
    let sa = if ta { (1, m as isize) } else { (k as isize, 1) };
    let sb = if tb { (1, k as isize) } else { (n as isize, 1) };
    let out_batch = &out.dims()[..r - 2];
    let a_batch = &a.dims()[..a.rank() - 2];
    let b_batch = &b.dims()[..b.rank() - 2];
    let batch: usize = out_batch.iter().product();
    let a_count: usize = a_batch.iter().product();
    let b_count: usize = b_batch.iter().product();

    let mut g = Gemm { m, n, k, a: sa, b: sb, out_rs: n as isize };
    let batches = if b_count == 1 && a_count == batch && !ta {
        g.m = m * batch;
        vec![(0, 0)]
    } else {
        let a_str = broadcast_strides(a_batch, out_batch);
        let b_str = broadcast_strides(b_batch, out_batch);
        let mut index = vec![0usize; out_batch.len()];
        (0..batch)
            .map(|_| {
                let off = |s: &[isize], size: usize| {
                    index.iter().zip(s).map(|(&i, &s)| i * s as usize).sum::<usize>() * size
                };
                let offsets = (off(&a_str, m * k), off(&b_str, k * n));
                for ax in (0..index.len()).rev() {
                    index[ax] += 1;
                    if index[ax] < out_batch[ax] {
                        break;
                    }
                    index[ax] = 0;
                }
                offsets
            })
            .collect()
    };
    let macs = batch * m * n * k;
    let per_batch = m * n * k;
    let threads = if macs < SERIAL_MACS {
        Threads::Serial
    } else if batches.len() >= 4 && per_batch <= TASK_MACS {
        Threads::PerBatch
    } else {
        Threads::PerGemm
    };
    let t = |x: bool| if x { "ᵀ" } else { "" };
    let batch_text = if batch > 1 { format!("{batch}x") } else { String::new() };
    let desc =
        format!("matmul {batch_text}{m}x{k}x{n} ({}{} @ {}{})", shape_text(a), t(ta), shape_text(b), t(tb));
    Box::new(MatMul { g, batches, threads, desc })
}

impl CpuKernel for MatMul {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (a, b) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
        let o = SendPtr::new(output as *mut f32);
        let size = self.g.m * self.g.n;
        let one = |i: usize, parallel: bool| {
            let (ao, bo) = self.batches[i];
            // SAFETY: offsets come from the operand shapes; output matrices are disjoint.
            unsafe { self.g.run(a.get().add(ao), b.get().add(bo), o.get().add(i * size), false, parallel) }
        };
        match self.threads {
            Threads::Serial => (0..self.batches.len()).for_each(|i| one(i, false)),
            Threads::PerBatch => (0..self.batches.len()).into_par_iter().for_each(|i| one(i, false)),
            Threads::PerGemm => (0..self.batches.len()).for_each(|i| one(i, true)),
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct MatMulRows {
    g: Gemm,
    /// The element offset of the block's first column in `a`.
    offset: usize,
    parallel: bool,
    desc: String,
}

/// a[:, rows]ᵀ · b for a[M, K], b[M, N] (checked by `ir::infer`): one GEMM of rows.len x M x N
/// reading the block of `a`'s columns in place (row stride 1, column stride K).
pub(crate) fn matmul_rows(a: &Shape, b: &Shape, rows: Rows, out: &Shape) -> Box<dyn CpuKernel> {
    let (m_rows, k) = (a.dims()[0], a.dims()[1]);
    let n = b.dims()[1];
    let g = Gemm { m: rows.len, n, k: m_rows, a: (1, k as isize), b: (n as isize, 1), out_rs: n as isize };
    let desc = format!(
        "matmul_rows {}x{m_rows}x{n} ({}ᵀ rows {}..{} @ {} -> {})",
        rows.len,
        shape_text(a),
        rows.start,
        rows.start + rows.len,
        shape_text(b),
        shape_text(out)
    );
    Box::new(MatMulRows { g, offset: rows.start, parallel: rows.len * n * m_rows >= SERIAL_MACS, desc })
}

impl CpuKernel for MatMulRows {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (a, b) = (inputs[0] as *const f32, inputs[1] as *const f32);
        // SAFETY: `ir::infer` checked rows.start + rows.len <= K, so every element the strided
        // block reads (column offset + i, row r < M) lies in a[M, K]; the output holds
        // rows.len x N elements and is not an operand (a compute op's own buffer).
        unsafe { self.g.run(a.add(self.offset), b, output as *mut f32, false, self.parallel) }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::Gemm;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
            })
            .collect()
    }

    fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = x[r * cols + c];
            }
        }
        t
    }

    /// A product reading an operand transposed through its strides gives the bits of the same
    /// product on a transposed copy wherever the gemm crate runs its packed kernel: everywhere but
    /// thin or small products (m or n at most 1, k at most 2, m x n at most 256), where it picks
    /// a kernel by the operands' strides (measured here: 612 of the 2,880 cases tried differ, all
    /// of them there). What reading transposes in place by default (`transpose_operands`) can
    /// rely on.
    #[test]
    fn transposed_operands_sum_in_the_copied_operands_order() {
        let sizes = [1usize, 2, 3, 5, 8, 13, 16, 17, 31, 64, 100, 257];
        let mut bad = Vec::new();
        for &m in &sizes {
            for &n in &sizes {
                for &k in &[1usize, 2, 3, 7, 16, 64, 130, 600] {
                    let a = values(m * k, (m * 31 + k) as u32);
                    let b = values(k * n, (n * 17 + k) as u32);
                    let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
                    let run = |ta: bool, tb: bool| {
                        let g = Gemm {
                            m,
                            n,
                            k,
                            a: if ta { (1, m as isize) } else { (k as isize, 1) },
                            b: if tb { (1, k as isize) } else { (n as isize, 1) },
                            out_rs: n as isize,
                        };
                        let mut out = vec![0.0f32; m * n];
                        let (pa, pb) = (if ta { &at } else { &a }, if tb { &bt } else { &b });
                        // SAFETY: the buffers hold m x k, k x n and m x n elements as the strides read.
                        unsafe { g.run(pa.as_ptr(), pb.as_ptr(), out.as_mut_ptr(), false, false) };
                        out.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
                    };
                    let want = run(false, false);
                    for (ta, tb) in [(true, false), (false, true), (true, true)] {
                        if run(ta, tb) != want && !(m <= 1 || n <= 1 || k <= 2 || m * n <= 256) {
                            bad.push((m, n, k, ta, tb));
                        }
                    }
                }
            }
        }
        assert!(bad.is_empty(), "{} differ: {:?}", bad.len(), &bad[..bad.len().min(40)]);
    }
}
