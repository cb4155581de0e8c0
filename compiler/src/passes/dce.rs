use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, NodeId};
use std::collections::HashSet;

/// Removes every node that no output and no effect depends on. Inputs stay, so a caller can feed
/// every input it declared.
pub struct DeadCode;

impl Pass for DeadCode {
    fn name(&self) -> &'static str {
        "dead_code"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        let mut live: HashSet<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
        live.extend(graph.effects());
        live.extend(graph.inputs());
        let mut stack: Vec<NodeId> = live.iter().copied().collect();
        while let Some(n) = stack.pop() {
            for p in graph.predecessors(n).collect::<Vec<_>>() {
                if live.insert(p) {
                    stack.push(p);
                }
            }
        }
        let dead: Vec<NodeId> = graph.node_ids().filter(|n| !live.contains(n)).collect();
        for n in dead {
            graph.remove(n);
        }
        Ok(())
    }
}
