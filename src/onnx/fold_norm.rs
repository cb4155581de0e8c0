//! Inference-mode batch normalisations folded into the convolution before them.
//!
//! With running statistics, `BatchNormalization(Conv(x, W, b))` is one convolution: per output
//! channel `c`, with `s = scale / √(var + ε)`, the filter `W[c] · s[c]` and the bias
//! `(b[c] − mean[c]) · s[c] + beta[c]`. Imported as written, every convolution of a CNN is
//! followed by a per-channel subtract, two multiplies and an add over its whole output (fused
//! into the convolution's epilogue, but still four operations and three broadcast operands per
//! element), and the model holds five tensors per channel where two do.
//!
//! This pass rewrites the file's graph before it is traced, for inference only (`import`; a
//! training step normalises by the batch and keeps the statistics as variables): each
//! `BatchNormalization` in inference mode whose input is a `Conv`'s output read by nothing else,
//! with the filter, the bias and the four per-channel tensors stored in the file (initializers,
//! or `Identity` chains of them, as PyTorch's exporter writes shared weights), becomes that
//! convolution with two new initializers, `<bn output>::weight` and `<bn output>::bias`. The
//! products are computed in f64 and rounded once, so the folded model agrees with the file to
//! the rounding of one f32 product per weight. Anything else (a shared convolution output, a
//! computed filter, a training-mode node, a name already taken) is left as written.
//!
//! So an imported model's variables are not all the file's initializers: a folded
//! convolution's filter and bias, and its batch norm's four tensors, become the two new ones
//! (`Imported::weights` lists what the graph holds). `KILN_ONNX_FOLD_NORM=0` turns the pass
//! off, for code that writes variables by the file's names after `import`.
//!
//! Measured (`kiln run X-eval.onnx --input X-inputs.npz --threads 1 --bench 20`, torchvision's
//! models exported for inference at batch 2, one core of the 2-core AMD EPYC with AVX-512,
//! medians of two interleaved runs each, without -> with the pass): EfficientNet-B0 23.7 ->
//! 20.8 ms (its SiLU epilogues went from six operations to three), MobileNetV3-small 5.4 ->
//! 4.7 ms, ResNet-50 93.5 -> 91.6 ms (within the runs' spread: its products dominate).

use super::proto::{self, GraphProto, NodeProto, TensorProto};
use super::{Node, tensor_values};
use crate::error::Result;
use std::collections::{HashMap, HashSet};

/// `graph` with every foldable batch normalisation folded, and for each of its nodes the index
/// of the node of `graph` it stands for (messages name unnamed nodes by index); `None` where
/// nothing folds.
pub(super) fn fold(graph: &GraphProto, opset: i64) -> Result<Option<(GraphProto, Vec<usize>)>> {
    let stored: HashMap<&str, &TensorProto> =
        graph.initializer.iter().filter_map(|t| Some((t.name.as_deref()?, t))).collect();
    let mut producer: HashMap<&str, usize> = HashMap::new();
    let mut reads: HashMap<&str, usize> = HashMap::new();
    for (k, node) in graph.node.iter().enumerate() {
        for o in node.output.iter().filter(|o| !o.is_empty()) {
            producer.insert(o, k);
        }
        for i in node.input.iter().filter(|i| !i.is_empty()) {
            *reads.entry(i).or_default() += 1;
        }
    }
    for o in graph.output.iter().filter_map(|o| o.name.as_deref()) {
        *reads.entry(o).or_default() += 1;
    }
    let mut taken: HashSet<String> = stored.keys().map(|s| s.to_string()).collect();
    taken.extend(producer.keys().map(|s| s.to_string()));
    taken.extend(graph.input.iter().filter_map(|i| i.name.clone()));
    let look = Lookup { graph, stored: &stored, producer: &producer };

    // The folds first; the graph is copied only where one applies.
    let mut folds = Vec::new();
    for (k, bn) in graph.node.iter().enumerate() {
        let Some(f) = look.foldable(k, bn, opset, &reads)? else { continue };
        let (weight, bias) = (format!("{}::weight", f.out), format!("{}::bias", f.out));
        if taken.contains(&weight) || taken.contains(&bias) {
            continue;
        }
        taken.extend([weight.clone(), bias.clone()]);
        folds.push((k, f, weight, bias));
    }
    if folds.is_empty() {
        return Ok(None);
    }
    let mut folded = GraphProto { node: Vec::new(), ..graph.clone() };
    let mut nodes = graph.node.clone();
    let mut gone = vec![false; nodes.len()];
    for (k, f, weight, bias) in folds {
        let conv = &mut nodes[f.conv];
        conv.input.truncate(1);
        conv.input.extend([weight.clone(), bias.clone()]);
        conv.output = vec![f.out.to_string()];
        gone[k] = true;
        folded.initializer.push(float_tensor(&weight, &f.filter_dims, &f.filter));
        folded.initializer.push(float_tensor(&bias, &[f.bias.len()], &f.bias));
    }
    let origin: Vec<usize> = (0..nodes.len()).filter(|&k| !gone[k]).collect();
    folded.node = nodes.into_iter().zip(gone).filter_map(|(n, g)| (!g).then_some(n)).collect();
    Ok(Some((folded, origin)))
}

