//! Named tensors in files, as `kiln run` and `kiln train --data` read and write them: NumPy's
//! `.npz` (`np.savez`, `npz`) and `.npy` (one array, named after the file), and safetensors
//! (checked as a checkpoint is, `kiln_runtime::checkpoint::read`, its integer tensors read after).
//! A file is told by its first bytes, not its name: a zip archive is an `.npz`, `\x93NUMPY` an
//! `.npy`, anything else a safetensors file. Outputs are written by extension: `.npz`, `.npy`
//! (one tensor) or `.safetensors`.

use crate::error::Result;
use kiln_compiler::ir::{DType, Shape};
use kiln_runtime::HostTensor;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;

use super::bad_input as invalid;

/// Whether the file at `path` starts with `magic`.
fn starts_with(path: &Path, magic: &[u8]) -> bool {
    let mut head = vec![0u8; magic.len()];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut head)).is_ok() && head == magic
}

/// Every tensor of the `.npz`, `.npy` or safetensors file at `path`, by name: an `.npz` array's
/// name as stored (without `.npy`), an `.npy` file's stem, a safetensors tensor's key. F32,
/// F16 and BF16 (read as f32), I32, I64 and BOOL, and in `.npz` and `.npy` float64 (rounded to
/// f32); anything else is an error naming the tensor.
pub fn read(path: &Path) -> Result<BTreeMap<String, HostTensor>> {
    if super::npz::is_npz(path) {
        return Ok(super::npz::read(path)?.into_iter().collect());
    }
    if starts_with(path, b"\x93NUMPY") {
        let bytes = std::fs::read(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display()), "check the path"))?;
        let name = path.file_stem().map_or("x".into(), |s| s.to_string_lossy().into_owned());
        let t = super::npz::array(&bytes)
            .map_err(|why| invalid(format!("{}: {why}", path.display()), super::npz::HELP))?;
        return Ok(BTreeMap::from([(name, t)]));
    }
    let checkpoint = kiln_runtime::checkpoint::read(path)?;
    let mut tensors = checkpoint.tensors;
    if !checkpoint.other_dtypes.is_empty() {
        tensors.extend(read_exact_tensors(path, &checkpoint.other_dtypes)?);
    }
    Ok(tensors.into_iter().collect())
}

