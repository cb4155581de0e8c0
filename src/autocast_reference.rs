//! Mixed precision held to PyTorch's autocast: two training steps of the zoo's models and the
//! GPT example from the same weights on the same batch, in f32 and in bf16, in kiln and in
//! PyTorch, and how far each bf16 run lands from PyTorch's f32 run.
//!
//! The measure is normwise, on what the two steps change: `Δ = parameters after − before`,
//! all parameters as one vector, and the error of a run is `‖Δ_run − Δ_torch_f32‖ /
//! ‖Δ_torch_f32‖`. The steps use plain SGD (`LEARNING_RATE`) whatever the model's own
//! optimizer: SGD's change is the sum of the two steps' gradients times the rate, so the error
//! is the gradients' error (Adam's first steps move each weight by about ± the rate whatever
//! its gradient, and would hide it). The batches are small (a few rows): numerics do not need
//! real ones, and the tests run in CI.
//!
//! PyTorch is not in CI, so its runs are committed: `scripts/reference/autocast.sh` writes the
//! weights and batches (`write_inputs`), runs `scripts/reference/autocast.py` (PyTorch's f32
//! step; `torch.autocast("cpu", torch.bfloat16)`, PyTorch's own CPU lists; and the CUDA autocast
//! lists applied on the CPU as the real-scale recorder does) and keeps, per model and seed, the
//! losses, each bf16 run's error (on the whole vectors) and a count sketch (`sketch`, `SKETCH`
//! buckets) of the f32 run's `Δ` in `tests/data/autocast/<model>.json`. A count sketch is
//! linear and keeps a vector's norm in expectation (each coordinate added, with a hashed sign,
//! into a hashed bucket), so kiln's error is the norm of its sketch's difference from PyTorch's
//! f32 sketch, within `sqrt(2 / SKETCH)` (12%) relative for one run and about 2% for the mean
//! over `SEEDS` runs — and 128 numbers per run instead of up to 1.9 M.
//!
//! One run's error is one draw of rounding noise: a ReLU or max-pool decision that a rounding
//! flips moves a gradient far, so single runs of the same arithmetic differ by 30% and more.
//! The check compares means over `SEEDS` starting points and batches: on the MLP, PyTorch's
//! autocast and kiln's bf16 measured 3.45% and 3.40% over 40 seeds (kiln no worse in 21 of 40).
//!
//! The weights and batches come from a hash of each parameter's key and each element's index
//! (`portable`), not from kiln's initializers, so the committed reference holds as long as the
//! models keep their parameter keys and shapes.

use crate::error::Result;
use crate::{gpt, zoo};
use kiln_compiler::Precision;
use kiln_compiler::ir::{Op, Shape, VarRole};
use kiln_compiler::losses::Loss;
use kiln_compiler::nn::Sequential;
use kiln_compiler::optim::Sgd;
use kiln_compiler::step::{InputSpec, TrainConfig, train_step_graph};
use kiln_runtime::{CpuBackend, HostTensor, RuntimeError, Trainer, checkpoint};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

/// Buckets of each run's count sketch.
pub const SKETCH: usize = 128;
/// Training steps of each run.
pub const STEPS: usize = 2;
/// Starting points and batches of each model (the check compares mean errors over them).
pub const SEEDS: usize = 32;
/// SGD's rate in every run.
pub const LEARNING_RATE: f32 = 0.05;

/// One model of the check: the model, its loss with SGD, and its batch.
pub struct Case {
    /// The zoo's name of the model, or `gpt`.
    pub name: &'static str,
    /// Which of the `SEEDS` starting points and batches.
    pub seed: usize,
    /// Builds the model.
    pub model: fn() -> Sequential,
    /// The model's loss and metrics with SGD at `LEARNING_RATE`.
    pub config: TrainConfig,
    /// The inputs of the batch.
    pub x: HostTensor,
    /// The targets of the batch.
    pub y: HostTensor,
}

/// The models of the check, the zoo's four and the GPT example, each from `SEEDS` starting
/// points and batches of a few rows.
pub fn cases() -> Result<Vec<Case>> {
    let mut all = Vec::new();
    for seed in 0..SEEDS {
        all.extend(cases_from(seed)?);
    }
    Ok(all)
}

