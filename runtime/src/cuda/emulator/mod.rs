//! The emulated CUDA device: what the CUDA backend runs on in CI, where there is no GPU.
//!
//! Kernels are the same generated CUDA C, compiled for the host (`host`: the system C++ compiler
//! against `cuda_host.h`, one shared library per batch of modules, cached on disk). Memory is
//! real host memory; every launch runs with its grid and block, in stream order (launches are
//! synchronous, one at a time in the process). Memory info reports what a driver would: the
//! configured total (16 GiB, `KILN_CUDA_EMULATE_MEMORY=256MiB`, or `EmulatedDevice::new`'s
//! argument), less a context (1/32 of it) and every allocation rounded up to the driver's 2 MiB.
//!
//! A host-side sanitizer checks every launch, with two mechanisms:
//! - each allocation ends flush against a `PROT_NONE` page, and another sits before it, so a
//!   read or write past either end, near or far, faults at once: the fault handler names the
//!   kernel and the address on stderr before the process dies (it cannot be resumed soundly);
//! - the bytes between the page boundary and the allocation (the start is 256-byte aligned, the
//!   end rounded to 256 bytes) are filled with a pattern and checked after every launch: a write
//!   there is reported as the launch's error, naming the kernel, the allocation and the offset.
//!
//! Besides, every pointer argument must lie inside a live allocation, and copies are checked
//! against the allocation they touch. As on a GPU, a failed launch is reported at the next
//! synchronisation or copy (the error is sticky for this device).

mod fault;
pub mod host;

pub use host::HostFunction;

use super::driver::{Driver, Function, Recording};
use super::nvrtc::CompileStats;
use super::probe::DeviceInfo;
use crate::error::{Result, RuntimeError};
use kiln_compiler::device::human_bytes;
use kiln_kernels::cuda::{CudaKernel, Launch};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// The default memory of the emulated device.
pub const DEFAULT_MEMORY: usize = 16 << 30;
/// The driver's allocation granularity, which memory info counts in.
const GRANULARITY: usize = 2 << 20;
const PATTERN: u8 = 0xA5;

static IN_PROCESS: OnceLock<usize> = OnceLock::new();

/// Turns emulation on for this process (as `KILN_CUDA_EMULATE=1` does), with `memory` bytes;
/// for tests that must not depend on the environment. Later calls keep the first size.
pub fn emulate_in_process(memory: usize) {
    let _ = IN_PROCESS.set(memory);
}

/// Whether CUDA devices are emulated (`KILN_CUDA_EMULATE=1` or `emulate_in_process`), and with
/// how much memory; an error for a malformed setting.
pub fn emulation() -> std::result::Result<Option<usize>, String> {
    if let Some(&m) = IN_PROCESS.get() {
        return Ok(Some(m));
    }
    match std::env::var("KILN_CUDA_EMULATE") {
        Ok(v) if v == "1" => {}
        Ok(v) if v.is_empty() || v == "0" => return Ok(None),
        Ok(v) => return Err(format!("KILN_CUDA_EMULATE={v:?}: set it to 1 (emulate) or 0")),
        Err(_) => return Ok(None),
    }
    match std::env::var("KILN_CUDA_EMULATE_MEMORY") {
        Ok(v) => match crate::devices::parse_bytes(&v) {
            Ok(0) => {
                Err("KILN_CUDA_EMULATE_MEMORY=0: the emulated device needs memory; give e.g. 256MiB".into())
            }
            Ok(m) => Ok(Some(m)),
            Err(e) => Err(format!("KILN_CUDA_EMULATE_MEMORY: {e}")),
        },
        Err(_) => Ok(Some(DEFAULT_MEMORY)),
    }
}

/// The description the probe reports for the emulated device.
pub fn device_info(memory: usize) -> DeviceInfo {
    DeviceInfo {
        ordinal: 0,
        name: "kiln emulated CUDA device (host C++)".into(),
        compute_capability: (9, 0),
        total_bytes: memory,
    }
}

/// What all emulated devices of one physical device share: its memory.
struct Ledger {
    id: u64,
    total: usize,
    context: usize,
    used: Mutex<usize>,
}

/// One guarded host allocation: `[map, map + page)` and the last page are `PROT_NONE`; the
/// allocation `[base, base + bytes)` ends within 256 bytes of the last page; the bytes between
/// hold the pattern.
struct Block {
    map: usize,
    map_len: usize,
    base: usize,
    bytes: usize,
    /// `base + round_up(bytes, 256)`: the end of the tail pad, the start of the last page.
    end: usize,
    page: usize,
    granular: usize,
}

