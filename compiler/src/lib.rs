//! kiln-compiler: from a traced model to a memory `Plan`.
//!
//! The pipeline, top to bottom (`compile` below runs steps 3–7):
//! 1. `trace` — the Rust DSL records a model into an `ir::Graph`; `nn` builds layers on it.
//! 2. `step` — composed attention and GELU become one op each (`attention_rewrite`,
//!    `activation_rewrite`); a training step appends the loss (`losses`), the backward graph
//!    (`autodiff`) and the optimizer's in-place updates (`optim`) to the same graph.
//! 3. `rewrites` — the graph rewrites as `passes::Pass`es in `passes::Pipeline`s, each saying
//!    what it changed and the pipeline recording it (`plan::RewriteFigures`): `passes` —
//!    verification, CSE, dead-code elimination, output copies, effect ordering, the cleanup
//!    after every rewrite that changed the graph —; then, to a fixed point,
//!    `const_fold` — values computed from constants alone are computed here, once —,
//!    `pad_sums` — a sum of zero-padded slice gradients becomes one concatenation —,
//!    `transpose_operands` — a transpose feeding a product becomes its operand flag,
//!    read in place —; then `saved_values` — a training step keeps, of the forward values its backward
//!    pass reads, what a minimum cut chooses, and recomputes the rest —,
//!    and for each graph the search plans, `product_updates` — an update computes its own
//!    weight gradient, never stored —, `log_softmax_split` — a log-softmax's readers recompute it from the logits and two values
//!    per row — and `fusion` — elementwise chains become one fused op each (plans only: eager
//!    stays unfused); a graph without effects is also planned in blocks of batch rows
//!    (`batch_blocks`: each block's intermediates die before the next), kept where smaller.
//! 4. `schedule` — candidate orders of the steps; every one is planned (steps 5–7) and the
//!    smallest plan kept, for the graph as it is and with its weight-gradient updates tiled
//!    (`tiled_updates`: each gradient made and applied a block of rows at a time).
//! 5. `liveness` — every buffer's lifetime, views and in-place reuse, and each step's scratch
//!    (`scratch`: what the backend's kernel for it asks for, live at that step alone).
//! 6. `planner` — offsets in one arena, with the lower bound beside it.
//! 7. `lower` — the result as a `plan::Plan`: plain data that backends execute.
//! 8. `validate`, `limits` — the plan is checked before anything runs: its invariants, and that
//!    it fits every device's memory limit; a training step that does not is rematerialized
//!    (`remat`: values recomputed instead of kept, steps 4–8 again) before it is refused.
#![warn(missing_docs)]

pub mod activation_rewrite;
pub mod attention_rewrite;
pub mod autodiff;
pub mod batch_blocks;
pub mod cheap_remat;
pub mod const_fold;
pub mod conv_relu_grad;
pub mod custom;
pub mod data_parallel;
pub mod device;
pub mod error;
pub mod fusion;
pub mod guard;
pub mod ir;
pub mod limits;
pub mod liveness;
pub mod log_softmax_split;
pub mod losses;
pub mod lower;
pub mod nn;
pub mod optim;
pub mod pad_sums;
pub mod passes;
pub mod placement;
pub mod plan;
pub mod planner;
pub mod pool_relu_grad;
pub mod product_updates;
pub mod remat;
pub mod rewrites;
pub mod saved_values;
pub mod schedule;
pub mod scratch;
pub mod step;
pub mod tiled_updates;
pub mod trace;
pub mod transpose_operands;
pub mod validate;
pub mod zero;

pub use device::DeviceSpec;
pub use error::{CompileError, Result};
pub use plan::Plan;

use lower::DeviceArena;
use passes::PassLog;
use planner::Interval;

