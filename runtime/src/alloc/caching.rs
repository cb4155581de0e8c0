//! PyTorch's CUDA caching allocator with its default configuration.
//!
//! Follows `DeviceCachingAllocator` in `c10/cuda/CUDACachingAllocator.cpp`, with the defaults of
//! `CUDAAllocatorConfig` (no `PYTORCH_CUDA_ALLOC_CONF`): `max_split_size` unlimited, no
//! `roundup_power2_divisions`, no `garbage_collection_threshold`, no `expandable_segments`. One
//! stream, no CUDA graphs. Rule by rule:
//!
//! - **Rounding** (`round_size`): requests below 512 B (`kMinBlockSize`) become 512 B, others are
//!   rounded up to a multiple of 512 B. A 0-byte request returns the null block (PyTorch returns a
//!   null `DataPtr` without calling `malloc`).
//! - **Pools** (`get_pool`): rounded sizes up to 1 MiB (`kSmallSize`) use the small pool, larger ones
//!   the large pool. Each pool orders its cached free blocks by (size, address)
//!   (`BlockComparatorSize`).
//! - **Segment sizes** (`get_allocation_size`): a small-pool miss allocates a 2 MiB segment
//!   (`kSmallBuffer`); a large request below 10 MiB (`kMinLargeAlloc`) a 20 MiB segment
//!   (`kLargeBuffer`); larger requests a segment of the request rounded up to 2 MiB (`kRoundLarge`).
//! - **Search** (`get_free_block`): the smallest cached block of the pool with size >= the request,
//!   lowest address on ties. The oversize rules are implemented with `max_split_size`: a request below
//!   it never takes a block of at least `max_split_size`, and a request at or above it only takes a
//!   block smaller than request + `max_non_split_rounding_size` (default 20 MiB). With the default
//!   (unlimited) `max_split_size` neither rule ever applies.
//! - **Split** (`should_split` / `alloc_found_block`): small pool when the remainder is >= 512 B; large
//!   pool when the request is below `max_split_size` and the remainder is > 1 MiB. The allocation
//!   keeps the low end, the remainder goes back to the pool. Unsplit blocks count whole in `in_use`.
//! - **Free** (`free_block` / `try_merge_blocks`): a freed block merges with free previous and next
//!   blocks of its segment and goes back to its pool. Segments are kept (cached) even when empty.
//! - **New segments** (`alloc_block`): refused when a memory limit is set and
//!   reserved + segment size > limit (`set_per_process_memory_fraction`), or when the device refuses.
//! - **Retry** (`malloc`): after a failed `alloc_block`, `release_available_cached_blocks` (frees cached
//!   oversize segments; a no-op while `max_split_size` is unlimited) and retry, then
//!   `release_cached_blocks` (frees every cached segment that is entirely free, both pools) and retry
//!   once more; then out of memory.
//! - **Stats** (`DeviceStats`): `in_use` is `allocated_bytes`, `reserved` is `reserved_bytes`,
//!   `requested_in_use` is `requested_bytes`, `num_allocs` counts allocations (`allocation.allocated`,
//!   not reset by `reset_peak`), `largest_free_chunk` is the largest cached block (`cacheInfo`).
//!   `reset_peak` is `resetPeakStats`: the peaks of allocated and reserved bytes become the current
//!   values.
//!
//! Left out because one single-stream executor never needs them: streams and events
//! (`recordStream`), CUDA graph private pools, expandable segments, the garbage-collection threshold,
//! `roundup_power2_divisions`, free-memory callbacks.

use std::collections::{BTreeMap, HashMap};

use super::source::{RegionSource, VirtualSource};
use super::{AllocError, Allocator, AllocatorStats, Block, MIB, fmt_bytes};

/// All sizes are rounded up to multiples of this (`kMinBlockSize`).
pub const K_MIN_BLOCK_SIZE: usize = 512;
/// Largest "small" request (`kSmallSize`).
pub const K_SMALL_SIZE: usize = MIB;
/// Segment size of the small pool (`kSmallBuffer`).
pub const K_SMALL_BUFFER: usize = 2 * MIB;
/// Segment size for large requests below [`K_MIN_LARGE_ALLOC`] (`kLargeBuffer`).
pub const K_LARGE_BUFFER: usize = 20 * MIB;
/// Large requests from this size get a segment of their own size (`kMinLargeAlloc`).
pub const K_MIN_LARGE_ALLOC: usize = 10 * MIB;
/// Rounding of segments for large requests (`kRoundLarge`).
pub const K_ROUND_LARGE: usize = 2 * MIB;

