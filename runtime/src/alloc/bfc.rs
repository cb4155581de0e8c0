//! TensorFlow's BFC ("best-fit with coalescing") allocator, as the GPU device runs it.
//!
//! Follows `BFCAllocator` in `tensorflow/core/common_runtime/bfc_allocator.cc` (today
//! `xla/tsl/framework/bfc_allocator.cc`) with the options `GPUBFCAllocator` passes
//! (`tensorflow/core/common_runtime/gpu/gpu_bfc_allocator.cc`). Rule by rule:
//!
//! - **Rounding** (`RoundedBytes`): every request is rounded up to a multiple of 256 B
//!   (`kMinAllocationSize`); a 0-byte request returns the null block (`AllocateRawInternal` returns
//!   nullptr).
//! - **Bins** (`BinNumForSize`): 21 bins; bin `i` holds free chunks of size `[256 << i, 256 << (i+1))`,
//!   the last bin is unbounded. A bin's chunks are ordered by (size, address) (`Bin::ChunkComparator`).
//! - **Search** (`FindChunkPtr`): from the request's bin upward, the first chunk of size >= the
//!   rounded request: best fit, lowest address on ties.
//! - **Split** (`FindChunkPtr` / `SplitChunk`): the chosen chunk is split when `size >= 2 * rounded` or
//!   `size - rounded >= 128 MiB` (`kMaxInternalFragmentation`; `fragmentation_fraction * limit` when
//!   that option is set). The allocation keeps the low end; the remainder becomes a free chunk.
//!   Unsplit chunks are handed out whole and count whole in `in_use`.
//! - **Coalescing** (`TryToCoalesce`): a freed chunk merges with a free next neighbour, then with a
//!   free previous neighbour, within its region. Regions never merge with each other: the GPU
//!   sub-allocator (`DeviceMemAllocator`) does not `SupportsCoalescing()`.
//! - **Growth** (`Extend`): when no chunk fits, a new region is requested. `available` is the limit
//!   minus the bytes of all regions, rounded down to 256; a request larger than `available` fails at
//!   once. Otherwise `curr_region_allocation_bytes` is doubled until it covers the request, the region
//!   is `min(curr, available)`, and if `curr` was not doubled for this request it is doubled after
//!   the region was obtained. With `allow_growth`, `curr` starts at `min(limit, 2 MiB)`; without, at
//!   the whole limit, so the first allocation takes one region of the whole limit.
//! - **Backpedal** (`Extend`): when the device refuses, the size is retried at 90% (rounded to 256 B)
//!   until it would no longer cover the request (the current TSL code retries every time; TF 2.0-2.4
//!   did it only once per allocator lifetime). One deliberate difference: the loop also stops when
//!   90% rounded up no longer shrinks the size (below ~2.5 KiB), where TF's loop would never end.
//! - **Garbage collection** (`DeallocateFreeRegions`): when neither a chunk nor a new region can serve
//!   the request, regions with no chunk in use are returned to the device if that can make room
//!   (`limit - reserved + free regions >= rounded`), and `Extend` runs again. `GPUBFCAllocator` turns
//!   this on unless `TF_ENABLE_GPU_GARBAGE_COLLECTION=false`, so it is on by default here too.
//! - **Out of memory**: after all that, an [`AllocError::OutOfMemory`]. (TF's `AllocatorRetry` would
//!   first wait up to 10 s for other threads to free memory; the eager executor is single-threaded,
//!   so nobody could, and that wait is left out.)
//! - **Stats** (`AllocatorStats`): `in_use` sums chunk sizes (rounded, whole unsplit chunks),
//!   `reserved` is the bytes of all regions (`pool_bytes`), `largest_free_chunk` is
//!   `LargestFreeChunk`, `reset_peak` does what `ClearStats` does (`reset_memory_stats`): `num_allocs`
//!   to 0 and `peak_in_use` to `in_use`; `peak_reserved` (`peak_pool_bytes`) is not reset by TF
//!   either.
//!
//! Left out because the eager executor does not use them: timestamped chunks (`freed_at_count`,
//! `SetSafeFrontier`), alignment requests above 256 B, spatial partitioning, memory dumps.

