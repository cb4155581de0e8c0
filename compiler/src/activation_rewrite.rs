//! GELU that a graph composes itself (an ONNX model exported at an opset without `Gelu`, a
//! hand-written layer), as one `UnaryOp::Gelu` or `UnaryOp::GeluTanh`:
//!
//! - exact: `0.5 · x · (1 + erf(x / √2))` (PyTorch's `nn.GELU` and transformers' `gelu` exported
//!   at opset 17: Div, Erf, Add, Mul, Mul);
//! - tanh: `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` (GPT-2's `gelu_new`: Pow, Mul,
//!   Add, Mul, Tanh, Add, Mul, Mul), the cube as `x ^ 3` or `x · x · x`;
//!
//! the factor 0.5 on x, on the sum or on the product, either operand order, each constant a
//! one-element fill or a scalar op (within 1e-5 of its value). Every intermediate must have one
//! reader, no output and no control edge; x must have the result's shape.
//!
//! Composed, autodiff differentiates each op: the backward pass reads `1 + erf(x / √2)` (or the
//! tanh) beside the forward output, so the cut keeps it or recomputes it as its own kernel next
//! to the GELU's recomputation, and the gradient is a chain of five ops. One op, its gradient is
//! `GeluGrad(x, dy)` (`GeluTanhGrad` for the tanh form): one elementwise op that fusion makes the epilogue of the product that
//! makes dy, written over x. Measured (`kiln memory MODEL.onnx --mode train`, the exports of
//! `cargo bench --bench realscale`; MB = 10^6 B): BERT-base at 8 x 256 plans 2,093 -> 2,044 MB,
//! ViT-B/16 at 16 2,220 -> 2,143 MB, GPT-2 small at 4 x 256 2,107 -> 2,061 MB: at each
//! backward MLP, three [tokens, 3072] temporaries of the composed gradient (the erf sum
//! recomputed, the GELU recomputed for the weight gradient, the derivative) became the one
//! recomputed GELU. Run before autodiff (`step`), after `attention_rewrite`; the forms matched
//! and left alone are in `tests/activation_rewrite.rs`.

use crate::attention_rewrite::{constant, private, remove_unread, rewrite_matches, scaled};
use crate::error::Result;
use crate::ir::{BinaryOp, Graph, Node, NodeId, Op, ScalarOp, UnaryOp};

/// Replaces every matched GELU of `graph` by one unary op; the count replaced. The graph is
/// renumbered afterwards (operands before users, dense ids) when anything changed.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    let starts = |op: &Op| matches!(op, Op::Unary(UnaryOp::Erf | UnaryOp::Tanh));
    rewrite_matches(graph, "activation_rewrite", starts, find, apply)
}

/// One match: the GELU's input, its form, the node whose readers it takes over, and the nodes
/// it replaces.
struct Match {
    x: NodeId,
    op: UnaryOp,
    result: NodeId,
    chain: Vec<NodeId>,
}

/// Whether `a` is within 1e-5 of `b`, relative to `b` (an exporter writes each constant as the
/// f32 nearest its value, or as an expression of constants that rounds within a few ulps).
fn near(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * b.abs()
}

/// The sole reader of `n`, where `n` is private (`attention_rewrite::private`).
fn reader(graph: &Graph, n: NodeId) -> Option<NodeId> {
    private(graph, n).then(|| graph.users(n).first().copied()).flatten()
}

/// `n` as `1 + t`: the other operand of an addition of the constant 1, or of a scalar addition
/// of 1.
fn one_plus(graph: &Graph, n: NodeId, t: NodeId) -> bool {
    let ops = graph.operands(n);
    match &graph.node(n).op {
        Op::Scalar { op: ScalarOp::Add, value } => ops[0] == t && near(*value, 1.0),
        Op::Binary(BinaryOp::Add) => {
            let other = if ops[0] == t {
                ops[1]
            } else if ops[1] == t {
                ops[0]
            } else {
                return false;
            };
            constant(graph, other).is_some_and(|c| near(c, 1.0))
        }
        _ => false,
    }
}

/// The operand of the product `n` other than `a` (`n` = a·other or other·a).
fn times(graph: &Graph, n: NodeId, a: NodeId) -> Option<NodeId> {
    if !matches!(graph.node(n).op, Op::Binary(BinaryOp::Mul)) {
        return None;
    }
    match graph.operands(n)[..] {
        [l, r] if l == a => Some(r),
        [l, r] if r == a => Some(l),
        _ => None,
    }
}

