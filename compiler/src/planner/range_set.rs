//! A set of byte offsets kept as sorted, disjoint, non-touching half-open ranges `[lo, hi)`.
//!
//! The interval index stores the *union* of the offsets its buffers occupy rather than the buffers
//! themselves: buffers stacked back to back merge into one range, so a query returns a handful of
//! ranges where a plain interval tree would return every conflicting buffer. A sorted `Vec` beats a
//! `BTreeMap` here: sets are small (a few ranges in the measured workloads) and an insert is one
//! binary search and, at worst, a short `memmove`. [`Union`] merges the sets a query collects.

/// Sorted, disjoint, non-touching `[lo, hi)` ranges, none empty.
///
/// Most sets in the index hold one range (buffers stacked back to back), so one range is kept
/// inline: no allocation, no pointer to follow. On a 100k-interval training step this took a
/// third off the placement time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeSet {
    repr: Repr,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum Repr {
    #[default]
    Empty,
    One((usize, usize)),
    Many(Vec<(usize, usize)>),
}

impl RangeSet {
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
                } else if hi < r.0 {
                    self.repr = Repr::Many(vec![(lo, hi), *r]);
                } else {
                    self.repr = Repr::Many(vec![*r, (lo, hi)]);
                }
            }
            Repr::Many(ranges) => return insert_sorted(ranges, lo, hi),
        }
        true
    }

    /// The ranges, ascending.
    pub fn ranges(&self) -> &[(usize, usize)] {
        match &self.repr {
            Repr::Empty => &[],
            Repr::One(r) => std::slice::from_ref(r),
            Repr::Many(ranges) => ranges,
        }
    }

    pub fn is_empty(&self) -> bool {
        matches!(self.repr, Repr::Empty)
    }

    pub fn len(&self) -> usize {
        self.ranges().len()
    }
}

/// A union of sorted, disjoint range lists. While the union is short, each list is merged in as it
/// comes (linear, no sort); once it is long, lists are appended and sorted once at the end, so that
/// a query over a fragmented arena costs `O(total log total)` rather than the union's length at
/// every list.
#[derive(Clone, Debug, Default)]
pub struct Union {
    ranges: Vec<(usize, usize)>,
    scratch: Vec<(usize, usize)>,
    /// `ranges` holds appended lists, to be sorted and merged.
    unsorted: bool,
}

/// Above this many ranges, lists are appended rather than merged.
const MERGE_LIMIT: usize = 64;

impl Union {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn clear(&mut self) {
        self.ranges.clear();
        self.unsorted = false;
    }

    /// Adds a sorted list of disjoint ranges (a [`RangeSet`]'s).
    pub fn add(&mut self, other: &[(usize, usize)]) {
        if other.is_empty() {
        } else if self.ranges.is_empty() {
            self.ranges.extend_from_slice(other);
        } else if let ([(lo, hi)], false) = (other, self.unsorted) {
            insert_sorted(&mut self.ranges, *lo, *hi);
        } else if self.unsorted || self.ranges.len() + other.len() > MERGE_LIMIT {
            self.ranges.extend_from_slice(other);
            self.unsorted = true;
        } else {
            let (a, out) = (&self.ranges, &mut self.scratch);
            out.clear();
            let (mut i, mut j) = (0, 0);
            while i < a.len() || j < other.len() {
                let next = if j == other.len() || (i < a.len() && a[i].0 <= other[j].0) {
                    i += 1;
                    a[i - 1]
                } else {
                    j += 1;
                    other[j - 1]
                };
                push_merged(out, next);
            }
            std::mem::swap(&mut self.ranges, &mut self.scratch);
        }
    }

    /// The union: sorted, disjoint, non-touching.
    pub fn ranges(&mut self) -> &[(usize, usize)] {
        if self.unsorted {
            self.ranges.sort_unstable();
            let (mut kept, mut k) = (1, 1);
            while k < self.ranges.len() {
                let next = self.ranges[k];
                let last = &mut self.ranges[kept - 1];
                if next.0 <= last.1 {
                    last.1 = last.1.max(next.1);
                } else {
                    self.ranges[kept] = next;
                    kept += 1;
                }
                k += 1;
            }
            self.ranges.truncate(kept);
            self.unsorted = false;
        }
        &self.ranges
    }
}

/// Adds non-empty `[lo, hi)` to sorted, disjoint, non-touching `ranges`, keeping them so; returns
/// whether they changed.
fn insert_sorted(ranges: &mut Vec<(usize, usize)>, lo: usize, hi: usize) -> bool {
    // Ranges [i, j) are the ones that overlap or touch [lo, hi).
    let i = ranges.partition_point(|&(_, h)| h < lo);
    let j = i + ranges[i..].partition_point(|&(l, _)| l <= hi);
    if i == j {
        ranges.insert(i, (lo, hi));
    } else if j == i + 1 && ranges[i].0 <= lo && hi <= ranges[i].1 {
        return false;
    } else {
        ranges[i] = (lo.min(ranges[i].0), hi.max(ranges[j - 1].1));
        ranges.drain(i + 1..j);
    }
    true
}

/// Pushes `next` (no lower than the last range) onto sorted disjoint `out`, merging if it touches.
fn push_merged(out: &mut Vec<(usize, usize)>, next: (usize, usize)) {
    match out.last_mut() {
        Some(last) if next.0 <= last.1 => last.1 = last.1.max(next.1),
        _ => out.push(next),
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

    #[test]
    fn union_merges_lists() {
        let mut u = Union::new();
        u.add(&[(10, 20), (40, 50)]);
        u.add(&[]);
        u.add(&[(0, 5), (20, 30), (45, 60), (70, 80)]);
        assert_eq!(u.ranges(), &[(0, 5), (10, 30), (40, 60), (70, 80)]);
        u.add(&[(5, 10)]);
        assert_eq!(u.ranges(), &[(0, 30), (40, 60), (70, 80)]);
        u.clear();
        assert!(u.ranges().is_empty());
        // Past the merge limit: appended, then sorted once.
        for k in (0..100).rev() {
            u.add(&[(4 * k, 4 * k + 2), (4 * k + 500, 4 * k + 504)]);
        }
        let got = u.ranges();
        assert_eq!(got.len(), 101);
        assert_eq!(got[0], (0, 2));
        assert_eq!(got[99], (396, 398));
        assert_eq!(got[100], (500, 900));
    }
}
