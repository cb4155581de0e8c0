//! Finding CUDA without requiring it. cudarc loads the driver and NVRTC at first use and panics
//! when a library is missing, so kiln probes first and touches cudarc only once a probe succeeded.
//!
//! NVRTC is looked for, in order: the file or folder named by `KILN_NVRTC`; the loader's own
//! search path (`LD_LIBRARY_PATH`, ldconfig); the project-local `.nvrtc/` folder that
//! `scripts/test.sh` fills from the PyPI package `nvidia-cuda-nvrtc`; the usual CUDA install
//! folders. A library found by path is loaded once and kept, so that cudarc's later load by name
//! (`libnvrtc.so.13`) resolves to it.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The NVRTC library's file name for the CUDA major version cudarc was built for.
pub const NVRTC_SONAME: &str = "libnvrtc.so.13";

/// The NVRTC library that was loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NvrtcInfo {
    /// Where it was found ("loader search path" when found by name).
    pub location: String,
    /// NVRTC's version as (major, minor), from `nvrtcVersion`.
    pub version: (i32, i32),
}

/// One CUDA device the driver reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's CUDA ordinal (its index in the driver's list).
    pub ordinal: usize,
    /// The device's name as the driver gives it, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// The compute capability as (major, minor), e.g. (9, 0) for `sm_90`.
    pub compute_capability: (i32, i32),
    /// The device's total memory in bytes.
    pub total_bytes: usize,
}

/// What was found, and why not where nothing was.
#[derive(Clone, Debug)]
pub struct CudaProbe {
    /// The NVRTC library loaded, or why none could be.
    pub nvrtc: Result<NvrtcInfo, String>,
    /// The devices the driver reports (possibly none), or why the driver could not be asked.
    pub devices: Result<Vec<DeviceInfo>, String>,
    /// The devices are the emulated device (`KILN_CUDA_EMULATE=1`), which needs no NVRTC.
    pub emulated: bool,
    /// The CUDA driver's version, where a driver answered.
    pub driver_version: Option<(i32, i32)>,
}

impl CudaProbe {
    /// The first usable device, or the reason there is none.
    pub fn usable(&self) -> Result<&DeviceInfo, String> {
        let devices = self.devices.as_ref().map_err(Clone::clone)?;
        let first = devices.first().ok_or_else(|| "the CUDA driver reports no device".to_string())?;
        if !self.emulated {
            self.nvrtc.as_ref().map_err(|e| format!("a CUDA device is present but NVRTC is missing: {e}"))?;
        }
        Ok(first)
    }

    /// "CUDA driver 13.0, NVRTC 13.0" (or what is missing), as `kiln devices` and errors print it.
    pub fn versions(&self) -> String {
        if self.emulated {
            return format!(
                "emulated CUDA device (KILN_CUDA_EMULATE=1; kernels built by {})",
                super::emulator::host::compiler()
            );
        }
        let driver = self.driver_version.map_or("none".into(), |(a, b)| format!("{a}.{b}"));
        let nvrtc = match &self.nvrtc {
            Ok(n) => format!("{}.{}", n.version.0, n.version.1),
            Err(_) => "none".into(),
        };
        format!("CUDA driver {driver}, NVRTC {nvrtc}")
    }
}

/// The CUDA driver's version (cuDriverGetVersion), where the driver loads.
pub fn driver_version() -> Option<(i32, i32)> {
    static VERSION: OnceLock<Option<(i32, i32)>> = OnceLock::new();
    *VERSION.get_or_init(|| {
        std::panic::catch_unwind(|| {
            // SAFETY: only tries to load the library.
            if !unsafe { cudarc::driver::sys::is_culib_present() } {
                return None;
            }
            let mut v = 0;
            // SAFETY: the driver is loaded; cuDriverGetVersion writes one int.
            let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
            (r == cudarc::driver::sys::CUresult::CUDA_SUCCESS).then_some((v / 1000, (v % 1000) / 10))
        })
        .ok()
        .flatten()
    })
}

fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = std::env::var_os("KILN_NVRTC") {
        v.push(PathBuf::from(p));
    }
    let project = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(".nvrtc");
    v.push(project.join("nvidia/cu13/lib"));
    for dir in [
        "/usr/local/cuda/lib64",
        "/usr/local/cuda-13/lib64",
        "/usr/local/cuda-13.0/lib64",
        "/usr/lib/x86_64-linux-gnu",
    ] {
        v.push(PathBuf::from(dir));
    }
    v
}

