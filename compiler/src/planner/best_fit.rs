//! Best-fit placement in a given order (TensorFlow Lite's arena planner, XLA's
//! GlobalDecreasingSizeBestFitHeap).
//!
//! Each buffer, in turn, goes into the smallest hole between the byte ranges taken during its
//! lifetime that fits it (the lowest such hole on ties), else on top of the highest of them. The
//! taken ranges come from the [`IntervalIndex`] as `O(log n)` sets. Up to 64 ranges they are
//! collected and sorted; beyond, the search walks the sets side by side without building their
//! union, skipping holes too small for the buffer ([`RangeSet::next_fitting`]).
//!
//! One deliberate bound: only the lowest [`SEARCH_BUDGET`] (8) holes that fit are compared. Exact
//! best fit compares them all, and some orders leave hundreds per buffer: on a 100k-interval
//! transformer step whose weight gradients live until the end, the `start` order took 7.6 s exact
//! and 0.28 s with the bound (1,700 and 37 search steps per buffer; `size` 0.90 and 0.38 s). The
//! arenas did not suffer: equal
//! on every training step measured, and on random mixes as often smaller as larger (best of the
//! three heuristics at 100k intervals, long lifetimes up to 5,000 steps: 1.085 x the bound with
//! the bound, 1.105 exact). `place_in_order_with_budget(.., usize::MAX)` is exact best fit.
//!
//! [`RangeSet::next_fitting`]: super::range_set::RangeSet::next_fitting

use super::interval_index::{IntervalIndex, SetId};
use super::timeline::Timeline;

/// Fitting holes compared, from the lowest up, before best fit takes the smallest of them (see
/// [`GapChoice`] and the module comment for the measurements behind 8).
pub const SEARCH_BUDGET: usize = 8;

/// The result of one best-fit pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BestFit {
    /// One per interval, in input order.
    pub offsets: Vec<usize>,
    /// max(offset + aligned size), 0 when nothing takes space.
    pub arena_bytes: usize,
    /// Over all buffers, the ranges collected (small queries) or the times the search moved past
    /// a taken range (large ones): the work beyond the index's `O(log n)` per buffer.
    pub search_steps: usize,
}

/// Places every interval of `timeline`, visiting them in `order` (a permutation of the indices),
/// with the default [`SEARCH_BUDGET`].
pub fn place_in_order(timeline: &Timeline, order: &[usize]) -> BestFit {
    place_in_order_with_budget(timeline, order, SEARCH_BUDGET)
}

/// [`place_in_order`] comparing at most `budget` fitting holes per buffer: `usize::MAX` is best
/// fit, 1 (or 0) first fit.
pub fn place_in_order_with_budget(timeline: &Timeline, order: &[usize], budget: usize) -> BestFit {
    debug_assert_eq!(order.len(), timeline.spans.len());
    let mut index = IntervalIndex::new(timeline.slots());
    let mut offsets = vec![0; timeline.spans.len()];
    let mut arena_bytes = 0;
    let mut search_steps = 0;
    let mut search = Search::default();
    for &i in order {
        let span = timeline.spans[i];
        if span.size == 0 {
            continue; // takes no bytes, conflicts with nothing; offset 0
        }
        index.occupied_sets(span.lo, span.hi, &mut search.sets);
        let (offset, steps) = search.find(&index, span.size, budget);
        search_steps += steps;
        index.insert(span.lo, span.hi, offset, span.size);
        offsets[i] = offset;
        arena_bytes = arena_bytes.max(offset + span.size);
    }
    BestFit { offsets, arena_bytes, search_steps }
}

/// Up to this many ranges in a query's sets, they are simply collected and sorted: cheaper than
/// the round-robin search over sets when there are few.
const COLLECT_MAX: usize = 64;

/// Scratch space for one query, reused from buffer to buffer.
#[derive(Default)]
struct Search {
    sets: Vec<SetId>,
    /// The collected ranges, for small queries.
    ranges: Vec<(usize, usize)>,
    /// Per set, the first range that may still matter (everything before it ends below the
    /// candidate offset, which only grows).
    cursors: Vec<usize>,
}

impl Search {
    /// The offset for `size` bytes given the taken ranges of `self.sets`, and the work done.
    fn find(&mut self, index: &IntervalIndex, size: usize, budget: usize) -> (usize, usize) {
        self.find_with(index, size, budget, COLLECT_MAX)
    }

    /// [`Search::find`], collecting and sorting up to `collect_max` ranges (both ways agree).
    fn find_with(
        &mut self,
        index: &IntervalIndex,
        size: usize,
        budget: usize,
        collect_max: usize,
    ) -> (usize, usize) {
        let total: usize = self.sets.iter().map(|&id| index.set(id).len()).sum();
        if total > collect_max
            && let Some(found) = self.walk(index, size, budget, 4 * total)
        {
            return found;
        }
        self.ranges.clear();
        self.sets.iter().for_each(|&id| self.ranges.extend_from_slice(index.set(id).ranges()));
        self.ranges.sort_unstable();
        (choose_gap(self.ranges.iter().copied(), size, budget), total)
    }

