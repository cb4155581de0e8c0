use super::{Changes, Pass};
use crate::error::{CompileError, Result};
use crate::ir::{Graph, Node, NodeId, Op};
use std::collections::HashMap;

/// Where an op reads a value that lives on another device, a copy to the reader's device is
/// inserted (one per value and destination device, shared by all readers there). The copy is
/// an ordinary step with a buffer of its own, planned like any other.
pub struct InsertTransfers;

impl Pass for InsertTransfers {
    fn name(&self) -> &'static str {
        "insert_transfers"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let mut moved = 0;
        let mut copies: HashMap<(NodeId, u32), NodeId> = HashMap::new();
        let ids: Vec<NodeId> = graph.node_ids().collect();
        for n in ids {
            let device = graph.node(n).device;
            let operands = graph.operands(n);
            for (i, &o) in operands.iter().enumerate() {
                let source = graph.node(o).clone();
                if source.device == device {
                    continue;
                }
                if graph.node(n).op.mutated_operands().contains(&i) {
                    return Err(CompileError::invalid(
                        format!(
                            "{} on device {} updates {} on device {}",
                            graph.node(n).describe(),
                            device.0,
                            source.describe(),
                            source.device.0
                        ),
                        "an update must run on its variable's device",
                    ));
                }
                let copy = *copies.entry((o, device.0)).or_insert_with(|| {
                    let to = format!("to device {}", device.0);
                    let node = Node {
                        op: Op::Copy,
                        shape: source.shape.clone(),
                        dtype: source.dtype,
                        device,
                        name: Some(source.name.as_ref().map_or(to.clone(), |s| format!("{s} {to}"))),
                        origin: source.origin,
                    };
                    graph.add(node, &[o])
                });
                graph.replace_operand(n, i, copy);
                moved += 1;
            }
        }
        Ok(Changes::count(moved))
    }
}
