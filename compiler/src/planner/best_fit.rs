//! Best-fit placement in a given order (TensorFlow Lite's arena planner, XLA's
//! GlobalDecreasingSizeBestFitHeap).
//!
//! Each buffer, in turn, goes into the smallest gap between the byte ranges taken during its
//! lifetime that fits it (the lowest such gap on ties), else on top of the highest of them. The
//! taken ranges come from the [`IntervalIndex`] as a few merged unions, so one buffer costs
//! `O(log n)` index work plus sorting the ranges returned, instead of a scan of every placed buffer.
//! The order is the only thing that differs between heuristics (see [`super::heuristics`]).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::interval_index::{IntervalIndex, SetId};
use super::range_set::Union;
use super::timeline::Timeline;

/// Holes visited before best fit settles for the best one seen (see [`choose_gap`]).
pub const SEARCH_BUDGET: usize = 4;

/// Up to this many ranges in a query's sets, they are merged eagerly (a linear merge or a sort);
/// above it, lazily through a heap so that the search can stop early.
const EAGER_MAX: usize = 128;

/// The result of one best-fit pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BestFit {
    /// One per interval, in input order.
    pub offsets: Vec<usize>,
    /// max(offset + aligned size), 0 when nothing takes space.
    pub arena_bytes: usize,
    /// Byte ranges read from the index, over all buffers: the work done beyond `O(n log n)`.
    pub ranges_scanned: usize,
}

/// Places every interval of `timeline`, visiting them in `order` (a permutation of the indices),
/// with the default [`SEARCH_BUDGET`].
pub fn place_in_order(timeline: &Timeline, order: &[usize]) -> BestFit {
    place_in_order_with_budget(timeline, order, SEARCH_BUDGET)
}

/// [`place_in_order`] with a chosen budget: `usize::MAX` is exact best fit, 0 is first fit.
pub fn place_in_order_with_budget(timeline: &Timeline, order: &[usize], budget: usize) -> BestFit {
    debug_assert_eq!(order.len(), timeline.spans.len());
    let mut index = IntervalIndex::new(timeline.slots());
    let mut offsets = vec![0; timeline.spans.len()];
    let mut arena_bytes = 0;
    let mut ranges_scanned = 0;
    let mut search = Search::default();
    for &i in order {
        let span = timeline.spans[i];
        if span.size == 0 {
            continue; // takes no bytes, conflicts with nothing; offset 0
        }
        index.occupied_sets(span.lo, span.hi, &mut search.sets);
        let (offset, work) = search.find(&index, span.size, budget, EAGER_MAX);
        ranges_scanned += work;
        index.insert(span.lo, span.hi, offset, span.size);
        offsets[i] = offset;
        arena_bytes = arena_bytes.max(offset + span.size);
    }
    BestFit { offsets, arena_bytes, ranges_scanned }
}

/// Scratch space for one query, reused from buffer to buffer.
#[derive(Default)]
struct Search {
    sets: Vec<SetId>,
    union: Union,
    /// (range start, range end, which set, position in it), lowest start first.
    heap: BinaryHeap<Reverse<(usize, usize, usize, usize)>>,
}

impl Search {
    /// The offset for `size` bytes among the ranges of `self.sets`, and the ranges read.
    /// Merges eagerly up to `eager_max` ranges (the two ways give the same answer).
    fn find(
        &mut self,
        index: &IntervalIndex,
        size: usize,
        budget: usize,
        eager_max: usize,
    ) -> (usize, usize) {
        let total: usize = self.sets.iter().map(|&id| index.set(id).len()).sum();
        if total <= eager_max {
            self.union.clear();
            self.sets.iter().for_each(|&id| self.union.add(index.set(id)));
            return (choose_gap(self.union.ranges().iter().copied(), size, budget), total);
        }
        self.heap.clear();
        for (k, &id) in self.sets.iter().enumerate() {
            let first = index.set(id)[0];
            self.heap.push(Reverse((first.0, first.1, k, 0)));
        }
        let mut read = 0;
        let ranges = std::iter::from_fn(|| {
            let Reverse((lo, hi, k, pos)) = self.heap.pop()?;
            if let Some(&next) = index.set(self.sets[k]).get(pos + 1) {
                self.heap.push(Reverse((next.0, next.1, k, pos + 1)));
            }
            read += 1;
            Some((lo, hi))
        });
        let offset = choose_gap(ranges, size, budget);
        (offset, read)
    }
}

