//! Scaled dot-product attention and its gradient, FlashAttention-2's algorithm on the CPU.
//!
//! The operands are seen as `bh` batch-heads of q `[S, D]`, k and v `[T, D]`, contiguous; the
//! bias, when given, broadcasts to `[bh, S, T]` through precomputed strides (an offset per
//! batch-head, a stride per query row and per key, 0 along broadcast axes). A masked entry of the
//! causal mask gets -1e9 added to its score, as the DSL's composed form does.
//!
//! Forward, per (batch-head, block of `BR` query rows): the keys go by in tiles of `BC`; each
//! row keeps a running maximum m and sum l and its output row is rescaled by e^(m_old - m_new)
//! before the tile's p·v is added; the row is divided by l at the end. Scores live one
//! `[BR, BC]` tile at a time on the stack, never as an `[S, T]` buffer. The tile products
//! (q·kᵀ, p·v and the gradient's five) are single-threaded GEMMs (the `gemm` crate).
//!
//! Backward, per batch-head, query blocks in order: each row's log-sum-exp is recomputed (a pass
//! over the key tiles) with Dᵢ = doᵢ·oᵢ, then for every key tile P = e^(score - lse),
//! dv += Pᵀ·do, dp = do·vᵀ, ds = P∘(dp - D), dq += scale·ds·k and dk += scale·dsᵀ·q, written
//! straight into the packed output `[dq; dk; dv]`.
//!
//! Key tiles that the causal mask hides from every row of a block are skipped, unless some row of
//! the block sees no key at all (S > T): such a row attends uniformly, as with the composed form.
//! Every sum runs in a fixed order inside one task, so the bits do not depend on the thread count.
//!
//! Half operands (a mixed-precision step's f16 or bf16 q, k, v, o, do and bias): one task per
//! batch-head widens the head's q, k and v (and o and do) into buffers of its thread, `[S, D]`
//! and `[T, D]` floats, runs the f32 algorithm on them, and rounds the head's output as it stores
//! it (ties to even, as `Op::Cast`); the bias is widened element by element as the scores read
//! it. The arithmetic is the f32 kernel's on the widened values, so the bits are those of the op
//! widened (`kiln_compiler::widen`) while the plan holds the half values alone.

use super::cast::widen_half;
use super::par::{SendPtr, par_ranges};
use super::simd::multiversion;
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{DType, Shape};
use std::slice;

