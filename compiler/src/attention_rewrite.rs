//! Attention that a graph composes itself (an imported ONNX model, a hand-written layer), as one
//! `Op::Attention`: softmax(c · q·kᵀ + bias) · v, matched as
//!
//! - a product of q and k: `MatMul(q, k, transpose_b)`, or `MatMul(q, Permute(k'))` where the
//!   permutation's last two axes are swapped (a permutation that also moves heads gives k as the
//!   same permutation with those two axes back in place, a new `Permute`);
//! - optionally scaled by a scalar constant (`Scalar` product, or `Mul` / `Div` by a one-element
//!   `Fill`), after the product, on q, on k, or several of these (the factors multiply);
//! - optionally plus a bias (`Add`) that broadcasts into the scores and depends on no trained
//!   parameter (a mask from the inputs and constants; a learned position bias stays composed);
//! - a softmax over the last axis, read only by
//! - a product with v: `MatMul(p, v)`, v `[.., T, D]` with q's leading axes and head width.
//!
//! The scores, their scaled and biased forms and the probabilities must have no other reader, no
//! output and no control edge. Run before autodiff (`step`): the op's gradient recomputes the
//! probabilities, so that no `[.., S, T]` value is kept from the forward pass to the backward.

use crate::error::{CompileError, Result};
use crate::ir::{BinaryOp, DType, Graph, Node, NodeId, Op, ScalarOp, Shape, UnaryOp, VarRole, infer};

/// Replaces every matched composition of `graph` by one `Op::Attention`; the count replaced.
/// The graph is renumbered afterwards (operands before users, dense ids) when anything changed.
pub fn rewrite(graph: &mut Graph) -> Result<usize> {
    rewrite_matches(graph, "attention_rewrite", |op| matches!(op, Op::Softmax { .. }), find, apply)
}

/// A pattern rewrite before autodiff: for each node whose op `starts` a match (taken before any
/// rewrite, skipped once a rewrite removed it), `find`'s match made by `apply`; the count made.
/// The graph is renumbered afterwards (operands before users, dense ids) when anything changed.
pub(crate) fn rewrite_matches<M>(
    graph: &mut Graph,
    name: &str,
    starts: impl Fn(&Op) -> bool,
    find: impl Fn(&Graph, NodeId) -> Option<M>,
    apply: impl Fn(&mut Graph, M),
) -> Result<usize> {
    let candidates: Vec<NodeId> = graph.node_ids().filter(|&n| starts(&graph.node(n).op)).collect();
    let mut count = 0;
    for n in candidates {
        if !graph.contains(n) {
            continue;
        }
        if let Some(m) = find(graph, n) {
            apply(graph, m);
            count += 1;
        }
    }
    if count > 0 {
        *graph = graph.compacted().ok_or_else(|| CompileError::Internal(format!("{name} made a cycle")))?;
    }
    Ok(count)
}

/// One match: the operands of the new op and the nodes it replaces.
struct Match {
    q: NodeId,
    /// k `[.., T, D]`, or the operand of a permutation that gives it (`k_perm`).
    k: NodeId,
    k_perm: Option<Vec<usize>>,
    v: NodeId,
    bias: Option<NodeId>,
    /// A masking `Select`'s mask and fill: the bias gets `select(mask, 0, fill)` added.
    mask: Option<(NodeId, f32)>,
    /// The shape of the bias the op reads (the bias's and the mask's broadcast).
    bias_shape: Option<Shape>,
    scale: f32,
    /// The final product, whose readers the new op takes over.
    product: NodeId,
    /// Nodes that may be left without readers.
    chain: Vec<NodeId>,
}

/// Whether `n` is read once, by operand, and is neither an output nor ordered by control edges.
pub(crate) fn private(graph: &Graph, n: NodeId) -> bool {
    graph.users(n).len() == 1
        && graph.successors(n).count() == 1
        && graph.control_predecessors(n).is_empty()
        && !graph.outputs().iter().any(|(_, o)| *o == n)
}

/// The value of a one-element constant: a fill, or unary, binary, scalar ops and float casts
/// over such constants (an exporter's `sqrt(1 / sqrt(d))` or `0 + 64 ^ 0.5` of a head width).
pub(crate) fn constant(graph: &Graph, n: NodeId) -> Option<f32> {
    let node = graph.node(n);
    if node.shape.numel() != 1 || node.dtype != DType::F32 {
        return None;
    }
    let operand = || graph.operands(n).first().and_then(|&o| constant(graph, o));
    let v = match &node.op {
        Op::Fill { value, .. } => *value,
        Op::Cast { to: DType::F32 } => operand()?,
        Op::Unary(u) => {
            let x = operand()?;
            match u {
                UnaryOp::Sqrt => x.sqrt(),
                UnaryOp::Rsqrt => 1.0 / x.sqrt(),
                UnaryOp::Reciprocal => 1.0 / x,
                UnaryOp::Neg => -x,
                _ => return None,
            }
        }
        Op::Binary(b) => {
            let [x, y] = graph.operands(n)[..] else { return None };
            let (x, y) = (constant(graph, x)?, constant(graph, y)?);
            match b {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => x * y,
                BinaryOp::Div => x / y,
                BinaryOp::Pow => x.powf(y),
                _ => return None,
            }
        }
        Op::Scalar { op: ScalarOp::Mul, value } => operand()? * value,
        Op::Scalar { op: ScalarOp::Add, value } => operand()? + value,
        _ => return None,
    };
    v.is_finite().then_some(v)
}