/// The two block pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pool {
    /// Requests up to 1 MiB, 2 MiB segments.
    Small,
    /// Larger requests.
    Large,
}

/// `round_size`: below 512 -> 512, else up to a multiple of 512 (saturates near `usize::MAX`).
pub fn caching_round_size(size: usize) -> usize {
    if size < K_MIN_BLOCK_SIZE {
        K_MIN_BLOCK_SIZE
    } else {
        size.div_ceil(K_MIN_BLOCK_SIZE).saturating_mul(K_MIN_BLOCK_SIZE)
    }
}

/// `get_pool`: the pool of a rounded size.
pub fn caching_pool(rounded: usize) -> Pool {
    if rounded <= K_SMALL_SIZE { Pool::Small } else { Pool::Large }
}

/// `get_allocation_size`: the segment allocated for a rounded size when no cached block fits.
pub fn caching_allocation_size(rounded: usize) -> usize {
    if rounded <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if rounded < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER
    } else {
        rounded.div_ceil(K_ROUND_LARGE).saturating_mul(K_ROUND_LARGE)
    }
}

/// Configuration of a [`CachingAllocator`] (the parts of `PYTORCH_CUDA_ALLOC_CONF` and
/// `set_per_process_memory_fraction` that apply).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachingOptions {
    /// Bound on reserved bytes (`allowed_memory_maximum`); `None` when only the device bounds it.
    pub memory_limit: Option<usize>,
    /// `max_split_size_mb` in bytes; `usize::MAX` (the default) means unlimited.
    pub max_split_size: usize,
    /// `max_non_split_rounding_mb` in bytes; 20 MiB by default.
    pub max_non_split_rounding_size: usize,
    /// Name used in messages.
    pub name: String,
}

impl Default for CachingOptions {
    fn default() -> Self {
        CachingOptions {
            memory_limit: None,
            max_split_size: usize::MAX,
            max_non_split_rounding_size: K_LARGE_BUFFER,
            name: "caching".to_string(),
        }
    }
}

impl CachingOptions {
    /// The defaults with a memory limit in bytes.
    pub fn with_limit(memory_limit: usize) -> Self {
        CachingOptions { memory_limit: Some(memory_limit), ..Self::default() }
    }

    /// `torch.cuda.set_per_process_memory_fraction(fraction)` on a device of `device_total` bytes:
    /// the limit is `floor(fraction * device_total)`.
    pub fn with_memory_fraction(mut self, fraction: f64, device_total: usize) -> Self {
        self.memory_limit = Some((fraction * device_total as f64) as usize);
        self
    }

    /// Sets the name.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// One block of a segment, as `torch.cuda.memory_snapshot()` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockInfo {
    /// The block's start address.
    pub addr: u64,
    /// The block's size in bytes (rounded; an allocated block may be larger than its request).
    pub size: usize,
    /// Bytes requested for an allocated block, 0 for a cached free block.
    pub requested: usize,
    /// Whether the block is allocated (false: cached, free for reuse).
    pub allocated: bool,
}

/// One segment (one `cudaMalloc`) with its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentInfo {
    /// The segment's start address (what the region source returned).
    pub addr: u64,
    /// The segment's size in bytes.
    pub size: usize,
    /// The pool the segment serves: small or large requests.
    pub pool: Pool,
    /// The segment's blocks in address order, covering it without gaps.
    pub blocks: Vec<BlockInfo>,
}

type BlockId = usize;

#[derive(Clone, Debug)]
struct Blk {
    addr: u64,
    size: usize,
    requested: usize,
    allocated: bool,
    pool: Pool,
    prev: Option<BlockId>,
    next: Option<BlockId>,
}

impl Blk {
    fn is_split(&self) -> bool {
        self.prev.is_some() || self.next.is_some()
    }
}

