//! The crate's one error type. Every message names the collective, the ranks and the lengths or
//! values involved, and says what to do.

use std::time::Duration;
use thiserror::Error;

/// Why a collective, `agree` or the setup of a group failed. Mismatches are detected before any
/// data moves and are the same error on every rank; after a fault (`PeerLeft`, `Timeout`) the
/// group is broken and later calls return `Broken`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CommError {
    /// Ranks entered different collectives at the same point of their programs.
    #[error(
        "{call}: rank {rank} called {call} but rank {other_rank} called {other_call} at the same point\n  help: every rank must issue the same collectives in the same order: run the same plan on every rank (check it with `agree` first)"
    )]
    CallMismatch {
        /// The collective that `rank` called, by its method name (e.g. `"all_reduce_sum"`).
        call: &'static str,
        /// The rank whose call is the reference (rank 0 in the engines' checks).
        rank: usize,
        /// The first rank that called a different collective.
        other_rank: usize,
        /// The collective that `other_rank` called.
        other_call: &'static str,
    },

    /// Ranks passed buffers of different lengths to the same collective.
    #[error(
        "{call}: rank {rank} passed {len} elements but rank {other_rank} passed {other_len}\n  help: every rank must pass a buffer of the same length (the same bucket of the same plan)"
    )]
    LengthMismatch {
        /// The collective, by its method name (e.g. `"broadcast"`).
        call: &'static str,
        /// The rank whose length is the reference (rank 0 in the engines' checks).
        rank: usize,
        /// The length, in elements, that `rank` passed.
        len: usize,
        /// The first rank that passed a different length.
        other_rank: usize,
        /// The length, in elements, that `other_rank` passed.
        other_len: usize,
    },

    /// A rank's shard does not have the length `shard_range` gives it.
    #[error(
        "{call}: rank {rank} passed a shard of {len} elements but shard_range({total}, {rank}, {size}) has {expected}\n  help: size each rank's shard with kiln_comm::shard_range(total, rank, size)"
    )]
    ShardLength {
        /// The collective: `"reduce_scatter_sum"` or `"all_gather"`.
        call: &'static str,
        /// The first rank whose shard has the wrong length.
        rank: usize,
        /// The shard's length that `rank` passed, in elements.
        len: usize,
        /// The length `shard_range(total, rank, size)` gives, in elements.
        expected: usize,
        /// The full buffer's length in elements (the input of `reduce_scatter_sum`, the output of
        /// `all_gather`).
        total: usize,
        /// The number of ranks in the group.
        size: usize,
    },

    /// A broadcast's root is not a rank of the group, or ranks named different roots.
    #[error("broadcast: {detail}\n  help: every rank must name the same root, a rank below the group's size")]
    BadRoot {
        /// Which ranks named which roots, or the out-of-range root and the group's size.
        detail: String,
    },

    /// `agree` found ranks holding different fingerprints.
    #[error(
        "agree({what}): the ranks disagree: {detail}\n  help: every rank must hold the same {what} before any collective runs: build it from the same model, options and kiln version on every rank"
    )]
    Disagree {
        /// What the fingerprint stands for, as the caller named it in `agree` (e.g. `"plan"`).
        what: String,
        /// Ranks grouped by the fingerprint they hold, in order of first appearance (rank 0's group first).
        groups: Vec<Vec<usize>>,
        /// Each group's ranks and the value they hold, as at most 8 bytes of hex from the first
        /// byte where the values differ.
        detail: String,
    },

    /// A peer dropped its communicator (its thread or process returned or panicked) instead of
    /// joining.
    #[error(
        "{call}: rank {rank} left the group (it dropped its communicator: returned or panicked) while the others waited\n  help: look at rank {rank}'s own error or panic first; this group cannot be used again"
    )]
    PeerLeft {
        /// The collective the remaining ranks were in, by its method name.
        call: &'static str,
        /// The rank that left.
        rank: usize,
    },

    /// Peers did not join a collective within the timeout.
    #[error(
        "{call}: ranks {missing:?} did not join within {timeout:?}\n  help: a rank is stuck, very slow or running a different plan; if steps are legitimately this slow, raise the timeout (LocalComm::set_timeout); this group cannot be used again"
    )]
    Timeout {
        /// The collective that timed out, by its method name.
        call: &'static str,
        /// The ranks that had not joined when the timeout expired, in increasing order.
        missing: Vec<usize>,
        /// The group's timeout ([`DEFAULT_TIMEOUT`](crate::DEFAULT_TIMEOUT) unless the group was made
        /// with `local_group_with_timeout` or `LocalComm::set_timeout` changed it).
        timeout: Duration,
    },

    /// The group failed earlier (a peer left or timed out) and cannot run collectives any more.
    #[error("{call}: the group is unusable after an earlier failure: {cause}\n  help: make a new group")]
    Broken {
        /// The collective called on the broken group, by its method name.
        call: &'static str,
        /// The first line of the error that broke the group (without its help).
        cause: String,
    },

    /// A buffer longer than MPI can address in one call (its counts are C ints).
    #[error(
        "{call}: {len} elements are more than one MPI call can address ({max})\n  help: split the buffer into smaller buckets"
    )]
    TooLong {
        /// The collective, by its method name.
        call: &'static str,
        /// The buffer's length in elements.
        len: usize,
        /// The largest count one MPI call takes (`i32::MAX`).
        max: usize,
    },

    /// MPI could not be set up.
    #[error("MPI: {what}\n  help: {help}")]
    Mpi {
        /// What went wrong (MPI already initialised, or a library without `Serialized` threading).
        what: String,
        /// What to do about it.
        help: String,
    },
}

/// The result of kiln-comm's calls: [`CommError`] unless another error type is named.
pub type Result<T, E = CommError> = std::result::Result<T, E>;
