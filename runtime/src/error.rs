//! The runtime's one error type.

use kiln_compiler::CompileError;
use kiln_compiler::ir::{DType, Shape};
use kiln_kernels::cpu::KernelError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Compile(Box<CompileError>),

    #[error(transparent)]
    Kernel(#[from] KernelError),

    #[error(transparent)]
    Alloc(Box<crate::alloc::AllocError>),

    #[error("input `{name}` expects {expected_dtype}{expected} but got {dtype}{got}\n  help: {help}")]
    InputShape {
        name: String,
        expected: Shape,
        expected_dtype: DType,
        got: Shape,
        dtype: DType,
        help: String,
    },

    /// The CUDA driver or NVRTC refused or is missing.
    #[error("CUDA: {0}")]
    Cuda(String),

    #[error("{what}\n  help: {help}")]
    Invalid { what: String, help: String },

    #[error(
        "variable `{key}` exists with shape {existing} but the plan declares {requested}\n  help: {help}"
    )]
    VariableShape { key: String, existing: Shape, requested: Shape, help: String },
}

impl From<CompileError> for RuntimeError {
    fn from(e: CompileError) -> Self {
        RuntimeError::Compile(Box::new(e))
    }
}

impl From<crate::alloc::AllocError> for RuntimeError {
    fn from(e: crate::alloc::AllocError) -> Self {
        RuntimeError::Alloc(Box::new(e))
    }
}

impl RuntimeError {
    pub fn invalid(what: impl Into<String>, help: impl Into<String>) -> Self {
        RuntimeError::Invalid { what: what.into(), help: help.into() }
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
