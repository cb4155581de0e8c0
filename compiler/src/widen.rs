//! Half values on a backend whose kernels compute f32 operands alone: every op that reads or
//! writes an f16 or bf16 value reads f32 copies of its half operands and writes an f32 value
//! that a cast narrows to the half type, as XLA's float normalization does for a backend
//! without bf16 kernels.
//!
//! The results are the mixed-precision step's own: a half value widens to f32 exactly, so a
//! kernel that computes in f32 and rounds its result to the half type on the way out (the cast)
//! gives the bits a half kernel with f32 arithmetic inside gives (`autocast`: a half op is its
//! f32 arithmetic and one rounding). A fused group's half instructions already round in
//! registers (`Inst::Cast`); it gets f32 operands and an f32 output, whose cast back is exact.
//!
//! The f32 copies are planned values like any other, live from their cast to their reader:
//! such a plan holds more than the one `kiln memory --precision` reports (planned for kernels
//! that read half values), by the widest step's f32 operands and output.
//!
//! A backend says which families of ops its kernels compute on half values ([`HalfKernels`]:
//! the host and the CUDA kernels compute every family in half, f32 inside
//! (`kiln_kernels::cpu::HALF_KERNELS`, `kiln_kernels::cuda::HALF_KERNELS`));
//! `widen` gives f32 copies to the other ops only, and to the ops outside every family (custom
//! ops, collectives) unless the set is `ALL`.
//! Measured on the real-scale bf16 training steps (batch as in `benches/realscale.rs`, MB =
//! 10^6 B): the plan the host runs holds GPT-2 2,079 MB, ViT-B/16 1,741, BERT-base 1,774,
//! ResNet-50 1,274 and EfficientNet-B0 931, each the plan `kiln memory --precision bf16`
//! reports; with every op widened: 2,321, 2,167, 2,150, 1,424 and 1,325.
//! `CompileOptions::half_kernels` holds the set (`Trainer` takes it from
//! `Backend::half_kernels`); all families, the default, is what `kiln memory --precision`
//! reports.

use crate::autocast::{cast_node, retype};
use crate::error::{CompileError, Result};
use crate::ir::fused::{Inst, Ref};
use crate::ir::{DType, Graph, NodeId, Op};
use std::collections::HashMap;
use std::ops::{BitAnd, BitOr};

/// The families of ops whose kernels read and write f16 and bf16 values (f32 arithmetic
/// inside, one rounding on the way out), as a set: a backend names those its kernels compute
/// in half, and `widen` reads and writes the others' half values through f32 copies.
/// [`HalfKernels::ALL`] (every op, the ones outside any family too) is what a plan for
/// kernels of every type needs; [`HalfKernels::NONE`] widens every op that touches a half
/// value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct HalfKernels(u16);

impl HalfKernels {
    /// No op computes in half: every op on half values reads f32 copies.
    pub const NONE: HalfKernels = HalfKernels(0);
    /// Data movement: permute, broadcast_to, copy, concat, slice, pad.
    pub const LAYOUT: HalfKernels = HalfKernels(1);
    /// Unary, binary, scalar and select ops, and fused groups of them (no reduction, no product).
    pub const ELEMENTWISE: HalfKernels = HalfKernels(1 << 1);
    /// Reductions, softmax and log-softmax, and fused groups ending in a reduction.
    pub const REDUCTIONS: HalfKernels = HalfKernels(1 << 2);
    /// Matrix products and fused groups that start with one.
    pub const PRODUCTS: HalfKernels = HalfKernels(1 << 3);
    /// Convolutions, their input gradients, dense filter gradients, and fused groups that start
    /// with a convolution.
    pub const CONVOLUTIONS: HalfKernels = HalfKernels(1 << 4);
    /// Pooling and its gradients.
    pub const POOLING: HalfKernels = HalfKernels(1 << 5);
    /// Fused attention and its gradient.
    pub const ATTENTION: HalfKernels = HalfKernels(1 << 6);
    /// Embedding lookups and their gradients.
    pub const GATHER: HalfKernels = HalfKernels(1 << 7);
    /// Filter gradients of grouped, depthwise and dilated convolutions.
    pub const GROUPED_FILTER_GRADIENTS: HalfKernels = HalfKernels(1 << 8);
    /// Every op, in the families and outside them (collectives, custom ops, ...).
    pub const ALL: HalfKernels = HalfKernels(u16::MAX);

    /// The family `op` belongs to; `None` for ops in none (sources, views, casts, effects,
    /// collectives, custom ops).
    pub fn family(op: &Op) -> Option<HalfKernels> {
        Some(match op {
            Op::Permute { .. }
            | Op::BroadcastTo { .. }
            | Op::Copy
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Pad { .. } => Self::LAYOUT,
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Select => Self::ELEMENTWISE,
            Op::Fused(f) if f.reduce.is_some() && !f.has_product() => Self::REDUCTIONS,
            Op::Fused(f) if f.matmul.is_some() => Self::PRODUCTS,
            Op::Fused(f) if f.conv.is_some() => Self::CONVOLUTIONS,
            Op::Fused(_) => Self::ELEMENTWISE,
            Op::Reduce { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } => Self::REDUCTIONS,
            Op::MatMul { .. } | Op::MatMulRows { .. } => Self::PRODUCTS,
            Op::Conv2dBackpropFilter { window } if !window.is_dense() => Self::GROUPED_FILTER_GRADIENTS,
            Op::Conv2d { .. }
            | Op::Conv2dBackpropInput { .. }
            | Op::Conv2dBackpropInputReluGrad { .. }
            | Op::Conv2dBackpropFilter { .. } => Self::CONVOLUTIONS,
            Op::Pool2d { .. } | Op::Pool2dGrad { .. } | Op::AvgPool2dGrad { .. } => Self::POOLING,
            Op::Attention { .. } | Op::AttentionGrad { .. } => Self::ATTENTION,
            Op::Gather | Op::GatherGrad { .. } => Self::GATHER,
            _ => return None,
        })
    }

