//! The GEMM kernels behind matmul and the three convolutions: out[b] (M x N, row-major) =
//! A[b] (M x K) · B[b] (K x N), where A and B are not matrices in memory but element loaders
//! (`Operand::load`): strided for matmul (transposes cost nothing), implicit im2col gathers with
//! zero padding for the convolutions. Matmul's operands (and a product update's) also declare
//! their plain strided layout (`Operand::plain`), which the fast variant reads as float4s.
//!
//! Design (the classic shared-memory + register-blocked SGEMM):
//! - A block of 256 threads (16 x 16) computes a BM x BN tile of the output, each thread a TM x TN
//!   micro-tile in registers (rows ty + 16 i, columns tx + 16 j: strided, so that a warp's shared
//!   reads are conflict-free and its stores to the output coalesced; 4 rows or columns at a time
//!   where TM or TN is a multiple of 4, `vector`).
//! - K advances BK at a time through shared memory: each thread loads its share of the BM x BK
//!   tile of A and the BK x BN tile of B, mapped so that consecutive threads read consecutive
//!   addresses (along k when the operand is contiguous along k, else along rows); a k-contiguous
//!   operand is stored transposed, its tile padded against bank conflicts. The next tile is
//!   fetched into registers while the current one is multiplied (register prefetch).
//! - Tiles: from 128x128 (8x8 per thread) down to 16x16 (1x1), chosen per shape by a small cost
//!   model (`choose`): padded work / (per-SM rate x utilisation), bounded below by the latency of
//!   the serial K loop. Large square products get 128x128 (fast) or 128x64 (base) tiles, thin
//!   ones (N = 10) 16-wide tiles, tiny ones (32x100x10) 16x16.
//! - In-block split-K: when the output has few tiles but K is long (a weight gradient contracts
//!   over the batch), the block runs S = 2 or 4 groups of 256 threads on interleaved K tiles and
//!   adds their partial tiles through shared memory in a fixed order.
//! - K-parallel kernel, for few outputs and K >= 1024 (a filter gradient contracts over all
//!   N·OH·OW positions into a few hundred outputs; a 16x16-tiled GEMM would occupy 2 of the 132
//!   SMs for a 64x32x32x3 -> 16 convolution): each block computes 4x4, 2x2 or 1x1 outputs with
//!   all of its 1024 threads, thread t taking k = t, t + 1024, ... straight from global memory
//!   (L2), then a warp butterfly and a shared-memory pass in warp order. `plan` picks it when its
//!   estimated cost is lower than the tiled kernel's.
//! - Split-K across blocks, when the step has scratch (`kiln_compiler::scratch`, planned in the
//!   arena) and the contraction is long (K >= 4 max(M, N)): `splits` groups of tiled blocks,
//!   group s over K range [s·chunk, (s + 1)·chunk), write partial tiles to the scratch; a second
//!   launch adds each output's partials in split order and applies the sink (store, epilogue or
//!   update). On an H100 (2026-11-25, `kiln bench-gpu`'s profile) the cnn's filter gradients went
//!   from 1.02 / 0.41 / 0.25 / 0.15 ms to 0.12 / 0.09 / 0.05 / under 0.05 ms (64, 16, 32 and 64
//!   splits, as the model picks them; the forced 4/8/16/32-split runs bracketed each choice), its
//!   training step from 2.61 to 1.16 ms.
//! - Everything stays deterministic: every output is reduced inside one block, or its partials
//!   are added in a fixed order, in an order fixed by the shape; no atomics.
//! - Edges: every load is guarded (rows < M or N, k < K; zero outside), every store too, so any
//!   M, N, K work. Blocks form a 1-D grid (tile column fastest, then tile row, then batch), so no
//!   grid dimension limit applies.
//!
//! Two variants of the tiled kernel, chosen when a kernel is generated:
//! - `KILN_GEMM_VARIANT=base`: the kernel measured on 2026-11-25 (below): element loads from
//!   global memory, one shared tile and two barriers per K tile, warps of 16 x 2 threads.
//! - `KILN_GEMM_VARIANT=fast` (the default; any value but `base`): the same tiles and sums, with
//!   - float4 global loads of an operand with a plain layout whose rows start 16-byte aligned
//!     (leading dimension, column offset and batch matrix size multiples of 4; slots are 16-byte
//!     aligned) along its contiguous axis, through per-thread pointers advanced by BK per tile;
//!     one row guard per float4, set once, and one k guard per tile; a float4 across the
//!     operand's edge (`matmul_rows` of a width not a multiple of 4) element by element;
//!     operands without a plain layout or alignment (convolutions, odd leading dimensions) go
//!     through the element loader;
//!   - two shared stages: per K tile, store the registers into this tile's stage, load the next
//!     tile into registers, one barrier, multiply (within 48 KiB of static shared memory, else
//!     the base order with one stage);
//!   - warps of 8 x 4 threads (a warp's float4 reads of A's and B's micro-tile rows are 64 and
//!     128 consecutive bytes: one shared-memory wavefront each);
//!   - float4 stores of plain output rows (no epilogue, N a multiple of 4);
//!   - `__launch_bounds__(256, 2)` for 8x8, 8x4 and 4x8 micro-tiles without split-K (at most
//!     128 registers: two blocks per SM), which the cost model now assumes: it moves big
//!     products (2048³ and up, 4096x1024x4096) from 128x64x8 to 128x128x8 tiles and keeps the
//!     zoo's (test `the_fast_variant_keeps_the_zoo_plans`).
//!
//!   Both variants add every product in the same order, so under the same tile their results
//!   are the same bits (test `gemm_variants`).
//! - Two factors of one half type (bf16 or f16, `half`) take the tensor-core kernel of
//!   `half_mma` in every variant (its own tiles, the same sinks and split-K); a half operand of
//!   the f32 kernels (an f32 factor beside it) is read element by element, widened as it loads.
//! - `KILN_GEMM_TILE=BMxBNxBKxTMxTN` (e.g. `128x128x16x8x8`) forces that tile (16 x 16 threads,
//!   no split-K) wherever it fits, under either variant: for measuring tiles on a device
//!   (`kiln bench-gemm`), not for production.
//!
//! Register use (`scripts/ptxas_info.py`: ptxas of NVRTC 13.0.88 for sm_90 with kiln's options
//! and `--ptxas-options=-v`, on the kernels `cuda_ops` dumps): no spills in any of
//! `kiln bench-gemm`'s kernels. 4096³, fast 128x128x8 (8x8):
//! 127 registers, 16,640 B shared; base 128x64x8 (8x4): 80. The zoo's 64x32x16 split-2 tiles
//! (4x2): fast 47, base 40; 128x64x8 split-2 (8x4): fast 81, base 64 (512 threads; these shapes
//! have 128 blocks, one per SM, either way). Forced fast tiles: 128x128x16x8x8 128 registers
//! without spills (but 46 register moves per K tile), 128x64x8 95, 64x128x8 91, 64x64x16 64.
//! Left to itself (no minimum of blocks) ptxas gave the fast 8x4 tiles 80 registers and 8 to
//! 16 bytes of spills. SASS of the 4096³ K loop (cuobjdump): fast, 588 instructions per tile
//! of which 512 FFMA (87%), 32 LDS.128, the two LDG.128 issued before the barrier; base
//! 128x64x8, 358 per tile of which 256 FFMA (71%), 6 LDG, 2 barriers. (With the fast kernel's
//! loads unconditional, or behind the same `if` as their stores, ptxas sank them past the
//! FMAs to the stores: the latency the prefetch is meant to hide showed.)
//!
//! Accumulation is f32 with FMA, in K order within a group or thread: the CPU's `gemm` crate adds
//! in another order, so results agree to rounding, not bitwise (measured on a host emulation of
//! the kernels: within 1e-7 of the sum of |terms|, as close to the exact f64 sum as the CPU's).
//! The tile choice is a model, calibrated where it mattered on an H100 (2026-11-25, `kpar_cost`
//! and `TILED_MEASURED_OVER_MODEL`). Measured there with the base variant: 4096³ at 36 TFLOP/s
//! (128x64x8; forced 128x128x8: 38.0; cuBLAS: 51.7) and the zoo's products at 0.75-3.9x
//! `torch.matmul`'s rate. The fast variant is not measured on a device yet: its figures above
//! are the compiler's, and its results the host emulation's.

use super::codegen::{Code, Elems, int};
use super::{Arg, Launch};
use kiln_compiler::ir::{Fused, Shape};

mod half_mma;
mod tf32;

/// Threads per K group; each block has `split` of them.
const GROUP: usize = 256;
/// Shared memory limit of a block without opting in to more.
const SHARED_LIMIT: usize = 48 * 1024;
/// SMs of the H200.
const SMS: usize = 132;

/// Whether a micro-tile side of `t` values is read from shared memory as float4s: thread
/// (tx, ty) then holds rows 64 g + 4 ty + r (r < 4) of its tile, and columns likewise, so that a
/// warp's threads along a side read consecutive bytes (no bank conflicts; 16 threads, 256 bytes
/// in the base variant's warps, 8 threads and 128 bytes for B in the fast one's) and the output
/// rows are written in runs of 4. Otherwise rows ty + 16 i, one float at a time.
fn vector(t: usize) -> bool {
    t.is_multiple_of(4)
}

