//! Reductions (sum, mean, max) over any set of axes.
//!
//! As on the CPU, size-1 axes are dropped and adjacent axes of one kind (kept or reduced) merge,
//! so the input alternates kept and reduced groups. Output o reads the elements at
//! `kept_offset(o) + reduced_offset(j)` for j < count, both offsets decomposed with baked extents
//! and strides, which covers non-contiguous axis sets. Two kernel shapes, chosen by the innermost
//! group:
//! - reduced innermost (`rows`: softmax-style [N, C] -> [N]): S threads per output take every
//!   S-th element, so consecutive threads read consecutive addresses. S = 1 for rows of at most
//!   8 elements (a thread per output, 256 outputs per block), a warp (S = 32, 8 outputs per
//!   block, `__shfl_xor_sync` tree) up to 1024 elements, else a block of 256 threads, or 1024
//!   when few outputs share the GPU (warp trees, then one warp over the per-warp results).
//! - kept innermost (`columns`: a bias gradient [N, C] -> [C]): 32 consecutive outputs per block
//!   row, so a warp reads 32 adjacent elements, and S block rows split the reduced elements
//!   between them (S chosen so the grid holds about 2^18 threads); the S partials of each output
//!   are combined by a shared-memory tree.
//!
//! Blocks loop over output groups (grid-stride) with block-uniform trip counts, so every thread
//! reaches every shuffle and barrier.
//!
//! Sum and mean accumulate in f64, as the CPU does, so that both round one exact-ish sum to f32
//! and agree although they add in different orders; max propagates NaN (`kiln_max_nan`).
//!
//! Column reductions with few outputs and a long reduced extent (a bias gradient over a batch of
//! 65,536 positions into 32 outputs: one block of 1024 threads, 0.10-0.13 ms on an H100) split
//! the reduced extent across blocks when the step has scratch (`kiln_compiler::scratch`): each
//! block writes its unfinished accumulator (f64 for sums) to the scratch, and a second launch
//! combines every output's partials in part order and finishes it, so the result stays
//! deterministic. Without scratch, one pass as above.

use super::codegen::{Code, decompose, grid_for, header, idx_type, int, linear, shape_text};
use super::codegen::{Elems, dbl, params};
use super::elementwise::Map;
use super::{Arg, CudaKernel, Launch, math};
use kiln_compiler::ir::{Fused, FusedReduce, ReduceOp, Shape};

/// Threads per block of the row and column kernels (the row kernel's big variant uses 1024).
const THREADS: usize = 256;

/// The reduction's accumulator and its C expressions.
struct Acc {
    op: ReduceOp,
    count: usize,
}

impl Acc {
    fn ty(&self) -> &'static str {
        match self.op {
            ReduceOp::Max => "float",
            _ => "double",
        }
    }

    fn zero(&self) -> &'static str {
        match self.op {
            ReduceOp::Max => "__int_as_float(0xff800000)",
            _ => "0.0",
        }
    }

    fn add(&self, acc: &str, v: &str) -> String {
        match self.op {
            ReduceOp::Max => format!("{acc} = kiln_max_nan({acc}, {v});"),
            _ => format!("{acc} += (double){v};"),
        }
    }

    fn combine(&self, a: &str, b: &str) -> String {
        match self.op {
            ReduceOp::Max => format!("kiln_max_nan({a}, {b})"),
            _ => format!("{a} + {b}"),
        }
    }

    fn finish(&self, acc: &str) -> String {
        match self.op {
            ReduceOp::Sum => format!("(float){acc}"),
            ReduceOp::Mean => format!("(float)({acc} / {})", dbl(self.count as f64)),
            ReduceOp::Max => acc.to_string(),
        }
    }

    fn prelude(&self) -> String {
        math::prelude(if self.op == ReduceOp::Max { "kiln_max_nan" } else { "" })
    }
}

