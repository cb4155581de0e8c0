//! kiln: a graph-mode tensor compiler with static memory planning.
//!
//! Models are written in a Rust DSL (`Tracer`, `Tensor` with operators, Keras-like layers),
//! traced into a dataflow graph, differentiated, and compiled into a `Plan` that gives every
//! intermediate tensor a fixed offset in one arena per device. Backends execute plans.
//!
//! ```
//! use kiln::prelude::*;
//!
//! let t = Tracer::new("affine");
//! let x = t.input("x", [4, 3]);
//! let w = t.param("w", [3, 2], Init::GlorotUniform);
//! let y = (x.matmul(&w) + 1.0).relu();
//! t.output("y", &y);
//! let plan = compile(t.finish()?, &CompileOptions::default())?;
//! assert!(plan.memory.arena_bytes >= plan.memory.lower_bound_bytes);
//! # Ok::<(), kiln::Error>(())
//! ```
#![warn(missing_docs)]

pub mod autocast_reference;
pub mod compare;
pub mod device;
mod error;
pub mod examples;
pub mod gpt;
pub mod gpu_bench;
pub mod onnx;
pub mod peers;
pub mod remat;
pub mod report;
pub mod results;
pub mod seed;
pub mod svg;
pub mod torch_stream;
pub mod zero_table;
pub mod zoo;

pub use device::Device;
pub use error::{Error, Result};
pub use kiln_comm as comm;
pub use kiln_compiler as compiler;
pub use kiln_kernels as kernels;
pub use kiln_runtime as runtime;

/// The names most programs need: `use kiln::prelude::*;`.
pub mod prelude {
    pub use crate::device::Device;
    pub use crate::error::{Error, Result};
    pub use kiln_compiler::ir::{DType, Init, Padding, Shape};
    pub use kiln_compiler::losses::{Loss, Metric};
    pub use kiln_compiler::nn::{Activation, Dense, Layer, Sequential};
    pub use kiln_compiler::optim::{Adam, Optimizer, Sgd};
    pub use kiln_compiler::placement::{Placed, split_sequential};
    pub use kiln_compiler::step::{InputSpec, TrainConfig};
    pub use kiln_compiler::trace::{Tensor, Tracer};
    pub use kiln_compiler::zero::ZeroStage;
    pub use kiln_compiler::{CompileOptions, Plan, Precision, compile};
    pub use kiln_runtime::devices::{DeviceConfig, Devices, GB, MB};
    pub use kiln_runtime::{Backend, CpuBackend, FitOptions, History, HostTensor, Trainer};
}

/// The README's and the book's code blocks run as doctests, so neither can drift from the API.
#[cfg(doctest)]
mod docs {
    #[doc = include_str!("../README.md")]
    struct Readme;
    macro_rules! book {
        ($($name:ident = $file:literal),* $(,)?) => {
            $(#[doc = include_str!(concat!("../docs/src/", $file))] struct $name;)*
        };
    }
    book! {
        Introduction = "introduction.md",
        GettingStarted = "getting-started.md",
        Dsl = "dsl.md",
        Training = "training.md",
        MemoryPlanning = "memory-planning.md",
        Precision = "precision.md",
        Devices = "devices.md",
        Onnx = "onnx.md",
        Gpu = "gpu.md",
        CustomOps = "custom-ops.md",
        ManyDevices = "many-devices.md",
        Benchmarks = "benchmarks.md",
        Architecture = "architecture.md",
    }
}
