//! Buffers and their lifetimes over a schedule.
//!
//! Every value gets a buffer: variables their persistent storage, everything else an arena buffer
//! live from the step that writes it to the last step that reads it. One arena means one arena:
//! a graph input is an arena buffer live from the first step (it is written before the run) to
//! its last reader, a graph output one live from its producer to the last step (it is read after
//! the run), so an input's bytes are reused once it is read and an output's are free until it is
//! made. Two rules let values share a buffer:
//! - a view (`reshape`) is its operand's buffer with another shape;
//! - an elementwise op writes in place into an operand of its own shape whose buffer dies at that
//!   op (its last reader, views of it included, is this op).
//!
//! Steps are the nodes that run a kernel: everything but inputs, variables and views. A step
//! whose kernel uses scratch (`crate::scratch`) gets one more buffer, live at that step alone.

use crate::error::{CompileError, Result};
use crate::ir::{DeviceId, Graph, NodeId, Op, OpClass};
use crate::scratch::Scratch;
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageClass {
    Arena,
    Input(String),
    Output(String),
    Variable(String),
    /// A step's scratch (`crate::scratch`): live at its step only, no value's storage.
    Scratch,
}

impl StorageClass {
    /// Whether the planner places the buffer in the arena: everything but variables.
    pub fn in_arena(&self) -> bool {
        !matches!(self, StorageClass::Variable(_))
    }
}

#[derive(Clone, Debug)]
pub struct BufferLife {
    pub bytes: usize,
    pub class: StorageClass,
    /// The device whose memory holds the buffer (its producer's device).
    pub device: DeviceId,
    /// First and last step (inclusive) at which the buffer holds a live value.
    pub start: usize,
    pub end: usize,
    /// The node whose value first occupies the buffer.
    pub producer: NodeId,
}

#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// The nodes that run, in order: step `i` runs `steps[i]`.
    pub steps: Vec<NodeId>,
    pub buffers: Vec<BufferLife>,
    /// The buffer of every node's value (effects have none).
    pub buffer_of: HashMap<NodeId, usize>,
    /// Steps that write into an operand's buffer.
    pub in_place: HashSet<NodeId>,
    /// The scratch buffer of every step that has one.
    pub scratch_of: HashMap<NodeId, usize>,
}

impl Liveness {
    /// Every arena value with its bytes, before any sharing: the "naive" figure (the graph's
    /// inputs, then every step's value, then every step's scratch).
    pub fn naive_values<'a>(&'a self, graph: &'a Graph) -> impl Iterator<Item = (NodeId, usize)> + 'a {
        let inputs =
            self.buffers.iter().filter(|b| matches!(b.class, StorageClass::Input(_))).map(|b| b.producer);
        let scratch =
            self.buffers.iter().filter(|b| b.class == StorageClass::Scratch).map(|b| (b.producer, b.bytes));
        inputs
            .chain(self.steps.iter().copied().filter(move |&n| self.is_arena(n)))
            .map(move |n| (n, graph.node(n).bytes()))
            .chain(scratch)
    }

    fn is_arena(&self, n: NodeId) -> bool {
        self.buffer_of.get(&n).is_some_and(|&b| self.buffers[b].class.in_arena())
    }
}

