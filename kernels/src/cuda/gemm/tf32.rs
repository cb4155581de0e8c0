//! The TF32 tensor-core GEMM (`allow_tf32`): the tiled kernel's loads, sinks and split-K, with
//! the multiplication on the tensor cores (`mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`,
//! sm_80 and later) instead of f32 FMAs.
//!
//! TF32 keeps 10 of f32's 23 mantissa bits: every operand element is rounded once, as it goes
//! into shared memory (`cvt.rna.tf32.f32`), and the products are accumulated in f32. A product's
//! error is then about 2^-11 of the sum of |terms| (PyTorch's `allow_tf32`, JAX's "default"
//! precision on GPUs), against about 2^-24 K for f32: an option, off by default
//! (`set_allow_tf32`, `KILN_TF32=1`).
//!
//! Block: 256 threads, 8 warps as 2 x 4, a BM x BN tile (128 x 128 where the blocks fill the
//! GPU, else 64 x 64) and BK = 32 of K at a time, one shared stage, the next K tile fetched into
//! registers while this one is multiplied. Both tiles are stored k-major with rows padded by 8
//! floats, so that the fragment reads of a warp (lanes 4g + t reading row g, k t) hit 32
//! distinct banks. Each warp computes (BM / 2) x (BN / 4) with MI x NI m16n8 tiles, MI·NI·4
//! accumulators per thread.
//!
//! Measured on an H100 (2026-11-25, `KILN_TF32=1 kiln bench-gemm`): 4096³ at 74.6 TFLOP/s
//! (the f32 kernel: 43.3; cuBLAS TF32: 406), 2048³ at 68.2, 1024x256x1024 at 27.6 (f32 22.3),
//! relative error 2.6e-4 against the CPU's f32 on every shape; the zoo's training steps: mlp
//! 0.186 ms (f32 0.205), transformer 0.644 (0.683), cnn 0.95 (0.80: its convolutions gather
//! through the element loader and lose the f32 kernel's in-block split-K). `tests/tf32.rs`
//! passed there, with operands TF32 holds exactly matching the CPU exactly (the fragment
//! layouts), and compute-sanitizer memcheck and racecheck found nothing. A cap of 128 registers
//! (two blocks an SM) made 4096³ no faster (73.0) and the cnn slower (1.46 ms). What it lacks
//! against cuBLAS: one shared stage (two barriers a K tile), 32-bit fragment reads (no wide
//! shared loads), mma.sync rather than Hopper's wgmma.
//!
//! On the host (`cuda_host.h`) the two PTX instructions are functions of the same meaning, so
//! the layout of every fragment is checked against the CPU without a GPU; the tensor cores add
//! the eight products of an m16n8k8 in an order of their own, so host and device agree to
//! rounding.

use super::{GROUP, Gemm, KSplit, SMS, Side, split_text};
use crate::cuda::Launch;
use crate::cuda::codegen::{Code, int};

/// K per shared tile.
const BK: usize = 32;
/// Warps along M and N.
const WM: usize = 2;
const WN: usize = 4;
/// Padding of a shared row (floats): rows 8 floats apart modulo 32 banks.
const PAD: usize = 8;

