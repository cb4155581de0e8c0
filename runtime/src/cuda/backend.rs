//! The CUDA backend. Each device of a plan (logical devices of this GPU each get their own) has
//! a memory budget: with growth, a plan's arena is one `cuMemAlloc` made when the plan first
//! runs, its io region and variables allocations made at load; with preallocation, all of them
//! are carved from one region allocated when the backend starts. Every step's kernels are
//! generated per shape, compiled by NVRTC (cached) and launched on base + offset pointers, all on
//! one stream. A training step allocates nothing: `device_allocations` counts every allocation
//! this backend ever made, so a test can check that it does not move while steps run.

use super::nvrtc::{CompileStats, NvrtcCompiler};
use super::probe::{self, DeviceInfo};
use crate::backend::{Backend, Feeds, ProgramId, Slot, check_input, io_slot, no_program, output_slot};
use crate::error::{Result, RuntimeError};
use crate::guard::{Canary, Guard, Region};
use crate::init::initial_values;
use crate::memory::{Account, DeviceBudget, Purpose, Tracker};
use crate::store::new_region;
use crate::tensor::HostTensor;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use kiln_compiler::Plan;
use kiln_compiler::ir::Shape;
use kiln_compiler::plan::{Storage, VariableSpec};
use kiln_kernels::cuda::{self, Arg, CudaKernel};
use std::collections::HashMap;
use std::sync::Arc;

fn driver(what: &str) -> impl Fn(cudarc::driver::DriverError) -> RuntimeError + '_ {
    move |e| RuntimeError::Cuda(format!("{what}: {e:?}"))
}

/// Device memory: an allocation of its own, or a piece of a preallocated pool.
struct DeviceMem {
    ptr: u64,
    _owned: Option<CudaSlice<u8>>,
}

/// Where a kernel argument points, resolved to an address once the arenas exist.
#[derive(Clone, Copy)]
enum Loc {
    Arena(usize, u64),
    Io(usize, u64),
    Var(u64),
}

struct BoundLaunch {
    function: CudaFunction,
    config: LaunchConfig,
    locs: Vec<Loc>,
    args: Vec<u64>,
    /// The plan step this launch belongs to (a step may take several launches).
    step: usize,
}

struct Program {
    plan: Plan,
    /// The backend device of each plan device.
    devices: Vec<usize>,
    /// One arena per plan device; `None` until the first run under the growth policy.
    arenas: Vec<Option<DeviceMem>>,
    ios: Vec<DeviceMem>,
    launches: Vec<BoundLaunch>,
    bound: bool,
    feeds: Feeds,
    /// Guard mode's canaries, when the plan has them (`crate::guard`).
    guard: Option<Guard>,
}

/// A variable: its spec and its address inside one of the backend's variable regions.
struct Variable {
    spec: VariableSpec,
    ptr: u64,
}

struct GpuDevice {
    account: Account,
    pool: Option<DeviceMem>,
}

pub struct CudaBackend {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    compiler: Arc<NvrtcCompiler>,
    seed: u64,
    devices: Vec<GpuDevice>,
    tracker: Tracker,
    variables: HashMap<String, Variable>,
    /// The variable regions (`crate::store::new_region`): one allocation per plan device for
    /// the variables a loaded plan declared first.
    variable_regions: Vec<DeviceMem>,
    programs: Vec<Program>,
    modules: HashMap<String, Arc<CudaModule>>,
    device_allocations: u64,
    device_allocated_bytes: usize,
}

/// Generates the CUDA kernels of every step of `plan` (no device needed): what the backend
/// compiles and launches, in order.
pub fn plan_kernels(plan: &Plan) -> Result<Vec<CudaKernel>> {
    RuntimeError::check_plan(plan)?;
    let scalar = Shape::scalar();
    plan.steps
        .iter()
        .map(|step| {
            let ins: Vec<_> =
                step.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
            let out = match step.output {
                Some(o) => (&plan.values[o].shape, plan.values[o].dtype),
                None => (&scalar, ins.first().map(|i| i.1).unwrap_or_default()),
            };
            Ok(cuda::generate(&step.op, &ins, out)?)
        })
        .collect()
}

impl CudaBackend {
    /// The backend of CUDA device `ordinal` with growing, unlimited memory, or why there is none.
    pub fn new(ordinal: usize, seed: u64) -> Result<Self> {
        Self::with_budgets(ordinal, seed, vec![], Tracker::default())
    }

