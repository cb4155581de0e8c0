//! Buffers and their lifetimes over a schedule.
//!
//! Every value gets a buffer: variables their persistent storage, everything else an arena buffer
//! live from the step that writes it to the last step that reads it. One arena means one arena:
//! a graph input is an arena buffer live from the first step (it is written before the run) to
//! its last reader, a graph output one live from its producer to the last step (it is read after
//! the run), so an input's bytes are reused once it is read and an output's are free until it is
//! made. Four rules let values share a buffer:
//! - a view (`reshape`) is its operand's buffer with another shape;
//! - an elementwise op writes in place into an operand of its own shape whose buffer dies at that
//!   op (its last reader, views of it included, is this op);
//! - a concatenation whose pieces are its own (each read by the concatenation alone, through
//!   reshapes) is written in place: each piece's producer writes at the piece's offset in the
//!   concatenation's buffer, and the concatenation itself runs nothing (`Views`);
//! - a contiguous slice (one whose axis 0 leads every element it takes) is its operand's buffer
//!   at the slice's offset, read in place.
//!
//! The last two are how a data-parallel step's gradient buckets (`data_parallel`) cost no copy
//! and no second buffer, as DDP's `gradient_as_bucket_view`: every gradient is made inside its
//! bucket, the bucket is reduced in place, and every update reads its gradient from it. They also
//! make a split forward pass's joins free (`batch_blocks`: each block's rows are written where
//! the whole batch's value has them). A value at an offset starts on a `VIEW_ALIGN` boundary
//! (the CUDA kernels load `float4`s); a piece or slice that would not stays a copy.
//!
//! Steps are the nodes that run a kernel: everything but inputs, variables and views. A step
//! whose kernel uses scratch (`crate::scratch`) gets one more buffer, live at that step alone.

use crate::error::{CompileError, Result};
use crate::ir::{DeviceId, Graph, NodeId, Op, OpClass};
use crate::scratch::Scratch;
use std::collections::{HashMap, HashSet};

/// What a buffer holds, and so where it is stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageClass {
    /// An intermediate value: an arena slot, live from its producer to its last reader.
    Arena,
    /// The graph input of that name: an arena slot, live from the first step to its last reader.
    Input(String),
    /// The graph output of that name: an arena slot, live from its producer to the last step.
    Output(String),
    /// The persistent variable of that key: stored outside the arena, live over every step.
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

/// One buffer and the steps it is live over.
#[derive(Clone, Debug)]
pub struct BufferLife {
    /// Its size in bytes, unaligned: its producer's value's (elements × dtype size) or the scratch's.
    pub bytes: usize,
    /// What it holds (and whether the planner places it in the arena).
    pub class: StorageClass,
    /// The device whose memory holds the buffer (its producer's device).
    pub device: DeviceId,
    /// First and last step (inclusive) at which the buffer holds a live value.
    pub start: usize,
    /// The last step (inclusive) at which it holds a live value.
    pub end: usize,
    /// The node whose value first occupies the buffer.
    pub producer: NodeId,
}

/// Every buffer of a scheduled graph with its lifetime, and which buffer each value is in.
#[derive(Clone, Debug, Default)]
pub struct Liveness {
    /// The nodes that run, in order: step `i` runs `steps[i]`.
    pub steps: Vec<NodeId>,
    /// Every buffer; `buffer_of`, `scratch_of` and the planner refer to them by index.
    pub buffers: Vec<BufferLife>,
    /// The buffer of every node's value (effects have none).
    pub buffer_of: HashMap<NodeId, usize>,
    /// Steps that write into an operand's buffer.
    pub in_place: HashSet<NodeId>,
    /// The scratch buffer of every step that has one.
    pub scratch_of: HashMap<NodeId, usize>,
    /// Where a value starts in its buffer, in bytes, when not at 0.
    pub offset_of: HashMap<NodeId, usize>,
}

/// A value at an offset in its buffer starts at a multiple of this many bytes: the CUDA kernels
/// read and write `float4`s (`validate` refuses plans with less).
pub const VIEW_ALIGN: usize = 16;

