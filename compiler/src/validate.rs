//! Checks a plan before anything runs: every buffer inside its region and aligned, no two arena
//! buffers live at a common step overlapping in bytes, every step reading and writing buffers
//! only while they are live, every arena buffer written before it is read, and every variable
//! read before (never after) the step that updates it in place.

use crate::plan::{Plan, Storage};
use crate::planner::{self, Interval, Placement};

pub fn validate(plan: &Plan) -> Result<(), String> {
    for d in 0..plan.devices.len() {
        validate_arena(plan, d)?;
    }
    validate_steps(plan)
}

fn validate_arena(plan: &Plan, device: usize) -> Result<(), String> {
    let arena: Vec<usize> = (0..plan.buffers.len())
        .filter(|&b| matches!(plan.buffers[b].storage, Storage::Arena { device: d, .. } if d == device))
        .collect();
    let intervals: Vec<Interval> = arena
        .iter()
        .map(|&b| {
            let buf = &plan.buffers[b];
            Interval { bytes: buf.bytes, start: buf.first_step, end: buf.last_step }
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

    let mut io_end = 0;
    for buf in &plan.buffers {
        if let Storage::Io { device: d, offset } = buf.storage
            && d == device
        {
            if !offset.is_multiple_of(plan.alignment) {
                return Err(format!("io buffer {} is not aligned", buf.label));
            }
            io_end = io_end.max(offset + buf.bytes);
        }
    }
    if io_end > figures.io_bytes {
        return Err(format!("io buffers end at {io_end} past the io region of {}", figures.io_bytes));
    }
    Ok(())
}

fn validate_steps(plan: &Plan) -> Result<(), String> {
    let mut written = vec![false; plan.buffers.len()];
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
                    if !written[b] {
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
            written[b] = true;
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
