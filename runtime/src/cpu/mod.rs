//! The CPU backend. Each device of a plan (logical CPU devices each get their own) has a memory
//! budget: with growth, a plan's arena is allocated when the plan first runs and its io region
//! and variables when it is loaded, each exactly sized; with preallocation, all of them are
//! carved from one region taken when the backend starts. Every step's kernel is prepared once at
//! load and runs on base + offset pointers; kernels use rayon for work large enough to split.

use crate::backend::{Backend, ProgramId, check_input, io_slot, output_slot};
use crate::error::{Result, RuntimeError};
use crate::host_buffer::{HostBuffer, HostMem};
use crate::memory::{Account, DeviceBudget, Purpose, Tracker};
use crate::store::VariableStore;
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::ir::{OpClass, Shape};
use kiln_compiler::plan::Storage;
use kiln_kernels::cpu::{self, CpuKernel};
use std::ptr::NonNull;

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
}

struct Program {
    plan: Plan,
    /// The backend device of each plan device.
    devices: Vec<usize>,
    /// One arena per plan device; `None` until the first run under the growth policy.
    arenas: Vec<Option<HostMem>>,
    ios: Vec<HostMem>,
    steps: Vec<BoundStep>,
    /// Reused operand-pointer list: no allocation per step.
    scratch: Vec<*mut u8>,
}

/// One host device's memory: its budget and, when preallocating, the pool.
struct HostDevice {
    account: Account,
    pool: Option<HostBuffer>,
}

impl HostDevice {
    fn new(budget: DeviceBudget, tracker: Tracker) -> Self {
        let pool = budget.pool_bytes().map(HostBuffer::zeroed);
        HostDevice { account: Account::new(budget, tracker), pool }
    }

    fn take(&mut self, bytes: usize, purpose: Purpose) -> Result<HostMem> {
        match (self.account.claim(bytes, purpose)?, &self.pool) {
            (Some(offset), Some(pool)) => {
                // SAFETY: the account keeps offset + bytes inside the pool.
                let ptr = unsafe { pool.as_mut_ptr().add(offset) };
                Ok(HostMem::Pooled { ptr: NonNull::new(ptr).expect("pool pointer"), len: bytes })
            }
            _ => Ok(HostMem::Owned(HostBuffer::zeroed(bytes))),
        }
    }
}

pub struct CpuBackend {
    store: VariableStore,
    devices: Vec<HostDevice>,
    tracker: Tracker,
    programs: Vec<Program>,
}

impl CpuBackend {
    /// A backend whose devices grow without limit.
    pub fn new(seed: u64) -> Self {
        Self::with_budgets(seed, vec![], Tracker::default())
    }

    /// A backend for devices with these budgets (plans may use any of them by name; a device
    /// name no budget mentions grows without limit), reporting to `tracker`.
    pub fn with_budgets(seed: u64, budgets: Vec<DeviceBudget>, tracker: Tracker) -> Self {
        let devices = budgets.into_iter().map(|b| HostDevice::new(b, tracker.clone())).collect();
        CpuBackend { store: VariableStore::new(seed), devices, tracker, programs: Vec::new() }
    }

    pub fn store(&self) -> &VariableStore {
        &self.store
    }

    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    fn device(&mut self, name: &str) -> usize {
        match self.devices.iter().position(|d| d.account.budget.name == name) {
            Some(i) => i,
            None => {
                self.devices.push(HostDevice::new(DeviceBudget::unlimited(name), self.tracker.clone()));
                self.devices.len() - 1
            }
        }
    }

    /// Runs the program `runs` times and returns each step's kernel description and median time
    /// in nanoseconds, in step order.
    pub fn profile(&mut self, program: ProgramId, runs: usize) -> Result<Vec<(String, u64)>> {
        self.ensure_arenas(program)?;
        let store = &self.store;
        let p = &mut self.programs[program];
        let mut times: Vec<Vec<u64>> = vec![Vec::with_capacity(runs); p.steps.len()];
        let mut scratch = std::mem::take(&mut p.scratch);
        for _ in 0..runs {
            for (i, step) in p.steps.iter().enumerate() {
                scratch.clear();
                scratch.extend(step.inputs.iter().map(|&l| ptr(p, store, l)));
                let out = step.output.map_or(std::ptr::null_mut(), |l| ptr(p, store, l));
                let start = std::time::Instant::now();
                // SAFETY: as in `run`.
                unsafe { step.kernel.run(&scratch, out) };
                times[i].push(start.elapsed().as_nanos() as u64);
            }
        }
        p.scratch = scratch;
        Ok(p.steps
            .iter()
            .zip(times)
            .map(|(s, mut t)| {
                t.sort_unstable();
                (s.kernel.describe(), t.get(t.len() / 2).copied().unwrap_or(0))
            })
            .collect())
    }

    /// Bytes of host memory the program's arenas and io regions hold (arenas not yet allocated
    /// under growth count 0).
    pub fn program_bytes(&self, program: ProgramId) -> (usize, usize) {
        let p = &self.programs[program];
        (p.arenas.iter().flatten().map(HostMem::len).sum(), p.ios.iter().map(HostMem::len).sum())
    }

