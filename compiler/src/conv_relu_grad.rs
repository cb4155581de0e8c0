//! A convolution's input gradient and ReLU's gradient after it, as one op written over the
//! activation.
//!
//! Backward through conv → ReLU → conv, the second convolution's input gradient dx =
//! conv2d_backprop_input(dy, w) is made, and ReLU's gradient `relu_grad(y, dx)` is written over
//! the activation y it reads (`Op::may_write_over`): for that one step dx is a buffer of y's
//! size beside y, dy and every activation the rest of the backward pass still reads, which is
//! the peak of a convolutional network's training step. `Op::Conv2dBackpropInputReluGrad`
//! computes both as one kernel and writes its result over y itself: the CPU a block of output
//! rows at a time into a tile of its own (`ROW_BLOCK` rows, 32 KiB for 8 rows of 32x32 pixels),
//! then through the mask into y's same rows; CUDA as the GEMM's epilogue, each element's y read
//! by the thread that stores it. dx is never in the arena. The bits are the two ops' apart (the
//! same product, then `y > 0 ? dx : 0`).
//!
//! Measured (`kiln memory cnn`: three of the zoo cnn's four 3x3 stride-1 convolutions get one,
//! all but the first, whose input is the batch; the pooled one's mask is the pooled activation,
//! where `pool_relu_grad` moved ReLU's gradient): the training arena 32,391,296 -> 30,179,456 B (unfused plans keep the
//! two ops: 32,391,296), the planned total 39,486,588 -> 37,274,748 B, device bytes 19 -> 18
//! granules of 2 MiB.
//!
//! Between the two there may be a residual sum, `relu_grad(y, r + dx)`: the gradient that
//! reaches y through a residual connection as well as through the convolution, as at the input
//! of every residual block whose input is a ReLU's output (ResNet's). The op then takes r as a
//! fourth operand and may write over it too, and the sum is never in the arena either: an
//! unseen residual conv net (`tests/unseen_models.rs`: conv, a residual block of two 3x3
//! convolutions, a strided conv, pools, at batch 5 of 11x13 images) planned its training step in
//! 102,720 B with or without fusion before, 93,440 B fused now (unfused 102,720), its peak the
//! block's input gradient beside every activation the filter gradients still read.
//!
//! Made where the input gradient is read by that ReLU gradient (or that sum) alone and the
//! convolution's stride is 1 (the CPU's turned convolution, which goes by output rows); with
//! fusion only, as one of fusion's kernels.

use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Node, NodeId, Op};

/// Rewrites every eligible pair (or triple, with a residual sum) in `graph`; returns how many.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    let found: Vec<Found> = graph.node_ids().filter_map(|r| eligible(graph, r)).collect();
    for f in &found {
        let [y, _] = graph.operands(f.relu_grad)[..] else { continue };
        let [dy, w] = graph.operands(f.input_gradient)[..] else { continue };
        let Op::Conv2dBackpropInput { window, input } = graph.node(f.input_gradient).op.clone() else {
            continue;
        };
        // The sum's other operand as it is now: an earlier rewrite may have replaced it (a
        // residual gradient that was itself a ReLU gradient of an input gradient).
        let operands: Vec<NodeId> = match f.residual {
            Some((sum, _)) => {
                let [a, b] = graph.operands(sum)[..] else { continue };
                vec![dy, w, y, if a == f.input_gradient { b } else { a }]
            }
            None => vec![dy, w, y],
        };
        let fused = graph.add(
            Node { op: Op::Conv2dBackpropInputReluGrad { window, input }, ..graph.node(f.relu_grad).clone() },
            &operands,
        );
        // The ordering they had (the filter's reader runs before the filter's update,
        // `passes::OrderEffects`) is the fused op's.
        let sum = f.residual.map(|(sum, _)| sum);
        for n in [Some(f.relu_grad), Some(f.input_gradient), sum].into_iter().flatten() {
            for before in graph.control_predecessors(n) {
                graph.add_control(before, fused);
            }
            for after in graph.control_successors(n) {
                graph.add_control(fused, after);
            }
        }
        graph.replace_uses(f.relu_grad, fused);
        graph.remove(f.relu_grad);
        if let Some(sum) = sum {
            graph.remove(sum);
        }
        graph.remove(f.input_gradient);
    }
    Ok(found.len())
}

