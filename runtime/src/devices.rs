//! Devices and their memory policies, configured once — what TensorFlow's `tf.config` knobs do
//! by hand (`set_memory_growth`, `memory_limit`, `set_logical_device_configuration`,
//! `per_process_gpu_memory_fraction`), checked when the configuration is built and again when
//! every plan compiles.
//!
//! A `DeviceConfig` lists the physical devices present and is consumed by `build`: the resulting
//! `Devices` has no setters, so changing a policy after the devices are in use is impossible by
//! construction. Physical devices may be split into logical devices, each with its own limit
//! and its own arenas; logical devices are numbered per kind in order, as TensorFlow numbers
//! them (`cpu:0`, `cpu:1`, ... `gpu:0`, `gpu:1`, ...).

use crate::alloc::{Allocator, BfcAllocator, BfcOptions, HostSource};
use crate::backend::Backend;
use crate::cpu::CpuBackend;
use crate::cuda::{self, CudaBackend, CudaSource};
use crate::error::{Result, RuntimeError};
use crate::memory::{DeviceBudget, MemoryInfo, Policy, Tracker};
use kiln_compiler::device::{DeviceSpec, human_bytes};
use kiln_compiler::{CompileOptions, ir::DeviceId};
use std::fmt::Write;

/// One mebibyte: TensorFlow's `memory_limit` unit.
pub const MB: usize = 1 << 20;
/// One gibibyte (`1 << 30` bytes).
pub const GB: usize = 1 << 30;

/// What kind of device a physical or logical device is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The host: run by the CPU backend, memory from the machine.
    Cpu,
    /// A CUDA device: run by the CUDA backend.
    Gpu,
}

/// A device present on the machine, as `DeviceConfig::detect` found it.
#[derive(Clone, Debug, PartialEq)]
pub struct PhysicalDevice {
    /// "cpu:0", "gpu:0", ...
    pub name: String,
    /// Whether it is the host or a CUDA device.
    pub kind: Kind,
    /// The CUDA ordinal for GPUs.
    pub ordinal: usize,
    /// The device's whole memory in bytes (the machine's `MemTotal` for the CPU, the driver's
    /// total for a GPU).
    pub total_bytes: usize,
    /// What plans, pools and limits may use: the total for the CPU; for a GPU the driver's free
    /// memory when it was detected, less a headroom for the context and the kernel compiler.
    pub usable_bytes: usize,
    /// A one-line description for tables: `host (N threads)`, or a GPU's name, compute
    /// capability, free memory and driver and CUDA versions.
    pub description: String,
}

#[derive(Clone, Debug, Default)]
struct Settings {
    growth: Option<bool>,
    fraction: Option<f64>,
    limit: Option<usize>,
    logical: Option<Vec<usize>>,
}

/// The one configuration value: the physical devices present and their policies.
#[derive(Clone, Debug)]
pub struct DeviceConfig {
    physical: Vec<PhysicalDevice>,
    settings: Vec<Settings>,
    errors: Vec<String>,
}

/// This process's host memory: resident now and at its peak (`VmRSS`, `VmHWM` of
/// /proc/self/status), what `psutil.Process().memory_info()` reports; `None` where the file is
/// not there.
pub fn process_host_memory() -> Option<(usize, usize)> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = |key: &str| -> Option<usize> {
        let line = status.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|k| k * 1024)
    };
    Some((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// The machine's memory from /proc/meminfo (16 GiB where it cannot be read).
fn host_memory() -> usize {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("MemTotal:"))?;
            line.split_whitespace().nth(1)?.parse::<usize>().ok()
        })
        .map_or(16 * GB, |kib| kib * 1024)
}

