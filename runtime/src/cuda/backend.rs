//! The CUDA backend. Each device of a plan (logical devices of this GPU each get their own) has
//! a memory budget: with growth, loading a plan makes one allocation per device for the
//! variables it adds, its io region and its arena (`plan::device_block`: one 2 MiB granule where
//! three took three); with preallocation, all of them are carved from one region allocated when
//! the first backend of the device starts. Every step's
//! kernels are generated per shape, compiled (cached) and launched on base + offset pointers, in
//! order. A training step allocates nothing: `device_allocations` counts every allocation this
//! backend ever made, so a test can check that it does not move while steps run.
//!
//! The device is reached only through `Driver` (cudarc's, or the emulated device). The books of
//! a logical device (its limit, what it holds, its preallocated pool) are kept once per physical
//! device in the process and shared by every backend on it, so two backends on one GPU never
//! each believe they own it. Pools are sized from the driver's free memory less a headroom for
//! the context and the compiler (`driver::headroom`). `KILN_CUDA_SYNC=1` synchronises after
//! every launch, so that a failing kernel is named (step, op, shapes, kernel) where it fails.

use super::driver::{self, Driver, Function, Recording};
use super::nvrtc::CompileStats;
use super::probe::DeviceInfo;
use crate::backend::{
    Backend, Feeds, ProgramId, Slot, StepTime, check_input, check_input_bytes, check_ran, io_slot,
    no_program, output_slot,
};
use crate::error::{Result, RuntimeError};
use crate::guard::{Canary, Guard, Region};
use crate::init::variable_values;
use crate::memory::{Account, DeviceBudget, Purpose, Tracker};
use crate::store::new_region;
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::device::human_bytes;
use kiln_compiler::ir::{DType, Shape};
use kiln_compiler::plan::{Storage, VariableSpec, device_block};
use kiln_kernels::cuda::{self, Arg, CudaKernel, Launch};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Device memory: an allocation of its own (freed on drop), or a piece of an allocation the
/// backend keeps (a preallocated pool, a plan's block).
struct DeviceMem {
    ptr: u64,
    owner: Option<Arc<dyn Driver>>,
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        if let Some(d) = &self.owner {
            // SAFETY: `ptr` came from `d.alloc` and this is its only owner; everything that
            // used it (programs, variables) is dropped with the backend that held it.
            unsafe { d.free(self.ptr) };
        }
    }
}

/// Where a kernel argument points, resolved to an address once the arenas exist.
#[derive(Clone, Copy)]
enum Loc {
    Arena(usize, u64),
    Io(usize, u64),
    Var(u64),
}

struct BoundLaunch {
    function: Function,
    launch: Launch,
    locs: Vec<Loc>,
    args: Vec<u64>,
    /// The plan step this launch belongs to (a step may take several launches).
    step: usize,
    /// The kernel's description ("matmul 32x100x10 ...").
    kernel: String,
}

struct Program {
    plan: Plan,
    /// The arena lies in the caller's region (`load_into`): inputs may be written there in place.
    owned_region: bool,
    /// One arena per plan device.
    arenas: Vec<DeviceMem>,
    ios: Vec<DeviceMem>,
    launches: Vec<BoundLaunch>,
    bound: bool,
    feeds: Feeds,
    /// Guard mode's canaries, when the plan has them (`crate::guard`).
    guard: Option<Guard>,
    /// The launches recorded as one CUDA graph at the first run after binding (`None` before,
    /// and where the driver records none): a run is then one graph launch.
    recording: Option<Recording>,
    /// Whether recording was tried since the launches were last bound.
    recorded: bool,
    /// Whether a run started (its inputs were all fed): outputs read before are refused.
    ran: bool,
    /// The plan's all-reduces, each staged through host memory (`HostCollective`).
    collectives: Vec<HostCollective>,
}

/// A data-parallel plan's collective on a CUDA device (`Op::AllReduce`, and ZeRO's
/// `Op::ReduceScatter` and `Op::AllGather`), run through the backend's communicator (in-process
/// ranks or MPI, `kiln_comm`) on host copies of its buffers: the device finishes the launches
/// before it, the operand is copied to the host, exchanged with the other ranks (scaled for a
/// mean) and the result copied back (the emulated device's memory is host memory, so CI runs the
/// CUDA backend's data-parallel and ZeRO plans this way); or, on a backend made with
/// `with_nccl`, through NCCL in device memory (`exchange_on_device`).
struct HostCollective {
    /// The plan step.
    step: usize,
    kind: Exchange,
    input: Loc,
    /// The output (an all-gather writes its operand, the variable, in place).
    output: Loc,
    /// The operand's elements (f32).
    n: usize,
    /// The input's and output's addresses once bound.
    args: [u64; 2],
}

/// What a `HostCollective` exchanges.
enum Exchange {
    /// The whole operand, reduced into the output.
    AllReduce { mean: bool },
    /// This rank's `range` of the operand's reduction into the output's first elements, the
    /// rest of its `part` elements zeros.
    ReduceScatter { mean: bool, range: std::ops::Range<usize>, part: usize },
    /// Every rank's range of the variable (this rank's: `range`) into every rank's variable.
    AllGather { range: std::ops::Range<usize> },
}

/// A variable: its spec and its address inside one of the backend's variable regions.
struct Variable {
    spec: VariableSpec,
    ptr: u64,
}

/// The books of one logical device, shared by every backend on its physical device.
struct Books {
    account: Account,
    pool: Option<DeviceMem>,
}

type Shared = Arc<Mutex<Books>>;

/// Per (physical device, logical device name): the books, while a backend holds them.
type Registry = HashMap<(String, String), Weak<Mutex<Books>>>;

fn registry() -> MutexGuard<'static, Registry> {
    static MAP: std::sync::OnceLock<Mutex<Registry>> = std::sync::OnceLock::new();
    MAP.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner())
}

fn budget_name(books: &Shared) -> String {
    books.lock().unwrap_or_else(|e| e.into_inner()).account.budget.name.clone()
}

struct GpuDevice {
    name: String,
    books: Shared,
    /// What this backend claimed under growth: released from the shared books when it drops.
    grown: usize,
}

