//! kiln-runtime: backends that execute plans, the eager executor, and its growth allocators.
//!
//! - `backend`: the interface every device offers (load a plan once, run it many times);
//! - `cpu`: the CPU backend (host arena, rayon kernels);
//! - `guard`: guard mode's canaries, filled and checked by both backends;
//! - `store`, `init`: persistent variables and their initialisers;
//! - `trainer`: Keras-like `fit` / `predict` over plans compiled per input shape and cached;
//! - `alloc`: TensorFlow's BFC and PyTorch's caching allocator, for the eager baseline.
#![warn(missing_docs)]

pub mod alloc;
pub mod backend;
pub mod checkpoint;
pub mod collective;
pub mod cpu;
pub mod cuda;
pub mod devices;
pub mod dlpack;
pub mod eager;
pub mod error;
pub mod guard;
mod host_buffer;
pub mod init;
pub mod memory;
pub mod owned_memory;
pub mod reference;
pub mod store;
pub mod tensor;
pub mod trainer;
pub mod visible;

pub use backend::{Backend, ProgramId, StepTime};
pub use cpu::CpuBackend;
pub use error::{Result, RuntimeError};
pub use tensor::HostTensor;
pub use trainer::{FitOptions, History, Trainer};
