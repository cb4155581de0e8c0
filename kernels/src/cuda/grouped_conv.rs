//! Convolutions over non-dense windows (groups > 1 and/or dilation > 1, any stride, any padding,
//! `Padding::Explicit` included): forward, input gradient and filter gradient as direct kernels,
//! one output element per thread (or per block slice), no scratch memory and no atomics. Dense
//! windows stay on the implicit GEMMs of `conv`, which these do not replace: with one group
//! every output element is a long dot product that the GEMM's shared-memory tiles reuse, where
//! here each thread streams its own operands from L1/L2.
//!
//! Notation: input x `[N, H, W, C]`, filter w `[KH, KW, C/G, F]` (HWIO, CG = C/G input channels
//! and FG = F/G output channels per group), output y `[N, OH, OW, F]`; input channel c is in
//! group c / CG, output channel f in group f / FG; depthwise is G = C (CG = 1, FG the channel
//! multiplier). Tap (kh, kw) of output (oh, ow) reads input row oh·SH - PH + kh·DH and column
//! ow·SW - PW + kw·DW (PH, PW the padding before; the padding after is implied by OH, OW), zero
//! outside the input.
//!
//! - forward (`kiln_conv2d_grouped`): a thread per output element (n, oh, ow, f), f fastest, in a
//!   grid-stride loop; it sums over the taps inside the input (kh, kw ascending) and, for each,
//!   over the CG input channels of f's group (ascending). Consecutive threads take consecutive
//!   f: their filter loads w[kh, kw, ci, f] and their stores are consecutive addresses
//!   (coalesced); their input loads are one address per group (a broadcast), and for depthwise
//!   consecutive f read consecutive input channels (coalesced too). Cost: KH·KW·CG loads of x
//!   and of w per output, served by L1/L2 (no shared-memory reuse): memory-bound, fine for the
//!   depthwise and small-group convolutions this is for, well below the GEMM's throughput for a
//!   dilated dense convolution of many channels.
//! - input gradient (`kiln_conv2d_backprop_input_grouped`), in gather form: a thread per dx
//!   element (n, ih, iw, c), c fastest. For each tap, th = ih + PH - kh·DH must be a multiple
//!   of SH with th / SH inside the output (taps that miss cost a test, not a product, so a
//!   strided convolution does no wasted arithmetic), then it sums over the FG output channels
//!   of c's group: dy[n, oh, ow, f] · w[kh, kw, c % CG, f]. Each dx element is written once by
//!   one thread in a fixed order: deterministic, no atomics. Through ReLU's gradient (and a
//!   residual's sum) the thread applies `conv::input_gradient_epilogue` as it stores, reading
//!   y (and r) at its own element only, so dx may be y's or r's buffer. Cost: KH·KW·FG loads of
//!   dy and of w per dx element.
//! - filter gradient (`kiln_conv2d_backprop_filter_grouped`): a block of 256 threads per tile of
//!   TF consecutive output channels f of one (kh, kw, ci), in a block-stride loop over tiles.
//!   Thread t takes f = tile·TF + t % TF and the positions p = t / TF, t / TF + TY, ... of
//!   the N·OH·OW output positions (TY = 256 / TF), summing x[n, ih, iw, c] · dy[p, f] in
//!   ascending p; the TY partial sums of each f then meet in shared memory through a tree of
//!   fixed shape (halving strides, a barrier per level), and row 0 stores. The order of every
//!   addition is fixed by the shape alone: deterministic, no atomics, no scratch. TF is 32 (a
//!   warp reads 32 consecutive f of one position: coalesced) unless that leaves fewer than
//!   `FILL_BLOCKS` tiles, then halved until it does not (down to 1: a block per dw element):
//!   depthwise dw is tiny (KH·KW·C) and its reduction long (all N·OH·OW positions), so a
//!   few-channel tile with 256 threads over the positions keeps many SMs busy instead of one
//!   thread summing millions of products; narrower tiles read fewer consecutive bytes per
//!   position (8 floats still fill a 32-byte sector). Cost: N·OH·OW products per dw element,
//!   spread over 256 threads, plus log2(TY) barriers.
//!
//! The forward also takes a fused elementwise epilogue (`Fused::conv`), applied as it stores,
//! should a fused non-dense convolution reach it (the fusion pass fuses dense ones only).
//! Products that feed additions are `__fmul_rn` (NVRTC does not fuse them into FMAs), as in the
//! other kernels. Index arithmetic is `int` or `long long` by the tensors' sizes (`idx_type`);
//! bounds tests that a geometry cannot fail are left out of the source.
//!
//! Checked without a GPU (`tests/cuda_grouped_conv.rs`): run on the host against a scalar
//! reference, and compiled by NVRTC 13.0 for sm_90 (through ptxas: 20 to 54 registers, no
//! spills, no warnings). Not yet timed on a device.