/// The models from starting point and batch `seed`.
fn cases_from(seed: usize) -> Result<Vec<Case>> {
    let key = |name: &str| format!("{seed}/{name}");
    let sgd = |loss: Loss| TrainConfig { loss, optimizer: Sgd::new(LEARNING_RATE).into(), metrics: vec![] };
    let one_hot = |key: &str, rows: usize, classes: usize| {
        HostTensor::from_fn(Shape::new([rows, classes]), |i| {
            let class = (splitmix64(fnv1a(key) ^ (i / classes) as u64) % classes as u64) as usize;
            if i % classes == class { 1.0 } else { 0.0 }
        })
    };
    let uniform = |key: &str, shape: &[usize]| HostTensor::from_fn(Shape::new(shape), |i| portable(key, i));
    let ids = |key: &str, shape: &[usize], vocab: usize| {
        let n: usize = shape.iter().product();
        (0..n).map(|i| (splitmix64(fnv1a(key) ^ i as u64) % vocab as u64) as i32).collect::<Vec<_>>()
    };
    let (tv, ts) = (zoo::TRANSFORMER_VOCAB, zoo::TRANSFORMER_SEQ);
    let transformer_y = {
        let t = one_hot(&key("transformer/y"), 2 * ts, tv)?;
        HostTensor::new(Shape::new([2, ts, tv]), t.into_data())?
    };
    let transformer_x = ids(&key("transformer/x"), &[2, ts], tv).into_iter().map(|v| v as f32).collect();
    Ok(vec![
        Case {
            name: "seed-mlp",
            seed,
            model: zoo::seed_mlp,
            config: sgd(Loss::BinaryCrossEntropy),
            x: uniform(&key("seed-mlp/x"), &[8, 100])?,
            y: HostTensor::from_fn(Shape::new([8, 1]), |i| {
                (splitmix64(fnv1a(&key("seed-mlp/y")) ^ i as u64) % 2) as f32
            })?,
        },
        Case {
            name: "mlp",
            seed,
            model: zoo::mlp,
            config: sgd(Loss::SoftmaxCrossEntropy),
            x: uniform(&key("mlp/x"), &[8, 784])?,
            y: one_hot(&key("mlp/y"), 8, 10)?,
        },
        Case {
            name: "cnn",
            seed,
            model: zoo::cnn,
            config: sgd(Loss::SoftmaxCrossEntropy),
            x: uniform(&key("cnn/x"), &[4, 32, 32, 3])?,
            y: one_hot(&key("cnn/y"), 4, 10)?,
        },
        Case {
            name: "transformer",
            seed,
            model: zoo::transformer,
            config: sgd(Loss::SoftmaxCrossEntropy),
            x: HostTensor::new(Shape::new([2, ts]), transformer_x)?,
            y: transformer_y,
        },
        Case {
            name: "gpt",
            seed,
            model: gpt::model,
            config: sgd(Loss::SparseSoftmaxCrossEntropy { ignore_index: None }),
            x: HostTensor::from_i32(
                Shape::new([2, gpt::SEQ]),
                ids(&key("gpt/x"), &[2, gpt::SEQ], gpt::VOCAB),
            )?,
            y: HostTensor::from_i32(
                Shape::new([2, gpt::SEQ]),
                ids(&key("gpt/y"), &[2, gpt::SEQ], gpt::VOCAB),
            )?,
        },
    ])
}

