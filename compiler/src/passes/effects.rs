use super::Pass;
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op, OpClass};

/// An effect writes a variable in place, so it must run after every other reader of that
/// variable's storage — including the readers of views (reshapes) of it. This pass adds those
/// control edges (write-after-read ordering). Updates of disjoint blocks of rows of the same
/// variable (`tiled_updates`) touch different elements and are not ordered against each other.
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
                    if reader != effect
                        && !disjoint_blocks(graph, reader, effect)
                        && !gathers_after(graph, reader, effect)
                    {
                        graph.add_control(reader, effect);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `reader` is the all-gather that follows the sharded update `effect` of the same
/// variable (`zero`): it reads the shard the update writes, so it runs after it, not before.
fn gathers_after(graph: &Graph, reader: NodeId, effect: NodeId) -> bool {
    matches!(graph.node(reader).op, Op::AllGather { .. })
        && graph.node(effect).op.is_effect()
        && graph.node(effect).op.shard().is_some()
}

/// Whether `a` and `b` are updates of disjoint blocks of rows.
fn disjoint_blocks(graph: &Graph, a: NodeId, b: NodeId) -> bool {
    let rows = |n: NodeId| match graph.node(n).op {
        Op::ApplyAdam { rows, .. } | Op::ApplySgd { rows, .. } => rows,
        _ => None,
    };
    match (rows(a), rows(b)) {
        (Some(x), Some(y)) => {
            let (xe, ye) = (x.start.saturating_add(x.len), y.start.saturating_add(y.len));
            xe <= y.start || ye <= x.start
        }
        _ => false,
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
