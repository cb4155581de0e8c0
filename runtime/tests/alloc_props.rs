//! Property tests: random allocate/free sequences against both allocators in several configurations.
//!
//! After every step: live blocks never overlap and each lies inside a region; the chunks (blocks) of
//! each region tile it exactly; no two free neighbours are left unmerged; the stats agree with the
//! live blocks and the regions; the limit holds. An out-of-memory error only happens when no free
//! chunk fits. After freeing everything, every region is one free chunk. The limits are small enough
//! that out-of-memory errors, backpedalling and cache releases happen in most runs.

use proptest::prelude::*;

use kiln_runtime::alloc::{
    AllocError, Allocator, BfcAllocator, BfcOptions, Block, CachingAllocator, CachingOptions, MIB,
    RegionSource, VirtualSource, bfc_rounded_bytes, caching_pool, caching_round_size,
};

#[derive(Clone, Debug)]
enum Op {
    Alloc(usize),
    Free(usize),
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..4096,
        3 => 4096usize..2 * MIB,
        2 => MIB..12 * MIB,
        1 => 10 * MIB..48 * MIB,
    ]
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![3 => size().prop_map(Op::Alloc), 2 => any::<usize>().prop_map(Op::Free)],
        1..250,
    )
}

/// A region's contents in address order: `(addr, size, in_use)`.
type Tiles = Vec<(u64, usize, bool)>;

/// What the checks need to see inside an allocator.
trait Inspect: Allocator {
    fn held_by_source(&self) -> usize;
    fn limit(&self) -> Option<usize>;
    fn layout(&self) -> Vec<((u64, usize), Tiles)>;
    /// Whether a free chunk that could serve `bytes` exists (checked after an out-of-memory error).
    fn could_serve(&self, bytes: usize) -> bool;
}

impl Inspect for BfcAllocator<VirtualSource> {
    fn held_by_source(&self) -> usize {
        self.source().held()
    }
    fn limit(&self) -> Option<usize> {
        Some(self.options().memory_limit)
    }
    fn layout(&self) -> Vec<((u64, usize), Tiles)> {
        let chunks = self.chunks();
        self.regions()
            .into_iter()
            .map(|r| {
                (r, chunks.iter().filter(|c| c.region == r.0).map(|c| (c.addr, c.size, c.in_use)).collect())
            })
            .collect()
    }
    fn could_serve(&self, bytes: usize) -> bool {
        self.chunks().iter().any(|c| !c.in_use && c.size >= bfc_rounded_bytes(bytes))
    }
}

impl Inspect for CachingAllocator<VirtualSource> {
    fn held_by_source(&self) -> usize {
        self.source().held()
    }
    fn limit(&self) -> Option<usize> {
        self.options().memory_limit
    }
    fn layout(&self) -> Vec<((u64, usize), Tiles)> {
        self.segments()
            .into_iter()
            .map(|s| ((s.addr, s.size), s.blocks.iter().map(|b| (b.addr, b.size, b.allocated)).collect()))
            .collect()
    }
    fn could_serve(&self, bytes: usize) -> bool {
        // The best fit must exist and pass the oversize rules (`get_free_block`).
        let size = caching_round_size(bytes);
        let max_split = self.options().max_split_size;
        let best = self
            .segments()
            .iter()
            .filter(|s| s.pool == caching_pool(size))
            .flat_map(|s| s.blocks.clone())
            .filter(|b| !b.allocated && b.size >= size)
            .map(|b| b.size)
            .min();
        best.is_some_and(|b| {
            let oversize_for_a_small_request = size < max_split && b >= max_split;
            let too_much_rounding = size >= max_split && b >= size + 20 * MIB;
            !(oversize_for_a_small_request || too_much_rounding)
        })
    }
}