thread_local! {
    /// Each thread's widened batch-head (q, k, v, o, do) and its f32 output block.
    static HEAD: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Query rows per forward task and per backward block.
const BR: usize = 64;
/// Keys per tile.
const BC: usize = 128;
/// Independent accumulators of the dot products, row maxima and sums, so that they vectorise in
/// a fixed order: one AVX-512 vector, two AVX2 ones.
const LANES: usize = 16;
/// What the causal mask adds to a hidden score (the DSL's value).
const MASKED: f32 = -1e9;

/// The bias's layout against the scores `[bh, S, T]`.
struct Bias {
    /// The bias's first element for each batch-head.
    offsets: Vec<usize>,
    /// Its stride along the query rows (0 when broadcast).
    row: usize,
    /// Its stride along the keys (0 when broadcast).
    col: usize,
}

/// The forward (`grad == false`) or gradient kernel for fixed shapes.
pub(crate) struct Attention {
    bh: usize,
    s: usize,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    grad: bool,
    bias: Option<Bias>,
    /// The bias's type where it is f16 or bf16 (widened as the scores read it).
    bias_half: Option<DType>,
    /// The operands' types (q, k, v, then o and do for the gradient) and the output's, where
    /// any of them is f16 or bf16: each batch-head is widened, computed and rounded (module doc).
    half: Option<(Vec<DType>, DType)>,
    desc: String,
}

/// Prepares `Op::Attention` (`grad == false`: q, k, v, optional bias) or `Op::AttentionGrad`
/// (q, k, v, o, do, optional bias), of the given types (f32, f16 or bf16) and output type. The
/// shapes were checked by `ir::infer`.
pub(crate) fn attention(
    operands: &[(&Shape, DType)],
    out_type: DType,
    scale: f32,
    causal: bool,
    grad: bool,
) -> Box<dyn CpuKernel> {
    let inputs: Vec<&Shape> = operands.iter().map(|&(s, _)| s).collect();
    let is_half = |d: DType| d.is_half();
    let (q, k) = (inputs[0], inputs[1]);
    let r = q.rank();
    let lead = &q.dims()[..r - 2];
    let (s, t, d) = (q.back(2), k.back(2), q.back(1));
    let bh: usize = lead.iter().product();
    let bias_at = if grad { 5 } else { 3 };
    let bias = inputs.get(bias_at).map(|b| {
        // Full score dims lead ++ [S, T]; the bias's dims align on the right.
        let mut full = lead.to_vec();
        full.extend([s, t]);
        let bd = b.dims();
        let pad = full.len() - bd.len();
        let mut strides = vec![0usize; full.len()];
        let mut acc = 1;
        for i in (0..bd.len()).rev() {
            if bd[i] != 1 {
                strides[pad + i] = acc;
            }
            acc *= bd[i];
        }
        let offsets = (0..bh)
            .map(|mut h| {
                let mut off = 0;
                for a in (0..lead.len()).rev() {
                    off += (h % lead[a]) * strides[a];
                    h /= lead[a];
                }
                off
            })
            .collect();
        Bias { offsets, row: strides[full.len() - 2], col: strides[full.len() - 1] }
    });
    let name = if grad { "attention_grad" } else { "attention" };
    let mut desc = format!("{name} q {} k {}", shape_text(q), shape_text(k));
    if causal {
        desc.push_str(" causal");
    }
    if let Some(b) = inputs.get(bias_at) {
        desc.push_str(&format!(" bias {}", shape_text(b)));
    }
    let bias_half = operands.get(bias_at).map(|&(_, d)| d).filter(|&d| is_half(d));
    let types: Vec<DType> = operands[..bias_at].iter().map(|&(_, d)| d).collect();
    let half = (types.iter().any(|&d| is_half(d)) || is_half(out_type)).then_some((types, out_type));
    Box::new(Attention { bh, s, t, d, scale, causal, grad, bias, bias_half, half, desc })
}

/// a·b over `LANES` running sums, combined in a fixed order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let rest: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut sum = 0.0;
    for l in lanes {
        sum += l;
    }
    sum + rest
}

/// The operands' and the output's first elements: of batch-head `head`, where the pointers are
/// one head's widened copies, else (`head` 0) of the whole tensors. The bias is the whole one.
#[derive(Clone, Copy)]
struct Ptrs {
    head: usize,
    q: SendPtr<f32>,
    k: SendPtr<f32>,
    v: SendPtr<f32>,
    /// The forward output (gradient: operand 3).
    o: SendPtr<f32>,
    /// The output's gradient (gradient only).
    g: SendPtr<f32>,
    bias: SendPtr<f32>,
    out: SendPtr<f32>,
}

impl Attention {
    /// The key tiles that rows i0..i1 must visit: all of them, or (causal) up to the last key
    /// that row i1 - 1 sees, unless a row of the block sees no key at all.
    #[inline(always)]
    fn key_end(&self, i0: usize, i1: usize) -> usize {
        if self.causal && i0 + self.t >= self.s {
            // Row i1 - 1 sees keys j <= i1 - 1 + T - S.
            (i1 + self.t - self.s).min(self.t)
        } else {
            self.t
        }
    }

