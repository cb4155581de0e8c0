//! Device-side scalar math: the CUDA twins of `cpu::math`, and each op's value as a C expression.
//!
//! The expressions follow the CPU definitions operation for operation, so that the GPU rounds the
//! same way: no reassociation, and no fused multiply-add where the CPU rounds the product first.
//! NVRTC contracts `a * b + c` into an FMA by default (`--fmad=true`); wherever a product feeds
//! an addition, the product is written `__fmul_rn(a, b)`, which the compiler never fuses; so is
//! every expression's top-level product, since in a fused group (`elementwise::fused`) the next
//! instruction may add to it. With
//! IEEE division and square root (NVRTC's defaults without fast-math), the arithmetic ops are then
//! bitwise equal to the CPU's; `expf`, `logf`, `tanhf`, `erff` and `powf` come from CUDA's math
//! library, within 1-2 ulp of glibc's.

use super::codegen::flt;
use crate::cpu::vmath::{GELU_TANH_A, GELU_TANH_B};
use kiln_compiler::ir::{BinaryOp, ScalarOp, UnaryOp};
use std::f32::consts::{FRAC_1_SQRT_2, PI};

/// Definitions of the helper functions an expression calls (and those they call), in order.
pub(crate) fn prelude(uses: &str) -> String {
    prelude_beside(uses, "")
}

