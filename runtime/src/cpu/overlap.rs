//! Collectives that overlap the steps after them: a data-parallel plan's all-reduces and
//! reduce-scatters run on a communication thread while the executor goes on with the backward
//! pass, and a step waits for a collective only when it touches the collective's bytes.
//!
//! Why: the plan issues each gradient bucket's collective right after the bucket's last
//! gradient (`kiln_compiler::data_parallel`), as DDP does, but a blocking collective holds the
//! rank until every other rank reaches it and the sum is done, while the rest of the backward
//! pass could run. XLA splits such ops into start/done pairs; here the done point is found at run
//! time: before each step the executor compares the byte ranges the step reads and writes (its
//! operands, output and scratch) with those of every collective in flight (operand and output)
//! and waits for the ones they overlap. That is safe whatever the plan: where the planner reused
//! a collective's operand buffer for a later value, the writer of that value waits; where the
//! reduce is in place (the buckets: `Op::may_write_over`), nothing but its readers touches it, so
//! it overlaps every step up to the updates. No buffer lives longer than planned: the arena is
//! unchanged.
//!
//! One thread runs the collectives in the plan's order (a communicator matches collectives by
//! their order on every rank); all-gathers, which write variables, stay in line (after the
//! collectives in flight); so does a collective whose next step touches its buffers (it would be
//! waited for at once: `next_reads`); guard mode runs everything in line (its canary checks read
//! buffers between steps), and so does `CpuBackend::set_overlap(false)` or `KILN_OVERLAP=0`.
//!
//! The order decides what there is to overlap: the `memory` order updates each bucket's weights
//! right after its collective (freeing the bucket at once), so `schedule::candidates` also tries
//! every order with each collective's readers deferred past the next collective (`+overlap`),
//! kept where it plans no larger (the transformer's data-parallel step: `depth-first-reversed
//! +overlap`, 30,235,556 B a rank as without; the mlp's would cost 3.2 MB, the cnn's 5 KB, so
//! theirs stay). Measured in `benches/data_parallel.rs` (the overlap table).

use std::ops::Range;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Condvar, Mutex};

use kiln_kernels::cpu::CpuKernel;

/// Whether collectives overlap the steps after them (`KILN_OVERLAP=0` runs them in line, to
/// compare).
pub(crate) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KILN_OVERLAP").map_or(true, |v| v != "0"))
}

/// A collective handed to the thread: its kernel and pointers.
struct Job<'a> {
    step: usize,
    kernel: &'a dyn CpuKernel,
    inputs: Vec<Address>,
    output: Address,
}

/// A pointer that may cross to the communication thread.
#[derive(Clone, Copy)]
struct Address(*mut u8);
// SAFETY: an address only; the executor keeps the bytes it points at untouched by every other
// step until the collective is done (`InFlight::wait_for`), and alive (the program outlives the
// scope the thread runs in).
unsafe impl Send for Address {}

/// What the thread has finished: the count of collectives done and the first failure.
pub(crate) type Books = (Mutex<Done>, Condvar);

/// What `Books` counts.
#[derive(Default)]
pub(crate) struct Done {
    count: usize,
    failure: Option<(usize, String)>,
}

/// The collectives in flight during one run, and the thread that runs them.
pub(crate) struct InFlight<'a> {
    jobs: Sender<Job<'a>>,
    done: &'a Books,
    /// (ticket, byte ranges) of each collective sent and not known to be done.
    pending: Vec<(usize, Vec<Range<usize>>)>,
    sent: usize,
}