/// PyTorch's caching allocator over a [`RegionSource`]; see the module documentation for the rules.
pub struct CachingAllocator<S: RegionSource = VirtualSource> {
    source: S,
    opts: CachingOptions,
    blocks: Vec<Blk>,
    unused_block_ids: Vec<BlockId>,
    /// Every block (allocated or cached) by start address.
    by_addr: HashMap<u64, BlockId>,
    /// Cached free blocks of the small pool, by (size, address).
    small_blocks: BTreeMap<(usize, u64), BlockId>,
    /// Cached free blocks of the large pool, by (size, address).
    large_blocks: BTreeMap<(usize, u64), BlockId>,
    /// Segments: base -> (bytes, pool).
    segments: BTreeMap<u64, (usize, Pool)>,
    allocated_bytes: usize,
    peak_allocated_bytes: usize,
    reserved_bytes: usize,
    peak_reserved_bytes: usize,
    requested_bytes: usize,
    num_allocs: u64,
    num_alloc_retries: u64,
    num_ooms: u64,
    num_device_alloc: u64,
    num_device_free: u64,
    last_device_error: Option<String>,
}

impl<S: RegionSource> CachingAllocator<S> {
    /// PyTorch's defaults; `memory_limit` as `set_per_process_memory_fraction` would set it.
    pub fn new(source: S, memory_limit: Option<usize>) -> Self {
        Self::with_options(source, CachingOptions { memory_limit, ..CachingOptions::default() })
    }

    /// An allocator with explicit options.
    pub fn with_options(source: S, opts: CachingOptions) -> Self {
        CachingAllocator {
            source,
            opts,
            blocks: Vec::new(),
            unused_block_ids: Vec::new(),
            by_addr: HashMap::new(),
            small_blocks: BTreeMap::new(),
            large_blocks: BTreeMap::new(),
            segments: BTreeMap::new(),
            allocated_bytes: 0,
            peak_allocated_bytes: 0,
            reserved_bytes: 0,
            peak_reserved_bytes: 0,
            requested_bytes: 0,
            num_allocs: 0,
            num_alloc_retries: 0,
            num_ooms: 0,
            num_device_alloc: 0,
            num_device_free: 0,
            last_device_error: None,
        }
    }

    /// The options.
    pub fn options(&self) -> &CachingOptions {
        &self.opts
    }

    /// The region source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The region source, mutable (e.g. to write into [`super::HostSource`] memory).
    pub fn source_mut(&mut self) -> &mut S {
        &mut self.source
    }

    /// `torch.cuda.empty_cache()`: returns every cached segment that is entirely free to the device.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    /// Times a segment allocation was retried after releasing the cache (`num_alloc_retries`).
    pub fn num_alloc_retries(&self) -> u64 {
        self.num_alloc_retries
    }

    /// Out-of-memory errors raised (`num_ooms`).
    pub fn num_ooms(&self) -> u64 {
        self.num_ooms
    }

    /// Segments obtained from the device (`num_device_alloc`).
    pub fn num_device_alloc(&self) -> u64 {
        self.num_device_alloc
    }

    /// Segments returned to the device (`num_device_free`).
    pub fn num_device_free(&self) -> u64 {
        self.num_device_free
    }

    /// Segments held, by base address: `(base, bytes)`.
    pub fn regions(&self) -> Vec<(u64, usize)> {
        self.segments.iter().map(|(&b, &(s, _))| (b, s)).collect()
    }