    /// Allocates the program's arenas if this is its first run (growth policy).
    fn ensure_arenas(&mut self, program: ProgramId) -> Result<()> {
        for d in 0..self.programs[program].arenas.len() {
            if self.programs[program].arenas[d].is_none() {
                let bytes = self.programs[program].plan.devices[d].memory.arena_bytes;
                let device = self.programs[program].devices[d];
                let mem = self.devices[device].take(bytes, Purpose::Arena)?;
                self.programs[program].arenas[d] = Some(mem);
            }
        }
        Ok(())
    }
}

impl Default for CpuBackend {
    fn default() -> Self {
        Self::new(0)
    }
}

fn ptr(p: &Program, store: &VariableStore, loc: Loc) -> *mut u8 {
    // SAFETY (of the adds): offsets come from the plan, whose buffers lie inside the arena and
    // io region allocated with the plan's sizes.
    match loc {
        Loc::Arena(d, o) => unsafe {
            p.arenas[d].as_ref().expect("arenas allocated before running").as_mut_ptr().add(o)
        },
        Loc::Io(d, o) => unsafe { p.ios[d].as_mut_ptr().add(o) },
        Loc::Var(slot) => store.ptr(slot),
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        let devices: Vec<usize> = plan.devices.iter().map(|d| self.device(&d.name)).collect();
        let mut slots = Vec::with_capacity(plan.variables.len());
        for v in &plan.variables {
            let device = &mut self.devices[devices[v.device]];
            slots.push(self.store.ensure(v, |bytes| device.take(bytes, Purpose::Variable))?);
        }
        let loc = |value: usize| match plan.buffers[plan.values[value].buffer].storage {
            Storage::Arena { device, offset } => Loc::Arena(device, offset),
            Storage::Io { device, offset } => Loc::Io(device, offset),
            Storage::Variable { index } => Loc::Var(slots[index]),
        };
        let mut steps = Vec::with_capacity(plan.steps.len());
        for step in &plan.steps {
            let ins: Vec<(&Shape, _)> =
                step.inputs.iter().map(|&v| (&plan.values[v].shape, plan.values[v].dtype)).collect();
            let scalar = Shape::scalar();
            let out = match step.output {
                Some(o) => (&plan.values[o].shape, plan.values[o].dtype),
                None => (&scalar, ins.first().map(|i| i.1).unwrap_or_default()),
            };
            let kernel = cpu::prepare(&step.op, &ins, out)?;
            debug_assert!(step.op.class() != OpClass::View);
            steps.push(BoundStep {
                kernel,
                inputs: step.inputs.iter().map(|&v| loc(v)).collect(),
                output: step.output.map(loc),
            });
        }
        let max_operands = plan.steps.iter().map(|s| s.inputs.len()).max().unwrap_or(0);
        let mut ios = Vec::with_capacity(plan.devices.len());
        let mut arenas = Vec::with_capacity(plan.devices.len());
        for (d, dev) in plan.devices.iter().enumerate() {
            let device = &mut self.devices[devices[d]];
            ios.push(device.take(dev.memory.io_bytes, Purpose::Io)?);
            // Growth: the arena waits for the first run. Preallocation: carved now.
            arenas.push(match device.pool {
                Some(_) => Some(device.take(dev.memory.arena_bytes, Purpose::Arena)?),
                None => None,
            });
        }
        self.programs.push(Program {
            plan,
            devices,
            arenas,
            ios,
            steps,
            scratch: Vec::with_capacity(max_operands),
        });
        Ok(self.programs.len() - 1)
    }

    fn plan(&self, program: ProgramId) -> &Plan {
        &self.programs[program].plan
    }

    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()> {
        let p = &mut self.programs[program];
        let value = check_input(&p.plan, name, shape, data.len())?;
        let (device, offset) = io_slot(&p.plan, value, name)?;
        p.ios[device].f32s_mut(offset, data.len()).copy_from_slice(data);
        Ok(())
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
        self.ensure_arenas(program)?;
        let store = &self.store;
        let p = &mut self.programs[program];
        let mut scratch = std::mem::take(&mut p.scratch);
        for step in &p.steps {
            scratch.clear();
            scratch.extend(step.inputs.iter().map(|&l| ptr(p, store, l)));
            let out = step.output.map_or(std::ptr::null_mut(), |l| ptr(p, store, l));
            // SAFETY: every pointer addresses a buffer of the plan with its value's size; the
            // planner guarantees that buffers live at the same step do not overlap, except the
            // in-place outputs of elementwise ops that the kernels allow.
            unsafe { step.kernel.run(&scratch, out) };
        }
        p.scratch = scratch;
        Ok(())
    }

    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor> {
        let p = &self.programs[program];
        let (value, device, offset) = output_slot(&p.plan, name)?;
        let shape = &p.plan.value(value).shape;
        HostTensor::new(shape.clone(), p.ios[device].f32s(offset, shape.numel()).to_vec())
    }

    fn read_variable(&self, key: &str) -> Result<HostTensor> {
        self.store.get(key).ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))
    }

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        self.store.set(key, value)
    }
}
