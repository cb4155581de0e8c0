//! ReLU's gradient through max pooling, taken on the pooled side.
//!
//! A conv → ReLU → max-pool block differentiates to `relu_grad(y, max_pool_grad(y, dy))`: the
//! pooling gradient makes a tensor of y's shape (zero but for one element a window) and ReLU's
//! gradient masks it by y > 0, reading y once more. The mask commutes with the pooling gradient:
//! pooling routes each window's dy to the window's first maximum y_i, and y_i > 0 exactly when
//! the window's pooled value p = max_pool(y), which is y_i, is > 0. So this pass rewrites it as
//! `max_pool_grad(y, relu_grad(p, dy))`, with the p the forward pass computed:
//!
//! - the mask runs on the pooled tensor (a quarter of the elements under 2x2 pooling);
//! - y's last reader is now the pooling gradient, which writes its result over y where the
//!   windows tile the input (`Op::may_write_over`; both backends' kernels then work a window
//!   at a time): the [N, H, W, C] gradient never takes a buffer of its own;
//! - the bits are the same for finite activations: ReLU's gradient passes dy or gives 0, and the
//!   pooling gradient adds what it routes to 0.0, in either order. (A window holding a NaN
//!   after its first maximum pools to NaN, whose mask is 0, where the maximum's own mask
//!   passed dy.)
//!
//! Measured (`kiln memory cnn`, the zoo's two conv-ReLU-pool blocks): the training arena
//! 33,292,416 -> 32,391,296 B (its lower bound, now at a convolution's input gradient) and the
//! planned total 40,387,708 -> 39,486,588 B, which one allocation rounds to 19 granules of 2 MiB
//! instead of 20 (device bytes 41,943,040 -> 39,845,888). PyTorch and TensorFlow take ReLU's
//! gradient on the unpooled tensor; kiln's eager columns run the graph as traced, as they do.
//!
//! Only a rewrite that needs nothing new is made: the forward pooling of the same y with the same
//! window must be in the graph, the pooling gradient read by the ReLU gradient alone, and neither
//! ordered by control edges.

use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Node, NodeId, Op, PoolKind};

/// Rewrites every eligible ReLU gradient of a max-pooling gradient in `graph`; returns how many.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    let found: Vec<(NodeId, NodeId, NodeId)> = graph.node_ids().filter_map(|r| eligible(graph, r)).collect();
    for &(relu_grad, pool_grad, pooled) in &found {
        let [y, dy] = graph.operands(pool_grad)[..] else { continue };
        let masked = graph.add(
            Node { shape: graph.node(dy).shape.clone(), ..graph.node(relu_grad).clone() },
            &[pooled, dy],
        );
        graph.set_operands(pool_grad, &[y, masked]);
        graph.replace_uses(relu_grad, pool_grad);
        graph.remove(relu_grad);
    }
    Ok(found.len())
}

/// `(relu_grad, max_pool_grad, max_pool)` when `r` is `relu_grad(y, max_pool_grad(y, dy))` and
/// the graph pools y forward with the same window.
fn eligible(graph: &Graph, r: NodeId) -> Option<(NodeId, NodeId, NodeId)> {
    let node = graph.node(r);
    if node.op != Op::Binary(BinaryOp::ReluGrad) {
        return None;
    }
    let [y, g] = graph.operands(r)[..] else { return None };
    let Op::Pool2dGrad { kind: PoolKind::Max, window } = &graph.node(g).op else { return None };
    let [y2, dy] = graph.operands(g)[..] else { return None };
    let unordered =
        |n: NodeId| graph.control_predecessors(n).is_empty() && graph.control_successors(n).is_empty();
    let alone = graph.users(g) == [r] && !graph.outputs().iter().any(|(_, o)| *o == g);
    if y2 != y || y == g || dy == y || !alone || !unordered(r) || !unordered(g) {
        return None;
    }
    let pooled = graph.users(y).into_iter().find(|&p| {
        let n = graph.node(p);
        matches!(&n.op, Op::Pool2d { kind: PoolKind::Max, window: w } if w == window)
            && n.device == node.device
            && n.dtype == graph.node(dy).dtype
            && n.shape == graph.node(dy).shape
    })?;
    Some((r, g, pooled))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Padding, Shape, UnaryOp, Window2d};

    fn window() -> Window2d {
        Window2d::new([2, 2], [2, 2], Padding::Valid)
    }

    /// y = relu(x), p = max_pool(y), and the two gradients of a given dy.
    fn block(with_pool: bool) -> (Graph, NodeId) {
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[1, 4, 4, 2]);
        let dy = g.add_input("dy", &[1, 2, 2, 2]);
        let y = g.add_f32(Op::Unary(UnaryOp::Relu), &[1, 4, 4, 2], &[x]);
        if with_pool {
            let p = g.add_f32(Op::Pool2d { kind: PoolKind::Max, window: window() }, &[1, 2, 2, 2], &[y]);
            g.set_output("p", p);
        }
        let pg = g.add_f32(Op::Pool2dGrad { kind: PoolKind::Max, window: window() }, &[1, 4, 4, 2], &[y, dy]);
        let r = g.add_f32(Op::Binary(BinaryOp::ReluGrad), &[1, 4, 4, 2], &[y, pg]);
        g.set_output("dx", r);
        (g, pg)
    }

    #[test]
    fn the_mask_moves_to_the_pooled_side() {
        let (mut g, pg) = block(true);
        assert_eq!(rewrite(&mut g).unwrap(), 1);
        assert_eq!(g.output("dx"), Some(pg), "the pooling gradient is the result");
        let masked = g.operands(pg)[1];
        assert_eq!(g.node(masked).op, Op::Binary(BinaryOp::ReluGrad));
        assert_eq!(g.node(masked).shape, Shape::new(vec![1, 2, 2, 2]));
        assert_eq!(g.operands(masked)[0], g.output("p").unwrap(), "masked by the pooled value");
    }

    #[test]
    fn nothing_is_rewritten_without_the_forward_pooling() {
        let (mut g, _) = block(false);
        let before = g.len();
        assert_eq!(rewrite(&mut g).unwrap(), 0);
        assert_eq!(g.len(), before);
    }
}
