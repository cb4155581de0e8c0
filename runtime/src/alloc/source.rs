//! Region sources: where the growth allocators get their memory from.
//!
//! A region source plays the part of TensorFlow's `SubAllocator` (`DeviceMemAllocator::Alloc` /
//! `Free`, which call `cuMemAlloc` / `cuMemFree`) and of PyTorch's `cudaMalloc` / `cudaFree` calls in
//! `DeviceCachingAllocator::alloc_block` / `release_block`: it hands out whole regions and takes them
//! back whole. The allocators never assume two regions are adjacent (TensorFlow only merges regions
//! when the sub-allocator `SupportsCoalescing()`, which the GPU one does not; PyTorch never does).
//!
//! - [`VirtualSource`]: addresses from a counter, no memory behind them, an optional capacity that
//!   stands in for the device's memory. For tests and for simulating a device of any size.
//! - [`HostSource`]: real host memory, 256-byte aligned, from `std::alloc`. The CPU backend's eager
//!   executor writes tensors there; addresses are pointer values.
//!
//! A CUDA source (`cuMemAlloc`) implements the same trait in the CUDA backend.

use std::alloc::Layout;
use std::collections::BTreeMap;
use std::ptr::NonNull;

use super::{AllocError, fmt_bytes};

/// A device that hands out regions of memory.
pub trait RegionSource {
    /// Obtains `bytes` from the device; returns the region's base address. Err when the device refuses.
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError>;
    /// Returns a region obtained from [`RegionSource::alloc_region`], whole.
    fn free_region(&mut self, base: u64, bytes: usize);
    /// The device's name, for messages.
    fn name(&self) -> &str;
}

impl<S: RegionSource + ?Sized> RegionSource for Box<S> {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        (**self).alloc_region(bytes)
    }
    fn free_region(&mut self, base: u64, bytes: usize) {
        (**self).free_region(base, bytes)
    }
    fn name(&self) -> &str {
        (**self).name()
    }
}

/// One call a [`VirtualSource`] served, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SourceEvent {
    /// A region was handed out.
    Alloc {
        /// The region's start address.
        base: u64,
        /// The region's size in bytes.
        bytes: usize,
    },
    /// A region was returned.
    Free {
        /// The region's start address.
        base: u64,
        /// The region's size in bytes, as the allocator gave it back.
        bytes: usize,
    },
    /// A request was refused (capacity exceeded).
    Refused {
        /// The size of the refused request in bytes.
        bytes: usize,
    },
}

/// A simulated device: addresses from a counter, no memory behind them.
///
/// Bases are 4 KiB aligned (CUDA guarantees at least 256 B) and consecutive regions are separated by
/// a gap of at least 4 KiB, so that a bug that lets a block straddle two regions shows up as an
/// address outside every region. With a capacity, a request that would make the bytes held exceed it
/// is refused, like `cuMemAlloc` on a full device.
#[derive(Debug, Clone)]
pub struct VirtualSource {
    name: String,
    next: u64,
    capacity: Option<usize>,
    held: usize,
    peak_held: usize,
    live: BTreeMap<u64, usize>,
    events: Vec<SourceEvent>,
}

const VIRTUAL_BASE: u64 = 1 << 32;
const VIRTUAL_ALIGN: u64 = 4096;

impl VirtualSource {
    /// A source without a capacity (only the allocator's memory limit bounds it).
    pub fn new() -> Self {
        VirtualSource {
            name: "virtual".to_string(),
            next: VIRTUAL_BASE,
            capacity: None,
            held: 0,
            peak_held: 0,
            live: BTreeMap::new(),
            events: Vec::new(),
        }
    }

    /// A source that refuses to hold more than `capacity` bytes at once.
    pub fn with_capacity(capacity: usize) -> Self {
        VirtualSource { capacity: Some(capacity), ..Self::new() }
    }

