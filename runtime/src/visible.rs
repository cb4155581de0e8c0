//! Which GPUs kiln may use: TensorFlow's `tf.config.set_visible_devices`, process-wide.
//!
//! `set_visible_devices(&["gpu:1"])` hides every other GPU from `DeviceConfig::detect`,
//! `Device::best`, `kiln devices` and the backends (a `CudaBackend` for a hidden GPU is an error),
//! so placement and device policies only ever see the chosen ones; the CPU is always visible.
//! As in TensorFlow, the choice is fixed once a GPU is in use (a backend opened it): changing it
//! then is an error that says which device is in use. `CUDA_VISIBLE_DEVICES` acts one level
//! below, in the driver, before kiln sees any device (ordinals are then the driver's renumbered
//! ones); the emulated device (`KILN_CUDA_EMULATE=1`, ordinal 0) honours it too, so the two
//! compose as on a real machine.

use crate::error::{Result, RuntimeError};
use std::sync::Mutex;

#[derive(Default)]
struct State {
    /// The GPU ordinals chosen; `None`: every GPU.
    visible: Option<Vec<usize>>,
    /// The first GPU a backend opened, if any.
    in_use: Option<usize>,
}

static STATE: Mutex<State> = Mutex::new(State { visible: None, in_use: None });

fn state() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Makes only the GPUs named (`"gpu:N"`, physical names as `kiln devices` lists them) visible;
/// `"cpu:0"` may be named and is always visible. Unknown or repeated names are errors, and so is
/// any change once a GPU is in use. `present` are the GPU ordinals the driver shows.
pub fn set_visible_devices_among(names: &[&str], present: &[usize]) -> Result<()> {
    let mut chosen = Vec::new();
    for (i, name) in names.iter().enumerate() {
        if names[..i].contains(name) {
            return Err(RuntimeError::invalid(
                format!("set_visible_devices: `{name}` is named twice in {names:?}"),
                "name each device once",
            ));
        }
        if *name == "cpu:0" {
            continue;
        }
        let ordinal = name.strip_prefix("gpu:").and_then(|n| n.parse::<usize>().ok());
        match ordinal {
            Some(o) if present.contains(&o) => chosen.push(o),
            _ => {
                let known: Vec<String> = std::iter::once("cpu:0".to_string())
                    .chain(present.iter().map(|o| format!("gpu:{o}")))
                    .collect();
                return Err(RuntimeError::invalid(
                    format!("set_visible_devices: no physical device `{name}` (devices: {known:?})"),
                    "name devices as `kiln devices` lists them",
                ));
            }
        }
    }
    let mut s = state();
    if let Some(used) = s.in_use {
        let now = s.visible.clone();
        if now.as_deref() != Some(chosen.as_slice()) {
            return Err(RuntimeError::invalid(
                format!(
                    "set_visible_devices: visible devices cannot be changed after gpu:{used} is in use (a backend opened it); \
                     visible now: {}",
                    describe(now.as_deref())
                ),
                "choose the visible devices before making any GPU backend, as TensorFlow requires",
            ));
        }
    }
    s.visible = Some(chosen);
    Ok(())
}

/// `set_visible_devices_among` with the GPUs the driver (or the emulator) shows.
pub fn set_visible_devices(names: &[&str]) -> Result<()> {
    let present: Vec<usize> =
        crate::cuda::probe().devices.map(|d| d.iter().map(|d| d.ordinal).collect()).unwrap_or_default();
    set_visible_devices_among(names, &present)
}

fn describe(visible: Option<&[usize]>) -> String {
    match visible {
        None => "every GPU".into(),
        Some([]) => "no GPU".into(),
        Some(v) => v.iter().map(|o| format!("gpu:{o}")).collect::<Vec<_>>().join(", "),
    }
}

/// Whether GPU `ordinal` may be used.
pub fn is_visible(ordinal: usize) -> bool {
    state().visible.as_ref().is_none_or(|v| v.contains(&ordinal))
}

/// The visible GPUs as a sentence ("every GPU", "gpu:1", "no GPU").
pub fn visible_description() -> String {
    describe(state().visible.as_deref())
}

/// Records that a backend opened GPU `ordinal` (the first one fixes the visible devices), or
/// refuses a hidden one.
pub fn open(ordinal: usize) -> Result<()> {
    let mut s = state();
    if s.visible.as_ref().is_some_and(|v| !v.contains(&ordinal)) {
        return Err(RuntimeError::invalid(
            format!("gpu:{ordinal} is not visible (visible: {})", describe(s.visible.as_deref())),
            "use a visible device, or choose the visible devices (set_visible_devices) before making backends",
        ));
    }
    s.in_use.get_or_insert(ordinal);
    Ok(())
}

/// Whether `CUDA_VISIBLE_DEVICES` (as the driver reads it: a comma-separated list, cut at the
/// first entry that is not a device index) lets ordinal 0 of an emulated machine through.
pub fn cuda_visible_devices_allow_first() -> bool {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Err(_) => true,
        Ok(v) => v.split(',').map(str::trim).map_while(|e| e.parse::<usize>().ok()).any(|o| o == 0),
    }
}
