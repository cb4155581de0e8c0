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
        if shape.numel() != data.len() {
            return Err(RuntimeError::invalid(
                format!("shape {shape} holds {} elements but {} were given", shape.numel(), data.len()),
                "pass exactly one value per element",
            ));
        }
        Ok(HostTensor { shape, data })
    }

    pub fn zeros(shape: impl Into<Shape>) -> Self {
        let shape = shape.into();
        HostTensor { data: vec![0.0; shape.numel()], shape }
    }

    pub fn scalar(v: f32) -> Self {
        HostTensor { shape: Shape::scalar(), data: vec![v] }
    }

    pub fn from_fn(shape: impl Into<Shape>, f: impl FnMut(usize) -> f32) -> Self {
        let shape = shape.into();
        HostTensor { data: (0..shape.numel()).map(f).collect(), shape }
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

    /// Elements per row (everything after the first axis).
    pub fn row_len(&self) -> usize {
        self.shape.dims().iter().skip(1).product()
    }

    /// Rows `range` along the first axis, copied.
    pub fn rows(&self, range: std::ops::Range<usize>) -> HostTensor {
        let r = self.row_len();
        let mut dims = self.shape.dims().to_vec();
        dims[0] = range.len();
        HostTensor { shape: Shape::new(dims), data: self.data[range.start * r..range.end * r].to_vec() }
    }

    /// Rows at `indices` along the first axis, copied into `out` (resized to fit).
    pub fn gather_rows_into(&self, indices: &[usize], out: &mut Vec<f32>) {
        let r = self.row_len();
        out.clear();
        for &i in indices {
            out.extend_from_slice(&self.data[i * r..(i + 1) * r]);
        }
    }

    /// The largest absolute difference to `other` (infinite when shapes differ).
    pub fn max_abs_diff(&self, other: &HostTensor) -> f32 {
        if self.shape != other.shape {
            return f32::INFINITY;
        }
        self.data.iter().zip(&other.data).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    }
}
