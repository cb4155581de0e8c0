//! Fused scaled dot-product attention (`Op::Attention`) and its gradient (`Op::AttentionGrad`),
//! FlashAttention-2 style: the scores `[.., S, T]` are never stored in global memory, and no
//! scratch is used (`scratch_bytes` is 0 for both ops).
//!
//! Notation: q `[BH, S, D]`, k and v `[BH, T, D]` (BH the product of the leading axes), an
//! optional bias broadcast to `[.., S, T]` through per-axis strides (0 on its axes of extent 1,
//! its leading-axis offset decoded from the batch-head index), OFF = T - S. The score of query i
//! and key j is `__fmul_rn(q_i·k_j, scale) + bias[i, j]`, the dot product summed over d in
//! ascending order, and, when causal and j > i + OFF, -1e9 is added to it (a row with no
//! visible key attends almost uniformly, as the DSL's mask does).
//!
//! Tiled kernels (256 threads a block; BR query rows and BC keys a tile, powers of two chosen
//! per shape so that the static shared memory stays within 48 KiB, `tiles`):
//! - forward (`kiln_attention_fwd`): a block per (batch-head, tile of BR query rows), in a
//!   block-stride loop. TPR = 256 / BR threads share a row (a group of lanes of one warp): lane
//!   l of row r computes the scores of keys l, l + TPR, ... of each key tile and owns the output
//!   columns d = l, l + TPR, ... (ceil(D / TPR) registers of accumulator). Shared memory: the
//!   query tile `[BR][D+1]`, one key-or-value tile `[BC][D+1]` (keys for the scores, then the
//!   values, in the same buffer) and the tile of scores / probabilities `[BR][BC+1]`; the +1 pads
//!   keep the lanes of a warp on distinct banks. Per key tile: scores into shared memory, the
//!   row's maximum and sum of exponentials by an xor-butterfly over its TPR lanes (every lane
//!   holds the same bits), the running maximum m and sum l rescaled by e^(m_old - m_new), the
//!   accumulator rescaled and given Σ_c p·v in ascending c. Four barriers per key tile. Cost:
//!   4·S·T·D flops and T·D·(S / BR) loads of k and v per batch-head.
//! - gradient, three launches, deterministic (each output element written by one thread, sums
//!   in a fixed order, no atomics) and without scratch:
//!   1. `kiln_attention_lse`: the forward's kernel without the values: each row's
//!      log-sum-exp m + log(l), stored in element 0 of the row's dq (`out[.., i, 0]`), which
//!      nothing else reads or writes until launch 3 overwrites it. 2·S·T·D flops.
//!   2. `kiln_attention_dkdv`: a block per (batch-head, tile of BC keys), looping over the query
//!      tiles of BR rows; TPK = 256 / BC lanes per key own dk and dv columns d = l, l + TPK, ...
//!      in registers. Shared memory: k and v tiles (kept for the block), q and do tiles, and
//!      P and dS `[BC][BR+1]`, plus lse and Dᵢ of the query tile. For each (key, query) pair:
//!      s and dP = doᵢ·vⱼ in one pass over d, P = e^(s - lseᵢ), dS = P·(dP - Dᵢ); then
//!      dv += Σᵢ P·doᵢ, dk += Σᵢ dS·qᵢ (ascending i), dk scaled at the end. Dᵢ = Σ_d doᵢ·oᵢ is
//!      recomputed per query tile by one thread per row (ascending d): D flops a row, 1/BC of
//!      the tile's work. 8·S·T·D flops.
//!   3. `kiln_attention_dq`: a block per (batch-head, tile of BR rows), looping over key tiles:
//!      reads its rows' lse (before overwriting them), recomputes s, P, dP, dS as launch 2
//!      and accumulates dq += Σⱼ dS·kⱼ, scaled at the end. 6·S·T·D flops.
//!
//!   In all 16·S·T·D flops (against 10·S·T·D for a backward that adds dq with atomics): the
//!   scores are computed three times, the price of determinism without a `[S, T]` buffer.
//!
//! Causal masking skips the key tiles that lie wholly above the diagonal of every row of a query
//! tile: a masked key's probability is e^(-1e9 + ...) = 0 exactly in f32 for a row with a
//! visible key (visible keys precede masked ones), so skipping it changes no bit. Tiles with a
//! row that sees no key (S > T: rows i < S - T) go over every key, as the DSL's softmax does.
//!
//! A row that sees no key (i + OFF < 0) has every score rounded next to -1e9, where its
//! log-sum-exp would lose log(l) entirely (the ulp of 1e9 is 64) and the gradient's
//! probabilities e^(s - lse) would come out T times too large. Its scores are therefore taken as
//! (s + -1e9) - (-1e9): the f32 rounding that the DSL's mask applies, then the exact shift back
//! (both terms within a factor of two: no rounding). Softmax does not see a common shift, so the
//! forward is unchanged bit for bit, and lse keeps its low bits.
//!
//! Fallback for D too large for the smallest tiles (8 x 8: D above about 760 for the forward,
//! 380 for the gradient): a warp per row (per key row for dk and dv), the scores as
//! xor-butterfly sums over the lanes' columns, the online softmax one key at a time, and the
//! accumulators kept in the output row itself (read-modify-write by the lane that owns the
//! column). Slow, but any D runs.
//!
//! Products that feed additions are `__fmul_rn` (NVRTC does not fuse them into FMAs), as in the
//! other kernels; the exponentials are `expf` and the logarithm `logf`. Index arithmetic is
//! `int` or `long long` by the tensors' sizes (`idx_type`). A bias of -inf over a whole row gives
//! NaN, as an unmasked softmax of -inf scores does.
//!
//! Checked without a GPU (`tests/cuda_attention.rs`): run on the host against an f64 reference
//! that materialises the softmax (D = 1 to 800, S = T and S < T and S > T, causal or not, five
//! bias shapes, grids of 1 and 3 blocks), and compiled by NVRTC 13.0 to PTX for sm_90 (64-bit
//! indices included). Register use and spills (ptxas) not yet looked at; not yet timed on a
//! device.