/// The merged groups of a reduction: (extent, input stride), outer first.
struct Groups {
    kept: Vec<(usize, usize)>,
    reduced: Vec<(usize, usize)>,
    innermost_reduced: bool,
}

fn groups(x: &Shape, axes: &[usize]) -> Groups {
    let mut g: Vec<(usize, bool)> = Vec::new();
    for (i, &d) in x.dims().iter().enumerate() {
        let r = axes.contains(&i);
        match g.last_mut() {
            _ if d == 1 => {}
            Some((gd, gr)) if *gr == r => *gd *= d,
            _ => g.push((d, r)),
        }
    }
    let dims: Vec<usize> = g.iter().map(|e| e.0).collect();
    let strides = super::codegen::contiguous_strides(&dims);
    let mut kept = Vec::new();
    let mut reduced = Vec::new();
    for (&(d, r), &s) in g.iter().zip(&strides) {
        if r { reduced.push((d, s)) } else { kept.push((d, s)) }
    }
    Groups { kept, reduced, innermost_reduced: g.last().is_some_and(|e| e.1) }
}

/// Emits `const T name = <offset of index var over groups>;`.
fn offset(c: &mut Code, ty: &str, name: &str, var: &str, groups: &[(usize, usize)], prefix: &str) {
    if groups.is_empty() {
        c.line(format!("const {ty} {name} = 0;"));
        return;
    }
    let dims: Vec<usize> = groups.iter().map(|g| g.0).collect();
    let strides: Vec<isize> = groups.iter().map(|g| g.1 as isize).collect();
    let coords = decompose(c, ty, var, &dims, prefix);
    c.line(format!("const {ty} {name} = {};", linear(&coords, &strides)));
}