/// The PTX behind the two functions the host header defines for itself.
const DEVICE_FUNCTIONS: &str = r#"#ifdef __CUDA_ARCH__
__device__ __forceinline__ float kiln_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}
__device__ __forceinline__ void kiln_mma_tf32(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif"#;

impl Gemm {
    /// The block tile of the tensor-core kernels (this and `half_mma`): 128 x 128 when those
    /// blocks (times the splits) give every SM one, else 64 x 64.
    pub(super) fn mma_tile(&self, split: Option<KSplit>) -> (usize, usize) {
        let groups = split.map_or(1, |s| s.splits);
        let big = groups * self.batch * self.m.div_ceil(128) * self.n.div_ceil(128);
        if big >= SMS { (128, 128) } else { (64, 64) }
    }

    /// The TF32 kernel (with a split, the partial kernel of split-K across blocks).
    pub(super) fn tiled_tf32(&self, c: &mut Code, split: Option<KSplit>) -> (Launch, String) {
        let ty = self.ty;
        let (bm, bn) = self.mma_tile(split);
        let (wtm, wtn) = (bm / WM, bn / WN);
        let (mi, ni) = (wtm / 16, wtn / 8);
        let (lda, ldb) = (bm + PAD, bn + PAD);
        let sides = [
            Side::new(("a", self.factor(0)), &self.a, self.m, bm, lda, BK, "ra"),
            Side::new(("b", self.factor(1)), &self.b, self.n, bn, ldb, BK, "rb"),
        ];
        let iters = split.map_or(self.k, |sp| sp.chunk).div_ceil(BK);
        let name = &self.function(split);
        c.line(DEVICE_FUNCTIONS);
        for s in sides.iter().filter(|s| !s.vector) {
            s.loader(c, name, ty, self.k);
        }
        c.line(format!(
            "extern \"C\" __global__ void __launch_bounds__({GROUP}) {name}({}) {{",
            self.params(split)
        ));
        c.line(format!(
            "// TF32 tensor cores: tile {bm}x{bn}x{BK}, warps {WM}x{WN} of {wtm}x{wtn} ({mi}x{ni} m16n8k8 tiles)"
        ));
        c.line(format!("__shared__ __align__(16) float smem[{}];", BK * (lda + ldb)));
        c.line("const int t = threadIdx.x;");
        c.line("const int warp = t / 32, lane = t % 32, g = lane / 4, q = lane % 4;");
        c.line(format!("const int wm = warp / {WN}, wn = warp % {WN};"));
        self.block_origin(c, bm, bn, true, split);
        c.line("float* const As = smem;");
        c.line(format!("float* const Bs = smem + {};", BK * lda));
        mma_accumulators(c, mi, ni);
        for s in &sides {
            c.line(format!("{} {}[{}];", s.element(), s.reg, s.loads));
        }
        let k_start = split.map_or("0".to_string(), |sp| format!("ks * {}", int(sp.chunk)));
        c.line(format!("{ty} k0 = {k_start};"));
        let at = [("in0", "a_base", "m0"), ("in1", "b_base", "n0")];
        for (s, &(src, base, r0)) in sides.iter().zip(&at) {
            if s.vector {
                s.setup(c, ty, src, base, r0);
            }
        }
        let load_next = |c: &mut Code| {
            for (s, &(src, base, r0)) in sides.iter().zip(&at) {
                if s.vector {
                    s.fetch(c, self.k, BK);
                } else {
                    c.line(format!("{name}_load_{}({src}, {base}, {r0}, k0, t, {});", s.name, s.reg));
                }
            }
        };
        // Every element is rounded to TF32 once, in registers, before it is stored.
        let round = |c: &mut Code| {
            for s in &sides {
                c.line("#pragma unroll");
                c.line(format!("for (int i = 0; i < {}; ++i) {{", s.loads));
                if s.vector {
                    let r = s.reg;
                    c.line(format!(
                        "{r}[i].x = kiln_tf32({r}[i].x); {r}[i].y = kiln_tf32({r}[i].y); \
                         {r}[i].z = kiln_tf32({r}[i].z); {r}[i].w = kiln_tf32({r}[i].w);"
                    ));
                } else {
                    c.line(format!("{0}[i] = kiln_tf32({0}[i]);", s.reg));
                }
                c.line("}");
            }
        };
        load_next(c);
        round(c);
        c.line(format!("for (int it = 0; it < {iters}; ++it) {{"));
        sides[0].store(c, "As");
        sides[1].store(c, "Bs");
        c.line("__syncthreads();");
        next_tile_while_multiplying(c, iters, BK, &load_next);
        c.line("#pragma unroll");
        c.line(format!("for (int kk = 0; kk < {BK}; kk += 8) {{"));
        c.line(format!("unsigned af[{mi}][4], bf[{ni}][2];"));
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
        c.line(format!("const float* const p = As + (kk + q) * {lda} + wm * {wtm} + i * 16 + g;"));
        c.line(format!(
            "af[i][0] = __float_as_uint(p[0]); af[i][1] = __float_as_uint(p[8]); \
             af[i][2] = __float_as_uint(p[{}]); af[i][3] = __float_as_uint(p[{}]);",
            4 * lda,
            4 * lda + 8
        ));
        c.line("}");
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {ni}; ++j) {{"));
        c.line(format!("const float* const p = Bs + (kk + q) * {ldb} + wn * {wtn} + j * 8 + g;"));
        c.line(format!("bf[j][0] = __float_as_uint(p[0]); bf[j][1] = __float_as_uint(p[{}]);", 4 * ldb));
        c.line("}");
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {ni}; ++j) kiln_mma_tf32(acc[i][j], af[i], bf[j]);"));
        c.line("}");
        c.line("}");
        c.line("__syncthreads();");
        if iters > 1 {
            c.line(format!("if (it + 1 < {iters}) {{"));
            round(c);
            c.line("}");
        }
        c.line("}");
        self.mma_stores(c, (wtm, wtn), (mi, ni), split);
        let launch = self.mma_launch((bm, bn), split);
        let vectors = match (sides[0].vector, sides[1].vector) {
            (true, true) => ", float4 loads of A and B",
            (true, false) => ", float4 loads of A",
            (false, true) => ", float4 loads of B",
            (false, false) => "",
        };
        let across = split_text(split);
        (launch, format!("TF32 tensor cores, tile {bm}x{bn}x{BK}{vectors}{across}"))
    }

    /// The tensor-core kernels' last lines (this and `half_mma`): each thread's m16n8
    /// accumulators `acc[i][j][r]` (row g, +8 for r >= 2; column 2q, +1 for odd r, of tile
    /// (i, j) of its warp's `wtm` x `wtn` tile) through the sink, then the kernel's closing brace.
    pub(super) fn mma_stores(
        &self,
        c: &mut Code,
        (wtm, wtn): (usize, usize),
        (mi, ni): (usize, usize),
        split: Option<KSplit>,
    ) {
        let ty = self.ty;
        c.line("#pragma unroll");
        c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
        c.line("#pragma unroll");
        c.line(format!("for (int j = 0; j < {ni}; ++j) {{"));
        c.line("#pragma unroll");
        c.line("for (int r = 0; r < 4; ++r) {");
        c.line(format!("const {ty} gm = m0 + wm * {wtm} + i * 16 + g + (r / 2) * 8;"));
        c.line(format!("const {ty} gn = n0 + wn * {wtn} + j * 8 + 2 * q + r % 2;"));
        c.line(format!(
            "if (gm < {} && gn < {}) {}",
            int(self.m),
            int(self.n),
            self.store("acc[i][j][r]", split)
        ));
        c.line("}");
        c.line("}");
        c.line("}");
        c.line("}");
    }

    /// The launch of a tensor-core kernel of `bm` x `bn` block tiles.
    pub(super) fn mma_launch(&self, (bm, bn): (usize, usize), split: Option<KSplit>) -> Launch {
        let groups = split.map_or(1, |sp| sp.splits);
        self.launch(groups * self.batch * self.m.div_ceil(bm) * self.n.div_ceil(bn), GROUP, split)
    }
}

/// After the shared tiles are stored: the next K tile (`k0` moved on by `bk`) loaded into
/// registers by `load_next` while this one is multiplied, where the loop has one more.
pub(super) fn next_tile_while_multiplying(
    c: &mut Code,
    iters: usize,
    bk: usize,
    load_next: &dyn Fn(&mut Code),
) {
    if iters > 1 {
        c.line("// the next K tile into registers while this one is multiplied");
        c.line(format!("if (it + 1 < {iters}) {{"));
        c.line(format!("k0 += {bk};"));
        load_next(c);
        c.line("}");
    }
}

/// `float acc[mi][ni][4]`, zeroed: a thread's m16n8 accumulators in the tensor-core kernels.
pub(super) fn mma_accumulators(c: &mut Code, mi: usize, ni: usize) {
    c.line(format!("float acc[{mi}][{ni}][4];"));
    c.line("#pragma unroll");
    c.line(format!("for (int i = 0; i < {mi}; ++i) {{"));
    c.line("#pragma unroll");
    c.line(format!("for (int j = 0; j < {ni}; ++j) {{"));
    c.line("acc[i][j][0] = 0.0f; acc[i][j][1] = 0.0f; acc[i][j][2] = 0.0f; acc[i][j][3] = 0.0f;");
    c.line("}");
    c.line("}");
}