impl Block {
    fn pads(&self) -> [(usize, usize); 2] {
        [(self.map + self.page, self.base), (self.base + self.bytes, self.end)]
    }
}

#[derive(Default)]
struct State {
    blocks: BTreeMap<usize, Block>,
    /// A failed launch, reported by every later synchronisation, copy and launch.
    sticky: Option<String>,
    /// Fault injection for tests: the next launch of a function whose name contains this fails.
    inject: Option<String>,
    launches: u64,
}

/// The emulated device (see the module's documentation).
pub struct EmulatedDevice {
    info: DeviceInfo,
    ledger: Arc<Ledger>,
    state: Mutex<State>,
    cache: PathBuf,
    kernels: Mutex<HashMap<String, Vec<HostFunction>>>,
    stats: Mutex<CompileStats>,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
}

impl EmulatedDevice {
    /// A device of its own with `memory` bytes (tests: memory limits without the environment).
    pub fn new(memory: usize) -> std::result::Result<Arc<Self>, String> {
        let ledger = Arc::new(Ledger {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            total: memory,
            context: (memory / 32) / GRANULARITY * GRANULARITY,
            used: Mutex::new(0),
        });
        Self::on(ledger)
    }

    /// Device 0 of the process under `KILN_CUDA_EMULATE=1`: every backend's device shares its
    /// memory (as backends share a GPU) and has its own error state (as contexts do).
    pub fn shared(memory: usize) -> std::result::Result<Arc<Self>, String> {
        static LEDGER: OnceLock<Arc<Ledger>> = OnceLock::new();
        let ledger = LEDGER
            .get_or_init(|| {
                Arc::new(Ledger {
                    id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                    total: memory,
                    context: (memory / 32) / GRANULARITY * GRANULARITY,
                    used: Mutex::new(0),
                })
            })
            .clone();
        Self::on(ledger)
    }

    fn on(ledger: Arc<Ledger>) -> std::result::Result<Arc<Self>, String> {
        host::available()
            .map_err(|e| format!("the emulated CUDA device compiles kernels for the host: {e}"))?;
        fault::install();
        Ok(Arc::new(EmulatedDevice {
            info: device_info(ledger.total),
            ledger,
            state: Mutex::new(State::default()),
            cache: host::default_cache_dir(),
            kernels: Mutex::new(HashMap::new()),
            stats: Mutex::new(CompileStats::default()),
        }))
    }

    /// Tests: the next launch of a function whose name contains `function` fails, as a kernel
    /// that hit an illegal address does (reported at the next synchronisation).
    pub fn inject_fault(&self, function: &str) {
        self.state().inject = Some(function.to_string());
    }

    /// Launches run so far.
    pub fn launches(&self) -> u64 {
        self.state().launches
    }

    /// Live allocations.
    pub fn allocations(&self) -> usize {
        self.state().blocks.len()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn sticky(&self) -> Result<()> {
        match &self.state().sticky {
            Some(e) => Err(RuntimeError::Cuda(e.clone())),
            None => Ok(()),
        }
    }

    /// The block holding `[addr, addr + len)`, if one does.
    fn find(state: &State, addr: usize, len: usize) -> Option<&Block> {
        let (_, b) = state.blocks.range(..=addr).next_back()?;
        (addr >= b.base && addr.checked_add(len)? <= b.base + b.bytes.max(1)).then_some(b)
    }

    fn check_range(&self, state: &State, addr: u64, len: usize, what: &str) -> Result<usize> {
        let a = addr as usize;
        match Self::find(state, a, len) {
            Some(_) => Ok(a),
            None => Err(RuntimeError::Cuda(format!(
                "{what}: [{addr:#x}, +{len}) is not inside one allocation of the emulated device \
                 (CUDA_ERROR_INVALID_VALUE); copy only within memory the backend allocated"
            ))),
        }
    }

    /// The first pad byte that lost its pattern, as (block, offset from the allocation's start).
    fn check_pads(state: &State) -> Option<(&Block, isize)> {
        for b in state.blocks.values() {
            for (start, end) in b.pads() {
                // SAFETY: the pads lie inside the block's readable and writable pages (`alloc`).
                let pad = unsafe { std::slice::from_raw_parts(start as *const u8, end - start) };
                if let Some(i) = pad.iter().position(|&x| x != PATTERN) {
                    return Some((b, (start + i) as isize - b.base as isize));
                }
            }
        }
        None
    }
}

impl Drop for EmulatedDevice {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let mut used = self.ledger.used.lock().unwrap_or_else(|e| e.into_inner());
        for b in std::mem::take(&mut state.blocks).into_values() {
            *used -= b.granular;
            // SAFETY: the mapping was made by `alloc` and nothing refers to it once the device is gone.
            unsafe { libc::munmap(b.map as *mut c_void, b.map_len) };
        }
    }
}

