//! Rematerialization: when a training step does not fit a device's memory limit, recompute values
//! in the backward pass instead of keeping them alive across the peak.
//!
//! A greedy loop in the spirit of XLA's rematerialization pass (Checkmate solves the same choice
//! exactly, with an integer program), run on the graph after `passes` (CSE has run and never runs
//! again, so the clones stay apart) and re-planned with the schedule search after each rewrite:
//!
//! 1. Take the over-limit device's peak step in the current plan (where its lower bound is
//!    reached) and the values whose buffers are live across it without being read there: each
//!    buffer holds the last value of its in-place chain by then, and the readers of that value
//!    after the peak (through views) are its late readers.
//! 2. For each such value, the ops that recompute it: its own op, and back through its operands
//!    every one that is no longer held when the first late reader runs (a "chain"; views are
//!    cloned for free). An operand still held then (read at or after that step), live at the
//!    peak anyway, or small (1/8 of the value or less) is read as it is, at the cost of keeping
//!    it; variables are read before their updates (control edges). Sources, effects and graph
//!    outputs are never recomputed. The value's bytes less what the chain keeps alive at the
//!    peak are what the rewrite saves; `Op::flops` summed over the chain is what it costs.
//! 3. Take the values with the most bytes saved per FLOP until their savings cover the excess
//!    (at most `MAX_PICK`, none sharing an op or operand), clone each chain (`name (recomputed)`,
//!    same op, operands, device and origin), point the late readers at the clone, and order the
//!    clones after an anchor: the latest-running other predecessor of the first late reader
//!    (typically the upstream gradient), or the peak op, so that no order computes them early.
//! 4. Re-run the schedule search. A round is kept when it lowers the device's need (persistent +
//!    arena), or leaves it and lowers the bytes over budget summed over all steps (several steps
//!    at one peak height take several rounds: at most `MAX_STALLS` in a row) or the arena's lower
//!    bound; otherwise the best value alone is tried, and if that does not help either it is not
//!    tried again.
//! 5. Once it fits, the costliest rewrites are undone one at a time (`MAX_PRUNE`) where the plan
//!    still fits without them: a round that chose several values may have needed fewer.
//!
//! Recomputing the cheapest value first can keep its larger operand alive longer (an activation
//! recomputed from a pre-activation the backward pass reads anyway), so when ranking by bytes per
//! FLOP does not fit, the loop runs again ranking by bytes saved, and the better result is kept.
//!
//! It stops when every device fits, when nothing at the peak can be recomputed, or after
//! `MAX_REWRITES` values, `MAX_ROUNDS` rounds or `SEARCH_BUDGET` (compile time). The same
//! kernels recompute the same values from the same operands, so results are bit-identical to the
//! plan without a limit (tests/remat.rs trains with both and compares every loss and variable).
//!
//! Measured on the 2-core build machine (`cargo bench --bench remat`, CPU backend, median of 21
//! steps, both plans alternating): the transformer (batch 8) under persistent + 0.5 x its arena
//! plans a 20.2 MB arena instead of 40.5 MB by recomputing 10 values (21 ops, 612 MFLOP a step:
//! layer-norm outputs, the GELU and its input, the attention softmax, log-softmax) at 1.13-1.20x
//! the step time, and fits down to 0.35x; the cnn (batch 64) fits in 0.6x (19.7 MB of 33.3 MB,
//! 1453 MFLOP: the first two convolution blocks recomputed, 1.10-1.14x) but not 0.5x, where its
//! first max-pool gradient's input and result (8 MiB each) with what that step reads exceed the
//! budget; the mlp's weight gradients (as large as its weights) leave little to recompute (0.9x).
//! Compile time under a limit: 10-60 ms against 3 ms without. Results are bit-identical.

use crate::device::{DeviceSpec, human_bytes};
use crate::error::Result;
use crate::ir::{DeviceId, Graph, Node, NodeId, Op, OpClass, Shape};
use crate::liveness::{self, Liveness};
use crate::plan::{Plan, Storage};
use crate::plan::{RematFigures, human_flops};
use crate::search::one as search;
use crate::{CompileOptions, limits, schedule};
use std::collections::{HashMap, HashSet};

