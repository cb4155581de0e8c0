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
//! Made where the input gradient is read by that ReLU gradient alone and the convolution's
//! stride is 1 (the CPU's turned convolution, which goes by output rows); with fusion only, as
//! one of fusion's kernels.

use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Node, NodeId, Op};

/// Rewrites every eligible pair in `graph`; returns how many.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    let found: Vec<(NodeId, NodeId)> = graph.node_ids().filter_map(|r| eligible(graph, r)).collect();
    for &(relu_grad, input_gradient) in &found {
        let [y, _] = graph.operands(relu_grad)[..] else { continue };
        let [dy, w] = graph.operands(input_gradient)[..] else { continue };
        let Op::Conv2dBackpropInput { window, input } = graph.node(input_gradient).op.clone() else {
            continue;
        };
        let fused = graph.add(
            Node { op: Op::Conv2dBackpropInputReluGrad { window, input }, ..graph.node(relu_grad).clone() },
            &[dy, w, y],
        );
        // The ordering the two had (the filter's reader runs before the filter's update,
        // `passes::OrderEffects`) is the fused op's.
        for n in [relu_grad, input_gradient] {
            for before in graph.control_predecessors(n) {
                graph.add_control(before, fused);
            }
            for after in graph.control_successors(n) {
                graph.add_control(fused, after);
            }
        }
        graph.replace_uses(relu_grad, fused);
        graph.remove(relu_grad);
        graph.remove(input_gradient);
    }
    Ok(found.len())
}

/// `(relu_grad, conv2d_backprop_input)` when `r` is `relu_grad(y, conv2d_backprop_input(dy, w))`
/// with stride 1, the input gradient read by `r` alone. Control edges carry over to the fused
/// op: it runs after everything either ran after and before everything either ran before.
fn eligible(graph: &Graph, r: NodeId) -> Option<(NodeId, NodeId)> {
    let node = graph.node(r);
    if node.op != Op::Binary(BinaryOp::ReluGrad) {
        return None;
    }
    let [y, c] = graph.operands(r)[..] else { return None };
    let Op::Conv2dBackpropInput { window, input } = &graph.node(c).op else { return None };
    let conv = graph.node(c);
    let alone = graph.users(c) == [r] && !graph.outputs().iter().any(|(_, o)| *o == c);
    let fits = graph.node(y).shape == *input
        && node.shape == *input
        && [node.dtype, conv.dtype, graph.node(y).dtype].iter().all(|d| *d == crate::ir::DType::F32)
        && conv.device == node.device;
    (window.stride == [1, 1] && y != c && alone && fits).then_some((r, c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Padding, Shape, Window2d};

    fn graph(stride: usize) -> Graph {
        let mut g = Graph::new("t");
        let window = Window2d { size: [3, 3], stride: [stride; 2], padding: Padding::Same };
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

    #[test]
    fn the_pair_becomes_one_op_reading_the_activation() {
        let mut g = graph(1);
        assert_eq!(rewrite(&mut g).unwrap(), 1);
        let out = g.output("dy_pre").unwrap();
        assert!(matches!(g.node(out).op, Op::Conv2dBackpropInputReluGrad { .. }));
        let names: Vec<String> = g
            .operands(out)
            .iter()
            .map(|&o| match &g.node(o).op {
                Op::Input { name, .. } => name.clone(),
                _ => String::new(),
            })
            .collect();
        assert_eq!(names, ["dy", "w", "y"]);
        assert!(g.node(out).op.may_write_over(2, &g.node(out).shape), "written over y");
    }

    #[test]
    fn strided_convolutions_are_left_apart() {
        let mut g = graph(2);
        assert_eq!(rewrite(&mut g).unwrap(), 0);
    }
}
