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

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub enum DType {
    #[default]
    F32,
    F16,
    BF16,
    I32,
    I64,
    Bool,
}

impl DType {
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

    /// i32, i64 or bool: exact values kiln stores, indexes with and casts, but does not compute on.
    pub fn is_exact(self) -> bool {
        !self.is_float()
    }

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