    /// Renames the source (the name appears in error messages).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The capacity, if any.
    pub fn capacity(&self) -> Option<usize> {
        self.capacity
    }

    /// Bytes currently handed out.
    pub fn held(&self) -> usize {
        self.held
    }

    /// High-water mark of [`VirtualSource::held`].
    pub fn peak_held(&self) -> usize {
        self.peak_held
    }

    /// Regions currently handed out, by base address: `(base, bytes)`.
    pub fn live_regions(&self) -> Vec<(u64, usize)> {
        self.live.iter().map(|(&b, &s)| (b, s)).collect()
    }

    /// Every call served so far, in order.
    pub fn events(&self) -> &[SourceEvent] {
        &self.events
    }

    /// Sizes of the regions handed out so far, in order (frees and refusals left out).
    pub fn allocated_sizes(&self) -> Vec<usize> {
        self.events
            .iter()
            .filter_map(|e| match e {
                SourceEvent::Alloc { bytes, .. } => Some(*bytes),
                _ => None,
            })
            .collect()
    }
}

impl Default for VirtualSource {
    fn default() -> Self {
        Self::new()
    }
}

impl RegionSource for VirtualSource {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        let refuse =
            |reason: String| AllocError::DeviceRefused { source_name: self.name.clone(), bytes, reason };
        if bytes == 0 {
            return Err(refuse("a region must not be empty".to_string()));
        }
        if let Some(cap) = self.capacity
            && self.held.checked_add(bytes).is_none_or(|total| total > cap)
        {
            let err =
                refuse(format!("capacity {} with {} already held", fmt_bytes(cap), fmt_bytes(self.held)));
            self.events.push(SourceEvent::Refused { bytes });
            return Err(err);
        }
        let base = self.next;
        let next = (bytes as u64)
            .checked_next_multiple_of(VIRTUAL_ALIGN)
            .and_then(|span| span.checked_add(VIRTUAL_ALIGN))
            .and_then(|span| base.checked_add(span));
        let (Some(next), Some(held)) = (next, self.held.checked_add(bytes)) else {
            self.events.push(SourceEvent::Refused { bytes });
            return Err(refuse("address space exhausted".to_string()));
        };
        self.next = next;
        self.held = held;
        self.peak_held = self.peak_held.max(self.held);
        self.live.insert(base, bytes);
        self.events.push(SourceEvent::Alloc { base, bytes });
        Ok(base)
    }

    fn free_region(&mut self, base: u64, bytes: usize) {
        let size = self.live.remove(&base);
        debug_assert_eq!(size, Some(bytes), "{}: freeing a region it did not hand out", self.name);
        if let Some(size) = size {
            self.held -= size;
            self.events.push(SourceEvent::Free { base, bytes: size });
        }
    }

    fn name(&self) -> &str {
        &self.name
    }
}

/// Alignment of [`HostSource`] regions, as `cudaMalloc` guarantees for device memory.
pub const HOST_ALIGN: usize = 256;

/// Real host memory: each region is one `std::alloc` allocation, 256-byte aligned, freed when the
/// region is returned or the source is dropped. Addresses are the pointer values.
///
/// Reading and writing go through [`HostSource::bytes`] / [`HostSource::bytes_mut`], which check that
/// the range lies inside a live region, or through [`HostSource::ptr`] for executors that need
/// several disjoint blocks at once (they then uphold aliasing themselves).
#[derive(Debug)]
pub struct HostSource {
    name: String,
    capacity: Option<usize>,
    held: usize,
    regions: BTreeMap<u64, HostRegion>,
}

#[derive(Debug)]
struct HostRegion {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a HostSource exclusively owns the memory of its regions; the safe API hands out slices
// borrowed from `&self` / `&mut self`, so the borrow checker rules out data races.
unsafe impl Send for HostSource {}
// SAFETY: see above; `&HostSource` only gives shared slices.
unsafe impl Sync for HostSource {}

impl HostSource {
    /// Host memory bounded only by what the system gives.
    pub fn new() -> Self {
        HostSource { name: "host".to_string(), capacity: None, held: 0, regions: BTreeMap::new() }
    }