/// How a graph is compiled.
#[derive(Clone, Debug)]
pub struct CompileOptions {
    /// Every arena and io slot starts at a multiple of this many bytes: 64 by default, a cache
    /// line and an AVX-512 vector, four times what the CUDA kernels' float4 accesses need, and
    /// the alignment XLA:CPU gives the slices of its temporary buffer (`xla::cpu::Align()`), so
    /// that the two buffer assignments are counted at one granularity. A coarser alignment wastes
    /// up to that many bytes less one per slot, which tiny models feel most.
    pub alignment: usize,
    /// The devices ops may be placed on (`Tracer::on_device`), with their memory limits.
    pub devices: Vec<DeviceSpec>,
    /// Guard mode: a canary gap of this many bytes after every arena and io slot, checked by
    /// the backends after every step (`guard`). 0 (off) unless `KILN_GUARD=1` is set.
    pub guard_bytes: usize,
    /// Whether the search also plans the graph with its weight-gradient updates tiled
    /// (`tiled_updates`; on by default). A block is its own GEMM, whose summation order can
    /// differ from the whole product's in the last bit: turn it off for results bitwise equal
    /// to an untiled run (the eager executor's, or a plan compiled before).
    pub tile_updates: bool,
    /// Whether elementwise chains are fused into one op each (`fusion`; on by default, or as
    /// `KILN_FUSE=0` says). Fused results are bitwise the unfused ones on the CPU.
    pub fuse: bool,
    /// Whether a forward pass may run a block of batch rows at a time where that plans smaller
    /// (`batch_blocks`; with fusion on, by default, or as `KILN_BATCH_BLOCKS=0` says).
    pub batch_blocks: bool,
    /// Plan a forward pass in exactly this many blocks of batch rows where its region allows,
    /// whatever the planned totals say (`KILN_BATCH_BLOCKS=N`, N >= 2: an A/B knob for timing
    /// block counts on a device; `None` by default).
    pub forced_blocks: Option<usize>,
    /// Whether values computed from constants alone are computed at compile time
    /// (`const_fold`; on by default, or as `KILN_FOLD=0` says).
    pub fold_constants: bool,
    /// Whether a training step recomputes values that cost next to nothing to remake, without a
    /// memory limit (`cheap_remat`; with fusion on, by default, or as `KILN_CHEAP_REMAT=0` says).
    pub cheap_remat: bool,
    /// The largest share of a training step's FLOPs (`ir::Op::flops`) that recomputation without
    /// a memory limit may add: `saved_values::FLOPS_BUDGET`, 2%, by default. The minimum cut
    /// (`saved_values`) takes what it needs of it first, `cheap_remat` the rest. Memory against
    /// time: at 1/1000 the zoo's transformer keeps its GELU outputs.
    pub recompute_budget: f64,
    /// At most this many FLOPs a step that recomputation under a memory limit (`remat`) may add;
    /// `None` (the default): as many as fitting takes. `cheap_remat` sets it to what its budget
    /// leaves, so that a try over it gives up, or fits by cheaper values, instead of fitting by
    /// costlier ones and being thrown away (the zoo's transformer: each such try 4.5 ms).
    pub remat_flops_cap: Option<u64>,
    /// The scratch a step's kernel may use (`scratch`), as the backend that will run the plan
    /// says (`Backend::scratch_rule`; `kiln_kernels::cuda::SCRATCH`); `None`: no step has any,
    /// and every kernel reduces within its blocks.
    pub scratch: Option<scratch::ScratchRule>,
    /// Whether a transpose (a permute of the last two axes) feeding a product is read in place
    /// through the product's operand flag instead of copied (`transpose_operands`). On by
    /// default, or as `KILN_TRANSPOSE_OPERANDS=0` says: every product sums each element in one
    /// order whatever its operands' layout (`kiln_kernels::cpu::matmul`), so a plan still gives
    /// the eager executor's and the reference interpreter's bits.
    pub transpose_operands: bool,
    /// Whether a training step keeps, of the forward values its backward pass reads, only what a
    /// minimum cut chooses, recomputing the rest within `recompute_budget` (`saved_values`; on
    /// by default, or as `KILN_SAVE_MINIMAL=0` says).
    pub save_minimal: bool,
    /// Plan only the candidate order this plan's schedule name starts with (`schedule::named`),
    /// and only the graph its marks name ("+tiled", "+product", ...; `search_updates`):
    /// `cheap_remat` plans its tries as the whole search chose, a fraction of the work. `None`
    /// (the default): every candidate.
    pub schedule: Option<String>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            alignment: 64,
            devices: vec![DeviceSpec::new(0, "device 0")],
            guard_bytes: guard::default_bytes(),
            tile_updates: true,
            fuse: std::env::var("KILN_FUSE").map_or(true, |v| v != "0"),
            batch_blocks: std::env::var("KILN_BATCH_BLOCKS").map_or(true, |v| v != "0" && v != "1"),
            forced_blocks: std::env::var("KILN_BATCH_BLOCKS")
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .filter(|&n| n >= 2),
            fold_constants: std::env::var("KILN_FOLD").map_or(true, |v| v != "0"),
            cheap_remat: std::env::var("KILN_CHEAP_REMAT").map_or(true, |v| v != "0"),
            recompute_budget: saved_values::FLOPS_BUDGET,
            remat_flops_cap: None,
            scratch: None,
            transpose_operands: std::env::var("KILN_TRANSPOSE_OPERANDS").map_or(true, |v| v != "0"),
            save_minimal: std::env::var("KILN_SAVE_MINIMAL").map_or(true, |v| v != "0"),
            schedule: None,
        }
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

    /// The devices ops may be placed on, in place of the default one.
    pub fn with_devices(mut self, devices: Vec<DeviceSpec>) -> Self {
        self.devices = devices;
        self
    }

    /// Guard mode on (`guard::GUARD_BYTES` of canary after every slot) or off, whatever
    /// `KILN_GUARD` says.
    pub fn with_guard(mut self, on: bool) -> Self {
        self.guard_bytes = if on { guard::GUARD_BYTES } else { 0 };
        self
    }

    /// Fusion on or off, whatever `KILN_FUSE` says.
    pub fn with_fusion(mut self, on: bool) -> Self {
        self.fuse = on;
        self
    }

    /// Forward passes in blocks of batch rows where that plans smaller, or never.
    pub fn with_batch_blocks(mut self, on: bool) -> Self {
        self.batch_blocks = on;
        self
    }

    /// Constant folding on or off, whatever `KILN_FOLD` says.
    pub fn with_constant_folding(mut self, on: bool) -> Self {
        self.fold_constants = on;
        self
    }

    /// Cheap recomputation without a limit on or off, whatever `KILN_CHEAP_REMAT` says.
    pub fn with_cheap_remat(mut self, on: bool) -> Self {
        self.cheap_remat = on;
        self
    }

    /// The minimum cut of what a training step keeps for its backward pass on or off, whatever
    /// `KILN_SAVE_MINIMAL` says.
    pub fn with_save_minimal(mut self, on: bool) -> Self {
        self.save_minimal = on;
        self
    }

    /// `recompute_budget`: the share of a step's FLOPs recomputation without a limit may add.
    pub fn with_recompute_budget(mut self, share: f64) -> Self {
        self.recompute_budget = share;
        self
    }

    /// Transposes read in place by products on or off, whatever `KILN_TRANSPOSE_OPERANDS` says.
    pub fn with_transpose_operands(mut self, on: bool) -> Self {
        self.transpose_operands = on;
        self
    }

    /// Steps get the scratch `rule` asks for (`None`: none).
    pub fn with_scratch(mut self, rule: Option<scratch::ScratchRule>) -> Self {
        self.scratch = rule;
        self
    }

    /// The largest slot alignment accepted: 1 MiB (GPU allocation granularity is 2 MiB and
    /// kernels need at most 256 bytes).
    pub const MAX_ALIGNMENT: usize = 1 << 20;

    /// Checks the options: the alignment a power of two from 4 (f32 kernels read aligned words)
    /// to `MAX_ALIGNMENT`, at least one device, device ids unique.
    pub fn check(&self) -> Result<()> {
        let a = self.alignment;
        if !a.is_power_of_two() || !(4..=Self::MAX_ALIGNMENT).contains(&a) {
            return Err(CompileError::invalid(
                format!("CompileOptions::alignment is {a}"),
                "use a power of two from 4 to 1 MiB (the default, 64, suits every backend)",
            ));
        }
        if self.guard_bytes > guard::MAX_GUARD_BYTES {
            return Err(CompileError::invalid(
                format!("CompileOptions::guard_bytes is {}", self.guard_bytes),
                "use at most 1 MiB of canary (`with_guard(true)` gives 256 bytes, which is enough)",
            ));
        }
        if !(self.recompute_budget.is_finite() && self.recompute_budget >= 0.0) {
            return Err(CompileError::invalid(
                format!("CompileOptions::recompute_budget is {}", self.recompute_budget),
                "use a share of the step's FLOPs from 0 (recompute nothing) up, 0.02 by default",
            ));
        }
        if self.devices.is_empty() {
            return Err(CompileError::invalid(
                "CompileOptions::devices is empty",
                "list at least one device (CompileOptions::default() has one)",
            ));
        }
        for (i, d) in self.devices.iter().enumerate() {
            if let Some(other) = self.devices[..i].iter().find(|o| o.id == d.id || o.name == d.name) {
                return Err(CompileError::invalid(
                    format!(
                        "CompileOptions::devices lists device {} ({:?}) and device {} ({:?}): ids and names must be unique",
                        other.id.0, other.name, d.id.0, d.name
                    ),
                    "give every device its own id and name",
                ));
            }
        }
        Ok(())
    }
}

