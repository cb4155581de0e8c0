//! Batched matrix products on the `gemm` crate.
//!
//! Operands are read in place through row and column strides, so a transposed operand costs
//! nothing. Batch axes broadcast (NumPy rules): `layout` lists, for every output matrix, the
//! offsets of its two operand matrices. When the right operand has no batch and the left one is
//! a plain stack of row-major matrices ([B, M, K] @ [K, N], a dense layer on a sequence), the
//! batch folds into M and the product is one GEMM.
//!
//! The gemm crate is built with its `x86-v4` feature: AVX-512 micro-kernels beside the AVX2
//! ones, the crate choosing by the CPU at run time (an AVX2-only machine runs the AVX2 kernels
//! as before). Both are a fused multiply-add chain over k per element, so every product keeps
//! its sums (`KC`). Measured with AVX-512 kernels against AVX2 alone (`kiln run --threads 1
//! --bench 3`, batch-2 inference exports, 2-core AMD EPYC with AVX-512): GPT-2 small
//! 1,341 -> 867 ms, ResNet-50 172.6 -> 93.4 ms, BERT-base 855 -> 790 ms; the zoo's training
//! steps as `kernels::cpu::simd` lists. MobileNetV3-small's pass grew 5.75 -> 6.7 ms: its
//! batch-2 classifier (2x1024 by a transposed 1000x1024 weight) took 1.65 ms, the crate
//! packing the weight across rows 4 KiB apart, until such factors were copied to row-major
//! panels first (`Gemm::chunk_untransposed`).
//!
//! Threads: products below `SERIAL_MACS` multiply-adds run on the calling thread
//! (`Parallelism::None`), since a rayon hand-off costs more than a 32x100x10 product; many
//! mid-sized batches run one per task; otherwise each GEMM uses the rayon pool.

use super::broadcast::broadcast_strides;
use super::mixed_gemm::Matrix;
use super::par::SendPtr;
use super::{CpuKernel, shape_text};
use gemm::{Parallelism, gemm};
use kiln_compiler::ir::{DType, Rows, Shape};
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

/// The depth of one call to the gemm crate. It splits no depth of at most 512 itself (its
/// small-size path takes `min(k, 512)`, its cache-sized path `max(.., 512).min(k)` before
/// evening the chunks out), so that every product element is the same sum whatever the
/// product's M, N and strides: one fused multiply-add chain from zero per chunk of `KC`, the
/// chunks added to the output in order.
pub(crate) const KC: usize = 512;

/// Products this thin or small leave the gemm crate's packed kernel: it picks a kernel by the
/// operands' strides there (dot products along k, or a GEMV), which sums k in another order
/// (measured: `a_product_sums_in_one_order_whatever_its_layout`). Such products run
/// `Gemm::direct`, which sums in the packed kernel's order.
fn stride_sensitive(m: usize, n: usize, k: usize) -> bool {
    m <= 1 || n <= 1 || k <= 2 || m * n <= 256
}

/// a·b + c rounded once, as the gemm crate's microkernels compute on every x86-64 CPU with FMA
/// (AVX2 and AVX-512 alike).
#[inline(always)]
fn fused(a: f32, b: f32, c: f32) -> f32 {
    a.mul_add(b, c)
}

