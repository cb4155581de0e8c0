//! Checks a plan before anything runs. A `Plan` is plain, serialisable data: a backend may be
//! handed one that was deserialised, edited or built by hand, and its `unsafe` code relies only on
//! what this module establishes. `validate` is the one door: `compile` calls it on every plan it
//! makes, and every backend's `load` calls it again. In order:
//!
//! 1. structure: every index (device, buffer, value, variable, step operand) in range; the
//!    alignment a power of two from 4 to 1 MiB; every size at most `ir::MAX_TENSOR_BYTES`; every
//!    dtype f32 (the only one with kernels); every step an op with a kernel whose output shape and
//!    dtype are what `ir::infer` derives from its operands, and every value no larger than its
//!    buffer, so that a kernel reads and writes exactly its values' bytes;
//! 2. regions: every arena and io buffer (in guard mode with its canary) aligned and inside its
//!    region; no two arena buffers live at a common step overlapping in bytes (`planner::verify`);
//!    no two io buffers of a device overlapping; variables the size their spec says;
//! 3. aliasing: a step's output shares no bytes with its operands unless the step is an
//!    elementwise op marked in place over an operand of its own shape and offset (values of one
//!    buffer at disjoint offsets, the pieces of a concatenation written in place, do not
//!    alias); only arena values start past their buffer's first byte; an update's mutated
//!    variables are distinct from each other and from its other operands;
//! 4. order: every step reading and writing arena buffers only while they are live, every arena
//!    value's bytes written before they are read, every variable read before (never after) its update;
//! 5. scratch: a step's scratch buffer is in the arena of the step's device, live at that step
//!    alone, and nothing else's storage (no value's, no other step's scratch).

use crate::ir::{self, DType, OpClass};
use crate::plan::{Plan, Storage};
use crate::planner::{self, Interval, Placement};

/// Checks the plan against the invariants the module's doc lists, and that every constant has
/// its values; the error describes the first one broken.
pub fn validate(plan: &Plan) -> Result<(), String> {
    validate_structure(plan)?;
    for d in 0..plan.devices.len() {
        validate_arena(plan, d)?;
        validate_io(plan, d)?;
        validate_variable_region(plan, d)?;
    }
    validate_steps(plan)?;
    validate_scratch(plan)?;
    validate_constants(plan)
}

/// Every constant variable has its values in the plan, as many as its shape holds, and is f32.
fn validate_constants(plan: &Plan) -> Result<(), String> {
    for v in plan.variables.iter().filter(|v| v.role == crate::ir::VarRole::Constant) {
        let n = v.shape.numel();
        match plan.constants.get(&v.key) {
            Some(data) if data.len() == n && v.dtype == crate::ir::DType::F32 => {}
            Some(data) => {
                return Err(format!(
                    "constant {:?} ({:?} {:?}) has {} values in the plan, not {n}",
                    v.key,
                    v.dtype,
                    v.shape.dims(),
                    data.len()
                ));
            }
            None => return Err(format!("constant {:?} has no values in the plan's constants", v.key)),
        }
    }
    Ok(())
}

fn validate_scratch(plan: &Plan) -> Result<(), String> {
    let mut owner: Vec<Option<usize>> = vec![None; plan.buffers.len()];
    for v in &plan.values {
        owner[v.buffer] = Some(usize::MAX);
    }
    for (s, step) in plan.steps.iter().enumerate() {
        let Some(b) = step.scratch else { continue };
        let Some(buf) = plan.buffers.get(b) else {
            return Err(format!(
                "step {s} ({}) names scratch buffer {b} of {}",
                step.label,
                plan.buffers.len()
            ));
        };
        let on_device = matches!(buf.storage, Storage::Arena { device, .. } if device == step.device);
        if !on_device || buf.first_step != s || buf.last_step != s {
            return Err(format!(
                "step {s} ({})'s scratch buffer {b} ({:?}, live {}..{}) must be in the arena of the step's device and live at step {s} alone",
                step.label, buf.storage, buf.first_step, buf.last_step
            ));
        }
        match owner[b] {
            None => owner[b] = Some(s),
            Some(usize::MAX) => {
                return Err(format!("step {s} ({})'s scratch buffer {b} holds a value", step.label));
            }
            Some(other) => {
                return Err(format!("steps {other} and {s} name the same scratch buffer {b}"));
            }
        }
    }
    Ok(())
}

