//! The crate's one error type. Every message names the collective, the ranks and the lengths or
//! values involved, and says what to do.

use std::time::Duration;
use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CommError {
    /// Ranks entered different collectives at the same point of their programs.
    #[error(
        "{call}: rank {rank} called {call} but rank {other_rank} called {other_call} at the same point\n  help: every rank must issue the same collectives in the same order: run the same plan on every rank (check it with `agree` first)"
    )]
    CallMismatch { call: &'static str, rank: usize, other_rank: usize, other_call: &'static str },

    /// Ranks passed buffers of different lengths to the same collective.
    #[error(
        "{call}: rank {rank} passed {len} elements but rank {other_rank} passed {other_len}\n  help: every rank must pass a buffer of the same length (the same bucket of the same plan)"
    )]
    LengthMismatch { call: &'static str, rank: usize, len: usize, other_rank: usize, other_len: usize },

    /// A rank's shard does not have the length `shard_range` gives it.
    #[error(
        "{call}: rank {rank} passed a shard of {len} elements but shard_range({total}, {rank}, {size}) has {expected}\n  help: size each rank's shard with kiln_comm::shard_range(total, rank, size)"
    )]
    ShardLength { call: &'static str, rank: usize, len: usize, expected: usize, total: usize, size: usize },

    /// A broadcast's root is not a rank of the group, or ranks named different roots.
    #[error("broadcast: {detail}\n  help: every rank must name the same root, a rank below the group's size")]
    BadRoot { detail: String },

    /// `agree` found ranks holding different fingerprints.
    #[error(
        "agree({what}): the ranks disagree: {detail}\n  help: every rank must hold the same {what} before any collective runs: build it from the same model, options and kiln version on every rank"
    )]
    Disagree {
        what: String,
        /// Ranks grouped by the fingerprint they hold, in order of first appearance (rank 0's group first).
        groups: Vec<Vec<usize>>,
        detail: String,
    },

    /// A peer dropped its communicator (its thread or process returned or panicked) instead of
    /// joining.
    #[error(
        "{call}: rank {rank} left the group (it dropped its communicator: returned or panicked) while the others waited\n  help: look at rank {rank}'s own error or panic first; this group cannot be used again"
    )]
    PeerLeft { call: &'static str, rank: usize },

    /// Peers did not join a collective within the timeout.
    #[error(
        "{call}: ranks {missing:?} did not join within {timeout:?}\n  help: a rank is stuck, very slow or running a different plan; if steps are legitimately this slow, raise the timeout (LocalComm::set_timeout); this group cannot be used again"
    )]
    Timeout { call: &'static str, missing: Vec<usize>, timeout: Duration },

    /// The group failed earlier (a peer left or timed out) and cannot run collectives any more.
    #[error("{call}: the group is unusable after an earlier failure: {cause}\n  help: make a new group")]
    Broken { call: &'static str, cause: String },

    /// A buffer longer than MPI can address in one call (its counts are C ints).
    #[error(
        "{call}: {len} elements are more than one MPI call can address ({max})\n  help: split the buffer into smaller buckets"
    )]
    TooLong { call: &'static str, len: usize, max: usize },

    /// MPI could not be set up.
    #[error("MPI: {what}\n  help: {help}")]
    Mpi { what: String, help: String },
}

pub type Result<T, E = CommError> = std::result::Result<T, E>;
