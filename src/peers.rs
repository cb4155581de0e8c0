//! kiln's planned memory beside a peer compiler's: XLA's buffer assignment (JAX, CPU backend) for
//! the same models, shapes, losses and Adam step.
//!
//! kiln's figure is the plan's `planned_total_bytes` (parameters + optimizer state + io region +
//! arena). XLA's figure comes from `scripts/peers/xla_memory.py`, which writes every model again in
//! plain `jax.numpy` with kiln's exact layer math, compiles (never runs) a jitted forward pass and a
//! jitted Adam step with donated parameters and optimizer state, and reads
//! `compiled.memory_analysis()`: total = argument + output + temp - alias.
//!
//! The models: the zoo's four (`kiln::zoo`) and three it was not tuned for, defined here in kiln's
//! layers and mirrored layer by layer in the script:
//!
//! | name | model | batch |
//! |---|---|---|
//! | `res-mlp` | 784 -> Dense 512 relu, 6 x residual [Dense 512 relu, Dense 512 relu], Dense 10; softmax CE | 256 |
//! | `vgg-avg` | 32x32x3: (conv 32 relu) x2, avg-pool, (conv 64) x2, avg-pool, (conv 128) x2, avg-pool, dense 256 relu, dense 10 | 64 |
//! | `transformer-2` | embedding 500x128, two pre-LN blocks (4 heads, GELU MLP 512), LN, dense 500; sequence 64 | 16 |
//!
//! JAX comes from a virtual environment under `target/kiln/peers-venv` (created once with pinned
//! CPU wheels, [`JAX_PINS`]) or from the interpreter named by `KILN_PEERS_PYTHON`. Where neither can
//! be had (no python3, no network, no wheel), [`xla_figures`] prints `skipped: <reason>` on stderr
//! and returns `Ok(None)`.
//!
//! The real-scale comparison (`benches/realscale.rs`) has an XLA column of its own:
//! [`realscale_xla_figures`] compiles the Flax versions of its models' training steps
//! (`scripts/realscale/xla.py`) in an environment with Flax, optax and transformers
//! ([`REALSCALE_XLA_PINS`], `KILN_REALSCALE_XLA_PYTHON`).

use crate::compare::Mode;
use crate::error::{Error, Result};
use crate::zoo::{self, ZooModel};
use kiln_compiler::ir::{Padding, Shape};
use kiln_compiler::nn::{
    Activation, Conv2D, Dense, Embedding, Flatten, LayerNorm, MultiHeadAttention, Pool2D, Residual,
    Sequential,
};
use kiln_compiler::step::{TrainConfig, forward_graph, train_step_graph};
use kiln_compiler::{CompileOptions, compile};
use kiln_runtime::RuntimeError;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The wheels the virtual environment pins (CPU jaxlib; both exist for Python 3.11+).
pub const JAX_PINS: [&str; 2] = ["jax==0.10.2", "jaxlib==0.10.2"];

/// Names an interpreter that already has JAX; no virtual environment is made then.
pub const PYTHON_ENV: &str = "KILN_PEERS_PYTHON";

/// What each side counts, printed beside the table.
pub const ASSUMPTIONS: &str = "\
assumptions:
- kiln: plan.memory.planned_total_bytes() = parameters + optimizer state (Adam m, v, iteration
  counter) + io region (inputs x, y and the outputs, each in its own aligned slot) + arena (every
  intermediate, 64-byte aligned slots, as XLA:CPU aligns its temporaries), from
  CompileOptions::default().
- XLA: jax.jit(..).lower(..).compile().memory_analysis() on jaxlib's CPU backend; total =
  argument + output + temp - alias. Forward: params and x as arguments, no donation. Train: one
  Adam step (Keras semantics, as kiln's) with params, m, v and the counter donated (alias = what
  the outputs reuse of them), x and y as arguments, loss and accuracy as outputs.
