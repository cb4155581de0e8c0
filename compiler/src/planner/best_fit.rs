//! Best-fit placement in a given order (TensorFlow Lite's arena planner, XLA's
//! GlobalDecreasingSizeBestFitHeap).
//!
//! Each buffer, in turn, goes into the smallest gap between the byte ranges taken during its
//! lifetime that fits it (the lowest such gap on ties), else on top of the highest of them. The
//! taken ranges come from the [`IntervalIndex`] as a few merged unions, so one buffer costs
//! `O(log n)` index work plus sorting the ranges returned, instead of a scan of every placed buffer.
//! The order is the only thing that differs between heuristics (see [`super::heuristics`]).

use super::interval_index::IntervalIndex;
use super::range_set::Union;
use super::timeline::Timeline;

/// The result of one best-fit pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BestFit {
    /// One per interval, in input order.
    pub offsets: Vec<usize>,
    /// max(offset + aligned size), 0 when nothing takes space.
    pub arena_bytes: usize,
    /// Byte ranges the index returned, over all buffers: the work done beyond `O(n log n)`.
    pub ranges_scanned: usize,
}

/// Places every interval of `timeline`, visiting them in `order` (a permutation of the indices).
pub fn place_in_order(timeline: &Timeline, order: &[usize]) -> BestFit {
    debug_assert_eq!(order.len(), timeline.spans.len());
    let mut index = IntervalIndex::new(timeline.slots());
    let mut offsets = vec![0; timeline.spans.len()];
    let mut arena_bytes = 0;
    let mut ranges_scanned = 0;
    let mut taken = Union::new();
    for &i in order {
        let span = timeline.spans[i];
        if span.size == 0 {
            continue; // takes no bytes, conflicts with nothing; offset 0
        }
        ranges_scanned += index.occupied(span.lo, span.hi, &mut taken);
        let offset = best_gap(taken.ranges(), span.size);
        index.insert(span.lo, span.hi, offset, span.size);
        offsets[i] = offset;
        arena_bytes = arena_bytes.max(offset + span.size);
    }
    BestFit { offsets, arena_bytes, ranges_scanned }
}

/// The offset for `size` bytes given the taken ranges (sorted by start; they may overlap): the start
/// of the smallest gap that fits (the lowest on ties), else the top of the highest taken range.
pub fn best_gap(taken: &[(usize, usize)], size: usize) -> usize {
    debug_assert!(taken.is_sorted());
    let mut best: Option<(usize, usize)> = None; // (gap length, offset)
    let mut top = 0;
    for &(lo, hi) in taken.iter() {
        if lo > top {
            let gap = lo - top;
            if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                if gap == size {
                    return top; // a perfect fit: nothing smaller, nothing lower
                }
                best = Some((gap, top));
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
        assert_eq!(best_gap(&taken, 8), 40);
        assert_eq!(best_gap(&taken, 10), 40);
        assert_eq!(best_gap(&taken, 15), 10);
        assert_eq!(best_gap(&taken, 21), 80);
        assert_eq!(best_gap(&[], 5), 0);
    }

    #[test]
    fn overlapping_ranges_do_not_open_gaps() {
        assert_eq!(best_gap(&[(0, 50), (10, 20), (60, 70)], 10), 50);
        assert_eq!(best_gap(&[(0, 10), (20, 30)], 10), 10);
    }
}