    /// The scores of rows (i0, rows): i0..i0 + rows of batch-head h against keys (j0, w):
    /// j0..j0 + w into `sc`
    /// (`[rows, BC]`, row stride `BC`): scale · q·kᵀ (one GEMM), plus the bias and the mask.
    ///
    /// # Safety
    /// The pointers hold the whole operands; h < bh, i0 + rows <= S, j0 + w <= T, rows <= BR,
    /// w <= BC.
    #[inline(always)]
    unsafe fn scores(
        &self,
        p: &Ptrs,
        h: usize,
        (i0, rows): (usize, usize),
        (j0, w): (usize, usize),
        sc: &mut [f32],
    ) {
        let d = self.d;
        // SAFETY: sc holds rows x BC; the rows of q and k read are in bounds by the contract.
        unsafe {
            mm(
                (rows, w, d),
                sc.as_mut_ptr(),
                BC,
                false,
                (p.q.get().add(((h - p.head) * self.s + i0) * d), d, 1),
                (p.k.get().add(((h - p.head) * self.t + j0) * d), 1, d),
                self.scale,
            )
        };
        if self.bias.is_none() && !self.causal {
            return;
        }
        for r in 0..rows {
            let i = i0 + r;
            let row = &mut sc[r * BC..r * BC + w];
            if let Some(b) = &self.bias {
                let base = b.offsets[h] + i * b.row;
                let at = |jj: usize| base + (j0 + jj) * b.col;
                // SAFETY (both branches): the bias's strides map (h, i, j) into its own elements.
                match self.bias_half {
                    // A bias contiguous along the keys (a padding mask): a slice, vectorised.
                    None if b.col == 1 => {
                        // SAFETY: with stride 1 the row's w elements from `at(0)` are the bias's.
                        let bias = unsafe { slice::from_raw_parts(p.bias.get().add(at(0)), w) };
                        row.iter_mut().zip(bias).for_each(|(x, b)| *x += b);
                    }
                    None => row
                        .iter_mut()
                        .enumerate()
                        .for_each(|(jj, x)| *x += unsafe { *p.bias.get().add(at(jj)) }),
                    Some(t) => {
                        let bias = p.bias.get() as *const u16;
                        row.iter_mut()
                            .enumerate()
                            .for_each(|(jj, x)| *x += widen_half(t, unsafe { *bias.add(at(jj)) }));
                    }
                }
            }
            if self.causal {
                // Keys j > i + T - S are hidden.
                let first = (i + self.t + 1).saturating_sub(self.s).max(j0) - j0;
                for x in row.iter_mut().skip(first) {
                    *x += MASKED;
                }
            }
        }
    }

    /// Each row's running maximum and sum over keys 0..end, for rows i0..i0 + m.len().
    ///
    /// # Safety
    /// As `scores`.
    #[inline(always)]
    unsafe fn row_stats(&self, p: &Ptrs, h: usize, i0: usize, end: usize, m: &mut [f32], l: &mut [f32]) {
        let mut sc = [0f32; BR * BC];
        let rows = m.len();
        for j0 in (0..end).step_by(BC) {
            let w = BC.min(end - j0);
            // SAFETY: forwarded contract.
            unsafe { self.scores(p, h, (i0, rows), (j0, w), &mut sc) };
            for (r, (m, l)) in m.iter_mut().zip(l.iter_mut()).enumerate() {
                let row = &mut sc[r * BC..r * BC + w];
                let mn = m.max(row_max(row));
                if mn == f32::NEG_INFINITY {
                    continue;
                }
                *l = *l * super::vmath::exp_nonpositive(*m - mn) + weights(row, mn);
                *m = mn;
            }
        }
    }

    /// The forward pass of query block `u % blocks` of batch-head `u / blocks`.
    ///
    /// # Safety
    /// The pointers hold the whole operands and output; tasks write disjoint output rows.
    #[inline(always)]
    unsafe fn forward_block(&self, p: &Ptrs, u: usize) {
        let (s, t, d) = (self.s, self.t, self.d);
        let blocks = s.div_ceil(BR);
        let (h, i0) = (u / blocks, (u % blocks) * BR);
        let rows = BR.min(s - i0);
        let end = self.key_end(i0, i0 + rows);
        let out = p.out.get();
        // SAFETY: rows i0..i0 + rows of batch-head h's output, this task's own.
        let o = unsafe { slice::from_raw_parts_mut(out.add(((h - p.head) * s + i0) * d), rows * d) };
        o.fill(0.0);
        let (mut m, mut l) = ([f32::NEG_INFINITY; BR], [0f32; BR]);
        let mut sc = [0f32; BR * BC];
        for j0 in (0..end).step_by(BC) {
            let w = BC.min(end - j0);
            // SAFETY: forwarded contract; j0 + w <= T.
            unsafe { self.scores(p, h, (i0, rows), (j0, w), &mut sc) };
            for r in 0..rows {
                let row = &mut sc[r * BC..r * BC + w];
                let mn = m[r].max(row_max(row));
                if mn == f32::NEG_INFINITY {
                    row.fill(0.0);
                    continue;
                }
                let alpha = super::vmath::exp_nonpositive(m[r] - mn);
                if alpha != 1.0 {
                    for x in &mut o[r * d..(r + 1) * d] {
                        *x *= alpha;
                    }
                }
                l[r] = l[r] * alpha + weights(row, mn);
                m[r] = mn;
            }
            // SAFETY: o += P·V over this tile: P rows x w (stride BC), v rows j0..j0 + w.
            unsafe {
                mm(
                    (rows, d, w),
                    o.as_mut_ptr(),
                    d,
                    true,
                    (sc.as_ptr(), BC, 1),
                    (p.v.get().add(((h - p.head) * t + j0) * d), d, 1),
                    1.0,
                )
            };
        }
        for r in 0..rows {
            let inv = 1.0 / l[r];
            for x in &mut o[r * d..(r + 1) * d] {
                *x *= inv;
            }
        }
    }

