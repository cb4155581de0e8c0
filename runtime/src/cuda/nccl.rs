//! NCCL: a data-parallel plan's collectives in device memory, queued on the backend's stream
//! between its kernels (`CudaBackend::with_nccl`), one rank per GPU.
//!
//! Why: staged through the host (`CudaBackend::with_communicator`), every collective waits for
//! the device, copies its buffer out and back and runs on the CPU's network stack; NCCL reads
//! and writes the arena where the planner put the buffer, over NVLink or the network, and the
//! stream orders it with the launches, so nothing waits on the host. The library is loaded at run
//! time (cudarc's dynamic loading, as the driver and NVRTC are): kiln builds and runs where it is
//! absent, and `with_nccl` says so instead of failing later. cudarc looks for it as `libnccl.so`
//! (not the runtime package's `libnccl.so.2`): a `libnccl.so` symlink on the loader's path does.
//!
//! kiln's shards are uneven (`Shard::range`: the first `n % ranks` ranks hold one element more),
//! which NCCL's reduce-scatter and all-gather (equal counts per rank) cannot express; so a
//! reduce-scatter is a group of `ncclReduce`s, one to each rank of its range, and an all-gather a
//! group of in-place `ncclBroadcast`s, one from each rank of its range: the same bytes on the
//! wire as the ring collectives, in one group call. A mean is NCCL's `ncclAvg`. NCCL's sums run
//! in its own order: its ranks agree with each other bit for bit, not with host-staged ranks.
//!
//! The bootstrap: rank 0 makes the group's id (`ncclGetUniqueId`), the host communicator
//! (in-process ranks or MPI) broadcasts its 128 bytes, every rank joins (`ncclCommInitRank`).
//!
//! Checked on one GPU: NCCL refuses two ranks on one device, so `tests/gpu.rs` runs one rank
//! through the same calls (an all-reduce, reduce-scatters and all-gathers) against a host-staged
//! rank; two ranks on two GPUs have not run.

use crate::error::{Result, RuntimeError};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys;
use kiln_comm::Communicator;
use std::ffi::c_void;

/// One rank's NCCL communicator.
pub struct Nccl {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the backend
// calls it only from `&mut self` runs (one at a time), and destroys it once, in `drop`.
unsafe impl Send for Nccl {}
// SAFETY: as above: no method is called concurrently (the backend's runs take `&mut self`).
unsafe impl Sync for Nccl {}

fn failed(what: &str) -> impl Fn(nccl::NcclError) -> RuntimeError + '_ {
    move |e| {
        RuntimeError::invalid(
            format!("NCCL {what} failed: {:?}", e.0),
            "every rank must run the same plan on its own GPU; NCCL_DEBUG=INFO says more",
        )
    }
}

/// The group id's 128 bytes as 32 f32 bit patterns, for a communicator that broadcasts floats
/// (copies, never arithmetic, so every bit pattern arrives as sent).
pub(crate) fn id_to_floats(id: &[std::ffi::c_char; 128]) -> Vec<f32> {
    id.chunks_exact(4)
        .map(|c| f32::from_bits(u32::from_le_bytes([c[0] as u8, c[1] as u8, c[2] as u8, c[3] as u8])))
        .collect()
}

/// The inverse of `id_to_floats`.
pub(crate) fn floats_to_id(floats: &[f32]) -> [std::ffi::c_char; 128] {
    let mut id = [0 as std::ffi::c_char; 128];
    for (c, f) in id.chunks_exact_mut(4).zip(floats) {
        for (b, v) in c.iter_mut().zip(f.to_bits().to_le_bytes()) {
            *b = v as std::ffi::c_char;
        }
    }
    id
}

impl Nccl {
    /// Whether the NCCL library can be loaded.
    pub fn available() -> bool {
        // SAFETY: only tries to load the library (libloading), calling nothing in it.
        unsafe { sys::is_culib_present() }
    }

