//! Keras-like training over compiled plans.
//!
//! A `Trainer` holds a model, its loss, metrics and optimizer, and a backend. Each distinct input
//! shape gets its own plan, compiled on first use and cached — as `tf.function` retraces per
//! input signature — so a last batch of 8 rows after batches of 32 compiles a second plan that
//! shares every variable with the first.

use crate::backend::{Backend, ProgramId};
use crate::checkpoint;
use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_compiler::ir::{DType, Shape, Shard, VarRole};
use kiln_compiler::nn::Layer;
use kiln_compiler::step::{
    InputSpec, TrainConfig, evaluate_graph_with, forward_graph_with, train_step_graph_with,
};
use kiln_compiler::zero::ZeroStage;
use kiln_compiler::{CompileOptions, Plan, compile};
use rand::SeedableRng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::{Duration, Instant};

/// How [`Trainer::fit`] walks the data.
#[derive(Clone, Debug)]
pub struct FitOptions {
    /// Passes over the whole data (0 trains nothing).
    pub epochs: usize,
    /// Rows per optimizer step (over all ranks of a data-parallel run); must be positive. The
    /// last batch of an epoch holds the remaining rows.
    pub batch_size: usize,
    /// Shuffle the rows every epoch (Keras's default).
    pub shuffle: bool,
    /// Seed of the shuffle's random order (the same seed gives the same batches).
    pub seed: u64,
    /// Progress bar and one line per epoch on stderr.
    pub verbose: bool,
    /// Stop with an error as soon as a batch's loss is NaN or infinite, naming the epoch and
    /// the batch (Keras's `TerminateOnNaN` callback). Off by default, as in Keras: `fit` then
    /// trains on and the epoch's loss reads NaN.
    pub stop_on_non_finite: bool,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            epochs: 1,
            batch_size: 32,
            shuffle: true,
            seed: 0,
            verbose: true,
            stop_on_non_finite: false,
        }
    }
}

/// Loss and metrics of one step, or averaged over an epoch (weighted by batch rows, as Keras).
#[derive(Clone, Debug, PartialEq)]
pub struct Logs {
    /// The loss's value.
    pub loss: f32,
    /// Each metric's name and value, in the order of the training configuration's metrics.
    pub metrics: Vec<(String, f32)>,
}

impl Logs {
    /// The value of the metric called `name`, if it was computed.
    pub fn metric(&self, name: &str) -> Option<f32> {
        self.metrics.iter().find(|(n, _)| n == name).map(|(_, v)| *v)
    }
}

/// Logs summed with row weights, averaged over the rows at the end: an epoch's figures in
/// `fit`, a dataset's in `evaluate` (Keras weights each batch by its rows).
#[derive(Default)]
struct RowWeighted {
    sums: Option<Logs>,
    rows: usize,
}

impl RowWeighted {
    fn add(&mut self, logs: &Logs, rows: usize) {
        let w = rows as f32;
        self.rows += rows;
        match &mut self.sums {
            None => {
                self.sums = Some(Logs {
                    loss: logs.loss * w,
                    metrics: logs.metrics.iter().map(|(n, v)| (n.clone(), v * w)).collect(),
                })
            }
            Some(s) => {
                s.loss += logs.loss * w;
                for (acc, (_, v)) in s.metrics.iter_mut().zip(&logs.metrics) {
                    acc.1 += v * w;
                }
            }
        }
    }

    fn mean(self) -> Logs {
        let mut logs = self.sums.unwrap_or(Logs { loss: 0.0, metrics: vec![] });
        let rows = self.rows.max(1) as f32;
        logs.loss /= rows;
        for m in &mut logs.metrics {
            m.1 /= rows;
        }
        logs
    }
}

/// What [`Trainer::fit`] returns, as Keras's `History`.
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Each epoch's loss and metrics, averaged over its rows, in epoch order.
    pub epochs: Vec<Logs>,
}

/// A model, its loss, metrics and optimizer, and the backend that runs them: `fit`, `evaluate`,
/// `predict` and `train_step` over plans compiled per input shape on first use and cached.
pub struct Trainer {
    model: Box<dyn Layer>,
    config: TrainConfig,
    backend: Box<dyn Backend>,
    options: CompileOptions,
    train_programs: HashMap<(InputSpec, InputSpec), ProgramId>,
    predict_programs: HashMap<InputSpec, ProgramId>,
    evaluate_programs: HashMap<(InputSpec, InputSpec), ProgramId>,
    compile_time: Duration,
    /// How much of a data-parallel step's state is sharded (`kiln_compiler::zero`).
    zero: ZeroStage,
    /// Blocks of batch rows each training step is computed in (`with_row_blocks`).
    row_blocks: usize,
    /// The gradient bucket cap of a data-parallel step (`with_bucket_bytes`).
    bucket_bytes: usize,
}

