//! Constant folding: values computed from constants alone are computed once, at compile time.
//!
//! A mask or a table built from `fill`, `iota` and layout ops (a causal mask padded, sliced and
//! broadcast, a block-diagonal pattern concatenated from fills) otherwise runs every step: each
//! `Pad`, `Slice`, `Permute` or `Concat` of it is a kernel and an arena buffer. This pass
//! evaluates such a value on the host and puts it in the plan as a constant variable
//! (`VarRole::Constant`, key `constant/<hash of shape and bits>`): its data travels in the plan
//! (`Plan::constants`) and the backends write it into the variable region once, at load.
//!
//! What is folded, and why not more:
//! - only f32 values of ops whose every element the evaluator computes with the very
//!   arithmetic of the CPU kernels (`kiln_kernels::cpu::math`: IEEE add, subtract, multiply,
//!   divide and square root, comparisons, select, max/min with their NaN rule, sign, relu, and
//!   the layout ops, which move bits): a folded plan computes the unfolded plan's bits.
//!   Transcendentals (exp, tanh, erf ...) and reductions (whose summation order is the
//!   kernel's) are left to run;
//! - a constant expression of sources and elementwise ops alone is left as it is: fusion copies
//!   it into each reader's kernel (`fusion`: an iota-made causal mask costs no buffer and no
//!   launch), where folding would make it persistent bytes (and with fusion off, the baseline
//!   plans keep the op stream as traced). What is folded is a constant expression with a layout
//!   op (`Pad`, `Slice`, `Permute`, `Concat`), which no fused kernel can take in;
//! - a value over `MAX_FOLD_BYTES` (and every value the evaluation passes through is held to the
//!   same bound) stays in the graph: the plan would carry it, and a large constant is usually a
//!   broadcast a kernel reads for free.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::error::{CompileError, Result};
use crate::ir::{BinaryOp, DType, Graph, Init, Node, NodeId, Op, ScalarOp, Shape, UnaryOp, VarRole};
use petgraph::algo::toposort;

/// The largest value folded, and the largest the evaluation passes through: 4 MiB.
pub const MAX_FOLD_BYTES: usize = 4 << 20;

/// What folding did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FoldFigures {
    /// Constants made, the nodes they replaced (gone from the graph: fills and iotas
    /// included), and their bytes.
    pub constants: usize,
    /// The graph nodes the constants replaced.
    pub ops: usize,
    /// The constants' bytes (each an f32 variable of the plan).
    pub bytes: usize,
}

/// Folds `graph`'s constant expressions that have a layout op (see the module doc).
pub fn fold(graph: &mut Graph) -> Result<FoldFigures> {
    let order = toposort(graph.petgraph(), None)
        .map_err(|_| CompileError::Internal("const_fold: the graph has a cycle".into()))?;
    // Constant nodes, and whether each one's expression has a layout op fusion cannot take in.
    let mut constant: HashMap<NodeId, bool> = HashMap::new();
    for &n in &order {
        if let Some(layout) = foldable(graph, n, &constant) {
            constant.insert(n, layout);
        }
    }
    let outputs: HashSet<NodeId> = graph.outputs().iter().map(|(_, o)| *o).collect();
    // A constant read outside the constant expressions is folded; a broadcast (or a reshape of
    // one) stays in the graph over the folded value it broadcasts, which every kernel reads for
    // free, rather than folded at its larger size.
    let mut roots: Vec<NodeId> = Vec::new();
    for &n in &order {
        if !constant.get(&n).is_some_and(|&layout| layout)
            || !(outputs.contains(&n) || graph.users(n).iter().any(|u| !constant.contains_key(u)))
        {
            continue;
        }
        let mut root = n;
        while matches!(graph.node(root).op, Op::BroadcastTo { .. } | Op::Reshape { .. }) {
            root = graph.operands(root)[0];
        }
        if !matches!(graph.node(root).op, Op::Fill { .. } | Op::Iota { .. } | Op::Variable { .. })
            && graph.node(root).bytes() <= MAX_FOLD_BYTES
            && !roots.contains(&root)
        {
            roots.push(root);
        }
    }
    let mut values: HashMap<NodeId, Arc<[f32]>> = HashMap::new();
    let mut figures = FoldFigures::default();
    let mut replaced = Vec::new();
    // Equal constants on one device are one variable (a variable is declared once per plan):
    // copies of one expression, as a graph split into blocks of rows holds, fold into one.
    let mut made: HashMap<(String, crate::ir::DeviceId), NodeId> = HashMap::new();
    for &root in &roots {
        let Some(data) = evaluate(graph, root, &mut values) else { continue };
        let node = graph.node(root).clone();
        let key = format!("constant/{:016x}", fingerprint(&node.shape, &data));
        if let Some(&c) = made.get(&(key.clone(), node.device)) {
            graph.replace_uses(root, c);
            replaced.push(root);
            continue;
        }
        graph.set_constant(key.clone(), data);
        let op = Op::Variable {
            key: key.clone(),
            shape: node.shape.clone(),
            dtype: DType::F32,
            role: VarRole::Constant,
            init: Init::Zeros,
        };
        let c = graph.add(Node { op, ..node.clone() }, &[]);
        made.insert((key, node.device), c);
        graph.replace_uses(root, c);
        figures.constants += 1;
        figures.bytes += node.bytes();
        replaced.push(root);
    }
    // The folded expressions, now unread, leave the graph (a constant still read elsewhere stays).
    let mut dead: Vec<NodeId> = replaced;
    while let Some(n) = dead.pop() {
        if !graph.contains(n) || !graph.users(n).is_empty() || graph.outputs().iter().any(|(_, o)| *o == n) {
            continue;
        }
        let operands = graph.operands(n);
        graph.remove(n);
        figures.ops += 1;
        dead.extend(operands.into_iter().filter(|o| constant.contains_key(o)));
    }
    Ok(figures)
}

