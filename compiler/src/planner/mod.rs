//! Memory placement: one fixed offset per buffer in ONE arena, with the lower bound beside it.
//!
//! The liveness analysis hands the planner a list of [`Interval`]s (a size and the inclusive range of
//! schedule steps during which the buffer is live); the planner returns an offset for each so that no
//! two buffers live at a common step overlap in bytes. As in XLA's heap simulator, the analysis and
//! the placement are separate, several orders are tried ([`heuristics`]) through one best-fit
//! placement ([`best_fit`], TensorFlow Lite's arena planner idea) and the smallest arena is kept.
//! [`lower_bound`] (no arena can be smaller) and [`naive_bytes`] (no reuse) frame the result, and
//! [`verify()`] checks any placement independently of how it was made.
//!
//! Modules, one job each:
//! - [`timeline`]: schedule steps compressed to the distinct start steps, and the live-bytes profile.
//! - [`range_set`]: a sorted set of disjoint byte ranges that can skip holes too small to use.
//! - [`interval_index`]: placed buffers indexed by time: the few sets whose union is what is taken
//!   during steps `[a, b]`, without visiting every conflicting buffer.
//! - [`best_fit`]: places buffers in a given order, each into the smallest hole that fits.
//! - [`heuristics`]: the orders tried (size, breadth, start).
//! - [`bound`]: the lower bound and the no-reuse size.
//! - [`mod@verify`]: the independent checker.
//! - [`workloads`]: synthetic interval sets (MLP and transformer training steps, random mixes) for
//!   tests, benches and reports.
//!
//! Measured with `tests/planner_scale.rs` (release, on the 2-core build machine, about ±20% from
//! run to run as other builds share it; `place` = all three heuristics on two threads): a
//! transformer training step of 1k / 10k / 100k intervals in 3.7 / 34 / 378 ms (each heuristic
//! alone 144-205 ms at 100k); the same with weight gradients held until the end 5.3 / 68 / 764 ms;
//! an MLP step 1.6 / 23 / 174 ms; `verify` 26-39 ms at 100k. Work per buffer stays flat from 1k to
//! 100k (20-40 search steps), so time grows as `n log n`. Arena / lower bound: 1.0000 on every MLP
//! and transformer training step in `tests/planner_workloads.rs`, 1.00-1.14 on random mixes.

pub mod best_fit;
pub mod bound;
pub mod heuristics;
pub mod interval_index;
pub mod range_set;
pub mod timeline;
pub mod verify;
pub mod workloads;

pub use bound::{Bound, lower_bound, naive_bytes};
pub use heuristics::Heuristic;
pub use verify::verify;

use serde::{Deserialize, Serialize};

/// One buffer to place: `bytes` (unaligned), live from schedule step `start` to `end` inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interval {
    /// The buffer's size in bytes, unaligned (the planner aligns it).
    pub bytes: usize,
    /// The first schedule step at which the buffer is live.
    pub start: usize,
    /// The last schedule step (inclusive) at which the buffer is live.
    pub end: usize,
}

impl Interval {
    /// A buffer of `bytes` live from step `start` to `end` inclusive.
    pub fn new(bytes: usize, start: usize, end: usize) -> Self {
        Interval { bytes, start, end }
    }

    /// Whether the two are live at a common step (inclusive ranges; sizes are not looked at).
    pub fn overlaps_in_time(&self, other: &Interval) -> bool {
        self.start <= other.end && other.start <= self.end
    }
}

/// Where every interval goes, and which heuristic gave it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// One per interval, in input order, multiples of the alignment.
    pub offsets: Vec<usize>,
    /// max(offset + aligned size); a multiple of the alignment (0 when nothing takes space).
    pub arena_bytes: usize,
    /// The heuristic that won (the first of the smallest, in [`Heuristic::ALL`] order).
    pub algorithm: String,
    /// Every heuristic tried and the arena it gave, in [`Heuristic::ALL`] order.
    pub tried: Vec<(String, usize)>,
}

/// `bytes` rounded up to a multiple of `alignment`.
///
/// # Panics
/// If `alignment` is 0, or the rounded size does not fit in `usize`.
pub fn align(bytes: usize, alignment: usize) -> usize {
    assert!(alignment > 0, "planner: alignment must be at least 1 byte");
    bytes
        .div_ceil(alignment)
        .checked_mul(alignment)
        .unwrap_or_else(|| panic!("planner: {bytes} bytes aligned to {alignment} overflows usize"))
}

/// Places every interval: tries each of [`Heuristic::ALL`] through best fit and keeps the smallest
/// arena (ties go to the earlier heuristic). Deterministic for a given input: from
/// [`PARALLEL_MIN`] intervals up the heuristics run on worker threads, but each is computed alone
/// and the results are compared in a fixed order.
///
/// # Panics
/// If an interval has `start > end` (liveness never produces one), or `alignment` is 0.
pub fn place(intervals: &[Interval], alignment: usize) -> Placement {
    check_intervals(intervals);
    let timeline = timeline::Timeline::new(intervals, alignment);
    let run = |h: Heuristic| best_fit::place_in_order(&timeline, &h.order(&timeline));
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(Heuristic::ALL.len());
    let fits: Vec<best_fit::BestFit> = if intervals.len() < PARALLEL_MIN || workers < 2 {
        Heuristic::ALL.into_iter().map(run).collect()
    } else {
        run_parallel(workers, &run)
    };
    let tried: Vec<(String, usize)> =
        Heuristic::ALL.iter().zip(&fits).map(|(h, fit)| (h.name().to_string(), fit.arena_bytes)).collect();
    let (winner, fit) = Heuristic::ALL
        .into_iter()
        .zip(fits)
        .reduce(|best, next| if next.1.arena_bytes < best.1.arena_bytes { next } else { best })
        .expect("at least one heuristic");
    Placement {
        offsets: fit.offsets,
        arena_bytes: fit.arena_bytes,
        algorithm: winner.name().to_string(),
        tried,
    }
}

/// From this many intervals up, `place` runs the heuristics on worker threads (below it, starting
/// threads costs more than it saves: 1k intervals take 1-2 ms for all three).
pub const PARALLEL_MIN: usize = 4096;

/// Runs every heuristic on `workers` scoped threads, each taking the next heuristic not yet taken;
/// returns the results in [`Heuristic::ALL`] order. A worker's panic is re-raised here.
fn run_parallel<F>(workers: usize, run: &F) -> Vec<best_fit::BestFit>
where
    F: Fn(Heuristic) -> best_fit::BestFit + Sync,
{
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let mut fits: Vec<Option<best_fit::BestFit>> = Heuristic::ALL.iter().map(|_| None).collect();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&h) = Heuristic::ALL.get(k) else { break done };
                        done.push((k, run(h)));
                    }
                })
            })
            .collect();
        for handle in handles {
            match handle.join() {
                Ok(done) => done.into_iter().for_each(|(k, fit)| fits[k] = Some(fit)),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    fits.into_iter().map(|fit| fit.expect("every heuristic ran")).collect()
}

/// Panics on an interval that ends before it starts: a liveness bug, not a user mistake.
pub(crate) fn check_intervals(intervals: &[Interval]) {
    if let Some((i, iv)) = intervals.iter().enumerate().find(|(_, iv)| iv.start > iv.end) {
        panic!("planner: interval {i} ends before it starts ({iv:?}); liveness must give start <= end");
    }
}