impl Trainer {
    /// A trainer of `model` with the loss, metrics and optimizer of `config`, running on
    /// `backend`. Plans are compiled with default options and the backend's scratch rule
    /// (change them with `with_options`); nothing is compiled until first use.
    pub fn new(model: impl Layer + 'static, config: TrainConfig, backend: Box<dyn Backend>) -> Self {
        let scratch = backend.scratch_rule();
        let half = backend.half_kernels();
        Trainer {
            model: Box::new(model),
            config,
            backend,
            options: CompileOptions::default().with_scratch(scratch).with_half_kernels(half),
            train_programs: HashMap::new(),
            predict_programs: HashMap::new(),
            evaluate_programs: HashMap::new(),
            compile_time: Duration::ZERO,
            zero: ZeroStage::Off,
            row_blocks: 1,
            bucket_bytes: kiln_compiler::data_parallel::BUCKET_BYTES,
        }
    }

    /// Computes each training step in `blocks` blocks of batch rows
    /// (`kiln_compiler::step::train_step_graph_in_blocks`: gradient accumulation over
    /// micro-batches, planned as one step; a batch of fewer rows than `blocks` in one block per
    /// row). The losses and weights are the whole step's within float rounding; the arena holds
    /// one block's activations. 1 (the default): the whole batch at once.
    pub fn with_row_blocks(mut self, blocks: usize) -> Self {
        self.row_blocks = blocks.max(1);
        self
    }

    /// On a backend that is a rank of a data-parallel run, shards the optimizer state (stage 1)
    /// and the reduced gradients too (stage 2) over the ranks (`kiln_compiler::zero`): each rank
    /// keeps and updates its shard, then the ranks gather the weights. One rank alone trains as
    /// without it. `save` gathers the shards into one whole checkpoint (see `save`).
    pub fn with_zero_stage(mut self, stage: ZeroStage) -> Self {
        self.zero = stage;
        self
    }

    /// On a backend that is a rank of a data-parallel run (ZeRO off), reduces the gradients in
    /// buckets of at most `bytes` (`kiln_compiler::data_parallel::all_reduce_gradients_in_buckets`:
    /// one collective per bucket, each bucket one buffer of the arena); 0 reduces each gradient
    /// by its own collective. The default is `BUCKET_BYTES`, 1 MiB. The weights are the same
    /// bits at any size.
    pub fn with_bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// How much of a data-parallel step's state is sharded over the ranks (`with_zero_stage`).
    pub fn zero_stage(&self) -> ZeroStage {
        self.zero
    }

    /// Compiles with these options: the devices (with their memory limits) plans may use, the
    /// precision (`CompileOptions::precision`: bf16 or f16 mixed precision, master weights f32).
    /// Options without a scratch rule get the backend's (`Backend::scratch_rule`); plans read
    /// half values only where the backend's kernels do (`Backend::half_kernels`).
    /// A precision set before (`with_precision`) stays where `options` leave f32, the default.
    pub fn with_options(mut self, options: CompileOptions) -> Self {
        let scratch = options.scratch.or(self.backend.scratch_rule());
        let half = options.half_kernels & self.backend.half_kernels();
        let precision = if options.precision == kiln_compiler::Precision::F32 {
            self.options.precision
        } else {
            options.precision
        };
        self.options = options.with_scratch(scratch).with_half_kernels(half).with_precision(precision);
        self
    }

    /// Computes in `precision` (`CompileOptions::precision`): programs compiled from now on.
    pub fn with_precision(mut self, precision: kiln_compiler::Precision) -> Self {
        self.options.precision = precision;
        self
    }

    /// The options plans are compiled with.
    pub fn options(&self) -> &CompileOptions {
        &self.options
    }

    /// The backend that holds the variables and runs the plans.
    pub fn backend(&self) -> &dyn Backend {
        self.backend.as_ref()
    }

    /// The backend, mutably (e.g. to read or write variables, or to run a loaded program).
    pub fn backend_mut(&mut self) -> &mut dyn Backend {
        self.backend.as_mut()
    }

    /// Time spent tracing, differentiating and planning so far.
    pub fn compile_time(&self) -> Duration {
        self.compile_time
    }

    /// Every plan compiled so far: training steps first, then inference, then evaluation, each in
    /// order of first use.
    pub fn plans(&self) -> Vec<&Plan> {
        let mut ids: Vec<ProgramId> = self.train_programs.values().copied().collect();
        ids.sort_unstable();
        let predict: Vec<ProgramId> = self.predict_programs.values().copied().collect();
        let evaluate: Vec<ProgramId> = self.evaluate_programs.values().copied().collect();
        for mut more in [predict, evaluate] {
            more.sort_unstable();
            ids.extend(more);
        }
        ids.into_iter().filter_map(|id| self.backend.plan(id).ok()).collect()
    }

    /// The variables every loaded plan declares (parameters, optimizer state, counters), by key;
    /// not the constants folded at compile time, which the plans carry.
    fn variables(&self) -> BTreeMap<String, Shape> {
        self.variable_roles().into_iter().map(|(k, (shape, _))| (k, shape)).collect()
    }

