//! The half-precision tensor-core GEMM: products of two bf16 or two f16 factors on the tensor
//! cores (`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` and its `.f16` twin, sm_80 and
//! later), accumulated in f32, with the tiled kernel's sinks and split-K (an epilogue, a half
//! or f32 output, partial tiles into the scratch).
//!
//! Half factors are exact in the instruction's inputs, and every product of two halves is exact
//! in f32 (short of bf16 products beyond f32's range): the result is the f32 product of the
//! widened factors up to how the additions round, as the FMA kernels' (which the same op
//! widened runs) and the CPU's are. The tensor cores add in an order of their own and their f32
//! accumulation does not round each sum to nearest as IEEE additions do, so the device differs
//! from the FMA kernel a little more than the host's meaning of the instruction (k order, each
//! sum rounded) shows. This is the path PyTorch's autocast takes for a product of half copies.
//!
//! Block: 256 threads, 8 warps as 2 x 4, a BM x BN tile (128 x 128 where the blocks fill the
//! GPU, else 64 x 64, as the TF32 kernel) and BK = 32 of K at a time. The factors' tiles stay
//! in their half bits in shared memory, rows of BK + 8 halves along k (a fragment register is
//! one 32-bit read of two consecutive k; the 8 halves of padding put the eight rows a warp
//! reads at once on distinct banks), 20 KiB for 128 x 128. Each thread reads its share of the
//! next K tile from global memory into registers (the half bits, moved as they are) while the
//! warps multiply this one. Each warp computes (BM / 2) x (BN / 4) with MI x NI m16n8 tiles.
//!
//! Fragments (PTX ISA, `mma.m16n8k16` for .f16/.bf16; lane l, g = l / 4, q = l % 4): A's four
//! registers hold rows g, g + 8, g, g + 8 at k 2q, 2q + 1 (the first two) and 2q + 8, 2q + 9
//! (the last two), the lower k in the lower half; B's two hold column g at k 2q, 2q + 1 and
//! 2q + 8, 2q + 9; the accumulators are the TF32 kernel's (rows g, g + 8, columns 2q, 2q + 1).
//! On the host (`cuda_host.h`) the instruction is a function of the same meaning, so the
//! fragment layout is checked against the CPU without a GPU; the tensor cores add the sixteen
//! products in an order of their own, so host and device agree to rounding.
//!
//! Not measured on a GPU yet. What it lacks against cuBLAS: one shared stage (two barriers a K
//! tile), element loads from global memory, mma.sync rather than Hopper's wgmma and TMA.

use super::tf32::{mma_accumulators, next_tile_while_multiplying};
use super::{GROUP, Gemm, KSplit, split_text};
use crate::cuda::Launch;
use crate::cuda::codegen::{Code, int};

/// K per shared tile.
const BK: usize = 32;
/// Warps along M and N.
const WM: usize = 2;
const WN: usize = 4;
/// Halves of a shared row: BK and 8 of padding.
const LDK: usize = BK + 8;

/// The two half types of the tensor cores' inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    BF16,
    F16,
}

impl Half {
    /// The half type both factors of a product hold (`half::elem` names), if they hold the same.
    pub(crate) fn of(a: &str, b: &str) -> Option<Half> {
        match (a, b) {
            ("kiln_bf16", "kiln_bf16") => Some(Half::BF16),
            ("kiln_f16", "kiln_f16") => Some(Half::F16),
            _ => None,
        }
    }

    /// The instruction's type suffix and the host function that stands for it.
    fn ptx(self) -> &'static str {
        match self {
            Half::BF16 => "bf16",
            Half::F16 => "f16",
        }
    }
}

