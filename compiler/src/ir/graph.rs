//! The dataflow graph: a petgraph `StableDiGraph` whose nodes are ops with their output type and
//! whose edges are operands (numbered) or control dependencies (ordering only).

use super::{DType, Op, Shape};
use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::panic::Location;

/// A node's index in a `Graph`: petgraph's stable index, which stays valid when other nodes are
/// removed (a removed node's index may be reused by a later node).
pub type NodeId = NodeIndex<u32>;

/// Index of a device in the list a graph is compiled for (0 is the default device).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceId(pub u32);

/// Where in the user's source an op was traced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SourceLoc {
    /// The source file's path, as `std::panic::Location::file` gives it.
    pub file: &'static str,
    /// The line, counted from 1.
    pub line: u32,
    /// The column, counted from 1.
    pub column: u32,
}

impl From<&'static Location<'static>> for SourceLoc {
    fn from(l: &'static Location<'static>) -> Self {
        SourceLoc { file: l.file(), line: l.line(), column: l.column() }
    }
}

impl fmt::Display for SourceLoc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// One op of a graph with its output's type, its device and where it came from.
#[derive(Clone, Debug)]
pub struct Node {
    /// The operation and its attributes.
    pub op: Op,
    /// The output's shape (a scalar for effects, which produce no tensor).
    pub shape: Shape,
    /// The output's element type.
    pub dtype: DType,
    /// The device the op runs on and its output lives on.
    pub device: DeviceId,
    /// A name given by the user (`Tensor::named`) or a pass, which dumps, plans and memory reports
    /// show; None: the node is described by its op.
    pub name: Option<String>,
    /// Where the user's source traced the op; None for nodes that passes made without one.
    pub origin: Option<SourceLoc>,
}

impl Node {
    /// Bytes of the node's output tensor (0 for effects, which produce none).
    pub fn bytes(&self) -> usize {
        if self.op.is_effect() { 0 } else { self.shape.numel() * self.dtype.size_bytes() }
    }

    /// The node as error messages and reports name it: its name, else its op.
    pub fn describe(&self) -> String {
        match (&self.name, &self.op) {
            (Some(n), _) => format!("{} `{n}`", self.op.name()),
            (None, Op::Variable { key, .. }) => format!("variable `{key}`"),
            (None, Op::Input { name, .. }) => format!("input `{name}`"),
            (None, op) => op.name().to_string(),
        }
    }
}

/// What an edge from one node to another means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Edge {
    /// The source node is operand `i` of the target.
    Operand(u32),
    /// The target must run after the source; no data flows.
    Control,
}

/// A named dataflow graph: nodes (ops with their output types), operand and control edges between
/// them, named outputs, and the values of its constant variables.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    name: String,
    g: StableDiGraph<Node, Edge>,
    outputs: Vec<(String, NodeId)>,
    /// The values of the graph's constant variables (`VarRole::Constant`, made by
    /// `const_fold`), by key: shared, not copied, when the graph is cloned.
    constants: std::collections::BTreeMap<String, std::sync::Arc<[f32]>>,
}

