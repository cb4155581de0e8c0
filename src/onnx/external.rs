//! Tensors stored outside the model file (ONNX's external data): every model over protobuf's
//! 2 GB limit keeps its weights so, each tensor naming a file beside the model (`location`), an
//! `offset` and a `length` in bytes (`TensorProto.external_data`).
//!
//! `location` is resolved only inside the model file's directory, as onnx's checker requires:
//! an absolute path, a `..` component, a symbolic link, or any path whose canonical form is not
//! inside the model directory's canonical form is refused, so that a file cannot make kiln read
//! what lies elsewhere. The range must lie inside the file and be exactly the tensor's shape times
//! its element size.
//!
//! Each data file is mapped into memory once (`memmap2`) and each tensor's `raw_data` becomes a
//! view of its range (`Bytes::from_owner`): nothing is copied until the importer converts the
//! values, and the map lives as long as a view does. The documented caveat of a memory map: a
//! file truncated or rewritten by another process while it is mapped changes (or faults) what
//! the views read; kiln maps read-only and reads the data at import.

use super::check::{element_bytes, type_name};
use super::invalid;
use super::proto::{self, ModelProto, TensorProto};
use crate::error::{Error, Result};
use prost::bytes::Bytes;
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};

/// Reads the external data of every tensor of `model` (initializers and node attributes) from
/// the directory of `file`; without a file (a model given as bytes) such a tensor is an error.
pub(crate) fn resolve(model: &mut ModelProto, file: Option<&Path>) -> Result<()> {
    let Some(graph) = model.graph.as_mut() else { return Ok(()) };
    let mut files = Files { model: file, maps: HashMap::new() };
    for t in &mut graph.initializer {
        files.load(t)?;
    }
    for node in &mut graph.node {
        for a in &mut node.attribute {
            if let Some(t) = a.t.as_mut() {
                files.load(t)?;
            }
        }
    }
    Ok(())
}

/// The model's file and the data files mapped so far, by canonical path.
struct Files<'a> {
    model: Option<&'a Path>,
    maps: HashMap<PathBuf, Bytes>,
}

