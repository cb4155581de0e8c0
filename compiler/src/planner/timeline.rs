//! Schedule steps compressed to the distinct start steps ("slots"), and the live-bytes profile.
//!
//! Two inclusive ranges intersect iff the later start lies inside both, so only start steps matter:
//! interval `[s, e]` becomes slots `[rank(s), (number of starts <= e) - 1]`, never empty (its own
//! start is a slot), and two intervals conflict iff their slot ranges intersect. This keeps the
//! time axis at most `n` long however sparse the step numbers are, and the live bytes at every step
//! are attained at some slot, so the profile over slots gives the lower bound exactly.

use super::{Interval, align};

/// One interval in slot coordinates, with its aligned size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Aligned bytes.
    pub size: usize,
    /// First slot (inclusive).
    pub lo: usize,
    /// Last slot (inclusive).
    pub hi: usize,
}

/// The compressed time axis of one interval set.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// The distinct start steps, ascending; slot `k` is step `steps[k]`.
    pub steps: Vec<usize>,
    /// One per interval, in input order.
    pub spans: Vec<Span>,
    /// Aligned bytes live at each slot.
    pub live: Vec<usize>,
    /// The alignment in bytes each interval's size is rounded up to in `live`.
    pub alignment: usize,
}

impl Timeline {
    /// Expects `start <= end` for every interval (see `place`).
    pub fn new(intervals: &[Interval], alignment: usize) -> Self {
        let mut steps: Vec<usize> = intervals.iter().map(|iv| iv.start).collect();
        steps.sort_unstable();
        steps.dedup();
        let spans: Vec<Span> = intervals
            .iter()
            .map(|iv| {
                let lo = steps.partition_point(|&s| s < iv.start);
                let hi = steps.partition_point(|&s| s <= iv.end) - 1;
                Span { size: align(iv.bytes, alignment), lo, hi }
            })
            .collect();
        // Difference array over slots, then a prefix sum (wrapping: every prefix is a true total).
        let mut delta = vec![0usize; steps.len() + 1];
        for span in &spans {
            delta[span.lo] = delta[span.lo].wrapping_add(span.size);
            delta[span.hi + 1] = delta[span.hi + 1].wrapping_sub(span.size);
        }
        let mut running = 0usize;
        let live = delta[..steps.len()]
            .iter()
            .map(|d| {
                running = running.wrapping_add(*d);
                running
            })
            .collect();
        Timeline { steps, spans, live, alignment }
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.steps.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compresses_to_start_steps() {
        let ivs = [Interval::new(1, 10, 20), Interval::new(3, 15, 15), Interval::new(5, 21, 30)];
        let t = Timeline::new(&ivs, 4);
        assert_eq!(t.steps, vec![10, 15, 21]);
        assert_eq!(
            t.spans,
            vec![
                Span { size: 4, lo: 0, hi: 1 },
                Span { size: 4, lo: 1, hi: 1 },
                Span { size: 8, lo: 2, hi: 2 }
            ]
        );
        assert_eq!(t.live, vec![4, 8, 8]);
    }
}