use super::codegen::{BLOCK, Code, Elems, MAX_BLOCKS, grid_for, grid_loop, header, idx_type, int};
use super::conv::{InputGradient, input_gradient_epilogue};
use super::gemm::{Epilogue, Sink};
use super::{Arg, CudaKernel, Launch};
use crate::geometry::Geom;
use kiln_compiler::ir::{Fused, Shape, Window2d};

/// Tiles below which the filter gradient narrows its tiles of output channels: two blocks for
/// each of the 132 SMs of an H100 / H200.
const FILL_BLOCKS: usize = 2 * 132;

/// One spatial axis of a geometry, as the kernels index it.
struct Axis {
    /// The input's extent (H or W).
    extent: usize,
    /// The output's extent (OH or OW).
    out: usize,
    /// Window size, stride, dilation and padding before.
    k: usize,
    s: usize,
    d: usize,
    p: usize,
}

/// The two spatial axes of `g`, as the kernels index them (free functions rather than methods
/// of `Geom`, whose other impl blocks live in other modules).
fn axes(g: &Geom) -> [Axis; 2] {
    [
        Axis { extent: g.h, out: g.oh, k: g.kh, s: g.sh, d: g.dh, p: g.ph },
        Axis { extent: g.w, out: g.ow, k: g.kw, s: g.sw, d: g.dw, p: g.pw },
    ]
}

/// Input channels (the filter's third axis) and output channels per group.
fn per_group(g: &Geom) -> (usize, usize) {
    (g.c / g.groups, g.f / g.groups)
}

impl Axis {
    /// `const ty i = o * s - p + k * d;`: the input index that tap `k` of output `o` reads.
    fn input_index(&self, ty: &str, i: &str, o: &str, k: &str) -> String {
        let mut e = if self.s == 1 { o.to_string() } else { format!("{o} * {}", self.s) };
        if self.p > 0 {
            e += &format!(" - {}", self.p);
        }
        e += &if self.d == 1 { format!(" + {k}") } else { format!(" + {k} * {}", self.d) };
        format!("const {ty} {i} = {e};")
    }

    /// Whether some output and tap read before the input (the padding before).
    fn reads_before(&self) -> bool {
        self.p > 0
    }

    /// Whether some output and tap read past the input: the last output's last tap.
    fn reads_past(&self) -> bool {
        (self.out - 1) * self.s + (self.k - 1) * self.d >= self.extent + self.p
    }
}

/// `const ty name = expr;` lines for the coordinates of linear index `var` over `dims` (outer
/// first, `names` in the same order; an empty name is not emitted); extents of 1 give 0.
fn coords(c: &mut Code, ty: &str, var: &str, dims: &[usize], names: &[&str]) {
    let n = dims.len();
    for a in (0..n).rev().filter(|&a| !names[a].is_empty()) {
        let inner: usize = dims[a + 1..].iter().product();
        let e = if dims[a] == 1 {
            "0".to_string()
        } else {
            let q = if inner == 1 { var.to_string() } else { format!("{var} / {}", int(inner)) };
            if a == 0 {
                q
            } else if inner == 1 {
                format!("{q} % {}", int(dims[a]))
            } else {
                format!("({q}) % {}", int(dims[a]))
            }
        };
        c.line(format!("const {ty} {} = {e};", names[a]));
    }
}

