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
//! compute in f32 as PyTorch's autocast makes them, with no list of their own. A batch norm
//! (on neither of PyTorch's lists: its kernel returns its input's type) ends with an
//! `Op::CastLike` of its input, resolved after the products are rounded
//! (`passes::cast_like::resolve`): it rounds the output where the input is a half value read
//! widened. Measured (`kiln memory FILE --precision bf16`, planned totals): ResNet-50 at batch
//! 32 1,330 -> 1,274 MB, EfficientNet-B0 at 32 1,321 -> 931 MB, f32 plans unchanged.
//!
//! What it produces, per op: float operands whose type differs from the rule's are cast to it
//! (one `Cast` per value and type, shared by every reader, so that a weight read by several
//! products is copied to half once per step and planned like any value), and the op's output
//! type is inferred again. Parameters and optimizer state stay f32 (master weights): autodiff
//! differentiates through the casts (`Cast`'s gradient is the cast back), so each weight's
//! gradient reaches its optimizer in f32. The graph's interface keeps its types: an output that
//! the policy made half is cast back to the type it was traced with.
//!
//! Rounded once, where PyTorch rounds: a product of half factors accumulates and stores f32
//! (`DType::accumulated`), and `round_products` rounds it to the half type after its bias add
//! (one f32 epilogue, as cuBLAS computes `x · W + b`), or at the product where no bias follows;
//! every reader reads that half copy, widened. An elementwise op of the `Follow` rule whose
//! float operands are all such copies, and max pooling, then compute on the half values and
//! store half (`sink_widening`), as PyTorch's ops on half tensors do: ReLU and pooling exactly,
//! GELU, SiLU and a residual add rounded once. Products that stored half rounded before the bias
//! and again after the activation, and measured 1.1-1.3x the error of PyTorch's autocast
//! against f32 on the zoo (mlp 1.28, cnn 1.24, transformer 1.14, GPT 1.09 over 8 seeds;
//! `tests/autocast_numerics.rs`); rounded once, 0.89-0.99 over 32. What a step keeps for its
//! backward pass is the half copies: the zoo's bf16 steps plan 24.34 MB (cnn; 24.68 with half
//! products) and 31.69 MB (transformer, unchanged; 31.14 MB since with the `-late` orders and
//! its elementwise ops on half values).
//!
//! Planned at their size: a half value takes 2 bytes an element in liveness and the arena. What a
//! fused plan keeps of the f32 chains between half values is the minimum cut's choice
//! (`saved_values`).

use crate::error::{CompileError, Result};
use crate::ir::{BinaryOp, PoolKind, ScalarOp};
use crate::ir::{DType, Graph, Node, NodeId, Op, OpClass, UnaryOp, infer};
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
        | Op::Cast { .. }
        | Op::CastLike => Rule::Keep,
        op if op.is_effect() || op.is_collective() => Rule::Keep,
        _ => Rule::Follow,
    }
}

/// Applies `precision`'s policy to `graph` (a traced forward pass, with its loss for a training
/// step, before autodiff); the number of casts inserted. `Precision::F32` changes nothing.
pub fn apply(graph: &mut Graph, precision: Precision) -> Result<usize> {
    let Precision::Mixed(half) = precision else {
        // A layer's `CastLike` is nothing (or a cast) in f32; autodiff reads dense ids.
        let resolved = crate::passes::cast_like::resolve(graph, None);
        if resolved > 0 {
            *graph =
                graph.compacted().ok_or_else(|| CompileError::Internal("autocast made a cycle".into()))?;
        }
        return Ok(0);
    };
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
        retype(graph, id, "autocast")?;
    }
    inserted += round_products(graph, half);
    inserted += crate::passes::cast_like::resolve(graph, Some(half));
    inserted += sink_widening(graph, half);
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

