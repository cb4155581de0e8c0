//! The CPU backend. Each device of a plan (logical CPU devices each get their own) has a memory
//! budget: with growth, loading a plan takes one allocation per device, exactly sized, for the
//! variables it adds, its io region and its arena (`plan::device_block`); with preallocation,
//! all of them are carved from one region taken when the backend starts. Every step's kernel is prepared once at
//! load and runs on base + offset pointers; kernels use rayon for work large enough to split.

use crate::backend::{
    Backend, Feeds, ProgramId, Slot, StepTime, check_input_bytes, check_ran, io_slot, no_program, output_slot,
};
use crate::error::{Result, RuntimeError};
use crate::guard::{Canary, Guard, Region};
use crate::host_buffer::{HostBuffer, HostMem};
use crate::memory::{Account, DeviceBudget, Purpose, Tracker};
use crate::store::VariableStore;
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::ir::{DType, Op, OpClass, Shape};
use kiln_compiler::plan::{Storage, device_block};
use kiln_kernels::cpu::{self, CpuKernel};
use std::ptr::NonNull;

mod overlap;
mod spread;

/// Where a value lives, resolved once at load: (plan device, offset) or a variable slot.
#[derive(Clone, Copy, Debug)]
enum Loc {
    Arena(usize, usize),
    Io(usize, usize),
    Var(usize),
}

struct BoundStep {
    kernel: Box<dyn CpuKernel>,
    inputs: Vec<Loc>,
    output: Option<Loc>,
    /// `kernel.checks_operands()`, read once at load.
    checks: bool,
    /// The bytes of each input (as `inputs`) and of the output, for the overlap of collectives
    /// (`overlap`).
    input_bytes: Vec<usize>,
    output_bytes: usize,
    /// An all-reduce or reduce-scatter, which may run while the steps after it do (`overlap`).
    overlaps: bool,
    /// A collective (`Op::is_collective`): one that runs in line (an all-gather) first waits
    /// for those in flight, since the ranks must issue their collectives in one order.
    collective: bool,
}

struct Program {
    plan: Plan,
    /// The arena lies in the caller's region (`load_into`): inputs may be written there in place.
    owned_region: bool,
    /// One arena per plan device.
    arenas: Vec<HostMem>,
    ios: Vec<HostMem>,
    steps: Vec<BoundStep>,
    /// Whether a run goes on a thread of the rayon pool (`on_the_pool`): the plan does work
    /// enough (`POOLED_FLOPS`) and has no collective.
    pooled: bool,
    /// Reused operand-pointer list: no allocation per step.
    scratch: Vec<*mut u8>,
    feeds: Feeds,
    /// Guard mode's canaries, when the plan has them (`crate::guard`).
    guard: Option<Guard>,
    /// Whether a run started (its inputs were all fed): outputs read before are refused.
    ran: bool,
}

/// One host device's memory: its budget and, when preallocating, the pool.
struct HostDevice {
    account: Account,
    pool: Option<HostBuffer>,
}

impl HostDevice {
    fn new(budget: DeviceBudget, tracker: Tracker) -> Result<Self> {
        let pool = match budget.pool_bytes() {
            Some(bytes) => Some(host_alloc(&budget.name, bytes, "its preallocated region")?),
            None => None,
        };
        Ok(HostDevice { account: Account::new(budget, tracker), pool })
    }

    fn take(&mut self, bytes: usize, purpose: Purpose) -> Result<HostMem> {
        // Growth: allocate before claiming, so that a failed allocation leaves the books as they were.
        if self.pool.is_none() {
            self.account.check(bytes)?;
            let mem = host_alloc(&self.account.budget.name, bytes, purpose.name())?;
            self.account.claim(bytes, purpose)?;
            return Ok(HostMem::Owned(mem));
        }
        match (self.account.claim(bytes, purpose)?, &self.pool) {
            (Some(offset), Some(pool)) => {
                // SAFETY: the account keeps offset + bytes inside the pool, so the pointer stays
                // inside (or one past) the pool's allocation.
                let ptr = unsafe { pool.as_mut_ptr().add(offset) };
                let ptr = NonNull::new(ptr).ok_or_else(|| RuntimeError::invalid("null pool pointer", ""))?;
                Ok(HostMem::Pooled { ptr, len: bytes })
            }
            _ => Err(RuntimeError::invalid("a preallocating device gave no pool offset", "")),
        }
    }