impl GpuDevice {
    fn books(&self) -> MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The CUDA backend: runs plans on one CUDA device (or the emulated device), one arena (and io
/// region) per plan device in device memory, with kernels generated by `kiln_kernels::cuda` and
/// compiled by NVRTC, launched in order on one stream (replayed as a CUDA graph by default).
pub struct CudaBackend {
    info: DeviceInfo,
    driver: Arc<dyn Driver>,
    seed: u64,
    devices: Vec<GpuDevice>,
    tracker: Tracker,
    variables: HashMap<String, Variable>,
    /// The allocations plans were loaded into under growth (`take_block`): the variables a plan
    /// declared first, its io region and its arena are parts of one per plan device.
    blocks: Vec<DeviceMem>,
    programs: Vec<Program>,
    device_allocations: u64,
    device_allocated_bytes: usize,
    /// The driver's used memory (total - free) when the backend opened, for `report`.
    used_at_open: usize,
    /// Synchronise after every launch and name the step that failed (`KILN_CUDA_SYNC=1`).
    sync_every_launch: bool,
    /// Replay each plan's launches as one CUDA graph (off with `KILN_CUDA_GRAPHS=0`).
    graphs: bool,
    /// The communicator of a data-parallel run (`with_communicator`).
    comm: Option<crate::collective::SharedComm>,
    /// The NCCL group of a data-parallel run whose collectives run in device memory
    /// (`with_nccl`); without it they are staged through the host.
    nccl: Option<super::nccl::Nccl>,
    /// Built for named devices (`with_budgets`): a plan may use those alone, so that a misspelt
    /// device name is an error, never a way around a device's limit.
    fixed_devices: bool,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The NCCL communicator first, while the device's context (held by the driver) lives.
        self.nccl.take();
        // Programs and variable regions free their memory as the fields drop; the shared books
        // forget what this backend grew.
        for d in &self.devices {
            if d.grown > 0 {
                d.books().account.release(d.grown);
            }
        }
    }
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
            // A step's scratch is its own buffer of this size (validated): the kernel uses at
            // most that many bytes of it.
            let scratch = step.scratch.map_or(0, |b| plan.buffers[b].bytes);
            if step.op.is_collective() {
                // Run by the backend (`HostCollective`: through host memory, or NCCL), no launch.
                return Ok(CudaKernel {
                    source: format!("// {}: run by the backend's communicator, no kernel\n", step.label),
                    launches: Vec::new(),
                    describe: format!("{} (host-staged)", step.op.label()),
                });
            }
            Ok(cuda::generate_with_scratch(&step.op, &ins, out, scratch)?)
        })
        .collect()
}

impl CudaBackend {
    /// The backend of CUDA device `ordinal` with growing, unlimited memory, or why there is none.
    /// Under `KILN_CUDA_EMULATE=1` it is the emulated device.
    pub fn new(ordinal: usize, seed: u64) -> Result<Self> {
        Self::with_budgets(ordinal, seed, vec![], Tracker::default())
    }

    /// A backend on an emulated device of its own with `memory` bytes (whatever the environment).
    pub fn emulated(memory: usize, seed: u64) -> Result<Self> {
        let device = super::emulator::EmulatedDevice::new(memory).map_err(RuntimeError::Cuda)?;
        Self::with_driver(device, seed, vec![], Tracker::default())
    }

    /// The backend of CUDA device `ordinal` whose (logical) devices have these budgets.
    pub fn with_budgets(
        ordinal: usize,
        seed: u64,
        budgets: Vec<DeviceBudget>,
        tracker: Tracker,
    ) -> Result<Self> {
        crate::visible::open(ordinal)?;
        Self::with_driver(driver::open(ordinal)?, seed, budgets, tracker)
    }

