//! Placing a model on several devices.
//!
//! `Placed` runs contiguous ranges of a `Sequential` model's layers on given devices (the
//! backward pass and the optimizer's updates follow their forward ops, and the compiler inserts
//! the copies between devices). `split_sequential` finds such ranges automatically: given
//! devices with memory limits, it gives each device, in order, as many layers as its plan can
//! hold, measuring each candidate with the compiler itself — every figure is from a real plan.

use crate::device::{DeviceSpec, human_bytes};
use crate::error::{CompileError, Result};
use crate::ir::{DeviceId, Shape};
use crate::nn::{Layer, Sequential};
use crate::plan::Plan;
use crate::step::{TrainConfig, train_step_graph};
use crate::trace::Tensor;
use crate::{CompileOptions, compile};
use std::ops::Range;

/// A `Sequential` model (owned or borrowed) whose layer ranges run on the given devices.
pub struct Placed<M: AsRef<Sequential>> {
    /// The model whose layers are placed.
    pub model: M,
    /// (device, layers), in layer order, covering every layer once.
    pub ranges: Vec<(DeviceId, Range<usize>)>,
}

impl<M: AsRef<Sequential>> Placed<M> {
    /// Places `model`'s layers by `ranges` (checked when the model is traced).
    pub fn new(model: M, ranges: Vec<(DeviceId, Range<usize>)>) -> Self {
        Placed { model, ranges }
    }
}

impl<M: AsRef<Sequential>> Placed<M> {
    /// Why `ranges` do not cover the model's layers once, in order (`None` when they do).
    fn ranges_problem(&self) -> Option<String> {
        let layers = self.model.as_ref().len();
        let mut next = 0;
        for (device, r) in &self.ranges {
            if r.start != next || r.end < r.start {
                return Some(format!(
                    "the range {}..{} on device {} does not start where the previous one ends ({next})",
                    r.start, r.end, device.0
                ));
            }
            next = r.end;
        }
        (next != layers).then(|| format!("the ranges end at layer {next}, but the model has {layers} layers"))
    }
}

impl<M: AsRef<Sequential>> Layer for Placed<M> {
    fn forward(&self, x: &Tensor) -> Tensor {
        let t = x.tracer();
        if let Some(why) = self.ranges_problem() {
            let ranges: Vec<String> =
                self.ranges.iter().map(|(d, r)| format!("device {}: {}..{}", d.0, r.start, r.end)).collect();
            return t.report(
                "placed",
                format!("Placed ranges [{}]: {why}", ranges.join(", ")),
                &[x],
                "give contiguous layer ranges, in order, that cover every layer once (0..a, a..b, ..., ..n)",
            );
        }
        t.attributed_to(std::panic::Location::caller(), || {
            let mut h = x.clone();
            for (device, range) in &self.ranges {
                h = t.on_device(*device, || self.model.as_ref().forward_range(&h, range.clone()));
            }
            h
        })
    }

    fn kind(&self) -> &'static str {
        "placed"
    }
}

/// How a model was split, with the plan that proves it fits.
#[derive(Clone, Debug)]
pub struct Split {
    /// (device name, layer range, layer scope names) in order.
    pub ranges: Vec<(String, Range<usize>, Vec<String>)>,
    /// The same ranges by device id, ready for `Placed`.
    pub placement: Vec<(DeviceId, Range<usize>)>,
    /// The training step's plan with these ranges, compiled under the devices' limits.
    pub plan: Plan,
    /// What the units are ("layers", "nodes").
    pub units: String,
}

impl Split {
    /// One line per device: its layers and what its plan holds against its limit.
    pub fn describe(&self) -> String {
        let mut s = String::new();
        for (name, range, layers) in &self.ranges {
            let dev = self.plan.devices.iter().find(|d| &d.name == name);
            let (needed, limit) = dev.map_or((0, None), |d| (d.memory.held_bytes(), d.memory_limit));
            s.push_str(&format!(
                "{name}: {} {}..{} ({}) need {} of {}\n",
                self.units,
                range.start,
                range.end,
                layers.join(", "),
                human_bytes(needed),
                limit.map_or("no limit".into(), human_bytes)
            ));
        }
        s
    }
}

/// Splits `model`'s layers over `devices` (in order, each a contiguous range) so that every
/// device's share of the training step's plan fits its memory limit.
pub fn split_sequential(
    model: &Sequential,
    x: &Shape,
    y: &Shape,
    cfg: &TrainConfig,
    devices: &[DeviceSpec],
    alignment: usize,
) -> Result<Split> {
    let layers = model.len();
    if devices.len() > layers && layers > 0 {
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        return Err(CompileError::invalid(
            format!(
                "split_sequential got {} devices {names:?} for a model of {layers} layers",
                devices.len()
            ),
            "give at most one device per layer (a device with no layers holds nothing)",
        ));
    }
    let names = model.scope_names();
    split_units(
        "split_sequential",
        "layers",
        layers,
        devices,
        alignment,
        |ranges| train_step_graph(&Placed { model, ranges: ranges.to_vec() }, x, y, cfg),
        |r| names[r].to_vec(),
    )
}

