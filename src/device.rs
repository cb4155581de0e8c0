//! Choosing the device a model runs on.

use crate::error::Result;
use kiln_runtime::cuda::{CudaBackend, probe};
use kiln_runtime::{Backend, CpuBackend};

/// A device to run plans on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Device {
    /// The host CPU, running plans on [`CpuBackend`].
    Cpu,
    /// CUDA device by ordinal.
    Cuda(usize),
}

impl Device {
    /// The CPU device ([`Device::Cpu`]), always available.
    pub fn cpu() -> Self {
        Device::Cpu
    }

    /// The first CUDA device when one works (driver, device and NVRTC present), else the CPU;
    /// with the reason for the choice.
    /// Only visible GPUs count (`kiln_runtime::visible`).
    pub fn best() -> (Self, String) {
        let p = probe();
        match p.usable() {
            Ok(_) => {
                let visible =
                    p.devices.iter().flatten().find(|d| kiln_runtime::visible::is_visible(d.ordinal));
                match visible {
                    Some(d) => {
                        let (major, minor) = d.compute_capability;
                        (Device::Cuda(d.ordinal), format!("{} (sm_{major}{minor}) found", d.name))
                    }
                    None => (
                        Device::Cpu,
                        format!(
                            "no visible CUDA device (visible: {})",
                            kiln_runtime::visible::visible_description()
                        ),
                    ),
                }
            }
            Err(why) => (Device::Cpu, format!("no CUDA: {why}")),
        }
    }

    /// A backend for this device; `seed` seeds variable initialisation.
    pub fn backend(&self, seed: u64) -> Result<Box<dyn Backend>> {
        Ok(match self {
            Device::Cpu => Box::new(CpuBackend::new(seed)),
            Device::Cuda(ordinal) => Box::new(CudaBackend::new(*ordinal, seed)?),
        })
    }

    /// A backend on this device that is one rank of a data-parallel run through `comm` (on a
    /// CUDA device, its collectives staged through host memory: every in-process rank may share
    /// the one GPU).
    pub fn rank_backend(
        &self,
        seed: u64,
        comm: impl kiln_comm::Communicator + 'static,
    ) -> Result<Box<dyn Backend>> {
        Ok(match self {
            Device::Cpu => Box::new(CpuBackend::new(seed).with_communicator(comm)),
            Device::Cuda(ordinal) => Box::new(CudaBackend::new(*ordinal, seed)?.with_communicator(comm)),
        })
    }
}

/// The best device present (`Device::best`); `Device::best().1` says why it was chosen.
impl Default for Device {
    fn default() -> Self {
        Device::best().0
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}
