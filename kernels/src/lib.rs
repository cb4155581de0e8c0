//! kiln-kernels: for every op of the IR, a CPU implementation (`cpu`) and, for the CUDA backend,
//! the CUDA C source that NVRTC compiles.

pub mod cpu;
mod error;

pub use error::KernelError;
