//! The runtime's one error type.

use kiln_compiler::CompileError;
use kiln_compiler::ir::{DType, Shape};
use kiln_kernels::cpu::KernelError;
use thiserror::Error;

/// Why loading or running a plan, an eager graph or a trainer failed. Every message says what
/// went wrong and, on a `help:` line, what to do.
#[derive(Debug, Error)]
pub enum RuntimeError {
    /// Building a graph or compiling it into a plan failed ([`Trainer`](crate::Trainer) compiles
    /// its plans on demand).
    #[error(transparent)]
    Compile(Box<CompileError>),

    /// No kernel could be prepared for a step of a plan being loaded (`kiln_kernels`).
    #[error(transparent)]
    Kernel(#[from] KernelError),

    /// A growth allocator of the eager baseline ([`crate::alloc`]) could not serve a request.
    #[error(transparent)]
    Alloc(Box<crate::alloc::AllocError>),

    /// A tensor fed or bound to an input has another shape or dtype than the input declares.
    #[error("input `{name}` expects {expected_dtype}{expected} but got {dtype}{got}\n  help: {help}")]
    InputShape {
        /// The input's name in the plan or graph.
        name: String,
        /// The shape the input was declared (compiled or traced) with.
        expected: Shape,
        /// The dtype the input was declared with.
        expected_dtype: DType,
        /// The shape of the tensor that was passed.
        got: Shape,
        /// The dtype of the tensor that was passed.
        dtype: DType,
        /// What to do: feed the declared dtype, or compile a plan for this shape.
        help: String,
    },

    /// The CUDA driver or NVRTC refused or is missing.
    #[error("CUDA: {0}")]
    Cuda(String),

    /// A call the runtime cannot honour as made: an unknown program, input or variable, a
    /// misuse of the API, a device or option that is not available (see `what`).
    #[error("{what}\n  help: {help}")]
    Invalid {
        /// What is wrong, naming the values involved.
        what: String,
        /// What to do instead (may be empty).
        help: String,
    },

    /// A plan handed to a backend broke an invariant that its execution relies on.
    #[error(
        "plan {plan:?} is invalid: {reason}\n  help: load plans as `compile` makes them (a plan edited or built by hand must keep every buffer inside its region, no two live buffers overlapping, and every step's values of the shapes its op produces)"
    )]
    InvalidPlan {
        /// The plan's name (`Plan::name`).
        plan: String,
        /// The invariant it breaks, as `kiln_compiler::validate` reports it.
        reason: String,
    },

    /// Memory could not be had from the machine or the device.
    #[error("{device}: cannot allocate {bytes} bytes for {what}{detail}\n  help: {help}")]
    OutOfMemory {
        /// The device or machine that refused, as the backend describes it.
        device: String,
        /// The size of the refused request, in bytes.
        bytes: usize,
        /// What the memory was for (e.g. a plan's arena and io region, the preallocated pool).
        what: String,
        /// More context (which device, the driver's reason), starting with its own separator;
        /// empty when there is none.
        detail: String,
        /// What to do: a smaller batch or model, a memory limit, a smaller pool.
        help: String,
    },

    /// Guard mode (`crate::guard`): a step wrote into the canary after a slot.
    #[error(transparent)]
    GuardOverrun(Box<crate::guard::Overrun>),

    /// A plan declares, or a write gives, a variable another shape or dtype than the one it
    /// already has: variables keep their shape and dtype for the backend's life.
    #[error(
        "variable `{key}` exists with shape {existing} but the plan declares {requested}\n  help: {help}"
    )]
    VariableShape {
        /// The variable's key (its name in the store).
        key: String,
        /// The shape the variable already has.
        existing: Shape,
        /// The shape the plan declares, or the shape of the tensor written to it.
        requested: Shape,
        /// What to do about it.
        help: String,
    },
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

    /// A [`RuntimeError::Invalid`] saying `what` is wrong and `help` what to do.
    pub fn invalid(what: impl Into<String>, help: impl Into<String>) -> Self {
        RuntimeError::Invalid { what: what.into(), help: help.into() }
    }

    /// A plan names device `name`, which a backend built for the devices `known` does not have.
    pub fn unknown_device<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> Self {
        let known: Vec<&str> = known.collect();
        RuntimeError::invalid(
            format!(
                "the plan uses device `{name}`, which this backend does not have (its devices: {})",
                known.join(", ")
            ),
            "compile the plan for the backend's devices (`Devices::compile_options`, or \
             `CompileOptions::device` with one of the names above): a backend runs a plan only on \
             the devices, and within the limits, it was built for",
        )
    }
}

/// The result of the runtime's calls: [`RuntimeError`] unless another error type is named.
pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
