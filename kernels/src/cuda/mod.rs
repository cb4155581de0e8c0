//! CUDA C source for every op (placeholder interface; the generator replaces this file).

use crate::KernelError;
use kiln_compiler::ir::{DType, Op, Shape};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudaKernel {
    pub source: String,
    pub launches: Vec<Launch>,
    pub describe: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Launch {
    pub function: String,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_bytes: u32,
    pub args: Vec<Arg>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    Input(usize),
    Output,
}

pub fn generate(
    op: &Op,
    _inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<CudaKernel, KernelError> {
    Err(KernelError::Unsupported { op: op.label(), dtype: output.1, help: "placeholder".into() })
}
