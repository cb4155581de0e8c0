//! Pins each rule of the PyTorch caching allocator (see `kiln_runtime::alloc::caching`).

use kiln_runtime::alloc::{
    AllocError, Allocator, Block, CachingAllocator, CachingOptions, K_LARGE_BUFFER, K_SMALL_BUFFER, KIB, MIB,
    OOM_HINT, Pool, VirtualSource, caching_allocation_size, caching_pool, caching_round_size,
};

fn caching(limit: Option<usize>) -> CachingAllocator {
    CachingAllocator::new(VirtualSource::new(), limit)
}

fn alloc(a: &mut impl Allocator, bytes: usize) -> Block {
    a.allocate(bytes).unwrap_or_else(|e| panic!("allocating {bytes}: {e}"))
}

#[test]
fn rounds_to_512_bytes() {
    assert_eq!(caching_round_size(1), 512);
    assert_eq!(caching_round_size(511), 512);
    assert_eq!(caching_round_size(512), 512);
    assert_eq!(caching_round_size(513), 1024);
    let mut a = caching(None);
    let b = alloc(&mut a, 1);
    assert_eq!((b.size, b.requested), (512, 1));
    assert_eq!(alloc(&mut a, 257).addr, b.addr + 512);
    assert!(alloc(&mut a, 0).is_null());
}

#[test]
fn pools_and_segment_sizes() {
    assert_eq!(caching_pool(MIB), Pool::Small);
    assert_eq!(caching_pool(MIB + 512), Pool::Large);
    let cases = [
        (1, Pool::Small, 2 * MIB),
        (MIB, Pool::Small, 2 * MIB),
        (MIB + 1, Pool::Large, 20 * MIB),
        (5 * MIB, Pool::Large, 20 * MIB),
        (10 * MIB - 512, Pool::Large, 20 * MIB),
        (10 * MIB, Pool::Large, 10 * MIB),
        (11 * MIB, Pool::Large, 12 * MIB),
        (11 * MIB + 1, Pool::Large, 12 * MIB),
        (100 * MIB + 1, Pool::Large, 102 * MIB),
    ];
    for (bytes, pool, segment) in cases {
        assert_eq!(caching_allocation_size(caching_round_size(bytes)), segment, "{bytes}");
        let mut a = caching(None);
        alloc(&mut a, bytes);
        let segs = a.segments();
        assert_eq!(segs.len(), 1);
        assert_eq!((segs[0].pool, segs[0].size), (pool, segment), "{bytes}");
        assert_eq!(a.stats().reserved, segment);
    }
    assert_eq!(K_SMALL_BUFFER, 2 * MIB);
    assert_eq!(K_LARGE_BUFFER, 20 * MIB);
}

#[test]
fn small_and_large_requests_never_share_a_segment() {
    let mut a = caching(None);
    let big = alloc(&mut a, 2 * MIB);
    alloc(&mut a, KIB);
    assert_eq!(a.stats().num_regions, 2, "a small request does not use the large segment's free 18 MiB");
    a.deallocate(big.addr).unwrap();
    alloc(&mut a, 2 * KIB);
    assert_eq!(a.stats().num_regions, 2);
}

#[test]
fn best_fit_lowest_address_on_ties() {
    let mut a = caching(None);
    // One 20 MiB segment: A2 B4 C2 D3 E2 F3 G2 (MiB), tail 2 MiB free.
    let blocks: Vec<Block> = [2, 4, 2, 3, 2, 3, 2].iter().map(|&m| alloc(&mut a, m * MIB)).collect();
    assert_eq!(a.stats().num_regions, 1);
    let base = blocks[0].addr;
    for (b, off) in blocks.iter().zip([0, 2, 6, 8, 11, 13, 16]) {
        assert_eq!(b.addr, base + off * MIB as u64);
    }
    for i in [1, 3, 5] {
        a.deallocate(blocks[i].addr).unwrap();
    }
    // 2.5 MiB: D (3 MiB) and F (3 MiB) are the best fits; D has the lower address. Remainder 0.5 MiB
    // is not > 1 MiB: not split.
    let x = alloc(&mut a, 5 * MIB / 2);
    assert_eq!((x.addr, x.size), (blocks[3].addr, 3 * MIB));
    // 1.5 MiB: the 2 MiB tail beats F and B.
    let y = alloc(&mut a, 3 * MIB / 2);
    assert_eq!((y.addr, y.size), (base + 18 * MIB as u64, 2 * MIB));
    assert_eq!(alloc(&mut a, 3 * MIB).addr, blocks[5].addr);
}