impl Driver for EmulatedDevice {
    fn id(&self) -> String {
        format!("emulated:{}", self.ledger.id)
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn versions(&self) -> String {
        format!("emulated CUDA device (kernels built by {} on the host)", host::compiler())
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        let used = *self.ledger.used.lock().unwrap_or_else(|e| e.into_inner());
        Ok((self.ledger.total.saturating_sub(self.ledger.context + used), self.ledger.total))
    }

    fn alloc(&self, bytes: usize) -> std::result::Result<u64, String> {
        let oom = || {
            format!(
                "cuMemAlloc of {} on the emulated device: out of memory (CUDA_ERROR_OUT_OF_MEMORY)",
                human_bytes(bytes)
            )
        };
        let page = page_size();
        let inner = bytes.max(1).checked_next_multiple_of(256).ok_or_else(oom)?;
        let body = inner.checked_next_multiple_of(page).ok_or_else(oom)?;
        let granular = bytes.max(1).checked_next_multiple_of(GRANULARITY).ok_or_else(oom)?;
        let map_len = body.checked_add(2 * page).ok_or_else(oom)?;
        {
            let mut used = self.ledger.used.lock().unwrap_or_else(|e| e.into_inner());
            let free = self.ledger.total.saturating_sub(self.ledger.context + *used);
            if granular > free {
                return Err(format!(
                    "{} ({} free of {})",
                    oom(),
                    human_bytes(free),
                    human_bytes(self.ledger.total)
                ));
            }
            *used += granular;
        }
        let unreserve = || *self.ledger.used.lock().unwrap_or_else(|e| e.into_inner()) -= granular;
        // SAFETY: a fresh anonymous private mapping; no existing memory is touched.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            unreserve();
            return Err(format!("{} (the host refused {} bytes)", oom(), map_len));
        }
        let map = map as usize;
        // SAFETY: `[map + page, map + page + body)` lies inside the mapping just made.
        if unsafe { libc::mprotect((map + page) as *mut c_void, body, libc::PROT_READ | libc::PROT_WRITE) }
            != 0
        {
            // SAFETY: the mapping just made, unused.
            unsafe { libc::munmap(map as *mut c_void, map_len) };
            unreserve();
            return Err(format!("{} (mprotect failed)", oom()));
        }
        let end = map + page + body;
        let block = Block { map, map_len, base: end - inner, bytes, end, page, granular };
        for (start, stop) in block.pads() {
            // SAFETY: the pads lie inside the readable and writable pages set above.
            unsafe { std::ptr::write_bytes(start as *mut u8, PATTERN, stop - start) };
        }
        let base = block.base;
        self.state().blocks.insert(base, block);
        Ok(base as u64)
    }