use std::collections::{BTreeMap, HashMap};

use super::source::{RegionSource, VirtualSource};
use super::{AllocError, Allocator, AllocatorStats, Block, MIB};

/// Sizes are rounded up to multiples of this (`kMinAllocationSize`).
pub const BFC_MIN_ALLOCATION: usize = 256;
/// Number of bins (`kNumBins`).
pub const BFC_BIN_COUNT: usize = 21;
/// Default bound on the padding an unsplit chunk may carry (`kMaxInternalFragmentation`).
const MAX_INTERNAL_FRAGMENTATION: usize = 128 * MIB;
/// First region size with `allow_growth`.
const INITIAL_GROWTH_REGION: usize = 2 * MIB;
/// Shrink factor when the device refuses a region (`kBackpedalFactor`).
const BACKPEDAL_FACTOR: f32 = 0.9;

/// `bytes` rounded up to a multiple of 256 (`BFCAllocator::RoundedBytes`); saturates near `usize::MAX`.
pub fn bfc_rounded_bytes(bytes: usize) -> usize {
    bytes.div_ceil(BFC_MIN_ALLOCATION).saturating_mul(BFC_MIN_ALLOCATION)
}

/// The bin of a chunk of `bytes` bytes (`BFCAllocator::BinNumForSize`):
/// `min(20, floor(log2(max(bytes, 256) / 256)))`.
pub fn bfc_bin_for_size(bytes: usize) -> usize {
    let v = bytes.max(BFC_MIN_ALLOCATION) >> 8;
    (v.ilog2() as usize).min(BFC_BIN_COUNT - 1)
}

/// Configuration of a [`BfcAllocator`].
#[derive(Clone, Debug, PartialEq)]
pub struct BfcOptions {
    /// Total bytes the regions may add up to (TF's `total_memory` / `memory_limit`).
    pub memory_limit: usize,
    /// Grow region by region from 2 MiB (`allow_growth`); otherwise the first region is the whole limit.
    pub allow_growth: bool,
    /// Return unused regions to the device before failing (`garbage_collection`, on for GPUs).
    pub garbage_collection: bool,
    /// When > 0, the padding bound for unsplit chunks is this fraction of the limit instead of 128 MiB
    /// (`GPUOptions.experimental.internal_fragmentation_fraction`; 0 by default).
    pub fragmentation_fraction: f64,
    /// Name used in messages.
    pub name: String,
}

impl BfcOptions {
    /// TF's GPU allocator with `allow_growth` (`tf.config.experimental.set_memory_growth`): growth and
    /// garbage collection on.
    pub fn growth(memory_limit: usize) -> Self {
        BfcOptions {
            memory_limit,
            allow_growth: true,
            garbage_collection: true,
            fragmentation_fraction: 0.0,
            name: "bfc".to_string(),
        }
    }

    /// TF's GPU allocator without `allow_growth` (TF's default): one region of the whole limit.
    pub fn preallocate(memory_limit: usize) -> Self {
        BfcOptions { allow_growth: false, ..Self::growth(memory_limit) }
    }

    /// Sets the name.
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

/// One chunk, as `BFCAllocator::RecordMemoryMap` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkInfo {
    /// The chunk's start address.
    pub addr: u64,
    /// The chunk's size in bytes (rounded; a chunk in use may be larger than its request).
    pub size: usize,
    /// Bytes requested for a chunk in use, 0 for a free chunk.
    pub requested: usize,
    /// Whether a live block occupies the chunk.
    pub in_use: bool,
    /// The bin a free chunk sits in; `None` for a chunk in use.
    pub bin: Option<usize>,
    /// Base address of the region holding the chunk.
    pub region: u64,
}