    /// The gradient for batch-head h: dq, dk and dv into its `[S + 2T, D]` output block.
    ///
    /// # Safety
    /// The pointers hold the whole operands and output; tasks take disjoint batch-heads.
    #[inline(always)]
    unsafe fn backward_head(&self, p: &Ptrs, h: usize) {
        let (s, t, d, scale) = (self.s, self.t, self.d, self.scale);
        let at = h - p.head;
        let base = p.out.get().wrapping_add(at * (s + 2 * t) * d);
        // SAFETY: batch-head h's output block, this task's own.
        unsafe { slice::from_raw_parts_mut(base, (s + 2 * t) * d) }.fill(0.0);
        let (dq, dk, dv) = (base, base.wrapping_add(s * d), base.wrapping_add((s + t) * d));
        // SAFETY: batch-head h's operands, read only.
        let (q, k, v, o, g) = unsafe {
            (
                p.q.get().add(at * s * d),
                p.k.get().add(at * t * d),
                p.v.get().add(at * t * d),
                slice::from_raw_parts(p.o.get().add(at * s * d), s * d),
                slice::from_raw_parts(p.g.get().add(at * s * d), s * d),
            )
        };
        let (mut pt, mut ds) = ([0f32; BR * BC], [0f32; BR * BC]);
        for i0 in (0..s).step_by(BR) {
            let rows = BR.min(s - i0);
            let end = self.key_end(i0, i0 + rows);
            let (mut m, mut l) = ([f32::NEG_INFINITY; BR], [0f32; BR]);
            // SAFETY: forwarded contract.
            unsafe { self.row_stats(p, h, i0, end, &mut m[..rows], &mut l[..rows]) };
            let (mut lse, mut di) = ([0f32; BR], [0f32; BR]);
            for r in 0..rows {
                lse[r] = m[r] + super::vmath::ln(l[r]);
                let i = i0 + r;
                di[r] = dot(&g[i * d..(i + 1) * d], &o[i * d..(i + 1) * d]);
            }
            let gb = g[i0 * d..].as_ptr();
            let qb = q.wrapping_add(i0 * d);
            for j0 in (0..end).step_by(BC) {
                let w = BC.min(end - j0);
                let (kt, vt) = (k.wrapping_add(j0 * d), v.wrapping_add(j0 * d));
                // SAFETY: forwarded contract; j0 + w <= T. dp = do·vᵀ into `ds`.
                unsafe {
                    self.scores(p, h, (i0, rows), (j0, w), &mut pt);
                    mm((rows, w, d), ds.as_mut_ptr(), BC, false, (gb, d, 1), (vt, 1, d), 1.0);
                }
                for r in 0..rows {
                    let (pr, dr) = (&mut pt[r * BC..r * BC + w], &mut ds[r * BC..r * BC + w]);
                    for (x, y) in pr.iter_mut().zip(dr.iter_mut()) {
                        *x = weight(*x - lse[r]);
                        *y = scale * *x * (*y - di[r]);
                    }
                }
                // SAFETY: dv[j0..] += Pᵀ·do, dq[i0..] += dS·k, dk[j0..] += dSᵀ·q: tiles of this
                // task's output block and of its operands, in bounds.
                unsafe {
                    mm((w, d, rows), dv.add(j0 * d), d, true, (pt.as_ptr(), 1, BC), (gb, d, 1), 1.0);
                    mm((rows, d, w), dq.add(i0 * d), d, true, (ds.as_ptr(), BC, 1), (kt, d, 1), 1.0);
                    mm((w, d, rows), dk.add(j0 * d), d, true, (ds.as_ptr(), 1, BC), (qb, d, 1), 1.0);
                }
            }
        }
    }
}

