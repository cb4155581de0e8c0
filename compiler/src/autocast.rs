//! Mixed precision as a policy table: under `Precision::Mixed(half)`, which ops compute in the
//! half type (bf16 or f16, with f32 accumulation inside the kernel), which in f32, and which
//! follow their operands, applied to a traced graph before autodiff (`step`).
//!
//! The table (`rule`) is PyTorch's CUDA autocast lists written for kiln's ops:
//!
//! | rule | ops | PyTorch's list |
//! |---|---|---|
//! | `Half` | products (`MatMul`, `MatMulRows`), convolutions (`Conv2d`, every window), `Attention` | "lower precision fp" (`matmul`, `linear`, `conv2d`, `bmm`, `scaled_dot_product_attention`) |
//! | `F32` | reductions (`Reduce`: sum, mean, max), `Softmax`, `LogSoftmax`, `Exp`, `Log`, `Sqrt`, `Rsqrt`, `Reciprocal`, `Pow`, custom ops | "fp32" (`sum`, `softmax`, `log_softmax`, `exp`, `log`, `rsqrt`, `reciprocal`, `pow`, the norms and losses) |
//! | `Follow` | every other elementwise op, layout ops, pooling, gather | "promote" / unlisted: the widest float operand's type |
//! | `Keep` | sources, casts, effects, collectives | not autocast |
//!
//! Norms and losses are composed of reductions and elementwise ops in kiln's DSL and in ONNX
//! imports: their statistics are reductions (f32), and what combines a statistic with the input
//! follows the widest operand (f32), so a layer norm, a batch norm, a softmax cross-entropy
//! compute in f32 as PyTorch's autocast makes them, with no list of their own.
//!
//! What it produces, per op: float operands whose type differs from the rule's are cast to it
//! (one `Cast` per value and type, shared by every reader, so that a weight read by several
//! products is copied to half once per step and planned like any value), and the op's output
//! type is inferred again. Parameters and optimizer state stay f32 (master weights): autodiff
//! differentiates through the casts (`Cast`'s gradient is the cast back), so each weight's
//! gradient reaches its optimizer in f32. The graph's interface keeps its types: an output that
//! the policy made half is cast back to the type it was traced with.
//!
//! Rounded once: a product of half factors accumulates and stores f32 (`DType::accumulated`),
//! and the value is rounded where a half op reads it. Products that stored half rounded twice per
//! layer (the product, then the activation for the next product) and measured 1.1-1.3x the
//! error of PyTorch's autocast against f32 on the zoo (mlp 1.28, cnn 1.24, transformer 1.14,
//! GPT 1.09; `tests/autocast_numerics.rs`, mean over 8 seeds); rounded once, 0.87-1.00 over 32.
//! An activation whose gradient reads its input or output (GELU, sigmoid, tanh) reads its f32
//! input rounded to the half type, as autocast's would be half; ReLU's and max pooling's
//! gradients read a half copy of their activation (`narrow_saved`). So what a step keeps for
//! its backward pass is half values, as with half products: the zoo's bf16 steps plan 24.66 MB
//! (cnn, 24.68 with half products) and 31.17 MB (transformer, 31.69), the MLP's unchanged.
//!
//! Planned at their size: a half value takes 2 bytes an element in liveness and the arena. What a
//! fused plan keeps of the f32 chains between half values is the minimum cut's choice
//! (`saved_values`).

use crate::error::{CompileError, Result};
use crate::ir::{BinaryOp, PoolKind, ScalarOp};
use crate::ir::{DType, Graph, Node, NodeId, Op, UnaryOp, infer};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// A 16-bit floating-point type that mixed precision computes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Half {
    /// bfloat16: f32's exponent range, 8 significant bits; needs no loss scaling.
    BF16,
    /// IEEE half: 11 significant bits, largest finite value 65,504.
    F16,
}