/// ", K split across ..." for a kernel's description; nothing without a split.
fn split_text(split: Option<KSplit>) -> String {
    split.map_or(String::new(), |sp| {
        format!(", K split across {} block groups of {} (scratch)", sp.splits, sp.chunk)
    })
}

/// One tile configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tile {
    pub bm: usize,
    pub bn: usize,
    pub bk: usize,
    pub tm: usize,
    pub tn: usize,
    /// K groups per block (in-block split-K).
    pub split: usize,
}

/// (BM, BN, BK, TM, TN): 16 x 16 threads, BM = 16 TM, BN = 16 TN.
const CANDIDATES: [(usize, usize, usize, usize, usize); 12] = [
    (128, 128, 8, 8, 8),
    (128, 64, 8, 8, 4),
    (64, 128, 8, 4, 8),
    (128, 32, 8, 8, 2),
    (32, 128, 8, 2, 8),
    (64, 64, 16, 4, 4),
    (64, 32, 16, 4, 2),
    (32, 64, 16, 2, 4),
    (64, 16, 16, 4, 1),
    (16, 64, 16, 1, 4),
    (32, 32, 16, 2, 2),
    (16, 16, 16, 1, 1),
];

/// Which code the tiled kernel is generated as: `KILN_GEMM_VARIANT=base` or `fast` (the default;
/// any other value is `fast` too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Variant {
    /// The kernel measured on 2026-11-25 (36 TFLOP/s at 4096³): element loads from global
    /// memory, one shared tile, two barriers per K tile, warps of 16 x 2 threads.
    Base,
    /// float4 global loads of plain operands, two shared tiles (one barrier per K tile), warps of
    /// 8 x 4 threads, float4 output stores, 8x8 micro-tiles held to 128 registers.
    Fast,
}

/// The variant `KILN_GEMM_VARIANT` names.
pub(crate) fn variant() -> Variant {
    match std::env::var("KILN_GEMM_VARIANT").as_deref() {
        Ok("base") => Variant::Base,
        _ => Variant::Fast,
    }
}

impl Tile {
    fn loads_a(&self) -> usize {
        self.bm * self.bk / GROUP
    }

    fn loads_b(&self) -> usize {
        self.bn * self.bk / GROUP
    }

    fn threads(&self) -> usize {
        GROUP * self.split
    }

    /// Shared-memory reads per k step for a micro-tile side of `t` values.
    fn reads(&self, t: usize) -> f64 {
        if vector(t) { (t / 4) as f64 } else { t as f64 }
    }

    /// Blocks per SM that the kernel asks the compiler to fit (`__launch_bounds__`' second
    /// argument): 2 for the fast variant's 8x8, 8x4 and 4x8 micro-tiles without split-K, which
    /// caps them at 128 registers per thread (ptxas, module doc: 8x8 fits without spills; left
    /// to itself it gave the 8x4 tiles 80 registers with a few spills); else no request.
    fn min_blocks(&self, v: Variant) -> usize {
        if v == Variant::Fast && self.tm * self.tn >= 32 && self.split == 1 { 2 } else { 1 }
    }

    /// Registers per thread, estimated (or the cap `min_blocks` sets).
    fn regs(&self, v: Variant) -> usize {
        let estimate = self.tm * self.tn + 2 * (self.tm + self.tn) + self.loads_a() + self.loads_b() + 32;
        match self.min_blocks(v) {
            1 => estimate,
            b => estimate.min(65536 / (b * self.threads())),
        }
    }

    /// Shared floats for the tiles (and, with split-K, the partial sums, which reuse them).
    fn shared_floats(&self, pad_a: usize, pad_b: usize) -> usize {
        let tiles = self.split * self.bk * (self.bm + pad_a + self.bn + pad_b);
        let partials = (self.split - 1) * self.tm * self.tn * GROUP;
        tiles.max(partials)
    }

    /// Estimated time in cycles, `None` when the configuration does not fit an SM.
    fn cost(&self, m: usize, n: usize, k: usize, batch: usize, v: Variant) -> Option<f64> {
        let tiles = batch * m.div_ceil(self.bm) * n.div_ceil(self.bn);
        let ktiles = k.div_ceil(self.bk).max(1);
        if self.split > 1 && ktiles < 2 * self.split {
            return None;
        }
        let iters = ktiles.div_ceil(self.split);
        let threads = self.threads();
        let regs = self.regs(v);
        if threads * regs > 65536 || self.shared_floats(4, 4) * 4 > SHARED_LIMIT {
            return None;
        }
        let per_sm = (2048 / threads).min(65536 / (threads * regs)).max(1);
        let active = tiles.min(SMS) as f64;
        let resident = tiles.div_ceil(SMS).min(per_sm);
        let util = ((resident * threads / 32) as f64 / 16.0).min(1.0);
        let (tm, tn) = (self.tm as f64, self.tn as f64);
        // Per k step: TM·TN FMAs against the shared-memory reads (a float4 per 4 rows or
        // columns where the micro-tile has them) and the loop's own instructions.
        let eff = tm * tn / (tm * tn + self.reads(self.tm) + self.reads(self.tn) + 4.0);
        let padded = (tiles * self.bm * self.bn * iters * self.split * self.bk) as f64;
        let compute = padded / (active * 128.0 * eff * util);
        let waves = tiles.div_ceil(SMS * per_sm) as f64;
        let latency = iters as f64 * waves * 400.0;
        Some(compute.max(latency))
    }
}

/// The cheapest tile for an M x N x K product repeated `batch` times.
pub(crate) fn choose(m: usize, n: usize, k: usize, batch: usize, v: Variant) -> (f64, Tile) {
    let mut best: Option<(f64, Tile)> = None;
    for &(bm, bn, bk, tm, tn) in &CANDIDATES {
        for split in [1, 2, 4] {
            let t = Tile { bm, bn, bk, tm, tn, split };
            if let Some(c) = t.cost(m, n, k, batch, v)
                && best.is_none_or(|(b, _)| c < b)
            {
                best = Some((c, t));
            }
        }
    }
    best.expect("the 16x16 tile always fits")
}

/// Threads of a K-parallel block.
const KPAR_THREADS: usize = 1024;

/// Estimated cycles of the K-parallel kernel with TM x TN outputs per block: per wave of
/// blocks, 14,000 cycles per pass of its 1024 threads over K and 12,000 for the block itself
/// (the tree over the threads, the launch of 1024 threads). Measured on an H100 (2026-11-25,
/// `kiln bench-gpu`'s per-launch profile): each thread's loads hit a sector of their own (rows
/// of A and columns of B are strided in k), so the kernel runs at the L2's rate, far below its
/// arithmetic: 256x256x1024 took 209 µs (16 waves of one pass), a 3x3 filter gradient over
/// 64x32x32x32 1.32 ms (3 waves of 64 passes), 256x1024x10 12.7 µs, 64x4096x128 53 µs; this
/// model gives 210 µs, 1.37 ms, 13 µs and 69 µs. (A first model, counting issue slots, was
/// 20 times too low and chose this kernel for the transformer's weight gradients.)
fn kpar_cost(m: usize, n: usize, k: usize, batch: usize, tm: usize, tn: usize) -> f64 {
    let blocks = batch * m.div_ceil(tm) * n.div_ceil(tn);
    let per_sm = 2048 / KPAR_THREADS;
    let waves = blocks.div_ceil(SMS * per_sm) as f64;
    let passes = k.div_ceil(KPAR_THREADS) as f64;
    waves * (passes * 14_000.0 + 12_000.0)
}

/// The tiled kernel's measured time over `Tile::cost` on the H100 (2026-11-25): 2.5x at
/// 256x1024x1024 (47 µs), 2.7x at 1024x256x1024 (34 µs), 1.8x at 4096³ (5.7 ms). Applied when
/// the tiled kernel is weighed against the K-parallel one, whose model is calibrated.
const TILED_MEASURED_OVER_MODEL: f64 = 2.5;

/// The tile `KILN_GEMM_TILE` names, if it is one of 16 x 16 threads (BM = 16 TM, BN = 16 TN).
fn forced_tile() -> Option<Tile> {
    let v = std::env::var("KILN_GEMM_TILE").ok()?;
    let d: Vec<usize> = v.split('x').filter_map(|x| x.parse().ok()).collect();
    match d[..] {
        [bm, bn, bk, tm, tn] if bm == 16 * tm && bn == 16 * tn && bk > 0 => {
            Some(Tile { bm, bn, bk, tm, tn, split: 1 })
        }
        _ => None,
    }
}

/// How a product is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Shared-memory tiles, each block a BM x BN tile of the output.
    Tiled(Tile),
    /// Few outputs and a long K: each block computes TM x TN outputs with all its 1024 threads
    /// splitting K, then a tree over the threads.
    KParallel { tm: usize, tn: usize },
    /// Split-K across blocks (needs scratch): `splits` groups of tiled blocks, group `ks` over
    /// K range [ks·chunk, (ks + 1)·chunk), each writing its partial tile to scratch; a second
    /// launch adds the partials of every output in group order and stores the sum.
    SplitK { tile: Tile, splits: usize, chunk: usize },
}