/// The nodes that are views of another value's buffer beyond reshapes (see the module's doc).
#[derive(Debug, Default)]
pub struct Views {
    /// Concatenations written in place by their pieces' producers: they run nothing.
    pub concats: HashSet<NodeId>,
    /// The producer of each such piece (the root under its reshapes): its concatenation and
    /// the piece's offset in it, in bytes.
    pub pieces: HashMap<NodeId, (NodeId, usize)>,
    /// Contiguous slices read in place: their offset in their operand, in bytes.
    pub slices: HashMap<NodeId, usize>,
}

impl Views {
    /// The views of `graph` (its nodes in `order`).
    pub fn find(graph: &Graph, order: &[NodeId]) -> Views {
        let outputs: HashSet<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
        let mut views = Views::default();
        for &n in order {
            let node = graph.node(n);
            match node.op {
                Op::Concat { axis } if !outputs.contains(&n) && leads(&node.shape, axis) => {
                    if let Some(pieces) = own_pieces(graph, n, &outputs, &views) {
                        views.concats.insert(n);
                        views.pieces.extend(pieces.into_iter().map(|(p, at)| (p, (n, at))));
                    }
                }
                Op::Slice { axis, start, .. } if !outputs.contains(&n) => {
                    let Some(&operand) = graph.operands(n).first() else { continue };
                    let source = graph.node(operand);
                    let row: usize = source.shape.dims()[axis + 1..].iter().product();
                    let at = start * row * source.dtype.size_bytes();
                    let root = views.root(graph, operand);
                    let sourced = graph.node(root).op.class() == OpClass::Source;
                    let split = only_split(graph, operand);
                    if leads(&source.shape, axis) && at.is_multiple_of(VIEW_ALIGN) && !sourced && split {
                        views.slices.insert(n, at);
                    }
                }
                _ => {}
            }
        }
        views
    }

    fn is_empty(&self) -> bool {
        self.concats.is_empty() && self.slices.is_empty()
    }

    /// The views that do not raise the peak of live bytes of `plain` (the buffers without any
    /// of them), each judged on the live bytes the ones before it leave: a concatenation in
    /// place adds, at every step from its first piece to its copy, the bytes of the pieces not
    /// yet made, and saves its copy; a slice in place saves its copy and keeps its operand's
    /// buffer until the slice's last reader.
    fn paying(&self, graph: &Graph, plain: &Liveness) -> Views {
        let steps = plain.steps.len();
        let mut live = vec![0i64; steps + 1];
        for b in plain.buffers.iter().filter(|b| b.class.in_arena()) {
            live[b.start] += b.bytes as i64;
            live[b.end + 1] -= b.bytes as i64;
        }
        let mut profile: Vec<i64> = live
            .iter()
            .scan(0i64, |acc, d| {
                *acc += d;
                Some(*acc)
            })
            .take(steps)
            .collect();
        let peak = profile.iter().copied().max().unwrap_or(0);
        let step_of: HashMap<NodeId, usize> = plain.steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let life = |n: NodeId| plain.buffer_of.get(&n).map(|&b| &plain.buffers[b]);
        let mut chosen = Views::default();
        // Each concatenation's pieces with their offsets.
        let mut pieces_of: HashMap<NodeId, Vec<(NodeId, usize)>> = HashMap::new();
        for (&p, &(c, at)) in &self.pieces {
            pieces_of.entry(c).or_default().push((p, at));
        }
        let mut concats: Vec<NodeId> = self.concats.iter().copied().collect();
        concats.sort_by_key(|n| step_of.get(n).copied().unwrap_or(usize::MAX));
        for c in concats {
            let Some(&at) = step_of.get(&c) else { continue };
            let whole = graph.node(c).bytes() as i64;
            let pieces = pieces_of.get(&c).map_or(&[][..], |v| &v[..]);
            let mut made: Vec<(usize, i64)> = pieces
                .iter()
                .filter_map(|&(p, _)| Some((*step_of.get(&p)?, graph.node(p).bytes() as i64)))
                .collect();
            made.sort_unstable();
            let Some(&(first, _)) = made.first() else { continue };
            if first > at {
                continue;
            }
            // Copied, the pieces made so far are live; in place, the whole bucket is.
            let mut delta = vec![0i64; at + 1 - first];
            let (mut so_far, mut next) = (0, made.iter().peekable());
            for (i, t) in (first..at).enumerate() {
                while let Some(&(_, bytes)) = next.next_if(|&&(s, _)| s <= t) {
                    so_far += bytes;
                }
                delta[i] = whole - so_far;
            }
            delta[at - first] = -whole;
            if (first..=at).zip(&delta).all(|(t, d)| profile[t] + d <= peak) {
                for (t, d) in (first..=at).zip(&delta) {
                    profile[t] += d;
                }
                chosen.concats.insert(c);
                chosen.pieces.extend(pieces.iter().map(|&(p, at)| (p, (c, at))));
            }
        }
        // Slices of one buffer extend it one after another.
        let mut ends: HashMap<usize, usize> = HashMap::new();
        let mut slices: Vec<(NodeId, usize)> = self.slices.iter().map(|(&n, &at)| (n, at)).collect();
        slices.sort_by_key(|&(n, _)| step_of.get(&n).copied().unwrap_or(usize::MAX));
        for (n, offset) in slices {
            let (Some(&t), Some(out)) = (step_of.get(&n), life(n)) else { continue };
            let Some(&source) = graph.operands(n).first().and_then(|o| plain.buffer_of.get(o)) else {
                continue;
            };
            let (bytes, kept) = (graph.node(n).bytes() as i64, plain.buffers[source].bytes as i64);
            let end = ends.get(&source).copied().unwrap_or(plain.buffers[source].end);
            let delta = |u: usize| if u > end { kept - bytes } else { -bytes };
            if (t..=out.end).all(|u| profile[u] + delta(u) <= peak) {
                for (u, live) in profile.iter_mut().enumerate().take(out.end + 1).skip(t) {
                    *live += delta(u);
                }
                ends.insert(source, end.max(out.end));
                chosen.slices.insert(n, offset);
            }
        }
        chosen
    }