    /// A plan's memory on this device: the variable region it adds, its io region and its arena
    /// (`[bytes; 3]`, purposes in that order). Growth: one allocation laid out by
    /// `plan::device_block`, kept in `blocks` for the backend's life, the pieces handed out as
    /// parts of it. Preallocation: each carved from the pool.
    fn take_block(
        &mut self,
        pieces: [usize; 3],
        align: usize,
        blocks: &mut Vec<HostBuffer>,
    ) -> Result<[HostMem; 3]> {
        if self.pool.is_some() {
            let [v, io, arena] = pieces;
            return Ok([
                self.take(v, Purpose::Variable)?,
                self.take(io, Purpose::Io)?,
                self.take(arena, Purpose::Arena)?,
            ]);
        }
        let (offsets, total) = device_block(pieces, align).ok_or_else(|| {
            RuntimeError::invalid(
                format!("device {}: a plan's memory of {pieces:?} bytes overflows", self.account.budget.name),
                "compile a smaller plan",
            )
        })?;
        // Allocate before claiming, so that a failed allocation leaves the books as they were.
        self.account.check(total)?;
        let block = host_alloc(&self.account.budget.name, total, "a plan's variables, io region and arena")?;
        self.account.claim_block(offsets, total)?;
        let piece = |i: usize| -> Result<HostMem> {
            // SAFETY: `device_block` keeps offsets[i] + pieces[i] <= total, the block's length,
            // so the pointer stays inside (or one past) the allocation.
            let ptr = unsafe { block.as_mut_ptr().add(offsets[i]) };
            let ptr = NonNull::new(ptr).ok_or_else(|| RuntimeError::invalid("null block pointer", ""))?;
            Ok(HostMem::Pooled { ptr, len: pieces[i] })
        };
        let taken = [piece(0)?, piece(1)?, piece(2)?];
        blocks.push(block);
        Ok(taken)
    }
}

/// Host memory, or an error naming the device and the size (never an abort).
fn host_alloc(device: &str, bytes: usize, what: &str) -> Result<HostBuffer> {
    HostBuffer::zeroed(bytes).ok_or_else(|| RuntimeError::OutOfMemory {
        device: device.into(),
        bytes,
        what: what.into(),
        detail: String::new(),
        help: "the machine cannot give that much memory: use a smaller batch or model, or set a memory limit so the compiler reports the plan's needs first".into(),
    })
}

/// The CPU backend: runs plans in host memory, one arena (and io region) per plan device, with
/// kernels prepared once at load from `kiln_kernels::cpu` (rayon splits large work); variables
/// live in its [`VariableStore`].
pub struct CpuBackend {
    store: VariableStore,
    devices: Vec<HostDevice>,
    /// The allocations plans were loaded into under growth (`HostDevice::take_block`): the
    /// store's regions and the programs' arenas and io regions are parts of them.
    blocks: Vec<HostBuffer>,
    tracker: Tracker,
    programs: Vec<Program>,
    /// The communicator of a data-parallel run: its rank's end of the collectives in plans.
    comm: Option<crate::collective::SharedComm>,
    /// Whether all-reduces and reduce-scatters run beside the steps after them (`overlap`).
    overlap: bool,
    /// Built for named devices (`with_budgets`): a plan may use those alone, so that a misspelt
    /// device name is an error, never a way around a device's limit.
    fixed_devices: bool,
}

impl CpuBackend {
    /// This backend as one rank of a data-parallel run: the collectives of the plans it loads
    /// (`Op::AllReduce`, from `kiln_compiler::data_parallel`) run through `comm` (in-process
    /// ranks, `kiln_comm::local_group`, or MPI), and a plan with collectives is checked against
    /// every rank's at load (`collective::agree_on_plan`).
    pub fn with_communicator(mut self, comm: impl kiln_comm::Communicator + 'static) -> Self {
        self.comm = Some(std::sync::Arc::new(std::sync::Mutex::new(Box::new(comm))));
        self
    }

    /// Whether a plan's all-reduces and reduce-scatters run on a communication thread beside the
    /// steps after them (`overlap`; on by default, off with `KILN_OVERLAP=0`), or in line. The
    /// results are the same bits either way.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    /// The communicator this backend is a rank with, for the caller's own collectives between
    /// calls (a check that the ranks' weights agree, say).
    pub fn communicator(&self) -> Option<crate::collective::SharedComm> {
        self.comm.clone()
    }

    /// A backend whose devices grow without limit.
    pub fn new(seed: u64) -> Self {
        let devices = Vec::new();
        CpuBackend {
            store: VariableStore::new(seed),
            devices,
            blocks: Vec::new(),
            tracker: Tracker::default(),
            programs: Vec::new(),
            comm: None,
            overlap: overlap::enabled(),
            fixed_devices: false,
        }
    }

    /// A backend for devices with these budgets (plans may use any of them by name, and no
    /// other: a plan naming a device no budget mentions is refused at load), reporting to
    /// `tracker`. With no budgets, as [`CpuBackend::new`], any device name grows without limit.
    /// Preallocating budgets take their region now: an error names the device when the machine
    /// cannot give it.
    pub fn with_budgets(seed: u64, budgets: Vec<DeviceBudget>, tracker: Tracker) -> Result<Self> {
        let fixed_devices = !budgets.is_empty();
        let devices =
            budgets.into_iter().map(|b| HostDevice::new(b, tracker.clone())).collect::<Result<_>>()?;
        Ok(CpuBackend {
            store: VariableStore::new(seed),
            devices,
            blocks: Vec::new(),
            tracker,
            programs: Vec::new(),
            comm: None,
            overlap: overlap::enabled(),
            fixed_devices,
        })
    }

    /// The variables this backend holds (every loaded plan's parameters and optimizer state).
    pub fn store(&self) -> &VariableStore {
        &self.store
    }

