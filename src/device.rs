//! Choosing the device a model runs on.

use kiln_runtime::{Backend, CpuBackend};

/// A device to run plans on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
}

impl Device {
    pub fn cpu() -> Self {
        Device::Cpu
    }

    /// The best device present, with the reason it was chosen.
    pub fn best() -> (Self, String) {
        (Device::Cpu, "no CUDA backend in this build".into())
    }

    /// A backend for this device; `seed` seeds variable initialisation.
    pub fn backend(&self, seed: u64) -> Box<dyn Backend> {
        match self {
            Device::Cpu => Box::new(CpuBackend::new(seed)),
        }
    }
}