    /// Whether `n` shares another value's buffer: a reshape or one of these views.
    pub fn is_view(&self, graph: &Graph, n: NodeId) -> bool {
        graph.node(n).op.class() == OpClass::View || self.concats.contains(&n) || self.slices.contains_key(&n)
    }

    /// The node whose buffer `n` is, through reshapes and slices read in place.
    fn root(&self, graph: &Graph, mut n: NodeId) -> NodeId {
        while graph.node(n).op.class() == OpClass::View || self.slices.contains_key(&n) {
            match graph.operands(n).first() {
                Some(&o) => n = o,
                None => break,
            }
        }
        n
    }
}

/// Whether `n` is a reduced gradient bucket: a collective's result read by slices alone (through
/// reshapes). Only those slices are read in place. Elsewhere a slice read in place keeps its
/// whole operand alive while any slice is read, and even where that left the peak where it was,
/// the passes planned after it did worse: the GPT example's one-hot step in 4 row blocks, whose
/// embedding is sliced per block, planned 5,769,216 B against 5,480,960 with slices copied.
fn only_split(graph: &Graph, n: NodeId) -> bool {
    let mut root = n;
    while let (Op::Reshape { .. }, Some(&o)) = (&graph.node(root).op, graph.operands(root).first()) {
        root = o;
    }
    matches!(graph.node(root).op, Op::AllReduce { .. }) && split_alone(graph, root)
}

fn split_alone(graph: &Graph, n: NodeId) -> bool {
    graph.users(n).into_iter().all(|u| match graph.node(u).op {
        Op::Slice { .. } => true,
        Op::Reshape { .. } => split_alone(graph, u),
        _ => false,
    })
}

/// Whether every axis before `axis` of `shape` has one element: then a block of `axis` is a
/// contiguous run of bytes.
fn leads(shape: &crate::ir::Shape, axis: usize) -> bool {
    axis < shape.rank() && shape.dims()[..axis].iter().all(|&d| d == 1)
}