/// At most this many values are recomputed and this many rounds run per strategy; at most this
/// many rounds in a row may leave the need where it was (peaks of one height).
const MAX_REWRITES: usize = 1024;
const MAX_ROUNDS: usize = 160;
const MAX_STALLS: usize = 16;
/// At most this many ops recompute one value, and this many values are chosen per round.
const MAX_CHAIN: usize = 48;
const MAX_PICK: usize = 32;

/// What `fit` reached.
pub(crate) struct Outcome {
    pub plan: Plan,
    pub figures: RematFigures,
}

impl Outcome {
    /// The out-of-memory report's line about rematerialization, for a plan that still does not
    /// fit: what it recomputed and reached, and what the need at the peak is made of.
    pub fn report(&self, oom: &limits::OutOfMemory, first_need: usize) -> String {
        let f = &self.figures;
        let persistent = oom.parameters + oom.optimizer_state + oom.io;
        if f.recomputed.is_empty() && persistent >= oom.limit {
            return format!(
                "not attempted: parameters and optimizer state alone ({}) exceed the limit, and recomputing values only shrinks the arena ({})",
                human_bytes(persistent),
                human_bytes(oom.arena)
            );
        }
        let did = if f.recomputed.is_empty() {
            "no value live across the peak could be recomputed there".to_string()
        } else {
            format!(
                "recomputed {} values ({} a step) and reached {} (from {}), not enough",
                f.recomputed.len(),
                human_flops(f.recomputed_flops),
                human_bytes(oom.needed),
                human_bytes(first_need)
            )
        };
        format!("{did}; the rest is {}", peak_breakdown(&self.plan, oom))
    }
}

/// What the over-limit device's need is made of at its peak, from the plan alone.
fn peak_breakdown(plan: &Plan, oom: &limits::OutOfMemory) -> String {
    let Some(d) = plan.devices.iter().position(|d| d.name == oom.device) else { return String::new() };
    let p = oom.peak_step;
    let buffer = |v: usize| plan.values.get(v).map(|v| v.buffer);
    let at_peak: HashSet<usize> = plan
        .steps
        .get(p)
        .map(|s| s.inputs.iter().chain(s.output.iter()).filter_map(|&v| buffer(v)).collect())
        .unwrap_or_default();
    let io: HashSet<usize> =
        plan.inputs.iter().chain(&plan.outputs).filter_map(|b| buffer(b.value)).collect();
    let (mut op, mut bound, mut other) = (0, 0, 0);
    for (i, b) in plan.buffers.iter().enumerate() {
        let live = matches!(b.storage, Storage::Arena { device, .. } if device == d)
            && b.first_step <= p
            && p <= b.last_step;
        if !live {
            continue;
        }
        let bytes = b.bytes.next_multiple_of(plan.alignment.max(1));
        if at_peak.contains(&i) {
            op += bytes;
        } else if io.contains(&i) {
            bound += bytes;
        } else {
            other += bytes;
        }
    }
    format!(
        "{} of parameters and optimizer state, {} read and written by the op at the peak ({}), {} of graph inputs and outputs, and {} of other values live there (recomputing them did not lower the need)",
        human_bytes(oom.parameters + oom.optimizer_state + oom.io),
        human_bytes(op),
        oom.peak_op,
        human_bytes(bound),
        human_bytes(other)
    )
}

/// Fits `plan` (the search result for `graph`) under its devices' limits by recomputation, or
/// returns the smallest plan it reached with what it did.
pub(crate) fn fit(
    graph: &Graph,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    plan: Plan,
) -> Result<Outcome> {
    let mut best: Option<(Outcome, (usize, u128, usize))> = None;
    let mut budget = Budget(SEARCH_BUDGET);
    for strategy in [Strategy::PerFlop, Strategy::Largest] {
        let outcome = greedy(graph, devices, options, plan.clone(), strategy, &mut budget)?;
        let Err(oom) = limits::check(&outcome.plan) else { return Ok(outcome) };
        let reached = devices
            .iter()
            .find(|d| d.name == oom.device)
            .map_or((oom.needed, 0, 0), |spec| progress(&outcome.plan, spec));
        if best.as_ref().is_none_or(|(_, b)| reached < *b) {
            best = Some((outcome, reached));
        }
    }
    Ok(best.map(|(o, _)| o).unwrap_or(Outcome { figures: RematFigures::default(), plan }))
}