/// From the sum `a` = 1 + t on: `0.5 · x · a` in any grouping. The final node and the nodes
/// after `a` it replaces.
fn half_x_times(graph: &Graph, a: NodeId, x: NodeId) -> Option<(NodeId, Vec<NodeId>)> {
    let m1 = reader(graph, a)?;
    // (0.5·a)·x
    if let Some((inner, c)) = scaled(graph, m1)
        && inner == a
        && near(c, 0.5)
    {
        let m2 = reader(graph, m1)?;
        return (times(graph, m2, m1)? == x).then(|| (m2, vec![m1, m2]));
    }
    let t = times(graph, m1, a)?;
    if t == x {
        // (x·a)·0.5
        let m2 = reader(graph, m1)?;
        let (inner, c) = scaled(graph, m2)?;
        return (inner == m1 && near(c, 0.5)).then(|| (m2, vec![m1, m2]));
    }
    // (0.5·x)·a
    let (inner, c) = scaled(graph, t)?;
    (inner == x && near(c, 0.5) && private(graph, t)).then(|| (m1, vec![t, m1]))
}

/// `n` as x³: `x ^ 3` (a power by the constant 3 or a scalar power) or `x · x · x`.
fn cube_of(graph: &Graph, n: NodeId) -> Option<NodeId> {
    let ops = graph.operands(n);
    match &graph.node(n).op {
        Op::Binary(BinaryOp::Pow) => constant(graph, ops[1]).is_some_and(|c| c == 3.0).then_some(ops[0]),
        Op::Scalar { op: ScalarOp::Pow, value } => (*value == 3.0).then_some(ops[0]),
        Op::Binary(BinaryOp::Mul) => {
            let [l, r] = ops[..] else { return None };
            let square = |s: NodeId, x: NodeId| {
                matches!(graph.node(s).op, Op::Binary(BinaryOp::Mul))
                    && graph.operands(s)[..] == [x, x]
                    && private(graph, s)
            };
            if square(l, r) {
                Some(r)
            } else if square(r, l) {
                Some(l)
            } else {
                None
            }
        }
        _ => None,
    }
}

/// The GELU that `f` (an erf or a tanh) is the middle of, if it is one.
fn find(graph: &Graph, f: NodeId) -> Option<Match> {
    let node = graph.node(f);
    let inner = graph.operands(f)[0];
    if !private(graph, inner) || node.dtype != crate::ir::DType::F32 {
        return None;
    }
    let (x, op, mut chain) = match node.op {
        Op::Unary(UnaryOp::Erf) => {
            let (x, c) = scaled(graph, inner)?;
            (near(c, std::f32::consts::FRAC_1_SQRT_2)).then_some((x, UnaryOp::Gelu, vec![inner]))?
        }
        Op::Unary(UnaryOp::Tanh) => {
            let (sum, c) = scaled(graph, inner)?;
            if !near(c, (2.0 / std::f32::consts::PI).sqrt()) || !private(graph, sum) {
                return None;
            }
            let Op::Binary(BinaryOp::Add) = graph.node(sum).op else { return None };
            let [l, r] = graph.operands(sum)[..] else { return None };
            // x + 0.044715·x³, either order.
            let term = |x: NodeId, t: NodeId| -> Option<Vec<NodeId>> {
                let (cube, k) = scaled(graph, t)?;
                let mut nodes = vec![t, cube];
                if let Op::Binary(BinaryOp::Mul) = graph.node(cube).op {
                    nodes.extend(graph.operands(cube).into_iter().filter(|&s| s != x));
                }
                (near(k, 0.044715) && private(graph, t) && private(graph, cube) && cube_of(graph, cube)? == x)
                    .then_some(nodes)
            };
            let (x, nodes) = match term(l, r) {
                Some(nodes) => (l, nodes),
                None => (r, term(r, l)?),
            };
            let mut chain = vec![inner, sum];
            chain.extend(nodes);
            (x, UnaryOp::GeluTanh, chain)
        }
        _ => return None,
    };
    let a = reader(graph, f)?;
    if !one_plus(graph, a, f) {
        return None;
    }
    let (result, rest) = half_x_times(graph, a, x)?;
    // The result's readers are taken over by operand; a control edge on it would keep the chain.
    let ordered =
        !graph.control_predecessors(result).is_empty() || !graph.control_successors(result).is_empty();
    if graph.node(x).shape != graph.node(result).shape || graph.node(x).dtype != node.dtype || ordered {
        return None;
    }
    chain.extend([f, a]);
    chain.extend(rest);
    Some(Match { x, op, result, chain })
}

fn apply(graph: &mut Graph, m: Match) {
    let template = graph.node(m.result).clone();
    let gelu = graph.add(Node { op: Op::Unary(m.op), ..template }, &[m.x]);
    graph.replace_uses(m.result, gelu);
    remove_unread(graph, &m.chain);
}
