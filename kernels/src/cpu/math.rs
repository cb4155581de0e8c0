//! Scalar math shared by the elementwise, reduction and pooling kernels: the one definition of
//! each op's value, so that every kernel computes the same thing.

use std::f32::consts::{FRAC_1_SQRT_2, PI};

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

/// Φ(x), the standard normal CDF.
#[inline(always)]
pub(crate) fn normal_cdf(x: f32) -> f32 {
    0.5 * (1.0 + libm::erff(x * FRAC_1_SQRT_2))
}

/// Exact GELU: x·Φ(x).
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    x * normal_cdf(x)
}

/// d/dx gelu(x) = Φ(x) + x·φ(x).
#[inline(always)]
pub(crate) fn gelu_derivative(x: f32) -> f32 {
    let inv_sqrt_2pi = 1.0 / (2.0 * PI).sqrt();
    normal_cdf(x) + x * (-0.5 * x * x).exp() * inv_sqrt_2pi
}