    /// Every segment with its blocks, in address order (`memory_snapshot`).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        self.segments
            .iter()
            .map(|(&base, &(size, pool))| {
                let mut blocks = Vec::new();
                let mut h = Some(self.by_addr[&base]);
                while let Some(id) = h {
                    let b = &self.blocks[id];
                    blocks.push(BlockInfo {
                        addr: b.addr,
                        size: b.size,
                        requested: b.requested,
                        allocated: b.allocated,
                    });
                    h = b.next;
                }
                SegmentInfo { addr: base, size, pool, blocks }
            })
            .collect()
    }

    fn pool_mut(&mut self, pool: Pool) -> &mut BTreeMap<(usize, u64), BlockId> {
        match pool {
            Pool::Small => &mut self.small_blocks,
            Pool::Large => &mut self.large_blocks,
        }
    }

    fn pool_ref(&self, pool: Pool) -> &BTreeMap<(usize, u64), BlockId> {
        match pool {
            Pool::Small => &self.small_blocks,
            Pool::Large => &self.large_blocks,
        }
    }

    fn new_block(&mut self, blk: Blk) -> BlockId {
        let addr = blk.addr;
        let id = match self.unused_block_ids.pop() {
            Some(id) => {
                self.blocks[id] = blk;
                id
            }
            None => {
                self.blocks.push(blk);
                self.blocks.len() - 1
            }
        };
        self.by_addr.insert(addr, id);
        id
    }

    fn delete_block(&mut self, id: BlockId) {
        self.by_addr.remove(&self.blocks[id].addr);
        self.unused_block_ids.push(id);
    }

    fn insert_into_pool(&mut self, id: BlockId) {
        let (pool, size, addr) = (self.blocks[id].pool, self.blocks[id].size, self.blocks[id].addr);
        let inserted = self.pool_mut(pool).insert((size, addr), id);
        debug_assert!(inserted.is_none());
    }

    fn remove_from_pool(&mut self, id: BlockId) {
        let (pool, size, addr) = (self.blocks[id].pool, self.blocks[id].size, self.blocks[id].addr);
        let removed = self.pool_mut(pool).remove(&(size, addr));
        debug_assert_eq!(removed, Some(id));
    }

    /// `get_free_block`: best fit in the pool, with the oversize rules.
    fn get_free_block(&mut self, pool: Pool, size: usize) -> Option<BlockId> {
        let (&(block_size, _), &id) = self.pool_ref(pool).range((size, 0)..).next()?;
        let max_split = self.opts.max_split_size;
        if size < max_split && block_size >= max_split {
            return None;
        }
        if size >= max_split && block_size >= size.saturating_add(self.opts.max_non_split_rounding_size) {
            return None;
        }
        self.remove_from_pool(id);
        Some(id)
    }

    /// `alloc_block`: a new segment of `alloc_size` bytes, unless the limit or the device refuses.
    fn alloc_block(&mut self, pool: Pool, alloc_size: usize, is_retry: bool) -> Option<BlockId> {
        if is_retry {
            self.num_alloc_retries += 1;
        }
        if let Some(limit) = self.opts.memory_limit
            && self.reserved_bytes.saturating_add(alloc_size) > limit
        {
            return None;
        }
        let base = match self.source.alloc_region(alloc_size) {
            Ok(base) => base,
            Err(e) => {
                self.last_device_error = Some(e.to_string());
                return None;
            }
        };
        self.reserved_bytes += alloc_size;
        self.peak_reserved_bytes = self.peak_reserved_bytes.max(self.reserved_bytes);
        self.num_device_alloc += 1;
        self.segments.insert(base, (alloc_size, pool));
        Some(self.new_block(Blk {
            addr: base,
            size: alloc_size,
            requested: 0,
            allocated: false,
            pool,
            prev: None,
            next: None,
        }))
    }

    /// `release_block`: returns an unsplit cached block (a whole segment) to the device.
    fn release_block(&mut self, id: BlockId) {
        debug_assert!(!self.blocks[id].is_split() && !self.blocks[id].allocated);
        self.remove_from_pool(id);
        let (addr, size) = (self.blocks[id].addr, self.blocks[id].size);
        self.source.free_region(addr, size);
        self.reserved_bytes -= size;
        self.num_device_free += 1;
        self.segments.remove(&addr);
        self.delete_block(id);
    }

    /// `release_available_cached_blocks`: with a finite `max_split_size`, frees the smallest cached
    /// oversize segment of at least max(size, max_split_size), or else the largest ones until that
    /// much is freed. Does nothing (returns false) while `max_split_size` is unlimited.
    fn release_available_cached_blocks(&mut self, pool: Pool, size: usize) -> bool {
        let max_split = self.opts.max_split_size;
        if max_split == usize::MAX {
            return false;
        }
        let key = size.max(max_split);
        // Only unsplit blocks are whole segments that can go back to the device; blocks of at least
        // max_split_size are never split by this allocator except in corner cases (see the report).
        let unsplit = |this: &Self, id: BlockId| !this.blocks[id].is_split();
        let single = self.pool_ref(pool).range((key, 0)..).map(|(_, &id)| id).find(|&id| unsplit(self, id));
        if let Some(id) = single {
            self.release_block(id);
            return true;
        }
        let candidates: Vec<BlockId> = self
            .pool_ref(pool)
            .iter()
            .rev()
            .take_while(|(k, _)| k.0 >= max_split)
            .map(|(_, &id)| id)
            .filter(|&id| unsplit(self, id))
            .collect();
        if candidates.is_empty() {
            return false;
        }
        let mut released = 0usize;
        for id in candidates {
            if released >= key {
                break;
            }
            released += self.blocks[id].size;
            self.release_block(id);
        }
        released >= key
    }

    /// `release_cached_blocks`: frees every cached block that is a whole segment, large pool first.
    fn release_cached_blocks(&mut self) -> bool {
        for pool in [Pool::Large, Pool::Small] {
            let whole: Vec<BlockId> =
                self.pool_ref(pool).values().copied().filter(|&id| !self.blocks[id].is_split()).collect();
            for id in whole {
                self.release_block(id);
            }
        }
        true
    }

    /// `should_split`.
    fn should_split(&self, id: BlockId, size: usize) -> bool {
        let b = &self.blocks[id];
        let remaining = b.size - size;
        match b.pool {
            Pool::Small => remaining >= K_MIN_BLOCK_SIZE,
            Pool::Large => size < self.opts.max_split_size && remaining > K_SMALL_SIZE,
        }
    }

    /// `alloc_found_block`: splits off the low end if asked, marks it allocated, updates the stats.
    fn alloc_found_block(&mut self, id: BlockId, size: usize, requested: usize, split: bool) -> Block {
        let id = if split {
            let (addr, prev, pool) = (self.blocks[id].addr, self.blocks[id].prev, self.blocks[id].pool);
            // The remainder keeps its identity and moves up; the allocation is a new block below it.
            self.by_addr.remove(&addr);
            let rem = &mut self.blocks[id];
            rem.addr = addr + size as u64;
            rem.size -= size;
            let new_id = self.new_block(Blk {
                addr,
                size,
                requested: 0,
                allocated: false,
                pool,
                prev,
                next: Some(id),
            });
            if let Some(p) = prev {
                self.blocks[p].next = Some(new_id);
            }
            self.blocks[id].prev = Some(new_id);
            self.by_addr.insert(self.blocks[id].addr, id);
            self.insert_into_pool(id);
            new_id
        } else {
            id
        };
        let b = &mut self.blocks[id];
        b.allocated = true;
        b.requested = requested;
        self.allocated_bytes += b.size;
        self.peak_allocated_bytes = self.peak_allocated_bytes.max(self.allocated_bytes);
        self.requested_bytes += requested;
        self.num_allocs += 1;
        Block { addr: b.addr, size: b.size, requested }
    }

    /// `try_merge_blocks`: folds the free neighbour `src` into `dst`.
    fn try_merge_blocks(&mut self, dst: BlockId, src: Option<BlockId>) {
        let Some(src) = src else { return };
        if self.blocks[src].allocated {
            return;
        }
        self.remove_from_pool(src);
        let (s_addr, s_size, s_prev, s_next) =
            (self.blocks[src].addr, self.blocks[src].size, self.blocks[src].prev, self.blocks[src].next);
        if self.blocks[dst].prev == Some(src) {
            // [src dst]: dst moves down to src's address.
            self.by_addr.remove(&self.blocks[dst].addr);
            self.delete_block(src);
            let d = &mut self.blocks[dst];
            d.addr = s_addr;
            d.prev = s_prev;
            if let Some(p) = s_prev {
                self.blocks[p].next = Some(dst);
            }
            self.by_addr.insert(s_addr, dst);
        } else {
            // [dst src]
            self.delete_block(src);
            self.blocks[dst].next = s_next;
            if let Some(n) = s_next {
                self.blocks[n].prev = Some(dst);
            }
        }
        self.blocks[dst].size += s_size;
    }

    fn largest_cached_block(&self) -> usize {
        let last = |m: &BTreeMap<(usize, u64), BlockId>| m.keys().next_back().map_or(0, |k| k.0);
        last(&self.small_blocks).max(last(&self.large_blocks))
    }

    fn segment_containing(&self, addr: u64) -> Option<u64> {
        let (&base, &(size, _)) = self.segments.range(..=addr).next_back()?;
        (addr < base + size as u64).then_some(base)
    }
}