impl Files<'_> {
    fn error(&self, what: impl std::fmt::Display, help: impl Into<String>) -> Error {
        let prefix = self.model.map(|p| format!("{}: ", p.display())).unwrap_or_default();
        invalid(format!("{prefix}{what}"), help)
    }

    /// Makes an external tensor's `raw_data` the bytes it names.
    fn load(&mut self, t: &mut TensorProto) -> Result<()> {
        if t.data_location != Some(proto::EXTERNAL) {
            return Ok(());
        }
        let name = t.name.clone().unwrap_or_default();
        let entry = |key: &str| {
            t.external_data
                .iter()
                .find(|e| e.key.as_deref() == Some(key))
                .map(|e| e.value.clone().unwrap_or_default())
        };
        let Some(location) = entry("location") else {
            return Err(self.error(
                format!("TensorProto ( tensor name: {name}) is stored externally but doesn't have a location."),
                "save the model with onnx.save_model(..., save_as_external_data=True), which writes each location",
            ));
        };
        let has_inline = t.raw_data.as_ref().is_some_and(|r| !r.is_empty())
            || !t.float_data.is_empty()
            || !t.int32_data.is_empty()
            || !t.int64_data.is_empty()
            || !t.double_data.is_empty();
        if has_inline {
            return Err(self.error(
                format!("Data of TensorProto ( tensor name: {name}) is stored externally and should not have data field."),
                "keep the tensor's values in one place: the external file or the tensor",
            ));
        }
        let number = |key: &str| -> Result<Option<u64>> {
            match entry(key) {
                None => Ok(None),
                Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    self.error(
                        format!("tensor `{name}`: its external data's {key} is {v:?}, not a number of bytes"),
                        "the file is damaged",
                    )
                }),
            }
        };
        let (offset, length) = (number("offset")?.unwrap_or(0), number("length")?);
        let Some(model) = self.model else {
            return Err(self.error(
                format!("tensor `{name}` keeps its data in the external file `{location}`, and the model was given as bytes"),
                "read the model from its path, which locates the data files beside it: \
                 `kiln::onnx::import_file`, `OnnxModel::open` (for `onnx::train`) or `OnnxLayer::open`",
            ));
        };
        let dir = match model.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let path = self.locate(&name, &location, &dir)?;
        let data_type = t.data_type.unwrap_or(0);
        let Some(element) = element_bytes(data_type) else {
            return Err(super::unsupported(
                format!("tensor `{name}` of {} keeps its data in an external file", type_name(data_type)),
                "kiln reads external data of whole-byte numeric types",
            ));
        };
        let dims = super::tensor_dims(t)?;
        let expected = dims.iter().try_fold(element as u64, |a, &d| a.checked_mul(d as u64));
        let Some(expected) = expected else {
            return Err(self.error(
                format!("tensor `{name}` of shape {dims:?} holds more bytes than a u64 counts"),
                "the file is damaged",
            ));
        };
        if let Some(length) = length.filter(|&l| l != expected) {
            return Err(self.error(
                format!(
                    "tensor `{name}`: its external data's length is {length} bytes, but its shape {dims:?} of {} \
                     ({element} bytes each) holds {expected}",
                    type_name(data_type)
                ),
                "the data file and the model disagree: save them together again (onnx.save_model)",
            ));
        }
        let data = self.map(&path, &name)?;
        let size = data.len() as u64;
        let end = offset.checked_add(expected).filter(|&end| end <= size);
        let Some(end) = end else {
            return Err(self.error(
                format!(
                    "tensor `{name}`: its external data at offset {offset}, {expected} bytes long, runs past the end \
                     of `{location}` ({size} bytes)"
                ),
                "the data file is truncated or not the model's: save them together again (onnx.save_model)",
            ));
        };
        // Both within `size`, which is a usize (the map's length).
        t.raw_data = Some(data.slice(offset as usize..end as usize));
        t.data_location = Some(proto::DEFAULT);
        t.external_data.clear();
        Ok(())
    }

    /// The data file `location` inside `dir`, refused outside it.
    fn locate(&self, name: &str, location: &str, dir: &Path) -> Result<PathBuf> {
        let help = "keep the data files in the model's directory, named relative to it (as \
                    onnx.save_model(..., save_as_external_data=True) writes them)";
        if location.is_empty() {
            return Err(self.error(
                format!("Location of external TensorProto ( tensor name: {name}) should not be empty."),
                help,
            ));
        }
        let relative = Path::new(location);
        if relative.is_absolute() || relative.has_root() || location.starts_with('/') {
            return Err(self.error(
                format!(
                    "Location of external TensorProto ( tensor name: {name}) should be a relative path, but it is an \
                     absolute path: {location}"
                ),
                help,
            ));
        }
        let outside = || {
            self.error(
                format!(
                    "Data of TensorProto ( tensor name: {name}) should be file inside the {}, but the '{location}' \
                     points outside the directory",
                    dir.display()
                ),
                help,
            )
        };
        if relative.components().any(|c| !matches!(c, Component::Normal(_) | Component::CurDir)) {
            return Err(outside());
        }
        let path = dir.join(relative);
        let missing = |e: std::io::Error| {
            self.error(
                format!(
                    "Data of TensorProto ( tensor name: {name}) should be stored in {}, but it doesn't exist or is \
                     not accessible. ({e})",
                    path.display()
                ),
                "keep the data files beside the model",
            )
        };
        let meta = std::fs::symlink_metadata(&path).map_err(missing)?;
        if !meta.file_type().is_file() {
            return Err(self.error(
                format!(
                    "Data of TensorProto ( tensor name: {name}) should be stored in {}, but it is not regular file.",
                    path.display()
                ),
                format!("{help}; a symbolic link is not followed"),
            ));
        }
        // A directory on the way may be a link: the canonical path must stay inside.
        let (canonical, root) = (path.canonicalize().map_err(missing)?, dir.canonicalize().map_err(missing)?);
        if !canonical.starts_with(&root) {
            return Err(outside());
        }
        Ok(canonical)
    }

    /// The bytes of the data file at canonical `path`, mapped once.
    fn map(&mut self, path: &Path, name: &str) -> Result<Bytes> {
        if let Some(b) = self.maps.get(path) {
            return Ok(b.clone());
        }
        let unreadable = |e: std::io::Error| {
            self.error(
                format!("tensor `{name}`: cannot read its external data {}: {e}", path.display()),
                "check the data file's permissions",
            )
        };
        let file = std::fs::File::open(path).map_err(unreadable)?;
        // SAFETY: `Mmap::map` is unsafe because the mapped bytes may change while they are
        // borrowed as a `&[u8]` if the file is modified. The file was opened read-only just
        // above, after `locate` established that it is a regular file (no link, no device)
        // inside the model's directory; every view handed out is a sub-range of the map's own
        // length (checked against `data.len()` in `load`), so no read goes past the mapping.
        // What no check can exclude is another process truncating or rewriting the file while
        // it is mapped: that is memmap2's documented caveat, accepted here as by every
        // memory-mapping loader (safetensors, onnxruntime) and stated in this module's docs.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(unreadable)?;
        let bytes = Bytes::from_owner(map);
        self.maps.insert(path.to_path_buf(), bytes.clone());
        Ok(bytes)
    }
}