fn validate_structure(plan: &Plan) -> Result<(), String> {
    if plan.guard_bytes > crate::guard::MAX_GUARD_BYTES {
        return Err(format!("guard of {} bytes is above 1 MiB", plan.guard_bytes));
    }
    let a = plan.alignment;
    if !a.is_power_of_two() || !(4..=crate::CompileOptions::MAX_ALIGNMENT).contains(&a) {
        return Err(format!("alignment {a} is not a power of two from 4 to 1 MiB"));
    }
    let max = ir::MAX_TENSOR_BYTES;
    let devices = plan.devices.len();
    let mut keys = std::collections::HashSet::new();
    for v in &plan.variables {
        if v.device >= devices {
            return Err(format!("variable `{}` is on device {} of {devices}", v.key, v.device));
        }
        if v.dtype != DType::F32 {
            return Err(format!("variable `{}` has dtype {}: kernels compute in f32", v.key, v.dtype));
        }
        if v.shape.checked_bytes(v.dtype).is_none_or(|b| b > max) {
            return Err(format!("variable `{}` of shape {} is larger than 1 TiB", v.key, v.shape));
        }
        if !keys.insert(v.key.as_str()) {
            return Err(format!("variable `{}` is declared twice", v.key));
        }
    }
    for (i, b) in plan.buffers.iter().enumerate() {
        if b.bytes > max {
            return Err(format!("buffer {i} ({}) has {} bytes, above 1 TiB", b.label, b.bytes));
        }
        if b.first_step > b.last_step {
            return Err(format!("buffer {i} ({}) ends at step {} before it starts", b.label, b.last_step));
        }
        match b.storage {
            Storage::Arena { device, .. } | Storage::Io { device, .. } if device >= devices => {
                return Err(format!("buffer {i} ({}) is on device {device} of {devices}", b.label));
            }
            Storage::Variable { index } => match plan.variables.get(index) {
                None => {
                    return Err(format!(
                        "buffer {i} ({}) names variable {index} of {}",
                        b.label,
                        plan.variables.len()
                    ));
                }
                Some(v) if v.bytes() != b.bytes => {
                    return Err(format!(
                        "buffer {i} has {} bytes but variable `{}` has {}",
                        b.bytes,
                        v.key,
                        v.bytes()
                    ));
                }
                Some(_) => {}
            },
            _ => {}
        }
    }
    for (i, v) in plan.values.iter().enumerate() {
        let Some(b) = plan.buffers.get(v.buffer) else {
            return Err(format!("value {i} names buffer {} of {}", v.buffer, plan.buffers.len()));
        };
        if v.shape
            .checked_bytes(v.dtype)
            .and_then(|bytes| bytes.checked_add(v.offset))
            .is_none_or(|end| end > b.bytes)
        {
            return Err(format!(
                "value {i} {}{} at offset {} does not fit its buffer {} ({}) of {} bytes",
                v.dtype, v.shape, v.offset, v.buffer, b.label, b.bytes
            ));
        }
        let in_arena = matches!(b.storage, Storage::Arena { .. });
        if v.offset > 0 && (!in_arena || !v.offset.is_multiple_of(crate::liveness::VIEW_ALIGN)) {
            return Err(format!(
                "value {i} starts {} bytes into buffer {} ({}): only arena values start past 0, at multiples of {}",
                v.offset,
                v.buffer,
                b.label,
                crate::liveness::VIEW_ALIGN
            ));
        }
    }
    let values = plan.values.len();
    for (kind, list) in [("input", &plan.inputs), ("output", &plan.outputs)] {
        for (i, binding) in list.iter().enumerate() {
            let Some(v) = plan.values.get(binding.value) else {
                return Err(format!("{kind} `{}` names value {} of {values}", binding.name, binding.value));
            };
            // An input in the arena is written before the run, so it must be live from the first
            // step (no buffer sharing its bytes runs before it); an output is read after the
            // run, so it must be live to the last step.
            let b = &plan.buffers[v.buffer];
            if v.offset != 0 {
                return Err(format!(
                    "{kind} `{}` starts {} bytes into its buffer, not at 0",
                    binding.name, v.offset
                ));
            }
            let last = plan.steps.len().saturating_sub(1);
            let ok = match b.storage {
                Storage::Io { .. } => true,
                Storage::Arena { .. } if kind == "input" => b.first_step == 0,
                Storage::Arena { .. } => b.last_step >= last,
                Storage::Variable { .. } => false,
            };
            if !ok {
                return Err(format!(
                    "{kind} `{}` lives in {:?} for steps {}..{}: an input must be live from step 0 and an output to the last step, in the arena or the io region",
                    binding.name, b.storage, b.first_step, b.last_step
                ));
            }
            if list[..i].iter().any(|o| o.name == binding.name) {
                return Err(format!("two {kind}s are named `{}`", binding.name));
            }
        }
    }
    for (s, step) in plan.steps.iter().enumerate() {
        let what = || format!("step {s} ({})", step.label);
        if step.device >= devices {
            return Err(format!("{} is on device {} of {devices}", what(), step.device));
        }
        if let Some(&v) = step.inputs.iter().chain(&step.output).find(|&&v| v >= values) {
            return Err(format!("{} names value {v} of {values}", what()));
        }
        if matches!(step.op.class(), OpClass::Source | OpClass::View) {
            return Err(format!("{}: {} runs no kernel and cannot be a step", what(), step.op.name()));
        }
        let types: Vec<_> =
            step.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
        let (shape, dtype) = ir::infer(&step.op, &types).map_err(|e| format!("{}: {}", what(), e.message))?;
        match (step.op.is_effect(), step.output) {
            (true, Some(_)) => return Err(format!("{} is an update but writes a value", what())),
            (false, None) => return Err(format!("{} writes no value", what())),
            (false, Some(o)) => {
                let v = &plan.values[o];
                if v.shape != shape || v.dtype != dtype {
                    return Err(format!(
                        "{}: its operands give {dtype}{shape} but its output value {o} is {}{}",
                        what(),
                        v.dtype,
                        v.shape
                    ));
                }
            }
            (true, None) => {}
        }
        validate_aliasing(plan, s)?;
    }
    Ok(())
}