/// Whether imports fold batch norms (`KILN_ONNX_FOLD_NORM=0`: no, every batch norm is traced
/// as the file writes it and every initializer keeps its name).
pub(super) fn enabled() -> bool {
    std::env::var("KILN_ONNX_FOLD_NORM").map_or(true, |v| v != "0")
}

/// A batch normalisation that folds: the convolution node it folds into, its output's name and
/// the folded filter and bias.
struct Fold<'a> {
    conv: usize,
    out: &'a str,
    filter_dims: Vec<usize>,
    filter: Vec<f32>,
    bias: Vec<f32>,
}

struct Lookup<'a> {
    graph: &'a GraphProto,
    stored: &'a HashMap<&'a str, &'a TensorProto>,
    producer: &'a HashMap<&'a str, usize>,
}

impl<'a> Lookup<'a> {
    /// The stored tensor `name` is, through `Identity` nodes.
    fn stored(&self, name: &str) -> Option<&'a TensorProto> {
        let mut name = name;
        for _ in 0..16 {
            if let Some(t) = self.stored.get(name) {
                return Some(t);
            }
            let node = &self.graph.node[*self.producer.get(name)?];
            if node.op_type.as_deref() != Some("Identity") || !default_domain(node) {
                return None;
            }
            name = node.input.first()?;
        }
        None
    }

    /// The values of the stored float tensor `name` (through `Identity` nodes), with its dims.
    fn values(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<f32>)>> {
        let Some(t) = self.stored(name) else { return Ok(None) };
        let float =
            matches!(t.data_type, Some(proto::FLOAT | proto::DOUBLE | proto::FLOAT16 | proto::BFLOAT16));
        if !float || t.data_location == Some(proto::EXTERNAL) {
            return Ok(None);
        }
        tensor_values(t).map(Some)
    }

    /// Node `k` (`bn`) folded into the convolution before it, where it folds.
    fn foldable(
        &self,
        k: usize,
        bn: &'a NodeProto,
        opset: i64,
        reads: &HashMap<&str, usize>,
    ) -> Result<Option<Fold<'a>>> {
        if bn.op_type.as_deref() != Some("BatchNormalization") || !default_domain(bn) {
            return Ok(None);
        }
        let n = Node { proto: bn, op: "BatchNormalization", who: String::new(), opset };
        let training = opset >= 14 && n.int("training_mode", 0) != 0;
        let per_activation = opset < 9 && n.int("spatial", 1) == 0;
        let extra_outputs = bn.output.iter().skip(1).any(|o| !o.is_empty());
        let (Some(x), Some(out)) = (bn.input.first(), bn.output.first().filter(|o| !o.is_empty())) else {
            return Ok(None);
        };
        if training
            || per_activation
            || extra_outputs
            || bn.input.len() != 5
            || reads.get(x.as_str()) != Some(&1)
        {
            return Ok(None);
        }
        let Some(&c) = self.producer.get(x.as_str()) else { return Ok(None) };
        let conv = &self.graph.node[c];
        let plain_conv =
            conv.op_type.as_deref() == Some("Conv") && default_domain(conv) && conv.output.len() == 1;
        if !plain_conv || c >= k || conv.input.len() < 2 {
            return Ok(None);
        }
        let Some((filter_dims, filter)) = self.values(&conv.input[1])? else { return Ok(None) };
        let Some(&channels) = filter_dims.first().filter(|&&c| c > 0 && filter_dims.len() >= 3) else {
            return Ok(None);
        };
        let bias = match conv.input.get(2).filter(|b| !b.is_empty()) {
            Some(b) => match self.values(b)? {
                Some((dims, v)) if dims == [channels] => v,
                _ => return Ok(None),
            },
            None => vec![0.0; channels],
        };
        let mut params = Vec::with_capacity(4);
        for name in &bn.input[1..] {
            match self.values(name)? {
                Some((dims, v)) if dims == [channels] => params.push(v),
                _ => return Ok(None),
            }
        }
        let [scale, beta, mean, var] = <[Vec<f32>; 4]>::try_from(params).expect("four parameters");
        let eps = f64::from(n.float("epsilon", 1e-5));
        let s: Vec<f64> =
            (0..channels).map(|o| f64::from(scale[o]) / (f64::from(var[o]) + eps).sqrt()).collect();
        let per_filter = filter.len() / channels;
        let filter =
            filter.iter().enumerate().map(|(i, &w)| (f64::from(w) * s[i / per_filter]) as f32).collect();
        let bias = (0..channels)
            .map(|o| ((f64::from(bias[o]) - f64::from(mean[o])) * s[o] + f64::from(beta[o])) as f32)
            .collect();
        Ok(Some(Fold { conv: c, out, filter_dims, filter, bias }))
    }
}

fn default_domain(node: &NodeProto) -> bool {
    node.domain.as_deref().is_none_or(|d| d.is_empty() || d == "ai.onnx")
}

/// An f32 initializer `name` of `dims` holding `values`.
fn float_tensor(name: &str, dims: &[usize], values: &[f32]) -> TensorProto {
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    TensorProto {
        dims: dims.iter().map(|&d| d as i64).collect(),
        data_type: Some(proto::FLOAT),
        name: Some(name.to_string()),
        raw_data: Some(raw.into()),
        ..Default::default()
    }
}