    /// `variables`, each with its role.
    fn variable_roles(&self) -> BTreeMap<String, (Shape, VarRole)> {
        self.plans()
            .into_iter()
            .flat_map(|p| p.variables.iter())
            .filter(|v| v.role != VarRole::Constant)
            .map(|v| (v.key.clone(), (v.shape.clone(), v.role)))
            .collect()
    }

    /// The f16 step's dynamic loss scale as it stands, and the finite steps counted since it last
    /// changed (`kiln_compiler::loss_scale`); None where the plans have none (f32 and bf16
    /// steps, or before the first plan).
    pub fn loss_scale(&self) -> Result<Option<(f32, u32)>> {
        use kiln_compiler::loss_scale::{GOOD_STEPS_KEY, SCALE_KEY};
        if !self.variables().contains_key(SCALE_KEY) {
            return Ok(None);
        }
        let one = |key: &str| -> Result<f32> {
            Ok(self.backend.read_variable(key)?.data().first().copied().unwrap_or(0.0))
        };
        Ok(Some((one(SCALE_KEY)?, one(GOOD_STEPS_KEY)? as u32)))
    }

    /// The variables this trainer holds that hold NaN or infinite values, by key, with how many
    /// each holds (what to look at when a loss turns NaN; `checkpoint::non_finite`). Empty when
    /// every value is finite.
    pub fn non_finite_variables(&self) -> Result<Vec<(String, usize)>> {
        let values = self
            .variables()
            .into_keys()
            .map(|k| Ok((self.backend.read_variable(&k)?, k)))
            .collect::<Result<Vec<_>>>()?;
        Ok(checkpoint::non_finite(values.iter().map(|(t, k)| (k.as_str(), t))))
    }

    /// The optimizer-state variables this rank holds a shard of (ZeRO, `with_zero_stage`), by
    /// key: the state's whole shape (its parameter's) and the shard. Read from the loaded plans'
    /// sharded updates: the state they write beside their parameter.
    fn sharded_state(&self) -> BTreeMap<String, (Shape, Shard)> {
        use kiln_compiler::ir::Op;
        use kiln_compiler::plan::Storage;
        let mut out = BTreeMap::new();
        for plan in self.plans() {
            let variable = |v: usize| {
                let buffer = plan.buffers.get(plan.values.get(v)?.buffer)?;
                match buffer.storage {
                    Storage::Variable { index } => plan.variables.get(index),
                    _ => None,
                }
            };
            for step in &plan.steps {
                let (Op::ApplyAdam { shard: Some(shard), .. } | Op::ApplySgd { shard: Some(shard), .. }) =
                    step.op
                else {
                    continue;
                };
                let Some(whole) = step.inputs.first().and_then(|&v| plan.values.get(v)) else { continue };
                for &i in step.op.mutated_operands().iter().filter(|&&i| i > 0) {
                    if let Some(state) = step.inputs.get(i).and_then(|&v| variable(v)) {
                        out.insert(state.key.clone(), (whole.shape.clone(), shard));
                    }
                }
            }
        }
        out
    }

