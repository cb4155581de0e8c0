//! `kiln train model.onnx`: an imported model trained as a layer (`OnnxLayer`) by the same
//! `Trainer`, autodiff and planner as a traced model, on random inputs and targets (or a batch
//! from a safetensors file), with the plan's memory report. The loss is the mean squared error
//! against targets of the output's shape and the optimizer Adam: what a fine-tuning step of the
//! model holds in memory, whatever head the user will put on it. Batch normalisation runs in
//! training mode where the file says so, dropout where the file has it. A model of several
//! inputs (a transformer's `input_ids`, `attention_mask`, `token_type_ids`) trains as one layer
//! whose input packs them (`OnnxModel::into_packed_layer`); random ids are drawn inside the
//! table each id input indexes, so that the step computes what real ids make it compute.
//!
//! Each function takes the model as a [`ModelSource`]: an [`OnnxModel`](super::OnnxModel) read
//! once (the CLI opens the file, so that its external data is read from the file's directory),
//! or the bytes of a model held in memory.

use super::ModelSource;
use crate::device::Device;
use crate::error::Result;
use crate::report::{PlanMemory, table};
use kiln_compiler::device::DeviceSpec;
use kiln_compiler::ir::{DType, Shape};
use kiln_compiler::step::{InputSpec, TrainConfig};
use kiln_runtime::{HostTensor, Trainer};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::path::Path;
use std::time::{Duration, Instant};

use super::bad_input as invalid;

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
        return Err(invalid("--batch 0", "use a batch size of at least 1"));
    }
    Ok(sizes)
}

/// One input of a model at given sizes: what a training batch holds for it, and what random
/// data draws for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInput {
    /// The graph input's name (`input_ids`, `attention_mask`, ...).
    pub name: String,
    /// Its shape at the sizes.
    pub shape: Shape,
    /// Its element type: f32 features, i32 or i64 ids, a bool mask.
    pub dtype: DType,
    /// For an integer input, the rows of the table it indexes (the first operand of the
    /// `Gather` it feeds, through casts and reshapes; the smallest where it feeds several):
    /// its ids must lie in [0, rows). `None` where no such table is found.
    pub table_rows: Option<usize>,
}

impl ModelInput {
    /// Whether random data fills the input with ones: a bool input, or an integer one that
    /// indexes no table and is named as a mask (`attention_mask`).
    pub fn is_mask(&self) -> bool {
        self.dtype == DType::Bool
            || (self.dtype.is_exact()
                && self.table_rows.is_none()
                && self.name.to_lowercase().contains("mask"))
    }
}

/// The model's inputs at `sizes`, in the file's order (initializers excluded), each with the
/// table its ids index where it has one.
pub fn inputs(model: &(impl ModelSource + ?Sized), sizes: &[(String, usize)]) -> Result<Vec<ModelInput>> {
    let model = model.model()?;
    let imported = model.import_for_training(sizes)?;
    Ok(model_inputs(&model, &imported))
}

fn model_inputs(model: &super::OnnxModel, imported: &super::Imported) -> Vec<ModelInput> {
    let g = &imported.graph;
    let proto = model.proto().graph.as_ref();
    imported
        .inputs
        .iter()
        .map(|(name, shape)| {
            let dtype = g.input(name).map_or(DType::F32, |n| g.node(n).dtype);
            let table_rows = if dtype.is_exact() { proto.and_then(|p| table_rows(p, name)) } else { None };
            ModelInput { name: name.clone(), shape: shape.clone(), dtype, table_rows }
        })
        .collect()
}

/// The rows of the tables value `input` indexes: the first operand of each `Gather` whose
/// indices it is, through ops that keep ids ids (casts, reshapes, slices); the smallest.
fn table_rows(graph: &super::proto::GraphProto, input: &str) -> Option<usize> {
    let mut names = vec![input.to_string()];
    let mut rows: Option<usize> = None;
    let mut i = 0;
    while let Some(v) = names.get(i).cloned() {
        i += 1;
        for n in &graph.node {
            let op = n.op_type.as_deref().unwrap_or("");
            let reads = |k: usize| n.input.get(k) == Some(&v);
            if op == "Gather" && reads(1) {
                let axis = n.attribute.iter().find(|a| a.name.as_deref() == Some("axis")).and_then(|a| a.i);
                let table = n.input.first().and_then(|t| stored_dims(graph, t, 0));
                let r = table.and_then(|dims| {
                    let axis = axis.unwrap_or(0);
                    let axis = if axis < 0 { axis + dims.len() as i64 } else { axis };
                    usize::try_from(*dims.get(usize::try_from(axis).ok()?)?).ok()
                });
                if let Some(r) = r {
                    rows = Some(rows.map_or(r, |m| m.min(r)));
                }
            } else if matches!(
                op,
                "Cast" | "Reshape" | "Unsqueeze" | "Squeeze" | "Flatten" | "Identity" | "Expand" | "Slice"
            ) && reads(0)
            {
                for o in &n.output {
                    if !names.contains(o) {
                        names.push(o.clone());
                    }
                }
            }
        }
    }
    rows
}

