//! The eager executor on a CUDA device: the growth allocators take their regions from the device
//! with real allocations through the driver (`CudaSource`), and every op runs the same generated
//! kernel the planned backend runs, compiled once per op and shape and cached.

use super::backend::CudaBackend;
use super::driver::{Driver, Function};
use crate::alloc::{AllocError, RegionSource};
use crate::eager::EagerDevice;
use crate::error::{Result, RuntimeError};
use kiln_compiler::ir::{DType, Op, Shape};
use kiln_kernels::cuda::{self, Arg, Launch};
use std::collections::HashMap;
use std::sync::Arc;

/// Device memory for the growth allocators: each region is one device allocation.
pub struct CudaSource {
    driver: Arc<dyn Driver>,
    name: String,
    regions: usize,
}

impl CudaSource {
    /// A source of regions on `backend`'s device, through its driver, named as the backend
    /// describes itself in short.
    pub fn new(backend: &CudaBackend) -> Self {
        CudaSource { driver: backend.driver().clone(), name: backend.describe_short(), regions: 0 }
    }

    /// Regions currently held.
    pub fn regions(&self) -> usize {
        self.regions
    }
}

impl RegionSource for CudaSource {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        let ptr = self.driver.alloc(bytes).map_err(|reason| AllocError::DeviceRefused {
            source_name: self.name.clone(),
            bytes,
            reason,
        })?;
        self.regions += 1;
        Ok(ptr)
    }

    fn free_region(&mut self, base: u64, _bytes: usize) {
        // SAFETY: `base` came from `alloc_region` and is freed once; the allocator frees a
        // region only when no block in it is live.
        unsafe { self.driver.free(base) };
        self.regions -= 1;
    }

    fn name(&self) -> &str {
        &self.name
    }
}

struct Loaded {
    launches: Vec<(Function, Launch)>,
}

/// Runs eager ops on a CUDA device (the backend's driver and its kernel caches).
pub struct CudaEager {
    name: String,
    driver: Arc<dyn Driver>,
    kernels: HashMap<String, Arc<Loaded>>,
}

impl CudaEager {
    /// An eager executor's device on `backend`'s device, sharing its driver and kernel caches;
    /// each op's kernel is generated and loaded on first use, then cached by op and shapes.
    pub fn new(backend: &CudaBackend) -> Self {
        CudaEager {
            name: backend.describe_short(),
            driver: backend.driver().clone(),
            kernels: HashMap::new(),
        }
    }

    fn kernel(&mut self, op: &Op, types: &[(&Shape, DType)], out: (&Shape, DType)) -> Result<Arc<Loaded>> {
        // Eager frameworks look kernels up per op and shape; so does this cache.
        let key = format!("{op:?}|{types:?}|{out:?}");
        if let Some(k) = self.kernels.get(&key) {
            return Ok(k.clone());
        }
        // Built-in kernels run with the scratch they cannot do without (`required_scratch`), a
        // custom op with what it declares (the executor allocates it and passes it after the
        // operands).
        let scratch = kiln_compiler::custom::declared_scratch(op, types, out.0)
            .max(cuda::required_scratch(op, types, out.0));
        let k = cuda::generate_with_scratch(op, types, out, scratch)?;
        let functions = self.driver.load(&[&k])?.remove(0);
        let launches = functions.into_iter().zip(k.launches.iter().cloned()).collect();
        let loaded = Arc::new(Loaded { launches });
        self.kernels.insert(key, loaded.clone());
        Ok(loaded)
    }
}

impl EagerDevice for CudaEager {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn required_scratch(&self, op: &Op, types: &[(&Shape, DType)], output: &Shape) -> usize {
        cuda::required_scratch(op, types, output)
    }

    fn write_bytes(&mut self, addr: u64, bytes: &[u8]) -> Result<()> {
        // SAFETY: `addr` is a live device block of at least bytes.len() bytes.
        unsafe { self.driver.htod(addr, bytes) }
    }

    fn read_bytes(&mut self, addr: u64, n: usize) -> Result<Vec<u8>> {
        let mut out = vec![0u8; n];
        // SAFETY: `addr` is a live device block of at least n bytes.
        unsafe { self.driver.dtoh(addr, &mut out) }?;
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
        for (f, launch) in &k.launches {
            let ptrs: Vec<u64> = launch
                .args
                .iter()
                .map(|a| match a {
                    Arg::Input(i) => Ok(inputs[*i]),
                    Arg::Output => Ok(output),
                    // Only a custom op's declared scratch, after its operands.
                    Arg::Scratch => inputs.get(types.len()).copied().ok_or_else(|| {
                        RuntimeError::Cuda(format!(
                            "eager kernel `{}` wants scratch, which the executor did not pass",
                            launch.function
                        ))
                    }),
                })
                .collect::<Result<_>>()?;
            // SAFETY: device pointers of live blocks sized for this op's shapes.
            unsafe { self.driver.launch(f, launch, &ptrs) }?;
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        self.driver.synchronize()
    }
}
