//! Pins each rule of the TensorFlow BFC allocator (see `kiln_runtime::alloc::bfc`).

use std::cell::RefCell;
use std::rc::Rc;

use kiln_runtime::alloc::{
    AllocError, Allocator, BfcAllocator, BfcOptions, Block, KIB, MIB, OOM_HINT, RegionSource, SourceEvent,
    VirtualSource, bfc_bin_for_size, bfc_rounded_bytes,
};

fn growth(limit: usize) -> BfcAllocator {
    BfcAllocator::new(VirtualSource::new(), limit)
}

fn alloc(a: &mut impl Allocator, bytes: usize) -> Block {
    a.allocate(bytes).unwrap_or_else(|e| panic!("allocating {bytes}: {e}"))
}

#[test]
fn rounds_to_256_bytes() {
    assert_eq!(bfc_rounded_bytes(1), 256);
    assert_eq!(bfc_rounded_bytes(256), 256);
    assert_eq!(bfc_rounded_bytes(257), 512);
    assert_eq!(bfc_rounded_bytes(MIB + 1), MIB + 256);

    let mut a = growth(64 * MIB);
    let b1 = alloc(&mut a, 1);
    assert_eq!((b1.size, b1.requested), (256, 1));
    let b2 = alloc(&mut a, 257);
    assert_eq!((b2.size, b2.requested), (512, 257));
    assert_eq!(b2.addr, b1.addr + 256, "the split remainder is used next");
    assert_eq!(a.stats().in_use, 768);
    assert_eq!(a.stats().requested_in_use, 258);
}

#[test]
fn zero_bytes_is_the_null_block() {
    let mut a = growth(64 * MIB);
    let b = alloc(&mut a, 0);
    assert!(b.is_null());
    assert_eq!(a.stats().num_regions, 0, "no region for a 0-byte request");
    assert_eq!(a.stats().num_allocs, 0);
    a.deallocate(0).unwrap();
}

#[test]
fn bins_by_size() {
    assert_eq!(bfc_bin_for_size(256), 0);
    assert_eq!(bfc_bin_for_size(511), 0);
    assert_eq!(bfc_bin_for_size(512), 1);
    assert_eq!(bfc_bin_for_size(1023), 1);
    assert_eq!(bfc_bin_for_size(1024), 2);
    assert_eq!(bfc_bin_for_size(MIB), 12);
    assert_eq!(bfc_bin_for_size(2 * MIB - 256), 12);
    assert_eq!(bfc_bin_for_size(2 * MIB), 13);
    assert_eq!(bfc_bin_for_size(3 * MIB), 13);
    assert_eq!(bfc_bin_for_size(256 * MIB), 20);
    assert_eq!(bfc_bin_for_size(512 * MIB), 20, "the last bin is unbounded");
    assert_eq!(bfc_bin_for_size(64 << 30), 20);

    // A free remainder lands in the bin of its size.
    let mut a = growth(64 * MIB);
    alloc(&mut a, 768 * KIB);
    let chunks = a.chunks();
    assert_eq!(chunks.len(), 2);
    assert_eq!((chunks[1].size, chunks[1].bin), (2 * MIB - 768 * KIB, Some(12)));
    assert_eq!(chunks[0].bin, None, "chunks in use are in no bin");
}

/// One region of 64 MiB holding A(1) B(3) C(1) D(2) E(1) F(2) G(1) MiB, then B, D, F freed.
fn fragmented() -> (BfcAllocator, Vec<Block>) {
    let mut a = BfcAllocator::with_options(VirtualSource::new(), BfcOptions::preallocate(64 * MIB));
    let blocks: Vec<Block> = [1, 3, 1, 2, 1, 2, 1].iter().map(|&m| alloc(&mut a, m * MIB)).collect();
    for i in [1, 3, 5] {
        a.deallocate(blocks[i].addr).unwrap();
    }
    (a, blocks)
}

