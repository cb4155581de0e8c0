//! kiln-comm: collective communication for data-parallel training.
//!
//! # Why the interface looks like this
//! In data-parallel training every rank runs the same compiled plan on its own slice of the
//! batch, then the ranks sum their gradients before the optimizer's updates. kiln plans memory
//! statically, so communication is planned too: a collective is an op of the plan, and the
//! gradients it sums are *buckets* — contiguous ranges of the plan's arena that the planner lays
//! out so that one call moves many gradients. Hence the interface works on plain `&mut [f32]`
//! slices (a bucket borrowed from the arena: no allocation, no tensor type, no engine type in the
//! planner), and [`Communicator`] is a small object-safe trait that the runtime holds as
//! `Box<dyn Communicator>`, whatever the engine: [`LocalComm`] (threads of one process, for tests
//! and for several devices of one machine) or `MpiComm` (processes, feature `mpi`).
//!
//! Sums are **deterministic**: every element is added in rank order, `((x_0 + x_1) + x_2) + …`,
//! by exactly one rank, and the result is copied to the others. Each rank therefore ends with
//! bitwise the same gradients, applies bitwise the same update and keeps bitwise the same
//! weights, step after step, without ever re-broadcasting them; and a run is reproducible
//! whatever the timing or the MPI library's choice of algorithm (`MPI_SUM` promises no order).
//! `reduce_scatter_sum` and `all_gather` are the two halves of that all-reduce, exposed for
//! sharded optimizers (each rank updates its [`shard_range`] of the weights, then gathers).
//!
//! Mistakes must not hang a job: before any data moves, every call gathers what each rank passed
//! (the call, the lengths, the root) and every rank reaches the same verdict, so a length
//! mismatch is the same [`CommError`] on every rank. [`Communicator::agree`] checks a fingerprint
//! of the compiled plan before the first step, so that ranks running different plans fail with
//! the ranks and values named instead of exchanging mismatched buckets. In-process ranks also
//! notice a peer that left (dropped its communicator) at once, and give up after a timeout.
//!
//! # Cost
//! All-reduce of `f32` buffers on the 2-core development machine (shared with other builds, load
//! about 1.6), 2 ranks; `cargo run --release -p kiln-comm --example bench` and, for MPI (Debian's
//! OpenMPI 4.1 over shared memory), `mpirun -np 2 target/release/examples/bench mpi` built with
//! `--features mpi`. Median of 15 calls after 3 warm-up calls; typical of 8 runs:
//!
//! | buffer              | `LocalComm` | `MpiComm` | `MPI_Allreduce(MPI_SUM)`, for scale | one-thread copy |
//! |---------------------|-------------|-----------|-------------------------------------|-----------------|
//! | 1 float             | 0.03 ms     | 0.002 ms  | < 0.001 ms                          | —               |
//! | 1M floats (4 MiB)   | 0.6 ms      | 0.63 ms   | 0.70 ms                             | 0.09 ms         |
//! | 16M floats (64 MiB) | 22–25 ms    | 26–31 ms  | 38–40 ms                            | 5.8 ms          |
//!
//! (In some runs all three all-reduces took 2.3–2.8 ms for 1M floats: the other builds' load.)
//! So the deterministic order costs nothing against MPI's own sum for large buffers. The local
//! engine copies each buffer into its rank's stage, adds its shard of everyone's stages in rank
//! order and copies the summed shards back: about four passes over the buffer per rank,
//! memory-bound (4 MiB stays in cache, 64 MiB does not); its fixed cost is two condition-variable
//! wake-ups per call. MPI moves the same bytes (an all-to-all of the shards, then an all-gather)
//! through OpenMPI's shared-memory transport, plus one all-gather of 3 words per call for the
//! checks; its fixed cost is microseconds (OpenMPI polls). Buckets of a few MiB amortise both.
#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod check;
mod error;
mod local;
#[cfg(feature = "mpi")]
mod mpi;
mod shard;

use std::time::Duration;

pub use error::{CommError, Result};
pub use local::{LocalComm, local_group, local_group_with_timeout, run_local_ranks};
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
pub use shard::shard_range;

/// How long a [`LocalComm`] collective waits for the other ranks before it fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Collectives over a fixed group of `size()` ranks, numbered `0..size()`.
///
/// Every rank must make the same calls in the same order, with buffers of the same length;
/// anything else is an error on every rank (never a panic), reported before any data moves.
/// After a fault (a peer left, a timeout) the group cannot be used again.
pub trait Communicator: Send {
    /// This rank's number, `0..size()`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn size(&self) -> usize;

    /// Every rank ends with the elementwise sum over ranks of `buf`.
    ///
    /// Summation order: element `i` is `((buf_0[i] + buf_1[i]) + buf_2[i]) + … + buf_{n-1}[i]`
    /// where `buf_r` is rank `r`'s buffer — rank order, starting from rank 0's value (not from
    /// `0.0`). It is computed once, by the rank that owns `i` in [`shard_range`], and copied to
    /// the others, so the result is bitwise identical on every rank and independent of timing.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()>;

    /// Rank `r` receives in `shard` the rank-order sum (as in
    /// [`all_reduce_sum`](Communicator::all_reduce_sum)) of elements
    /// `shard_range(input.len(), r, size)` of every rank's `input`.
    fn reduce_scatter_sum(&mut self, input: &[f32], shard: &mut [f32]) -> Result<()>;

    /// Every rank receives in `out` every rank's `shard`, rank `r`'s at
    /// `shard_range(out.len(), r, size)`: the inverse layout of `reduce_scatter_sum`.
    fn all_gather(&mut self, shard: &[f32], out: &mut [f32]) -> Result<()>;

    /// Every rank receives rank `root`'s `buf`.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Checks that every rank holds the same `fingerprint` (e.g. a hash of the compiled plan).
    /// On a mismatch every rank returns [`CommError::Disagree`], naming `what`, the ranks that
    /// hold each value and the values in short hex.
    fn agree(&mut self, what: &str, fingerprint: &[u8]) -> Result<()>;

    /// Returns once every rank has called it.
    fn barrier(&mut self) -> Result<()>;
}
