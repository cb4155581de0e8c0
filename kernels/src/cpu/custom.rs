//! A registered custom op's CPU kernel (`kiln_compiler::custom`): the user's function on f32
//! slices built from the step's pointers.

use super::{CpuKernel, shape_text};
use crate::KernelError;
use kiln_compiler::custom::{CustomOp, lookup};
use kiln_compiler::ir::Shape;
use std::sync::Arc;

struct Custom {
    def: Arc<dyn CustomOp>,
    shapes: Vec<Shape>,
    out: usize,
    out_shape: Shape,
    /// The scratch bytes the op declares (`CustomOp::scratch`): the step's planned scratch comes
    /// as a pointer after the operands; where none comes (the eager and reference executors
    /// allocate their own, a direct call may not) the kernel takes a buffer of its own.
    scratch: usize,
    desc: String,
    /// A panic of the user's kernel in the last run (`take_failure`).
    failure: std::sync::Mutex<Option<String>>,
}

pub(crate) fn custom(
    name: &str,
    operands: &[&Shape],
    out: &Shape,
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let def = lookup(name).ok_or_else(|| KernelError::Unsupported {
        op: format!("custom {name}"),
        dtype: kiln_compiler::ir::DType::F32,
        help: "register the custom op (kiln::compiler::custom::register) in this process before loading the plan".into(),
    })?;
    let list: Vec<String> = operands.iter().map(|s| shape_text(s)).collect();
    let scratch = def.scratch(operands, out);
    Ok(Box::new(Custom {
        def,
        shapes: operands.iter().map(|s| (*s).clone()).collect(),
        out: out.numel(),
        out_shape: out.clone(),
        scratch,
        desc: format!("custom {name} {} -> {}", list.join(", "), shape_text(out)),
        failure: std::sync::Mutex::new(None),
    }))
}

impl CpuKernel for Custom {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let shapes: Vec<&Shape> = self.shapes.iter().collect();
        // The step's scratch, when the caller passes it after the operands.
        let (inputs, planned) = inputs.split_at(inputs.len().min(self.shapes.len()));
        // The output overlaps an operand only when the op declared it may (`in_place`). A mutable
        // slice must not coexist with a shared one over the same memory, so the operands are
        // then copied (through their pointers, before any slice of the output exists).
        let in_place = inputs.iter().any(|&p| std::ptr::eq(p, output));
        let copies: Vec<Vec<f32>> = if in_place {
            inputs
                .iter()
                .zip(&self.shapes)
                // SAFETY: the caller's contract: operand i holds shapes[i].numel() f32s, 4-byte
                // aligned; no slice of the output exists yet.
                .map(|(&p, s)| unsafe { std::slice::from_raw_parts(p as *const f32, s.numel()) }.to_vec())
                .collect()
        } else {
            Vec::new()
        };
        let refs: Vec<&[f32]> = if in_place {
            copies.iter().map(Vec::as_slice).collect()
        } else {
            inputs
                .iter()
                .zip(&self.shapes)
                // SAFETY: as above; these operands do not overlap the output (not in place).
                .map(|(&p, s)| unsafe { std::slice::from_raw_parts(p as *const f32, s.numel()) })
                .collect()
        };
        // SAFETY: the output holds `out` f32s, 4-byte aligned, and no slice in `refs` refers to
        // it (copies when the op runs in place).
        let out = unsafe { std::slice::from_raw_parts_mut(output as *mut f32, self.out) };
        // The user's code may panic (an index past the output `infer` sized, say): caught and
        // reported as the step's error rather than unwinding through the executor.
        let mut own: Vec<u128> = Vec::new();
        let scratch: &mut [u8] = match planned.first() {
            // SAFETY: the caller's contract for a trailing pointer: the step's scratch buffer of
            // at least `self.scratch` bytes, 16-byte aligned (an arena slot), used by no operand.
            Some(&p) if self.scratch > 0 => unsafe { std::slice::from_raw_parts_mut(p, self.scratch) },
            _ => {
                own.resize(self.scratch.div_ceil(16), 0);
                &mut bytemuck::cast_slice_mut::<u128, u8>(&mut own)[..self.scratch]
            }
        };
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if self.scratch > 0 {
                self.def.cpu_with_scratch(&refs, &shapes, out, scratch)
            } else {
                self.def.cpu(&refs, &shapes, out)
            }
        }));
        if let Err(p) = run {
            let why = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic".into());
            *self.failure.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!(
                "custom op `{}`'s CPU kernel panicked ({why}); its shape function gave f32{} ({} elements): \
                 make the kernel write exactly the output `infer` describes",
                self.def.name(),
                self.out_shape,
                self.out
            ));
        }
    }

    fn take_failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