/// A ReLU gradient over a convolution's input gradient, directly or through a residual sum.
struct Found {
    relu_grad: NodeId,
    input_gradient: NodeId,
    /// The sum `r + dx` (either order) between them, and r.
    residual: Option<(NodeId, NodeId)>,
}

/// When `r` is `relu_grad(y, conv2d_backprop_input(dy, w))`, or `relu_grad(y, a + b)` with one
/// of a, b such an input gradient and the other a gradient r of its shape (a residual
/// connection's: ResNet's backward pass meets one at every block whose input is a ReLU's
/// output), with stride 1, each value between read by the next alone. Control edges carry over
/// to the fused op: it runs after everything any of them ran after and before everything any
/// ran before.
fn eligible(graph: &Graph, r: NodeId) -> Option<Found> {
    let node = graph.node(r);
    if node.op != Op::Binary(BinaryOp::ReluGrad) {
        return None;
    }
    let alone =
        |n: NodeId, user: NodeId| graph.users(n) == [user] && !graph.outputs().iter().any(|(_, o)| *o == n);
    let [y, g] = graph.operands(r)[..] else { return None };
    // Dense windows only: a grouped or dilated input gradient has no masked (in-place) kernel.
    let is_input_gradient =
        |c: NodeId| matches!(graph.node(c).op, Op::Conv2dBackpropInput { window, .. } if window.is_dense());
    let (c, residual) = if is_input_gradient(g) {
        (g, None)
    } else if graph.node(g).op == Op::Binary(BinaryOp::Add) && alone(g, r) {
        let [a, b] = graph.operands(g)[..] else { return None };
        // An input gradient of the two that the sum alone reads, the first such (a + b and
        // b + a are the same bits); the other may be one too, read elsewhere as well.
        let own = |c: NodeId| is_input_gradient(c) && alone(c, g);
        let (c, other) = if own(a) && a != b { (a, b) } else { (b, a) };
        if !own(c) || other == c || other == y || graph.node(other).shape != graph.node(g).shape {
            return None;
        }
        (c, Some((g, other)))
    } else {
        return None;
    };
    let Op::Conv2dBackpropInput { window, input } = &graph.node(c).op else { return None };
    let conv = graph.node(c);
    let sum = residual.map(|(s, other)| (graph.node(s), graph.node(other)));
    let user = residual.map_or(r, |(s, _)| s);
    let fits = graph.node(y).shape == *input
        && node.shape == *input
        && [node.dtype, conv.dtype, graph.node(y).dtype].iter().all(|d| *d == crate::ir::DType::F32)
        && sum.is_none_or(|(s, o)| s.shape == *input && s.dtype == node.dtype && o.dtype == node.dtype)
        && sum.is_none_or(|(s, o)| s.device == node.device && o.device == node.device)
        && conv.device == node.device;
    (window.stride == [1, 1] && y != c && alone(c, user) && fits).then_some(Found {
        relu_grad: r,
        input_gradient: c,
        residual,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Padding, Shape, Window2d};

    fn graph(stride: usize) -> Graph {
        let mut g = Graph::new("t");
        let window = Window2d::new([3, 3], [stride; 2], Padding::Same);
        let out = 8 / stride;
        let y = g.add_input("y", &[1, 8, 8, 2]);
        let dy = g.add_input("dy", &[1, out, out, 3]);
        let w = g.add_input("w", &[3, 3, 2, 3]);
        let input = Shape::new(vec![1, 8, 8, 2]);
        let dx = g.add_f32(Op::Conv2dBackpropInput { window, input }, &[1, 8, 8, 2], &[dy, w]);
        let r = g.add_f32(Op::Binary(BinaryOp::ReluGrad), &[1, 8, 8, 2], &[y, dx]);
        g.set_output("dy_pre", r);
        g
    }

    /// The graph-input names of `n`'s operands ("" for any other operand).
    fn input_names(g: &Graph, n: NodeId) -> Vec<String> {
        g.operands(n)
            .iter()
            .map(|&o| match &g.node(o).op {
                Op::Input { name, .. } => name.clone(),
                _ => String::new(),
            })
            .collect()
    }

    #[test]
    fn the_pair_becomes_one_op_reading_the_activation() {
        let mut g = graph(1);
        assert_eq!(rewrite(&mut g).unwrap(), 1);
        let out = g.output("dy_pre").unwrap();
        assert!(matches!(g.node(out).op, Op::Conv2dBackpropInputReluGrad { .. }));
        assert_eq!(input_names(&g, out), ["dy", "w", "y"]);
        assert!(g.node(out).op.may_write_over(2, &g.node(out).shape), "written over y");
    }

    /// relu_grad(y, r + dx) (or dx + r), dx a stride-1 input gradient read by the sum alone.
    fn residual_graph(dx_first: bool, dx_read_elsewhere: bool) -> Graph {
        let mut g = Graph::new("t");
        let window = Window2d::new([3, 3], [1, 1], Padding::Same);
        let y = g.add_input("y", &[1, 8, 8, 2]);
        let r = g.add_input("r", &[1, 8, 8, 2]);
        let dy = g.add_input("dy", &[1, 8, 8, 3]);
        let w = g.add_input("w", &[3, 3, 2, 3]);
        let input = Shape::new(vec![1, 8, 8, 2]);
        let dx = g.add_f32(Op::Conv2dBackpropInput { window, input }, &[1, 8, 8, 2], &[dy, w]);
        let pair = if dx_first { [dx, r] } else { [r, dx] };
        let sum = g.add_f32(Op::Binary(BinaryOp::Add), &[1, 8, 8, 2], &pair);
        let out = g.add_f32(Op::Binary(BinaryOp::ReluGrad), &[1, 8, 8, 2], &[y, sum]);
        g.set_output("dy_pre", out);
        if dx_read_elsewhere {
            g.set_output("dx", dx);
        }
        g
    }

    #[test]
    fn a_residual_sum_between_joins_the_op_as_its_fourth_operand() {
        for dx_first in [true, false] {
            let mut g = residual_graph(dx_first, false);
            assert_eq!(rewrite(&mut g).unwrap(), 1);
            let out = g.output("dy_pre").unwrap();
            assert!(matches!(g.node(out).op, Op::Conv2dBackpropInputReluGrad { .. }));
            assert_eq!(input_names(&g, out), ["dy", "w", "y", "r"]);
            assert!(!g.node_ids().any(|n| g.node(n).op == Op::Binary(BinaryOp::Add)), "the sum is gone");
            assert!(g.node(out).op.may_write_over(3, &g.node(out).shape), "written over r too");
        }
        // An input gradient read elsewhere too stays a value of its own.
        let mut g = residual_graph(true, true);
        assert_eq!(rewrite(&mut g).unwrap(), 0);
    }

    #[test]
    fn a_residual_that_is_itself_rewritten_is_read_as_rewritten() {
        // relu_grad(y1, relu_grad(y2, r + dx2) + dx1): the inner pair's result is the outer
        // sum's other operand, replaced by the inner rewrite whichever runs first.
        let mut g = Graph::new("t");
        let window = Window2d::new([3, 3], [1, 1], Padding::Same);
        let shape = [1, 8, 8, 2];
        let (y1, y2, r) = (g.add_input("y1", &shape), g.add_input("y2", &shape), g.add_input("r", &shape));
        let (dy1, dy2) = (g.add_input("dy1", &[1, 8, 8, 3]), g.add_input("dy2", &[1, 8, 8, 3]));
        let w = g.add_input("w", &[3, 3, 2, 3]);
        let input = Shape::new(shape.to_vec());
        let grad = |g: &mut Graph, dy| {
            g.add_f32(Op::Conv2dBackpropInput { window, input: input.clone() }, &shape, &[dy, w])
        };
        let dx2 = grad(&mut g, dy2);
        let s2 = g.add_f32(Op::Binary(BinaryOp::Add), &shape, &[r, dx2]);
        let inner = g.add_f32(Op::Binary(BinaryOp::ReluGrad), &shape, &[y2, s2]);
        let dx1 = grad(&mut g, dy1);
        let s1 = g.add_f32(Op::Binary(BinaryOp::Add), &shape, &[inner, dx1]);
        let outer = g.add_f32(Op::Binary(BinaryOp::ReluGrad), &shape, &[y1, s1]);
        g.set_output("out", outer);
        assert_eq!(rewrite(&mut g).unwrap(), 2);
        let out = g.output("out").unwrap();
        let residual = g.operands(out)[3];
        assert!(matches!(g.node(residual).op, Op::Conv2dBackpropInputReluGrad { .. }), "reads the inner op");
        assert_eq!(g.operands(residual).len(), 4);
    }

    #[test]
    fn strided_convolutions_are_left_apart() {
        let mut g = graph(2);
        assert_eq!(rewrite(&mut g).unwrap(), 0);
    }
}