#[test]
fn best_fit_lowest_address_on_ties() {
    let (mut a, blocks) = fragmented();
    let base = blocks[0].addr;
    for (b, off) in blocks.iter().zip([0, 1, 4, 5, 7, 8, 10]) {
        assert_eq!(b.addr, base + off * MIB as u64);
    }
    // 1.5 MiB: bin 12 is empty; bin 13 holds D(2 MiB), F(2 MiB), B(3 MiB): D is the best fit with the
    // lowest address, although B comes first in memory.
    let x = alloc(&mut a, 3 * MIB / 2);
    assert_eq!(x.addr, blocks[3].addr);
    assert_eq!(x.size, 2 * MIB, "2 MiB < 2 x 1.5 MiB: not split");
    // The other 2 MiB chunk next, then the 3 MiB one.
    assert_eq!(alloc(&mut a, 2 * MIB).addr, blocks[5].addr);
    let y = alloc(&mut a, 2 * MIB);
    assert_eq!((y.addr, y.size), (blocks[1].addr, 3 * MIB));
    // Now only the tail is free.
    assert_eq!(alloc(&mut a, 2 * MIB).addr, base + 11 * MIB as u64);
}

#[test]
fn split_at_twice_the_request() {
    // 2 MiB region, 1 MiB request: 2 MiB >= 2 x 1 MiB, split.
    let mut a = growth(64 * MIB);
    let b = alloc(&mut a, MIB);
    assert_eq!(b.size, MIB);
    assert_eq!(a.chunks().len(), 2);

    // 2 MiB region, 1 MiB + 256 request: 2 MiB < 2 x (1 MiB + 256) and the padding is below 128 MiB:
    // the whole chunk is handed out and counted.
    let mut a = growth(64 * MIB);
    let b = alloc(&mut a, MIB + 1);
    assert_eq!(b.size, 2 * MIB);
    assert_eq!(a.stats().in_use, 2 * MIB);
    assert_eq!(a.stats().requested_in_use, MIB + 1);
    assert_eq!(a.chunks().len(), 1);
}

#[test]
fn split_when_padding_reaches_128_mib() {
    let mut a = growth(4 << 30);
    // 200 MiB: the region grows to 256 MiB; 256 < 400 and 56 MiB < 128 MiB: not split.
    let b = alloc(&mut a, 200 * MIB);
    assert_eq!(a.regions()[0].1, 256 * MIB);
    assert_eq!(b.size, 256 * MIB);
    // 300 MiB: region of 512 MiB; 512 < 600 but 212 MiB >= 128 MiB: split.
    let b = alloc(&mut a, 300 * MIB);
    assert_eq!(a.regions()[1].1, 512 * MIB);
    assert_eq!(b.size, 300 * MIB);

    // With fragmentation_fraction the bound is a fraction of the limit: 1% of 4 GiB = ~41 MiB < 56 MiB.
    let opts = BfcOptions { fragmentation_fraction: 0.01, ..BfcOptions::growth(4 << 30) };
    let mut a = BfcAllocator::with_options(VirtualSource::new(), opts);
    assert_eq!(alloc(&mut a, 200 * MIB).size, 200 * MIB);
}

#[test]
fn coalesces_with_both_neighbours() {
    let mut a = growth(64 * MIB);
    let [x, y, z] = [0; 3].map(|_| alloc(&mut a, 256 * KIB));
    a.deallocate(x.addr).unwrap();
    a.deallocate(z.addr).unwrap();
    let chunks = a.chunks();
    let shape: Vec<(usize, bool)> = chunks.iter().map(|c| (c.size, c.in_use)).collect();
    assert_eq!(
        shape,
        [(256 * KIB, false), (256 * KIB, true), (2 * MIB - 512 * KIB, false)],
        "z merged with the tail"
    );
    a.deallocate(y.addr).unwrap();
    let chunks = a.chunks();
    assert_eq!(chunks.len(), 1);
    assert_eq!((chunks[0].size, chunks[0].bin), (2 * MIB, Some(13)));
    assert_eq!(a.stats().largest_free_chunk, 2 * MIB);
    assert_eq!(a.stats().in_use, 0);
}