/// The byte range of `bytes` bytes at `ptr`.
pub(crate) fn range(ptr: *mut u8, bytes: usize) -> Range<usize> {
    let start = ptr as usize;
    start..start + bytes
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

impl<'a> InFlight<'a> {
    /// Starts the communication thread in `scope`; `done` is its books, owned by the caller.
    pub(crate) fn start<'scope>(
        scope: &'scope std::thread::Scope<'scope, '_>,
        done: &'a Books,
    ) -> InFlight<'a>
    where
        'a: 'scope,
    {
        let (jobs, queue) = channel::<Job<'a>>();
        scope.spawn(move || {
            for job in queue {
                let (lock, signal) = done;
                // After a failure the rest are counted without running: the run is failing, and
                // each would wait for a communicator that has given up.
                let failed = lock.lock().unwrap_or_else(|e| e.into_inner()).failure.is_some();
                let failure = if failed {
                    None
                } else {
                    let pointers: Vec<*mut u8> = job.inputs.iter().map(|a| a.0).collect();
                    // A panic is caught and counted as a failure: otherwise the job would never
                    // be counted done and the executor would wait for it forever.
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        // SAFETY: the executor's contract for this step (`CpuBackend::run`:
                        // validated plan, pointers into live buffers of the values' sizes), and
                        // no other step touches these bytes until this job is counted done
                        // (`wait_for`).
                        unsafe { job.kernel.run(&pointers, job.output.0) };
                        job.kernel.take_failure()
                    }))
                    .unwrap_or_else(|_| {
                        Some(format!("{} panicked on the communication thread", job.kernel.describe()))
                    })
                };
                let mut d = lock.lock().unwrap_or_else(|e| e.into_inner());
                d.count += 1;
                if d.failure.is_none() {
                    d.failure = failure.map(|why| (job.step, why));
                }
                signal.notify_all();
            }
        });
        InFlight { jobs, done, pending: Vec::new(), sent: 0 }
    }

    /// The books of a run's collectives.
    pub(crate) fn books() -> Books {
        (Mutex::new(Done::default()), Condvar::new())
    }

    /// Sends step `step`'s collective; `ranges` are the bytes it reads and writes. Err where the
    /// thread is gone (it ended: nothing would run the collective).
    pub(crate) fn send(
        &mut self,
        step: usize,
        kernel: &'a dyn CpuKernel,
        inputs: &[*mut u8],
        output: *mut u8,
        ranges: Vec<Range<usize>>,
    ) -> Result<(), (usize, String)> {
        let job = Job {
            step,
            kernel,
            inputs: inputs.iter().map(|&p| Address(p)).collect(),
            output: Address(output),
        };
        self.jobs.send(job).map_err(|_| (step, "the communication thread has ended".to_string()))?;
        self.pending.push((self.sent, ranges));
        self.sent += 1;
        Ok(())
    }

    /// Waits for every collective in flight whose bytes overlap `touched`; the first failure
    /// of any collective done so far, as (step, why).
    pub(crate) fn wait_for(&mut self, touched: &[Range<usize>]) -> Option<(usize, String)> {
        let last = self
            .pending
            .iter()
            .filter(|(_, ranges)| ranges.iter().any(|r| touched.iter().any(|t| overlaps(r, t))))
            .map(|(ticket, _)| *ticket)
            .max();
        match last {
            Some(ticket) => self.wait_until(ticket + 1),
            None => {
                // Forget the collectives already done, so that the steps after them need not
                // compare their bytes.
                let d = self.done.0.lock().unwrap_or_else(|e| e.into_inner());
                let (count, failure) = (d.count, d.failure.clone());
                drop(d);
                self.pending.retain(|(ticket, _)| *ticket >= count);
                failure
            }
        }
    }

    /// Waits for every collective sent.
    pub(crate) fn wait_all(&mut self) -> Option<(usize, String)> {
        self.wait_until(self.sent)
    }

    /// Whether any collective is in flight.
    pub(crate) fn busy(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Waits until `count` collectives are done (they finish in order).
    fn wait_until(&mut self, count: usize) -> Option<(usize, String)> {
        let (lock, signal) = self.done;
        let mut d = lock.lock().unwrap_or_else(|e| e.into_inner());
        while d.count < count {
            d = signal.wait(d).unwrap_or_else(|e| e.into_inner());
        }
        let failure = d.failure.clone();
        drop(d);
        self.pending.retain(|(ticket, _)| *ticket >= count);
        failure
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::Receiver;

    /// A collective that finishes when the test says so, and may fail.
    struct Gate {
        open: Mutex<Receiver<()>>,
        fail: bool,
    }

    impl CpuKernel for Gate {
        unsafe fn run(&self, _inputs: &[*mut u8], _output: *mut u8) {
            let _ = self.open.lock().unwrap().recv();
        }

        fn describe(&self) -> String {
            "gate".into()
        }

        fn take_failure(&self) -> Option<String> {
            self.fail.then(|| "the other rank left".into())
        }
    }

    /// A step waits only for the collectives whose bytes it touches: one that touches none runs
    /// while a collective is in flight, one that touches its bytes waits until it is done, and a
    /// failure reaches the step that waits.
    #[test]
    // (Lists of one byte range each, as the executor passes them.)
    #[allow(clippy::single_range_in_vec_init)]
    fn steps_wait_only_for_the_collectives_they_touch() {
        let (release, gate) = channel();
        let kernel = Gate { open: Mutex::new(gate), fail: false };
        let (release_failing, gate) = channel();
        let failing = Gate { open: Mutex::new(gate), fail: true };
        let books = InFlight::books();
        std::thread::scope(|scope| {
            let mut flight = InFlight::start(scope, &books);
            flight.send(3, &kernel, &[], std::ptr::null_mut(), vec![1000..1064]).unwrap();
            assert!(flight.busy());
            // Bytes beside the collective's: no wait (the gate is still shut).
            assert_eq!(flight.wait_for(&[0..1000, 1064..2000]), None);
            assert!(flight.busy());
            let opener = scope.spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(50));
                release.send(()).unwrap();
            });
            let start = std::time::Instant::now();
            assert_eq!(flight.wait_for(&[1060..1070]), None);
            assert!(start.elapsed() >= std::time::Duration::from_millis(40), "waited for the gate");
            assert!(!flight.busy());
            opener.join().unwrap();
            flight.send(7, &failing, &[], std::ptr::null_mut(), vec![0..8]).unwrap();
            release_failing.send(()).unwrap();
            assert_eq!(flight.wait_all(), Some((7, "the other rank left".to_string())));
        });
    }

    #[test]
    fn ranges_overlap_only_where_they_share_a_byte() {
        assert!(overlaps(&(0..8), &(4..12)));
        assert!(overlaps(&(4..12), &(0..8)));
        assert!(!overlaps(&(0..8), &(8..16)));
        assert!(!overlaps(&(8..16), &(0..8)));
        assert!(overlaps(&(0..100), &(10..20)));
    }
}
