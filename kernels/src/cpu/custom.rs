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
    desc: String,
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
    Ok(Box::new(Custom {
        def,
        shapes: operands.iter().map(|s| (*s).clone()).collect(),
        out: out.numel(),
        desc: format!("custom {name} {} -> {}", list.join(", "), shape_text(out)),
    }))
}

impl CpuKernel for Custom {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: the caller's contract: operand i holds shapes[i].numel() f32s, the output
        // `out` f32s, 4-byte aligned. The output overlaps an operand only when the op declared
        // it may (`in_place`); a mutable slice must not alias a shared one, so the user's
        // function then gets copies of the operands (below).
        let ins: Vec<&[f32]> = inputs
            .iter()
            .zip(&self.shapes)
            .map(|(&p, s)| unsafe { std::slice::from_raw_parts(p as *const f32, s.numel()) })
            .collect();
        let shapes: Vec<&Shape> = self.shapes.iter().collect();
        if ins.iter().any(|s| std::ptr::eq(s.as_ptr(), output as *const f32)) {
            // In place: the user's function gets a copy of the operands and writes the output.
            let copies: Vec<Vec<f32>> = ins.iter().map(|s| s.to_vec()).collect();
            let refs: Vec<&[f32]> = copies.iter().map(Vec::as_slice).collect();
            // SAFETY: the output holds `out` f32s and no other slice now refers to it.
            let out = unsafe { std::slice::from_raw_parts_mut(output as *mut f32, self.out) };
            self.def.cpu(&refs, &shapes, out);
            return;
        }
        // SAFETY: the output holds `out` f32s and overlaps no operand (checked above).
        let out = unsafe { std::slice::from_raw_parts_mut(output as *mut f32, self.out) };
        self.def.cpu(&ins, &shapes, out);
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}