/// How a round ranks the values it could recompute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Strategy {
    /// The most bytes saved per recomputed FLOP first (XLA's and Checkmate's cost model).
    PerFlop,
    /// The most bytes saved first, the fewest FLOPs among equals: tried when the first does not
    /// fit, since recomputing a cheap value can keep its larger operand alive (an activation
    /// recomputed from a pre-activation that the backward pass reads anyway).
    Largest,
}

fn greedy(
    graph: &Graph,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    plan: Plan,
    strategy: Strategy,
    budget: &mut Budget,
) -> Result<Outcome> {
    let mut g = graph.clone();
    let mut plan = plan;
    let total = plan.memory.planned_total_bytes();
    let mut applied: Vec<Applied> = Vec::new();
    let mut rejected: HashSet<NodeId> = HashSet::new();
    let mut stalls = 0;
    for _ in 0..MAX_ROUNDS {
        let Err(oom) = limits::check(&plan) else { break };
        if applied.len() >= MAX_REWRITES || budget.0 < g.len() {
            break;
        }
        let Some(spec) = devices.iter().find(|d| d.name == oom.device) else { break };
        if oom.parameters + oom.optimizer_state + oom.io >= oom.limit {
            break;
        }
        budget.spend(g.len());
        let Some(peak) = Peak::analyze(&g, &plan, &oom, spec.id)? else { break };
        let candidates = peak.candidates(&g, &rejected, strategy);
        let Some(best) = candidates.first() else { break };
        let picks = pick(&candidates, oom.needed - oom.limit);
        let before = progress(&plan, spec);
        let mut kept = None;
        let single = std::slice::from_ref(best);
        let attempts: &[&[Candidate]] = if picks.len() > 1 { &[&picks, single] } else { &[single] };
        for &attempt in attempts {
            let mut next = g.clone();
            let done: Vec<Applied> = attempt.iter().map(|c| rewrite(&mut next, c)).collect();
            if !budget.spend(next.len()) {
                break;
            }
            let Ok(p) = search(&next, devices, options) else { continue };
            let need = progress(&p, spec);
            if need < before {
                kept = Some((next, p, need, done));
                break;
            }
        }
        let Some((next, p, need, chosen)) = kept else {
            rejected.insert(best.value);
            continue;
        };
        stalls = if need.0 == before.0 { stalls + 1 } else { 0 };
        applied.extend(chosen);
        g = next;
        plan = p;
        // Past the FLOPs the caller allows (`CompileOptions::remat_flops_cap`) it gives up: the
        // caller would throw the plan away.
        if options.remat_flops_cap.is_some_and(|cap| applied.iter().map(|a| a.flops).sum::<u64>() > cap) {
            break;
        }
        if stalls > MAX_STALLS {
            break;
        }
    }
    if limits::check(&plan).is_ok() {
        prune(&mut g, &mut plan, &mut applied, devices, options, budget)?;
    }
    let figures = RematFigures {
        recomputed: applied.iter().map(|a| a.label.clone()).collect(),
        recomputed_ops: applied.iter().map(|a| a.ops).sum(),
        recomputed_flops: applied.iter().map(|a| a.flops).sum(),
        bytes_before: total,
        bytes_after: plan.memory.planned_total_bytes(),
    };
    Ok(Outcome { plan, figures })
}

/// Plans searched, weighted by their nodes, per compile (both strategies and pruning): about
/// 1,600 searches of a 600-node training step, 10 of a 100k-node graph (a round's analysis of
/// the current order counts as one).
const SEARCH_BUDGET: usize = 1_000_000;

/// What is left of `SEARCH_BUDGET`.
struct Budget(usize);

impl Budget {
    /// Takes a search of `nodes` nodes from the budget; false when it is spent.
    fn spend(&mut self, nodes: usize) -> bool {
        match self.0.checked_sub(nodes.max(1)) {
            Some(left) => {
                self.0 = left;
                true
            }
            None => false,
        }
    }
}

