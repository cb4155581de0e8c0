//! Device memory policies and accounting, shared by the backends and `Devices`.
//!
//! - `Policy::Growth`: memory is taken when needed and exactly sized — a plan's memory on a device
//!   (the variables it adds, its io region and its arena) as one allocation when it is loaded
//!   (`plan::device_block`; eager pools grow on demand).
//! - `Policy::Preallocate { fraction }`: one region of `fraction` of the device (or of its limit)
//!   is taken up front — TensorFlow's `per_process_gpu_memory_fraction`, JAX's 75% default — and
//!   every arena, io region and variable is carved from it.
//!
//! A limit caps what a device may hold. Plans are checked against it when they compile; the
//! backends check again at load (several plans share a device) and never allocate past it.
//! `Tracker` keeps each device's current and peak bytes for `Devices::memory_info`.

use crate::error::{Result, RuntimeError};
use kiln_compiler::device::human_bytes;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// How a backend takes a device's memory (see the module's doc).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Policy {
    /// Memory is allocated when needed, exactly sized: one allocation per loaded plan.
    Growth,
    /// One region is allocated up front and every arena, io region and variable is carved from it.
    Preallocate {
        /// The share of the device's limit (else of its capacity) taken up front, in `(0, 1]`.
        fraction: f64,
    },
}

impl Policy {
    /// The policy for messages: `growth` or `preallocate N%`.
    pub fn describe(&self) -> String {
        match self {
            Policy::Growth => "growth".into(),
            Policy::Preallocate { fraction } => format!("preallocate {:.0}%", fraction * 100.0),
        }
    }
}

/// What a backend may take from one (logical) device.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceBudget {
    /// The device's name, as plans name their devices (e.g. `cpu:0`, `gpu:1`): it keys its
    /// statistics in [`Tracker`].
    pub name: String,
    /// How the backend takes the device's memory.
    pub policy: Policy,
    /// The most the device may hold, if limited.
    pub limit: Option<usize>,
    /// The device's (or logical device's share of) memory.
    pub capacity: usize,
}

impl DeviceBudget {
    /// An unlimited, growing budget (a device nobody configured).
    pub fn unlimited(name: &str) -> Self {
        DeviceBudget { name: name.into(), policy: Policy::Growth, limit: None, capacity: usize::MAX }
    }

    /// The bytes available: the limit, else the capacity.
    pub fn available(&self) -> usize {
        self.limit.unwrap_or(self.capacity)
    }

    /// The region taken up front, for the preallocating policy.
    pub fn pool_bytes(&self) -> Option<usize> {
        match self.policy {
            Policy::Growth => None,
            Policy::Preallocate { fraction } => {
                // `as` saturates; rounding up must not wrap (an unlimited device's pool is then
                // refused by the allocation, with an error naming the device and the size).
                let bytes = (self.available() as f64 * fraction) as usize;
                Some(bytes.checked_next_multiple_of(256).unwrap_or(usize::MAX - 255))
            }
        }
    }
}

/// What the memory of a device is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// A plan's arena: its intermediate buffers at their planned offsets.
    Arena,
    /// A plan's io region: its inputs and outputs, when planned apart from the arena.
    Io,
    /// Persistent variables: parameters and optimizer state.
    Variable,
}

impl Purpose {
    /// The purpose for messages, with its article (`an arena`, `an io region`, `a variable`).
    pub fn name(self) -> &'static str {
        match self {
            Purpose::Arena => "an arena",
            Purpose::Io => "an io region",
            Purpose::Variable => "a variable",
        }
    }
}

/// One device's statistics (bytes), as TensorFlow's `get_memory_info` reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct MemoryInfo {
    /// Bytes held for plans and variables now, and the most since the last reset.
    pub current: usize,
    /// The most `current` has been since the tracker began or the last `reset_peak`, in bytes.
    pub peak: usize,
    /// The part of `current` claimed for arenas, in bytes.
    pub arenas: usize,
    /// The part of `current` claimed for io regions, in bytes.
    pub io: usize,
    /// The part of `current` claimed for variables, in bytes.
    pub variables: usize,
    /// Bytes taken from the device (the preallocated region, or the sum of allocations).
    pub reserved: usize,
}

/// Per-device statistics shared by every backend of a `Devices`.
#[derive(Clone, Debug, Default)]
pub struct Tracker(Arc<Mutex<BTreeMap<String, MemoryInfo>>>);

