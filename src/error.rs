use thiserror::Error;

/// kiln's one error type: compile-time mistakes (shapes, dtypes, memory limits) and run-time ones.
#[derive(Debug, Error)]
pub enum Error {
    #[error(transparent)]
    Compile(Box<kiln_compiler::CompileError>),
    #[error(transparent)]
    Runtime(#[from] kiln_runtime::RuntimeError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl From<kiln_compiler::CompileError> for Error {
    fn from(e: kiln_compiler::CompileError) -> Self {
        Error::Compile(Box::new(e))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