impl DeviceConfig {
    /// The devices present: the CPU (with the machine's memory) and every CUDA device that works.
    pub fn detect() -> Self {
        let memory = host_memory();
        let mut physical = vec![PhysicalDevice {
            name: "cpu:0".into(),
            kind: Kind::Cpu,
            ordinal: 0,
            total_bytes: memory,
            usable_bytes: memory,
            description: format!("host ({} threads)", rayon::current_num_threads()),
        }];
        let probe = cuda::probe();
        if probe.usable().is_ok()
            && let Ok(gpus) = &probe.devices
        {
            for g in gpus.iter().filter(|g| crate::visible::is_visible(g.ordinal)) {
                // Pools and limits are sized from what is free now, not from the total: the
                // context, other processes and the compiler hold the rest.
                let Ok((free, total)) = cuda::driver::open(g.ordinal).and_then(|d| d.mem_info()) else {
                    continue;
                };
                physical.push(PhysicalDevice {
                    name: format!("gpu:{}", g.ordinal),
                    kind: Kind::Gpu,
                    ordinal: g.ordinal,
                    total_bytes: total,
                    usable_bytes: free.saturating_sub(cuda::headroom(total)),
                    description: format!(
                        "{} (sm_{}{}; {} free; {})",
                        g.name,
                        g.compute_capability.0,
                        g.compute_capability.1,
                        human_bytes(free),
                        probe.versions()
                    ),
                });
            }
        }
        Self::with_devices(physical)
    }

    /// Only a CPU, with `total_bytes` of memory (tests and examples that must not depend on the machine).
    pub fn cpu(total_bytes: usize) -> Self {
        Self::with_devices(vec![PhysicalDevice {
            name: "cpu:0".into(),
            kind: Kind::Cpu,
            ordinal: 0,
            total_bytes,
            usable_bytes: total_bytes,
            description: "host".into(),
        }])
    }

    fn with_devices(physical: Vec<PhysicalDevice>) -> Self {
        let settings = vec![Settings::default(); physical.len()];
        DeviceConfig { physical, settings, errors: Vec::new() }
    }

    /// The physical devices present, the CPU first.
    pub fn physical(&self) -> &[PhysicalDevice] {
        &self.physical
    }

    /// Whether a GPU was found.
    pub fn has_gpu(&self) -> bool {
        self.physical.iter().any(|p| p.kind == Kind::Gpu)
    }

    /// The settings of `device`; a name that matches no physical device is recorded as a
    /// mistake (naming the setter and the known devices) that `build` reports.
    fn settings(&mut self, setter: &str, device: &str) -> Option<&mut Settings> {
        match self.physical.iter().position(|p| p.name == device) {
            Some(i) => Some(&mut self.settings[i]),
            None => {
                let known: Vec<&str> = self.physical.iter().map(|p| p.name.as_str()).collect();
                self.errors.push(format!(
                    "{setter}({device:?}, ..): no physical device `{device}` (devices: {known:?}); name one of them"
                ));
                None
            }
        }
    }

    /// Growth: memory taken when needed, exactly sized (TensorFlow's `set_memory_growth(True)`).
    /// Off: the whole device (or its limit) is taken up front. Growth is the default.
    pub fn set_memory_growth(mut self, device: &str, on: bool) -> Self {
        if let Some(s) = self.settings("set_memory_growth", device) {
            s.growth = Some(on);
        }
        self
    }

    /// Takes `fraction` of the device (or of its limit) up front and carves every arena from it
    /// (TensorFlow's `per_process_gpu_memory_fraction`; JAX preallocates 0.75).
    pub fn set_memory_fraction(mut self, device: &str, fraction: f64) -> Self {
        if let Some(s) = self.settings("set_memory_fraction", device) {
            s.fraction = Some(fraction);
        }
        self
    }

    /// A hard limit in bytes on what kiln may hold on the device.
    pub fn set_memory_limit(mut self, device: &str, bytes: usize) -> Self {
        if let Some(s) = self.settings("set_memory_limit", device) {
            s.limit = Some(bytes);
        }
        self
    }

    /// Splits the device into logical devices with these limits (TensorFlow's
    /// `set_logical_device_configuration`), each with its own arenas.
    pub fn set_logical_devices(mut self, device: &str, limits: &[usize]) -> Self {
        if let Some(s) = self.settings("set_logical_devices", device) {
            s.logical = Some(limits.to_vec());
        }
        self
    }