impl Gemm {
    /// out = A·B, or out += A·B with `accumulate`.
    ///
    /// Every element is summed in one order whatever the (non-negative) strides, M and N: chunks of `KC` along
    /// k, each a fused multiply-add chain from zero, added to the output in order. So a product
    /// that reads an operand transposed through its strides gives the bits of the same product
    /// on a transposed copy, a product split into row blocks (fused epilogues) or batches gives
    /// the bits of the whole, and (A·B)ᵀ computed as Bᵀ·Aᵀ gives the bits of A·B transposed.
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
        debug_assert!(self.a.0 >= 0 && self.a.1 >= 0 && self.b.0 >= 0 && self.b.1 >= 0, "negative strides");
        if self.m == 0 || self.n == 0 {
            return;
        }
        if self.k == 0 {
            // SAFETY: forwarded contract; with k = 0 nothing is read.
            unsafe { self.chunk(0, a, b, out, accumulate, parallel) };
            return;
        }
        if self.k >= THIN_DEPTH / 4 && self.m <= THIN_ROWS && self.n >= THIN_COLS / 2 && self.b.0 == 1 {
            // SAFETY: forwarded contract, the right operand's row stride 1.
            return unsafe { self.thin_transposed(a, b, out, accumulate, parallel) };
        }
        let mut k0 = 0;
        while k0 < self.k {
            let kb = KC.min(self.k - k0);
            // SAFETY: k0 + kb <= k: the chunk's operand columns/rows lie inside the matrices
            // the caller vouched for.
            unsafe {
                let (ak, bk) = (a.offset(k0 as isize * self.a.1), b.offset(k0 as isize * self.b.0));
                self.chunk(kb, ak, bk, out, accumulate || k0 > 0, parallel);
            }
            k0 += kb;
        }
    }

    /// One chunk of depth `kb` (at most `KC`).
    ///
    /// # Safety
    /// As `run`, for an m x kb left and kb x n right operand.
    unsafe fn chunk(
        &self,
        kb: usize,
        a: *const f32,
        b: *const f32,
        out: *mut f32,
        accumulate: bool,
        parallel: bool,
    ) {
        if kb > 0 && stride_sensitive(self.m, self.n, kb) {
            // SAFETY: forwarded contract.
            return unsafe { self.direct(kb, a, b, out, accumulate) };
        }
        if self.b.0 == 1 && aliasing(self.b.1) && self.n >= ALIASED_BLOCK / 64 {
            // SAFETY: forwarded contract.
            return unsafe { self.chunk_untransposed(kb, a, b, out, accumulate, parallel) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.crate_chunk(kb, a, b, out, accumulate, parallel) }
    }

    /// One chunk in the gemm crate.
    ///
    /// # Safety
    /// As `chunk`.
    unsafe fn crate_chunk(
        &self,
        kb: usize,
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
                kb,
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

    /// A chunk whose right operand is a transposed matrix (`[N, K]` read as `K x N`: column
    /// stride K, row stride 1) with an aliasing row stride (`aliasing`): blocks of
    /// `ALIASED_BLOCK` columns copied row-major into a panel, each by a cache-friendly
    /// transposition, then the crate's product of the panel. The crate's own packing reads such
    /// an operand across its rows, and at a stride of a multiple of 4 KiB every read maps to one
    /// cache set. The same sums in the same order (`run`): only where the operand's elements
    /// are read from changes. Measured (the products alone, one AVX-512 core, 2026-11-29):
    /// ResNet-50's classifier (2 x 2048 by a transposed 1000 x 2048 weight) 3.25 -> 0.76 ms,
    /// MobileNetV3-small's (K = 1,024) 1.63 -> 0.36 ms, BERT's MLP down-projection (512 x 3072
    /// by 768 x 3072ᵀ) 13.3 -> 10.7 ms, level with its up-projection; at other strides the copy
    /// cost more than it gave (K = 1,280: 0.40 -> 0.51 ms).
    ///
    /// # Safety
    /// As `chunk`.
    unsafe fn chunk_untransposed(
        &self,
        kb: usize,
        a: *const f32,
        b: *const f32,
        out: *mut f32,
        accumulate: bool,
        parallel: bool,
    ) {
        PANEL.with(|cell| {
            let mut fresh = Vec::new();
            let mut held = cell.try_borrow_mut();
            // A nested call on this thread (a rayon task run while an outer product waits)
            // takes a panel of its own.
            let panel = match held.as_mut() {
                Ok(p) => &mut **p,
                Err(_) => &mut fresh,
            };
            for j0 in (0..self.n).step_by(ALIASED_BLOCK) {
                let nb = ALIASED_BLOCK.min(self.n - j0);
                // A panel row stride off the 4 KiB multiples, so that writing it does not alias.
                let ld = nb.next_multiple_of(16);
                let ld = if aliasing(ld as isize) { ld + 16 } else { ld };
                panel.resize(kb * ld, 0.0);
                // SAFETY: columns j0 .. j0 + nb <= n of the kb x n operand.
                let src = SendPtr::new(unsafe { b.offset(j0 as isize * self.b.1) } as *mut f32);
                let threads = if parallel { rayon::current_num_threads() } else { 1 };
                // The panel's rows in one band per thread, so that the copy is not the serial part
                // of a parallel product: with the copy on the calling thread alone, ViT-B/16's MLP
                // down-projections (K = 3,072) ran 1.76 times as fast on two threads as on one,
                // its up-projections 1.93 (`kiln run --profile 3`); with the bands its whole
                // pass on two threads took 0.95-0.98 of its time.
                let band = kb.div_ceil(threads).next_multiple_of(8).max(8);
                let dst = SendPtr::new(panel.as_mut_ptr());
                let copy = |t: usize| {
                    let (k0, k1) = (t * band, ((t + 1) * band).min(kb));
                    // SAFETY: elements k0..k1 <= kb of the operand's nb columns (above); the
                    // panel's rows k0..k1, ld floats each, are this band's alone.
                    unsafe {
                        let rows = std::slice::from_raw_parts_mut(dst.get().add(k0 * ld), (k1 - k0) * ld);
                        transpose_into(src.get().add(k0), self.b.1 as usize, k1 - k0, nb, rows, ld)
                    };
                };
                if threads > 1 {
                    (0..kb.div_ceil(band)).into_par_iter().for_each(copy);
                } else {
                    copy(0);
                }
                let block = Gemm { n: nb, b: (ld as isize, 1), ..*self };
                // SAFETY: the panel is the kb x nb operand block, row-major with stride ld; the
                // output's columns j0 .. j0 + nb lie in the output.
                unsafe {
                    block.chunk(kb, a, panel.as_ptr(), out.add(j0), accumulate, parallel);
                }
            }
        })
    }

    /// A product of at most `THIN_ROWS` rows whose right operand is a transposed matrix (`[N,
    /// K]` read as K x N, row stride 1: a classifier's or projection's weight at a small batch),
    /// in blocks of `THIN_COLS` columns, each through all its chunks of `KC` before the next
    /// (so that each row of the weight is read once, front to back): per chunk, its
    /// `THIN_DEPTH`-deep tiles of the operand are transposed into a buffer in L1
    /// (`transpose_into`), each element's fused multiply-add chain over the chunk runs from zero
    /// across the block's columns at once, and is stored (or added to the output) in chunk
    /// order: `run`'s sums, so the same bits.
    ///
    /// Why: the gemm crate packed the whole weight for the two rows of a batch-2 classifier,
    /// reading and writing it once more than the product reads it, and `direct` read it a
    /// strided element at a time. Measured, one core of the 2-core AMD EPYC with AVX-512, the
    /// crate's path -> this one: the products alone, warm (`cargo bench --bench products`,
    /// KILN_PRODUCTS_ONLY=classifier) ResNet-50's classifier (2 x 2048 by 1000 x 2048ᵀ) 0.659 ->
    /// 0.267 ms, EfficientNet-B0's (K = 1,280) 0.400 -> 0.152 ms, MobileNetV3-small's (K =
    /// 1,024) 0.299 -> 0.133 ms; inside MobileNetV3-small's pass, the weight coming from memory
    /// (`kiln run --threads 1 --profile 20`), 0.668 -> 0.145 ms (onnxruntime's: 0.136 ms). A
    /// chunk of `KC` at a time across all the blocks (the weight read in three sweeps of
    /// 2 KiB slabs for K = 1,280) took EfficientNet-B0's 0.36-0.53 ms there.
    ///
    /// # Safety
    /// As `run`, with the right operand's row stride 1.
    unsafe fn thin_transposed(
        &self,
        a: *const f32,
        b: *const f32,
        out: *mut f32,
        accumulate: bool,
        parallel: bool,
    ) {
        let blocks = self.n.div_ceil(THIN_COLS);
        let (a, b, out) = (SendPtr::new(a as *mut f32), SendPtr::new(b as *mut f32), SendPtr::new(out));
        // SAFETY: blocks write disjoint columns of the output; the operands are only read.
        let block =
            |j: usize| unsafe { self.thin_block(a.get(), b.get(), out.get(), accumulate, j * THIN_COLS) };
        if parallel && self.m * self.n * self.k >= SERIAL_MACS {
            (0..blocks).into_par_iter().for_each(block);
        } else {
            (0..blocks).for_each(block);
        }
    }

    /// Columns j0 .. j0 + `THIN_COLS` (or to n) of `thin_transposed`.
    ///
    /// # Safety
    /// As `thin_transposed`, with j0 < n.
    #[inline(always)]
    unsafe fn thin_block(&self, a: *const f32, b: *const f32, out: *mut f32, accumulate: bool, j0: usize) {
        let (m, nb) = (self.m, THIN_COLS.min(self.n - j0));
        let mut tile = [0f32; THIN_DEPTH * THIN_COLS];
        for k0 in (0..self.k).step_by(KC) {
            let kb = KC.min(self.k - k0);
            let mut acc = [[0f32; THIN_COLS]; THIN_ROWS];
            for t0 in (k0..k0 + kb).step_by(THIN_DEPTH) {
                let kt = THIN_DEPTH.min(k0 + kb - t0);
                // SAFETY: rows j0 .. j0 + nb <= n of the [N, K] operand (column stride b.1),
                // its elements t0 .. t0 + kt <= k; the tile holds kt rows of THIN_COLS >= nb.
                unsafe {
                    let src = b.offset(j0 as isize * self.b.1 + t0 as isize);
                    transpose_into(src, self.b.1 as usize, kt, nb, &mut tile, THIN_COLS);
                }
                for kk in 0..kt {
                    let w: &[f32; THIN_COLS] =
                        tile[kk * THIN_COLS..(kk + 1) * THIN_COLS].try_into().expect("a tile row");
                    for (i, row) in acc[..m].iter_mut().enumerate() {
                        // SAFETY: row i < m, column t0 + kk < k of the left operand.
                        let x = unsafe { *a.offset(i as isize * self.a.0 + (t0 + kk) as isize * self.a.1) };
                        for (c, &y) in row.iter_mut().zip(w) {
                            *c = fused(x, y, *c);
                        }
                    }
                }
            }
            for (i, row) in acc[..m].iter().enumerate() {
                // SAFETY: row i < m, columns j0 .. j0 + nb <= n of the output.
                unsafe { self.store(out, (i, j0), &row[..nb], accumulate || k0 > 0) };
            }
        }
    }

    /// A block's sums for output row `i`, columns j0 .. j0 + sums.len(): stored, or added to
    /// what the output holds with `accumulate`.
    ///
    /// # Safety
    /// Those elements lie in the output (row i < m, j0 + sums.len() <= n).
    #[inline(always)]
    unsafe fn store(&self, out: *mut f32, (i, j0): (usize, usize), sums: &[f32], accumulate: bool) {
        // SAFETY: the caller's contract.
        let o = unsafe {
            std::slice::from_raw_parts_mut(out.offset(i as isize * self.out_rs + j0 as isize), sums.len())
        };
        if accumulate {
            o.iter_mut().zip(sums).for_each(|(o, &c)| *o += c);
        } else {
            o.copy_from_slice(sums);
        }
    }

    /// A thin or small chunk in the packed kernel's order: per element a fused multiply-add
    /// chain over the chunk's k from zero, then stored (or added to the output once). Blocks of
    /// `BI` rows x `BJ` columns keep independent chains side by side (a column vector runs `BI`
    /// at once, a row vector vectorises along its columns).
    ///
    /// # Safety
    /// As `run`, for an m x kb left and kb x n right operand.
    unsafe fn direct(&self, kb: usize, a: *const f32, b: *const f32, out: *mut f32, accumulate: bool) {
        const BI: usize = 8;
        const BJ: usize = 32;
        let (m, n) = (self.m, self.n);
        let mut acc = [[0.0f32; BJ]; BI];
        for i0 in (0..m).step_by(BI) {
            let bi = BI.min(m - i0);
            for j0 in (0..n).step_by(BJ) {
                let bj = BJ.min(n - j0);
                for row in &mut acc[..bi] {
                    row[..bj].fill(0.0);
                }
                for kk in 0..kb {
                    // SAFETY: kk < kb, j0 + bj <= n, i0 + bi <= m: every element read lies in
                    // the m x kb and kb x n matrices the caller vouched for.
                    unsafe {
                        let brow = b.offset(kk as isize * self.b.0 + j0 as isize * self.b.1);
                        let mut bv = [0.0f32; BJ];
                        if self.b.1 == 1 {
                            bv[..bj].copy_from_slice(std::slice::from_raw_parts(brow, bj));
                        } else {
                            for (jj, v) in bv[..bj].iter_mut().enumerate() {
                                *v = *brow.offset(jj as isize * self.b.1);
                            }
                        }
                        for (ii, row) in acc[..bi].iter_mut().enumerate() {
                            let x = *a.offset((i0 + ii) as isize * self.a.0 + kk as isize * self.a.1);
                            for (c, &y) in row[..bj].iter_mut().zip(&bv[..bj]) {
                                *c = fused(x, y, *c);
                            }
                        }
                    }
                }
                for (ii, row) in acc[..bi].iter().enumerate() {
                    // SAFETY: row i0 + ii < m, columns j0 .. j0 + bj <= n of the output.
                    unsafe { self.store(out, (i0 + ii, j0), &row[..bj], accumulate) };
                }
            }
        }
    }
}

/// Whether a stride of `stride` floats maps successive rows into one set of an L1 cache: a
/// multiple of 4 KiB (with 64-byte lines and 64 sets, an address's set is bits 6..12).
fn aliasing(stride: isize) -> bool {
    stride > 0 && (stride as usize * 4).is_multiple_of(4096)
}

/// Rows, columns per block and depth per tile of `Gemm::thin_transposed`: the block's sums
/// (8 x 32) and its tile of the operand (64 x 32, 8 KiB) stay in L1.
const THIN_ROWS: usize = 8;
const THIN_COLS: usize = 32;
const THIN_DEPTH: usize = 64;

/// Columns per panel of `Gemm::chunk_untransposed`: a panel of `KC` rows is about 2 MiB.
const ALIASED_BLOCK: usize = 1024;

thread_local! {
    /// Each thread's panel for `Gemm::chunk_untransposed`.
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `dst[kk * ld + j] = src[j * stride + kk]` for kk < kb, j < nb: a transposition in tiles of
/// 8 x 8 (`transpose8`: in registers where the build has AVX), the edges an element at a time,
/// so that both sides stay within 8 cache lines at a time. An element at a time throughout (16 x
/// 16 tiles through an array) it cost about a cycle an element: 0.3 ms of the 0.5 ms of
/// EfficientNet-B0's batch-2 classifier in `Gemm::thin_transposed`.
///
/// # Safety
/// `src` is valid for `nb` rows of `kb` floats at `stride`; `dst` holds `kb * ld` floats and
/// `ld >= nb`.
pub(crate) unsafe fn transpose_into(
    src: *const f32,
    stride: usize,
    kb: usize,
    nb: usize,
    dst: &mut [f32],
    ld: usize,
) {
    const T: usize = 8;
    assert!(kb == 0 || nb == 0 || (kb - 1) * ld + nb <= dst.len(), "the destination holds the transposition");
    let (full_j, full_k) = (nb - nb % T, kb - kb % T);
    for j0 in (0..full_j).step_by(T) {
        for k0 in (0..full_k).step_by(T) {
            // SAFETY: rows j0 .. j0 + 8 <= nb, elements k0 .. k0 + 8 <= kb of them; destination
            // rows k0 .. k0 + 8 <= kb, columns j0 .. j0 + 8 <= nb <= ld, inside dst (asserted).
            unsafe { transpose8(src.add(j0 * stride + k0), stride, dst.as_mut_ptr().add(k0 * ld + j0), ld) };
        }
    }
    // The edges: columns past the last full tile of rows, and rows past the last full tile of
    // elements.
    let mut edge = |j: usize, kk: usize| {
        // SAFETY: j < nb, kk < kb: inside the source rows; the destination index is checked.
        dst[kk * ld + j] = unsafe { *src.add(j * stride + kk) };
    };
    for j in 0..full_j {
        (full_k..kb).for_each(|kk| edge(j, kk));
    }
    for j in full_j..nb {
        (0..kb).for_each(|kk| edge(j, kk));
    }
}

/// `dst[k * ld + j] = src[j * stride + k]` for j, k < 8, in AVX registers.
///
/// # Safety
/// `src` is valid for 8 rows of 8 floats at `stride`, `dst` for 8 rows of 8 floats at `ld`.
#[inline(always)]
unsafe fn transpose8(src: *const f32, stride: usize, dst: *mut f32, ld: usize) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    // SAFETY: the build has AVX (cfg); the loads and stores stay inside the caller's rows.
    unsafe {
        use std::arch::x86_64::*;
        let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src.add(j * stride)));
        let t = [
            _mm256_unpacklo_ps(r[0], r[1]),
            _mm256_unpackhi_ps(r[0], r[1]),
            _mm256_unpacklo_ps(r[2], r[3]),
            _mm256_unpackhi_ps(r[2], r[3]),
            _mm256_unpacklo_ps(r[4], r[5]),
            _mm256_unpackhi_ps(r[4], r[5]),
            _mm256_unpacklo_ps(r[6], r[7]),
            _mm256_unpackhi_ps(r[6], r[7]),
        ];
        let q = [
            _mm256_shuffle_ps::<0x44>(t[0], t[2]),
            _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
            _mm256_shuffle_ps::<0x44>(t[1], t[3]),
            _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
            _mm256_shuffle_ps::<0x44>(t[4], t[6]),
            _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
            _mm256_shuffle_ps::<0x44>(t[5], t[7]),
            _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
        ];
        for k in 0..4 {
            _mm256_storeu_ps(dst.add(k * ld), _mm256_permute2f128_ps::<0x20>(q[k], q[k + 4]));
            _mm256_storeu_ps(dst.add((k + 4) * ld), _mm256_permute2f128_ps::<0x31>(q[k], q[k + 4]));
        }
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
    for j in 0..8 {
        for k in 0..8 {
            // SAFETY: j, k < 8: inside the caller's rows.
            unsafe { *dst.add(k * ld + j) = *src.add(j * stride + k) };
        }
    }
}

