//! Half values in the CUDA kernels: f16 and bf16 in memory, f32 in arithmetic, as on the host
//! (`cpu::cast`).
//!
//! A kernel of a family in `HALF_KERNELS` takes a pointer parameter of the type its operand or
//! output holds ([`Elems`]): `kiln_bf16*` or `kiln_f16*` for half values, `float*` for f32.
//! The two half types are structs of the value's bits whose conversion to `float` widens it
//! (exactly) and whose assignment from a `float` rounds to nearest, ties to even: a generator
//! reads `in0[i]` into a `float` and stores `out[i] = v` as it does for f32, and every read and
//! store of a half value converts, once, at memory. Arithmetic, shared-memory tiles, shuffles
//! and accumulators stay f32, so a half kernel's result is its f32 kernel's on the widened
//! operands, rounded once on the way out: the bits of the plan `kiln_compiler::widen` would
//! make (an f32 kernel between two casts), without the f32 copies. Where a generator reads
//! several elements at once (`float4` loads and stores of plain f32 rows) a half operand takes
//! the element path.
//!
//! The conversions are bit arithmetic (no `cuda_fp16.h`, so that the host build compiles the
//! same source): the CPU's rounding (the `half` crate's), a NaN either way a quiet NaN with its
//! payload's high bits.

use super::codegen::{BLOCK, Code, grid_for, grid_loop, idx_type};
use super::{Arg, Launch, math};
use kiln_compiler::ir::{DType, Shape};

/// The C type a kernel parameter of `dtype` points to: the half structs for f16 and bf16,
/// `float` for f32 (and for what no family kernel reads: ids and flags have their own
/// parameters, `gather`'s and `cast`'s).
pub(crate) fn elem(dtype: DType) -> &'static str {
    match dtype {
        DType::BF16 => "kiln_bf16",
        DType::F16 => "kiln_f16",
        _ => "float",
    }
}

/// The element types of one step's operands and output.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Elems {
    inputs: Vec<DType>,
    output: Option<DType>,
}

impl Elems {
    /// The types of a step's operands and output.
    pub(crate) fn of(inputs: &[(&Shape, DType)], output: DType) -> Elems {
        Elems { inputs: inputs.iter().map(|&(_, d)| d).collect(), output: Some(output) }
    }

    /// The C type operand `i` points to (`float` for an operand the step does not have).
    pub(crate) fn input(&self, i: usize) -> &'static str {
        elem(self.inputs.get(i).copied().unwrap_or(DType::F32))
    }

    /// The C type the output points to.
    pub(crate) fn output(&self) -> &'static str {
        elem(self.output.unwrap_or(DType::F32))
    }

    /// The C type launch argument `arg` points to (the scratch holds f32).
    pub(crate) fn arg(&self, arg: super::Arg) -> &'static str {
        match arg {
            super::Arg::Input(i) => self.input(i),
            super::Arg::Output => self.output(),
            super::Arg::Scratch => "float",
        }
    }

    /// Whether operand `i` holds f32 (a generator's multi-element loads are for f32 alone).
    pub(crate) fn input_f32(&self, i: usize) -> bool {
        self.input(i) == "float"
    }

    /// Whether the output holds f32.
    pub(crate) fn output_f32(&self) -> bool {
        self.output() == "float"
    }

    /// Whether any operand or the output is a half type.
    pub(crate) fn any_half(&self) -> bool {
        !self.output_f32() || (0..self.inputs.len()).any(|i| !self.input_f32(i))
    }

    /// These types with operand `first` renumbered 0 (a launch over a subset of the operands).
    pub(crate) fn shifted(&self, first: usize) -> Elems {
        Elems { inputs: self.inputs.get(first..).unwrap_or_default().to_vec(), output: self.output }
    }

    /// Operands `which` (in that order) and the output.
    pub(crate) fn select(&self, which: &[usize]) -> Elems {
        Elems {
            inputs: which.iter().map(|&j| self.inputs.get(j).copied().unwrap_or(DType::F32)).collect(),
            output: self.output,
        }
    }
}