/// Where a reduction reads its input: operand 0 in memory, or a fused elementwise program over
/// the operands (`elementwise::load_function`), evaluated as each element is read.
/// Either way with the element types of the op's operands and output.
#[derive(Clone, Copy)]
pub(crate) enum Input<'a> {
    Memory(&'a Elems),
    /// The program, every operand of the op, and the output's shape (for an epilogue).
    Fused(&'a Fused, &'a [&'a Shape], &'a Shape, &'a Elems),
}

impl Input<'_> {
    fn operands(&self) -> usize {
        match self {
            Input::Memory(_) => 1,
            Input::Fused(_, operands, ..) => operands.len(),
        }
    }

    fn elems(&self) -> &Elems {
        match self {
            Input::Memory(e) | Input::Fused(.., e) => e,
        }
    }

    /// Where the epilogue's operands start (all operands when there is none).
    fn split(&self) -> usize {
        match self {
            Input::Memory(_) => 1,
            Input::Fused(program, operands, ..) => operands.len() - program.epilogue_operands,
        }
    }

    /// The source lines that define what `read` and `store` call, beside the source `defined`
    /// already has.
    fn definitions(&self, ty: &str, defined: &str) -> String {
        match self {
            Input::Memory(_) => String::new(),
            Input::Fused(program, operands, out, elems) => {
                let split = self.split();
                let load =
                    super::elementwise::load_function(program, &operands[..split], (ty, elems), defined);
                if program.epilogue.is_empty() {
                    return load;
                }
                let mut shapes: Vec<&Shape> = vec![out];
                shapes.extend_from_slice(&operands[split..]);
                let epilogue = super::elementwise::epilogue_function(
                    &program.epilogue_program(out),
                    &shapes,
                    // Epilogue operand j >= 1 is operand split - 1 + j.
                    (ty, &elems.shifted(split - 1)),
                    &format!("{defined}\n{load}"),
                );
                format!("{load}\n{epilogue}")
            }
        }
    }

    /// The input element at linear index `at`.
    fn read(&self, at: &str) -> String {
        match self {
            Input::Memory(_) => format!("in0[{at}]"),
            Input::Fused(..) => {
                let ins: Vec<String> = (0..self.split()).map(|j| format!("in{j}")).collect();
                format!("kiln_load({at}, {})", ins.join(", "))
            }
        }
    }

    /// What output `o` stores for its reduced `value`: the value, or the epilogue of it.
    fn store(&self, value: String) -> String {
        match self {
            Input::Fused(program, ..) if !program.epilogue.is_empty() => {
                let extra: String = (self.split()..self.operands()).map(|j| format!(", in{j}")).collect();
                format!("kiln_epilogue({value}, o{extra})")
            }
            _ => value,
        }
    }

    fn args(&self) -> Vec<Arg> {
        (0..self.operands()).map(Arg::Input).chain([Arg::Output]).collect()
    }
}

/// Blocks a column reduction should keep busy when it splits: four per SM of an H100.
const SPLIT_BLOCKS: usize = 4 * 132;

/// How a column reduction of `outputs` over `count` elements splits the reduced extent across
/// blocks: (parts, chunk), or `None` when its blocks already fill the GPU or the extent is short.
fn column_parts(outputs: usize, count: usize) -> Option<(usize, usize)> {
    let blocks = outputs.div_ceil(32);
    let mut parts = pow2_floor(SPLIT_BLOCKS / blocks.max(1)).min(64);
    while parts > 1 && count / parts < 1024 {
        parts /= 2;
    }
    (parts > 1).then(|| (parts, count.div_ceil(parts)))
}

/// The bytes of scratch a reduction of `x` over `axes` uses when given enough: a column
/// reduction's partial accumulators (0 for one that does not split).
pub(crate) fn scratch_wanted(op: ReduceOp, x: &Shape, axes: &[usize]) -> usize {
    let g = groups(x, axes);
    let outputs: usize = g.kept.iter().map(|k| k.0).product();
    let count: usize = g.reduced.iter().map(|k| k.0).product();
    if count == 0 || g.reduced.is_empty() || g.innermost_reduced {
        return 0;
    }
    column_parts(outputs, count).map_or(0, |(parts, _)| parts * outputs * partial_bytes(op))
}

/// Bytes of one partial accumulator in the scratch: f64 for sums and means, f32 for max.
fn partial_bytes(op: ReduceOp) -> usize {
    if op == ReduceOp::Max { 4 } else { 8 }
}

pub(crate) fn reduce(
    op: ReduceOp,
    name: &str,
    label: &str,
    x: &Shape,
    axes: &[usize],
    out: &Shape,
    (scratch, elems): (usize, &Elems),
) -> CudaKernel {
    reduce_from(Input::Memory(elems), op, name, label, x, (axes, scratch), out)
}

/// A fused elementwise program (`ir::fused`) followed by its reduction, one kernel: the
/// reduction below reading its input through the program.
pub(crate) fn fused_reduce(
    label: &str,
    program: &Fused,
    reduce: &FusedReduce,
    operands: &[&Shape],
    out: &Shape,
    scratch: usize,
    elems: &Elems,
) -> CudaKernel {
    let name = reduce.op().name();
    reduce_from(
        Input::Fused(program, operands, out, elems),
        reduce.op,
        name,
        label,
        &program.shape,
        (&reduce.axes, scratch),
        out,
    )
}

#[allow(clippy::too_many_arguments)]
fn reduce_from(
    input: Input,
    op: ReduceOp,
    name: &str,
    label: &str,
    x: &Shape,
    (axes, scratch): (&[usize], usize),
    out: &Shape,
) -> CudaKernel {
    let g = groups(x, axes);
    let outputs: usize = g.kept.iter().map(|k| k.0).product();
    let count: usize = g.reduced.iter().map(|k| k.0).product();
    let acc = Acc { op, count };
    let describe = format!("{name}{axes:?} {}", shape_text(x));
    let head = match input {
        Input::Memory(_) => header(label, &[x], Some(out)),
        Input::Fused(_, operands, ..) => header(label, operands, Some(out)),
    };
    let fname = format!("kiln_{name}");
    if count == 0 || g.reduced.is_empty() {
        // Nothing reduced (every reduced axis has size 1) or nothing to reduce (an empty axis):
        // the CPU's finish(add(zero, x)) or finish(zero), elementwise, of the input or of a
        // fused program's values (whose element count is the output's).
        let single = |v: &str| match (count, op) {
            (0, _) => acc.finish(&format!("({})", acc.zero())),
            (_, ReduceOp::Max) => v.to_string(),
            _ => acc.finish(&format!("(0.0 + (double){v})")),
        };
        if let Input::Fused(program, operands, _, elems) = input {
            let mut k =
                super::elementwise::fused_finishing(label, program, operands, out, &single("v"), elems);
            k.describe = format!("{describe} of {} (elementwise)", k.describe);
            return k;
        }
        let strides = if count == 0 {
            Vec::new()
        } else {
            vec![super::codegen::broadcast_strides(out.dims(), out.dims())]
        };
        let expr = single("a");
        let mut k = Map {
            name: &fname,
            header: head,
            describe: describe.clone(),
            out: out.dims(),
            strides,
            max_operand: x.numel(),
            expr,
            in_place: false,
            elems: input.elems().clone(),
            ..Default::default()
        }
        .generate();
        k.describe = format!("{describe} (elementwise)");
        return k;
    }
    let ty = idx_type(x.numel());
    if g.innermost_reduced {
        rows(input, &acc, &g, outputs, count, ty, &fname, head, describe)
    } else {
        let split =
            column_parts(outputs, count).filter(|(parts, _)| parts * outputs * partial_bytes(op) <= scratch);
        columns(input, &acc, &g, (outputs, count, split), ty, &fname, head, describe)
    }
}

/// Threads per output of the row kernel.
fn row_slices(outputs: usize, count: usize) -> usize {
    if count <= 8 {
        1
    } else if count <= 1024 {
        32
    } else if count >= 16384 && outputs < 264 {
        1024
    } else {
        256
    }
}

#[allow(clippy::too_many_arguments)]
fn rows(
    input: Input,
    acc: &Acc,
    g: &Groups,
    outputs: usize,
    count: usize,
    ty: &str,
    fname: &str,
    head: String,
    describe: String,
) -> CudaKernel {
    let s = row_slices(outputs, count);
    let per_block = if s >= THREADS { 1 } else { THREADS / s };
    let threads = s * per_block;
    let blocks_needed = outputs.div_ceil(per_block);
    let t = acc.ty();
    let mut c = Code::new();
    c.line(head);
    c.line(acc.prelude());
    c.line(input.definitions(ty, &acc.prelude()));
    c.line(format!(
        "extern \"C\" __global__ void {fname}({}) {{",
        params(input.elems(), input.operands(), true, true)
    ));
    if s > 32 {
        c.line(format!("__shared__ {t} partial[{}];", s / 32));
    }
    if s > 1 {
        c.line(format!("const int slice = threadIdx.x % {s};"));
    }
    if per_block > 1 {
        c.line(format!("const int lane = threadIdx.x / {s};"));
    }
    c.line(format!("for ({ty} group = blockIdx.x; group < {}; group += gridDim.x) {{", int(blocks_needed)));
    let o = if per_block > 1 { format!("group * {per_block} + lane") } else { "group".into() };
    c.line(format!("const {ty} o = {o};"));
    c.line(format!("{t} acc = {};", acc.zero()));
    c.line(format!("if (o < {}) {{", int(outputs)));
    offset(&mut c, ty, "base", "o", &g.kept, "k");
    if s == 1 {
        c.line(format!("for ({ty} j = 0; j < {}; ++j) {{", int(count)));
    } else {
        c.line(format!("for ({ty} j = slice; j < {}; j += {s}) {{", int(count)));
    }
    offset(&mut c, ty, "off", "j", &g.reduced, "q");
    c.line(acc.add("acc", &input.read("base + off")));
    c.line("}");
    c.line("}");
    if s >= 32 {
        c.line("// butterfly over the warp: every lane ends with the warp's result");
        c.line("for (int d = 16; d > 0; d >>= 1) {");
        c.line(format!("acc = {};", acc.combine("acc", "__shfl_xor_sync(0xffffffffu, acc, d)")));
        c.line("}");
    }
    if s > 32 {
        let warps = s / 32;
        c.line("if (slice % 32 == 0) partial[slice / 32] = acc;");
        c.line("__syncthreads();");
        c.line("if (slice < 32) {");
        c.line(format!("acc = slice < {warps} ? partial[slice] : {};", acc.zero()));
        c.line("for (int d = 16; d > 0; d >>= 1) {");
        c.line(format!("acc = {};", acc.combine("acc", "__shfl_xor_sync(0xffffffffu, acc, d)")));
        c.line("}");
        c.line("}");
        c.line(format!("if (slice == 0) out[o] = {};", input.store(acc.finish("acc"))));
        c.line("__syncthreads();");
    } else if s == 32 {
        c.line(format!(
            "if (slice == 0 && o < {}) out[o] = {};",
            int(outputs),
            input.store(acc.finish("acc"))
        ));
    } else {
        c.line(format!("if (o < {}) out[o] = {};", int(outputs), input.store(acc.finish("acc"))));
    }
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: fname.into(),
            grid: grid_for(blocks_needed, 1),
            block: [threads as u32, 1, 1],
            shared_bytes: 0,
            args: input.args(),
        }],
        describe: format!("{describe} ({s} threads per output)"),
    }
}