    /// Checks the configuration and makes the devices. Every mistake is reported at once.
    pub fn build(self) -> Result<Devices> {
        let mut errors = self.errors.clone();
        let mut logical = Vec::new();
        let mut count = [0usize; 2];
        for (p, s) in self.physical.iter().zip(&self.settings) {
            if let Some(f) = s.fraction
                && !(f > 0.0 && f <= 1.0)
            {
                errors.push(format!("{}: the memory fraction must be in (0, 1], got {f}", p.name));
            }
            let policy = match (s.growth, s.fraction) {
                (Some(true), Some(_)) => {
                    errors.push(format!(
                        "{}: memory growth and a preallocated fraction exclude each other; choose one",
                        p.name
                    ));
                    Policy::Growth
                }
                (_, Some(f)) if !(f > 0.0 && f <= 1.0) => Policy::Growth,
                (_, Some(fraction)) => Policy::Preallocate { fraction },
                (Some(false), None) => Policy::Preallocate { fraction: 1.0 },
                (_, None) => Policy::Growth,
            };
            if s.limit == Some(0) {
                errors.push(format!(
                    "{}: a memory limit of 0 bytes holds nothing; give a positive limit",
                    p.name
                ));
            }
            if let Some(l) = s.limit
                && l > p.usable_bytes
            {
                let usable = if p.usable_bytes == p.total_bytes {
                    String::new()
                } else {
                    format!(
                        " usable (of {} total: the free memory less the context's and the compiler's headroom)",
                        human_bytes(p.total_bytes)
                    )
                };
                errors.push(format!(
                    "{}: the memory limit {} exceeds the device's {}{usable}",
                    p.name,
                    human_bytes(l),
                    human_bytes(p.usable_bytes)
                ));
            }
            let available = s.limit.unwrap_or(p.usable_bytes);
            let kind = p.kind as usize;
            let shares: Vec<Option<usize>> = match &s.logical {
                Some(limits) => {
                    let sum = limits.iter().try_fold(0usize, |a, &l| a.checked_add(l));
                    let zero: Vec<usize> = (0..limits.len()).filter(|&i| limits[i] == 0).collect();
                    if limits.is_empty() {
                        errors.push(format!(
                            "{}: set_logical_devices got no sizes; logical devices need positive memory limits",
                            p.name
                        ));
                    } else if !zero.is_empty() {
                        errors.push(format!(
                            "{}: logical devices need positive memory limits, but logical device(s) {zero:?} of {limits:?} have 0 bytes",
                            p.name
                        ));
                    } else if let Some(sum) = sum
                        && sum > available
                    {
                        errors.push(format!(
                            "{}: the logical devices' limits add up to {}, more than the {} available",
                            p.name,
                            human_bytes(sum),
                            human_bytes(available)
                        ));
                    } else if sum.is_none() {
                        errors.push(format!(
                            "{}: the logical devices' limits {limits:?} add up to more bytes than a usize counts",
                            p.name
                        ));
                    }
                    limits.iter().map(|&l| Some(l)).collect()
                }
                None => vec![s.limit],
            };
            for share in shares {
                let prefix = if p.kind == Kind::Cpu { "cpu" } else { "gpu" };
                let name = format!("{prefix}:{}", count[kind]);
                count[kind] += 1;
                logical.push(LogicalDevice {
                    name: name.clone(),
                    physical: p.name.clone(),
                    kind: p.kind,
                    ordinal: p.ordinal,
                    budget: DeviceBudget {
                        name,
                        policy,
                        limit: share,
                        capacity: share.unwrap_or(p.usable_bytes),
                    },
                });
            }
        }
        if !errors.is_empty() {
            return Err(RuntimeError::invalid(
                format!(
                    "the device configuration has {} mistake(s):\n  {}",
                    errors.len(),
                    errors.join("\n  ")
                ),
                "fix them in the DeviceConfig before build(); policies cannot change once the devices exist",
            ));
        }
        Ok(Devices { physical: self.physical, logical, tracker: Tracker::default() })
    }
}

/// A device as plans and backends see it: a whole physical device, or one of the parts
/// `set_logical_devices` split it into, with its own limit and arenas.
#[derive(Clone, Debug, PartialEq)]
pub struct LogicalDevice {
    /// "cpu:0", "gpu:1", ...: numbered per kind over all physical devices.
    pub name: String,
    /// The name of the physical device it is part of.
    pub physical: String,
    /// The physical device's kind.
    pub kind: Kind,
    /// The physical device's CUDA ordinal (0 for the CPU).
    pub ordinal: usize,
    /// Its memory policy, limit and capacity.
    pub budget: DeviceBudget,
}

