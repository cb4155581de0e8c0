//! Embedding lookup (gather rows of a table by ids held as f32) and its gradient (scatter-add).
//!
//! An id is valid when it is a whole number with 0 <= id < V. On the CPU an invalid id (out of
//! range, fractional, NaN) is an error before the kernel runs (`check_operands`: the executor
//! names the step, the ids' operand and the first bad id), as TensorFlow's CPU gather raises.
//! The CUDA kernels cannot stop a launch: there an invalid id gathers a zero row and contributes
//! nothing to the gradient (TensorFlow's GPU behaviour); the `run` below does the same, so that a
//! caller who skips the check still never reads outside the table. The gradient adds rows in id
//! order, split across threads by column blocks, so each element is summed in one fixed order.

use super::par::{SendPtr, par_chunks, par_ranges};
use super::{CpuKernel, shape_text};
use kiln_compiler::ir::Shape;
use std::slice;

/// Columns of the gradient's rows handled by one task.
const COLUMNS: usize = 64;

/// The first invalid id among `count` ids: (position, value).
/// # Safety
/// `ids` is valid for `count` f32s.
unsafe fn first_invalid(ids: *const f32, count: usize, vocab: usize) -> Option<(usize, f32)> {
    // SAFETY: the caller's contract.
    let ids = unsafe { slice::from_raw_parts(ids, count) };
    ids.iter().position(|&v| v.fract() != 0.0 || row_of(v, vocab).is_none()).map(|i| (i, ids[i]))
}

fn invalid_id(at: usize, v: f32, vocab: usize) -> String {
    let why = if v.fract() != 0.0 || v.is_nan() { "is not a whole number" } else { "is outside the table" };
    format!("id {v} at position {at} {why} (valid ids: 0..{vocab})")
}

/// The row index of id value `v`, if it is inside a table of `vocab` rows.
#[inline(always)]
fn row_of(v: f32, vocab: usize) -> Option<usize> {
    (v >= 0.0 && v < vocab as f32).then(|| (v as usize).min(vocab - 1))
}

struct Gather {
    vocab: usize,
    row: usize,
    count: usize,
    desc: String,
}

pub(crate) fn gather(table: &Shape, ids: &Shape) -> Box<dyn CpuKernel> {
    let row = table.dims()[1..].iter().product();
    let desc = format!("gather {} by {}", shape_text(table), shape_text(ids));
    Box::new(Gather { vocab: table.dims()[0], row, count: ids.numel(), desc })
}

impl CpuKernel for Gather {
    fn checks_operands(&self) -> bool {
        true
    }

    unsafe fn check_operands(&self, inputs: &[*mut u8]) -> Result<(), String> {
        // SAFETY: operand 1 (the ids) holds `count` f32s (the caller's contract).
        match unsafe { first_invalid(inputs[1] as *const f32, self.count, self.vocab) } {
            None => Ok(()),
            Some((at, v)) => Err(invalid_id(at, v, self.vocab)),
        }
    }

    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (table, ids) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
        let o = SendPtr::new(output as *mut f32);
        let row = self.row;
        par_ranges(self.count, row, |s, e| {
            for i in s..e {
                // SAFETY: ids hold `count` values; output row i and table row r are in bounds;
                // tasks write disjoint output rows.
                unsafe {
                    let dst = slice::from_raw_parts_mut(o.get().add(i * row), row);
                    match row_of(*ids.get().add(i), self.vocab) {
                        Some(r) => dst.copy_from_slice(slice::from_raw_parts(table.get().add(r * row), row)),
                        None => dst.fill(0.0),
                    }
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

struct GatherGrad {
    vocab: usize,
    row: usize,
    count: usize,
    desc: String,
}

pub(crate) fn gather_grad(ids: &Shape, vocab: usize, out: &Shape) -> Box<dyn CpuKernel> {
    let row = out.dims()[1..].iter().product();
    let desc = format!("gather_grad[vocab {vocab}] {} -> {}", shape_text(ids), shape_text(out));
    Box::new(GatherGrad { vocab, row, count: ids.numel(), desc })
}

impl CpuKernel for GatherGrad {
    fn checks_operands(&self) -> bool {
        true
    }

    unsafe fn check_operands(&self, inputs: &[*mut u8]) -> Result<(), String> {
        // SAFETY: operand 0 (the ids) holds `count` f32s (the caller's contract).
        match unsafe { first_invalid(inputs[0] as *const f32, self.count, self.vocab) } {
            None => Ok(()),
            Some((at, v)) => Err(invalid_id(at, v, self.vocab)),
        }
    }

    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (ids, dy) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1] as *mut f32));
        let o = SendPtr::new(output as *mut f32);
        let row = self.row;
        let work = (self.count + self.vocab) * row;
        par_chunks(row, COLUMNS, work, |c0, c1| {
            let w = c1 - c0;
            // SAFETY: columns c0..c1 of every row of the output belong to this task; dy rows
            // and ids are in bounds.
            unsafe {
                for v in 0..self.vocab {
                    slice::from_raw_parts_mut(o.get().add(v * row + c0), w).fill(0.0);
                }
                for i in 0..self.count {
                    if let Some(r) = row_of(*ids.get().add(i), self.vocab) {
                        let src = slice::from_raw_parts(dy.get().add(i * row + c0), w);
                        let dst = slice::from_raw_parts_mut(o.get().add(r * row + c0), w);
                        dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
                    }
                }
            }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