/// Where `size` bytes go, given the taken ranges in ascending order of start (they may overlap):
/// the holes between them are visited from the bottom; a hole of exactly `size` is taken at once;
/// otherwise the smallest hole that fits (the lowest on ties) is kept, and once `budget` holes
/// have been visited the search stops at the first moment it has one. With no fitting hole the
/// buffer goes on top of the highest range. `budget = usize::MAX` is best fit, 0 is first fit.
pub fn choose_gap(ranges: impl IntoIterator<Item = (usize, usize)>, size: usize, budget: usize) -> usize {
    let mut best: Option<(usize, usize)> = None; // (hole length, offset)
    let mut holes = 0;
    let mut top = 0;
    for (lo, hi) in ranges {
        if lo > top {
            let hole = lo - top;
            if hole == size {
                return top; // a perfect fit: nothing smaller, nothing lower
            }
            if hole > size && best.is_none_or(|(len, _)| hole < len) {
                best = Some((hole, top));
            }
            holes += 1;
            if holes >= budget
                && let Some((_, offset)) = best
            {
                return offset;
            }
        }
        top = top.max(hi);
    }
    best.map_or(top, |(_, offset)| offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_the_smallest_gap_then_the_lowest() {
        // Gaps: [10, 30) len 20, [40, 50) len 10, [60, 70) len 10; top 80.
        let taken = [(0, 10), (30, 40), (50, 60), (70, 80)];
        let best = |size| choose_gap(taken, size, usize::MAX);
        assert_eq!(best(8), 40);
        assert_eq!(best(10), 40);
        assert_eq!(best(15), 10);
        assert_eq!(best(21), 80);
        assert_eq!(choose_gap([], 5, usize::MAX), 0);
    }

    #[test]
    fn overlapping_ranges_do_not_open_gaps() {
        assert_eq!(choose_gap([(0, 50), (10, 20), (60, 70)], 10, usize::MAX), 50);
        assert_eq!(choose_gap([(0, 10), (20, 30)], 10, usize::MAX), 10);
    }

    #[test]
    fn eager_and_lazy_merges_agree() {
        let mut state = 7u64;
        let mut next = move |m: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % m
        };
        for _ in 0..50 {
            let slots = 1 + next(40);
            let mut index = IntervalIndex::new(slots);
            for _ in 0..next(120) {
                let lo = next(slots);
                let hi = lo + next(slots - lo);
                index.insert(lo, hi, 16 * next(64), 16 * (1 + next(6)));
            }
            let mut search = Search::default();
            for _ in 0..20 {
                let lo = next(slots);
                let hi = lo + next(slots - lo);
                let size = 16 * (1 + next(6));
                index.occupied_sets(lo, hi, &mut search.sets);
                for budget in [0, 1, 2, 5, usize::MAX] {
                    let eager = search.find(&index, size, budget, usize::MAX).0;
                    let lazy = search.find(&index, size, budget, 0).0;
                    assert_eq!(eager, lazy, "slots [{lo}, {hi}], size {size}, budget {budget}");
                }
            }
        }
    }

    #[test]
    fn the_budget_bounds_the_search() {
        // Holes: [10, 30) 20, [40, 45) 5, [50, 58) 8, [60, 66) 6; top 70.
        let taken = [(0, 10), (30, 40), (45, 50), (58, 60), (66, 70)];
        assert_eq!(choose_gap(taken, 6, usize::MAX), 60); // exact fit, found last
        assert_eq!(choose_gap(taken, 6, 0), 10); // first fit
        assert_eq!(choose_gap(taken, 6, 1), 10); // settles after the first hole
        assert_eq!(choose_gap(taken, 6, 3), 50); // best of the first three
        assert_eq!(choose_gap(taken, 7, 2), 10); // best of the first two
        assert_eq!(choose_gap(taken, 8, 3), 50); // a perfect fit ends the search
        // Past the budget with nothing found yet: the first hole that fits.
        assert_eq!(choose_gap([(0, 10), (12, 20), (25, 30), (40, 50), (70, 80)], 7, 1), 30);
        assert_eq!(choose_gap(taken, 21, 0), 70); // nothing fits: on top
    }
}