/// At most this many rewrites are tried for removal once a plan fits.
const MAX_PRUNE: usize = 12;

/// Rewrites chosen early, or several in one round, may prove unnecessary once later ones are in:
/// undoes the costliest ones (most FLOPs first) one at a time while the plan still fits.
fn prune(
    g: &mut Graph,
    plan: &mut Plan,
    applied: &mut Vec<Applied>,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    budget: &mut Budget,
) -> Result<()> {
    let mut order: Vec<usize> = (0..applied.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(applied[i].flops));
    let mut dropped: HashSet<usize> = HashSet::new();
    for i in order.into_iter().take(MAX_PRUNE) {
        // A rewrite whose clones a kept rewrite recomputes again stays.
        let a = &applied[i];
        if applied
            .iter()
            .enumerate()
            .any(|(j, b)| j != i && !dropped.contains(&j) && a.added.contains(&b.value))
        {
            continue;
        }
        let mut next = g.clone();
        undo(&mut next, a);
        if !budget.spend(next.len()) {
            break;
        }
        let Ok(p) = search(&next, devices, options) else { continue };
        if limits::check(&p).is_ok() {
            *g = next;
            *plan = p;
            dropped.insert(i);
        }
    }
    let mut i = 0;
    applied.retain(|_| {
        i += 1;
        !dropped.contains(&(i - 1))
    });
    Ok(())
}

/// The over-limit device's persistent + arena bytes in `plan`.
fn need_of(plan: &Plan, spec: &DeviceSpec) -> usize {
    plan.devices.iter().find(|d| d.name == spec.name).map_or(usize::MAX, |d| d.memory.held_bytes())
}

/// What a rewrite must lower, in order: the device's need (persistent + arena), the bytes over
/// its budget summed over steps (`excess_area`), its arena's lower bound (an arena above the
/// bound with every step within budget needs a lower peak to place in less).
fn progress(plan: &Plan, spec: &DeviceSpec) -> (usize, u128, usize) {
    let bound =
        plan.devices.iter().find(|d| d.name == spec.name).map_or(usize::MAX, |d| d.memory.lower_bound_bytes);
    (need_of(plan, spec), excess_area(plan, spec), bound)
}

/// Bytes over the device's arena budget (its limit less persistent bytes), summed over the
/// steps of `plan`: what a rewrite that leaves the peak's height alone (another step holds the
/// same peak) may still lower.
fn excess_area(plan: &Plan, spec: &DeviceSpec) -> u128 {
    let Some(d) = plan.devices.iter().position(|d| d.name == spec.name) else { return 0 };
    let dev = &plan.devices[d];
    let held_outside_arena = dev.memory.held_bytes() - dev.memory.arena_bytes;
    let budget = dev.memory_limit.unwrap_or(usize::MAX).saturating_sub(held_outside_arena);
    let mut delta = vec![0i128; plan.steps.len() + 1];
    for b in &plan.buffers {
        if matches!(b.storage, Storage::Arena { device, .. } if device == d) && b.first_step <= b.last_step {
            let bytes = b.bytes.next_multiple_of(plan.alignment.max(1)) as i128;
            delta[b.first_step.min(plan.steps.len())] += bytes;
            delta[(b.last_step + 1).min(plan.steps.len())] -= bytes;
        }
    }
    let mut live = 0i128;
    let mut area = 0u128;
    for d in delta.iter().take(plan.steps.len()) {
        live += d;
        area += (live - budget as i128).max(0) as u128;
    }
    area
}

/// One value to recompute and how.
#[derive(Clone, Debug)]
struct Candidate {
    /// The value held across the peak.
    value: NodeId,
    /// Its buffer's bytes, less the bytes of operands the chain keeps alive across the peak.
    saved: usize,
    flops: u64,
    /// The nodes to clone, operands first (views included).
    chain: Vec<NodeId>,
    /// The clones run after this node.
    anchor: NodeId,
    /// The readers (not views) of the value's storage after the peak: they read the clone.
    late: HashSet<NodeId>,
    /// The chain, its operands and the value: candidates of one round share none.
    touched: HashSet<NodeId>,
    /// Effects that write variables the chain reads: the clones run before them.
    before_effects: Vec<NodeId>,
}

