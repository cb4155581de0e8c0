//! A set of byte offsets kept as sorted, disjoint, non-touching half-open ranges `[lo, hi)`, that
//! can skip over holes too small for a buffer.
//!
//! The interval index stores the *union* of the offsets its buffers occupy rather than the buffers
//! themselves: buffers stacked back to back merge into one range. A sorted `Vec` beats a `BTreeMap`
//! here: most sets hold one range (kept inline: no allocation) and an insert is one binary search
//! and, at worst, a short `memmove`.
//!
//! Fragmented sets are where the time goes: on a transformer training step whose weight gradients
//! live until the end, a query's sets held 580 ranges per buffer at 20k intervals (2,600 at 100k),
//! almost all of them separated by holes too small for the buffer being placed. So every set with
//! more than one range keeps the largest hole of each block of [`BLOCK`] ranges, and
//! [`RangeSet::next_fitting`] skips whole blocks: the search then moves about 20-35 times per
//! buffer, and exact best fit in `size` order plans that step in 0.9 s instead of 7.4 s at 100k
//! intervals.

use std::cell::RefCell;

/// Ranges per block of the hole index.
pub const BLOCK: usize = 16;

/// Sorted, disjoint, non-touching `[lo, hi)` ranges, none empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet {
    repr: Repr,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Repr {
    #[default]
    Empty,
    One((usize, usize)),
    Many(Box<Many>),
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Many {
    ranges: Vec<(usize, usize)>,
    /// Per block of `BLOCK` ranges, the largest hole after one of them (the last range's hole is
    /// unbounded). Only a prefix is kept: an insert drops the blocks from its position on, and a
    /// search recomputes the blocks it reaches. Recomputing them all on each insert cost half the
    /// placement time on fragmented sets.
    block_max: RefCell<Vec<usize>>,
}

impl RangeSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `[lo, hi)`, merging it with every range it overlaps or touches. Empty ranges are ignored.
    /// Returns whether the set changed (false when it already held every byte of the range).
    pub fn insert(&mut self, lo: usize, hi: usize) -> bool {
        if lo >= hi {
            return false;
        }
        match &mut self.repr {
            Repr::Empty => self.repr = Repr::One((lo, hi)),
            Repr::One(r) => {
                if r.0 <= lo && hi <= r.1 {
                    return false;
                } else if lo <= r.1 && r.0 <= hi {
                    *r = (r.0.min(lo), r.1.max(hi));
                } else {
                    let ranges = if hi < r.0 { vec![(lo, hi), *r] } else { vec![*r, (lo, hi)] };
                    self.repr = Repr::Many(Box::new(Many { ranges, block_max: RefCell::default() }));
                }
            }
            Repr::Many(many) => match insert_sorted(&mut many.ranges, lo, hi) {
                Some(changed) => many.block_max.get_mut().truncate(changed.saturating_sub(1) / BLOCK),
                None => return false,
            },
        }
        true
    }

    /// The ranges, ascending.
    pub fn ranges(&self) -> &[(usize, usize)] {
        match &self.repr {
            Repr::Empty => &[],
            Repr::One(r) => std::slice::from_ref(r),
            Repr::Many(many) => &many.ranges,
        }
    }

    /// Whether the set holds no range.
    pub fn is_empty(&self) -> bool {
        matches!(self.repr, Repr::Empty)
    }

    /// The number of disjoint ranges (not bytes).
    pub fn len(&self) -> usize {
        self.ranges().len()
    }

    /// The first range at or after position `from` (< `len`) followed by a hole of at least `size`
    /// bytes (the last range is followed by an unbounded one).
    pub fn next_fitting(&self, from: usize, size: usize) -> usize {
        let Repr::Many(many) = &self.repr else { return 0 };
        let r = &many.ranges;
        let hole = |j: usize| if j + 1 < r.len() { r[j + 1].0 - r[j].1 } else { usize::MAX };
        let mut j = from;
        // Finish the current block one range at a time, then skip whole blocks.
        while !j.is_multiple_of(BLOCK) {
            if hole(j) >= size {
                return j;
            }
            j += 1;
        }
        let mut block = j / BLOCK;
        while many.block(block) < size {
            block += 1;
        }
        j = block * BLOCK;
        while hole(j) < size {
            j += 1;
        }
        j
    }
}