/// The most scratch a split-K product asks for: 4 MiB, and at most 64 partial sums of each
/// output.
const MAX_SCRATCH_BYTES: usize = 4 << 20;
const MAX_SPLITS: usize = 64;

/// A split must be modelled at least this much faster than the best product without one.
const SPLIT_GAIN: f64 = 0.67;

/// Estimated cycles of adding `splits` partials of `outputs` elements (a memory-bound pass:
/// about 1,500 bytes a cycle on an H100, and a launch's worth of latency).
fn split_reduce_cost(splits: usize, outputs: usize) -> f64 {
    ((splits + 1) * outputs * 4) as f64 / 1500.0 + 3_000.0
}

/// The cheapest way to compute an M x N x K product repeated `batch` times with at most
/// `scratch` bytes of scratch: the tiled kernel, for K >= 1024 the K-parallel one, and with
/// scratch split-K across blocks.
///
/// `KILN_GEMM_TILE=BMxBNxBKxTMxTN` (e.g. `128x128x8x8x8`) forces that tile wherever it fits,
/// for measuring tiles against each other on a device (`kiln bench-gemm`); not for production.
/// `KILN_GEMM_SPLIT=0` turns split-K across blocks off, `KILN_GEMM_SPLIT=N` (a power of two up
/// to 64) forces N splits wherever the scratch allows (for A/B measurements on a device).
pub(crate) fn plan(m: usize, n: usize, k: usize, batch: usize, scratch: usize, v: Variant) -> Plan {
    if let Some(t) = forced_tile()
        && t.cost(m, n, k, batch, v).is_some()
    {
        return Plan::Tiled(t);
    }
    let (tiled, tile) = choose(m, n, k, batch, v);
    let mut best = (tiled * TILED_MEASURED_OVER_MODEL, Plan::Tiled(tile));
    if k >= KPAR_THREADS {
        for (tm, tn) in [(4, 4), (2, 2), (1, 1)] {
            let c = kpar_cost(m, n, k, batch, tm, tn);
            if c < best.0 {
                best = (c, Plan::KParallel { tm, tn });
            }
        }
    }
    // Split only a long contraction into few outputs (K at least 4x the longer side), and only
    // for a clear modelled gain: the scratch is memory, and the model is coarse. Measured on an
    // H100 (2026-11-25): the cnn's filter gradients (K = 16,384 and 65,536) ran 2.6-4.4x faster
    // split, the mlp's 256x1024x1024 products (K = 1024) no faster with twice the arena.
    let outputs = batch.saturating_mul(m).saturating_mul(n);
    let forced = std::env::var("KILN_GEMM_SPLIT").ok().and_then(|v| v.parse::<usize>().ok());
    let split_off = forced == Some(0) || (forced.is_none() && k < 4 * m.max(n));
    let unsplit = best.0;
    let mut splits = 2;
    while !split_off && splits <= MAX_SPLITS && splits.saturating_mul(outputs).saturating_mul(4) <= scratch {
        if forced.is_some_and(|f| f != splits) {
            splits *= 2;
            continue;
        }
        // Chunks of whole K tiles for every tile the search may pick (BK 8 or 16, up to 4
        // groups in a block): the last chunk may be short, none is empty.
        let chunk = k.div_ceil(splits).next_multiple_of(64);
        let groups = k.div_ceil(chunk);
        if groups < splits {
            break;
        }
        let (c, t) = choose(m, n, chunk, batch * splits, v);
        let c = c * TILED_MEASURED_OVER_MODEL + split_reduce_cost(splits, outputs);
        if forced == Some(splits) || (c < best.0 && c < SPLIT_GAIN * unsplit) {
            best = (c, Plan::SplitK { tile: t, splits, chunk });
        }
        splits *= 2;
    }
    best.1
}

/// The scratch bytes the product's best plan uses with scratch to spare (0: none).
pub(crate) fn scratch_wanted(m: usize, n: usize, k: usize, batch: usize) -> usize {
    match plan(m, n, k, batch, MAX_SCRATCH_BYTES, variant()) {
        Plan::SplitK { splits, .. } => splits * batch * m * n * 4,
        Plan::Tiled(_) | Plan::KParallel { .. } => 0,
    }
}

/// How the kernel reads one operand.
pub(crate) struct Operand {
    /// Whether consecutive k are adjacent in memory (else consecutive rows of A, columns of B).
    pub k_contiguous: bool,
    /// Statements that set `float v` to the element at (`gr`, `gk`) (row of A or column of B, k),
    /// both in range, reading pointer `src` at batch offset `base`.
    pub load: String,
    /// The batch offset (elements) of batch `bz`, or "0".
    pub batch_offset: String,
    /// The operand's layout when it is a plain strided matrix (what `load` reads), so that the
    /// fast kernel may read it as float4s; `None` for gathers (the convolutions' im2col).
    pub plain: Option<Plain>,
}

/// A plain strided matrix: element (r, k) (row of A or column of B, k) of batch `bz` at
/// `src[base + offset + r * ld + k]` when the operand is k-contiguous, else at
/// `src[base + offset + k * ld + r]`, `base` the batch offset. The pointer is a slot's start
/// (16-byte aligned: plans with less are refused at load).
pub(crate) struct Plain {
    /// Elements between consecutive rows (k-contiguous) or consecutive k (else).
    pub ld: usize,
    /// Elements before the matrix's first element (a block of columns, `matmul_rows`).
    pub offset: usize,
    /// Every batch offset is a multiple of this many elements (the matrix's size).
    pub batch_granule: usize,
}

/// One GEMM kernel: out[bz] = A[bz] · B[bz] for bz < batch, A = operand 0, B = operand 1.
pub(crate) struct Gemm {
    pub name: String,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batch: usize,
    pub a: Operand,
    pub b: Operand,
    /// Index type of the kernel (`codegen::idx_type` over every tensor).
    pub ty: &'static str,
    /// Which launch arguments the two operand pointers are.
    pub args: [Arg; 2],
    /// What becomes of every product.
    pub sink: Sink,
    /// Bytes of scratch the step has (`Arg::Scratch`; 0: none), for split-K across blocks.
    pub scratch: usize,
    /// The element types of the step's operands and output: the factors' are those of
    /// `args`, the epilogue's operands' those of `Epilogue::extra` (an update's are f32).
    pub elems: Elems,
}

/// Split-K across blocks, as the partial kernel runs it: `splits` groups of blocks, group `ks`
/// over K from ks·chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KSplit {
    splits: usize,
    chunk: usize,
}

/// Where a GEMM's products go.
pub(crate) enum Sink {
    /// Stored in the output.
    Output,
    /// Through an elementwise epilogue into the output (a fused matmul).
    Epilogue(Epilogue),
    /// Handed to an in-place update, element by element, and never stored: an optimizer update
    /// that computes its own gradient (`ir::Grad::Product`). No output argument.
    Update(Update),
}

/// An update fed by a GEMM: `definition` declares `kiln_update(value, i, ...)` (`i` the
/// element's index in the M x N matrix), `params` are the kernel's parameters after the two
/// factors (the update's operands, pointers for `args`), `prelude` runs once per thread before
/// the K loop (what the update needs from the step, as Adam's step size from its counter), and
/// `call` is what follows `value, i` in each call.
pub(crate) struct Update {
    pub definition: String,
    pub params: String,
    pub args: Vec<Arg>,
    pub prelude: Vec<String>,
    pub call: String,
}

/// What a GEMM applies to its products as it stores them: `kiln_epilogue(value, i, e0, ...)`
/// (`elementwise::epilogue_function`), `i` the element's index in the whole output, `eJ` the
/// launch arguments `extra[J]`.
pub(crate) struct Epilogue {
    pub definition: String,
    pub extra: Vec<Arg>,
}

impl Sink {
    /// Stored in `out`, or through `program` with the op's operands from 2 on (`extra`) beside
    /// each element (a fused product or convolution).
    pub(crate) fn of(
        epilogue: Option<(&Fused, &[&Shape])>,
        out: &Shape,
        (ty, elems): (&str, &Elems),
    ) -> Sink {
        epilogue.map_or(Sink::Output, |(program, extra)| {
            let mut shapes = vec![out];
            shapes.extend_from_slice(extra);
            Sink::Epilogue(Epilogue {
                // Program operand j >= 1 is the op's operand j + 1.
                definition: super::elementwise::epilogue_function(
                    program,
                    &shapes,
                    (ty, &elems.shifted(1)),
                    "",
                ),
                extra: (2..2 + extra.len()).map(Arg::Input).collect(),
            })
        })
    }
}