/// The current plan's order seen from its peak step on one device.
struct Peak {
    step: usize,
    /// The over-limit device: only its arena's values are candidates.
    device: DeviceId,
    order: Vec<NodeId>,
    live: Liveness,
    step_of: HashMap<NodeId, usize>,
    /// Position of every node (views and sources included) in the order.
    pos: HashMap<NodeId, usize>,
    /// The last step that reads each node's value, through views.
    last_read: HashMap<NodeId, usize>,
    outputs: HashSet<NodeId>,
    /// The effects that write each variable.
    writers: HashMap<NodeId, Vec<NodeId>>,
}

impl Peak {
    fn analyze(g: &Graph, plan: &Plan, oom: &limits::OutOfMemory, device: DeviceId) -> Result<Option<Peak>> {
        // The plan's order, made alone; its name may carry its graph's mark ("+product").
        let wanted = plan.memory.schedule.as_str();
        let named = schedule::named(schedule::candidates_for(g, Some(wanted))?, Some(wanted));
        let Some(order) = named.into_iter().find(|c| {
            wanted.strip_prefix(c.name).is_some_and(|rest| rest.is_empty() || rest.starts_with('+'))
        }) else {
            return Ok(None);
        };
        let order = order.order;
        // Scratch buffers hold no value to recompute: the values are what matter here.
        let live = liveness::analyze(g, &order, &crate::scratch::Scratch::none())?;
        if live.steps.len() != plan.steps.len() || oom.peak_step >= live.steps.len() {
            return Ok(None);
        }
        let step_of: HashMap<NodeId, usize> = live.steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let mut last_read: HashMap<NodeId, usize> = HashMap::new();
        for &n in order.iter().rev() {
            let end = g
                .users(n)
                .into_iter()
                .filter_map(
                    |u| if is_view(g, u) { last_read.get(&u).copied() } else { step_of.get(&u).copied() },
                )
                .max();
            if let Some(e) = end {
                last_read.insert(n, e);
            }
        }
        let mut writers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
        for e in g.effects() {
            let operands = g.operands(e);
            for &i in g.node(e).op.mutated_operands() {
                if let Some(&v) = operands.get(i) {
                    writers.entry(v).or_default().push(e);
                }
            }
        }
        let outputs = g.outputs().iter().map(|(_, n)| *n).collect();
        Ok(Some(Peak { step: oom.peak_step, device, order, live, step_of, pos, last_read, outputs, writers }))
    }

    /// The values worth recomputing at the peak, the best first as `strategy` ranks them.
    fn candidates(&self, g: &Graph, rejected: &HashSet<NodeId>, strategy: Strategy) -> Vec<Candidate> {
        let p = self.step;
        let peak_node = self.live.steps[p];
        // Buffers the peak op reads or writes: needed there whatever happens.
        let mut at_peak: HashSet<usize> =
            g.operands(peak_node).iter().filter_map(|o| self.buffer(*o)).collect();
        at_peak.extend(self.buffer(peak_node));
        // The value each buffer holds at the peak: the last of its in-place chain by then.
        let mut holder: HashMap<usize, NodeId> = HashMap::new();
        for &n in &self.order {
            if is_view(g, n) || self.pos[&n] > self.pos[&peak_node] {
                continue;
            }
            if let Some(b) = self.buffer(n) {
                holder.insert(b, n);
            }
        }
        let mut out = Vec::new();
        for (b, buf) in self.live.buffers.iter().enumerate() {
            if !buf.class.in_arena() || buf.device != self.device || !(buf.start <= p && p <= buf.end) {
                continue;
            }
            if at_peak.contains(&b) {
                continue;
            }
            let Some(&v) = holder.get(&b) else { continue };
            if rejected.contains(&v)
                || !recomputable(g.node(v))
                || self.step_of.get(&v).is_none_or(|&s| s >= p)
            {
                continue;
            }
            if let Some(c) = self.candidate(g, v, buf.bytes) {
                out.push(c);
            }
        }
        let score = |c: &Candidate| match strategy {
            Strategy::PerFlop => (c.saved as f64 / c.flops.max(1) as f64, 0.0),
            Strategy::Largest => (c.saved as f64, -(c.flops as f64)),
        };
        out.sort_by(|a, b| {
            let (sa, sb) = (score(a), score(b));
            (sb.0.total_cmp(&sa.0))
                .then_with(|| sb.1.total_cmp(&sa.1))
                .then_with(|| self.pos[&a.value].cmp(&self.pos[&b.value]))
        });
        out
    }