/// Rounds each product of half factors once, where PyTorch's autocast rounds it: after its bias
/// add when its one reader adds a parameter (a linear layer's `x · W + b`, which cuBLAS and
/// cuDNN compute in one f32 epilogue), else at the product. Every reader then reads the value
/// through its half copy (`cast` to the half type and back), so the step computes what a
/// half-storing step computes and keeps the half copy for its backward pass; the product's own
/// f32 value (`DType::accumulated`) lives only until the copy is made. Two differences from
/// PyTorch remain, both toward f32: the bias is added in f32 (PyTorch rounds it to the half type
/// first), and an output of the graph keeps the unrounded value (PyTorch returns the half one).
/// The casts made.
fn round_products(graph: &mut Graph, half: DType) -> usize {
    let products: Vec<NodeId> = graph
        .node_ids()
        .filter(|&n| {
            matches!(graph.node(n).op, Op::MatMul { .. } | Op::MatMulRows { .. } | Op::Conv2d { .. })
                && graph.node(n).dtype == DType::F32
                && graph.operands(n).iter().all(|&o| graph.node(o).dtype == half)
        })
        .collect();
    let mut made = 0;
    for p in products {
        let rounded = match graph.users(p)[..] {
            [add] if adds_a_parameter(graph, add, p) => add,
            _ => p,
        };
        if graph.node(rounded).dtype != DType::F32 {
            continue;
        }
        let readers = graph.users(rounded);
        // A cast to the half type already made (for a product, or below a layout op) is the copy.
        let existing =
            readers.iter().copied().find(|&r| matches!(graph.node(r).op, Op::Cast { to } if to == half));
        let narrow = existing.unwrap_or_else(|| {
            made += 1;
            cast_node(graph, rounded, half)
        });
        made += 1;
        let wide = cast_node(graph, narrow, DType::F32);
        for r in readers.into_iter().filter(|&r| r != narrow) {
            for (i, o) in graph.operands(r).into_iter().enumerate() {
                if o == rounded {
                    graph.replace_operand(r, i, wide);
                }
            }
        }
    }
    made
}

/// Moves each widening of a half value below the elementwise ops of the `Follow` rule whose
/// float operands are all half values read widened, and below the max poolings that read one:
/// they compute on the half values and store half, as PyTorch's ops on half tensors do (ReLU
/// and pooling exactly: a sign, a choice), half-sized, and the next product reads their output
/// without another cast. The casts made. (A ReLU and a pooling of an f32 activation held the
/// step's largest values: the zoo cnn's bf16 step planned 28.5 MB with them, and less with them
/// half; a batch norm's half output, its residual add and ReLU: ResNet-50's step at batch 32.)
fn sink_widening(graph: &mut Graph, half: DType) -> usize {
    let mut made = 0;
    loop {
        let widened = |w: NodeId| {
            matches!(graph.node(w).op, Op::Cast { to: DType::F32 })
                && graph.operands(w).first().is_some_and(|&h| graph.node(h).dtype == half)
        };
        let found = graph.node_ids().find(|&r| {
            let op = &graph.node(r).op;
            let follows = match op {
                Op::Pool2d { kind: PoolKind::Max, .. } => true,
                Op::Fused(_) => false,
                op => op.class() == OpClass::Elementwise && rule(op) == Rule::Follow,
            };
            let floats: Vec<NodeId> =
                graph.operands(r).into_iter().filter(|&o| graph.node(o).dtype.is_float()).collect();
            follows
                && graph.node(r).dtype == DType::F32
                && !graph
                    .users(r)
                    .into_iter()
                    .chain([r])
                    .any(|n| graph.outputs().iter().any(|(_, o)| *o == n))
                && graph.control_predecessors(r).is_empty()
                && graph.control_successors(r).is_empty()
                && !floats.is_empty()
                && floats.iter().all(|&w| widened(w))
        });
        let Some(r) = found else { return made };
        let operands: Vec<NodeId> = graph
            .operands(r)
            .into_iter()
            .map(|o| if widened(o) { graph.operands(o)[0] } else { o })
            .collect();
        let narrow = Node { dtype: half, name: None, ..graph.node(r).clone() };
        let r_half = graph.add(narrow, &operands);
        made += 2;
        let wide = cast_node(graph, r_half, DType::F32);
        for reader in graph.users(r) {
            // A reader that narrows it again reads the half value itself.
            if matches!(graph.node(reader).op, Op::Cast { to } if to == half) {
                graph.replace_uses(reader, r_half);
                graph.remove(reader);
            }
        }
        graph.replace_uses(r, wide);
        graph.remove(r);
    }
}

/// Whether `add` is `product + b` (either order) with `b` a parameter or constant, through
/// reshapes and broadcasts: a bias.
fn adds_a_parameter(graph: &Graph, add: NodeId, product: NodeId) -> bool {
    if graph.node(add).op != Op::Binary(BinaryOp::Add) || graph.node(add).dtype != DType::F32 {
        return false;
    }
    let operands = graph.operands(add);
    let Some(&other) = operands.iter().find(|&&o| o != product) else { return false };
    if operands.iter().filter(|&&o| o == product).count() != 1 {
        return false;
    }
    let mut b = other;
    loop {
        match graph.node(b).op {
            Op::Variable { .. } | Op::Fill { .. } => return true,
            Op::Reshape { .. } | Op::BroadcastTo { .. } | Op::Permute { .. } => match graph.operands(b)[..] {
                [inner] => b = inner,
                _ => return false,
            },
            _ => return false,
        }
    }
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