- XLA's figures are its CPU buffer assignment; the GPU backend's differs (other fusion, layouts,
  cuDNN/cuBLAS workspaces). They are compiled with YNNPACK library fusion off
  (xla_cpu_experimental_ynn_fusion_type=\"\") so that every intermediate is an XLA buffer: with
  the default flags a fused convolution chain keeps its intermediates inside YNNPACK, outside
  the figure (\"XLA default\" column: cnn forward temp 0). Kernel-internal scratch (Eigen/oneDNN
  packing) is in neither side's figure.
- Same architectures, shapes, f32, losses and metrics on both sides; token ids are f32 inputs on
  both sides (kiln stores ids as f32).
- Forward passes: kiln runs the row-separable part in blocks of batch rows where that plans
  smaller (cnn and vgg-avg: 8 blocks of 8 images; `kiln_compiler::batch_blocks`), XLA the whole
  batch; KILN_BATCH_BLOCKS=0 plans kiln's whole batch too (cnn forward kiln / XLA 0.960).";

// ---------------------------------------------------------------- the models

/// A model measured on both sides: a zoo entry or one of this module's three.
#[derive(Clone, Debug)]
pub struct PeerModel {
    /// The model's name, as the zoo and `scripts/peers/xla_memory.py` know it.
    pub name: &'static str,
    /// The batch size both sides compile for.
    pub batch: usize,
    /// Input and target shapes without the batch axis.
    pub x: Vec<usize>,
    /// The target's shape without the batch axis (`[10]` for ten classes).
    pub y: Vec<usize>,
    /// Whether it is one of kiln's zoo models (the ones kiln's planner was developed on).
    pub in_zoo: bool,
    source: Source,
}

#[derive(Clone, Debug)]
enum Source {
    Zoo(ZooModel),
    Extra { build: fn() -> Sequential, config: fn() -> TrainConfig },
}

impl PeerModel {
    fn zoo(m: ZooModel) -> Self {
        PeerModel {
            name: m.name,
            batch: m.batch,
            x: m.x.clone(),
            y: m.y.clone(),
            in_zoo: true,
            source: Source::Zoo(m),
        }
    }

    /// Builds the model's layers (a fresh `Sequential` each call).
    pub fn model(&self) -> Sequential {
        match &self.source {
            Source::Zoo(m) => m.model(),
            Source::Extra { build, .. } => build(),
        }
    }

    /// The model's loss, optimizer (Adam) and metrics for a training step.
    pub fn config(&self) -> TrainConfig {
        match &self.source {
            Source::Zoo(m) => m.config(),
            Source::Extra { config, .. } => config(),
        }
    }

    /// The input's shape with the batch axis first: `[batch, x...]`.
    pub fn x_shape(&self) -> Shape {
        batched(self.batch, &self.x)
    }

    /// The target's shape with the batch axis first: `[batch, y...]`.
    pub fn y_shape(&self) -> Shape {
        batched(self.batch, &self.y)
    }
}

fn batched(batch: usize, dims: &[usize]) -> Shape {
    let mut d = vec![batch];
    d.extend_from_slice(dims);
    Shape::new(d)
}

/// `transformer-2`'s sequence length in tokens (its input is `[batch, 64]` token ids).
pub const TRANSFORMER_2_SEQ: usize = 64;
/// `transformer-2`'s vocabulary size: embedding rows and output logits per token.
pub const TRANSFORMER_2_VOCAB: usize = 500;
/// `transformer-2`'s model width (embedding size; the MLP is 4x wider).
pub const TRANSFORMER_2_MODEL: usize = 128;

/// The three models kiln's zoo does not have.
pub fn extra() -> Vec<PeerModel> {
    let extra = |name, batch, x: Vec<usize>, y: Vec<usize>, build| PeerModel {
        name,
        batch,
        x,
        y,
        in_zoo: false,
        source: Source::Extra { build, config: zoo::classifier_config },
    };
    vec![
        extra("res-mlp", 256, vec![784], vec![10], res_mlp),
        extra("vgg-avg", 64, vec![32, 32, 3], vec![10], vgg_avg),
        extra(
            "transformer-2",
            16,
            vec![TRANSFORMER_2_SEQ],
            vec![TRANSFORMER_2_SEQ, TRANSFORMER_2_VOCAB],
            transformer_2,
        ),
    ]
}

/// The zoo's models, then the three extra ones.
pub fn all() -> Vec<PeerModel> {
    zoo::all().into_iter().map(PeerModel::zoo).chain(extra()).collect()
}

/// 784 -> Dense(512, relu), six residual blocks x + relu(Dense 512)(relu(Dense 512)(x)), Dense(10).
pub fn res_mlp() -> Sequential {
    let mut m = Sequential::new().add(Dense::new(512).relu());
    for _ in 0..6 {
        m.push(Residual::new(Sequential::new().add(Dense::new(512).relu()).add(Dense::new(512).relu())));
    }
    m.add(Dense::new(10))
}

/// A small VGG-style net on 32x32x3 with average pooling, producing 10 logits.
pub fn vgg_avg() -> Sequential {
    let conv = |f: usize| Conv2D::new(f, [3, 3]).padding(Padding::Same).relu();
    let mut m = Sequential::new();
    for f in [32, 64, 128] {
        m.push(conv(f));
        m.push(conv(f));
        m.push(Pool2D::avg([2, 2]));
    }
    m.add(Flatten).add(Dense::new(256).relu()).add(Dense::new(10))
}

/// Token ids -> embedding -> two pre-LN transformer blocks -> LN -> logits over the vocabulary.
pub fn transformer_2() -> Sequential {
    let d = TRANSFORMER_2_MODEL;
    let ln = || LayerNorm::new().epsilon(1e-5);
    let mut m = Sequential::new().add(Embedding::new(TRANSFORMER_2_VOCAB, d));
    for _ in 0..2 {
        m.push(Residual::new(Sequential::new().add(ln()).add(MultiHeadAttention::new(4))));
        m.push(Residual::new(
            Sequential::new()
                .add(ln())
                .add(Dense::new(4 * d).activation(Activation::Gelu))
                .add(Dense::new(d)),
        ));
    }
    m.add(ln()).add(Dense::new(TRANSFORMER_2_VOCAB))
}

// ---------------------------------------------------------------- kiln's side

/// One plan's memory figures (bytes).
#[derive(Clone, Debug, serde::Serialize)]
pub struct KilnFigures {
    /// The parameters' bytes (the model's weights).
    pub parameter_bytes: usize,
    /// The optimizer state's bytes (Adam's m and v and its iteration counter; 0 for a forward
    /// pass).
    pub optimizer_state_bytes: usize,
    /// The io region's bytes: the inputs and outputs, each in its own aligned slot.
    pub io_bytes: usize,
    /// parameters + optimizer state + constants + io: the bytes outside the arena.
    pub persistent_bytes: usize,
    /// The planned arena's bytes (every intermediate, 64-byte aligned slots).
    pub arena_bytes: usize,
    /// The most bytes live at any one step of the chosen schedule: the arena's lower bound.
    pub lower_bound_bytes: usize,
    /// persistent + arena: kiln's figure, compared with [`XlaFigures::total_bytes`].
    pub planned_total_bytes: usize,
}

/// Compiles `m` in `mode` with the default options and reads the plan's figures.
pub fn kiln_figures(m: &PeerModel, mode: Mode) -> Result<KilnFigures> {
    let model = m.model();
    let graph = match mode {
        Mode::Forward => forward_graph(&model, m.x_shape())?,
        Mode::Train => train_step_graph(&model, m.x_shape(), m.y_shape(), &m.config())?,
    };
    let plan = compile(graph, &CompileOptions::default())?;
    let f = &plan.memory;
    Ok(KilnFigures {
        parameter_bytes: f.parameter_bytes,
        optimizer_state_bytes: f.optimizer_state_bytes,
        io_bytes: f.io_bytes,
        persistent_bytes: f.persistent_bytes,
        arena_bytes: f.arena_bytes,
        lower_bound_bytes: f.lower_bound_bytes,
        planned_total_bytes: f.planned_total_bytes(),
    })
}

// ---------------------------------------------------------------- XLA's side

/// XLA's buffer assignment for one compiled function (bytes).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct XlaFigures {
    /// The bytes of the function's arguments (parameters, inputs; for a training step also Adam's
    /// state and counter), `memory_analysis().argument_size_in_bytes`.
    pub argument_bytes: usize,
    /// The bytes of the function's outputs, `memory_analysis().output_size_in_bytes`.
    pub output_bytes: usize,
    /// The bytes of XLA's temporary buffers (its intermediates' heap),
    /// `memory_analysis().temp_size_in_bytes`.
    pub temp_bytes: usize,
    /// The output bytes that reuse donated argument buffers (0 for a forward pass),
    /// `memory_analysis().alias_size_in_bytes`.
    pub alias_bytes: usize,
    /// argument + output + temp - alias.
    pub total_bytes: usize,
    /// The same with jaxlib's default flags (YNNPACK library fusion on).
    pub default_flags_temp_bytes: usize,
    /// argument + output + temp - alias with jaxlib's default flags (the "XLA default" column).
    pub default_flags_total_bytes: usize,
}

