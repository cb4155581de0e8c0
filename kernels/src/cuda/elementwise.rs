//! Elementwise kernels (unary, binary with NumPy broadcasting, scalar, select) and the strided map
//! that the layout kernels (fill, copy, broadcast_to, permute) share.
//!
//! One thread per output element in a grid-stride loop (256-thread blocks). The output's loop nest
//! is merged first (`codegen::Nest`), so each operand is read either at the output's own index,
//! as a broadcast scalar, or through baked strides after a div/mod decomposition of the index.
//! When no operand needs strides and the element count is a multiple of 4, the loop runs over
//! `float4`s: 16-byte loads and stores (arena offsets are at least 16-byte aligned: plans with less are refused at load), scalar operands
//! loaded once per thread.
//!
//! In place: the runtime may pass an input's buffer as the output. Elementwise kernels therefore
//! take plain pointers (no `__restrict__`) and every thread reads all operands of element i (or
//! float4 i) before it writes that element; an operand aliasing the output has the output's
//! shape, so it is read at the same index, by the same thread.

use super::codegen::{
    Access, BLOCK, Code, Nest, broadcast_strides, decompose_some, grid_for, grid_loop, header,
};
use super::codegen::{Elems, flt, idx_type, int, linear, params, shape_text};
use super::{Arg, CudaKernel, Launch, math};
use kiln_compiler::ir::fused::{Inst, Ref};
use kiln_compiler::ir::{BinaryOp, DType, Fused, ScalarOp, Shape, UnaryOp};

/// Operand value names in the op expressions.
const NAMES: [&str; 3] = ["a", "b", "c"];

/// A one-thread-per-element kernel over a contiguous output.
#[derive(Default)]
pub(crate) struct Map<'a> {
    /// Function name, e.g. "kiln_add".
    pub name: &'a str,
    /// The source's first line (`codegen::header`).
    pub header: String,
    pub describe: String,
    pub out: &'a [usize],
    /// Operand k's element strides along the output's axes (0 where broadcast).
    pub strides: Vec<Vec<isize>>,
    /// Largest operand, in elements (chooses the index type).
    pub max_operand: usize,
    /// The output value as an expression of the operand values a, b, c.
    pub expr: String,
    /// Statements before `expr` (`const float v0 = ...;`), for fused groups; usually empty.
    pub lets: Vec<String>,
    /// The operand values' names where not a, b, c (fused groups take more operands).
    pub names: Vec<String>,
    /// Whether the output may alias an operand (elementwise ops): no `__restrict__`.
    pub in_place: bool,
    /// Whether the expression reads the element's linear index, as `idx` (a fused iota).
    pub index: bool,
    /// The operands' and the output's element types (f32 where not given).
    pub elems: Elems,
}