/// A graph after the default passes, with its execution order: what the planner plans, and
/// what the eager executor runs op by op.
pub struct Scheduled {
    /// The graph after the default passes.
    pub graph: ir::Graph,
    /// Its nodes in program order (`schedule::schedule`), each after its operands.
    pub order: Vec<ir::NodeId>,
}

/// Runs the default passes and schedules the graph.
pub fn optimize(mut graph: ir::Graph) -> Result<Scheduled> {
    passes::default_pipeline().run(&mut graph)?;
    let order = schedule::schedule(&graph)?;
    Ok(Scheduled { graph, order })
}

/// Compiles a graph into a plan: passes, then for each candidate order (`schedule::candidates`)
/// liveness, arena placement, lowering and validation; the plan with the smallest planned total
/// is kept, and its figures name the order that won and what every order gave. A training step
/// over a device's memory limit recomputes values instead of keeping them (`remat`) and is an
/// out-of-memory error only when that cannot make it fit.
pub fn compile(graph: ir::Graph, options: &CompileOptions) -> Result<Plan> {
    options.check()?;
    let mut graph = graph;
    // The rewrites, each recorded by the pipeline (`rewrites::before_search`).
    let rewritten = rewrites::before_search(options).run(&mut graph)?;
    // The search over plan variants: block counts of a forward pass, or recomputation within
    // the budget of a training step, or the graph's own variants (`search_updates`).
    let region = (options.fuse && options.batch_blocks).then(|| batch_blocks::region(&graph)).flatten();
    let mut plan = match region {
        Some(region) => compile_blocked(graph, &region, options),
        None if cheap_remat::applies(&graph, options) => {
            let tries = cheap_remat::tries(&graph);
            // Each try plans the same lowered graph: it is lowered once.
            let (lowered, plan) = lower_and_plan(graph, options, false)?;
            // What the cut recomputes comes out of the same budget.
            let used = rewritten
                .figures
                .saved_values
                .as_ref()
                .map_or(0.0, |s| s.recomputed_flops as f64 / s.step_flops.max(1) as f64);
            let rest = options.clone().with_recompute_budget((options.recompute_budget - used).max(0.0));
            Ok(cheap_remat::shrink(&lowered.graph, tries, &rest, plan, |graph, o| {
                plan_lowered(Lowered { graph, ..lowered.clone() }, o)
            }))
        }
        None => compile_rewritten(graph, options),
    }?;
    // The figures of every rewrite, those before the search first.
    let mut figures = rewritten.figures;
    figures.merge(&plan.memory.rewrites);
    plan.memory.rewrites = figures;
    Ok(plan)
}