impl Graph {
    /// An empty graph named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Graph { name: name.into(), ..Default::default() }
    }

    /// The graph's name, as dumps and plans show it (`seed/forward`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Records the values of constant variable `key` (row-major f32).
    pub fn set_constant(&mut self, key: impl Into<String>, values: std::sync::Arc<[f32]>) {
        self.constants.insert(key.into(), values);
    }

    /// The values of constant variable `key`, if the graph holds them.
    pub fn constant(&self, key: &str) -> Option<&std::sync::Arc<[f32]>> {
        self.constants.get(key)
    }

    /// Renames the graph.
    pub fn set_name(&mut self, name: impl Into<String>) {
        self.name = name.into();
    }

    /// Adds `node` with `operands` in order. Shapes are not checked here: the tracer and
    /// `passes::verify` do that.
    pub fn add(&mut self, node: Node, operands: &[NodeId]) -> NodeId {
        let id = self.g.add_node(node);
        for (i, &o) in operands.iter().enumerate() {
            self.g.add_edge(o, id, Edge::Operand(i as u32));
        }
        id
    }

    /// Makes `after` run after `before` without data flowing between them; nothing if `before` is
    /// `after` or such an edge exists already. Whether it added the edge.
    pub fn add_control(&mut self, before: NodeId, after: NodeId) -> bool {
        let new =
            before != after && !self.g.edges_connecting(before, after).any(|e| *e.weight() == Edge::Control);
        if new {
            self.g.add_edge(before, after, Edge::Control);
        }
        new
    }

    /// Node `id`; panics if it is not in the graph.
    pub fn node(&self, id: NodeId) -> &Node {
        &self.g[id]
    }

    /// Node `id`, to change in place; panics if it is not in the graph.
    pub fn node_mut(&mut self, id: NodeId) -> &mut Node {
        &mut self.g[id]
    }

    /// Whether node `id` is in the graph (added and not removed).
    pub fn contains(&self, id: NodeId) -> bool {
        self.g.contains_node(id)
    }

    /// The number of nodes.
    pub fn len(&self) -> usize {
        self.g.node_count()
    }

    /// Whether the graph has no node.
    pub fn is_empty(&self) -> bool {
        self.g.node_count() == 0
    }

    /// Node ids in insertion order (a topological order for traced graphs).
    pub fn node_ids(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.g.node_indices()
    }

    /// `roots` and every node they depend on (through operands and control edges).
    pub fn ancestors(&self, roots: &[NodeId]) -> std::collections::HashSet<NodeId> {
        let mut seen: std::collections::HashSet<NodeId> = roots.iter().copied().collect();
        let mut stack: Vec<NodeId> = seen.iter().copied().collect();
        while let Some(n) = stack.pop() {
            for p in self.predecessors(n) {
                if seen.insert(p) {
                    stack.push(p);
                }
            }
        }
        seen
    }

    /// Operands of `id` in operand order.
    pub fn operands(&self, id: NodeId) -> Vec<NodeId> {
        let mut ops: Vec<(u32, NodeId)> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .filter_map(|e| match e.weight() {
                Edge::Operand(i) => Some((*i, e.source())),
                Edge::Control => None,
            })
            .collect();
        ops.sort_unstable_by_key(|(i, _)| *i);
        ops.into_iter().map(|(_, n)| n).collect()
    }

    /// Nodes that read `id` as an operand, each once, in id order.
    pub fn users(&self, id: NodeId) -> Vec<NodeId> {
        let mut users: Vec<NodeId> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .filter(|e| matches!(e.weight(), Edge::Operand(_)))
            .map(|e| e.target())
            .collect();
        users.sort_unstable();
        users.dedup();
        users
    }

    /// Nodes that must run before `id` without feeding it data.
    pub fn control_predecessors(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .g
            .edges_directed(id, Direction::Incoming)
            .filter(|e| *e.weight() == Edge::Control)
            .map(|e| e.source())
            .collect();
        v.sort_unstable();
        v
    }

    /// Nodes that must run after `id` without reading it.
    pub fn control_successors(&self, id: NodeId) -> Vec<NodeId> {
        let mut v: Vec<NodeId> = self
            .g
            .edges_directed(id, Direction::Outgoing)
            .filter(|e| *e.weight() == Edge::Control)
            .map(|e| e.target())
            .collect();
        v.sort_unstable();
        v
    }

    /// Every node that must run before `id`: operands and control predecessors.
    pub fn predecessors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.g.neighbors_directed(id, Direction::Incoming)
    }

    /// Every node that must run after `id`.
    pub fn successors(&self, id: NodeId) -> impl Iterator<Item = NodeId> + '_ {
        self.g.neighbors_directed(id, Direction::Outgoing)
    }

    /// Points every operand edge that reads `old` at `new` instead.
    pub fn replace_uses(&mut self, old: NodeId, new: NodeId) {
        let edges: Vec<_> = self
            .g
            .edges_directed(old, Direction::Outgoing)
            .filter_map(|e| match e.weight() {
                Edge::Operand(i) => Some((e.id(), e.target(), *i)),
                Edge::Control => None,
            })
            .collect();
        for (e, target, i) in edges {
            if target == new {
                continue;
            }
            self.g.remove_edge(e);
            self.g.add_edge(new, target, Edge::Operand(i));
        }
        for (_, o) in &mut self.outputs {
            if *o == old {
                *o = new;
            }
        }
    }

    /// Makes operand `index` of `node` read `new` instead.
    pub fn replace_operand(&mut self, node: NodeId, index: usize, new: NodeId) {
        let edge = self
            .g
            .edges_directed(node, Direction::Incoming)
            .find(|e| *e.weight() == Edge::Operand(index as u32))
            .map(|e| e.id());
        if let Some(e) = edge {
            self.g.remove_edge(e);
            self.g.add_edge(new, node, Edge::Operand(index as u32));
        }
    }

    /// Makes `node` read `operands`, in order. Edges from sources it already reads are kept, with
    /// their operand index updated, so that a source with many readers (an optimizer's
    /// iteration counter, read by every update) is never walked; edges from sources it no
    /// longer reads are removed.
    pub fn set_operands(&mut self, node: NodeId, operands: &[NodeId]) {
        let existing: Vec<(petgraph::stable_graph::EdgeIndex, NodeId)> = self
            .g
            .edges_directed(node, Direction::Incoming)
            .filter(|e| matches!(e.weight(), Edge::Operand(_)))
            .map(|e| (e.id(), e.source()))
            .collect();
        let mut kept = vec![false; existing.len()];
        for (i, &o) in operands.iter().enumerate() {
            match (0..existing.len()).find(|&j| !kept[j] && existing[j].1 == o) {
                Some(j) => {
                    kept[j] = true;
                    if let Some(w) = self.g.edge_weight_mut(existing[j].0) {
                        *w = Edge::Operand(i as u32);
                    }
                }
                None => {
                    self.g.add_edge(o, node, Edge::Operand(i as u32));
                }
            }
        }
        for (j, &(e, _)) in existing.iter().enumerate() {
            if !kept[j] {
                self.g.remove_edge(e);
            }
        }
    }

    /// The graph renumbered: its nodes re-added in a topological order (of data and control
    /// edges) that keeps insertion order wherever the edges allow, so that ids are dense and
    /// every operand's id is below its user's, as in a freshly traced graph (what autodiff
    /// needs after a pass removed or appended nodes, `step::train_step_graph_in_blocks`). Outputs,
    /// constants and the name are kept. `None` for a graph with a cycle.
    pub fn compacted(&self) -> Option<Graph> {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, HashMap};
        let mut pending: HashMap<NodeId, usize> =
            self.node_ids().map(|n| (n, self.g.neighbors_directed(n, Direction::Incoming).count())).collect();
        let mut ready: BinaryHeap<Reverse<NodeId>> =
            pending.iter().filter(|(_, c)| **c == 0).map(|(n, _)| Reverse(*n)).collect();
        let mut new_id: HashMap<NodeId, NodeId> = HashMap::new();
        let mut out =
            Graph { name: self.name.clone(), constants: self.constants.clone(), ..Default::default() };
        while let Some(Reverse(n)) = ready.pop() {
            let operands: Vec<NodeId> = self.operands(n).iter().map(|o| new_id[o]).collect();
            let id = out.add(self.g[n].clone(), &operands);
            for c in self.control_predecessors(n) {
                out.add_control(new_id[&c], id);
            }
            new_id.insert(n, id);
            for e in self.g.edges_directed(n, Direction::Outgoing) {
                let t = e.target();
                let left = pending.get_mut(&t)?;
                *left -= 1;
                if *left == 0 {
                    ready.push(Reverse(t));
                }
            }
        }
        if new_id.len() != self.len() {
            return None;
        }
        out.outputs = self.outputs.iter().map(|(name, o)| (name.clone(), new_id[o])).collect();
        Some(out)
    }

    /// Removes node `id`, its edges and any output that names it; the node, or None if it was not
    /// in the graph.
    pub fn remove(&mut self, id: NodeId) -> Option<Node> {
        self.outputs.retain(|(_, o)| *o != id);
        self.g.remove_node(id)
    }

    /// The named outputs, (name, node), in the order they were first set.
    pub fn outputs(&self) -> &[(String, NodeId)] {
        &self.outputs
    }

    /// The named outputs, to rename, reorder or drop in place.
    pub fn outputs_mut(&mut self) -> &mut Vec<(String, NodeId)> {
        &mut self.outputs
    }

    /// Names `id` as a graph output (replacing an output of the same name).
    pub fn set_output(&mut self, name: impl Into<String>, id: NodeId) {
        let name = name.into();
        match self.outputs.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = id,
            None => self.outputs.push((name, id)),
        }
    }

    /// The node of the output named `name`, if any.
    pub fn output(&self, name: &str) -> Option<NodeId> {
        self.outputs.iter().find(|(n, _)| n == name).map(|(_, id)| *id)
    }

    fn filter(&self, f: impl Fn(&Op) -> bool) -> Vec<NodeId> {
        self.node_ids().filter(|&n| f(&self.g[n].op)).collect()
    }

    /// `Input` nodes in insertion order.
    pub fn inputs(&self) -> Vec<NodeId> {
        self.filter(|op| matches!(op, Op::Input { .. }))
    }

    /// The first `Input` node fed under `name`, in insertion order, if any.
    pub fn input(&self, name: &str) -> Option<NodeId> {
        self.node_ids().find(|&n| matches!(&self.g[n].op, Op::Input { name: m, .. } if m == name))
    }

    /// `Variable` nodes in insertion order.
    pub fn variables(&self) -> Vec<NodeId> {
        self.filter(|op| matches!(op, Op::Variable { .. }))
    }

    /// The first `Variable` node with key `key`, in insertion order, if any.
    pub fn variable(&self, key: &str) -> Option<NodeId> {
        self.node_ids().find(|&n| matches!(&self.g[n].op, Op::Variable { key: k, .. } if k == key))
    }

    /// Effect nodes (optimizer updates) in insertion order.
    pub fn effects(&self) -> Vec<NodeId> {
        self.filter(Op::is_effect)
    }

    /// The underlying petgraph graph, for its algorithms (toposort, visits).
    pub fn petgraph(&self) -> &StableDiGraph<Node, Edge> {
        &self.g
    }
}