/// The tensors `dtypes` names (all of the file's tensors that are not F32, F16 or BF16), read
/// from the safetensors file at `path`, whose header `checkpoint::read` has checked: I32, I64
/// and BOOL.
fn read_exact_tensors(path: &Path, dtypes: &BTreeMap<String, String>) -> Result<Vec<(String, HostTensor)>> {
    let bytes = std::fs::read(path)
        .map_err(|e| invalid(format!("cannot read {}: {e}", path.display()), "check the path of the file"))?;
    let malformed = || {
        invalid(format!("{} is not a safetensors file", path.display()), "write it with a safetensors writer")
    };
    let n = bytes.get(..8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes).ok_or_else(malformed)?;
    let header_end = usize::try_from(n).ok().and_then(|n| n.checked_add(8)).ok_or_else(malformed)?;
    let header: serde_json::Value =
        serde_json::from_slice(bytes.get(8..header_end).ok_or_else(malformed)?).map_err(|_| malformed())?;
    let mut out = Vec::new();
    for (name, dtype) in dtypes {
        let dtype = match dtype.as_str() {
            "I32" => DType::I32,
            "I64" => DType::I64,
            "BOOL" => DType::Bool,
            other => {
                return Err(invalid(
                    format!("{}: tensor `{name}` is {other}", path.display()),
                    "store tensors as F32, F16, BF16, I32, I64 or BOOL",
                ));
            }
        };
        let entry = &header[name.as_str()];
        let dims: Option<Vec<usize>> = entry["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok())).collect());
        let range = entry["data_offsets"].as_array().and_then(|a| match a.as_slice() {
            [b, e] => Some((usize::try_from(b.as_u64()?).ok()?, usize::try_from(e.as_u64()?).ok()?)),
            _ => None,
        });
        let (Some(dims), Some((b, e))) = (dims, range) else { return Err(malformed()) };
        let data = header_end
            .checked_add(b)
            .zip(header_end.checked_add(e))
            .and_then(|(b, e)| bytes.get(b..e))
            .ok_or_else(malformed)?;
        out.push((name.clone(), HostTensor::from_bytes(Shape::new(dims), dtype, data)?));
    }
    Ok(out)
}

/// Writes `tensors` to `path` by its extension: `.npz` (`np.load` reads it, each tensor an array
/// of its name), `.npy` (exactly one tensor) or `.safetensors` (f32 tensors only: another type
/// is an error naming the tensor). Each tensor keeps its dtype in `.npz` and `.npy` (f32, i32,
/// i64, bool).
pub fn write(path: &Path, tensors: &[(String, HostTensor)]) -> Result<()> {
    let shown = path.display();
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let failed = |e: std::io::Error| invalid(format!("cannot write {shown}: {e}"), "check the output path");
    match ext.as_str() {
        "npz" => {
            let file = std::fs::File::create(path).map_err(failed)?;
            let mut zip = zip::ZipWriter::new(file);
            let options =
                zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
            for (name, t) in tensors {
                let bytes = npy(t).map_err(failed)?;
                zip.start_file(format!("{name}.npy"), options)
                    .map_err(|e| invalid(format!("cannot write {shown}: {e}"), "check the output path"))?;
                zip.write_all(&bytes).map_err(failed)?;
            }
            zip.finish()
                .map_err(|e| invalid(format!("cannot write {shown}: {e}"), "check the output path"))?;
            Ok(())
        }
        "npy" => match tensors {
            [(_, t)] => std::fs::write(path, npy(t).map_err(failed)?).map_err(failed),
            _ => Err(invalid(
                format!("{shown}: an .npy file holds one array, and there are {} outputs", tensors.len()),
                "write them to an .npz file",
            )),
        },
        "safetensors" => match tensors.iter().find(|(_, t)| t.dtype() != DType::F32) {
            // A checkpoint stores f32: an id or a mask would come back as floats.
            Some((name, t)) => Err(invalid(
                format!("{shown}: `{name}` is {}, and kiln writes safetensors of f32 tensors", t.dtype()),
                "write the outputs to an .npz file, which keeps each tensor's type",
            )),
            None => Ok(kiln_runtime::checkpoint::save(path, tensors)?),
        },
        _ => Err(invalid(
            format!("{shown}: no writer for the extension `.{ext}`"),
            "name the output file .npz, .npy or .safetensors",
        )),
    }
}

/// `t` as the bytes of an `.npy` file, in its own dtype.
fn npy(t: &HostTensor) -> std::io::Result<Vec<u8>> {
    let dims: Vec<u64> = t.shape().dims().iter().map(|&d| d as u64).collect();
    let ints = t.ints().unwrap_or(&[]);
    match t.dtype() {
        DType::I32 => npy_of(&dims, ints.iter().map(|&v| v as i32)),
        DType::I64 => npy_of(&dims, ints.iter().copied()),
        DType::Bool => npy_of(&dims, ints.iter().map(|&v| v != 0)),
        _ => npy_of(&dims, t.data().iter().copied()),
    }
}

/// An `.npy` file of `dims` holding `values`, in their NumPy type.
fn npy_of<T: npyz::AutoSerialize>(
    dims: &[u64],
    values: impl IntoIterator<Item = T>,
) -> std::io::Result<Vec<u8>> {
    use npyz::WriterBuilder;
    let mut bytes = Vec::new();
    let mut w = npyz::WriteOptions::new().default_dtype().shape(dims).writer(&mut bytes).begin_nd()?;
    w.extend(values)?;
    w.finish()?;
    Ok(bytes)
}