impl Gemm {
    /// Appends the kernel to `c`; returns its launches and a description of the tiling.
    pub(crate) fn generate(self, c: &mut Code) -> (Vec<Launch>, String) {
        assert!(self.k > 0 && self.m > 0 && self.n > 0, "empty products are filled, not multiplied");
        match &self.sink {
            Sink::Output => {}
            Sink::Epilogue(e) => {
                c.line(&e.definition);
            }
            Sink::Update(u) => {
                assert_eq!(self.batch, 1, "an update's gradient is one matrix");
                c.line(&u.definition);
            }
        }
        let v = variant();
        let tf32 = super::allow_tf32();
        // Two factors of one half type run on the tensor cores in that type.
        let half = half_mma::Half::of(self.factor(0), self.factor(1));
        let kernel = |g: &Self, c: &mut Code, t: Tile, split: Option<KSplit>| match (half, v) {
            (Some(h), _) => g.tiled_half(c, split, h),
            _ if tf32 => g.tiled_tf32(c, split),
            (None, Variant::Base) => g.tiled(c, t, split),
            (None, Variant::Fast) => g.tiled_fast(c, t, split),
        };
        match plan(self.m, self.n, self.k, self.batch, self.scratch, v) {
            Plan::Tiled(t) => {
                let (launch, describe) = kernel(&self, c, t, None);
                (vec![launch], describe)
            }
            Plan::KParallel { tm, tn } => {
                let (launch, describe) = self.k_parallel(c, tm, tn);
                (vec![launch], describe)
            }
            Plan::SplitK { tile, splits, chunk } => {
                let split = KSplit { splits, chunk };
                let (partial, describe) = kernel(&self, c, tile, Some(split));
                c.blank();
                let reduce = self.split_reduce(c, split);
                (vec![partial, reduce], describe)
            }
        }
    }

    /// The kernel that adds the partial products of a split-K product (`Arg::Scratch`, one
    /// batch of M x N matrices per split) in split order and stores each sum through the sink.
    fn split_reduce(&self, c: &mut Code, split: KSplit) -> Launch {
        let ty = self.ty;
        let (mn, total) = (self.m * self.n, self.batch * self.m * self.n);
        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__(256) {}(const float* __restrict__ part, {}) {{",
            self.name,
            self.sink_params()
        ));
        c.line(format!("// the sum of {} partial products, in split order", split.splits));
        if let Sink::Update(u) = &self.sink {
            for l in &u.prelude {
                c.line(l);
            }
        }
        c.line(super::codegen::grid_loop(ty, "i", total));
        c.line("float s = part[i];");
        c.line(format!(
            "for (int ks = 1; ks < {}; ++ks) s += part[({ty})ks * {} + i];",
            split.splits,
            int(total)
        ));
        if self.batch > 1 {
            c.line(format!("const {ty} r = i % {};", int(mn)));
            if !matches!(self.sink, Sink::Update(_)) {
                c.line(format!("{}* o = out + (i / {}) * {};", self.elems.output(), int(mn), int(mn)));
            }
        } else {
            c.line(format!("const {ty} r = i;"));
            if !matches!(self.sink, Sink::Update(_)) {
                c.line(format!("{}* o = out;", self.elems.output()));
            }
        }
        c.line(format!("const {ty} gm = r / {n}, gn = r % {n};", n = int(self.n)));
        c.line(self.store("s", None));
        c.line("}");
        c.line("}");
        Launch {
            function: self.name.clone(),
            grid: super::codegen::grid_for(total, 256),
            block: [256, 1, 1],
            shared_bytes: 0,
            args: std::iter::once(Arg::Scratch).chain(self.sink_args()).collect(),
        }
    }

    /// Emits the block -> (batch, m0, n0) mapping (with a split, the split `ks` outermost) and
    /// the batch offsets a_base, b_base, o.
    fn block_origin(&self, c: &mut Code, bm: usize, bn: usize, all_bases: bool, split: Option<KSplit>) {
        let ty = self.ty;
        let (tiles_m, tiles_n) = (self.m.div_ceil(bm), self.n.div_ceil(bn));
        c.line(format!("// block -> (batch, tile row, tile column): {} x {tiles_m} x {tiles_n}", self.batch));
        let id = if let Some(sp) = split {
            let per = self.batch * tiles_m * tiles_n;
            c.line(format!("// split-K across blocks: {} groups of {per} blocks", sp.splits));
            c.line(format!("const {ty} ks = ({ty})blockIdx.x / {};", int(per)));
            c.line(format!("const {ty} bid = ({ty})blockIdx.x % {};", int(per)));
            "bid"
        } else {
            "blockIdx.x"
        };
        if tiles_n > 1 {
            c.line(format!("const {ty} n0 = (({ty}){id} % {tiles_n}) * {bn};"));
            c.line(format!("const {ty} blk = ({ty}){id} / {tiles_n};"));
        } else {
            c.line(format!("const {ty} n0 = 0;"));
            c.line(format!("const {ty} blk = {id};"));
        }
        match (self.batch > 1, tiles_m > 1) {
            (true, true) => {
                c.line(format!("const {ty} m0 = (blk % {tiles_m}) * {bm};"));
                c.line(format!("const {ty} bz = blk / {tiles_m};"));
            }
            (true, false) => {
                c.line(format!("const {ty} m0 = 0;"));
                c.line(format!("const {ty} bz = blk;"));
            }
            (false, _) => {
                c.line(format!("const {ty} m0 = blk * {bm};"));
            }
        }
        if all_bases || self.a.load.contains("base") {
            c.line(format!("const {ty} a_base = {};", self.a.batch_offset));
        }
        if all_bases || self.b.load.contains("base") {
            c.line(format!("const {ty} b_base = {};", self.b.batch_offset));
        }
        let bz = if self.batch > 1 { "bz" } else { "0" };
        match (&self.sink, split) {
            // The partials of split ks: batch matrix (ks, bz) of the scratch.
            (_, Some(_)) => {
                c.line(format!("float* o = out + (ks * {} + {bz}) * {};", self.batch, int(self.m * self.n)));
            }
            (Sink::Update(u), None) => {
                for l in &u.prelude {
                    c.line(l);
                }
            }
            _ if self.batch > 1 => {
                c.line(format!("{}* o = out + bz * {};", self.elems.output(), int(self.m * self.n)));
            }
            _ => {
                c.line(format!("{}* o = out;", self.elems.output()));
            }
        }
    }

    /// The launch of the product kernel: the factors, then the sink's arguments (with a
    /// split, the scratch that takes the partials).
    fn launch(&self, blocks: usize, threads: usize, split: Option<KSplit>) -> Launch {
        let sink = if split.is_some() { vec![Arg::Scratch] } else { self.sink_args() };
        Launch {
            function: self.function(split),
            grid: [u32::try_from(blocks).expect("fewer than 2^32 blocks"), 1, 1],
            block: [threads as u32, 1, 1],
            shared_bytes: 0,
            args: self.args.iter().copied().chain(sink).collect(),
        }
    }

    /// The product kernel's name: with a split, the partial kernel's (the sum keeps the name).
    fn function(&self, split: Option<KSplit>) -> String {
        if split.is_some() { format!("{}_partial", self.name) } else { self.name.clone() }
    }

