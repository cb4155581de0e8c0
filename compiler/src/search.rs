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
//! per variant placed one at least in each; median of 30 compiles, against that per-variant
//! search: mlp 3.7 -> 2.3 ms, cnn 8.8 -> 8.5 ms, transformer 11.6 -> 10.4 ms (most of the last
//! two is their recomputation tries, `cheap_remat`, one pair each), every planned total equal.

use crate::error::{CompileError, Result};
use crate::ir::{self, Op, VarRole};
use crate::lower::{DeviceArena, Lowering};
use crate::plan::Plan;
use crate::planner::{self, Interval};
use crate::variants::Variant;
use crate::{CompileOptions, DeviceSpec, liveness, schedule, scratch, validate};
use std::collections::HashMap;

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
            let mut candidates = match wanted {
                Some(w) if !some.iter().any(|c| w.starts_with(c.name)) => schedule::candidates(graph)?,
                _ => schedule::named(some, wanted),
            };
            // A late order asked for by name is planned all the same.
            if !options.late_orders && wanted.is_none() {
                candidates.retain(|c| !c.name.contains("-late"));
            }
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
    let (bounds, lives): (Vec<usize>, Vec<liveness::Liveness>) =
        lives.into_iter().collect::<Result<Vec<_>>>()?.into_iter().unzip();
    // Pairs by their index, which orders them as ties are broken: variant, then order.
    let mut pool: Vec<(usize, usize)> = bounds.iter().copied().zip(0..).collect();
    // A large graph places only its order of lowest bound (the first such).
    for (k, o) in orders.iter().enumerate() {
        if graphs[k].0.len() >= SEARCH_PLACES_ALL_BELOW && o.candidates.len() > 1 {
            let lowest = pool.iter().filter(|&&(_, p)| pairs[p].0 == k).min().copied();
            pool.retain(|&(b, p)| pairs[p].0 != k || Some((b, p)) == lowest);
        }
    }
    let (kept, placed) = branch_and_bound(
        pool,
        |p| place(graphs[pairs[p].0].0, &lives[p], devices, options),
        |plan| plan.memory.planned_total_bytes(),
    );
    let (mut plan, p) = kept.ok_or_else(|| CompileError::Internal("no schedule candidates".into()))?;
    let (k, c) = pairs[p];
    // Every pair, as placed or, where it was not, its bound.
    plan.memory.schedules = pairs
        .iter()
        .zip(&bounds)
        .enumerate()
        .map(|(q, (&(j, i), &bound))| {
            let name = format!("{}{}", orders[j].candidates[i].name, graphs[j].1);
            (name, placed.get(&q).copied().unwrap_or(bound))
        })
        .collect();
    plan.memory.schedule = format!("{}{}", orders[k].candidates[c].name, graphs[k].1);
    validated(plan).map(|plan| (k, plan))
}

