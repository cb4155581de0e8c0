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
//!
//! Half values: a gather of an f16 or bf16 table moves its rows' bits (2-byte elements); the
//! gradient widens half rows of dy as it adds them, and a half gradient is summed in an f32
//! block of the task's columns (vocab x 64 floats) and rounded once, as the op widened is.

use super::cast::{narrow_slice, widen_slice};
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
    /// The table's (and output's) element size: 4 (f32) or 2 (f16, bf16).
    size: usize,
    desc: String,
}

/// The gather of `table` (of `dtype`: f32, f16 or bf16) by `ids`.
pub(crate) fn gather(table: &Shape, ids: &Shape, ids_dtype: DType, dtype: DType) -> Box<dyn CpuKernel> {
    let row = table.dims()[1..].iter().product();
    let desc = format!("gather {} by {}{}", shape_text(table), id_note(ids_dtype), shape_text(ids));
    let (ids, vocab, count, size) = (Ids::of(ids_dtype), table.dims()[0], ids.numel(), dtype.size_bytes());
    Box::new(Gather { ids, vocab, row, count, size, desc })
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
        let (table, ids) = (SendPtr::new(inputs[0]), SendPtr::new(inputs[1]));
        let o = SendPtr::new(output);
        // Rows as bytes: the bits of either type, an invalid id's row all zero bits (+0.0).
        let bytes = self.row * self.size;
        par_ranges(self.count, self.row, |s, e| {
            for i in s..e {
                // SAFETY: ids hold `count` values; output row i and table row r are in bounds;
                // tasks write disjoint output rows.
                unsafe {
                    let dst = slice::from_raw_parts_mut(o.get().add(i * bytes), bytes);
                    match self.ids.row(ids.get(), i, self.vocab) {
                        Some(r) => {
                            dst.copy_from_slice(slice::from_raw_parts(table.get().add(r * bytes), bytes))
                        }
                        None => dst.fill(0),
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
    /// The types of dy and of the gradient where they are f16 or bf16.
    half: [Option<DType>; 2],
    desc: String,
}

/// The gradient of a gather of a `vocab`-row table by `ids`: dy of type `types[0]` summed into
/// an output of `out`'s shape and type `types[1]` (f32, f16 or bf16).
pub(crate) fn gather_grad(
    ids: &Shape,
    ids_dtype: DType,
    vocab: usize,
    out: &Shape,
    types: [DType; 2],
) -> Box<dyn CpuKernel> {
    let half = types.map(|d| d.is_half().then_some(d));
    let row = out.dims()[1..].iter().product();
    let desc = format!(
        "gather_grad[vocab {vocab}] {}{} -> {}",
        id_note(ids_dtype),
        shape_text(ids),
        shape_text(out)
    );
    Box::new(GatherGrad { ids: Ids::of(ids_dtype), vocab, row, count: ids.numel(), half, desc })
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
        if self.half != [None, None] {
            // SAFETY: forwarded contract.
            return unsafe { self.run_widened(inputs, output) };
        }
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

impl GatherGrad {
    /// `run` with a half dy or gradient: the same sums in the same order, each dy segment
    /// widened as it is added, a half gradient's columns summed in the thread's f32 block and
    /// rounded once.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn run_widened(&self, inputs: &[*mut u8], output: *mut u8) {
        let (ids, dy, o) = (SendPtr::new(inputs[0]), SendPtr::new(inputs[1]), SendPtr::new(output));
        let [tdy, tout] = self.half;
        let row = self.row;
        let work = (self.count + self.vocab) * row;
        par_chunks(row, COLUMNS, work, |c0, c1| {
            let w = c1 - c0;
            super::buffers::with(|bufs| {
                let (segment, block) = (&mut bufs.gradients, &mut bufs.sums);
                segment.resize(w, 0.0);
                // The gradient's columns c0..c1 of every row: the output itself (f32, row
                // stride `row`) or the block (row stride w).
                let (sums, stride) = match tout {
                    Some(_) => {
                        block.clear();
                        block.resize(self.vocab * w, 0.0);
                        (block.as_mut_ptr(), w)
                    }
                    None => {
                        // SAFETY: columns c0..c1 of every output row are this task's.
                        let o = unsafe { (o.get() as *mut f32).add(c0) };
                        for v in 0..self.vocab {
                            unsafe { slice::from_raw_parts_mut(o.add(v * row), w).fill(0.0) };
                        }
                        (o, row)
                    }
                };
                for i in 0..self.count {
                    // SAFETY: ids hold `count` values; dy row i's columns c0..c1 are in bounds.
                    let Some(r) = (unsafe { self.ids.row(ids.get(), i, self.vocab) }) else { continue };
                    let src: &[f32] = match tdy {
                        Some(t) => {
                            let bits = unsafe {
                                slice::from_raw_parts((dy.get() as *const u16).add(i * row + c0), w)
                            };
                            widen_slice(t, bits, segment);
                            segment
                        }
                        None => unsafe {
                            slice::from_raw_parts((dy.get() as *const f32).add(i * row + c0), w)
                        },
                    };
                    // SAFETY: row r of the sums, this task's columns.
                    let dst = unsafe { slice::from_raw_parts_mut(sums.add(r * stride), w) };
                    dst.iter_mut().zip(src).for_each(|(d, &s)| *d += s);
                }
                if let Some(t) = tout {
                    for v in 0..self.vocab {
                        // SAFETY: columns c0..c1 of output row v, this task's.
                        let out =
                            unsafe { slice::from_raw_parts_mut((o.get() as *mut u16).add(v * row + c0), w) };
                        narrow_slice(t, &block[v * w..(v + 1) * w], out);
                    }
                }
            });
        });
    }
}

/// The ids' dtype in a kernel's description: nothing for f32 ids (the descriptions of f32 plans
/// stay as they were), else the dtype before the shape.
pub(crate) fn id_note(dtype: DType) -> String {
    if dtype == DType::F32 { String::new() } else { dtype.to_string() }
}
