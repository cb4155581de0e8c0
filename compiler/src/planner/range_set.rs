//! A set of byte offsets kept as sorted, disjoint, non-touching half-open ranges `[lo, hi)`.
//!
//! The interval index stores the *union* of the offsets its buffers occupy rather than the buffers
//! themselves: buffers stacked back to back merge into one range, so a query returns a handful of
//! ranges where a plain interval tree would return every conflicting buffer. A sorted `Vec` beats a
//! `BTreeMap` here: sets are small (a few ranges in the measured workloads) and an insert is one
//! binary search and, at worst, a short `memmove`.

/// Sorted, disjoint, non-touching `[lo, hi)` ranges, none empty.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet {
    ranges: Vec<(usize, usize)>,
}

impl RangeSet {
    pub fn new() -> Self {
        RangeSet { ranges: Vec::new() }
    }

    /// Adds `[lo, hi)`, merging it with every range it overlaps or touches. Empty ranges are ignored.
    pub fn insert(&mut self, lo: usize, hi: usize) {
        if lo >= hi {
            return;
        }
        // Ranges [i, j) are the ones that overlap or touch [lo, hi).
        let i = self.ranges.partition_point(|&(_, h)| h < lo);
        let j = i + self.ranges[i..].partition_point(|&(l, _)| l <= hi);
        if i == j {
            self.ranges.insert(i, (lo, hi));
            return;
        }
        let merged = (lo.min(self.ranges[i].0), hi.max(self.ranges[j - 1].1));
        self.ranges[i] = merged;
        self.ranges.drain(i + 1..j);
    }

    /// The ranges, ascending.
    pub fn ranges(&self) -> &[(usize, usize)] {
        &self.ranges
    }

    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    pub fn len(&self) -> usize {
        self.ranges.len()
    }
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
        s.insert(20, 25); // touches the middle one
        assert_eq!(s.ranges(), &[(0, 5), (10, 25), (30, 40)]);
        s.insert(12, 14); // inside
        assert_eq!(s.ranges(), &[(0, 5), (10, 25), (30, 40)]);
        s.insert(3, 35); // swallows across
        assert_eq!(s.ranges(), &[(0, 40)]);
        s.insert(7, 7); // empty
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn matches_a_bitmap() {
        // A tiny deterministic sweep over many small inserts, checked against a bitmap.
        let mut state = 12345u64;
        let mut next = move |m: u64| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % m) as usize
        };
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
}
