//! Host tensors: what users feed in and read out (row-major). f32 by default; i32, i64 and bool
//! tensors (ids, masks: `DType::is_exact`) keep their exact values (`ints`) beside the same
//! values as f32 (`data`, exact up to 2^24), so that code reading f32s reads them too.

use crate::error::{Result, RuntimeError};
use kiln_compiler::ir::{DType, Shape};

/// A tensor in host memory, row-major: its shape, its values as f32 and, for an i32, i64 or
/// bool tensor, its exact values and dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    data: Vec<f32>,
    /// The dtype and exact values of an i32, i64 or bool tensor; `None` for f32.
    exact: Option<(DType, Vec<i64>)>,
}

impl HostTensor {
    /// A tensor of `shape` holding `data` (row-major); an error when the sizes disagree.
    pub fn new(shape: impl Into<Shape>, data: Vec<f32>) -> Result<Self> {
        let shape = shape.into();
        if shape.checked_numel() != Some(data.len()) {
            let holds = shape
                .checked_numel()
                .map_or("more elements than a usize counts".into(), |n| format!("{n} elements"));
            return Err(RuntimeError::invalid(
                format!("shape {shape} holds {holds} but {} were given", data.len()),
                "pass exactly one value per element",
            ));
        }
        Ok(HostTensor { shape, data, exact: None })
    }

    /// An i32 tensor (token or class ids) of `shape`; an error when the sizes disagree.
    pub fn from_i32(shape: impl Into<Shape>, values: Vec<i32>) -> Result<Self> {
        Self::exact(shape.into(), DType::I32, values.into_iter().map(i64::from).collect())
    }

    /// An i64 tensor of `shape`; an error when the sizes disagree.
    pub fn from_i64(shape: impl Into<Shape>, values: Vec<i64>) -> Result<Self> {
        Self::exact(shape.into(), DType::I64, values)
    }

    /// A bool tensor (a mask) of `shape`; an error when the sizes disagree.
    pub fn from_bool(shape: impl Into<Shape>, values: Vec<bool>) -> Result<Self> {
        Self::exact(shape.into(), DType::Bool, values.into_iter().map(i64::from).collect())
    }

    fn exact(shape: Shape, dtype: DType, values: Vec<i64>) -> Result<Self> {
        let mut t = HostTensor::new(shape, values.iter().map(|&v| v as f32).collect())?;
        t.exact = Some((dtype, values));
        Ok(t)
    }

    /// The tensor's dtype: f32, or the i32 / i64 / bool it was made as.
    pub fn dtype(&self) -> DType {
        self.exact.as_ref().map_or(DType::F32, |(d, _)| *d)
    }

    /// The exact values of an i32, i64 or bool tensor (bools as 0 and 1); `None` for f32.
    pub fn ints(&self) -> Option<&[i64]> {
        self.exact.as_ref().map(|(_, v)| v.as_slice())
    }