    /// The C type factor `i` (0: A, 1: B) holds.
    fn factor(&self, i: usize) -> &'static str {
        self.elems.arg(self.args[i])
    }

    /// The launch arguments after the factors.
    fn sink_args(&self) -> Vec<Arg> {
        match &self.sink {
            Sink::Output => vec![Arg::Output],
            Sink::Epilogue(e) => e.extra.iter().copied().chain([Arg::Output]).collect(),
            Sink::Update(u) => u.args.clone(),
        }
    }

    /// The kernel's parameters: the factors, then the epilogue's operands and the output, or
    /// the update's operands. The output may be an epilogue operand's memory
    /// (`Op::may_write_over`: each element's operands are read by the thread that then stores
    /// it), so neither is `__restrict__` when there is an epilogue; the factors never alias the
    /// output, nor what an update writes (`product_updates` checks it).
    fn params(&self, split: Option<KSplit>) -> String {
        let factors =
            format!("const {}* __restrict__ in0, const {}* __restrict__ in1", self.factor(0), self.factor(1));
        if split.is_some() {
            return format!("{factors}, float* __restrict__ out");
        }
        format!("{factors}, {}", self.sink_params())
    }

    /// The sink's parameters (after the factors, or after the partials of a split).
    fn sink_params(&self) -> String {
        match &self.sink {
            Sink::Output => format!("{}* __restrict__ out", self.elems.output()),
            Sink::Epilogue(e) => {
                let extra: String = e
                    .extra
                    .iter()
                    .enumerate()
                    .map(|(j, &a)| format!("const {}* e{j}, ", self.elems.arg(a)))
                    .collect();
                format!("{extra}{}* out", self.elems.output())
            }
            Sink::Update(u) => u.params.clone(),
        }
    }

    /// Stores `value` as output element (gm, gn) of this block's matrix `o`, through the
    /// epilogue if there is one, or applies it as the update's gradient element; with a split,
    /// stores the partial sum as it is.
    fn store(&self, value: &str, split: Option<KSplit>) -> String {
        let at = format!("gm * {} + gn", int(self.n));
        if split.is_some() {
            return format!("o[{at}] = {value};");
        }
        match &self.sink {
            Sink::Output => format!("o[{at}] = {value};"),
            Sink::Epilogue(e) => {
                let extra: String = (0..e.extra.len()).map(|j| format!(", e{j}")).collect();
                format!("o[{at}] = kiln_epilogue({value}, ({})(o - out) + {at}{extra});", self.ty)
            }
            Sink::Update(u) => format!("kiln_update({value}, {at}, {});", u.call),
        }
    }

    /// The K-parallel kernel: TM x TN outputs per block, k = thread, thread + 1024, ...; the
    /// threads' partial sums meet in a warp butterfly, then in shared memory in warp order.
    fn k_parallel(self, c: &mut Code, tm: usize, tn: usize) -> (Launch, String) {
        let ty = self.ty;
        let warps = KPAR_THREADS / 32;
        let name = &self.name;
        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__({KPAR_THREADS}) {name}({}) {{",
            self.params(None)
        ));
        c.line(format!("// {tm}x{tn} outputs per block, K split over {KPAR_THREADS} threads"));
        c.line(format!("__shared__ float partial[{warps}][{}];", tm * tn));
        c.line("const int t = threadIdx.x;");
        self.block_origin(c, tm, tn, false, None);
        c.line(format!("float acc[{tm}][{tn}];"));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {tm}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {tn}; ++j) acc[i][j] = 0.0f;"));
        c.line("}");
        c.line(format!("for ({ty} gk = t; gk < {}; gk += {KPAR_THREADS}) {{", int(self.k)));
        c.line(format!("float a[{tm}], b[{tn}];"));
        for (op, arr, count, r0, rows, ptr, basev) in [
            (&self.a, "a", tm, "m0", self.m, "in0", "a_base"),
            (&self.b, "b", tn, "n0", self.n, "in1", "b_base"),
        ] {
            c.line("{");
            c.line(format!("const {}* __restrict__ src = {ptr};", self.factor(usize::from(arr == "b"))));
            if op.load.contains("base") {
                c.line(format!("const {ty} base = {basev};"));
            }
            c.line("#pragma unroll");
            c.line(format!("for (int i = 0; i < {count}; ++i) {{"));
            c.line(format!("const {ty} gr = {r0} + i;"));
            c.line("float v = 0.0f;");
            c.line(format!("if (gr < {}) {{", int(rows)));
            c.line(&op.load);
            c.line("}");
            c.line(format!("{arr}[i] = v;"));
            c.line("}");
            c.line("}");
        }
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {tm}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {tn}; ++j) acc[i][j] += a[i] * b[j];"));
        c.line("}");
        c.line("}");
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {tm}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {tn}; ++j) {{"));
        c.line("for (int d = 16; d > 0; d >>= 1) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], d);");
        c.line(format!("if (t % 32 == 0) partial[t / 32][i * {tn} + j] = acc[i][j];"));
        c.line("}");
        c.line("}");
        c.line("__syncthreads();");
        c.line(format!("if (t < {}) {{", tm * tn));
        c.line("float s = partial[0][t];");
        c.line(format!("for (int w = 1; w < {warps}; ++w) s += partial[w][t];"));
        c.line(format!("const {ty} gm = m0 + t / {tn}, gn = n0 + t % {tn};"));
        c.line(format!("if (gm < {} && gn < {}) {}", int(self.m), int(self.n), self.store("s", None)));
        c.line("}");
        c.line("}");
        let blocks = self.batch * self.m.div_ceil(tm) * self.n.div_ceil(tn);
        (
            self.launch(blocks, KPAR_THREADS, None),
            format!("K-parallel, {tm}x{tn} outputs per block of {KPAR_THREADS} threads"),
        )
    }

    /// The tiled kernel; with a split, the partial kernel of split-K across blocks (K range
    /// from ks·chunk, partial tiles into the scratch).
    fn tiled(&self, c: &mut Code, t: Tile, split: Option<KSplit>) -> (Launch, String) {
        let ty = self.ty;
        let (vec_a, vec_b) = (vector(t.tm), vector(t.tn));
        // A k-contiguous operand is stored transposed into its tile: a padding column keeps its
        // stores off one bank; four keep the float4 reads of either tile 16-byte aligned.
        let pad = if vec_a || vec_b { 4 } else { 1 };
        let (pad_a, pad_b) = (pad * usize::from(self.a.k_contiguous), pad * usize::from(self.b.k_contiguous));
        let (lda, ldb) = (t.bm + pad_a, t.bn + pad_b);
        let (tiles_m, tiles_n) = (self.m.div_ceil(t.bm), self.n.div_ceil(t.bn));
        let ktiles = split.map_or(self.k, |sp| sp.chunk).div_ceil(t.bk);
        let iters = ktiles.div_ceil(t.split);
        let (la, lb) = (t.loads_a(), t.loads_b());
        let name = &self.function(split);

        for (side, op, rows, br, loads, elem) in [
            ("a", &self.a, self.m, t.bm, la, self.factor(0)),
            ("b", &self.b, self.n, t.bn, lb, self.factor(1)),
        ] {
            let (rr, kk) = if op.k_contiguous {
                (format!("e / {}", t.bk), format!("e % {}", t.bk))
            } else {
                (format!("e % {br}"), format!("e / {br}"))
            };
            c.line(format!(
                "__device__ __forceinline__ void {name}_load_{side}(const {elem}* __restrict__ src, \
                 const {ty} base, const {ty} r0, const {ty} k0, const int t, float (&dst)[{loads}]) {{"
            ));
            c.line("#pragma unroll");
            c.line(format!("for (int i = 0; i < {loads}; ++i) {{"));
            c.line(format!("const int e = t + i * {GROUP};"));
            c.line(format!("const {ty} gr = r0 + {rr}, gk = k0 + {kk};"));
            c.line("float v = 0.0f;");
            c.line(format!("if (gr < {} && gk < {}) {{", int(rows), int(self.k)));
            c.line(&op.load);
            c.line("}");
            c.line("dst[i] = v;");
            c.line("}");
            c.line("}");
            c.blank();
        }

        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__({}) {name}({}) {{",
            t.threads(),
            self.params(split)
        ));
        c.line(format!(
            "// tile {}x{}x{}, {}x{} per thread, {} K group(s) of {GROUP} threads",
            t.bm, t.bn, t.bk, t.tm, t.tn, t.split
        ));
        c.line(format!("__shared__ __align__(16) float smem[{}];", t.shared_floats(pad_a, pad_b)));
        if t.split > 1 {
            c.line(format!("const int t = threadIdx.x % {GROUP};"));
            c.line(format!("const int group = threadIdx.x / {GROUP};"));
        } else {
            c.line("const int t = threadIdx.x;");
        }
        c.line("const int tx = t % 16, ty = t / 16;");
        self.block_origin(c, t.bm, t.bn, true, split);
        let (a_at, b_at, mut k_start) = if t.split > 1 {
            (
                format!("smem + group * {}", t.bk * lda),
                format!("smem + {} + group * {}", t.split * t.bk * lda, t.bk * ldb),
                format!("({ty})group * {}", t.bk),
            )
        } else {
            ("smem".to_string(), format!("smem + {}", t.bk * lda), "0".to_string())
        };
        if let Some(sp) = split {
            k_start = format!("ks * {} + {k_start}", int(sp.chunk));
        }
        c.line(format!("float* As = {a_at};"));
        c.line(format!("float* Bs = {b_at};"));
        c.line(format!("float acc[{}][{}];", t.tm, t.tn));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {}; ++j) acc[i][j] = 0.0f;", t.tn));
        c.line("}");
        c.line(format!("float ra[{la}], rb[{lb}];"));
        c.line(format!("{ty} k0 = {k_start};"));
        c.line(format!("{name}_load_a(in0, a_base, m0, k0, t, ra);"));
        c.line(format!("{name}_load_b(in1, b_base, n0, k0, t, rb);"));
        c.line(format!("for (int it = 0; it < {iters}; ++it) {{"));
        for (s, op, br, loads, ld, reg) in
            [("As", &self.a, t.bm, la, lda, "ra"), ("Bs", &self.b, t.bn, lb, ldb, "rb")]
        {
            let (rr, kk) = if op.k_contiguous {
                (format!("e / {}", t.bk), format!("e % {}", t.bk))
            } else {
                (format!("e % {br}"), format!("e / {br}"))
            };
            c.line("#pragma unroll");
            c.line(format!("for (int i = 0; i < {loads}; ++i) {{"));
            c.line(format!("const int e = t + i * {GROUP};"));
            c.line(format!("{s}[({kk}) * {ld} + {rr}] = {reg}[i];"));
            c.line("}");
        }
        c.line("__syncthreads();");
        if iters > 1 {
            c.line(format!("if (it + 1 < {iters}) {{"));
            c.line(format!("k0 += {};", t.split * t.bk));
            c.line(format!("{name}_load_a(in0, a_base, m0, k0, t, ra);"));
            c.line(format!("{name}_load_b(in1, b_base, n0, k0, t, rb);"));
            c.line("}");
        }
        c.line("#pragma unroll");
        c.line(format!("for (int kk = 0; kk < {}; ++kk) {{", t.bk));
        c.line(format!("float av[{}], bv[{}];", t.tm, t.tn));
        for (arr, tile, ld, count, is_vec, idx) in
            [("av", "As", lda, t.tm, vec_a, "ty"), ("bv", "Bs", ldb, t.tn, vec_b, "tx")]
        {
            c.line("#pragma unroll");
            if is_vec {
                c.line(format!("for (int g = 0; g < {}; ++g) {{", count / 4));
                c.line(format!(
                    "const float4 v = *reinterpret_cast<const float4*>({tile} + kk * {ld} + {idx} * 4 + g * 64);"
                ));
                c.line(format!(
                    "{arr}[4 * g] = v.x; {arr}[4 * g + 1] = v.y; {arr}[4 * g + 2] = v.z; {arr}[4 * g + 3] = v.w;"
                ));
                c.line("}");
            } else {
                c.line(format!(
                    "for (int i = 0; i < {count}; ++i) {arr}[i] = {tile}[kk * {ld} + {idx} + i * 16];"
                ));
            }
        }
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {}; ++j) acc[i][j] += av[i] * bv[j];", t.tn));
        c.line("}");
        c.line("}");
        c.line("__syncthreads();");
        c.line("}");
        combine_groups(c, t);
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line(if vec_a {
            format!("const {ty} gm = m0 + (i / 4) * 64 + ty * 4 + i % 4;")
        } else {
            format!("const {ty} gm = m0 + ty + i * 16;")
        });
        c.line(format!("if (gm < {}) {{", int(self.m)));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {}; ++j) {{", t.tn));
        c.line(if vec_b {
            format!("const {ty} gn = n0 + (j / 4) * 64 + tx * 4 + j % 4;")
        } else {
            format!("const {ty} gn = n0 + tx + j * 16;")
        });
        c.line(format!("if (gn < {}) {}", int(self.n), self.store("acc[i][j]", split)));
        c.line("}");
        c.line("}");
        c.line("}");
        c.line("}");
        let groups = split.map_or(1, |sp| sp.splits);
        let launch = self.launch(groups * self.batch * tiles_m * tiles_n, t.threads(), split);
        let in_block = if t.split > 1 { format!(", split-K {}", t.split) } else { String::new() };
        let across = split_text(split);
        (launch, format!("tile {}x{}x{}, {}x{} per thread{in_block}{across}", t.bm, t.bn, t.bk, t.tm, t.tn))
    }

    /// The fast variant of the tiled kernel (`Variant::Fast`, see the module doc): the base
    /// kernel's tiles and arithmetic (each product summed in K order by one thread, split-K
    /// groups added in group order), with float4 global loads of plain operands, two shared
    /// stages and one barrier per K tile, warps of 8 x 4 threads and float4 output stores.
    /// The fast tiled kernel; with a split, the partial kernel of split-K across blocks, as
    /// `tiled`'s.
    fn tiled_fast(&self, c: &mut Code, t: Tile, split: Option<KSplit>) -> (Launch, String) {
        let ty = self.ty;
        let (vec_a, vec_b) = (vector(t.tm), vector(t.tn));
        // As in the base kernel: a k-contiguous operand is stored transposed, its tile padded.
        let pad = if vec_a || vec_b { 4 } else { 1 };
        let (pad_a, pad_b) = (pad * usize::from(self.a.k_contiguous), pad * usize::from(self.b.k_contiguous));
        let sides = [
            Side::new(("a", self.factor(0)), &self.a, self.m, t.bm, t.bm + pad_a, t.bk, "ra"),
            Side::new(("b", self.factor(1)), &self.b, self.n, t.bn, t.bn + pad_b, t.bk, "rb"),
        ];
        // Per K group and stage: A's tile, then B's, each a multiple of 16 bytes.
        let (tile_a, tile_b) =
            ((t.bk * sides[0].ld).next_multiple_of(4), (t.bk * sides[1].ld).next_multiple_of(4));
        let group_floats = tile_a + tile_b;
        let stage = t.split * group_floats;
        let stages = if 2 * stage * 4 <= SHARED_LIMIT { 2 } else { 1 };
        let partials = (t.split - 1) * t.tm * t.tn * GROUP;
        let (tiles_m, tiles_n) = (self.m.div_ceil(t.bm), self.n.div_ceil(t.bn));
        let iters = split.map_or(self.k, |sp| sp.chunk).div_ceil(t.bk).div_ceil(t.split);
        let name = &self.function(split);

        for s in sides.iter().filter(|s| !s.vector) {
            s.loader(c, name, ty, self.k);
        }

        let min_blocks = t.min_blocks(Variant::Fast);
        let bounds =
            if min_blocks > 1 { format!("{}, {min_blocks}", t.threads()) } else { t.threads().to_string() };
        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__({bounds}) {name}({}) {{",
            self.params(split)
        ));
        c.line(format!(
            "// tile {}x{}x{}, {}x{} per thread, {} K group(s) of {GROUP} threads, {stages} shared stage(s)",
            t.bm, t.bn, t.bk, t.tm, t.tn, t.split
        ));
        c.line(format!("__shared__ __align__(16) float smem[{}];", (stages * stage).max(partials)));
        if t.split > 1 {
            c.line(format!("const int t = threadIdx.x % {GROUP};"));
            c.line(format!("const int group = threadIdx.x / {GROUP};"));
        } else {
            c.line("const int t = threadIdx.x;");
        }
        c.line("// a warp holds 8 x 4 threads: 4 rows of A's and 8 columns of B's micro-tiles");
        c.line("const int tx = t / 32 % 2 * 8 + t % 8, ty = t / 64 * 4 + t % 32 / 8;");
        self.block_origin(c, t.bm, t.bn, true, split);
        let group_at = if t.split > 1 { format!(" + group * {group_floats}") } else { String::new() };
        c.line(format!("float* const As0 = smem{group_at};"));
        c.line(format!("float* const Bs0 = As0 + {tile_a};"));
        c.line(format!("float acc[{}][{}];", t.tm, t.tn));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {}; ++j) acc[i][j] = 0.0f;", t.tn));
        c.line("}");
        for s in &sides {
            c.line(format!("{} {}[{}];", s.element(), s.reg, s.loads));
        }
        let mut k_start = if t.split > 1 { format!("({ty})group * {}", t.bk) } else { "0".to_string() };
        if let Some(sp) = split {
            k_start = format!("ks * {} + {k_start}", int(sp.chunk));
        }
        c.line(format!("{ty} k0 = {k_start};"));
        let at = [("in0", "a_base", "m0"), ("in1", "b_base", "n0")];
        for (s, &(src, base, r0)) in sides.iter().zip(&at) {
            if s.vector {
                s.setup(c, ty, src, base, r0);
            }
        }
        let step = t.split * t.bk;
        let load_next = |c: &mut Code| {
            for (s, &(src, base, r0)) in sides.iter().zip(&at) {
                if s.vector {
                    s.fetch(c, self.k, step);
                } else {
                    c.line(format!("{name}_load_{}({src}, {base}, {r0}, k0, t, {});", s.name, s.reg));
                }
            }
        };
        load_next(c);
        // Two stages: in iteration `it` each thread stores K tile `it` (in registers) into stage
        // it % 2, whose last readers (iteration it - 2) all passed the previous barrier, loads
        // tile it + 1 into the registers, waits at the one barrier, and multiplies tile `it`.
        // The loads sit in a block of their own (`if`) before the barrier: ptxas keeps them
        // there, so their latency hides behind the barrier and the whole multiplication. (With
        // the loads unconditional it sank them after the multiplication, next to the stores
        // that use them, and their latency showed.) One stage: the base kernel's order, two
        // barriers per tile.
        if stages == 1 {
            sides[0].store(c, "As0");
            sides[1].store(c, "Bs0");
            c.line("__syncthreads();");
        }
        c.line(format!("for (int it = 0; it < {iters}; ++it) {{"));
        let fetch = |c: &mut Code| {
            if iters > 1 {
                c.line("// the next K tile into registers while this one is multiplied");
                c.line(format!("if (it + 1 < {iters}) {{"));
                c.line(format!("k0 += {step};"));
                load_next(c);
                c.line("}");
            }
        };
        if stages == 2 {
            c.line(format!("float* const As = As0 + (it % 2) * {stage};"));
            c.line(format!("float* const Bs = Bs0 + (it % 2) * {stage};"));
            sides[0].store(c, "As");
            sides[1].store(c, "Bs");
            fetch(c);
            c.line("__syncthreads();");
        } else {
            c.line("const float* As = As0;");
            c.line("const float* Bs = Bs0;");
            fetch(c);
        }
        // This thread's first row of A's tile and column of B's: the reads below are at constant
        // offsets from them.
        c.line(format!("const float* const Ar = As + ty{};", if vec_a { " * 4" } else { "" }));
        c.line(format!("const float* const Br = Bs + tx{};", if vec_b { " * 4" } else { "" }));
        c.line("#pragma unroll");
        c.line(format!("for (int kk = 0; kk < {}; ++kk) {{", t.bk));
        c.line(format!("float av[{}], bv[{}];", t.tm, t.tn));
        for (arr, tile, ld, count, is_vec) in
            [("av", "Ar", sides[0].ld, t.tm, vec_a), ("bv", "Br", sides[1].ld, t.tn, vec_b)]
        {
            c.line("#pragma unroll");
            if is_vec {
                c.line(format!("for (int g = 0; g < {}; ++g) {{", count / 4));
                c.line(format!(
                    "const float4 v = *reinterpret_cast<const float4*>({tile} + (kk * {ld} + g * 64));"
                ));
                c.line(format!(
                    "{arr}[4 * g] = v.x; {arr}[4 * g + 1] = v.y; {arr}[4 * g + 2] = v.z; {arr}[4 * g + 3] = v.w;"
                ));
                c.line("}");
            } else {
                c.line(format!("for (int i = 0; i < {count}; ++i) {arr}[i] = {tile}[kk * {ld} + i * 16];"));
            }
        }
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {}; ++j) acc[i][j] += av[i] * bv[j];", t.tn));
        c.line("}");
        c.line("}");
        if stages == 1 {
            c.line("__syncthreads();");
            if iters > 1 {
                c.line(format!("if (it + 1 < {iters}) {{"));
                sides[0].store(c, "As0");
                sides[1].store(c, "Bs0");
                c.line("__syncthreads();");
                c.line("}");
            }
        }
        c.line("}");
        if stages == 2 && t.split > 1 {
            // The partial tiles below reuse the stages.
            c.line("__syncthreads();");
        }
        combine_groups(c, t);
        // Plain output rows of a multiple of 4 floats take float4 stores (the output is a slot:
        // 16-byte aligned; each batch matrix M·N floats); an epilogue or update stays per element.
        let vec_out = (split.is_some() || (matches!(self.sink, Sink::Output) && self.elems.output_f32()))
            && vec_b
            && self.n.is_multiple_of(4);
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
        c.line(if vec_a {
            format!("const {ty} gm = m0 + (i / 4) * 64 + ty * 4 + i % 4;")
        } else {
            format!("const {ty} gm = m0 + ty + i * 16;")
        });
        c.line(format!("if (gm < {}) {{", int(self.m)));
        c.line("#pragma unroll");
        if vec_out {
            c.line(format!("for (int g = 0; g < {}; ++g) {{", t.tn / 4));
            c.line(format!("const {ty} gn = n0 + g * 64 + tx * 4;"));
            c.line(format!(
                "if (gn < {}) *reinterpret_cast<float4*>(o + gm * {} + gn) = \
                 make_float4(acc[i][4 * g], acc[i][4 * g + 1], acc[i][4 * g + 2], acc[i][4 * g + 3]);",
                int(self.n),
                int(self.n)
            ));
            c.line("}");
        } else {
            c.line(format!("for (int j = 0; j < {}; ++j) {{", t.tn));
            c.line(if vec_b {
                format!("const {ty} gn = n0 + (j / 4) * 64 + tx * 4 + j % 4;")
            } else {
                format!("const {ty} gn = n0 + tx + j * 16;")
            });
            c.line(format!("if (gn < {}) {}", int(self.n), self.store("acc[i][j]", split)));
            c.line("}");
        }
        c.line("}");
        c.line("}");
        c.line("}");
        let groups = split.map_or(1, |sp| sp.splits);
        let launch = self.launch(groups * self.batch * tiles_m * tiles_n, t.threads(), split);
        let across = split_text(split);
        let split = if t.split > 1 { format!(", split-K {}", t.split) } else { String::new() };
        let vectors = match (sides[0].vector, sides[1].vector) {
            (true, true) => ", float4 loads of A and B",
            (true, false) => ", float4 loads of A",
            (false, true) => ", float4 loads of B",
            (false, false) => "",
        };
        (
            launch,
            format!(
                "tile {}x{}x{}, {}x{} per thread{split}{vectors}, {stages} shared stage{}{across}",
                t.bm,
                t.bn,
                t.bk,
                t.tm,
                t.tn,
                if stages > 1 { "s" } else { "" }
            ),
        )
    }
}