/// Kernels may not read a buffer they write, except in place over operands the op may write
/// over (`Op::may_write_over`: elementwise operands, a fused product's epilogue operands) of its
/// own element count; updates write their variables in place and nothing else.
fn validate_aliasing(plan: &Plan, s: usize) -> Result<(), String> {
    let step = &plan.steps[s];
    let buffer = |v: usize| plan.values[v].buffer;
    // The bytes of value `v` in its buffer (sizes were checked in `validate_structure`).
    let range = |v: usize| {
        let value = &plan.values[v];
        value.offset..value.offset + value.shape.numel() * value.dtype.size_bytes()
    };
    let overlap = |a: usize, b: usize| {
        let (a, b) = (range(a), range(b));
        a.start < b.end && b.start < a.end
    };
    if let Some(o) = step.output {
        let out = buffer(o);
        let aliased: Vec<(usize, usize)> = step
            .inputs
            .iter()
            .copied()
            .enumerate()
            .filter(|&(_, v)| buffer(v) == out && overlap(v, o))
            .collect();
        // In place, every operand read from the output's bytes has the output's element count,
        // type and offset: with broadcasting to the output's shape that means the same flat index, so
        // each element is read before it is overwritten (`x * x`, `x * x.reshape(..)`).
        let shape = &plan.values[o].shape;
        let ok = if aliased.is_empty() {
            // An empty output (a batch of zero rows) shares no bytes with anything: marked in
            // place or not, nothing is overwritten.
            !step.in_place || range(o).is_empty()
        } else {
            step.in_place
                && aliased.iter().all(|&(i, v)| {
                    step.op.may_write_over(i, shape)
                        && plan.values[v].shape.numel() == shape.numel()
                        && plan.values[v].dtype == plan.values[o].dtype
                        && plan.values[v].offset == plan.values[o].offset
                })
        };
        if !ok {
            return Err(format!(
                "step {s} ({}) writes buffer {out} ({}) {}",
                step.label,
                plan.buffers[out].label,
                if aliased.is_empty() { "but is marked in place" } else { "that it also reads" }
            ));
        }
    }
    let mutated = step.op.mutated_operands();
    for &i in mutated {
        let b = buffer(step.inputs[i]);
        if !matches!(plan.buffers[b].storage, Storage::Variable { .. }) {
            return Err(format!("step {s} ({}) updates operand {i}, which is not a variable", step.label));
        }
        // Updates are elementwise: another operand may read the variable it writes at the same
        // flat index (`p -= lr * p`), but two written operands may not be one variable.
        let numel = plan.values[step.inputs[i]].shape.numel();
        let clash = step.inputs.iter().enumerate().any(|(j, &v)| {
            j != i && buffer(v) == b && (mutated.contains(&j) || plan.values[v].shape.numel() != numel)
        });
        if clash {
            return Err(format!(
                "step {s} ({}) updates variable {} through two operands",
                step.label, plan.buffers[b].label
            ));
        }
    }
    Ok(())
}