/// `prelude`, less the helpers that `defined` (source already in the translation unit) defines.
pub(crate) fn prelude_beside(uses: &str, defined: &str) -> String {
    let mut out = String::new();
    let needs = |name: &str| {
        let base = name.trim_end_matches('(');
        uses.contains(name) && !defined.contains(&format!("float {base}("))
    };
    if needs("kiln_max_nan") {
        out.push_str(
            "// max that propagates NaN (NumPy's maximum)\n\
             __device__ __forceinline__ float kiln_max_nan(float a, float b) {\n    \
             return (a > b || a != a) ? a : b;\n}\n",
        );
    }
    if needs("kiln_min_nan") {
        out.push_str(
            "__device__ __forceinline__ float kiln_min_nan(float a, float b) {\n    \
             return (a < b || a != a) ? a : b;\n}\n",
        );
    }
    if needs("kiln_uniform") {
        out.push_str(
            "// ir::uniform: SplitMix64's finaliser over seed, step and index; 24 bits in [0, 1)\n\
             __device__ __forceinline__ float kiln_uniform(unsigned long long seed, float step, unsigned long long i) {\n    \
             const unsigned long long s = step > 0.0f ? (step < 18446744073709551616.0f ? (unsigned long long)step : 0xFFFFFFFFFFFFFFFFull) : 0ull;\n    \
             unsigned long long x = seed ^ (s * 0x9E3779B97F4A7C15ull) ^ (i * 0xD1B54A32D192ED03ull);\n    \
             x ^= x >> 30;\n    x *= 0xBF58476D1CE4E5B9ull;\n    x ^= x >> 27;\n    \
             x *= 0x94D049BB133111EBull;\n    x ^= x >> 31;\n    \
             return (float)(x >> 40) * (1.0f / 16777216.0f);\n}\n",
        );
    }
    if needs("kiln_round_bf16") {
        out.push_str(
            "// x rounded to the nearest bfloat16 (ties to even), as f32; NaN kept (defined once\n\
             // per translation unit: a half kernel's types define it too, `half`)\n\
             #ifndef KILN_ROUND_BF16\n#define KILN_ROUND_BF16\n\
             __device__ __forceinline__ float kiln_round_bf16(float x) {\n    \
             unsigned int u = __float_as_uint(x);\n    \
             if ((u & 0x7fffffffu) > 0x7f800000u) return x;\n    \
             u += 0x7fffu + ((u >> 16) & 1u);\n    \
             return __uint_as_float(u & 0xffff0000u);\n}\n#endif\n",
        );
    }
    if needs("kiln_round_f16") {
        out.push_str(
            "// x rounded to the nearest IEEE half (ties to even), as f32: 10 fraction bits kept\n\
             // for normal halves, multiples of 2^-24 below 2^-14, infinity from 65520 up\n\
             #ifndef KILN_ROUND_F16\n#define KILN_ROUND_F16\n\
             __device__ __forceinline__ float kiln_round_f16(float x) {\n    \
             const unsigned int u = __float_as_uint(x), a = u & 0x7fffffffu, s = u & 0x80000000u;\n    \
             if (a >= 0x7f800000u) return x;\n    \
             if (a >= 0x477ff000u) return __uint_as_float(s | 0x7f800000u);\n    \
             if (a < 0x38800000u) {\n        \
             const float r = rintf(__uint_as_float(a) * 16777216.0f) * (1.0f / 16777216.0f);\n        \
             return __uint_as_float(s | __float_as_uint(r));\n    }\n    \
             const unsigned int r = (a + 0xfffu + ((a >> 13) & 1u)) & 0xffffe000u;\n    \
             return __uint_as_float(s | r);\n}\n#endif\n",
        );
    }
    if needs("kiln_sigmoid") {
        out.push_str(
            "// 1 / (1 + e^-x) without overflow: e^-|x| never exceeds 1\n\
             __device__ __forceinline__ float kiln_sigmoid(float x) {\n    \
             if (x >= 0.0f) {\n        return 1.0f / (1.0f + expf(-x));\n    }\n    \
             const float e = expf(x);\n    return e / (1.0f + e);\n}\n",
        );
    }
    // Helpers shared by several functions are named by their own definition, so that a
    // translation unit that defined them for one (a reduction's prologue) does not again.
    let helper = |user: &str, name: &str| uses.contains(user) && !defined.contains(&format!("float {name}("));
    if helper("kiln_gelu", "kiln_normal_cdf") {
        out.push_str(&format!(
            "// standard normal CDF\n\
             __device__ __forceinline__ float kiln_normal_cdf(float x) {{\n    \
             return __fmul_rn(0.5f, 1.0f + erff(x * {}));\n}}\n",
            flt(FRAC_1_SQRT_2)
        ));
    }
    if needs("kiln_gelu(") {
        out.push_str(
            "// exact GELU: x * Phi(x)\n\
             __device__ __forceinline__ float kiln_gelu(float x) {\n    \
             return __fmul_rn(x, kiln_normal_cdf(x));\n}\n",
        );
    }
    if needs("kiln_gelu_grad") {
        let inv_sqrt_2pi = 1.0f32 / (2.0f32 * PI).sqrt();
        out.push_str(&format!(
            "// d/dx gelu(x) = Phi(x) + x * phi(x)\n\
             __device__ __forceinline__ float kiln_gelu_grad(float x) {{\n    \
             return kiln_normal_cdf(x) + __fmul_rn(x * expf(-0.5f * x * x), {});\n}}\n",
            flt(inv_sqrt_2pi)
        ));
    }
    if helper("kiln_gtanh", "kiln_gtanh_clamp") {
        out.push_str(&format!(
            "// GELU's tanh form: x * sigmoid(2u), 2u = x * (A + B * x^2); e = e^-|2u|\n\
             __device__ __forceinline__ float kiln_gtanh_clamp(float x) {{\n    \
             return x < -20.0f ? -20.0f : (x > 20.0f ? 20.0f : x);\n}}\n\
             __device__ __forceinline__ float kiln_gtanh_u2(float c) {{\n    \
             return c * ({b} * (c * c) + {a});\n}}\n",
            a = flt(GELU_TANH_A),
            b = flt(GELU_TANH_B)
        ));
    }
    if needs("kiln_gtanh(") {
        // The CPU's form (`cpu::vmath::gelu_tanh`): x·σ(2u), 2u = x·(A + B·x²), x clamped to
        // ±20 inside (comparisons, so that NaN stays NaN).
        out.push_str(
            "__device__ __forceinline__ float kiln_gtanh(float x) {\n    \
             const float u2 = kiln_gtanh_u2(kiln_gtanh_clamp(x));\n    \
             const float e = expf(-fabsf(u2));\n    \
             const float s = u2 >= 0.0f ? 1.0f / (1.0f + e) : e / (1.0f + e);\n    \
             return (x < -20.0f ? -20.0f : x) * s;\n}\n",
        );
    }
    if needs("kiln_gtanh_grad") {
        out.push_str(&format!(
            "// d/dx x * sigmoid(2u) = s + x * s * (1 - s) * (A + 3B x^2)\n\
             __device__ __forceinline__ float kiln_gtanh_grad(float x) {{\n    \
             const float c = kiln_gtanh_clamp(x);\n    \
             const float u2 = kiln_gtanh_u2(c);\n    \
             const float e = expf(-fabsf(u2));\n    \
             const float r = 1.0f / (1.0f + e);\n    \
             const float s = u2 >= 0.0f ? r : e * r;\n    \
             return s + c * ({b3} * (c * c) + {a}) * (e * r * r);\n}}\n",
            a = flt(GELU_TANH_A),
            b3 = flt(3.0 * GELU_TANH_B)
        ));
    }
    out
}