fn check<A: Inspect>(a: &A, live: &[Block]) -> Result<(), TestCaseError> {
    let s = a.stats();
    let layout = a.layout();
    let regions: Vec<(u64, usize)> = layout.iter().map(|l| l.0).collect();

    let mut sorted: Vec<Block> = live.to_vec();
    sorted.sort_by_key(|b| b.addr);
    for w in sorted.windows(2) {
        prop_assert!(w[0].end() <= w[1].addr, "overlapping live blocks {:?} and {:?}", w[0], w[1]);
    }
    for b in &sorted {
        prop_assert!(
            regions.iter().any(|&(base, size)| base <= b.addr && b.end() <= base + size as u64),
            "{b:?} is in no region"
        );
        prop_assert!(b.size >= b.requested);
    }

    let mut in_use_tiles = Vec::new();
    let mut largest_free = 0;
    for ((base, size), tiles) in &layout {
        let mut at = *base;
        for (i, &(addr, len, used)) in tiles.iter().enumerate() {
            prop_assert_eq!(addr, at, "gap or overlap in the region at {:#x}", base);
            at += len as u64;
            if used {
                in_use_tiles.push((addr, len));
            } else {
                largest_free = largest_free.max(len);
                if i > 0 {
                    prop_assert!(tiles[i - 1].2, "two free neighbours left unmerged at {:#x}", addr);
                }
            }
        }
        prop_assert_eq!(at, base + *size as u64, "chunks do not cover the region");
    }
    in_use_tiles.sort();
    let live_tiles: Vec<(u64, usize)> = sorted.iter().map(|b| (b.addr, b.size)).collect();
    prop_assert_eq!(in_use_tiles, live_tiles);

    prop_assert_eq!(s.in_use, live.iter().map(|b| b.size).sum::<usize>());
    prop_assert_eq!(s.requested_in_use, live.iter().map(|b| b.requested).sum::<usize>());
    let reserved: usize = regions.iter().map(|r| r.1).sum();
    prop_assert_eq!(s.reserved, reserved);
    prop_assert_eq!(s.reserved, a.held_by_source());
    prop_assert_eq!(s.num_regions, regions.len());
    prop_assert_eq!(s.largest_free_chunk, largest_free);
    prop_assert!(s.peak_in_use >= s.in_use && s.peak_reserved >= s.reserved);
    if let Some(limit) = a.limit() {
        prop_assert!(s.reserved <= limit && s.peak_reserved <= limit);
    }
    let f = s.fragmentation();
    prop_assert!((0.0..=1.0).contains(&f));
    Ok(())
}

fn run<A: Inspect>(mut a: A, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut live: Vec<Block> = Vec::new();
    for op in ops {
        match *op {
            Op::Alloc(bytes) => match a.allocate(bytes) {
                Ok(b) if b.is_null() => prop_assert_eq!(bytes, 0),
                Ok(b) => {
                    prop_assert_eq!(b.requested, bytes);
                    live.push(b);
                }
                Err(AllocError::OutOfMemory { .. }) => {
                    prop_assert!(
                        !a.could_serve(bytes),
                        "out of memory for {} although a free chunk fits",
                        bytes
                    );
                }
                Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
            },
            Op::Free(pick) => {
                if !live.is_empty() {
                    let b = live.swap_remove(pick % live.len());
                    a.deallocate(b.addr).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    prop_assert!(a.deallocate(b.addr).is_err(), "a second free must fail");
                }
            }
        }
        check(&a, &live)?;
    }
    for b in live.drain(..) {
        a.deallocate(b.addr).map_err(|e| TestCaseError::fail(e.to_string()))?;
    }
    check(&a, &live)?;
    prop_assert_eq!(a.stats().in_use, 0);
    for (region, tiles) in a.layout() {
        prop_assert_eq!(tiles.len(), 1, "region {:?} is not one free chunk", region);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 160, ..ProptestConfig::default() })]

    #[test]
    fn bfc_growth(ops in ops()) {
        run(BfcAllocator::new(VirtualSource::new(), 80 * MIB), &ops)?;
    }

    #[test]
    fn bfc_growth_without_garbage_collection(ops in ops()) {
        let opts = BfcOptions { garbage_collection: false, ..BfcOptions::growth(64 * MIB) };
        run(BfcAllocator::with_options(VirtualSource::new(), opts), &ops)?;
    }

    #[test]
    fn bfc_preallocated(ops in ops()) {
        run(BfcAllocator::with_options(VirtualSource::new(), BfcOptions::preallocate(64 * MIB)), &ops)?;
    }

    #[test]
    fn bfc_on_a_small_device(ops in ops()) {
        run(BfcAllocator::new(VirtualSource::with_capacity(72 * MIB), 1 << 30), &ops)?;
    }

    #[test]
    fn bfc_on_a_tiny_device(ops in ops()) {
        run(BfcAllocator::new(VirtualSource::with_capacity(3 * MIB), 1 << 30), &ops)?;
    }

    #[test]
    fn caching_default(ops in ops()) {
        run(CachingAllocator::new(VirtualSource::new(), Some(80 * MIB)), &ops)?;
    }

    #[test]
    fn caching_with_max_split_size(ops in ops()) {
        let opts = CachingOptions { max_split_size: 16 * MIB, ..CachingOptions::with_limit(64 * MIB) };
        run(CachingAllocator::with_options(VirtualSource::new(), opts), &ops)?;
    }

    #[test]
    fn caching_on_a_small_device(ops in ops()) {
        run(CachingAllocator::new(VirtualSource::with_capacity(72 * MIB), None), &ops)?;
    }
}

#[test]
fn region_source_is_object_safe() {
    let mut s: Box<dyn RegionSource> = Box::new(VirtualSource::new());
    let base = s.alloc_region(MIB).unwrap();
    s.free_region(base, MIB);
}
