//! kiln-kernels: for every op of the IR, a CPU implementation (`cpu`) and, for the CUDA backend,
//! the CUDA C source that NVRTC compiles.
#![warn(missing_docs)]

mod check;
pub mod cpu;
pub mod cuda;
mod error;
mod geometry;
mod strides;

pub use error::KernelError;
