//! What every backend offers: load a plan once, then feed inputs, run, read outputs — any number
//! of times, with no allocation after `load`.

use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::ir::{DType, Shape};

/// A program loaded on a backend: the index `Backend::load` returned, valid on that backend only.
pub type ProgramId = usize;

/// One timed kernel of a profiled run (`Backend::profile_run`).
#[derive(Clone, Debug, PartialEq)]
pub struct StepTime {
    /// The index of its step in the plan.
    pub step: usize,
    /// The step's op, as plans print it ("MatMul", "Conv2d", ...).
    pub op: String,
    /// The step's label: the model line (or imported node) it came from.
    pub label: String,
    /// The kernel that ran, as the backend describes it.
    pub kernel: String,
    /// Milliseconds it took.
    pub ms: f64,
}

/// A device that runs plans: `load` binds a plan once (memory, variables, kernels), then each
/// call feeds inputs, runs every step and reads outputs. Implemented by the CPU and CUDA backends.
pub trait Backend {
    /// The device, for reports: "cpu (2 threads)".
    fn describe(&self) -> String;

    /// What the backend has to say beyond `describe` (kernel compilation and cache figures for
    /// CUDA), or nothing.
    fn report(&self) -> Option<String> {
        None
    }

    /// The scratch this backend's kernels use (`kiln_compiler::scratch`): compile plans for it
    /// with `CompileOptions::with_scratch(backend.scratch_rule())`. A plan compiled without
    /// (or with another rule) still runs: a kernel uses at most the scratch its step has.
    fn scratch_rule(&self) -> Option<kiln_compiler::scratch::ScratchRule> {
        None
    }

    /// The ops whose kernels on this backend read and write f16 and bf16 values (none by
    /// default): compile plans for it with `CompileOptions::with_half_kernels(this)`, which
    /// reads the other ops' half values through f32 copies (`kiln_compiler::widen`), as
    /// `Trainer` does.
    fn half_kernels(&self) -> kiln_compiler::widen::HalfKernels {
        kiln_compiler::widen::HalfKernels::NONE
    }

    /// (this rank, the rank count) when the backend is a rank of a data-parallel run
    /// (`CpuBackend::with_communicator`): a `Trainer` on it trains data-parallel.
    fn rank(&self) -> Option<(usize, usize)> {
        None
    }

    /// The communicator of a data-parallel run (`rank`), for collectives between calls: a
    /// `Trainer` gathers its ZeRO shards through it to save a whole checkpoint.
    fn communicator(&self) -> Option<crate::collective::SharedComm> {
        None
    }

    /// Binds a plan to this device: allocates its arena and io region once, creates the
    /// variables it declares (initialised on first sight), prepares every kernel.
    fn load(&mut self, plan: Plan) -> Result<ProgramId>;

    /// The plan of a loaded program; an id this backend did not hand out is an error.
    fn plan(&self, program: ProgramId) -> Result<&Plan>;

    /// Copies `data` (of `shape`) into the program's input `name`, an f32 input: a byte feed of f32.
    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()> {
        self.set_input_bytes(program, name, shape, DType::F32, bytemuck::cast_slice(data))
    }

    /// Copies `bytes` (elements of `dtype`, little-endian, of `shape`) into input `name`, whose
    /// dtype must be `dtype`: how i32, i64 and bool inputs are fed.
    fn set_input_bytes(
        &mut self,
        program: ProgramId,
        name: &str,
        shape: &Shape,
        dtype: DType,
        bytes: &[u8],
    ) -> Result<()>;

    /// Marks input `name` fed without copying anything: the caller wrote its bytes where the
    /// plan keeps it, inside a region it owns (`owned_memory`, `load_into`). Programs whose arena
    /// the backend allocated refuse it (their inputs must be copied in with `set_input`).
    fn set_input_in_place(&mut self, program: ProgramId, name: &str) -> Result<()> {
        let _ = (program, name);
        Err(RuntimeError::invalid(
            format!("input `{name}`: this backend's programs are fed by copying"),
            "use set_input, or load the plan into your own region (load_into)",
        ))
    }

    /// Copies `t` into input `name`, whose dtype must be `t`'s.
    fn set_input_tensor(&mut self, program: ProgramId, name: &str, t: &HostTensor) -> Result<()> {
        match t.dtype() {
            DType::F32 => self.set_input(program, name, t.shape(), t.data()),
            d => self.set_input_bytes(program, name, t.shape(), d, &t.to_bytes()?),
        }
    }

    /// Runs every step of the program once. Inputs live in the arena until their last reader, so
    /// a run consumes them: every input must be fed before each run. Outputs stay readable until
    /// the next `set_input` or run.
    fn run(&mut self, program: ProgramId) -> Result<()>;