    /// The search over the sets side by side; `None` once it has looked at sets `max_visits`
    /// times (sets that fill each other's holes range by range make it slower than a sort).
    ///
    /// A candidate offset `p` rises until `[p, p + size)` is free in every set: a set that overlaps
    /// it moves `p` to the end of its first range followed by a hole of `size` or more (no smaller
    /// hole can hold the buffer, whatever the other sets hold there). Settled, `p` starts a hole of
    /// the union that fits; holes are thus visited from the bottom, and only those that fit.
    fn walk(
        &mut self,
        index: &IntervalIndex,
        size: usize,
        budget: usize,
        max_visits: usize,
    ) -> Option<(usize, usize)> {
        let k = self.sets.len();
        self.cursors.clear();
        self.cursors.resize(k, 0);
        let mut choice = GapChoice::new(size, budget);
        let (mut p, mut steps, mut visits) = (0, 0, 0);
        loop {
            // Visit the sets round robin until a whole round leaves `p` where it is.
            let (mut i, mut quiet) = (0, 0);
            while quiet < k {
                visits += 1;
                if visits > max_visits {
                    return None;
                }
                let set = index.set(self.sets[i]);
                let r = set.ranges();
                let mut c = self.cursors[i];
                if c < r.len() && r[c].1 <= p {
                    c += r[c..].partition_point(|&(_, hi)| hi <= p);
                }
                if c < r.len() && r[c].0 < p + size {
                    let j = set.next_fitting(c, size);
                    p = r[j].1;
                    c = j + 1;
                    steps += 1;
                    quiet = 1; // this set is settled now
                } else {
                    quiet += 1;
                }
                self.cursors[i] = c;
                i = if i + 1 == k { 0 } else { i + 1 };
            }
            // [p, p + size) is free everywhere: the hole runs to the lowest range still ahead.
            let hole_end = (0..k)
                .filter_map(|i| index.set(self.sets[i]).ranges().get(self.cursors[i]))
                .map(|r| r.0)
                .min();
            visits += k;
            match hole_end {
                None => return Some((choice.finish(p), steps)),
                Some(end) => {
                    if let Some(offset) = choice.offer(p, end - p) {
                        return Some((offset, steps));
                    }
                    p = end;
                }
            }
        }
    }
}

/// The best-fit rule over fitting holes offered from the lowest up: a hole of exactly the size is
/// taken at once; otherwise the smallest (the lowest on ties) is kept, and after `budget` holes
/// the best so far is taken. With no hole, the buffer goes on top of everything.
#[derive(Clone, Copy, Debug)]
pub struct GapChoice {
    size: usize,
    budget: usize,
    seen: usize,
    best: Option<(usize, usize)>, // (hole length, offset)
}

impl GapChoice {
    /// A choice for a buffer of `size` bytes that takes the best hole so far once `budget` holes
    /// (at least 1) were offered.
    pub fn new(size: usize, budget: usize) -> Self {
        GapChoice { size, budget: budget.max(1), seen: 0, best: None }
    }

    /// Offers the hole `[offset, offset + len)` (`len >= size`); returns the decision if made.
    pub fn offer(&mut self, offset: usize, len: usize) -> Option<usize> {
        debug_assert!(len >= self.size);
        if len == self.size {
            return Some(offset);
        }
        if self.best.is_none_or(|(best, _)| len < best) {
            self.best = Some((len, offset));
        }
        self.seen += 1;
        if self.seen >= self.budget { self.best.map(|(_, offset)| offset) } else { None }
    }

    /// The decision once every fitting hole was offered; `top` is the end of the highest range.
    pub fn finish(self, top: usize) -> usize {
        self.best.map_or(top, |(_, offset)| offset)
    }
}

/// The rule applied to explicit taken ranges (ascending by start; they may overlap): the
/// specification that [`place_in_order`] implements without building the union.
pub fn choose_gap(ranges: impl IntoIterator<Item = (usize, usize)>, size: usize, budget: usize) -> usize {
    let mut choice = GapChoice::new(size, budget);
    let mut top = 0;
    for (lo, hi) in ranges {
        if lo > top
            && lo - top >= size
            && let Some(offset) = choice.offer(top, lo - top)
        {
            return offset;
        }
        top = top.max(hi);
    }
    choice.finish(top)
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
    fn the_search_agrees_with_the_rule_on_the_union() {
        let mut state = 7u64;
        let mut next = move |m: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (state >> 33) as usize % m
        };
        for _ in 0..100 {
            let slots = 1 + next(40);
            let mut index = IntervalIndex::new(slots);
            for _ in 0..next(150) {
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
                let mut all: Vec<(usize, usize)> =
                    search.sets.iter().flat_map(|&id| index.set(id).ranges().iter().copied()).collect();
                all.sort_unstable();
                for budget in [0, 1, 2, 5, usize::MAX] {
                    let got = search.find(&index, size, budget).0;
                    assert_eq!(
                        got,
                        choose_gap(all.iter().copied(), size, budget),
                        "size {size}, budget {budget}"
                    );
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
        assert_eq!(choose_gap(taken, 6, 1), 10);
        assert_eq!(choose_gap(taken, 6, 2), 50); // best of the first two that fit
        assert_eq!(choose_gap(taken, 7, 2), 50);
        assert_eq!(choose_gap(taken, 8, 3), 50); // a perfect fit ends the search
        assert_eq!(choose_gap(taken, 21, 1), 70); // nothing fits: on top
    }
}