    /// Writes every variable the trainer holds (parameters, optimizer state and the iteration
    /// counter: everything a resumed run needs) to `path` as safetensors
    /// (`crate::checkpoint`). The trainer holds variables once a plan is compiled: train a step
    /// or call `train_program` first.
    ///
    /// With ZeRO (`with_zero_stage`) each rank holds a shard of the optimizer state: `save`
    /// gathers the shards from every rank (a collective: every rank calls it, with its own
    /// path or the same one), so the file holds the whole state, the same bytes on every rank,
    /// and loads on any rank count, with ZeRO or without (DeepSpeed calls this a universal
    /// checkpoint).
    #[track_caller]
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let variables = self.variables();
        if variables.is_empty() {
            return Err(RuntimeError::invalid(
                "Trainer::save: the trainer holds no variables yet",
                "train a step (or call `train_program(x_shape, y_shape)`) before saving",
            ));
        }
        let values = self.whole_values(variables.keys())?;
        checkpoint::save(path.as_ref(), &values)
    }

    /// Writes the model's parameters alone (the variables of role `Parameter`, what
    /// `load_weights` reads) to `path` as safetensors of `dtype`: `DType::F32`, or a half copy,
    /// `DType::BF16` or `DType::F16`, at two bytes a value, each rounded to the nearest
    /// (`checkpoint::save_as`): weights to publish or to fine-tune from, not a run to resume
    /// (optimizer state and counters stay out). With ZeRO every rank calls it, as `save`.
    #[track_caller]
    pub fn save_weights(&self, path: impl AsRef<Path>, dtype: DType) -> Result<()> {
        let roles = self.variable_roles();
        let parameters = roles.iter().filter(|(_, (_, r))| *r == VarRole::Parameter).map(|(k, _)| k);
        let values = self.whole_values(parameters)?;
        if values.is_empty() {
            return Err(RuntimeError::invalid(
                "Trainer::save_weights: the trainer holds no parameters yet",
                "train a step (or call `train_program(x_shape, y_shape)`) before saving",
            ));
        }
        checkpoint::save_as(path.as_ref(), &values, dtype)
    }

    /// The values of the variables `keys` names, each whole: a ZeRO shard gathered from every
    /// rank (a collective).
    fn whole_values<'k>(&self, keys: impl Iterator<Item = &'k String>) -> Result<Vec<(String, HostTensor)>> {
        let sharded = self.sharded_state();
        keys.map(|k| {
            let local = self.backend.read_variable(k)?;
            match sharded.get(k) {
                Some((whole, shard)) => Ok((k.clone(), self.gather(k, &local, whole, *shard)?)),
                None => Ok((k.clone(), local)),
            }
        })
        .collect()
    }

    /// The whole optimizer state `key` of `whole`'s shape from every rank's `shard` of it.
    fn gather(&self, key: &str, local: &HostTensor, whole: &Shape, shard: Shard) -> Result<HostTensor> {
        let comm = self.backend.communicator().ok_or_else(|| {
            RuntimeError::invalid(
                format!(
                    "Trainer::save: `{key}` is sharded over {} ranks but the backend has no communicator",
                    shard.ranks
                ),
                "save from the backend the sharded run trained on",
            )
        })?;
        let n = whole.numel();
        let mine = shard.range(n);
        let mut out = vec![0.0; n];
        let part = local.data().get(..mine.len()).ok_or_else(|| {
            RuntimeError::invalid(
                format!(
                    "Trainer::save: `{key}` holds {} elements, its shard {}",
                    local.data().len(),
                    mine.len()
                ),
                "save from the trainer whose plans declared this state",
            )
        })?;
        let mut c = comm.lock().map_err(|_| {
            RuntimeError::invalid(
                "Trainer::save: the communicator's lock is poisoned",
                "restart the run from its last checkpoint",
            )
        })?;
        c.all_gather(part, &mut out).map_err(|e| {
            RuntimeError::invalid(
                format!("Trainer::save: gathering `{key}` from the ranks failed: {e}"),
                "every rank of the run calls `save` at the same step",
            )
        })?;
        HostTensor::new(whole.clone(), out)
    }

    /// Sets every variable from the checkpoint at `path` (written by `save`): training then
    /// continues where the saved run was, with the same losses bit for bit on the CPU. The file
    /// must hold exactly the variables the trainer's plans declare, with their shapes; any
    /// difference is an error listing them all, and nothing is written then. Compile the
    /// training step first (`train_program(x_shape, y_shape)`), so that the optimizer's state
    /// exists to be loaded. With ZeRO each rank takes its shard of the whole state the file
    /// holds, so a checkpoint saved on any rank count, sharded or not, resumes a sharded run.
    ///
    /// A file of the model's weights alone (published weights, or a file another tool wrote)
    /// lacks the optimizer's state: load it with [`load_weights`](Self::load_weights). A file
    /// holding NaN or infinite values loads, with a warning on stderr naming the variables.
    #[track_caller]
    pub fn load(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let roles = self.variable_roles();
        if roles.is_empty() {
            return Err(RuntimeError::invalid(
                format!("Trainer::load({}): the trainer holds no variables yet", path.display()),
                "call `train_program(x_shape, y_shape)` first, so that the model's variables and the \
                 optimizer's state exist to be loaded",
            ));
        }
        let file = checkpoint::read(path)?;
        // Sharded state is saved whole (`save`): this rank takes its shard of it.
        let sharded = self.sharded_state();
        let mut variables: BTreeMap<String, Shape> =
            roles.iter().map(|(k, (shape, _))| (k.clone(), shape.clone())).collect();
        for (key, (whole, _)) in &sharded {
            variables.insert(key.clone(), whole.clone());
        }
        // f16 loss scaling's scale and count (`loss_scale`) are the precision's, not the
        // model's: a checkpoint of an f32 or bf16 run loads into an f16 trainer, which keeps the
        // scale it has (GradScaler's first on a trainer that has not trained), and an f16
        // checkpoint loads into another precision without them.
        let loss_scale = |k: &str| k.starts_with("loss_scale/");
        variables.retain(|k, _| !loss_scale(k) || file.tensors.contains_key(k));
        let differences = file.differences_ignoring(&variables, loss_scale);
        if !differences.is_empty() {
            let count = |role: VarRole| roles.values().filter(|(_, r)| *r == role).count();
            let (parameters, state) = (count(VarRole::Parameter), count(VarRole::OptimizerState));
            let counters: Vec<String> = roles
                .iter()
                .filter(|(_, (_, r))| *r == VarRole::Counter)
                .map(|(k, _)| format!("`{k}`"))
                .collect();
            let mut needs = vec![format!("the model's {parameters} parameter{}", plural(parameters))];
            if state > 0 {
                needs.push(format!(
                    "the optimizer's {state} state variable{} (`optimizer/<parameter>/<slot>`)",
                    plural(state)
                ));
            }
            if !counters.is_empty() {
                needs.push(format!("the counter{} {}", plural(counters.len()), counters.join(", ")));
            }
            // The file fits the model's parameters and lacks only the rest: a weights-only file.
            let weights_only = roles
                .iter()
                .filter(|(_, (_, r))| *r == VarRole::Parameter)
                .all(|(k, (shape, _))| file.tensors.get(k).is_some_and(|t| t.shape() == shape));
            let hint = if weights_only {
                "\n    the file holds the model's parameters but not the rest: a weights-only file \
                 (published weights?) loads with `Trainer::load_weights`"
            } else {
                ""
            };
            return Err(RuntimeError::invalid(
                format!(
                    "Trainer::load({}): the checkpoint does not fit the model ({} difference{}):\n    {}{hint}",
                    path.display(),
                    differences.len(),
                    if differences.len() == 1 { "" } else { "s" },
                    differences.join("\n    ")
                ),
                format!(
                    "a full `load` needs every one of the {} variables the trainer holds, by the keys and \
                     shapes `save` writes: {}; load a checkpoint saved from this model with the same \
                     optimizer and layer sizes, or, for a file of the model's weights alone, call \
                     `Trainer::load_weights`, which sets the parameters and leaves the optimizer's state fresh",
                    roles.len(),
                    needs.join(", ")
                ),
            ));
        }
        warn_non_finite("Trainer::load", path, &file.non_finite());
        for (key, value) in file.tensors.iter().filter(|(k, _)| variables.contains_key(*k)) {
            match sharded.get(key) {
                Some((_, shard)) => {
                    let n = value.data().len();
                    let mut part = vec![0.0; shard.padded(n)];
                    let mine = shard.range(n);
                    part[..mine.len()].copy_from_slice(&value.data()[mine]);
                    self.backend
                        .write_variable(key, &HostTensor::new(Shape::new(vec![part.len()]), part)?)?;
                }
                None => self.backend.write_variable(key, value)?,
            }
        }
        Ok(())
    }

    /// Sets the model's parameters (the variables of role `Parameter`: kernels, biases,
    /// embeddings) from the safetensors file at `path`, and nothing else: the optimizer's state
    /// and counters are left as they are, fresh on a trainer that has not trained yet, so that
    /// published weights start a fine-tuning run (PyTorch's `model.load_state_dict`, Keras's
    /// `load_weights`). The file may hold more: the optimizer's state (`optimizer/...`) and the
    /// trainer's other non-parameter variables are ignored. Every parameter the model has must
    /// be in the file with its shape, as F32, F16 or BF16 (read as f32), and no other name may
    /// be there (a parameter of another model); any difference is an error listing them all, and nothing is written
    /// then. Compile a program first (`train_program(x_shape, y_shape)` to fine-tune, or
    /// `predict` once), so that the parameters exist. A file holding NaN or infinite values
    /// loads, with a warning on stderr naming the variables.
    #[track_caller]
    pub fn load_weights(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let roles = self.variable_roles();
        let parameters: BTreeMap<String, Shape> = roles
            .iter()
            .filter(|(_, (_, r))| *r == VarRole::Parameter)
            .map(|(k, (shape, _))| (k.clone(), shape.clone()))
            .collect();
        if parameters.is_empty() {
            return Err(RuntimeError::invalid(
                format!("Trainer::load_weights({}): the trainer holds no parameters yet", path.display()),
                "call `train_program(x_shape, y_shape)` (or `predict`) first, so that the model's \
                 parameters exist to be loaded",
            ));
        }
        let file = checkpoint::read(path)?;
        // Not parameters: the model's other variables, any optimizer's state or counter, and an
        // f16 run's loss scale.
        let ignored = |key: &str| {
            roles.contains_key(key)
                || key.starts_with("optimizer/")
                || key.starts_with("loss_scale/")
                || NON_PARAMETER_KEYS.contains(&key)
        };
        let differences = file.differences_ignoring(&parameters, ignored);
        if !differences.is_empty() {
            return Err(RuntimeError::invalid(
                format!(
                    "Trainer::load_weights({}): the file does not fit the model's parameters ({} difference{}):\n    {}",
                    path.display(),
                    differences.len(),
                    if differences.len() == 1 { "" } else { "s" },
                    differences.join("\n    ")
                ),
                format!(
                    "the file must hold each of the model's {} parameter{} by its key (such as `{}`), with \
                     its shape, as F32, F16 or BF16; load weights saved from this model, with the same layer sizes",
                    parameters.len(),
                    plural(parameters.len()),
                    parameters.keys().next().map_or("", |k| k.as_str()),
                ),
            ));
        }
        let weights: Vec<(&str, &HostTensor)> =
            parameters.keys().filter_map(|k| Some((k.as_str(), file.tensors.get(k)?))).collect();
        warn_non_finite("Trainer::load_weights", path, &checkpoint::non_finite(weights.iter().copied()));
        for (key, value) in weights {
            self.backend.write_variable(key, value)?;
        }
        Ok(())
    }

    /// The training-step program for these shapes (f32 inputs, or `InputSpec`s with their
    /// dtypes), compiled on first use.
    #[track_caller]
    pub fn train_program(&mut self, x: impl Into<InputSpec>, y: impl Into<InputSpec>) -> Result<ProgramId> {
        let (x, y) = (x.into(), y.into());
        if let Some(&id) = self.train_programs.get(&(x.clone(), y.clone())) {
            return Ok(id);
        }
        let start = Instant::now();
        let batch = x.shape.dims().first().copied().unwrap_or(1).max(1);
        let mut graph = train_step_graph_with(
            self.model.as_ref(),
            x.clone(),
            y.clone(),
            &self.config,
            self.row_blocks.min(batch),
            self.options.precision,
        )?;
        let ranks = self.backend.rank().filter(|&(_, ranks)| ranks > 1);
        if let Some((_, ranks)) = ranks {
            // Data parallel: gradients, loss and metrics averaged over the ranks; with ZeRO,
            // the state sharded, as rank 0's plan (specialised to this rank below).
            if self.zero == ZeroStage::Off {
                kiln_compiler::data_parallel::all_reduce_gradients_in_buckets(&mut graph, self.bucket_bytes)?;
            } else {
                kiln_compiler::zero::shard_optimizer_state(&mut graph, self.zero, Shard { ranks, rank: 0 })?;
            }
            let mut names = vec!["loss"];
            names.extend(self.config.metrics.iter().map(|m| m.name()));
            kiln_compiler::data_parallel::all_reduce_outputs(&mut graph, &names)?;
        }
        let mut plan = compile(graph, &self.options)?;
        if let Some((rank, _)) = ranks {
            plan = kiln_compiler::zero::for_rank(plan, rank)?;
        }
        self.compile_time += start.elapsed();
        let id = self.backend.load(plan)?;
        self.train_programs.insert((x, y), id);
        Ok(id)
    }

    #[track_caller]
    fn predict_program(&mut self, x: &InputSpec) -> Result<ProgramId> {
        if let Some(&id) = self.predict_programs.get(x) {
            return Ok(id);
        }
        let start = Instant::now();
        let graph = forward_graph_with(self.model.as_ref(), x.clone(), self.options.precision)?;
        let plan = compile(graph, &self.options)?;
        self.compile_time += start.elapsed();
        let id = self.backend.load(plan)?;
        self.predict_programs.insert(x.clone(), id);
        Ok(id)
    }

    /// One optimizer step on a batch. On a backend that is a rank of a data-parallel run
    /// (`Backend::rank`), every rank is given the same whole batch and trains on its shard of
    /// it (`rank_rows`), its gradients averaged with the others' inside the plan; the logs are
    /// the whole batch's (averaged over the ranks too).
    #[track_caller]
    pub fn train_step(&mut self, x: &HostTensor, y: &HostTensor) -> Result<Logs> {
        if let Some((rank, ranks)) = self.backend.rank().filter(|(_, n)| *n > 1) {
            let rows = x.shape().dims().first().copied().unwrap_or(0);
            if rows == 0 || y.shape().dims().first() != Some(&rows) {
                return Err(RuntimeError::invalid(
                    format!(
                        "Trainer::train_step on rank {rank} of {ranks}: inputs {} and targets {} are not one batch of rows",
                        x.shape(),
                        y.shape()
                    ),
                    "give every rank the same whole batch: inputs and targets with the same number of rows, at least one",
                ));
            }
            let idx = self.rank_rows(&(0..rows).collect::<Vec<_>>());
            return self.step_rows(x, y, &idx);
        }
        self.step_on(x, y)
    }

    /// This rank's rows of a batch of rows `idx` (all of them off a data-parallel run): the
    /// batch padded to a multiple of the rank count by repeating its first rows, as PyTorch's
    /// `DistributedSampler` pads, then cut into equal contiguous shards in rank order (with a
    /// batch the rank count divides, `kiln_comm::shard_range`'s shards). Every rank then runs
    /// the same plan, and a repeated row counts twice in the step's mean.
    fn rank_rows(&self, idx: &[usize]) -> Vec<usize> {
        match self.backend.rank().filter(|(_, n)| *n > 1) {
            Some((rank, ranks)) if !idx.is_empty() => {
                let per = idx.len().div_ceil(ranks);
                (rank * per..(rank + 1) * per).map(|i| idx[i % idx.len()]).collect()
            }
            _ => idx.to_vec(),
        }
    }

    /// One optimizer step on rows `idx` of `x` and `y`.
    #[track_caller]
    fn step_rows(&mut self, x: &HostTensor, y: &HostTensor, idx: &[usize]) -> Result<Logs> {
        let id = self.train_program(with_rows(x, idx.len()), with_rows(y, idx.len()))?;
        let (mut xb, mut yb) = (Vec::new(), Vec::new());
        self.feed_rows(id, "x", x, idx, &mut xb)?;
        self.feed_rows(id, "y", y, idx, &mut yb)?;
        self.backend.run(id)?;
        self.logs(id)
    }

    /// One optimizer step on exactly `x` and `y`.
    #[track_caller]
    fn step_on(&mut self, x: &HostTensor, y: &HostTensor) -> Result<Logs> {
        let id = self.train_program(spec(x), spec(y))?;
        self.backend.set_input_tensor(id, "x", x)?;
        self.backend.set_input_tensor(id, "y", y)?;
        self.backend.run(id)?;
        self.logs(id)
    }

    fn logs(&self, id: ProgramId) -> Result<Logs> {
        let scalar = |name: &str| -> Result<f32> {
            let t = self.backend.output(id, name)?;
            t.item().ok_or_else(|| RuntimeError::invalid(format!("output `{name}` is not a scalar"), ""))
        };
        let metrics = self.config.metrics.iter().map(|m| Ok((m.name().to_string(), scalar(m.name())?)));
        Ok(Logs { loss: scalar("loss")?, metrics: metrics.collect::<Result<_>>()? })
    }

    /// The loss and metrics on `x` and `y` (rows along the first axis) in batches of
    /// `batch_size` rows, averaged over the rows as `fit` averages an epoch, without updating
    /// anything (Keras's `evaluate`). One plan per batch shape, compiled on first use.
    #[track_caller]
    pub fn evaluate(&mut self, x: &HostTensor, y: &HostTensor, batch_size: usize) -> Result<Logs> {
        let rows = x.shape().dims().first().copied().unwrap_or(0);
        if y.shape().dims().first() != Some(&rows) || rows == 0 || batch_size == 0 {
            return Err(RuntimeError::invalid(
                format!(
                    "evaluate got inputs {} and targets {} with batch size {batch_size}",
                    x.shape(),
                    y.shape()
                ),
                "inputs and targets need the same number of rows (at least one), and the batch size must be positive",
            ));
        }
        let (mut xb, mut yb) = (Vec::new(), Vec::new());
        let mut sums = RowWeighted::default();
        let order: Vec<usize> = (0..rows).collect();
        for idx in order.chunks(batch_size) {
            let (xs, ys) = (with_rows(x, idx.len()), with_rows(y, idx.len()));
            let id = self.evaluate_program(&xs, &ys)?;
            self.feed_rows(id, "x", x, idx, &mut xb)?;
            self.feed_rows(id, "y", y, idx, &mut yb)?;
            self.backend.run(id)?;
            sums.add(&self.logs(id)?, idx.len());
        }
        Ok(sums.mean())
    }

    /// Feeds rows `idx` of `t` to input `name`: f32 rows through `buffer` (reused, no
    /// allocation per batch), exact ones as a tensor of their dtype.
    fn feed_rows(
        &mut self,
        id: ProgramId,
        name: &str,
        t: &HostTensor,
        idx: &[usize],
        buffer: &mut Vec<f32>,
    ) -> Result<()> {
        if t.dtype() != DType::F32 {
            return self.backend.set_input_tensor(id, name, &t.select_rows(idx)?);
        }
        t.gather_rows_into(idx, buffer)?;
        self.backend.set_input(id, name, &with_rows(t, idx.len()).shape, buffer)
    }

    #[track_caller]
    fn evaluate_program(&mut self, x: &InputSpec, y: &InputSpec) -> Result<ProgramId> {
        if let Some(&id) = self.evaluate_programs.get(&(x.clone(), y.clone())) {
            return Ok(id);
        }
        let start = Instant::now();
        let plan = compile(
            evaluate_graph_with(
                self.model.as_ref(),
                x.clone(),
                y.clone(),
                &self.config,
                self.options.precision,
            )?,
            &self.options,
        )?;
        self.compile_time += start.elapsed();
        let id = self.backend.load(plan)?;
        self.evaluate_programs.insert((x.clone(), y.clone()), id);
        Ok(id)
    }

    /// The model's output for `x`, computed in one batch.
    #[track_caller]
    pub fn predict(&mut self, x: &HostTensor) -> Result<HostTensor> {
        let id = self.predict_program(&spec(x))?;
        self.backend.set_input_tensor(id, "x", x)?;
        self.backend.run(id)?;
        self.backend.output(id, "y")
    }

    /// Trains on `x` and `y` (rows along the first axis) for `opts.epochs` epochs of
    /// `opts.batch_size` rows; the last batch of an epoch holds the remaining rows. Zero epochs
    /// train nothing and return an empty history (as Keras's `fit(epochs=0)`). On a rank of a
    /// data-parallel run every rank is given the whole data and trains on its shard of each
    /// batch, as `train_step` does. With `opts.stop_on_non_finite`, a batch whose loss is NaN
    /// or infinite ends training with an error naming the epoch and the batch.
    #[track_caller]
    pub fn fit(&mut self, x: &HostTensor, y: &HostTensor, opts: &FitOptions) -> Result<History> {
        let rows = x.shape().dims().first().copied().unwrap_or(0);
        if y.shape().dims().first() != Some(&rows) || rows == 0 || opts.batch_size == 0 {
            return Err(RuntimeError::invalid(
                format!(
                    "fit got inputs {} and targets {} with batch size {}",
                    x.shape(),
                    y.shape(),
                    opts.batch_size
                ),
                "inputs and targets need the same number of rows (at least one), and the batch size must be positive",
            ));
        }
        let batches = rows.div_ceil(opts.batch_size);
        let mut order: Vec<usize> = (0..rows).collect();
        let mut rng = StdRng::seed_from_u64(opts.seed);
        let (mut xb, mut yb) = (Vec::new(), Vec::new());
        let mut history = History::default();
        for epoch in 0..opts.epochs {
            if opts.shuffle {
                order.shuffle(&mut rng);
            }
            let bar = progress_bar(batches, epoch, opts);
            let mut sums = RowWeighted::default();
            for b in 0..batches {
                let idx = &order[b * opts.batch_size..((b + 1) * opts.batch_size).min(rows)];
                // On a rank of a data-parallel run, this rank's shard of the batch.
                let mine = self.rank_rows(idx);
                let (xs, ys) = (with_rows(x, mine.len()), with_rows(y, mine.len()));
                let id = self.train_program(xs, ys)?;
                self.feed_rows(id, "x", x, &mine, &mut xb)?;
                self.feed_rows(id, "y", y, &mine, &mut yb)?;
                self.backend.run(id)?;
                let logs = self.logs(id)?;
                if opts.stop_on_non_finite && !logs.loss.is_finite() {
                    bar.finish_and_clear();
                    return Err(RuntimeError::invalid(
                        format!(
                            "Trainer::fit: the loss became non-finite ({}) at epoch {} of {}, batch {} of \
                             {batches} (`stop_on_non_finite` stopped training; the weights are those after \
                             this batch's update)",
                            logs.loss,
                            epoch + 1,
                            opts.epochs,
                            b + 1
                        ),
                        "lower the learning rate (the usual cause: the weights diverged), check the inputs \
                         and targets for NaN or infinite values and for scale, list the variables that hold \
                         them with `Trainer::non_finite_variables`, and rerun with KILN_GUARD=1 to rule out \
                         a kernel writing out of bounds",
                    ));
                }
                sums.add(&logs, idx.len());
                bar.inc(1);
            }
            let logs = sums.mean();
            bar.finish_and_clear();
            if opts.verbose {
                eprintln!("Epoch {}/{} - {}", epoch + 1, opts.epochs, format_logs(&logs));
            }
            history.epochs.push(logs);
        }
        Ok(history)
    }
}