use super::codegen::{Code, Elems, MAX_BLOCKS, broadcast_strides, flt, header, idx_type, int};
use super::{Arg, CudaKernel, Launch, half};
use kiln_compiler::ir::Shape;

/// Threads per block of every attention kernel.
const THREADS: usize = 256;
/// Static shared memory each block may use, in floats (48 KiB).
const SHARED_FLOATS: usize = 12 * 1024;
/// The tile extents tried, largest first.
const EXTENTS: [usize; 4] = [64, 32, 16, 8];
const NEG_INF: &str = "__int_as_float(0xff800000)";

/// The geometry of one attention op.
struct Geo {
    bh: usize,
    s: usize,
    t: usize,
    d: usize,
    scale: f32,
    causal: bool,
    /// The bias's strides along (leading axes..., S, T), when there is a bias.
    bias: Option<Vec<isize>>,
    /// The leading axes' extents.
    lead: Vec<usize>,
    ty: &'static str,
    /// The C types of the operands (q, k, v, then o and do for the gradient, then the bias).
    elems: Vec<&'static str>,
    /// The C type of the `out` parameter: the output's, or f32 where the kernels write an f32
    /// copy of a half output into the scratch (`staged`).
    out: &'static str,
}

impl Geo {
    fn new(
        (q, k, bias): (&Shape, &Shape, Option<&Shape>),
        (scale, causal): (f32, bool),
        out: &Shape,
        (elems, operands, staged): (&Elems, usize, bool),
    ) -> Geo {
        let r = q.rank();
        let lead = q.dims()[..r - 2].to_vec();
        let (s, t, d) = (q.back(2), k.back(2), q.back(1));
        let mut full = lead.clone();
        full.extend([s, t]);
        let bias_strides = bias.map(|b| broadcast_strides(b.dims(), &full));
        let biggest =
            [q.numel(), k.numel(), out.numel(), bias.map_or(0, |b| b.numel())].into_iter().max().unwrap_or(0);
        Geo {
            bh: lead.iter().product(),
            s,
            t,
            d,
            scale,
            causal,
            bias: bias_strides,
            lead,
            ty: idx_type(biggest),
            elems: (0..operands).map(|i| elems.input(i)).collect(),
            out: if staged { "float" } else { elems.output() },
        }
    }

    /// The C type operand `name` ("q", "k", "v", "o", "dout", "bias") points to.
    fn elem(&self, name: &str) -> &'static str {
        let at = match name {
            "q" => 0,
            "k" => 1,
            "v" => 2,
            "o" => 3,
            "dout" => 4,
            _ => self.elems.len() - 1,
        };
        self.elems[at]
    }

    /// `T - S` as a signed literal.
    fn off(&self) -> String {
        let off = self.t as i64 - self.s as i64;
        if off < 0 { format!("({off})") } else { off.to_string() }
    }

    /// `const ty boff = ...;`: the bias's offset for batch-head `bh` (nothing without a bias).
    fn bias_offset(&self, c: &mut Code) {
        let Some(strides) = &self.bias else { return };
        let ty = self.ty;
        let mut terms = Vec::new();
        let mut inner = 1usize;
        for a in (0..self.lead.len()).rev() {
            let ext = self.lead[a];
            if ext > 1 && strides[a] != 0 {
                let q = if inner == 1 { "bh".to_string() } else { format!("bh / {}", int(inner)) };
                let coord = if a == 0 { q } else { format!("({q}) % {}", int(ext)) };
                terms.push(format!("({coord}) * {}", int(strides[a] as usize)));
            }
            inner *= ext;
        }
        let e = if terms.is_empty() { "0".to_string() } else { terms.join(" + ") };
        c.line(format!("const {ty} boff = {e};"));
    }

    /// Lines that turn the dot product `dot` of query `i` and key `j` into the score `sc`.
    fn score(&self, c: &mut Code, dot: &str, i: &str, j: &str) {
        c.line(format!("float sc = __fmul_rn({dot}, {});", flt(self.scale)));
        if let Some(st) = &self.bias {
            let r = st.len();
            let (bs, bt) = (st[r - 2] as usize, st[r - 1] as usize);
            let mut idx = "boff".to_string();
            if bs != 0 {
                idx += &format!(" + {i} * {}", int(bs));
            }
            if bt != 0 {
                idx += &format!(" + {j} * {}", int(bt));
            }
            c.line(format!("sc += bias[{idx}];"));
        }
        if self.causal {
            let off = self.off();
            c.line(format!("if ({j} > {i} + {off}) {{"));
            c.line("sc += -1000000000.0f;");
            if self.s > self.t {
                c.line("// A row that sees no key: the rounded score less the exact -1e9 (see above).");
                c.line(format!("if ({i} + {off} < 0) sc -= -1000000000.0f;"));
            }
            c.line("}");
        }
    }

    /// `const ty kend = ...;`: the keys a tile of query rows from `i0` (BR of them) must visit.
    fn key_end(&self, c: &mut Code, i0: &str, br: usize) {
        let ty = self.ty;
        if !self.causal {
            c.line(format!("const {ty} kend = {};", int(self.t)));
            return;
        }
        let (s, t, off) = (int(self.s), int(self.t), self.off());
        c.line(format!("const {ty} ilast = {i0} + {br} < {s} ? {i0} + {br} : {s};"));
        c.line(format!(
            "const {ty} kend = {i0} + {off} < 0 ? {t} : (ilast + {off} < {t} ? ilast + {off} : {t});"
        ));
    }

    fn rows_out(&self) -> usize {
        self.s + 2 * self.t
    }
}