/// The first channel on the other side of the group of channel `v` (groups of `per` channels
/// on its side, of `other` on the other): `v / per * other`, without the factors of 1.
fn first_of_group(groups: usize, v: &str, per: usize, other: usize) -> String {
    if groups == 1 {
        return "0".into();
    }
    let group = if per == 1 { v.to_string() } else { format!("{v} / {per}") };
    if other == 1 { group } else { format!("{group} * {other}") }
}

/// The parameters and launch arguments after the two factors: an epilogue's operands and the
/// output (none `__restrict__`: the output may be an epilogue operand's buffer), or the output.
/// Each points to its type in `elems` (the op's).
fn sink_params(epilogue: Option<&Epilogue>, elems: &Elems) -> (String, Vec<Arg>, String) {
    let out = elems.output();
    match epilogue {
        None => (format!("{out}* __restrict__ out"), vec![Arg::Output], String::new()),
        Some(e) => {
            let params: String =
                e.extra.iter().enumerate().map(|(j, &a)| format!("const {}* e{j}, ", elems.arg(a))).collect();
            let call: String = (0..e.extra.len()).map(|j| format!(", e{j}")).collect();
            (format!("{params}{out}* out"), e.extra.iter().copied().chain([Arg::Output]).collect(), call)
        }
    }
}

/// The two factors' parameters, of their types in `elems`.
fn factor_params(elems: &Elems) -> String {
    format!("const {}* __restrict__ in0, const {}* __restrict__ in1", elems.input(0), elems.input(1))
}

/// Stores `acc` as output element `e`, through the epilogue if there is one.
fn store(epilogue: Option<&Epilogue>, call: &str) -> String {
    match epilogue {
        None => "out[e] = acc;".into(),
        Some(_) => format!("out[e] = kiln_epilogue(acc, e{call});"),
    }
}

fn one_launch(source: String, function: &str, work: usize, args: Vec<Arg>, describe: String) -> CudaKernel {
    CudaKernel {
        source,
        launches: vec![Launch {
            function: function.into(),
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args,
        }],
        describe,
    }
}

/// The forward convolution of a non-dense window, optionally through a fused elementwise
/// epilogue (`Fused::conv`, the op's operands from 2 on beside each element).
pub(crate) fn conv2d(
    label: &str,
    x: &Shape,
    w: &Shape,
    window: &Window2d,
    out: &Shape,
    epilogue: Option<(&Fused, &[&Shape])>,
    elems: &Elems,
) -> CudaKernel {
    let g = Geom::new(x, window, w.dims()[3]);
    let mut all = vec![x, w];
    all.extend(epilogue.map_or(&[][..], |(_, extra)| extra));
    let ty = idx_type(all.iter().map(|s| s.numel()).max().unwrap_or(0).max(out.numel()));
    let sink = match Sink::of(epilogue, out, (ty, elems)) {
        Sink::Epilogue(e) => Some(e),
        _ => None,
    };
    let (params, sink_args, call) = sink_params(sink.as_ref(), elems);
    let (cg, fg) = per_group(&g);
    let [ah, aw] = axes(&g);
    let fname = "kiln_conv2d_grouped";
    let mut c = Code::new();
    c.line(header(label, &all, Some(out)));
    if let Some(e) = &sink {
        c.line(&e.definition);
    }
    c.line(format!("extern \"C\" __global__ void {fname}({}, {params}) {{", factor_params(elems)));
    c.line(grid_loop(ty, "e", out.numel()));
    coords(&mut c, ty, "e", &[g.n, g.oh, g.ow, g.f], &["n_", "oh_", "ow_", "f_"]);
    c.line(format!("// the input channels of f_'s group: {cg} from c0"));
    c.line(format!("const {ty} c0 = {};", first_of_group(g.groups, "f_", fg, cg)));
    c.line("float acc = 0.0f;");
    for (axis, (i, o, k)) in [(&ah, ("ih", "oh_", "kh")), (&aw, ("iw", "ow_", "kw"))] {
        c.line(format!("for ({ty} {k} = 0; {k} < {}; ++{k}) {{", axis.k));
        c.line(axis.input_index(ty, i, o, k));
        // The index grows with the tap: past the input, every later tap is too.
        if axis.reads_past() {
            c.line(format!("if ({i} >= {}) break;", int(axis.extent)));
        }
        if axis.reads_before() {
            c.line(format!("if ({i} < 0) continue;"));
        }
    }
    c.line(format!(
        "const {}* xp = in0 + ((n_ * {} + ih) * {} + iw) * {} + c0;",
        elems.input(0),
        int(g.h),
        int(g.w),
        int(g.c)
    ));
    c.line(format!("const {}* wp = in1 + (kh * {} + kw) * {} + f_;", elems.input(1), g.kw, int(cg * g.f)));
    c.line(format!("for (int ci = 0; ci < {cg}; ++ci) {{"));
    c.line(format!("acc += __fmul_rn(xp[ci], wp[({ty})ci * {}]);", int(g.f)));
    c.line("}");
    c.line("}");
    c.line("}");
    c.line(store(sink.as_ref(), &call));
    c.line("}");
    c.line("}");
    let describe = match epilogue {
        Some((program, _)) => format!("conv2d {} then fused({} ops)", g.text(), program.insts.len()),
        None => format!("conv2d {}", g.text()),
    };
    let args = [Arg::Input(0), Arg::Input(1)].into_iter().chain(sink_args).collect();
    one_launch(c.finish(), fname, out.numel(), args, format!("{describe} (direct: a thread per output)"))
}