    /// The per-device memory statistics this backend reports to.
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    fn device(&mut self, name: &str) -> Result<usize> {
        match self.devices.iter().position(|d| d.account.budget.name == name) {
            Some(i) => Ok(i),
            None if self.fixed_devices => Err(RuntimeError::unknown_device(
                name,
                self.devices.iter().map(|d| d.account.budget.name.as_str()),
            )),
            None => {
                // An unlimited growth budget preallocates nothing, so this cannot fail.
                let account = Account::new(DeviceBudget::unlimited(name), self.tracker.clone());
                self.devices.push(HostDevice { account, pool: None });
                Ok(self.devices.len() - 1)
            }
        }
    }

    /// Runs the program `runs` times and returns each step's kernel description and median time
    /// in nanoseconds, in step order, each kernel timed on its own. The runs read whatever the
    /// inputs hold (nothing needs feeding); each is checked as `run` checks it.
    pub fn profile(&mut self, program: ProgramId, runs: usize) -> Result<Vec<(String, u64)>> {
        let times = self.time_steps(program, runs)?;
        Ok(self.programs[program]
            .steps
            .iter()
            .zip(times)
            .map(|(s, mut t)| {
                t.sort_unstable();
                (s.kernel.describe(), t.get(t.len() / 2).copied().unwrap_or(0))
            })
            .collect())
    }

    /// Each step's nanoseconds in `runs` runs of the program, per step in step order.
    fn time_steps(&mut self, program: ProgramId, runs: usize) -> Result<Vec<Vec<u64>>> {
        self.program(program)?;
        let store = &self.store;
        let p = &mut self.programs[program]; // the id was checked above
        p.ran = true;
        let mut scratch = std::mem::take(&mut p.scratch);
        let p = &*p;
        let mut times: Vec<Vec<u64>> = vec![Vec::with_capacity(runs); p.steps.len()];
        let mut all = || -> Result<()> {
            let mut one = Vec::with_capacity(p.steps.len());
            for _ in 0..runs {
                one.clear();
                run_steps(p, store, &[], &mut scratch, None, Some(&mut one))?;
                times.iter_mut().zip(&one).for_each(|(t, &ns)| t.push(ns));
            }
            Ok(())
        };
        // Where `run` runs the steps (collectives in line).
        let result = if !p.pooled {
            all()
        } else {
            // SAFETY: as in `run_overriding`.
            unsafe { on_the_pool(all) }
        };
        self.programs[program].scratch = scratch;
        result.map(|()| times)
    }

    /// Replaces the kernel of one step of a loaded program: a test seam (guard mode's tests plant
    /// a kernel that writes out of bounds). The kernel must honour `CpuKernel::run`'s contract
    /// for the step's operands, or write only into guard mode's canaries.
    #[doc(hidden)]
    pub fn replace_kernel(
        &mut self,
        program: ProgramId,
        step: usize,
        kernel: Box<dyn CpuKernel>,
    ) -> Result<()> {
        let p = self.program_mut(program)?;
        let steps = p.steps.len();
        let s = p.steps.get_mut(step).ok_or_else(|| {
            RuntimeError::invalid(
                format!("step {step} of a program of {steps} steps"),
                "name a step of the plan",
            )
        })?;
        s.checks = kernel.checks_operands();
        s.kernel = kernel;
        Ok(())
    }

    /// Bytes of host memory the program's arenas and io regions hold.
    pub fn program_bytes(&self, program: ProgramId) -> Result<(usize, usize)> {
        let p = self.program(program)?;
        Ok((p.arenas.iter().map(HostMem::len).sum(), p.ios.iter().map(HostMem::len).sum()))
    }

    fn program(&self, program: ProgramId) -> Result<&Program> {
        self.programs.get(program).ok_or_else(|| no_program(program, self.programs.len()))
    }

    fn program_mut(&mut self, program: ProgramId) -> Result<&mut Program> {
        let loaded = self.programs.len();
        self.programs.get_mut(program).ok_or_else(|| no_program(program, loaded))
    }

    /// Loads `plan` with its arena in `region`, memory the caller owns (`crate::owned_memory`):
    /// refused before anything is loaded when the plan spans several devices or the region is
    /// too small or misaligned for it. Inputs and outputs live in the region at
    /// `owned_memory::io_offset`; write an input there and call `set_input_in_place`, read an
    /// output there after `run`. The region must outlive the backend (hence `'static`: a leaked
    /// or static buffer, or a pool that lives as long as the process).
    pub fn load_into(&mut self, plan: Plan, region: &'static mut [u8]) -> Result<ProgramId> {
        crate::owned_memory::check_region(&plan, region.as_ptr() as u64, region.len())?;
        let ptr = std::ptr::NonNull::new(region.as_mut_ptr())
            .ok_or_else(|| RuntimeError::invalid("the region is a null pointer", ""))?;
        self.load_with(plan, Some((ptr, region.len())))
    }