fn load_nvrtc() -> Result<String, String> {
    // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
    if let Ok(lib) = unsafe { libloading::Library::new(NVRTC_SONAME) } {
        std::mem::forget(lib);
        return Ok("loader search path".into());
    }
    for c in candidates() {
        let file = if c.is_dir() { c.join(NVRTC_SONAME) } else { c.clone() };
        if !file.is_file() {
            continue;
        }
        // NVRTC opens its builtins library by name when it compiles: load it from the same
        // folder first, so that the name resolves to it.
        if let Some(dir) = file.parent()
            && let Ok(entries) = std::fs::read_dir(dir)
        {
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if name.starts_with("libnvrtc-builtins.so") {
                    // SAFETY: as above.
                    if let Ok(lib) = unsafe { libloading::Library::new(e.path()) } {
                        std::mem::forget(lib);
                    }
                }
            }
        }
        // SAFETY: as above.
        match unsafe { libloading::Library::new(&file) } {
            Ok(lib) => {
                // Kept loaded for the life of the process: cudarc finds it by its soname.
                std::mem::forget(lib);
                return Ok(file.display().to_string());
            }
            Err(e) => return Err(format!("{} exists but does not load: {e}", file.display())),
        }
    }
    Err(format!(
        "{NVRTC_SONAME} not found (looked on the loader path, in KILN_NVRTC, in .nvrtc/ and the CUDA folders); \
         `scripts/test.sh` installs it from PyPI (nvidia-cuda-nvrtc)"
    ))
}

/// NVRTC, loaded once per process.
pub fn nvrtc() -> Result<NvrtcInfo, String> {
    static NVRTC: OnceLock<Result<NvrtcInfo, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| {
            let location = load_nvrtc()?;
            let (mut major, mut minor) = (0, 0);
            // SAFETY: NVRTC is loaded (above); nvrtcVersion writes two ints.
            let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
                return Err(format!("nvrtcVersion failed: {status:?}"));
            }
            Ok(NvrtcInfo { location, version: (major, minor) })
        })
        .clone()
}

fn devices() -> Result<Vec<DeviceInfo>, String> {
    // SAFETY: only tries to load the library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("the CUDA driver (libcuda) is not installed".into());
    }
    cudarc::driver::result::init().map_err(|e| format!("the CUDA driver failed to initialise: {e:?}"))?;
    let count =
        cudarc::driver::CudaContext::device_count().map_err(|e| format!("cuDeviceGetCount: {e:?}"))?;
    let mut out = Vec::new();
    for ordinal in 0..count.max(0) as usize {
        let device = cudarc::driver::result::device::get(ordinal as i32).map_err(|e| format!("{e:?}"))?;
        // SAFETY: `device` is a valid handle from cuDeviceGet.
        let total_bytes =
            unsafe { cudarc::driver::result::device::total_mem(device) }.map_err(|e| format!("{e:?}"))?;
        let name = cudarc::driver::result::device::get_name(device).map_err(|e| format!("{e:?}"))?;
        use cudarc::driver::sys::CUdevice_attribute as A;
        // SAFETY: valid device handle and attribute.
        let attr = |a| unsafe { cudarc::driver::result::device::get_attribute(device, a) }.unwrap_or(0);
        let compute_capability = (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        );
        out.push(DeviceInfo { ordinal, name, compute_capability, total_bytes });
    }
    Ok(out)
}

/// Probes the driver, the devices and NVRTC once per process; never panics. Under
/// `KILN_CUDA_EMULATE=1` the one device is the emulated device (`super::emulator`).
pub fn probe() -> CudaProbe {
    match super::emulator::emulation() {
        Ok(Some(memory)) => {
            // The one emulated device is ordinal 0, behind CUDA_VISIBLE_DEVICES as a GPU would be.
            let shown = crate::visible::cuda_visible_devices_allow_first();
            let devices = super::emulator::host::available()
                .map(|_| if shown { vec![super::emulator::device_info(memory)] } else { vec![] })
                .map_err(|e| {
                    format!("KILN_CUDA_EMULATE=1, but the emulated device cannot build kernels: {e}")
                });
            return CudaProbe {
                nvrtc: Err("not used by the emulated device".into()),
                devices,
                emulated: true,
                driver_version: None,
            };
        }
        Ok(None) => {}
        Err(e) => {
            return CudaProbe {
                nvrtc: Err(e.clone()),
                devices: Err(e),
                emulated: true,
                driver_version: None,
            };
        }
    }
    static PROBE: OnceLock<CudaProbe> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            let devices = std::panic::catch_unwind(devices)
                .unwrap_or_else(|_| Err("probing the CUDA driver panicked".into()));
            CudaProbe { nvrtc: nvrtc(), devices, emulated: false, driver_version: driver_version() }
        })
        .clone()
}
