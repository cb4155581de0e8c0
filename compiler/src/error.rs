//! The compiler's one error type. Every user mistake names the op, the shapes involved and the
//! caller's line, and says what to do.

use crate::ir::SourceLoc;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum CompileError {
    /// An op rejected its operands while the model was traced.
    #[error("`{op}` at {location}: {message}\n  operands: {operands}\n  help: {help}")]
    Op { op: String, location: SourceLoc, message: String, operands: String, help: String },

    /// A variable was declared twice with different shapes.
    #[error(
        "variable `{key}` at {location} is declared with shape {shape} but already exists with shape {existing}\n  help: {help}"
    )]
    VariableShape { key: String, location: SourceLoc, shape: String, existing: String, help: String },

    /// The model, loss or optimizer was used in a way the compiler cannot lower.
    #[error("{what}\n  help: {help}")]
    Invalid { what: String, help: String },

    /// The plan does not fit a device's memory limit (checked before anything runs).
    #[error("{0}")]
    OutOfMemory(Box<crate::limits::OutOfMemory>),

    /// Something the compiler does not implement yet.
    #[error("not supported: {what}\n  help: {help}")]
    Unsupported { what: String, help: String },

    /// A broken invariant inside kiln: a bug, not a user mistake.
    #[error("internal compiler error: {0}")]
    Internal(String),
}

impl CompileError {
    pub fn invalid(what: impl Into<String>, help: impl Into<String>) -> Self {
        CompileError::Invalid { what: what.into(), help: help.into() }
    }

    pub fn unsupported(what: impl Into<String>, help: impl Into<String>) -> Self {
        CompileError::Unsupported { what: what.into(), help: help.into() }
    }
}

pub type Result<T, E = CompileError> = std::result::Result<T, E>;