/// Pointer parameters: q, k, v, (o, do,) (bias,) out.
fn params(g: &Geo, grad: bool) -> (String, Vec<Arg>) {
    let mut names = vec!["q", "k", "v"];
    if grad {
        names.extend(["o", "dout"]);
    }
    if g.bias.is_some() {
        names.push("bias");
    }
    let mut p: Vec<String> = names.iter().map(|n| format!("const {}* __restrict__ {n}", g.elem(n))).collect();
    p.push(format!("{}* __restrict__ out", g.out));
    let args = (0..names.len()).map(Arg::Input).chain([Arg::Output]).collect();
    (p.join(", "), args)
}

/// Floats of static shared memory of the forward (and log-sum-exp) kernel.
fn forward_floats(d: usize, br: usize, bc: usize) -> usize {
    (br + bc) * (d + 1) + br * (bc + 1)
}

/// Floats of the dk/dv kernel (BC keys a block, BR query rows a tile).
fn dkdv_floats(d: usize, br: usize, bc: usize) -> usize {
    2 * (br + bc) * (d + 1) + 2 * bc * (br + 1) + 2 * br
}

/// Floats of the dq kernel (BR query rows a block, BC keys a tile).
fn dq_floats(d: usize, br: usize, bc: usize) -> usize {
    2 * (br + bc) * (d + 1) + br * (bc + 1) + 2 * br
}

/// The (first, second) tile extents for a kernel whose first extent has `first` items and
/// whose second has `second`: the largest product within the shared memory, ties to the
/// larger first extent; None when not even 8 x 8 fits.
fn tiles(first: usize, second: usize, floats: impl Fn(usize, usize) -> usize) -> Option<(usize, usize)> {
    let cap = |n: usize| n.next_power_of_two().max(8);
    let mut best: Option<(usize, usize)> = None;
    for &a in EXTENTS.iter().filter(|&&a| a <= cap(first)) {
        for &b in EXTENTS.iter().filter(|&&b| b <= cap(second)) {
            if floats(a, b) > SHARED_FLOATS {
                continue;
            }
            if best.is_none_or(|(x, y)| a * b > x * y) {
                best = Some((a, b));
            }
        }
    }
    best
}

fn launch(function: &str, blocks: usize, threads: usize, args: Vec<Arg>) -> Launch {
    Launch {
        function: function.into(),
        grid: [blocks.clamp(1, MAX_BLOCKS) as u32, 1, 1],
        block: [threads as u32, 1, 1],
        shared_bytes: 0,
        args,
    }
}

/// Emits `for (mm ...) ... d = lane + step * mm` column loop openers; returns the closers.
fn columns(c: &mut Code, g: &Geo, step: usize) -> usize {
    let per = g.d.div_ceil(step);
    c.line(format!("for (int mm = 0; mm < {per}; ++mm) {{"));
    c.line(format!("const int d = lane + {step} * mm;"));
    if !g.d.is_multiple_of(step) {
        c.line(format!("if (d < {}) {{", g.d));
        2
    } else {
        1
    }
}

fn close(c: &mut Code, n: usize) {
    for _ in 0..n {
        c.line("}");
    }
}

/// Loads rows `first..first + rows` of the `[BH, len, D]` tensor `src` (batch-head `bh`) into
/// the padded shared tile `dst` (`[rows][D+1]`), zeros past `len`.
fn load_tile(c: &mut Code, g: &Geo, dst: &str, src: &str, len: usize, first: &str, rows: usize) {
    let ty = g.ty;
    let d = g.d;
    c.line(format!("for (int e = (int)threadIdx.x; e < {}; e += {THREADS}) {{", rows * d));
    c.line(format!("const int rr = e / {d};"));
    c.line(format!("const int cc = e % {d};"));
    c.line(format!("const {ty} row = {first} + rr;"));
    c.line(format!(
        "{dst}[rr * {} + cc] = row < {} ? {src}[(bh * {} + row) * {d} + cc] : 0.0f;",
        d + 1,
        int(len),
        int(len)
    ));
    c.line("}");
}

/// Each row's `lse` and `Di = Σ do·o` into shared `lse_s`, `dd_s` for the query tile at `i0`:
/// one thread a row, ascending d.
fn row_terms(c: &mut Code, g: &Geo, i0: &str, br: usize) {
    let (ty, d, s) = (g.ty, g.d, int(g.s));
    c.line(format!("if ((int)threadIdx.x < {br}) {{"));
    c.line(format!("const {ty} ri = {i0} + (int)threadIdx.x;"));
    c.line("float lv = 0.0f;");
    c.line("float dv_ = 0.0f;");
    c.line(format!("if (ri < {s}) {{"));
    c.line(format!("lv = out[(bh * {} + ri) * {d}];", int(g.rows_out())));
    c.line(format!("const {}* op = o + (bh * {s} + ri) * {d};", g.elem("o")));
    c.line(format!("const {}* gp = dout + (bh * {s} + ri) * {d};", g.elem("dout")));
    c.line(format!("for (int x = 0; x < {d}; ++x) dv_ += __fmul_rn(gp[x], op[x]);"));
    c.line("}");
    c.line("lse_s[threadIdx.x] = lv;");
    c.line("dd_s[threadIdx.x] = dv_;");
    c.line("}");
}

/// The xor-butterfly of `v` over groups of `width` lanes with `op` (`fmaxf` or `+`).
fn butterfly(c: &mut Code, v: &str, width: usize, max: bool) {
    let mut o = width / 2;
    while o > 0 {
        let other = format!("__shfl_xor_sync(0xffffffffu, {v}, {o})");
        c.line(if max { format!("{v} = fmaxf({v}, {other});") } else { format!("{v} += {other};") });
        o /= 2;
    }
}

