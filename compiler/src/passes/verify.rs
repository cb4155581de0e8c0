use super::{Changes, Pass};
use crate::error::{CompileError, Result};
use crate::ir::{self, Graph};

/// Re-derives every node's shape and dtype from its op and operands, and checks that the graph
/// has no cycle: a graph built or rewritten by hand is held to the tracer's rules.
pub struct Verify;

impl Pass for Verify {
    fn name(&self) -> &'static str {
        "verify"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        for id in graph.node_ids() {
            let node = graph.node(id);
            let operands = graph.operands(id);
            let types: Vec<_> =
                operands.iter().map(|&o| (&graph.node(o).shape, graph.node(o).dtype)).collect();
            let (shape, dtype) = ir::infer(&node.op, &types).map_err(|e| {
                CompileError::Internal(format!("{} ({}): {}", node.describe(), node.op.label(), e.message))
            })?;
            if shape != node.shape || dtype != node.dtype {
                return Err(CompileError::Internal(format!(
                    "{} is typed {}{} but its operands give {}{}",
                    node.describe(),
                    node.dtype,
                    node.shape,
                    dtype,
                    shape
                )));
            }
        }
        if petgraph::algo::is_cyclic_directed(graph.petgraph()) {
            return Err(CompileError::Internal(format!("graph {:?} has a cycle", graph.name())));
        }
        Ok(Changes::default())
    }
}