struct MatMul {
    g: Gemm,
    /// Per output matrix: element offsets of its A and B matrices.
    batches: Vec<(usize, usize)>,
    threads: Threads,
    /// The types of A, B and the output (f32, f16 or bf16: `Gemm::run_mixed`).
    types: [DType; 3],
    desc: String,
}

/// The product's GEMM and, per output matrix, the element offsets of its A and B matrices
/// : operand strides read transposes in place, batch axes
/// broadcast, and a [B, M, K] @ [K, N] product folds its batch into M (one GEMM, one entry).
pub(crate) fn layout(a: &Shape, b: &Shape, ta: bool, tb: bool, out: &Shape) -> (Gemm, Vec<(usize, usize)>) {
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
    (g, batches)
}

/// The product of `a` and `b` (transposed as `ta`, `tb`) into `out`; `types` are theirs (A, B,
/// output: f32, f16 or bf16).
pub(crate) fn matmul(
    a: &Shape,
    b: &Shape,
    (ta, tb): (bool, bool),
    out: &Shape,
    types: [DType; 3],
) -> Box<dyn CpuKernel> {
    let (g, batches) = layout(a, b, ta, tb, out);
    let r = out.rank();
    let (m, n) = (out.dims()[r - 2], out.dims()[r - 1]);
    let k = g.k;
    let batch: usize = out.dims()[..r - 2].iter().product();
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
    Box::new(MatMul { g, batches, threads, types, desc })
}