/// The variable region of `device`: every variable aligned, inside the region, none overlapping.
fn validate_variable_region(plan: &Plan, device: usize) -> Result<(), String> {
    let region = plan.devices[device].memory.variable_region_bytes;
    let mut slots: Vec<(usize, usize, &str)> = Vec::new();
    for v in plan.variables.iter().filter(|v| v.device == device) {
        if !v.offset.is_multiple_of(plan.alignment) {
            return Err(format!("variable `{}` is not aligned in its region", v.key));
        }
        match v.shape.checked_bytes(v.dtype).and_then(|b| v.offset.checked_add(b)) {
            Some(end) if end <= region => slots.push((v.offset, end, &v.key)),
            _ => {
                return Err(format!(
                    "variable `{}` ({} at {}) runs past the variable region of {region} bytes",
                    v.key, v.shape, v.offset
                ));
            }
        }
    }
    slots.sort_unstable();
    for w in slots.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("variables `{}` and `{}` overlap in their region", w[0].2, w[1].2));
        }
    }
    Ok(())
}

/// The io region of `device`: inputs and outputs live for the whole call, so no two may overlap.
fn validate_io(plan: &Plan, device: usize) -> Result<(), String> {
    let region = plan.devices[device].memory.io_bytes;
    let mut slots: Vec<(usize, usize, &str)> = Vec::new();
    for buf in &plan.buffers {
        if let Storage::Io { device: d, offset } = buf.storage
            && d == device
        {
            if !offset.is_multiple_of(plan.alignment) {
                return Err(format!("io buffer {} is not aligned", buf.label));
            }
            // In guard mode a slot ends after its canary (`crate::guard`).
            match offset.checked_add(buf.bytes + plan.guard_bytes) {
                Some(end) if end <= region => slots.push((offset, end, &buf.label)),
                _ => {
                    return Err(format!(
                        "io buffer {} ({} bytes at {offset}) runs past the io region of {region} bytes",
                        buf.label, buf.bytes
                    ));
                }
            }
        }
    }
    slots.sort_unstable();
    for w in slots.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("io buffers {} and {} overlap", w[0].2, w[1].2));
        }
    }
    Ok(())
}

fn validate_arena(plan: &Plan, device: usize) -> Result<(), String> {
    let arena: Vec<usize> = (0..plan.buffers.len())
        .filter(|&b| matches!(plan.buffers[b].storage, Storage::Arena { device: d, .. } if d == device))
        .collect();
    let intervals: Vec<Interval> = arena
        .iter()
        .map(|&b| {
            let buf = &plan.buffers[b];
            Interval { bytes: buf.bytes + plan.guard_bytes, start: buf.first_step, end: buf.last_step }
        })
        .collect();
    let offsets = arena
        .iter()
        .map(|&b| match plan.buffers[b].storage {
            Storage::Arena { offset, .. } => offset,
            _ => unreachable!("filtered to arena buffers"),
        })
        .collect();
    let figures = &plan.devices[device].memory;
    let placement = Placement {
        offsets,
        arena_bytes: figures.arena_bytes,
        algorithm: figures.algorithm.clone(),
        tried: vec![],
    };
    planner::verify(&intervals, &placement, plan.alignment)?;

    Ok(())
}

