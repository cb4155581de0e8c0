//! Growth allocators for the eager baseline.
//!
//! kiln's benchmarks compare graph mode (one planned arena per device) against eager execution, where
//! every tensor is allocated when its op runs and freed when its last use has run. The eager numbers
//! are only honest if the eager executor allocates the way real frameworks do, so this module
//! reimplements the two allocators people actually run, rule for rule:
//!
//! - [`BfcAllocator`]: TensorFlow's best-fit-with-coalescing allocator
//!   (`tensorflow/core/common_runtime/bfc_allocator.cc`, now `xla/tsl/framework/bfc_allocator.cc`),
//!   as `GPUBFCAllocator` configures it: `allow_growth` and region garbage collection.
//! - [`CachingAllocator`]: PyTorch's CUDA caching allocator
//!   (`c10/cuda/CUDACachingAllocator.cpp`, `DeviceCachingAllocator`) with its default configuration.
//!
//! Both are device independent: they hand out addresses inside *regions* obtained from a
//! [`RegionSource`] (TensorFlow's `SubAllocator`, PyTorch's `cudaMalloc`). [`VirtualSource`] hands
//! out addresses from a counter (tests, simulations: no memory is touched), [`HostSource`] hands out
//! real host memory that the CPU backend's eager executor writes tensors into.
//!
//! All sizes are bytes. The address 0 is the null block: allocating 0 bytes returns it without
//! touching the allocator (both originals return a null pointer there), and freeing it is a no-op.

mod bfc;
mod caching;
mod source;

pub use bfc::{
    BFC_BIN_COUNT, BFC_MIN_ALLOCATION, BfcAllocator, BfcOptions, ChunkInfo, bfc_bin_for_size,
    bfc_rounded_bytes,
};
pub use caching::{
    BlockInfo, CachingAllocator, CachingOptions, K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE, K_SMALL_BUFFER, K_SMALL_SIZE, Pool, SegmentInfo, caching_allocation_size, caching_pool,
    caching_round_size,
};
pub use source::{HostSource, RegionSource, SourceEvent, VirtualSource};

/// One allocation handed out by an [`Allocator`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Block {
    /// Start address (for [`HostSource`], the pointer value). 0 only for the null block of a 0-byte request.
    pub addr: u64,
    /// Bytes the allocator reserved for this block (rounded, possibly more when a chunk is not split).
    pub size: usize,
    /// Bytes the caller asked for.
    pub requested: usize,
}

impl Block {
    /// The block returned for a 0-byte request.
    pub const NULL: Block = Block { addr: 0, size: 0, requested: 0 };

    /// Whether this is the null block of a 0-byte request.
    pub fn is_null(&self) -> bool {
        self.addr == 0
    }

    /// One past the last byte of the block.
    pub fn end(&self) -> u64 {
        self.addr + self.size as u64
    }
}

/// What an eager executor needs from a growth allocator.
pub trait Allocator {
    /// Allocates at least `bytes` bytes. `bytes == 0` returns [`Block::NULL`].
    fn allocate(&mut self, bytes: usize) -> Result<Block, AllocError>;
    /// Frees the block that starts at `addr`. Freeing address 0 is a no-op; freeing an address that is
    /// not a live block is an error (double free or foreign address).
    fn deallocate(&mut self, addr: u64) -> Result<(), AllocError>;
    /// Current statistics.
    fn stats(&self) -> AllocatorStats;
    /// Starts a new peak measurement, like `tf.config.experimental.reset_memory_stats` or
    /// `torch.cuda.reset_peak_memory_stats` (each implementation says which peaks it resets).
    fn reset_peak(&mut self);
    /// The allocator's name, used in error messages and reports.
    fn name(&self) -> &str;
}

impl<A: Allocator + ?Sized> Allocator for Box<A> {
    fn allocate(&mut self, bytes: usize) -> Result<Block, AllocError> {
        (**self).allocate(bytes)
    }
    fn deallocate(&mut self, addr: u64) -> Result<(), AllocError> {
        (**self).deallocate(addr)
    }
    fn stats(&self) -> AllocatorStats {
        (**self).stats()
    }
    fn reset_peak(&mut self) {
        (**self).reset_peak()
    }
    fn name(&self) -> &str {
        (**self).name()
    }
}

/// Memory statistics of an allocator (bytes unless noted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct AllocatorStats {
    /// Bytes held by live blocks (their rounded sizes).
    pub in_use: usize,
    /// High-water mark of `in_use` since construction or the last [`Allocator::reset_peak`].
    pub peak_in_use: usize,
    /// Bytes held from the device (sum of region sizes).
    pub reserved: usize,
    /// High-water mark of `reserved`.
    pub peak_reserved: usize,
    /// Largest free chunk (BFC) or cached free block (caching allocator).
    pub largest_free_chunk: usize,
    /// Number of successful non-empty allocations (see each allocator for when it is reset).
    pub num_allocs: u64,
    /// Number of regions (BFC) or segments (caching allocator) currently held.
    pub num_regions: usize,
    /// Bytes the callers asked for, summed over live blocks.
    pub requested_in_use: usize,
}

