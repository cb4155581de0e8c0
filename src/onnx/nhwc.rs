//! Channels-last twins: an imported CNN computed between its convolutions in kiln's NHWC.
//!
//! ONNX's tensors are NCHW and kiln's convolutions and pooling NHWC, so each imported
//! convolution permuted its input to NHWC and its output back: two copies per convolution, one
//! of them saved for the filter gradient. In a training step of ResNet-50 (`light/`, batch 2)
//! 393 of the 1,722 plan steps were permutes, and at the step where the arena peaks permuted
//! copies were 149 of its 254.5 MB (activations 108, filters 41).
//!
//! A convolution's or pooling's output is made channels-last anyway: the importer keeps it as
//! the value's twin (`Importer::nchw_of_twin`) and defines the NCHW value as its permute. An op
//! that computes the same elements in either layout then runs on the twins where its operands
//! allow: elementwise arithmetic and activations whose 4-D operands all have twins (or are
//! per-channel, per-pixel or per-image tensors, which broadcast as reshapes: a [C, 1, 1] bias
//! becomes [1, 1, 1, C]), batch normalisation (its statistics over N, H, W), global pooling
//! (its [N, 1, 1, C] result a reshape of [N, C, 1, 1]) and concatenation of channels. Its NCHW
//! value is again the twin's permute. The next convolution reads the twin; an NCHW value only a
//! layout-bound op (a reshape, a transpose, a graph output) reads keeps its permute, and every
//! other permute is dead code, removed before planning.
//!
//! A stored tensor read only as a plain convolution's filter is a parameter stored HWIO
//! (`filters`), so no step permutes the filters either.
//!
//! The elements are the same and every elementwise op computes each the same way; a reduction
//! over N, H, W (batch normalisation's statistics, global pooling) adds them in another order.
//!
//! Measured (`kiln memory light_X.onnx --mode train --batch 8`, the training arena): ResNet-50
//! 1,038,750,848 B -> 835,198,144 with the twins -> 745,526,208 with HWIO filters too,
//! DenseNet-121 2.54 -> 2.04 GB, SqueezeNet 138.8 -> 99.6 MB, Inception v2 687.8 -> 569.1 MB,
//! AlexNet 92.9 -> 88.3 MB (the README's ONNX section has every `light/` model).

use super::proto::GraphProto;
use super::{Importer, Node, Value, elementwise, norm};
use crate::error::Result;
use kiln_compiler::trace::Tensor;
use std::collections::{HashMap, HashSet};

/// Elementwise ops that compute each element from the operands' elements at its index alone:
/// the same in either layout.
const ELEMENTWISE: &[&str] = &[
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "Relu",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Exp",
    "Log",
    "Sqrt",
    "Neg",
    "Abs",
    "Sign",
    "Reciprocal",
    "Softsign",
    "Softplus",
    "Mish",
    "LeakyRelu",
    "PRelu",
    "ThresholdedRelu",
    "Elu",
    "Selu",
    "Celu",
    "HardSigmoid",
    "HardSwish",
    "Gelu",
    "Shrink",
    "Clip",
    "Max",
    "Min",
    "Sum",
    "Mean",
];

/// The values of `graph` worth computing channels-last: those read only as the input of a
/// convolution or pooling, or by ops of the kinds above whose results are worth it themselves
/// (never a graph output). Elsewhere a twin would be permuted back for an NCHW reader (an LRN,
/// a reshape) and, in a training step, both layouts saved: AlexNet's arena grew 15% when every
/// ReLU after a convolution ran on its twin.
pub(super) fn worth_it(graph: &GraphProto) -> HashSet<String> {
    let mut readers: HashMap<&str, Vec<(usize, usize)>> = HashMap::new();
    for (k, node) in graph.node.iter().enumerate() {
        for (i, name) in node.input.iter().enumerate() {
            readers.entry(name.as_str()).or_default().push((k, i));
        }
    }
    let outputs: HashSet<&str> = graph.output.iter().filter_map(|o| o.name.as_deref()).collect();
    let mut worth = HashSet::new();
    for node in graph.node.iter().rev() {
        let Some(value) = node.output.first().filter(|v| !v.is_empty()) else { continue };
        let Some(reads) = readers.get(value.as_str()) else { continue };
        let fits = !outputs.contains(value.as_str())
            && reads.iter().all(|&(k, i)| {
                let reader = &graph.node[k];
                let op = reader.op_type.as_deref().unwrap_or("");
                let made = || reader.output.first().is_some_and(|o| worth.contains(o));
                match op {
                    "Conv" | "MaxPool" | "AveragePool" | "GlobalAveragePool" | "GlobalMaxPool" => i == 0,
                    "BatchNormalization" => i == 0 && made(),
                    // Of channels only: a concatenation along another axis stays NCHW.
                    "Concat" => {
                        let axis = reader.attribute.iter().find(|a| a.name.as_deref() == Some("axis"));
                        matches!(axis.and_then(|a| a.i), Some(1 | -3)) && made()
                    }
                    op => ELEMENTWISE.contains(&op) && made(),
                }
            });
        if fits {
            worth.insert(value.clone());
        }
    }
    worth
}