/// `compile` of a graph whose forward pass can run a block of batch rows at a time
/// (`batch_blocks`): the graph as it is and split into each block count, the smallest planned
/// total kept (the graph as it is on a tie; a split one where only it fits a memory limit).
/// For a target whose rule says so (`ScratchRule::blocks_only_to_fit`: a GPU) only the last.
fn compile_blocked(
    graph: ir::Graph,
    region: &batch_blocks::Region,
    options: &CompileOptions,
) -> Result<Plan> {
    let whole = compile_rewritten(graph.clone(), options);
    let only_to_fit =
        options.scratch.is_some_and(|r| r.blocks_only_to_fit) && options.forced_blocks.is_none();
    match &whole {
        Err(e) if !matches!(e, CompileError::OutOfMemory(_)) => return whole,
        Ok(_) if only_to_fit => return whole,
        _ => {}
    }
    // Every order of every graph, as `schedules` lists them: the split ones' marked "+blocksN".
    let mut tried = whole.as_ref().map(|p| p.memory.schedules.clone()).unwrap_or_default();
    let mut best = whole;
    let counts = match options.forced_blocks {
        Some(n) if n <= region.batch => vec![n],
        _ => region.block_counts(),
    };
    let forced = options.forced_blocks.is_some();
    for blocks in counts {
        let mut split = batch_blocks::split(&graph, region, blocks)?;
        passes::default_pipeline().run(&mut split)?;
        let Ok(mut plan) = compile_rewritten(split, options) else { continue };
        let mark = format!("+blocks{blocks}");
        tried.extend(plan.memory.schedules.iter().map(|(name, total)| (format!("{name}{mark}"), *total)));
        if forced
            || best
                .as_ref()
                .map_or(true, |b| plan.memory.planned_total_bytes() < b.memory.planned_total_bytes())
        {
            plan.memory.batch_blocks = blocks;
            plan.memory.schedule = format!("{}{mark}", plan.memory.schedule);
            best = Ok(plan);
        }
    }
    if let Ok(plan) = &mut best {
        plan.memory.schedules = tried;
    }
    best
}

/// `compile` after the passes every graph takes.
fn compile_rewritten(graph: ir::Graph, options: &CompileOptions) -> Result<Plan> {
    compile_rewritten_with(graph, options, true)
}

/// `compile_rewritten`; with `refuse`, a step over its limit is fused again without products
/// before recomputation (so that activations can be remade from pre-activations), which cheap
/// recomputation does not do (it keeps every product's epilogue: fewer steps).
fn compile_rewritten_with(graph: ir::Graph, options: &CompileOptions, refuse: bool) -> Result<Plan> {
    lower_and_plan(graph, options, refuse).map(|(_, plan)| plan)
}

/// The schedule mark of a graph whose products that would wait for a value are fused
/// (`fusion::Products::Waiting`).
const WAITING: &str = "+waiting";

/// `options` with `mark` taken out of the schedule it asks for (`CompileOptions::schedule`),
/// and whether the name had it: a plan's name carries its graph's marks, and the searches below
/// look the rest up.
fn unmarked(options: &CompileOptions, mark: &str) -> (CompileOptions, bool) {
    match options.schedule.as_deref() {
        Some(wanted) if wanted.contains(mark) => {
            (CompileOptions { schedule: Some(wanted.replace(mark, "")), ..options.clone() }, true)
        }
        _ => (options.clone(), false),
    }
}

/// `graph` lowered (`lower`) and planned (`plan_lowered`); where fusion kept products apart
/// that fused would wait for a value their epilogue reads (`RewriteFigures::waiting_products`),
/// the graph with them fused is planned too and the smaller plan kept (the first on a tie;
/// the one that plans where the other fails, as under a memory limit), its schedule marked
/// `WAITING`. A schedule asked for by name plans the graph its mark names.
fn lower_and_plan(graph: ir::Graph, options: &CompileOptions, refuse: bool) -> Result<(Lowered, Plan)> {
    let (plain, wants_waiting) = unmarked(options, WAITING);
    let (apart, fused) = lower(graph, options, refuse)?;
    let Some(fused) = fused else { return Ok((apart.clone(), plan_lowered(apart, &plain)?)) };
    if wants_waiting {
        return Ok((fused.clone(), plan_lowered(fused, options)?));
    }
    let first = plan_lowered(apart.clone(), options);
    if options.schedule.is_some() {
        return first.map(|plan| (apart, plan));
    }
    match (first, plan_lowered(fused.clone(), options)) {
        (Ok(plan), Ok(other)) => {
            let mut schedules = plan.memory.schedules.clone();
            schedules.extend(other.memory.schedules.iter().cloned());
            let (kept, mut plan) = if other.memory.planned_total_bytes() < plan.memory.planned_total_bytes() {
                (fused, other)
            } else {
                (apart, plan)
            };
            plan.memory.schedules = schedules;
            Ok((kept, plan))
        }
        (Ok(plan), Err(_)) => Ok((apart, plan)),
        (Err(_), Ok(other)) => Ok((fused, other)),
        (Err(e), Err(_)) => Err(e),
    }
}