/// XLA's figures for one model as the script reports them: its forward pass and its Adam
/// training step.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct XlaModel {
    /// The batch size the script compiled for (the input's leading dimension).
    pub batch: usize,
    /// The number of parameter tensors and their bytes, as the script declared them.
    pub parameters: usize,
    /// The parameters' bytes, 4 per f32 element, as the script counts them.
    pub parameter_bytes: usize,
    /// The jitted forward pass's figures.
    pub forward: XlaFigures,
    /// The jitted training step's figures (parameters, m, v and counter donated).
    pub train: XlaFigures,
}

impl XlaModel {
    /// The figures of `mode`: `forward` or `train`.
    pub fn mode(&self, mode: Mode) -> &XlaFigures {
        match mode {
            Mode::Forward => &self.forward,
            Mode::Train => &self.train,
        }
    }
}

/// What the script prints.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct XlaReport {
    /// The version of JAX the script ran with (`jax.__version__`).
    pub jax: String,
    /// The version of jaxlib the script ran with (`jaxlib.__version__`).
    pub jaxlib: String,
    /// The backend XLA compiled for (`jax.default_backend()`; `cpu` here).
    pub backend: String,
    /// Each model's figures, by model name.
    pub models: BTreeMap<String, XlaModel>,
}

/// The script, in the source tree.
pub fn script_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/xla_memory.py")
}

/// The virtual environment's directory.
pub fn venv_dir() -> PathBuf {
    crate::report::output_dir().join("peers-venv")
}

fn venv_python(venv: &Path) -> PathBuf {
    if cfg!(windows) { venv.join("Scripts").join("python.exe") } else { venv.join("bin").join("python") }
}

/// Why JAX cannot be had: printed as `skipped: ...`, never an error.
struct Skip(String);

/// The last lines of a command's stderr (pip's complaint), on one line.
fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty()).collect();
    lines[lines.len().saturating_sub(2)..].join(" | ")
}

/// Runs `cmd`; a failure to start or a non-zero exit is a `Skip` naming `what`.
fn run_or_skip(cmd: &mut Command, what: &str) -> std::result::Result<std::process::Output, Skip> {
    let out = cmd.output().map_err(|e| Skip(format!("{what}: {e}")))?;
    if !out.status.success() {
        return Err(Skip(format!("{what} failed ({}): {}", out.status, tail(&out.stderr))));
    }
    Ok(out)
}