    /// The elements as a device holds them: little-endian, each of the tensor's dtype's size; an
    /// error when the host cannot allocate the copy (its size is the caller's tensor's).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let len = self.exact.as_ref().map_or(self.data.len(), |(_, v)| v.len());
        let bytes = len.saturating_mul(self.dtype().size_bytes());
        let mut out = Vec::new();
        out.try_reserve_exact(bytes).map_err(|e| {
            RuntimeError::invalid(
                format!(
                    "copying {}{} to bytes needs {bytes} bytes, which the host cannot allocate ({e})",
                    self.dtype(),
                    self.shape
                ),
                "use a smaller tensor (fewer rows per batch)",
            )
        })?;
        match &self.exact {
            None => self.data.iter().for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            Some((DType::I32, v)) => v.iter().for_each(|&x| out.extend_from_slice(&(x as i32).to_le_bytes())),
            Some((DType::Bool, v)) => out.extend(v.iter().map(|&x| u8::from(x != 0))),
            Some((_, v)) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
        }
        Ok(out)
    }

    /// A tensor of `shape` and `dtype` from the bytes a device holds (`to_bytes`' layout; f16
    /// and bf16 bytes read as an f32 tensor, widened exactly); an error when the byte count is
    /// not the shape's.
    pub fn from_bytes(shape: impl Into<Shape>, dtype: DType, bytes: &[u8]) -> Result<Self> {
        let shape = shape.into();
        let size = dtype.size_bytes();
        if shape.checked_numel().and_then(|n| n.checked_mul(size)) != Some(bytes.len()) {
            return Err(RuntimeError::invalid(
                format!("{} bytes do not hold {dtype}{shape}", bytes.len()),
                "read exactly the tensor's bytes",
            ));
        }
        match dtype {
            DType::I32 => Self::exact(
                shape,
                dtype,
                bytes
                    .chunks_exact(4)
                    .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                    .collect(),
            ),
            DType::I64 => Self::exact(
                shape,
                dtype,
                bytes.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect(),
            ),
            DType::Bool => Self::exact(shape, dtype, bytes.iter().map(|&b| i64::from(b != 0)).collect()),
            DType::F32 => HostTensor::new(
                shape,
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            ),
            // Half values widen to f32 exactly: the tensor is f32.
            DType::F16 => HostTensor::new(
                shape,
                bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            ),
            DType::BF16 => HostTensor::new(
                shape,
                bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            ),
        }
    }

    /// A tensor of `shape` filled with zeros; an error when its element count overflows or the
    /// host cannot allocate it.
    pub fn zeros(shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let (mut data, n) = alloc_elements(&shape, "HostTensor::zeros")?;
        data.resize(n, 0.0);
        Ok(HostTensor { data, shape, exact: None })
    }

    /// An f32 scalar (shape `[]`) holding `v`.
    pub fn scalar(v: f32) -> Self {
        HostTensor { shape: Shape::scalar(), data: vec![v], exact: None }
    }

    /// A tensor of `shape` whose element `i` (row-major) is `f(i)`; an error when its element
    /// count overflows or the host cannot allocate it.
    pub fn from_fn(shape: impl Into<Shape>, f: impl FnMut(usize) -> f32) -> Result<Self> {
        let shape = shape.into();
        let (mut data, n) = alloc_elements(&shape, "HostTensor::from_fn")?;
        data.extend((0..n).map(f));
        Ok(HostTensor { data, shape, exact: None })
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The values as f32, row-major, one per element (an exact tensor's values converted).
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// The f32 values, to change in place. An i32, i64 or bool tensor becomes an f32 tensor of
    /// these values (its exact values are dropped).
    pub fn data_mut(&mut self) -> &mut [f32] {
        self.exact = None;
        &mut self.data
    }

    /// The f32 values, row-major, without a copy (an exact tensor's exact values are dropped).
    pub fn into_data(self) -> Vec<f32> {
        self.data
    }

    /// The single element of a one-element tensor.
    pub fn item(&self) -> Option<f32> {
        (self.data.len() == 1).then(|| self.data[0])
    }

    /// Elements per row (everything after the first axis); an error on a scalar, which has no rows.
    pub fn row_len(&self) -> Result<usize> {
        match self.shape.dims() {
            [] => Err(RuntimeError::invalid(
                format!("a scalar {} has no rows", self.shape),
                "rows are taken along the first axis: give a tensor of rank 1 or more",
            )),
            // A zero row length whatever the other axes; else the product may still overflow
            // when there are no rows ([0, 2^63, 4]).
            [_, rest @ ..] if rest.contains(&0) => Ok(0),
            [_, rest @ ..] => rest.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
                RuntimeError::invalid(
                    format!("a row of {} holds more elements than a usize counts", self.shape),
                    "check the shape for a wrong or overflowing dimension",
                )
            }),
        }
    }

    fn row_count(&self) -> usize {
        self.shape.dims().first().copied().unwrap_or(0)
    }

    /// Rows `range` along the first axis, copied; an error when the range is not inside the
    /// tensor's rows (or the tensor is a scalar).
    pub fn rows(&self, range: std::ops::Range<usize>) -> Result<HostTensor> {
        let r = self.row_len()?;
        let n = self.row_count();
        if range.start > range.end || range.end > n {
            return Err(RuntimeError::invalid(
                format!("rows {}..{} of a tensor {} with {n} rows", range.start, range.end, self.shape),
                format!("take a range start..end with start <= end <= {n}"),
            ));
        }
        let mut dims = self.shape.dims().to_vec();
        dims[0] = range.len();
        let exact = self.exact.as_ref().map(|(d, v)| (*d, v[range.start * r..range.end * r].to_vec()));
        Ok(HostTensor {
            shape: Shape::new(dims),
            data: self.data[range.start * r..range.end * r].to_vec(),
            exact,
        })
    }

    /// Rows at `indices` along the first axis, as a tensor of this one's dtype; an error naming
    /// the first index outside the tensor's rows.
    pub fn select_rows(&self, indices: &[usize]) -> Result<HostTensor> {
        let mut data = Vec::new();
        self.gather_rows_into(indices, &mut data)?;
        let r = self.row_len()?;
        let mut dims = self.shape.dims().to_vec();
        dims[0] = indices.len();
        let exact = self.exact.as_ref().map(|(d, v)| {
            (*d, indices.iter().flat_map(|&i| v[i * r..(i + 1) * r].iter().copied()).collect())
        });
        Ok(HostTensor { shape: Shape::new(dims), data, exact })
    }

    /// Rows at `indices` along the first axis, copied into `out` (resized to fit); an error
    /// naming the first index outside the tensor's rows (`out` is then left empty).
    pub fn gather_rows_into(&self, indices: &[usize], out: &mut Vec<f32>) -> Result<()> {
        let r = self.row_len()?;
        let n = self.row_count();
        out.clear();
        if let Some((at, &i)) = indices.iter().enumerate().find(|&(_, &i)| i >= n) {
            return Err(RuntimeError::invalid(
                format!(
                    "row index {i} (at position {at} of {} indices) is outside a tensor {} with {n} rows",
                    indices.len(),
                    self.shape
                ),
                format!("row indices run from 0 to {}", n.saturating_sub(1)),
            ));
        }
        for &i in indices {
            out.extend_from_slice(&self.data[i * r..(i + 1) * r]);
        }
        Ok(())
    }

    /// The largest absolute difference to `other` (infinite when shapes differ). NaN and
    /// infinities count: a NaN where the other is not NaN, or an infinity where the other is not
    /// the same infinity, is an infinite difference; two NaNs do not differ.
    pub fn max_abs_diff(&self, other: &HostTensor) -> f32 {
        if self.shape != other.shape {
            return f32::INFINITY;
        }
        // `element_diff` is never NaN, so `max` drops nothing.
        self.data.iter().zip(&other.data).map(|(&a, &b)| element_diff(a, b)).fold(0.0, f32::max)
    }
}