type ChunkId = usize;

#[derive(Clone, Debug)]
struct Chunk {
    addr: u64,
    size: usize,
    requested: usize,
    in_use: bool,
    prev: Option<ChunkId>,
    next: Option<ChunkId>,
    bin: Option<usize>,
}

/// TensorFlow's BFC allocator over a [`RegionSource`]; see the module documentation for the rules.
pub struct BfcAllocator<S: RegionSource = VirtualSource> {
    source: S,
    opts: BfcOptions,
    chunks: Vec<Chunk>,
    unused_chunk_ids: Vec<ChunkId>,
    /// Every chunk (free or in use) by start address.
    by_addr: HashMap<u64, ChunkId>,
    /// Free chunks, per bin, ordered by (size, address).
    bins: Vec<BTreeMap<(usize, u64), ChunkId>>,
    /// Regions: base -> bytes.
    regions: BTreeMap<u64, usize>,
    curr_region_allocation_bytes: usize,
    max_internal_fragmentation: usize,
    in_use: usize,
    peak_in_use: usize,
    pool_bytes: usize,
    peak_pool_bytes: usize,
    requested_in_use: usize,
    num_allocs: u64,
    last_device_error: Option<String>,
}

impl<S: RegionSource> BfcAllocator<S> {
    /// TF's GPU allocator with `allow_growth` and the given memory limit ([`BfcOptions::growth`]).
    pub fn new(source: S, memory_limit: usize) -> Self {
        Self::with_options(source, BfcOptions::growth(memory_limit))
    }

    /// An allocator with explicit options. Nothing is taken from the device until the first allocation
    /// (as in TF, where the constructor only sets `curr_region_allocation_bytes_`).
    pub fn with_options(source: S, opts: BfcOptions) -> Self {
        let curr = if opts.allow_growth {
            bfc_rounded_bytes(opts.memory_limit.min(INITIAL_GROWTH_REGION))
        } else {
            bfc_rounded_bytes(opts.memory_limit)
        };
        let max_internal_fragmentation = if opts.fragmentation_fraction > 0.0 {
            (opts.fragmentation_fraction * opts.memory_limit as f64) as usize
        } else {
            MAX_INTERNAL_FRAGMENTATION
        };
        BfcAllocator {
            source,
            opts,
            chunks: Vec::new(),
            unused_chunk_ids: Vec::new(),
            by_addr: HashMap::new(),
            bins: vec![BTreeMap::new(); BFC_BIN_COUNT],
            regions: BTreeMap::new(),
            curr_region_allocation_bytes: curr,
            max_internal_fragmentation,
            in_use: 0,
            peak_in_use: 0,
            pool_bytes: 0,
            peak_pool_bytes: 0,
            requested_in_use: 0,
            num_allocs: 0,
            last_device_error: None,
        }
    }

