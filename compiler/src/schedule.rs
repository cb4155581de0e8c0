//! The execution order: a topological order of data and control edges that, among the nodes
//! ready at each point, takes the earliest traced one — program order whenever it is legal, so
//! plans read like the model's source.

use crate::error::{CompileError, Result};
use crate::ir::{Graph, NodeId};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

pub fn schedule(graph: &Graph) -> Result<Vec<NodeId>> {
    let mut pending: HashMap<NodeId, usize> =
        graph.node_ids().map(|n| (n, graph.predecessors(n).count())).collect();
    let mut ready: BinaryHeap<Reverse<NodeId>> =
        pending.iter().filter(|(_, c)| **c == 0).map(|(n, _)| Reverse(*n)).collect();
    let mut order = Vec::with_capacity(graph.len());
    while let Some(Reverse(n)) = ready.pop() {
        order.push(n);
        for s in graph.successors(n) {
            let c = pending.get_mut(&s).expect("successor in graph");
            *c -= 1;
            if *c == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() != graph.len() {
        return Err(CompileError::Internal(format!("graph {:?} has a cycle", graph.name())));
    }
    Ok(order)
}