    /// Host memory bounded by `capacity` bytes held at once.
    pub fn with_capacity(capacity: usize) -> Self {
        let mut s = Self::new();
        s.capacity = Some(capacity);
        s
    }

    /// Bytes currently held.
    pub fn held(&self) -> usize {
        self.held
    }

    fn region_of(&self, addr: u64, len: usize) -> Option<&HostRegion> {
        let (&base, region) = self.regions.range(..=addr).next_back()?;
        let end = addr.checked_add(len as u64)?;
        (end <= base + region.layout.size() as u64).then_some(region)
    }

    /// Whether `[addr, addr + len)` lies inside one live region.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        self.region_of(addr, len).is_some()
    }

    /// The memory at `[addr, addr + len)`, if it lies inside one live region.
    pub fn bytes(&self, addr: u64, len: usize) -> Option<&[u8]> {
        self.region_of(addr, len)?;
        // SAFETY: the range lies inside a live allocation owned by self, which outlives the borrow.
        Some(unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) })
    }

    /// The memory at `[addr, addr + len)`, writable, if it lies inside one live region.
    pub fn bytes_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        self.region_of(addr, len)?;
        // SAFETY: as in `bytes`; `&mut self` makes the borrow exclusive.
        Some(unsafe { std::slice::from_raw_parts_mut(addr as usize as *mut u8, len) })
    }

    /// The raw pointer for `addr` if `[addr, addr + len)` lies inside one live region. The pointer is
    /// valid until the region is freed; callers uphold Rust's aliasing rules themselves.
    pub fn ptr(&self, addr: u64, len: usize) -> Option<NonNull<u8>> {
        self.region_of(addr, len)?;
        NonNull::new(addr as usize as *mut u8)
    }
}

impl Default for HostSource {
    fn default() -> Self {
        Self::new()
    }
}

impl RegionSource for HostSource {
    fn alloc_region(&mut self, bytes: usize) -> Result<u64, AllocError> {
        let refuse =
            |reason: String| AllocError::DeviceRefused { source_name: self.name.clone(), bytes, reason };
        if bytes == 0 {
            return Err(refuse("a region must not be empty".to_string()));
        }
        if let Some(cap) = self.capacity
            && self.held.checked_add(bytes).is_none_or(|total| total > cap)
        {
            return Err(refuse(format!(
                "capacity {} with {} already held",
                fmt_bytes(cap),
                fmt_bytes(self.held)
            )));
        }
        let layout =
            Layout::from_size_align(bytes, HOST_ALIGN).map_err(|e| refuse(format!("invalid layout: {e}")))?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr =
            NonNull::new(raw).ok_or_else(|| refuse("the system allocator returned null".to_string()))?;
        let base = ptr.as_ptr() as usize as u64;
        self.held += bytes;
        self.regions.insert(base, HostRegion { ptr, layout });
        Ok(base)
    }

    fn free_region(&mut self, base: u64, bytes: usize) {
        let region = self.regions.remove(&base);
        debug_assert!(
            region.as_ref().is_some_and(|r| r.layout.size() == bytes),
            "{}: freeing a region it did not hand out",
            self.name
        );
        if let Some(region) = region {
            self.held -= region.layout.size();
            // SAFETY: the pointer came from `std::alloc::alloc` with this layout and is freed once.
            unsafe { std::alloc::dealloc(region.ptr.as_ptr(), region.layout) };
        }
    }

    fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for HostSource {
    fn drop(&mut self) {
        for (_, region) in std::mem::take(&mut self.regions) {
            // SAFETY: as in `free_region`.
            unsafe { std::alloc::dealloc(region.ptr.as_ptr(), region.layout) };
        }
    }
}