/// `Some(layout)` when `n` is an f32 value computed from constants alone by ops the evaluator
/// computes exactly; `layout` says whether its expression has a layout op.
fn foldable(graph: &Graph, n: NodeId, constant: &HashMap<NodeId, bool>) -> Option<bool> {
    let node = graph.node(n);
    if node.dtype != DType::F32
        || !graph.control_predecessors(n).is_empty()
        || !graph.control_successors(n).is_empty()
    {
        return None;
    }
    let operands = graph.operands(n);
    let from = |layout: bool| -> Option<bool> {
        let mut any = layout;
        for o in &operands {
            any |= *constant.get(o)?;
            if graph.node(*o).device != node.device {
                return None;
            }
        }
        Some(any)
    };
    match &node.op {
        Op::Fill { .. } | Op::Iota { .. } => Some(false),
        Op::Variable { role: VarRole::Constant, key, .. } => graph.constant(key).map(|_| false),
        Op::Unary(u) if exact_unary(*u) => from(false),
        Op::Binary(b) if exact_binary(*b) => from(false),
        Op::Scalar { op, value } if exact_scalar(*op, *value) => from(false),
        Op::Select | Op::Reshape { .. } | Op::BroadcastTo { .. } => from(false),
        Op::Cast { to: DType::F32 } => from(false),
        Op::Permute { .. } | Op::Slice { .. } | Op::Pad { .. } | Op::Concat { .. } => from(true),
        _ => None,
    }
}

fn exact_unary(u: UnaryOp) -> bool {
    use UnaryOp::*;
    matches!(u, Neg | Abs | Sign | Relu | Sqrt | Rsqrt | Square | Reciprocal)
}

fn exact_binary(b: BinaryOp) -> bool {
    use BinaryOp::*;
    matches!(
        b,
        Add | Sub
            | Mul
            | Div
            | Maximum
            | Minimum
            | Greater
            | GreaterEqual
            | Less
            | LessEqual
            | Equal
            | NotEqual
    )
}

fn exact_scalar(op: ScalarOp, c: f32) -> bool {
    op != ScalarOp::Pow || [2.0, 1.0, 0.5, -1.0, 0.0].contains(&c)
}

// The kernels' arithmetic (`kiln_kernels::cpu::math`), element by element.
fn max_nan(a: f32, b: f32) -> f32 {
    if a > b || a.is_nan() { a } else { b }
}

fn min_nan(a: f32, b: f32) -> f32 {
    if a < b || a.is_nan() { a } else { b }
}