/// The bytes of value `v` in its buffer (sizes were checked in `validate_structure`).
fn value_range(plan: &Plan, v: usize) -> (usize, usize) {
    let value = &plan.values[v];
    (value.offset, value.offset + value.shape.numel() * value.dtype.size_bytes())
}

/// Adds `[start, end)` to a buffer's sorted, disjoint written ranges.
fn mark_written(ranges: &mut Vec<(usize, usize)>, (start, end): (usize, usize)) {
    ranges.push((start, end));
    ranges.sort_unstable();
    let mut merged: Vec<(usize, usize)> = Vec::with_capacity(ranges.len());
    for &(a, b) in ranges.iter() {
        match merged.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => merged.push((a, b)),
        }
    }
    *ranges = merged;
}

/// Whether `[start, end)` lies inside one of the (merged) written ranges.
fn is_written(ranges: &[(usize, usize)], (start, end): (usize, usize)) -> bool {
    start == end || ranges.iter().any(|&(a, b)| a <= start && end <= b)
}

fn validate_steps(plan: &Plan) -> Result<(), String> {
    // The bytes of each buffer written so far: a value inside a buffer (a piece of a
    // concatenation written in place) is read only once its own bytes are written.
    let mut written: Vec<Vec<(usize, usize)>> = vec![Vec::new(); plan.buffers.len()];
    for binding in &plan.inputs {
        // Fed before the run.
        let v = binding.value;
        mark_written(&mut written[plan.values[v].buffer], value_range(plan, v));
    }
    let mut first_update: Vec<Option<usize>> = vec![None; plan.variables.len()];
    let mut last_read: Vec<Option<usize>> = vec![None; plan.variables.len()];
    for (s, step) in plan.steps.iter().enumerate() {
        let mutated = step.op.mutated_operands();
        for (i, &v) in step.inputs.iter().enumerate() {
            let b = plan.values[v].buffer;
            let buf = &plan.buffers[b];
            let device = match buf.storage {
                Storage::Arena { device, .. } | Storage::Io { device, .. } => device,
                Storage::Variable { index } => plan.variables[index].device,
            };
            // Copies are the transfers between devices: the only steps that read another device.
            if device != step.device && !matches!(step.op, crate::ir::Op::Copy) {
                return Err(format!(
                    "step {s} ({}) on one device reads {} on another",
                    step.label, buf.label
                ));
            }
            match buf.storage {
                Storage::Arena { .. } => {
                    if !(buf.first_step <= s && s <= buf.last_step) {
                        return Err(format!(
                            "step {s} ({}) reads {} outside its life {}..{}",
                            step.label, buf.label, buf.first_step, buf.last_step
                        ));
                    }
                    if !is_written(&written[b], value_range(plan, v)) {
                        return Err(format!(
                            "step {s} ({}) reads {} before it is written",
                            step.label, buf.label
                        ));
                    }
                }
                Storage::Variable { index } if mutated.contains(&i) => {
                    first_update[index].get_or_insert(s);
                }
                Storage::Variable { index } => last_read[index] = Some(s),
                Storage::Io { .. } => {}
            }
        }
        if let Some(o) = step.output {
            let b = plan.values[o].buffer;
            let buf = &plan.buffers[b];
            if matches!(buf.storage, Storage::Arena { .. }) && !(buf.first_step <= s && s <= buf.last_step) {
                return Err(format!("step {s} ({}) writes {} outside its life", step.label, buf.label));
            }
            if matches!(buf.storage, Storage::Variable { .. }) {
                return Err(format!("step {s} ({}) writes a variable without being an update", step.label));
            }
            mark_written(&mut written[b], value_range(plan, o));
        }
    }
    for (i, v) in plan.variables.iter().enumerate() {
        if let (Some(u), Some(r)) = (first_update[i], last_read[i])
            && r > u
        {
            return Err(format!("variable `{}` is read at step {r}, after its update at step {u}", v.key));
        }
    }
    Ok(())
}