/// How far apart two elements are: 0 for equal values (infinities of one sign included) and for
/// two NaNs; infinite where exactly one is NaN or one is infinite and the other is not equal.
fn element_diff(a: f32, b: f32) -> f32 {
    match (a.is_nan(), b.is_nan()) {
        (true, true) => 0.0,
        (true, false) | (false, true) => f32::INFINITY,
        _ if a == b => 0.0,
        _ => (a - b).abs(),
    }
}

/// An empty vector with room for `shape`'s elements, and their count; or an error naming `what`, the
/// shape and the bytes when the count overflows or the host refuses the allocation (instead of
/// the process aborting).
fn alloc_elements(shape: &Shape, what: &str) -> Result<(Vec<f32>, usize)> {
    let bytes = shape.checked_numel().and_then(|n| n.checked_mul(size_of::<f32>()).map(|b| (n, b)));
    let Some((n, bytes)) = bytes else {
        return Err(RuntimeError::invalid(
            format!("{what}: shape {shape} has more elements than a usize counts"),
            "check the shape for a wrong or overflowing dimension",
        ));
    };
    let mut data = Vec::new();
    data.try_reserve_exact(n).map_err(|e| {
        RuntimeError::invalid(
            format!("{what}: f32{shape} needs {bytes} bytes, which the host cannot allocate ({e})"),
            "use a smaller shape (fewer rows per batch)",
        )
    })?;
    Ok((data, n))
}

#[cfg(test)]
mod diff_tests {
    use super::*;

    #[test]
    fn max_abs_diff_counts_nan_and_infinities() {
        let t = |v: Vec<f32>| HostTensor::new(Shape::from([v.len()].as_slice()), v).unwrap();
        let a = t(vec![1.0, 2.0, 3.0]);
        assert_eq!(a.max_abs_diff(&t(vec![1.0, 2.5, 3.0])), 0.5);
        assert_eq!(a.max_abs_diff(&t(vec![1.0, f32::NAN, 3.0])), f32::INFINITY);
        assert_eq!(t(vec![f32::NAN, 0.0]).max_abs_diff(&t(vec![0.0, 0.0])), f32::INFINITY);
        assert_eq!(a.max_abs_diff(&t(vec![1.0, f32::INFINITY, 3.0])), f32::INFINITY);
        assert_eq!(t(vec![f32::INFINITY, f32::NAN]).max_abs_diff(&t(vec![f32::INFINITY, f32::NAN])), 0.0);
        assert_eq!(t(vec![f32::INFINITY]).max_abs_diff(&t(vec![f32::NEG_INFINITY])), f32::INFINITY);
    }
}
