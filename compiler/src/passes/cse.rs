use super::{Changes, Pass};
use crate::error::Result;
use crate::ir::{Graph, NodeId, OpClass};
use std::collections::HashMap;

/// Merges nodes that apply the same op to the same operands (autodiff and losses build many
/// identical constants and masks). Sources, effects and nodes with control edges are left alone.
pub struct CommonSubexpressions;

impl Pass for CommonSubexpressions {
    fn name(&self) -> &'static str {
        "cse"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let mut seen: HashMap<(String, Vec<NodeId>, String), NodeId> = HashMap::new();
        let ids: Vec<NodeId> = graph.node_ids().collect();
        let mut merged = 0;
        for id in ids {
            let node = graph.node(id);
            if matches!(node.op.class(), OpClass::Source | OpClass::Effect)
                || !graph.control_predecessors(id).is_empty()
            {
                continue;
            }
            let key =
                (format!("{:?}", node.op), graph.operands(id), format!("{}{:?}", node.dtype, node.device));
            match seen.get(&key) {
                Some(&first) => {
                    let name = graph.node(id).name.clone();
                    graph.replace_uses(id, first);
                    if graph.node(first).name.is_none() {
                        graph.node_mut(first).name = name;
                    }
                    graph.remove(id);
                    merged += 1;
                }
                None => {
                    seen.insert(key, id);
                }
            }
        }
        Ok(Changes::count(merged))
    }
}