impl Map<'_> {
    pub(crate) fn generate(self) -> CudaKernel {
        let numel: usize = self.out.iter().product();
        let k = self.strides.len();
        let nest = Nest::new(self.out, &self.strides);
        let access: Vec<Access> = (0..k).map(|j| nest.access(j)).collect();
        let ty = idx_type(numel.max(self.max_operand));
        let vector = numel.is_multiple_of(4)
            && numel >= 4
            && access.iter().all(|&a| a != Access::Strided)
            && !self.elems.any_half();
        let names: Vec<&str> = if self.names.is_empty() {
            NAMES[..k].to_vec()
        } else {
            self.names.iter().map(String::as_str).collect()
        };

        let mut c = Code::new();
        c.line(self.header);
        let prelude = math::prelude(&format!("{}\n{}", self.lets.join("\n"), self.expr));
        if !prelude.is_empty() {
            c.line(prelude);
        }
        let mut args: Vec<String> = names.iter().map(|n| format!("float {n}")).collect();
        if self.index {
            args.push(format!("{ty} idx"));
        }
        c.line(format!("__device__ __forceinline__ float kiln_op({}) {{", args.join(", ")));
        for l in &self.lets {
            c.line(l);
        }
        c.line(format!("return {};", self.expr));
        c.line("}");
        c.blank();
        c.line(format!(
            "extern \"C\" __global__ void {}({}) {{",
            self.name,
            params(&self.elems, k, true, !self.in_place)
        ));
        let index = self.index;
        let call = |vals: &[String], at: &str| {
            let mut vals = vals.to_vec();
            if index {
                vals.push(at.to_string());
            }
            format!("kiln_op({})", vals.join(", "))
        };
        let work;
        if vector {
            work = numel / 4;
            for (j, a) in access.iter().enumerate() {
                match a {
                    Access::Same => {
                        c.line(format!("const float4* in{j}v = reinterpret_cast<const float4*>(in{j});"));
                    }
                    _ => {
                        c.line(format!("const float {} = in{j}[0];", names[j]));
                    }
                }
            }
            c.line("float4* outv = reinterpret_cast<float4*>(out);");
            c.line(grid_loop(ty, "i", work));
            for (j, a) in access.iter().enumerate() {
                if *a == Access::Same {
                    c.line(format!("const float4 {}4 = in{j}v[i];", names[j]));
                }
            }
            c.line("float4 r;");
            for (l, lane) in ["x", "y", "z", "w"].into_iter().enumerate() {
                let vals: Vec<String> = (0..k)
                    .map(|j| match access[j] {
                        Access::Same => format!("{}4.{lane}", names[j]),
                        _ => names[j].to_string(),
                    })
                    .collect();
                c.line(format!("r.{lane} = {};", call(&vals, &format!("i * 4 + {l}"))));
            }
            c.line("outv[i] = r;");
            c.line("}");
        } else {
            work = numel;
            c.line(grid_loop(ty, "i", numel));
            let used: Vec<bool> = (0..nest.dims.len())
                .map(|a| (0..k).any(|j| access[j] == Access::Strided && nest.strides[j][a] != 0))
                .collect();
            let coords = if access.contains(&Access::Strided) {
                decompose_some(&mut c, ty, "i", &nest.dims, &used, "c")
            } else {
                Vec::new()
            };
            for (j, a) in access.iter().enumerate() {
                let at = match a {
                    Access::Same => "i".to_string(),
                    Access::Scalar => "0".to_string(),
                    Access::Strided => linear(&coords, &nest.strides[j]),
                };
                c.line(format!("const float {} = in{j}[{at}];", names[j]));
            }
            let vals: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            c.line(format!("out[i] = {};", call(&vals, "i")));
            c.line("}");
        }
        c.line("}");
        let launch = Launch {
            function: self.name.to_string(),
            grid: grid_for(work, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: (0..k).map(Arg::Input).chain([Arg::Output]).collect(),
        };
        let how = if vector {
            "float4"
        } else if access.contains(&Access::Strided) {
            "strided"
        } else {
            "flat"
        };
        CudaKernel {
            source: c.finish(),
            launches: vec![launch],
            describe: format!("{} ({how})", self.describe),
        }
    }
}

fn strides_of(operands: &[&Shape], out: &Shape) -> Vec<Vec<isize>> {
    operands.iter().map(|s| broadcast_strides(s.dims(), out.dims())).collect()
}

fn max_numel(operands: &[&Shape]) -> usize {
    operands.iter().map(|s| s.numel()).max().unwrap_or(0)
}