impl CpuKernel for MatMul {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (a, b, o) = (SendPtr::new(inputs[0]), SendPtr::new(inputs[1]), SendPtr::new(output));
        let [ta, tb, to] = self.types;
        let size = self.g.m * self.g.n;
        let one = |i: usize, parallel: bool| {
            let (ao, bo) = self.batches[i];
            // SAFETY: offsets come from the operand shapes (in elements of each one's type);
            // output matrices are disjoint.
            unsafe {
                let (a, b) =
                    (Matrix::new(a.get(), ta).at(ao as isize), Matrix::new(b.get(), tb).at(bo as isize));
                self.g.run_mixed(a, b, Matrix::new(o.get(), to).at((i * size) as isize), false, parallel)
            }
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
    /// The types of a, b and the output (`Gemm::run_mixed`).
    types: [DType; 3],
    /// The element offset of the block's first column in `a`.
    offset: usize,
    parallel: bool,
    desc: String,
}

/// a[:, rows]ᵀ · b for a[M, K], b[M, N] (checked by `ir::infer`): one GEMM of rows.len x M x N
/// reading the block of `a`'s columns in place (row stride 1, column stride K).
pub(crate) fn matmul_rows(
    a: &Shape,
    b: &Shape,
    rows: Rows,
    out: &Shape,
    types: [DType; 3],
) -> Box<dyn CpuKernel> {
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
    let parallel = rows.len * n * m_rows >= SERIAL_MACS;
    Box::new(MatMulRows { g, types, offset: rows.start, parallel, desc })
}

impl CpuKernel for MatMulRows {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let [ta, tb, to] = self.types;
        // SAFETY: `ir::infer` checked rows.start + rows.len <= K, so every element the strided
        // block reads (column offset + i, row r < M) lies in a[M, K]; the output holds
        // rows.len x N elements and is not an operand (a compute op's own buffer).
        unsafe {
            let (a, b) = (Matrix::new(inputs[0], ta).at(self.offset as isize), Matrix::new(inputs[1], tb));
            self.g.run_mixed(a, b, Matrix::new(output, to), false, self.parallel)
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::Gemm;
    use crate::cpu::test_values as values;

    fn transposed(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0.0; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = x[r * cols + c];
            }
        }
        t
    }