/// `n` as (x, c) where n = c·x for a scalar constant c, of x's shape.
pub(crate) fn scaled(graph: &Graph, n: NodeId) -> Option<(NodeId, f32)> {
    let ops = graph.operands(n);
    let (x, c) = match &graph.node(n).op {
        Op::Scalar { op: ScalarOp::Mul, value } => (ops[0], *value),
        Op::Binary(BinaryOp::Mul) => match (constant(graph, ops[0]), constant(graph, ops[1])) {
            (_, Some(c)) => (ops[0], c),
            (Some(c), None) => (ops[1], c),
            _ => return None,
        },
        Op::Binary(BinaryOp::Div) => (ops[0], 1.0 / constant(graph, ops[1])?),
        _ => return None,
    };
    (graph.node(x).shape == graph.node(n).shape && c.is_finite()).then_some((x, c))
}

/// Whether `n` reads a trained parameter, directly or not.
fn reads_parameter(graph: &Graph, n: NodeId) -> bool {
    graph
        .ancestors(&[n])
        .into_iter()
        .any(|a| matches!(graph.node(a).op, Op::Variable { role: VarRole::Parameter, .. }))
}

/// The scores' product behind `n` (optionally scaled): (product, q, k, k's permutation, scale,
/// nodes passed).
#[allow(clippy::type_complexity)]
fn scores(
    graph: &Graph,
    n: NodeId,
) -> Option<(NodeId, NodeId, NodeId, Option<Vec<usize>>, f32, Vec<NodeId>)> {
    let mut chain = vec![];
    let (mut prod, mut scale) = (n, 1.0f32);
    if let Some((x, c)) = scaled(graph, n) {
        if !private(graph, n) {
            return None;
        }
        chain.push(n);
        (prod, scale) = (x, c);
    }
    let Op::MatMul { transpose_a: false, transpose_b } = graph.node(prod).op else { return None };
    if !private(graph, prod) {
        return None;
    }
    chain.push(prod);
    let ops = graph.operands(prod);
    let (mut q, kt) = (ops[0], ops[1]);
    let (mut kt, mut k_scale) = (kt, 1.0f32);
    if !transpose_b && let Some((x, c)) = scaled(graph, kt) {
        // A scale on kᵀ (PyTorch's decomposition scales q and kᵀ by √scale each).
        if !private(graph, kt) {
            return None;
        }
        chain.push(kt);
        (kt, k_scale) = (x, c);
    }
    scale *= k_scale;
    let (mut k, mut perm) = (kt, None);
    if !transpose_b {
        let Op::Permute { perm: p } = &graph.node(kt).op else { return None };
        let r = p.len();
        let mut p = p.clone();
        p.swap(r - 2, r - 1);
        chain.push(kt);
        k = graph.operands(kt)[0];
        perm = (!p.iter().enumerate().all(|(i, &a)| i == a)).then_some(p);
    }
    if let Some((x, c)) = scaled(graph, q) {
        chain.push(q);
        (q, scale) = (x, scale * c);
    }
    if let Some((x, c)) = scaled(graph, k) {
        chain.push(k);
        (k, scale) = (x, scale * c);
    }
    Some((prod, q, k, perm, scale, chain))
}