    /// The backend of the device behind `driver` whose (logical) devices have these budgets.
    pub fn with_driver(
        driver: Arc<dyn Driver>,
        seed: u64,
        budgets: Vec<DeviceBudget>,
        tracker: Tracker,
    ) -> Result<Self> {
        let mut backend = CudaBackend {
            info: driver.info().clone(),
            driver,
            seed,
            devices: Vec::new(),
            tracker,
            variables: HashMap::new(),
            blocks: Vec::new(),
            programs: Vec::new(),
            device_allocations: 0,
            device_allocated_bytes: 0,
            used_at_open: 0,
            sync_every_launch: std::env::var("KILN_CUDA_SYNC").is_ok_and(|v| v == "1"),
            graphs: !std::env::var("KILN_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            comm: None,
            nccl: None,
            fixed_devices: false,
        };
        backend.used_at_open = backend.driver.mem_info().map_or(0, |(free, total)| total - free);
        for b in budgets {
            backend.add_device(b)?;
        }
        backend.fixed_devices = !backend.devices.is_empty();
        Ok(backend)
    }

    /// This backend as one rank of a data-parallel run: the all-reduces of the plans it loads
    /// run through `comm` (`HostCollective`), and a plan with collectives is checked against
    /// every rank's at load (`collective::agree_on_plan`); so do ZeRO's reduce-scatters and
    /// all-gathers, whose shards must be this rank's (`collective::check_shard`).
    pub fn with_communicator(mut self, comm: impl kiln_comm::Communicator + 'static) -> Self {
        self.comm = Some(Arc::new(std::sync::Mutex::new(Box::new(comm))));
        self
    }

    /// This backend as one rank of a data-parallel run whose collectives run in device memory
    /// through NCCL (`super::nccl`), one rank per GPU: every rank calls it with its communicator
    /// (in-process ranks or MPI), which carries the NCCL group's id and, as in
    /// `with_communicator`, the checks at load. Errors on the emulated device (no CUDA stream:
    /// use `with_communicator`) and where the NCCL library is not found.
    pub fn with_nccl(mut self, comm: impl kiln_comm::Communicator + 'static) -> Result<Self> {
        let mut comm: Box<dyn kiln_comm::Communicator> = Box::new(comm);
        if self.driver.raw_stream()?.is_none() {
            return Err(RuntimeError::invalid(
                format!("NCCL needs a CUDA device; {} has no CUDA stream", self.describe_short()),
                "stage the collectives through the host instead: CudaBackend::with_communicator",
            ));
        }
        self.nccl = Some(super::nccl::Nccl::join(comm.as_mut())?);
        self.comm = Some(Arc::new(std::sync::Mutex::new(comm)));
        Ok(self)
    }

    /// Whether the collectives run through NCCL (`with_nccl`).
    pub fn uses_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Synchronise after every launch, so that a failing kernel is reported at its step (the
    /// step, its op and shapes, and the kernel) instead of at the next copy. `KILN_CUDA_SYNC=1`
    /// turns it on for every backend.
    pub fn set_sync_every_launch(&mut self, on: bool) {
        self.sync_every_launch = on;
    }

    /// The driver: cudarc's or the emulated device.
    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    /// Waits for every queued launch; reports a failed one.
    pub fn synchronize(&self) -> Result<()> {
        self.driver.synchronize()
    }

    /// What the driver can still give for pools and plans: free memory less the headroom.
    fn usable(&self) -> Result<(usize, String)> {
        let (free, total) = self.driver.mem_info()?;
        let headroom = driver::headroom(total);
        Ok((
            free.saturating_sub(headroom),
            format!(
                "the driver reports {} free of {}, less a {} headroom for the context and the kernel compiler",
                human_bytes(free),
                human_bytes(total),
                human_bytes(headroom)
            ),
        ))
    }

    fn add_device(&mut self, budget: DeviceBudget) -> Result<usize> {
        let key = (self.driver.id(), budget.name.clone());
        let mut registry = registry();
        let books = match registry.get(&key).and_then(Weak::upgrade) {
            Some(books) => {
                let held = books.lock().unwrap_or_else(|e| e.into_inner()).account.budget.clone();
                if held != budget {
                    return Err(RuntimeError::invalid(
                        format!(
                            "{} of {} is already in use in this process with another budget ({}, limit {}); \
                             a second backend with {} (limit {}) would count the device twice",
                            budget.name,
                            self.describe_short(),
                            held.policy.describe(),
                            held.limit.map_or("none".into(), human_bytes),
                            budget.policy.describe(),
                            budget.limit.map_or("none".into(), human_bytes)
                        ),
                        "take every backend of a device from one `Devices`, or drop the first backend before configuring the device anew",
                    ));
                }
                books
            }
            None => {
                let pool = match budget.pool_bytes() {
                    Some(bytes) => {
                        let (usable, why) = self.usable()?;
                        if bytes > usable {
                            return Err(RuntimeError::OutOfMemory {
                                device: budget.name.clone(),
                                bytes,
                                what: format!("the preallocated pool ({})", budget.policy.describe()),
                                detail: format!(" on {}: {why}", self.describe_short()),
                                help: "preallocate a smaller fraction or limit, use memory growth, or free the device (another process may hold it)".into(),
                            });
                        }
                        Some(self.alloc(bytes)?)
                    }
                    None => None,
                };
                let books =
                    Arc::new(Mutex::new(Books { account: Account::new(budget, self.tracker.clone()), pool }));
                registry.insert(key, Arc::downgrade(&books));
                books
            }
        };
        drop(registry);
        let name = budget_name(&books);
        self.devices.push(GpuDevice { name, books, grown: 0 });
        Ok(self.devices.len() - 1)
    }

    fn device(&mut self, name: &str) -> Result<usize> {
        match self.devices.iter().position(|d| d.name == name) {
            Some(i) => Ok(i),
            None if self.fixed_devices => {
                Err(RuntimeError::unknown_device(name, self.devices.iter().map(|d| d.name.as_str())))
            }
            None => self.add_device(DeviceBudget {
                capacity: self.info.total_bytes,
                ..DeviceBudget::unlimited(name)
            }),
        }
    }

    /// The device's ordinal, name, compute capability and total memory.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Every device allocation this backend made, and their bytes: constant while steps run.
    pub fn device_allocations(&self) -> (u64, usize) {
        (self.device_allocations, self.device_allocated_bytes)
    }

    /// The driver's free and total bytes of the device (what nvidia-smi shows).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.driver.mem_info()
    }

    /// How many kernels were compiled or found in the caches, and the time spent compiling.
    pub fn compile_stats(&self) -> CompileStats {
        self.driver.compile_stats()
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
        let ptr = self.driver.alloc(bytes.max(1)).map_err(|e| RuntimeError::OutOfMemory {
            device: self.describe_short(),
            bytes,
            what: "device memory".into(),
            detail: format!(" ({e})"),
            help: "use a smaller batch or model, or set a memory limit so the compiler reports the plan's needs first".into(),
        })?;
        self.device_allocations += 1;
        self.device_allocated_bytes += bytes.max(1);
        Ok(DeviceMem { ptr, owner: Some(self.driver.clone()) })
    }

    /// Memory for `purpose` on backend device `device`, under its budget.
    fn take(&mut self, device: usize, bytes: usize, purpose: Purpose) -> Result<DeviceMem> {
        // Nothing to hold (an empty io region): no allocation, and no address is ever formed.
        if bytes == 0 {
            return Ok(DeviceMem { ptr: 0, owner: None });
        }
        let books = self.devices[device].books.clone();
        let mut books = books.lock().unwrap_or_else(|e| e.into_inner());
        // Growth: allocate before claiming, so that a failed allocation leaves the books as they were.
        if books.pool.is_none() {
            let rounded = books.account.check(bytes)?;
            let mem = self.alloc(bytes)?;
            books.account.claim(bytes, purpose)?;
            self.devices[device].grown += rounded;
            return Ok(mem);
        }
        let offset = books.account.claim(bytes, purpose)?;
        match (offset, &books.pool) {
            (Some(offset), Some(pool)) => Ok(DeviceMem { ptr: pool.ptr + offset as u64, owner: None }),
            _ => {
                drop(books);
                self.alloc(bytes)
            }
        }
    }

    /// A plan's memory on backend device `device`: the variable region it adds, its io region
    /// and its arena (`[bytes; 3]`, purposes in that order). Growth: one allocation laid out by
    /// `plan::device_block`, kept in `blocks` for the backend's life, the pieces parts of it.
    /// Preallocation: each carved from the pool.
    fn take_block(&mut self, device: usize, pieces: [usize; 3], align: usize) -> Result<[DeviceMem; 3]> {
        let books = self.devices[device].books.clone();
        let mut books = books.lock().unwrap_or_else(|e| e.into_inner());
        if books.pool.is_some() {
            drop(books);
            let [v, io, arena] = pieces;
            return Ok([
                self.take(device, v, Purpose::Variable)?,
                self.take(device, io, Purpose::Io)?,
                self.take(device, arena, Purpose::Arena)?,
            ]);
        }
        let (offsets, total) = device_block(pieces, align).ok_or_else(|| {
            RuntimeError::invalid(
                format!(
                    "device {}: a plan's memory of {pieces:?} bytes overflows",
                    self.devices[device].name
                ),
                "compile a smaller plan",
            )
        })?;
        let piece = |base: u64, i: usize| DeviceMem { ptr: base + offsets[i] as u64, owner: None };
        if total == 0 {
            // Nothing to hold: no allocation, and no address is ever formed.
            return Ok([piece(0, 0), piece(0, 1), piece(0, 2)]);
        }
        // Allocate before claiming, so that a failed allocation leaves the books as they were.
        let rounded = books.account.check(total)?;
        let block = self.alloc(total)?;
        books.account.claim_block(offsets, total)?;
        self.devices[device].grown += rounded;
        let taken = [piece(block.ptr, 0), piece(block.ptr, 1), piece(block.ptr, 2)];
        self.blocks.push(block);
        Ok(taken)
    }

    /// Checks the variables of `plan` the backend holds already against the plan's specs.
    fn check_variables(&self, plan: &Plan) -> Result<()> {
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
        Ok(())
    }

    /// A plan's memory on every device (`take_block`), its new variables created and
    /// initialised: the address of every variable (in `plan.variables` order), and each plan
    /// device's io region and arena (at `owned_arena` where the caller's region holds it: not in
    /// the device's budget, never freed by kiln).
    fn take_plan_memory(
        &mut self,
        plan: &Plan,
        devices: &[usize],
        owned_arena: Option<u64>,
    ) -> Result<(Vec<u64>, Vec<DeviceMem>, Vec<DeviceMem>)> {
        self.check_variables(plan)?;
        let mut ios = Vec::with_capacity(devices.len());
        let mut arenas = Vec::with_capacity(devices.len());
        for (d, &device) in devices.iter().enumerate() {
            let region = new_region(plan, d, |key| self.variables.contains_key(key));
            let m = &plan.devices[d].memory;
            let arena = if owned_arena.is_some() { 0 } else { m.arena_bytes };
            let [vars, io, arena_mem] = self.take_block(
                device,
                [region.as_ref().map_or(0, |r| r.bytes), m.io_bytes, arena],
                plan.block_align(),
            )?;
            for (spec, &offset) in region.iter().flat_map(|r| r.variables.iter().zip(&r.offsets)) {
                let ptr = vars.ptr + offset as u64;
                self.htod(ptr, &variable_values(plan, spec, self.seed))?;
                self.variables.insert(spec.key.clone(), Variable { spec: (*spec).clone(), ptr });
            }
            ios.push(io);
            arenas.push(owned_arena.map_or(arena_mem, |ptr| DeviceMem { ptr, owner: None }));
        }
        Ok((plan.variables.iter().map(|v| self.variables[&v.key].ptr).collect(), ios, arenas))
    }

    fn htod(&self, dst: u64, data: &[f32]) -> Result<()> {
        // SAFETY: `dst` addresses at least data.len() f32s of device memory this backend holds
        // (a validated plan's slot, or a variable's place in its region).
        unsafe { self.driver.htod(dst, bytemuck::cast_slice(data)) }
    }

    fn dtoh(&self, src: u64, n: usize) -> Result<Vec<f32>> {
        let mut host = vec![0f32; n];
        // SAFETY: `src` addresses at least n f32s of device memory this backend holds.
        unsafe { self.driver.dtoh(src, bytemuck::cast_slice_mut(&mut host)) }?;
        Ok(host)
    }

    /// Runs `program` once (its inputs fed, as `run` asks) and returns the milliseconds the
    /// device spent on its launches, between two timing events around them (guard mode's copies
    /// included when the plan has canaries).
    pub fn timed_run(&mut self, program: ProgramId) -> Result<f64> {
        let driver = self.driver.clone();
        driver.synchronize()?;
        driver.time(&mut || Backend::run(self, program))
    }

    /// One run of `program` with every launch timed on its own (two events around each, which
    /// adds the events' cost to the total): per launch, its step's label, the kernel's
    /// description and milliseconds, in launch order. For finding where a step's time goes.
    pub fn profile(&mut self, program: ProgramId) -> Result<Vec<(String, String, f64)>> {
        Ok(self.profile_run(program)?.into_iter().map(|t| (t.label, t.kernel, t.ms)).collect())
    }

    /// Launches one kernel of a bound program; with `sync_every_launch`, waits for it.
    fn launch(&self, p: &Program, l: &BoundLaunch) -> Result<()> {
        // SAFETY: `load` validated the plan (`kiln_compiler::validate`): the arguments are
        // device pointers into the plan's arenas, io regions and variables, allocated with
        // the plan's sizes, each buffer inside its region and no two live ones overlapping;
        // the kernel was generated for exactly these shapes and argument order.
        let launched = unsafe { self.driver.launch(&l.function, &l.launch, &l.args) };
        let result =
            launched.and_then(|_| if self.sync_every_launch { self.driver.synchronize() } else { Ok(()) });
        result.map_err(|e| self.step_error(p, l, e))
    }

    /// An error at a launch, naming the step, its op and shapes, and the kernel.
    fn step_error(&self, p: &Program, l: &BoundLaunch, e: RuntimeError) -> RuntimeError {
        let step = &p.plan.steps[l.step];
        let shapes: Vec<String> = step.inputs.iter().map(|&v| p.plan.values[v].shape.to_string()).collect();
        let out = step.output.map_or("none".into(), |o| p.plan.values[o].shape.to_string());
        RuntimeError::Cuda(format!(
            "step {} of plan {:?} (`{}`: op {}, inputs [{}], output {}) failed in kernel `{}` ({}) on {}: {}{}",
            l.step,
            p.plan.name,
            step.label,
            step.op.name(),
            shapes.join(", "),
            out,
            l.launch.function,
            l.kernel,
            self.describe_short(),
            match e {
                RuntimeError::Cuda(m) => m,
                other => other.to_string(),
            },
            if self.sync_every_launch { String::new() } else { format!(" [{}]", self.driver.versions()) }
        ))
    }

    /// The launches in order, each collective run through the host where its step is.
    fn run_with_collectives(&self, p: &Program) -> Result<()> {
        let mut launches = p.launches.iter().peekable();
        let mut collectives = p.collectives.iter().peekable();
        for s in 0..p.plan.steps.len() {
            while let Some(l) = launches.next_if(|l| l.step == s) {
                self.launch(p, l)?;
            }
            if let Some(c) = collectives.next_if(|c| c.step == s) {
                self.exchange(p, c)?;
            }
        }
        Ok(())
    }

    /// One collective: through NCCL in device memory (`with_nccl`), or through host memory.
    fn exchange(&self, p: &Program, c: &HostCollective) -> Result<()> {
        if let Some(nccl) = &self.nccl {
            return self.exchange_on_device(nccl, c);
        }
        let label = &p.plan.steps[c.step].label;
        let Some(comm) = &self.comm else {
            return Err(RuntimeError::invalid(format!("step `{label}` needs a communicator"), ""));
        };
        let failed = |e: String| {
            RuntimeError::invalid(
                format!("step `{label}` ({} floats) on {}: {e}", c.n, self.describe_short()),
                "every rank must run the same plan; restart the run from its last checkpoint",
            )
        };
        self.driver.synchronize()?;
        let mut comm = comm.lock().map_err(|_| failed("the communicator's lock is poisoned".into()))?;
        let scale = 1.0 / comm.size() as f32;
        match &c.kind {
            Exchange::AllReduce { mean } => {
                let mut host = self.dtoh(c.args[0], c.n)?;
                comm.all_reduce_sum(&mut host).map_err(|e| failed(e.to_string()))?;
                if *mean {
                    host.iter_mut().for_each(|v| *v *= scale);
                }
                drop(comm);
                self.htod(c.args[1], &host)
            }
            Exchange::ReduceScatter { mean, range, part } => {
                let input = self.dtoh(c.args[0], c.n)?;
                let mut out = vec![0f32; *part];
                let shard = &mut out[..range.len()];
                comm.reduce_scatter_sum(&input, shard).map_err(|e| failed(e.to_string()))?;
                if *mean {
                    shard.iter_mut().for_each(|v| *v *= scale);
                }
                drop(comm);
                self.htod(c.args[1], &out)
            }
            Exchange::AllGather { range } => {
                let mut var = self.dtoh(c.args[0], c.n)?;
                let mine = var[range.clone()].to_vec();
                comm.all_gather(&mine, &mut var).map_err(|e| failed(e.to_string()))?;
                drop(comm);
                self.htod(c.args[1], &var)
            }
        }
    }

    /// One collective through NCCL, queued on the stream after the launches before it.
    fn exchange_on_device(&self, nccl: &super::nccl::Nccl, c: &HostCollective) -> Result<()> {
        let stream = self
            .driver
            .raw_stream()?
            .ok_or_else(|| RuntimeError::Cuda("NCCL without a CUDA stream".into()))?;
        let ranges = |n: usize| -> Vec<std::ops::Range<usize>> {
            (0..nccl.size())
                .map(|rank| kiln_compiler::ir::Shard { ranks: nccl.size(), rank }.range(n))
                .collect()
        };
        // SAFETY (all three): the addresses are the bound step's operand and output, validated
        // to hold their values' elements (`n` the operand's; an output of a reduce-scatter holds
        // the padded shard, at least this rank's range; a reduce-scatter's output is never its
        // operand's buffer); the stream is this device's, its context bound by `raw_stream`.
        match &c.kind {
            Exchange::AllReduce { mean } => unsafe {
                nccl.all_reduce(c.args[0], c.args[1], c.n, *mean, stream)
            },
            // The output's padding after the shard (at most one element) is left as it is:
            // nothing reads it (`Shard`), and writing it from the host would wait for the stream.
            Exchange::ReduceScatter { mean, .. } => unsafe {
                nccl.reduce_scatter(c.args[0], c.args[1], &ranges(c.n), *mean, stream)
            },
            Exchange::AllGather { .. } => unsafe { nccl.all_gather(c.args[0], &ranges(c.n), stream) },
        }
    }

    /// Guard mode (`crate::guard`): before each step the canaries whose buffer's life begins
    /// there are written, after it the canaries of every buffer live there are read back (the
    /// driver's copies of the gap bytes, synchronising the stream) and compared.
    fn run_guarded(&self, p: &Program, g: &Guard) -> Result<()> {
        let mut launches = p.launches.iter().peekable();
        let mut collectives = p.collectives.iter().peekable();
        for s in 0..p.plan.steps.len() {
            for c in g.to_fill(s) {
                self.htod_bytes(canary_address(p, c)?, g.pattern())?;
            }
            while let Some(l) = launches.next_if(|l| l.step == s) {
                self.launch(p, l)?;
            }
            if let Some(c) = collectives.next_if(|c| c.step == s) {
                self.exchange(p, c)?;
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
        // SAFETY: `dst` addresses at least data.len() bytes of device memory this backend holds.
        unsafe { self.driver.htod(dst, data) }
    }

    fn dtoh_bytes(&self, src: u64, n: usize) -> Result<Vec<u8>> {
        let mut host = vec![0u8; n];
        // SAFETY: `src` addresses at least n bytes of device memory this backend holds.
        unsafe { self.driver.dtoh(src, &mut host) }?;
        Ok(host)
    }

    /// Refuses, at load, a plan this device cannot run: an alignment the kernels cannot use, or
    /// arenas larger than the device or than what it has free.
    fn check_fits(&self, plan: &Plan, devices: &[usize]) -> Result<()> {
        if !plan.alignment.is_multiple_of(16) {
            return Err(RuntimeError::invalid(
                format!(
                    "plan {:?}: its slots are aligned to {} bytes, not a multiple of 16: CUDA kernels \
                     read and write 16-byte vectors and {} hands out 256-byte aligned memory",
                    plan.name,
                    plan.alignment,
                    self.describe_short()
                ),
                "compile the plan with an alignment of 16 bytes or more (CompileOptions::alignment; the default is 256)",
            ));
        }
        let (usable, why) = self.usable()?;
        for (d, dev) in plan.devices.iter().enumerate() {
            let need = dev.memory.arena_bytes.saturating_add(dev.memory.io_bytes);
            let pooled = self.devices[devices[d]].books().pool.is_some();
            if need > self.info.total_bytes || (!pooled && need > usable) {
                return Err(RuntimeError::OutOfMemory {
                    device: format!("{} ({})", dev.name, self.describe_short()),
                    bytes: need,
                    what: format!("the arena and io region of plan {:?}", plan.name),
                    detail: format!(": {why}"),
                    help: "compile with a memory limit for this device (rematerialisation then fits the plan, or the compiler reports what does not), use a smaller batch, or free the device".into(),
                });
            }
        }
        Ok(())
    }

    /// Allocates the program's arenas if this is its first run (growth) and resolves every launch
    /// argument to an address.
    /// Loads `plan` with its arena at device address `ptr` (`len` bytes), memory the caller
    /// owns (`crate::owned_memory`): refused before anything is loaded when the plan spans several
    /// devices or the region is too small or misaligned. Inputs and outputs live in the region at
    /// `owned_memory::io_offset`: write an input there (with the caller's own copy or kernel) and
    /// call `set_input_in_place`; read an output there after `run`.
    ///
    /// # Safety
    /// `ptr..ptr + len` is device memory of this backend's device that stays allocated, and that
    /// nothing else writes while the program runs, for as long as the backend lives.
    pub unsafe fn load_into(&mut self, plan: Plan, ptr: u64, len: usize) -> Result<ProgramId> {
        crate::owned_memory::check_region(&plan, ptr, len)?;
        self.load_with(plan, Some((ptr, len)))
    }

    fn load_with(&mut self, plan: Plan, region: Option<(u64, usize)>) -> Result<ProgramId> {
        // Every device pointer formed below and at launch relies on what validation establishes.
        RuntimeError::check_plan(&plan)?;
        let devices: Vec<usize> = plan.devices.iter().map(|d| self.device(&d.name)).collect::<Result<_>>()?;
        self.check_fits(&plan, &devices)?;
        // Every kernel first: a plan one cannot run (a custom op without a CUDA kernel, say) is
        // refused before any variable is created, so a refused load leaves nothing behind.
        let kernels = plan_kernels(&plan)?;
        // As the CPU backend: collectives and sharded updates need a communicator whose rank
        // the shards were made for.
        let ranked = |s: &&kiln_compiler::plan::Step| s.op.is_collective() || s.op.shard().is_some();
        if let Some(step) = plan.steps.iter().find(ranked) {
            let Some(comm) = &self.comm else {
                return Err(crate::collective::no_communicator(
                    &plan,
                    &step.label,
                    "CudaBackend::with_communicator",
                ));
            };
            crate::collective::agree_on_plan(&plan, comm)?;
            for step in plan.steps.iter().filter(ranked) {
                crate::collective::check_shard(&step.op, &step.label, comm)?;
            }
        }
        let refs: Vec<&CudaKernel> = kernels.iter().collect();
        let functions = self.driver.load(&refs)?;
        let (var_ptrs, ios, arenas) = self.take_plan_memory(&plan, &devices, region.map(|(ptr, _)| ptr))?;
        let loc = |value: usize| -> Loc {
            match plan.buffers[plan.values[value].buffer].storage {
                // A value at an offset in its buffer (`Value::offset`) is an arena value.
                Storage::Arena { device, offset } => {
                    Loc::Arena(device, (offset + plan.values[value].offset) as u64)
                }
                Storage::Io { device, offset } => Loc::Io(device, offset as u64),
                Storage::Variable { index } => Loc::Var(var_ptrs[index]),
            }
        };
        let mut launches = Vec::new();
        for (s, ((step, kernel), functions)) in plan.steps.iter().zip(&kernels).zip(functions).enumerate() {
            for (l, function) in kernel.launches.iter().zip(functions) {
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
                        Arg::Scratch => match step.scratch.map(|b| plan.buffers[b].storage) {
                            Some(Storage::Arena { device, offset }) => Ok(Loc::Arena(device, offset as u64)),
                            _ => Err(RuntimeError::Cuda(format!(
                                "kernel `{}` wants scratch but `{}` has none",
                                l.function, step.label
                            ))),
                        },
                    })
                    .collect::<Result<Vec<Loc>>>()?;
                launches.push(BoundLaunch {
                    function,
                    launch: l.clone(),
                    locs,
                    args: Vec::new(),
                    step: s,
                    kernel: kernel.describe.clone(),
                });
            }
        }
        let mut collectives = Vec::new();
        for (s, step) in plan.steps.iter().enumerate() {
            use kiln_compiler::ir::{Op, ReduceOp};
            let input = step.inputs.first().map(|&v| (loc(v), plan.values[v].shape.numel()));
            let output = step.output.map(|o| (loc(o), plan.values[o].shape.numel()));
            let (kind, (input, n), output) = match (&step.op, input, output) {
                (Op::AllReduce { op }, Some(i), Some((o, _))) => {
                    (Exchange::AllReduce { mean: *op == ReduceOp::Mean }, i, o)
                }
                (Op::ReduceScatter { op, shard }, Some((i, n)), Some((o, part))) => (
                    Exchange::ReduceScatter { mean: *op == ReduceOp::Mean, range: shard.range(n), part },
                    (i, n),
                    o,
                ),
                // The variable, gathered in place.
                (Op::AllGather { shard }, Some((i, n)), None) => {
                    (Exchange::AllGather { range: shard.range(n) }, (i, n), i)
                }
                _ => continue,
            };
            collectives.push(HostCollective { step: s, kind, input, output, n, args: [0; 2] });
        }
        self.programs.push(Program {
            owned_region: region.is_some(),
            feeds: Feeds::new(&plan),
            guard: Guard::new(&plan),
            plan,
            arenas,
            ios,
            launches,
            bound: false,
            recording: None,
            recorded: false,
            ran: false,
            collectives,
        });
        Ok(self.programs.len() - 1)
    }

    /// This device as DLPack names it.
    fn dl_device(&self) -> crate::dlpack::DLDevice {
        crate::dlpack::DLDevice { device_type: crate::dlpack::KDL_CUDA, device_id: self.info.ordinal as i32 }
    }

    /// Output `name` where the plan left it on the device, as a DLPack tensor (no copy), valid
    /// while the view lives: it borrows the backend, so the program cannot run again meanwhile.
    pub fn output_dlpack(&self, program: ProgramId, name: &str) -> Result<crate::dlpack::Dlpack<'_>> {
        let plan = &self.program(program)?.plan;
        let (value, _) = output_slot(plan, name)?;
        let v = plan.value(value);
        let addr = self.output_address(program, value, name)?;
        // SAFETY: the output's bytes lie at `addr` in the program's device memory, which lives
        // as long as the backend; the view borrows the backend.
        unsafe { crate::dlpack::view(addr, self.dl_device(), v.dtype, &v.shape) }
    }