    /// The backend of CUDA device `ordinal` whose (logical) devices have these budgets.
    pub fn with_budgets(
        ordinal: usize,
        seed: u64,
        budgets: Vec<DeviceBudget>,
        tracker: Tracker,
    ) -> Result<Self> {
        let found = probe::probe();
        found.usable().map_err(RuntimeError::Cuda)?;
        let devices = found.devices.map_err(RuntimeError::Cuda)?;
        let info = devices
            .into_iter()
            .find(|d| d.ordinal == ordinal)
            .ok_or_else(|| RuntimeError::Cuda(format!("no CUDA device {ordinal}")))?;
        let ctx = CudaContext::new(ordinal).map_err(driver("creating the context"))?;
        // One stream runs every step in order: cudarc's per-buffer event tracking is not needed.
        // SAFETY: called before any allocation or launch on this context.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let compiler = Arc::new(NvrtcCompiler::new(info.compute_capability)?);
        let mut backend = CudaBackend {
            info,
            ctx,
            stream,
            compiler,
            seed,
            devices: Vec::new(),
            tracker,
            variables: HashMap::new(),
            variable_regions: Vec::new(),
            programs: Vec::new(),
            modules: HashMap::new(),
            device_allocations: 0,
            device_allocated_bytes: 0,
        };
        for b in budgets {
            backend.add_device(b)?;
        }
        Ok(backend)
    }

    fn add_device(&mut self, budget: DeviceBudget) -> Result<usize> {
        let pool = match budget.pool_bytes() {
            Some(bytes) => Some(self.alloc(bytes)?),
            None => None,
        };
        self.devices.push(GpuDevice { account: Account::new(budget, self.tracker.clone()), pool });
        Ok(self.devices.len() - 1)
    }

    fn device(&mut self, name: &str) -> Result<usize> {
        match self.devices.iter().position(|d| d.account.budget.name == name) {
            Some(i) => Ok(i),
            None => self.add_device(DeviceBudget {
                capacity: self.info.total_bytes,
                ..DeviceBudget::unlimited(name)
            }),
        }
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Every device allocation this backend made, and their bytes: constant while steps run.
    pub fn device_allocations(&self) -> (u64, usize) {
        (self.device_allocations, self.device_allocated_bytes)
    }

    /// The driver's free and total bytes of the device (what nvidia-smi shows).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.mem_get_info().map_err(driver("cuMemGetInfo"))
    }

    pub fn compile_stats(&self) -> CompileStats {
        self.compiler.stats()
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The NVRTC compiler and its caches, shared with the eager executor.
    pub fn compiler(&self) -> &Arc<NvrtcCompiler> {
        &self.compiler
    }

    /// "cuda:0".
    pub fn describe_short(&self) -> String {
        format!("cuda:{}", self.info.ordinal)
    }

    /// Kernel launches per run of `program`.
    pub fn launches(&self, program: ProgramId) -> usize {
        self.programs.get(program).map_or(0, |p| p.launches.len())
    }

    /// One real device allocation (`cuMemAlloc`), counted.
    fn alloc(&mut self, bytes: usize) -> Result<DeviceMem> {
        let slice = self.stream.alloc_zeros::<u8>(bytes.max(1)).map_err(|e| RuntimeError::OutOfMemory {
            device: format!("cuda:{}", self.info.ordinal),
            bytes,
            what: "device memory".into(),
            detail: format!(" (cuMemAlloc: {e})"),
            help: "use a smaller batch or model, or set a memory limit so the compiler reports the plan's needs first".into(),
        })?;
        self.device_allocations += 1;
        self.device_allocated_bytes += bytes.max(1);
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(&self.stream);
            ptr
        };
        Ok(DeviceMem { ptr, _owned: Some(slice) })
    }

    /// Memory for `purpose` on backend device `device`, under its budget.
    fn take(&mut self, device: usize, bytes: usize, purpose: Purpose) -> Result<DeviceMem> {
        // Nothing to hold (an empty io region): no allocation, and no address is ever formed.
        if bytes == 0 {
            return Ok(DeviceMem { ptr: 0, _owned: None });
        }
        // Growth: allocate before claiming, so that a failed allocation leaves the books as they were.
        if self.devices[device].pool.is_none() {
            self.devices[device].account.check(bytes)?;
            let mem = self.alloc(bytes)?;
            self.devices[device].account.claim(bytes, purpose)?;
            return Ok(mem);
        }
        let offset = self.devices[device].account.claim(bytes, purpose)?;
        match (offset, &self.devices[device].pool) {
            (Some(offset), Some(pool)) => Ok(DeviceMem { ptr: pool.ptr + offset as u64, _owned: None }),
            _ => self.alloc(bytes),
        }
    }