    /// The bits of one m x k x n product, `ta`/`tb` reading the operand transposed through its
    /// strides (from the transposed copies `at`/`bt`), rows `r0..r1` of it only.
    fn product(
        (m, n, k): (usize, usize, usize),
        (a, at): (&[f32], &[f32]),
        (b, bt): (&[f32], &[f32]),
        ta: bool,
        tb: bool,
        (r0, r1): (usize, usize),
    ) -> Vec<u32> {
        let g = Gemm {
            m: r1 - r0,
            n,
            k,
            a: if ta { (1, m as isize) } else { (k as isize, 1) },
            b: if tb { (1, k as isize) } else { (n as isize, 1) },
            out_rs: n as isize,
        };
        let mut out = vec![0.0f32; (r1 - r0) * n];
        let (pa, pb) = (if ta { at } else { a }, if tb { bt } else { b });
        let first = if ta { r0 } else { r0 * k };
        // SAFETY: the buffers hold m x k, k x n and (r1 - r0) x n elements as the strides read,
        // from row r0 on.
        unsafe { g.run(pa[first..].as_ptr(), pb.as_ptr(), out.as_mut_ptr(), false, false) };
        out.iter().map(|v| v.to_bits()).collect()
    }

    /// Every element of a product is one sum in one order, whatever reaches the kernel: an
    /// operand read transposed through its strides gives the bits of a transposed copy, a block
    /// of rows the bits of those rows of the whole (thin blocks run `Gemm::direct`, so its order
    /// is the packed kernel's), and Bᵀ·Aᵀ the bits of A·B transposed — thin, small and deep
    /// (k past `KC`) products included. What reading transposes in place (`transpose_operands`)
    /// and fused row blocks rely on.
    #[test]
    fn a_product_sums_in_one_order_whatever_its_layout() {
        let sizes = [1usize, 2, 3, 5, 8, 13, 16, 17, 31, 64, 100, 257];
        let mut bad = Vec::new();
        for &m in &sizes {
            for &n in &sizes {
                for &k in &[1usize, 2, 3, 7, 16, 64, 130, 600, 1100] {
                    let a = values(m * k, (m * 31 + k) as u32);
                    let b = values(k * n, (n * 17 + k) as u32);
                    let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
                    let run = |ta, tb, rows| product((m, n, k), (&a, &at), (&b, &bt), ta, tb, rows);
                    let want = run(false, false, (0, m));
                    for (ta, tb) in [(true, false), (false, true), (true, true)] {
                        if run(ta, tb, (0, m)) != want {
                            bad.push(format!("{m}x{k}x{n} ta {ta} tb {tb}"));
                        }
                    }
                    for (r0, r1) in [(0, 1), (m / 2, m), (m - 1, m), (0, m.min(7))] {
                        if r0 < r1 && run(false, false, (r0, r1))[..] != want[r0 * n..r1 * n] {
                            bad.push(format!("{m}x{k}x{n} rows {r0}..{r1}"));
                        }
                    }
                    // Bᵀ·Aᵀ, [n, m], read from the same buffers, transposed back.
                    let swapped = product((n, m, k), (&bt, &b), (&at, &a), true, true, (0, n));
                    if transposed_bits(&swapped, n, m) != want {
                        bad.push(format!("{m}x{k}x{n} swapped"));
                    }
                }
            }
        }
        assert!(bad.is_empty(), "{} differ: {:?}", bad.len(), &bad[..bad.len().min(40)]);
    }

