//! Host tensors: what users feed in and read out (f32, row-major).

use crate::error::{Result, RuntimeError};
use kiln_compiler::ir::Shape;

#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    shape: Shape,
    data: Vec<f32>,
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
        Ok(HostTensor { shape, data })
    }

    /// A tensor of `shape` filled with zeros; an error when its element count overflows or the
    /// host cannot allocate it.
    pub fn zeros(shape: impl Into<Shape>) -> Result<Self> {
        let shape = shape.into();
        let (mut data, n) = alloc_elements(&shape, "HostTensor::zeros")?;
        data.resize(n, 0.0);
        Ok(HostTensor { data, shape })
    }

    pub fn scalar(v: f32) -> Self {
        HostTensor { shape: Shape::scalar(), data: vec![v] }
    }

    /// A tensor of `shape` whose element `i` (row-major) is `f(i)`; an error when its element
    /// count overflows or the host cannot allocate it.
    pub fn from_fn(shape: impl Into<Shape>, f: impl FnMut(usize) -> f32) -> Result<Self> {
        let shape = shape.into();
        let (mut data, n) = alloc_elements(&shape, "HostTensor::from_fn")?;
        data.extend((0..n).map(f));
        Ok(HostTensor { data, shape })
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    pub fn data(&self) -> &[f32] {
        &self.data
    }

    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

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
        Ok(HostTensor { shape: Shape::new(dims), data: self.data[range.start * r..range.end * r].to_vec() })
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