/// The tiled forward (`stats` false) or log-sum-exp kernel (`stats` true).
fn forward_tiled(c: &mut Code, g: &Geo, fname: &str, br: usize, bc: usize, stats: bool) -> usize {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    let tpr = THREADS / br;
    let (dp, bcp) = (d + 1, bc + 1);
    let qt = g.s.div_ceil(br);
    let ntiles = g.bh * qt;
    let (p, _) = params(g, stats);
    c.line(format!("extern \"C\" __global__ void __launch_bounds__({THREADS}) {fname}({p}) {{"));
    c.line(format!("__shared__ float qs[{}];", br * dp));
    c.line(format!("__shared__ float kv[{}];", bc * dp));
    c.line(format!("__shared__ float ps[{}];", br * bcp));
    c.line(format!("const int r = (int)threadIdx.x / {tpr};"));
    c.line(format!("const int lane = (int)threadIdx.x % {tpr};"));
    c.line(format!("for ({ty} tile = ({ty})blockIdx.x; tile < {}; tile += ({ty})gridDim.x) {{", int(ntiles)));
    c.line(format!("const {ty} bh = tile / {qt};"));
    c.line(format!("const {ty} i0 = (tile % {qt}) * {br};"));
    c.line(format!("const {ty} i = i0 + r;"));
    g.bias_offset(c);
    c.line("__syncthreads();");
    load_tile(c, g, "qs", "q", g.s, "i0", br);
    c.line(format!("float m = {NEG_INF};"));
    c.line("float l = 0.0f;");
    let per = d.div_ceil(tpr);
    if !stats {
        c.line(format!("float acc[{per}];"));
        c.line(format!("for (int mm = 0; mm < {per}; ++mm) acc[mm] = 0.0f;"));
    }
    g.key_end(c, "i0", br);
    c.line(format!("for ({ty} c0 = 0; c0 < kend; c0 += {bc}) {{"));
    c.line("__syncthreads();");
    load_tile(c, g, "kv", "k", g.t, "c0", bc);
    c.line("__syncthreads();");
    let spt = bc.div_ceil(tpr);
    c.line(format!("for (int u = 0; u < {spt}; ++u) {{"));
    c.line(format!("const int cc = lane + {tpr} * u;"));
    if !bc.is_multiple_of(tpr) {
        c.line(format!("if (cc < {bc}) {{"));
    }
    c.line(format!("const {ty} j = c0 + cc;"));
    c.line("float val;");
    c.line(format!("if (i < {s} && j < {t}) {{"));
    c.line("float dot = 0.0f;");
    c.line(format!("for (int x = 0; x < {d}; ++x) dot += __fmul_rn(qs[r * {dp} + x], kv[cc * {dp} + x]);"));
    g.score(c, "dot", "i", "j");
    c.line("val = sc;");
    c.line(format!("}} else val = i < {s} ? {NEG_INF} : 0.0f;"));
    c.line(format!("ps[r * {bcp} + cc] = val;"));
    if !bc.is_multiple_of(tpr) {
        c.line("}");
    }
    c.line("}");
    c.line("__syncthreads();");
    if !stats {
        load_tile(c, g, "kv", "v", g.t, "c0", bc);
    }
    // The row's maximum and sum over the tile, the same bits in all its lanes.
    let guard = if !bc.is_multiple_of(tpr) { format!("if (cc < {bc}) ") } else { String::new() };
    c.line(format!("float mx = {NEG_INF};"));
    c.line(format!(
        "for (int u = 0; u < {spt}; ++u) {{ const int cc = lane + {tpr} * u; {guard}mx = fmaxf(mx, ps[r * {bcp} + cc]); }}"
    ));
    butterfly(c, "mx", tpr, true);
    c.line("const float mn = fmaxf(m, mx);");
    c.line("const float alpha = expf(m - mn);");
    c.line("float sum = 0.0f;");
    c.line(format!(
        "for (int u = 0; u < {spt}; ++u) {{ const int cc = lane + {tpr} * u; {guard}{{ const float pv = expf(ps[r * {bcp} + cc] - mn); ps[r * {bcp} + cc] = pv; sum += pv; }} }}"
    ));
    butterfly(c, "sum", tpr, false);
    c.line("l = __fmul_rn(l, alpha) + sum;");
    c.line("m = mn;");
    if !stats {
        c.line("__syncthreads();");
        let n = columns(c, g, tpr);
        c.line("float a = __fmul_rn(acc[mm], alpha);");
        c.line(format!(
            "for (int cc = 0; cc < {bc}; ++cc) a += __fmul_rn(ps[r * {bcp} + cc], kv[cc * {dp} + d]);"
        ));
        c.line("acc[mm] = a;");
        close(c, n);
    }
    c.line("}");
    c.line(format!("if (i < {s}) {{"));
    if stats {
        c.line(format!("if (lane == 0) out[(bh * {} + i) * {d}] = m + logf(l);", int(g.rows_out())));
    } else {
        let n = columns(c, g, tpr);
        c.line(format!("out[(bh * {s} + i) * {d} + d] = acc[mm] / l;"));
        close(c, n);
    }
    c.line("}");
    c.line("}");
    c.line("}");
    ntiles
}