fn flag(b: bool) -> f32 {
    if b { 1.0 } else { 0.0 }
}

fn unary(u: UnaryOp, x: f32) -> f32 {
    match u {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Sign if x > 0.0 => 1.0,
        UnaryOp::Sign if x < 0.0 => -1.0,
        UnaryOp::Sign => x,
        UnaryOp::Relu if x < 0.0 => 0.0,
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Square => x * x,
        UnaryOp::Reciprocal => 1.0 / x,
        _ => x,
    }
}

fn binary(b: BinaryOp, x: f32, y: f32) -> f32 {
    match b {
        BinaryOp::Add => x + y,
        BinaryOp::Sub => x - y,
        BinaryOp::Mul => x * y,
        BinaryOp::Div => x / y,
        BinaryOp::Maximum => max_nan(x, y),
        BinaryOp::Minimum => min_nan(x, y),
        BinaryOp::Greater => flag(x > y),
        BinaryOp::GreaterEqual => flag(x >= y),
        BinaryOp::Less => flag(x < y),
        BinaryOp::LessEqual => flag(x <= y),
        BinaryOp::Equal => flag(x == y),
        BinaryOp::NotEqual => flag(x != y),
        _ => f32::NAN,
    }
}

fn scalar(op: ScalarOp, c: f32, x: f32) -> f32 {
    match op {
        ScalarOp::Add => x + c,
        ScalarOp::Mul => x * c,
        ScalarOp::RSub => c - x,
        ScalarOp::RDiv => c / x,
        ScalarOp::Pow if c == 2.0 => x * x,
        ScalarOp::Pow if c == 1.0 => x,
        ScalarOp::Pow if c == 0.5 => x.sqrt(),
        ScalarOp::Pow if c == -1.0 => 1.0 / x,
        ScalarOp::Pow => 1.0,
        ScalarOp::Max => max_nan(x, c),
        ScalarOp::Min => min_nan(x, c),
        ScalarOp::Greater => flag(x > c),
        ScalarOp::GreaterEqual => flag(x >= c),
        ScalarOp::Less => flag(x < c),
        ScalarOp::LessEqual => flag(x <= c),
        ScalarOp::Equal => flag(x == c),
    }
}

/// The value of constant node `n`, row-major; `None` where a value on the way is over
/// `MAX_FOLD_BYTES`.
fn evaluate(graph: &Graph, n: NodeId, memo: &mut HashMap<NodeId, Arc<[f32]>>) -> Option<Arc<[f32]>> {
    if let Some(v) = memo.get(&n) {
        return Some(v.clone());
    }
    let node = graph.node(n);
    if node.bytes() > MAX_FOLD_BYTES {
        return None;
    }
    let operands = graph.operands(n);
    let mut args = Vec::with_capacity(operands.len());
    for &o in &operands {
        args.push((evaluate(graph, o, memo)?, graph.node(o).shape.clone()));
    }
    let out = &node.shape;
    let at = |i: usize| -> Vec<f32> { broadcast(&args[i].0, &args[i].1, out) };
    let data: Vec<f32> = match &node.op {
        Op::Fill { value, .. } => vec![*value; out.numel()],
        Op::Iota { axis, .. } => {
            let strides = out.strides();
            (0..out.numel()).map(|i| ((i / strides[*axis]) % out.dims()[*axis]) as f32).collect()
        }
        Op::Variable { key, .. } => graph.constant(key)?.to_vec(),
        Op::Unary(u) => at(0).into_iter().map(|x| unary(*u, x)).collect(),
        Op::Binary(b) => at(0).into_iter().zip(at(1)).map(|(x, y)| binary(*b, x, y)).collect(),
        Op::Scalar { op, value } => at(0).into_iter().map(|x| scalar(*op, *value, x)).collect(),
        Op::Select => {
            let (c, a, b) = (at(0), at(1), at(2));
            c.iter().zip(a).zip(b).map(|((c, a), b)| if *c != 0.0 { a } else { b }).collect()
        }
        Op::Reshape { .. } | Op::Cast { .. } => args[0].0.to_vec(),
        Op::BroadcastTo { .. } => at(0),
        Op::Permute { perm } => {
            let (data, shape) = (&args[0].0, &args[0].1);
            let in_strides = shape.strides();
            let out_strides = out.strides();
            (0..out.numel())
                .map(|i| {
                    let src: usize = perm
                        .iter()
                        .enumerate()
                        .map(|(a, &p)| (i / out_strides[a] % out.dims()[a]) * in_strides[p])
                        .sum();
                    data[src]
                })
                .collect()
        }
        Op::Slice { axis, start, .. } => {
            let (data, shape) = (&args[0].0, &args[0].1);
            let (outer, inner) = split(out, *axis);
            let (len, full) = (out.dims()[*axis], shape.dims()[*axis]);
            let mut v = Vec::with_capacity(out.numel());
            for o in 0..outer {
                let base = o * full * inner + start * inner;
                v.extend_from_slice(&data[base..base + len * inner]);
            }
            v
        }
        Op::Pad { axis, before, .. } => {
            let (data, shape) = (&args[0].0, &args[0].1);
            let (outer, inner) = split(out, *axis);
            let (len, full) = (shape.dims()[*axis], out.dims()[*axis]);
            let mut v = vec![0.0; out.numel()];
            for o in 0..outer {
                let to = o * full * inner + before * inner;
                v[to..to + len * inner].copy_from_slice(&data[o * len * inner..(o + 1) * len * inner]);
            }
            v
        }
        Op::Concat { axis } => {
            let (outer, inner) = split(out, *axis);
            let mut v = Vec::with_capacity(out.numel());
            for o in 0..outer {
                for (data, shape) in &args {
                    let len = shape.dims()[*axis] * inner;
                    v.extend_from_slice(&data[o * len..(o + 1) * len]);
                }
            }
            v
        }
        _ => return None,
    };
    if data.len() != out.numel() {
        return None;
    }
    let data: Arc<[f32]> = data.into();
    memo.insert(n, data.clone());
    Some(data)
}