    /// The options.
    pub fn options(&self) -> &BfcOptions {
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

    /// The size the next region will have if it is not doubled for the request
    /// (`curr_region_allocation_bytes_`).
    pub fn curr_region_allocation_bytes(&self) -> usize {
        self.curr_region_allocation_bytes
    }

    /// Regions held, by base address: `(base, bytes)`.
    pub fn regions(&self) -> Vec<(u64, usize)> {
        self.regions.iter().map(|(&b, &s)| (b, s)).collect()
    }

    /// Every chunk, region by region, in address order (`RecordMemoryMap`).
    pub fn chunks(&self) -> Vec<ChunkInfo> {
        let mut out = Vec::new();
        for &base in self.regions.keys() {
            let mut h = Some(self.by_addr[&base]);
            while let Some(id) = h {
                let c = &self.chunks[id];
                out.push(ChunkInfo {
                    addr: c.addr,
                    size: c.size,
                    requested: c.requested,
                    in_use: c.in_use,
                    bin: c.bin,
                    region: base,
                });
                h = c.next;
            }
        }
        out
    }

    fn new_chunk(&mut self, chunk: Chunk) -> ChunkId {
        let addr = chunk.addr;
        let id = match self.unused_chunk_ids.pop() {
            Some(id) => {
                self.chunks[id] = chunk;
                id
            }
            None => {
                self.chunks.push(chunk);
                self.chunks.len() - 1
            }
        };
        self.by_addr.insert(addr, id);
        id
    }

    fn delete_chunk(&mut self, id: ChunkId) {
        self.by_addr.remove(&self.chunks[id].addr);
        self.unused_chunk_ids.push(id);
    }

    fn insert_free_chunk_into_bin(&mut self, id: ChunkId) {
        let c = &mut self.chunks[id];
        debug_assert!(!c.in_use && c.bin.is_none());
        let bin = bfc_bin_for_size(c.size);
        c.bin = Some(bin);
        self.bins[bin].insert((c.size, c.addr), id);
    }

    fn remove_free_chunk_from_bin(&mut self, id: ChunkId) {
        let c = &mut self.chunks[id];
        let bin = c.bin.take().expect("free chunk is in a bin");
        let removed = self.bins[bin].remove(&(c.size, c.addr));
        debug_assert_eq!(removed, Some(id));
    }

    /// `Extend`: obtains a region able to hold `rounded` bytes. Returns false when the limit or the
    /// device does not allow it.
    fn extend(&mut self, rounded: usize) -> bool {
        let available = self.opts.memory_limit.saturating_sub(self.pool_bytes);
        let available = available / BFC_MIN_ALLOCATION * BFC_MIN_ALLOCATION;
        if rounded > available {
            return false;
        }
        let mut increased = false;
        while rounded > self.curr_region_allocation_bytes {
            self.curr_region_allocation_bytes = self.curr_region_allocation_bytes.saturating_mul(2);
            increased = true;
        }
        let mut bytes = self.curr_region_allocation_bytes.min(available);
        let base = loop {
            match self.source.alloc_region(bytes) {
                Ok(base) => break base,
                Err(e) => {
                    self.last_device_error = Some(e.to_string());
                    let smaller = bfc_rounded_bytes((bytes as f32 * BACKPEDAL_FACTOR) as usize);
                    // TF stops only when the size drops below the request; below ~2.5 KiB, 90% rounded
                    // up to 256 B no longer shrinks and TF would retry forever. Stop there too.
                    if smaller < rounded || smaller >= bytes {
                        return false;
                    }
                    bytes = smaller;
                }
            }
        };
        if !increased {
            self.curr_region_allocation_bytes = self.curr_region_allocation_bytes.saturating_mul(2);
        }
        self.pool_bytes += bytes;
        self.peak_pool_bytes = self.peak_pool_bytes.max(self.pool_bytes);
        self.regions.insert(base, bytes);
        let id = self.new_chunk(Chunk {
            addr: base,
            size: bytes,
            requested: 0,
            in_use: false,
            prev: None,
            next: None,
            bin: None,
        });
        self.insert_free_chunk_into_bin(id);
        true
    }

    /// `FindChunkPtr`: best fit from `bin` upward, splitting when the chunk is too large.
    fn find_chunk(&mut self, bin: usize, rounded: usize, requested: usize) -> Option<Block> {
        for b in bin..BFC_BIN_COUNT {
            let Some((_, &id)) = self.bins[b].range((rounded, 0)..).next() else { continue };
            self.remove_free_chunk_from_bin(id);
            let size = self.chunks[id].size;
            if size >= rounded.saturating_mul(2) || size - rounded >= self.max_internal_fragmentation {
                self.split_chunk(id, rounded);
            }
            let c = &mut self.chunks[id];
            c.in_use = true;
            c.requested = requested;
            self.num_allocs += 1;
            self.in_use += c.size;
            self.peak_in_use = self.peak_in_use.max(self.in_use);
            self.requested_in_use += requested;
            return Some(Block { addr: c.addr, size: c.size, requested });
        }
        None
    }

    /// `SplitChunk`: keeps the first `bytes` in `id`, the rest becomes a new free chunk.
    fn split_chunk(&mut self, id: ChunkId, bytes: usize) {
        let (addr, size, next) = {
            let c = &self.chunks[id];
            (c.addr, c.size, c.next)
        };
        let new_id = self.new_chunk(Chunk {
            addr: addr + bytes as u64,
            size: size - bytes,
            requested: 0,
            in_use: false,
            prev: Some(id),
            next,
            bin: None,
        });
        self.chunks[id].size = bytes;
        self.chunks[id].next = Some(new_id);
        if let Some(n) = next {
            self.chunks[n].prev = Some(new_id);
        }
        self.insert_free_chunk_into_bin(new_id);
    }

    /// `Merge`: folds `b` (which directly follows `a`) into `a`.
    fn merge(&mut self, a: ChunkId, b: ChunkId) {
        debug_assert_eq!(self.chunks[a].next, Some(b));
        debug_assert_eq!(self.chunks[b].prev, Some(a));
        let (b_size, b_next) = (self.chunks[b].size, self.chunks[b].next);
        self.chunks[a].next = b_next;
        if let Some(n) = b_next {
            self.chunks[n].prev = Some(a);
        }
        self.chunks[a].size += b_size;
        self.delete_chunk(b);
    }

    /// `TryToCoalesce`: merges with a free next neighbour, then a free previous one.
    fn try_to_coalesce(&mut self, id: ChunkId) -> ChunkId {
        let mut result = id;
        if let Some(n) = self.chunks[id].next
            && !self.chunks[n].in_use
        {
            self.remove_free_chunk_from_bin(n);
            self.merge(id, n);
        }
        if let Some(p) = self.chunks[id].prev
            && !self.chunks[p].in_use
        {
            self.remove_free_chunk_from_bin(p);
            self.merge(p, id);
            result = p;
        }
        result
    }

    /// `DeallocateFreeRegions`: returns regions without chunks in use to the device, if that can make
    /// room for `rounded` bytes.
    fn deallocate_free_regions(&mut self, rounded: usize) -> bool {
        if !self.opts.garbage_collection {
            return false;
        }
        let free_regions: Vec<(u64, usize)> = self
            .regions
            .iter()
            .filter(|&(&base, _)| {
                let mut h = Some(self.by_addr[&base]);
                while let Some(id) = h {
                    if self.chunks[id].in_use {
                        return false;
                    }
                    h = self.chunks[id].next;
                }
                true
            })
            .map(|(&b, &s)| (b, s))
            .collect();
        let total_free: usize = free_regions.iter().map(|r| r.1).sum();
        if total_free == 0 {
            return false;
        }
        let available = self.opts.memory_limit.saturating_sub(self.pool_bytes) + total_free;
        if rounded > available {
            return false;
        }
        for (base, bytes) in free_regions {
            let mut h = Some(self.by_addr[&base]);
            while let Some(id) = h {
                h = self.chunks[id].next;
                if self.chunks[id].bin.is_some() {
                    self.remove_free_chunk_from_bin(id);
                }
                self.delete_chunk(id);
            }
            self.source.free_region(base, bytes);
            self.pool_bytes -= bytes;
            self.regions.remove(&base);
        }
        true
    }

    fn largest_free_chunk(&self) -> usize {
        self.bins.iter().rev().find_map(|b| b.keys().next_back().map(|k| k.0)).unwrap_or(0)
    }

    fn region_containing(&self, addr: u64) -> Option<u64> {
        let (&base, &size) = self.regions.range(..=addr).next_back()?;
        (addr < base + size as u64).then_some(base)
    }
}

impl<S: RegionSource> Allocator for BfcAllocator<S> {
    /// `AllocateRawInternal`: find a chunk; else extend and find; else garbage-collect free regions,
    /// extend and find; else out of memory.
    fn allocate(&mut self, bytes: usize) -> Result<Block, AllocError> {
        if bytes == 0 {
            return Ok(Block::NULL);
        }
        self.last_device_error = None;
        let rounded = bfc_rounded_bytes(bytes);
        let bin = bfc_bin_for_size(rounded);
        if let Some(b) = self.find_chunk(bin, rounded, bytes) {
            return Ok(b);
        }
        if self.extend(rounded)
            && let Some(b) = self.find_chunk(bin, rounded, bytes)
        {
            return Ok(b);
        }
        if self.deallocate_free_regions(rounded)
            && self.extend(rounded)
            && let Some(b) = self.find_chunk(bin, rounded, bytes)
        {
            return Ok(b);
        }
        let mut detail = format!(
            "{} region(s) held, next region would be {}",
            self.regions.len(),
            super::fmt_bytes(self.curr_region_allocation_bytes)
        );
        if let Some(e) = &self.last_device_error {
            detail.push_str(&format!("; {e}"));
        }
        Err(AllocError::OutOfMemory {
            allocator: self.opts.name.clone(),
            requested: bytes,
            rounded,
            limit: Some(self.opts.memory_limit),
            reserved: self.pool_bytes,
            in_use: self.in_use,
            largest_free: self.largest_free_chunk(),
            detail,
        })
    }