    /// This rank joins the NCCL group of `host`'s ranks, on the device whose context is bound to
    /// the calling thread (`Driver::raw_stream` binds it). Every rank must call it.
    pub fn join(host: &mut dyn Communicator) -> Result<Nccl> {
        if !Self::available() {
            return Err(RuntimeError::invalid(
                "the NCCL library is not found (cudarc loads it as `libnccl.so`)",
                "install libnccl-dev (or put a `libnccl.so` symlink to the `nvidia-nccl-cu13` wheel's libnccl.so.2 in a directory on LD_LIBRARY_PATH), or stage the collectives through the host: CudaBackend::with_communicator",
            ));
        }
        let (rank, size) = (host.rank(), host.size());
        let mut floats = vec![0f32; 32];
        if rank == 0 {
            floats = id_to_floats(&nccl::get_uniqueid().map_err(failed("making the group id"))?.internal);
        }
        host.broadcast(&mut floats, 0).map_err(|e| {
            RuntimeError::invalid(
                format!("broadcasting the NCCL group id: {e}"),
                "every rank must call with_nccl",
            )
        })?;
        let id = sys::ncclUniqueId { internal: floats_to_id(&floats) };
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` is a place for the communicator; every rank passes the same id, its own
        // rank and the group's size.
        unsafe { nccl::comm_init_rank(&mut comm, size as i32, id, rank as i32) }
            .map_err(failed("joining the group"))?;
        Ok(Nccl { comm, rank, size })
    }

    /// This rank's number in the NCCL group, `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks (GPUs) the group has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// `n` floats at `send` reduced over the ranks into `recv` (a mean or a sum), queued on
    /// `stream`.
    ///
    /// # Safety
    /// `send` and `recv` address `n` floats of this device (equal, or disjoint), `stream` is its
    /// stream, with its context bound to this thread.
    pub unsafe fn all_reduce(&self, send: u64, recv: u64, n: usize, mean: bool, stream: usize) -> Result<()> {
        let op = if mean { sys::ncclRedOp_t::ncclAvg } else { sys::ncclRedOp_t::ncclSum };
        // SAFETY: per the contract.
        unsafe {
            nccl::all_reduce(
                send as *const c_void,
                recv as *mut c_void,
                n,
                sys::ncclDataType_t::ncclFloat32,
                op,
                self.comm,
                stream as sys::cudaStream_t,
            )
        }
        .map_err(failed("all-reduce"))?;
        Ok(())
    }

    /// Rank r's `ranges[r]` of the reduction of the `send` floats into rank r's `recv` (from its
    /// first element): one `ncclReduce` to each rank, in one group.
    ///
    /// # Safety
    /// `send` addresses floats up to the last range's end, `recv` this rank's range's length,
    /// disjoint from `send`; as `all_reduce` for the stream.
    pub unsafe fn reduce_scatter(
        &self,
        send: u64,
        recv: u64,
        ranges: &[std::ops::Range<usize>],
        mean: bool,
        stream: usize,
    ) -> Result<()> {
        let op = if mean { sys::ncclRedOp_t::ncclAvg } else { sys::ncclRedOp_t::ncclSum };
        Self::grouped("reduce-scatter", ranges, |root, r| {
            // SAFETY: per the contract; the root writes its range's length at `recv`.
            unsafe {
                nccl::reduce(
                    (send + 4 * r.start as u64) as *const c_void,
                    recv as *mut c_void,
                    r.len(),
                    sys::ncclDataType_t::ncclFloat32,
                    op,
                    root as i32,
                    self.comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }

    /// Every rank's `ranges[r]` of the `n` floats at `var` from rank r, in place: one
    /// `ncclBroadcast` from each rank, in one group.
    ///
    /// # Safety
    /// `var` addresses floats up to the last range's end; as `all_reduce` for the stream.
    pub unsafe fn all_gather(
        &self,
        var: u64,
        ranges: &[std::ops::Range<usize>],
        stream: usize,
    ) -> Result<()> {
        Self::grouped("all-gather", ranges, |root, r| {
            let at = var + 4 * r.start as u64;
            // SAFETY: per the contract; in place (send = receive buffer), as NCCL allows.
            unsafe {
                nccl::broadcast(
                    at as *const c_void,
                    at as *mut c_void,
                    r.len(),
                    sys::ncclDataType_t::ncclFloat32,
                    root as i32,
                    self.comm,
                    stream as sys::cudaStream_t,
                )
            }
        })
    }

    /// `call(root, range)` for each rank's non-empty range, in one NCCL group: ended even after
    /// a failed call, so that the communicator stays usable; the first failure is the result.
    fn grouped(
        what: &str,
        ranges: &[std::ops::Range<usize>],
        call: impl Fn(usize, &std::ops::Range<usize>) -> std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<()> {
        nccl::group_start().map_err(failed("starting a group"))?;
        let mut result = Ok(());
        for (root, r) in ranges.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
            let status = call(root, r);
            if result.is_ok() {
                result = status.map(|_| ()).map_err(failed(what));
            }
        }
        let end = nccl::group_end().map_err(failed("ending a group"));
        result.and(end.map(|_| ()))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by `join` and is destroyed once, here.
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_id_survives_its_trip_as_floats() {
        let mut id = [0 as std::ffi::c_char; 128];
        for (i, b) in id.iter_mut().enumerate() {
            // Every byte value, NaN and signalling-NaN float patterns among them.
            *b = (i as u8).wrapping_mul(37).wrapping_add(0x7f) as std::ffi::c_char;
        }
        id[0..4].copy_from_slice(&[0x01, 0x00, 0x80, 0x7f].map(|b: u8| b as std::ffi::c_char));
        let floats = id_to_floats(&id);
        assert_eq!(floats.len(), 32);
        assert!(floats[0].is_nan());
        // Through a copy, as a communicator's broadcast moves them.
        let copied: Vec<f32> = floats.to_vec();
        assert_eq!(floats_to_id(&copied), id);
    }
}