    /// Runs the program once as `run` does (every input fed), timing each kernel on its own:
    /// one row per kernel in launch order. Timing adds a clock read (a pair of events on a GPU)
    /// per kernel, so the rows' sum exceeds a plain run's time a little. For finding where a
    /// model's time goes (`kiln run --profile`).
    fn profile_run(&mut self, program: ProgramId) -> Result<Vec<StepTime>> {
        let _ = program;
        Err(RuntimeError::invalid(
            format!("{} cannot time its kernels one by one", self.describe()),
            "profile on the CPU or CUDA backend",
        ))
    }

    /// Copies output `name` back to the host.
    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor>;

    /// Copies variable `key` (a parameter or optimizer state) back to the host; an error when
    /// no loaded plan declared it.
    fn read_variable(&self, key: &str) -> Result<HostTensor>;

    /// Overwrites variable `key` with `value`, which must have the variable's shape (e.g. to
    /// restore a checkpoint).
    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()>;

    /// Feeds `inputs`, runs, and returns every output by name. Every input of the plan must be
    /// among `inputs`, each once.
    fn call(
        &mut self,
        program: ProgramId,
        inputs: &[(&str, &HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>> {
        let plan = self.plan(program)?;
        for (i, (name, _)) in inputs.iter().enumerate() {
            if inputs[..i].iter().any(|(n, _)| n == name) {
                return Err(RuntimeError::invalid(
                    format!("input `{name}` of plan {:?} is fed twice", plan.name),
                    "feed each input once",
                ));
            }
        }
        if let Some(missing) = plan.inputs.iter().find(|b| !inputs.iter().any(|(n, _)| *n == b.name)) {
            let fed: Vec<&str> = inputs.iter().map(|(n, _)| *n).collect();
            return Err(RuntimeError::invalid(
                format!(
                    "plan {:?} was called without its input `{}` (fed: {fed:?})",
                    plan.name, missing.name
                ),
                format!("feed every input: {:?}", plan.inputs.iter().map(|b| &b.name).collect::<Vec<_>>()),
            ));
        }
        for (name, t) in inputs {
            self.set_input_tensor(program, name, t)?;
        }
        self.run(program)?;
        let names: Vec<String> = self.plan(program)?.outputs.iter().map(|b| b.name.clone()).collect();
        names.into_iter().map(|n| self.output(program, &n).map(|t| (n, t))).collect()
    }
}

/// Checks `bytes` fed to input `name` as elements of `dtype` of `shape` (whole elements, and
/// what `check_input` checks); returns the binding's value index.
pub fn check_input_bytes(
    plan: &Plan,
    name: &str,
    shape: &Shape,
    dtype: DType,
    bytes: &[u8],
) -> Result<usize> {
    let len = bytes.len() / dtype.size_bytes().max(1);
    let value = check_input(plan, name, shape, len, dtype)?;
    if len * dtype.size_bytes() != bytes.len() {
        return Err(RuntimeError::invalid(
            format!("input `{name}`: {} bytes are not whole {dtype} elements", bytes.len()),
            "pass HostTensor::to_bytes of the tensor",
        ));
    }
    Ok(value)
}

/// Checks a fed input (`len` elements of `dtype`) against the plan's binding; returns the
/// binding's value index.
pub fn check_input(plan: &Plan, name: &str, shape: &Shape, len: usize, dtype: DType) -> Result<usize> {
    let Some(b) = plan.input(name) else {
        let known: Vec<&str> = plan.inputs.iter().map(|b| b.name.as_str()).collect();
        return Err(RuntimeError::invalid(
            format!("plan {:?} has no input `{name}`", plan.name),
            format!("its inputs are {known:?}"),
        ));
    };
    let v = plan.value(b.value);
    if v.dtype != dtype {
        let how = match v.dtype {
            DType::I32 => "HostTensor::from_i32",
            DType::I64 => "HostTensor::from_i64",
            DType::Bool => "HostTensor::from_bool",
            _ => "HostTensor::new (f32)",
        };
        return Err(RuntimeError::InputShape {
            name: name.into(),
            expected: v.shape.clone(),
            expected_dtype: v.dtype,
            got: shape.clone(),
            dtype,
            help: format!("feed the dtype the input was declared with: make the tensor with {how}"),
        });
    }
    if &v.shape == shape && shape.numel() != len {
        return Err(RuntimeError::invalid(
            format!(
                "input `{name}` expects {}{} ({} values) but was given {len} values",
                v.dtype,
                v.shape,
                shape.numel()
            ),
            format!(
                "pass exactly {} values, one per element of the shape, in row-major order",
                shape.numel()
            ),
        ));
    }
    if &v.shape != shape {
        return Err(RuntimeError::InputShape {
            name: name.into(),
            expected: v.shape.clone(),
            expected_dtype: v.dtype,
            got: shape.clone(),
            dtype: v.dtype,
            help: "plans are compiled per input shape: compile one for this shape".into(),
        });
    }
    Ok(b.value)
}

/// Where an input or output lives: `compile` puts them in the arena (an input live from the
/// first step, an output to the last); plans made by hand may use the io region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// In the arena of the plan's device `device`.
    Arena {
        /// The index of the device in the plan (`plan.devices`).
        device: usize,
        /// Bytes from the start of that device's arena.
        offset: usize,
    },
    /// In the io region of the plan's device `device`.
    Io {
        /// The index of the device in the plan (`plan.devices`).
        device: usize,
        /// Bytes from the start of that device's io region.
        offset: usize,
    },
}

/// Where output `name` of `plan` lives: its value and its slot.
pub fn output_slot(plan: &Plan, name: &str) -> Result<(usize, Slot)> {
    let Some(b) = plan.output(name) else {
        let known: Vec<&str> = plan.outputs.iter().map(|b| b.name.as_str()).collect();
        return Err(RuntimeError::invalid(
            format!("plan {:?} has no output `{name}`", plan.name),
            format!("its outputs are {known:?}"),
        ));
    };
    Ok((b.value, io_slot(plan, b.value, name)?))
}

/// The slot of an input or output value (the plan was validated at load: bindings are in the
/// arena or the io region).
pub fn io_slot(plan: &Plan, value: usize, name: &str) -> Result<Slot> {
    use kiln_compiler::plan::Storage;
    match plan.buffers[plan.values[value].buffer].storage {
        Storage::Arena { device, offset } => Ok(Slot::Arena { device, offset }),
        Storage::Io { device, offset } => Ok(Slot::Io { device, offset }),
        Storage::Variable { .. } => Err(RuntimeError::Invalid {
            what: format!("`{name}` of plan {:?} is a variable, not an input or output", plan.name),
            help: "recompile the plan".into(),
        }),
    }
}

/// Tracks which inputs of a program have been fed since its last run: an input lives in the
/// arena only until its last reader, so every run consumes its inputs, and running without
/// feeding one would compute on whatever its slot holds.
#[derive(Clone, Debug, Default)]
pub struct Feeds(Vec<bool>);

impl Feeds {
    /// No input of `plan` fed yet.
    pub fn new(plan: &Plan) -> Self {
        Feeds(vec![false; plan.inputs.len()])
    }

    /// Records that the input bound to value `value` was fed.
    pub fn fed(&mut self, plan: &Plan, value: usize) {
        if let Some(i) = plan.inputs.iter().position(|b| b.value == value) {
            self.0[i] = true;
        }
    }

    /// Before a run: an error naming the first input not fed since the last run; else the
    /// inputs count as consumed.
    pub fn consume(&mut self, plan: &Plan) -> Result<()> {
        match self.0.iter().position(|f| !f) {
            None => {
                self.0.iter_mut().for_each(|f| *f = false);
                Ok(())
            }
            Some(i) => Err(RuntimeError::invalid(
                format!("plan {:?} was run before its input `{}` was fed", plan.name, plan.inputs[i].name),
                "feed every input before each run (set_input, or pass them all to call): a run consumes its inputs",
            )),
        }
    }
}

/// Refuses reading output `name` of `plan` before any run of it started (`ran`): its memory
/// holds nothing the plan computed yet.
pub fn check_ran(ran: bool, plan: &Plan, name: &str) -> Result<()> {
    if ran {
        return Ok(());
    }
    Err(RuntimeError::invalid(
        format!("output `{name}` of plan {:?} was read before the plan ran", plan.name),
        "run the plan (or call it) before reading its outputs",
    ))
}

/// The error for a program id a backend did not hand out (`loaded`: how many it has loaded).
pub fn no_program(program: ProgramId, loaded: usize) -> RuntimeError {
    RuntimeError::invalid(
        format!("no program {program}: this backend has loaded {loaded}"),
        "use the id that `load` returned on this backend",
    )
}

/// The error for step `step` of `plan` whose operand values its op rejects (a gather id out of
/// range): names the step, its op and where the operands come from.
pub fn operand_error(plan: &Plan, step: usize, message: String) -> RuntimeError {
    step_error(plan, step, message, "feed ids that are whole numbers inside the table (0 <= id < rows)")
}

/// A step that failed, named with its label, the line that traced it and its operands.
pub fn step_error(plan: &Plan, step: usize, message: String, help: &str) -> RuntimeError {
    let s = &plan.steps[step];
    let sources: Vec<&str> =
        s.inputs.iter().map(|&v| plan.buffers[plan.values[v].buffer].label.as_str()).collect();
    let at = s.origin.as_ref().map(|o| format!(" (traced at {o})")).unwrap_or_default();
    RuntimeError::invalid(
        format!("step {step} ({}{at}): {message}; its operands are {}", s.label, sources.join(", ")),
        help,
    )
}
