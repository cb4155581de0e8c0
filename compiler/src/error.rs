//! The compiler's one error type. Every user mistake names the op, the shapes involved and the
//! caller's line, and says what to do.

use crate::ir::SourceLoc;
use thiserror::Error;

/// Why tracing, compiling or planning a model failed.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum CompileError {
    /// An op rejected its operands while the model was traced.
    #[error("`{op}` at {location}: {message}\n  operands: {operands}\n  help: {help}")]
    Op {
        /// The op's name (`matmul`, `conv2d`, ...), or the layer kind for a layer's options.
        op: String,
        /// The user's source line that traced the op.
        location: SourceLoc,
        /// What is wrong with the operands or options.
        message: String,
        /// Every operand's dtype and shape (`f32[2, 3], f32[4, 5]`), or "none".
        operands: String,
        /// What to do about it.
        help: String,
    },

    /// A variable was declared twice with different shapes.
    #[error(
        "variable `{key}` at {location} is declared with shape {shape} but already exists with shape {existing}\n  help: {help}"
    )]
    VariableShape {
        /// The variable's key.
        key: String,
        /// The user's source line of the second declaration.
        location: SourceLoc,
        /// The shape that declaration asked for.
        shape: String,
        /// The shape the variable already has.
        existing: String,
        /// What to do about it.
        help: String,
    },

    /// The model, loss or optimizer was used in a way the compiler cannot lower.
    #[error("{what}\n  help: {help}")]
    Invalid {
        /// What was used wrongly, and how.
        what: String,
        /// What to do about it.
        help: String,
    },

    /// The plan does not fit a device's memory limit (checked before anything runs).
    #[error("{0}")]
    OutOfMemory(Box<crate::limits::OutOfMemory>),

    /// Something the compiler does not implement yet.
    #[error("not supported: {what}\n  help: {help}")]
    Unsupported {
        /// The feature or combination asked for.
        what: String,
        /// What to do instead.
        help: String,
    },

    /// A broken invariant inside kiln: a bug, not a user mistake.
    #[error("internal compiler error: {0}")]
    Internal(String),
}

impl CompileError {
    /// A `CompileError::Invalid` from its two messages.
    pub fn invalid(what: impl Into<String>, help: impl Into<String>) -> Self {
        CompileError::Invalid { what: what.into(), help: help.into() }
    }

    /// A `CompileError::Unsupported` from its two messages.
    pub fn unsupported(what: impl Into<String>, help: impl Into<String>) -> Self {
        CompileError::Unsupported { what: what.into(), help: help.into() }
    }
}

/// The compiler's result type: `CompileError` unless another error is named.
pub type Result<T, E = CompileError> = std::result::Result<T, E>;