/// A Python environment a peer needs: the modules it must import, the wheels that provide them,
/// the variable that may name an interpreter that has them, and the virtual environment made
/// otherwise.
struct PythonEnv {
    what: &'static str,
    imports: &'static str,
    pins: &'static [&'static str],
    variable: &'static str,
    venv: &'static str,
}

const JAX_ENV: PythonEnv = PythonEnv {
    what: "jax and jaxlib",
    imports: "import jax, jaxlib",
    pins: &JAX_PINS,
    variable: PYTHON_ENV,
    venv: "peers-venv",
};

/// PyTorch for the speed bench: PyPI's wheel (the CPU-only index is not reachable from the build
/// machines), which pulls CUDA's libraries (about 5 GB) although only its CPU kernels run.
pub const TORCH_PINS: [&str; 2] = ["torch==2.15.0", "numpy"];

/// Names an interpreter that already has PyTorch; no virtual environment is made then.
pub const TORCH_PYTHON_ENV: &str = "KILN_TORCH_PYTHON";

const TORCH_ENV: PythonEnv = PythonEnv {
    what: "torch",
    imports: "import torch",
    pins: &TORCH_PINS,
    variable: TORCH_PYTHON_ENV,
    venv: "torch-venv",
};

/// PyTorch with torchvision, transformers and onnx, for the real-scale comparison
/// (`benches/realscale.rs`): exports and PyTorch's recorded streams of the architectures of
/// `scripts/realscale/models.py`.
pub const REALSCALE_PINS: [&str; 5] =
    ["torch==2.15.0", "torchvision==0.29.2", "transformers==4.46.3", "onnx==1.23.2", "numpy"];

/// Names an interpreter that already has `REALSCALE_PINS`' packages.
pub const REALSCALE_PYTHON_ENV: &str = "KILN_REALSCALE_PYTHON";

const REALSCALE_ENV: PythonEnv = PythonEnv {
    what: "torch, torchvision, transformers and onnx",
    imports: "import torch, torchvision, transformers, onnx",
    pins: &REALSCALE_PINS,
    variable: REALSCALE_PYTHON_ENV,
    venv: "realscale-venv",
};

/// onnxruntime (its CPU provider) for the forward-pass comparison (`benches/forward.rs`):
/// `scripts/peers/ort_forward.py` runs a model on the same inputs kiln runs.
pub const ORT_PINS: [&str; 2] = ["onnxruntime==1.32.0", "numpy"];

/// Names an interpreter that already has onnxruntime.
pub const ORT_PYTHON_ENV: &str = "KILN_ORT_PYTHON";

const ORT_ENV: PythonEnv = PythonEnv {
    what: "onnxruntime",
    imports: "import onnxruntime, numpy",
    pins: &ORT_PINS,
    variable: ORT_PYTHON_ENV,
    venv: "ort-venv",
};

/// The forward-pass comparison's onnxruntime interpreter (`ORT_PYTHON_ENV`, or a virtual
/// environment under target/kiln made on first use), or why there is none.
pub fn ort_python() -> std::result::Result<PathBuf, String> {
    python_with(&ORT_ENV).map_err(|Skip(why)| why)
}