/// The dims of stored tensor `name`: an initializer, a `Constant`'s value, or either through
/// `Identity` / `Cast`.
fn stored_dims(graph: &super::proto::GraphProto, name: &str, depth: usize) -> Option<Vec<i64>> {
    if let Some(t) = graph.initializer.iter().find(|t| t.name.as_deref() == Some(name)) {
        return Some(t.dims.clone());
    }
    let n = graph.node.iter().find(|n| n.output.first().map(String::as_str) == Some(name))?;
    match n.op_type.as_deref()? {
        "Constant" => n
            .attribute
            .iter()
            .find(|a| a.name.as_deref() == Some("value"))?
            .t
            .as_ref()
            .map(|t| t.dims.clone()),
        "Identity" | "Cast" if depth < 16 => stored_dims(graph, n.input.first()?, depth + 1),
        _ => None,
    }
}

/// The input and output shapes of the model as a layer at `sizes`: x is what a training step of
/// it reads (the one input's shape, or, for a model of several inputs, the `[rows, columns]`
/// they are packed into: `OnnxModel::into_packed_layer`) and y what it is compared with.
pub fn shapes(model: &(impl ModelSource + ?Sized), sizes: &[(String, usize)]) -> Result<(Shape, Shape)> {
    let (x, y) = specs(model, sizes)?;
    Ok((x.shape, y))
}

/// [`shapes`], with the layer's input dtype: the one input's (f32, i32 or i64 ids, a bool
/// mask), or f32 for the packed input of several.
pub fn specs(model: &(impl ModelSource + ?Sized), sizes: &[(String, usize)]) -> Result<(InputSpec, Shape)> {
    let model = model.model()?;
    let imported = model.import_for_training(sizes)?;
    specs_of(&model_inputs(&model, &imported), &imported)
}

/// [`specs`] of an imported model whose inputs are `inputs`.
fn specs_of(inputs: &[ModelInput], imported: &super::Imported) -> Result<(InputSpec, Shape)> {
    let x = match inputs {
        [] => {
            return Err(invalid(
                "the model has no inputs",
                "a model trains as a layer of its inputs: export it with at least one",
            ));
        }
        [x] => InputSpec::new(x.shape.clone(), x.dtype),
        several => {
            let rows = several[0].shape.dims().first().copied().unwrap_or(1);
            let columns =
                several.iter().map(|i| i.shape.dims().iter().skip(1).product::<usize>()).sum::<usize>();
            InputSpec::new(Shape::new([rows, columns]), DType::F32)
        }
    };
    let g = &imported.graph;
    let y = match g.outputs() {
        [(_, y)] => g.node(*y).shape.clone(),
        outputs => {
            return Err(invalid(
                format!("the model has {} outputs", outputs.len()),
                "a model trains as a layer with one output",
            ));
        }
    };
    Ok((x, y))
}

/// One batch to train on: a tensor per model input, by the input's name (`x` stands for the
/// input of a model of one), and the targets `y`.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The inputs by name: f32 features, i32/i64 ids, bool masks (or f32 holding integers).
    pub inputs: Vec<(String, HostTensor)>,
    /// The targets, of the model's output's shape.
    pub y: HostTensor,
}

/// The batch in the safetensors or `.npz` file at `path`: `y` and one tensor per model input,
/// each F32 (or F16/BF16 in safetensors, read as f32), I32, I64 or BOOL. A safetensors file is checked as a checkpoint is
/// (`kiln_runtime::checkpoint::read`) before its integer tensors are read; an `.npz` (a zip
/// archive, `np.savez`) is read by `npz::read`. A tensor of another dtype, or no `y`, is an
/// error naming it.
pub fn read_data(path: &Path) -> Result<Batch> {
    let mut tensors = super::tensors::read(path)?;
    let y = tensors.remove("y").ok_or_else(|| {
        invalid(
            format!("{} holds no tensor `y`", path.display()),
            "store the targets as `y` beside one tensor per model input, named as the model's inputs",
        )
    })?;
    // Targets of ints (class ids) are compared as the f32 values they hold.
    let y = match y.dtype() {
        DType::F32 => y,
        _ => HostTensor::new(y.shape().clone(), y.data().to_vec())?,
    };
    Ok(Batch { inputs: tensors.into_iter().collect(), y })
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
    /// The shape of the layer's input fed every step: the model's one input, or the
    /// `[rows, columns]` its several inputs are packed into (`inputs` lists them).
    pub x: Shape,
    /// The shape of the model's one output (the targets' shape).
    pub y: Shape,
    /// The model's inputs, in the file's order.
    pub inputs: Vec<ModelInput>,
    /// The wall time of the training steps, compilation and weight loading excluded.
    pub elapsed: Duration,
    /// The packed inputs and the targets every step was fed (`step` feeds them again).
    fed: (HostTensor, HostTensor),
}

