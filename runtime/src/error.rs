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

    /// A plan handed to a backend broke an invariant that its execution relies on.
    #[error(
        "plan {plan:?} is invalid: {reason}\n  help: load plans as `compile` makes them (a plan edited or built by hand must keep every buffer inside its region, no two live buffers overlapping, and every step's values of the shapes its op produces)"
    )]
    InvalidPlan { plan: String, reason: String },

    /// Memory could not be had from the machine or the device.
    #[error("{device}: cannot allocate {bytes} bytes for {what}{detail}\n  help: {help}")]
    OutOfMemory { device: String, bytes: usize, what: String, detail: String, help: String },

    /// Guard mode (`crate::guard`): a step wrote into the canary after a slot.
    #[error(transparent)]
    GuardOverrun(Box<crate::guard::Overrun>),

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
    /// Validates a plan at a backend's door (`kiln_compiler::validate`).
    pub fn check_plan(plan: &kiln_compiler::Plan) -> Result<()> {
        kiln_compiler::validate::validate(plan)
            .map_err(|reason| RuntimeError::InvalidPlan { plan: plan.name.clone(), reason })
    }

    pub fn invalid(what: impl Into<String>, help: impl Into<String>) -> Self {
        RuntimeError::Invalid { what: what.into(), help: help.into() }
    }
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