    /// The device address of every variable of `plan` (in `plan.variables` order): held ones
    /// checked against their spec, new ones created one region per plan device and initialised.
    fn ensure_variables(&mut self, plan: &Plan, devices: &[usize]) -> Result<Vec<u64>> {
        for spec in &plan.variables {
            if let Some(v) = self.variables.get(&spec.key)
                && (v.spec.shape != spec.shape || v.spec.dtype != spec.dtype)
            {
                return Err(RuntimeError::VariableShape {
                    key: spec.key.clone(),
                    existing: v.spec.shape.clone(),
                    requested: spec.shape.clone(),
                    help: "a variable keeps its shape across plans".into(),
                });
            }
        }
        for (d, &device) in devices.iter().enumerate() {
            let Some(region) = new_region(plan, d, |key| self.variables.contains_key(key)) else { continue };
            let mem = self.take(device, region.bytes, Purpose::Variable)?;
            for (spec, &offset) in region.variables.iter().zip(&region.offsets) {
                let ptr = mem.ptr + offset as u64;
                self.htod(ptr, &initial_values(spec.init, &spec.shape, self.seed, &spec.key))?;
                self.variables.insert(spec.key.clone(), Variable { spec: (*spec).clone(), ptr });
            }
            self.variable_regions.push(mem);
        }
        Ok(plan.variables.iter().map(|v| self.variables[&v.key].ptr).collect())
    }