impl Half {
    /// The element type of values computed in it.
    pub fn dtype(self) -> DType {
        match self {
            Half::BF16 => DType::BF16,
            Half::F16 => DType::F16,
        }
    }
}

/// The precision a model computes in: a compile option (`CompileOptions::precision`), the
/// `Trainer`'s and the CLI's `--precision f32|bf16|f16`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32 (the default).
    #[default]
    F32,
    /// Products, convolutions and attention in the half type with f32 accumulation; reductions,
    /// softmax, norms, losses and the optimizer in f32; parameters and optimizer state f32.
    Mixed(Half),
}

impl Precision {
    /// bf16 mixed precision.
    pub const BF16: Precision = Precision::Mixed(Half::BF16);
    /// f16 mixed precision.
    pub const F16: Precision = Precision::Mixed(Half::F16);

    /// The name the CLI takes and reports print: `f32`, `bf16` or `f16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Mixed(Half::BF16) => "bf16",
            Precision::Mixed(Half::F16) => "f16",
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Ok(Precision::F32),
            "bf16" | "bfloat16" => Ok(Precision::BF16),
            "f16" | "fp16" | "float16" | "half" => Ok(Precision::F16),
            _ => Err(format!("unknown precision `{s}`: use f32, bf16 or f16")),
        }
    }
}

/// What an op computes in under mixed precision (the table in the module's doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The half type: float operands cast to it.
    Half,
    /// f32: float operands cast to it.
    F32,
    /// The widest type among its float operands (f32 when any is f32), the others cast to it.
    Follow,
    /// Untouched.
    Keep,
}

/// The rule of `op` (the module's table).
pub fn rule(op: &Op) -> Rule {
    match op {
        Op::MatMul { .. } | Op::MatMulRows { .. } | Op::Conv2d { .. } | Op::Attention { .. } => Rule::Half,
        Op::Reduce { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } | Op::Custom { .. } => Rule::F32,
        Op::Unary(UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Reciprocal) => {
            Rule::F32
        }
        Op::Binary(BinaryOp::Pow) | Op::Scalar { op: ScalarOp::Pow, .. } => Rule::F32,
        Op::Input { .. }
        | Op::Variable { .. }
        | Op::Fill { .. }
        | Op::Iota { .. }
        | Op::RandomUniform { .. }
        | Op::Cast { .. } => Rule::Keep,
        op if op.is_effect() || op.is_collective() => Rule::Keep,
        _ => Rule::Follow,
    }
}