    fn load_with(&mut self, plan: Plan, region: Option<(std::ptr::NonNull<u8>, usize)>) -> Result<ProgramId> {
        // Everything below (and every pointer `run` forms) relies on what validation establishes.
        RuntimeError::check_plan(&plan)?;
        // Every kernel first: a plan one cannot run (an unregistered custom op, say) is refused
        // before any variable is created, so a refused load leaves nothing behind.
        let mut kernels = Vec::with_capacity(plan.steps.len());
        let mut collectives = false;
        for step in &plan.steps {
            let ins: Vec<(&Shape, _)> =
                step.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
            let scalar = Shape::scalar();
            let out = match step.output {
                Some(o) => (&plan.values[o].shape, plan.values[o].dtype),
                None => (&scalar, ins.first().map(|i| i.1).unwrap_or_default()),
            };
            // A custom op's kernel uses the scratch it declares: the step must have that much.
            let declared = kiln_compiler::scratch::declared(&step.op, &ins, out.0);
            let given = step.scratch.map_or(0, |b| plan.buffers[b].bytes);
            if declared > given {
                return Err(RuntimeError::invalid(
                    format!(
                        "step `{}` ({}) declares {declared} bytes of scratch but the plan gives it {given}",
                        step.label,
                        step.op.label()
                    ),
                    "compile the plan in a process where the custom op is registered as it is now",
                ));
            }
            if step.op.is_collective() || step.op.shard().is_some() {
                let Some(comm) = &self.comm else {
                    return Err(crate::collective::no_communicator(
                        &plan,
                        &step.label,
                        "`CpuBackend::new(seed).with_communicator(comm)`",
                    ));
                };
                crate::collective::check_shard(&step.op, &step.label, comm)?;
                if step.op.is_collective() {
                    kernels.push(crate::collective::kernel(&step.op, comm.clone(), ins[0].0, out.0));
                    collectives = true;
                    continue;
                }
            }
            kernels.push(cpu::prepare(&step.op, &ins, out)?);
            debug_assert!(step.op.class() != OpClass::View);
        }
        if let Some(comm) = self.comm.as_ref().filter(|_| collectives) {
            crate::collective::agree_on_plan(&plan, comm)?;
        }
        let devices: Vec<usize> = plan.devices.iter().map(|d| self.device(&d.name)).collect::<Result<_>>()?;
        // One block per plan device (`take_block`): the variables it adds (taken when the store
        // creates them, after it checked the held ones), its io region and its arena, which the
        // caller's region replaces.
        let align = plan.block_align();
        let own = |d: usize| {
            let m = &plan.devices[d].memory;
            (m.io_bytes, if region.is_some() { 0 } else { m.arena_bytes })
        };
        let mut taken: Vec<Option<(HostMem, HostMem)>> = (0..plan.devices.len()).map(|_| None).collect();
        let (backend_devices, blocks) = (&mut self.devices, &mut self.blocks);
        let slots = self.store.ensure_plan(&plan, |d, bytes| {
            let (io, arena) = own(d);
            let [v, io, arena] = backend_devices[devices[d]].take_block([bytes, io, arena], align, blocks)?;
            taken[d] = Some((io, arena));
            Ok(v)
        })?;
        let loc = |value: usize| match plan.buffers[plan.values[value].buffer].storage {
            // A value at an offset in its buffer (`Value::offset`) is an arena value.
            Storage::Arena { device, offset } => Loc::Arena(device, offset + plan.values[value].offset),
            Storage::Io { device, offset } => Loc::Io(device, offset),
            Storage::Variable { index } => Loc::Var(slots[index]),
        };
        let steps: Vec<BoundStep> = plan
            .steps
            .iter()
            .zip(kernels)
            .enumerate()
            .map(|(i, (step, kernel))| {
                let mut inputs: Vec<Loc> = step.inputs.iter().map(|&v| loc(v)).collect();
                // A custom op's scratch (`CustomOp::scratch`) and an all-gather's are passed after
                // its operands; the built-in CPU kernels use none (the plan's other scratch is the
                // CUDA kernels').
                let value_bytes = |v: usize| plan.values[v].shape.numel() * plan.values[v].dtype.size_bytes();
                let mut input_bytes: Vec<usize> = step.inputs.iter().map(|&v| value_bytes(v)).collect();
                if let (Op::Custom { .. } | Op::AllGather { .. }, Some(b)) = (&step.op, step.scratch)
                    && let Storage::Arena { device, offset } = plan.buffers[b].storage
                {
                    inputs.push(Loc::Arena(device, offset));
                    input_bytes.push(plan.buffers[b].bytes);
                }
                BoundStep {
                    checks: kernel.checks_operands(),
                    kernel,
                    inputs,
                    output: step.output.map(loc),
                    input_bytes,
                    output_bytes: step.output.map_or(0, value_bytes),
                    overlaps: kiln_compiler::schedule::overlaps(&step.op) && !next_reads(&plan, i),
                    collective: step.op.is_collective(),
                }
            })
            .collect();
        let max_operands = steps.iter().map(|s| s.inputs.len()).max().unwrap_or(0);
        let mut ios = Vec::with_capacity(plan.devices.len());
        let mut arenas = Vec::with_capacity(plan.devices.len());
        for (d, taken) in taken.into_iter().enumerate() {
            let (io, arena) = match taken {
                Some(t) => t,
                None => {
                    let (io, arena) = own(d);
                    let [_, io, arena] =
                        self.devices[devices[d]].take_block([0, io, arena], align, &mut self.blocks)?;
                    (io, arena)
                }
            };
            ios.push(io);
            // The caller's region: not in the device's budget, never freed by kiln.
            arenas.push(match region {
                Some((ptr, len)) => HostMem::Pooled { ptr, len },
                None => arena,
            });
        }
        let flops: u64 = plan
            .steps
            .iter()
            .map(|s| {
                let shapes: Vec<&Shape> = s.inputs.iter().map(|&v| &plan.values[v].shape).collect();
                s.output.map_or(0, |o| s.op.flops(&shapes, &plan.values[o].shape))
            })
            .sum();
        let pooled = flops >= POOLED_FLOPS && !steps.iter().any(|s| s.collective);
        self.programs.push(Program {
            pooled,
            owned_region: region.is_some(),
            feeds: Feeds::new(&plan),
            guard: Guard::new(&plan),
            plan,
            arenas,
            ios,
            steps,
            scratch: Vec::with_capacity(max_operands),
            ran: false,
        });
        Ok(self.programs.len() - 1)
    }