/// onnxruntime's run of `model` on the arrays of `inputs` (an .npz), its outputs written to
/// `outputs` (an .npz) and the milliseconds of each of `runs` timed runs on `threads` threads
/// (`scripts/peers/ort_forward.py`), with its version.
pub fn ort_forward(
    python: &Path,
    model: &Path,
    (inputs, outputs): (&Path, &Path),
    threads: usize,
    runs: usize,
) -> Result<(String, Vec<f64>)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/ort_forward.py");
    let out = Command::new(python)
        .arg(&script)
        .args([model, inputs, outputs])
        .args(["--threads", &threads.to_string(), "--runs", &runs.to_string()])
        .output()
        .map_err(|e| script_error(format!("{}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(script_error(format!("onnxruntime on {}: {}", model.display(), tail(&out.stderr))));
    }
    let line = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(line.trim())
        .map_err(|e| script_error(format!("onnxruntime on {} printed no result: {e}", model.display())))?;
    let ms = v["ms"].as_array().map(|a| a.iter().filter_map(|x| x.as_f64()).collect()).unwrap_or_default();
    Ok((v["version"].as_str().unwrap_or("?").to_string(), ms))
}

/// The export of the real-scale architecture `name` (`scripts/realscale/export.py`) at `batch`
/// as `dir/batch{batch}/{name}.onnx`, or with `eval` the inference export `{name}-eval.onnx`,
/// made by `python` (`realscale_python`) where it is not there yet; or why it could not be made.
pub fn realscale_export(
    python: &Path,
    dir: &Path,
    name: &str,
    batch: usize,
    eval: bool,
) -> std::result::Result<PathBuf, String> {
    // One folder per batch: an export's shapes are fixed.
    let dir = dir.join(format!("batch{batch}"));
    let path = dir.join(if eval { format!("{name}-eval.onnx") } else { format!("{name}.onnx") });
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut command = Command::new(python);
    command
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/realscale/export.py"))
        .arg(&dir)
        .arg(name);
    command.args(["--batch", &batch.to_string()]);
    if eval {
        command.arg("--eval");
    }
    let out = command.output().map_err(|e| format!("exporting {name}: {e}"))?;
    if !out.status.success() {
        return Err(format!("exporting {name}: {}", tail(&out.stderr)));
    }
    Ok(path)
}

/// The real-scale comparison's interpreter (`REALSCALE_PYTHON_ENV`, or a virtual environment
/// under target/kiln made on first use), or why there is none.
pub fn realscale_python() -> std::result::Result<PathBuf, String> {
    python_with(&REALSCALE_ENV).map_err(|Skip(why)| why)
}

/// JAX, Flax, optax and transformers (its Flax classes) for the real-scale comparison's XLA
/// column: `scripts/realscale/xla.py` compiles the Flax versions of the real-scale models'
/// training steps on jaxlib's CPU backend. transformers 4.46's Flax models import and trace
/// under jax 0.10 and flax 0.12 (flax pulls orbax and tensorstore; about 0.9 GB in all).
pub const REALSCALE_XLA_PINS: [&str; 6] =
    ["jax==0.10.2", "jaxlib==0.10.2", "flax==0.12.8", "optax==0.2.8", "transformers==4.46.3", "numpy"];

/// Names an interpreter that already has `REALSCALE_XLA_PINS`' packages.
pub const REALSCALE_XLA_PYTHON_ENV: &str = "KILN_REALSCALE_XLA_PYTHON";

const REALSCALE_XLA_ENV: PythonEnv = PythonEnv {
    what: "jax, flax, optax and transformers' Flax models",
    imports: "import jax, jaxlib, flax, optax; from transformers import FlaxGPT2LMHeadModel",
    pins: &REALSCALE_XLA_PINS,
    variable: REALSCALE_XLA_PYTHON_ENV,
    venv: "realscale-xla-venv",
};

/// The real-scale XLA column's interpreter (`REALSCALE_XLA_PYTHON_ENV`, or a virtual environment
/// under target/kiln made on first use), or why there is none.
pub fn realscale_xla_python() -> std::result::Result<PathBuf, String> {
    python_with(&REALSCALE_XLA_ENV).map_err(|Skip(why)| why)
}

/// XLA's figures for one training step of a real-scale model's Flax version, as
/// `scripts/realscale/xla.py` reports them.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RealscaleXlaModel {
    /// The step's buffer assignment: arguments (parameters, BatchNorm statistics, Adam's state,
    /// inputs, target), outputs, temporaries and what the outputs reuse of the donated
    /// arguments, compiled with YNNPACK library fusion off where jaxlib has it; the default
    /// flags' temp and total beside.
    #[serde(flatten)]
    pub figures: XlaFigures,
    /// The Flax model's trainable elements (PyTorch's `sum(p.numel())` for the same
    /// architecture).
    pub parameters: usize,
    /// The parameters' bytes, 4 per f32 element.
    pub parameter_bytes: usize,
    /// BatchNorm's running statistics' elements (0 without BatchNorm).
    pub batch_stats: usize,
    /// The batch the step was compiled for (`scripts/realscale/models.py`'s).
    pub batch: usize,
}

/// What `scripts/realscale/xla.py` prints.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RealscaleXlaReport {
    /// `jax.__version__`.
    pub jax: String,
    /// `jaxlib.__version__`.
    pub jaxlib: String,
    /// `flax.__version__`.
    pub flax: String,
    /// `optax.__version__`.
    pub optax: String,
    /// `transformers.__version__`.
    pub transformers: String,
    /// The backend XLA compiled for (`cpu`).
    pub backend: String,
    /// Whether the main figures were compiled with YNNPACK library fusion off (false where
    /// jaxlib has no such flag: then they are the default flags' figures).
    pub ynn_fusion_off: bool,
    /// Each model's figures, by the name `scripts/realscale/models.py` gives it.
    pub models: BTreeMap<String, RealscaleXlaModel>,
}

/// The real-scale XLA script, in the source tree.
pub fn realscale_xla_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/realscale/xla.py")
}

/// XLA's buffer assignment for one training step of the Flax versions of `models` (names of
/// `scripts/realscale/models.py`: `gpt2`, `resnet50`, `vit_b_16`, `bert`, `efficientnet_b0`,
/// `mobilenet_v3_small`), or `Ok(None)` after printing `skipped: <reason>` on stderr where the
/// interpreter cannot be had ([`realscale_xla_python`]). A script that fails once its packages
/// import, or prints what does not parse or lacks a model, is an error. Compiling takes about
/// half a minute per model on two cores; nothing is run.
pub fn realscale_xla_figures(models: &[&str]) -> Result<Option<RealscaleXlaReport>> {
    let script = realscale_xla_script();
    let args = ["--models".to_string(), models.join(",")];
    let Some(stdout) = run_env_script(&REALSCALE_XLA_ENV, &script, &args)? else { return Ok(None) };
    let report: RealscaleXlaReport = serde_json::from_slice(&stdout)
        .map_err(|e| script_error(format!("{} printed no report that parses: {e}", script.display())))?;
    if let Some(missing) = models.iter().find(|m| !report.models.contains_key(**m)) {
        return Err(script_error(format!("{} printed no figures for {missing}", script.display())));
    }
    Ok(Some(report))
}