/// In-block split-K: the other K groups' partial tiles (`acc`) added to group 0's through the
/// shared memory `smem`, in group order; groups other than 0 return.
fn combine_groups(c: &mut Code, t: Tile) {
    if t.split == 1 {
        return;
    }
    let micro = t.tm * t.tn;
    c.line("// add the other K groups' partial tiles to group 0's, in group order");
    c.line("if (group > 0) {");
    c.line("#pragma unroll");
    c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
    c.line("#pragma unroll");
    c.line(format!(
        "for (int j = 0; j < {}; ++j) smem[((group - 1) * {micro} + i * {} + j) * {GROUP} + t] = acc[i][j];",
        t.tn, t.tn
    ));
    c.line("}");
    c.line("}");
    c.line("__syncthreads();");
    c.line("if (group > 0) return;");
    c.line(format!("for (int g = 0; g < {}; ++g) {{", t.split - 1));
    c.line("#pragma unroll");
    c.line(format!("for (int i = 0; i < {}; ++i) {{", t.tm));
    c.line("#pragma unroll");
    c.line(format!(
        "for (int j = 0; j < {}; ++j) acc[i][j] += smem[(g * {micro} + i * {} + j) * {GROUP} + t];",
        t.tn, t.tn
    ));
    c.line("}");
    c.line("}");
}

