//! Products of f16 and bf16 factors on the f32 GEMM (`matmul::Gemm`): f32 arithmetic inside,
//! half in memory, as a mixed-precision step's products are (PyTorch's CPU autocast, oneDNN's
//! bf16 GEMM: half panels widened as they are packed, f32 accumulation).
//!
//! A half factor is widened a panel at a time into a buffer of the calling thread (at most
//! `MC` x `KC` floats of the left factor and `KC` x `NC` of the right: 3 MiB, outside the arena,
//! as the gemm crate's own packing buffers are), and each block of the output (`MC` rows x `NC`
//! columns) is the same GEMM on the widened panels, its depth in the chunks of `KC` that
//! `Gemm::run` sums in, each added to the block in order. `Gemm::run` sums every element in one
//! order whatever the product's M, N and strides, so the product is bitwise the f32 product of
//! the widened factors, which is what a plan that widens the factors (`kiln_compiler::widen`)
//! computes. A half output is made in an f32 tile of the block and rounded once as it is stored
//! (ties to even, as `Op::Cast`).
//!
//! A panel line that lies contiguous (a row, or a column of a transposed factor) is converted
//! at once (`cast::widen_slice`: F16C for f16 where the CPU has it, a vectorised shift for
//! bf16) and the panel laid out along it. Measured (release, 2-core AMD EPYC, AVX-512, best of
//! 5): 1024³ f32 13.3 ms, bf16 and f16 factors 9.0 ms; 64x256x784 with the right factor
//! transposed 0.15 ms f32, 0.17 bf16 (0.36 before panels followed the factor's layout). The
//! zoo's training steps with these products, against every op widened: `docs/src/precision.md`.

use super::cast::{narrow_slice, widen_slice};
use super::matmul::{Gemm, KC};
use kiln_compiler::ir::DType;
use std::cell::RefCell;

/// Rows of the left factor's panels and of an output block.
const MC: usize = 512;
/// Columns of the right factor's panels and of an output block.
const NC: usize = 1024;

thread_local! {
    /// Each thread's widened panels (left, right) and f32 output tile.
    static PANELS: RefCell<[Vec<f32>; 3]> = const { RefCell::new([Vec::new(), Vec::new(), Vec::new()]) };
}

/// A factor of a product or its output: an f32 matrix read where it lies, or an f16 or bf16
/// one (its type), widened as it is read.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Matrix {
    F32(*mut f32),
    Half(*mut u16, DType),
}

impl Matrix {
    /// `p`, a matrix of `dtype` (f32, f16 or bf16).
    pub(crate) fn new(p: *mut u8, dtype: DType) -> Matrix {
        match dtype {
            DType::F16 | DType::BF16 => Matrix::Half(p as *mut u16, dtype),
            _ => Matrix::F32(p as *mut f32),
        }
    }

    /// The matrix whose element 0 is this one's element `i`.
    ///
    /// # Safety
    /// Element `i` lies inside (or one past) the buffer.
    pub(crate) unsafe fn at(self, i: isize) -> Matrix {
        // SAFETY: the contract.
        unsafe {
            match self {
                Matrix::F32(p) => Matrix::F32(p.offset(i)),
                Matrix::Half(p, d) => Matrix::Half(p.offset(i), d),
            }
        }
    }

    /// Whether it is f32 (read and written where it lies).
    pub(crate) fn is_f32(&self) -> bool {
        matches!(self, Matrix::F32(_))
    }
}

/// `rows` x `cols` elements of the half matrix `p` (row and column strides `s`) widened into
/// `dst`, laid out as the matrix is read fastest: row-major where its rows are contiguous,
/// column-major where its columns are (a transposed factor), each contiguous line converted at
/// once (`cast::widen_slice`); otherwise row-major, gathered a piece at a time. Returns the
/// strides (row, column) of `dst` (`Gemm::run` sums in one order whatever the strides).
///
/// # Safety
/// Every element read lies inside the matrix.
unsafe fn widen_panel(
    p: *const u16,
    t: DType,
    s: (isize, isize),
    rows: usize,
    cols: usize,
    dst: &mut Vec<f32>,
) -> (isize, isize) {
    const PIECE: usize = 256;
    dst.resize(rows * cols, 0.0);
    // Lines of `len` elements `along` apart, `lines` of them `across` apart.
    let by_columns = s.1 != 1 && s.0 == 1;
    let (lines, len, across, along) =
        if by_columns { (cols, rows, s.1, s.0) } else { (rows, cols, s.0, s.1) };
    let mut bits = [0u16; PIECE];
    for (l, out) in dst.chunks_exact_mut(len.max(1)).take(lines).enumerate() {
        // SAFETY: the contract.
        let line = unsafe { p.offset(l as isize * across) };
        if along == 1 {
            // SAFETY: the line's len elements lie inside the matrix (the contract).
            widen_slice(t, unsafe { std::slice::from_raw_parts(line, len) }, out);
            continue;
        }
        for (c0, piece) in out.chunks_mut(PIECE).enumerate() {
            for (i, b) in bits[..piece.len()].iter_mut().enumerate() {
                // SAFETY: element c0 * PIECE + i < len of the line (the contract).
                *b = unsafe { *line.offset((c0 * PIECE + i) as isize * along) };
            }
            widen_slice(t, &bits[..piece.len()], piece);
        }
    }
    if by_columns { (1, rows as isize) } else { (cols as isize, 1) }
}