#[test]
fn split_thresholds() {
    // Small pool: split when the remainder is >= 512 B.
    let mut a = caching(None);
    alloc(&mut a, MIB);
    let b = alloc(&mut a, MIB - 512);
    assert_eq!(b.size, MIB - 512);
    let shape: Vec<(usize, bool)> = a.segments()[0].blocks.iter().map(|b| (b.size, b.allocated)).collect();
    assert_eq!(shape, [(MIB, true), (MIB - 512, true), (512, false)]);

    // Large pool: 11 MiB in a 12 MiB segment leaves exactly 1 MiB: not > 1 MiB, not split.
    let mut a = caching(None);
    let b = alloc(&mut a, 11 * MIB);
    assert_eq!(b.size, 12 * MIB);
    assert_eq!(a.stats().in_use, 12 * MIB);
    assert_eq!(a.stats().requested_in_use, 11 * MIB);
    // 11 MiB - 512 leaves 1 MiB + 512: split.
    let mut a = caching(None);
    let b = alloc(&mut a, 11 * MIB - 512);
    assert_eq!(b.size, 11 * MIB - 512);
    assert_eq!(a.segments()[0].blocks.len(), 2);
}

#[test]
fn merges_with_both_neighbours_and_keeps_the_segment() {
    let mut a = caching(None);
    let [x, y, z] = [0; 3].map(|_| alloc(&mut a, 512 * KIB));
    a.deallocate(x.addr).unwrap();
    a.deallocate(z.addr).unwrap();
    let shape: Vec<(usize, bool)> = a.segments()[0].blocks.iter().map(|b| (b.size, b.allocated)).collect();
    assert_eq!(shape, [(512 * KIB, false), (512 * KIB, true), (MIB, false)]);
    a.deallocate(y.addr).unwrap();
    let segs = a.segments();
    assert_eq!(segs[0].blocks.len(), 1);
    assert_eq!(segs[0].blocks[0].size, 2 * MIB);
    let s = a.stats();
    assert_eq!((s.in_use, s.reserved, s.num_regions, s.largest_free_chunk), (0, 2 * MIB, 1, 2 * MIB));
    // Reused from the cache, no new segment.
    alloc(&mut a, KIB);
    assert_eq!(a.num_device_alloc(), 1);
    a.empty_cache();
    assert_eq!(a.stats().reserved, 2 * MIB, "a segment with a live block stays");
}

#[test]
fn empty_cache_returns_free_segments() {
    let mut a = caching(None);
    let x = alloc(&mut a, 5 * MIB);
    let y = alloc(&mut a, KIB);
    a.deallocate(x.addr).unwrap();
    a.deallocate(y.addr).unwrap();
    assert_eq!(a.stats().reserved, 22 * MIB, "cached when empty");
    a.empty_cache();
    assert_eq!(a.stats().reserved, 0);
    assert_eq!(a.source().held(), 0);
    assert_eq!(a.num_device_free(), 2);
}

#[test]
fn releases_the_cache_and_retries_once_on_oom() {
    let mut a = caching(Some(40 * MIB));
    let x = alloc(&mut a, 15 * MIB);
    assert_eq!(x.size, 16 * MIB, "16 MiB segment, remainder 1 MiB: not split");
    a.deallocate(x.addr).unwrap();
    // 30 MiB: 16 + 30 > 40; the cached 16 MiB segment is released and the allocation retried.
    let y = alloc(&mut a, 30 * MIB);
    assert_eq!(y.size, 30 * MIB);
    assert_eq!(a.regions().iter().map(|r| r.1).collect::<Vec<_>>(), [30 * MIB]);
    assert_eq!(a.num_alloc_retries(), 1);
    assert_eq!(a.num_device_free(), 1);
    assert_eq!(a.stats().peak_reserved, 30 * MIB, "never above the limit");
}

