//! Execution orders. Every order is a topological order of data and control edges; they differ in
//! which ready op runs next, and so in what is live at once. `compile` plans several and keeps
//! the one with the smallest plan (XLA's "choose best" scheduler idea); the eager baseline runs
//! program order, as eager frameworks do.
//!
//! - `program`: among the ready ops, the earliest traced: plans read like the model's source.
//! - `memory`: a list scheduler that runs the ready op that frees the most bytes net of what it
//!   allocates (ties in program order). An optimizer update frees its gradient and allocates
//!   nothing, so it runs as soon as its gradient is final and the old value's readers have run.
//! - `depth-first` and `depth-first-reversed`: post-order walks from the graph's sinks (outputs,
//!   updates), operands first or last first: each value is consumed soon after it is made.
//!
//! Each runs in O((nodes + edges) log nodes).

use crate::error::{CompileError, Result};
use crate::ir::{Graph, NodeId, Op, OpClass};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// A named order.
pub struct Candidate {
    pub name: &'static str,
    pub order: Vec<NodeId>,
}

/// Program order: the order eager execution and the default plans use.
pub fn schedule(graph: &Graph) -> Result<Vec<NodeId>> {
    let mut pending = pending_counts(graph);
    let mut ready: BinaryHeap<Reverse<NodeId>> =
        pending.iter().filter(|(_, c)| **c == 0).map(|(n, _)| Reverse(*n)).collect();
    let mut order = Vec::with_capacity(graph.len());
    while let Some(Reverse(n)) = ready.pop() {
        order.push(n);
        release(graph, n, &mut pending, |s| ready.push(Reverse(s)));
    }
    complete(graph, order)
}

/// Every order `compile` tries, program order first.
pub fn candidates(graph: &Graph) -> Result<Vec<Candidate>> {
    Ok(vec![
        Candidate { name: "program", order: schedule(graph)? },
        Candidate { name: "memory", order: memory_greedy(graph)? },
        Candidate { name: "depth-first", order: depth_first(graph, false)? },
        Candidate { name: "depth-first-reversed", order: depth_first(graph, true)? },
    ])
}

fn pending_counts(graph: &Graph) -> HashMap<NodeId, usize> {
    graph.node_ids().map(|n| (n, graph.predecessors(n).count())).collect()
}

/// Marks `n` done: successors whose predecessors have all run become ready.
fn release(graph: &Graph, n: NodeId, pending: &mut HashMap<NodeId, usize>, mut ready: impl FnMut(NodeId)) {
    for s in graph.successors(n) {
        if let Some(c) = pending.get_mut(&s) {
            *c -= 1;
            if *c == 0 {
                ready(s);
            }
        }
    }
}

fn complete(graph: &Graph, order: Vec<NodeId>) -> Result<Vec<NodeId>> {
    if order.len() != graph.len() {
        return Err(CompileError::Internal(format!("graph {:?} has a cycle", graph.name())));
    }
    Ok(order)
}

/// Bytes an op's own storage takes when it runs: nothing for sources (io and persistent),
/// views (their operand's buffer) and updates (they write variables).
fn allocates(graph: &Graph, n: NodeId) -> i64 {
    let node = graph.node(n);
    match node.op.class() {
        OpClass::Source | OpClass::View | OpClass::Effect => 0,
        _ => node.bytes() as i64,
    }
}

/// The node whose buffer `n`'s value lives in (through views).
fn storage_root(graph: &Graph, mut n: NodeId) -> NodeId {
    while graph.node(n).op.class() == OpClass::View {
        n = graph.operands(n)[0];
    }
    n
}

