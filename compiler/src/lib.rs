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
//! 8. `validate`, `limits` — the plan is checked before anything runs: its invariants, and that
//!    it fits every device's memory limit.

pub mod autodiff;
pub mod device;
pub mod error;
pub mod ir;
pub mod limits;
pub mod liveness;
pub mod losses;
pub mod lower;
pub mod nn;
pub mod optim;
pub mod passes;
pub mod placement;
pub mod plan;
pub mod planner;
pub mod schedule;
pub mod step;
pub mod trace;
pub mod validate;

pub use device::DeviceSpec;
pub use error::{CompileError, Result};
pub use plan::Plan;

use liveness::StorageClass;
use lower::DeviceArena;
use planner::Interval;

/// How a graph is compiled.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Every arena and io slot starts at a multiple of this many bytes.
    pub alignment: usize,
    /// The devices ops may be placed on (`Tracer::on_device`), with their memory limits.
    pub devices: Vec<DeviceSpec>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { alignment: 256, devices: vec![DeviceSpec::new(0, "device 0")] }
    }
}

impl CompileOptions {
    /// One device with a name and an optional memory limit.
    pub fn device(name: &str, memory_limit: Option<usize>) -> Self {
        CompileOptions {
            devices: vec![DeviceSpec { id: ir::DeviceId(0), name: name.into(), memory_limit }],
            ..Default::default()
        }
    }

    pub fn with_devices(mut self, devices: Vec<DeviceSpec>) -> Self {
        self.devices = devices;
        self
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
    let devices = devices_used(&graph, options)?;
    let live = liveness::analyze(&graph, &order)?;
    let arenas: Vec<DeviceArena> = devices
        .into_iter()
        .map(|spec| {
            let (buffers, intervals): (Vec<usize>, Vec<Interval>) = live
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, b)| b.class == StorageClass::Arena && b.device == spec.id)
                .map(|(i, b)| (i, Interval { bytes: b.bytes, start: b.start, end: b.end }))
                .unzip();
            let placement = planner::place(&intervals, options.alignment);
            DeviceArena { spec, buffers, intervals, placement }
        })
        .collect();
    let plan =
        lower::Lowering { graph: &graph, live: &live, arenas: &arenas, alignment: options.alignment }.plan();
    validate::validate(&plan)
        .map_err(|e| CompileError::Internal(format!("plan {:?} failed validation: {e}", plan.name)))?;
    limits::check(&plan).map_err(CompileError::OutOfMemory)?;
    Ok(plan)
}

/// The configured devices that the graph's ops use, in configuration order; an op placed on a
/// device that is not configured is an error naming it.
fn devices_used(graph: &ir::Graph, options: &CompileOptions) -> Result<Vec<DeviceSpec>> {
    let used: std::collections::BTreeSet<u32> = graph.node_ids().map(|n| graph.node(n).device.0).collect();
    if let Some(&missing) = used.iter().find(|&&d| !options.devices.iter().any(|s| s.id.0 == d)) {
        let node = graph.node_ids().find(|&n| graph.node(n).device.0 == missing).map(|n| graph.node(n));
        let (what, at) = node.map_or((String::new(), String::new()), |n| {
            (n.describe(), n.origin.map(|o| format!(" at {o}")).unwrap_or_default())
        });
        let names: Vec<&str> = options.devices.iter().map(|d| d.name.as_str()).collect();
        return Err(CompileError::invalid(
            format!("{what}{at} is placed on device {missing}, which is not configured (devices: {names:?})"),
            "compile with CompileOptions listing that device, or place the op on a configured one",
        ));
    }
    Ok(options.devices.iter().filter(|s| used.contains(&s.id.0)).cloned().collect())
}
