//! Data-movement kernels: fill, copy, permute, broadcast_to, concat, slice, pad.
//!
//! - fill, copy, broadcast_to and most permutes are `elementwise::Map`s: one thread per output
//!   element, operands read through baked strides (float4 when nothing is strided).
//! - A permute that moves the input's contiguous axis away from the innermost position (a
//!   transpose) reads and writes through a 32x33 shared-memory tile (block 32x8, each thread
//!   moves 4 elements), so that both the global reads and the writes are coalesced. It is used
//!   when both tiled extents are at least 16; thinner transposes (NHWC <-> NCHW with 3 channels)
//!   waste most of a tile and stay a strided map.
//! - concat, slice and pad see the output as rows (everything from the axis inwards) made of
//!   segments; each thread finds its segment by a balanced if-tree over baked offsets. They move
//!   float4s when every row length and offset is a multiple of 4. Concat takes up to 32 operands
//!   per launch (more launches for more operands), which keeps the parameter list short.

use super::codegen::{BLOCK, Code, contiguous_strides, decompose, grid_for, grid_loop, header, idx_type};
use super::codegen::{Elems, Nest, broadcast_strides, flt, int, linear, params, shape_text};
use super::elementwise::Map;
use super::{Arg, CudaKernel, Launch};
use kiln_compiler::ir::Shape;

pub(crate) fn fill(label: &str, value: f32, out: &Shape, elems: &Elems) -> CudaKernel {
    Map {
        name: "kiln_fill",
        header: header(label, &[], Some(out)),
        describe: format!("fill[{value}] {}", shape_text(out)),
        out: out.dims(),
        strides: Vec::new(),
        max_operand: out.numel(),
        expr: flt(value),
        in_place: false,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

/// Every element its index along `axis`, as a float.
pub(crate) fn iota(label: &str, axis: usize, out: &Shape) -> CudaKernel {
    let n = out.numel();
    let dims = out.dims();
    let stride: usize = dims[axis + 1..].iter().product();
    let ty = idx_type(n);
    let mut c = Code::new();
    c.line(header(label, &[], Some(out)));
    c.line("extern \"C\" __global__ void kiln_iota(float* __restrict__ out) {");
    c.line(grid_loop(ty, "i", n));
    c.line(format!("out[i] = (float)((i / {}) % {});", int(stride.max(1)), int(dims[axis].max(1))));
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: "kiln_iota".into(),
            grid: grid_for(n, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Output],
        }],
        describe: format!("iota[axis {axis}] {}", shape_text(out)),
    }
}