    fn candidate(&self, g: &Graph, v: NodeId, bytes: usize) -> Option<Candidate> {
        let p = self.step;
        let readers = storage_readers(g, v, &self.outputs)?;
        let late: HashSet<NodeId> =
            readers.into_iter().filter(|u| self.step_of.get(u).is_some_and(|&s| s > p)).collect();
        let first = *late.iter().min_by_key(|u| self.step_of[u])?;
        let t = self.step_of[&first];
        // The anchor: the latest other predecessor of the first late reader that runs after the
        // peak, else the peak op.
        let anchor = g
            .predecessors(first)
            .filter_map(|q| {
                let r = root(g, q);
                (r != v).then(|| self.step_of.get(&r).map(|&s| (s, r))).flatten()
            })
            .filter(|&(s, _)| s > p)
            .max()
            .map_or(self.live.steps[p], |(_, r)| r);

        // The chain: `v`, and every operand not held at `t` that is worth recomputing.
        let mut chain: Vec<NodeId> = Vec::new();
        let mut kept: HashSet<NodeId> = HashSet::new();
        let mut extra = 0usize;
        let mut stack = vec![v];
        let mut seen: HashSet<NodeId> = HashSet::from([v]);
        while let Some(m) = stack.pop() {
            chain.push(m);
            if chain.len() > MAX_CHAIN {
                return None;
            }
            for o in g.operands(m) {
                if !seen.insert(o) {
                    continue;
                }
                match self.hold(g, o, t, bytes) {
                    Hold::Free => {
                        kept.insert(o);
                    }
                    Hold::Keep(cost) => {
                        kept.insert(o);
                        extra += cost;
                    }
                    Hold::Recompute => stack.push(o),
                    Hold::Impossible => return None,
                }
            }
        }
        let saved = bytes.checked_sub(extra).filter(|&s| s > 0)?;
        chain.sort_unstable_by_key(|m| self.pos[m]);
        let flops = chain.iter().map(|&m| node_flops(g, m)).sum();
        let mut before_effects = Vec::new();
        for &o in &kept {
            if let Some(es) = self.writers.get(&root(g, o)) {
                before_effects.extend(es.iter().copied());
            }
        }
        // A variable updated before the anchor can no longer be read after it.
        let anchor_pos = self.pos[&anchor];
        if before_effects.iter().any(|e| self.pos[e] < anchor_pos) && {
            let ancestors = ancestors(g, anchor);
            before_effects.iter().any(|e| ancestors.contains(e))
        } {
            return None;
        }
        let mut touched: HashSet<NodeId> = chain.iter().copied().collect();
        touched.extend(kept.iter().map(|&o| root(g, o)));
        Some(Candidate { value: v, saved, flops, chain, anchor, late, touched, before_effects })
    }

    /// How the clone of a chain whose first late reader runs at step `t` gets operand `o`.
    fn hold(&self, g: &Graph, o: NodeId, t: usize, value_bytes: usize) -> Hold {
        let node = g.node(o);
        if matches!(node.op, Op::Variable { .. }) || self.outputs.contains(&o) {
            return Hold::Free;
        }
        if is_view(g, o) {
            // A view is as available as what it views; cloning it costs nothing.
            return self.hold(g, root(g, o), t, value_bytes);
        }
        let last = self.last_read.get(&o).copied();
        if last.is_some_and(|l| l >= t) {
            return Hold::Free;
        }
        let live_at_peak =
            self.step_of.get(&o).is_none_or(|&s| s <= self.step) && last.is_some_and(|l| l >= self.step);
        if live_at_peak {
            return Hold::Keep(0);
        }
        let small = node.bytes().saturating_mul(8) <= value_bytes;
        if recomputable(node) && !small {
            Hold::Recompute
        } else if matches!(node.op, Op::Input { .. }) || recomputable(node) {
            Hold::Keep(node.bytes())
        } else {
            Hold::Impossible
        }
    }