#[test]
fn regions_double_as_allocations_accumulate() {
    let mut a = growth(GIB);
    assert_eq!(a.curr_region_allocation_bytes(), 2 * MIB);
    // 1 MiB at a time: 2 MiB holds 2, 4 MiB holds 4, 8 MiB holds 8; the 15th needs 16 MiB.
    for _ in 0..14 {
        alloc(&mut a, MIB);
    }
    assert_eq!(a.source().allocated_sizes(), [2 * MIB, 4 * MIB, 8 * MIB]);
    assert_eq!(a.curr_region_allocation_bytes(), 16 * MIB);
    alloc(&mut a, MIB);
    assert_eq!(a.source().allocated_sizes(), [2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]);
    assert_eq!(a.stats().reserved, 30 * MIB);
    assert_eq!(a.stats().in_use, 15 * MIB);
}

const GIB: usize = 1 << 30;

#[test]
fn request_larger_than_the_current_region_size() {
    let mut a = growth(GIB);
    alloc(&mut a, MIB); // region 2 MiB, next 4 MiB
    assert_eq!(a.curr_region_allocation_bytes(), 4 * MIB);
    // 10 MiB: 4 -> 8 -> 16 MiB covers it; doubled for this request, so not doubled again.
    alloc(&mut a, 10 * MIB);
    assert_eq!(a.source().allocated_sizes(), [2 * MIB, 16 * MIB]);
    assert_eq!(a.curr_region_allocation_bytes(), 16 * MIB);
    alloc(&mut a, MIB); // fits in the first region
    // The 10 MiB block holds its whole 16 MiB region (16 < 20 MiB, padding < 128 MiB: not split), so
    // 8 MiB needs a new region: 16 MiB, then 32 MiB next.
    alloc(&mut a, 8 * MIB);
    assert_eq!(a.source().allocated_sizes(), [2 * MIB, 16 * MIB, 16 * MIB]);
    assert_eq!(a.curr_region_allocation_bytes(), 32 * MIB);
}

