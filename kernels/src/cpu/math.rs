//! Scalar math shared by the elementwise, reduction and pooling kernels: the one definition of
//! each op's value, so that every kernel computes the same thing.

/// max that propagates NaN (as NumPy's `maximum`), so that a diverging model shows up.
#[inline(always)]
pub(crate) fn max_nan(a: f32, b: f32) -> f32 {
    if a > b || a.is_nan() { a } else { b }
}

#[inline(always)]
pub(crate) fn min_nan(a: f32, b: f32) -> f32 {
    if a < b || a.is_nan() { a } else { b }
}

#[inline(always)]
pub(crate) fn flag(b: bool) -> f32 {
    if b { 1.0 } else { 0.0 }
}

#[inline(always)]
pub(crate) fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x // ±0 and NaN
    }
}

/// max(x, 0) that keeps NaN.
#[inline(always)]
pub(crate) fn relu(x: f32) -> f32 {
    if x < 0.0 { 0.0 } else { x }
}

/// 1 / (1 + e^-x) without overflow: e^-|x| never exceeds 1 (`vmath`).
#[inline(always)]
pub(crate) fn sigmoid(x: f32) -> f32 {
    super::vmath::sigmoid(x)
}

/// Exact GELU: x·Φ(x) (`vmath`: Φ from the Gaussian tail, accurate in both tails).
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    super::vmath::gelu(x)
}

/// d/dx gelu(x) = Φ(x) + x·φ(x).
#[inline(always)]
pub(crate) fn gelu_derivative(x: f32) -> f32 {
    super::vmath::gelu_derivative(x)
}

/// GELU's tanh approximation (`vmath`: x·σ(2u), one exp).
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    super::vmath::gelu_tanh(x)
}

#[inline(always)]
pub(crate) fn gelu_tanh_derivative(x: f32) -> f32 {
    super::vmath::gelu_tanh_derivative(x)
}

/// Evaluates `$body` with `$f` bound to the scalar function of unary op `$op`: the one
/// definition of every unary op's value on the CPU, read by the single-op kernels and by fused
/// groups alike (so that a fused group computes the unfused bits). Each arm binds its own
/// closure, so that `$body` is compiled, and vectorised, once per op.
macro_rules! with_unary {
    ($op:expr, |$f:ident| $body:expr) => {{
        use kiln_compiler::ir::UnaryOp;
        use $crate::cpu::math::*;
        use $crate::cpu::vmath;
        match $op {
            UnaryOp::Neg => {
                let $f = |v: f32| -v;
                $body
            }
            UnaryOp::Abs => {
                let $f = f32::abs;
                $body
            }
            UnaryOp::Sign => {
                let $f = sign;
                $body
            }
            UnaryOp::Relu => {
                let $f = relu;
                $body
            }
            UnaryOp::Sigmoid => {
                let $f = sigmoid;
                $body
            }
            UnaryOp::Tanh => {
                let $f = vmath::tanh;
                $body
            }
            UnaryOp::Gelu => {
                let $f = gelu;
                $body
            }
            UnaryOp::GeluTanh => {
                let $f = gelu_tanh;
                $body
            }
            UnaryOp::Exp => {
                let $f = vmath::exp;
                $body
            }
            UnaryOp::Log => {
                let $f = vmath::ln;
                $body
            }
            UnaryOp::Sqrt => {
                let $f = f32::sqrt;
                $body
            }
            UnaryOp::Rsqrt => {
                let $f = |v: f32| 1.0 / v.sqrt();
                $body
            }
            UnaryOp::Square => {
                let $f = |v: f32| v * v;
                $body
            }
            UnaryOp::Reciprocal => {
                let $f = |v: f32| 1.0 / v;
                $body
            }
            UnaryOp::Erf => {
                let $f = vmath::erf;
                $body
            }
        }
    }};
}

