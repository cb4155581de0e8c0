//! Reverse-mode automatic differentiation as a graph-to-graph pass.
//!
//! `gradients` appends the backward graph to the forward graph: every gradient is an ordinary node,
//! scheduled, planned and executed like any other, so the backward pass's memory is in the plan.
//! The vector-Jacobian product of each op lives in `rules`; contributions to a value used several
//! times are summed.

mod rules;

use crate::error::{CompileError, Result};
use crate::ir::{Graph, NodeId, Shape};
use crate::trace::{Tensor, Tracer};
use std::collections::{HashMap, HashSet};

/// Appends d`loss`/d`wrt[i]` to `graph`. `loss` must hold one element. A `wrt` node the loss does
/// not depend on gets `None`.
pub fn gradients(graph: Graph, loss: NodeId, wrt: &[NodeId]) -> Result<(Graph, Vec<Option<NodeId>>)> {
    let loss_node = graph.node(loss);
    if loss_node.shape.numel() != 1 {
        return Err(CompileError::invalid(
            format!("the loss must be a scalar, but {} has shape {}", loss_node.describe(), loss_node.shape),
            "reduce it first, e.g. with `.mean(.., false)`",
        ));
    }
    if petgraph::visit::NodeIndexable::node_bound(graph.petgraph()) != graph.len() {
        // New nodes would reuse removed nodes' indices, and the backward nodes of an op are
        // recognised by their indices (to attribute them to the op).
        return Err(CompileError::invalid(
            "cannot differentiate a graph that nodes were removed from",
            "differentiate the traced graph before running passes on it",
        ));
    }
    let relevant = relevant_nodes(&graph, loss, wrt);
    // Traced graphs are built operands-first, so reverse insertion order visits every node after
    // all of its users. Verify rather than assume.
    let order: Vec<NodeId> = graph.node_ids().filter(|n| relevant.contains(n)).collect();
    let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    for &n in &order {
        if graph.operands(n).iter().any(|o| relevant.contains(o) && position[o] > position[&n]) {
            return Err(CompileError::Internal("graph is not in topological insertion order".into()));
        }
    }

    let wanted: HashSet<NodeId> = wrt.iter().copied().collect();
    let tracer = Tracer::resume(graph);
    let mut grads: HashMap<NodeId, Tensor> = HashMap::new();
    grads.insert(loss, tracer.fill(1.0, tracer.tensor(loss).shape().clone()));
    for &n in order.iter().rev() {
        let Some(g) = grads.remove(&n) else { continue };
        if wanted.contains(&n) {
            grads.insert(n, g.clone());
        }
        let operands = tracer.with_graph(|gr| gr.operands(n));
        let ins: Vec<Tensor> = operands.iter().map(|&o| tracer.tensor(o)).collect();
        let out = tracer.tensor(n);
        let (op, device) = tracer.with_graph(|gr| (gr.node(n).op.clone(), gr.node(n).device));
        let first_new = tracer.with_graph(|gr| gr.node_ids().last()).map_or(0, |id| id.index() + 1);
        // The backward of an op runs on the op's device.
        let contributions = tracer.on_device(device, || rules::vjp(&op, &ins, &out, &g))?;
        // Its nodes are reported as the op's gradient, at the op's source line.
        tracer.label_since(first_new, n);
        for ((&o, t), c) in operands.iter().zip(&ins).zip(contributions) {
            let Some(c) = c else { continue };
            if !relevant.contains(&o) {
                continue;
            }
            debug_assert_eq!(c.shape(), t.shape(), "gradient of {} operand", op.name());
            // A gradient has its value's type: a half product's f32 accumulation (`DType::
            // accumulated`) reaching a half operand is rounded to it, as the operand would be.
            let c = if c.dtype().is_float() && t.dtype().is_float() { c.cast(t.dtype()) } else { c };
            // Contributions are summed where the value they belong to lives.
            let total = match grads.remove(&o) {
                Some(prev) => tracer.on_device(t.device(), || &prev + &c),
                None => c,
            };
            grads.insert(o, total);
        }
    }
    let result: Vec<Option<NodeId>> = wrt.iter().map(|w| grads.get(w).and_then(Tensor::id)).collect();
    let graph = tracer.finish()?;
    Ok((graph, result))
}

/// Nodes on some path from a `wrt` node to `loss`.
fn relevant_nodes(graph: &Graph, loss: NodeId, wrt: &[NodeId]) -> HashSet<NodeId> {
    let mut ancestors = HashSet::from([loss]);
    let mut stack = vec![loss];
    while let Some(n) = stack.pop() {
        for o in graph.operands(n) {
            if ancestors.insert(o) {
                stack.push(o);
            }
        }
    }
    let mut reach: HashSet<NodeId> = wrt.iter().copied().filter(|w| ancestors.contains(w)).collect();
    let mut stack: Vec<NodeId> = reach.iter().copied().collect();
    while let Some(n) = stack.pop() {
        for u in graph.users(n) {
            if ancestors.contains(&u) && reach.insert(u) {
                stack.push(u);
            }
        }
    }
    reach
}

/// Sums `g` over the axes along which `shape` was broadcast to `g`'s shape.
#[track_caller]
pub(crate) fn sum_to(g: &Tensor, shape: &Shape) -> Tensor {
    if g.shape() == shape {
        return g.clone();
    }
    let lead = g.rank() - shape.rank();
    let axes: Vec<usize> =
        (0..g.rank()).filter(|&i| i < lead || (shape.dims()[i - lead] == 1 && g.dims()[i] != 1)).collect();
    let summed = if axes.is_empty() { g.clone() } else { g.sum(axes, true) };
    if summed.shape() == shape { summed } else { summed.reshape(shape.clone()) }
}