#[test]
fn last_region_is_clipped_to_the_limit_then_oom() {
    let mut a =
        BfcAllocator::with_options(VirtualSource::new(), BfcOptions::growth(7 * MIB).named("GPU_0_bfc"));
    for _ in 0..7 {
        alloc(&mut a, MIB);
    }
    // 2 + 4 MiB, then min(8 MiB, 1 MiB left).
    assert_eq!(a.source().allocated_sizes(), [2 * MIB, 4 * MIB, MIB]);
    assert_eq!(a.stats().reserved, 7 * MIB);
    let err = a.allocate(MIB).unwrap_err();
    match &err {
        AllocError::OutOfMemory {
            allocator,
            requested,
            rounded,
            limit,
            reserved,
            in_use,
            largest_free,
            ..
        } => {
            assert_eq!(allocator, "GPU_0_bfc");
            assert_eq!((*requested, *rounded), (MIB, MIB));
            assert_eq!(*limit, Some(7 * MIB));
            assert_eq!((*reserved, *in_use, *largest_free), (7 * MIB, 7 * MIB, 0));
        }
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let msg = err.to_string();
    for needle in [
        "GPU_0_bfc: out of memory allocating 1.00 MiB",
        "memory limit 7.00 MiB",
        "reserved 7.00 MiB",
        "in use 7.00 MiB",
        "largest free chunk 0 B",
        OOM_HINT,
    ] {
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }
    assert_eq!(a.stats().reserved, 7 * MIB, "a failed allocation takes nothing");
}

#[test]
fn request_above_the_limit_fails_without_a_region() {
    let mut a = growth(8 * MIB);
    assert!(matches!(a.allocate(9 * MIB), Err(AllocError::OutOfMemory { .. })));
    assert!(matches!(a.allocate(usize::MAX), Err(AllocError::OutOfMemory { .. })));
    assert!(a.source().events().is_empty());
}

#[test]
fn growth_off_takes_the_whole_limit_once() {
    let mut a = BfcAllocator::with_options(VirtualSource::new(), BfcOptions::preallocate(64 * MIB + 100));
    assert_eq!(a.stats().reserved, 0, "TF takes the region at the first allocation, not at construction");
    alloc(&mut a, KIB);
    assert_eq!(a.source().allocated_sizes(), [64 * MIB], "the limit rounded down to 256 B");
    for _ in 0..60 {
        alloc(&mut a, MIB);
    }
    assert_eq!(a.stats().num_regions, 1);
    assert!(matches!(a.allocate(4 * MIB), Err(AllocError::OutOfMemory { .. })));
}

/// limit 8 MiB: A = 1 MiB takes region R1 (2 MiB), B = 3 MiB takes R2 (4 MiB, whole). A is freed,
/// so R1 is entirely free; a 3 MiB request fits nowhere and only 2 MiB are left under the limit.
fn gc_setup(garbage_collection: bool) -> BfcAllocator {
    let opts = BfcOptions { garbage_collection, ..BfcOptions::growth(8 * MIB) };
    let mut a = BfcAllocator::with_options(VirtualSource::new(), opts);
    let x = alloc(&mut a, MIB);
    let y = alloc(&mut a, 3 * MIB);
    assert_eq!(y.size, 4 * MIB, "4 MiB < 2 x 3 MiB: not split");
    a.deallocate(x.addr).unwrap();
    a
}

#[test]
fn garbage_collection_frees_unused_regions_before_failing() {
    let mut a = gc_setup(true);
    let b = alloc(&mut a, 3 * MIB);
    assert_eq!(b.size, 4 * MIB);
    let events = a.source().events();
    assert!(matches!(events[2], SourceEvent::Free { bytes, .. } if bytes == 2 * MIB), "{events:?}");
    assert!(
        matches!(events[3], SourceEvent::Alloc { bytes, .. } if bytes == 4 * MIB),
        "min(8 MiB, 4 MiB left)"
    );
    assert_eq!(a.regions().iter().map(|r| r.1).collect::<Vec<_>>(), [4 * MIB, 4 * MIB]);
    assert_eq!(a.stats().reserved, 8 * MIB);
    assert_eq!(a.stats().peak_reserved, 8 * MIB);
}

#[test]
fn without_garbage_collection_the_same_request_fails() {
    let mut a = gc_setup(false);
    assert!(matches!(a.allocate(3 * MIB), Err(AllocError::OutOfMemory { .. })));
    assert_eq!(a.stats().num_regions, 2);
}

#[test]
fn backpedals_when_the_device_refuses() {
    // The device holds 3 MiB: the 4 MiB second region is refused, then retried at 90% steps.
    let mut a = BfcAllocator::new(VirtualSource::with_capacity(3 * MIB), GIB);
    alloc(&mut a, MIB);
    alloc(&mut a, MIB);
    let b = alloc(&mut a, 512 * KIB);
    let sizes = a.source().allocated_sizes();
    assert_eq!(sizes.len(), 2);
    assert!(sizes[1] <= MIB && sizes[1] as f64 > 0.9 * MIB as f64 - 256.0, "{sizes:?}");
    assert_eq!(sizes[1] % 256, 0);
    assert!(
        a.source().events().iter().any(|e| matches!(e, SourceEvent::Refused { bytes } if *bytes == 4 * MIB))
    );
    assert_eq!(b.requested, 512 * KIB);
    // Nothing of at least 1 MiB fits the device any more: out of memory, and it says the device refused.
    let err = a.allocate(MIB).unwrap_err().to_string();
    assert!(err.contains("refused"), "{err}");
}

#[test]
fn backpedal_ends_when_the_device_refuses_everything() {
    let mut a = BfcAllocator::new(VirtualSource::with_capacity(0), 64 * MIB);
    assert!(matches!(a.allocate(1), Err(AllocError::OutOfMemory { .. })));
    let tries = a.source().events().len();
    assert!((40..200).contains(&tries), "{tries} attempts from 2 MiB down to ~2.5 KiB");
    // Almost nothing left under the limit: 1 KiB regions, and the device refuses them.
    let mut a = BfcAllocator::new(VirtualSource::with_capacity(0), 1024);
    assert!(matches!(a.allocate(1), Err(AllocError::OutOfMemory { .. })));
    assert_eq!(a.source().events().len(), 1);
}

#[test]
fn stats_and_fragmentation() {
    let mut a = growth(64 * MIB);
    let [_x, y, _z] = [0; 3].map(|_| alloc(&mut a, 512 * KIB));
    a.deallocate(y.addr).unwrap();
    let s = a.stats();
    assert_eq!(s.in_use, MIB);
    assert_eq!(s.peak_in_use, 3 * MIB / 2);
    assert_eq!(s.reserved, 2 * MIB);
    assert_eq!(s.peak_reserved, 2 * MIB);
    assert_eq!(s.largest_free_chunk, 512 * KIB);
    assert_eq!(s.num_allocs, 3);
    assert_eq!(s.num_regions, 1);
    assert_eq!(s.requested_in_use, MIB);
    // Free: 1 MiB in two 512 KiB chunks; (1 MiB - 512 KiB) / 1 MiB.
    assert!((s.fragmentation() - 0.5).abs() < 1e-12);
}

#[test]
fn reset_peak_is_tf_clear_stats() {
    let mut a = growth(64 * MIB);
    let x = alloc(&mut a, 2 * MIB); // region 2 MiB, exact fit
    alloc(&mut a, MIB); // region 4 MiB, split
    a.deallocate(x.addr).unwrap();
    assert_eq!(a.stats().peak_in_use, 3 * MIB);
    a.reset_peak();
    let s = a.stats();
    assert_eq!((s.peak_in_use, s.in_use, s.num_allocs), (MIB, MIB, 0));
    assert_eq!((s.reserved, s.peak_reserved), (6 * MIB, 6 * MIB), "TF keeps peak_pool_bytes");
    alloc(&mut a, MIB); // best fit: the free 2 MiB region, split
    assert_eq!(a.stats().peak_in_use, 2 * MIB);
    assert_eq!(a.stats().num_allocs, 1);
}

#[test]
fn double_free_and_foreign_addresses_are_errors() {
    let mut a = growth(64 * MIB);
    let b = alloc(&mut a, KIB);
    alloc(&mut a, KIB);
    a.deallocate(b.addr).unwrap();
    let err = a.deallocate(b.addr).unwrap_err();
    assert_eq!(err, AllocError::DoubleFree { allocator: "bfc".into(), addr: b.addr });
    assert!(err.to_string().contains("double free"));
    assert!(matches!(a.deallocate(b.addr + 256), Err(AllocError::DoubleFree { .. })));
    let err = a.deallocate(0xdead_0000).unwrap_err();
    assert!(matches!(err, AllocError::UnknownAddress { addr: 0xdead_0000, .. }), "{err:?}");
    assert_eq!(a.stats().in_use, KIB);
}

/// A source that records what it is given back, to observe `Drop`.
struct Recording(VirtualSource, Rc<RefCell<Vec<usize>>>);

impl RegionSource for Recording {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        self.0.alloc_region(bytes)
    }
    fn free_region(&mut self, base: u64, bytes: usize) {
        self.1.borrow_mut().push(bytes);
        self.0.free_region(base, bytes)
    }
    fn name(&self) -> &str {
        "recording"
    }
}

#[test]
fn drop_returns_every_region() {
    let freed = Rc::new(RefCell::new(Vec::new()));
    {
        let mut a = BfcAllocator::new(Recording(VirtualSource::new(), freed.clone()), 64 * MIB);
        for _ in 0..5 {
            alloc(&mut a, 3 * MIB);
        }
        assert_eq!(a.source().0.held(), a.stats().reserved);
    }
    let mut sizes = freed.borrow().clone();
    sizes.sort();
    assert_eq!(sizes, [4 * MIB, 4 * MIB, 8 * MIB, 16 * MIB]);
}

#[test]
fn boxed_sources_and_allocators() {
    let source: Box<dyn RegionSource> = Box::new(VirtualSource::new());
    let mut a: Box<dyn Allocator> = Box::new(BfcAllocator::new(source, 64 * MIB));
    let b = alloc(&mut a, MIB);
    assert_eq!(a.name(), "bfc");
    a.deallocate(b.addr).unwrap();
}
