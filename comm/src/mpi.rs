//! Ranks in separate processes over MPI (feature `mpi`): rsmpi over the system's MPI, e.g.
//! Debian's OpenMPI (`scripts/setup-mpi.sh` installs it, `scripts/test-mpi.sh` tests it).
//!
//! Every call starts with an all-gather of each rank's [`Meta`] (3 × u64), so that mismatched
//! calls, lengths or roots become the same error on every rank before any data moves. The sums
//! never use `MPI_SUM`, whose order of additions is up to the MPI library (it may depend on the
//! algorithm it picks for the message size and process layout): `all_reduce_sum` is an
//! `MPI_Alltoallv` that sends shard `r` of every rank's buffer to rank `r`, which adds the
//! contributions in rank order, then an `MPI_Allgatherv` of the summed shards.
//!
//! # When a rank dies or leaves
//! MPI has no timeout. Under OpenMPI's `mpirun`, a rank that exits with a non-zero status or is
//! killed by a signal makes `mpirun` kill every other rank of the job and exit non-zero, so the
//! others never return from their collective but the job ends. A rank that *hangs* (alive, but
//! never calling the collective) hangs the job: bound it from outside (`mpirun --timeout
//! SECONDS`, or the batch scheduler's limit). MPI's default error handler
//! (`MPI_ERRORS_ARE_FATAL`) aborts the job on any MPI error.
//!
//! Returning normally is the dangerous case: `MPI_Finalize` does not come back while other
//! ranks wait in a collective (measured with OpenMPI 4.1: the job hangs). So dropping an
//! `MpiComm` first announces that this rank leaves, like any call: if every rank is leaving, MPI
//! is finalized; if some rank is in (or later enters) a collective instead, the leaving rank
//! prints which and ends the job with `MPI_Abort`, so `mpirun` exits non-zero. Dropping it
//! while the thread panics aborts the job at once. [`MpiComm::abort`] ends it explicitly.

use mpi::Count;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
// The glob above does not bring MPI's `Communicator` trait, shadowed by ours: name it here.
use mpi::traits::Communicator as _;

use crate::Communicator;
use crate::check::{Meta, Op, check, disagreement};
use crate::error::{CommError, Result};
use crate::shard::{shard_range, sum_in_order};

/// The ranks of `MPI_COMM_WORLD`.
pub struct MpiComm {
    /// Finalizes MPI when dropped: the one `Universe` of the process lives as long as this.
    universe: Universe,
    rank: usize,
    size: usize,
    /// Every rank's contribution to this rank's shard, reused between calls (no page faults on
    /// same-sized buckets).
    gathered: Vec<f32>,
    /// This rank's summed shard in `all_reduce_sum`, reused between calls.
    summed: Vec<f32>,
}