impl LogicalDevice {
    /// What plans on this device must fit: its limit, the preallocated region, or the device.
    pub fn plan_limit(&self) -> usize {
        self.budget.pool_bytes().unwrap_or(self.budget.available())
    }
}

/// One device's statistics: what kiln's plans and variables hold, and for a GPU the driver's view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DeviceMemoryInfo {
    /// What the backends hold on the device for plans and variables, as their accounts record it.
    pub planned: MemoryInfo,
    /// (free, total) bytes from the driver (what nvidia-smi shows), for GPUs.
    pub driver: Option<(usize, usize)>,
}

/// The configured devices: read-only once built.
pub struct Devices {
    physical: Vec<PhysicalDevice>,
    logical: Vec<LogicalDevice>,
    tracker: Tracker,
}

impl Devices {
    /// The physical devices present, the CPU first.
    pub fn physical(&self) -> &[PhysicalDevice] {
        &self.physical
    }

    /// The logical devices, in the order of their physical devices (at least the CPU's).
    pub fn logical(&self) -> &[LogicalDevice] {
        &self.logical
    }

    /// The logical device called `name` (e.g. `gpu:0`); an error listing the devices when there
    /// is none.
    pub fn get(&self, name: &str) -> Result<&LogicalDevice> {
        self.logical.iter().find(|d| d.name == name).ok_or_else(|| {
            let known: Vec<&str> = self.logical.iter().map(|d| d.name.as_str()).collect();
            RuntimeError::invalid(format!("no logical device `{name}`"), format!("the devices are {known:?}"))
        })
    }

    /// The first GPU if there is one, else the CPU.
    pub fn best(&self) -> &LogicalDevice {
        // `build` always makes at least one logical device: the CPU's.
        self.logical.iter().find(|d| d.kind == Kind::Gpu).unwrap_or(&self.logical[0])
    }

