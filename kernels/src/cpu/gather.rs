//! Embedding lookup (gather rows of a table by ids, i32, i64 or whole f32s) and its gradient
//! (scatter-add).
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
use kiln_compiler::ir::{DType, Shape};
use std::slice;

/// How the ids are stored.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Ids {
    F32,
    I32,
    I64,
}

impl Ids {
    /// The ids' dtype (the checks admit f32, i32 and i64 only: `ir::infer`).
    pub(crate) fn of(dtype: DType) -> Ids {
        match dtype {
            DType::I32 => Ids::I32,
            DType::I64 => Ids::I64,
            _ => Ids::F32,
        }
    }

    /// The row id `i` selects in a table of `vocab` rows, if it is valid.
    /// # Safety
    /// `p` is valid for `i + 1` ids of this type, aligned for it.
    #[inline(always)]
    unsafe fn row(self, p: *const u8, i: usize, vocab: usize) -> Option<usize> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Ids::F32 => row_of(*(p as *const f32).add(i), vocab),
                Ids::I32 => int_row(i64::from(*(p as *const i32).add(i)), vocab),
                Ids::I64 => int_row(*(p as *const i64).add(i), vocab),
            }
        }
    }

    /// The first invalid id among `count`, described.
    /// # Safety
    /// `p` is valid for `count` ids of this type, aligned for it.
    unsafe fn first_invalid(self, p: *const u8, count: usize, vocab: usize) -> Option<String> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Ids::F32 => {
                    first_invalid(p as *const f32, count, vocab).map(|(at, v)| invalid_id(at, v, vocab))
                }
                Ids::I32 => {
                    let ids = slice::from_raw_parts(p as *const i32, count);
                    ids.iter().position(|&v| int_row(i64::from(v), vocab).is_none()).map(|at| {
                        format!(
                            "id {} at position {at} is outside the table (valid ids: 0..{vocab})",
                            ids[at]
                        )
                    })
                }
                Ids::I64 => {
                    let ids = slice::from_raw_parts(p as *const i64, count);
                    ids.iter().position(|&v| int_row(v, vocab).is_none()).map(|at| {
                        format!(
                            "id {} at position {at} is outside the table (valid ids: 0..{vocab})",
                            ids[at]
                        )
                    })
                }
            }
        }
    }
}

#[inline(always)]
fn int_row(v: i64, vocab: usize) -> Option<usize> {
    (v >= 0 && (v as u64) < vocab as u64).then_some(v as usize)
}

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
    ids: Ids,
    vocab: usize,
    row: usize,
    count: usize,
    desc: String,
}

pub(crate) fn gather(table: &Shape, ids: &Shape, ids_dtype: DType) -> Box<dyn CpuKernel> {
    let row = table.dims()[1..].iter().product();
    let desc = format!("gather {} by {}{}", shape_text(table), id_note(ids_dtype), shape_text(ids));
    Box::new(Gather { ids: Ids::of(ids_dtype), vocab: table.dims()[0], row, count: ids.numel(), desc })
}

impl CpuKernel for Gather {
    fn checks_operands(&self) -> bool {
        true
    }

    unsafe fn check_operands(&self, inputs: &[*mut u8]) -> Result<(), String> {
        // SAFETY: operand 1 (the ids) holds `count` ids of the prepared type (the caller's contract).
        match unsafe { self.ids.first_invalid(inputs[1], self.count, self.vocab) } {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (table, ids) = (SendPtr::new(inputs[0] as *mut f32), SendPtr::new(inputs[1]));
        let o = SendPtr::new(output as *mut f32);
        let row = self.row;
        par_ranges(self.count, row, |s, e| {
            for i in s..e {
                // SAFETY: ids hold `count` values; output row i and table row r are in bounds;
                // tasks write disjoint output rows.
                unsafe {
                    let dst = slice::from_raw_parts_mut(o.get().add(i * row), row);
                    match self.ids.row(ids.get(), i, self.vocab) {
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
    ids: Ids,
    vocab: usize,
    row: usize,
    count: usize,
    desc: String,
}

pub(crate) fn gather_grad(ids: &Shape, ids_dtype: DType, vocab: usize, out: &Shape) -> Box<dyn CpuKernel> {
    let row = out.dims()[1..].iter().product();
    let desc = format!(
        "gather_grad[vocab {vocab}] {}{} -> {}",
        id_note(ids_dtype),
        shape_text(ids),
        shape_text(out)
    );
    Box::new(GatherGrad { ids: Ids::of(ids_dtype), vocab, row, count: ids.numel(), desc })
}

impl CpuKernel for GatherGrad {
    fn checks_operands(&self) -> bool {
        true
    }

    unsafe fn check_operands(&self, inputs: &[*mut u8]) -> Result<(), String> {
        // SAFETY: operand 0 (the ids) holds `count` ids of the prepared type (the caller's contract).
        match unsafe { self.ids.first_invalid(inputs[0], self.count, self.vocab) } {
            None => Ok(()),
            Some(why) => Err(why),
        }
    }

    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (ids, dy) = (SendPtr::new(inputs[0]), SendPtr::new(inputs[1] as *mut f32));
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
                    if let Some(r) = self.ids.row(ids.get(), i, self.vocab) {
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

/// The ids' dtype in a kernel's description: nothing for f32 ids (the descriptions of f32 plans
/// stay as they were), else the dtype before the shape.
pub(crate) fn id_note(dtype: DType) -> String {
    if dtype == DType::F32 { String::new() } else { dtype.to_string() }
}