    fn htod(&self, dst: u64, data: &[f32]) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        // SAFETY: `dst` addresses at least data.len() f32s of device memory this backend holds.
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, data) }
            .map_err(driver("copying to the device"))
    }

    fn dtoh(&self, src: u64, n: usize) -> Result<Vec<f32>> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        let mut host = vec![0f32; n];
        // SAFETY: `src` addresses at least n f32s of device memory this backend holds.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, src) }
            .map_err(driver("copying to the host"))?;
        Ok(host)
    }

    /// Launches one kernel of a bound program on the stream.
    fn launch(&self, l: &BoundLaunch) -> Result<()> {
        let mut builder = self.stream.launch_builder(&l.function);
        for a in &l.args {
            builder.arg(a);
        }
        // SAFETY: `load` validated the plan (`kiln_compiler::validate`): the arguments are
        // device pointers into the plan's arenas, io regions and variables, allocated with
        // the plan's sizes, each buffer inside its region and no two live ones overlapping;
        // the kernel was generated for exactly these shapes and argument order.
        unsafe { builder.launch(l.config) }.map_err(driver("launching a kernel"))?;
        Ok(())
    }

    /// Guard mode (`crate::guard`): before each step the canaries whose buffer's life begins
    /// there are written, after it the canaries of every buffer live there are read back (the
    /// driver's copies of the gap bytes, synchronising the stream) and compared.
    fn run_guarded(&self, p: &Program, g: &Guard) -> Result<()> {
        let mut launches = p.launches.iter().peekable();
        for s in 0..p.plan.steps.len() {
            for c in g.to_fill(s) {
                self.htod_bytes(canary_address(p, c)?, g.pattern())?;
            }
            while let Some(l) = launches.next_if(|l| l.step == s) {
                self.launch(l)?;
            }
            for c in g.to_check(s) {
                let bytes = self.dtoh_bytes(canary_address(p, c)?, c.range.len())?;
                if let Some(at) = g.check(&bytes) {
                    return Err(Guard::overrun(&p.plan, s, c, at));
                }
            }
        }
        Ok(())
    }

    fn htod_bytes(&self, dst: u64, data: &[u8]) -> Result<()> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        // SAFETY: `dst` addresses at least data.len() bytes of device memory this backend holds.
        unsafe { cudarc::driver::result::memcpy_htod_sync(dst, data) }
            .map_err(driver("writing a guard canary"))
    }

    fn dtoh_bytes(&self, src: u64, n: usize) -> Result<Vec<u8>> {
        self.ctx.bind_to_thread().map_err(driver("binding the context"))?;
        self.stream.synchronize().map_err(driver("waiting for the stream"))?;
        let mut host = vec![0u8; n];
        // SAFETY: `src` addresses at least n bytes of device memory this backend holds.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, src) }
            .map_err(driver("reading a guard canary"))?;
        Ok(host)
    }

    fn module(&mut self, key: &str, ptx: &str) -> Result<Arc<CudaModule>> {
        if let Some(m) = self.modules.get(key) {
            return Ok(m.clone());
        }
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_src(ptx))
            .map_err(driver("loading a compiled kernel (cuModuleLoadData)"))?;
        self.modules.insert(key.to_string(), m.clone());
        Ok(m)
    }

    /// Allocates the program's arenas if this is its first run (growth) and resolves every launch
    /// argument to an address.
    fn bind(&mut self, program: ProgramId) -> Result<()> {
        if self.program(program)?.bound {
            return Ok(());
        }
        for d in 0..self.programs[program].arenas.len() {
            if self.programs[program].arenas[d].is_none() {
                let bytes = self.programs[program].plan.devices[d].memory.arena_bytes;
                let device = self.programs[program].devices[d];
                let mem = self.take(device, bytes, Purpose::Arena)?;
                self.programs[program].arenas[d] = Some(mem);
            }
        }
        let p = self.program_mut(program)?;
        let arena: Vec<u64> = p.arenas.iter().map(|a| a.as_ref().map_or(0, |m| m.ptr)).collect();
        let io: Vec<u64> = p.ios.iter().map(|m| m.ptr).collect();
        for l in &mut p.launches {
            l.args = l
                .locs
                .iter()
                .map(|loc| match *loc {
                    Loc::Arena(d, off) => arena[d] + off,
                    Loc::Io(d, off) => io[d] + off,
                    Loc::Var(ptr) => ptr,
                })
                .collect();
        }
        p.bound = true;
        Ok(())
    }

    fn program(&self, program: ProgramId) -> Result<&Program> {
        self.programs.get(program).ok_or_else(|| no_program(program, self.programs.len()))
    }

    fn program_mut(&mut self, program: ProgramId) -> Result<&mut Program> {
        let loaded = self.programs.len();
        self.programs.get_mut(program).ok_or_else(|| no_program(program, loaded))
    }

    /// The device address of an input or output (the arena must be bound: `bind`).
    fn io_address(&self, program: ProgramId, value: usize, name: &str) -> Result<u64> {
        let p = self.program(program)?;
        match io_slot(&p.plan, value, name)? {
            Slot::Io { device, offset } => Ok(p.ios[device].ptr + offset as u64),
            Slot::Arena { device, offset } => match &p.arenas[device] {
                Some(a) => Ok(a.ptr + offset as u64),
                None => Err(RuntimeError::invalid(
                    format!("`{name}` of plan {:?} is in an arena not allocated yet", p.plan.name),
                    "feed the inputs and run the plan before reading its outputs",
                )),
            },
        }
    }
}

/// The device address of a canary of a bound program: inside its region, since validation of
/// a guarded plan keeps every canary inside the arena or io region allocated with the plan's size.
fn canary_address(p: &Program, c: &Canary) -> Result<u64> {
    let base = match c.region {
        Region::Arena(d) => p.arenas.get(d).and_then(|a| a.as_ref()).map(|m| m.ptr),
        Region::Io(d) => p.ios.get(d).map(|m| m.ptr),
    };
    base.map(|b| b + c.range.start as u64)
        .ok_or_else(|| RuntimeError::invalid("guard: a canary's region is not allocated", ""))
}

impl Backend for CudaBackend {
    fn describe(&self) -> String {
        let (major, minor) = self.info.compute_capability;
        format!(
            "cuda:{} ({}, sm_{major}{minor}, {:.1} GiB)",
            self.info.ordinal,
            self.info.name,
            self.info.total_bytes as f64 / (1u64 << 30) as f64
        )
    }