impl OnnxTraining {
    /// One more training step on the same batch; its loss (also appended to `losses`, its
    /// time to `elapsed`).
    pub fn step(&mut self) -> Result<f32> {
        let start = Instant::now();
        let loss = self.trainer.train_step(&self.fed.0, &self.fed.1)?.loss;
        self.elapsed += start.elapsed();
        self.losses.push(loss);
        Ok(loss)
    }
}

/// Trains `model` for `steps` steps of one batch each on `device`, on `data` or, without it,
/// on random data (seeded): f32 inputs uniform in [0, 1), ids uniform over the rows of the
/// table they index (0 or 1 where none is found), masks all ones ([`ModelInput::is_mask`]),
/// targets standard normal. A model of several inputs trains as the layer
/// `OnnxModel::into_packed_layer` makes. The file's weights are the starting point. Data of
/// other shapes than the model's at `sizes`, a missing or unknown input, or an id outside its
/// table is an error naming the input.
pub fn train(
    model: &(impl ModelSource + ?Sized),
    sizes: &[(String, usize)],
    steps: usize,
    device: &Device,
    data: Option<Batch>,
    each: impl FnMut(usize, f32),
) -> Result<OnnxTraining> {
    train_in(model, sizes, steps, device, data, kiln_compiler::Precision::F32, each)
}