fn find(graph: &Graph, sm: NodeId) -> Option<Match> {
    let node = graph.node(sm);
    let Op::Softmax { axis } = node.op else { return None };
    if axis + 1 != node.shape.rank()
        || node.shape.rank() < 2
        || node.dtype != DType::F32
        || !private(graph, sm)
    {
        return None;
    }
    let product = graph.users(sm)[0];
    if graph.node(product).op != (Op::MatMul { transpose_a: false, transpose_b: false }) {
        return None;
    }
    let ops = graph.operands(product);
    if ops[0] != sm || ops[1] == sm {
        return None;
    }
    let v = ops[1];
    let x = graph.operands(sm)[0];
    let mut chain = vec![product, sm];
    // The scores behind an optional masking `Select` (transformers' `where(mask, w, min)`).
    let masked = |n: NodeId| -> Option<(NodeId, Option<(NodeId, f32)>)> {
        if let Op::Select = graph.node(n).op {
            let [m, w, c] = graph.operands(n)[..] else { return None };
            let fill = constant(graph, c).filter(|&c| c <= -1e4)?;
            let ok = private(graph, n)
                && graph.node(w).shape == graph.node(n).shape
                && matches!(graph.node(m).dtype, DType::F32 | DType::Bool)
                && !reads_parameter(graph, m)
                && scores(graph, w).is_some();
            return ok.then_some((w, Some((m, fill))));
        }
        scores(graph, n).map(|_| (n, None))
    };
    let (x, bias) = match graph.node(x).op {
        Op::Binary(BinaryOp::Add) if private(graph, x) => {
            let ab = graph.operands(x);
            let side = (0..2)
                .find(|&i| graph.node(ab[i]).shape == graph.node(x).shape && masked(ab[i]).is_some())?;
            chain.push(x);
            (ab[side], Some(ab[1 - side]))
        }
        _ => (x, None),
    };
    let (s, mask) = masked(x)?;
    if mask.is_some() {
        chain.push(x);
    }
    let (_, q, k, k_perm, scale, passed) = scores(graph, s)?;
    chain.extend(passed);
    if bias.is_some_and(|b| reads_parameter(graph, b)) {
        return None;
    }
    // The op's own checks: q, k and v of one head width and leading axes, the bias broadcasting.
    let k_shape = match &k_perm {
        Some(p) => {
            let d = graph.node(k).shape.dims();
            Shape::new(p.iter().map(|&a| d[a]).collect::<Vec<_>>())
        }
        None => graph.node(k).shape.clone(),
    };
    let bias_shape = match (bias, mask) {
        (Some(b), None) => Some(graph.node(b).shape.clone()),
        (None, Some((m, _))) => Some(graph.node(m).shape.clone()),
        (Some(b), Some((m, _))) => Some(Shape::broadcast(&graph.node(b).shape, &graph.node(m).shape)?),
        (None, None) => None,
    };
    let mut shapes = vec![&graph.node(q).shape, &k_shape, &graph.node(v).shape];
    if let Some(b) = &bias_shape {
        shapes.push(b);
    }
    let typed: Vec<(&Shape, DType)> = shapes.iter().map(|&s| (s, DType::F32)).collect();
    let all_f32 = [q, k, v].into_iter().chain(bias).all(|n| graph.node(n).dtype == DType::F32);
    let op = Op::Attention { scale, causal: false };
    match infer(&op, &typed) {
        Ok((out, _)) if all_f32 && out == graph.node(product).shape => {}
        _ => return None,
    }
    Some(Match { q, k, k_perm, v, bias, mask, bias_shape, scale, product, chain })
}

fn apply(graph: &mut Graph, m: Match) {
    let template = graph.node(m.product).clone();
    let k = match &m.k_perm {
        Some(perm) => {
            let kn = graph.node(m.k).clone();
            let d = kn.shape.dims();
            let shape = Shape::new(perm.iter().map(|&a| d[a]).collect::<Vec<_>>());
            graph.add(Node { op: Op::Permute { perm: perm.clone() }, shape, ..kn }, &[m.k])
        }
        None => m.k,
    };
    // where(mask, w, fill) is w + where(mask, 0, fill) for a fill far below any score: the
    // masked probabilities are 0 either way.
    let mut bias = m.bias;
    if let Some((mask, fill)) = m.mask {
        let scalar = |graph: &mut Graph, value: f32| {
            let op = Op::Fill { value, shape: Shape::scalar() };
            graph.add(Node { op, shape: Shape::scalar(), dtype: DType::F32, ..template.clone() }, &[])
        };
        let (zero, low) = (scalar(graph, 0.0), scalar(graph, fill));
        let shape = graph.node(mask).shape.clone();
        let select = graph
            .add(Node { op: Op::Select, shape, dtype: DType::F32, ..template.clone() }, &[mask, zero, low]);
        bias = Some(match bias {
            Some(b) => {
                let shape = m.bias_shape.clone().expect("a bias shape with a bias");
                let op = Op::Binary(BinaryOp::Add);
                graph.add(Node { op, shape, dtype: DType::F32, ..template.clone() }, &[b, select])
            }
            None => select,
        });
    }
    let mut operands = vec![m.q, k, m.v];
    operands.extend(bias);
    let attention =
        graph.add(Node { op: Op::Attention { scale: m.scale, causal: false }, ..template }, &operands);
    graph.replace_uses(m.product, attention);
    remove_unread(graph, &m.chain);
}

