//! Rematerialization: when a training step does not fit a device's memory limit, recompute forward
//! values in the backward pass instead of keeping them alive across the peak.
//!
//! A greedy loop in the spirit of XLA's rematerialization pass (Checkmate solves the same choice
//! exactly): plan; if a device is over its limit, take the step where its memory peaks and the
//! forward values live across it whose readers after the peak are backward ops; among those whose
//! operands are still available there (values live that long anyway, or variables), pick the one
//! with the most bytes per recomputed FLOP; clone its op, point its late readers at the clone, and
//! order the clone after the peak op (a control edge), and before any update of a variable it
//! reads; re-run the schedule search and repeat. A rewrite that does not lower the over-limit
//! device's need is undone and not tried again. The same kernels recompute the same values, so
//! results are bit-identical to the plan without a limit.

use crate::device::DeviceSpec;
use crate::error::Result;
use crate::ir::{Graph, Node, NodeId, Op, OpClass};
use crate::liveness::{self, StorageClass};
use crate::plan::Plan;
use crate::planner::{self, Interval};
use crate::{CompileOptions, limits, schedule, search};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};

/// What rematerialization did to a plan.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RematFigures {
    /// The recomputed values, as reports name them.
    pub recomputed: Vec<String>,
    /// FLOPs added per step (estimates: `flops`).
    pub recomputed_flops: u64,
    /// The over-limit device's need (persistent + arena) before and after.
    pub bytes_before: usize,
    pub bytes_after: usize,
}

/// At most this many rewrites are tried per compile, and at most this many in a row that leave
/// the need unchanged.
const MAX_REWRITES: usize = 256;
const MAX_STALLS: usize = 16;

