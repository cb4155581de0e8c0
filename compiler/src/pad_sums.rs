//! Sums of zero-padded pieces become one concatenation.
//!
//! The gradient of a `Slice` is a `Pad` of the slice's gradient back to the whole shape, and a
//! value read as several slices gets the sum of their pads. Each pad is a whole-sized tensor
//! that is zero outside its window, and autodiff adds them when the value's gradient is needed,
//! so all of them are live at once before the sum. A training step in blocks of batch rows
//! (`step::train_step_graph_in_blocks`) reads its embedding's rows one slice per block: at 8
//! blocks, 8 whole [batch, seq, width] pads were summed at the end of the step. A user's model
//! that splits a tensor with slices (heads, gates) builds the same sum. Measured on the GPT
//! example's model (16 x 64 tokens, width 64, sparse loss): arena in 4 blocks 6,121,280 ->
//! 5,530,176 B, in 8 blocks 6,021,440 -> 5,562,688 B.
//!
//! Where the pads of a sum share their axis and their windows are disjoint, the sum is the
//! concatenation of the pieces along that axis, zeros filling any gap: each element is one
//! piece's value plus zeros, so the result is the same (up to the sign of a zero). The
//! pieces stay as small as they were, and one whole-sized tensor is made, by the
//! concatenation. Other terms of the sum (a whole-shaped gradient from another reader) are
//! added to the concatenation.

use crate::error::Result;
use crate::ir::{BinaryOp, DType, Graph, Node, NodeId, Op, Shape};

/// Rewrites every sum of disjoint pads (`module docs`); returns how many.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    let roots: Vec<NodeId> = graph.node_ids().filter(|&n| is_root(graph, n)).collect();
    let mut rewritten = 0;
    for root in roots {
        if !graph.contains(root) {
            continue;
        }
        let mut leaves = Vec::new();
        let mut inner = Vec::new();
        collect(graph, root, &mut leaves, &mut inner);
        let Some((axis, windows)) = disjoint_pads(graph, &leaves) else { continue };
        let node = graph.node(root).clone();
        let pads: Vec<NodeId> = windows.iter().map(|&(_, p)| p).collect();
        let pieces: Vec<(usize, NodeId)> =
            windows.iter().map(|&(start, p)| (start, graph.operands(p)[0])).collect();
        let whole = node.shape.dims()[axis];
        let mut parts = Vec::new();
        let mut at = 0;
        let zeros = |graph: &mut Graph, len: usize| {
            let mut dims = node.shape.dims().to_vec();
            dims[axis] = len;
            let shape = Shape::new(dims);
            graph.add(Node { op: Op::Fill { value: 0.0, shape: shape.clone() }, shape, ..node.clone() }, &[])
        };
        for &(start, piece) in &pieces {
            if start > at {
                parts.push(zeros(graph, start - at));
            }
            parts.push(piece);
            at = start + graph.node(piece).shape.dims()[axis];
        }
        if at < whole {
            parts.push(zeros(graph, whole - at));
        }
        let mut sum = graph.add(Node { op: Op::Concat { axis }, ..node.clone() }, &parts);
        for &other in leaves.iter().filter(|l| !pads.contains(l)) {
            sum = graph.add(Node { op: Op::Binary(BinaryOp::Add), ..node.clone() }, &[sum, other]);
        }
        graph.replace_uses(root, sum);
        for n in inner.into_iter().chain(pads).chain([root]) {
            graph.remove(n);
        }
        rewritten += 1;
    }
    Ok(rewritten)
}

/// An f32 add with no control edges.
fn is_add(graph: &Graph, n: NodeId) -> bool {
    let node = graph.node(n);
    node.op == Op::Binary(BinaryOp::Add)
        && node.dtype == DType::F32
        && graph.control_predecessors(n).is_empty()
        && graph.control_successors(n).is_empty()
}

/// Read by `user` alone, not an output, unordered.
fn only_for(graph: &Graph, n: NodeId, user: NodeId) -> bool {
    graph.users(n) == [user]
        && !graph.outputs().iter().any(|(_, o)| *o == n)
        && graph.control_predecessors(n).is_empty()
        && graph.control_successors(n).is_empty()
}

/// An add that is not a term of a larger sum of its shape.
fn is_root(graph: &Graph, n: NodeId) -> bool {
    if !is_add(graph, n) {
        return false;
    }
    let shape = &graph.node(n).shape;
    match graph.users(n)[..] {
        [u] => !(is_add(graph, u) && graph.node(u).shape == *shape && only_for(graph, n, u)),
        _ => true,
    }
}