    /// The families of both sets (`|`, usable in constants).
    pub const fn union(self, other: HalfKernels) -> HalfKernels {
        HalfKernels(self.0 | other.0)
    }

    /// Whether every family of `other` is in this set.
    pub fn contains(self, other: HalfKernels) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether kernels of this set compute `op` on half values.
    pub fn computes(self, op: &Op) -> bool {
        self == Self::ALL || Self::family(op).is_some_and(|f| self.contains(f))
    }
}

impl std::fmt::Display for HalfKernels {
    /// "no", "all", or the families: "layout and elementwise".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const NAMES: [&str; 9] = [
            "layout",
            "elementwise",
            "reduction",
            "product",
            "convolution",
            "pooling",
            "attention",
            "gather",
            "grouped filter gradient",
        ];
        match *self {
            Self::ALL => return write!(f, "all"),
            Self::NONE => return write!(f, "no"),
            _ => {}
        }
        let names: Vec<&str> =
            (0..NAMES.len()).filter(|b| self.0 & (1 << b) != 0).map(|b| NAMES[b]).collect();
        match names.split_last() {
            Some((last, [])) => write!(f, "{last}"),
            Some((last, rest)) => write!(f, "{} and {last}", rest.join(", ")),
            None => write!(f, "no"),
        }
    }
}

impl BitOr for HalfKernels {
    type Output = HalfKernels;
    fn bitor(self, other: HalfKernels) -> HalfKernels {
        self.union(other)
    }
}

impl BitAnd for HalfKernels {
    type Output = HalfKernels;
    fn bitand(self, other: HalfKernels) -> HalfKernels {
        HalfKernels(self.0 & other.0)
    }
}

impl From<bool> for HalfKernels {
    /// true: every op ([`HalfKernels::ALL`]); false: none.
    fn from(all: bool) -> HalfKernels {
        if all { Self::ALL } else { Self::NONE }
    }
}

/// Whether `d` is a half type.
fn half(d: DType) -> bool {
    d.is_half()
}

/// Ops that need no widening: casts (which convert half values themselves), sources, views
/// (no kernel) and effects (which update f32 master weights).
fn untouched(op: &Op) -> bool {
    matches!(
        op,
        Op::Cast { .. }
            | Op::Input { .. }
            | Op::Variable { .. }
            | Op::Fill { .. }
            | Op::Iota { .. }
            | Op::RandomUniform { .. }
            | Op::Reshape { .. }
    ) || op.is_effect()
}

/// Widens every op of `graph` that reads or writes a half value and that `kernels` do not
/// compute in half; the casts inserted. A graph without half values is left as it is.
pub fn widen(graph: &mut Graph, kernels: HalfKernels) -> Result<usize> {
    let order = petgraph::algo::toposort(graph.petgraph(), None)
        .map_err(|_| CompileError::Internal("widen: the graph has a cycle".into()))?;
    let mut wide: HashMap<NodeId, NodeId> = HashMap::new();
    let mut inserted = 0;
    for id in order {
        if untouched(&graph.node(id).op) || kernels.computes(&graph.node(id).op) {
            continue;
        }
        let operands = graph.operands(id);
        let reads_half = operands.iter().any(|&o| half(graph.node(o).dtype));
        let writes = graph.node(id).dtype;
        if !reads_half && !half(writes) {
            continue;
        }
        for (i, &o) in operands.iter().enumerate() {
            if half(graph.node(o).dtype) {
                let w = match wide.get(&o) {
                    Some(&w) => w,
                    None => {
                        inserted += 1;
                        let w = cast_node(graph, o, DType::F32);
                        wide.insert(o, w);
                        w
                    }
                };
                graph.replace_operand(id, i, w);
            }
        }
        // A fused program stores f32: its last value, rounded to the half type already where
        // its type is half, widened.
        if let Op::Fused(f) = &mut graph.node_mut(id).op {
            let last = if f.epilogue.is_empty() { &mut f.insts } else { &mut f.epilogue };
            if !matches!(last.last(), Some(Inst::Cast(DType::F32, _))) {
                let at = Ref::Value(last.len() as u32 - 1);
                if half(writes) && !matches!(last.last(), Some(Inst::Cast(to, _)) if *to == writes) {
                    last.push(Inst::Cast(writes, at));
                }
                let at = Ref::Value(last.len() as u32 - 1);
                last.push(Inst::Cast(DType::F32, at));
            }
        }
        retype(graph, id, "widen")?;
        if half(writes) {
            inserted += 1;
            let narrow = cast_node(graph, id, writes);
            graph.replace_uses(id, narrow);
        }
    }
    if inserted > 0 {
        *graph = graph.compacted().ok_or_else(|| CompileError::Internal("widen made a cycle".into()))?;
    }
    Ok(inserted)
}