/// e^x for a score less its row's maximum (or log-sum-exp), 0 where e^x would be below f32's
/// normal range: a masked key's weight is then exactly 0 instead of a subnormal, whose
/// arithmetic costs x86 cores 10-100x (relative contributions below 2^-125, invisible).
#[inline(always)]
fn weight(x: f32) -> f32 {
    // Both sides computed, then a select: a branch would keep the loops scalar. The exponential
    // of a hidden score is taken at -87, so that it never makes the subnormal it avoids.
    let e = super::vmath::exp_nonpositive(x.max(-87.0));
    if x < -87.0 { 0.0 } else { e }
}

/// The largest element of a row of scores: `LANES` running maxima, then their maximum, so
/// that the loop vectorises (one running maximum is a chain of dependent instructions).
#[inline(always)]
fn row_max(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let rest = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for l in 0..LANES {
            lanes[l] = lanes[l].max(c[l]);
        }
    }
    lanes.iter().fold(rest, |a, &b| a.max(b))
}

/// Each score of `row` replaced by its weight against the row's maximum `mn`
/// (`weight(x - mn)`); their sum, in `LANES` partial sums added in lane order, then the
/// remainder: a fixed order, and a loop that vectorises (a single running sum is a chain of
/// dependent additions, 4 cycles each: with it and a single running maximum, BERT-base's
/// attention at 2 x 256 took 6.2 ms a layer on one AVX-512 core, 3x its products).
#[inline(always)]
fn weights(row: &mut [f32], mn: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = row.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            c[l] = weight(c[l] - mn);
            lanes[l] += c[l];
        }
    }
    let mut rest = 0.0;
    for x in chunks.into_remainder() {
        *x = weight(*x - mn);
        rest += *x;
    }
    lanes.iter().sum::<f32>() + rest
}

