//! What every backend offers: load a plan once, then feed inputs, run, read outputs — any number
//! of times, with no allocation after `load`.

use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use kiln_compiler::Plan;
use kiln_compiler::ir::Shape;

pub type ProgramId = usize;

pub trait Backend {
    /// The device, for reports: "cpu (2 threads)".
    fn describe(&self) -> String;

    /// What the backend has to say beyond `describe` (kernel compilation and cache figures for
    /// CUDA), or nothing.
    fn report(&self) -> Option<String> {
        None
    }

    /// Binds a plan to this device: allocates its arena and io region once, creates the
    /// variables it declares (initialised on first sight), prepares every kernel.
    fn load(&mut self, plan: Plan) -> Result<ProgramId>;

    fn plan(&self, program: ProgramId) -> &Plan;

    /// Copies `data` (of `shape`) into the program's input `name`.
    fn set_input(&mut self, program: ProgramId, name: &str, shape: &Shape, data: &[f32]) -> Result<()>;

    /// Runs every step of the program once.
    fn run(&mut self, program: ProgramId) -> Result<()>;

    /// Copies output `name` back to the host.
    fn output(&self, program: ProgramId, name: &str) -> Result<HostTensor>;

    fn read_variable(&self, key: &str) -> Result<HostTensor>;

    fn write_variable(&mut self, key: &str, value: &HostTensor) -> Result<()>;

    /// Feeds `inputs`, runs, and returns every output by name.
    fn call(
        &mut self,
        program: ProgramId,
        inputs: &[(&str, &HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>> {
        for (name, t) in inputs {
            self.set_input(program, name, t.shape(), t.data())?;
        }
        self.run(program)?;
        let names: Vec<String> = self.plan(program).outputs.iter().map(|b| b.name.clone()).collect();
        names.into_iter().map(|n| self.output(program, &n).map(|t| (n, t))).collect()
    }
}

/// Checks a fed input against the plan's binding; returns the binding's value index.
pub fn check_input(plan: &Plan, name: &str, shape: &Shape, len: usize) -> Result<usize> {
    let Some(b) = plan.input(name) else {
        let known: Vec<&str> = plan.inputs.iter().map(|b| b.name.as_str()).collect();
        return Err(RuntimeError::invalid(
            format!("plan {:?} has no input `{name}`", plan.name),
            format!("its inputs are {known:?}"),
        ));
    };
    let v = plan.value(b.value);
    if &v.shape != shape || shape.numel() != len {
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

/// Where output `name` of `plan` lives: its value, and (device, offset) in the io regions.
pub fn output_slot(plan: &Plan, name: &str) -> Result<(usize, usize, usize)> {
    let Some(b) = plan.output(name) else {
        let known: Vec<&str> = plan.outputs.iter().map(|b| b.name.as_str()).collect();
        return Err(RuntimeError::invalid(
            format!("plan {:?} has no output `{name}`", plan.name),
            format!("its outputs are {known:?}"),
        ));
    };
    let (device, offset) = io_slot(plan, b.value, name)?;
    Ok((b.value, device, offset))
}

/// (device, offset) of an input or output value in the io regions.
pub fn io_slot(plan: &Plan, value: usize, name: &str) -> Result<(usize, usize)> {
    match plan.buffers[plan.values[value].buffer].storage {
        kiln_compiler::plan::Storage::Io { device, offset } => Ok((device, offset)),
        _ => Err(RuntimeError::Invalid {
            what: format!("`{name}` of plan {:?} is not in the io region", plan.name),
            help: "plans from `compile` keep inputs and outputs there; recompile the plan".into(),
        }),
    }
}
