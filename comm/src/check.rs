//! What every rank says about a call before any data moves, and the checks on it.
//!
//! Each engine first gathers one [`Meta`] from every rank, then runs [`check`] on the gathered
//! list. Every rank sees the same list, so every rank reaches the same verdict: a mistake becomes
//! the same error on all ranks instead of a hang, a crash or a silent mix-up of buffers.

use crate::error::{CommError, Result};
use crate::shard::shard_range;

/// The collectives, as they are announced to the other ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    AllReduceSum,
    ReduceScatterSum,
    AllGather,
    Broadcast,
    Agree,
    Barrier,
    /// A rank drops its communicator (MPI only: finalizing needs every rank to leave together).
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Leave,
}

impl Op {
    const ALL: [Op; 7] = [
        Op::AllReduceSum,
        Op::ReduceScatterSum,
        Op::AllGather,
        Op::Broadcast,
        Op::Agree,
        Op::Barrier,
        Op::Leave,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduceSum => "all_reduce_sum",
            Op::ReduceScatterSum => "reduce_scatter_sum",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Agree => "agree",
            Op::Barrier => "barrier",
            Op::Leave => "drop",
        }
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn code(self) -> u64 {
        Op::ALL.iter().position(|&op| op == self).map_or(0, |i| i as u64 + 1)
    }

    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    pub(crate) fn from_code(code: u64) -> Option<Op> {
        let i = usize::try_from(code).ok()?.checked_sub(1)?;
        Op::ALL.get(i).copied()
    }
}

/// One rank's announcement of a call.
///
/// `len` is the buffer's length (`all_reduce_sum`, `broadcast`), the full input's
/// (`reduce_scatter_sum`), the full output's (`all_gather`) or the fingerprint's (`agree`).
/// `aux` is the shard's length (`reduce_scatter_sum`, `all_gather`) or the root (`broadcast`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Meta {
    pub op: Op,
    pub len: usize,
    pub aux: usize,
}

impl Meta {
    pub(crate) fn new(op: Op, len: usize, aux: usize) -> Self {
        Meta { op, len, aux }
    }
}

/// The same verdict on every rank: `Ok` when the call can go ahead.
pub(crate) fn check(metas: &[Meta]) -> Result<()> {
    let size = metas.len();
    let Some(first) = metas.first() else { return Ok(()) };
    let call = first.op.name();
    // A rank dropping its communicator while others call a collective: say that it left.
    let leaving = metas.iter().position(|m| m.op == Op::Leave);
    if let (Some(rank), Some(staying)) = (leaving, metas.iter().find(|m| m.op != Op::Leave)) {
        return Err(CommError::PeerLeft { call: staying.op.name(), rank });
    }
    if let Some((r, m)) = metas.iter().enumerate().find(|(_, m)| m.op != first.op) {
        return Err(CommError::CallMismatch { call, rank: 0, other_rank: r, other_call: m.op.name() });
    }
    let same_len = || match metas.iter().enumerate().find(|(_, m)| m.len != first.len) {
        Some((r, m)) => {
            Err(CommError::LengthMismatch { call, rank: 0, len: first.len, other_rank: r, other_len: m.len })
        }
        None => Ok(()),
    };
    let shards_fit = || {
        for (rank, m) in metas.iter().enumerate() {
            let expected = shard_range(m.len, rank, size).len();
            if m.aux != expected {
                return Err(CommError::ShardLength { call, rank, len: m.aux, expected, total: m.len, size });
            }
        }
        Ok(())
    };
    match first.op {
        Op::AllReduceSum => same_len(),
        Op::ReduceScatterSum | Op::AllGather => {
            same_len()?;
            shards_fit()
        }
        Op::Broadcast => {
            same_len()?;
            if let Some((r, m)) = metas.iter().enumerate().find(|(_, m)| m.aux != first.aux) {
                let detail = format!("rank 0 named root {} but rank {r} named root {}", first.aux, m.aux);
                return Err(CommError::BadRoot { detail });
            }
            if first.aux >= size {
                let detail = format!("root {} is not a rank of this group of {size}", first.aux);
                return Err(CommError::BadRoot { detail });
            }
            Ok(())
        }
        // Fingerprints of different lengths are a disagreement, reported by `disagreement`.
        Op::Agree | Op::Barrier | Op::Leave => Ok(()),
    }
}

/// `Err` naming the ranks and their (shortened) values when the fingerprints differ.
pub(crate) fn disagreement<'a>(what: &str, fingerprints: impl Iterator<Item = &'a [u8]>) -> Result<()> {
    let mut values: Vec<&[u8]> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (rank, fp) in fingerprints.enumerate() {
        match values.iter().position(|v| *v == fp) {
            Some(g) => groups[g].push(rank),
            None => {
                values.push(fp);
                groups.push(vec![rank]);
            }
        }
    }
    if groups.len() <= 1 {
        return Ok(());
    }
    // Where the values first differ: show the bytes from there, not a prefix they all share.
    let common = values[1..]
        .iter()
        .map(|v| v.iter().zip(values[0]).take_while(|(a, b)| a == b).count())
        .min()
        .unwrap_or(0);
    let detail = groups
        .iter()
        .zip(&values)
        .map(|(ranks, value)| {
            let who = match ranks.as_slice() {
                [r] => format!("rank {r} holds"),
                rs => {
                    format!("ranks {} hold", rs.iter().map(usize::to_string).collect::<Vec<_>>().join(", "))
                }
            };
            format!("{who} {}", short_hex(value, common))
        })
        .collect::<Vec<_>>()
        .join("; ");
    Err(CommError::Disagree { what: what.to_string(), groups, detail })
}

/// At most 8 bytes of `bytes` in hex, starting at `from` (clamped), marked where cut.
fn short_hex(bytes: &[u8], from: usize) -> String {
    const SHOWN: usize = 8;
    if bytes.is_empty() {
        return "nothing (0 bytes)".to_string();
    }
    let start = from.min(bytes.len().saturating_sub(SHOWN));
    let end = (start + SHOWN).min(bytes.len());
    let hex: String = bytes[start..end].iter().map(|b| format!("{b:02x}")).collect();
    if start == 0 && end == bytes.len() {
        hex
    } else {
        let head = if start > 0 { "…" } else { "" };
        let tail = if end < bytes.len() { "…" } else { "" };
        format!("{head}{hex}{tail} (bytes {start}..{end} of {})", bytes.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_codes_round_trip() {
        for op in Op::ALL {
            assert_eq!(Op::from_code(op.code()), Some(op));
        }
        assert_eq!(Op::from_code(0), None);
        assert_eq!(Op::from_code(99), None);
    }

    #[test]
    fn disagreement_shows_where_values_differ() {
        let a: Vec<u8> = (0..32).collect();
        let mut b = a.clone();
        b[20] = 0xff;
        let err = disagreement("plan", [&a[..], &b[..], &a[..]].into_iter()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("ranks 0, 2 hold"), "{msg}");
        assert!(msg.contains("rank 1 holds"), "{msg}");
        assert!(msg.contains("ff"), "{msg}");
        assert!(msg.contains("bytes 20..28 of 32"), "{msg}");
    }

    #[test]
    fn short_values_are_shown_whole() {
        assert_eq!(short_hex(&[0xab, 0x01], 1), "ab01");
        assert_eq!(short_hex(&[], 0), "nothing (0 bytes)");
    }
}