/// The terms of the sum at `n` (`leaves`) and its adds below the root (`inner`): an operand
/// that is an add of the same shape, device and dtype read by this add alone is opened.
fn collect(graph: &Graph, n: NodeId, leaves: &mut Vec<NodeId>, inner: &mut Vec<NodeId>) {
    let node = graph.node(n);
    for o in graph.operands(n) {
        let term = graph.node(o);
        let opens = is_add(graph, o)
            && term.shape == node.shape
            && term.device == node.device
            && only_for(graph, o, n)
            && graph.operands(o).len() == 2;
        if opens {
            inner.push(o);
            collect(graph, o, leaves, inner);
        } else {
            leaves.push(o);
        }
    }
}

/// The axis and the pads among `leaves` (each with its window's start, in window order) when at
/// least two pad along one axis into disjoint windows, each read by the sum alone, of the sum's shape, device and dtype (terms read twice
/// are left alone).
fn disjoint_pads(graph: &Graph, leaves: &[NodeId]) -> Option<(usize, Vec<(usize, NodeId)>)> {
    let mut by_axis: std::collections::BTreeMap<usize, Vec<(usize, usize, NodeId)>> = Default::default();
    for &l in leaves {
        let node = graph.node(l);
        let Op::Pad { axis, before, after } = node.op else { continue };
        let users = graph.users(l);
        let once = leaves.iter().filter(|&&m| m == l).count() == 1;
        let single_reader = users.len() == 1
            && !graph.outputs().iter().any(|(_, o)| *o == l)
            && graph.control_predecessors(l).is_empty()
            && graph.control_successors(l).is_empty();
        let whole = node.shape.dims().get(axis).copied()?;
        if once && single_reader && node.dtype == DType::F32 && before + after <= whole {
            by_axis.entry(axis).or_default().push((before, whole - after, l));
        }
    }
    by_axis.into_iter().find_map(|(axis, mut windows)| {
        windows.sort();
        let disjoint = windows.windows(2).all(|w| w[0].1 <= w[1].0);
        (windows.len() >= 2 && disjoint).then(|| (axis, windows.into_iter().map(|w| (w.0, w.2)).collect()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x [8, 3] read as slices of rows `windows`; the gradient of each slice (an input of its
    /// shape) padded back and summed, plus `extra` whole-shaped terms.
    fn graph(windows: &[(usize, usize)], extra: usize) -> (Graph, Vec<NodeId>) {
        let mut g = Graph::new("t");
        let mut terms = Vec::new();
        let mut pieces = Vec::new();
        for (i, &(start, len)) in windows.iter().enumerate() {
            let d = g.add_input(&format!("d{i}"), &[len, 3]);
            pieces.push(d);
            terms.push(g.add_f32(Op::Pad { axis: 0, before: start, after: 8 - start - len }, &[8, 3], &[d]));
        }
        for i in 0..extra {
            terms.push(g.add_input(&format!("e{i}"), &[8, 3]));
        }
        let mut sum = terms[0];
        for &t in &terms[1..] {
            sum = g.add_f32(Op::Binary(BinaryOp::Add), &[8, 3], &[sum, t]);
        }
        g.set_output("sum", sum);
        (g, pieces)
    }

    fn ops(g: &Graph) -> Vec<String> {
        let mut v: Vec<String> = g.node_ids().map(|n| g.node(n).op.name().to_string()).collect();
        v.sort();
        v
    }

    #[test]
    fn pads_that_tile_the_axis_become_a_concatenation() {
        let (mut g, d) = graph(&[(0, 2), (4, 4), (2, 2)], 0);
        assert_eq!(rewrite(&mut g).unwrap(), 1);
        let sum = g.output("sum").unwrap();
        assert_eq!(g.node(sum).op, Op::Concat { axis: 0 });
        assert_eq!(g.operands(sum), [d[0], d[2], d[1]], "pieces in the order of their windows");
        assert!(!ops(&g).iter().any(|o| o == "pad" || o == "add"));
    }

    #[test]
    fn gaps_are_zeros_and_other_terms_are_added() {
        let (mut g, _) = graph(&[(1, 2), (5, 1)], 1);
        assert_eq!(rewrite(&mut g).unwrap(), 1);
        let sum = g.output("sum").unwrap();
        assert_eq!(g.node(sum).op, Op::Binary(BinaryOp::Add));
        let concat = g.operands(sum)[0];
        let parts: Vec<Shape> = g.operands(concat).iter().map(|&o| g.node(o).shape.clone()).collect();
        let rows: Vec<usize> = parts.iter().map(|s| s.dims()[0]).collect();
        assert_eq!(rows, [1, 2, 2, 1, 2]);
        assert!(matches!(g.node(g.operands(concat)[0]).op, Op::Fill { value: 0.0, .. }));
    }

    #[test]
    fn overlapping_windows_or_a_single_pad_are_left_alone() {
        for (windows, extra) in [(&[(0, 3), (2, 3)][..], 0), (&[(0, 3)][..], 1)] {
            let (mut g, _) = graph(windows, extra);
            let before = ops(&g);
            assert_eq!(rewrite(&mut g).unwrap(), 0);
            assert_eq!(ops(&g), before);
        }
    }
}
