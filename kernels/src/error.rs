//! The kernels' one error type: what `cpu::prepare` says when it cannot build a kernel.

use kiln_compiler::ir::DType;
use thiserror::Error;

#[derive(Debug, Error, Clone, PartialEq)]
pub enum KernelError {
    /// No kernel exists for this op (sources and views are never run) or for this dtype.
    #[error("no kernel for `{op}` on {dtype}\n  help: {help}")]
    Unsupported { op: String, dtype: DType, help: String },

    /// The operand or output shapes disagree with the op's shape rules (`ir::infer`).
    #[error("`{op}`: {message}")]
    Shape { op: String, message: String },
}