/// `shape` with its first axis set to `rows` (`fit` has checked that the rank is at least 1).
/// `t`'s shape with `rows` rows, and its dtype.
fn with_rows(t: &HostTensor, rows: usize) -> InputSpec {
    let mut dims = t.shape().dims().to_vec();
    if let Some(first) = dims.first_mut() {
        *first = rows;
    }
    InputSpec::new(Shape::new(dims), t.dtype())
}

/// `t`'s shape and dtype.
fn spec(t: &HostTensor) -> InputSpec {
    InputSpec::new(t.shape().clone(), t.dtype())
}

/// `logs` as Keras prints them: `loss: 0.1234 - accuracy: 0.9876`, four decimals each.
pub fn format_logs(logs: &Logs) -> String {
    let mut s = format!("loss: {:.4}", logs.loss);
    for (n, v) in &logs.metrics {
        s.push_str(&format!(" - {n}: {v:.4}"));
    }
    s
}

fn progress_bar(batches: usize, epoch: usize, opts: &FitOptions) -> ProgressBar {
    if !opts.verbose {
        return ProgressBar::with_draw_target(Some(batches as u64), ProgressDrawTarget::hidden());
    }
    let bar = ProgressBar::new(batches as u64);
    let style = ProgressStyle::with_template("Epoch {msg} {bar:30} {pos}/{len} [{elapsed_precise}]")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_message(format!("{}/{}", epoch + 1, opts.epochs));
    bar
}

/// Counters that are no parameter although outside `optimizer/` (dropout's step,
/// `kiln_compiler::nn::Dropout`), which `load_weights` ignores in a file.
const NON_PARAMETER_KEYS: [&str; 1] = ["dropout/step"];

/// `"s"` unless `n` is 1.
fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Warns on stderr that the file at `path`, loaded by `what`, holds non-finite values in the
/// variables `bad` (name, count); nothing when `bad` is empty. Loading goes on, as PyTorch and
/// Keras load such files, but the next step's loss will be NaN.
fn warn_non_finite(what: &str, path: &Path, bad: &[(String, usize)]) {
    if bad.is_empty() {
        return;
    }
    let total: usize = bad.iter().map(|(_, n)| n).sum();
    let names: Vec<String> = bad.iter().map(|(k, n)| format!("`{k}` ({n})")).collect();
    eprintln!(
        "warning: {what}({}): {total} non-finite value{} (NaN or infinite) in {} variable{}: {}; the next \
         step's loss will be NaN (the run that saved it diverged? resume from an earlier checkpoint, \
         with a lower learning rate)",
        path.display(),
        plural(total),
        bad.len(),
        plural(bad.len()),
        names.join(", ")
    );
}
