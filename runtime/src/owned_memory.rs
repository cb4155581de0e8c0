//! Memory you own: a plan's arena placed in a region the caller already holds (its own pool,
//! cudarc, another library), checked before anything is loaded, and its inputs and outputs read
//! and written there in place, so a step copies nothing in or out.
//!
//! `CpuBackend::load_into` / `CudaBackend::load_into` take the region; `check_region` refuses one
//! that is too small or misaligned, and a plan over several devices (one region per plan device
//! would be needed), before the backend is touched, so a refused region leaves nothing
//! half-loaded. The region is not counted in the device's budget (the caller holds it) and is
//! never freed by kiln. `io_offset` says where an input or output lives inside the region; after
//! writing an input there the caller marks it fed with `Backend::set_input_in_place`.

use crate::backend::{Slot, io_slot};
use crate::error::{Result, RuntimeError};
use kiln_compiler::Plan;

/// Refuses `len` bytes at `addr` for `plan`'s arena unless the plan has one device, the region
/// holds its arena and is aligned as the plan's slots are.
pub fn check_region(plan: &Plan, addr: u64, len: usize) -> Result<()> {
    if plan.devices.len() != 1 {
        return Err(RuntimeError::invalid(
            format!(
                "plan {:?} spans {} devices; a caller's region holds the arena of a one-device plan",
                plan.name,
                plan.devices.len()
            ),
            "load plans over several devices with `load`, or compile this one for one device",
        ));
    }
    let need = plan.devices[0].memory.arena_bytes;
    if len < need {
        return Err(RuntimeError::invalid(
            format!("the region holds {len} bytes but plan {:?}'s arena needs {need}", plan.name),
            "give a region of at least plan.memory.arena_bytes",
        ));
    }
    let align = plan.alignment as u64;
    if addr == 0 || !addr.is_multiple_of(align) {
        return Err(RuntimeError::invalid(
            format!("the region at {addr:#x} is not aligned to the plan's {align} bytes"),
            "allocate the region aligned to plan.alignment",
        ));
    }
    Ok(())
}

/// Where input or output `name` lives inside a caller's region: its byte offset and length.
pub fn io_offset(plan: &Plan, name: &str) -> Result<(usize, usize)> {
    let value = plan.input(name).or_else(|| plan.output(name)).map(|b| b.value).ok_or_else(|| {
        RuntimeError::invalid(format!("plan {:?} has no input or output `{name}`", plan.name), "")
    })?;
    let v = plan.value(value);
    match io_slot(plan, value, name)? {
        Slot::Arena { offset, .. } => Ok((offset, v.shape.numel() * v.dtype.size_bytes())),
        Slot::Io { .. } => Err(RuntimeError::invalid(
            format!("`{name}` of plan {:?} lives in the io region, not in the arena", plan.name),
            "plans from `compile` keep inputs and outputs in the arena; feed this one with set_input",
        )),
    }
}

/// The value of input `name`, which the caller wrote in place inside its region: refused for a
/// program whose arena is the backend's (`owned` false), or a name that is no input.
pub fn in_place_input(plan: &Plan, owned: bool, name: &str) -> Result<usize> {
    if !owned {
        return Err(RuntimeError::invalid(
            format!("input `{name}` of plan {:?}: its arena is kiln's, so inputs are copied in", plan.name),
            "use set_input, or load the plan into your own region (load_into)",
        ));
    }
    io_offset(plan, name)?;
    plan.input(name).map(|b| b.value).ok_or_else(|| {
        RuntimeError::invalid(format!("`{name}` is an output of plan {:?}, not an input", plan.name), "")
    })
}