/// The list scheduler: the ready op with the largest (bytes freed - bytes allocated) runs next.
fn memory_greedy(graph: &Graph) -> Result<Vec<NodeId>> {
    let outputs: std::collections::HashSet<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
    // Per storage root, the distinct non-view ops that read it (through views), and per op the
    // distinct roots it reads.
    let mut roots_of: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    let mut readers: HashMap<NodeId, Vec<NodeId>> = HashMap::new();
    for n in graph.node_ids() {
        if graph.node(n).op.class() == OpClass::View {
            continue;
        }
        let mut roots: Vec<NodeId> = graph.operands(n).into_iter().map(|o| storage_root(graph, o)).collect();
        roots.sort_unstable();
        roots.dedup();
        for &r in &roots {
            readers.entry(r).or_default().push(n);
        }
        roots_of.insert(n, roots);
    }
    let mut remaining: HashMap<NodeId, usize> = readers.iter().map(|(r, v)| (*r, v.len())).collect();
    let freeable = |r: NodeId| {
        !outputs.contains(&r)
            && !matches!(graph.node(r).op, Op::Variable { .. })
            && !graph.node(r).op.is_effect()
    };
    let score = |n: NodeId, remaining: &HashMap<NodeId, usize>| -> i64 {
        let freed: i64 = roots_of.get(&n).map_or(0, |roots| {
            roots
                .iter()
                .filter(|&&r| remaining.get(&r) == Some(&1) && freeable(r))
                .map(|&r| graph.node(r).bytes() as i64)
                .sum()
        });
        freed - allocates(graph, n)
    };

    let mut pending = pending_counts(graph);
    let mut version: HashMap<NodeId, u32> = HashMap::new();
    // (score, earliest id first, version); stale versions are skipped when popped.
    let mut heap: BinaryHeap<(i64, Reverse<NodeId>, u32)> = BinaryHeap::new();
    let mut free_now: Vec<NodeId> = Vec::new(); // ready views and sources: run at once
    macro_rules! push {
        ($n:expr) => {{
            let n: NodeId = $n;
            if matches!(graph.node(n).op.class(), OpClass::View | OpClass::Source) {
                free_now.push(n);
            } else {
                let v = version.entry(n).or_insert(0);
                *v += 1;
                heap.push((score(n, &remaining), Reverse(n), *v));
            }
        }};
    }
    let mut initial: Vec<NodeId> = pending.iter().filter(|(_, c)| **c == 0).map(|(n, _)| *n).collect();
    initial.sort_unstable();
    for n in initial.into_iter().rev() {
        push!(n);
    }
    let mut done: std::collections::HashSet<NodeId> = std::collections::HashSet::new();
    let mut order = Vec::with_capacity(graph.len());
    loop {
        let n = if let Some(n) = free_now.pop() {
            n
        } else if let Some((_, Reverse(n), v)) = heap.pop() {
            if version.get(&n) != Some(&v) || done.contains(&n) {
                continue;
            }
            n
        } else {
            break;
        };
        done.insert(n);
        order.push(n);
        let mut newly_ready = Vec::new();
        release(graph, n, &mut pending, |s| newly_ready.push(s));
        // Reading `n`'s operands may leave one reader of a root: that reader now frees it.
        if let Some(roots) = roots_of.get(&n) {
            for &r in roots {
                let Some(c) = remaining.get_mut(&r) else { continue };
                *c -= 1;
                if *c == 1 {
                    let last = readers[&r].iter().copied().find(|u| !done.contains(u));
                    if let Some(u) = last
                        && pending.get(&u) == Some(&0)
                        && !newly_ready.contains(&u)
                    {
                        push!(u);
                    }
                }
            }
        }
        newly_ready.sort_unstable();
        for s in newly_ready.into_iter().rev() {
            push!(s);
        }
    }
    complete(graph, order)
}

/// Post-order from the sinks (nodes nothing runs after), in program order; each node's
/// predecessors are visited first to last, or last to first.
fn depth_first(graph: &Graph, reversed: bool) -> Result<Vec<NodeId>> {
    let mut sinks: Vec<NodeId> = graph.node_ids().filter(|&n| graph.successors(n).next().is_none()).collect();
    sinks.sort_unstable();
    let preds = |n: NodeId| -> Vec<NodeId> {
        let mut p = graph.operands(n);
        p.extend(graph.control_predecessors(n));
        if reversed {
            p.reverse();
        }
        p
    };
    let mut visited: std::collections::HashSet<NodeId> = std::collections::HashSet::new();
    let mut order = Vec::with_capacity(graph.len());
    for sink in sinks {
        if !visited.insert(sink) {
            continue;
        }
        // Iterative post-order: (node, its predecessors, next index).
        let mut stack: Vec<(NodeId, Vec<NodeId>, usize)> = vec![(sink, preds(sink), 0)];
        while let Some((n, ps, i)) = stack.last_mut() {
            if let Some(&p) = ps.get(*i) {
                *i += 1;
                if visited.insert(p) {
                    let pp = preds(p);
                    stack.push((p, pp, 0));
                }
            } else {
                order.push(*n);
                stack.pop();
            }
        }
    }
    complete(graph, order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;

    fn is_topological(graph: &Graph, order: &[NodeId]) -> bool {
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        graph.node_ids().all(|n| graph.predecessors(n).all(|p| pos[&p] < pos[&n]))
    }

    #[test]
    fn every_candidate_is_a_topological_order() {
        let t = Tracer::new("g");
        let x = t.input("x", [4, 8]);
        let a = x.relu();
        let b = x.tanh();
        let c = (&a * &b).matmul(&t.param("w", [8, 3], crate::ir::Init::Zeros));
        t.output("y", &c.sum(-1, false));
        t.output("z", &a.reshape([32]));
        let g = t.finish().unwrap();
        for c in candidates(&g).unwrap() {
            assert_eq!(c.order.len(), g.len(), "{}", c.name);
            assert!(is_topological(&g, &c.order), "{}", c.name);
        }
    }
}