impl<S: RegionSource> Allocator for CachingAllocator<S> {
    /// `DeviceCachingAllocator::malloc`.
    fn allocate(&mut self, bytes: usize) -> Result<Block, AllocError> {
        if bytes == 0 {
            return Ok(Block::NULL);
        }
        self.last_device_error = None;
        let size = caching_round_size(bytes);
        let pool = caching_pool(size);
        let alloc_size = caching_allocation_size(size);
        let mut found = self.get_free_block(pool, size);
        if found.is_none() {
            found = self.alloc_block(pool, alloc_size, false);
        }
        if found.is_none() && self.release_available_cached_blocks(pool, size) {
            found = self.alloc_block(pool, alloc_size, false);
        }
        if found.is_none() {
            self.release_cached_blocks();
            found = self.alloc_block(pool, alloc_size, true);
        }
        let Some(id) = found else {
            self.num_ooms += 1;
            let pool_name = match pool {
                Pool::Small => "small",
                Pool::Large => "large",
            };
            let mut detail = format!(
                "needed a new {pool_name}-pool segment of {} after releasing the cache; {} segment(s) held",
                fmt_bytes(alloc_size),
                self.segments.len()
            );
            if let Some(e) = &self.last_device_error {
                detail.push_str(&format!("; {e}"));
            }
            return Err(AllocError::OutOfMemory {
                allocator: self.opts.name.clone(),
                requested: bytes,
                rounded: size,
                limit: self.opts.memory_limit,
                reserved: self.reserved_bytes,
                in_use: self.allocated_bytes,
                largest_free: self.largest_cached_block(),
                detail,
            });
        };
        let split = self.should_split(id, size);
        Ok(self.alloc_found_block(id, size, bytes, split))
    }

