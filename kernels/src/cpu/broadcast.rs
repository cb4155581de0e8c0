//! Strided loop nests over a contiguous output, computed once in `prepare`.
//!
//! Every broadcasting or re-striding kernel (binary ops, select, permute, broadcast_to) walks its
//! row-major output while each operand is read through its own element strides (0 on a broadcast
//! axis). `Strided::new` drops size-1 axes and merges adjacent axes that are contiguous for every
//! operand, so the common cases collapse to one or two loops: same shapes become one run over the
//! whole tensor, a scalar operand one run with stride 0, a bias ([N, C] with [C]) N runs of C.
//! The walk is recursive over the remaining axes, so it needs no heap and works for any rank,
//! and it can start and stop at any output offset, which is how parallel chunks are cut.

pub(crate) use crate::strides::{broadcast_strides, contiguous_strides};
use std::array;

/// A loop nest over a contiguous output with `K` strided operands.
#[derive(Clone, Debug)]
pub(crate) struct Strided<const K: usize> {
    dims: Vec<usize>,
    strides: Vec<[isize; K]>,
    /// Output elements per step of each axis.
    blocks: Vec<usize>,
    numel: usize,
}

impl<const K: usize> Strided<K> {
    /// `strides[k][axis]` is operand k's element stride along output axis `axis`.
    pub(crate) fn new(out_dims: &[usize], strides: [&[isize]; K]) -> Self {
        let numel = out_dims.iter().product();
        let mut dims: Vec<usize> = Vec::new();
        let mut merged: Vec<[isize; K]> = Vec::new();
        for (axis, &d) in out_dims.iter().enumerate() {
            if d == 1 {
                continue;
            }
            let s: [isize; K] = array::from_fn(|k| strides[k][axis]);
            if let (Some(last_d), Some(last_s)) = (dims.last_mut(), merged.last_mut())
                && (0..K).all(|k| last_s[k] == s[k] * d as isize)
            {
                *last_d *= d;
                *last_s = s;
                continue;
            }
            dims.push(d);
            merged.push(s);
        }
        if dims.is_empty() {
            dims.push(1);
            merged.push([0; K]);
        }
        let blocks = contiguous_strides(&dims);
        Strided { dims, strides: merged, blocks, numel }
    }

    pub(crate) fn numel(&self) -> usize {
        self.numel
    }

    /// The operands' strides along the innermost loop.
    pub(crate) fn inner_strides(&self) -> [isize; K] {
        *self.strides.last().expect("at least one axis")
    }

    /// The loop nest after merging, as (extent, strides) from the outermost axis.
    pub(crate) fn axes(&self) -> Vec<(usize, [isize; K])> {
        self.dims.iter().copied().zip(self.strides.iter().copied()).collect()
    }

    /// Calls `f(out_offset, operand_offsets, len)` for every innermost run of output elements in
    /// `start..end`, in order; along a run operand k advances by `inner_strides()[k]`.
    #[inline]
    pub(crate) fn for_each_run(
        &self,
        start: usize,
        end: usize,
        f: &mut impl FnMut(usize, [isize; K], usize),
    ) {
        if start < end {
            self.walk(0, 0, [0; K], start, end, f);
        }
    }

    fn walk(
        &self,
        axis: usize,
        out: usize,
        ins: [isize; K],
        start: usize,
        end: usize,
        f: &mut impl FnMut(usize, [isize; K], usize),
    ) {
        let s = self.strides[axis];
        if axis + 1 == self.dims.len() {
            f(out + start, array::from_fn(|k| ins[k] + start as isize * s[k]), end - start);
            return;
        }
        let b = self.blocks[axis];
        let (first, last) = (start / b, (end - 1) / b);
        for i in first..=last {
            let lo = if i == first { start - i * b } else { 0 };
            let hi = if i == last { end - i * b } else { b };
            let offs = array::from_fn(|k| ins[k] + i as isize * s[k]);
            self.walk(axis + 1, out + i * b, offs, lo, hi, f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapses_common_patterns() {
        let same = broadcast_strides(&[4, 5, 6], &[4, 5, 6]);
        let w = Strided::<2>::new(&[4, 5, 6], [&same, &same]);
        assert_eq!(w.axes(), vec![(120, [1, 1])]);

        let scalar = broadcast_strides(&[], &[4, 5]);
        let full = broadcast_strides(&[4, 5], &[4, 5]);
        let w = Strided::<2>::new(&[4, 5], [&full, &scalar]);
        assert_eq!(w.axes(), vec![(20, [1, 0])]);

        let bias = broadcast_strides(&[10], &[32, 10]);
        let x = broadcast_strides(&[32, 10], &[32, 10]);
        let w = Strided::<2>::new(&[32, 10], [&x, &bias]);
        assert_eq!(w.axes(), vec![(32, [10, 0]), (10, [1, 1])]);

        let col = broadcast_strides(&[4, 1, 3], &[4, 5, 3]);
        assert_eq!(col, vec![3, 0, 1]);
        let w = Strided::<1>::new(&[1, 1], [&[0, 0]]);
        assert_eq!(w.axes(), vec![(1, [0])]);
    }

    #[test]
    fn runs_cover_any_subrange_in_order() {
        let a = broadcast_strides(&[3, 1, 5], &[2, 3, 4, 5]);
        let w = Strided::<1>::new(&[2, 3, 4, 5], [&a]);
        let mut all = Vec::new();
        w.for_each_run(0, w.numel(), &mut |o, [i], n| all.extend((0..n).map(|j| (o + j, i + j as isize))));
        assert_eq!(all.len(), 120);
        for (k, &(o, i)) in all.iter().enumerate() {
            assert_eq!(o, k);
            let (c, b) = ((k / 20) % 3, k % 5);
            assert_eq!(i, (c * 5 + b) as isize);
        }
        for (s, e) in [(0, 1), (7, 63), (19, 20), (21, 120), (5, 6)] {
            let mut part = Vec::new();
            w.for_each_run(s, e, &mut |o, [i], n| part.extend((0..n).map(|j| (o + j, i + j as isize))));
            assert_eq!(part, all[s..e]);
        }
    }
}