/// Applies `precision`'s policy to `graph` (a traced forward pass, with its loss for a training
/// step, before autodiff); the number of casts inserted. `Precision::F32` changes nothing.
pub fn apply(graph: &mut Graph, precision: Precision) -> Result<usize> {
    let Precision::Mixed(half) = precision else { return Ok(0) };
    let half = half.dtype();
    let order = petgraph::algo::toposort(graph.petgraph(), None)
        .map_err(|_| CompileError::Internal("autocast: the graph has a cycle".into()))?;
    let traced: HashMap<NodeId, DType> =
        graph.outputs().iter().map(|&(_, id)| (id, graph.node(id).dtype)).collect();
    let mut casts: HashMap<(NodeId, DType), NodeId> = HashMap::new();
    let mut inserted = 0;
    for id in order {
        let target = match rule(&graph.node(id).op) {
            Rule::Keep => continue,
            Rule::Half => half,
            Rule::F32 => DType::F32,
            Rule::Follow => {
                let floats: Vec<DType> = graph
                    .operands(id)
                    .iter()
                    .map(|&o| graph.node(o).dtype)
                    .filter(|d| d.is_float())
                    .collect();
                if floats.contains(&DType::F32) || floats.is_empty() { DType::F32 } else { half }
            }
        };
        let operands = graph.operands(id);
        for (i, &o) in operands.iter().enumerate() {
            let d = graph.node(o).dtype;
            if d.is_float() && d != target {
                let cast = match casts.get(&(o, target)) {
                    Some(&c) => c,
                    None => {
                        let (c, made) = cast_through_layout(graph, o, target);
                        inserted += made;
                        casts.insert((o, target), c);
                        c
                    }
                };
                graph.replace_operand(id, i, cast);
            }
        }
        // An activation reads its f32 input rounded to the half type, as autocast's activations
        // between half products are half: what its gradient and the next product's gradient
        // read is then recomputed from that half copy.
        if target == DType::F32 && activation(&graph.node(id).op) {
            let x = graph.operands(id)[0];
            if graph.node(x).dtype == DType::F32 {
                let narrow = match casts.get(&(x, half)) {
                    Some(&c) => c,
                    None => {
                        inserted += 1;
                        let c = cast_node(graph, x, half);
                        casts.insert((x, half), c);
                        c
                    }
                };
                let wide = match casts.get(&(narrow, DType::F32)) {
                    Some(&c) => c,
                    None => {
                        inserted += 1;
                        let c = cast_node(graph, narrow, DType::F32);
                        casts.insert((narrow, DType::F32), c);
                        c
                    }
                };
                graph.replace_operand(id, 0, wide);
            }
        }
        retype(graph, id, "autocast")?;
    }
    // The interface keeps its traced types.
    let outputs: Vec<(String, NodeId)> = graph.outputs().to_vec();
    for (name, id) in outputs {
        let want = traced[&id];
        if graph.node(id).dtype != want {
            let cast = cast_node(graph, id, want);
            inserted += 1;
            graph.set_output(name, cast);
        }
    }
    // Autodiff reads a traced graph: dense ids, operands before their users.
    if inserted > 0 {
        *graph = graph.compacted().ok_or_else(|| CompileError::Internal("autocast made a cycle".into()))?;
    }
    Ok(inserted)
}

/// Under `precision`'s half type, the backward ops of `graph` (a differentiated training step)
/// that read a forward activation to compute its derivative — ReLU's gradient, max pooling's
/// (which finds each window's maximum again) — read that activation rounded to the half type
/// (widened back), as PyTorch's autocast, whose activations between products are half,
/// computes them; the number of casts made. A value already cast to the half type (the input
/// of the next product) shares that cast. (GELU, sigmoid and tanh read a rounded input in the
/// forward pass already, `apply`; ReLU commutes with the rounding, so its forward pass keeps
/// the exact value: rounding before it measured 28.5 MB on the cnn's bf16 step, 24.7 after.)
///
/// Why: a product accumulates and stores f32 (`DType::accumulated`), rounded once where a
/// half op reads it, so the elementwise chain between two products computes in f32. Were the
/// backward pass to read those f32 values, the step would keep them for it (2x a half
/// value's bytes): the cnn's bf16 step planned 28.9 MB against 24.7 MB with half products.
/// Read rounded, what the step keeps is the half copy, which the next product's gradient
/// reads anyway (`saved_values` counts such a copy as a forward value, and fusion leaves it a
/// kernel of its own); `pool_relu_grad` still moves ReLU's mask to the pooled side. A ReLU
/// mask differs only where a positive value rounds to zero (below 2^-133 in bf16, 2^-25 in
/// f16); a pooling window's maximum, only where its two largest values round to one half
/// value, when the gradient goes to the first of them.
pub fn narrow_saved(graph: &mut Graph, precision: Precision) -> Result<usize> {
    let Precision::Mixed(half) = precision else { return Ok(0) };
    let half = half.dtype();
    let mut narrow: HashMap<NodeId, NodeId> = HashMap::new();
    for id in graph.node_ids() {
        if matches!(graph.node(id).op, Op::Cast { to } if to == half)
            && let [of] = graph.operands(id)[..]
        {
            narrow.entry(of).or_insert(id);
        }
    }
    let mut made = 0;
    let readers: Vec<NodeId> = graph
        .node_ids()
        .filter(|&id| {
            matches!(
                graph.node(id).op,
                Op::Binary(BinaryOp::ReluGrad) | Op::Pool2dGrad { kind: PoolKind::Max, .. }
            )
        })
        .collect();
    for id in readers {
        let value = graph.operands(id)[0];
        if graph.node(value).dtype != DType::F32 {
            continue;
        }
        let n = match narrow.get(&value) {
            Some(&n) => n,
            None => {
                made += 1;
                let n = cast_node(graph, value, half);
                narrow.insert(value, n);
                n
            }
        };
        // A widening of its own per reader: an elementwise reader reads the half copy in its
        // fused kernel, with no f32 copy stored.
        made += 1;
        let widened = cast_node(graph, n, DType::F32);
        graph.replace_operand(id, 0, widened);
    }
    if made > 0 {
        *graph =
            graph.compacted().ok_or_else(|| CompileError::Internal("narrow_saved made a cycle".into()))?;
    }
    Ok(made)
}