    fn buffer(&self, n: NodeId) -> Option<usize> {
        self.live.buffer_of.get(&n).copied()
    }
}

enum Hold {
    /// Held at that step anyway.
    Free,
    /// Kept alive until then, at this many bytes at the peak.
    Keep(usize),
    Recompute,
    Impossible,
}

/// Up to `MAX_PICK` candidates in order (the most bytes per FLOP first) whose savings cover
/// `excess`, sharing no op or operand.
fn pick(candidates: &[Candidate], excess: usize) -> Vec<Candidate> {
    let mut picked: Vec<Candidate> = Vec::new();
    let mut touched: HashSet<NodeId> = HashSet::new();
    let mut saved = 0;
    for c in candidates {
        if picked.len() >= MAX_PICK || saved >= excess {
            break;
        }
        if c.touched.iter().any(|n| touched.contains(n)) {
            continue;
        }
        touched.extend(c.touched.iter().copied());
        saved += c.saved;
        picked.push(c.clone());
    }
    picked
}

/// One rewrite as applied to the graph: enough to report it and to undo it.
#[derive(Clone, Debug)]
struct Applied {
    value: NodeId,
    clone: NodeId,
    /// Every node added, in order, and the views cloned for late readers (original, clone).
    added: Vec<NodeId>,
    views: Vec<(NodeId, NodeId)>,
    label: String,
    ops: usize,
    flops: u64,
}

/// Clones `c`'s chain after its anchor, and points the value's late readers at the clone.
fn rewrite(g: &mut Graph, c: &Candidate) -> Applied {
    let mut clone_of: HashMap<NodeId, NodeId> = HashMap::new();
    let mut added = Vec::new();
    for &m in &c.chain {
        let node = g.node(m).clone();
        let operands: Vec<NodeId> =
            g.operands(m).into_iter().map(|o| clone_of.get(&o).copied().unwrap_or(o)).collect();
        let view = node.op.class() == OpClass::View;
        let name = match node.name.as_deref() {
            Some(n) if n.ends_with(" (recomputed)") || view => n.to_string(),
            Some(n) => format!("{n} (recomputed)"),
            None if view => node.op.name().to_string(),
            None => format!("{} (recomputed)", node.op.name()),
        };
        let clone = g.add(Node { name: Some(name), ..node }, &operands);
        if !view {
            g.add_control(c.anchor, clone);
            for &e in &c.before_effects {
                g.add_control(clone, e);
            }
        }
        clone_of.insert(m, clone);
        added.push(clone);
    }
    let clone = clone_of[&c.value];
    let mut views = Vec::new();
    redirect(g, c.value, clone, &c.late, &mut views);
    added.extend(views.iter().map(|&(_, v)| v));
    Applied {
        value: c.value,
        clone,
        added,
        views,
        label: g.node(c.value).describe(),
        ops: c.chain.iter().filter(|&&m| !is_view(g, m)).count(),
        flops: c.flops,
    }
}

/// Undoes `a`: the value's readers read the original again and the clones no longer read are
/// removed (clones that later rewrites read stay; they compute the same values).
fn undo(g: &mut Graph, a: &Applied) {
    for &(view, clone) in a.views.iter().rev() {
        if g.contains(clone) && g.contains(view) {
            g.replace_uses(clone, view);
        }
    }
    if g.contains(a.clone) && g.contains(a.value) {
        g.replace_uses(a.clone, a.value);
    }
    for &n in a.added.iter().rev() {
        if g.contains(n) && g.users(n).is_empty() && !g.outputs().iter().any(|(_, o)| *o == n) {
            g.remove(n);
        }
    }
}

