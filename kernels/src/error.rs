//! The kernels' one error type: what `cpu::prepare` says when it cannot build a kernel.

use kiln_compiler::ir::DType;
use thiserror::Error;

/// Why no kernel could be prepared for an op: `cpu::prepare` and the CUDA source generators
/// (`cuda::generate`) return it when a backend loads a plan (before any step runs) or when the
/// eager executor first runs the op.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    /// No kernel exists for this op (sources and views are never run) or for this dtype.
    #[error("no kernel for `{op}` on {dtype}\n  help: {help}")]
    Unsupported {
        /// The op, by its name or its label (name plus attributes, as `Op::label` writes it).
        op: String,
        /// The dtype of the op's output (`f32` for a custom op).
        dtype: DType,
        /// What to do instead (e.g. register the custom op, or run the op on the other backend).
        help: String,
    },

    /// The operand or output shapes disagree with the op's shape rules (`ir::infer`).
    #[error("`{op}`: {message}")]
    Shape {
        /// The op's label: its name plus attributes, as `Op::label` writes it (`fused[...]` with
        /// the program's text for a fused elementwise program).
        op: String,
        /// What disagrees: the declared and inferred shapes with the operands' shapes and a help
        /// line, or the limit of the CPU kernel that a fused program exceeds.
        message: String,
    },
}