    /// `DeviceCachingAllocator::free` / `free_block`: merge with free neighbours, back to the pool.
    fn deallocate(&mut self, addr: u64) -> Result<(), AllocError> {
        if addr == 0 {
            return Ok(());
        }
        let id = match self.by_addr.get(&addr) {
            Some(&id) if self.blocks[id].allocated => id,
            _ => {
                let allocator = self.opts.name.clone();
                return Err(if self.segment_containing(addr).is_some() {
                    AllocError::DoubleFree { allocator, addr }
                } else {
                    AllocError::UnknownAddress { allocator, addr }
                });
            }
        };
        let b = &mut self.blocks[id];
        b.allocated = false;
        self.allocated_bytes -= b.size;
        self.requested_bytes -= b.requested;
        b.requested = 0;
        let (prev, next) = (b.prev, b.next);
        self.try_merge_blocks(id, prev);
        self.try_merge_blocks(id, next);
        self.insert_into_pool(id);
        Ok(())
    }

    fn stats(&self) -> AllocatorStats {
        AllocatorStats {
            in_use: self.allocated_bytes,
            peak_in_use: self.peak_allocated_bytes,
            reserved: self.reserved_bytes,
            peak_reserved: self.peak_reserved_bytes,
            largest_free_chunk: self.largest_cached_block(),
            num_allocs: self.num_allocs,
            num_regions: self.segments.len(),
            requested_in_use: self.requested_bytes,
        }
    }

    /// `resetPeakStats`: peaks of allocated and reserved bytes become the current values.
    fn reset_peak(&mut self) {
        self.peak_allocated_bytes = self.allocated_bytes;
        self.peak_reserved_bytes = self.reserved_bytes;
    }

    fn name(&self) -> &str {
        &self.opts.name
    }
}

impl<S: RegionSource> Drop for CachingAllocator<S> {
    /// Returns every segment to the source.
    fn drop(&mut self) {
        for (base, (bytes, _)) in std::mem::take(&mut self.segments) {
            self.source.free_region(base, bytes);
        }
    }
}