impl Tracker {
    /// Adds `bytes` claimed for `purpose` on `device` to its current figure, that purpose's figure
    /// and its peak, and `reserved` bytes newly taken from the device to its reserved figure.
    pub fn record(&self, device: &str, purpose: Purpose, bytes: usize, reserved: usize) {
        let mut map = self.0.lock().expect("tracker lock");
        let m = map.entry(device.to_string()).or_default();
        match purpose {
            Purpose::Arena => m.arenas += bytes,
            Purpose::Io => m.io += bytes,
            Purpose::Variable => m.variables += bytes,
        }
        m.current += bytes;
        m.peak = m.peak.max(m.current);
        m.reserved += reserved;
    }

    /// `device`'s statistics now (all zero for a device nothing was recorded on).
    pub fn info(&self, device: &str) -> MemoryInfo {
        self.0.lock().expect("tracker lock").get(device).copied().unwrap_or_default()
    }

    /// Starts a new peak measurement at the current figure.
    pub fn reset_peak(&self, device: &str) {
        if let Some(m) = self.0.lock().expect("tracker lock").get_mut(device) {
            m.peak = m.current;
        }
    }
}

/// Bookkeeping of one device inside a backend: what it holds, under its budget.
#[derive(Debug)]
pub struct Account {
    /// The device's name, policy, limit and capacity.
    pub budget: DeviceBudget,
    held: usize,
    /// For the preallocating policy: the pool's size and how much of it is carved.
    pool: Option<(usize, usize)>,
    tracker: Tracker,
}

impl Account {
    /// An empty account under `budget`, reporting to `tracker`. Under the preallocating policy
    /// the pool ([`DeviceBudget::pool_bytes`]) is recorded as reserved at once.
    pub fn new(budget: DeviceBudget, tracker: Tracker) -> Self {
        let pool = budget.pool_bytes().map(|b| (b, 0));
        if let Some((bytes, _)) = pool {
            tracker.record(&budget.name, Purpose::Arena, 0, bytes);
        }
        Account { budget, held: 0, pool, tracker }
    }

    /// Whether `bytes` more fit the device's limit (and its pool): an error naming the device
    /// when not. Returns the size rounded as it will be claimed. Sizes come from plans and may be
    /// anything: the arithmetic is checked.
    pub fn check(&self, bytes: usize) -> Result<usize> {
        let rounded = bytes.checked_next_multiple_of(256);
        let limit = self.budget.available();
        let over = |needed: String| {
            RuntimeError::invalid(
                format!(
                    "device {} cannot hold {needed} more: it holds {} of its {} limit",
                    self.budget.name,
                    human_bytes(self.held),
                    human_bytes(limit)
                ),
                "load fewer plans on this device, use another device, or raise its limit",
            )
        };
        let Some(bytes) = rounded.filter(|b| self.held.checked_add(*b).is_some_and(|t| t <= limit)) else {
            return Err(over(human_bytes(bytes)));
        };
        if let Some((size, top)) = self.pool
            && top.checked_add(bytes).is_none_or(|t| t > size)
        {
            return Err(RuntimeError::invalid(
                format!(
                    "device {}: the preallocated {} region has {} left, {} needed",
                    self.budget.name,
                    human_bytes(size),
                    human_bytes(size - top),
                    human_bytes(bytes)
                ),
                "preallocate a larger fraction, or use memory growth",
            ));
        }
        Ok(bytes)
    }

    /// Claims `bytes` for `purpose` (after `check`). Returns the offset in the pool for the
    /// preallocating policy.
    pub fn claim(&mut self, bytes: usize, purpose: Purpose) -> Result<Option<usize>> {
        let bytes = self.check(bytes)?;
        let offset = self.pool.as_mut().map(|(_, top)| {
            let at = *top;
            *top += bytes; // checked above
            at
        });
        self.held += bytes;
        let reserved = if self.pool.is_some() { 0 } else { bytes };
        self.tracker.record(&self.budget.name, purpose, bytes, reserved);
        Ok(offset)
    }

    /// Claims a plan's block (`plan::device_block`: its variable region, io region and arena
    /// start at `offsets`, `total` bytes in all) piece by piece for the statistics by purpose,
    /// each up to where the next begins, so that the claims add up to the allocation.
    pub fn claim_block(&mut self, offsets: [usize; 3], total: usize) -> Result<()> {
        let ends = [offsets[1], offsets[2], total];
        for (i, purpose) in [Purpose::Variable, Purpose::Io, Purpose::Arena].into_iter().enumerate() {
            self.claim(ends[i] - offsets[i], purpose)?;
        }
        Ok(())
    }

    /// The bytes claimed on the device and not released, each claim rounded up to 256 bytes.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Gives back `bytes` claimed under growth (their owner freed them), so the limit counts
    /// only what is held. Pool carvings are not given back: the pool is bump-allocated.
    pub fn release(&mut self, bytes: usize) {
        if self.pool.is_none() {
            self.held = self.held.saturating_sub(bytes);
        }
    }
}
