//! kiln-compiler: from a traced model to a memory `Plan`.
//!
//! The pipeline, top to bottom (`compile` below runs steps 3–7):
//! 1. `trace` — the Rust DSL records a model into an `ir::Graph`; `nn` builds layers on it.
//! 2. `step` — composed attention and GELU become one op each (`attention_rewrite`,
//!    `activation_rewrite`); `autocast` applies the precision policy (`Precision`: products
//!    in bf16 or f16, master weights f32); a training step appends the loss (`losses`), the
//!    backward graph (`autodiff`) and the optimizer's in-place updates (`optim`) to the same
//!    graph; an f16 step differentiates its loss times a dynamic scale and gates its updates
//!    on the gradients being finite (`loss_scale`).
//! 3. `rewrites` — the graph rewrites as `passes::Pass`es in `passes::Pipeline`s, each saying
//!    what it changed and the pipeline recording it (`plan::RewriteFigures`): `passes` —
//!    verification, CSE, dead-code elimination, output copies, effect ordering, the cleanup
//!    after every rewrite that changed the graph —; then, to a fixed point,
//!    `const_fold` — values computed from constants alone are computed here, once —,
//!    `pad_sums` — a sum of zero-padded slice gradients becomes one concatenation —,
//!    `transpose_operands` — a transpose feeding a product becomes its operand flag,
//!    read in place —; then `saved_values` — a training step keeps, of the forward values its backward
//!    pass reads, what a minimum cut chooses, and recomputes the rest.
//! 4. `variants` — the graphs the model can be planned as, each marked: lowered
//!    (`conv_relu_grad` — a convolution's input gradient and ReLU's gradient after it as one op —,
//!    `log_softmax_split` — a log-softmax's readers recompute it from the logits and two values
//!    per row —, `fusion` — elementwise chains become one fused op each; plans only, eager stays
//!    unfused — with products that would wait for a value apart and fused, "+waiting"), a
//!    training step's updates as traced, tiled (`tiled_updates`: each gradient made and applied
//!    a block of rows at a time, "+tiled") or computing their own weight gradient
//!    (`product_updates`: never stored, "+product"), a forward pass whole and in blocks of batch
//!    rows (`batch_blocks`: each block's intermediates die before the next, "+blocks2").
//!    `search` — every variant in every candidate order (`schedule`), one branch and bound: each
//!    pair's liveness and lower bound (steps 5–6), pairs placed from the lowest bound up until
//!    none left can beat the best plan, the smallest planned total kept. A training step then
//!    recomputes what costs next to nothing within its budget (`cheap_remat`).
//! 5. `liveness` — every buffer's lifetime, views and in-place reuse, and each step's scratch
//!    (`scratch`: what the backend's kernel for it asks for, live at that step alone).
//! 6. `planner` — offsets in one arena, with the lower bound beside it.
//! 7. `lower` — the result as a `plan::Plan`: plain data that backends execute.
//! 8. `validate`, `limits` — the plan is checked before anything runs: its invariants, and that
//!    it fits every device's memory limit; a training step that does not is rematerialized
//!    (`remat`: values recomputed instead of kept, steps 4–8 again, on a finer
//!    fusion) before it is refused.
#![warn(missing_docs)]

pub mod activation_rewrite;
pub mod attention_rewrite;
pub mod autocast;
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
pub mod loss_scale;
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
pub mod search;
pub mod step;
pub mod tiled_updates;
pub mod trace;
pub mod transpose_operands;
pub mod validate;
pub mod variants;
pub mod widen;
pub mod zero;

pub use autocast::{Half, Precision};
pub use device::DeviceSpec;
pub use error::{CompileError, Result};
pub use plan::Plan;