/// The stored tensors read only as the filter of 2-D convolutions (grouped and dilated ones
/// too: ONNX's [F, C/G, KH, KW] is kiln's [KH, KW, C/G, F]): their parameters are made HWIO, kiln's filter layout, with an OIHW view for
/// anything that asks (`Importer::stored_parameter`, read by `Importer::stored_filter`), so
/// that no step permutes them. Every
/// step of an imported ResNet-50 permuted all its filters (94 MB) and kept the copies for the
/// backward pass: 41 of the 254.5 MB live at the peak of its training step at batch 2.
pub(super) fn filters(graph: &GraphProto) -> HashSet<String> {
    let mut plain = HashSet::new();
    let mut other = HashSet::new();
    for node in &graph.node {
        let conv = node.op_type.as_deref() == Some("Conv");
        for (i, name) in node.input.iter().enumerate() {
            if conv && i == 1 {
                plain.insert(name.clone());
            } else {
                other.insert(name.clone());
            }
        }
    }
    for o in graph.output.iter().filter_map(|o| o.name.as_ref()) {
        other.insert(o.clone());
    }
    plain.retain(|name| !other.contains(name));
    plain
}

/// Whether imports go channels-last (`KILN_ONNX_CHANNELS_LAST=0`: no, NCHW and OIHW as before).
pub(super) fn enabled() -> bool {
    std::env::var("KILN_ONNX_CHANNELS_LAST").map_or(true, |v| v != "0")
}

/// A filter's `dims` [F, C, KH, KW] as kiln's HWIO [KH, KW, C, F], and its `values` (OIHW) in
/// that order; `None` for any other rank.
pub(super) fn hwio(dims: &[usize], values: Option<&[f32]>) -> Option<(Vec<usize>, Option<Vec<f32>>)> {
    let &[f, c, kh, kw] = dims else { return None };
    // out[(tap·C + ci)·F + fo] = v[(fo·C + ci)·taps + tap], 16 filters at a time: each output
    // line is written whole and the 16 filters' rows are read front to back. An element at a
    // time, with four integer divisions to place it, ResNet-50's 25 M weights took about 0.4 s
    // of its load (perf: 9.7% of `kiln train --bench 8`).
    let taps = kh * kw;
    let values = values.filter(|v| v.len() == f * c * taps).map(|v| {
        let mut out = vec![0.0; v.len()];
        for f0 in (0..f).step_by(16) {
            let f1 = (f0 + 16).min(f);
            for ci in 0..c {
                for tap in 0..taps {
                    let row = &mut out[(tap * c + ci) * f..][f0..f1];
                    for (fo, o) in (f0..f1).zip(row) {
                        *o = v[(fo * c + ci) * taps + tap];
                    }
                }
            }
        }
        out
    });
    Some((vec![kh, kw, c, f], values))
}