/// An interpreter that imports `env`'s modules: the one its variable names, or its virtual
/// environment under `target/kiln` (made and filled on first use; the time it took is printed).
fn python_with(env: &PythonEnv) -> std::result::Result<PathBuf, Skip> {
    let has = |python: &Path| {
        Command::new(python)
            .args(["-c", env.imports])
            .env("JAX_PLATFORMS", "cpu")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if let Some(python) = std::env::var_os(env.variable) {
        let python = PathBuf::from(python);
        if has(&python) {
            return Ok(python);
        }
        return Err(Skip(format!("{}={} cannot import {}", env.variable, python.display(), env.what)));
    }
    let venv = crate::report::output_dir().join(env.venv);
    let python = venv_python(&venv);
    let marker = venv.join("kiln-pins.txt");
    let pins = env.pins.join(" ");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m.trim() == pins) && has(&python) {
        return Ok(python);
    }
    let start = Instant::now();
    eprintln!("peers: installing {pins} into {} (once)", venv.display());
    if venv.exists() {
        std::fs::remove_dir_all(&venv).map_err(|e| Skip(format!("cannot remove {}: {e}", venv.display())))?;
    }
    run_or_skip(Command::new("python3").arg("--version"), "python3")?;
    run_or_skip(Command::new("python3").args(["-m", "venv"]).arg(&venv), "python3 -m venv")?;
    run_or_skip(
        Command::new(&python)
            .args(["-m", "pip", "install", "--disable-pip-version-check", "--quiet"])
            .args(["--retries", "1", "--timeout", "30"])
            .args(env.pins),
        &format!("pip install {pins}"),
    )?;
    if !has(&python) {
        return Err(Skip(format!("{} cannot import {} after installing {pins}", python.display(), env.what)));
    }
    std::fs::write(&marker, &pins).map_err(|e| Skip(format!("cannot write {}: {e}", marker.display())))?;
    eprintln!("peers: installed {pins} in {:.1} s", start.elapsed().as_secs_f64());
    Ok(python)
}

fn script_error(what: String) -> Error {
    Error::Runtime(RuntimeError::invalid(
        what,
        "run the script by hand with the same interpreter to see the whole traceback",
    ))
}

/// Runs `scripts/peers/xla_memory.py` on `models` with `extra` arguments and returns what it
/// printed, or `Ok(None)` after printing `skipped: <reason>` on stderr where JAX cannot be had.
/// A script that fails once JAX imports is an error.
fn run_script(models: &[&str], extra: &[String]) -> Result<Option<Vec<u8>>> {
    let mut args = vec!["--models".to_string(), models.join(",")];
    args.extend_from_slice(extra);
    run_env_script(&JAX_ENV, &script_path(), &args)
}

/// Runs `script` with `args` in `env`'s interpreter (JAX on the CPU) and returns its stdout, or
/// `Ok(None)` after printing `skipped: <reason>` on stderr where the interpreter cannot be had.
/// A script that fails once the interpreter is had is an error.
fn run_env_script(env: &PythonEnv, script: &Path, args: &[String]) -> Result<Option<Vec<u8>>> {
    let python = match python_with(env) {
        Ok(p) => p,
        Err(Skip(why)) => {
            eprintln!("skipped: {why}");
            return Ok(None);
        }
    };
    let out = Command::new(&python).arg(script).args(args).env("JAX_PLATFORMS", "cpu").output()?;
    if !out.status.success() {
        return Err(script_error(format!(
            "{} {} {} failed ({}): {}",
            python.display(),
            script.display(),
            args.join(" "),
            out.status,
            tail(&out.stderr)
        )));
    }
    Ok(Some(out.stdout))
}

/// XLA's figures for `models` (names from [`all`]), or `Ok(None)` after printing
/// `skipped: <reason>` on stderr where JAX cannot be had. A script that fails once JAX imports,
/// or prints what does not parse, is an error.
pub fn xla_figures(models: &[&str]) -> Result<Option<XlaReport>> {
    let Some(stdout) = run_script(models, &[])? else { return Ok(None) };
    let script = script_path();
    let report: XlaReport = serde_json::from_slice(&stdout)
        .map_err(|e| script_error(format!("{} printed no report that parses: {e}", script.display())))?;
    if let Some(missing) = models.iter().find(|m| !report.models.contains_key(**m)) {
        return Err(script_error(format!("{} printed no figures for {missing}", script.display())));
    }
    Ok(Some(report))
}

/// JAX's times for `models`: milliseconds of each of `steps` jitted training steps and of as
/// many jitted forward passes (after warm-up), or `Ok(None)` after printing `skipped: <reason>` where JAX cannot be had.
pub fn xla_step_times(models: &[&str], steps: usize) -> Result<Option<BTreeMap<String, JaxTimes>>> {
    #[derive(serde::Deserialize)]
    struct Report {
        models: BTreeMap<String, JaxTimes>,
    }
    let Some(stdout) = run_script(models, &["--time".into(), steps.to_string()])? else { return Ok(None) };
    let report: Report = serde_json::from_slice(&stdout).map_err(|e| {
        script_error(format!("{} --time printed no report that parses: {e}", script_path().display()))
    })?;
    Ok(Some(report.models))
}