/// ReLU, GELU, sigmoid, tanh: the activations between products.
fn activation(op: &Op) -> bool {
    matches!(op, Op::Unary(UnaryOp::Gelu | UnaryOp::GeluTanh | UnaryOp::Sigmoid | UnaryOp::Tanh))
}

/// `of` converted to `to`: where `of` is a transpose or a reshape (of a transpose ...) of a
/// float value, the layout op applied to the cast of that value, so that a product still reads
/// its transposed operand in place (`transpose_operands`: GPT-2's tied output head reads the
/// [50257, 768] embedding transposed; cast after the transpose, the f32 transpose was a
/// 154 MB buffer at the step's peak). The casts made.
fn cast_through_layout(graph: &mut Graph, of: NodeId, to: DType) -> (NodeId, usize) {
    let node = graph.node(of);
    let layout = matches!(node.op, Op::Permute { .. } | Op::Reshape { .. });
    let inner = graph.operands(of);
    match inner[..] {
        [x] if layout && graph.node(x).dtype.is_float() => {
            let (c, made) = cast_through_layout(graph, x, to);
            let n = graph.node(of).clone();
            (graph.add(Node { dtype: to, name: None, ..n }, &[c]), made)
        }
        _ => (cast_node(graph, of, to), 1),
    }
}

/// A new `Cast` of `of` to `to`, on `of`'s device (`widen` makes its casts so too).
pub(crate) fn cast_node(graph: &mut Graph, of: NodeId, to: DType) -> NodeId {
    let n = graph.node(of);
    let node = Node {
        op: Op::Cast { to },
        shape: n.shape.clone(),
        dtype: to,
        device: n.device,
        name: None,
        origin: n.origin,
    };
    graph.add(node, &[of])
}

/// Infers `id`'s output type again from its (recast) operands; `pass` names the caller in an
/// internal error.
pub(crate) fn retype(graph: &mut Graph, id: NodeId, pass: &str) -> Result<()> {
    let operands = graph.operands(id);
    let types: Vec<(crate::ir::Shape, DType)> =
        operands.iter().map(|&o| (graph.node(o).shape.clone(), graph.node(o).dtype)).collect();
    let refs: Vec<(&crate::ir::Shape, DType)> = types.iter().map(|(s, d)| (s, *d)).collect();
    let node = graph.node(id);
    let (_, dtype) = infer(&node.op, &refs).map_err(|e| {
        CompileError::Internal(format!(
            "{pass}: {} after recasting its operands: {}",
            node.describe(),
            e.message
        ))
    })?;
    graph.node_mut(id).dtype = dtype;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_names_parse_back() {
        for p in [Precision::F32, Precision::BF16, Precision::F16] {
            assert_eq!(p.name().parse::<Precision>().unwrap(), p);
        }
        assert!("f8".parse::<Precision>().is_err());
    }
}
