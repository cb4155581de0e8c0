//! Running an ONNX model on given inputs, as `kiln run` does: a [`Runner`] imports the model
//! once (its symbolic dimensions sized), compiles its forward pass, loads the plan on a device
//! with every weight of the file written, and then runs it on named inputs as often as asked.
//!
//! ```no_run
//! use kiln::onnx::runner::{Runner, RunnerOptions};
//! use kiln::prelude::*;
//!
//! let mut runner = Runner::open("resnet18.onnx", &RunnerOptions::default().batch(2))?;
//! let x = HostTensor::zeros(runner.inputs()[0].shape.clone())?;
//! let outputs = runner.run(&[("input", &x)])?;
//! println!("{}: {}", outputs[0].0, outputs[0].1.shape());
//! # Ok::<(), kiln::Error>(())
//! ```
//!
//! Each input is checked against the model's declared name, shape and type before anything
//! runs, and an error names the input, both shapes or types, and what to do. Ids and masks
//! convert between int32, int64 and bool as the model declares them (an int64 id that does not
//! fit an int32 input is an error); integers fed to a float input become their f32 values; a
//! float fed to an id input is refused (it would have to be truncated).
//!
//! The CPU's kernels run on rayon's global pool: `RAYON_NUM_THREADS`, or `kiln run --threads`,
//! which builds that pool before the runner is made.

use super::{OnnxModel, train};
use crate::device::Device;
use crate::error::Result;
use kiln_compiler::ir::{DType, Op, Shape};
use kiln_compiler::{CompileOptions, Precision};
use kiln_runtime::{Backend, HostTensor, ProgramId, StepTime};
use std::borrow::Cow;
use std::path::Path;

use super::bad_input as invalid;

/// How a [`Runner`] sizes, compiles and places the model.
#[derive(Clone, Debug)]
pub struct RunnerOptions {
    /// Every input's first axis (a symbolic one by its name, a static one re-batched): the
    /// file's own batch where `None`.
    pub batch: Option<usize>,
    /// Sizes of named symbolic dimensions (`NAME=N`, as `kiln run --dim` takes them).
    pub dims: Vec<String>,
    /// Where the model runs.
    pub device: Device,
    /// The precision the forward pass computes in (`--precision`).
    pub precision: Precision,
    /// How the forward pass is compiled; the device's scratch rule and half kernels are set
    /// from its backend.
    pub compile: CompileOptions,
}

impl Default for RunnerOptions {
    /// The file's batch, on the CPU, in f32, with the default compile options.
    fn default() -> Self {
        RunnerOptions {
            batch: None,
            dims: Vec::new(),
            device: Device::cpu(),
            precision: Precision::F32,
            compile: CompileOptions::default(),
        }
    }
}

impl RunnerOptions {
    /// Every input's first axis set to `batch`.
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = Some(batch);
        self
    }

    /// The model runs on `device`.
    pub fn device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
}

/// One input the model takes: its name, its shape once sized, and its element type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInput {
    /// The graph input's name in the file.
    pub name: String,
    /// Its shape, symbolic dimensions sized.
    pub shape: Shape,
    /// Its element type (f32 for a float input, including an f16 or bf16 one, which the
    /// import rounds from f32).
    pub dtype: DType,
}

/// An ONNX model loaded on a device, ready to run on named inputs.
pub struct Runner {
    backend: Box<dyn Backend>,
    program: ProgramId,
    inputs: Vec<ModelInput>,
    outputs: Vec<String>,
    device: Device,
}

impl Runner {
    /// Opens the model at `path` (its external data read from the file's directory) and loads
    /// it as `options` says.
    pub fn open(path: impl AsRef<Path>, options: &RunnerOptions) -> Result<Runner> {
        Runner::new(&OnnxModel::open(path)?, options)
    }

    /// Imports `model` sized as `options` says, compiles its forward pass for the device's
    /// backend and loads it there with every weight of the file.
    pub fn new(model: &OnnxModel, options: &RunnerOptions) -> Result<Runner> {
        let sizes = train::sizes(model, options.batch, &options.dims)?;
        let mut imported = model.import(&sizes)?;
        kiln_compiler::step::prepare_forward(&mut imported.graph, options.precision)?;
        let graph = &imported.graph;
        let inputs = graph
            .inputs()
            .into_iter()
            .filter_map(|n| match &graph.node(n).op {
                Op::Input { name, shape, dtype } => {
                    Some(ModelInput { name: name.clone(), shape: shape.clone(), dtype: *dtype })
                }
                _ => None,
            })
            .collect();
        let outputs = graph.outputs().iter().map(|(name, _)| name.clone()).collect();
        let mut backend = options.device.backend(0)?;
        let compile = options
            .compile
            .clone()
            .with_scratch(backend.scratch_rule())
            .with_half_kernels(backend.half_kernels());
        let program = imported.load(backend.as_mut(), &compile)?;
        Ok(Runner { backend, program, inputs, outputs, device: options.device.clone() })
    }

    /// The inputs the model takes, in the file's order.
    pub fn inputs(&self) -> &[ModelInput] {
        &self.inputs
    }

    /// The outputs' names, in the file's order.
    pub fn outputs(&self) -> &[String] {
        &self.outputs
    }