/// The device functions the host header defines for itself: a 32-bit read of two halves and
/// the instruction, which needs sm_80; before it (a Turing GPU) the instruction's meaning through
/// shuffles, as the host header computes it: the same sums in k order, slower (the halves
/// widened by the source's own conversions, `half::types`).
fn device_functions(h: Half) -> String {
    let t = h.ptx();
    let f16 = h == Half::F16;
    format!(
        r#"#ifdef __CUDA_ARCH__
#ifndef KILN_PAIR
#define KILN_PAIR
__device__ __forceinline__ unsigned kiln_pair(const unsigned short* p) {{
  return *reinterpret_cast<const unsigned*>(p);
}}
#endif
#if __CUDA_ARCH__ < 800
#ifndef KILN_MMA_SHUFFLED
#define KILN_MMA_SHUFFLED
__device__ __forceinline__ void kiln_mma_shuffled(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2], bool f16) {{
  const int l = (int)(threadIdx.x % 32u), g = l / 4, t = l % 4;
  for (int k = 0; k < 16; ++k) {{
    const int src = (k % 8) / 2, hi = k >= 8, shift = (k % 2) * 16;
    const unsigned a_lo = __shfl_sync(0xffffffffu, a[hi ? 2 : 0], 4 * g + src);
    const unsigned a_hi = __shfl_sync(0xffffffffu, a[hi ? 3 : 1], 4 * g + src);
    const unsigned b0 = __shfl_sync(0xffffffffu, b[hi], 4 * (2 * t) + src);
    const unsigned b1 = __shfl_sync(0xffffffffu, b[hi], 4 * (2 * t + 1) + src);
    const unsigned short h[4] = {{(unsigned short)(a_lo >> shift), (unsigned short)(a_hi >> shift),
                                  (unsigned short)(b0 >> shift), (unsigned short)(b1 >> shift)}};
    float v[4];
    for (int e = 0; e < 4; ++e) v[e] = f16 ? kiln_f16_to_f32(h[e]) : kiln_bf16_to_f32(h[e]);
    const float x0 = v[0], x1 = v[1], y0 = v[2], y1 = v[3];
    d[0] = fmaf(x0, y0, d[0]);
    d[1] = fmaf(x0, y1, d[1]);
    d[2] = fmaf(x1, y0, d[2]);
    d[3] = fmaf(x1, y1, d[3]);
  }}
}}
#endif
#endif
#ifndef KILN_MMA_{up}
#define KILN_MMA_{up}
__device__ __forceinline__ void kiln_mma_{t}(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {{
#if __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  kiln_mma_shuffled(d, a, b, {f16});
#endif
}}
#endif
#endif"#,
        up = t.to_uppercase()
    )
}