/// PyTorch's CPU step times for `models` (`scripts/peers/torch_speed.py`): milliseconds of each
/// of `steps` eager training steps, and with `compiled` of as many `torch.compile`d ones, after
/// warm-up; or `Ok(None)` after printing `skipped: <reason>` where PyTorch cannot be had.
pub fn torch_step_times(
    models: &[&str],
    steps: usize,
    compiled: bool,
) -> Result<Option<BTreeMap<String, TorchTimes>>> {
    #[derive(serde::Deserialize)]
    struct Report {
        models: BTreeMap<String, TorchTimes>,
    }
    let mut args = vec!["--models".to_string(), models.join(","), "--steps".into(), steps.to_string()];
    if compiled {
        args.push("--compile".into());
    }
    let report: Option<Report> = run_torch_script("torch_speed.py", &args)?;
    Ok(report.map(|r| r.models))
}

/// PyTorch's CPU training steps of a real-scale model (`scripts/peers/torch_speed.py
/// --realscale`) at `batch` on `threads` threads, run by `python` (`realscale_python`): its
/// version and the milliseconds of each of `steps` steps after 3 warm-up ones, eager or
/// (`compiled`) with `torch.compile` on the model and `opt.step`.
pub fn realscale_torch_step_times(
    python: &Path,
    model: &str,
    batch: usize,
    steps: usize,
    threads: usize,
    compiled: bool,
) -> Result<RealscaleSteps> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers/torch_speed.py");
    let mut command = Command::new(python);
    command.arg(&script).args(["--realscale", "--train-only", "--models", model]).args([
        "--batch",
        &batch.to_string(),
        "--steps",
        &steps.to_string(),
        "--threads",
        &threads.to_string(),
    ]);
    if compiled {
        command.arg("--compile-only");
    }
    let out = command.output()?;
    if !out.status.success() {
        return Err(script_error(format!("{} on {model}: {}", script.display(), tail(&out.stderr))));
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| {
        script_error(format!("{} on {model} printed no report that parses: {e}", script.display()))
    })?;
    let key = if compiled { "compile_ms" } else { "eager_ms" };
    let ms: Vec<f64> = v["models"][model][key]
        .as_array()
        .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
        .unwrap_or_default();
    if ms.is_empty() {
        return Err(script_error(format!("{} printed no {key} for {model}", script.display())));
    }
    Ok(RealscaleSteps { version: v["torch"].as_str().unwrap_or("?").to_string(), ms })
}

/// What `realscale_torch_step_times` measured.
#[derive(Clone, Debug)]
pub struct RealscaleSteps {
    /// PyTorch's version.
    pub version: String,
    /// Each timed step's wall time, ms.
    pub ms: Vec<f64>,
}

/// Runs `scripts/peers/<script>` with `args` in PyTorch's environment and parses the JSON it
/// prints; `Ok(None)` after printing `skipped: <reason>` where PyTorch cannot be had.
fn run_torch_script<R: serde::de::DeserializeOwned>(script: &str, args: &[String]) -> Result<Option<R>> {
    let python = match python_with(&TORCH_ENV) {
        Ok(p) => p,
        Err(Skip(why)) => {
            eprintln!("skipped: {why}");
            return Ok(None);
        }
    };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/peers").join(script);
    let out = Command::new(&python).arg(&script).args(args).output()?;
    if !out.status.success() {
        return Err(script_error(format!(
            "{} {} failed ({}): {}",
            python.display(),
            script.display(),
            out.status,
            tail(&out.stderr)
        )));
    }
    let report = serde_json::from_slice(&out.stdout)
        .map_err(|e| script_error(format!("{} printed no report that parses: {e}", script.display())))?;
    Ok(Some(report))
}

/// One model's PyTorch DDP figures at one rank count (`scripts/peers/torch_ddp.py`).
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct DdpTimes {
    /// Rank 0's training-step times, ms.
    pub step_ms: Vec<f64>,
    /// The gradients' bytes (what DDP all-reduces every step).
    pub grad_bytes: usize,
}

/// PyTorch DistributedDataParallel (gloo, CPU) step times for `models` at each rank count in
/// `ranks`, keyed by model then rank count; or `Ok(None)` after printing `skipped: <reason>`
/// where PyTorch cannot be had.
pub fn torch_ddp_times(
    models: &[&str],
    ranks: &[usize],
    steps: usize,
) -> Result<Option<BTreeMap<String, BTreeMap<String, DdpTimes>>>> {
    #[derive(serde::Deserialize)]
    struct Report {
        models: BTreeMap<String, BTreeMap<String, DdpTimes>>,
    }
    let ranks: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    let args = ["--models", &models.join(","), "--ranks", &ranks.join(","), "--steps", &steps.to_string()];
    let report: Option<Report> = run_torch_script("torch_ddp.py", &args.map(String::from))?;
    Ok(report.map(|r| r.models))
}

/// One model's PyTorch step times in milliseconds.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct TorchTimes {
    /// Each timed eager training step's wall time, ms.
    pub eager_ms: Vec<f64>,
    /// Each timed `torch.compile`d training step's wall time, ms; empty unless compiled ones were
    /// asked for.
    #[serde(default)]
    pub compile_ms: Vec<f64>,
    /// Forward passes (under `no_grad`), eager and compiled.
    #[serde(default)]
    pub forward_eager_ms: Vec<f64>,
    /// Each timed `torch.compile`d forward pass's wall time, ms; empty unless compiled ones were
    /// asked for.
    #[serde(default)]
    pub forward_compile_ms: Vec<f64>,
}