impl MpiComm {
    /// Initialises MPI (with `MPI_THREAD_SERIALIZED`: the communicator may move between threads,
    /// one call at a time) and returns `MPI_COMM_WORLD`. Fails if MPI was already initialised in
    /// this process: make one `MpiComm` per process and pass it around.
    pub fn world() -> Result<MpiComm> {
        let Some((universe, threading)) = mpi::initialize_with_threading(mpi::Threading::Serialized) else {
            return Err(CommError::Mpi {
                what: "MPI is already initialised in this process".into(),
                help: "call MpiComm::world() once per process and pass the MpiComm around".into(),
            });
        };
        if matches!(threading, mpi::Threading::Single | mpi::Threading::Funneled) {
            return Err(CommError::Mpi {
                what: format!("the MPI library provides only {threading:?} threading, not Serialized"),
                help: "use an MPI built with thread support (Debian's OpenMPI has it)".into(),
            });
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or_default();
        let size = usize::try_from(world.size()).unwrap_or(1);
        Ok(MpiComm { universe, rank, size, gathered: Vec::new(), summed: Vec::new() })
    }

    /// Ends the whole job at once (`MPI_Abort`): every rank exits with `code`, including ranks
    /// blocked in a collective. Use it instead of returning when one rank fails on its own.
    pub fn abort(&self, code: i32) -> ! {
        self.comm().abort(code)
    }

    fn comm(&self) -> SimpleCommunicator {
        self.universe.world()
    }

    /// Every rank's `Meta` for this call, checked: the same `Ok` or `Err` on every rank.
    fn announce(&self, mine: Meta) -> Result<Vec<Meta>> {
        let send = [mine.op.code(), mine.len as u64, mine.aux as u64];
        let mut all = vec![0u64; 3 * self.size];
        self.comm().all_gather_into(&send[..], &mut all[..]);
        let metas: Vec<Meta> = all
            .chunks_exact(3)
            .map(|m| {
                // A code no rank sends would be memory corruption; call it a barrier so that the
                // mismatch is still reported by `check`.
                let op = Op::from_code(m[0]).unwrap_or(Op::Barrier);
                Meta::new(op, m[1] as usize, m[2] as usize)
            })
            .collect();
        check(&metas)?;
        Ok(metas)
    }

    /// Counts and displacements of the shards of a buffer of `len` elements, one per rank.
    fn shard_layout(&self, call: &'static str, len: usize) -> Result<(Vec<Count>, Vec<Count>)> {
        let max = Count::MAX as usize;
        // `len + size` bounds every displacement of the reduce-scatter's receive buffer too.
        if len.saturating_add(self.size) > max {
            return Err(CommError::TooLong { call, len, max });
        }
        let ranges = (0..self.size).map(|r| shard_range(len, r, self.size));
        Ok(ranges.map(|r| (r.len() as Count, r.start as Count)).unzip())
    }

    /// This rank's shard of the rank-order sum of every rank's `input` (whose lengths `announce`
    /// has checked to be equal).
    fn reduce_scatter(&mut self, call: &'static str, input: &[f32], shard: &mut [f32]) -> Result<()> {
        let (counts, displs) = self.shard_layout(call, input.len())?;
        let mine = shard.len();
        let mut gathered = std::mem::take(&mut self.gathered);
        gathered.resize(mine * self.size, 0.0);
        let recv_counts = vec![mine as Count; self.size];
        let recv_displs: Vec<Count> = (0..self.size).map(|r| (r * mine) as Count).collect();
        let send = Partition::new(input, counts, displs);
        let mut recv = PartitionMut::new(&mut gathered[..], recv_counts, recv_displs);
        self.comm().all_to_all_varcount_into(&send, &mut recv);
        if mine > 0 {
            sum_in_order(shard, gathered.chunks_exact(mine));
        }
        self.gathered = gathered;
        Ok(())
    }

    fn gather(&self, call: &'static str, shard: &[f32], out: &mut [f32]) -> Result<()> {
        let (counts, displs) = self.shard_layout(call, out.len())?;
        let mut recv = PartitionMut::new(out, counts, displs);
        self.comm().all_gather_varcount_into(shard, &mut recv);
        Ok(())
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("kiln-comm: rank {} panicked: aborting the MPI job", self.rank);
            self.abort(101);
        }
        // Every rank leaving together may finalize; one leaving alone would hang the others.
        if let Err(e) = self.announce(Meta::new(Op::Leave, 0, 0)) {
            let call = match e {
                CommError::PeerLeft { call, .. } => call,
                _ => "another call",
            };
            eprintln!(
                "kiln-comm: rank {} dropped its MpiComm while other ranks are in {call}: aborting the MPI job (MPI_Finalize would hang)",
                self.rank
            );
            self.abort(1);
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        let call = Op::AllReduceSum.name();
        self.announce(Meta::new(Op::AllReduceSum, buf.len(), 0))?;
        if self.size == 1 {
            return Ok(());
        }
        let mut summed = std::mem::take(&mut self.summed);
        summed.resize(shard_range(buf.len(), self.rank, self.size).len(), 0.0);
        let res = self.reduce_scatter(call, buf, &mut summed).and_then(|()| self.gather(call, &summed, buf));
        self.summed = summed;
        res
    }

    fn reduce_scatter_sum(&mut self, input: &[f32], shard: &mut [f32]) -> Result<()> {
        self.announce(Meta::new(Op::ReduceScatterSum, input.len(), shard.len()))?;
        self.reduce_scatter(Op::ReduceScatterSum.name(), input, shard)
    }

    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> Result<()> {
        self.announce(Meta::new(Op::AllGather, out.len(), shard.len()))?;
        self.gather(Op::AllGather.name(), shard, out)
    }

    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()> {
        self.announce(Meta::new(Op::Broadcast, buf.len(), root))?;
        let call = Op::Broadcast.name();
        if buf.len() > Count::MAX as usize {
            return Err(CommError::TooLong { call, len: buf.len(), max: Count::MAX as usize });
        }
        // `announce` checked that `root` is below the size, which is a `Rank`.
        self.comm().process_at_rank(root as mpi::Rank).broadcast_into(buf);
        Ok(())
    }

    fn agree(&mut self, what: &str, fingerprint: &[u8]) -> Result<()> {
        // The lengths may differ (that is a disagreement): the announcement carries them.
        let metas = self.announce(Meta::new(Op::Agree, fingerprint.len(), 0))?;
        let total: usize = metas.iter().map(|m| m.len).sum();
        let call = Op::Agree.name();
        if total > Count::MAX as usize {
            return Err(CommError::TooLong { call, len: total, max: Count::MAX as usize });
        }
        let counts: Vec<Count> = metas.iter().map(|m| m.len as Count).collect();
        let displs: Vec<Count> =
            counts.iter().scan(0, |at, &c| Some(std::mem::replace(at, *at + c))).collect();
        let mut bytes = vec![0u8; total];
        let mut recv = PartitionMut::new(&mut bytes[..], &counts[..], &displs[..]);
        self.comm().all_gather_varcount_into(fingerprint, &mut recv);
        disagreement(what, counts.iter().zip(&displs).map(|(&c, &d)| &bytes[d as usize..(d + c) as usize]))
    }

    fn barrier(&mut self) -> Result<()> {
        self.announce(Meta::new(Op::Barrier, 0, 0))?;
        self.comm().barrier();
        Ok(())
    }
}