/// Of the pairs in `pool` (each a bound on its total and its index, the smaller index winning
/// a tie), the one whose `place`d result has the smallest `total`, placing as few as it can:
/// from the lowest bound up, two at a time (each on its own core), skipping each that cannot
/// beat the best so far, stopping where none left can. Every bound at most its pair's total,
/// the pair kept is the one placing every pair would keep. The kept result and its index, and
/// the total of every pair placed.
fn branch_and_bound<P: Send>(
    mut pool: Vec<(usize, usize)>,
    place: impl Fn(usize) -> P + Sync,
    total: impl Fn(&P) -> usize,
) -> (Option<(P, usize)>, HashMap<usize, usize>) {
    pool.sort_unstable();
    let mut placed = HashMap::new();
    let mut kept: Option<(P, usize, usize)> = None;
    let beats = |(bound, p): (usize, usize), kept: &Option<(P, usize, usize)>| {
        kept.as_ref().is_none_or(|&(_, best, at)| bound < best || (bound == best && p < at))
    };
    let mut rest = pool.as_slice();
    while !rest.is_empty() {
        let batch: Vec<usize> =
            rest.iter().take(2).filter(|&&pair| beats(pair, &kept)).map(|&(_, p)| p).collect();
        rest = &rest[rest.len().min(2)..];
        if batch.is_empty() {
            if rest.first().is_none_or(|&pair| !beats(pair, &kept)) {
                break;
            }
            continue;
        }
        for (p, result) in batch.iter().zip(par_map(&batch, |&p| place(p))) {
            let t = total(&result);
            placed.insert(*p, t);
            if beats((t, *p), &kept) {
                kept = Some((result, t, *p));
            }
        }
    }
    (kept.map(|(result, _, p)| (result, p)), placed)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::losses::Loss;
    use crate::nn::{Conv2D, Dense, Flatten, Layer, Sequential};
    use crate::optim::{Adam, Optimizer};
    use crate::step::{TrainConfig, forward_graph, train_step_graph};
    use crate::variants::Variants;
    use crate::{CompileOptions, batch_blocks, passes, rewrites};

    /// A model by name, its input's shape and, for a training step, its targets'.
    type Case = (&'static str, Box<dyn Layer>, Vec<usize>, Option<[usize; 2]>);

    /// Every pair placed, the smallest planned total kept (the first such): what the branch
    /// and bound must find. Its schedule name and total.
    fn every_pair(variants: &Variants, options: &CompileOptions) -> (String, usize) {
        let devices = options.devices.clone();
        let mut best: Option<(String, usize)> = None;
        for v in &variants.list {
            let scratch = scratch::of_graph(&v.graph, None);
            for c in schedule::candidates(&v.graph).unwrap() {
                let live = liveness::analyze(&v.graph, &c.order, &scratch).unwrap();
                let total = place(&v.graph, &live, &devices, options).memory.planned_total_bytes();
                if best.as_ref().is_none_or(|(_, b)| total < *b) {
                    best = Some((format!("{}{}", c.name, v.mark), total));
                }
            }
        }
        best.unwrap()
    }

    /// The variants `compile` plans of a model's training step or forward pass.
    fn variants_of(
        model: &dyn Layer,
        x: &[usize],
        y: Option<[usize; 2]>,
        options: &CompileOptions,
    ) -> Variants {
        let mut graph = match y {
            Some(y) => {
                let cfg = TrainConfig {
                    optimizer: Optimizer::Adam(Adam::new(1e-3)),
                    loss: Loss::MeanSquaredError,
                    metrics: Vec::new(),
                };
                train_step_graph(model, ir::Shape::from(x.to_vec()), ir::Shape::from(y), &cfg).unwrap()
            }
            None => forward_graph(model, ir::Shape::from(x.to_vec())).unwrap(),
        };
        rewrites::before_search(options).run(&mut graph).unwrap();
        let mut all = Variants::of_graph(graph.clone(), options, false, 0).unwrap();
        if let Some(region) = batch_blocks::region(&graph) {
            for blocks in region.block_counts() {
                let mut split = batch_blocks::split(&graph, &region, blocks).unwrap();
                passes::default_pipeline().run(&mut split).unwrap();
                all.extend(Variants::of_graph(split, options, false, blocks).unwrap());
            }
        }
        all
    }

    #[test]
    fn branch_and_bound_keeps_the_smallest_total_placing_few() {
        // Bounds and totals from a fixed generator: each total its bound plus a slack that is
        // mostly 0 (placement at the bound) and sometimes more than the gaps between bounds.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut fewer = 0;
        for case in 0..500 {
            let n = 1 + next(12) as usize;
            let bounds: Vec<usize> = (0..n).map(|_| 100 + next(40) as usize).collect();
            let totals: Vec<usize> =
                bounds.iter().map(|b| b + if next(3) == 0 { next(30) as usize } else { 0 }).collect();
            let pool: Vec<(usize, usize)> = bounds.iter().copied().zip(0..).collect();
            let (kept, placed) = branch_and_bound(pool, |p| totals[p], |t| *t);
            let (t, p) = kept.unwrap();
            let want = (0..n).min_by_key(|&q| (totals[q], q)).unwrap();
            assert_eq!((p, t), (want, totals[want]), "case {case}: bounds {bounds:?} totals {totals:?}");
            assert!(placed.iter().all(|(&q, &t)| totals[q] == t), "case {case}");
            fewer += usize::from(placed.len() < n);
        }
        // Most pools are decided before every pair is placed.
        assert!(fewer > 300, "{fewer} of 500 placed fewer than all");
        let (kept, placed) = branch_and_bound(Vec::new(), |p| p, |t| *t);
        assert!(kept.is_none() && placed.is_empty());
    }

    #[test]
    fn the_search_keeps_what_placing_every_pair_keeps() {
        let options = CompileOptions::default().with_guard(false);
        let mlp = |widths: &[usize]| {
            widths.iter().fold(Sequential::new(), |m, &w| m.add(Dense::new(w).relu())).add(Dense::new(3))
        };
        let conv = Sequential::new()
            .add(Conv2D::new(6, [3, 3]).relu())
            .add(Conv2D::new(5, [3, 3]).relu())
            .add(Flatten)
            .add(Dense::new(4));
        let conv2 = Sequential::new()
            .add(Conv2D::new(8, [3, 3]).relu())
            .add(Conv2D::new(4, [3, 3]).relu())
            .add(Flatten)
            .add(Dense::new(5));
        let cases: Vec<Case> = vec![
            ("mlp 37-53-7 batch 13", Box::new(mlp(&[53, 7])), vec![13, 37], Some([13, 3])),
            ("mlp 64-128-128 batch 32", Box::new(mlp(&[128, 128])), vec![32, 64], Some([32, 3])),
            ("mlp 5-300-2 batch 3", Box::new(mlp(&[300, 2])), vec![3, 5], Some([3, 3])),
            ("mlp forward batch 64", Box::new(mlp(&[256, 256, 64])), vec![64, 100], None),
            ("conv step batch 4", Box::new(conv), vec![4, 12, 12, 3], Some([4, 4])),
            ("conv forward batch 16", Box::new(conv2), vec![16, 20, 20, 2], None),
        ];
        let mut several = 0;
        for (name, model, x, y) in cases {
            let variants = variants_of(model.as_ref(), &x, y, &options);
            several += usize::from(variants.list.len() > 1);
            let only: Vec<usize> = (0..variants.list.len()).collect();
            let found = best(&variants.list, &only, &options.devices, &options).unwrap();
            let (want, total) = every_pair(&variants, &options);
            assert_eq!(found.plan.memory.planned_total_bytes(), total, "{name}");
            assert_eq!(found.plan.memory.schedule, want, "{name}");
            // Every pair is listed, placed or not.
            let pairs: usize =
                variants.list.iter().map(|v| schedule::candidates(&v.graph).unwrap().len()).sum();
            assert_eq!(found.plan.memory.schedules.len(), pairs, "{name}");
        }
        // The cases search more than one variant (tiled and product updates, blocks of rows).
        assert!(several >= 4, "{several} cases with several variants");
    }
}