    /// Compile options for plans on `names`: device `i` of the plan is `names[i]`, with the
    /// limit plans there must fit.
    pub fn compile_options(&self, names: &[&str]) -> Result<CompileOptions> {
        distinct(names)?;
        let devices = names
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let d = self.get(n)?;
                Ok(DeviceSpec {
                    id: DeviceId(i as u32),
                    name: d.name.clone(),
                    memory_limit: Some(d.plan_limit()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CompileOptions::default().with_devices(devices))
    }

    /// A backend for plans on `names`: logical devices of the CPU, or of one GPU.
    pub fn backend(&self, names: &[&str], seed: u64) -> Result<Box<dyn Backend>> {
        distinct(names)?;
        let devices: Vec<&LogicalDevice> = names.iter().map(|n| self.get(n)).collect::<Result<_>>()?;
        let Some(first) = devices.first() else {
            return Err(RuntimeError::invalid("no device named", "name at least one logical device"));
        };
        if devices.iter().any(|d| d.physical != first.physical) {
            return Err(RuntimeError::invalid(
                format!("{names:?} are on different physical devices"),
                "one backend runs the logical devices of one physical device; split across the logical devices of one CPU or one GPU",
            ));
        }
        let budgets: Vec<DeviceBudget> = devices.iter().map(|d| d.budget.clone()).collect();
        Ok(match first.kind {
            Kind::Cpu => Box::new(CpuBackend::with_budgets(seed, budgets, self.tracker.clone())?),
            Kind::Gpu => {
                Box::new(CudaBackend::with_budgets(first.ordinal, seed, budgets, self.tracker.clone())?)
            }
        })
    }

    /// An eager allocator for `name` following its policy: TensorFlow's BFC with allow_growth
    /// under growth, one region of the preallocated size otherwise; capped by the device's limit.
    pub fn eager_allocator(&self, name: &str) -> Result<Box<dyn Allocator>> {
        let d = self.get(name)?;
        let limit = d.budget.available();
        let opts = match d.budget.pool_bytes() {
            Some(pool) => BfcOptions::preallocate(pool),
            None => BfcOptions::growth(limit),
        }
        .named(d.name.clone());
        Ok(match d.kind {
            Kind::Cpu => Box::new(BfcAllocator::with_options(HostSource::new(), opts)),
            Kind::Gpu => {
                let backend = CudaBackend::new(d.ordinal, 0)?;
                Box::new(BfcAllocator::with_options(CudaSource::new(&backend), opts))
            }
        })
    }

    /// Current and peak bytes of `name` (TensorFlow's `get_memory_info`), and for a GPU the
    /// driver's free and total memory.
    pub fn memory_info(&self, name: &str) -> Result<DeviceMemoryInfo> {
        let d = self.get(name)?;
        let driver = match d.kind {
            Kind::Cpu => None,
            Kind::Gpu => cuda::driver::open(d.ordinal).and_then(|drv| drv.mem_info()).ok(),
        };
        Ok(DeviceMemoryInfo { planned: self.tracker.info(name), driver })
    }

    /// Starts a new peak measurement on `name` (TensorFlow's `reset_memory_stats`).
    pub fn reset_memory_stats(&self, name: &str) -> Result<()> {
        self.get(name)?;
        self.tracker.reset_peak(name);
        Ok(())
    }

    /// The devices with their policies, limits and usage, as `kiln devices` prints them, and
    /// the process's host memory beside them (nvidia-smi and psutil in one place).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "physical devices (visible GPUs: {}):", crate::visible::visible_description());
        for p in &self.physical {
            let _ = writeln!(s, "  {:<6} {:>12}  {}", p.name, human_bytes(p.total_bytes), p.description);
        }
        let _ = writeln!(s, "logical devices:");
        let _ = writeln!(
            s,
            "  {:<6} {:<8} {:<16} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
            "name", "on", "policy", "limit", "arenas", "io", "variables", "current", "peak"
        );
        for d in &self.logical {
            let m = self.tracker.info(&d.name);
            let _ = writeln!(
                s,
                "  {:<6} {:<8} {:<16} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}",
                d.name,
                d.physical,
                d.budget.policy.describe(),
                d.budget.limit.map_or("none".into(), human_bytes),
                human_bytes(m.arenas),
                human_bytes(m.io),
                human_bytes(m.variables),
                human_bytes(m.current),
                human_bytes(m.peak)
            );
        }
        if let Some((rss, peak)) = process_host_memory() {
            let _ = writeln!(
                s,
                "process: {} resident on the host (peak {})",
                human_bytes(rss),
                human_bytes(peak)
            );
        }
        s
    }
}

/// Plan device `i` is logical device `names[i]`: naming one twice would give two plan devices
/// one budget.
fn distinct(names: &[&str]) -> Result<()> {
    for (i, n) in names.iter().enumerate() {
        if let Some(first) = names[..i].iter().position(|m| m == n) {
            return Err(RuntimeError::invalid(
                format!("the logical device `{n}` is named twice in {names:?} (positions {first} and {i})"),
                "name each logical device once; to run on one device, pass it alone",
            ));
        }
    }
    Ok(())
}

/// The units `parse_bytes` accepts, case-insensitive, each 1024-based as TensorFlow's
/// `memory_limit` counts them: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB.
const UNITS: [(&[&str], usize); 5] = [
    (&["", "b"], 1),
    (&["k", "kb", "kib"], 1 << 10),
    (&["m", "mb", "mib"], 1 << 20),
    (&["g", "gb", "gib"], 1 << 30),
    (&["t", "tb", "tib"], 1 << 40),
];

/// A byte count as people write it: "5000MB", "1GB", "1.5GiB", "512 KB", "1e3MB", "1048576".
/// Every unit is 1024-based, as TensorFlow's `memory_limit` counts them: MB = MiB = 2^20 bytes,
/// GB = GiB = 2^30 bytes (so "4GB" is 4 GiB). The number is a decimal (with an optional exponent);
/// the result must be a whole number of bytes that fits a `usize`. Negative numbers, NaN,
/// infinities, fractions of a byte ("0.5B") and sizes that overflow are errors.
pub fn parse_bytes(s: &str) -> Result<usize> {
    const HELP: &str = "write a whole number of bytes or a number with a unit: 5000MB, 1GB, 1.5GiB, 512KB, 1e3MB \
         (units are 1024-based: 1MB = 1MiB = 1048576 bytes)";
    let bad = |why: String| RuntimeError::invalid(format!("`{s}` is not a size: {why}"), HELP);
    let t = s.trim();
    if t.is_empty() {
        return Err(bad("it is empty".into()));
    }
    // The unit is the trailing run of letters ("1e3MB": "MB"; the exponent's `e` is followed by a digit).
    let split = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).len();
    let (num, unit) = (t[..split].trim(), t[split..].to_ascii_lowercase());
    let Some(&(_, scale)) = UNITS.iter().find(|(names, _)| names.contains(&unit.as_str())) else {
        return Err(bad(format!("unknown unit `{}`", &t[split..])));
    };
    if num.is_empty() {
        return Err(bad("there is no number".into()));
    }
    if num.starts_with(['-', '+']) {
        return Err(bad("a size has no sign (and is never negative)".into()));
    }
    let overflow = || bad(format!("more than {} bytes, the most a usize counts", usize::MAX));
    // Whole numbers are exact; decimals and exponents go through f64.
    if num.bytes().all(|b| b.is_ascii_digit()) {
        let n: usize = num.parse().map_err(|_| overflow())?;
        return n.checked_mul(scale).ok_or_else(overflow);
    }
    let v: f64 = num.parse().map_err(|_| bad(format!("`{num}` is not a number")))?;
    if !v.is_finite() {
        return Err(bad(format!("{v} is not a finite number")));
    }
    let bytes = v * scale as f64;
    // 2^64 and above do not fit (usize::MAX as f64 rounds up to 2^64).
    if bytes >= usize::MAX as f64 {
        return Err(overflow());
    }
    if bytes.fract() != 0.0 {
        return Err(bad(format!("it is {bytes} bytes, not a whole number of bytes")));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_like_tensorflow_counts_them() {
        assert_eq!(parse_bytes("5000MB").unwrap(), 5000 * MB);
        assert_eq!(parse_bytes("1GB").unwrap(), GB);
        assert_eq!(parse_bytes("4GB").unwrap(), 4 * GB);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 * GB / 2);
        assert_eq!(parse_bytes("512 KB").unwrap(), 512 * 1024);
        assert_eq!(parse_bytes("2 MiB").unwrap(), 2 * MB);
        assert_eq!(parse_bytes("1e3MB").unwrap(), 1000 * MB);
        assert_eq!(parse_bytes("1E3").unwrap(), 1000);
        assert_eq!(parse_bytes("512").unwrap(), 512);
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("2tb").unwrap(), 2 << 40);
        assert_eq!(parse_bytes("0").unwrap(), 0);
        assert_eq!(parse_bytes(&usize::MAX.to_string()).unwrap(), usize::MAX);
        assert!(parse_bytes("12XB").is_err() && parse_bytes("lots").is_err());
    }

    #[test]
    fn sizes_that_are_not_whole_positive_byte_counts_are_errors() {
        for bad in [
            "",
            " ",
            "0.5B",
            "0.3",
            "-0GB",
            "-1",
            "+5MB",
            "-1.5GB",
            "NaN",
            "nan",
            "inf",
            "-inf",
            "infGB",
            "1e400",
            "99999999999TB",
            "18446744073709551616",
            "1e30GB",
            "MB",
            "1.2.3MB",
            "5e",
            "1e3XB",
            "0x10",
            "1_000",
        ] {
            let e = parse_bytes(bad).expect_err(bad).to_string();
            assert!(e.contains("is not a size") && e.contains("help:"), "{bad}: {e}");
        }
        assert!(parse_bytes("0.5B").unwrap_err().to_string().contains("not a whole number of bytes"));
        assert!(parse_bytes("-0GB").unwrap_err().to_string().contains("never negative"));
        assert!(parse_bytes("99999999999TB").unwrap_err().to_string().contains("the most a usize counts"));
    }
}