pub(crate) fn copy(label: &str, x: &Shape, elems: &Elems) -> CudaKernel {
    Map {
        name: "kiln_copy",
        header: header(label, &[x], Some(x)),
        describe: format!("copy {}", shape_text(x)),
        out: x.dims(),
        strides: vec![broadcast_strides(x.dims(), x.dims())],
        max_operand: x.numel(),
        expr: "a".into(),
        in_place: false,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

pub(crate) fn broadcast_to(label: &str, x: &Shape, out: &Shape, elems: &Elems) -> CudaKernel {
    Map {
        name: "kiln_broadcast_to",
        header: header(label, &[x], Some(out)),
        describe: format!("broadcast_to {} -> {}", shape_text(x), shape_text(out)),
        out: out.dims(),
        strides: vec![broadcast_strides(x.dims(), out.dims())],
        max_operand: out.numel(),
        expr: "a".into(),
        in_place: false,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

/// Tile side of the shared-memory transpose.
const TILE: usize = 32;
/// Rows of threads per transpose block (each thread moves TILE / ROWS elements each way).
const ROWS: usize = 8;
/// Smallest extents of the two tiled axes for which the tiled transpose is used.
const TILED_MIN: usize = 16;

pub(crate) fn permute(label: &str, x: &Shape, perm: &[usize], out: &Shape, elems: &Elems) -> CudaKernel {
    let xs = contiguous_strides(x.dims());
    let strides: Vec<isize> = perm.iter().map(|&p| xs[p] as isize).collect();
    let describe = format!("permute{perm:?} {}", shape_text(x));
    let nest = Nest::new(out.dims(), std::slice::from_ref(&strides));
    let last = nest.dims.len() - 1;
    let p = nest.strides[0][..last].iter().position(|&s| s == 1);
    if let Some(p) = p
        && nest.dims[p] >= TILED_MIN
        && nest.dims[last] >= TILED_MIN
    {
        return transpose(label, (x, out), &nest, p, describe, elems);
    }
    Map {
        name: "kiln_permute",
        header: header(label, &[x], Some(out)),
        describe,
        out: out.dims(),
        strides: vec![strides],
        max_operand: x.numel(),
        expr: "a".into(),
        in_place: false,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

/// Tiled transpose of merged axis `p` (contiguous in the input) with the innermost axis.
fn transpose(
    label: &str,
    (x, out): (&Shape, &Shape),
    nest: &Nest,
    p: usize,
    describe: String,
    elems: &Elems,
) -> CudaKernel {
    let ty = idx_type(x.numel());
    let last = nest.dims.len() - 1;
    let os = contiguous_strides(&nest.dims);
    let (pd, ld) = (nest.dims[p], nest.dims[last]);
    let (ps, ls) = (os[p], nest.strides[0][last]);
    let outer: Vec<usize> = (0..last).filter(|&i| i != p).collect();
    let outer_dims: Vec<usize> = outer.iter().map(|&i| nest.dims[i]).collect();
    let outer_count: usize = outer_dims.iter().product();
    let (tp, tl) = (pd.div_ceil(TILE), ld.div_ceil(TILE));
    let blocks = outer_count * tp * tl;

    let mut c = Code::new();
    c.line(header(label, &[x], Some(out)));
    c.line(format!("// tiled transpose: axis of {pd} (input stride 1, output stride {ps}) with axis of {ld} (input stride {ls}, output stride 1)"));
    c.line(format!("extern \"C\" __global__ void kiln_permute({}) {{", params(elems, 1, true, true)));
    c.line(format!("__shared__ float tile[{TILE}][{}];", TILE + 1));
    c.line(format!("{ty} q = blockIdx.x;"));
    c.line(format!("const int l0 = (int)(q % {tl}) * {TILE}; q /= {tl};"));
    c.line(format!("const int p0 = (int)(q % {tp}) * {TILE}; q /= {tp};"));
    if outer.is_empty() {
        c.line(format!("const {ty} io = 0, oo = 0;"));
    } else {
        let coords = decompose(&mut c, ty, "q", &outer_dims, "c");
        let in_s: Vec<isize> = outer.iter().map(|&i| nest.strides[0][i]).collect();
        let out_s: Vec<isize> = outer.iter().map(|&i| os[i] as isize).collect();
        c.line(format!("const {ty} io = {};", linear(&coords, &in_s)));
        c.line(format!("const {ty} oo = {};", linear(&coords, &out_s)));
    }
    c.line("const int tx = threadIdx.x, ty = threadIdx.y;");
    c.line(format!("for (int j = 0; j < {TILE}; j += {ROWS}) {{"));
    c.line("const int l = l0 + ty + j, p = p0 + tx;");
    c.line(format!("if (l < {ld} && p < {pd}) tile[ty + j][tx] = in0[io + p + ({ty})l * {ls}];"));
    c.line("}");
    c.line("__syncthreads();");
    c.line(format!("for (int j = 0; j < {TILE}; j += {ROWS}) {{"));
    c.line("const int p = p0 + ty + j, l = l0 + tx;");
    c.line(format!("if (l < {ld} && p < {pd}) out[oo + ({ty})p * {ps} + l] = tile[tx][ty + j];"));
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: "kiln_permute".into(),
            grid: [blocks as u32, 1, 1],
            block: [TILE as u32, ROWS as u32, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Output],
        }],
        describe: format!("{describe} (tiled {TILE}x{TILE})"),
    }
}

/// (rows before the axis, elements per index of the axis).
fn split(dims: &[usize], axis: usize) -> (usize, usize) {
    (dims[..axis].iter().product(), dims[axis + 1..].iter().product())
}

/// The element type and the loads/stores of a row kernel moving `w` elements at a time: four
/// f32 as a `float4`, four halves as a `uint2` (8 bytes, moved as they are), or one element.
struct Width {
    w: usize,
    /// The elements' C type (`half::elem`): operands and output have the same.
    elem: &'static str,
}

impl Width {
    fn of(lengths: &[usize], elem: &'static str) -> Width {
        Width { w: if lengths.iter().all(|&l| l.is_multiple_of(4)) { 4 } else { 1 }, elem }
    }

    fn ty(&self) -> &'static str {
        match (self.w, self.elem) {
            (4, "float") => "float4",
            (4, _) => "uint2",
            (_, e) => e,
        }
    }

    /// Declares `name`v, a view of pointer `name` in units of the width.
    fn view(&self, name: &str, constant: bool) -> String {
        let k = if constant { "const " } else { "" };
        let t = self.ty();
        if self.w == 4 {
            format!("{k}{t}* {name}v = reinterpret_cast<{k}{t}*>({name});")
        } else {
            format!("{k}{t}* {name}v = {name};")
        }
    }

    /// A zero of the width's type (every element +0.0).
    fn zero(&self) -> String {
        match (self.w, self.elem) {
            (4, "float") => "make_float4(0.0f, 0.0f, 0.0f, 0.0f)".into(),
            (4, _) => "make_uint2(0u, 0u)".into(),
            (_, "float") => "0.0f".into(),
            (_, e) => format!("{e}{{0}}"),
        }
    }
}

/// Operands per concat launch.
const CONCAT_GROUP: usize = 32;

pub(crate) fn concat(label: &str, xs: &[&Shape], axis: usize, out: &Shape, elems: &Elems) -> CudaKernel {
    let (rows, inner) = split(out.dims(), axis);
    let lens: Vec<usize> = xs.iter().map(|x| x.dims()[axis] * inner).collect();
    let row: usize = lens.iter().sum();
    let width = Width::of(&lens, elems.output());
    let w = width.w;
    let ty = idx_type(out.numel());
    let mut offsets = Vec::with_capacity(xs.len());
    let mut acc = 0;
    for &l in &lens {
        offsets.push(acc);
        acc += l;
    }
    // Non-empty operands, in groups of CONCAT_GROUP.
    let live: Vec<usize> = (0..xs.len()).filter(|&j| lens[j] > 0).collect();
    let mut c = Code::new();
    c.line(header(label, xs, Some(out)));
    let mut launches = Vec::new();
    for (g, group) in live.chunks(CONCAT_GROUP).enumerate() {
        let name = format!("kiln_concat_{g}");
        let goff = offsets[group[0]];
        let glen: usize = group.iter().map(|&j| lens[j]).sum();
        let work = rows * glen / w;
        c.blank();
        let list: Vec<String> = group.iter().map(|j| j.to_string()).collect();
        c.line(format!("// operands {} at row offsets {goff}..{}", list.join(", "), goff + glen));
        let group_elems = elems.select(group);
        c.line(format!(
            "extern \"C\" __global__ void {name}({}) {{",
            params(&group_elems, group.len(), true, true)
        ));
        for i in 0..group.len() {
            c.line(width.view(&format!("in{i}"), true));
        }
        c.line(width.view("out", false));
        c.line(grid_loop(ty, "e", work));
        c.line(format!("const {ty} r = e / {}; const {ty} p = e % {};", int(glen / w), int(glen / w)));
        c.line(format!("{} v;", width.ty()));
        let segs: Vec<(usize, usize, usize)> =
            group.iter().enumerate().map(|(i, &j)| (i, (offsets[j] - goff) / w, lens[j] / w)).collect();
        concat_tree(&mut c, &segs);
        c.line(format!("outv[r * {} + {} + p] = v;", int(row / w), goff / w));
        c.line("}");
        c.line("}");
        launches.push(Launch {
            function: name,
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: group.iter().map(|&j| Arg::Input(j)).chain([Arg::Output]).collect(),
        });
    }
    let parts: Vec<String> = xs.iter().map(|x| shape_text(x)).collect();
    CudaKernel {
        source: c.finish(),
        launches,
        describe: format!(
            "concat[axis {axis}] {}{}",
            parts.join(" "),
            if w == 4 { format!(" ({})", width.ty()) } else { String::new() }
        ),
    }
}

/// `v = in_i[r * len + (p - off)]` for the segment (i, off, len) that holds position p.
fn concat_tree(c: &mut Code, segs: &[(usize, usize, usize)]) {
    if let [(i, off, len)] = segs {
        let at = if *off == 0 { "p".to_string() } else { format!("p - {off}") };
        c.line(format!("v = in{i}v[r * {len} + {at}];"));
        return;
    }
    let mid = segs.len() / 2;
    c.line(format!("if (p < {}) {{", segs[mid].1));
    concat_tree(c, &segs[..mid]);
    c.line("} else {");
    concat_tree(c, &segs[mid..]);
    c.line("}");
}

/// Slice and pad: output row r, position p comes from input row r, position p - begin when
/// begin <= p < end, else 0.
struct Window<'a> {
    name: &'a str,
    label: &'a str,
    x: &'a Shape,
    out: &'a Shape,
    in_row: usize,
    out_row: usize,
    begin: usize,
    end: usize,
    /// Input position of output position `begin`.
    src: usize,
    describe: String,
    elems: &'a Elems,
}

impl Window<'_> {
    fn generate(self) -> CudaKernel {
        let width =
            Width::of(&[self.in_row, self.out_row, self.begin, self.end, self.src], self.elems.output());
        let w = width.w;
        let numel = self.out.numel();
        let ty = idx_type(numel.max(self.x.numel()));
        let (ir, or, b, e, s) =
            (self.in_row / w, self.out_row / w, self.begin / w, self.end / w, self.src / w);
        let mut c = Code::new();
        c.line(header(self.label, &[self.x], Some(self.out)));
        c.line(format!(
            "extern \"C\" __global__ void {}({}) {{",
            self.name,
            params(self.elems, 1, true, true)
        ));
        c.line(width.view("in0", true));
        c.line(width.view("out", false));
        c.line(grid_loop(ty, "i", numel / w));
        c.line(format!("const {ty} r = i / {}; const {ty} p = i % {};", int(or), int(or)));
        let read = format!("in0v[r * {} + p{}]", int(ir), offset(s as isize - b as isize));
        let inside = match (b > 0, e < or) {
            (false, false) => None,
            (true, false) => Some(format!("p >= {b}")),
            (false, true) => Some(format!("p < {e}")),
            (true, true) => Some(format!("p >= {b} && p < {e}")),
        };
        match inside {
            None => c.line(format!("outv[i] = {read};")),
            Some(cond) => c.line(format!("outv[i] = ({cond}) ? {read} : {};", width.zero())),
        };
        c.line("}");
        c.line("}");
        CudaKernel {
            source: c.finish(),
            launches: vec![Launch {
                function: self.name.into(),
                grid: grid_for(numel / w, BLOCK),
                block: [BLOCK, 1, 1],
                shared_bytes: 0,
                args: vec![Arg::Input(0), Arg::Output],
            }],
            describe: format!(
                "{}{}",
                self.describe,
                if w == 4 { format!(" ({})", width.ty()) } else { String::new() }
            ),
        }
    }
}