impl AllocatorStats {
    /// TensorFlow's fragmentation metric (`BFCAllocator::GetFragmentation`):
    /// `(reserved - in_use - largest_free) / (reserved - in_use)`, 0 when nothing is free.
    pub fn fragmentation(&self) -> f64 {
        let free = self.reserved.saturating_sub(self.in_use);
        if free == 0 {
            return 0.0;
        }
        free.saturating_sub(self.largest_free_chunk) as f64 / free as f64
    }
}

/// The hint every out-of-memory error carries.
pub const OOM_HINT: &str =
    "set a larger memory limit, reduce the batch, or use graph mode whose plan is checked before running";

/// Errors of the allocators and region sources.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Nothing free fits, the memory limit (or the device) allows no new region, and releasing
    /// unused regions did not help.
    #[error(
        "{allocator}: out of memory allocating {} (rounded to {}): memory limit {}, reserved {}, in use {}, \
         largest free chunk {}{}. Hint: {OOM_HINT}",
        fmt_bytes(*.requested), fmt_bytes(*.rounded), fmt_limit(*.limit), fmt_bytes(*.reserved),
        fmt_bytes(*.in_use), fmt_bytes(*.largest_free), fmt_detail(.detail)
    )]
    OutOfMemory {
        /// The allocator's name (its options' `name`).
        allocator: String,
        /// The bytes the caller asked for.
        requested: usize,
        /// The request rounded as the allocator serves it (its bin or block size), in bytes.
        rounded: usize,
        /// The allocator's memory limit; `None` when only the device bounds it.
        limit: Option<usize>,
        /// Bytes the allocator held from the device when it failed.
        reserved: usize,
        /// Bytes held by live blocks when it failed.
        in_use: usize,
        /// The largest free chunk (BFC) or cached block (caching allocator) when it failed, in
        /// bytes.
        largest_free: usize,
        /// Extra context, e.g. what the device said; may be empty.
        detail: String,
    },
    /// The address lies in memory this allocator holds but is not the start of a live block.
    #[error(
        "{allocator}: double free: {addr:#x} is not a live allocation (it was already freed, or is not the \
         start of a block). Free each block once, by the address `allocate` returned"
    )]
    DoubleFree {
        /// The allocator's name.
        allocator: String,
        /// The address passed to `deallocate`.
        addr: u64,
    },
    /// The address is not in any region this allocator holds.
    #[error(
        "{allocator}: unknown address {addr:#x}: it lies in no region of this allocator; free blocks with the \
         allocator that allocated them"
    )]
    UnknownAddress {
        /// The allocator's name.
        allocator: String,
        /// The address passed to `deallocate`.
        addr: u64,
    },
    /// A region source refused a region.
    #[error("device {source_name} refused a region of {}: {reason}", fmt_bytes(*.bytes))]
    DeviceRefused {
        /// The region source's name (the device it takes memory from).
        source_name: String,
        /// The size of the refused region, in bytes.
        bytes: usize,
        /// Why: an empty region, the source's capacity exceeded, an exhausted address space, or the
        /// driver's or the system allocator's refusal.
        reason: String,
    },
}

/// Formats a byte count for messages, e.g. `2.00 MiB (2097152 B)`.
pub fn fmt_bytes(bytes: usize) -> String {
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    format!("{} ({bytes} B)", kiln_compiler::device::human_bytes(bytes))
}

fn fmt_limit(limit: Option<usize>) -> String {
    match limit {
        Some(l) => fmt_bytes(l),
        None => "none (bounded by the device)".to_string(),
    }
}

fn fmt_detail(detail: &str) -> String {
    if detail.is_empty() { String::new() } else { format!("; {detail}") }
}

/// 1 KiB.
pub const KIB: usize = 1 << 10;
/// 1 MiB.
pub const MIB: usize = 1 << 20;
/// 1 GiB.
pub const GIB: usize = 1 << 30;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragmentation_formula() {
        let s = AllocatorStats {
            reserved: 10 * MIB,
            in_use: 6 * MIB,
            largest_free_chunk: MIB,
            ..Default::default()
        };
        assert!((s.fragmentation() - 0.75).abs() < 1e-12);
        let full = AllocatorStats { reserved: MIB, in_use: MIB, ..Default::default() };
        assert_eq!(full.fragmentation(), 0.0);
        assert_eq!(AllocatorStats::default().fragmentation(), 0.0);
    }

    #[test]
    fn bytes_format() {
        assert_eq!(fmt_bytes(100), "100 B");
        assert_eq!(fmt_bytes(2 * MIB), "2.00 MiB (2097152 B)");
        assert_eq!(fmt_bytes(1536), "1.50 KiB (1536 B)");
    }
}