/// One operand of the fast tiled kernel: how its tile is read from global memory (float4s or
/// elements) and stored into shared memory.
struct Side<'a> {
    /// "a" or "b".
    name: &'static str,
    /// The C type of the operand's elements (`half::elem`).
    elem: &'static str,
    op: &'a Operand,
    /// M or N.
    rows: usize,
    /// BM or BN.
    br: usize,
    /// The shared tile's leading dimension (floats per k).
    ld: usize,
    bk: usize,
    /// Whether the tile is read as float4s (`Side::vector_loads`).
    vector: bool,
    /// float4s or floats per tile, and per thread (the last round of threads may have none).
    total: usize,
    loads: usize,
    /// The registers that hold a thread's share of the next tile.
    reg: &'static str,
}

impl<'a> Side<'a> {
    fn new(
        (name, elem): (&'static str, &'static str),
        op: &'a Operand,
        rows: usize,
        br: usize,
        ld: usize,
        bk: usize,
        reg: &'static str,
    ) -> Self {
        // Half operands are read element by element (`half`).
        let vector = elem == "float" && Self::vector_loads(op, br, bk);
        let total = if vector { br * bk / 4 } else { br * bk };
        Side { name, elem, op, rows, br, ld, bk, vector, total, loads: total.div_ceil(GROUP), reg }
    }

    /// Whether `op` (tiles of `br` rows by `bk`) is read as float4s: a plain layout whose rows
    /// (along its contiguous axis) start 16-byte aligned in every batch, and a tile extent along
    /// that axis that is a multiple of 4. A float4 then starts at a multiple of 4 along the axis;
    /// one that crosses the operand's edge (the extent not a multiple of 4) is read element by
    /// element.
    fn vector_loads(op: &Operand, br: usize, bk: usize) -> bool {
        let Some(p) = &op.plain else { return false };
        let extent = if op.k_contiguous { bk } else { br };
        p.ld.is_multiple_of(4)
            && p.offset.is_multiple_of(4)
            && (op.batch_offset == "0" || p.batch_granule.is_multiple_of(4))
            && extent.is_multiple_of(4)
    }

