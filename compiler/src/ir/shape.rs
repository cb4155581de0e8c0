//! Tensor shapes: row-major dimensions, NumPy broadcasting, axis normalisation.

use serde::{Deserialize, Serialize};
use std::fmt;

/// A tensor's dimensions, outermost first (row-major), in elements; rank 0 is a scalar of one
/// element.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct Shape(Vec<usize>);

impl Shape {
    /// The shape with these dimensions, outermost first.
    pub fn new(dims: impl Into<Vec<usize>>) -> Self {
        Shape(dims.into())
    }

    /// The rank-0 shape: one element, no axes.
    pub fn scalar() -> Self {
        Shape(Vec::new())
    }

    /// The dimensions, outermost first; empty for a scalar.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// The number of axes (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// The element count, saturating at `usize::MAX` (so that a shape whose count overflows never
    /// equals a real length). Shapes inside a traced graph are checked by `ir::infer` to hold at
    /// most `MAX_TENSOR_BYTES`, so there it is exact.
    pub fn numel(&self) -> usize {
        self.checked_numel().unwrap_or(usize::MAX)
    }

    /// The element count, or `None` when it overflows `usize`.
    pub fn checked_numel(&self) -> Option<usize> {
        self.0.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Bytes of a tensor of this shape and `dtype`, or `None` when the count overflows `usize`.
    pub fn checked_bytes(&self, dtype: super::DType) -> Option<usize> {
        self.checked_numel()?.checked_mul(dtype.size_bytes())
    }

    /// Dimension `i` counted from the end (`back(1)` is the last axis); 1 past the rank, and 1 for
    /// `back(0)`, which names no axis (as a broadcast reads a missing axis).
    pub fn back(&self, i: usize) -> usize {
        if (1..=self.0.len()).contains(&i) { self.0[self.0.len() - i] } else { 1 }
    }

    /// Row-major strides in elements.
    pub fn strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }

    /// NumPy broadcasting of two shapes; `None` when some axis pair is neither equal nor 1.
    pub fn broadcast(a: &Shape, b: &Shape) -> Option<Shape> {
        let rank = a.rank().max(b.rank());
        let mut dims = vec![0; rank];
        for (i, d) in dims.iter_mut().enumerate() {
            let (x, y) = (a.back(rank - i), b.back(rank - i));
            *d = match (x, y) {
                _ if x == y => x,
                (1, _) => y,
                (_, 1) => x,
                _ => return None,
            };
        }
        Some(Shape(dims))
    }

    /// Whether `self` broadcasts to `target` (NumPy rules, `self` on the right-aligned axes).
    pub fn broadcasts_to(&self, target: &Shape) -> bool {
        self.rank() <= target.rank()
            && (1..=self.rank()).all(|i| self.back(i) == target.back(i) || self.back(i) == 1)
    }

    /// Normalise a possibly negative axis; `None` when out of range.
    pub fn axis(&self, axis: isize) -> Option<usize> {
        let rank = self.rank() as isize;
        let a = if axis < 0 { axis + rank } else { axis };
        (0..rank).contains(&a).then_some(a as usize)
    }
}

impl From<Vec<usize>> for Shape {
    fn from(v: Vec<usize>) -> Self {
        Shape(v)
    }
}

impl From<&[usize]> for Shape {
    fn from(v: &[usize]) -> Self {
        Shape(v.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(v: [usize; N]) -> Self {
        Shape(v.to_vec())
    }
}

impl From<&Shape> for Shape {
    fn from(s: &Shape) -> Self {
        s.clone()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        let s = |v: &[usize]| Shape::from(v);
        assert_eq!(Shape::broadcast(&s(&[32, 10]), &s(&[10])), Some(s(&[32, 10])));
        assert_eq!(Shape::broadcast(&s(&[4, 1, 3]), &s(&[5, 1])), Some(s(&[4, 5, 3])));
        assert_eq!(Shape::broadcast(&s(&[]), &s(&[2, 2])), Some(s(&[2, 2])));
        assert_eq!(Shape::broadcast(&s(&[3]), &s(&[4])), None);
        assert!(s(&[1, 3]).broadcasts_to(&s(&[2, 3])));
        assert!(!s(&[2, 3]).broadcasts_to(&s(&[3])));
    }

    #[test]
    fn strides_and_axes() {
        let s = Shape::from([2, 3, 4]);
        assert_eq!(s.strides(), vec![12, 4, 1]);
        assert_eq!(s.axis(-1), Some(2));
        assert_eq!(s.axis(3), None);
        assert_eq!(s.numel(), 24);
        assert_eq!(Shape::scalar().numel(), 1);
    }
}