/// The tiled dk/dv kernel: BC keys a block, query tiles of BR rows.
fn dkdv_tiled(c: &mut Code, g: &Geo, fname: &str, br: usize, bc: usize) -> usize {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    let tpk = THREADS / bc;
    let (dp, brp) = (d + 1, br + 1);
    let kt = g.t.div_ceil(bc);
    let ntiles = g.bh * kt;
    let rows = int(g.rows_out());
    let (p, _) = params(g, true);
    c.line(format!("extern \"C\" __global__ void __launch_bounds__({THREADS}) {fname}({p}) {{"));
    for (name, n) in [
        ("ks", bc * dp),
        ("vs", bc * dp),
        ("qs", br * dp),
        ("dos", br * dp),
        ("ps", bc * brp),
        ("dss", bc * brp),
        ("lse_s", br),
        ("dd_s", br),
    ] {
        c.line(format!("__shared__ float {name}[{n}];"));
    }
    c.line(format!("const int cr = (int)threadIdx.x / {tpk};"));
    c.line(format!("const int lane = (int)threadIdx.x % {tpk};"));
    c.line(format!("for ({ty} tile = ({ty})blockIdx.x; tile < {}; tile += ({ty})gridDim.x) {{", int(ntiles)));
    c.line(format!("const {ty} bh = tile / {kt};"));
    c.line(format!("const {ty} c0 = (tile % {kt}) * {bc};"));
    c.line(format!("const {ty} j = c0 + cr;"));
    g.bias_offset(c);
    c.line("__syncthreads();");
    load_tile(c, g, "ks", "k", g.t, "c0", bc);
    load_tile(c, g, "vs", "v", g.t, "c0", bc);
    let per = d.div_ceil(tpk);
    c.line(format!("float dk[{per}];"));
    c.line(format!("float dv[{per}];"));
    c.line(format!("for (int mm = 0; mm < {per}; ++mm) {{ dk[mm] = 0.0f; dv[mm] = 0.0f; }}"));
    c.line(format!("for ({ty} i0 = 0; i0 < {s}; i0 += {br}) {{"));
    if g.causal {
        let off = g.off();
        c.line(format!("const {ty} ilast = i0 + {br} < {s} ? i0 + {br} : {s};"));
        c.line("// Every row of the tile sees some key and none of these keys: nothing to add.");
        c.line(format!("if (i0 + {off} >= 0 && c0 >= ilast + {off}) continue;"));
    }
    c.line("__syncthreads();");
    load_tile(c, g, "qs", "q", g.s, "i0", br);
    load_tile(c, g, "dos", "dout", g.s, "i0", br);
    row_terms(c, g, "i0", br);
    c.line("__syncthreads();");
    let spt = br.div_ceil(tpk);
    c.line(format!("for (int u = 0; u < {spt}; ++u) {{"));
    c.line(format!("const int ii = lane + {tpk} * u;"));
    if !br.is_multiple_of(tpk) {
        c.line(format!("if (ii < {br}) {{"));
    }
    c.line(format!("const {ty} i = i0 + ii;"));
    c.line("float pv = 0.0f;");
    c.line("float ds = 0.0f;");
    c.line(format!("if (i < {s} && j < {t}) {{"));
    c.line("float dot = 0.0f;");
    c.line("float dpv = 0.0f;");
    c.line(format!("for (int x = 0; x < {d}; ++x) {{"));
    c.line(format!("dot += __fmul_rn(qs[ii * {dp} + x], ks[cr * {dp} + x]);"));
    c.line(format!("dpv += __fmul_rn(dos[ii * {dp} + x], vs[cr * {dp} + x]);"));
    c.line("}");
    g.score(c, "dot", "i", "j");
    c.line("pv = expf(sc - lse_s[ii]);");
    c.line("ds = __fmul_rn(pv, dpv - dd_s[ii]);");
    c.line("}");
    c.line(format!("ps[cr * {brp} + ii] = pv;"));
    c.line(format!("dss[cr * {brp} + ii] = ds;"));
    if !br.is_multiple_of(tpk) {
        c.line("}");
    }
    c.line("}");
    c.line("__syncthreads();");
    let n = columns(c, g, tpk);
    c.line("float a = dv[mm];");
    c.line("float b = dk[mm];");
    c.line(format!("for (int ii = 0; ii < {br}; ++ii) {{"));
    c.line(format!("a += __fmul_rn(ps[cr * {brp} + ii], dos[ii * {dp} + d]);"));
    c.line(format!("b += __fmul_rn(dss[cr * {brp} + ii], qs[ii * {dp} + d]);"));
    c.line("}");
    c.line("dv[mm] = a;");
    c.line("dk[mm] = b;");
    close(c, n);
    c.line("}");
    c.line(format!("if (j < {t}) {{"));
    let n = columns(c, g, tpk);
    c.line(format!("out[(bh * {rows} + {s} + j) * {d} + d] = __fmul_rn(dk[mm], {});", flt(g.scale)));
    c.line(format!("out[(bh * {rows} + {} + j) * {d} + d] = dv[mm];", int(g.s + g.t)));
    close(c, n);
    c.line("}");
    c.line("}");
    c.line("}");
    ntiles
}

