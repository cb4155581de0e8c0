//! How a buffer is split between ranks, and the one summation every engine uses.

use std::ops::Range;

/// The elements of a buffer of `len` elements that `rank` of `size` ranks owns in
/// `reduce_scatter_sum` and `all_gather`: contiguous shards, in rank order, as equal as possible,
/// the first `len % size` ranks one element longer. Shards may be empty (when `len < size`).
///
/// Panics if `size == 0` or `rank >= size` (a bug in the caller, not a runtime condition).
pub fn shard_range(len: usize, rank: usize, size: usize) -> Range<usize> {
    assert!(rank < size, "shard_range: rank {rank} is not below the group's size {size}");
    let (base, extra) = (len / size, len % size);
    let start = rank * base + rank.min(extra);
    let end = start + base + usize::from(rank < extra);
    start..end
}

/// `out[i] = ((c_0[i] + c_1[i]) + c_2[i]) + … + c_{n-1}[i]`, the contributions in the order given
/// (rank order): starts from the first contribution itself, not from `0.0`, so a lone `-0.0`
/// stays `-0.0`. Leaves `out` alone when there are no contributions.
pub(crate) fn sum_in_order<'a>(out: &mut [f32], mut contributions: impl Iterator<Item = &'a [f32]>) {
    let Some(first) = contributions.next() else { return };
    out.copy_from_slice(first);
    for c in contributions {
        for (o, x) in out.iter_mut().zip(c) {
            *o += *x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_buffer_in_order() {
        for size in 1..=5 {
            for len in 0..=13 {
                let mut next = 0;
                for rank in 0..size {
                    let r = shard_range(len, rank, size);
                    assert_eq!(r.start, next);
                    let want = len / size + usize::from(rank < len % size);
                    assert_eq!(r.len(), want, "len {len} rank {rank} size {size}");
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    #[test]
    fn sum_starts_from_the_first_contribution() {
        let mut out = [1.0];
        sum_in_order(&mut out, [&[-0.0f32][..]].into_iter());
        assert_eq!(out[0].to_bits(), (-0.0f32).to_bits());
    }
}