/// A graph after the rewrites every planned graph takes (`rewrites::before_fusion`, then
/// `rewrites::fusion`), with their figures.
#[derive(Clone)]
struct Lowered {
    graph: ir::Graph,
    /// The graph before fusion, kept where a memory limit may ask for recomputation.
    unfused: Option<ir::Graph>,
    before_fusion: PassLog,
    fusion: PassLog,
    /// What its plans' schedule names end with: `WAITING` for a graph fused with
    /// `fusion::Products::Waiting`, else nothing.
    mark: &'static str,
}

/// `graph` lowered for planning (`Lowered`; with `refuse`, its unfused graph kept): fused with
/// `fusion::Products::All`, and where that kept products apart that would wait for a value,
/// fused again from the same graph with `fusion::Products::Waiting` (marked `WAITING`).
fn lower(mut graph: ir::Graph, options: &CompileOptions, refuse: bool) -> Result<(Lowered, Option<Lowered>)> {
    let before_fusion = rewrites::before_fusion(options).run(&mut graph)?;
    // Kept for recomputation, which only a memory limit asks for.
    let unfused = (refuse && options.devices.iter().any(|d| d.memory_limit.is_some())).then(|| graph.clone());
    let mut apart = graph.clone();
    let fusion = rewrites::fusion(options, fusion::Products::All).run(&mut apart)?;
    let fused = if fusion.figures.waiting_products > 0 {
        let fusion = rewrites::fusion(options, fusion::Products::Waiting).run(&mut graph)?;
        let before_fusion = before_fusion.clone();
        Some(Lowered { graph, unfused: unfused.clone(), before_fusion, fusion, mark: WAITING })
    } else {
        None
    };
    Ok((Lowered { graph: apart, unfused, before_fusion, fusion, mark: "" }, fused))
}

/// The plan of a lowered graph: the search over its variants (`search_updates`), and over a
/// limit recomputation (`fit`); the figures of its rewrites set on the plan, once.
fn plan_lowered(lowered: Lowered, options: &CompileOptions) -> Result<Plan> {
    let Lowered { graph, unfused, before_fusion, mut fusion, mut mark } = lowered;
    // A schedule asked for by name is looked up without this graph's mark.
    let plain;
    let options = if mark.is_empty() {
        options
    } else {
        plain = unmarked(options, mark).0;
        &plain
    };
    let devices = devices_used(&graph, options)?;
    let variants = search_updates(graph, &devices, options)?;
    let plan = match limits::check(&variants[0].1) {
        Ok(()) => Ok(variants.into_iter().next().map(|(_, plan)| plan).expect("one variant at least")),
        Err(oom) if variants[0].0.effects().is_empty() => Err(CompileError::OutOfMemory(oom)),
        Err(oom) => {
            // Recomputation works on a finer graph: forward products stay apart from their
            // epilogues, so that an activation can be recomputed from its pre-activation
            // without redoing the product; backward ones keep theirs (written over the
            // activation they read).
            let variants = match unfused {
                Some(mut graph) if fusion.rewrites > 0 => {
                    fusion = rewrites::fusion(options, fusion::Products::OverValues).run(&mut graph)?;
                    // Fused again without the products that would wait: no mark.
                    mark = "";
                    search_updates(graph, &devices, options)?
                }
                _ => variants,
            };
            fit(variants, &devices, options, oom)
        }
    };
    plan.map(|mut plan| {
        let mut figures = before_fusion.figures;
        figures.merge(&fusion.figures);
        plan.memory.rewrites = figures;
        if !mark.is_empty() {
            plan.memory.schedule.push_str(mark);
            for (name, _) in &mut plan.memory.schedules {
                name.push_str(mark);
            }
        }
        plan
    })
}

/// A training step over a limit: recompute values instead of keeping them (`remat`), in each
/// graph the search planned (tiled updates change what is live, so either may fit), the
/// smaller planned total first; the first that fits, or the error of the one that came closest.
fn fit(
    variants: Vec<(ir::Graph, Plan)>,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    oom: Box<limits::OutOfMemory>,
) -> Result<Plan> {
    let mut failure: Option<Box<limits::OutOfMemory>> = None;
    for (graph, plan) in variants {
        let needed = limits::check(&plan).err().map_or(0, |o| o.needed);
        let outcome = remat::fit(&graph, devices, options, plan)?;
        match limits::check(&outcome.plan) {
            Ok(()) => {
                let mut plan = outcome.plan;
                if !outcome.figures.recomputed.is_empty() {
                    plan.memory.remat = Some(outcome.figures);
                }
                return Ok(plan);
            }
            Err(mut oom_after) => {
                oom_after.remat = Some(outcome.report(&oom_after, needed));
                if failure.as_ref().is_none_or(|f| oom_after.needed < f.needed) {
                    failure = Some(oom_after);
                }
            }
        }
    }
    Err(CompileError::OutOfMemory(failure.unwrap_or(oom)))
}