    /// A transposed right factor at a 4 KiB-multiple stride (K a multiple of 1,024) is copied
    /// to row-major panels (`Gemm::chunk_untransposed`), in blocks of `ALIASED_BLOCK` columns:
    /// the same bits as the product of the row-major factor, whole or in row blocks.
    #[test]
    fn an_aliasing_transposed_factor_keeps_the_sums() {
        for (m, n, k) in [(2usize, 1000usize, 1024usize), (5, 70, 2048), (64, 1030, 1024), (17, 2100, 1024)] {
            let a = values(m * k, (m * 31 + k) as u32);
            let b = values(k * n, (n * 17 + k) as u32);
            let (at, bt) = (transposed(&a, m, k), transposed(&b, k, n));
            let run = |tb, rows| product((m, n, k), (&a, &at), (&b, &bt), false, tb, rows);
            let want = run(false, (0, m));
            assert!(run(true, (0, m)) == want, "{m}x{k}x{n}");
            assert!(run(true, (m / 2, m))[..] == want[m / 2 * n..], "{m}x{k}x{n} rows {}..{m}", m / 2);
        }
    }

    fn transposed_bits(x: &[u32], rows: usize, cols: usize) -> Vec<u32> {
        let mut t = vec![0; x.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows + r] = x[r * cols + c];
            }
        }
        t
    }
}
