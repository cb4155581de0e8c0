//! Convolutions and pooling on f16 and bf16 values, a group of images at a time: the f32
//! kernel of the op on `images` images (prepared for that batch), its half operands' images
//! widened into the kernel's buffer first and its output's images rounded as they are stored
//! (ties to even, as `Op::Cast`). Operands without a batch axis (a filter, a bias) are widened
//! once per run. A group holds as many images as keep each widened part within `GROUP_FLOATS`
//! (a whole small batch; one image of a large activation): one image at a time made the zoo
//! cnn's 64 input gradients of 16x16x64 take 20.5 ms against 5.2 widened (per-call costs and
//! threads idle on a small image).
//!
//! Every image of these ops' outputs is computed from the same image of their batched operands
//! alone, by the same arithmetic at any batch size (the f32 kernels split work by image and by
//! rows within an image, never summing across images), so the result is bitwise the op widened
//! (`kiln_compiler::widen`: f32 copies of the whole tensors), while the plan holds the half
//! values alone. The buffer (the thread's, `buffers`) holds a group of images of each widened operand and of a half
//! output, and the whole of each widened unbatched operand: 4 MiB a part at most, or one image
//! where an image is larger, outside the arena like the GEMM's packing buffers. The filter
//! gradient sums over images and is not computed here (`conv::backprop_filter` widens its own
//! tiles).

use super::cast::{narrow_slice, widen_slice};
use super::{CpuKernel, KernelError};
use kiln_compiler::ir::fused::{Inst, Ref};
use kiln_compiler::ir::{DType, Fused, Op, Shape};

/// One operand or the output of a `PerImage` kernel.
#[derive(Clone, Copy, Debug)]
struct Part {
    /// Its type where it is f16 or bf16 (widened or rounded), else `None` (read in place).
    half: Option<DType>,
    /// Elements per image (batched) or in all (unbatched).
    len: usize,
    /// Whether it has the batch axis (one image per output image).
    batched: bool,
    /// Its element size in bytes.
    size: usize,
}

/// Floats of one widened part of a group of images (4 MiB).
const GROUP_FLOATS: usize = 1 << 20;

/// The op's f32 kernel on groups of images (module doc).
pub(crate) struct PerImage {
    /// The kernel on a group of `group` images, and on the last group's (fewer) where the
    /// batch is not a multiple.
    inner: Box<dyn CpuKernel>,
    last: Option<(usize, Box<dyn CpuKernel>)>,
    group: usize,
    images: usize,
    operands: Vec<Part>,
    output: Part,
}

/// `shape` with its first axis `n`: `n` images of a batched `[N, ...]` tensor.
fn images_of(shape: &Shape, n: usize) -> Shape {
    let mut dims = shape.dims().to_vec();
    if let Some(d) = dims.first_mut() {
        *d = n;
    }
    Shape::from(dims.as_slice())
}

/// Which operands of `op` carry the batch axis of an output of `n` images: the image operands
/// of convolutions and pooling, and a fused convolution's epilogue operands of the output's
/// rank and batch (the others broadcast: a bias).
fn batched(op: &Op, operands: &[&Shape], out: &Shape) -> Vec<bool> {
    let n = out.dims().first().copied().unwrap_or(1);
    operands
        .iter()
        .enumerate()
        .map(|(i, s)| match op {
            Op::Conv2d { .. } | Op::Conv2dBackpropInput { .. } => i == 0,
            Op::Conv2dBackpropInputReluGrad { .. } => i != 1,
            Op::Pool2d { .. } | Op::Pool2dGrad { .. } | Op::AvgPool2dGrad { .. } => true,
            Op::Fused(_) => i == 0 || (i >= 2 && s.rank() == out.rank() && s.dims().first() == Some(&n)),
            _ => false,
        })
        .collect()
}

/// `op` on `n` images: the shapes it carries (a gradient's input shape, a fused program's
/// shape) with their batch axis `n`, computing f32.
fn op_on_images(op: &Op, n: usize) -> Op {
    match op {
        Op::Conv2dBackpropInput { window, input } => {
            Op::Conv2dBackpropInput { window: *window, input: images_of(input, n) }
        }
        Op::Conv2dBackpropInputReluGrad { window, input } => {
            Op::Conv2dBackpropInputReluGrad { window: *window, input: images_of(input, n) }
        }
        Op::AvgPool2dGrad { window, input } => {
            Op::AvgPool2dGrad { window: *window, input: images_of(input, n) }
        }
        Op::Fused(f) => {
            // The group kernel computes f32: a program that stores half ends with its value
            // rounded, then widened (exact), as `kiln_compiler::widen` makes it.
            let mut insts = f.insts.clone();
            if f.stored_dtype().is_some_and(DType::is_half) {
                insts.push(Inst::Cast(DType::F32, Ref::Value(insts.len() as u32 - 1)));
            }
            Op::Fused(Fused { shape: images_of(&f.shape, n), insts, ..f.clone() })
        }
        other => other.clone(),
    }
}