/// dst (`[m, n]`, row stride `dst_rs`) = (dst if `read`) + beta · lhs · rhs, lhs `[m, k]` and
/// rhs `[k, n]` given as (pointer, row stride, column stride); one thread.
///
/// # Safety
/// Every pointer is valid for the elements its strides reach; dst overlaps neither operand.
#[inline(always)]
unsafe fn mm(
    (m, n, k): (usize, usize, usize),
    dst: *mut f32,
    dst_rs: usize,
    read: bool,
    lhs: (*const f32, usize, usize),
    rhs: (*const f32, usize, usize),
    beta: f32,
) {
    // SAFETY: forwarded contract. gemm computes dst = alpha·dst + beta·lhs·rhs and does not read
    // dst when `read` is false.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            read,
            lhs.0,
            lhs.2 as isize,
            lhs.1 as isize,
            rhs.0,
            rhs.2 as isize,
            rhs.1 as isize,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

multiversion! {
    /// `Attention::forward_block` on the widest vectors the CPU has (`simd`).
    unsafe fn forward_dispatch / forward_at(kernel: &Attention, p: &Ptrs, u: usize) => Attention::forward_block;
}

multiversion! {
    /// `Attention::backward_head` on the widest vectors the CPU has (`simd`).
    unsafe fn backward_dispatch / backward_at(kernel: &Attention, p: &Ptrs, h: usize) => Attention::backward_head;
}

impl CpuKernel for Attention {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let ptr = |i: usize| SendPtr::new(inputs.get(i).map_or(std::ptr::null_mut(), |&x| x as *mut f32));
        let bias_at = if self.grad { 5 } else { 3 };
        if let Some((types, out_type)) = &self.half {
            // SAFETY: forwarded contract.
            return unsafe { self.run_widened(inputs, output, types, *out_type) };
        }
        let p = Ptrs {
            head: 0,
            q: ptr(0),
            k: ptr(1),
            v: ptr(2),
            o: if self.grad { ptr(3) } else { ptr(usize::MAX) },
            g: if self.grad { ptr(4) } else { ptr(usize::MAX) },
            bias: ptr(bias_at),
            out: SendPtr::new(output as *mut f32),
        };
        let work = self.t * self.d * 4;
        if self.grad {
            par_ranges(self.bh, self.s * work * 3, |a, b| {
                for h in a..b {
                    // SAFETY: the pointers hold the whole tensors (`run`'s contract); each batch-head
                    // writes its own output block.
                    unsafe { backward_dispatch(self, &p, h) };
                }
            });
        } else {
            let blocks = self.s.div_ceil(BR);
            par_ranges(self.bh * blocks, BR * work, |a, b| {
                for u in a..b {
                    // SAFETY: as above; each unit writes its own query rows.
                    unsafe { forward_dispatch(self, &p, u) };
                }
            });
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

impl Attention {
    /// `run` for operands or an output of half types: one task per batch-head widens the
    /// head's operands into its thread's buffer, computes it in f32 and stores its output
    /// block in `out_type` (module doc).
    ///
    /// # Safety
    /// As `run`: every pointer is valid for its tensor of its type; the output overlaps none.
    unsafe fn run_widened(&self, inputs: &[*mut u8], output: *mut u8, types: &[DType], out_type: DType) {
        let (s, t, d) = (self.s, self.t, self.d);
        // Per operand (q, k, v, then o and do): elements per head.
        let sizes: Vec<usize> =
            (0..types.len()).map(|i| if i == 1 || i == 2 { t * d } else { s * d }).collect();
        let out_size = if self.grad { (s + 2 * t) * d } else { s * d };
        let total = sizes.iter().sum::<usize>() + out_size;
        let ins: Vec<SendPtr<u8>> = inputs.iter().map(|&p| SendPtr::new(p)).collect();
        let bias = SendPtr::new(inputs.get(types.len()).map_or(std::ptr::null_mut(), |&p| p as *mut f32));
        let out = SendPtr::new(output);
        let head = |h: usize, buf: &mut Vec<f32>| {
            buf.resize(total, 0.0);
            let mut starts = Vec::with_capacity(types.len());
            let mut at = 0;
            for (i, (&n, &ty)) in sizes.iter().zip(types).enumerate() {
                // SAFETY: head h's n elements of operand i lie inside it (the contract).
                unsafe { super::cast::widen_into(ins[i].get(), ty, h * n, &mut buf[at..at + n]) };
                starts.push(at);
                at += n;
            }
            let base = buf.as_mut_ptr();
            let ptr = |i: Option<usize>| {
                SendPtr::new(i.map_or(std::ptr::null_mut(), |i| base.wrapping_add(starts[i])))
            };
            let grad = |i: usize| ptr(self.grad.then_some(i));
            let p = Ptrs {
                head: h,
                q: ptr(Some(0)),
                k: ptr(Some(1)),
                v: ptr(Some(2)),
                o: grad(3),
                g: grad(4),
                bias,
                out: SendPtr::new(base.wrapping_add(at)),
            };
            // SAFETY: the head's widened operands and its f32 output block are this thread's
            // buffer; the bias is the whole operand (the contract).
            unsafe {
                if self.grad {
                    backward_dispatch(self, &p, h);
                } else {
                    let blocks = s.div_ceil(BR);
                    for u in h * blocks..(h + 1) * blocks {
                        forward_dispatch(self, &p, u);
                    }
                }
                super::cast::store_from(&buf[at..at + out_size], out.get(), out_type, h * out_size);
            }
        };
        par_ranges(self.bh, (s + t) * t * d * 4, |a, b| {
            HEAD.with(|cell| match cell.try_borrow_mut() {
                Ok(mut buf) => (a..b).for_each(|h| head(h, &mut buf)),
                Err(_) => (a..b).for_each(|h| head(h, &mut Vec::new())),
            })
        });
    }
}