/// The `rows` x `cols` block at `at` (row, column) of factor `m` (strides `s`) as f32: where it
/// lies for an f32 factor, else widened into `buf` (`widen_panel`); with its strides.
///
/// # Safety
/// Every element of the block lies inside the factor.
unsafe fn panel(
    m: Matrix,
    s: (isize, isize),
    at: (usize, usize),
    (rows, cols): (usize, usize),
    buf: &mut Vec<f32>,
) -> (*mut f32, (isize, isize)) {
    let offset = at.0 as isize * s.0 + at.1 as isize * s.1;
    // SAFETY: the contract; a widened panel is `buf`, exactly its elements.
    unsafe {
        match m {
            Matrix::F32(p) => (p.offset(offset), s),
            Matrix::Half(p, t) => {
                let strides = widen_panel(p.offset(offset), t, s, rows, cols, buf);
                (buf.as_mut_ptr(), strides)
            }
        }
    }
}

impl Gemm {
    /// out = A·B, or out += A·B with `accumulate` (an f32 output only), for factors and an
    /// output of any float type: the bits of `run` on the widened factors, rounded to the
    /// output's type (module doc).
    ///
    /// # Safety
    /// As `run`: the matrices are valid for their strides and shapes, the output overlaps no
    /// factor, and distinct output (row, column) pairs are distinct elements.
    pub(crate) unsafe fn run_mixed(
        &self,
        a: Matrix,
        b: Matrix,
        out: Matrix,
        accumulate: bool,
        parallel: bool,
    ) {
        if let (Matrix::F32(a), Matrix::F32(b), Matrix::F32(o)) = (a, b, out) {
            // SAFETY: forwarded contract.
            return unsafe { self.run(a, b, o, accumulate, parallel) };
        }
        debug_assert!(out.is_f32() || !accumulate, "a half output is written, never added to");
        PANELS.with(|cell| match cell.try_borrow_mut() {
            // SAFETY: forwarded contract.
            Ok(mut panels) => unsafe { self.blocks(a, b, out, accumulate, parallel, &mut panels) },
            // A nested call on this thread (a rayon task run while the outer GEMM waits).
            Err(_) => unsafe { self.blocks(a, b, out, accumulate, parallel, &mut Default::default()) },
        })
    }

    /// `run_mixed` a block of `MC` x `NC` at a time, with `panels` for the widened panels and
    /// the f32 tile.
    ///
    /// # Safety
    /// As `run_mixed`.
    unsafe fn blocks(
        &self,
        a: Matrix,
        b: Matrix,
        out: Matrix,
        accumulate: bool,
        parallel: bool,
        panels: &mut [Vec<f32>; 3],
    ) {
        let [pa, pb, tile] = panels;
        let mut m0 = 0;
        while m0 < self.m {
            let mb = MC.min(self.m - m0);
            let mut n0 = 0;
            while n0 < self.n {
                let nb = NC.min(self.n - n0);
                // Where the block's sums go: the output's own f32 elements, or the tile.
                let (dst, dst_rs) = match out {
                    // SAFETY: rows m0.. and columns n0.. of the output lie inside it.
                    Matrix::F32(o) => {
                        (unsafe { o.offset(m0 as isize * self.out_rs + n0 as isize) }, self.out_rs)
                    }
                    Matrix::Half(..) => {
                        tile.resize(mb * nb, 0.0);
                        (tile.as_mut_ptr(), nb as isize)
                    }
                };
                let mut k0 = 0;
                loop {
                    let kb = KC.min(self.k - k0);
                    // SAFETY (both factors): rows m0..m0 + mb, columns n0..n0 + nb and depth
                    // k0..k0 + kb lie inside the matrices the caller vouched for; a widened
                    // panel is the thread's own buffer of exactly its elements.
                    let (ap, a_s) = unsafe { panel(a, self.a, (m0, k0), (mb, kb), pa) };
                    let (bp, b_s) = unsafe { panel(b, self.b, (k0, n0), (kb, nb), pb) };
                    let block = Gemm { m: mb, n: nb, k: kb, a: a_s, b: b_s, out_rs: dst_rs };
                    let add = (accumulate && out.is_f32()) || k0 > 0;
                    // SAFETY: the block's factors and output as stated above; the tile holds
                    // mb x nb floats and is no factor.
                    unsafe { block.run(ap, bp, dst, add, parallel) };
                    k0 += kb;
                    if k0 >= self.k {
                        break;
                    }
                }
                if let Matrix::Half(o, t) = out {
                    for r in 0..mb {
                        // SAFETY: row m0 + r, columns n0..n0 + nb of the output lie inside it,
                        // written by this call alone.
                        let row = unsafe {
                            std::slice::from_raw_parts_mut(
                                o.offset((m0 + r) as isize * self.out_rs + n0 as isize),
                                nb,
                            )
                        };
                        narrow_slice(t, &tile[r * nb..(r + 1) * nb], row);
                    }
                }
                n0 += nb;
            }
            m0 += mb;
        }
    }
}
