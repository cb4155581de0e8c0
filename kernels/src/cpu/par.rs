//! Thread-level parallelism shared by the kernels.
//!
//! Small tensors run on the calling thread: a training step of a small MLP launches dozens of
//! kernels on a few hundred elements each, and a rayon hand-off (a few microseconds) would cost more
//! than the work. Above `PAR_MIN` units of work the range is cut into chunks whose size depends only
//! on the shape, never on the thread count, so that any kernel whose chunks accumulate produces the
//! same bits on every machine.

use rayon::prelude::*;

/// Work (in elements touched) below which a kernel stays on the calling thread.
pub(crate) const PAR_MIN: usize = 32 * 1024;
/// Elements per parallel chunk.
pub(crate) const CHUNK: usize = 16 * 1024;

/// A raw pointer that may cross threads. Kernels hand disjoint parts of a buffer to different
/// threads; the pointer itself carries no ownership.
#[derive(Debug)]
pub(crate) struct SendPtr<T>(*mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

// SAFETY: a SendPtr is only an address; every kernel that shares one across threads writes
// disjoint ranges through it (and reads shared inputs only).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    pub(crate) fn new(p: *mut T) -> Self {
        SendPtr(p)
    }

    /// The pointer (a method, so that closures capture the whole `SendPtr`, not its field).
    #[inline(always)]
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// Calls `f(start, end)` over sub-ranges covering `0..units`, where one unit costs about `unit_cost`
/// elements of work. Serial (one call, the whole range) below `PAR_MIN` total work; otherwise
/// chunks of about `CHUNK` elements each, run on the rayon pool.
pub(crate) fn par_ranges(units: usize, unit_cost: usize, f: impl Fn(usize, usize) + Sync) {
    if units == 0 {
        return;
    }
    let cost = unit_cost.max(1);
    if units.saturating_mul(cost) < PAR_MIN || units == 1 || rayon::current_num_threads() == 1 {
        f(0, units);
        return;
    }
    let grain = (CHUNK / cost).max(1);
    let chunks = units.div_ceil(grain);
    (0..chunks).into_par_iter().for_each(|c| f(c * grain, ((c + 1) * grain).min(units)));
}

/// Like `par_ranges`, but always cuts `0..units` into chunks of `grain` units, whether or not it
/// runs them in parallel: for kernels whose chunks must be fixed by the shape.
pub(crate) fn par_chunks(units: usize, grain: usize, work: usize, f: impl Fn(usize, usize) + Sync) {
    let grain = grain.max(1);
    let chunks = units.div_ceil(grain);
    let body = |c: usize| f(c * grain, ((c + 1) * grain).min(units));
    if work < PAR_MIN || chunks <= 1 || rayon::current_num_threads() == 1 {
        (0..chunks).for_each(body);
    } else {
        (0..chunks).into_par_iter().for_each(body);
    }
}
