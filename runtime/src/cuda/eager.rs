//! The eager executor on a CUDA device: the growth allocators take their regions from the device
//! with real `cuMemAlloc` calls (`CudaSource`), and every op runs the same generated kernel the
//! planned backend runs, compiled once per op and shape and cached.

use super::backend::CudaBackend;
use super::nvrtc::NvrtcCompiler;
use crate::alloc::{AllocError, RegionSource};
use crate::eager::EagerDevice;
use crate::error::{Result, RuntimeError};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use kiln_compiler::ir::{DType, Op, Shape};
use kiln_kernels::cuda::{self, Arg};
use std::collections::HashMap;
use std::sync::Arc;

/// Device memory for the growth allocators: each region is one `cuMemAlloc`.
pub struct CudaSource {
    ctx: Arc<CudaContext>,
    name: String,
    regions: usize,
}

impl CudaSource {
    pub fn new(backend: &CudaBackend) -> Self {
        CudaSource { ctx: backend.context().clone(), name: backend.describe_short(), regions: 0 }
    }

    /// Regions currently held.
    pub fn regions(&self) -> usize {
        self.regions
    }
}

impl RegionSource for CudaSource {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        let refused =
            |reason: String| AllocError::DeviceRefused { source_name: self.name.clone(), bytes, reason };
        self.ctx.bind_to_thread().map_err(|e| refused(format!("{e:?}")))?;
        // SAFETY: a plain device allocation in the bound context.
        let ptr =
            unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|e| refused(format!("{e:?}")))?;
        self.regions += 1;
        Ok(ptr)
    }

    fn free_region(&mut self, base: u64, _bytes: usize) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `base` came from `alloc_region` and is freed once.
            let _ = unsafe { cudarc::driver::result::free_sync(base) };
            self.regions -= 1;
        }
    }

    fn name(&self) -> &str {
        &self.name
    }
}

struct Loaded {
    launches: Vec<(CudaFunction, LaunchConfig, Vec<Arg>)>,
}

/// Runs eager ops on a CUDA device (the backend's context, stream and kernel caches).
pub struct CudaEager {
    name: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compiler: Arc<NvrtcCompiler>,
    kernels: HashMap<String, Arc<Loaded>>,
}

impl CudaEager {
    pub fn new(backend: &CudaBackend) -> Self {
        CudaEager {
            name: backend.describe_short(),
            ctx: backend.context().clone(),
            stream: backend.stream().clone(),
            compiler: backend.compiler().clone(),
            kernels: HashMap::new(),
        }
    }

    fn kernel(&mut self, op: &Op, types: &[(&Shape, DType)], out: (&Shape, DType)) -> Result<Arc<Loaded>> {
        // Eager frameworks look kernels up per op and shape; so does this cache.
        let key = format!("{op:?}|{types:?}|{out:?}");
        if let Some(k) = self.kernels.get(&key) {
            return Ok(k.clone());
        }
        let k = cuda::generate(op, types, out)?;
        let ptx = self.compiler.compile(&k.source)?;
        let module = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx.as_str()))
            .map_err(|e| RuntimeError::Cuda(format!("loading a compiled kernel: {e:?}")))?;
        let launches = k
            .launches
            .iter()
            .map(|l| {
                let f = module
                    .load_function(&l.function)
                    .map_err(|e| RuntimeError::Cuda(format!("kernel function `{}`: {e:?}", l.function)))?;
                let cfg = LaunchConfig {
                    grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                    block_dim: (l.block[0], l.block[1], l.block[2]),
                    shared_mem_bytes: l.shared_bytes,
                };
                Ok((f, cfg, l.args.clone()))
            })
            .collect::<Result<_>>()?;
        let loaded = Arc::new(Loaded { launches });
        self.kernels.insert(key, loaded.clone());
        Ok(loaded)
    }
}

fn driver(e: cudarc::driver::DriverError) -> RuntimeError {
    RuntimeError::Cuda(format!("{e:?}"))
}

impl EagerDevice for CudaEager {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn write(&mut self, addr: u64, data: &[f32]) -> Result<()> {
        self.stream.synchronize().map_err(driver)?;
        // SAFETY: `addr` is a live device block of at least data.len() f32s.
        unsafe { cudarc::driver::result::memcpy_htod_sync(addr, data) }.map_err(driver)
    }

    fn read(&mut self, addr: u64, n: usize) -> Result<Vec<f32>> {
        self.stream.synchronize().map_err(driver)?;
        let mut out = vec![0f32; n];
        // SAFETY: `addr` is a live device block of at least n f32s.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut out, addr) }.map_err(driver)?;
        Ok(out)
    }

    fn run_op(
        &mut self,
        op: &Op,
        types: &[(&Shape, DType)],
        out_type: (&Shape, DType),
        inputs: &[u64],
        output: u64,
    ) -> Result<()> {
        let k = self.kernel(op, types, out_type)?;
        for (f, cfg, args) in &k.launches {
            let ptrs: Vec<u64> = args
                .iter()
                .map(|a| match a {
                    Arg::Input(i) => inputs[*i],
                    Arg::Output => output,
                })
                .collect();
            let mut b = self.stream.launch_builder(f);
            for p in &ptrs {
                b.arg(p);
            }
            // SAFETY: device pointers of live blocks sized for this op's shapes.
            unsafe { b.launch(*cfg) }.map_err(driver)?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.stream.synchronize().map_err(driver)
    }
}
