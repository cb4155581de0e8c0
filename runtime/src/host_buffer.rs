//! Host memory allocated once, 256-byte aligned and zeroed: the CPU arena, io regions, variables.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

pub const ALIGN: usize = 256;

pub struct HostBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the buffer owns its allocation; access goes through &self / &mut self or raw pointers
// whose use the executor orders.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `bytes` of zeroed memory, or `None` when the machine cannot give them (or the size is
    /// beyond what a layout can describe): callers turn that into an error naming the device.
    pub fn zeroed(bytes: usize) -> Option<Self> {
        if bytes == 0 {
            // A dangling pointer aligned to ALIGN: valid for zero-sized access.
            let ptr = NonNull::new(ALIGN as *mut u8)?;
            return Some(HostBuffer { ptr, bytes });
        }
        let layout = Layout::from_size_align(bytes, ALIGN).ok()?;
        // SAFETY: layout has non-zero size; a null result is handled, never dereferenced.
        let raw = unsafe { alloc_zeroed(layout) };
        Some(HostBuffer { ptr: NonNull::new(raw)?, bytes })
    }

    pub fn len(&self) -> usize {
        self.bytes
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// `count` f32s at byte `offset`.
    pub fn f32s(&self, offset: usize, count: usize) -> &[f32] {
        assert!(offset.is_multiple_of(4) && offset + count * 4 <= self.bytes, "f32 view inside the buffer");
        // SAFETY: in bounds (checked), aligned (offset multiple of 4, base 256-aligned), initialised (zeroed).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset) as *const f32, count) }
    }

    pub fn f32s_mut(&mut self, offset: usize, count: usize) -> &mut [f32] {
        assert!(offset.is_multiple_of(4) && offset + count * 4 <= self.bytes, "f32 view inside the buffer");
        // SAFETY: as in `f32s`, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(offset) as *mut f32, count) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.bytes > 0 {
            // SAFETY: allocated in `zeroed` with this very layout, which was valid then.
            unsafe { dealloc(self.ptr.as_ptr(), Layout::from_size_align_unchecked(self.bytes, ALIGN)) };
        }
    }
}

/// Host memory handed to a plan or a variable: an allocation of its own, or a piece of a
/// device's preallocated pool (which outlives it: both belong to the same backend).
pub enum HostMem {
    Owned(HostBuffer),
    Pooled { ptr: NonNull<u8>, len: usize },
}

// SAFETY: as for HostBuffer; a pooled piece is exclusively this owner's part of the pool.
unsafe impl Send for HostMem {}
unsafe impl Sync for HostMem {}

impl HostMem {
    pub fn len(&self) -> usize {
        match self {
            HostMem::Owned(b) => b.len(),
            HostMem::Pooled { len, .. } => *len,
        }
    }

    pub fn as_mut_ptr(&self) -> *mut u8 {
        match self {
            HostMem::Owned(b) => b.as_mut_ptr(),
            HostMem::Pooled { ptr, .. } => ptr.as_ptr(),
        }
    }

    pub fn f32s(&self, offset: usize, count: usize) -> &[f32] {
        assert!(offset.is_multiple_of(4) && offset + count * 4 <= self.len(), "f32 view inside the memory");
        // SAFETY: in bounds (checked), aligned (pool pieces are 256-aligned), zero-initialised.
        unsafe { std::slice::from_raw_parts(self.as_mut_ptr().add(offset) as *const f32, count) }
    }

    pub fn f32s_mut(&mut self, offset: usize, count: usize) -> &mut [f32] {
        assert!(offset.is_multiple_of(4) && offset + count * 4 <= self.len(), "f32 view inside the memory");
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr().add(offset) as *mut f32, count) }
    }

    /// `count` bytes at byte `offset`.
    pub fn bytes(&self, offset: usize, count: usize) -> &[u8] {
        assert!(
            offset.checked_add(count).is_some_and(|end| end <= self.len()),
            "byte view inside the memory"
        );
        // SAFETY: in bounds (checked), zero-initialised.
        unsafe { std::slice::from_raw_parts(self.as_mut_ptr().add(offset), count) }
    }

    pub fn bytes_mut(&mut self, offset: usize, count: usize) -> &mut [u8] {
        assert!(
            offset.checked_add(count).is_some_and(|end| end <= self.len()),
            "byte view inside the memory"
        );
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.as_mut_ptr().add(offset), count) }
    }
}