/// The buffers of `graph` run in `order`, with each step's scratch as `scratch` gives it.
pub fn analyze(graph: &Graph, order: &[NodeId], scratch: &Scratch) -> Result<Liveness> {
    let is_step = |n: NodeId| !matches!(graph.node(n).op.class(), OpClass::Source | OpClass::View);
    let steps: Vec<NodeId> = order.iter().copied().filter(|&n| is_step(n)).collect();
    let step_of: HashMap<NodeId, usize> = steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let last = steps.len().saturating_sub(1);

    // The last step that reads each value's storage, through views: computed in reverse order
    // so that a view's readers are known before its operand's.
    let mut reads_until: HashMap<NodeId, Option<usize>> = HashMap::new();
    for &n in order.iter().rev() {
        let mut end: Option<usize> = None;
        for u in graph.users(n) {
            let e =
                if graph.node(u).op.class() == OpClass::View { reads_until[&u] } else { Some(step_of[&u]) };
            end = end.max(e);
        }
        reads_until.insert(n, end);
    }

    let outputs: HashMap<NodeId, &str> =
        graph.outputs().iter().map(|(name, id)| (*id, name.as_str())).collect();
    let mut live = Liveness { steps, ..Default::default() };
    for &n in order {
        let node = graph.node(n);
        let new = |class: StorageClass, start: usize, end: usize| BufferLife {
            bytes: node.bytes(),
            class,
            device: node.device,
            start,
            end,
            producer: n,
        };
        let buffer = match &node.op {
            _ if node.op.is_effect() => None,
            Op::Input { name, .. } => {
                Some(new(StorageClass::Input(name.clone()), 0, reads_until[&n].unwrap_or(0)))
            }
            Op::Variable { key, .. } => Some(new(StorageClass::Variable(key.clone()), 0, last)),
            Op::Reshape { .. } => {
                let operand = graph.operands(n)[0];
                let b = live.buffer_of[&operand];
                live.buffer_of.insert(n, b);
                None
            }
            _ => {
                let s = step_of[&n];
                if let Some(name) = outputs.get(&n) {
                    Some(new(StorageClass::Output(name.to_string()), s, last))
                } else if let Some(b) = in_place_target(graph, &live, n, s) {
                    let end = reads_until[&n].unwrap_or(s);
                    live.buffers[b].end = live.buffers[b].end.max(end);
                    live.buffer_of.insert(n, b);
                    live.in_place.insert(n);
                    None
                } else {
                    Some(new(StorageClass::Arena, s, reads_until[&n].unwrap_or(s)))
                }
            }
        };
        if let Some(b) = buffer {
            live.buffer_of.insert(n, live.buffers.len());
            live.buffers.push(b);
        }
        let bytes = scratch.bytes(n);
        if bytes > 0
            && let Some(&s) = step_of.get(&n)
        {
            live.scratch_of.insert(n, live.buffers.len());
            live.buffers.push(BufferLife {
                bytes,
                class: StorageClass::Scratch,
                device: node.device,
                start: s,
                end: s,
                producer: n,
            });
        }
    }
    for (&n, &b) in &live.buffer_of {
        if graph.node(n).op.class() != OpClass::View && live.buffers[b].bytes < graph.node(n).bytes() {
            return Err(CompileError::Internal(format!(
                "{} does not fit its buffer",
                graph.node(n).describe()
            )));
        }
    }
    Ok(live)
}

/// An arena buffer of an operand of `n` (step `s`) with `n`'s shape and dtype whose last reader
/// is `n`, which `n` may write over (`Op::may_write_over`, for every operand read from it).
fn in_place_target(graph: &Graph, live: &Liveness, n: NodeId, s: usize) -> Option<usize> {
    let node = graph.node(n);
    let operands = graph.operands(n);
    let buffer = |o: NodeId| live.buffer_of.get(&o).copied();
    operands.iter().enumerate().find_map(|(i, &o)| {
        let b = buffer(o)?;
        let buf = &live.buffers[b];
        let fits = graph.node(o).shape == node.shape && graph.node(o).dtype == node.dtype;
        // Not into an output (it lives to the end) or a variable; an input may be overwritten
        // once read, since every run is fed anew.
        let reusable = matches!(buf.class, StorageClass::Arena | StorageClass::Input(_));
        // Every operand read from that buffer (the same value twice, or a view of it) must be
        // one the op may write over.
        let allowed = operands
            .iter()
            .enumerate()
            .filter(|&(_, &p)| buffer(p) == Some(b))
            .all(|(j, _)| node.op.may_write_over(j, &node.shape));
        (fits && reusable && allowed && buf.end == s && node.op.may_write_over(i, &node.shape)).then_some(b)
    })
}
