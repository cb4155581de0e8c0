//! The search: of every variant of a graph (`variants::Variant`) in every candidate order
//! (`schedule::candidates`), the plan with the smallest planned total, found by branch and bound.
//!
//! Placing an order in the arena (`planner::place`) is what costs: its liveness and the
//! arena's lower bound (`planner::lower_bound`) cost a fraction of it, and placement sits at
//! the bound on every plan (arena/bound 1.000 on the real-scale models, at most 1.005 on the
//! zoo). So every (variant, order) pair's bound is computed first, on both cores, and the
//! pairs are placed from the lowest bound up, two at a time, skipping each whose bound plus its
//! variant's persistent bytes cannot beat the best plan so far: the plan is the one placing
//! every pair would keep (ties to the earlier variant, then the earlier order), with most of
//! the pairs never placed. One list for all variants: a variant whose best bound is above
//! another's plan is not placed at all, where it was placed before a per-variant search ended.
//! Measured (2-core build machine): the zoo's mlp, cnn and transformer training steps place 2,
//! 2 and 4 of their 27, 30 and 18 pairs (5, 5 and 3 variants of 5–6 orders each), where a search
//! per variant placed one at least in each; the mlp's step compiles in 3.0–4.5 ms instead of
//! 5.9 ms, the others' plan time is their recomputation tries (`cheap_remat`), each one pair.

use crate::error::{CompileError, Result};
use crate::ir::{self, Op, VarRole};
use crate::lower::{DeviceArena, Lowering};
use crate::plan::Plan;
use crate::planner::{self, Interval};
use crate::variants::Variant;
use crate::{CompileOptions, DeviceSpec, liveness, schedule, scratch, validate};

/// Graphs with more nodes than this rank their candidate orders by their lower bound and place
/// only the lowest (the arena sits within 2% of it), so that a 100k-node graph still compiles
/// in well under a second; smaller graphs enter every order into the branch and bound.
/// 2,000: the real-scale training steps (2,500-3,600 nodes) planned the same totals with every
/// candidate placed (ResNet-50, ViT-B/16, BERT, GPT-2, EfficientNet-B0, MobileNetV3: byte for
/// byte) in up to 2.5 s less (ViT-B/16: 4.3 -> 1.7 s, before `cheap_remat` took fewer tries).
pub const SEARCH_PLACES_ALL_BELOW: usize = 2_000;

/// The plan the search kept.
pub struct Found {
    /// The variant it plans, as an index into the list searched.
    pub variant: usize,
    /// The plan: validated, its schedule named by its order and its variant's marks, every
    /// pair tried listed in `MemoryFigures::schedules`.
    pub plan: Plan,
}

/// The plan of `graph` as it is (one variant, no marks): what `remat` plans each round.
pub fn one(graph: &ir::Graph, devices: &[DeviceSpec], options: &CompileOptions) -> Result<Plan> {
    best_of(&[(graph, "")], devices, options).map(|(_, plan)| plan)
}

