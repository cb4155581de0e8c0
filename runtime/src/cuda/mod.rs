//! The CUDA backend (cudarc, NVRTC), loaded at run time: kiln builds and runs where no CUDA is
//! installed, and says why it chose the CPU.

mod backend;
mod eager;
pub mod nvrtc;
pub mod probe;

pub use backend::{CudaBackend, plan_kernels};
pub use eager::{CudaEager, CudaSource};
pub use nvrtc::{CompileStats, NvrtcCompiler};
pub use probe::{CudaProbe, DeviceInfo, NvrtcInfo, probe};