#[cfg(test)]
impl Graph {
    /// A test's f32 node on device 0, added with its operands.
    pub(crate) fn add_f32(&mut self, op: Op, dims: &[usize], operands: &[NodeId]) -> NodeId {
        let shape = Shape::new(dims.to_vec());
        self.add(
            Node { op, shape, dtype: DType::F32, device: DeviceId(0), name: None, origin: None },
            operands,
        )
    }

    /// A test's f32 input.
    pub(crate) fn add_input(&mut self, name: &str, dims: &[usize]) -> NodeId {
        let op = Op::Input { name: name.into(), shape: Shape::new(dims.to_vec()), dtype: DType::F32 };
        self.add_f32(op, dims, &[])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_operands_keeps_reorders_adds_and_drops_edges() {
        let mut g = Graph::new("g");
        let s = Shape::new([2]);
        let node = |name: &str| Node {
            op: Op::Input { name: name.into(), shape: s.clone(), dtype: DType::F32 },
            shape: s.clone(),
            dtype: DType::F32,
            device: DeviceId(0),
            name: None,
            origin: None,
        };
        let [x, y, z, w] = ["x", "y", "z", "w"].map(|n| g.add(node(n), &[]));
        let sum = g.add(Node { op: Op::Concat { axis: 0 }, ..node("sum") }, &[x, y, z]);
        g.add_control(w, sum);
        g.set_operands(sum, &[x, w, z, z]);
        assert_eq!(g.operands(sum), [x, w, z, z]);
        assert!(g.users(y).is_empty());
        assert_eq!(g.users(w), [sum]);
        assert_eq!(g.control_predecessors(sum), [w], "control edges are left alone");
    }

    #[test]
    fn a_compacted_graph_is_dense_and_operands_first() {
        let mut g = Graph::new("g");
        let x = g.add_input("x", &[2]);
        let gone = g.add_f32(Op::Unary(crate::ir::UnaryOp::Neg), &[2], &[x]);
        let late = g.add_input("late", &[2]);
        // A user added before one of its operands, as a pass that appends nodes leaves it.
        let sum = g.add_f32(Op::Binary(crate::ir::BinaryOp::Add), &[2], &[x, x]);
        let neg = g.add_f32(Op::Unary(crate::ir::UnaryOp::Neg), &[2], &[late]);
        g.set_operands(sum, &[x, neg]);
        g.add_control(late, sum);
        g.remove(gone);
        g.set_output("y", sum);
        let c = g.compacted().expect("acyclic");
        assert_eq!(c.len(), 4);
        let ids: Vec<usize> = c.node_ids().map(|n| n.index()).collect();
        assert_eq!(ids, [0, 1, 2, 3], "dense");
        for n in c.node_ids() {
            assert!(c.predecessors(n).all(|p| p < n), "operands and control edges first");
        }
        let y = c.output("y").unwrap();
        assert!(matches!(c.node(y).op, Op::Binary(_)));
        assert_eq!(c.control_predecessors(y).len(), 1);
    }
}