    /// `run`, with the operands of the buffers in `bound` read from the caller's memory
    /// (`run_with`): (buffer index, address). A plan's all-reduces and reduce-scatters run on a
    /// communication thread while the steps after them do (`overlap`), except in guard mode.
    fn run_overriding(&mut self, program: ProgramId, bound: &[(usize, *mut u8)]) -> Result<()> {
        let p = self.program_mut(program)?;
        p.feeds.consume(&p.plan)?;
        p.ran = true;
        let store = &self.store;
        let p = &mut self.programs[program]; // the id was checked above
        let mut scratch = std::mem::take(&mut p.scratch);
        let p = &*p;
        let result = if p.guard.is_none() && self.overlap && p.steps.iter().any(|s| s.overlaps) {
            let books = overlap::InFlight::books();
            std::thread::scope(|scope| {
                let mut flight = overlap::InFlight::start(scope, &books);
                let result = run_steps(p, store, bound, &mut scratch, Some(&mut flight), None);
                let failure = flight.wait_all();
                result.and(failure.map_or(Ok(()), |(step, why)| Err(collective_error(p, step, why))))
            })
        } else if !p.pooled {
            // Too little work to hand to the pool, or a collective, which blocks its thread until
            // every rank reaches it: on the pool, ranks beyond its thread count would wait for
            // ranks that never get a thread.
            run_steps(p, store, bound, &mut scratch, None, None)
        } else {
            // SAFETY: a run holds the program's kernels (`Send + Sync`) and pointers into memory
            // the program owns, which the pool thread uses while this one waits.
            unsafe { on_the_pool(|| run_steps(p, store, bound, &mut scratch, None, None)) }
        };
        self.programs[program].scratch = scratch;
        result
    }

    /// Runs `program` with the inputs in `bound` read in place from DLPack tensors (no copy) and
    /// the others fed as usual. A bound tensor must be contiguous, on the CPU, aligned, of the
    /// input's dtype and shape, and an input the plan never writes over (an elementwise op may
    /// write its result over an input it reads last); otherwise an error says which.
    pub fn run_with(
        &mut self,
        program: ProgramId,
        bound: &[(&str, &crate::dlpack::Dlpack<'_>)],
    ) -> Result<()> {
        let p = self.program(program)?;
        let buffers: Vec<(usize, usize, u64)> = bound
            .iter()
            .map(|(name, t)| crate::dlpack::bindable(&p.plan, name, t, crate::dlpack::CPU))
            .collect::<Result<_>>()?;
        let p = &mut self.programs[program];
        for &(_, value, _) in &buffers {
            p.feeds.fed(&p.plan, value);
        }
        let bound: Vec<(usize, *mut u8)> = buffers.iter().map(|&(b, _, a)| (b, a as *mut u8)).collect();
        self.run_overriding(program, &bound)
    }

    /// Output `name` where the plan left it, as a DLPack tensor (no copy), valid while the view
    /// lives: it borrows the backend, so the program cannot run again meanwhile.
    pub fn output_dlpack(&self, program: ProgramId, name: &str) -> Result<crate::dlpack::Dlpack<'_>> {
        let p = self.program(program)?;
        let (value, slot) = output_slot(&p.plan, name)?;
        let v = p.plan.value(value);
        check_ran(p.ran, &p.plan, name)?;
        let base = match slot {
            Slot::Io { device, offset } => p.ios[device].as_mut_ptr() as u64 + offset as u64,
            Slot::Arena { device, offset } => p.arenas[device].as_mut_ptr() as u64 + offset as u64,
        };
        // SAFETY: the output's bytes lie at `base` inside the program's memory, which lives as
        // long as the backend; the view borrows the backend.
        unsafe { crate::dlpack::view(base, crate::dlpack::CPU, v.dtype, &v.shape) }
    }

    /// Variable `key` in its region, as a DLPack tensor (no copy), borrowing the backend.
    pub fn variable_dlpack(&self, key: &str) -> Result<crate::dlpack::Dlpack<'_>> {
        let (ptr, shape) = self.store.locate(key).ok_or_else(|| {
            RuntimeError::invalid(
                format!("no variable `{key}`"),
                "variables exist once a plan that declares them is loaded",
            )
        })?;
        // SAFETY: the variable's f32s lie at `ptr` in a region the store keeps for the backend's
        // life; the view borrows the backend.
        unsafe { crate::dlpack::view(ptr as u64, crate::dlpack::CPU, DType::F32, shape) }
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new(0)
    }
}

