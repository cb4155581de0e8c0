use thiserror::Error;

/// kiln's one error type: compile-time mistakes (shapes, dtypes, memory limits) and run-time ones.
#[derive(Debug, Error)]
pub enum Error {
    /// Building, checking or planning a graph failed: a shape or dtype mistake, an unsupported
    /// op or model file, a plan over a device's memory limit.
    #[error(transparent)]
    Compile(Box<kiln_compiler::CompileError>),
    /// Running a plan failed: no usable device, a kernel, allocation, collective or
    /// variable-transfer error from a backend.
    #[error(transparent)]
    Runtime(#[from] kiln_runtime::RuntimeError),
    /// Reading or writing a file (a model, a picture, a report) failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<kiln_compiler::CompileError> for Error {
    fn from(e: kiln_compiler::CompileError) -> Self {
        Error::Compile(Box::new(e))
    }
}

/// kiln's result type: `E` is [`enum@Error`] unless given.
pub type Result<T, E = Error> = std::result::Result<T, E>;
