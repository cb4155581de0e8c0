//! Checkpoints: every variable a trainer holds (parameters, optimizer state, the iteration
//! counter) in one safetensors file, the format PyTorch, JAX (flax), Keras 3 and Hugging Face
//! read and write: tensors by name, f32, little-endian, row-major, and a JSON header.
//!
//! Why safetensors: it is a plain, checked container (no code runs on load, unlike a pickle),
//! other tools open it, and a kiln variable's key ("dense/kernel", "optimizer/dense/kernel/m")
//! is its tensor name, so a checkpoint is readable as is. Loading compares the file with the
//! variables the trainer's plans declare and names every difference (missing, unexpected,
//! another shape or dtype) in one error, before anything is written: a half-loaded model
//! would train on silently.

use crate::error::{Result, RuntimeError};
use crate::tensor::HostTensor;
use kiln_compiler::ir::Shape;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// The header's metadata, so that a file says what wrote it.
const FORMAT: (&str, &str) = ("format", "kiln checkpoint 1");

/// Writes `variables` (name, value) to `path` as safetensors.
pub fn save(path: &Path, variables: &[(String, HostTensor)]) -> Result<()> {
    // The views borrow the tensors' bytes (kiln's targets are little-endian, as safetensors
    // stores f32): nothing is copied before the file is written.
    let views = variables
        .iter()
        .map(|(k, t)| {
            TensorView::new(Dtype::F32, t.shape().dims().to_vec(), bytemuck::cast_slice(t.data()))
                .map(|v| (k.as_str(), v))
                .map_err(|e| {
                    RuntimeError::invalid(format!("checkpoint tensor `{k}`: {e}"), "report this as a bug")
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let metadata = HashMap::from([(FORMAT.0.to_string(), FORMAT.1.to_string())]);
    safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| {
        RuntimeError::invalid(
            format!("cannot write the checkpoint {}: {e}", path.display()),
            "check that the directory exists and is writable",
        )
    })
}

/// A checkpoint read from disk: its f32 tensors by name, and the names of tensors of another
/// dtype (with it), which no kiln variable can take.
#[derive(Debug)]
pub struct Checkpoint {
    pub tensors: BTreeMap<String, HostTensor>,
    pub other_dtypes: BTreeMap<String, String>,
}

/// Reads the safetensors file at `path`.
pub fn read(path: &Path) -> Result<Checkpoint> {
    let bytes = std::fs::read(path).map_err(|e| {
        RuntimeError::invalid(format!("cannot read the checkpoint {}: {e}", path.display()), "check the path")
    })?;
    let file = SafeTensors::deserialize(&bytes).map_err(|e| {
        RuntimeError::invalid(
            format!("{} is not a safetensors file: {e}", path.display()),
            "load a file written by `Trainer::save` (or any safetensors writer)",
        )
    })?;
    let mut tensors = BTreeMap::new();
    let mut other_dtypes = BTreeMap::new();
    for (name, view) in file.tensors() {
        if view.dtype() != Dtype::F32 {
            other_dtypes.insert(name, format!("{:?}", view.dtype()));
            continue;
        }
        // The data of an f32 view is 4 bytes per element (checked by `deserialize`); copied,
        // since a file's bytes need not be 4-byte aligned.
        let data: Vec<f32> =
            view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        tensors.insert(name, HostTensor::new(Shape::from(view.shape()), data)?);
    }
    Ok(Checkpoint { tensors, other_dtypes })
}

impl Checkpoint {
    /// Every difference between this file and the variables `expected` (name and shape): names
    /// the model has and the file lacks, names the file has and the model lacks, shapes and
    /// dtypes that differ. Empty when the file fits.
    pub fn differences(&self, expected: &BTreeMap<String, Shape>) -> Vec<String> {
        let mut out = Vec::new();
        for (key, shape) in expected {
            match (self.tensors.get(key), self.other_dtypes.get(key)) {
                (Some(t), _) if t.shape() != shape => {
                    out.push(format!("`{key}` is {} in the file, {shape} in the model", t.shape()))
                }
                (Some(_), _) => {}
                (None, Some(dtype)) => {
                    out.push(format!("`{key}` is {dtype} in the file; kiln's variables are F32"))
                }
                (None, None) => out.push(format!("`{key}` ({shape}) is missing from the file")),
            }
        }
        for key in self.tensors.keys().chain(self.other_dtypes.keys()) {
            if !expected.contains_key(key) {
                out.push(format!("`{key}` is in the file but not in the model"));
            }
        }
        out
    }
}