    /// `DeallocateRawInternal`: mark free, coalesce, put back into a bin.
    fn deallocate(&mut self, addr: u64) -> Result<(), AllocError> {
        if addr == 0 {
            return Ok(());
        }
        let id = match self.by_addr.get(&addr) {
            Some(&id) if self.chunks[id].in_use => id,
            _ => {
                let allocator = self.opts.name.clone();
                return Err(if self.region_containing(addr).is_some() {
                    AllocError::DoubleFree { allocator, addr }
                } else {
                    AllocError::UnknownAddress { allocator, addr }
                });
            }
        };
        let c = &mut self.chunks[id];
        c.in_use = false;
        self.in_use -= c.size;
        self.requested_in_use -= c.requested;
        c.requested = 0;
        let merged = self.try_to_coalesce(id);
        self.insert_free_chunk_into_bin(merged);
        Ok(())
    }

    fn stats(&self) -> AllocatorStats {
        AllocatorStats {
            in_use: self.in_use,
            peak_in_use: self.peak_in_use,
            reserved: self.pool_bytes,
            peak_reserved: self.peak_pool_bytes,
            largest_free_chunk: self.largest_free_chunk(),
            num_allocs: self.num_allocs,
            num_regions: self.regions.len(),
            requested_in_use: self.requested_in_use,
        }
    }

    /// `ClearStats`: `num_allocs` to 0, `peak_in_use` to `in_use`; `peak_reserved` is kept, as in TF.
    fn reset_peak(&mut self) {
        self.num_allocs = 0;
        self.peak_in_use = self.in_use;
    }

    fn name(&self) -> &str {
        &self.opts.name
    }
}

impl<S: RegionSource> Drop for BfcAllocator<S> {
    /// Returns every region to the source, as `~BFCAllocator` does.
    fn drop(&mut self) {
        for (base, bytes) in std::mem::take(&mut self.regions) {
            self.source.free_region(base, bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bins_cover_their_ranges() {
        for b in 0..BFC_BIN_COUNT {
            let lo = 256usize << b;
            assert_eq!(bfc_bin_for_size(lo), b);
            assert_eq!(bfc_bin_for_size(lo + 255), b);
            assert_eq!(bfc_bin_for_size(2 * lo - 1), b);
            if b + 1 < BFC_BIN_COUNT {
                assert_ne!(bfc_bin_for_size(2 * lo), b);
            }
        }
    }
}