impl Gemm {
    /// The half tensor-core kernel for factors of type `h` (with a split, the partial kernel of
    /// split-K across blocks).
    pub(super) fn tiled_half(&self, c: &mut Code, split: Option<KSplit>, h: Half) -> (Launch, String) {
        let ty = self.ty;
        let (bm, bn) = self.mma_tile(split);
        let (wtm, wtn) = (bm / WM, bn / WN);
        let (mi, ni) = (wtm / 16, wtn / 8);
        let iters = split.map_or(self.k, |sp| sp.chunk).div_ceil(BK);
        let name = &self.function(split);
        let sides = [("a", &self.a, self.m, bm, self.factor(0)), ("b", &self.b, self.n, bn, self.factor(1))];
        let loads = |rows: usize| (rows * BK).div_ceil(GROUP);
        c.line(device_functions(h));
        // `NAME_load_SIDE(src, base, r0, k0, t, dst)`: thread t's elements of the tile at rows
        // r0.., k0.., as half bits (zeros outside the operand).
        for &(side, op, rows, br, elem) in &sides {
            let (rr, kk) = if op.k_contiguous {
                (format!("e / {BK}"), format!("e % {BK}"))
            } else {
                (format!("e % {br}"), format!("e / {br}"))
            };
            let n = loads(br);
            c.line(format!(
                "__device__ __forceinline__ void {name}_load_{side}(const {elem}* __restrict__ src, \
                 const {ty} base, const {ty} r0, const {ty} k0, const int t, unsigned short (&dst)[{n}]) {{"
            ));
            c.line("#pragma unroll");
            c.line(format!("for (int i = 0; i < {n}; ++i) {{"));
            c.line(format!("const int e = t + i * {GROUP};"));
            c.line(format!("const {ty} gr = r0 + {rr}, gk = k0 + {kk};"));
            c.line(format!("{elem} v = {{0}};"));
            let some =
                if (br * BK).is_multiple_of(GROUP) { String::new() } else { format!("e < {} && ", br * BK) };
            c.line(format!("if ({some}gr < {} && gk < {}) {{", int(rows), int(self.k)));
            c.line(&op.load);
            c.line("}");
            c.line("dst[i] = v.bits;");
            c.line("}");
            c.line("}");
            c.blank();
        }
        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__({GROUP}) {name}({}) {{",
            self.params(split)
        ));
        c.line(format!(
            "// {} tensor cores: tile {bm}x{bn}x{BK}, warps {WM}x{WN} of {wtm}x{wtn} ({mi}x{ni} m16n8k16 tiles)",
            h.ptx()
        ));
        c.line(format!("__shared__ __align__(16) unsigned short smem[{}];", (bm + bn) * LDK));
        c.line("const int t = threadIdx.x;");
        c.line("const int warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;");
        c.line(format!("const int wm = warp / {WN}, wn = warp % {WN};"));
        self.block_origin(c, bm, bn, true, split);
        c.line("unsigned short* const As = smem;");
        c.line(format!("unsigned short* const Bs = smem + {};", bm * LDK));
        mma_accumulators(c, mi, ni);
        c.line(format!("unsigned short ra[{}], rb[{}];", loads(bm), loads(bn)));
        let k_start = split.map_or("0".to_string(), |sp| format!("ks * {}", int(sp.chunk)));
        c.line(format!("{ty} k0 = {k_start};"));
        let load_next = |c: &mut Code| {
            c.line(format!("{name}_load_a(in0, a_base, m0, k0, t, ra);"));
            c.line(format!("{name}_load_b(in1, b_base, n0, k0, t, rb);"));
        };
        load_next(c);
        c.line(format!("for (int it = 0; it < {iters}; ++it) {{"));
        // Registers into the shared tiles: element (row, k) at row * LDK + k.
        for &(side, op, _, br, _) in &sides {
            let (tile, reg) = if side == "a" { ("As", "ra") } else { ("Bs", "rb") };
            let (rr, kk) = if op.k_contiguous {
                (format!("e / {BK}"), format!("e % {BK}"))
            } else {
                (format!("e % {br}"), format!("e / {br}"))
            };
            c.line("#pragma unroll");
            c.line(format!("for (int i = 0; i < {}; ++i) {{", loads(br)));
            c.line(format!("const int e = t + i * {GROUP};"));
            let store = format!("{tile}[({rr}) * {LDK} + {kk}] = {reg}[i];");
            if (br * BK).is_multiple_of(GROUP) {
                c.line(store);
            } else {
                c.line(format!("if (e < {}) {store}", br * BK));
            }
            c.line("}");
        }
        c.line("__syncthreads();");
        next_tile_while_multiplying(c, iters, BK, &load_next);
        c.line("#pragma unroll");
        c.line(format!("for (int kk = 0; kk < {BK}; kk += 16) {{"));
        c.line(format!("unsigned af[{mi}][4], bf[{ni}][2];"));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
        c.line(format!(
            "const unsigned short* const p = As + (wm * {wtm} + i * 16 + g) * {LDK} + kk + 2 * q;"
        ));
        c.line(format!(
            "af[i][0] = kiln_pair(p); af[i][1] = kiln_pair(p + {}); af[i][2] = kiln_pair(p + 8); af[i][3] = kiln_pair(p + {});",
            8 * LDK,
            8 * LDK + 8
        ));
        c.line("}");
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {ni}; ++j) {{"));
        c.line(format!(
            "const unsigned short* const p = Bs + (wn * {wtn} + j * 8 + g) * {LDK} + kk + 2 * q;"
        ));
        c.line("bf[j][0] = kiln_pair(p); bf[j][1] = kiln_pair(p + 8);");
        c.line("}");
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {ni}; ++j) kiln_mma_{}(acc[i][j], af[i], bf[j]);", h.ptx()));
        c.line("}");
        c.line("}");
        c.line("__syncthreads();");
        c.line("}");
        self.mma_stores(c, (wtm, wtn), (mi, ni), split);
        let launch = self.mma_launch((bm, bn), split);
        let across = split_text(split);
        (launch, format!("{} tensor cores, tile {bm}x{bn}x{BK}{across}", h.ptx()))
    }
}
