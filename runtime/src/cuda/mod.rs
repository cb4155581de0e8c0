//! The CUDA backend (cudarc, NVRTC), loaded at run time: kiln builds and runs where no CUDA is
//! installed, and says why it chose the CPU. The backend and the eager executor reach the device
//! only through `driver::Driver`: cudarc's driver, or the emulated device (`emulator`) that runs
//! the same generated kernels on the host (`KILN_CUDA_EMULATE=1`).

mod backend;
pub mod driver;
mod eager;
pub mod emulator;
pub mod nccl;
pub mod nvrtc;
pub mod probe;

pub use backend::{CudaBackend, plan_kernels};
pub use driver::{Driver, Function, Recording, headroom};
pub use eager::{CudaEager, CudaSource};
pub use emulator::{EmulatedDevice, emulate_in_process};
pub use nvrtc::{CompileStats, Image, NvrtcCompiler};
pub use probe::{CudaProbe, DeviceInfo, NvrtcInfo, probe};