/// (the product of the axes before `axis`, the product of those after it) of `shape`.
fn split(shape: &Shape, axis: usize) -> (usize, usize) {
    let dims = shape.dims();
    (dims[..axis].iter().product(), dims[axis + 1..].iter().product())
}

/// `data` of `shape` broadcast (NumPy rules) to `out`.
fn broadcast(data: &[f32], shape: &Shape, out: &Shape) -> Vec<f32> {
    if shape == out {
        return data.to_vec();
    }
    let rank = out.rank();
    let pad = rank - shape.rank();
    let strides = shape.strides();
    let src_stride: Vec<usize> =
        (0..rank).map(|a| if a < pad || shape.dims()[a - pad] == 1 { 0 } else { strides[a - pad] }).collect();
    let out_strides = out.strides();
    (0..out.numel())
        .map(|i| data[(0..rank).map(|a| (i / out_strides[a] % out.dims()[a]) * src_stride[a]).sum::<usize>()])
        .collect()
}

/// FNV-1a over the dims and the bits: the constant's key, so that equal constants of two plans
/// share one slot (the variable store finds variables by key).
fn fingerprint(shape: &Shape, data: &[f32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    for &d in shape.dims() {
        eat(&(d as u64).to_le_bytes());
    }
    for v in data {
        eat(&v.to_bits().to_le_bytes());
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A [4, 4] lower-triangular mask built from fills, pads and slices, added to x.
    fn padded_mask() -> (Graph, NodeId) {
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[4, 4]);
        let ones = g.add_f32(Op::Fill { value: 1.0, shape: Shape::new(vec![4, 1]) }, &[4, 1], &[]);
        let padded = g.add_f32(Op::Pad { axis: 1, before: 0, after: 4 }, &[4, 5], &[ones]);
        let cut = g.add_f32(Op::Slice { axis: 1, start: 1, len: 4 }, &[4, 4], &[padded]);
        let scaled = g.add_f32(Op::Scalar { op: ScalarOp::Mul, value: -1e9 }, &[4, 4], &[cut]);
        let y = g.add_f32(Op::Binary(BinaryOp::Add), &[4, 4], &[x, scaled]);
        g.set_output("y", y);
        (g, y)
    }

    #[test]
    fn a_padded_and_sliced_mask_becomes_one_constant() {
        let (mut g, y) = padded_mask();
        let f = fold(&mut g).unwrap();
        assert_eq!(f.constants, 1);
        assert_eq!(f.ops, 4, "fill, pad, slice and scale are gone");
        assert_eq!(g.len(), 3, "x, the constant and the sum");
        let c = g.operands(y)[1];
        let Op::Variable { key, role: VarRole::Constant, .. } = &g.node(c).op else {
            panic!("{:?}", g.node(c))
        };
        let data = g.constant(key).unwrap();
        // Column 0 of the padded tensor (the ones) is sliced away: every element is 0 * -1e9.
        assert!(data.iter().all(|v| *v == 0.0 * -1e9), "{data:?}");
    }

    #[test]
    fn equal_constants_fold_into_one_variable() {
        // Two copies of one masked expression (as a graph split into blocks of rows holds).
        let mut g = Graph::new("t");
        let mut sums = Vec::new();
        for name in ["x", "z"] {
            let x = g.add_input(name, &[4, 4]);
            let ones = g.add_f32(Op::Fill { value: 1.0, shape: Shape::new(vec![4, 1]) }, &[4, 1], &[]);
            let padded = g.add_f32(Op::Pad { axis: 1, before: 0, after: 4 }, &[4, 5], &[ones]);
            let cut = g.add_f32(Op::Slice { axis: 1, start: 1, len: 4 }, &[4, 4], &[padded]);
            sums.push(g.add_f32(Op::Binary(BinaryOp::Add), &[4, 4], &[x, cut]));
        }
        g.set_output("a", sums[0]);
        g.set_output("b", sums[1]);
        let f = fold(&mut g).unwrap();
        assert_eq!(f.constants, 1, "one variable, declared once");
        assert_eq!(g.operands(sums[0])[1], g.operands(sums[1])[1]);
        assert_eq!(g.variables().len(), 1);
    }

    #[test]
    fn elementwise_constants_are_left_to_fusion() {
        let mut g = Graph::new("t");
        let x = g.add_input("x", &[4, 4]);
        let i = g.add_f32(Op::Iota { shape: Shape::new(vec![4, 4]), axis: 0 }, &[4, 4], &[]);
        let j = g.add_f32(Op::Iota { shape: Shape::new(vec![4, 4]), axis: 1 }, &[4, 4], &[]);
        let mask = g.add_f32(Op::Binary(BinaryOp::GreaterEqual), &[4, 4], &[i, j]);
        let y = g.add_f32(Op::Binary(BinaryOp::Mul), &[4, 4], &[x, mask]);
        g.set_output("y", y);
        assert_eq!(fold(&mut g).unwrap(), FoldFigures::default());
        let mut memo = HashMap::new();
        let want: Vec<f32> = (0..16).map(|k| if k / 4 >= k % 4 { 1.0 } else { 0.0 }).collect();
        assert_eq!(&evaluate(&g, mask, &mut memo).unwrap()[..], &want[..], "what it would fold to");
    }

    #[test]
    fn layouts_evaluate_as_the_ops_define_them() {
        let mut g = Graph::new("t");
        let i = g.add_f32(Op::Iota { shape: Shape::new(vec![2, 3]), axis: 1 }, &[2, 3], &[]);
        let r = g.add_f32(Op::Iota { shape: Shape::new(vec![2, 3]), axis: 0 }, &[2, 3], &[]);
        let v = g.add_f32(Op::Scalar { op: ScalarOp::Mul, value: 10.0 }, &[2, 3], &[r]);
        let v = g.add_f32(Op::Binary(BinaryOp::Add), &[2, 3], &[v, i]); // [[0,1,2],[10,11,12]]
        let t = g.add_f32(Op::Permute { perm: vec![1, 0] }, &[3, 2], &[v]);
        let c = g.add_f32(Op::Concat { axis: 1 }, &[3, 4], &[t, t]);
        g.set_output("c", c);
        let mut memo = HashMap::new();
        let data = evaluate(&g, c, &mut memo).unwrap();
        assert_eq!(&data[..], &[0., 10., 0., 10., 1., 11., 1., 11., 2., 12., 2., 12.]);
        fold(&mut g).unwrap();
        assert_eq!(g.len(), 1, "one constant, the output");
    }
}