/// Threads that the column kernel aims to keep busy.
const COLUMN_THREADS: usize = 1 << 18;

fn pow2_floor(v: usize) -> usize {
    if v == 0 { 1 } else { 1 << (usize::BITS - 1 - v.leading_zeros()) }
}

/// The column kernel; with `split` = (parts, chunk), block (group, part) reduces elements
/// [part·chunk, (part + 1)·chunk) of its outputs into the scratch, and a second kernel combines
/// the parts.
#[allow(clippy::too_many_arguments)]
fn columns(
    input: Input,
    acc: &Acc,
    g: &Groups,
    (outputs, count, split): (usize, usize, Option<(usize, usize)>),
    ty: &str,
    fname: &str,
    head: String,
    describe: String,
) -> CudaKernel {
    let extent = split.map_or(count, |(_, chunk)| chunk);
    let s = pow2_floor(COLUMN_THREADS / outputs.max(1)).min(pow2_floor(extent / 8)).clamp(1, 32);
    let groups = outputs.div_ceil(32);
    let t = acc.ty();
    let mut c = Code::new();
    c.line(head);
    c.line(acc.prelude());
    c.line(input.definitions(ty, &acc.prelude()));
    let ins = params(input.elems(), input.operands(), false, true);
    let kernel = if split.is_some() { format!("{fname}_partial") } else { fname.to_string() };
    match split {
        Some(_) => c.line(format!("extern \"C\" __global__ void {kernel}({ins}, {t}* __restrict__ part) {{")),
        None => c.line(format!(
            "extern \"C\" __global__ void {kernel}({}) {{",
            params(input.elems(), input.operands(), true, true)
        )),
    };
    if s > 1 {
        c.line(format!("__shared__ {t} partial[{s}][32];"));
    }
    c.line("const int lane = threadIdx.x % 32;");
    if s > 1 {
        c.line("const int slice = threadIdx.x / 32;");
    }
    let (blocks, first, end) = match split {
        Some((parts, chunk)) => {
            c.line(format!("// part p of {parts} reduces elements [p * {chunk}, (p + 1) * {chunk})"));
            c.line(format!("const {ty} p = ({ty})blockIdx.x / {groups};"));
            c.line(format!("const {ty} j0 = p * {};", int(chunk)));
            c.line(format!(
                "const {ty} j1 = j0 + {chunk} < {count} ? j0 + {chunk} : ({ty}){count};",
                chunk = int(chunk),
                count = int(count)
            ));
            c.line(format!(
                "for ({ty} group = blockIdx.x % {groups}; group < {}; group += {groups}) {{",
                int(groups)
            ));
            (groups * parts, "j0", "j1".to_string())
        }
        None => {
            c.line(format!("for ({ty} group = blockIdx.x; group < {}; group += gridDim.x) {{", int(groups)));
            (groups, "0", int(count))
        }
    };
    c.line(format!("const {ty} o = group * 32 + lane;"));
    c.line(format!("{t} acc = {};", acc.zero()));
    c.line(format!("if (o < {}) {{", int(outputs)));
    offset(&mut c, ty, "base", "o", &g.kept, "k");
    if s == 1 {
        c.line(format!("for ({ty} j = {first}; j < {end}; ++j) {{"));
    } else {
        c.line(format!("for ({ty} j = {first} + slice; j < {end}; j += {s}) {{"));
    }
    offset(&mut c, ty, "off", "j", &g.reduced, "q");
    c.line(acc.add("acc", &input.read("base + off")));
    c.line("}");
    c.line("}");
    if s > 1 {
        c.line("partial[slice][lane] = acc;");
        c.line("__syncthreads();");
        c.line(format!("for (int d = {}; d > 0; d >>= 1) {{", s / 2));
        c.line(format!(
            "if (slice < d) partial[slice][lane] = {};",
            acc.combine("partial[slice][lane]", "partial[slice + d][lane]")
        ));
        c.line("__syncthreads();");
        c.line("}");
        c.line("acc = partial[0][lane];");
        c.line("__syncthreads();");
    }
    match split {
        Some(_) => c.line(format!(
            "if ({}o < {}) part[p * {} + o] = acc;",
            if s > 1 { "slice == 0 && " } else { "" },
            int(outputs),
            int(outputs)
        )),
        None => c.line(format!(
            "if ({}o < {}) out[o] = {};",
            if s > 1 { "slice == 0 && " } else { "" },
            int(outputs),
            input.store(acc.finish("acc"))
        )),
    };
    c.line("}");
    c.line("}");
    let mut launches = vec![Launch {
        function: kernel,
        grid: [blocks as u32, 1, 1],
        block: [(32 * s) as u32, 1, 1],
        shared_bytes: 0,
        args: match split {
            Some(_) => (0..input.operands()).map(Arg::Input).chain([Arg::Scratch]).collect(),
            None => input.args(),
        },
    }];
    let mut how = format!("32 outputs x {s} slices per block");
    if let Some((parts, chunk)) = split {
        c.blank();
        c.line(format!(
            "extern \"C\" __global__ void {fname}(const {t}* __restrict__ part, {}) {{",
            params(input.elems(), input.operands(), true, true)
        ));
        c.line(format!("// the {parts} parts of every output, in part order"));
        c.line(super::codegen::grid_loop(ty, "o", outputs));
        c.line(format!("{t} acc = part[o];"));
        c.line(format!(
            "for (int q = 1; q < {parts}; ++q) acc = {};",
            acc.combine("acc", &format!("part[({ty})q * {} + o]", int(outputs)))
        ));
        c.line(format!("out[o] = {};", input.store(acc.finish("acc"))));
        c.line("}");
        c.line("}");
        launches.push(Launch {
            function: fname.into(),
            grid: grid_for(outputs, 256),
            block: [256, 1, 1],
            shared_bytes: 0,
            args: std::iter::once(Arg::Scratch).chain(input.args()).collect(),
        });
        how = format!("{how}, {parts} parts of {chunk} across blocks (scratch)");
    }
    CudaKernel { source: c.finish(), launches, describe: format!("{describe} ({how})") }
}