/// One model's JAX times in milliseconds: jitted training steps and forward passes.
#[derive(Clone, Debug, Default, serde::Deserialize)]
pub struct JaxTimes {
    /// Each timed jitted training step's wall time, ms (`train_step_ms` in the script's JSON).
    #[serde(rename = "train_step_ms")]
    pub train_ms: Vec<f64>,
    /// Each timed jitted forward pass's wall time, ms.
    #[serde(default)]
    pub forward_ms: Vec<f64>,
}

// ---------------------------------------------------------------- side by side

/// One model and mode on both sides.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PeerRow {
    /// The model's name.
    pub model: String,
    /// Whether the row is a forward pass or a training step.
    pub mode: Mode,
    /// The batch size both sides compiled for.
    pub batch: usize,
    /// Whether the model is one of kiln's zoo models (the table marks the others with `*`).
    pub in_zoo: bool,
    /// kiln's figures, read from the plan compiled with the default options.
    pub kiln: KilnFigures,
    /// XLA's figures; `None` where JAX could not be had.
    pub xla: Option<XlaFigures>,
    /// kiln planned total / XLA total.
    pub kiln_over_xla: Option<f64>,
}

impl PeerRow {
    /// The row of `m` in `mode` from both sides' figures, with kiln / XLA computed when XLA's are
    /// given.
    pub fn new(m: &PeerModel, mode: Mode, kiln: KilnFigures, xla: Option<XlaFigures>) -> Self {
        let kiln_over_xla =
            xla.as_ref().map(|x| crate::report::ratio(kiln.planned_total_bytes, x.total_bytes));
        PeerRow {
            model: m.name.to_string(),
            mode,
            batch: m.batch,
            in_zoo: m.in_zoo,
            kiln,
            xla,
            kiln_over_xla,
        }
    }
}

/// Geometric mean of kiln / XLA over the training rows that `keep` selects (None without any).
pub fn train_geomean(rows: &[PeerRow], keep: impl Fn(&PeerRow) -> bool) -> Option<f64> {
    let logs: Vec<f64> = rows
        .iter()
        .filter(|r| r.mode == Mode::Train && keep(r))
        .filter_map(|r| r.kiln_over_xla)
        .map(f64::ln)
        .collect();
    (!logs.is_empty()).then(|| (logs.iter().sum::<f64>() / logs.len() as f64).exp())
}

/// The side-by-side table, one row per model and mode.
pub fn table(rows: &[PeerRow]) -> String {
    use crate::report::bytes;
    let headers = [
        "model",
        "mode",
        "batch",
        "kiln persistent",
        "kiln arena",
        "kiln total",
        "XLA argument",
        "XLA output",
        "XLA temp",
        "XLA alias",
        "XLA total",
        "kiln/XLA",
        "XLA default",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let x = |f: fn(&XlaFigures) -> usize| r.xla.as_ref().map_or("-".to_string(), |x| bytes(f(x)));
            vec![
                if r.in_zoo { r.model.clone() } else { format!("{} *", r.model) },
                r.mode.name().to_string(),
                r.batch.to_string(),
                bytes(r.kiln.persistent_bytes),
                bytes(r.kiln.arena_bytes),
                bytes(r.kiln.planned_total_bytes),
                x(|x| x.argument_bytes),
                x(|x| x.output_bytes),
                x(|x| x.temp_bytes),
                x(|x| x.alias_bytes),
                x(|x| x.total_bytes),
                r.kiln_over_xla.map_or("-".to_string(), |v| format!("{v:.3}")),
                x(|x| x.default_flags_total_bytes),
            ]
        })
        .collect();
    crate::report::render_table(&headers, &cells)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extra_models_compile_with_the_parameters_the_script_declares() {
        // Parameter bytes as scripts/peers/xla_memory.py counts them (weights + biases, f32).
        let dense = |i: usize, o: usize| i * o + o;
        let conv = |i: usize, o: usize| 9 * i * o + o;
        let block = |d: usize, v: usize| 4 * dense(d, d) + dense(d, v) + dense(v, d) + 4 * d;
        let expected = [
            ("res-mlp", dense(784, 512) + 12 * dense(512, 512) + dense(512, 10)),
            (
                "vgg-avg",
                conv(3, 32)
                    + conv(32, 32)
                    + conv(32, 64)
                    + conv(64, 64)
                    + conv(64, 128)
                    + conv(128, 128)
                    + dense(2048, 256)
                    + dense(256, 10),
            ),
            ("transformer-2", 500 * 128 + 2 * block(128, 512) + 2 * 128 + dense(128, 500)),
        ];
        for (m, (name, params)) in extra().iter().zip(expected) {
            assert_eq!(m.name, name);
            let f = kiln_figures(m, Mode::Forward).unwrap();
            assert_eq!(f.parameter_bytes, 4 * params, "{name}");
            assert!(f.planned_total_bytes >= f.parameter_bytes);
        }
    }
}