/// Points the readers in `late` of `old`'s storage at `new`, cloning views read both early and
/// late (recorded in `views` as (original, clone)).
fn redirect(
    g: &mut Graph,
    old: NodeId,
    new: NodeId,
    late: &HashSet<NodeId>,
    views: &mut Vec<(NodeId, NodeId)>,
) {
    for u in g.users(old) {
        if is_view(g, u) {
            let readers = storage_readers(g, u, &HashSet::new()).unwrap_or_default();
            let n_late = readers.iter().filter(|r| late.contains(r)).count();
            if n_late == 0 {
                continue;
            }
            if n_late == readers.len() {
                g.replace_operand(u, 0, new);
            } else {
                let view = g.node(u).clone();
                let v2 = g.add(view, &[new]);
                views.push((u, v2));
                redirect(g, u, v2, late, views);
            }
        } else if late.contains(&u) {
            for (i, o) in g.operands(u).into_iter().enumerate() {
                if o == old {
                    g.replace_operand(u, i, new);
                }
            }
        }
    }
}

/// The readers (not views) of `n`'s storage, through views; `None` when a view of it is a graph
/// output.
fn storage_readers(g: &Graph, n: NodeId, outputs: &HashSet<NodeId>) -> Option<Vec<NodeId>> {
    let mut out = Vec::new();
    let mut stack = vec![n];
    while let Some(m) = stack.pop() {
        for u in g.users(m) {
            if is_view(g, u) {
                if outputs.contains(&u) {
                    return None;
                }
                stack.push(u);
            } else if !out.contains(&u) {
                out.push(u);
            }
        }
    }
    Some(out)
}

/// Every node that must run before `n`.
fn ancestors(g: &Graph, n: NodeId) -> HashSet<NodeId> {
    let mut seen = HashSet::new();
    let mut stack = vec![n];
    while let Some(m) = stack.pop() {
        for p in g.predecessors(m) {
            if seen.insert(p) {
                stack.push(p);
            }
        }
    }
    seen
}

fn is_view(g: &Graph, n: NodeId) -> bool {
    g.node(n).op.class() == OpClass::View
}

/// The node whose buffer a view (of a view...) reads; `n` itself when it is not a view.
pub(crate) fn root(g: &Graph, n: NodeId) -> NodeId {
    let mut r = n;
    while is_view(g, r) {
        match g.operands(r).first() {
            Some(&o) => r = o,
            None => break,
        }
    }
    r
}

/// Ops that can run again with the same result: anything that computes (elementwise, layout,
/// products, convolutions, reductions, fills), never a source, an effect or a collective (which
/// every rank must run once, in the same order).
fn recomputable(node: &Node) -> bool {
    matches!(node.op.class(), OpClass::Elementwise | OpClass::Compute) && !node.op.is_collective()
}

/// `Op::flops` of node `n` of `g`.
pub(crate) fn node_flops(g: &Graph, n: NodeId) -> u64 {
    let shapes: Vec<Shape> = g.operands(n).iter().map(|&o| g.node(o).shape.clone()).collect();
    let refs: Vec<&Shape> = shapes.iter().collect();
    g.node(n).op.flops(&refs, &g.node(n).shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_are_printed_with_units() {
        assert_eq!(human_flops(999), "999 FLOP");
        assert_eq!(human_flops(236_978_176), "237.0 MFLOP");
    }

    #[test]
    fn matmul_and_conv_flops() {
        let mm = Op::MatMul { transpose_a: false, transpose_b: false };
        let (a, b, c) = (Shape::new([4, 8, 16]), Shape::new([16, 32]), Shape::new([4, 8, 32]));
        assert_eq!(mm.flops(&[&a, &b], &c), 2 * 4 * 8 * 32 * 16);
        let window = crate::ir::Window2d::new([3, 3], [1, 1], crate::ir::Padding::Same);
        let (x, w, y) = (Shape::new([2, 8, 8, 3]), Shape::new([3, 3, 3, 16]), Shape::new([2, 8, 8, 16]));
        let conv = Op::Conv2d { window };
        assert_eq!(conv.flops(&[&x, &w], &y), 2 * 2 * 8 * 8 * 16 * 9 * 3);
        let dx = Op::Conv2dBackpropInput { window, input: x.clone() };
        assert_eq!(dx.flops(&[&y, &w], &x), conv.flops(&[&x, &w], &y));
        let dw = Op::Conv2dBackpropFilter { window };
        assert_eq!(dw.flops(&[&x, &y], &w), conv.flops(&[&x, &w], &y));
    }
}