/// The tiled dq kernel: BR query rows a block, key tiles of BC.
fn dq_tiled(c: &mut Code, g: &Geo, fname: &str, br: usize, bc: usize) -> usize {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    let tpr = THREADS / br;
    let (dp, bcp) = (d + 1, bc + 1);
    let qt = g.s.div_ceil(br);
    let ntiles = g.bh * qt;
    let rows = int(g.rows_out());
    let (p, _) = params(g, true);
    c.line(format!("extern \"C\" __global__ void __launch_bounds__({THREADS}) {fname}({p}) {{"));
    for (name, n) in [
        ("qs", br * dp),
        ("dos", br * dp),
        ("ks", bc * dp),
        ("vs", bc * dp),
        ("dss", br * bcp),
        ("lse_s", br),
        ("dd_s", br),
    ] {
        c.line(format!("__shared__ float {name}[{n}];"));
    }
    c.line(format!("const int r = (int)threadIdx.x / {tpr};"));
    c.line(format!("const int lane = (int)threadIdx.x % {tpr};"));
    c.line(format!("for ({ty} tile = ({ty})blockIdx.x; tile < {}; tile += ({ty})gridDim.x) {{", int(ntiles)));
    c.line(format!("const {ty} bh = tile / {qt};"));
    c.line(format!("const {ty} i0 = (tile % {qt}) * {br};"));
    c.line(format!("const {ty} i = i0 + r;"));
    g.bias_offset(c);
    c.line("__syncthreads();");
    load_tile(c, g, "qs", "q", g.s, "i0", br);
    load_tile(c, g, "dos", "dout", g.s, "i0", br);
    c.line("// The rows' lse, read before this block overwrites them with dq.");
    row_terms(c, g, "i0", br);
    let per = d.div_ceil(tpr);
    c.line(format!("float dq[{per}];"));
    c.line(format!("for (int mm = 0; mm < {per}; ++mm) dq[mm] = 0.0f;"));
    g.key_end(c, "i0", br);
    c.line(format!("for ({ty} c0 = 0; c0 < kend; c0 += {bc}) {{"));
    c.line("__syncthreads();");
    load_tile(c, g, "ks", "k", g.t, "c0", bc);
    load_tile(c, g, "vs", "v", g.t, "c0", bc);
    c.line("__syncthreads();");
    let spt = bc.div_ceil(tpr);
    c.line(format!("for (int u = 0; u < {spt}; ++u) {{"));
    c.line(format!("const int cc = lane + {tpr} * u;"));
    if !bc.is_multiple_of(tpr) {
        c.line(format!("if (cc < {bc}) {{"));
    }
    c.line(format!("const {ty} j = c0 + cc;"));
    c.line("float ds = 0.0f;");
    c.line(format!("if (i < {s} && j < {t}) {{"));
    c.line("float dot = 0.0f;");
    c.line("float dpv = 0.0f;");
    c.line(format!("for (int x = 0; x < {d}; ++x) {{"));
    c.line(format!("dot += __fmul_rn(qs[r * {dp} + x], ks[cc * {dp} + x]);"));
    c.line(format!("dpv += __fmul_rn(dos[r * {dp} + x], vs[cc * {dp} + x]);"));
    c.line("}");
    g.score(c, "dot", "i", "j");
    c.line("const float pv = expf(sc - lse_s[r]);");
    c.line("ds = __fmul_rn(pv, dpv - dd_s[r]);");
    c.line("}");
    c.line(format!("dss[r * {bcp} + cc] = ds;"));
    if !bc.is_multiple_of(tpr) {
        c.line("}");
    }
    c.line("}");
    c.line("__syncthreads();");
    let n = columns(c, g, tpr);
    c.line("float a = dq[mm];");
    c.line(format!(
        "for (int cc = 0; cc < {bc}; ++cc) a += __fmul_rn(dss[r * {bcp} + cc], ks[cc * {dp} + d]);"
    ));
    c.line("dq[mm] = a;");
    close(c, n);
    c.line("}");
    c.line(format!("if (i < {s}) {{"));
    let n = columns(c, g, tpr);
    c.line(format!("out[(bh * {rows} + i) * {d} + d] = __fmul_rn(dq[mm], {});", flt(g.scale)));
    close(c, n);
    c.line("}");
    c.line("}");
    c.line("}");
    ntiles
}

/// A warp-wide dot product of rows `a` and `b` (pointers) into `var`: each lane sums its
/// columns d = lane, lane + 32, ... ascending, then an xor-butterfly.
fn warp_dot(c: &mut Code, g: &Geo, var: &str, a: &str, b: &str) {
    c.line(format!("float {var} = 0.0f;"));
    c.line(format!("for (int d = lane; d < {}; d += 32) {var} += __fmul_rn({a}[d], {b}[d]);", g.d));
    butterfly(c, var, 32, false);
}

/// The opening of a warp-per-row kernel over `n` rows: `w` the row of this warp.
fn warp_rows(c: &mut Code, g: &Geo, fname: &str, grad: bool, n: usize) {
    let ty = g.ty;
    let (p, _) = params(g, grad);
    c.line(format!("extern \"C\" __global__ void __launch_bounds__({THREADS}) {fname}({p}) {{"));
    c.line("const int lane = (int)threadIdx.x % 32;");
    c.line(format!(
        "for ({ty} w = ({ty})blockIdx.x * {} + (int)threadIdx.x / 32; w < {}; w += ({ty})gridDim.x * {}) {{",
        THREADS / 32,
        int(n),
        THREADS / 32
    ));
}

/// The keys row `i` visits: all, or (causal) those up to i + OFF unless there are none.
fn row_key_end(c: &mut Code, g: &Geo) {
    let ty = g.ty;
    let t = int(g.t);
    if g.causal {
        let off = g.off();
        c.line(format!(
            "const {ty} kend = i + {off} < 0 ? {t} : (i + {off} + 1 < {t} ? i + {off} + 1 : {t});"
        ));
    } else {
        c.line(format!("const {ty} kend = {t};"));
    }
}

/// The per-row forward (`stats` false) or log-sum-exp kernel, for any D.
fn forward_rows(c: &mut Code, g: &Geo, fname: &str, stats: bool) {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    warp_rows(c, g, fname, stats, g.bh * g.s);
    c.line(format!("const {ty} bh = w / {s};"));
    c.line(format!("const {ty} i = w % {s};"));
    g.bias_offset(c);
    c.line(format!("const {}* qr = q + w * {d};", g.elem("q")));
    let orow = if stats { String::new() } else { format!("out + w * {d}") };
    if !stats {
        c.line(format!("{}* orow = {orow};", g.out));
        c.line(format!("for (int d = lane; d < {d}; d += 32) orow[d] = 0.0f;"));
    }
    c.line(format!("float m = {NEG_INF};"));
    c.line("float l = 0.0f;");
    row_key_end(c, g);
    c.line(format!("for ({ty} j = 0; j < kend; ++j) {{"));
    warp_dot(c, g, "dot", "qr", &format!("(k + (bh * {t} + j) * {d})"));
    g.score(c, "dot", "i", "j");
    c.line("const float mn = fmaxf(m, sc);");
    c.line("const float alpha = expf(m - mn);");
    c.line("const float pv = expf(sc - mn);");
    c.line("l = __fmul_rn(l, alpha) + pv;");
    c.line("m = mn;");
    if !stats {
        c.line(format!("const {}* vr = v + (bh * {t} + j) * {d};", g.elem("v")));
        c.line(format!(
            "for (int d = lane; d < {d}; d += 32) orow[d] = __fmul_rn(orow[d], alpha) + __fmul_rn(pv, vr[d]);"
        ));
    }
    c.line("}");
    if stats {
        c.line(format!("if (lane == 0) out[(bh * {} + i) * {d}] = m + logf(l);", int(g.rows_out())));
    } else {
        c.line(format!("for (int d = lane; d < {d}; d += 32) orow[d] = orow[d] / l;"));
    }
    c.line("}");
    c.line("}");
}