/// The pieces of `concat` with their offsets, when every one can be written in place: made by
/// a step (no input, variable or view of something else) that is not an output, on the
/// concatenation's device and of its dtype, read by nothing but the chain of reshapes that ends
/// at `concat` (which reads it once), at an aligned offset, and no piece of another
/// concatenation.
fn own_pieces(
    graph: &Graph,
    concat: NodeId,
    outputs: &HashSet<NodeId>,
    views: &Views,
) -> Option<Vec<(NodeId, usize)>> {
    let node = graph.node(concat);
    let mut pieces = Vec::new();
    let mut at = 0usize;
    for operand in graph.operands(concat) {
        let mut user = concat;
        let mut n = operand;
        loop {
            if graph.users(n) != [user] || outputs.contains(&n) {
                return None;
            }
            if graph.node(n).op.class() != OpClass::View {
                break;
            }
            user = n;
            n = *graph.operands(n).first()?;
        }
        let piece = graph.node(n);
        let made = matches!(piece.op.class(), OpClass::Compute | OpClass::Elementwise)
            && !matches!(piece.op, Op::Concat { .. } | Op::Slice { .. })
            && !views.is_view(graph, n);
        let fits = piece.dtype == node.dtype && piece.device == node.device;
        if !made || !fits || !at.is_multiple_of(VIEW_ALIGN) || views.pieces.contains_key(&n) {
            return None;
        }
        if pieces.iter().any(|&(p, _)| p == n) {
            return None;
        }
        pieces.push((n, at));
        at += graph.node(operand).bytes();
    }
    (!pieces.is_empty()).then_some(pieces)
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

    /// Where `n`'s value starts in its buffer, in bytes.
    pub fn offset(&self, n: NodeId) -> usize {
        self.offset_of.get(&n).copied().unwrap_or(0)
    }

    fn is_arena(&self, n: NodeId) -> bool {
        self.buffer_of.get(&n).is_some_and(|&b| self.buffers[b].class.in_arena())
    }
}

/// The buffers of `graph` run in `order`, with each step's scratch as `scratch` gives it.
///
/// A view is not always smaller: a concatenation written in place holds all its bytes from its
/// first piece on, where copying held only the pieces made so far; a slice read in place keeps
/// its whole operand alive as long as the slice is read. So the buffers are analysed without
/// these views first, and each view is kept only where it does not raise the peak of live bytes
/// (`Views::paying`); the rest stay copies.
pub fn analyze(graph: &Graph, order: &[NodeId], scratch: &Scratch) -> Result<Liveness> {
    let views = Views::find(graph, order);
    if views.is_empty() {
        return analyze_with(graph, order, scratch, &views);
    }
    let plain = analyze_with(graph, order, scratch, &Views::default())?;
    analyze_with(graph, order, scratch, &views.paying(graph, &plain))
}

