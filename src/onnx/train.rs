//! `kiln train model.onnx`: an imported model trained as a layer (`OnnxLayer`) by the same
//! `Trainer`, autodiff and planner as a traced model, on random inputs and targets (or a batch
//! from a safetensors file), with the plan's memory report. The loss is the mean squared error
//! against targets of the output's shape and the optimizer Adam: what a fine-tuning step of the
//! model holds in memory, whatever head the user will put on it. Batch normalisation runs in
//! training mode where the file says so, dropout where the file has it.
//!
//! Each function takes the model as a [`ModelSource`]: an [`OnnxModel`](super::OnnxModel) read
//! once (the CLI opens the file, so that its external data is read from the file's directory),
//! or the bytes of a model held in memory.

use super::ModelSource;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::report::{PlanMemory, table};
use kiln_compiler::device::DeviceSpec;
use kiln_compiler::ir::{DType, Shape};
use kiln_compiler::step::TrainConfig;
use kiln_runtime::{HostTensor, Trainer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::time::{Duration, Instant};

fn invalid(what: String, help: &str) -> Error {
    Error::Runtime(kiln_runtime::RuntimeError::invalid(what, help))
}

/// Symbolic sizes from `--batch N` (every input's first axis: a symbolic one by its name, a
/// static one re-batched, `onnx::STATIC_BATCH`) and `--dim NAME=N`. A batch that cannot apply
/// (the file's inputs have a fixed batch other than 1, and not N) is an error saying so; so are
/// the flags [`flags`] refuses, before the model is read.
pub fn sizes(
    model: &(impl ModelSource + ?Sized),
    batch: Option<usize>,
    dims: &[String],
) -> Result<Vec<(String, usize)>> {
    let mut sizes = flags(batch, dims)?;
    if let Some(b) = batch {
        // A batch no input can take (every first axis a fixed size other than 1) is an error,
        // not a plan of the file's own batch under the requested one's name.
        let model = model.model()?;
        super::check_batch(model.proto(), b)?;
        sizes.extend(model.batch_dims().into_iter().map(|n| (n, b)));
        // A model exported with a fixed batch is re-batched.
        sizes.push((super::STATIC_BATCH.to_string(), b));
    }
    Ok(sizes)
}

/// The sizes `--dim NAME=N` gives, once `--batch` and `--dim` are checked without the model: a
/// batch of 0 or a `--dim` other than NAME=N (N at least 1) is an error. What [`sizes`] starts
/// from; the CLI calls it first, so that a mistyped flag is named before the file is read.
pub fn flags(batch: Option<usize>, dims: &[String]) -> Result<Vec<(String, usize)>> {
    let mut sizes: Vec<(String, usize)> = Vec::new();
    for d in dims {
        let parsed = d.split_once('=').and_then(|(n, v)| Some((n.to_string(), v.parse::<usize>().ok()?)));
        match parsed {
            Some((n, v)) if v > 0 => sizes.push((n, v)),
            _ => return Err(invalid(format!("--dim {d}"), "write NAME=N with N at least 1")),
        }
    }
    if batch == Some(0) {
        return Err(invalid("--batch 0".into(), "use a batch size of at least 1"));
    }
    Ok(sizes)
}

/// The model's input and output shapes at `sizes`: what a training step of it as a layer
/// reads (x) and is compared with (y). A model whose input is not a float tensor is refused
/// (ids need data of their own, not random floats).
pub fn shapes(model: &(impl ModelSource + ?Sized), sizes: &[(String, usize)]) -> Result<(Shape, Shape)> {
    let imported = model.model()?.import(sizes)?;
    let g = &imported.graph;
    let x = match g.inputs().as_slice() {
        [x] if g.node(*x).dtype == DType::F32 => g.node(*x).shape.clone(),
        [x] => {
            return Err(invalid(
                format!("the model's input is {:?}, not f32", g.node(*x).dtype),
                "train a model of integer inputs from its own data with the API (`OnnxLayer` and `Trainer`)",
            ));
        }
        inputs => {
            return Err(invalid(
                format!("the model has {} inputs", inputs.len()),
                "a model trains as a layer with one input and one output",
            ));
        }
    };
    let y = match g.outputs() {
        [(_, y)] => g.node(*y).shape.clone(),
        outputs => {
            return Err(invalid(
                format!("the model has {} outputs", outputs.len()),
                "a model trains as a layer with one input and one output",
            ));
        }
    };
    Ok((x, y))
}

/// The training step an imported model is planned and trained with: the mean squared error
/// against targets of its output's shape, Adam 1e-3 (what a fine-tuning step holds in memory,
/// whatever head the user will put on it).
pub fn fine_tuning() -> TrainConfig {
    TrainConfig {
        loss: kiln_compiler::losses::Loss::MeanSquaredError,
        optimizer: kiln_compiler::optim::Adam::new(1e-3).into(),
        metrics: vec![],
    }
}

/// A finished run: the losses of every step and the trainer (plans, backend, memory).
pub struct OnnxTraining {
    /// The loss of each training step, in step order.
    pub losses: Vec<f32>,
    /// The trainer after the last step: its plans, its backend (with the trained weights) and
    /// its compile time.
    pub trainer: Trainer,
    /// The shape of the model's one input (the batch fed every step).
    pub x: Shape,
    /// The shape of the model's one output (the targets' shape).
    pub y: Shape,
    /// The wall time of the training steps, compilation and weight loading excluded.
    pub elapsed: Duration,
}

/// Trains `model` for `steps` steps of one batch each on `device`: inputs uniform
/// in [0, 1) and targets standard normal (seeded), or `data` (x, y) when given. The file's
/// weights are the starting point.
pub fn train(
    model: &(impl ModelSource + ?Sized),
    sizes: &[(String, usize)],
    steps: usize,
    device: &Device,
    data: Option<(HostTensor, HostTensor)>,
    mut each: impl FnMut(usize, f32),
) -> Result<OnnxTraining> {
    let model = model.model()?;
    let (x_shape, y_shape) = shapes(&*model, sizes)?;
    let layer = model.into_owned().into_layer()?;
    let weights = layer.weights.clone();
    let config = fine_tuning();
    let (x, y) = match data {
        Some((x, y)) => {
            if x.shape() != &x_shape || y.shape() != &y_shape {
                return Err(invalid(
                    format!(
                        "the data holds x {} and y {}; the model at these sizes takes {} and gives {}",
                        x.shape(),
                        y.shape(),
                        x_shape,
                        y_shape
                    ),
                    "size the model with --batch / --dim to the data, or give data of the model's shapes",
                ));
            }
            (x, y)
        }
        None => {
            let mut rng = StdRng::seed_from_u64(1);
            let x = HostTensor::from_fn(x_shape.clone(), |_| rng.random::<f32>())?;
            let y = HostTensor::from_fn(y_shape.clone(), |_| {
                // Box-Muller: standard normal targets.
                let (u, v) = (rng.random::<f32>().max(f32::MIN_POSITIVE), rng.random::<f32>());
                (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
            })?;
            (x, y)
        }
    };
    let mut trainer = Trainer::new(layer, config, device.backend(7)?);
    trainer.train_program(x.shape().clone(), y.shape().clone())?;
    // The file's values of the constants the step reads as parameters (a constant only folded
    // into an attribute, or read by nothing, is no variable).
    let declared: std::collections::HashSet<String> =
        trainer.plans().iter().flat_map(|p| p.variables.iter().map(|v| v.key.clone())).collect();
    for (key, value) in weights.iter().filter(|(k, _)| declared.contains(k)) {
        trainer.backend_mut().write_variable(key, value)?;
    }
    let start = Instant::now();
    let mut losses = Vec::with_capacity(steps);
    for i in 0..steps {
        let loss = trainer.train_step(&x, &y)?.loss;
        each(i, loss);
        losses.push(loss);
    }
    Ok(OnnxTraining { losses, trainer, x: x_shape, y: y_shape, elapsed: start.elapsed() })
}

/// The run's summary: steps, time, the backend's report and the plans' memory table.
pub fn summary(run: &OnnxTraining) -> String {
    let mut s = format!(
        "trained {} steps (x {}, y {}) in {:.2} s (compile {:.2} s) on {}\n",
        run.losses.len(),
        run.x,
        run.y,
        run.elapsed.as_secs_f64(),
        run.trainer.compile_time().as_secs_f64(),
        run.trainer.backend().describe()
    );
    if let Some(r) = run.trainer.backend().report() {
        s.push_str(&format!("{r}\n"));
    }
    let rows: Vec<PlanMemory> = run.trainer.plans().into_iter().map(PlanMemory::of).collect();
    s.push_str(&format!("\nmemory report (bytes)\n{}", table(&rows)));
    s
}

/// Whether a model's step fits devices of given sizes (`kiln memory model.onnx --device
/// gpu:0=24GB --device gpu:1=12GB`): on the first device alone (recomputing values if its limit
/// asks for it, `remat`), or else split over the devices in order, each taking a contiguous
/// range of the file's nodes (`placement::split_units` over `OnnxLayer::placed`: the placement
/// `split_sequential` gives a `Sequential`, applied to the imported graph). Every figure is from a
/// plan compiled under the devices' limits.
// The closures return the compiler's own error (`split_units` takes it as it is), which is large.
#[allow(clippy::result_large_err)]
pub fn fit(
    model: &(impl ModelSource + ?Sized),
    sizes: &[(String, usize)],
    train: bool,
    devices: &[DeviceSpec],
) -> Result<String> {
    use kiln_compiler::device::human_bytes;
    use kiln_compiler::{CompileError, CompileOptions, compile};
    let Some(first) = devices.first() else {
        return Err(invalid("no --device given".into(), "give devices as --device gpu:0=24GB"));
    };
    let model = model.model()?;
    let (x, y) = shapes(&*model, sizes)?;
    let layer = model.into_owned().into_layer()?;
    let config = fine_tuning();
    let graph_of = |model: &dyn kiln_compiler::nn::Layer| {
        if train {
            kiln_compiler::step::train_step_graph(model, x.clone(), y.clone(), &config)
        } else {
            kiln_compiler::step::forward_graph(model, x.clone())
        }
    };
    let what = if train { "training step" } else { "forward pass" };
    let limit = |d: &DeviceSpec| d.memory_limit.map_or("no limit".into(), human_bytes);
    let mut out = String::new();
    let alone = CompileOptions { devices: vec![first.clone()], ..CompileOptions::default() };
    match compile(graph_of(&layer)?, &alone) {
        Ok(plan) => {
            let m = &plan.memory;
            out.push_str(&format!(
                "the {what} fits on {}: it needs {} of {} (persistent {}, arena {})\n",
                first.name,
                human_bytes(m.held_bytes()),
                limit(first),
                human_bytes(m.persistent_bytes),
                human_bytes(m.arena_bytes)
            ));
            if let Some(r) = &m.remat {
                out.push_str(&format!(
                    "  by recomputing {} values ({} ops more a step) instead of keeping them\n",
                    r.recomputed.len(),
                    r.recomputed_ops
                ));
            }
            return Ok(out);
        }
        Err(CompileError::OutOfMemory(oom)) => {
            out.push_str(&format!("the {what} does not fit on {} alone:\n{oom}\n", first.name));
        }
        Err(e) => return Err(e.into()),
    }
    if devices.len() < 2 {
        out.push_str("give more devices (--device NAME=SIZE, in order) to split the model over them\n");
        return Ok(out);
    }
    let alignment = CompileOptions::default().alignment;
    match kiln_compiler::placement::split_units(
        "kiln memory --device",
        "nodes",
        layer.nodes(),
        devices,
        alignment,
        |ranges| graph_of(&layer.placed(ranges)),
        |r| layer.describe_nodes(r),
    ) {
        Ok(split) => {
            let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
            out.push_str(&format!(
                "split over {} (contiguous ranges of the file's nodes, copies between devices planned):\n{}",
                names.join(", "),
                split.describe()
            ));
        }
        Err(e) => out.push_str(&format!("{e}\n")),
    }
    Ok(out)
}