/// `f(x)` of a unary op.
pub(crate) fn unary(op: UnaryOp, x: &str) -> String {
    match op {
        UnaryOp::Neg => format!("-{x}"),
        UnaryOp::Abs => format!("fabsf({x})"),
        UnaryOp::Sign => format!("({x} > 0.0f ? 1.0f : ({x} < 0.0f ? -1.0f : {x}))"),
        UnaryOp::Relu => format!("({x} < 0.0f ? 0.0f : {x})"),
        UnaryOp::Sigmoid => format!("kiln_sigmoid({x})"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Gelu => format!("kiln_gelu({x})"),
        UnaryOp::GeluTanh => format!("kiln_gtanh({x})"),
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Log => format!("logf({x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
        UnaryOp::Rsqrt => format!("1.0f / sqrtf({x})"),
        UnaryOp::Square => format!("__fmul_rn({x}, {x})"),
        UnaryOp::Reciprocal => format!("1.0f / {x}"),
        UnaryOp::Erf => format!("erff({x})"),
    }
}

fn flag(cond: String) -> String {
    format!("({cond} ? 1.0f : 0.0f)")
}

/// `f(a, b)` of a binary op; the gradient helpers take (forward value, upstream gradient).
pub(crate) fn binary(op: BinaryOp, a: &str, b: &str) -> String {
    match op {
        BinaryOp::Add => format!("{a} + {b}"),
        BinaryOp::Sub => format!("{a} - {b}"),
        BinaryOp::Mul => format!("__fmul_rn({a}, {b})"),
        BinaryOp::Div => format!("{a} / {b}"),
        BinaryOp::Pow => format!("powf({a}, {b})"),
        BinaryOp::Maximum => format!("kiln_max_nan({a}, {b})"),
        BinaryOp::Minimum => format!("kiln_min_nan({a}, {b})"),
        BinaryOp::Greater => flag(format!("{a} > {b}")),
        BinaryOp::GreaterEqual => flag(format!("{a} >= {b}")),
        BinaryOp::Less => flag(format!("{a} < {b}")),
        BinaryOp::LessEqual => flag(format!("{a} <= {b}")),
        BinaryOp::Equal => flag(format!("{a} == {b}")),
        BinaryOp::NotEqual => flag(format!("{a} != {b}")),
        BinaryOp::ReluGrad => format!("({a} > 0.0f ? {b} : 0.0f)"),
        BinaryOp::GeluGrad => format!("__fmul_rn({b}, kiln_gelu_grad({a}))"),
        BinaryOp::GeluTanhGrad => format!("__fmul_rn({b}, kiln_gtanh_grad({a}))"),
        BinaryOp::SigmoidGrad => format!("__fmul_rn(__fmul_rn({b}, {a}), 1.0f - {a})"),
        BinaryOp::TanhGrad => format!("__fmul_rn({b}, 1.0f - __fmul_rn({a}, {a}))"),
    }
}

/// `x op c` of a scalar op, with the CPU's special cases of `pow`.
pub(crate) fn scalar(op: ScalarOp, c: f32, x: &str) -> String {
    let k = flt(c);
    match op {
        ScalarOp::Add => format!("{x} + {k}"),
        ScalarOp::Mul => format!("__fmul_rn({x}, {k})"),
        ScalarOp::RSub => format!("{k} - {x}"),
        ScalarOp::RDiv => format!("{k} / {x}"),
        ScalarOp::Pow if c == 2.0 => format!("__fmul_rn({x}, {x})"),
        ScalarOp::Pow if c == 1.0 => x.to_string(),
        ScalarOp::Pow if c == 0.5 => format!("sqrtf({x})"),
        ScalarOp::Pow if c == -1.0 => format!("1.0f / {x}"),
        ScalarOp::Pow if c == 0.0 => "1.0f".to_string(),
        ScalarOp::Pow => format!("powf({x}, {k})"),
        ScalarOp::Max => format!("kiln_max_nan({x}, {k})"),
        ScalarOp::Min => format!("kiln_min_nan({x}, {k})"),
        ScalarOp::Greater => flag(format!("{x} > {k}")),
        ScalarOp::GreaterEqual => flag(format!("{x} >= {k}")),
        ScalarOp::Less => flag(format!("{x} < {k}")),
        ScalarOp::LessEqual => flag(format!("{x} <= {k}")),
        ScalarOp::Equal => flag(format!("{x} == {k}")),
    }
}
