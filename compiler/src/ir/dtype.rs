//! Element types. kiln computes in f32; f16 and bf16 are part of the type so that graphs, plans
//! and byte counts already carry them, and a backend that has no kernel for a type says so.
//!
//! Integers and booleans (i32, i64, bool) are storage types with exact values: token and class
//! ids, masks. They are fed and read back as themselves, planned at their own size (an i64 id
//! takes 8 bytes, a bool mask 1), gather and embedding lookups index with them, `cast` converts
//! between any two of f32, i32, i64 and bool, and layout views (reshape) keep them. Arithmetic is
//! f32: an op that computes on an integer or bool operand is an error naming the op, the dtypes and
//! the cast that fixes it.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The element type of a tensor: what a node's output, an input or a variable holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum DType {
    /// 32-bit IEEE float: the type kiln computes in, and the default.
    #[default]
    F32,
    /// 16-bit IEEE half float (2 bytes).
    F16,
    /// 16-bit bfloat16, f32's exponent range with an 8-bit significand (2 bytes).
    BF16,
    /// 32-bit signed integer: ids stored exactly.
    I32,
    /// 64-bit signed integer: ids stored exactly (8 bytes).
    I64,
    /// A boolean mask, one byte per element (0 or 1).
    Bool,
}

impl DType {
    /// Bytes of one element: what the planner counts per element of a buffer of this type.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I64 => 8,
            DType::Bool => 1,
        }
    }

    /// f32, f16 or bf16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// f16 or bf16: a half type, stored in 2 bytes and computed in f32.
    pub fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// The type a product of two values of this type is accumulated and stored in: f32 for a
    /// half type (tensor cores and CPU kernels alike sum half products in f32, and the value
    /// is kept so, rounded once where a reader computes in half), else the type itself.
    pub fn accumulated(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        }
    }

    /// i32, i64 or bool: exact values kiln stores, indexes with and casts, but does not compute on.
    pub fn is_exact(self) -> bool {
        !self.is_float()
    }

    /// The lower-case name (`f32`, `bf16`, `bool`) that dumps, plans and error messages print.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::Bool => "bool",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