    unsafe fn free(&self, ptr: u64) {
        let block = self.state().blocks.remove(&(ptr as usize));
        if let Some(b) = block {
            *self.ledger.used.lock().unwrap_or_else(|e| e.into_inner()) -= b.granular;
            // SAFETY: the mapping was made by `alloc`; the caller guarantees nothing uses it after.
            unsafe { libc::munmap(b.map as *mut c_void, b.map_len) };
        }
    }

    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.sticky()?;
        let state = self.state();
        let dst = self.check_range(&state, dst, src.len(), "copying to the device")?;
        // SAFETY: `[dst, dst + len)` was just checked to lie inside a live, writable allocation;
        // launches are synchronous, so no kernel runs on it now.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.sticky()?;
        let state = self.state();
        let src = self.check_range(&state, src, dst.len(), "copying to the host")?;
        // SAFETY: `[src, src + len)` was just checked to lie inside a live allocation.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.sticky()?;
        let state = self.state();
        let src = self.check_range(&state, src, bytes, "copying on the device (source)")?;
        let dst = self.check_range(&state, dst, bytes, "copying on the device")?;
        // SAFETY: both ranges were just checked to lie inside live allocations of this device;
        // `copy` allows them to overlap.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes) };
        Ok(())
    }

    fn load(&self, kernels: &[&CudaKernel]) -> Result<Vec<Vec<Function>>> {
        let key = |k: &CudaKernel| -> String {
            let mut h = Sha256::new();
            h.update(k.source.as_bytes());
            for l in &k.launches {
                h.update(l.function.as_bytes());
                h.update([0]);
            }
            h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect()
        };
        let keys: Vec<String> = kernels.iter().map(|k| key(k)).collect();
        let mut missing: Vec<usize> = Vec::new();
        {
            let cache = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
            for (i, k) in keys.iter().enumerate() {
                if !cache.contains_key(k) && !missing.iter().any(|&m| keys[m] == *k) {
                    missing.push(i);
                }
            }
        }
        let start = Instant::now();
        if !missing.is_empty() {
            let batch: Vec<&CudaKernel> = missing.iter().map(|&i| kernels[i]).collect();
            let units = if batch.len() >= 8 { 2 } else { 1 };
            let built = host::compile(&batch, &self.cache, units)
                .map_err(|e| RuntimeError::Cuda(format!("building kernels for the emulated device: {e}")))?;
            let mut cache = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
            for (&i, functions) in missing.iter().zip(built) {
                cache.insert(keys[i].clone(), functions);
            }
        }
        let mut stats = self.stats.lock().unwrap_or_else(|e| e.into_inner());
        stats.compiled += missing.len();
        stats.from_memory += kernels.len() - missing.len();
        stats.compile_seconds += start.elapsed().as_secs_f64();
        drop(stats);
        let cache = self.kernels.lock().unwrap_or_else(|e| e.into_inner());
        Ok(keys.iter().map(|k| cache[k].iter().cloned().map(Function::Host).collect()).collect())
    }

    unsafe fn launch(&self, f: &Function, launch: &Launch, args: &[u64]) -> Result<()> {
        self.sticky()?;
        let Function::Host(f) = f else {
            return Err(RuntimeError::Cuda("a CUDA function launched on the emulated device".into()));
        };
        let mut state = self.state();
        state.launches += 1;
        let threads = launch.block.iter().map(|&b| b as u64).product::<u64>();
        let blocks = launch.grid.iter().map(|&b| b as u64).product::<u64>();
        let mut failure = None;
        if threads == 0 || threads > 1024 || blocks == 0 || launch.shared_bytes > 0 {
            failure = Some(format!(
                "kernel `{}`: launch of grid {:?} x block {:?} ({} B dynamic shared memory) is invalid \
                 (CUDA_ERROR_INVALID_VALUE)",
                f.name(),
                launch.grid,
                launch.block,
                launch.shared_bytes
            ));
        }
        if let Some(i) = args.iter().position(|&a| Self::find(&state, a as usize, 1).is_none()) {
            failure = Some(format!(
                "kernel `{}`: pointer argument {i} ({:#x}) is not inside any allocation of the emulated \
                 device (an illegal address)",
                f.name(),
                args[i]
            ));
        }
        if let Some(name) = state.inject.take_if(|n| f.name().contains(n.as_str())) {
            failure = Some(format!(
                "kernel `{}`: an illegal memory access was encountered (fault injected for `{name}`)",
                f.name()
            ));
        }
        if let Some(why) = failure {
            state.sticky = Some(why);
            return Ok(());
        }
        let mut ptrs: Vec<*mut c_void> = args.iter().map(|&a| a as *mut c_void).collect();
        {
            // SAFETY: every argument was checked to lie inside a live allocation of this device,
            // and the caller guarantees each holds what the kernel touches; an access past an
            // allocation's ends faults on its guard pages (reported by `fault`) or lands in its
            // pads (checked below); the state lock keeps frees and copies out.
            unsafe { f.launch(launch.grid, launch.block, &mut ptrs) };
        }
        if let Some((b, at)) = Self::check_pads(&state) {
            let why = format!(
                "kernel `{}` wrote outside an allocation: byte {at} relative to the {}-byte allocation at \
                 {:#x} ({} its end) was overwritten",
                f.name(),
                b.bytes,
                b.base,
                if at < 0 { "before" } else { "past" }
            );
            state.sticky = Some(why);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.sticky()
    }

    fn record(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<Option<Recording>> {
        queue().map(|()| None)
    }

    unsafe fn replay(&self, _: &Recording) -> Result<()> {
        Err(RuntimeError::Cuda("the emulated device records no graphs to replay".into()))
    }

    fn time(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        self.synchronize()?;
        let start = std::time::Instant::now();
        queue()?;
        self.synchronize()?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    }

    fn compile_stats(&self) -> CompileStats {
        *self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn compiler_description(&self) -> String {
        format!("host C++ ({}, emulated device)", host::compiler())
    }
}