    fn element(&self) -> &'static str {
        if self.vector { "float4" } else { "float" }
    }

    /// The (row, k) in the tile of thread item `e` (of `total`; `e` names it): for float4s of a k-contiguous
    /// operand, pairs of threads read 8 consecutive k of a row (a 32-byte sector) and a warp 16
    /// rows, whose transposed stores then hit 32 banks; along rows, consecutive threads read
    /// consecutive float4s. Elements as in the base kernel.
    fn coords(&self, e: &str) -> (String, String) {
        let (br, bk) = (self.br, self.bk);
        match (self.vector, self.op.k_contiguous) {
            (true, true) if (bk / 4).is_multiple_of(2) => {
                (format!("{e} / 2 % {br}"), format!("4 * ({e} / {} * 2 + {e} % 2)", 2 * br))
            }
            (true, true) => (format!("{e} / {}", bk / 4), format!("4 * ({e} % {})", bk / 4)),
            (true, false) => (format!("4 * ({e} % {})", br / 4), format!("{e} / {}", br / 4)),
            (false, true) => (format!("{e} / {bk}"), format!("{e} % {bk}")),
            (false, false) => (format!("{e} % {br}"), format!("{e} / {br}")),
        }
    }

    /// `NAME_load_SIDE(src, base, r0, k0, t, dst)`: thread `t`'s elements of the tile at rows
    /// r0.., k0.. into `dst`, zeros outside the operand (the element loader, for operands that
    /// are not read as float4s).
    fn loader(&self, c: &mut Code, name: &str, ty: &str, k: usize) {
        let (rr, kk) = self.coords("e");
        c.line(format!(
            "__device__ __forceinline__ void {name}_load_{}(const {}* __restrict__ src, const {ty} base, \
             const {ty} r0, const {ty} k0, const int t, float (&dst)[{}]) {{",
            self.name, self.elem, self.loads
        ));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", self.loads));
        c.line(format!("const int e = t + i * {GROUP};"));
        c.line(format!("const {ty} gr = r0 + {rr}, gk = k0 + {kk};"));
        let some =
            if self.total.is_multiple_of(GROUP) { String::new() } else { format!("e < {} && ", self.total) };
        c.line("float v = 0.0f;");
        c.line(format!("if ({some}gr < {} && gk < {}) {{", int(self.rows), int(k)));
        c.line(&self.op.load);
        c.line("}");
        c.line("dst[i] = v;");
        c.line("}");
        c.line("}");
        c.blank();
    }

    /// For float4 loads: per float4 `i` of this thread, its row `X_rI`, its k in the tile
    /// `X_kI`, whether it has one (`X_okI`: in the tile's float4s and a row inside the operand)
    /// and a pointer `X_pI` to it in the first K tile (`k0`), advanced by `fetch`.
    fn setup(&self, c: &mut Code, ty: &str, src: &str, base: &str, r0: &str) {
        let p = self.op.plain.as_ref().expect("float4 loads read a plain operand");
        let s = self.name;
        let offset = if p.offset > 0 { format!(" + {}", int(p.offset)) } else { String::new() };
        for i in 0..self.loads {
            c.line(format!("const int {s}_e{i} = t + {};", i * GROUP));
            let (rr, kk) = self.coords(&format!("{s}_e{i}"));
            c.line(format!("const {ty} {s}_r{i} = {r0} + {rr};"));
            c.line(format!("const int {s}_k{i} = {kk};"));
            let some = if self.total.is_multiple_of(GROUP) || (i + 1) * GROUP <= self.total {
                String::new()
            } else {
                format!("{s}_e{i} < {} && ", self.total)
            };
            c.line(format!("const bool {s}_ok{i} = {some}{s}_r{i} < {};", int(self.rows)));
            let at = if self.op.k_contiguous {
                format!("{s}_r{i} * {} + (k0 + {s}_k{i})", int(p.ld))
            } else {
                format!("(k0 + {s}_k{i}) * {} + {s}_r{i}", int(p.ld))
            };
            c.line(format!("const float* {s}_p{i} = {src} + {base}{offset} + {at};"));
        }
    }

    /// Loads this thread's float4s of the K tile at `k0` into the registers (zeros outside the
    /// operand; a float4 across its edge element by element) and advances the pointers by
    /// `step` k.
    fn fetch(&self, c: &mut Code, k: usize, step: usize) {
        let p = self.op.plain.as_ref().expect("float4 loads read a plain operand");
        let (s, reg) = (self.name, self.reg);
        let advance = if self.op.k_contiguous { step } else { step * p.ld };
        for i in 0..self.loads {
            let (along, extent) = if self.op.k_contiguous {
                (format!("k0 + {s}_k{i}"), k)
            } else {
                (format!("{s}_r{i}"), self.rows)
            };
            c.line(format!("{reg}[{i}] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);"));
            c.line(format!("if ({s}_ok{i} && k0 + {s}_k{i} < {}) {{", int(k)));
            if extent.is_multiple_of(4) {
                c.line(format!("{reg}[{i}] = *reinterpret_cast<const float4*>({s}_p{i});"));
            } else {
                c.line(format!("if ({along} + 3 < {}) {{", int(extent)));
                c.line(format!("{reg}[{i}] = *reinterpret_cast<const float4*>({s}_p{i});"));
                c.line("} else {");
                c.line(format!("{reg}[{i}].x = {s}_p{i}[0];"));
                c.line(format!("if ({along} + 1 < {}) {reg}[{i}].y = {s}_p{i}[1];", int(extent)));
                c.line(format!("if ({along} + 2 < {}) {reg}[{i}].z = {s}_p{i}[2];", int(extent)));
                c.line("}");
            }
            c.line("}");
            c.line(format!("{s}_p{i} += {};", int(advance)));
        }
    }

    /// Stores the registers into the shared tile at `tile` (k-major: k · ld + row).
    fn store(&self, c: &mut Code, tile: &str) {
        let (rr, kk) = self.coords("e");
        let (ld, reg) = (self.ld, self.reg);
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {}; ++i) {{", self.loads));
        c.line(format!("const int e = t + i * {GROUP};"));
        let partial = !self.total.is_multiple_of(GROUP);
        if partial {
            c.line(format!("if (e < {}) {{", self.total));
        }
        match (self.vector, self.op.k_contiguous) {
            (true, true) => {
                c.line(format!("float* const d = {tile} + ({kk}) * {ld} + {rr};"));
                c.line(format!(
                    "d[0] = {reg}[i].x; d[{ld}] = {reg}[i].y; d[{}] = {reg}[i].z; d[{}] = {reg}[i].w;",
                    2 * ld,
                    3 * ld
                ));
            }
            (true, false) => {
                c.line(format!("*reinterpret_cast<float4*>({tile} + ({kk}) * {ld} + {rr}) = {reg}[i];"));
            }
            (false, _) => {
                c.line(format!("{tile}[({kk}) * {ld} + {rr}] = {reg}[i];"));
            }
        }
        if partial {
            c.line("}");
        }
        c.line("}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_the_shape() {
        for v in [Variant::Base, Variant::Fast] {
            let small = choose(32, 10, 100, 1, v).1;
            assert!(small.bm <= 32 && small.bn <= 32, "{small:?}");
            let big = choose(4096, 4096, 4096, 1, v).1;
            assert!(big.bm >= 64 && big.bn >= 64 && big.split == 1, "{big:?}");
            let thin = choose(65536, 16, 27, 1, v).1;
            assert!(thin.bn <= 32, "{thin:?}");
            let long_k = choose(144, 32, 4096, 1, v).1;
            assert!(long_k.split > 1, "{long_k:?}");
            for t in [small, big, thin, long_k] {
                assert!(t.threads() <= 1024 && t.shared_floats(4, 4) * 4 <= SHARED_LIMIT);
            }
            // A filter gradient: few outputs, the whole batch of positions to contract.
            assert!(matches!(plan(27, 16, 65536, 1, 0, v), Plan::KParallel { .. }));
            assert!(matches!(plan(1024, 1024, 1024, 1, 0, v), Plan::Tiled(_)));
            // A weight gradient over 1024 positions (the transformer's projections): 256 x 256
            // outputs fill the SMs with tiles.
            assert!(matches!(plan(256, 256, 1024, 1, 0, v), Plan::Tiled(_)));
        }
    }

    /// The zoo's products (M x K x N, as `kiln bench-gemm` names them) keep the base variant's
    /// plans; big squares move to 8x8 micro-tiles.
    #[test]
    fn the_fast_variant_keeps_the_zoo_plans() {
        let zoo = [
            (256, 784, 1024),
            (256, 1024, 1024),
            (256, 1024, 10),
            (64, 4096, 128),
            (1024, 256, 256),
            (1024, 256, 1024),
            (1024, 1024, 256),
            (1024, 256, 1000),
        ];
        for (m, k, n) in zoo {
            let (base, fast) = (plan(m, n, k, 1, 0, Variant::Base), plan(m, n, k, 1, 0, Variant::Fast));
            eprintln!("{m}x{k}x{n}: base {base:?}, fast {fast:?}");
            assert_eq!(base, fast, "{m}x{k}x{n}");
        }
        for s in [2048, 4096, 8192] {
            let (base, fast) = (plan(s, s, s, 1, 0, Variant::Base), plan(s, s, s, 1, 0, Variant::Fast));
            eprintln!("{s}^3: base {base:?}, fast {fast:?}");
            assert!(matches!(fast, Plan::Tiled(Tile { tm: 8, tn: 8, split: 1, .. })), "{s}^3: {fast:?}");
        }
    }

    #[test]
    fn long_contractions_split_across_blocks_given_scratch() {
        // The cnn's filter gradients: a few thousand outputs over 65,536 or 16,384 positions.
        for (m, n, k) in [(288, 32, 65536), (27, 32, 65536), (288, 64, 16384), (576, 64, 16384)] {
            let p = plan(m, n, k, 1, MAX_SCRATCH_BYTES, Variant::Fast);
            eprintln!("{m}x{n}x{k}: {p:?}");
            let Plan::SplitK { splits, chunk, tile } = p else { panic!("{m}x{n}x{k}: {p:?}") };
            assert!(splits * chunk >= k && (splits - 1) * chunk < k, "{p:?}");
            assert_eq!(chunk % (tile.bk * tile.split), 0, "{p:?}");
            assert_eq!(scratch_wanted(m, n, k, 1), splits * m * n * 4);
            // Never more than the scratch given.
            let less = plan(m, n, k, 1, splits * m * n * 4 - 1, Variant::Fast);
            assert!(!matches!(less, Plan::SplitK { splits: s, .. } if s >= splits), "{less:?}");
        }
        // Large squares fill the GPU with tiles: no scratch.
        assert_eq!(scratch_wanted(4096, 4096, 4096, 1), 0);
        assert_eq!(scratch_wanted(32, 10, 100, 1), 0);
    }
}
