//! The driver seam: everything the CUDA backend and the CUDA eager executor ask of a device, in
//! one small trait. Two implementations: `CudaDriver` (cudarc, NVRTC-compiled cubins with PTX as
//! the fallback, cached on disk) and `emulator::EmulatedDevice` (the same generated CUDA C built
//! for the host, host memory with guarded allocations). Budgets, policies, arena binding, io
//! copies, statistics and the eager allocators sit above it and are the same code for both.
//!
//! `open` picks the emulated device wherever a CUDA device is asked for when `KILN_CUDA_EMULATE=1`
//! (or `emulator::emulate_in_process` was called).

use super::emulator;
use super::nvrtc::{CompileStats, Image, NvrtcCompiler};
use super::probe::{self, DeviceInfo};
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg};
use kiln_kernels::cuda::{CudaKernel, Launch};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// A loaded kernel function, ready to launch on the driver that loaded it.
#[derive(Clone, Debug)]
pub enum Function {
    /// A function of a module loaded by cudarc's driver on a CUDA device.
    Cuda(CudaFunction),
    /// A function of the emulated device's host build of the kernel source.
    Host(emulator::HostFunction),
}

/// A recorded sequence of launches (an instantiated CUDA graph), replayed with one call.
pub struct Recording(cudarc::driver::CudaGraph);

// SAFETY: a CUDA graph exec is a handle the driver may use from any thread that binds its
// context (`replay` binds it); the backend replays a recording only from `run`, under `&mut
// self`, so it is never launched from two threads at once.
unsafe impl Send for Recording {}
// SAFETY: as for Send: shared references reach `replay` only, which the backend calls under
// `&mut self`.
unsafe impl Sync for Recording {}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recording")
    }
}

/// What the CUDA backend and eager executor need from a device.
pub trait Driver: Send + Sync {
    /// Identifies the physical device within the process: backends of one id share its books.
    fn id(&self) -> String;
    /// The device's ordinal, name, compute capability and total memory.
    fn info(&self) -> &DeviceInfo;
    /// The driver's and the compiler's versions, for reports and errors.
    fn versions(&self) -> String;
    /// (free, total) bytes, as cuMemGetInfo reports them.
    fn mem_info(&self) -> Result<(usize, usize)>;
    /// A zeroed allocation of `bytes` (at least 1), 256-byte aligned; the error says why not.
    fn alloc(&self, bytes: usize) -> std::result::Result<u64, String>;
    /// Frees an allocation.
    ///
    /// # Safety
    /// `ptr` came from `alloc` of this driver, is freed once, and no launch or copy uses it after.
    unsafe fn free(&self, ptr: u64);
    /// Copies host bytes to device memory (after the stream's earlier work).
    ///
    /// # Safety
    /// `[dst, dst + src.len())` lies inside one allocation of this driver.
    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()>;
    /// Copies device memory to the host (after the stream's earlier work).
    ///
    /// # Safety
    /// `[src, src + dst.len())` lies inside one allocation of this driver.
    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()>;
    /// Copies `bytes` bytes between device addresses of this device (after the stream's earlier
    /// work).
    ///
    /// # Safety
    /// `[src, src + bytes)` lies inside device memory of this device (an allocation of this driver
    /// or another library's on the same device) and `[dst, dst + bytes)` inside one allocation
    /// of this driver; the two do not overlap.
    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()>;
    /// Compiles (or finds in a cache) and loads `kernels`: per kernel, one function per launch.
    fn load(&self, kernels: &[&CudaKernel]) -> Result<Vec<Vec<Function>>>;
    /// Queues one launch of `f` with `launch`'s geometry and these pointer arguments.
    ///
    /// # Safety
    /// Every argument is an address inside an allocation of this driver holding what the kernel
    /// reads and writes for the shapes it was generated for.
    unsafe fn launch(&self, f: &Function, launch: &Launch, args: &[u64]) -> Result<()>;
    /// Waits for everything queued; reports a failed launch.
    fn synchronize(&self) -> Result<()>;
    /// Records the launches `queue` makes as one replayable graph (CUDA stream capture: nothing
    /// runs while recording), or `None` where the driver replays nothing (the emulated device),
    /// in which case `queue` has launched its work as usual.
    fn record(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<Option<Recording>>;
    /// Queues one replay of a recording of this driver.
    ///
    /// # Safety
    /// Every address its launches were recorded with still lies in the allocation it lay in
    /// then, holding what the kernels read and write.
    unsafe fn replay(&self, recording: &Recording) -> Result<()>;
    /// Milliseconds the device spent on what `queue` enqueues: two timing events recorded on the
    /// stream around it (the emulated device, which has no clock of its own: the host's clock
    /// between two synchronisations). Waits for the work to finish.
    fn time(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<f64>;
    /// How many kernels were compiled or found in the caches, and the time spent compiling.
    fn compile_stats(&self) -> CompileStats;
    /// "NVRTC 13.0 (cubin for sm_90)" or "host C++ (c++)".
    fn compiler_description(&self) -> String;
    /// The CUDA stream every launch and copy is queued on (a `CUstream`), with the device's
    /// context bound to the calling thread: for libraries that queue work of their own on it
    /// (NCCL, `super::nccl`). `None` where there is no CUDA stream (the emulated device).
    fn raw_stream(&self) -> Result<Option<usize>> {
        Ok(None)
    }
}

/// The bytes a preallocated pool leaves free for the context's growth, NVRTC and module loads:
/// 1/64 of the device, between 64 MiB and 1 GiB, and never over 1/16 of it.
pub fn headroom(total: usize) -> usize {
    (total / 64).clamp(64 << 20, 1 << 30).min(total / 16)
}

/// The driver of CUDA device `ordinal`: the emulated device when emulation is on, else cudarc's.
pub fn open(ordinal: usize) -> Result<Arc<dyn Driver>> {
    if let Some(memory) = emulator::emulation().map_err(RuntimeError::Cuda)? {
        if ordinal != 0 {
            return Err(RuntimeError::Cuda(format!(
                "no CUDA device {ordinal}: the emulated device (KILN_CUDA_EMULATE=1) is device 0"
            )));
        }
        return Ok(emulator::EmulatedDevice::shared(memory).map_err(RuntimeError::Cuda)?);
    }
    Ok(Arc::new(CudaDriver::new(ordinal)?))
}

fn err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Cuda(format!("{what}: {e:?}"))
}

/// cudarc's driver: one context and one stream per backend, kernels compiled by NVRTC.
pub struct CudaDriver {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compiler: NvrtcCompiler,
    modules: Mutex<HashMap<String, Arc<CudaModule>>>,
}

impl CudaDriver {
    /// The driver of CUDA device `ordinal`: a new context and stream on it, and an NVRTC compiler
    /// for its architecture; an error (never a panic) when the driver, the device or NVRTC is
    /// missing.
    pub fn new(ordinal: usize) -> Result<Self> {
        let found = probe::probe();
        found.usable().map_err(RuntimeError::Cuda)?;
        let devices = found.devices.map_err(RuntimeError::Cuda)?;
        let info = devices
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| RuntimeError::Cuda(format!("no CUDA device {ordinal}")))?;
        let ctx = CudaContext::new(ordinal).map_err(err("creating the context"))?;
        // One stream runs every step in order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        // A stream of its own (graphs cannot be captured on the legacy default stream); it does
        // not wait for the legacy stream, so copies and fills are queued on it too.
        let stream = ctx.new_stream().map_err(err("creating a stream"))?;
        let compiler = NvrtcCompiler::new(info.compute_capability)?;
        Ok(CudaDriver { info, ctx, stream, compiler, modules: Mutex::new(HashMap::new()) })
    }