/// As `with_unary`, for `x op c` of scalar op `$op` with the constant `$c` (pow's special cases
/// of `c` included).
macro_rules! with_scalar {
    ($op:expr, $c:expr, |$f:ident| $body:expr) => {{
        use kiln_compiler::ir::ScalarOp;
        use $crate::cpu::math::*;
        let c: f32 = $c;
        match $op {
            ScalarOp::Add => {
                let $f = move |v: f32| v + c;
                $body
            }
            ScalarOp::Mul => {
                let $f = move |v: f32| v * c;
                $body
            }
            ScalarOp::RSub => {
                let $f = move |v: f32| c - v;
                $body
            }
            ScalarOp::RDiv => {
                let $f = move |v: f32| c / v;
                $body
            }
            ScalarOp::Pow if c == 2.0 => {
                let $f = |v: f32| v * v;
                $body
            }
            ScalarOp::Pow if c == 1.0 => {
                let $f = |v: f32| v;
                $body
            }
            ScalarOp::Pow if c == 0.5 => {
                let $f = f32::sqrt;
                $body
            }
            ScalarOp::Pow if c == -1.0 => {
                let $f = |v: f32| 1.0 / v;
                $body
            }
            ScalarOp::Pow if c == 0.0 => {
                let $f = |_: f32| 1.0f32;
                $body
            }
            ScalarOp::Pow => {
                let $f = move |v: f32| v.powf(c);
                $body
            }
            ScalarOp::Max => {
                let $f = move |v: f32| max_nan(v, c);
                $body
            }
            ScalarOp::Min => {
                let $f = move |v: f32| min_nan(v, c);
                $body
            }
            ScalarOp::Greater => {
                let $f = move |v: f32| flag(v > c);
                $body
            }
            ScalarOp::GreaterEqual => {
                let $f = move |v: f32| flag(v >= c);
                $body
            }
            ScalarOp::Less => {
                let $f = move |v: f32| flag(v < c);
                $body
            }
            ScalarOp::LessEqual => {
                let $f = move |v: f32| flag(v <= c);
                $body
            }
            ScalarOp::Equal => {
                let $f = move |v: f32| flag(v == c);
                $body
            }
        }
    }};
}

/// As `with_unary`, for binary op `$op`; the gradient helpers take (forward value, upstream
/// gradient).
macro_rules! with_binary {
    ($op:expr, |$f:ident| $body:expr) => {{
        use kiln_compiler::ir::BinaryOp;
        use $crate::cpu::math::*;
        match $op {
            BinaryOp::Add => {
                let $f = |x: f32, y: f32| x + y;
                $body
            }
            BinaryOp::Sub => {
                let $f = |x: f32, y: f32| x - y;
                $body
            }
            BinaryOp::Mul => {
                let $f = |x: f32, y: f32| x * y;
                $body
            }
            BinaryOp::Div => {
                let $f = |x: f32, y: f32| x / y;
                $body
            }
            BinaryOp::Pow => {
                let $f = f32::powf;
                $body
            }
            BinaryOp::Maximum => {
                let $f = max_nan;
                $body
            }
            BinaryOp::Minimum => {
                let $f = min_nan;
                $body
            }
            BinaryOp::Greater => {
                let $f = |x: f32, y: f32| flag(x > y);
                $body
            }
            BinaryOp::GreaterEqual => {
                let $f = |x: f32, y: f32| flag(x >= y);
                $body
            }
            BinaryOp::Less => {
                let $f = |x: f32, y: f32| flag(x < y);
                $body
            }
            BinaryOp::LessEqual => {
                let $f = |x: f32, y: f32| flag(x <= y);
                $body
            }
            BinaryOp::Equal => {
                let $f = |x: f32, y: f32| flag(x == y);
                $body
            }
            BinaryOp::NotEqual => {
                let $f = |x: f32, y: f32| flag(x != y);
                $body
            }
            BinaryOp::ReluGrad => {
                let $f = |x: f32, dy: f32| if x > 0.0 { dy } else { 0.0 };
                $body
            }
            BinaryOp::GeluGrad => {
                let $f = |x: f32, dy: f32| dy * gelu_derivative(x);
                $body
            }
            BinaryOp::GeluTanhGrad => {
                let $f = |x: f32, dy: f32| dy * gelu_tanh_derivative(x);
                $body
            }
            BinaryOp::SigmoidGrad => {
                let $f = |y: f32, dy: f32| dy * y * (1.0 - y);
                $body
            }
            BinaryOp::TanhGrad => {
                let $f = |y: f32, dy: f32| dy * (1.0 - y * y);
                $body
            }
        }
    }};
}

pub(crate) use {with_binary, with_scalar, with_unary};