fn analyze_with(graph: &Graph, order: &[NodeId], scratch: &Scratch, views: &Views) -> Result<Liveness> {
    let is_view = |n: NodeId| views.is_view(graph, n);
    let is_step = |n: NodeId| graph.node(n).op.class() != OpClass::Source && !is_view(n);
    let steps: Vec<NodeId> = order.iter().copied().filter(|&n| is_step(n)).collect();
    let step_of: HashMap<NodeId, usize> = steps.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let last = steps.len().saturating_sub(1);

    // The last step that reads each value's storage, through views: computed in reverse order
    // so that a view's readers are known before its operand's.
    let mut reads_until: HashMap<NodeId, Option<usize>> = HashMap::new();
    for &n in order.iter().rev() {
        let mut end: Option<usize> = None;
        for u in graph.users(n) {
            let e = if is_view(u) { reads_until[&u] } else { Some(step_of[&u]) };
            end = end.max(e);
        }
        reads_until.insert(n, end);
    }

    let outputs: HashMap<NodeId, &str> =
        graph.outputs().iter().map(|(name, id)| (*id, name.as_str())).collect();
    let mut live = Liveness { steps, ..Default::default() };
    // The buffer of each concatenation written in place, made by the first of its pieces to run
    // (its operands may be reshapes the order puts after other pieces).
    let mut concat_buffer: HashMap<NodeId, usize> = HashMap::new();
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
            _ if views.concats.contains(&n) => {
                // Its first piece made its buffer; every piece is in it.
                let Some(&b) = concat_buffer.get(&n) else {
                    return Err(CompileError::Internal(format!("{} has no pieces", node.describe())));
                };
                if graph.operands(n).iter().any(|o| live.buffer_of.get(o) != Some(&b)) {
                    return Err(CompileError::Internal(format!(
                        "a piece of {} is not in its buffer",
                        node.describe()
                    )));
                }
                live.buffer_of.insert(n, b);
                None
            }
            _ if is_view(n) => {
                let operand = graph.operands(n)[0];
                let b = live.buffer_of[&operand];
                let at = live.offset(operand) + views.slices.get(&n).copied().unwrap_or(0);
                live.buffer_of.insert(n, b);
                if at > 0 {
                    live.offset_of.insert(n, at);
                }
                None
            }
            _ => {
                let s = step_of[&n];
                if let Some(&(concat, at)) = views.pieces.get(&n) {
                    // The concatenation's buffer, made by its first piece to run, live to its
                    // last reader (and at least to its last piece).
                    let b = match concat_buffer.get(&concat) {
                        Some(&b) => b,
                        None => {
                            let c = graph.node(concat);
                            let last_piece = views
                                .pieces
                                .iter()
                                .filter(|(_, (of, _))| *of == concat)
                                .filter_map(|(p, _)| step_of.get(p).copied())
                                .max()
                                .unwrap_or(s);
                            live.buffers.push(BufferLife {
                                bytes: c.bytes(),
                                class: StorageClass::Arena,
                                device: c.device,
                                start: s,
                                end: reads_until[&concat].unwrap_or(s).max(last_piece),
                                producer: concat,
                            });
                            concat_buffer.insert(concat, live.buffers.len() - 1);
                            live.buffers.len() - 1
                        }
                    };
                    live.buffer_of.insert(n, b);
                    if at > 0 {
                        live.offset_of.insert(n, at);
                    }
                    None
                } else if let Some(name) = outputs.get(&n) {
                    Some(new(StorageClass::Output(name.to_string()), s, last))
                } else if let Some((b, at)) = in_place_target(graph, &live, n, s) {
                    let end = reads_until[&n].unwrap_or(s);
                    live.buffers[b].end = live.buffers[b].end.max(end);
                    live.buffer_of.insert(n, b);
                    if at > 0 {
                        live.offset_of.insert(n, at);
                    }
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
        if live.buffers[b].bytes < live.offset(n) + graph.node(n).bytes() {
            return Err(CompileError::Internal(format!(
                "{} does not fit its buffer",
                graph.node(n).describe()
            )));
        }
    }
    Ok(live)
}

/// An arena buffer of an operand of `n` (step `s`) with `n`'s shape and dtype whose last reader
/// is `n`, which `n` may write over (`Op::may_write_over`, for every operand read from it), and
/// the operand's offset in it, where `n` writes.
fn in_place_target(graph: &Graph, live: &Liveness, n: NodeId, s: usize) -> Option<(usize, usize)> {
    let node = graph.node(n);
    let operands = graph.operands(n);
    let buffer = |o: NodeId| live.buffer_of.get(&o).copied();
    operands.iter().enumerate().find_map(|(i, &o)| {
        let b = buffer(o)?;
        let at = live.offset(o);
        let buf = &live.buffers[b];
        let fits = graph.node(o).shape == node.shape && graph.node(o).dtype == node.dtype;
        // Not into an output (it lives to the end) or a variable; an input may be overwritten
        // once read, since every run is fed anew.
        let reusable = matches!(buf.class, StorageClass::Arena | StorageClass::Input(_));
        // Every operand read from that buffer (the same value twice, or a view of it) must be
        // one the op may write over, at the same offset (the same elements).
        let allowed = operands.iter().enumerate().filter(|&(_, &p)| buffer(p) == Some(b)).all(|(j, &p)| {
            node.op.may_write_over(j, &node.shape)
                && live.offset(p) == at
                && graph.node(p).shape.numel() == node.shape.numel()
        });
        (fits && reusable && allowed && buf.end == s && node.op.may_write_over(i, &node.shape))
            .then_some((b, at))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Node, ReduceOp, Shape};
    use crate::trace::Tracer;

    fn analyzed(graph: &Graph) -> Liveness {
        let order = crate::schedule::schedule(graph).unwrap();
        analyze(graph, &order, &Scratch::none()).unwrap()
    }

    fn node(graph: &Graph, op: &str) -> Vec<NodeId> {
        graph.node_ids().filter(|&n| graph.node(n).op.name() == op).collect()
    }

    #[test]
    fn a_concatenation_of_its_own_pieces_is_written_in_place() {
        let t = Tracer::new("concat");
        let x = t.input("x", [4, 8]);
        let c = x.exp().concat(&[&x.tanh()], 0);
        t.output("y", &c.relu());
        let g = t.finish().unwrap();
        let live = analyzed(&g);
        let (c, a, b) = (node(&g, "concat")[0], node(&g, "exp")[0], node(&g, "tanh")[0]);
        assert!(!live.steps.contains(&c), "the concatenation runs nothing");
        assert_eq!(live.buffer_of[&a], live.buffer_of[&c]);
        assert_eq!(live.buffer_of[&b], live.buffer_of[&c]);
        assert_eq!((live.offset(a), live.offset(b)), (0, 128), "each piece at its place");
        assert_eq!(live.buffers[live.buffer_of[&c]].bytes, 256);
    }

    #[test]
    fn pieces_behind_reshapes_share_one_buffer_in_any_order() {
        // Program order runs both pieces before either reshape: the second piece must still
        // find the buffer the first made.
        let t = Tracer::new("reshaped");
        let x = t.input("x", [4, 8]);
        let (a, b) = (x.exp(), x.tanh());
        t.output("y", &a.reshape([32]).concat(&[&b.reshape([32])], 0).relu());
        let g = t.finish().unwrap();
        let live = analyzed(&g);
        let (c, a, b) = (node(&g, "concat")[0], node(&g, "exp")[0], node(&g, "tanh")[0]);
        assert!(!live.steps.contains(&c));
        assert_eq!(live.buffer_of[&a], live.buffer_of[&c]);
        assert_eq!(live.buffer_of[&b], live.buffer_of[&c]);
        assert_eq!(live.offset(b), 128);
    }

    #[test]
    fn pieces_that_are_misaligned_or_read_elsewhere_are_copied() {
        // 3 floats: the second piece would start 12 bytes in.
        let t = Tracer::new("misaligned");
        let x = t.input("x", [3]);
        t.output("y", &x.exp().concat(&[&x.tanh()], 0).relu());
        let g = t.finish().unwrap();
        assert!(analyzed(&g).steps.contains(&node(&g, "concat")[0]));
        // A piece another op reads.
        let t = Tracer::new("shared");
        let x = t.input("x", [4, 8]);
        let a = x.exp();
        t.output("y", &a.concat(&[&x.tanh()], 0).relu());
        t.output("z", &a.sigmoid());
        let g = t.finish().unwrap();
        assert!(analyzed(&g).steps.contains(&node(&g, "concat")[0]));
    }

    #[test]
    fn a_concatenation_in_place_that_would_raise_the_peak_is_copied() {
        // The first piece is made before a large temporary and the second after it: in place,
        // the concatenation would hold the second piece's bytes through the temporary's peak.
        let t = Tracer::new("early");
        let x = t.input("x", [4, 4]);
        let a = x.exp();
        let big = x.reshape([1, 4, 4]).broadcast_to([64, 4, 4]).exp();
        let b = big.sum(0, false);
        t.output("y", &a.concat(&[&b], 0).relu());
        let g = t.finish().unwrap();
        assert!(analyzed(&g).steps.contains(&node(&g, "concat")[0]));
    }

    #[test]
    fn slices_of_a_reduced_bucket_are_read_in_place() {
        let t = Tracer::new("bucket");
        let x = t.input("x", [8]);
        let grad = x.exp();
        t.output("y", &grad);
        let mut g = t.finish().unwrap();
        let grad = node(&g, "exp")[0];
        let base = g.node(grad).clone();
        let reduced = g.add(Node { op: Op::AllReduce { op: ReduceOp::Mean }, ..base.clone() }, &[grad]);
        g.outputs_mut().clear();
        for (i, start) in [0, 4].into_iter().enumerate() {
            let slice =
                Node { op: Op::Slice { axis: 0, start, len: 4 }, shape: Shape::new([4]), ..base.clone() };
            let s = g.add(slice, &[reduced]);
            let y = g.add(
                Node { op: Op::Unary(crate::ir::UnaryOp::Tanh), shape: Shape::new([4]), ..base.clone() },
                &[s],
            );
            g.set_output(format!("y{i}"), y);
        }
        let live = analyzed(&g);
        let slices = node(&g, "slice");
        assert!(slices.iter().all(|s| !live.steps.contains(s)), "no slice runs");
        let offsets: Vec<usize> = slices.iter().map(|&s| live.offset(s)).collect();
        assert!(offsets == [0, 16] || offsets == [16, 0], "{offsets:?}");
        assert!(slices.iter().all(|s| live.buffer_of[s] == live.buffer_of[&reduced]));
    }
}
