//! One CPU for each thread of a pooled run (`on_the_pool`): a worker kept awake for the run that
//! finds itself on a CPU another of the run's threads already stands on moves to a free one.
//!
//! Why: Linux can leave two workers of a pool on one CPU while another CPU of the process idles.
//! A worker woken by the runner is placed beside it (wake-affine), and two threads that keep
//! each other cache-hot are slow to be pulled apart by the load balancer; the worker kept
//! awake for the run never sleeps, so the pair stays for several runs. It happens after the
//! pool idled (two seconds between rounds of runs, as a bench interleaving another process
//! does, or a server between requests). MobileNetV3-small's forward pass on two threads, three
//! rounds of 20 runs after a 2 s pause each (2-core AMD EPYC VM, `cargo bench --bench forward`),
//! each run's CPUs read with `sched_getcpu`: without this, 15 of the 66 runs had the runner and
//! the worker kept awake on one CPU, and took 4.6-4.8 ms (one thread alone takes 3.4), the
//! others 1.8-2.1 ms; with it none of 66 shared a CPU and none took over 3.8 ms. Pinning each
//! worker to its own CPU for good ends it too, but a pinned worker cannot leave a CPU another
//! process wants. Here a worker is moved only when it shares a CPU with another thread of the
//! run, by narrowing its affinity to one free CPU (Linux migrates it at once) and restoring the
//! mask right after: the scheduler stays free to move it later.
//!
//! Elsewhere than Linux this does nothing.

use std::sync::Mutex;

/// The CPUs the threads of one run stand on, claimed as each begins, and the pool threads that
/// sat (a worker kept awake can run another worker's `keep_busy` job nested in its own: it sits
/// once).
#[derive(Default)]
pub(super) struct Seats {
    taken: Mutex<(Vec<usize>, Vec<Option<usize>>)>,
}

impl Seats {
    /// Claims the calling thread's CPU, or moves the thread to a CPU of its allowed set that no
    /// thread of the run has claimed and claims that one. Nothing moves where every allowed CPU
    /// is claimed (more threads than CPUs), the CPU cannot be read, or this thread already sat.
    pub(super) fn sit(&self) {
        let Some(cpu) = os::current_cpu() else { return };
        let mut guard = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let (taken, sat) = &mut *guard;
        let thread = rayon::current_thread_index();
        if sat.contains(&thread) {
            return;
        }
        sat.push(thread);
        let allowed = if taken.contains(&cpu) { os::allowed_cpus() } else { Vec::new() };
        let Some(free) = choose(cpu, taken, &allowed) else { return };
        if free != cpu && !os::move_to(free) {
            return;
        }
        taken.push(free);
    }
}

/// The CPU a thread on `cpu` should stand on: `cpu` itself where no one claimed it, else the
/// first of `allowed` no one claimed, else none.
fn choose(cpu: usize, taken: &[usize], allowed: &[usize]) -> Option<usize> {
    if !taken.contains(&cpu) {
        return Some(cpu);
    }
    allowed.iter().copied().find(|c| !taken.contains(c))
}

#[cfg(target_os = "linux")]
mod os {
    /// The CPU the calling thread runs on.
    pub fn current_cpu() -> Option<usize> {
        // SAFETY: sched_getcpu takes no arguments and only reads the calling thread's state.
        let cpu = unsafe { libc::sched_getcpu() };
        usize::try_from(cpu).ok()
    }

    fn affinity() -> Option<libc::cpu_set_t> {
        // SAFETY: an all-zero cpu_set_t is a valid (empty) set; sched_getaffinity writes at most
        // size_of::<cpu_set_t>() bytes into it, the size passed.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            (libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0).then_some(set)
        }
    }

    /// The CPUs the calling thread may run on.
    pub fn allowed_cpus() -> Vec<usize> {
        let Some(set) = affinity() else { return Vec::new() };
        // SAFETY: CPU_ISSET reads bit c of the set, c below CPU_SETSIZE, the set's size in bits.
        (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
    }

    /// Moves the calling thread to `cpu` (it runs there when this returns) and gives it back
    /// its allowed set; whether it moved. Where the set cannot be given back (the process's
    /// cpuset shrank meanwhile), the thread is given every CPU it may still use, so that it is
    /// never left bound to one.
    pub fn move_to(cpu: usize) -> bool {
        let Some(before) = affinity() else { return false };
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: `cpu` comes from `allowed_cpus`, so it is below CPU_SETSIZE and CPU_SET
        // writes inside the set; every set passed is a whole cpu_set_t of `size` bytes.
        unsafe {
            let mut one: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut one);
            if libc::sched_setaffinity(0, size, &one) != 0 {
                return false;
            }
            if libc::sched_setaffinity(0, size, &before) != 0 {
                // Every CPU: the kernel keeps the cpuset's own.
                let mut all: libc::cpu_set_t = std::mem::zeroed();
                (0..libc::CPU_SETSIZE as usize).for_each(|c| libc::CPU_SET(c, &mut all));
                libc::sched_setaffinity(0, size, &all);
            }
        }
        true
    }
}

#[cfg(not(target_os = "linux"))]
mod os {
    pub fn current_cpu() -> Option<usize> {
        None
    }
    pub fn allowed_cpus() -> Vec<usize> {
        Vec::new()
    }
    pub fn move_to(_: usize) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_a_free_cpu_and_leaves_a_taken_one_for_a_free_one() {
        assert_eq!(choose(1, &[], &[0, 1]), Some(1));
        assert_eq!(choose(1, &[0], &[0, 1]), Some(1));
        assert_eq!(choose(1, &[1], &[0, 1, 2]), Some(0));
        assert_eq!(choose(1, &[1, 0], &[0, 1, 2]), Some(2));
        // More threads than CPUs: it stays where it is.
        assert_eq!(choose(1, &[0, 1], &[0, 1]), None);
        // A CPU outside the allowed set is never chosen.
        assert_eq!(choose(3, &[3], &[3, 5]), Some(5));
    }

    /// On Linux with two CPUs allowed, a thread sitting after another on its CPU ends on the
    /// other one, and keeps its allowed set.
    #[test]
    fn a_second_thread_on_a_taken_cpu_moves_off_it() {
        let allowed = os::allowed_cpus();
        if allowed.len() < 2 || os::current_cpu().is_none() {
            return;
        }
        let seats = Seats::default();
        seats.sit();
        let first = seats.taken.lock().unwrap().0[0];
        // Sitting again from the same thread sits once.
        seats.sit();
        assert_eq!(seats.taken.lock().unwrap().0, [first]);
        // A second thread on the same CPU: this one under another name.
        seats.taken.lock().unwrap().1.clear();
        seats.sit();
        let taken = seats.taken.lock().unwrap().0.clone();
        assert_eq!(taken.len(), 2);
        assert_ne!(taken[1], first);
        assert_eq!(os::allowed_cpus(), allowed, "the allowed set is given back");
    }
}
