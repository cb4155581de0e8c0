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
//! that read half values), by the widest step's f32 operands and output. The host and CUDA
//! backends compute f32 today; `CompileOptions::half_kernels` is false for the plans they run
//! (`Trainer` takes it from `Backend::half_kernels`).

use crate::autocast::{cast_node, retype};
use crate::error::{CompileError, Result};
use crate::ir::fused::{Inst, Ref};
use crate::ir::{DType, Graph, NodeId, Op};
use std::collections::HashMap;

/// Whether `d` is a half type.
fn half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
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

/// Widens every op of `graph` that reads or writes a half value; the casts inserted. A graph
/// without half values is left as it is.
pub fn widen(graph: &mut Graph) -> Result<usize> {
    let order = petgraph::algo::toposort(graph.petgraph(), None)
        .map_err(|_| CompileError::Internal("widen: the graph has a cycle".into()))?;
    let mut wide: HashMap<NodeId, NodeId> = HashMap::new();
    let mut inserted = 0;
    for id in order {
        if untouched(&graph.node(id).op) {
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
