//! CPU kernels (placeholder interface; the real kernels replace this file).

use kiln_compiler::ir::{DType, Op, Shape};

#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("no CPU kernel for `{op}` on {dtype}: {help}")]
    Unsupported { op: String, dtype: DType, help: String },
    #[error("`{op}`: {message}")]
    Shape { op: String, message: String },
}

pub trait CpuKernel: Send + Sync {
    /// # Safety
    /// See the real kernels' documentation.
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8);
    fn describe(&self) -> String;
}

pub fn prepare(
    op: &Op,
    _inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    Err(KernelError::Unsupported { op: op.name().into(), dtype: output.1, help: "placeholder".into() })
}
