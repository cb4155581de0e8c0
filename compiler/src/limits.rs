//! Memory limits, checked at compile time: a plan that does not fit a device's limit is an error
//! that names the device, its limit, what the plan needs (persistent + arena, and the lower
//! bound), the step where memory peaks with the largest tensors live there, and what would
//! help. A plan that compiles never runs out of memory at run time.

use crate::device::human_bytes;
use crate::plan::{Plan, Storage};
use std::fmt;

/// What a plan needs on one device and why it does not fit.
#[derive(Clone, Debug, PartialEq)]
pub struct OutOfMemory {
    /// The plan's name (`Plan::name`).
    pub plan: String,
    /// The device's name ("gpu:0", ...).
    pub device: String,
    /// The device's memory limit, in bytes.
    pub limit: usize,
    /// The bytes the plan holds on the device (`MemoryFigures::held_bytes`: variable region, io
    /// region and arena); more than `limit`.
    pub needed: usize,
    /// The planned arena on the device, in bytes.
    pub arena: usize,
    /// The arena's lower bound on the device (no placement of this schedule is smaller), in bytes.
    pub lower_bound: usize,
    /// The device's parameter bytes.
    pub parameters: usize,
    /// The device's optimizer state bytes (counters included).
    pub optimizer_state: usize,
    /// The device's io region, in bytes.
    pub io: usize,
    /// The step at which the device's live bytes peak (its lower bound's step).
    pub peak_step: usize,
    /// The number of steps in the plan.
    pub steps: usize,
    /// The op running at the peak step, with its source line.
    pub peak_op: String,
    /// The largest tensors live at the peak step: (bytes, op and name, source line).
    pub largest: Vec<(usize, String, Option<String>)>,
    /// What rematerialization did before giving up, when it was tried.
    pub remat: Option<String>,
}

impl fmt::Display for OutOfMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "out of memory on device {}: plan {:?} needs {} but the limit is {}",
            self.device,
            self.plan,
            human_bytes(self.needed),
            human_bytes(self.limit)
        )?;
        let persistent = self.needed.saturating_sub(self.arena);
        let padding = persistent.saturating_sub(self.parameters + self.optimizer_state + self.io);
        writeln!(
            f,
            "  needs: arena {} (lower bound {}) + persistent {} (parameters {}, optimizer state {}, inputs and outputs {}, slot alignment {})",
            human_bytes(self.arena),
            human_bytes(self.lower_bound),
            human_bytes(persistent),
            human_bytes(self.parameters),
            human_bytes(self.optimizer_state),
            human_bytes(self.io),
            human_bytes(padding)
        )?;
        writeln!(f, "  memory peaks at step {} of {}: {}", self.peak_step, self.steps, self.peak_op)?;
        writeln!(f, "  largest tensors live there:")?;
        for (bytes, label, origin) in &self.largest {
            match origin {
                Some(o) => writeln!(f, "    {:>12}  {label} ({o})", human_bytes(*bytes))?,
                None => writeln!(f, "    {:>12}  {label}", human_bytes(*bytes))?,
            }
        }
        if let Some(r) = &self.remat {
            writeln!(f, "  rematerialization: {r}")?;
        }
        let over = self.needed - self.limit;
        write!(
            f,
            "  help: {} more is needed. Reduce the batch size (activations grow with it), place some layers on \
             another device (`Tracer::on_device`, or `kiln::prelude::split_sequential` to split a Sequential \
             model), or raise this device's memory limit",
            human_bytes(over)
        )
    }
}

/// The first device of `plan` whose limit the plan exceeds, with the details.
pub fn check(plan: &Plan) -> Result<(), Box<OutOfMemory>> {
    for (d, dev) in plan.devices.iter().enumerate() {
        let Some(limit) = dev.memory_limit else { continue };
        let m = &dev.memory;
        let needed = m.held_bytes();
        if needed <= limit {
            continue;
        }
        let step = m.lower_bound_step;
        let mut largest: Vec<(usize, String, Option<String>)> = plan
            .buffers
            .iter()
            .filter(|b| {
                matches!(b.storage, Storage::Arena { device, .. } if device == d)
                    && b.first_step <= step
                    && step <= b.last_step
            })
            .map(|b| (b.bytes, b.label.clone(), b.origin.clone()))
            .collect();
        largest.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        largest.truncate(5);
        let peak_op = plan.steps.get(step).map_or_else(String::new, |s| match &s.origin {
            Some(o) => format!("{} ({o})", s.label),
            None => s.label.clone(),
        });
        return Err(Box::new(OutOfMemory {
            plan: plan.name.clone(),
            device: dev.name.clone(),
            limit,
            needed,
            arena: m.arena_bytes,
            lower_bound: m.lower_bound_bytes,
            parameters: m.parameter_bytes,
            optimizer_state: m.optimizer_state_bytes,
            io: m.io_bytes,
            peak_step: step,
            steps: plan.steps.len(),
            peak_op,
            largest,
            remat: None,
        }));
    }
    Ok(())
}
