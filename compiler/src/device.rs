//! The devices a graph is compiled for, as the compiler sees them: plain data (the compiler
//! never touches a device). Each has a name for messages and, optionally, a memory limit that
//! every plan must fit — checked at compile time, so a planned graph never runs out of memory.

use crate::ir::DeviceId;
use serde::{Deserialize, Serialize};

/// One device a graph is compiled for: its id, name and memory limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// The device's id: what `Tracer::on_device` places ops by, and `DevicePlan::device` names.
    pub id: DeviceId,
    /// "cpu:0", "gpu:0", "gpu:0/1" (logical device 1 of GPU 0), ...
    pub name: String,
    /// Bytes the plan may hold on this device (persistent + arena); None: unlimited.
    pub memory_limit: Option<usize>,
}

impl DeviceSpec {
    /// Device `id` named `name`, without a memory limit.
    pub fn new(id: u32, name: impl Into<String>) -> Self {
        DeviceSpec { id: DeviceId(id), name: name.into(), memory_limit: None }
    }

    /// Sets the memory limit to `bytes` (what the plan may hold on the device).
    pub fn with_limit(mut self, bytes: usize) -> Self {
        self.memory_limit = Some(bytes);
        self
    }
}

/// 1536 -> "1.50 KiB": byte counts in messages.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.2} {}", UNITS[u])
}