/// `n` computed on its inputs' twins, when it is one of the ops above, its result is worth
/// making channels-last (`worth_it`; global pooling always) and its inputs allow it; `None`
/// leaves it to the NCHW importers.
pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    // Global pooling's NCHW result is a reshape of its twin's: worth it whoever reads it.
    let pooling = matches!(n.op, "GlobalAveragePool" | "GlobalMaxPool");
    let worth = pooling || n.proto.output.first().is_some_and(|o| imp.worth_twin.contains(o));
    if !worth || !(0..n.inputs()).any(|i| imp.twin(n, i).is_some()) {
        return Ok(None);
    }
    match n.op {
        op if ELEMENTWISE.contains(&op) => elementwise_on_twins(imp, n),
        "BatchNormalization" => {
            let Some(x) = imp.twin(n, 0) else { return Ok(None) };
            let mut out = norm::batch_norm_of(imp, n, x, true)?;
            let y = out.remove(0);
            let y = imp.nchw_of_twin(n, 0, y);
            Ok(Some(std::iter::once(y).chain(out).map(Value::Tensor).collect()))
        }
        "GlobalAveragePool" | "GlobalMaxPool" => {
            let Some(x) = imp.twin(n, 0) else { return Ok(None) };
            let y = if n.op == "GlobalAveragePool" { x.mean([1, 2], true) } else { x.max([1, 2], true) };
            // [N, 1, 1, C] and [N, C, 1, 1] hold their elements in the same order.
            let &[batch, _, _, c] = y.dims() else { return Ok(None) };
            if let Some(name) = n.proto.output.first().filter(|s| !s.is_empty()) {
                imp.twins.insert(name.clone(), y.clone());
            }
            Ok(Some(vec![Value::Tensor(y.reshape([batch, c, 1, 1]))]))
        }
        "Concat" => {
            let axis = n.int("axis", 1);
            let twins: Option<Vec<Tensor>> = (0..n.inputs()).map(|i| imp.twin(n, i)).collect();
            match twins {
                Some(t) if (axis == 1 || axis == -3) && !t.is_empty() => {
                    let rest: Vec<&Tensor> = t[1..].iter().collect();
                    let y = t[0].concat(&rest, 3);
                    Ok(Some(vec![Value::Tensor(imp.nchw_of_twin(n, 0, y))]))
                }
                _ => Ok(None),
            }
        }
        _ => Ok(None),
    }
}

/// An elementwise op on its inputs' twins: each input of rank 4 with a twin is read as it, each
/// other f32 input whose NCHW-to-NHWC permute moves only axes of size 1 (a per-channel
/// [C, 1, 1], a per-pixel [N, 1, H, W], a scalar) as that reshape; any other input leaves the op
/// to NCHW. The op's own importer runs on them (the inputs' values swapped for the call).
fn elementwise_on_twins(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    // Operands that do not broadcast in the file's layout are left to the NCHW importer, whose
    // error names their NCHW shapes.
    let mut dims: Option<Vec<usize>> = Some(Vec::new());
    for i in 0..n.inputs() {
        if let (Some(d), Some(Value::Tensor(t))) = (dims.as_ref(), imp.input(n, i).ok()) {
            dims = super::layout::broadcast_dims(d, t.dims());
        }
    }
    if dims.is_none_or(|d| d.len() != 4) {
        return Ok(None);
    }
    let mut swapped: Vec<(String, Value)> = Vec::new();
    for i in 0..n.inputs() {
        let Some(name) = n.proto.input.get(i).filter(|s| !s.is_empty()) else { continue };
        let twin = match (imp.twin(n, i), imp.values.get(name)) {
            (Some(t), _) => t,
            (None, Some(Value::Tensor(t))) => match reshaped(t) {
                Some(t) => t,
                None => return Ok(None),
            },
            _ => return Ok(None),
        };
        if !swapped.iter().any(|(s, _)| s == name) {
            swapped.push((name.clone(), Value::Tensor(twin)));
        }
    }
    let originals: Vec<(String, Option<Value>)> = swapped
        .into_iter()
        .map(|(name, v)| {
            let old = imp.values.insert(name.clone(), v);
            (name, old)
        })
        .collect();
    let out = elementwise::import(imp, n);
    for (name, old) in originals {
        match old {
            Some(v) => imp.values.insert(name, v),
            None => imp.values.remove(&name),
        };
    }
    let Some(out) = out? else { return Ok(None) };
    let mut values = Vec::with_capacity(out.len());
    for (i, v) in out.into_iter().enumerate() {
        values.push(match v {
            Value::Tensor(y) if y.rank() == 4 => Value::Tensor(imp.nchw_of_twin(n, i, y)),
            // A twin operand makes every result 4-D: anything else is not this op's.
            _ => {
                return Err(n.invalid(
                    "computed on channels-last twins, gave a result of another rank",
                    "report this model",
                ));
            }
        });
    }
    Ok(Some(values))
}

/// `t` (NCHW, rank at most 4, right-aligned) as NHWC where that is a reshape: where the permute
/// of [a, b, c, d] to [a, c, d, b] moves b past axes of size 1 only, or b is 1.
fn reshaped(t: &Tensor) -> Option<Tensor> {
    let d = t.dims();
    if d.len() > 4 {
        return None;
    }
    let mut full = vec![1; 4 - d.len()];
    full.extend_from_slice(d);
    let [a, b, c, e] = full[..] else { return None };
    (b == 1 || (c == 1 && e == 1)).then(|| t.reshape([a, c, e, b]))
}
