//! Recomputation that costs next to nothing, without a memory limit.
//!
//! `remat` recomputes values instead of keeping them only when a device's limit asks for it.
//! Some recomputations are worth taking anyway: a training step keeps, across its peak, values
//! that one elementwise op remakes from an operand the backward pass holds regardless, such as a
//! GELU's output (its input is kept for the GELU gradient) or a layer norm's scaled output (its
//! normalised input is kept for the scale's gradient). PyTorch's min-cut partitioner in
//! `torch.compile` recomputes such pointwise ops by default for the same reason.
//!
//! This pass asks `remat` for a plan a little smaller each time, `max(1 MiB, 1/(4 x tries))` of
//! the bytes held (`tries`: 8, fewer above 2,000 nodes, each try being a compilation), and keeps
//! each one whose recomputation (`Op::flops`) stays within what
//! `CompileOptions::recompute_budget` leaves after `saved_values` (2% of the step's work in all,
//! by default). Where no such plan fits, it asks for half the step again, down to `MIN_STEP`.
//! Each try plans only the order and the graph the whole search chose
//! (`CompileOptions::schedule`). On the real-scale training steps (2,500-3,600 nodes, 5-6 tries)
//! compiling takes 0.5-0.85 s instead of 2-4.3 s with 8 tries of every order and graph, at
//! planned totals from 1,625 MB instead of 1,676 MB (ResNet-50) to 2,231 MB instead of 2,221 MB
//! (ViT-B/16).
//! Each try plans the graph as lowered once (fused once, not again per try), and a try's
//! recomputation gives up as soon as it passes the budget (`CompileOptions::remat_flops_cap`)
//! rather than fit by costlier values and be thrown away: the zoo transformer's step compiles
//! in 23 ms instead of 29 ms, ViT-B/16's at batch 16 in 0.32 s instead of 0.75 s, at the same
//! planned totals (BERT-base's 2,127 -> 2,095 MB: a try that gave up early left a smaller
//! step to the next).
//! The recomputed values are the same kernels on the same operands, so the results are the
//! same bits. Unlike recomputation under a limit, the graph keeps its fused products (no
//! re-fusion without them), so only the recomputed ops are added: the transformer's step goes
//! from 117 to 120 plan steps, the cnn's from 56 to 57.
//!
//! It runs on training steps of up to `MAX_NODES` nodes on one device, with fusion on and no
//! memory limit (under a limit `remat` already runs). `CompileOptions::cheap_remat` or
//! `KILN_CHEAP_REMAT=0` turns it off.
//!
//! Measured on the zoo (`kiln memory`), at the default budget after the cut: the transformer's
//! training arena goes from 20,877,440 to 19,832,960 B (one value), the cnn's from 30,179,456 to
//! 19,693,696 B (two, one a convolution: 119.5 MFLOP). At a budget of 1/1000 without the cut the
//! transformer's went from 32,338,112 to 29,192,384 B (three layer-norm scalings, 0.8 MFLOP
//! against 6.8 GFLOP a step); its GELU, 32 operations an element and 0.55 ms of a 42 ms CPU step,
//! needs a budget of 1/100.

use crate::error::Result;
use crate::plan::Plan;
use crate::{CompileOptions, ir};

/// Graphs with more nodes than this are not searched: each try is a whole compilation.
pub const MAX_NODES: usize = 5_000;

/// At most this many smaller plans are tried.
pub const MAX_TRIES: usize = 8;

/// Nodes times tries: a graph of more than `TRY_WORK / MAX_TRIES` nodes gets fewer tries (at
/// least `MIN_TRIES`), each a compilation of the whole graph, so that compiling stays near its
/// budget (about 150 ms a try at 3,000 nodes on a 2-core build machine).
pub const TRY_WORK: usize = 16_000;

/// The fewest tries a graph gets.
pub const MIN_TRIES: usize = 2;

/// The tries `graph` gets: `MAX_TRIES`, fewer above `TRY_WORK / MAX_TRIES` nodes.
pub fn tries(graph: &ir::Graph) -> usize {
    (TRY_WORK / graph.len().max(1)).clamp(MIN_TRIES, MAX_TRIES)
}

/// The smallest step below the bytes held that is tried.
pub const MIN_STEP: usize = 1 << 18;

/// Whether `graph` compiled with `options` is a candidate.
pub fn applies(graph: &ir::Graph, options: &CompileOptions) -> bool {
    options.cheap_remat
        && options.fuse
        && options.devices.len() == 1
        && options.devices.iter().all(|d| d.memory_limit.is_none())
        && !graph.effects().is_empty()
        && graph.len() <= MAX_NODES
}

/// The step's FLOPs (`Op::flops` over its steps).
pub fn step_flops(plan: &Plan) -> u64 {
    plan.steps
        .iter()
        .map(|s| {
            let operands: Vec<&ir::Shape> = s.inputs.iter().map(|&v| &plan.values[v].shape).collect();
            let scalar = ir::Shape::scalar();
            let out = s.output.map_or(&scalar, |o| &plan.values[o].shape);
            s.op.flops(&operands, out)
        })
        .sum()
}