/// The memory an input or output slot lives in.
fn slot_mem(p: &mut Program, slot: Slot) -> &mut HostMem {
    match slot {
        Slot::Io { device, .. } => &mut p.ios[device],
        Slot::Arena { device, .. } => &mut p.arenas[device],
    }
}

fn offset_of(slot: Slot) -> usize {
    match slot {
        Slot::Io { offset, .. } | Slot::Arena { offset, .. } => offset,
    }
}

/// The floating-point work (`Op::flops`, all steps) from which a plan runs on the pool: 16.8
/// MFLOP, 0.1 to 0.3 ms of one core's work, against the hand-off's tens of microseconds.
const POOLED_FLOPS: u64 = 1 << 24;

/// `f` run on a thread of the rayon pool, the caller waiting, the pool's other workers kept
/// awake meanwhile (`keep_busy`): a run's kernels then split their
/// work from inside the pool. Called from outside it, every parallel loop of every kernel
/// hands its work to the pool and wakes a sleeping worker (tens of microseconds each): on one
/// thread EfficientNet-B0's squeeze-excitation means took 1.0 ms in a run against 0.35 ms
/// alone. Its forward pass at batch 2 went 26.3 -> 23.2 ms on one thread and 17.1 -> 13.6 ms on
/// two, MobileNetV3-small's 7.25 -> 6.59 and 5.59 -> 3.99 ms (`kiln run --bench 20`, 2-core
/// AMD EPYC). Handing a run to the pool and waiting for it costs tens of microseconds, which
/// plans of less than `POOLED_FLOPS` do not win back: the zoo's seed-mlp step took 7 µs on the
/// caller's thread and 35 µs on the pool.
///
/// # Safety
/// `f` and its result may be used on another thread than the caller's (one at a time: the
/// caller waits): nothing they hold may be tied to the calling thread. Plan runs qualify: they
/// hold kernels (`Send + Sync`) and raw pointers into memory the program owns.
unsafe fn on_the_pool<R>(f: impl FnOnce() -> R) -> R {
    /// What crosses to the pool thread: the closure and its result.
    struct Pass<T>(T);
    // SAFETY: `rayon::scope` runs the closure on one pool thread while the calling thread
    // waits for it, and the caller vouched that `f` and its result may move to that thread.
    unsafe impl<T> Send for Pass<T> {}
    let f = Pass(f);
    let done = std::sync::atomic::AtomicBool::new(false);
    let done = &done;
    let seats = spread::Seats::default();
    let seats = &seats;
    rayon::scope(move |scope| {
        let f = f;
        let runner = rayon::current_thread_index();
        // The runner's CPU first: a worker kept awake beside it moves to another (`spread`).
        seats.sit();
        for _ in 1..rayon::current_num_threads() {
            scope.spawn(move |_| keep_busy(done, runner, seats));
        }
        /// Ends the spinning when the run ends, a panicking one included: otherwise the scope
        /// would wait for the spinners forever instead of passing the panic on.
        struct Stop<'a>(&'a std::sync::atomic::AtomicBool);
        impl Drop for Stop<'_> {
            fn drop(&mut self) {
                self.0.store(true, std::sync::atomic::Ordering::Release);
            }
        }
        let _stop = Stop(done);
        Pass((f.0)())
    })
    .0
}

/// A pool worker kept awake for the length of a run (`on_the_pool`): it runs whatever work the
/// pool has (the run's kernels' parallel pieces) as soon as there is some, and spins between,
/// until `done`. A worker that slept between kernels took tens of microseconds to wake for each
/// one: EfficientNet-B0's depthwise convolutions ran slower on two threads than on one inside
/// its pass, though twice as fast alone. Measured (`kiln run --threads 2 --bench 20`, three
/// interleaved rounds, the 2-core AMD EPYC, batch 2, sleeping -> kept awake): EfficientNet-B0
/// 10.1-12.6 -> 10.0-11.9 ms, MobileNetV3-small 2.8-3.6 -> 2.6-2.7 ms. On the runner's own
/// thread (a join there may run this job while it waits) it returns at once: spinning there
/// would wait on itself. A worker kept awake runs any work of the pool, another runner's
/// included, so two runs sharing a pool can wait on each other's pieces. It first takes a CPU
/// no other thread of the run stands on (`spread`).
fn keep_busy(done: &std::sync::atomic::AtomicBool, runner: Option<usize>, seats: &spread::Seats) {
    if rayon::current_thread_index() == runner || done.load(std::sync::atomic::Ordering::Acquire) {
        return;
    }
    seats.sit();
    let mut since = std::time::Instant::now();
    while !done.load(std::sync::atomic::Ordering::Acquire) {
        match rayon::yield_now() {
            Some(rayon::Yield::Executed) => since = std::time::Instant::now(),
            // Idle for `IDLE_SPIN`: the worker goes back to sleep. Whatever this job sits on
            // then goes on (a piece of the run this worker left below it, in a nest rayon's
            // stealing order does not make, included): a delay, never a wait for ever.
            Some(rayon::Yield::Idle) if since.elapsed() > IDLE_SPIN => return,
            Some(rayon::Yield::Idle) => std::hint::spin_loop(),
            None => return,
        }
    }
}