/// `train` computing in `precision` (`kiln_compiler::autocast`: products in bf16 or f16,
/// master weights f32).
pub fn train_in(
    model: &(impl ModelSource + ?Sized),
    sizes: &[(String, usize)],
    steps: usize,
    device: &Device,
    data: Option<Batch>,
    precision: kiln_compiler::Precision,
    mut each: impl FnMut(usize, f32),
) -> Result<OnnxTraining> {
    let model = model.model()?;
    let imported = model.import_for_training(sizes)?;
    let inputs = model_inputs(&model, &imported);
    let (x_spec, y_shape) = specs_of(&inputs, &imported)?;
    drop(imported);
    let layer = model.into_owned().into_packed_layer(sizes)?;
    let weights = layer.weights.clone();
    let config = fine_tuning();
    let (feeds, y) = match data {
        Some(batch) => (checked_feeds(&inputs, batch.inputs)?, {
            if batch.y.shape() != &y_shape {
                return Err(invalid(
                    format!(
                        "the data's y is {}; the model at these sizes gives {}",
                        batch.y.shape(),
                        y_shape
                    ),
                    "size the model with --batch / --dim to the data, or give targets of the model's output shape",
                ));
            }
            batch.y
        }),
        None => {
            let mut rng = StdRng::seed_from_u64(1);
            let mut feeds = Vec::with_capacity(inputs.len());
            for input in &inputs {
                let shape = input.shape.clone();
                let t = if input.dtype == DType::F32 {
                    HostTensor::from_fn(shape, |_| rng.random::<f32>())?
                } else {
                    let n = shape.numel();
                    let values: Vec<i64> = if input.is_mask() {
                        vec![1; n]
                    } else {
                        let rows = input.table_rows.unwrap_or(2).max(1) as i64;
                        (0..n).map(|_| rng.random_range(0..rows)).collect()
                    };
                    match input.dtype {
                        DType::Bool => {
                            HostTensor::from_bool(shape, values.iter().map(|&v| v != 0).collect())?
                        }
                        DType::I32 => {
                            HostTensor::from_i32(shape, values.iter().map(|&v| v as i32).collect())?
                        }
                        _ => HostTensor::from_i64(shape, values)?,
                    }
                };
                feeds.push((input.name.clone(), t));
            }
            let y = HostTensor::from_fn(y_shape.clone(), |_| {
                // Box-Muller: standard normal targets.
                let (u, v) = (rng.random::<f32>().max(f32::MIN_POSITIVE), rng.random::<f32>());
                (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
            })?;
            (feeds, y)
        }
    };
    let named: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let x = layer.pack(&named)?;
    let mut trainer = Trainer::new(layer, config, device.backend(7)?).with_precision(precision);
    trainer.train_program(InputSpec::new(x.shape().clone(), x.dtype()), y.shape().clone())?;
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
    let elapsed = start.elapsed();
    Ok(OnnxTraining { losses, trainer, x: x_spec.shape, y: y_shape, inputs, elapsed, fed: (x, y) })
}

/// The data's inputs in the model's order, each checked: every input given (`x` for the one
/// input of a model of one), none unknown, each of the input's shape, ids inside their table,
/// masks 0 or 1.
fn checked_feeds(
    inputs: &[ModelInput],
    mut given: Vec<(String, HostTensor)>,
) -> Result<Vec<(String, HostTensor)>> {
    let names = || inputs.iter().map(|i| format!("`{}`", i.name)).collect::<Vec<_>>().join(", ");
    if let ([one], [(name, _)]) = (inputs, given.as_mut_slice())
        && name == "x"
    {
        *name = one.name.clone();
    }
    if let Some((unknown, _)) = given.iter().find(|(n, _)| !inputs.iter().any(|i| &i.name == n)) {
        return Err(invalid(
            format!("the data holds `{unknown}`, which is no input of the model (its inputs: {})", names()),
            "name each tensor as the model's input it feeds (`x` for a model of one input), and the targets `y`",
        ));
    }
    let mut feeds = Vec::with_capacity(inputs.len());
    for input in inputs {
        let Some(i) = given.iter().position(|(n, _)| n == &input.name) else {
            return Err(invalid(
                format!(
                    "the data holds no tensor for the model's input `{}` (its inputs: {})",
                    input.name,
                    names()
                ),
                "store one tensor per model input, named as the model names it, beside the targets `y`",
            ));
        };
        let (name, t) = given.swap_remove(i);
        if t.shape() != &input.shape {
            return Err(invalid(
                format!(
                    "the data's `{name}` is {}; the model at these sizes takes {}",
                    t.shape(),
                    input.shape
                ),
                "size the model with --batch / --dim to the data, or give data of the model's shapes",
            ));
        }
        let range = match input.dtype {
            DType::Bool => Some((2, "a mask holds 0 or 1".to_string())),
            // ONNX's Gather counts a negative id from the table's end.
            d if d.is_exact() => input
                .table_rows
                .map(|r| (r, format!("it indexes a table of {r} rows: ids lie in [-{r}, {r})"))),
            _ => None,
        };
        if let Some((rows, why)) = range {
            let low = if input.dtype == DType::Bool { 0 } else { -(rows as i64) };
            let bad = match t.ints() {
                Some(ints) => {
                    ints.iter().position(|&v| v < low || v >= rows as i64).map(|p| (p, ints[p] as f64))
                }
                None => t
                    .data()
                    .iter()
                    .position(|&v| v.fract() != 0.0 || v < low as f32 || v >= rows as f32)
                    .map(|p| (p, t.data()[p] as f64)),
            };
            if let Some((at, v)) = bad {
                return Err(invalid(
                    format!("the data's input `{name}` holds {v} at element {at}: {why}"),
                    "give ids the model's tables hold (its vocabulary), masks of 0 and 1",
                ));
            }
        }
        feeds.push((name, t));
    }
    Ok(feeds)
}

/// The run's summary: steps, time, the backend's report and the plans' memory table.
pub fn summary(run: &OnnxTraining) -> String {
    let x = match run.inputs.as_slice() {
        [_] | [] => format!("x {}", run.x),
        several => several
            .iter()
            .map(|i| format!("{} {}{}", i.name, i.dtype, i.shape))
            .collect::<Vec<_>>()
            .join(", "),
    };
    let mut s = format!(
        "trained {} steps ({x}, y {}) in {:.2} s (compile {:.2} s) on {}\n",
        run.losses.len(),
        run.y,
        run.elapsed.as_secs_f64(),
        run.trainer.compile_time().as_secs_f64(),
        run.trainer.backend().describe()
    );
    if let Some(r) = run.trainer.backend().report() {
        s.push_str(&format!("{r}\n"));
    }
    if let Ok(Some((scale, good))) = run.trainer.loss_scale() {
        s.push_str(&format!(
            "f16 loss scale {scale} ({good} finite steps since it last changed; a step whose gradients overflow is skipped and halves it)\n"
        ));
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
        return Err(invalid("no --device given", "give devices as --device gpu:0=24GB"));
    };
    let model = model.model()?;
    let (x, y) = specs(&*model, sizes)?;
    let layer = model.into_owned().into_packed_layer(sizes)?;
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