/// The schedule search over the ways a training step's updates can take their gradients: the
/// graph as it is, with its weight-gradient updates tiled (`tiled_updates`: a block of rows at a
/// time) and, with fusion on, with updates that compute their own gradient products
/// (`product_updates`: never stored). Each graph with its best plan, the smallest planned total
/// first (the graph as it is on a tie). Which wins depends on the model: a product update keeps
/// its factors (an activation, a delta) until every reader of the old weight has run, which
/// can cost more than the gradient on a narrow layer. Every plan's `schedules` lists the orders
/// of every graph ("+tiled", "+product" for the rewritten ones'). Above
/// `SEARCH_PLACES_ALL_BELOW` nodes only one graph is planned: with the product updates that pay
/// (`Selection::Paying`) when fusion is on, else as it is.
fn search_updates(
    graph: ir::Graph,
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Result<Vec<(ir::Graph, Plan)>> {
    let folded = |graph: &ir::Graph, selection| -> Result<Option<(ir::Graph, usize)>> {
        if !options.fuse {
            return Ok(None);
        }
        let mut g = graph.clone();
        let n = product_updates::fold(&mut g, selection)?;
        Ok((n > 0).then_some((g, n)))
    };
    if graph.len() >= SEARCH_PLACES_ALL_BELOW {
        return Ok(vec![match folded(&graph, product_updates::Selection::Paying)? {
            Some((g, n)) => {
                let mut plan = search(&g, devices, options)?;
                plan.memory.product_updates = n;
                (g, plan)
            }
            None => {
                let plan = search(&graph, devices, options)?;
                (graph, plan)
            }
        }]);
    }
    let mut graphs: Vec<(&str, ir::Graph, usize, usize)> = Vec::new();
    if options.tile_updates
        && let Some(t) = tiled_updates::tile(&graph, options.alignment)?
    {
        graphs.push(("+tiled", t.graph, t.updates, 0));
    }
    let all = folded(&graph, product_updates::Selection::All)?;
    let paying = folded(&graph, product_updates::Selection::Paying)?;
    if let Some((g, n)) = paying
        && all.as_ref().is_some_and(|(_, every)| *every > n)
    {
        // The updates left, tiled where that is allowed, and as they are: tiling is not always
        // smaller (an unseen 37-53-7-1 MLP at batch 13 planned 8,128 B with its last updates
        // tiled against 6,848 B without, when only the tiled graph was tried).
        // As they are first, so that a tie keeps the untiled graph.
        let tiled = if options.tile_updates { tiled_updates::tile(&g, options.alignment)? } else { None };
        graphs.push(("+some-product", g, 0, n));
        if let Some(t) = tiled {
            graphs.push(("+product+tiled", t.graph, t.updates, n));
        }
    }
    if let Some((g, n)) = all {
        graphs.push(("+product", g, 0, n));
    }
    graphs.insert(0, ("", graph, 0, 0));
    // A schedule asked for by name (`CompileOptions::schedule`) names its graph too.
    if let Some(wanted) = options.schedule.as_deref() {
        let suffix = ["+product+tiled", "+some-product", "+product", "+tiled"]
            .into_iter()
            .find(|s| wanted.ends_with(s))
            .unwrap_or("");
        if graphs.iter().any(|(s, ..)| *s == suffix) {
            graphs.retain(|(s, ..)| *s == suffix);
        }
    }
    let mut variants = Vec::with_capacity(graphs.len());
    let mut tried = Vec::new();
    for (suffix, g, tiled, products) in graphs {
        let mut plan = search(&g, devices, options)?;
        // Ranked by the planned total without canaries (what `search` ranked by), so that guard
        // mode keeps the graph it would keep without.
        let total = plan.memory.schedules.iter().map(|(_, t)| *t).min().unwrap_or(usize::MAX);
        tried.extend(plan.memory.schedules.iter().map(|(name, total)| (format!("{name}{suffix}"), *total)));
        plan.memory.schedule = format!("{}{suffix}", plan.memory.schedule);
        plan.memory.tiled_updates = tiled;
        plan.memory.product_updates = products;
        variants.push((total, g, plan));
    }
    variants.sort_by_key(|(total, ..)| *total);
    Ok(variants
        .into_iter()
        .map(|(_, g, mut plan)| {
            plan.memory.schedules = tried.clone();
            (g, plan)
        })
        .collect())
}

/// Graphs with more nodes than this rank the candidate orders by their lower bound (the arena
/// sits within 2% of it) and place only the winner, so that a 100k-node graph still compiles in
/// well under a second; smaller graphs place the orders from the lowest bound up until none left
/// can beat the best plan (branch and bound: the same plan as placing every one). 2,000: the real-scale training
/// steps (2,500-3,600 nodes) planned the same totals with every candidate placed (ResNet-50,
/// ViT-B/16, BERT, GPT-2, EfficientNet-B0, MobileNetV3: byte for byte) in up to 2.5 s less
/// (ViT-B/16: 4.3 -> 1.7 s, before `cheap_remat` took fewer tries).
pub const SEARCH_PLACES_ALL_BELOW: usize = 2_000;

/// The schedule search: plans the graph in the candidate orders that can win (by their arena's
/// lower bound) and keeps the plan with the smallest planned total (the first such in `schedule::candidates`' order: the `+overlap` orders
/// of a data-parallel graph, then program order, win ties), and validates it (`validate`; the
/// orders placed and dropped are not checked). In guard mode the
/// order is chosen as without it (canaries would tip the choice and change what runs) and then
/// planned with the canaries.
pub(crate) fn search(graph: &ir::Graph, devices: &[DeviceSpec], options: &CompileOptions) -> Result<Plan> {
    if options.guard_bytes > 0 {
        let chosen = search(graph, devices, &CompileOptions { guard_bytes: 0, ..options.clone() })?;
        let order = schedule::candidates(graph)?
            .into_iter()
            .find(|c| c.name == chosen.memory.schedule)
            .ok_or_else(|| CompileError::Internal(format!("no schedule named {}", chosen.memory.schedule)))?
            .order;
        let scratch = scratch::of_graph(graph, options.scratch.as_ref());
        let mut plan = plan_order(graph, &order, &scratch, devices, options)?;
        plan.memory.schedule = chosen.memory.schedule;
        plan.memory.schedules = chosen.memory.schedules;
        return validated(plan);
    }
    let wanted = options.schedule.as_deref();
    let some = schedule::candidates_for(graph, wanted)?;
    // A name none of them fits (an order a rewritten graph no longer has): every order.
    let candidates = match wanted {
        Some(w) if !some.iter().any(|c| w.starts_with(c.name)) => schedule::candidates(graph)?,
        _ => schedule::named(some, wanted),
    };
    let scratch = scratch::of_graph(graph, options.scratch.as_ref());
    let mut tried = Vec::new();
    let mut plan = if graph.len() < SEARCH_PLACES_ALL_BELOW {
        // Branch and bound: every order's liveness and arena lower bound (cheap), then orders
        // placed two at a time from the lowest bound up, skipping each that cannot beat the best
        // plan so far (a bound above its planned total, or equal and later in the list, which
        // loses the tie). Placement sits at the bound on every plan, so few are placed.
        let lives = par_map(&candidates, |c| -> Result<(usize, liveness::Liveness)> {
            let live = liveness::analyze(graph, &c.order, &scratch)?;
            check_sizes(&live, options.alignment, options.guard_bytes)?;
            Ok((arena_bound(&live, devices, options), live))
        });
        let mut lives: Vec<(usize, usize, liveness::Liveness)> = lives
            .into_iter()
            .enumerate()
            .map(|(i, r)| r.map(|(bound, live)| (bound, i, live)))
            .collect::<Result<_>>()?;
        lives.sort_by_key(|&(bound, i, _)| (bound, i));
        let mut totals: Vec<Option<usize>> = vec![None; candidates.len()];
        let mut best: Option<(Plan, usize)> = None;
        let mut rest = lives.as_slice();
        while !rest.is_empty() {
            let beats = |&(bound, i, _): &(usize, usize, liveness::Liveness),
                         best: &Option<(Plan, usize)>| {
                best.as_ref().is_none_or(|(b, j)| {
                    let (other, total) = (b.memory.persistent_bytes, b.memory.planned_total_bytes());
                    bound + other < total || (bound + other == total && i < *j)
                })
            };
            let batch: Vec<&(usize, usize, liveness::Liveness)> =
                rest.iter().take(2).filter(|c| beats(c, &best)).collect();
            rest = &rest[rest.len().min(2)..];
            if batch.is_empty() {
                if rest.first().is_none_or(|c| !beats(c, &best)) {
                    break;
                }
                continue;
            }
            let plans = par_map(&batch, |(_, _, live)| plan_live(graph, live, devices, options));
            for (&&(_, i, _), plan) in batch.iter().zip(plans) {
                let plan = plan?;
                let total = plan.memory.planned_total_bytes();
                totals[i] = Some(total);
                if best.as_ref().is_none_or(|(b, j)| {
                    total < b.memory.planned_total_bytes()
                        || (total == b.memory.planned_total_bytes() && i < *j)
                }) {
                    best = Some((plan, i));
                }
            }
        }
        let (mut plan, i) = best.ok_or_else(|| CompileError::Internal("no schedule candidates".into()))?;
        // Orders not placed report their bound with the best plan's bytes outside the arena.
        let other = plan.memory.persistent_bytes;
        let mut rows: Vec<(usize, usize)> =
            lives.iter().map(|&(bound, j, _)| (j, totals[j].unwrap_or(bound + other))).collect();
        rows.sort_unstable();
        tried.extend(rows.into_iter().map(|(j, total)| (candidates[j].name.to_string(), total)));
        plan.memory.schedule = candidates[i].name.to_string();
        plan
    } else {
        let bounds = par_map(&candidates, |c| -> Result<(usize, liveness::Liveness)> {
            let live = liveness::analyze(graph, &c.order, &scratch)?;
            check_sizes(&live, options.alignment, options.guard_bytes)?;
            Ok((arena_bound(&live, devices, options), live))
        });
        let mut best: Option<(usize, &schedule::Candidate, liveness::Liveness)> = None;
        for (c, result) in candidates.iter().zip(bounds) {
            let (bound, live) = result?;
            tried.push((c.name.to_string(), bound));
            if best.as_ref().is_none_or(|(b, _, _)| bound < *b) {
                best = Some((bound, c, live));
            }
        }
        let (_, c, live) = best.ok_or_else(|| CompileError::Internal("no schedule candidates".into()))?;
        let mut plan = plan_live(graph, &live, devices, options)?;
        plan.memory.schedule = c.name.to_string();
        // The same figure for every order: persistent bytes plus the arena's lower bound.
        let persistent = plan.memory.persistent_bytes;
        tried.iter_mut().for_each(|(_, b)| *b += persistent);
        plan
    };
    plan.memory.schedules = tried;
    validated(plan)
}

/// The arena's lower bound of one order's liveness, summed over the devices (slots with their
/// canaries in guard mode): no placement of that order is smaller.
fn arena_bound(live: &liveness::Liveness, devices: &[DeviceSpec], options: &CompileOptions) -> usize {
    devices
        .iter()
        .map(|spec| {
            let intervals: Vec<Interval> = live
                .buffers
                .iter()
                .filter(|b| b.class.in_arena() && b.device == spec.id)
                .map(|b| Interval { bytes: b.bytes + options.guard_bytes, start: b.start, end: b.end })
                .collect();
            planner::lower_bound(&intervals, options.alignment).bytes
        })
        .sum()
}

/// `f` over `items` in two halves (the build machines have two cores), in order, on rayon's
/// pool: its threads outlive the call, where a thread started per call cost more than placing
/// a zoo plan's order.
fn par_map<T: Sync, R: Send>(items: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    if items.len() < 2 {
        return items.iter().map(&f).collect();
    }
    let half = items.len().div_ceil(2);
    let (a, b) = items.split_at(half);
    let (mut out, second) =
        rayon::join(|| a.iter().map(&f).collect::<Vec<R>>(), || b.iter().map(&f).collect::<Vec<R>>());
    out.extend(second);
    out
}

/// One order's plan: liveness, arena placement per device, lowering.
fn plan_order(
    graph: &ir::Graph,
    order: &[ir::NodeId],
    scratch: &scratch::Scratch,
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Result<Plan> {
    let live = liveness::analyze(graph, order, scratch)?;
    check_sizes(&live, options.alignment, options.guard_bytes)?;
    plan_live(graph, &live, devices, options)
}

/// The plan of one order's liveness: arena placement per device, lowering (not validated:
/// `search` validates the plan it keeps).
fn plan_live(
    graph: &ir::Graph,
    live: &liveness::Liveness,
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Result<Plan> {
    let arenas: Vec<DeviceArena> = devices
        .iter()
        .cloned()
        .map(|spec| {
            let (buffers, intervals): (Vec<usize>, Vec<Interval>) = live
                .buffers
                .iter()
                .enumerate()
                .filter(|(_, b)| b.class.in_arena() && b.device == spec.id)
                .map(|(i, b)| (i, Interval { bytes: b.bytes, start: b.start, end: b.end }))
                .unzip();
            // Guard mode places each slot with its canary; the figures keep the real sizes.
            let placement = if options.guard_bytes == 0 {
                planner::place(&intervals, options.alignment)
            } else {
                let guarded: Vec<Interval> = intervals
                    .iter()
                    .map(|iv| Interval { bytes: iv.bytes + options.guard_bytes, ..*iv })
                    .collect();
                planner::place(&guarded, options.alignment)
            };
            DeviceArena { spec, buffers, intervals, placement }
        })
        .collect();
    let plan = lower::Lowering {
        graph,
        live,
        arenas: &arenas,
        alignment: options.alignment,
        guard_bytes: options.guard_bytes,
    }
    .plan();
    Ok(plan)
}

/// `plan` if it passes `validate` (every plan `search` returns does; the orders it places and
/// drops are not checked).
fn validated(plan: Plan) -> Result<Plan> {
    validate::validate(&plan)
        .map_err(|e| CompileError::Internal(format!("plan {:?} failed validation: {e}", plan.name)))?;
    Ok(plan)
}

/// Every buffer holds at most `ir::MAX_TENSOR_BYTES` (checked by `ir::infer`), but their sum
/// is what the planner, lowering and the figures add up: it is checked once here, so that no
/// later sum or offset can overflow.
fn check_sizes(live: &liveness::Liveness, alignment: usize, guard_bytes: usize) -> Result<()> {
    let total = live.buffers.iter().try_fold(0usize, |sum, b| {
        (b.bytes.checked_add(guard_bytes))
            .and_then(|g| g.checked_next_multiple_of(alignment))
            .and_then(|a| sum.checked_add(a))
    });
    match total {
        Some(_) => Ok(()),
        None => Err(CompileError::invalid(
            format!("the graph's {} buffers add up to more bytes than a usize can count", live.buffers.len()),
            "the model is far larger than any device: check its shapes",
        )),
    }
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
