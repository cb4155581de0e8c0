//! kiln-compiler: from a traced model to a memory `Plan`.
//!
//! The pipeline, top to bottom:
//! 1. `trace` — the Rust DSL records a model into an `ir::Graph`; `nn` builds layers on it.
//! 2. `losses`, `autodiff`, `optim` — a training step appends the loss, the backward graph and the
//!    optimizer's in-place updates to the same graph.
//! 3. `passes` — verification, dead-code elimination, output copies, effect ordering.
//! 4. `schedule` — one order of the steps.
//! 5. `liveness` — every buffer's lifetime, views and in-place reuse.
//! 6. `planner` — offsets in one arena, with the lower bound beside it.
//! 7. `plan` — the result as plain data that backends execute.

pub mod error;
pub mod ir;
pub mod trace;

pub use error::{CompileError, Result};
pub mod planner;
