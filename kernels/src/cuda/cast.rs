//! `cast` between f32, f16, bf16, i32, i64 and bool: a thread per element. The conversions are the CPU's
//! (`cpu::cast`) spelled out, since C++ leaves float -> integer undefined out of range: truncation
//! toward zero, saturation at the type's range, NaN -> 0; integer -> integer keeps the low bits;
//! anything -> bool is `!= 0`; bool and integers -> f32 round to nearest.

use super::codegen::{BLOCK, Code, grid_for, grid_loop, header, idx_type, shape_text};
use super::{Arg, CudaKernel, Launch};
use kiln_compiler::ir::{DType, Shape};

/// The C type a buffer of `dtype` holds (f32, i32, i64, bool: the checks admit no other).
pub(crate) fn c_type(dtype: DType) -> &'static str {
    match dtype {
        DType::I32 => "int",
        DType::I64 => "long long",
        DType::Bool => "unsigned char",
        // A half value's bits (`half::conversions` widen and narrow them).
        DType::F16 | DType::BF16 => "unsigned short",
        DType::F32 => "float",
    }
}

/// The expression converting `v` of `from` to `to`.
fn convert(v: &str, from: DType, to: DType) -> String {
    let float = |d: DType| !matches!(d, DType::I32 | DType::I64 | DType::Bool);
    // A half operand is widened first, a half result narrowed last.
    match (from, to) {
        (DType::BF16, _) => return convert(&format!("kiln_bf16_to_f32({v})"), DType::F32, to),
        (DType::F16, _) => return convert(&format!("kiln_f16_to_f32({v})"), DType::F32, to),
        (_, DType::BF16) => return format!("kiln_f32_to_bf16({})", convert(v, from, DType::F32)),
        (_, DType::F16) => return format!("kiln_f32_to_f16({})", convert(v, from, DType::F32)),
        _ => {}
    }
    match to {
        DType::Bool if float(from) => format!("(unsigned char)({v} != 0.0f)"),
        DType::Bool => format!("(unsigned char)({v} != 0)"),
        DType::I32 if float(from) => format!(
            "({v} != {v} ? 0 : {v} >= 2147483648.0f ? 2147483647 : {v} < -2147483648.0f ? (-2147483647 - 1) : (int){v})"
        ),
        DType::I64 if float(from) => format!(
            "({v} != {v} ? 0LL : {v} >= 9223372036854775808.0f ? 9223372036854775807LL : \
             {v} < -9223372036854775808.0f ? (-9223372036854775807LL - 1) : (long long){v})"
        ),
        // Two's complement: the low bits, as the CPU's `as`.
        DType::I32 => format!("(int)(unsigned int)(unsigned long long){v}"),
        DType::I64 => format!("(long long){v}"),
        _ => format!("(float){v}"),
    }
}

pub(crate) fn cast(label: &str, x: &Shape, from: DType, to: DType) -> CudaKernel {
    let n = x.numel();
    let ty = idx_type(n);
    let mut c = Code::new();
    c.line(header(label, &[x], Some(x)));
    if [from, to].iter().any(|d| matches!(d, DType::F16 | DType::BF16)) {
        c.line(super::half::conversions());
    }
    c.line(format!(
        "extern \"C\" __global__ void kiln_cast(const {}* __restrict__ in0, {}* __restrict__ out) {{",
        c_type(from),
        c_type(to)
    ));
    c.line(grid_loop(ty, "i", n));
    c.line(format!("const {} v = in0[i];", c_type(from)));
    c.line(format!("out[i] = {};", convert("v", from, to)));
    c.line("}");
    c.line("}");
    CudaKernel {
        source: c.finish(),
        launches: vec![Launch {
            function: "kiln_cast".into(),
            grid: grid_for(n, BLOCK),
            block: [BLOCK, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Input(0), Arg::Output],
        }],
        describe: format!("cast {from} {} to {to}", shape_text(x)),
    }
}