    fn report(&self) -> Option<String> {
        let s = self.compiler.stats();
        let (n, bytes) = self.device_allocations();
        Some(format!(
            "kernels: {} compiled by NVRTC {}.{} for {} in {:.2} s, {} from the memory cache, {} from the disk cache; \
             {n} device allocations, {bytes} B",
            s.compiled,
            self.compiler.version().0,
            self.compiler.version().1,
            self.compiler.arch(),
            s.compile_seconds,
            s.from_memory,
            s.from_disk
        ))
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        // Every device pointer formed below and at launch relies on what validation establishes.
        RuntimeError::check_plan(&plan)?;
        let devices: Vec<usize> = plan.devices.iter().map(|d| self.device(&d.name)).collect::<Result<_>>()?;
        let var_ptrs = self.ensure_variables(&plan, &devices)?;
        let kernels = plan_kernels(&plan)?;
        let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
        let ptx = self.compiler.compile_all(&sources)?;
        let mut ios = Vec::with_capacity(plan.devices.len());
        let mut arenas = Vec::with_capacity(plan.devices.len());
        for (d, dev) in plan.devices.iter().enumerate() {
            ios.push(self.take(devices[d], dev.memory.io_bytes, Purpose::Io)?);
            // Growth: the arena waits for the first run. Preallocation: carved now.
            arenas.push(match self.devices[devices[d]].pool {
                Some(_) => Some(self.take(devices[d], dev.memory.arena_bytes, Purpose::Arena)?),
                None => None,
            });
        }
        let loc = |value: usize| -> Loc {
            match plan.buffers[plan.values[value].buffer].storage {
                Storage::Arena { device, offset } => Loc::Arena(device, offset as u64),
                Storage::Io { device, offset } => Loc::Io(device, offset as u64),
                Storage::Variable { index } => Loc::Var(var_ptrs[index]),
            }
        };
        let mut launches = Vec::new();
        for (s, ((step, kernel), ptx)) in plan.steps.iter().zip(&kernels).zip(&ptx).enumerate() {
            let key = self.compiler.key(&kernel.source);
            let module = self.module(&key, ptx)?;
            for l in &kernel.launches {
                let function = module
                    .load_function(&l.function)
                    .map_err(driver(&format!("finding kernel function `{}`", l.function)))?;
                let locs = l
                    .args
                    .iter()
                    .map(|a| match a {
                        Arg::Input(i) => Ok(loc(step.inputs[*i])),
                        Arg::Output => step.output.map(loc).ok_or_else(|| {
                            RuntimeError::Cuda(format!(
                                "kernel `{}` wants an output but `{}` has none",
                                l.function, step.label
                            ))
                        }),
                    })
                    .collect::<Result<Vec<Loc>>>()?;
                let config = LaunchConfig {
                    grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                    block_dim: (l.block[0], l.block[1], l.block[2]),
                    shared_mem_bytes: l.shared_bytes,
                };
                launches.push(BoundLaunch { function, config, locs, args: Vec::new(), step: s });
            }
        }
        self.programs.push(Program {
            feeds: Feeds::new(&plan),
            guard: Guard::new(&plan),
            plan,
            devices,
            arenas,
            ios,
            launches,
            bound: false,
        });
        Ok(self.programs.len() - 1)
    }

    fn plan(&self, program: ProgramId) -> Result<&Plan> {
        Ok(&self.program(program)?.plan)
    }

    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()> {
        let value = check_input(&self.program(program)?.plan, name, shape, data.len())?;
        // Inputs live in the arena: under growth it is allocated by the first feed.
        self.bind(program)?;
        let dst = self.io_address(program, value, name)?;
        self.htod(dst, data)?;
        let p = self.program_mut(program)?;
        p.feeds.fed(&p.plan, value);
        Ok(())
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
        let p = self.program_mut(program)?;
        p.feeds.consume(&p.plan)?;
        self.bind(program)?;
        let p = self.program(program)?;
        if let Some(g) = &p.guard {
            return self.run_guarded(p, g);
        }
        for l in &p.launches {
            self.launch(l)?;
        }
        Ok(())
    }

    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor> {
        let plan = &self.program(program)?.plan;
        let (value, _) = output_slot(plan, name)?;
        let shape = plan.value(value).shape.clone();
        let src = self.io_address(program, value, name)?;
        HostTensor::new(shape.clone(), self.dtoh(src, shape.numel())?)
    }

    fn read_variable(&self, key: &str) -> Result<HostTensor> {
        let v = self
            .variables
            .get(key)
            .ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))?;
        HostTensor::new(v.spec.shape.clone(), self.dtoh(v.ptr, v.spec.shape.numel())?)
    }

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        let v = self
            .variables
            .get(key)
            .ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))?;
        if value.shape() != &v.spec.shape {
            return Err(RuntimeError::VariableShape {
                key: key.into(),
                existing: v.spec.shape.clone(),
                requested: value.shape().clone(),
                help: "write a tensor of the variable's shape".into(),
            });
        }
        self.htod(v.ptr, value.data())
    }
}