    /// Variable `key` on the device, as a DLPack tensor (no copy), borrowing the backend.
    pub fn variable_dlpack(&self, key: &str) -> Result<crate::dlpack::Dlpack<'_>> {
        let v = self.variables.get(key).ok_or_else(|| {
            RuntimeError::invalid(
                format!("no variable `{key}`"),
                "variables exist once a plan that declares them is loaded",
            )
        })?;
        // SAFETY: the variable lives at `v.ptr` in a region the backend keeps for its life.
        unsafe { crate::dlpack::view(v.ptr, self.dl_device(), v.spec.dtype, &v.spec.shape) }
    }

    /// Runs `program` with the inputs in `bound` read in place from DLPack tensors on this device
    /// (no copy), the others fed as usual: the launches go one by one with those arguments (not
    /// as the recorded CUDA graph, which is bound to the arena), and the call waits for them, so
    /// the tensors may be released when it returns. A bound tensor must be contiguous, on this
    /// device, aligned, of the input's dtype and shape, and an input the plan never writes over.
    pub fn run_with(
        &mut self,
        program: ProgramId,
        bound: &[(&str, &crate::dlpack::Dlpack<'_>)],
    ) -> Result<()> {
        let device = self.dl_device();
        let p = self.program(program)?;
        refuse_collectives(p, "run_with")?;
        let buffers: Vec<(usize, usize, u64)> = bound
            .iter()
            .map(|(name, t)| crate::dlpack::bindable(&p.plan, name, t, device))
            .collect::<Result<_>>()?;
        let p = self.program_mut(program)?;
        for &(_, value, _) in &buffers {
            p.feeds.fed(&p.plan, value);
        }
        p.feeds.consume(&p.plan)?;
        p.ran = true;
        self.bind(program)?;
        let p = self.program(program)?;
        for l in &p.launches {
            let mut args = l.args.clone();
            for (arg, a) in args.iter_mut().zip(&l.launch.args) {
                if let Arg::Input(i) = a {
                    let value = p.plan.steps[l.step].inputs[*i];
                    if let Some(&(_, _, addr)) =
                        buffers.iter().find(|(b, _, _)| *b == p.plan.values[value].buffer)
                    {
                        *arg = addr + p.plan.values[value].offset as u64;
                    }
                }
            }
            // SAFETY: as in `launch`; a replaced argument addresses the caller's contiguous tensor
            // of the input's dtype and shape on this device (`bindable`), which no launch writes,
            // and which outlives the launches (waited for below).
            unsafe { self.driver.launch(&l.function, &l.launch, &args) }
                .map_err(|e| self.step_error(p, l, e))?;
        }
        self.driver.synchronize()
    }

    /// Feeds input `name` from a DLPack tensor by copy: on the device from a tensor on this
    /// device, host to device from a CPU one (`run_with` binds device tensors in place instead).
    pub fn set_input_dlpack(
        &mut self,
        program: ProgramId,
        name: &str,
        t: &crate::dlpack::Dlpack<'_>,
    ) -> Result<()> {
        if t.device().device_type == crate::dlpack::KDL_CPU {
            let host = crate::dlpack::host_from_dlpack(t)?;
            return self.set_input_tensor(program, name, &host);
        }
        let (dtype, shape) = t.check_for(self.dl_device())?;
        let len = shape.numel();
        let value = check_input(&self.program(program)?.plan, name, &shape, len, dtype)?;
        self.bind(program)?;
        let dst = self.io_address(program, value, name)?;
        // SAFETY: `check_for` established a contiguous tensor of `shape` and `dtype` on this
        // device; the destination is the input's slot, of exactly those bytes.
        unsafe { self.driver.dtod(dst, t.data_ptr(), len * dtype.size_bytes()) }?;
        let p = self.program_mut(program)?;
        p.feeds.fed(&p.plan, value);
        Ok(())
    }

    fn bind(&mut self, program: ProgramId) -> Result<()> {
        if self.program(program)?.bound {
            return Ok(());
        }
        let p = self.program_mut(program)?;
        let arena: Vec<u64> = p.arenas.iter().map(|m| m.ptr).collect();
        let io: Vec<u64> = p.ios.iter().map(|m| m.ptr).collect();
        let address = |loc: &Loc| match *loc {
            Loc::Arena(d, off) => arena[d] + off,
            Loc::Io(d, off) => io[d] + off,
            Loc::Var(ptr) => ptr,
        };
        for l in &mut p.launches {
            l.args = l.locs.iter().map(address).collect();
        }
        for c in &mut p.collectives {
            c.args = [address(&c.input), address(&c.output)];
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

    /// The device address of output `name` (value `value`), once a run finished.
    fn output_address(&self, program: ProgramId, value: usize, name: &str) -> Result<u64> {
        let p = self.program(program)?;
        check_ran(p.ran, &p.plan, name)?;
        self.io_address(program, value, name)
    }

    /// The device address of an input or output (the arena must be bound: `bind`).
    fn io_address(&self, program: ProgramId, value: usize, name: &str) -> Result<u64> {
        let p = self.program(program)?;
        match io_slot(&p.plan, value, name)? {
            Slot::Io { device, offset } => Ok(p.ios[device].ptr + offset as u64),
            Slot::Arena { device, offset } => Ok(p.arenas[device].ptr + offset as u64),
        }
    }
}

/// Refuses `what` (a way of running launch by launch) on a program with collectives, which only
/// `run` (and `timed_run`) carry out.
fn refuse_collectives(p: &Program, what: &str) -> Result<()> {
    match p.collectives.first() {
        None => Ok(()),
        Some(c) => Err(RuntimeError::invalid(
            format!(
                "{what}: plan {:?} has collectives (step `{}`), which {what} does not run",
                p.plan.name, p.plan.steps[c.step].label
            ),
            "run a data-parallel plan with `run` or `call`",
        )),
    }
}

/// The device address of a canary of a bound program: inside its region, since validation of
/// a guarded plan keeps every canary inside the arena or io region allocated with the plan's size.
fn canary_address(p: &Program, c: &Canary) -> Result<u64> {
    let base = match c.region {
        Region::Arena(d) => p.arenas.get(d).map(|m| m.ptr),
        Region::Io(d) => p.ios.get(d).map(|m| m.ptr),
    };
    base.map(|b| b + c.range.start as u64)
        .ok_or_else(|| RuntimeError::invalid("guard: a canary's region is not allocated", ""))
}

impl Backend for CudaBackend {
    fn scratch_rule(&self) -> Option<kiln_compiler::scratch::ScratchRule> {
        Some(cuda::SCRATCH)
    }

    /// Every family of ops reads and writes f16 and bf16 values (`kiln_kernels::cuda::HALF_KERNELS`);
    /// custom ops and collectives compute f32 copies.
    fn half_kernels(&self) -> kiln_compiler::widen::HalfKernels {
        cuda::HALF_KERNELS
    }

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
        let s = self.driver.compile_stats();
        let (n, bytes) = self.device_allocations();
        // The driver's view: its used memory now against when this backend opened (module code
        // and allocations, each rounded up to the driver's granularity; other processes and
        // backends on the device move it too).
        let driver_view = match self.driver.mem_info() {
            Ok((free, total)) => format!(
                "; the driver's used memory grew by {} B since the backend opened (allocations at \
                 the driver's granularity, and loaded kernel code)",
                (total - free) as i64 - self.used_at_open as i64
            ),
            Err(_) => String::new(),
        };
        Some(format!(
            "kernels: {} compiled by {} in {:.2} s, {} from the memory cache, {} from the disk cache; \
             {n} device allocations, {bytes} B{driver_view}; {}",
            s.compiled,
            self.driver.compiler_description(),
            s.compile_seconds,
            s.from_memory,
            s.from_disk,
            self.driver.versions()
        ))
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        self.load_with(plan, None)
    }

    fn rank(&self) -> Option<(usize, usize)> {
        let comm = self.comm.as_ref()?.lock().ok()?;
        Some((comm.rank(), comm.size()))
    }

    fn communicator(&self) -> Option<crate::collective::SharedComm> {
        self.comm.clone()
    }

    fn set_input_in_place(&mut self, program: ProgramId, name: &str) -> Result<()> {
        let p = self.program(program)?;
        let value = crate::owned_memory::in_place_input(&p.plan, p.owned_region, name)?;
        let p = self.program_mut(program)?;
        p.feeds.fed(&p.plan, value);
        Ok(())
    }

    fn plan(&self, program: ProgramId) -> Result<&Plan> {
        Ok(&self.program(program)?.plan)
    }

    fn set_input_bytes(
        &mut self,
        program: ProgramId,
        name: &str,
        shape: &Shape,
        dtype: DType,
        bytes: &[u8],
    ) -> Result<()> {
        let value = check_input_bytes(&self.program(program)?.plan, name, shape, dtype, bytes)?;
        self.bind(program)?;
        let dst = self.io_address(program, value, name)?;
        self.htod_bytes(dst, bytes)?;
        let p = self.program_mut(program)?;
        p.feeds.fed(&p.plan, value);
        Ok(())
    }

    fn profile_run(&mut self, program: ProgramId) -> Result<Vec<StepTime>> {
        refuse_collectives(self.program(program)?, "profile")?;
        let p = self.program_mut(program)?;
        p.feeds.consume(&p.plan)?;
        p.ran = true;
        self.bind(program)?;
        let p = self.program(program)?;
        let mut out = Vec::with_capacity(p.launches.len());
        for l in &p.launches {
            let ms = self.driver.time(&mut || self.launch(p, l))?;
            let step = &p.plan.steps[l.step];
            out.push(StepTime {
                step: l.step,
                op: step.op.name().to_string(),
                label: step.label.clone(),
                kernel: l.kernel.clone(),
                ms,
            });
        }
        Ok(out)
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
        let p = self.program_mut(program)?;
        p.feeds.consume(&p.plan)?;
        p.ran = true;
        self.bind(program)?;
        let p = self.program(program)?;
        if let Some(g) = &p.guard {
            return self.run_guarded(p, g);
        }
        if !p.collectives.is_empty() {
            // Host steps between launches: no CUDA graph.
            return self.run_with_collectives(p);
        }
        if self.sync_every_launch || !self.graphs {
            return p.launches.iter().try_for_each(|l| self.launch(p, l));
        }
        if !p.recorded {
            // The first run records its launches (running them, where the driver records
            // nothing); a failure in a launch is reported as at any run.
            let recording =
                self.driver.record(&mut || p.launches.iter().try_for_each(|l| self.launch(p, l)))?;
            let replay = recording.is_some();
            let p = self.program_mut(program)?;
            p.recording = recording;
            p.recorded = true;
            if !replay {
                return Ok(());
            }
        }
        let p = self.program(program)?;
        match &p.recording {
            // SAFETY: the recording was made from this program's bound launches, whose
            // addresses stay in its arenas, io regions and variable regions for as long as it
            // is loaded (binding happens once; see `bind`), with the invariants `launch` states.
            Some(r) => unsafe { self.driver.replay(r) }.map_err(|e| {
                RuntimeError::Cuda(format!(
                    "replaying plan {:?} ({} launches as one CUDA graph) on {}: {e}; KILN_CUDA_SYNC=1 \
                     runs the launches one by one and names the failing step",
                    p.plan.name,
                    p.launches.len(),
                    self.describe_short()
                ))
            }),
            None => p.launches.iter().try_for_each(|l| self.launch(p, l)),
        }
    }

    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor> {
        let plan = &self.program(program)?.plan;
        let (value, _) = output_slot(plan, name)?;
        let shape = plan.value(value).shape.clone();
        let dtype = plan.value(value).dtype;
        let src = self.output_address(program, value, name)?;
        if dtype != DType::F32 {
            return HostTensor::from_bytes(
                shape.clone(),
                dtype,
                &self.dtoh_bytes(src, shape.numel() * dtype.size_bytes())?,
            );
        }
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
