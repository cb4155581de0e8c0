//! A stable, readable text form of a graph, one node a line in insertion order:
//!
//! ```text
//! graph "seed/forward" (7 nodes)
//!   %0 = input "x" : f32[32, 100]
//!   %2 = matmul(%0, %1) : f32[32, 10]
//! outputs: y = %6
//! ```
//! Nodes are numbered densely in insertion order, so removing a node renumbers those after it
//! and the dump stays independent of petgraph's index reuse.

use super::{DeviceId, Graph, NodeId};
use std::collections::HashMap;
use std::fmt::Write;

/// The text form of `graph`: a header with its name and node count, one line per node in
/// insertion order, numbered densely from `%0`
/// (`%i = label(operands) after(control) : dtype shape`, `: effect` for effects, then
/// `@deviceN` off device 0 and `# name` for a named node), then the named outputs.
pub fn dump(graph: &Graph) -> String {
    let number: HashMap<NodeId, usize> = graph.node_ids().enumerate().map(|(i, n)| (n, i)).collect();
    let name = |n: &NodeId| format!("%{}", number[n]);
    let mut out = String::new();
    let _ = writeln!(out, "graph {:?} ({} nodes)", graph.name(), graph.len());
    for id in graph.node_ids() {
        let node = graph.node(id);
        let _ = write!(out, "  {} = {}", name(&id), node.op.label());
        let operands = graph.operands(id);
        if !operands.is_empty() {
            let list: Vec<String> = operands.iter().map(name).collect();
            let _ = write!(out, "({})", list.join(", "));
        }
        let after = graph.control_predecessors(id);
        if !after.is_empty() {
            let list: Vec<String> = after.iter().map(name).collect();
            let _ = write!(out, " after({})", list.join(", "));
        }
        if node.op.is_effect() {
            out.push_str(" : effect");
        } else {
            let _ = write!(out, " : {}{}", node.dtype, node.shape);
        }
        if node.device != DeviceId::default() {
            let _ = write!(out, " @device{}", node.device.0);
        }
        if let Some(n) = &node.name {
            let _ = write!(out, "  # {n}");
        }
        out.push('\n');
    }
    if !graph.outputs().is_empty() {
        let list: Vec<String> = graph.outputs().iter().map(|(n, id)| format!("{n} = {}", name(id))).collect();
        let _ = writeln!(out, "outputs: {}", list.join(", "));
    }
    out
}