/// How long a worker kept awake for a run (`keep_busy`) spins without work before it sleeps:
/// longer than the serial stretches between an inference pass's parallel kernels (tens of
/// microseconds), short enough that a long serial step does not hold a core for nothing.
const IDLE_SPIN: std::time::Duration = std::time::Duration::from_millis(1);

/// The steps of a run, in order; with `flight`, collectives that may overlap (`overlap`) are
/// sent to its thread and each step first waits for those whose bytes it touches. With
/// `times`, each step's kernel is timed and its nanoseconds pushed there, in step order (0 for a
/// collective sent to `flight`).
fn run_steps<'a>(
    p: &'a Program,
    store: &VariableStore,
    bound: &[(usize, *mut u8)],
    scratch: &mut Vec<*mut u8>,
    mut flight: Option<&mut overlap::InFlight<'a>>,
    mut times: Option<&mut Vec<u64>>,
) -> Result<()> {
    let guard = p.guard.as_ref();
    if let Some(g) = guard {
        fill_canaries(p, g, 0);
    }
    for (i, step) in p.steps.iter().enumerate() {
        scratch.clear();
        scratch.extend(step.inputs.iter().map(|&l| ptr(p, store, l)));
        for (j, &v) in p.plan.steps[i].inputs.iter().enumerate() {
            if let Some(&(_, addr)) = bound.iter().find(|(b, _)| *b == p.plan.values[v].buffer) {
                scratch[j] = addr.wrapping_add(p.plan.values[v].offset);
            }
        }
        let out = step.output.map_or(std::ptr::null_mut(), |l| ptr(p, store, l));
        if let Some(flight) = flight.as_deref_mut()
            && (flight.busy() || step.overlaps)
        {
            // The bytes this step reads and writes: it waits for the collectives in flight
            // that touch any of them (`overlap`), or for all of them before a collective
            // that runs in line.
            let touched: Vec<std::ops::Range<usize>> = scratch
                .iter()
                .zip(&step.input_bytes)
                .map(|(&a, &n)| overlap::range(a, n))
                .chain(step.output.map(|_| overlap::range(out, step.output_bytes)))
                .collect();
            let failure =
                if step.collective && !step.overlaps { flight.wait_all() } else { flight.wait_for(&touched) };
            if let Some((at, why)) = failure {
                return Err(collective_error(p, at, why));
            }
            if step.overlaps {
                if let Err((at, why)) = flight.send(i, step.kernel.as_ref(), scratch, out, touched) {
                    return Err(collective_error(p, at, why));
                }
                if let Some(t) = times.as_deref_mut() {
                    t.push(0);
                }
                continue;
            }
        }
        // (After the wait above: the check reads the operands.)
        if step.checks {
            // SAFETY: as for `run` below.
            if let Err(e) = unsafe { step.kernel.check_operands(scratch) } {
                return Err(crate::backend::operand_error(&p.plan, i, e));
            }
        }
        let start = times.is_some().then(std::time::Instant::now);
        // SAFETY: `load` validated the plan (`kiln_compiler::validate`): every pointer
        // addresses a buffer of the plan inside its arena, io region or variable, holding
        // its value's bytes; buffers live at this step do not overlap, and an output shares
        // an operand's buffer only for an elementwise op in place, which the kernels allow;
        // every kernel was prepared for exactly these shapes; a custom op's trailing pointer is
        // its step's scratch buffer, live at this step alone. A bound input (`run_with`)
        // addresses the caller's contiguous tensor of its value's dtype and shape, which no
        // step writes (checked there).
        unsafe { step.kernel.run(scratch, out) };
        if let (Some(t), Some(start)) = (times.as_deref_mut(), start) {
            t.push(start.elapsed().as_nanos() as u64);
        }
        if let Some(why) = step.kernel.take_failure() {
            return Err(crate::backend::step_error(
                &p.plan,
                i,
                why,
                "fix the custom op's kernel or its shape function",
            ));
        }
        if let Some(g) = guard
            && let Err(e) = guard_step(p, g, i)
        {
            return Err(e);
        }
    }
    Ok(())
}

/// Whether the step after step `i` reads or writes a buffer of step `i`'s operands or output:
/// then a collective at `i` would be waited for at once, and runs in line instead (`overlap`).
fn next_reads(plan: &Plan, i: usize) -> bool {
    let Some(next) = plan.steps.get(i + 1) else { return true };
    let step = &plan.steps[i];
    let buffers = |s: &kiln_compiler::plan::Step| -> Vec<usize> {
        s.inputs.iter().chain(&s.output).map(|&v| plan.values[v].buffer).collect()
    };
    let mine = buffers(step);
    buffers(next).iter().any(|b| mine.contains(b))
}

/// The error of a collective that failed on the communication thread (`overlap`).
fn collective_error(p: &Program, step: usize, why: String) -> RuntimeError {
    crate::backend::step_error(
        &p.plan,
        step,
        why,
        "every rank must run the same plan; restart the run from its last checkpoint",
    )
}