#[test]
fn oom_when_the_free_memory_is_inside_a_used_segment() {
    let mut a = CachingAllocator::with_options(
        VirtualSource::new(),
        CachingOptions::default().with_memory_fraction(0.5, 80 * MIB).named("cuda:0"),
    );
    assert_eq!(a.options().memory_limit, Some(40 * MIB));
    alloc(&mut a, 5 * MIB); // 20 MiB segment, 15 MiB of it free
    let small = alloc(&mut a, KIB); // 2 MiB small segment
    a.deallocate(small.addr).unwrap();
    // 30 MiB: the small segment is released, the 20 MiB one is in use: 20 + 30 > 40.
    let err = a.allocate(30 * MIB).unwrap_err();
    assert_eq!(a.stats().reserved, 20 * MIB);
    assert_eq!(a.num_ooms(), 1);
    match &err {
        AllocError::OutOfMemory { requested, limit, reserved, in_use, largest_free, .. } => {
            assert_eq!((*requested, *limit), (30 * MIB, Some(40 * MIB)));
            assert_eq!((*reserved, *in_use, *largest_free), (20 * MIB, 5 * MIB, 15 * MIB));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let msg = err.to_string();
    for needle in [
        "cuda:0: out of memory allocating 30.00 MiB",
        "memory limit 40.00 MiB",
        "segment of 30.00 MiB",
        OOM_HINT,
    ] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
}

#[test]
fn device_refusal_is_out_of_memory_too() {
    let mut a = CachingAllocator::new(VirtualSource::with_capacity(25 * MIB), None);
    alloc(&mut a, 5 * MIB);
    let err = a.allocate(16 * MIB).unwrap_err(); // 15 MiB free in the segment: a new one is needed
    assert!(matches!(err, AllocError::OutOfMemory { limit: None, .. }));
    assert!(err.to_string().contains("refused"), "{err}");
    // Absurd sizes are refused, not overflowed.
    let mut a = caching(None);
    assert!(matches!(a.allocate(usize::MAX), Err(AllocError::OutOfMemory { .. })));
    assert_eq!(a.stats().reserved, 0);
}

#[test]
fn stats_fragmentation_and_reset_peak() {
    let mut a = caching(None);
    let x = alloc(&mut a, 5 * MIB);
    let y = alloc(&mut a, 3 * MIB);
    a.deallocate(x.addr).unwrap();
    let s = a.stats();
    assert_eq!(
        (s.in_use, s.peak_in_use, s.reserved, s.num_allocs, s.num_regions),
        (3 * MIB, 8 * MIB, 20 * MIB, 2, 1)
    );
    // Free: 5 MiB at the start and 12 MiB at the end of the segment.
    assert_eq!(s.largest_free_chunk, 12 * MIB);
    assert!((s.fragmentation() - 5.0 / 17.0).abs() < 1e-12);

    // resetPeakStats: both peaks to the current values; the allocation count stays.
    a.reset_peak();
    let s = a.stats();
    assert_eq!((s.peak_in_use, s.peak_reserved, s.num_allocs), (3 * MIB, 20 * MIB, 2));
    a.deallocate(y.addr).unwrap();
    a.empty_cache();
    assert_eq!(a.stats().peak_reserved, 20 * MIB);
    a.reset_peak();
    assert_eq!(a.stats().peak_reserved, 0);
}

#[test]
fn double_free_and_foreign_addresses_are_errors() {
    let mut a = caching(None);
    let b = alloc(&mut a, KIB);
    a.deallocate(b.addr).unwrap();
    assert_eq!(
        a.deallocate(b.addr),
        Err(AllocError::DoubleFree { allocator: "caching".into(), addr: b.addr })
    );
    assert!(matches!(a.deallocate(1234), Err(AllocError::UnknownAddress { addr: 1234, .. })));
    a.deallocate(0).unwrap();
}

#[test]
fn oversize_rules_with_a_max_split_size() {
    let opts = CachingOptions { max_split_size: 32 * MIB, ..CachingOptions::with_limit(80 * MIB) };
    let mut a = CachingAllocator::with_options(VirtualSource::new(), opts);
    let x = alloc(&mut a, 40 * MIB);
    a.deallocate(x.addr).unwrap();
    // A request below max_split_size does not take an oversize cached block.
    let y = alloc(&mut a, 8 * MIB);
    assert_ne!(y.addr, x.addr);
    assert_eq!(a.stats().reserved, 60 * MIB);
    // A request at or above it takes one less than 20 MiB larger, unsplit.
    let z = alloc(&mut a, 36 * MIB);
    assert_eq!((z.addr, z.size), (x.addr, 40 * MIB));
    a.deallocate(z.addr).unwrap();
    // Out of room (60 + 30 > 80): release_available_cached_blocks frees the smallest cached oversize
    // segment of at least max(30, 32) MiB before the full cache release, so this is not a retry.
    let w = alloc(&mut a, 30 * MIB);
    assert_eq!(w.size, 30 * MIB);
    assert_eq!(a.num_alloc_retries(), 0);
    assert_eq!(a.num_device_free(), 1);
    assert_eq!(a.stats().reserved, 50 * MIB);
}