    /// The NVRTC compiler (and caches) this driver's kernels are built with.
    pub fn compiler(&self) -> &NvrtcCompiler {
        &self.compiler
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(err("binding the context"))
    }
}

impl Driver for CudaDriver {
    fn id(&self) -> String {
        format!("cuda:{}", self.info.ordinal)
    }

    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn versions(&self) -> String {
        let driver = probe::driver_version().map_or("unknown".into(), |(a, b)| format!("{a}.{b}"));
        let (a, b) = self.compiler.version();
        format!("CUDA driver {driver}, NVRTC {a}.{b}")
    }

    fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(err("cuMemGetInfo"))
    }

    fn alloc(&self, bytes: usize) -> std::result::Result<u64, String> {
        self.bind().map_err(|e| e.to_string())?;
        // SAFETY: a plain allocation in the bound context.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(1)) }
            .map_err(|e| format!("cuMemAlloc: {e:?}"))?;
        // SAFETY: `ptr` was just allocated with at least `bytes.max(1)` bytes; the fill is
        // queued on the stream and waited for, so no later launch sees it unfinished.
        let filled =
            unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes.max(1), self.stream.cu_stream()) }
                .and_then(|()| self.stream.synchronize());
        if let Err(e) = filled {
            // SAFETY: freed once, never used.
            let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
            return Err(format!("cuMemsetD8: {e:?}"));
        }
        Ok(ptr)
    }

    unsafe fn free(&self, ptr: u64) {
        if self.bind().is_ok() && self.stream.synchronize().is_ok() {
            // SAFETY: the caller guarantees `ptr` came from `alloc` and is freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
        }
    }

    unsafe fn htod(&self, dst: u64, src: &[u8]) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(err("waiting for the stream"))?;
        // SAFETY: the caller guarantees the destination range lies in one allocation; `src`
        // outlives the copy, which is waited for before returning.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(err("copying to the device"))?;
        self.stream.synchronize().map_err(err("copying to the device"))
    }

    unsafe fn dtoh(&self, src: u64, dst: &mut [u8]) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(err("waiting for the stream"))?;
        // SAFETY: the caller guarantees the source range lies in one allocation; `dst` outlives
        // the copy, which is waited for before returning.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }
            .map_err(err("copying to the host"))?;
        self.stream.synchronize().map_err(err("copying to the host"))
    }

    unsafe fn dtod(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(err("waiting for the stream"))?;
        // SAFETY: the caller guarantees both ranges are device memory of this device, the
        // destination inside one allocation; the copy is waited for before returning.
        unsafe { cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(err("copying on the device"))?;
        self.stream.synchronize().map_err(err("copying on the device"))
    }

    fn load(&self, kernels: &[&CudaKernel]) -> Result<Vec<Vec<Function>>> {
        let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
        let images = self.compiler.compile_images(&sources)?;
        let mut out = Vec::with_capacity(kernels.len());
        for (k, image) in kernels.iter().zip(images) {
            let key = self.compiler.image_key(&k.source);
            let module = {
                let mut modules = self.modules.lock().expect("module cache lock");
                match modules.get(&key) {
                    Some(m) => m.clone(),
                    None => {
                        let loaded = match &*image {
                            Image::Cubin(bytes) => {
                                self.ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bytes.clone()))
                            }
                            Image::Ptx(ptx) => {
                                self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx.as_str()))
                            }
                        };
                        let m = loaded.map_err(|e| {
                            RuntimeError::Cuda(format!(
                                "loading the compiled kernel `{}` ({}, cuModuleLoadData): {e:?}; {}",
                                k.describe,
                                image.describe(),
                                self.versions()
                            ))
                        })?;
                        modules.insert(key, m.clone());
                        m
                    }
                }
            };
            let functions = k
                .launches
                .iter()
                .map(|l| {
                    module
                        .load_function(&l.function)
                        .map(Function::Cuda)
                        .map_err(err(&format!("finding kernel function `{}`", l.function)))
                })
                .collect::<Result<Vec<_>>>()?;
            out.push(functions);
        }
        Ok(out)
    }

    unsafe fn launch(&self, f: &Function, launch: &Launch, args: &[u64]) -> Result<()> {
        let Function::Cuda(f) = f else {
            return Err(RuntimeError::Cuda("a host function launched on a CUDA device".into()));
        };
        let config = LaunchConfig {
            grid_dim: (launch.grid[0], launch.grid[1], launch.grid[2]),
            block_dim: (launch.block[0], launch.block[1], launch.block[2]),
            shared_mem_bytes: launch.shared_bytes,
        };
        let mut builder = self.stream.launch_builder(f);
        for a in args {
            builder.arg(a);
        }
        // SAFETY: the caller guarantees every argument addresses memory sized for the kernel.
        unsafe { builder.launch(config) }.map_err(err("launching a kernel"))?;
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        self.bind()?;
        self.stream.synchronize().map_err(err("waiting for the stream"))
    }

    fn record(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<Option<Recording>> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.bind()?;
        self.stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(err("starting a graph capture"))?;
        let queued = queue();
        // The capture ends whatever happened, so that the stream is usable again.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        queued?;
        let graph = graph.map_err(err("capturing the launches as a graph"))?;
        let graph = graph.ok_or_else(|| RuntimeError::Cuda("the graph capture recorded nothing".into()))?;
        graph.upload().map_err(err("uploading a graph"))?;
        Ok(Some(Recording(graph)))
    }

    unsafe fn replay(&self, recording: &Recording) -> Result<()> {
        recording.0.launch().map_err(err("launching a graph"))
    }

    fn time(&self, queue: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.ctx.new_event(timing).map_err(err("creating a timing event"))?;
        let end = self.ctx.new_event(timing).map_err(err("creating a timing event"))?;
        start.record(&self.stream).map_err(err("recording a timing event"))?;
        queue()?;
        end.record(&self.stream).map_err(err("recording a timing event"))?;
        let ms = start.elapsed_ms(&end).map_err(err("reading a timing event"))?;
        Ok(f64::from(ms))
    }

    fn compile_stats(&self) -> CompileStats {
        self.compiler.stats()
    }

    fn raw_stream(&self) -> Result<Option<usize>> {
        self.bind()?;
        Ok(Some(self.stream.cu_stream() as usize))
    }

    fn compiler_description(&self) -> String {
        let (a, b) = self.compiler.version();
        let (major, minor) = self.info.compute_capability;
        format!("NVRTC {a}.{b} (cubin for sm_{major}{minor}, PTX where NVRTC cannot)")
    }
}