/// Conversions of half bits to f32 and back: widening is exact; narrowing rounds to nearest,
/// ties to even, as `kiln_round_bf16` and `kiln_round_f16` (`math`) do.
const CONVERSIONS: &str = "\
#ifndef KILN_HALF_CONVERSIONS
#define KILN_HALF_CONVERSIONS
__device__ __forceinline__ float kiln_bf16_to_f32(unsigned short h) {
    if ((h & 0x7fffu) > 0x7f80u) h |= 0x40u;
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ unsigned short kiln_f32_to_bf16(float x) {
    const unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    return (unsigned short)(__float_as_uint(kiln_round_bf16(x)) >> 16);
}
__device__ __forceinline__ float kiln_f16_to_f32(unsigned short h) {
    const unsigned int s = ((unsigned int)(h & 0x8000u)) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(s | 0x7f800000u | (m << 13) | (m ? 0x400000u : 0u));
    if (e == 0u) {
        const float v = (float)m * (1.0f / 16777216.0f);
        return __uint_as_float(s | __float_as_uint(v));
    }
    return __uint_as_float(s | ((e + 112u) << 23) | (m << 13));
}
__device__ __forceinline__ unsigned short kiln_f32_to_f16(float x) {
    const float r = kiln_round_f16(x);
    const unsigned int u = __float_as_uint(r), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(s | 0x7e00u | ((a & 0x7fffffu) >> 13));
    if (a >= 0x47800000u) return (unsigned short)(s | 0x7c00u);
    if (a < 0x38800000u) return (unsigned short)(s | (unsigned int)(__uint_as_float(a) * 16777216.0f));
    return (unsigned short)(s | (((a >> 23) - 112u) << 10) | ((a >> 13) & 0x3ffu));
}
#endif
";

/// The two value types: read as `float`, assigned from `float` (copied between themselves bit
/// for bit). No constructor from `float`, so that `c ? half : 0.0f` converts the half value.
const TYPES: &str = "\
#ifndef KILN_HALF_TYPES
#define KILN_HALF_TYPES
struct kiln_bf16 {
    unsigned short bits;
    __device__ __forceinline__ operator float() const { return kiln_bf16_to_f32(bits); }
    __device__ __forceinline__ kiln_bf16& operator=(float v) { bits = kiln_f32_to_bf16(v); return *this; }
};
struct kiln_f16 {
    unsigned short bits;
    __device__ __forceinline__ operator float() const { return kiln_f16_to_f32(bits); }
    __device__ __forceinline__ kiln_f16& operator=(float v) { bits = kiln_f32_to_f16(v); return *this; }
};
#endif
";

/// The conversion helpers (and what they call); defined once however often a source includes
/// them.
pub(crate) fn conversions() -> String {
    format!("{}{CONVERSIONS}", math::prelude("kiln_round_bf16 kiln_round_f16"))
}

/// The source that defines `kiln_bf16` and `kiln_f16`, for a kernel with half parameters.
pub(crate) fn types() -> String {
    format!("// f16 and bf16 in memory, f32 in arithmetic\n{}{TYPES}", conversions())
}

/// `source` with the half types defined after its first line (the header comment) when `elems`
/// has a half type; as it is otherwise.
pub(crate) fn with_types(source: String, elems: &Elems) -> String {
    if !elems.any_half() {
        return source;
    }
    let (head, rest) = source.split_once('\n').unwrap_or((&source, ""));
    format!("{head}\n{}{rest}", types())
}

/// The last launch of a kernel that keeps an f32 copy of its half output in the scratch (its
/// running sums): `function` narrows the `n` values into the output of type `elem`, appended
/// to `c`.
pub(crate) fn narrow(c: &mut Code, function: &str, n: usize, elem: &str) -> Launch {
    c.blank();
    c.line(format!(
        "extern \"C\" __global__ void {function}(const float* __restrict__ part, {elem}* __restrict__ out) {{"
    ));
    c.line(grid_loop(idx_type(n), "i", n));
    c.line("out[i] = part[i];");
    c.line("}");
    c.line("}");
    Launch {
        function: function.into(),
        grid: grid_for(n, BLOCK),
        block: [BLOCK, 1, 1],
        shared_bytes: 0,
        args: vec![Arg::Scratch, Arg::Output],
    }
}

/// An error's help when a kernel that keeps its half output's f32 copy in the scratch (`what`
/// it does) has `have` bytes of scratch and needs `need`; `None` when it has enough.
pub(crate) fn short_of_scratch(what: &str, need: usize, have: usize) -> Option<String> {
    (have < need).then(|| {
        format!(
            "{what} through {need} bytes of f32 scratch but the step has {have}: compile the plan with the CUDA scratch rule (`CompileOptions::with_scratch(kiln_kernels::cuda::SCRATCH)`, as `Trainer` does)"
        )
    })
}
