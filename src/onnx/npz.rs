//! NumPy's `.npz` archives for `kiln train --data` and `kiln run --input`: a zip archive (`np.savez`, stored, or
//! `np.savez_compressed`, deflated) of `.npy` arrays, one per model input and the targets `y`.
//!
//! The archive is read with the `zip` crate and each array's header with `npyz`; the data after
//! the header is taken as it is stored. Accepted: little-endian (or one-byte) `float32`,
//! `int32`, `int64` and `bool` arrays in C order (and `float64`, NumPy's default, rounded to
//! f32, and `float16`, widened), whose stored bytes are exactly their shape's
//! (checked before any tensor is made, so a header that claims more than the file holds is an
//! error, not an allocation). Anything else is an error naming the array and saying how to write
//! it.

use crate::error::Result;
use kiln_compiler::ir::{DType, Shape};
use kiln_runtime::HostTensor;
use npyz::{Order, TypeChar};
use std::io::Read;
use std::path::Path;

/// Whether the file at `path` starts as a zip archive does (an `.npz`).
pub fn is_npz(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut magic)).is_ok() && magic == *b"PK\x03\x04"
}

use super::bad_input as invalid;

/// Every array of the `.npz` file at `path`, named as stored (without `.npy`), in the
/// archive's order.
pub fn read(path: &Path) -> Result<Vec<(String, HostTensor)>> {
    let shown = path.display();
    let file = std::fs::File::open(path)
        .map_err(|e| invalid(format!("cannot read {shown}: {e}"), "check the path of the file"))?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| {
        invalid(
            format!("{shown} is not an .npz archive: {e}"),
            "write it with np.savez or np.savez_compressed",
        )
    })?;
    let mut out = Vec::with_capacity(archive.len());
    for i in 0..archive.len() {
        let mut entry = archive.by_index(i).map_err(|e| {
            invalid(format!("{shown}: entry {i} cannot be read: {e}"), "write it with np.savez")
        })?;
        let stored = entry.name().map_err(|e| {
            invalid(format!("{shown}: entry {i} has no readable name: {e}"), "write it with np.savez")
        })?;
        let name = stored.strip_suffix(".npy").unwrap_or(&stored).to_string();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).map_err(|e| {
            invalid(format!("{shown}: array `{name}` cannot be read: {e}"), "write it with np.savez")
        })?;
        if out.iter().any(|(n, _)| *n == name) {
            return Err(invalid(format!("{shown} holds two arrays named `{name}`"), "store each array once"));
        }
        out.push((
            name.clone(),
            array(&bytes).map_err(|why| invalid(format!("{shown}: array `{name}` {why}"), HELP))?,
        ));
    }
    Ok(out)
}

pub(crate) const HELP: &str = "store C-ordered float32 (or float64, float16), int32, int64 or bool arrays (np.savez(path, input_ids=ids.astype(np.int64), y=y.astype(np.float32)))";

/// One `.npy` array from its bytes, or what is wrong with it.
pub(crate) fn array(bytes: &[u8]) -> std::result::Result<HostTensor, String> {
    let npy = npyz::NpyFile::new(bytes).map_err(|e| format!("has no .npy header: {e}"))?;
    let header = npy.header().clone();
    let data: &[u8] = npy.into_inner();
    if header.order() == Order::Fortran {
        return Err("is in Fortran order".into());
    }
    let npyz::DType::Plain(ty) = header.dtype() else {
        return Err(format!("is a structured array ({})", header.dtype().descr()));
    };
    let dtype = match (ty.type_char(), ty.size_field()) {
        (TypeChar::Float, 4) => DType::F32,
        // NumPy's default float type, rounded to f32 (to nearest), and f16, widened exactly.
        (TypeChar::Float, 8 | 2) => DType::F32,
        (TypeChar::Int, 4) => DType::I32,
        (TypeChar::Int, 8) => DType::I64,
        (TypeChar::Bool, 1) => DType::Bool,
        _ => return Err(format!("is {ty}")),
    };
    if ty.size_field() > 1 && ty.endianness() != npyz::Endianness::Little {
        return Err(format!("is big-endian ({ty})"));
    }
    let dims: Option<Vec<usize>> = header.shape().iter().map(|&d| usize::try_from(d).ok()).collect();
    let shape = Shape::new(dims.ok_or("has a dimension too large for this machine")?);
    let size = usize::try_from(ty.size_field()).map_err(|_| format!("is {ty}"))?;
    let want = shape.checked_numel().and_then(|n| n.checked_mul(size));
    if want != Some(data.len()) {
        return Err(format!("claims {ty}{shape} but stores {} bytes of data", data.len()));
    }
    let values: Option<Vec<f32>> = match (ty.type_char(), size) {
        (TypeChar::Float, 8) => {
            let wide = data.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])));
            let narrow: Vec<f32> = wide.clone().map(|v| v as f32).collect();
            if let Some((i, v)) = wide.enumerate().find(|(i, v)| v.is_finite() && narrow[*i].is_infinite()) {
                return Err(format!("holds {v} at element {i}, beyond float32's range"));
            }
            Some(narrow)
        }
        (TypeChar::Float, 2) => {
            Some(data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect())
        }
        _ => None,
    };
    match values {
        Some(v) => HostTensor::new(shape, v).map_err(|e| e.to_string()),
        None => HostTensor::from_bytes(shape, dtype, data).map_err(|e| e.to_string()),
    }
}
