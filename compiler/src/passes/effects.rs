use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, NodeId, OpClass};

/// An effect writes a variable in place, so it must run after every other reader of that
/// variable's storage — including the readers of views (reshapes) of it. This pass adds those
/// control edges (write-after-read ordering).
pub struct OrderEffects;

impl Pass for OrderEffects {
    fn name(&self) -> &'static str {
        "order_effects"
    }

    fn run(&self, graph: &mut Graph) -> Result<()> {
        for effect in graph.effects() {
            let operands = graph.operands(effect);
            let mutated: Vec<NodeId> =
                graph.node(effect).op.mutated_operands().iter().map(|&i| operands[i]).collect();
            for var in mutated {
                for reader in storage_readers(graph, var) {
                    if reader != effect {
                        graph.add_control(reader, effect);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Nodes that read `id`'s storage: its users, and through views the users of those.
fn storage_readers(graph: &Graph, id: NodeId) -> Vec<NodeId> {
    let mut out = Vec::new();
    let mut stack = vec![id];
    while let Some(n) = stack.pop() {
        for u in graph.users(n) {
            if graph.node(u).op.class() == OpClass::View {
                stack.push(u);
            } else {
                out.push(u);
            }
        }
    }
    out
}