    /// The device the model runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The backend's description of itself ("cpu (2 threads)").
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// Runs the model on `feeds` (every input by name, each once) and returns every output by
    /// name, in the file's order. Each feed is checked, and converted where the module docs
    /// say, before anything runs.
    pub fn run(&mut self, feeds: &[(&str, &HostTensor)]) -> Result<Vec<(String, HostTensor)>> {
        let fed = self.conform(feeds)?;
        let fed: Vec<(&str, &HostTensor)> = fed.iter().map(|(n, t)| (*n, t.as_ref())).collect();
        let mut out = self.backend.call(self.program, &fed)?;
        let order = |name: &str| self.outputs.iter().position(|o| o == name).unwrap_or(usize::MAX);
        out.sort_by_key(|(name, _)| order(name));
        Ok(out)
    }

    /// Runs the model `runs` times on `feeds` (as `run` takes them) with each kernel timed on
    /// its own (`Backend::profile_run`): one row per kernel in launch order, holding its median
    /// milliseconds over the runs.
    pub fn profile(&mut self, feeds: &[(&str, &HostTensor)], runs: usize) -> Result<Vec<StepTime>> {
        let fed = self.conform(feeds)?;
        let mut rows: Vec<StepTime> = Vec::new();
        let mut times: Vec<Vec<f64>> = Vec::new();
        for _ in 0..runs.max(1) {
            for (name, t) in &fed {
                self.backend.set_input_tensor(self.program, name, t)?;
            }
            let run = self.backend.profile_run(self.program)?;
            times.resize_with(run.len(), Vec::new);
            for (i, row) in run.iter().enumerate() {
                times[i].push(row.ms);
            }
            rows = run;
        }
        for (row, mut t) in rows.iter_mut().zip(times) {
            t.sort_by(f64::total_cmp);
            row.ms = t[t.len() / 2];
        }
        Ok(rows)
    }

    /// `feeds` checked as `run` checks them and converted to the model's types once, in the
    /// model's order: what a loop of runs (`kiln run --bench`) feeds, so that no run converts.
    pub fn prepare(&self, feeds: &[(&str, &HostTensor)]) -> Result<Vec<(String, HostTensor)>> {
        Ok(self.conform(feeds)?.into_iter().map(|(n, t)| (n.to_string(), t.into_owned())).collect())
    }

    /// Inputs for a run without data (`kiln run` without `--input`): floats uniform in [0, 1)
    /// from `seed`, ids 0 (valid for any table), masks true.
    pub fn random_inputs(&self, seed: u64) -> Result<Vec<(String, HostTensor)>> {
        let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(seed);
        let mut random = |i: &ModelInput| crate::compare::random_input(&i.shape, i.dtype, &mut rng);
        self.inputs.iter().map(|i| Ok((i.name.clone(), random(i)?))).collect()
    }

    /// `feeds` checked against the model's inputs, in its order, converted to its types.
    fn conform<'a>(
        &self,
        feeds: &[(&'a str, &'a HostTensor)],
    ) -> Result<Vec<(&'a str, Cow<'a, HostTensor>)>> {
        let names = || {
            self.inputs.iter().map(|i| format!("`{}` {} {}", i.name, i.dtype, i.shape)).collect::<Vec<_>>()
        };
        if let Some((name, _)) = feeds.iter().find(|(n, _)| !self.inputs.iter().any(|i| i.name == *n)) {
            return Err(invalid(
                format!("the model has no input `{name}`"),
                format!("feed its inputs by name: {}", names().join(", ")),
            ));
        }
        let mut out = Vec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            let mut matching = feeds.iter().filter(|(n, _)| *n == input.name);
            let (Some(&(name, t)), None) = (matching.next(), matching.next()) else {
                let fed = feeds.iter().filter(|(n, _)| *n == input.name).count();
                let what = if fed == 0 { "is not fed".to_string() } else { format!("is fed {fed} times") };
                return Err(invalid(
                    format!("input `{}` {what}", input.name),
                    format!(
                        "feed every input once, by name (`kiln run`: in the --input files, or no --input for random ones): {}",
                        names().join(", ")
                    ),
                ));
            };
            if t.shape() != &input.shape {
                return Err(invalid(
                    format!("input `{name}` is {} but the model takes {}", t.shape(), input.shape),
                    "feed the model's shape, or size the model to the data (`--batch N`, `--dim NAME=N`)",
                ));
            }
            out.push((name, conformed(input, t)?));
        }
        Ok(out)
    }
}

/// `t` as the element type `input` takes (module docs).
fn conformed<'a>(input: &ModelInput, t: &'a HostTensor) -> Result<Cow<'a, HostTensor>> {
    let (from, to) = (t.dtype(), input.dtype);
    if from == to {
        return Ok(Cow::Borrowed(t));
    }
    let shape = t.shape().clone();
    let refused = |why: &str| {
        Err(invalid(
            format!("input `{}` holds {from} values but the model takes {to}: {why}", input.name),
            format!("store `{}` as {to}", input.name),
        ))
    };
    match (t.ints(), to) {
        (Some(_), DType::F32) => Ok(Cow::Owned(HostTensor::new(shape, t.data().to_vec())?)),
        (Some(ints), DType::I64) => Ok(Cow::Owned(HostTensor::from_i64(shape, ints.to_vec())?)),
        (Some(ints), DType::I32) => {
            match ints.iter().map(|&v| i32::try_from(v)).collect::<Result<Vec<_>, _>>() {
                Ok(v) => Ok(Cow::Owned(HostTensor::from_i32(shape, v)?)),
                Err(_) => refused("a value does not fit an int32"),
            }
        }
        (Some(ints), DType::Bool) => {
            Ok(Cow::Owned(HostTensor::from_bool(shape, ints.iter().map(|&v| v != 0).collect())?))
        }
        _ => refused("a float would have to be truncated"),
    }
}
