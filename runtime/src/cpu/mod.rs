//! The CPU backend: each plan's arenas and io regions (one per device of the plan: logical CPU
//! devices each get their own) are host buffers allocated once at `load`;
//! every step's kernel is prepared once and runs on base + offset pointers. Kernels use rayon
//! for work large enough to split.

use crate::backend::{Backend, ProgramId, check_input};
use crate::error::{Result, RuntimeError};
use crate::host_buffer::HostBuffer;
use crate::store::VariableStore;
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::ir::{OpClass, Shape};
use kiln_compiler::plan::Storage;
use kiln_kernels::cpu::{self, CpuKernel};

/// Where a value lives, resolved once at load.
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
    arenas: Vec<HostBuffer>,
    ios: Vec<HostBuffer>,
    steps: Vec<BoundStep>,
    /// Reused operand-pointer list: no allocation per step.
    scratch: Vec<*mut u8>,
}

pub struct CpuBackend {
    store: VariableStore,
    programs: Vec<Program>,
}

impl CpuBackend {
    pub fn new(seed: u64) -> Self {
        CpuBackend { store: VariableStore::new(seed), programs: Vec::new() }
    }

    pub fn store(&self) -> &VariableStore {
        &self.store
    }

    /// Runs the program `runs` times and returns each step's kernel description and median time
    /// in nanoseconds, in step order.
    pub fn profile(&mut self, program: ProgramId, runs: usize) -> Vec<(String, u64)> {
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
        p.steps
            .iter()
            .zip(times)
            .map(|(s, mut t)| {
                t.sort_unstable();
                (s.kernel.describe(), t.get(t.len() / 2).copied().unwrap_or(0))
            })
            .collect()
    }

    /// Bytes of host memory the program's arenas and io regions hold.
    pub fn program_bytes(&self, program: ProgramId) -> (usize, usize) {
        let p = &self.programs[program];
        (p.arenas.iter().map(HostBuffer::len).sum(), p.ios.iter().map(HostBuffer::len).sum())
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
        Loc::Arena(d, o) => unsafe { p.arenas[d].as_mut_ptr().add(o) },
        Loc::Io(d, o) => unsafe { p.ios[d].as_mut_ptr().add(o) },
        Loc::Var(slot) => store.ptr(slot),
    }
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", rayon::current_num_threads())
    }

    fn load(&mut self, plan: Plan) -> Result<ProgramId> {
        let slots: Vec<usize> = plan.variables.iter().map(|v| self.store.ensure(v)).collect::<Result<_>>()?;
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
        let arenas = plan.devices.iter().map(|d| HostBuffer::zeroed(d.memory.arena_bytes)).collect();
        let ios = plan.devices.iter().map(|d| HostBuffer::zeroed(d.memory.io_bytes)).collect();
        self.programs.push(Program { plan, arenas, ios, steps, scratch: Vec::with_capacity(max_operands) });
        Ok(self.programs.len() - 1)
    }

    fn plan(&self, program: ProgramId) -> &Plan {
        &self.programs[program].plan
    }

    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()> {
        let p = &mut self.programs[program];
        let value = check_input(&p.plan, name, shape, data.len())?;
        let Storage::Io { device, offset } = p.plan.buffers[p.plan.values[value].buffer].storage else {
            return Err(RuntimeError::invalid(
                format!("input `{name}` is not in the io region"),
                "recompile",
            ));
        };
        p.ios[device].f32s_mut(offset, data.len()).copy_from_slice(data);
        Ok(())
    }

    fn run(&mut self, program: ProgramId) -> Result<()> {
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
        let Some(b) = p.plan.output(name) else {
            return Err(RuntimeError::invalid(format!("plan {:?} has no output `{name}`", p.plan.name), ""));
        };
        let v = p.plan.value(b.value);
        let Storage::Io { device, offset } = p.plan.buffers[v.buffer].storage else {
            return Err(RuntimeError::invalid(
                format!("output `{name}` is not in the io region"),
                "recompile",
            ));
        };
        HostTensor::new(v.shape.clone(), p.ios[device].f32s(offset, v.shape.numel()).to_vec())
    }

    fn read_variable(&self, key: &str) -> Result<HostTensor> {
        self.store.get(key).ok_or_else(|| RuntimeError::invalid(format!("no variable `{key}`"), ""))
    }

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()> {
        self.store.set(key, value)
    }
}
