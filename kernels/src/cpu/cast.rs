//! `cast`: every element converted between f32, f16, bf16, i32, i64 and bool, one definition of
//! each conversion (`read`, `write`), shared by the CUDA kernel's host tests as the reference.
//! A half type widens to f32 exactly and f32 narrows to it rounding to nearest, ties to even
//! (the `half` crate's conversions); a half value goes to or from an integer through f32.
//!
//! f32 -> integer truncates toward zero, saturates at the type's range and maps NaN to 0 (Rust's
//! `as`; the CUDA kernel spells the same rule out, since C++'s cast is undefined there); integer
//! -> integer keeps the low bits (NumPy's `astype`); anything -> bool is `!= 0` (NaN is true);
//! bool -> number is 0 or 1; integer -> f32 rounds to nearest.

use super::par::{SendPtr, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::{DType, Shape};
use std::slice;

/// `x` rounded to the nearest value of the float type `to` (ties to even, as the `half` crate
/// converts), returned as f32: the value an f16 or bf16 buffer would hold. f32 (and any other
/// type, which fused programs never round to) is `x` itself.
#[inline(always)]
pub fn round_to(to: DType, x: f32) -> f32 {
    match to {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// The value of the bits of an element of the half type `t` (f16; bf16 for any other type).
#[inline(always)]
pub(crate) fn widen_half(t: DType, bits: u16) -> f32 {
    match t {
        DType::F16 => half::f16::from_bits(bits).to_f32(),
        _ => half::bf16::from_bits(bits).to_f32(),
    }
}

/// `src`, bits of the half type `t` (f16; bf16 for any other type), widened into `dst` (as
/// many elements as the shorter has): f16 eight at a time where the CPU converts them (F16C,
/// the `half` crate), bf16 a shift that vectorises.
#[inline]
pub(crate) fn widen_slice(t: DType, src: &[u16], dst: &mut [f32]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let n = src.len().min(dst.len());
    match t {
        DType::F16 => src[..n].reinterpret_cast::<half::f16>().convert_to_f32_slice(&mut dst[..n]),
        _ => dst.iter_mut().zip(src).for_each(|(d, &b)| *d = f32::from_bits(u32::from(b) << 16)),
    }
}

/// `src` rounded to the half type `t` (f16; bf16 for any other type), ties to even, as bits
/// into `dst` (as many elements as the shorter has).
#[inline]
pub(crate) fn narrow_slice(t: DType, src: &[f32], dst: &mut [u16]) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let n = src.len().min(dst.len());
    match t {
        DType::F16 => dst[..n].reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(&src[..n]),
        _ => dst.iter_mut().zip(src).for_each(|(d, &v)| *d = half::bf16::from_f32(v).to_bits()),
    }
}

/// `dst.len()` elements of the tensor at `p` (of type `ty`) from element `at`, widened.
///
/// # Safety
/// Elements at..at + dst.len() lie inside the tensor.
pub(crate) unsafe fn widen_into(p: *const u8, ty: DType, at: usize, dst: &mut [f32]) {
    // SAFETY: the contract.
    unsafe {
        match ty {
            DType::F16 | DType::BF16 => {
                widen_slice(ty, slice::from_raw_parts((p as *const u16).add(at), dst.len()), dst);
            }
            _ => dst.copy_from_slice(slice::from_raw_parts((p as *const f32).add(at), dst.len())),
        }
    }
}

/// `src` stored into the tensor at `p` (of type `ty`) from element `at`, rounded to it.
///
/// # Safety
/// Elements at..at + src.len() lie inside the tensor, which no other task writes there.
pub(crate) unsafe fn store_from(src: &[f32], p: *mut u8, ty: DType, at: usize) {
    // SAFETY: the contract.
    unsafe {
        match ty {
            DType::F16 | DType::BF16 => {
                narrow_slice(ty, src, slice::from_raw_parts_mut((p as *mut u16).add(at), src.len()));
            }
            _ => slice::from_raw_parts_mut((p as *mut f32).add(at), src.len()).copy_from_slice(src),
        }
    }
}

/// One element's value, widened: what every conversion goes through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    /// An `f32` element's value.
    F(f32),
    /// An `i32`, `i64` or `bool` element's value (`bool` as 0 or 1), widened to `i64`.
    I(i64),
}

impl Scalar {
    /// The value as f32: an integer rounded to nearest.
    #[inline(always)]
    pub fn float(self) -> f32 {
        match self {
            Scalar::F(f) => f,
            Scalar::I(n) => n as f32,
        }
    }
}

/// Reads element `i` of a buffer of `dtype`.
/// # Safety
/// `p` is valid for `i + 1` elements of `dtype`, aligned for it.
#[inline(always)]
pub unsafe fn read(p: *const u8, i: usize, dtype: DType) -> Scalar {
    // SAFETY: the caller's contract.
    unsafe {
        match dtype {
            DType::I32 => Scalar::I(i64::from(*(p as *const i32).add(i))),
            DType::I64 => Scalar::I(*(p as *const i64).add(i)),
            DType::Bool => Scalar::I(i64::from(*p.add(i) != 0)),
            DType::BF16 => Scalar::F(half::bf16::from_bits(*(p as *const u16).add(i)).to_f32()),
            DType::F16 => Scalar::F(half::f16::from_bits(*(p as *const u16).add(i)).to_f32()),
            DType::F32 => Scalar::F(*(p as *const f32).add(i)),
        }
    }
}

/// Writes `v` converted to `dtype` as element `i`.
/// # Safety
/// `p` is valid for `i + 1` elements of `dtype`, aligned for it.
#[inline(always)]
pub unsafe fn write(p: *mut u8, i: usize, dtype: DType, v: Scalar) {
    // SAFETY: the caller's contract.
    unsafe {
        match (dtype, v) {
            (DType::I32, Scalar::F(f)) => *(p as *mut i32).add(i) = f as i32,
            (DType::I32, Scalar::I(n)) => *(p as *mut i32).add(i) = n as i32,
            (DType::I64, Scalar::F(f)) => *(p as *mut i64).add(i) = f as i64,
            (DType::I64, Scalar::I(n)) => *(p as *mut i64).add(i) = n,
            (DType::Bool, Scalar::F(f)) => *p.add(i) = u8::from(f != 0.0),
            (DType::Bool, Scalar::I(n)) => *p.add(i) = u8::from(n != 0),
            (DType::BF16, v) => *(p as *mut u16).add(i) = half::bf16::from_f32(v.float()).to_bits(),
            (DType::F16, v) => *(p as *mut u16).add(i) = half::f16::from_f32(v.float()).to_bits(),
            (DType::F32, v) => *(p as *mut f32).add(i) = v.float(),
        }
    }
}

struct Cast {
    from: DType,
    to: DType,
    numel: usize,
    desc: String,
}

/// The cast of `x` (of `from`) to `to`, any two of the types.
pub(crate) fn cast(x: &Shape, from: DType, to: DType) -> Box<dyn CpuKernel> {
    let desc = format!("cast {from}{} to {to}", shape_text(x));
    Box::new(Cast { from, to, numel: x.numel(), desc })
}

impl CpuKernel for Cast {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (x, y) = (SendPtr::new(inputs[0]), SendPtr::new(output));
        par_ranges(self.numel, 1, |s, e| {
            for i in s..e {
                // SAFETY: both buffers hold `numel` elements of their dtypes, aligned (the
                // caller's contract); tasks write disjoint ranges; a cast never runs in place.
                unsafe { write(y.get(), i, self.to, read(x.get(), i, self.from)) }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