/// " + k" / " - k" / "" for a signed constant offset.
fn offset(k: isize) -> String {
    match k {
        0 => String::new(),
        k if k > 0 => format!(" + {}", int(k as usize)),
        k => format!(" - {}", int(k.unsigned_abs())),
    }
}

pub(crate) fn slice(
    label: &str,
    x: &Shape,
    (axis, start, len): (usize, usize, usize),
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let (_, inner) = split(x.dims(), axis);
    let in_row = x.dims()[axis] * inner;
    let out_row = len * inner;
    Window {
        name: "kiln_slice",
        label,
        x,
        out,
        in_row,
        out_row,
        begin: 0,
        end: out_row,
        src: start * inner,
        describe: format!("slice[axis {axis}, {start}..{}] {}", start + len, shape_text(x)),
        elems,
    }
    .generate()
}

pub(crate) fn pad(
    label: &str,
    x: &Shape,
    (axis, before, after): (usize, usize, usize),
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let describe = format!("pad[axis {axis}, {before}+{after}] {}", shape_text(x));
    if x.numel() == 0 {
        // Nothing to copy: the output is all padding.
        let mut k = Map {
            name: "kiln_pad",
            header: header(label, &[x], Some(out)),
            describe: describe.clone(),
            out: out.dims(),
            strides: Vec::new(),
            max_operand: out.numel(),
            expr: "0.0f".into(),
            in_place: false,
            elems: elems.clone(),
            ..Default::default()
        }
        .generate();
        k.describe = format!("{describe} (zeros)");
        return k;
    }
    let (_, inner) = split(x.dims(), axis);
    let in_row = x.dims()[axis] * inner;
    let out_row = (x.dims()[axis] + before + after) * inner;
    let begin = before * inner;
    Window {
        name: "kiln_pad",
        label,
        x,
        out,
        in_row,
        out_row,
        begin,
        end: begin + in_row,
        src: 0,
        describe,
        elems,
    }
    .generate()
}
