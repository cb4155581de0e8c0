//! kiln-compiler: from a traced model to a memory `Plan`.
//!
//! The pipeline, top to bottom (`compile` below runs steps 3–7):
//! 1. `trace` — the Rust DSL records a model into an `ir::Graph`; `nn` builds layers on it.
//! 2. `step` — a training step appends the loss (`losses`), the backward graph (`autodiff`) and
//!    the optimizer's in-place updates (`optim`) to the same graph.
//! 3. `passes` — verification, CSE, dead-code elimination, output copies, effect ordering.
//! 4. `schedule` — one order of the steps.
//! 5. `liveness` — every buffer's lifetime, views and in-place reuse.
//! 6. `planner` — offsets in one arena, with the lower bound beside it.
//! 7. `lower` — the result as a `plan::Plan`: plain data that backends execute.
//! 8. `validate` — the plan is checked before anything runs.

pub mod autodiff;
pub mod error;
pub mod ir;
pub mod liveness;
pub mod losses;
pub mod lower;
pub mod nn;
pub mod optim;
pub mod passes;
pub mod plan;
pub mod planner;
pub mod schedule;
pub mod step;
pub mod trace;
pub mod validate;

pub use error::{CompileError, Result};
pub use plan::Plan;

use liveness::StorageClass;
use planner::Interval;

/// How a graph is compiled.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Every arena and io slot starts at a multiple of this many bytes.
    pub alignment: usize,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { alignment: 256 }
    }
}

/// A graph after the default passes, with its execution order: what the planner plans, and
/// what the eager executor runs op by op.
pub struct Scheduled {
    pub graph: ir::Graph,
    pub order: Vec<ir::NodeId>,
}

/// Runs the default passes and schedules the graph.
pub fn optimize(mut graph: ir::Graph) -> Result<Scheduled> {
    passes::default_pipeline().run(&mut graph)?;
    let order = schedule::schedule(&graph)?;
    Ok(Scheduled { graph, order })
}

/// Compiles a graph into a plan: passes, schedule, liveness, arena placement, lowering, validation.
pub fn compile(graph: ir::Graph, options: &CompileOptions) -> Result<Plan> {
    let Scheduled { graph, order } = optimize(graph)?;
    let live = liveness::analyze(&graph, &order)?;
    let (arena_buffers, intervals): (Vec<usize>, Vec<Interval>) = live
        .buffers
        .iter()
        .enumerate()
        .filter(|(_, b)| b.class == StorageClass::Arena)
        .map(|(i, b)| (i, Interval { bytes: b.bytes, start: b.start, end: b.end }))
        .unzip();
    let placement = planner::place(&intervals, options.alignment);
    let lowering = lower::Lowering {
        graph: &graph,
        live: &live,
        intervals: &intervals,
        arena_buffers: &arena_buffers,
        placement: &placement,
        alignment: options.alignment,
    };
    let plan = lowering.plan();
    validate::validate(&plan)
        .map_err(|e| CompileError::Internal(format!("plan {:?} failed validation: {e}", plan.name)))?;
    Ok(plan)
}