use passes::PassLog;
pub use search::SEARCH_PLACES_ALL_BELOW;
use variants::{Lowered, Variants};

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
    /// and only the graph its marks name ("+tiled", "+product", ...; `variants::Variants::named`):
    /// `cheap_remat` plans its tries as the whole search chose, a fraction of the work. `None`
    /// (the default): every candidate.
    pub schedule: Option<String>,
    /// Whether the search tries the orders that run allocating ops late (the `-late` orders,
    /// `schedule::allocating_late`); true by default. `compile` turns it off for a second
    /// search where a late order won before cheap recomputation (`cheap_remat`).
    pub late_orders: bool,
    /// The precision a model's graphs are built in (`autocast`, applied by the step builders
    /// before autodiff: `Trainer` builds its graphs in it, the CLI's `--precision` sets it):
    /// f32 by default. `compile` itself plans the graph it is given, whose values already carry
    /// their types.
    pub precision: Precision,
    /// The ops whose kernels, on the backend that will run the plan, read and write f16 and
    /// bf16 values (every op by default: what `kiln memory --precision` reports). Any other op
    /// on half values reads f32 copies and writes an f32 value cast back (`widen`); `Trainer`
    /// takes the set from `Backend::half_kernels`.
    pub half_kernels: widen::HalfKernels,
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
            late_orders: true,
            precision: Precision::F32,
            half_kernels: widen::HalfKernels::ALL,
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

    /// The precision the step builders compute a model in (`precision`).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The ops whose kernels read and write half values (`half_kernels`): a set, or `true`
    /// (every op) and `false` (none).
    pub fn with_half_kernels(mut self, kernels: impl Into<widen::HalfKernels>) -> Self {
        self.half_kernels = kernels.into();
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

/// Compiles a graph into a plan: the rewrites (`rewrites::before_search`), then the search
/// (`search`) over the graph's variants (`variants`) and their candidate orders, each with
/// liveness, arena placement, lowering and validation; the plan with the smallest planned total
/// is kept, and its figures name the order and variant that won and what every one gave. A
/// training step recomputes what costs next to nothing within its budget (`cheap_remat`), and
/// over a device's memory limit recomputes values instead of keeping them (`remat`); it is an
/// out-of-memory error only when that cannot make it fit.
pub fn compile(graph: ir::Graph, options: &CompileOptions) -> Result<Plan> {
    options.check()?;
    let mut graph = graph;
    // The rewrites, each recorded by the pipeline (`rewrites::before_search`).
    let rewritten = rewrites::before_search(options).run(&mut graph)?;
    let region = (options.fuse && options.batch_blocks).then(|| batch_blocks::region(&graph)).flatten();
    let mut plan = match region {
        Some(region) => plan_blocked(graph, &region, options),
        None if cheap_remat::applies(&graph, options) => plan_within_budget(graph, &rewritten, options),
        None => plan_variants(&Variants::of_graph(graph, options, true, 0)?, options).map(|(_, plan)| plan),
    }?;
    // The figures of every rewrite, those before the search first.
    let mut figures = rewritten.figures;
    figures.merge(&plan.memory.rewrites);
    plan.memory.rewrites = figures;
    Ok(plan)
}

/// A forward pass that can run a block of batch rows at a time (`batch_blocks`): the graph as
/// it is and split into each block count, searched as one list of variants (the graph as it is
/// wins a tie). For a target whose rule says so (`ScratchRule::blocks_only_to_fit`: a GPU) the
/// split graphs only where the whole one does not fit; a forced count
/// (`CompileOptions::forced_blocks`) that one alone, where it plans.
fn plan_blocked(graph: ir::Graph, region: &batch_blocks::Region, options: &CompileOptions) -> Result<Plan> {
    let split = |blocks: usize| -> Result<Variants> {
        let mut split = batch_blocks::split(&graph, region, blocks)?;
        passes::default_pipeline().run(&mut split)?;
        Variants::of_graph(split, options, true, blocks)
    };
    let mut all = Variants::of_graph(graph.clone(), options, true, 0)?;
    if let Some(n) = options.forced_blocks.filter(|&n| n <= region.batch) {
        return match plan_variants(&split(n)?, options) {
            Ok((_, plan)) => Ok(plan),
            Err(_) => plan_variants(&all, options).map(|(_, plan)| plan),
        };
    }
    if options.scratch.is_some_and(|r| r.blocks_only_to_fit) && options.forced_blocks.is_none() {
        match plan_variants(&all, options) {
            Err(CompileError::OutOfMemory(_)) => {}
            whole => return whole.map(|(_, plan)| plan),
        }
    }
    for blocks in region.block_counts() {
        all.extend(split(blocks)?);
    }
    plan_variants(&all, options).map(|(_, plan)| plan)
}

/// A training step that recomputes what costs next to nothing (`cheap_remat`): the search's
/// plan, then tries under ever lower limits in the order and variant it chose, within what the
/// budget leaves after the minimum cut (`saved_values`).
///
/// Where the order that won runs its allocating ops late (a `-late` order,
/// `schedule::allocating_late`), the search's best order without the late ones is shrunk too
/// and the smaller result kept: a late order can win the search before recomputation and lose
/// after it (ResNet-50's f32 step at batch 32: 1,701 MB from the late order, 1,624 MB from
/// the other; BERT-base's bf16 step at 8 x 256: 1,835 and 1,777 MB).
fn plan_within_budget(graph: ir::Graph, rewritten: &PassLog, options: &CompileOptions) -> Result<Plan> {
    let tries = cheap_remat::tries(&graph);
    let all = Variants::of_graph(graph, options, false, 0)?;
    let used = rewritten
        .figures
        .saved_values
        .as_ref()
        .map_or(0.0, |s| s.recomputed_flops as f64 / s.step_flops.max(1) as f64);
    let rest = options.clone().with_recompute_budget((options.recompute_budget - used).max(0.0));
    let shrunk = |options: &CompileOptions| -> Result<Plan> {
        let (winner, plan) = plan_variants(&all, options)?;
        let winner =
            winner.ok_or_else(|| CompileError::Internal("a plan within budget from a finer graph".into()))?;
        // Each try plans the winner's lowered graph: it is lowered once.
        let lowered = &all.lowered[all.list[winner].source];
        let rest = CompileOptions { late_orders: options.late_orders, ..rest.clone() };
        Ok(cheap_remat::shrink(&lowered.graph, tries, &rest, plan, |graph, o| {
            let mut one = Variants::default();
            one.push(Lowered { graph, ..lowered.clone() }, o, 0)?;
            plan_variants(&one, o).map(|(_, plan)| plan)
        }))
    };
    let plan = shrunk(options)?;
    if !plan.memory.schedule.contains("-late") || options.schedule.is_some() {
        return Ok(plan);
    }
    let other = shrunk(&CompileOptions { late_orders: false, ..options.clone() });
    Ok(match other {
        Ok(other) if other.memory.planned_total_bytes() < plan.memory.planned_total_bytes() => other,
        _ => plan,
    })
}

/// The search's plan of `variants` (those a schedule asked for by name can be), the figures of
/// its lowering set on it, and the variant it plans (`None`: a variant of the finer graph). A
/// training step over a memory limit recomputes values instead of keeping them (`fit`), on a
/// finer graph where fusion made one. The limit is checked on the smallest plan: on one device,
/// where every variant holds the same variables, no larger plan fits where it does not.
fn plan_variants(variants: &Variants, options: &CompileOptions) -> Result<(Option<usize>, Plan)> {
    let first = variants.list.first().ok_or_else(|| CompileError::Internal("no variant to plan".into()))?;
    let devices = devices_used(&first.graph, options)?;
    let only = variants.named(options.schedule.as_deref());
    let found = search::best(&variants.list, &only, &devices, options)?;
    let variant = &variants.list[found.variant];
    let lowered = &variants.lowered[variant.source];
    let mut plan = found.plan;
    plan.memory.rewrites = lowered.figures();
    let oom = match limits::check(&plan) {
        Ok(()) => return Ok((Some(found.variant), plan)),
        Err(oom) if variant.graph.effects().is_empty() => return Err(CompileError::OutOfMemory(oom)),
        Err(oom) => oom,
    };
    // Recomputation works on a finer graph: forward products stay apart from their
    // epilogues, so that an activation can be recomputed from its pre-activation without
    // redoing the product; backward ones keep theirs (written over the activation they read).
    match &lowered.unfused {
        Some(unfused) if lowered.fusion.rewrites > 0 => {
            let mut graph = unfused.clone();
            let fusion = rewrites::fusion(options, fusion::Products::OverValues).run(&mut graph)?;
            let before_fusion = lowered.before_fusion.clone();
            let mut finer = Variants::default();
            finer.push(Lowered { graph, unfused: None, before_fusion, fusion, mark: "" }, options, 0)?;
            let only = finer.named(options.schedule.as_deref());
            fit(&finer, &only, None, &devices, options, oom).map(|(_, plan)| (None, plan))
        }
        _ => {
            let found = search::Found { variant: found.variant, plan };
            fit(variants, &only, Some(found), &devices, options, oom).map(|(v, plan)| (Some(v), plan))
        }
    }
}

/// A training step over a limit: recompute values instead of keeping them (`remat`), in each
/// variant (tiled updates change what is live, so either may fit), the smaller planned total
/// first (without guard mode's canaries, so that they do not change what runs); the first that
/// fits, or the error of the one that came closest. `known`: one variant's plan, already made.
fn fit(
    variants: &Variants,
    only: &[usize],
    known: Option<search::Found>,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    oom: Box<limits::OutOfMemory>,
) -> Result<(usize, Plan)> {
    let known_variant = known.as_ref().map(|f| f.variant);
    let mut planned: Vec<search::Found> = known.into_iter().collect();
    for &v in only.iter().filter(|&&v| Some(v) != known_variant) {
        planned.push(search::best(&variants.list, &[v], devices, options)?);
    }
    planned.sort_by_key(|found| {
        let total = found.plan.memory.schedules.iter().map(|(_, t)| *t).min();
        (total.unwrap_or(usize::MAX), found.variant)
    });
    let mut failure: Option<Box<limits::OutOfMemory>> = None;
    for found in planned {
        let variant = &variants.list[found.variant];
        let needed = limits::check(&found.plan).err().map_or(0, |o| o.needed);
        let outcome = remat::fit(&variant.graph, devices, options, found.plan)?;
        match limits::check(&outcome.plan) {
            Ok(()) => {
                let mut plan = outcome.plan;
                // `remat`'s rounds plan its graph as it is: the plan keeps its variant's name
                // and counts, so that a schedule asked for by that name plans that variant.
                let memory = &mut plan.memory;
                for name in
                    std::iter::once(&mut memory.schedule).chain(memory.schedules.iter_mut().map(|(n, _)| n))
                {
                    if !name.ends_with(&variant.mark) {
                        name.push_str(&variant.mark);
                    }
                }
                plan.memory.tiled_updates = variant.tiled_updates;
                plan.memory.product_updates = variant.product_updates;
                if !outcome.figures.recomputed.is_empty() {
                    plan.memory.remat = Some(outcome.figures);
                }
                plan.memory.rewrites = variants.lowered[variant.source].figures();
                return Ok((found.variant, plan));
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
