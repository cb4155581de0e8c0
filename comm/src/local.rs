//! In-process ranks: `local_group(n)` makes n communicators for n threads of one process.
//!
//! Every call is one or two *rounds* of a rendezvous guarded by one mutex: each rank copies its
//! data into its own stage buffer, deposits its [`Meta`] and waits on a condition variable until
//! all `n` have deposited; the last one publishes the `n` metas and wakes the others, who then
//! read each other's stage buffers (see `Shared::stages` for why that is race-free).
//! `all_reduce_sum` is a reduce-scatter round (each rank adds its own shard of everyone's
//! buffers, in rank order) followed by an all-gather round of the summed shards.
//!
//! Faults never hang: dropping a `LocalComm` (its thread returned or panicked) marks its rank as
//! gone and wakes the waiters, who return [`CommError::PeerLeft`] at once; a rank that waits
//! longer than the group's timeout returns [`CommError::Timeout`] and wakes the others with the
//! same error. Either way the group is then broken: later calls return [`CommError::Broken`].

use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use crate::check::{Meta, Op, check, disagreement};
use crate::error::{CommError, Result};
use crate::shard::{shard_range, sum_in_order};
use crate::{Communicator, DEFAULT_TIMEOUT};

/// `n` in-process ranks, to be moved one to each of `n` threads, with the default timeout
/// ([`DEFAULT_TIMEOUT`]). Element `r` is rank `r`.
pub fn local_group(n: usize) -> Vec<LocalComm> {
    local_group_with_timeout(n, DEFAULT_TIMEOUT)
}