/// `plan`, or a smaller plan of `graph` that recomputes values within the budget, in at most
/// `tries` tries (`tries` of the graph before lowering). `compile` compiles `graph` with the
/// options it is given (a memory limit set).
///
/// A try that misses is followed by one half as far below the same plan, so each try runs
/// beside that next one, on the other core (each is one thread's work: a search of one named
/// order): where the first misses, the second is the try that would have come next, and where
/// the first fits, the second is dropped. The tries kept, and so the plan, are those of trying
/// one after the other. Measured (2-core build machine, median of 20 compiles): the zoo
/// transformer's step (4 tries, one fitting) compiles in 13.5 ms instead of 23.5 ms and the
/// cnn's in 10.2 ms instead of 15.7 ms; BERT-base's (8 x 256) in 0.18 s instead of 0.25 s and
/// EfficientNet-B0's (batch 32) in 0.51 s instead of 0.70 s (one compile each), every planned
/// total unchanged.
pub fn shrink(
    graph: &ir::Graph,
    tries: usize,
    options: &CompileOptions,
    plan: Plan,
    compile: impl Fn(ir::Graph, &CompileOptions) -> Result<Plan> + Sync,
) -> Plan {
    let budget = (step_flops(&plan) as f64 * options.recompute_budget) as u64;
    let held = |p: &Plan| p.devices.iter().map(|d| d.memory.held_bytes()).sum::<usize>();
    let mut best = plan;
    // A target missed (no plan fits it by cheap recomputation alone) is tried again half as far
    // below, down to `MIN_STEP`: the first step of 1 MiB can ask more than recomputation can
    // give where a smaller one would still pay (the GPT example's one-hot step in 4 blocks of
    // rows: 6.29 MB kept at the first miss, 5.19 MB two halvings later).
    let mut shift = 0;
    let mut left = tries;
    while left > 0 {
        let now = held(&best);
        let step_at = |shift: usize| (now / (4 * tries)).max(1 << 20) >> shift;
        if step_at(shift) < MIN_STEP {
            break;
        }
        let attempt = |shift: usize| -> Option<Plan> {
            let mut limited = options.clone();
            limited.devices[0].memory_limit = Some(now.saturating_sub(step_at(shift)));
            limited.schedule = Some(best.memory.schedule.clone());
            limited.remat_flops_cap = Some(budget);
            let tried = compile(graph.clone(), &limited);
            tried.ok().filter(|p| {
                p.memory.remat.as_ref().is_some_and(|r| r.recomputed_flops <= budget) && held(p) < now
            })
        };
        // On one thread the second try would run after the first, and be wasted where it fits.
        let next = left >= 2 && step_at(shift + 1) >= MIN_STEP && rayon::current_num_threads() > 1;
        let (first, second) =
            if next { rayon::join(|| attempt(shift), || attempt(shift + 1)) } else { (attempt(shift), None) };
        let smaller = match first {
            Some(p) => {
                left -= 1;
                Some(p)
            }
            None if next => {
                left -= 2;
                shift += 1;
                second
            }
            None => {
                left -= 1;
                None
            }
        };
        match smaller {
            Some(mut smaller) => {
                // The limit was a means: the plan has the caller's (none).
                for d in &mut smaller.devices {
                    d.memory_limit = None;
                }
                best = smaller;
            }
            None => shift += 1,
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::RematFigures;
    use crate::trace::Tracer;

    /// Whether a try at a limit fits.
    type Fits = Box<dyn Fn(usize) -> bool + Sync>;

    /// A plan holding `held` bytes on its one device, as a try that recomputed nothing.
    fn holding(base: &Plan, held: usize) -> Plan {
        let mut p = base.clone();
        let d = &mut p.devices[0].memory;
        d.arena_bytes = held - (d.held_bytes() - d.arena_bytes);
        p.memory.remat = Some(RematFigures::default());
        p
    }

    /// The tries one after the other, as `shrink` makes them without a second thread: the held
    /// bytes of the plan kept.
    fn sequential(start: usize, tries: usize, fits: impl Fn(usize) -> bool) -> usize {
        let (mut now, mut shift) = (start, 0);
        for _ in 0..tries {
            let step = (now / (4 * tries)).max(1 << 20) >> shift;
            if step < MIN_STEP {
                break;
            }
            let limit = now - step;
            if fits(limit) { now = limit } else { shift += 1 }
        }
        now
    }

    /// Each try beside the one that would follow its miss keeps the plan the tries one after
    /// the other keep, whichever limits fit (a floor below which nothing fits, and limits that
    /// fit only in bands).
    #[test]
    fn paired_tries_keep_what_tries_in_turn_keep() {
        let t = Tracer::new("tiny");
        let x = t.input("x", [4, 4]);
        t.output("y", &x.relu());
        let base = crate::compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
        let fixed = base.devices[0].memory.held_bytes() - base.devices[0].memory.arena_bytes;
        let start = fixed + (64 << 20);
        let rules: [(&str, Fits); 4] = [
            ("floor", Box::new(move |l| l >= fixed + (40 << 20))),
            ("bands", Box::new(move |l| ((l - fixed) >> 19) % 3 != 1)),
            ("never", Box::new(|_| false)),
            ("always", Box::new(|_| true)),
        ];
        for (name, fits) in &rules {
            for tries in [1, 2, 3, 8] {
                let want = sequential(start, tries, fits);
                let options = CompileOptions::default();
                let got =
                    shrink(&ir::Graph::new("unused"), tries, &options, holding(&base, start), |_, o| {
                        let limit = o.devices[0].memory_limit.expect("a try sets a limit");
                        if fits(limit) {
                            Ok(holding(&base, limit))
                        } else {
                            Err(crate::error::CompileError::Internal("does not fit".into()))
                        }
                    });
                assert_eq!(got.devices[0].memory.held_bytes(), want, "{name}, {tries} tries");
            }
        }
    }
}