/// The per-key-row dk/dv kernel, for any D.
fn dkdv_rows(c: &mut Code, g: &Geo, fname: &str) {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    let rows = int(g.rows_out());
    warp_rows(c, g, fname, true, g.bh * g.t);
    c.line(format!("const {ty} bh = w / {t};"));
    c.line(format!("const {ty} j = w % {t};"));
    g.bias_offset(c);
    c.line(format!("const {}* kr = k + w * {d};", g.elem("k")));
    c.line(format!("const {}* vr = v + w * {d};", g.elem("v")));
    c.line(format!("{}* dkr = out + (bh * {rows} + {s} + j) * {d};", g.out));
    c.line(format!("{}* dvr = out + (bh * {rows} + {} + j) * {d};", g.out, int(g.s + g.t)));
    c.line(format!("for (int d = lane; d < {d}; d += 32) {{ dkr[d] = 0.0f; dvr[d] = 0.0f; }}"));
    c.line(format!("for ({ty} i = 0; i < {s}; ++i) {{"));
    if g.causal {
        let off = g.off();
        c.line(format!("if (i + {off} >= 0 && j > i + {off}) continue;"));
    }
    c.line(format!("const {}* qr = q + (bh * {s} + i) * {d};", g.elem("q")));
    c.line(format!("const {}* gr = dout + (bh * {s} + i) * {d};", g.elem("dout")));
    c.line(format!("const {}* orr = o + (bh * {s} + i) * {d};", g.elem("o")));
    c.line(format!("const float lse = out[(bh * {rows} + i) * {d}];"));
    warp_dot(c, g, "dot", "qr", "kr");
    warp_dot(c, g, "dpv", "gr", "vr");
    warp_dot(c, g, "di", "gr", "orr");
    g.score(c, "dot", "i", "j");
    c.line("const float pv = expf(sc - lse);");
    c.line("const float ds = __fmul_rn(pv, dpv - di);");
    c.line(format!(
        "for (int d = lane; d < {d}; d += 32) {{ dvr[d] += __fmul_rn(pv, gr[d]); dkr[d] += __fmul_rn(ds, qr[d]); }}"
    ));
    c.line("}");
    c.line(format!("for (int d = lane; d < {d}; d += 32) dkr[d] = __fmul_rn(dkr[d], {});", flt(g.scale)));
    c.line("}");
    c.line("}");
}

/// The per-row dq kernel, for any D.
fn dq_rows(c: &mut Code, g: &Geo, fname: &str) {
    let (ty, d, s, t) = (g.ty, g.d, int(g.s), int(g.t));
    let rows = int(g.rows_out());
    warp_rows(c, g, fname, true, g.bh * g.s);
    c.line(format!("const {ty} bh = w / {s};"));
    c.line(format!("const {ty} i = w % {s};"));
    g.bias_offset(c);
    c.line(format!("const {}* qr = q + w * {d};", g.elem("q")));
    c.line(format!("const {}* gr = dout + w * {d};", g.elem("dout")));
    c.line(format!("const {}* orr = o + w * {d};", g.elem("o")));
    c.line(format!("{}* dqr = out + (bh * {rows} + i) * {d};", g.out));
    c.line("// Lane 0 reads the lse (dq's element 0) before it zeroes that element.");
    c.line("float lse = 0.0f;");
    c.line("if (lane == 0) lse = dqr[0];");
    c.line("lse = __shfl_sync(0xffffffffu, lse, 0);");
    c.line(format!("for (int d = lane; d < {d}; d += 32) dqr[d] = 0.0f;"));
    warp_dot(c, g, "di", "gr", "orr");
    row_key_end(c, g);
    c.line(format!("for ({ty} j = 0; j < kend; ++j) {{"));
    c.line(format!("const {}* kr = k + (bh * {t} + j) * {d};", g.elem("k")));
    c.line(format!("const {}* vr = v + (bh * {t} + j) * {d};", g.elem("v")));
    warp_dot(c, g, "dot", "qr", "kr");
    warp_dot(c, g, "dpv", "gr", "vr");
    g.score(c, "dot", "i", "j");
    c.line("const float pv = expf(sc - lse);");
    c.line("const float ds = __fmul_rn(pv, dpv - di);");
    c.line(format!("for (int d = lane; d < {d}; d += 32) dqr[d] += __fmul_rn(ds, kr[d]);"));
    c.line("}");
    c.line(format!("for (int d = lane; d < {d}; d += 32) dqr[d] = __fmul_rn(dqr[d], {});", flt(g.scale)));
    c.line("}");
    c.line("}");
}

fn warp_blocks(rows: usize) -> usize {
    rows.div_ceil(THREADS / 32)
}

/// Whether the kernels of an attention op (the gradient with `grad`) on operands `s` write an
/// f32 copy of a half output into the scratch, narrowed by a last launch: the gradient's (its
/// first launch keeps each row's log-sum-exp in the output, which the third reads back) and
/// the forward's fallback (its accumulators live in the output row); the tiled forward writes
/// each output element once, in its own type.
fn staged(s: &[&Shape], grad: bool, out_half: bool) -> bool {
    let (d, rows, keys) = (s[0].back(1), s[0].back(2), s[1].back(2));
    out_half && (grad || tiles(rows, keys, |br, bc| forward_floats(d, br, bc)).is_none())
}