/// Runs `f(rank, comm)` for each of `n` in-process ranks on threads of its own and returns the
/// results in rank order; a rank's panic is resumed here once every rank ended (the others'
/// collectives fail when its `LocalComm` is dropped, so none waits forever).
pub fn run_local_ranks<T: Send>(n: usize, f: impl Fn(usize, LocalComm) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> =
            local_group(n).into_iter().enumerate().map(|(r, comm)| s.spawn(move || f(r, comm))).collect();
        let results: Vec<_> = handles.into_iter().map(|h| h.join()).collect();
        results.into_iter().map(|r| r.unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// `n` in-process ranks whose collectives give up after waiting `timeout` for the others.
pub fn local_group_with_timeout(n: usize, timeout: Duration) -> Vec<LocalComm> {
    let state = State {
        round: 0,
        slots: (0..n).map(|_| None).collect(),
        arrived: 0,
        published: Arc::from(Vec::new()),
        left: vec![false; n],
        broken: None,
    };
    let stages = (0..n).map(|_| [RwLock::new(Vec::new()), RwLock::new(Vec::new())]).collect();
    let shared = Arc::new(Shared { size: n, state: Mutex::new(state), wake: Condvar::new(), stages });
    (0..n)
        .map(|rank| LocalComm {
            rank,
            shared: Arc::clone(&shared),
            timeout,
            round: 0,
            latency: Duration::ZERO,
        })
        .collect()
}

/// One rank of a [`local_group`]. Dropping it tells the other ranks that it left.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
    timeout: Duration,
    /// Rounds this rank has completed: the same count on every rank.
    round: u64,
    /// A simulated network latency added to each collective (`set_latency`).
    latency: Duration,
}

struct Shared {
    size: usize,
    state: Mutex<State>,
    wake: Condvar,
    /// Each rank's data for a round, two buffers used alternately: rank `r` fills
    /// `stages[r][k % 2]` before round `k`, and the others read it after round `k` completes and
    /// before they join round `k + 1`. So when `r` fills the same buffer again, for round `k + 2`,
    /// every reader is done with it (round `k + 1` needed them all). The locks only make this safe
    /// Rust: the rounds already keep writers and readers apart. Buffers keep their capacity, so
    /// repeated calls on same-sized buckets allocate nothing.
    stages: Vec<[RwLock<Vec<f32>>; 2]>,
}

struct State {
    /// Rounds completed so far.
    round: u64,
    /// This round's deposits, by rank.
    slots: Vec<Option<Contribution>>,
    arrived: usize,
    /// The last completed round's deposits, by rank.
    published: Arc<[Contribution]>,
    left: Vec<bool>,
    /// Set by the first failure; every waiter returns it, and later calls refuse to start.
    broken: Option<CommError>,
}

/// What a rank deposits in a round, besides its stage buffer.
#[derive(Debug)]
struct Contribution {
    meta: Meta,
    bytes: Vec<u8>,
}

impl LocalComm {
    /// How long a collective waits for the other ranks before it fails.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets how long this rank's collectives wait for the other ranks before they fail.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Makes each of this rank's collectives take `latency` longer once every rank has arrived
    /// (a sleep): a network's per-message latency, simulated between threads that share memory,
    /// for measuring what overlapping collectives with compute hides (`benches/data_parallel.rs`).
    pub fn set_latency(&mut self, latency: Duration) {
        self.latency = latency;
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code panics while holding the lock, so a poisoned lock still holds a consistent state.
        self.shared.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Rank `rank`'s stage buffer for round `round`, to read once that round has completed.
    fn stage(&self, rank: usize, round: u64) -> RwLockReadGuard<'_, Vec<f32>> {
        let lock = &self.shared.stages[rank][(round % 2) as usize];
        lock.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fills this rank's stage buffer for the next round with `fill`.
    fn fill_stage(&self, fill: impl FnOnce(&mut Vec<f32>)) {
        let lock = &self.shared.stages[self.rank][(self.round % 2) as usize];
        fill(&mut lock.write().unwrap_or_else(PoisonError::into_inner));
    }

    /// One round: deposits `mine` (with this rank's stage buffer, filled before), returns the
    /// round's number and every rank's deposit once all have deposited.
    fn exchange(&mut self, meta: Meta, bytes: Vec<u8>) -> Result<(u64, Arc<[Contribution]>)> {
        let result = self.exchange_now(meta, bytes);
        if !self.latency.is_zero() {
            std::thread::sleep(self.latency);
        }
        result
    }

    fn exchange_now(&mut self, meta: Meta, bytes: Vec<u8>) -> Result<(u64, Arc<[Contribution]>)> {
        let call = meta.op.name();
        let size = self.shared.size;
        let mut st = self.lock();
        if let Some(cause) = &st.broken {
            return Err(broken(call, cause));
        }
        let round = st.round;
        st.slots[self.rank] = Some(Contribution { meta, bytes });
        st.arrived += 1;
        if st.arrived == size {
            let all: Vec<Contribution> = st.slots.iter_mut().filter_map(Option::take).collect();
            st.published = Arc::from(all);
            st.arrived = 0;
            st.round += 1;
            self.shared.wake.notify_all();
            let all = Arc::clone(&st.published);
            drop(st);
            return Ok((self.completed(), all));
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            if st.round != round {
                let all = Arc::clone(&st.published);
                drop(st);
                return Ok((self.completed(), all));
            }
            if let Some(err) = &st.broken {
                return Err(err.clone());
            }
            let gone = (0..size).find(|&r| st.left[r] && st.slots[r].is_none());
            let now = Instant::now();
            let err = if let Some(rank) = gone {
                CommError::PeerLeft { call, rank }
            } else if now >= deadline {
                let missing = (0..size).filter(|&r| st.slots[r].is_none()).collect();
                CommError::Timeout { call, missing, timeout: self.timeout }
            } else {
                st = self
                    .shared
                    .wake
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            };
            st.broken = Some(err.clone());
            self.shared.wake.notify_all();
            return Err(err);
        }
    }

    /// Counts a completed round; returns its number.
    fn completed(&mut self) -> u64 {
        self.round += 1;
        self.round - 1
    }

    /// One round whose metas must pass [`check`] (the same verdict on every rank).
    fn checked_exchange(&mut self, meta: Meta, bytes: Vec<u8>) -> Result<(u64, Arc<[Contribution]>)> {
        let (round, all) = self.exchange(meta, bytes)?;
        check(&all.iter().map(|c| c.meta).collect::<Vec<_>>())?;
        Ok((round, all))
    }

    /// `out` = this rank's shard of the rank-order sum of every rank's stage in `round`, whose
    /// buffers have `len` elements.
    fn my_shard_sum(&self, round: u64, len: usize, out: &mut [f32]) {
        let range = shard_range(len, self.rank, self.shared.size);
        let stages: Vec<_> = (0..self.shared.size).map(|r| self.stage(r, round)).collect();
        sum_in_order(out, stages.iter().map(|s| &s[range.clone()]));
    }
}

/// Makes `stage` a copy of `data`, reusing its capacity.
fn set_to(stage: &mut Vec<f32>, data: &[f32]) {
    stage.clear();
    stage.extend_from_slice(data);
}

/// The error of a call made after the group failed with `cause` (its first line: not its help).
fn broken(call: &'static str, cause: &CommError) -> CommError {
    let cause = cause.to_string().lines().next().unwrap_or_default().to_string();
    CommError::Broken { call, cause }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.lock();
        st.left[self.rank] = true;
        self.shared.wake.notify_all();
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        let (len, size) = (buf.len(), self.shared.size);
        let meta = Meta::new(Op::AllReduceSum, len, 0);
        if size == 1 {
            return Ok(());
        }
        // Round 1 (reduce-scatter): everyone's buffer; each rank sums its shard into its next stage.
        self.fill_stage(|s| set_to(s, buf));
        let (round, _) = self.checked_exchange(meta, Vec::new())?;
        let mine = shard_range(len, self.rank, size).len();
        let next = &self.shared.stages[self.rank][((round + 1) % 2) as usize];
        {
            let mut shard = next.write().unwrap_or_else(PoisonError::into_inner);
            shard.resize(mine, 0.0);
            self.my_shard_sum(round, len, &mut shard);
        }
        // Round 2 (all-gather): everyone's summed shard.
        let (round, _) = self.exchange(meta, Vec::new())?;
        for r in 0..size {
            buf[shard_range(len, r, size)].copy_from_slice(&self.stage(r, round));
        }
        Ok(())
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], shard: &mut [f32]) -> Result<()> {
        let meta = Meta::new(Op::ReduceScatterSum, input.len(), shard.len());
        self.fill_stage(|s| set_to(s, input));
        let (round, _) = self.checked_exchange(meta, Vec::new())?;
        self.my_shard_sum(round, input.len(), shard);
        Ok(())
    }

    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> Result<()> {
        let meta = Meta::new(Op::AllGather, out.len(), shard.len());
        self.fill_stage(|s| set_to(s, shard));
        let (round, _) = self.checked_exchange(meta, Vec::new())?;
        let (len, size) = (out.len(), self.shared.size);
        for r in 0..size {
            out[shard_range(len, r, size)].copy_from_slice(&self.stage(r, round));
        }
        Ok(())
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        let meta = Meta::new(Op::Broadcast, buf.len(), root);
        if self.rank == root {
            self.fill_stage(|s| set_to(s, buf));
        }
        let (round, _) = self.checked_exchange(meta, Vec::new())?;
        if self.rank != root {
            buf.copy_from_slice(&self.stage(root, round));
        }
        Ok(())
    }

    fn agree(&mut self, what: &str, fingerprint: &[u8]) -> Result<()> {
        let meta = Meta::new(Op::Agree, fingerprint.len(), 0);
        let (_, all) = self.checked_exchange(meta, fingerprint.to_vec())?;
        disagreement(what, all.iter().map(|c| c.bytes.as_slice()))
    }

    fn barrier(&mut self) -> Result<()> {
        self.checked_exchange(Meta::new(Op::Barrier, 0, 0), Vec::new()).map(drop)
    }
}