fn ptr(p: &Program, store: &VariableStore, loc: Loc) -> *mut u8 {
    match loc {
        // SAFETY: `load` validated the plan, so offset o + the buffer's bytes lie inside the
        // arena of the plan's size, allocated (or the caller's region checked) at load.
        Loc::Arena(d, o) => unsafe { p.arenas[d].as_mut_ptr().add(o) },
        // SAFETY: as above, inside the io region allocated at load with the plan's io size.
        Loc::Io(d, o) => unsafe { p.ios[d].as_mut_ptr().add(o) },
        Loc::Var(slot) => store.ptr(slot),
    }
}

/// Guard mode, after step `i`: checks the canaries of the buffers live at `i`, then fills those
/// whose buffer's life begins at `i + 1`.
fn guard_step(p: &Program, g: &Guard, i: usize) -> Result<()> {
    for c in g.to_check(i) {
        // SAFETY: `canary_ptr` checked the bytes lie inside their region (zeroed at allocation,
        // so initialised); no kernel runs now and no reference into the region is held.
        let bytes = unsafe { std::slice::from_raw_parts(canary_ptr(p, c), c.range.len()) };
        if let Some(at) = g.check(bytes) {
            return Err(Guard::overrun(&p.plan, i, c, at));
        }
    }
    fill_canaries(p, g, i + 1);
    Ok(())
}

/// Guard mode: fills the canaries whose buffer's life begins at `step`, before it runs.
fn fill_canaries(p: &Program, g: &Guard, step: usize) {
    for c in g.to_fill(step) {
        // SAFETY: as in `guard_step`; validation keeps a canary clear of every buffer live while
        // it is filled and checked, so this writes no live tensor.
        g.fill(unsafe { std::slice::from_raw_parts_mut(canary_ptr(p, c), c.range.len()) });
    }
}

/// A canary's first byte; panics unless the canary lies inside its region (validation of a
/// guarded plan establishes that it does).
fn canary_ptr(p: &Program, c: &Canary) -> *mut u8 {
    let mem = match c.region {
        Region::Arena(d) => &p.arenas[d],
        Region::Io(d) => &p.ios[d],
    };
    assert!(
        c.range.end <= mem.len(),
        "guard: canary {:?} outside its region of {} bytes",
        c.range,
        mem.len()
    );
    // SAFETY: inside the allocation (checked above).
    unsafe { mem.as_mut_ptr().add(c.range.start) }
}

impl Backend for CpuBackend {
    /// Every family of ops reads and writes f16 and bf16 values but custom ops
    /// (`kiln_kernels::cpu::HALF_KERNELS`), which compute f32 copies.
    fn half_kernels(&self) -> kiln_compiler::widen::HalfKernels {
        cpu::HALF_KERNELS
    }

    fn rank(&self) -> Option<(usize, usize)> {
        let comm = self.comm.as_ref()?.lock().ok()?;
        Some((comm.rank(), comm.size()))
    }

    fn communicator(&self) -> Option<crate::collective::SharedComm> {
        self.comm.clone()
    }

    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        self.load_with(plan, None)
    }

    fn set_input_in_place(&mut self, program: ProgramId, name: &str) -> Result<()> {
        let p = self.program(program)?;
        let value = crate::owned_memory::in_place_input(&p.plan, p.owned_region, name)?;
        let p = &mut self.programs[program];
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
        let p = &mut self.programs[program];
        let slot = io_slot(&p.plan, value, name)?;
        slot_mem(p, slot).bytes_mut(offset_of(slot), bytes.len()).copy_from_slice(bytes);
        p.feeds.fed(&p.plan, value);
        Ok(())
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
        self.run_overriding(program, &[])
    }

    fn profile_run(&mut self, program: ProgramId) -> Result<Vec<StepTime>> {
        let p = self.program_mut(program)?;
        p.feeds.consume(&p.plan)?;
        let times = self.profile(program, 1)?;
        let plan = &self.programs[program].plan; // the id was checked above
        Ok(plan
            .steps
            .iter()
            .zip(times)
            .enumerate()
            .map(|(step, (s, (kernel, ns)))| StepTime {
                step,
                op: s.op.name().to_string(),
                label: s.label.clone(),
                kernel,
                ms: ns as f64 / 1e6,
            })
            .collect())
    }

    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor> {
        let p = self.program(program)?;
        let (value, slot) = output_slot(&p.plan, name)?;
        let shape = &p.plan.value(value).shape;
        check_ran(p.ran, &p.plan, name)?;
        let mem = match slot {
            Slot::Io { device, .. } => &p.ios[device],
            Slot::Arena { device, .. } => &p.arenas[device],
        };
        let dtype = p.plan.value(value).dtype;
        if dtype != DType::F32 {
            return HostTensor::from_bytes(
                shape.clone(),
                dtype,
                mem.bytes(offset_of(slot), shape.numel() * dtype.size_bytes()),
            );
        }
        HostTensor::new(shape.clone(), mem.f32s(offset_of(slot), shape.numel()).to_vec())
    }

    fn read_variable(&self, key: &str) -> Result<HostTensor> {
        self.store.get(key).ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))
    }

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        self.store.set(key, value)
    }
}