/// An estimate of an op's floating-point work: 2mnk per product, 2 per filter tap and output
/// for convolutions, one per element read for reductions, one per output element otherwise.
pub fn flops(op: &Op, operands: &[&crate::ir::Shape], output: &crate::ir::Shape) -> u64 {
    let n = |s: &crate::ir::Shape| s.numel() as u64;
    match op {
        Op::MatMul { transpose_a, .. } => {
            let a = operands[0];
            let k = if *transpose_a { a.back(2) } else { a.back(1) } as u64;
            2 * n(output) * k
        }
        Op::Conv2d { window } => {
            let c = operands[0].back(1) as u64;
            2 * n(output) * (window.size[0] * window.size[1]) as u64 * c
        }
        Op::Reduce { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::Pool2d { .. } => {
            operands.iter().map(|s| n(s)).sum::<u64>().max(n(output))
        }
        _ => n(output),
    }
}

fn node_flops(g: &Graph, n: NodeId) -> u64 {
    let shapes: Vec<crate::ir::Shape> = g.operands(n).iter().map(|&o| g.node(o).shape.clone()).collect();
    let refs: Vec<&crate::ir::Shape> = shapes.iter().collect();
    flops(&g.node(n).op, &refs, &g.node(n).shape)
}

fn recomputable(node: &Node) -> bool {
    let backward = node.name.as_deref().is_some_and(|n| n.ends_with(" grad"));
    !backward
        && matches!(node.op.class(), OpClass::Elementwise | OpClass::Compute)
        && !matches!(node.op, Op::Fill { .. })
}

/// Fits `plan` (the search result for `graph`) under its devices' limits by recomputation, or
/// returns the smallest plan it reached with what it did.
pub(crate) fn fit(
    graph: &Graph,
    devices: &[DeviceSpec],
    options: &CompileOptions,
    plan: Plan,
) -> Result<(Plan, RematFigures)> {
    let mut g = graph.clone();
    let mut plan = plan;
    let mut figures = RematFigures::default();
    let mut rejected: HashSet<NodeId> = HashSet::new();
    let effects = g.effects();
    let mut stalls = 0;
    for _ in 0..MAX_REWRITES {
        let Err(oom) = limits::check(&plan) else { break };
        let Some(spec) = devices.iter().find(|d| d.name == oom.device) else { break };
        if figures.bytes_before == 0 {
            figures.bytes_before = oom.needed;
        }
        let Some(order) = schedule::candidates(&g)?.into_iter().find(|c| c.name == plan.memory.schedule)
        else {
            break;
        };
        let live = liveness::analyze(&g, &order.order)?;
        let step_of: HashMap<NodeId, usize> = live.steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let arena: Vec<&liveness::BufferLife> =
            live.buffers.iter().filter(|b| b.class.in_arena() && b.device == spec.id).collect();
        let intervals: Vec<Interval> =
            arena.iter().map(|b| Interval { bytes: b.bytes, start: b.start, end: b.end }).collect();
        let peak = planner::lower_bound(&intervals, options.alignment).step;
        let outputs: HashSet<NodeId> = g.outputs().iter().map(|(_, n)| *n).collect();

        // The value each arena buffer holds at the peak: the last op of its in-place chain that
        // ran by then.
        let mut holder: HashMap<usize, NodeId> = HashMap::new();
        for (&n, &b) in &live.buffer_of {
            if let Some(&s) = step_of.get(&n)
                && s <= peak
                && holder.get(&b).is_none_or(|h| step_of.get(h).is_some_and(|&hs| hs < s))
            {
                holder.insert(b, n);
            }
        }
        // An operand is there for a clone feeding step `at` when it is a variable (updates are
        // ordered after the clone below) or when one of its own readers runs at `at` or later
        // (so nothing writes over it before).
        let available = |o: NodeId, at: usize| match &g.node(o).op {
            Op::Variable { .. } => true,
            _ => g.users(o).iter().any(|u| step_of.get(u).is_some_and(|&s| s >= at)),
        };
        // (bytes per flop, value, the ops to clone in order, its late readers)
        let mut best: Option<(f64, NodeId, Vec<NodeId>, Vec<NodeId>)> = None;
        for (bi, b) in live.buffers.iter().enumerate() {
            if !b.class.in_arena() || b.device != spec.id || b.class != StorageClass::Arena {
                continue;
            }
            if !(b.start < peak && peak < b.end) {
                continue;
            }
            let Some(&n) = holder.get(&bi) else { continue };
            if rejected.contains(&n) || outputs.contains(&n) || !recomputable(g.node(n)) {
                continue;
            }
            let users = g.users(n);
            if users.iter().any(|&u| g.node(u).op.class() == OpClass::View || !step_of.contains_key(&u)) {
                continue;
            }
            let late: Vec<NodeId> = users.into_iter().filter(|u| step_of[u] > peak).collect();
            let Some(first_late) = late.iter().map(|u| step_of[u]).min() else { continue };
            // The ops to recompute: `n`, and (up to a small depth) operands no longer held there.
            let mut chain: Vec<NodeId> = Vec::new();
            let mut ok = true;
            let mut stack = vec![(n, 0usize)];
            while let Some((m, depth)) = stack.pop() {
                if chain.contains(&m) {
                    continue;
                }
                if depth > 4 || !recomputable(g.node(m)) {
                    ok = false;
                    break;
                }
                chain.push(m);
                for o in g.operands(m) {
                    if !available(o, first_late) {
                        stack.push((o, depth + 1));
                    }
                }
            }
            if !ok {
                continue;
            }
            chain.sort_unstable_by_key(|m| step_of.get(m).copied().unwrap_or(0));
            let cost: u64 = chain.iter().map(|&m| node_flops(&g, m)).sum::<u64>().max(1);
            let score = b.bytes as f64 / cost as f64;
            if best.as_ref().is_none_or(|(s, ..)| score > *s) {
                best = Some((score, n, chain, late));
            }
        }
        let Some((_, n, chain, late)) = best else { break };

        // The rewrite, on a copy: undone if it does not help.
        let mut next = g.clone();
        let mut clone_of: HashMap<NodeId, NodeId> = HashMap::new();
        let mut variables_read: Vec<NodeId> = Vec::new();
        for &m in &chain {
            let node = next.node(m).clone();
            let operands: Vec<NodeId> =
                next.operands(m).into_iter().map(|o| clone_of.get(&o).copied().unwrap_or(o)).collect();
            variables_read
                .extend(operands.iter().copied().filter(|&o| matches!(next.node(o).op, Op::Variable { .. })));
            let name = format!("{} (recomputed)", node.name.as_deref().unwrap_or(node.op.name()));
            let c = next.add(Node { name: Some(name), ..node }, &operands);
            next.add_control(live.steps[peak], c);
            clone_of.insert(m, c);
        }
        let clone = clone_of[&n];
        for u in late {
            for (i, o) in next.operands(u).into_iter().enumerate() {
                if o == n {
                    next.replace_operand(u, i, clone);
                }
            }
        }
        for &o in &variables_read {
            for &e in &effects {
                let mutated = next.node(e).op.mutated_operands();
                if next.operands(e).iter().enumerate().any(|(i, &x)| x == o && mutated.contains(&i)) {
                    for &c in clone_of.values() {
                        next.add_control(c, e);
                    }
                }
            }
        }
        let label = g.node(n).describe();
        let added: u64 = chain.iter().map(|&m| node_flops(&g, m)).sum();
        let before = oom.needed;
        let candidate = match search(&next, devices, options) {
            Ok(p) => p,
            Err(_) => {
                rejected.insert(n);
                continue;
            }
        };
        let need = candidate
            .devices
            .iter()
            .find(|d| d.name == spec.name)
            .map_or(usize::MAX, |d| d.memory.persistent_bytes + d.memory.arena_bytes);
        // A rewrite may leave the need where it was when another value holds the same peak
        // (several peaks of one height): keep it, but give up after a run of such rewrites.
        if need > before {
            rejected.insert(n);
            continue;
        }
        stalls = if need == before { stalls + 1 } else { 0 };
        if stalls > MAX_STALLS {
            break;
        }
        figures.recomputed_flops += added;
        figures.recomputed.push(label);
        figures.bytes_after = need;
        g = next;
        plan = candidate;
    }
    Ok((plan, figures))
}