/// FNV-1a of a key's bytes: the seed of its values.
fn fnv1a(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// SplitMix64's output function: a well-mixed 64-bit hash of `x`.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Element `i` of the value named `key`: uniform in [-1, 1), from their hash alone.
pub fn portable(key: &str, i: usize) -> f32 {
    let bits = splitmix64(fnv1a(key) ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 40;
    (bits as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

impl Case {
    /// The directory of this case's files: `<name>-<seed>`.
    pub fn dir(&self) -> String {
        format!("{}-{}", self.name, self.seed)
    }
}

/// The parameters' keys and shapes of `case`'s training step.
pub fn parameters(case: &Case) -> Result<Vec<(String, Shape)>> {
    let spec = |t: &HostTensor| InputSpec::new(t.shape().clone(), t.dtype());
    let graph = train_step_graph(&(case.model)(), spec(&case.x), spec(&case.y), &case.config)?;
    let mut out: Vec<(String, Shape)> = graph
        .variables()
        .into_iter()
        .filter_map(|v| match &graph.node(v).op {
            Op::Variable { key, role: VarRole::Parameter, .. } => {
                Some((key.clone(), graph.node(v).shape.clone()))
            }
            _ => None,
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The starting weights of `case`: each matrix or kernel uniform in ±sqrt(3 / fan-in) (fan-in:
/// every axis but the last), each norm's scale 1 ± 0.1 and each other vector ± 0.1, from
/// `portable`.
pub fn weights(case: &Case) -> Result<Vec<(String, HostTensor)>> {
    parameters(case)?
        .into_iter()
        .map(|(key, shape)| {
            let dims = shape.dims().to_vec();
            let (scale, offset) = match dims.len() {
                0 | 1 if key.ends_with("gamma") => (0.1, 1.0),
                0 | 1 => (0.1, 0.0),
                n => ((3.0 / dims[..n - 1].iter().product::<usize>().max(1) as f32).sqrt(), 0.0),
            };
            let t = HostTensor::from_fn(shape, |i| {
                offset + scale * portable(&format!("{}/{key}", case.seed), i)
            })?;
            Ok((key, t))
        })
        .collect()
}

/// The losses and parameter change of one run of `STEPS` steps.
pub struct Run {
    /// The loss of each step (at the weights before its update).
    pub losses: Vec<f32>,
    /// The parameters after the steps minus before, by key.
    pub change: BTreeMap<String, HostTensor>,
}

/// `case` trained `STEPS` steps on the CPU in `precision` from `weights(case)`; `scratch` is a
/// directory for the weights' file.
pub fn run(case: &Case, precision: Precision, scratch: &Path) -> Result<Run> {
    let weights = weights(case)?;
    let start = scratch.join(format!("{}-start.safetensors", case.dir()));
    checkpoint::save(&start, &weights)?;
    let mut trainer = Trainer::new((case.model)(), case.config.clone(), Box::new(CpuBackend::new(0)))
        .with_precision(precision);
    let spec = |t: &HostTensor| InputSpec::new(t.shape().clone(), t.dtype());
    trainer.train_program(spec(&case.x), spec(&case.y))?;
    trainer.load_weights(&start)?;
    let losses =
        (0..STEPS).map(|_| Ok(trainer.train_step(&case.x, &case.y)?.loss)).collect::<Result<Vec<_>>>()?;
    let end = scratch.join(format!("{}-{precision}-end.safetensors", case.dir()));
    trainer.save(&end)?;
    let after = checkpoint::read(&end)?.tensors;
    Ok(Run { losses, change: difference(&after, &weights)? })
}

/// `after − before` for every key of `before`; an error naming a key `after` lacks or shapes
/// differently.
pub fn difference(
    after: &BTreeMap<String, HostTensor>,
    before: &[(String, HostTensor)],
) -> Result<BTreeMap<String, HostTensor>> {
    before
        .iter()
        .map(|(key, b)| {
            let a = after.get(key).filter(|a| a.shape() == b.shape()).ok_or_else(|| {
                RuntimeError::invalid(
                    format!("the run's parameters lack `{key}` {} (or hold another shape)", b.shape()),
                    "regenerate the reference with scripts/reference/autocast.sh",
                )
            })?;
            let d = a.data().iter().zip(b.data()).map(|(a, b)| a - b).collect();
            Ok((key.clone(), HostTensor::new(b.shape().clone(), d)?))
        })
        .collect()
}

/// The count sketch of `change`'s values, keys in order, each tensor row-major: coordinate `i`
/// of the whole vector is added, with a sign from its hash, to bucket `hash(i) % SKETCH`.
pub fn sketch(change: &BTreeMap<String, HostTensor>) -> Vec<f64> {
    let mut buckets = vec![0.0f64; SKETCH];
    for (i, &v) in change.values().flat_map(|t| t.data().iter()).enumerate() {
        let h = splitmix64(i as u64 ^ 0x6b69_6c6e);
        let sign = if h >> 63 == 1 { -1.0 } else { 1.0 };
        buckets[(h % SKETCH as u64) as usize] += sign * f64::from(v);
    }
    buckets
}

/// The Euclidean norm of `a − b` (sketches of the same length).
pub fn distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum::<f64>().sqrt()
}

/// The Euclidean norm of `a`.
pub fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// PyTorch's runs of one model, as committed in `tests/data/autocast/<model>.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Reference {
    /// The model's name.
    pub model: String,
    /// The PyTorch version that ran.
    pub torch: String,
    /// Training steps of each run.
    pub steps: usize,
    /// SGD's rate.
    pub learning_rate: f32,
    /// The runs from each starting point and batch, by seed.
    pub seeds: Vec<Runs>,
}

/// PyTorch's runs from one starting point and batch: `f32`, `bf16-cpu`
/// (`torch.autocast("cpu", torch.bfloat16)`) and `bf16-cuda-lists`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Runs {
    /// Each run's losses, by run.
    pub losses: BTreeMap<String, Vec<f32>>,
    /// The count sketch of the f32 run's parameter change (stored as f32).
    pub f32_sketch: Vec<f32>,
    /// Each half run's error against the f32 run, `‖Δ_run − Δ_f32‖ / ‖Δ_f32‖`, computed on
    /// the whole vectors (no sketch), by run.
    pub errors: BTreeMap<String, f64>,
}

/// The committed reference's path for `model`.
pub fn reference_path(model: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/autocast").join(format!("{model}.json"))
}

/// Reads the committed reference of `model`.
pub fn read_reference(model: &str) -> Result<Reference> {
    let path = reference_path(model);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        RuntimeError::invalid(
            format!("cannot read {}: {e}", path.display()),
            "run from a checkout of the repository (scripts/reference/autocast.sh writes the file)",
        )
    })?;
    serde_json::from_str(&text).map_err(|e| {
        RuntimeError::invalid(
            format!("{}: {e}", path.display()),
            "regenerate it with scripts/reference/autocast.sh",
        )
        .into()
    })
}

/// Writes, for PyTorch, each case's starting weights (`<dir>/<name>-<seed>/start.safetensors`)
/// and batch (`batch.safetensors`: `x` and `y` as f32; ids are exact in f32).
pub fn write_inputs(dir: &Path) -> Result<()> {
    for case in cases()? {
        let at = dir.join(case.dir());
        std::fs::create_dir_all(&at).map_err(|e| {
            RuntimeError::invalid(format!("cannot create {}: {e}", at.display()), "pass a writable directory")
        })?;
        checkpoint::save(&at.join("start.safetensors"), &weights(&case)?)?;
        let f32_copy = |t: &HostTensor| HostTensor::new(t.shape().clone(), t.data().to_vec());
        checkpoint::save(
            &at.join("batch.safetensors"),
            &[("x".into(), f32_copy(&case.x)?), ("y".into(), f32_copy(&case.y)?)],
        )?;
    }
    Ok(())
}

/// Reads PyTorch's runs of each case from `<dir>/<name>-<seed>/torch.json` (losses by run, the
/// version) and `<run>.safetensors` (the parameters after the steps) and writes each model's
/// reference file.
pub fn write_references(dir: &Path) -> Result<()> {
    #[derive(Deserialize)]
    struct TorchRuns {
        torch: String,
        losses: BTreeMap<String, Vec<f32>>,
    }
    let mut references: BTreeMap<&str, Reference> = BTreeMap::new();
    for case in cases()? {
        let at = dir.join(case.dir());
        let file = at.join("torch.json");
        let text = std::fs::read_to_string(&file).map_err(|e| {
            RuntimeError::invalid(
                format!("{}: {e}", file.display()),
                "run scripts/reference/autocast.py first",
            )
        })?;
        let runs: TorchRuns = serde_json::from_str(&text)
            .map_err(|e| RuntimeError::invalid(format!("{}: {e}", file.display()), "rerun the script"))?;
        let start = weights(&case)?;
        let change = |run: &str| -> Result<BTreeMap<String, HostTensor>> {
            difference(&checkpoint::read(&at.join(format!("{run}.safetensors")))?.tensors, &start)
        };
        let flat = |d: &BTreeMap<String, HostTensor>| -> Vec<f64> {
            d.values().flat_map(|t| t.data().iter().map(|&v| f64::from(v))).collect()
        };
        let f32_change = change("f32")?;
        let f32_flat = flat(&f32_change);
        let mut errors = BTreeMap::new();
        for run in runs.losses.keys().filter(|r| *r != "f32") {
            errors.insert(run.clone(), distance(&flat(&change(run)?), &f32_flat) / norm(&f32_flat));
        }
        let f32_sketch = sketch(&f32_change).into_iter().map(|v| v as f32).collect();
        let reference = references.entry(case.name).or_insert_with(|| Reference {
            model: case.name.into(),
            torch: runs.torch.clone(),
            steps: STEPS,
            learning_rate: LEARNING_RATE,
            seeds: vec![],
        });
        reference.seeds.push(Runs { losses: runs.losses, f32_sketch, errors });
    }
    for (name, reference) in references {
        let path = reference_path(name);
        let json = serde_json::to_string(&reference)
            .map_err(|e| RuntimeError::invalid(format!("{name}: {e}"), "a reference always serialises"))?;
        std::fs::write(&path, json + "\n").map_err(|e| {
            RuntimeError::invalid(format!("cannot write {}: {e}", path.display()), "run from a checkout")
        })?;
    }
    Ok(())
}