/// The scratch bytes an attention op's kernels use (`staged`: an f32 copy of the output).
pub(crate) fn scratch_wanted(s: &[&Shape], out: &Shape, grad: bool, out_half: bool) -> usize {
    if staged(s, grad, out_half) { out.numel() * 4 } else { 0 }
}

/// The geometry of an attention op (the gradient with `grad`), its kernels' launch arguments
/// and whether it is staged; an error when a staged op has less scratch than it needs.
fn geometry(
    s: &[&Shape],
    out: &Shape,
    (scale, causal, grad): (f32, bool, bool),
    (scratch, elems): (usize, &Elems),
) -> Result<(Geo, Vec<Arg>, bool), String> {
    let is_staged = staged(s, grad, !elems.output_f32());
    let need = scratch_wanted(s, out, grad, !elems.output_f32());
    if let Some(help) =
        half::short_of_scratch(&format!("writes its {} output", elems.output()), need, scratch)
    {
        return Err(help);
    }
    let bias = s.get(if grad { 5 } else { 3 }).copied();
    let g = Geo::new((s[0], s[1], bias), (scale, causal), out, (elems, s.len(), is_staged));
    // A staged kernel's `out` parameter is the scratch.
    let (_, args) = params(&g, grad);
    let args =
        args.into_iter().map(|a| if is_staged && a == Arg::Output { Arg::Scratch } else { a }).collect();
    Ok((g, args, is_staged))
}

/// The kernel of `Op::Attention`: operands q, k, v and an optional bias (`s`), output `out`.
pub(crate) fn attention(
    label: &str,
    s: &[&Shape],
    out: &Shape,
    (scale, causal): (f32, bool),
    (scratch, elems): (usize, &Elems),
) -> Result<CudaKernel, String> {
    let (g, args, is_staged) = geometry(s, out, (scale, causal, false), (scratch, elems))?;
    let mut c = Code::new();
    c.line(header(label, s, Some(out)));
    let fname = "kiln_attention_fwd";
    let shape = format!("attention {}x{}x{}x{}{}", g.bh, g.s, g.t, g.d, if causal { " causal" } else { "" });
    Ok(match tiles(g.s, g.t, |br, bc| forward_floats(g.d, br, bc)) {
        Some((br, bc)) => {
            let n = forward_tiled(&mut c, &g, fname, br, bc, false);
            CudaKernel {
                source: c.finish(),
                launches: vec![launch(fname, n, THREADS, args)],
                describe: format!("{shape} (flash: tiles of {br} queries x {bc} keys)"),
            }
        }
        None => {
            forward_rows(&mut c, &g, fname, false);
            let mut launches = vec![launch(fname, warp_blocks(g.bh * g.s), THREADS, args)];
            if is_staged {
                launches.push(half::narrow(&mut c, "kiln_attention_narrow", out.numel(), elems.output()));
            }
            CudaKernel {
                source: c.finish(),
                launches,
                describe: format!(
                    "{shape} (a warp per query row{})",
                    if is_staged { ", f32 in scratch" } else { "" }
                ),
            }
        }
    })
}

/// The kernel of `Op::AttentionGrad`: operands q, k, v, o, do and an optional bias (`s`),
/// output `out` `[.., S + 2T, D]`.
pub(crate) fn attention_grad(
    label: &str,
    s: &[&Shape],
    out: &Shape,
    (scale, causal): (f32, bool),
    (scratch, elems): (usize, &Elems),
) -> Result<CudaKernel, String> {
    let (g, args, is_staged) = geometry(s, out, (scale, causal, true), (scratch, elems))?;
    let mut c = Code::new();
    c.line(header(label, s, Some(out)));
    let shape =
        format!("attention_grad {}x{}x{}x{}{}", g.bh, g.s, g.t, g.d, if causal { " causal" } else { "" });
    let names = ["kiln_attention_lse", "kiln_attention_dkdv", "kiln_attention_dq"];
    let fwd = tiles(g.s, g.t, |br, bc| forward_floats(g.d, br, bc));
    let dkdv = tiles(g.t, g.s, |bc, br| dkdv_floats(g.d, br, bc));
    let dq = tiles(g.s, g.t, |br, bc| dq_floats(g.d, br, bc));
    let (blocks, mut how) = match (fwd, dkdv, dq) {
        (Some((fr, fc)), Some((kc, kr)), Some((qr, qc))) => {
            let a = forward_tiled(&mut c, &g, names[0], fr, fc, true);
            c.blank();
            let b = dkdv_tiled(&mut c, &g, names[1], kr, kc);
            c.blank();
            let d = dq_tiled(&mut c, &g, names[2], qr, qc);
            ([a, b, d], format!("flash: lse {fr}x{fc}, dk/dv {kc} keys x {kr} queries, dq {qr}x{qc}"))
        }
        _ => {
            forward_rows(&mut c, &g, names[0], true);
            c.blank();
            dkdv_rows(&mut c, &g, names[1]);
            c.blank();
            dq_rows(&mut c, &g, names[2]);
            let rows = warp_blocks(g.bh * g.s);
            ([rows, warp_blocks(g.bh * g.t), rows], "a warp per row".into())
        }
    };
    let mut launches: Vec<Launch> =
        names.iter().zip(blocks).map(|(f, n)| launch(f, n, THREADS, args.clone())).collect();
    if is_staged {
        launches.push(half::narrow(&mut c, "kiln_attention_narrow", out.numel(), elems.output()));
        how += ", f32 in scratch";
    }
    Ok(CudaKernel { source: c.finish(), launches, describe: format!("{shape} ({how}, no atomics)") })
}