/// The input gradient of a non-dense window's convolution, in gather form, through `then`.
pub(crate) fn backprop_input(
    label: &str,
    dy: &Shape,
    w: &Shape,
    window: &Window2d,
    dx: &Shape,
    then: InputGradient,
    elems: &Elems,
) -> CudaKernel {
    let g = Geom::new(dx, window, w.dims()[3]);
    let operands: Vec<&Shape> = match then {
        InputGradient::Plain => vec![dy, w],
        InputGradient::ReluGrad => vec![dy, w, dx],
        InputGradient::ResidualReluGrad => vec![dy, w, dx, dx],
    };
    let ty = idx_type(dy.numel().max(w.numel()).max(dx.numel()));
    let sink = input_gradient_epilogue(then, dx, (ty, elems));
    let (params, sink_args, call) = sink_params(sink.as_ref(), elems);
    let (cg, fg) = per_group(&g);
    let [ah, aw] = axes(&g);
    let fname = "kiln_conv2d_backprop_input_grouped";
    let mut c = Code::new();
    c.line(header(label, &operands, Some(dx)));
    if let Some(e) = &sink {
        c.line(&e.definition);
    }
    c.line(format!("extern \"C\" __global__ void {fname}({}, {params}) {{", factor_params(elems)));
    c.line(grid_loop(ty, "e", dx.numel()));
    // (One input channel: no group and no channel in it to find.)
    let c_ = if g.c == 1 { "" } else { "c_" };
    coords(&mut c, ty, "e", &[g.n, g.h, g.w, g.c], &["n_", "ih_", "iw_", c_]);
    c.line(format!("// c_ is channel ci of its group, whose output channels are {fg} from f0"));
    c.line(if cg == 1 { format!("const {ty} ci = 0;") } else { format!("const {ty} ci = c_ % {cg};") });
    c.line(format!("const {ty} f0 = {};", first_of_group(g.groups, "c_", cg, fg)));
    c.line("float acc = 0.0f;");
    for (axis, (t, i, o, k)) in [(&ah, ("th", "ih_", "oh", "kh")), (&aw, ("tw", "iw_", "ow", "kw"))] {
        c.line(format!("for ({ty} {k} = 0; {k} < {}; ++{k}) {{", axis.k));
        // t = o * s exactly for the output o whose tap k reads this element.
        let pad = if axis.p > 0 { format!(" + {}", axis.p) } else { String::new() };
        let tap = if axis.d == 1 { k.to_string() } else { format!("{k} * {}", axis.d) };
        c.line(format!("const {ty} {t} = {i}{pad} - {tap};"));
        // t shrinks as the tap grows: below 0, every later tap is too.
        if (axis.k - 1) * axis.d > axis.p {
            c.line(format!("if ({t} < 0) break;"));
        }
        if axis.s > 1 {
            c.line(format!("if ({t} % {} != 0) continue;", axis.s));
            c.line(format!("const {ty} {o} = {t} / {};", axis.s));
        } else {
            c.line(format!("const {ty} {o} = {t};"));
        }
        if (axis.extent - 1 + axis.p) / axis.s >= axis.out {
            c.line(format!("if ({o} >= {}) continue;", int(axis.out)));
        }
    }
    c.line(format!(
        "const {}* dp = in0 + ((n_ * {} + oh) * {} + ow) * {} + f0;",
        elems.input(0),
        int(g.oh),
        int(g.ow),
        int(g.f)
    ));
    c.line(format!(
        "const {}* wp = in1 + ((kh * {} + kw) * {cg} + ci) * {} + f0;",
        elems.input(1),
        g.kw,
        int(g.f)
    ));
    c.line(format!("for (int j = 0; j < {fg}; ++j) {{"));
    c.line("acc += __fmul_rn(dp[j], wp[j]);");
    c.line("}");
    c.line("}");
    c.line("}");
    c.line(store(sink.as_ref(), &call));
    c.line("}");
    c.line("}");
    let describe = format!(
        "conv2d_backprop_input {}{} (direct: a thread per input element, gathered)",
        g.text(),
        match then {
            InputGradient::Plain => "",
            InputGradient::ReluGrad => " then relu_grad",
            InputGradient::ResidualReluGrad => " plus a residual then relu_grad",
        }
    );
    let args = [Arg::Input(0), Arg::Input(1)].into_iter().chain(sink_args).collect();
    one_launch(c.finish(), fname, dx.numel(), args, describe)
}