/// The smallest plan of the variants `only` names (indices into `variants`, in the order that
/// wins ties), over their candidate orders (those a schedule asked for by name can be,
/// `CompileOptions::schedule`). Its figures name the order and variant that won
/// (`MemoryFigures::schedule`, `tiled_updates`, `product_updates`, `batch_blocks`) and what
/// every pair gave. In guard mode the pair is chosen as without it (canaries would tip the
/// choice and change what runs) and then planned with the canaries.
pub fn best(
    variants: &[Variant],
    only: &[usize],
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Result<Found> {
    let graphs: Vec<(&ir::Graph, &str)> =
        only.iter().map(|&v| (&variants[v].graph, variants[v].mark.as_str())).collect();
    let (k, mut plan) = best_of(&graphs, devices, options)?;
    let variant = &variants[only[k]];
    plan.memory.tiled_updates = variant.tiled_updates;
    plan.memory.product_updates = variant.product_updates;
    plan.memory.batch_blocks = variant.batch_blocks;
    Ok(Found { variant: only[k], plan })
}

/// `best` over graphs with their marks: the index of the graph whose plan is kept, and the
/// plan (validated).
fn best_of(
    graphs: &[(&ir::Graph, &str)],
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Result<(usize, Plan)> {
    if options.guard_bytes > 0 {
        let (k, chosen) = best_of(graphs, devices, &CompileOptions { guard_bytes: 0, ..options.clone() })?;
        let (graph, mark) = graphs[k];
        let name = chosen.memory.schedule.strip_suffix(mark).unwrap_or_default();
        let order = schedule::candidates_for(graph, Some(name))?
            .into_iter()
            .find(|c| c.name == name)
            .ok_or_else(|| CompileError::Internal(format!("no schedule named {name}")))?
            .order;
        let scratch = scratch::of_graph(graph, options.scratch.as_ref());
        let live = liveness::analyze(graph, &order, &scratch)?;
        check_sizes(&live, options.alignment, options.guard_bytes)?;
        let mut plan = place(graph, &live, devices, options);
        plan.memory.schedule = chosen.memory.schedule;
        plan.memory.schedules = chosen.memory.schedules;
        return validated(plan).map(|plan| (k, plan));
    }
    let wanted = options.schedule.as_deref();
    // Each variant's candidate orders (a name none of them fits, an order a rewritten graph no
    // longer has: every order), its scratch and its bytes outside the arena.
    struct Orders {
        candidates: Vec<schedule::Candidate>,
        scratch: scratch::Scratch,
        persistent: usize,
    }
    let orders: Vec<Orders> = graphs
        .iter()
        .map(|&(graph, _)| -> Result<Orders> {
            let some = schedule::candidates_for(graph, wanted)?;
            let candidates = match wanted {
                Some(w) if !some.iter().any(|c| w.starts_with(c.name)) => schedule::candidates(graph)?,
                _ => schedule::named(some, wanted),
            };
            let scratch = scratch::of_graph(graph, options.scratch.as_ref());
            Ok(Orders { candidates, scratch, persistent: persistent_bytes(graph, devices) })
        })
        .collect::<Result<_>>()?;
    // Every pair's liveness and bound on the planned total (cheap beside placing it).
    let pairs: Vec<(usize, usize)> =
        (0..graphs.len()).flat_map(|k| (0..orders[k].candidates.len()).map(move |c| (k, c))).collect();
    let lives = par_map(&pairs, |&(k, c)| -> Result<(usize, liveness::Liveness)> {
        let graph = graphs[k].0;
        let live = liveness::analyze(graph, &orders[k].candidates[c].order, &orders[k].scratch)?;
        check_sizes(&live, options.alignment, options.guard_bytes)?;
        Ok((arena_bound(&live, devices, options) + orders[k].persistent, live))
    });
    let mut pool: Vec<(usize, (usize, usize), liveness::Liveness)> = pairs
        .iter()
        .zip(lives)
        .map(|(&pair, r)| r.map(|(bound, live)| (bound, pair, live)))
        .collect::<Result<_>>()?;
    let bounds: Vec<((usize, usize), usize)> = pool.iter().map(|(bound, pair, _)| (*pair, *bound)).collect();
    // A large graph places only its order of lowest bound (the first such).
    for (k, o) in orders.iter().enumerate() {
        if graphs[k].0.len() >= SEARCH_PLACES_ALL_BELOW && o.candidates.len() > 1 {
            let lowest = pool.iter().filter(|(_, (j, _), _)| *j == k).map(|&(b, (_, c), _)| (b, c)).min();
            pool.retain(|(b, (j, c), _)| *j != k || Some((*b, *c)) == lowest);
        }
    }
    pool.sort_by_key(|&(bound, pair, _)| (bound, pair));
    // Placed two at a time from the lowest bound up: each on its own core.
    let mut totals: std::collections::HashMap<(usize, usize), usize> = Default::default();
    let mut kept: Option<(Plan, (usize, usize))> = None;
    let beats = |&(bound, pair, _): &(usize, (usize, usize), liveness::Liveness),
                 kept: &Option<(Plan, (usize, usize))>| {
        kept.as_ref().is_none_or(|(plan, at)| {
            let total = plan.memory.planned_total_bytes();
            bound < total || (bound == total && pair < *at)
        })
    };
    let mut rest = pool.as_slice();
    while !rest.is_empty() {
        let batch: Vec<&(usize, (usize, usize), liveness::Liveness)> =
            rest.iter().take(2).filter(|p| beats(p, &kept)).collect();
        rest = &rest[rest.len().min(2)..];
        if batch.is_empty() {
            if rest.first().is_none_or(|p| !beats(p, &kept)) {
                break;
            }
            continue;
        }
        let plans = par_map(&batch, |(_, (k, _), live)| place(graphs[*k].0, live, devices, options));
        for (&&(_, pair, _), plan) in batch.iter().zip(plans) {
            let total = plan.memory.planned_total_bytes();
            totals.insert(pair, total);
            if kept.as_ref().is_none_or(|(b, at)| {
                let best = b.memory.planned_total_bytes();
                total < best || (total == best && pair < *at)
            }) {
                kept = Some((plan, pair));
            }
        }
    }
    let (mut plan, (k, c)) = kept.ok_or_else(|| CompileError::Internal("no schedule candidates".into()))?;
    // Every pair, as placed or, where it was not, its bound.
    plan.memory.schedules = bounds
        .iter()
        .map(|&((j, i), bound)| {
            let name = format!("{}{}", orders[j].candidates[i].name, graphs[j].1);
            (name, totals.get(&(j, i)).copied().unwrap_or(bound))
        })
        .collect();
    plan.memory.schedule = format!("{}{}", orders[k].candidates[c].name, graphs[k].1);
    validated(plan).map(|plan| (k, plan))
}

/// The bytes a plan of `graph` holds outside its arenas, as `lower` counts them: parameters,
/// optimizer state, counters and constants on `devices` (every io value is in the arena).
fn persistent_bytes(graph: &ir::Graph, devices: &[DeviceSpec]) -> usize {
    graph
        .variables()
        .into_iter()
        .filter(|&v| devices.iter().any(|d| d.id == graph.node(v).device))
        .map(|v| match &graph.node(v).op {
            Op::Variable {
                shape,
                dtype,
                role: VarRole::Parameter | VarRole::OptimizerState | VarRole::Counter | VarRole::Constant,
                ..
            } => shape.numel() * dtype.size_bytes(),
            _ => 0,
        })
        .sum()
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

/// The plan of one order's liveness: arena placement per device, lowering (not validated:
/// `best` validates the plan it keeps).
fn place(
    graph: &ir::Graph,
    live: &liveness::Liveness,
    devices: &[DeviceSpec],
    options: &CompileOptions,
) -> Plan {
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
    Lowering { graph, live, arenas: &arenas, alignment: options.alignment, guard_bytes: options.guard_bytes }
        .plan()
}

/// `plan` if it passes `validate` (every plan `best` returns does; the pairs it places and
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