/// Removes the nodes of `chain` that nothing reads any more (no reader, no control edge, no
/// output, no effect), readers first, until none is left to remove: what a rewrite replaced.
pub(crate) fn remove_unread(graph: &mut Graph, chain: &[NodeId]) {
    let mut changed = true;
    while changed {
        changed = false;
        for &n in chain {
            let dead = graph.contains(n)
                && graph.successors(n).count() == 0
                && graph.control_predecessors(n).is_empty()
                && !graph.outputs().iter().any(|(_, o)| *o == n)
                && !graph.node(n).op.is_effect();
            if dead {
                graph.remove(n);
                changed = true;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;

    fn count(graph: &Graph, f: impl Fn(&Op) -> bool) -> usize {
        graph.node_ids().filter(|&n| f(&graph.node(n).op)).count()
    }

    /// The composed forms (transpose_b or a head permutation of k, a scale after the product or
    /// on q, a mask bias) become one op each; a bias from a parameter, or probabilities read
    /// twice, stay composed.
    #[test]
    fn composed_attention_becomes_one_op() {
        let t = Tracer::new("composed");
        let q = t.input("q", [2, 3, 5, 4]);
        let k = t.input("k", [2, 3, 7, 4]);
        let v = t.input("v", [2, 3, 7, 4]);
        let mask = t.input("mask", [2, 1, 1, 7]);
        // softmax(q·kᵀ / 2 + mask) · v
        let a = (q.matmul_t(&k, false, true) * 0.5 + &mask).softmax(-1).matmul(&v);
        // k as [b, t, h, d] with a combined permutation, the scale on q.
        let kb = t.input("kb", [2, 7, 3, 4]);
        let b = q.mul(0.25).matmul(&kb.permute(&[0, 2, 3, 1])).softmax(-1).matmul(&v);
        // A learned bias stays.
        let w = t.param("w", [5, 7], crate::ir::Init::Constant(0.0));
        let c = (q.matmul_t(&k, false, true) + &w).softmax(-1).matmul(&v);
        // Probabilities read twice stay.
        let p = q.matmul_t(&k, false, true).softmax(-1);
        let d = p.matmul(&v) + p.sum(-1, true);
        t.output("a", &a);
        t.output("b", &b);
        t.output("c", &c);
        t.output("d", &d);
        let mut g = t.finish().unwrap();
        assert_eq!(count(&g, |o| matches!(o, Op::Softmax { .. })), 4);
        assert_eq!(rewrite(&mut g).unwrap(), 2);
        assert_eq!(count(&g, |o| matches!(o, Op::Attention { .. })), 2);
        assert_eq!(count(&g, |o| matches!(o, Op::Softmax { .. })), 2);
        let scales: Vec<Op> = g
            .node_ids()
            .map(|n| g.node(n).op.clone())
            .filter(|o| matches!(o, Op::Attention { .. }))
            .collect();
        assert!(scales.contains(&Op::Attention { scale: 0.5, causal: false }));
        assert!(scales.contains(&Op::Attention { scale: 0.25, causal: false }));
        for (i, n) in g.node_ids().enumerate() {
            assert!(g.operands(n).iter().all(|&o| o < n), "node {i} reads a later node");
        }
    }

    /// transformers' and PyTorch's exported forms: scores masked by `where(mask, w, min)` (and
    /// a padding bias added after), and q and kᵀ each scaled by √scale with a scale computed
    /// from constants.
    #[test]
    fn masked_selects_and_scales_on_both_factors_become_one_op() {
        let t = Tracer::new("exported");
        let q = t.input("q", [2, 3, 5, 4]);
        let k = t.input("k", [2, 3, 5, 4]);
        let v = t.input("v", [2, 3, 5, 4]);
        let causal = t.input("causal", [1, 1, 5, 5]);
        let padding = t.input("padding", [2, 1, 1, 5]);
        let low = t.fill(-3.0e38, Shape::scalar());
        let w = q.matmul_t(&k, false, true).mul(0.5);
        let a = causal.select(&w, &low).softmax(-1).matmul(&v);
        let b = (causal.select(&q.matmul_t(&k, false, true), &low) + &padding).softmax(-1).matmul(&v);
        let root = t.fill(0.25, Shape::scalar()).sqrt();
        let kt = k.permute(&[0, 1, 3, 2]);
        let c = (&q * &root).matmul(&(&kt * &root)).softmax(-1).matmul(&v);
        t.output("a", &a);
        t.output("b", &b);
        t.output("c", &c);
        let mut g = t.finish().unwrap();
        assert_eq!(rewrite(&mut g).unwrap(), 3);
        assert_eq!(count(&g, |o| matches!(o, Op::Softmax { .. })), 0);
        let scales: Vec<Op> = g
            .node_ids()
            .map(|n| g.node(n).op.clone())
            .filter(|o| matches!(o, Op::Attention { .. }))
            .collect();
        assert!(scales.contains(&Op::Attention { scale: 0.5, causal: false }));
        assert!(scales.contains(&Op::Attention { scale: 1.0, causal: false }));
        assert!(scales.contains(&Op::Attention { scale: 0.25, causal: false }));
    }
}