/// Splits a model of `units` ordered units (layers, or an imported graph's nodes) over `devices`
/// (in order, each a contiguous range of units) so that every device's share of the graph
/// `graph_of(ranges)` makes fits its memory limit: each device in turn takes the most units
/// whose plan fits it (the rest on the next device for the trial), found by bisection, which
/// relies on a device's needs growing with the units it holds (its parameters, their optimizer
/// state and their activations do). `caller` and `what` name the call and the units in errors;
/// `names` lists a range's units for the result.
pub fn split_units(
    caller: &str,
    what: &str,
    units: usize,
    devices: &[DeviceSpec],
    alignment: usize,
    graph_of: impl Fn(&[(DeviceId, Range<usize>)]) -> Result<crate::ir::Graph>,
    names: impl Fn(Range<usize>) -> Vec<String>,
) -> Result<Split> {
    if devices.is_empty() || units == 0 {
        return Err(CompileError::invalid(
            format!("{caller} got {} devices and a model of {units} {what}: nothing to split", devices.len()),
            format!("give at least one device and a model with at least one of its {what}"),
        ));
    }
    // The options are checked once here (alignment, unique device ids and names), not in every trial.
    CompileOptions { alignment, devices: devices.to_vec(), ..Default::default() }.check()?;
    let unlimited: Vec<DeviceSpec> =
        devices.iter().map(|d| DeviceSpec { memory_limit: None, ..d.clone() }).collect();
    let options = CompileOptions { alignment, devices: unlimited, ..Default::default() };
    // The plan of a placement (limits not enforced: we read each device's needs).
    let plan_of =
        |ranges: &[(DeviceId, Range<usize>)]| -> Result<Plan> { compile(graph_of(ranges)?, &options) };
    let needs = |plan: &Plan, d: &DeviceSpec| {
        plan.devices.iter().find(|p| p.device == d.id).map_or(0, |p| p.memory.held_bytes())
    };
    let mut ranges: Vec<(DeviceId, Range<usize>)> = Vec::new();
    let mut start = 0;
    for (i, d) in devices.iter().enumerate() {
        if start == units {
            break;
        }
        let last = i + 1 == devices.len();
        let fits = |end: usize, ranges: &[(DeviceId, Range<usize>)]| -> Result<bool> {
            let mut trial = ranges.to_vec();
            trial.push((d.id, start..end));
            if end < units {
                // The rest goes to the next device for now; it does not change this device's needs.
                trial.push((devices[i + 1].id, end..units));
            }
            let plan = plan_of(&trial)?;
            Ok(d.memory_limit.is_none_or(|limit| needs(&plan, d) <= limit))
        };
        if last {
            if !fits(units, &ranges)? {
                break;
            }
            ranges.push((d.id, start..units));
            start = units;
            continue;
        }
        if !fits(start + 1, &ranges)? {
            // Not even one unit fits here: this device takes none.
            continue;
        }
        // The largest end that fits: `lo` fits, `hi + 1` does not (or is past the end).
        let (mut lo, mut hi) = (start + 1, units);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid, &ranges)? {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        ranges.push((d.id, start..lo));
        start = lo;
    }
    let placed_all = start == units && ranges.last().is_some_and(|r| r.1.end == units);
    // The final plan is compiled with the real limits: it is checked like any other.
    let limited = CompileOptions { alignment, devices: devices.to_vec(), ..Default::default() };
    let plan = placed_all.then(|| compile(graph_of(&ranges)?, &limited)).transpose();
    let plan = match plan {
        Err(CompileError::OutOfMemory(_)) => None,
        other => other?,
    };
    let Some(plan) = plan else {
        let total: Vec<String> = devices
            .iter()
            .map(|d| format!("{} {}", d.name, d.memory_limit.map_or("unlimited".into(), human_bytes)))
            .collect();
        return Err(CompileError::invalid(
            format!("the model's {units} {what} do not fit on {} even when split", total.join(", ")),
            "reduce the batch size, add a device, or raise the limits",
        ));
    };
    let placement = ranges.clone();
    let ranges = ranges
        .into_iter()
        .map(|(id, r)| {
            let name = devices.iter().find(|d| d.id == id).map_or_else(String::new, |d| d.name.clone());
            (name, r.clone(), names(r))
        })
        .collect();
    Ok(Split { ranges, placement, plan, units: what.to_string() })
}