/// The width TF of the filter gradient's tiles of output channels for `tiles_of(tf)` tiles:
/// 32 (no wider than F needs), halved while that leaves fewer than `FILL_BLOCKS` tiles.
fn tile_width(f: usize, tiles_of: impl Fn(usize) -> usize) -> usize {
    let mut tf = 32.min(f.next_power_of_two());
    while tf > 1 && tiles_of(tf) < FILL_BLOCKS {
        tf /= 2;
    }
    tf
}

/// The filter gradient of a non-dense window's convolution: blocks of 256 threads over tiles of
/// TF output channels, the positions split over TY = 256 / TF rows and added in a fixed tree.
pub(crate) fn backprop_filter(
    label: &str,
    x: &Shape,
    dy: &Shape,
    window: &Window2d,
    dw: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let g = Geom::new(x, window, dy.dims()[3]);
    let ty = idx_type(x.numel().max(dy.numel()).max(dw.numel()));
    let (cg, fg) = per_group(&g);
    let [ah, aw] = axes(&g);
    let taps = g.kh * g.kw * cg;
    let tf = tile_width(g.f, |tf| taps * g.f.div_ceil(tf));
    let rows = BLOCK as usize / tf;
    let fb = g.f.div_ceil(tf);
    let tiles = taps * fb;
    let positions = g.n * g.oh * g.ow;
    let fname = "kiln_conv2d_backprop_filter_grouped";
    let mut c = Code::new();
    c.line(header(label, &[x, dy], Some(dw)));
    c.line(format!(
        "extern \"C\" __global__ void {fname}({}, {}* __restrict__ out) {{",
        factor_params(elems),
        elems.output()
    ));
    c.line(format!("// {rows} rows of positions x {tf} output channels, then a tree over the rows"));
    c.line(format!("__shared__ float part[{rows}][{tf}];"));
    c.line(format!("const int tx = (int)threadIdx.x % {tf};"));
    c.line(format!("const int ty_ = (int)threadIdx.x / {tf};"));
    c.line(format!("for ({ty} tile = ({ty})blockIdx.x; tile < {}; tile += ({ty})gridDim.x) {{", int(tiles)));
    coords(&mut c, ty, "tile", &[g.kh, g.kw, cg, fb], &["kh", "kw", "ci", "fb"]);
    c.line(if tf == 1 { format!("const {ty} f_ = fb;") } else { format!("const {ty} f_ = fb * {tf} + tx;") });
    c.line("float acc = 0.0f;");
    let guarded = !g.f.is_multiple_of(tf);
    if guarded {
        c.line(format!("if (f_ < {}) {{", int(g.f)));
    }
    c.line(match (g.groups, cg) {
        (1, _) => format!("const {ty} c_ = ci;"),
        (_, 1) => format!("const {ty} c_ = {};", first_of_group(g.groups, "f_", fg, cg)),
        _ => format!("const {ty} c_ = {} + ci;", first_of_group(g.groups, "f_", fg, cg)),
    });
    c.line(format!("for ({ty} p = ty_; p < {}; p += {rows}) {{", int(positions)));
    coords(&mut c, ty, "p", &[g.n, g.oh, g.ow], &["n_", "oh_", "ow_"]);
    let mut conds = Vec::new();
    for (axis, (i, o, k)) in [(&ah, ("ih", "oh_", "kh")), (&aw, ("iw", "ow_", "kw"))] {
        c.line(axis.input_index(ty, i, o, k));
        if axis.reads_before() {
            conds.push(format!("{i} >= 0"));
        }
        if axis.reads_past() {
            conds.push(format!("{i} < {}", int(axis.extent)));
        }
    }
    let product = format!(
        "acc += __fmul_rn(in0[((n_ * {} + ih) * {} + iw) * {} + c_], in1[p * {} + f_]);",
        int(g.h),
        int(g.w),
        int(g.c),
        int(g.f)
    );
    if conds.is_empty() {
        c.line(product);
    } else {
        c.line(format!("if ({}) {{", conds.join(" && ")));
        c.line(product);
        c.line("}");
    }
    c.line("}");
    if guarded {
        c.line("}");
    }
    c.line("part[ty_][tx] = acc;");
    c.line("__syncthreads();");
    let mut stride = rows / 2;
    while stride > 0 {
        c.line(format!("if (ty_ < {stride}) part[ty_][tx] += part[ty_ + {stride}][tx];"));
        c.line("__syncthreads();");
        stride /= 2;
    }
    let store = format!("out[((kh * {} + kw) * {cg} + ci) * {} + f_] = part[0][tx];", g.kw, int(g.f));
    if guarded {
        c.line(format!("if (ty_ == 0 && f_ < {}) {store}", int(g.f)));
    } else {
        c.line(format!("if (ty_ == 0) {store}"));
    }
    c.line("// part is written again by the next tile");
    c.line("__syncthreads();");
    c.line("}");
    c.line("}");
    let describe = format!(
        "conv2d_backprop_filter {} (direct: tiles of {tf} channels x {rows} rows of positions)",
        g.text()
    );
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: fname.into(),
            grid: [tiles.clamp(1, MAX_BLOCKS) as u32, 1, 1],
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Input(1), Arg::Output],
        }],
        describe,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::Padding;

    #[test]
    fn filter_gradient_tiles_narrow_to_fill_the_gpu() {
        // Many filters: full warps of consecutive channels.
        assert_eq!(tile_width(256, |tf| 9 * 64 * 256usize.div_ceil(tf)), 32);
        // Depthwise 3x3 over 96 channels: 864 dw elements, narrowed to 2-channel tiles.
        assert_eq!(tile_width(96, |tf| 9 * 96usize.div_ceil(tf)), 2);
        // Never wider than the channels need.
        assert_eq!(tile_width(3, |_| 1000), 4);
        assert_eq!(tile_width(1, |_| 1), 1);
    }

    #[test]
    fn bounds_tests_are_left_out_where_they_cannot_fail() {
        let x = Shape::from([1, 8, 8, 4]);
        let w = Shape::from([3, 3, 1, 4]);
        let valid = Window2d::new([3, 3], [1, 1], Padding::Valid).grouped(4);
        let k = conv2d("c", &x, &w, &valid, &Shape::from([1, 6, 6, 4]), None, &Elems::default());
        assert!(!k.source.contains("break") && !k.source.contains("continue"), "{}", k.source);
        let same = Window2d::new([3, 3], [1, 1], Padding::Same).grouped(4).dilated([2, 2]);
        let k = conv2d("c", &x, &w, &same, &Shape::from([1, 8, 8, 4]), None, &Elems::default());
        assert!(k.source.contains("if (ih >= 8) break;") && k.source.contains("if (iw < 0) continue;"));
    }
}
