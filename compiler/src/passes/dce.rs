use super::{Changes, Pass};
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

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let mut roots: Vec<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
        roots.extend(graph.effects());
        roots.extend(graph.inputs());
        let live: HashSet<NodeId> = graph.ancestors(&roots);
        let dead: Vec<NodeId> = graph.node_ids().filter(|n| !live.contains(n)).collect();
        let removed = dead.len();
        for n in dead {
            graph.remove(n);
        }
        Ok(Changes::count(removed))
    }
}
