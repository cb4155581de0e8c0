//! What both backends require of a step before they build its kernel: an op that has a kernel
//! (sources are filled by the runtime, a reshape is a view), f32 operands (f16 and bf16 too for
//! the ops whose kernels compute in half, `halves`), and shapes that agree with `ir::infer`.

use crate::KernelError;
use kiln_compiler::ir::{DType, Op, Shape, infer};
use kiln_compiler::widen::HalfKernels;

/// `who` names the backend in messages: "the CPU backend", "the CUDA kernels"; `halves` the
/// ops its kernels compute on f16 and bf16 values.
pub(crate) fn check(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
    who: &str,
    halves: HalfKernels,
) -> Result<(), KernelError> {
    if matches!(op, Op::Input { .. } | Op::Variable { .. } | Op::Reshape { .. }) {
        let help = if matches!(op, Op::Reshape { .. }) {
            "reshape is a view of its operand's buffer: the runtime aliases it and runs no kernel"
        } else {
            "sources are filled by the runtime (feeds and variable initialisation), not by a kernel"
        };
        return Err(KernelError::Unsupported { op: op.label(), dtype: output.1, help: help.into() });
    }
    // f32 everywhere, but for what moves other types: a cast's operand and result (any type)
    // and the ids of a gather or its gradient (f32, i32, i64).
    // Every type a cast converts between: mixed precision's half values are made and read
    // through casts on backends that compute in f32 (`kiln_compiler::widen`).
    let stored = |_: DType| true;
    let allowed = |i: Option<usize>, d: DType| match (op, i) {
        (Op::Cast { .. }, _) => stored(d),
        (Op::Gather, Some(1)) | (Op::GatherGrad { .. }, Some(0)) => {
            matches!(d, DType::F32 | DType::I32 | DType::I64)
        }
        // An update computing its weight gradient (`ir::Grad::Product`) from half factors: a
        // product's kernel reads them; the variable and its state are f32.
        (Op::ApplySgd { product: true, .. } | Op::ApplyAdam { product: true, .. }, Some(1 | 2))
            if halves.contains(HalfKernels::PRODUCTS) =>
        {
            d.is_float()
        }
        _ if halves.computes(op) => d.is_float(),
        _ => d == DType::F32,
    };
    let dtypes = inputs.iter().enumerate().map(|(i, &(_, d))| (Some(i), d)).chain([(None, output.1)]);
    if let Some((_, d)) = dtypes.into_iter().find(|&(i, d)| !allowed(i, d)) {
        return Err(KernelError::Unsupported {
            op: op.label(),
            dtype: d,
            help: format!(
                "{who} compute in f32 (half, i32, i64 and bool values are cast, ids index, nothing else; {halves} ops read and write f16 and bf16 too); declare the model's inputs and variables as f32 or cast them, and compile a mixed-precision plan for this backend (`CompileOptions::with_half_kernels(backend.half_kernels())`, as `Trainer` does)"
            ),
        });
    }
    let operands = || inputs.iter().map(|(s, _)| s.to_string()).collect::<Vec<_>>().join(", ");
    let (shape, dtype) = infer(op, inputs).map_err(|e| KernelError::Shape {
        op: op.label(),
        message: format!("{} (operands {})\n  help: {}", e.message, operands(), e.help),
    })?;
    // Kernels size their elements by the declared output type: it must be the inferred one.
    if dtype != output.1 {
        return Err(KernelError::Shape {
            op: op.label(),
            message: format!(
                "the output is declared {} but the operands ({}) give {dtype}",
                output.1,
                inputs.iter().map(|(s, d)| format!("{d}{s}")).collect::<Vec<_>>().join(", ")
            ),
        });
    }
    if &shape != output.0 {
        return Err(KernelError::Shape {
            op: op.label(),
            message: format!(
                "the output is declared as {} but the operands {} give {shape}",
                output.0,
                operands()
            ),
        });
    }
    Ok(())
}

/// How a kernel treats empty tensors, decided once for both backends: `Nothing` when the op
/// writes no element (nothing runs), `Fill(v)` when an operand is empty but the output is not
/// (a reduction over no elements, a product over an empty inner axis, padding of nothing: every
/// output element is `v`, the value over no elements), `Compute` otherwise. Deciding it here
/// keeps the kernels from ever forming strides or block sizes from a shape with a zero in it
/// (which may hold huge dims whose product overflows).
pub(crate) enum Empty {
    Compute,
    Nothing,
    Fill(f32),
}

pub(crate) fn empty_case(op: &Op, inputs: &[&Shape], output: &Shape) -> Empty {
    let written = if op.is_effect() { inputs.first().map_or(0, |s| s.numel()) } else { output.numel() };
    if written == 0 {
        return Empty::Nothing;
    }
    // Concat skips empty pieces itself; gather must still check its ids against an empty table.
    if matches!(op, Op::Concat { .. } | Op::Gather) || inputs.iter().all(|s| s.numel() > 0) {
        return Empty::Compute;
    }
    // A fused reduction's value over no elements is its reduction's.
    let reduce = match op {
        Op::Reduce { op, .. } => Some(*op),
        Op::Fused(f) => f.reduce.as_ref().map(|r| r.op),
        _ => None,
    };
    Empty::Fill(match reduce {
        Some(kiln_compiler::ir::ReduceOp::Mean) => f32::NAN,
        Some(kiln_compiler::ir::ReduceOp::Max) => f32::NEG_INFINITY,
        _ => 0.0,
    })
}