impl Many {
    /// The largest hole after a range of block `block`, computing the blocks up to it if needed.
    fn block(&self, block: usize) -> usize {
        let mut maxima = self.block_max.borrow_mut();
        let r = &self.ranges;
        while maxima.len() <= block {
            let b = maxima.len();
            let end = ((b + 1) * BLOCK).min(r.len());
            let max = (b * BLOCK..end)
                .map(|j| if j + 1 < r.len() { r[j + 1].0 - r[j].1 } else { usize::MAX })
                .max()
                .unwrap_or(0);
            maxima.push(max);
        }
        maxima[block]
    }
}

/// Adds non-empty `[lo, hi)` to sorted, disjoint, non-touching `ranges`, keeping them so; returns
/// the position of the first range that changed, or `None` when they already held it.
fn insert_sorted(ranges: &mut Vec<(usize, usize)>, lo: usize, hi: usize) -> Option<usize> {
    // Ranges [i, j) are the ones that overlap or touch [lo, hi).
    let i = ranges.partition_point(|&(_, h)| h < lo);
    let j = i + ranges[i..].partition_point(|&(l, _)| l <= hi);
    if i == j {
        ranges.insert(i, (lo, hi));
    } else if j == i + 1 && ranges[i].0 <= lo && hi <= ranges[i].1 {
        return None;
    } else {
        ranges[i] = (lo.min(ranges[i].0), hi.max(ranges[j - 1].1));
        ranges.drain(i + 1..j);
    }
    Some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_overlapping_and_touching() {
        let mut s = RangeSet::new();
        s.insert(10, 20);
        s.insert(30, 40);
        s.insert(0, 5);
        assert_eq!(s.ranges(), &[(0, 5), (10, 20), (30, 40)]);
        assert!(s.insert(20, 25)); // touches the middle one
        assert_eq!(s.ranges(), &[(0, 5), (10, 25), (30, 40)]);
        assert!(!s.insert(12, 14)); // inside
        assert_eq!(s.ranges(), &[(0, 5), (10, 25), (30, 40)]);
        s.insert(3, 35); // swallows across
        assert_eq!(s.ranges(), &[(0, 40)]);
        assert!(!s.insert(7, 7)); // empty
        assert_eq!(s.len(), 1);
    }

    /// A tiny deterministic generator for the randomized checks below.
    fn lcg(seed: u64) -> impl FnMut(usize) -> usize {
        let mut state = seed;
        move |m| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % m
        }
    }

    #[test]
    fn matches_a_bitmap() {
        let mut next = lcg(12345);
        for _ in 0..200 {
            let mut s = RangeSet::new();
            let mut bits = [false; 64];
            for _ in 0..next(12) {
                let lo = next(64);
                let hi = (lo + next(10)).min(64);
                s.insert(lo, hi);
                bits[lo..hi].iter_mut().for_each(|b| *b = true);
            }
            let mut from_set = [false; 64];
            for &(l, h) in s.ranges() {
                assert!(l < h);
                from_set[l..h].iter_mut().for_each(|b| *b = true);
            }
            assert_eq!(bits, from_set);
            assert!(s.ranges().windows(2).all(|w| w[0].1 < w[1].0), "{:?}", s.ranges());
        }
    }

    #[test]
    fn next_fitting_matches_a_scan() {
        let mut next = lcg(777);
        for _ in 0..300 {
            let mut s = RangeSet::new();
            for _ in 0..1 + next(120) {
                let lo = next(2000);
                s.insert(lo, lo + 1 + next(12));
            }
            let r = s.ranges();
            for _ in 0..20 {
                let from = next(r.len());
                let size = 1 + next(30);
                let want =
                    (from..r.len()).find(|&j| j + 1 == r.len() || r[j + 1].0 - r[j].1 >= size).unwrap();
                assert_eq!(s.next_fitting(from, size), want, "from {from} size {size} in {r:?}");
            }
        }
    }
}