pub(crate) fn unary(op: UnaryOp, name: &str, label: &str, x: &Shape, elems: &Elems) -> CudaKernel {
    Map {
        name: &format!("kiln_{name}"),
        header: header(label, &[x], Some(x)),
        describe: format!("{name} {}", shape_text(x)),
        out: x.dims(),
        strides: strides_of(&[x], x),
        max_operand: x.numel(),
        expr: math::unary(op, "a"),
        in_place: true,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

pub(crate) fn binary(
    op: BinaryOp,
    name: &str,
    label: &str,
    (a, b, out): (&Shape, &Shape, &Shape),
    elems: &Elems,
) -> CudaKernel {
    Map {
        name: &format!("kiln_{name}"),
        header: header(label, &[a, b], Some(out)),
        describe: format!("{name} {} {}", shape_text(a), shape_text(b)),
        out: out.dims(),
        strides: strides_of(&[a, b], out),
        max_operand: max_numel(&[a, b, out]),
        expr: math::binary(op, "a", "b"),
        in_place: true,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

pub(crate) fn scalar(op: ScalarOp, c: f32, name: &str, label: &str, x: &Shape, elems: &Elems) -> CudaKernel {
    Map {
        name: &format!("kiln_{name}"),
        header: header(label, &[x], Some(x)),
        describe: format!("{name}[{c}] {}", shape_text(x)),
        out: x.dims(),
        strides: strides_of(&[x], x),
        max_operand: x.numel(),
        expr: math::scalar(op, c, "a"),
        in_place: true,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

/// `Op::RandomUniform`: element i is `kiln_uniform(seed, step, i)` (`ir::uniform`), the step
/// read from the one-element operand.
pub(crate) fn random_uniform(label: &str, seed: u64, step: &Shape, out: &Shape) -> CudaKernel {
    Map {
        name: "kiln_random_uniform",
        header: header(label, &[step], Some(out)),
        describe: format!("random_uniform[seed {seed}] {}", shape_text(out)),
        out: out.dims(),
        strides: strides_of(&[step], out),
        max_operand: out.numel(),
        expr: format!("kiln_uniform({seed}ull, a, (unsigned long long)idx)"),
        in_place: false,
        index: true,
        ..Default::default()
    }
    .generate()
}

pub(crate) fn select(
    label: &str,
    (c, a, b): (&Shape, &Shape, &Shape),
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    // Operands (cond, a, b) are named a, b, c in the expression.
    Map {
        name: "kiln_select",
        header: header(label, &[c, a, b], Some(out)),
        describe: format!("select {} {} {}", shape_text(c), shape_text(a), shape_text(b)),
        out: out.dims(),
        strides: strides_of(&[c, a, b], out),
        max_operand: max_numel(&[c, a, b, out]),
        expr: "a != 0.0f ? b : c".into(),
        in_place: true,
        elems: elems.clone(),
        ..Default::default()
    }
    .generate()
}

/// A fused elementwise group (`ir::fused`): the same one-thread-per-element kernel, whose
/// per-element function computes the program's instructions in registers (`const float vJ`),
/// operands named x0, x1, ... Each instruction is its op's expression (`math`), whose top-level
/// products are `__fmul_rn`: NVRTC never contracts a product of one instruction with a sum of the
/// next into an FMA, so every instruction rounds as the unfused op does.
/// The program's instructions as `const float vJ = ...;` lines and the last one's expression,
/// operands named x0, x1, ..., the element's linear index in the program's shape `index` (what
/// an iota reads).
fn program_code(program: &Fused, index: &str) -> (Vec<String>, String) {
    let dims = program.shape.dims();
    let iota = |axis: u32| {
        let a = (axis as usize).min(dims.len().saturating_sub(1));
        let stride: usize = dims.get(a + 1..).map_or(1, |d| d.iter().product());
        let len = dims.get(a).copied().unwrap_or(1).max(1);
        format!("(float)(({index} / {}) % {})", int(stride), int(len))
    };
    let value = |r: Ref| match r {
        Ref::Operand(i) => format!("x{i}"),
        Ref::Value(v) => format!("v{v}"),
    };
    let mut exprs: Vec<String> = program
        .insts
        .iter()
        .map(|inst| match *inst {
            Inst::Unary(op, a) => math::unary(op, &value(a)),
            Inst::Binary(op, a, b) => math::binary(op, &value(a), &value(b)),
            Inst::Scalar(op, c, a) => math::scalar(op, c, &value(a)),
            Inst::Select(w, a, b) => format!("{} != 0.0f ? {} : {}", value(w), value(a), value(b)),
            Inst::Iota(axis) => iota(axis),
            Inst::Const(c) => flt(c),
            Inst::Uniform(seed, step) => {
                format!("kiln_uniform({seed}ull, {}, (unsigned long long)({index}))", value(step))
            }
            Inst::Cast(DType::BF16, a) => format!("kiln_round_bf16({})", value(a)),
            Inst::Cast(DType::F16, a) => format!("kiln_round_f16({})", value(a)),
            Inst::Cast(_, a) => value(a),
        })
        .collect();
    let last = exprs.pop().unwrap_or_else(|| "0.0f".into());
    (exprs.iter().enumerate().map(|(j, e)| format!("const float v{j} = {e};")).collect(), last)
}

/// A device function `kiln_load(i, p0, p1, ...)`: the fused program's value at linear index `i`
/// of its shape, each operand read at its broadcast position. A reduction with an elementwise
/// prologue reads its input through it (`reduce`), so the prologue's values are never stored.
/// Helpers already in `defined` (the reduction's own) are not defined again.
/// `elems` gives operand j's type as its input j.
pub(crate) fn load_function(
    program: &Fused,
    operands: &[&Shape],
    (ty, elems): (&str, &Elems),
    defined: &str,
) -> String {
    value_function(program, operands, (ty, elems), defined, false)
}

/// A device function `kiln_epilogue(x0, i, p1, p2, ...)`: the fused program's value at linear
/// index `i` of its shape given its operand 0's value there (a product just computed), the other
/// operands read at their broadcast positions. A GEMM applies it as it stores (`gemm`).
/// `elems` gives operand j's type (j >= 1) as its input j.
pub(crate) fn epilogue_function(
    program: &Fused,
    operands: &[&Shape],
    (ty, elems): (&str, &Elems),
    defined: &str,
) -> String {
    value_function(program, operands, (ty, elems), defined, true)
}

fn value_function(
    program: &Fused,
    operands: &[&Shape],
    (ty, elems): (&str, &Elems),
    defined: &str,
    epilogue: bool,
) -> String {
    let k = operands.len();
    let first = usize::from(epilogue);
    let strides = strides_of(operands, &program.shape);
    let nest = Nest::new(program.shape.dims(), &strides);
    let access: Vec<Access> = (0..k).map(|j| if j < first { Access::Same } else { nest.access(j) }).collect();
    let (lets, last) = program_code(program, "i");
    let mut c = Code::new();
    let prelude = math::prelude_beside(&format!("{}\n{last}", lets.join("\n")), defined);
    if !prelude.is_empty() {
        c.line(prelude);
    }
    let mut params: Vec<String> = Vec::new();
    if epilogue {
        params.push("float x0".into());
    }
    params.push(format!("{ty} i"));
    params.extend((first..k).map(|j| format!("const {}* __restrict__ p{j}", elems.input(j))));
    let name = if epilogue { "kiln_epilogue" } else { "kiln_load" };
    c.line(format!("__device__ __forceinline__ float {name}({}) {{", params.join(", ")));
    let used: Vec<bool> = (0..nest.dims.len())
        .map(|a| (first..k).any(|j| access[j] == Access::Strided && nest.strides[j][a] != 0))
        .collect();
    let coords = if access.contains(&Access::Strided) {
        decompose_some(&mut c, ty, "i", &nest.dims, &used, "c")
    } else {
        Vec::new()
    };
    for (j, a) in access.iter().enumerate().skip(first) {
        let at = match a {
            Access::Same => "i".to_string(),
            Access::Scalar => "0".to_string(),
            Access::Strided => linear(&coords, &nest.strides[j]),
        };
        c.line(format!("const float x{j} = p{j}[{at}];"));
    }
    for l in lets {
        c.line(l);
    }
    c.line(format!("return {last};"));
    c.line("}");
    c.finish()
}

pub(crate) fn fused(
    label: &str,
    program: &Fused,
    operands: &[&Shape],
    out: &Shape,
    elems: &Elems,
) -> CudaKernel {
    let names: Vec<String> = (0..operands.len()).map(|j| format!("x{j}")).collect();
    let (lets, last) = program_code(program, "idx");
    Map {
        name: "kiln_fused",
        header: header(label, operands, Some(out)),
        describe: format!("fused({} ops) {}", program.insts.len(), shape_text(out)),
        out: out.dims(),
        strides: strides_of(operands, out),
        max_operand: max_numel(&[operands, &[out]].concat()),
        expr: last,
        lets,
        names,
        in_place: true,
        index: program.insts.iter().any(Inst::reads_index),
        elems: elems.clone(),
    }
    .generate()
}

/// A fused program whose last value, named `v`, becomes the output through `finish` (an
/// expression of `v`): a fused reduction that reduces nothing (only size-1 axes, or an empty
/// one), written over the program's shape, whose element count is the output's.
pub(crate) fn fused_finishing(
    label: &str,
    program: &Fused,
    operands: &[&Shape],
    out: &Shape,
    finish: &str,
    elems: &Elems,
) -> CudaKernel {
    let (mut lets, last) = program_code(program, "idx");
    lets.push(format!("const float v = {last};"));
    Map {
        name: "kiln_fused_reduce",
        header: header(label, operands, Some(out)),
        describe: format!("fused({} ops) {}", program.insts.len(), shape_text(&program.shape)),
        out: program.shape.dims(),
        strides: strides_of(operands, &program.shape),
        max_operand: max_numel(&[operands, &[&program.shape]].concat()),
        expr: finish.to_string(),
        lets,
        names: (0..operands.len()).map(|j| format!("x{j}")).collect(),
        in_place: false,
        index: program.insts.iter().any(Inst::reads_index),
        elems: elems.clone(),
    }
    .generate()
}
