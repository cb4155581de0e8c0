//! Where the eager executor runs: something that can write and read tensors at block addresses
//! and run one op's kernel on them.

use crate::error::{Result, RuntimeError};
use kiln_compiler::ir::{DType, Op, Shape};
use kiln_kernels::cpu;

/// A device the eager executor runs ops on, addressed by the blocks its allocator hands out:
/// the CPU ([`CpuEager`]) or a CUDA device (`CudaEager`).
pub trait EagerDevice {
    /// The device's name for reports and errors (e.g. `cpu`, `cuda:0`).
    fn name(&self) -> String;
    /// Writes `bytes` at `addr` (a live block of at least that many bytes).
    fn write_bytes(&mut self, addr: u64, bytes: &[u8]) -> Result<()>;
    /// Reads `n` bytes at `addr` (a live block of at least that many bytes).
    fn read_bytes(&mut self, addr: u64, n: usize) -> Result<Vec<u8>>;
    /// Writes the f32 values `data` at `addr` (a live block of at least `4 * data.len()` bytes).
    fn write(&mut self, addr: u64, data: &[f32]) -> Result<()> {
        self.write_bytes(addr, bytemuck::cast_slice(data))
    }
    /// Reads `n` f32 values at `addr` (a live block of at least `4 * n` bytes).
    fn read(&mut self, addr: u64, n: usize) -> Result<Vec<f32>> {
        let bytes = self.read_bytes(addr, n * 4)?;
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    /// The scratch bytes this device's kernel of `op` cannot run without (0 by default); the
    /// executor takes them from its allocator around the op, as a custom op's declared scratch.
    fn required_scratch(&self, _op: &Op, _types: &[(&Shape, DType)], _output: &Shape) -> usize {
        0
    }
    /// Runs `op` on operands at `inputs` writing its output at `output` (0 for effects). A
    /// kernel with scratch (a custom op's declared scratch, or `required_scratch`) finds it
    /// after its operands in `inputs`.
    fn run_op(
        &mut self,
        op: &Op,
        types: &[(&Shape, DType)],
        out_type: (&Shape, DType),
        inputs: &[u64],
        output: u64,
    ) -> Result<()>;
    /// Waits for queued work (a no-op on the CPU).
    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}

/// The CPU: addresses are host pointers (the allocator's regions come from a `HostSource`).
pub struct CpuEager;

impl EagerDevice for CpuEager {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn write_bytes(&mut self, addr: u64, bytes: &[u8]) -> Result<()> {
        // An empty tensor's block may be no memory at all (address 0): nothing to copy.
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: `addr` is a live host block of at least bytes.len() bytes (HostSource memory),
        // non-null since the allocator hands out real blocks for non-empty tensors.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as usize as *mut u8, bytes.len()) };
        Ok(())
    }

    fn read_bytes(&mut self, addr: u64, n: usize) -> Result<Vec<u8>> {
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: as in `write_bytes`.
        Ok(unsafe { std::slice::from_raw_parts(addr as usize as *const u8, n) }.to_vec())
    }

    fn run_op(
        &mut self,
        op: &Op,
        types: &[(&Shape, DType)],
        out_type: (&Shape, DType),
        inputs: &[u64],
        output: u64,
    ) -> Result<()> {
        let kernel = cpu::prepare(op, types, out_type)?;
        let ptrs: Vec<*mut u8> = inputs.iter().map(|&a| a as usize as *mut u8).collect();
        if kernel.checks_operands() {
            // SAFETY: as for `run` below.
            unsafe { kernel.check_operands(&ptrs) }.map_err(|e| {
                RuntimeError::invalid(
                    format!("eager `{}`: {e}", op.name()),
                    "feed ids that are whole numbers inside the table",
                )
            })?;
        }
        // SAFETY: every block is live host memory of its value's size; blocks of live values do
        // not overlap (the allocator hands out disjoint blocks).
        unsafe { kernel.run(&ptrs, output as usize as *mut u8) };
        match kernel.take_failure() {
            Some(why) => Err(RuntimeError::invalid(format!("eager `{}`: {why}", op.name()), "")),
            None => Ok(()),
        }
    }
}

/// No device: the allocations are replayed (same sizes, same order, same lifetimes) but nothing
/// is computed; reads return zeros.
pub struct Simulated;

impl EagerDevice for Simulated {
    fn name(&self) -> String {
        "simulated".into()
    }

    fn write_bytes(&mut self, _addr: u64, _bytes: &[u8]) -> Result<()> {
        Ok(())
    }

    fn read_bytes(&mut self, _addr: u64, n: usize) -> Result<Vec<u8>> {
        Ok(vec![0; n])
    }

    fn run_op(&mut self, _: &Op, _: &[(&Shape, DType)], _: (&Shape, DType), _: &[u64], _: u64) -> Result<()> {
        Ok(())
    }
}