/// The kernel of `op` (a convolution other than the filter gradient, a fused convolution, or
/// pooling) on operands and an output of any float types, an image at a time.
pub(crate) fn per_image(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let half = |d: DType| d.is_half().then_some(d);
    let shapes: Vec<&Shape> = inputs.iter().map(|&(s, _)| s).collect();
    let batched = batched(op, &shapes, output.0);
    let images = output.0.dims().first().copied().unwrap_or(1).max(1);
    let one: Vec<Shape> =
        shapes.iter().zip(&batched).map(|(s, &b)| if b { images_of(s, 1) } else { (*s).clone() }).collect();
    let out_one = images_of(output.0, 1);
    // As many images as keep every batched part within GROUP_FLOATS.
    let widest =
        one.iter().zip(&batched).filter(|(_, b)| **b).map(|(s, _)| s.numel()).chain([out_one.numel()]);
    let group = (GROUP_FLOATS / widest.max().unwrap_or(1).max(1)).clamp(1, images);
    let kernel = |n: usize| -> Result<Box<dyn CpuKernel>, KernelError> {
        let shapes: Vec<Shape> = shapes
            .iter()
            .zip(&batched)
            .map(|(s, &b)| if b { images_of(s, n) } else { (*s).clone() })
            .collect();
        let f32s: Vec<(&Shape, DType)> = shapes.iter().map(|s| (s, DType::F32)).collect();
        super::prepare(&op_on_images(op, n), &f32s, (&images_of(output.0, n), DType::F32))
    };
    let inner = kernel(group)?;
    let last = match images % group {
        0 => None,
        r => Some((r, kernel(r)?)),
    };
    let part = |(s, d): (&Shape, DType), b: bool, one: &Shape| Part {
        half: half(d),
        len: if b { one.numel() } else { s.numel() },
        batched: b,
        size: d.size_bytes(),
    };
    let operands = inputs.iter().zip(&batched).zip(&one).map(|((&sd, &b), one)| part(sd, b, one)).collect();
    let output = part(output, true, &out_one);
    Ok(Box::new(PerImage { inner, last, group, images, operands, output }))
}

impl CpuKernel for PerImage {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: forwarded contract; the buffer is the thread's (`buffers`).
        super::buffers::with(|b| unsafe { self.run_in(inputs, output, &mut b.images) })
    }

    fn describe(&self) -> String {
        format!("{} ({} images at a time, half widened)", self.inner.describe(), self.group)
    }
}

impl PerImage {
    /// `run` with `buffer` for the widened parts.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn run_in(&self, inputs: &[*mut u8], output: *mut u8, buffer: &mut Vec<f32>) {
        // The buffer's parts: each widened operand's, then a half output's image.
        // A batched part holds a group of images; an unbatched one all of it.
        let room = |p: &Part| if p.batched { p.len * self.group } else { p.len };
        let mut at = Vec::with_capacity(self.operands.len());
        let mut next = 0;
        for p in &self.operands {
            at.push(next);
            next += if p.half.is_some() { room(p) } else { 0 };
        }
        let out_at = next;
        buffer.resize(out_at + self.output.half.map_or(0, |_| room(&self.output)), 0.0);
        // Unbatched half operands: widened once.
        for (i, p) in self.operands.iter().enumerate() {
            if let (Some(t), false) = (p.half, p.batched) {
                // SAFETY: the operand holds p.len elements of its type (run's contract).
                let src = unsafe { std::slice::from_raw_parts(inputs[i] as *const u16, p.len) };
                widen_slice(t, src, &mut buffer[at[i]..at[i] + p.len]);
            }
        }
        let mut ptrs = vec![std::ptr::null_mut::<u8>(); self.operands.len()];
        let mut n = 0;
        while n < self.images {
            let count = self.group.min(self.images - n);
            let kernel = match &self.last {
                Some((r, last)) if count == *r && count < self.group => last,
                _ => &self.inner,
            };
            for (i, p) in self.operands.iter().enumerate() {
                let first = if p.batched { n * p.len } else { 0 };
                ptrs[i] = match p.half {
                    Some(t) => {
                        if p.batched {
                            let len = count * p.len;
                            // SAFETY: images n..n + count of a batched operand: len elements
                            // from n * p.len.
                            let src = unsafe {
                                std::slice::from_raw_parts((inputs[i] as *const u16).add(first), len)
                            };
                            widen_slice(t, src, &mut buffer[at[i]..at[i] + len]);
                        }
                        buffer[at[i]..].as_mut_ptr() as *mut u8
                    }
                    // An f32 operand is read where it lies: images n.. of it, or all of it.
                    None => inputs[i].wrapping_add(first * p.size),
                };
            }
            let dst = match self.output.half {
                Some(_) => buffer[out_at..].as_mut_ptr() as *mut u8,
                None => output.wrapping_add(n * self.output.len * self.output.size),
            };
            // SAFETY: every pointer is the group's images (or the whole) of its tensor, f32:
            // widened copies in the buffer or the f32 tensors themselves, as the group kernel's
            // contract asks; an output written over an operand (`Op::may_write_over`) is the
            // same images of both, or the operand was widened before the kernel writes.
            unsafe { kernel.run(&ptrs, dst) };
            if let Some(t) = self.output.half {
                let len = count * self.output.len;
                // SAFETY: images n..n + count of the output, len elements of its half type.
                let out = unsafe {
                    std::slice::from_raw_parts_mut((output as *mut u16).add(n * self.output.len), len)
                };
                narrow_slice(t, &buffer[out_at..out_at + len], out);
            }
            n += count;
        }
    }
}
