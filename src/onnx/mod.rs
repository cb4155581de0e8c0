//! ONNX in: a model file becomes a kiln graph, so that the models people already have get
//! planned, checked against device limits and compared with eager execution like traced ones.
//!
//! The file is read with `prost` over the schema's messages (`proto`); the graph is then traced
//! node by node with kiln's DSL, so every op gets the same shape checks, error messages and
//! autodiff as a hand-written model. Graph inputs that are not initializers become inputs (a
//! symbolic dimension takes its size from `dims`, by name); float initializers become trainable
//! parameters (their values are returned beside the graph, for `Backend::write_variable`); integer
//! initializers and `Constant` nodes feed shape arguments (Reshape's, Unsqueeze's) and are folded
//! at import.
//!
//! This first slice covers dense, attention-style and plain convolutional graphs, opsets 7 to 22
//! of the default domain: Gemm, MatMul, Add, Sub, Mul, Div, Pow, Relu, Sigmoid, Tanh, Erf, Exp,
//! Log, Sqrt, Neg, Abs, Softmax, LogSoftmax, Identity, Dropout (inference), Flatten, Reshape,
//! Transpose, Unsqueeze, Squeeze, Concat, Constant, Conv (explicit pads, no groups or dilation),
//! MaxPool and AveragePool (unpadded or SAME-padded), GlobalAveragePool and BatchNormalization
//! with running statistics. ONNX's NCHW tensors stay NCHW; a convolution or pooling permutes to
//! kiln's NHWC and back around itself (and the OIHW filter to HWIO), copies a layout pass could
//! later remove. Anything else is an error naming the op, the node and what is supported.
//!
//! A model of one input and one output is also a layer (`OnnxLayer`): each trace replays its
//! nodes on the layer's input, so it goes through autodiff and trains like a traced model.
//!
//! Not yet: LRN, Split/Slice/Gather and shape-driven subgraphs, integer tensors as values,
//! BatchNormalization in training mode, external data, the conformance suite of the `onnx`
//! package's test data.

pub mod proto;

use crate::error::{Error, Result};
use kiln_compiler::CompileError;
use kiln_compiler::ir::{Graph, Init, Padding, Shape};
use kiln_compiler::trace::{Tensor, Tracer};
use kiln_runtime::HostTensor;
use prost::Message;
use proto::{AttributeProto, ModelProto, NodeProto, TensorProto};
use std::collections::HashMap;

/// The default domain's opsets this importer reads.
pub const OPSETS: std::ops::RangeInclusive<i64> = 7..=22;

/// The ops the importer maps, for error messages and the README.
pub const SUPPORTED: &[&str] = &[
    "Abs",
    "Add",
    "Constant",
    "Div",
    "Dropout",
    "Erf",
    "Exp",
    "Flatten",
    "Gemm",
    "Identity",
    "Log",
    "LogSoftmax",
    "MatMul",
    "Mul",
    "Neg",
    "Pow",
    "Relu",
    "Reshape",
    "Sigmoid",
    "Softmax",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Tanh",
    "Transpose",
    "Unsqueeze",
];

/// An imported model: its forward graph (inputs and outputs named as in the file), the values
/// of its parameters by variable key, and its inputs' shapes.
pub struct Imported {
    pub graph: Graph,
    pub weights: Vec<(String, HostTensor)>,
    pub inputs: Vec<(String, Shape)>,
    pub opset: i64,
}

fn invalid(what: impl Into<String>, help: impl Into<String>) -> Error {
    Error::from(CompileError::invalid(what, help))
}

fn unsupported(what: impl Into<String>, help: impl Into<String>) -> Error {
    Error::from(CompileError::unsupported(what, help))
}

/// Reads an ONNX file; `dims` sizes its symbolic dimensions (`("batch", 32)`).
pub fn import_file(path: impl AsRef<std::path::Path>, dims: &[(String, usize)]) -> Result<Imported> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| {
        invalid(format!("cannot read the ONNX file {}: {e}", path.display()), "pass the path of a .onnx file")
    })?;
    import(&bytes, dims)
}

/// Imports an ONNX model from its bytes; `dims` sizes its symbolic dimensions.
pub fn import(bytes: &[u8], dims: &[(String, usize)]) -> Result<Imported> {
    let (model, opset) = decode(bytes)?;
    let graph = model.graph.as_ref().ok_or_else(no_graph)?;
    let t = Tracer::new(graph.name.clone().unwrap_or_else(|| "onnx".into()));
    let mut inputs = Vec::new();
    let mut feeds = HashMap::new();
    for input in &graph.input {
        let name = input.name.clone().unwrap_or_default();
        if graph.initializer.iter().any(|i| i.name.as_deref() == Some(name.as_str())) {
            continue;
        }
        let shape = input_shape(input, dims)?;
        feeds.insert(name.clone(), t.input(&name, shape.clone()));
        inputs.push((name, shape));
    }
    let (outputs, weights) = trace(&t, graph, opset, feeds)?;
    for (name, value) in &outputs {
        t.output(name, value);
    }
    Ok(Imported { graph: t.finish()?, weights, inputs, opset })
}

fn no_graph() -> Error {
    invalid("the model has no graph", "export the model with its graph")
}

/// The model and the default domain's opset, checked.
fn decode(bytes: &[u8]) -> Result<(ModelProto, i64)> {
    let model = ModelProto::decode(bytes).map_err(|e| {
        invalid(
            format!("the bytes are not an ONNX model: {e}"),
            "pass an ONNX file (a serialised ModelProto)",
        )
    })?;
    let opset = model
        .opset_import
        .iter()
        .filter(|o| o.domain.as_deref().unwrap_or("").is_empty() || o.domain.as_deref() == Some("ai.onnx"))
        .filter_map(|o| o.version)
        .max()
        .unwrap_or(1);
    if !OPSETS.contains(&opset) {
        return Err(unsupported(
            format!("the model imports ONNX opset {opset}"),
            format!(
                "kiln reads opsets {} to {}; convert the model (onnx.version_converter)",
                OPSETS.start(),
                OPSETS.end()
            ),
        ));
    }
    Ok((model, opset))
}

/// Named values: a graph's outputs, or its parameters' values.
type Named<T> = Vec<(String, T)>;

/// Traces `graph`'s nodes into `t` from the given input values: its outputs by name, in the
/// graph's order, and its parameters' values.
fn trace(
    t: &Tracer,
    graph: &proto::GraphProto,
    opset: i64,
    feeds: HashMap<String, Tensor>,
) -> Result<(Named<Tensor>, Named<HostTensor>)> {
    let mut importer =
        Importer { t: t.clone(), values: feeds, ints: HashMap::new(), weights: Vec::new(), opset };
    for init in &graph.initializer {
        importer.initializer(init)?;
    }
    for (index, node) in graph.node.iter().enumerate() {
        importer.node(index, node)?;
    }
    let outputs = graph
        .output
        .iter()
        .map(|o| {
            let name = o.name.clone().unwrap_or_default();
            importer.tensor(&name, "the graph's outputs").map(|v| (name, v))
        })
        .collect::<Result<_>>()?;
    Ok((outputs, importer.weights))
}

/// An ONNX model as a kiln layer of one input and one output, so that it trains like a traced
/// model (`Trainer`, `step::train_step_graph`, `compare`): each trace replays the file's nodes
/// on the layer's input. Its parameters start as the file's initializers only once written with
/// `Backend::write_variable` from `weights` (the trainer initialises them to zeros first).
pub struct OnnxLayer {
    model: ModelProto,
    opset: i64,
    /// The file's parameters by variable key.
    pub weights: Vec<(String, HostTensor)>,
}

impl OnnxLayer {
    /// The model of `bytes`, which must have one (non-initializer) input and one output.
    pub fn new(bytes: &[u8]) -> Result<Self> {
        let (model, opset) = decode(bytes)?;
        let graph = model.graph.as_ref().ok_or_else(no_graph)?;
        let inputs =
            graph.input.iter().filter(|i| !graph.initializer.iter().any(|t| t.name == i.name)).count();
        if inputs != 1 || graph.output.len() != 1 {
            return Err(unsupported(
                format!("the model has {inputs} inputs and {} outputs", graph.output.len()),
                "a model trains as a layer with one input and one output; plan others with `import`",
            ));
        }
        let weights = graph
            .initializer
            .iter()
            .filter(|i| !is_integer(i))
            .map(|i| {
                let (dims, values) = tensor_values(i)?;
                Ok((i.name.clone().unwrap_or_default(), HostTensor::new(Shape::new(dims), values)?))
            })
            .collect::<Result<_>>()?;
        Ok(OnnxLayer { model, opset, weights })
    }
}

impl kiln_compiler::nn::Layer for OnnxLayer {
    fn forward(&self, x: &Tensor) -> Tensor {
        let t = x.tracer();
        let Some(graph) = self.model.graph.as_ref() else {
            return t.report("onnx", "the model has no graph", &[x], "");
        };
        let input = graph
            .input
            .iter()
            .find(|i| !graph.initializer.iter().any(|t| t.name == i.name))
            .and_then(|i| i.name.clone())
            .unwrap_or_default();
        let feeds = HashMap::from([(input, x.clone())]);
        match trace(&t, graph, self.opset, feeds) {
            Ok((outputs, _)) => match outputs.into_iter().next() {
                Some((_, y)) => y,
                None => t.report("onnx", "the model has no output", &[x], "export the model with its output"),
            },
            Err(e) => t.report("onnx", e.to_string(), &[x], "see the message"),
        }
    }

    fn kind(&self) -> &'static str {
        "onnx"
    }
}

/// The symbolic names of the models' inputs' first axes (what `--batch N` sizes).
pub fn batch_dims(bytes: &[u8]) -> Vec<String> {
    let Ok(model) = ModelProto::decode(bytes) else { return Vec::new() };
    let mut names: Vec<String> = model
        .graph
        .iter()
        .flat_map(|g| &g.input)
        .filter_map(|i| {
            i.r#type.as_ref()?.tensor_type.as_ref()?.shape.as_ref()?.dim.first()?.dim_param.clone()
        })
        .filter(|p| !p.is_empty())
        .collect();
    names.sort();
    names.dedup();
    names
}

/// An input's shape, symbolic dimensions sized from `dims`.
fn input_shape(input: &proto::ValueInfoProto, dims: &[(String, usize)]) -> Result<Shape> {
    let name = input.name.as_deref().unwrap_or("");
    let tensor = input.r#type.as_ref().and_then(|t| t.tensor_type.as_ref()).ok_or_else(|| {
        unsupported(format!("input `{name}` is not a tensor"), "kiln imports tensor inputs only")
    })?;
    if tensor.elem_type.unwrap_or(proto::FLOAT) != proto::FLOAT {
        return Err(unsupported(
            format!("input `{name}` has element type {} (not float)", tensor.elem_type.unwrap_or(0)),
            "kiln's tensors are f32 (integer inputs are not supported yet)",
        ));
    }
    let shape = tensor.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or(&[]);
    let mut out = Vec::with_capacity(shape.len());
    for (axis, d) in shape.iter().enumerate() {
        match (d.dim_value, d.dim_param.as_deref()) {
            (Some(v), _) if v > 0 => out.push(v as usize),
            (Some(0), _) => {
                return Err(unsupported(
                    format!("input `{name}` axis {axis} has size 0"),
                    "kiln's tensors have no empty axes",
                ));
            }
            (_, Some(p)) if !p.is_empty() => match dims.iter().find(|(n, _)| n == p) {
                Some(&(_, v)) => out.push(v),
                None => {
                    return Err(invalid(
                        format!(
                            "input `{name}` axis {axis} is the symbolic dimension `{p}`, which has no size"
                        ),
                        format!(
                            "give it one: --dim {p}=N (or --batch N for the first axis), or `(\"{p}\", N)` in the API"
                        ),
                    ));
                }
            },
            _ => {
                return Err(invalid(
                    format!("input `{name}` axis {axis} has no size"),
                    "give the model's inputs fixed or named dimensions",
                ));
            }
        }
    }
    Ok(Shape::new(out))
}

/// A tensor's values as f32 and its shape; integers and doubles converted.
fn tensor_values(t: &TensorProto) -> Result<(Vec<usize>, Vec<f32>)> {
    let name = t.name.as_deref().unwrap_or("");
    if t.data_location == Some(1) {
        return Err(unsupported(
            format!("tensor `{name}` keeps its data in an external file"),
            "save the model with its data inside (onnx.save_model(..., save_as_external_data=False))",
        ));
    }
    let dims: Vec<usize> = t.dims.iter().map(|&d| usize::try_from(d).unwrap_or(0)).collect();
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| {
        invalid(format!("tensor `{name}` has dimensions {dims:?}, too many elements"), "the file is damaged")
    })?;
    let raw = t.raw_data.as_deref().unwrap_or(&[]);
    let values: Vec<f32> = match t.data_type.unwrap_or(0) {
        proto::FLOAT if !raw.is_empty() => le(raw, f32::from_le_bytes),
        proto::FLOAT => t.float_data.clone(),
        proto::DOUBLE if !raw.is_empty() => {
            le(raw, f64::from_le_bytes).into_iter().map(|v| v as f32).collect()
        }
        proto::DOUBLE => t.double_data.iter().map(|&v| v as f32).collect(),
        proto::INT64 | proto::INT32 => tensor_ints(t).iter().map(|&v| v as f32).collect(),
        other => {
            return Err(unsupported(
                format!("tensor `{name}` has element type {other}"),
                "kiln reads float, double, int32 and int64 tensors",
            ));
        }
    };
    if values.len() != n {
        return Err(invalid(
            format!("tensor `{name}` of shape {dims:?} holds {} values, not {n}", values.len()),
            "the file is damaged or truncated",
        ));
    }
    Ok((dims, values))
}

/// The elements of little-endian raw data, `N` bytes each (a trailing partial element is
/// dropped, and the element count then checked by the caller).
fn le<const N: usize, T>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N).filter_map(|c| c.try_into().ok()).map(f).collect()
}

/// An integer tensor's values (shape arguments); empty for other element types.
fn tensor_ints(t: &TensorProto) -> Vec<i64> {
    let raw = t.raw_data.as_deref().unwrap_or(&[]);
    match t.data_type.unwrap_or(0) {
        proto::INT64 if !raw.is_empty() => le(raw, i64::from_le_bytes),
        proto::INT64 => t.int64_data.clone(),
        proto::INT32 if !raw.is_empty() => le(raw, i32::from_le_bytes).into_iter().map(i64::from).collect(),
        proto::INT32 => t.int32_data.iter().map(|&v| v as i64).collect(),
        _ => Vec::new(),
    }
}

fn is_integer(t: &TensorProto) -> bool {
    matches!(t.data_type, Some(proto::INT64) | Some(proto::INT32))
}

struct Importer {
    t: Tracer,
    values: HashMap<String, Tensor>,
    /// Integer constants (shape arguments), folded at import.
    ints: HashMap<String, Vec<i64>>,
    weights: Vec<(String, HostTensor)>,
    opset: i64,
}

impl Importer {
    /// A float initializer becomes a parameter named after it; an integer one a folded constant.
    fn initializer(&mut self, init: &TensorProto) -> Result<()> {
        let name = init.name.clone().unwrap_or_default();
        if is_integer(init) {
            self.ints.insert(name, tensor_ints(init));
            return Ok(());
        }
        let (dims, values) = tensor_values(init)?;
        let shape = Shape::new(dims);
        let p = self.t.param(&name, shape.clone(), Init::Zeros);
        self.weights.push((name.clone(), HostTensor::new(shape, values)?));
        self.values.insert(name, p);
        Ok(())
    }

    fn tensor(&self, name: &str, user: &str) -> Result<Tensor> {
        match self.values.get(name) {
            Some(t) => Ok(t.clone()),
            None if self.ints.contains_key(name) => Err(unsupported(
                format!("{user} read the integer tensor `{name}` as a value"),
                "kiln's tensors are f32; integer tensors are read only as shape arguments",
            )),
            None => Err(invalid(
                format!("{user} read `{name}`, which no input, initializer or earlier node makes"),
                "the graph must be in topological order with every value defined",
            )),
        }
    }

    fn node(&mut self, index: usize, node: &NodeProto) -> Result<()> {
        let op = node.op_type.clone().unwrap_or_default();
        let who = match node.name.as_deref().filter(|n| !n.is_empty()) {
            Some(name) => format!("node `{name}` ({op})"),
            None => format!("node #{index} ({op})"),
        };
        if let Some(d) = node.domain.as_deref().filter(|d| !d.is_empty() && *d != "ai.onnx") {
            return Err(unsupported(
                format!("{who} is in the domain `{d}`"),
                "kiln imports the default ONNX domain",
            ));
        }
        let attr = |name: &str| node.attribute.iter().find(|a| a.name.as_deref() == Some(name));
        let int_attr = |name: &str, default: i64| attr(name).and_then(|a| a.i).unwrap_or(default);
        let float_attr = |name: &str, default: f32| attr(name).and_then(|a| a.f).unwrap_or(default);
        let ints_attr = |name: &str| attr(name).map(|a: &AttributeProto| a.ints.clone());
        let input = |i: usize| -> Result<Tensor> {
            let name =
                node.input.get(i).filter(|n| !n.is_empty()).ok_or_else(|| {
                    invalid(format!("{who} has no input {i}"), format!("{op} needs input {i}"))
                })?;
            self.tensor(name, &who)
        };
        let ints_input = |i: usize| -> Result<Vec<i64>> {
            let name = node.input.get(i).cloned().unwrap_or_default();
            self.ints.get(&name).cloned().ok_or_else(|| {
                unsupported(
                    format!("{who} takes its input {i} (`{name}`) from a computed tensor"),
                    "kiln folds shape arguments at import: they must be initializers or Constant nodes",
                )
            })
        };
        let rank_axis = |axis: i64, rank: usize| -> Result<usize> {
            let a = if axis < 0 { axis + rank as i64 } else { axis };
            usize::try_from(a).ok().filter(|&a| a < rank.max(1)).ok_or_else(|| {
                invalid(
                    format!("{who} names axis {axis} of a rank-{rank} tensor"),
                    "use an axis the tensor has",
                )
            })
        };
        let out = match op.as_str() {
            "Constant" => {
                let value = attr("value").and_then(|a| a.t.as_ref()).ok_or_else(|| {
                    unsupported(
                        format!("{who} has no tensor `value`"),
                        "kiln reads Constant nodes with a tensor value",
                    )
                })?;
                let name = node.output.first().cloned().unwrap_or_default();
                if is_integer(value) {
                    self.ints.insert(name, tensor_ints(value));
                    return Ok(());
                }
                let (dims, values) = tensor_values(value)?;
                match values.first() {
                    Some(&v) if values.iter().all(|&x| x.to_bits() == v.to_bits()) => self.t.fill(v, dims),
                    _ => {
                        let shape = Shape::new(dims);
                        let p = self.t.param(&name, shape.clone(), Init::Zeros);
                        self.weights.push((name.clone(), HostTensor::new(shape, values)?));
                        p
                    }
                }
            }
            "Gemm" => {
                let (a, b) = (input(0)?, input(1)?);
                let (alpha, beta) = (float_attr("alpha", 1.0), float_attr("beta", 1.0));
                let mut y = a.matmul_t(&b, int_attr("transA", 0) != 0, int_attr("transB", 0) != 0);
                if alpha != 1.0 {
                    y = y * alpha;
                }
                if node.input.get(2).is_some_and(|n| !n.is_empty()) {
                    let c = input(2)?;
                    y = if beta == 1.0 { y + &c } else { y + &(c * beta) };
                }
                y
            }
            "MatMul" => input(0)?.matmul(&input(1)?),
            "Add" => input(0)?.add(&input(1)?),
            "Sub" => input(0)?.sub(&input(1)?),
            "Mul" => input(0)?.mul(&input(1)?),
            "Div" => input(0)?.div(&input(1)?),
            "Pow" => input(0)?.pow(&input(1)?),
            "Relu" => input(0)?.relu(),
            "Sigmoid" => input(0)?.sigmoid(),
            "Tanh" => input(0)?.tanh(),
            "Erf" => input(0)?.erf(),
            "Exp" => input(0)?.exp(),
            "Log" => input(0)?.log(),
            "Sqrt" => input(0)?.sqrt(),
            "Neg" => input(0)?.neg(),
            "Abs" => input(0)?.abs(),
            "Identity" | "Dropout" => input(0)?,
            "Softmax" | "LogSoftmax" => {
                let x = input(0)?;
                let rank = x.rank();
                // Before opset 13 the op flattened the axes from `axis` on (default 1): the same
                // as along the last axis only when that is the last axis.
                let default = if self.opset < 13 { 1 } else { -1 };
                let axis = rank_axis(int_attr("axis", default), rank)?;
                if self.opset < 13 && axis + 1 != rank {
                    return Err(unsupported(
                        format!("{who} normalises axes {axis}.. together (opset {} semantics)", self.opset),
                        "kiln imports this op along the last axis only: export with axis = -1 or opset 13+",
                    ));
                }
                if op == "Softmax" { x.softmax(axis as isize) } else { x.log_softmax(axis as isize) }
            }
            "Flatten" => {
                let x = input(0)?;
                let d = x.dims().to_vec();
                // Flatten's axis runs from -r to r (r itself flattens everything into one row).
                let a = int_attr("axis", 1);
                let r = d.len() as i64;
                // (a + r below 0 stays out of range for rank_axis's own negative step.)
                let a = if a < 0 && a + r >= 0 {
                    a + r
                } else if a < 0 {
                    -2 * r - 2
                } else {
                    a
                };
                let axis = rank_axis(a, d.len() + 1)?;
                let lead: usize = d[..axis.min(d.len())].iter().product();
                let rest: usize = d[axis.min(d.len())..].iter().product();
                x.reshape([lead, rest])
            }
            "Reshape" => {
                let x = input(0)?;
                let spec = ints_input(1)?;
                let shape =
                    reshape_target(x.dims(), &spec, int_attr("allowzero", 0) != 0).map_err(|why| {
                        invalid(format!("{who}: {why}"), "give a shape with the input's element count")
                    })?;
                x.reshape(shape)
            }
            "Transpose" => {
                let x = input(0)?;
                let rank = x.rank();
                let perm: Vec<usize> = match ints_attr("perm") {
                    Some(p) if !p.is_empty() => {
                        p.iter().map(|&a| rank_axis(a, rank)).collect::<Result<_>>()?
                    }
                    _ => (0..rank).rev().collect(),
                };
                x.permute(&perm)
            }
            "Unsqueeze" | "Squeeze" => {
                let x = input(0)?;
                let axes = if self.opset >= 13 {
                    if node.input.len() > 1 { Some(ints_input(1)?) } else { None }
                } else {
                    ints_attr("axes")
                };
                let mut dims = x.dims().to_vec();
                if op == "Unsqueeze" {
                    let axes = axes.unwrap_or_default();
                    let rank = dims.len() + axes.len();
                    let mut axes: Vec<usize> =
                        axes.iter().map(|&a| rank_axis(a, rank)).collect::<Result<_>>()?;
                    axes.sort_unstable();
                    for a in axes {
                        dims.insert(a.min(dims.len()), 1);
                    }
                } else {
                    let rank = dims.len();
                    let axes: Vec<usize> = match axes {
                        Some(a) => a.iter().map(|&a| rank_axis(a, rank)).collect::<Result<_>>()?,
                        None => (0..rank).filter(|&a| dims[a] == 1).collect(),
                    };
                    dims =
                        dims.iter().enumerate().filter(|(a, _)| !axes.contains(a)).map(|(_, &d)| d).collect();
                }
                x.reshape(dims)
            }
            "Conv" => {
                let (x, w) = (input(0)?, input(1)?);
                let window = self.window(node, &who, x.rank())?;
                if int_attr("group", 1) != 1 {
                    return Err(unsupported(
                        format!("{who} is a grouped convolution"),
                        "kiln convolves with group = 1",
                    ));
                }
                // ONNX is NCHW with OIHW filters; kiln's convolution is NHWC with HWIO filters.
                let mut nhwc = x.permute(&[0, 2, 3, 1]);
                let [top, left, bottom, right] = window.pads;
                if top + bottom > 0 {
                    nhwc = nhwc.pad(1, top, bottom);
                }
                if left + right > 0 {
                    nhwc = nhwc.pad(2, left, right);
                }
                let mut y = nhwc.conv2d(&w.permute(&[2, 3, 1, 0]), window.strides, Padding::Valid);
                if node.input.get(2).is_some_and(|n| !n.is_empty()) {
                    y = y + &input(2)?;
                }
                y.permute(&[0, 3, 1, 2])
            }
            "MaxPool" | "AveragePool" => {
                let x = input(0)?;
                let window = self.window(node, &who, x.rank())?;
                let size = window.kernel.ok_or_else(|| {
                    invalid(format!("{who} has no kernel_shape"), "give the pooling its kernel_shape")
                })?;
                if int_attr("ceil_mode", 0) != 0 {
                    return Err(unsupported(
                        format!("{who} rounds its output size up (ceil_mode = 1)"),
                        "kiln pools with ceil_mode = 0",
                    ));
                }
                // Padded elements are skipped by both (and not counted by kiln's average, as by
                // ONNX's default count_include_pad = 0); kiln pads only as SAME does.
                let padding = if window.pads == [0; 4] {
                    Padding::Valid
                } else if same_pads(x.dims(), size, window.strides) == Some(window.pads) {
                    Padding::Same
                } else {
                    return Err(unsupported(
                        format!("{who} pads {:?}, which are not SAME's", window.pads),
                        "kiln pools unpadded or with SAME padding",
                    ));
                };
                if op == "AveragePool" && int_attr("count_include_pad", 0) != 0 && padding == Padding::Same {
                    return Err(unsupported(
                        format!("{who} counts padding in its average"),
                        "kiln averages over the window's in-bounds elements (count_include_pad = 0)",
                    ));
                }
                let nhwc = x.permute(&[0, 2, 3, 1]);
                let y = if op == "MaxPool" {
                    nhwc.max_pool2d(size, window.strides, padding)
                } else {
                    nhwc.avg_pool2d(size, window.strides, padding)
                };
                y.permute(&[0, 3, 1, 2])
            }
            "GlobalAveragePool" => {
                let x = input(0)?;
                let axes: Vec<usize> = (2..x.rank()).collect();
                x.mean(axes.as_slice(), true)
            }
            "BatchNormalization" => {
                if int_attr("training_mode", 0) != 0 || node.output.len() > 1 {
                    return Err(unsupported(
                        format!("{who} is in training mode"),
                        "kiln imports BatchNormalization for inference (running statistics)",
                    ));
                }
                let x = input(0)?;
                // [C] statistics over NCHW: as [C, 1, 1].
                let per_channel = |t: Tensor| {
                    let mut dims = t.dims().to_vec();
                    dims.extend(std::iter::repeat_n(1, x.rank().saturating_sub(2)));
                    t.reshape(dims)
                };
                let (scale, bias, mean, var) = (
                    per_channel(input(1)?),
                    per_channel(input(2)?),
                    per_channel(input(3)?),
                    per_channel(input(4)?),
                );
                let eps = float_attr("epsilon", 1e-5);
                (x - &mean) * &(var + eps).rsqrt() * &scale + &bias
            }
            "Concat" => {
                let parts: Vec<Tensor> = (0..node.input.len()).map(input).collect::<Result<_>>()?;
                let Some((first, rest)) = parts.split_first() else {
                    return Err(invalid(format!("{who} has no inputs"), "concatenate at least one tensor"));
                };
                let axis = rank_axis(int_attr("axis", 0), first.rank())?;
                let rest: Vec<&Tensor> = rest.iter().collect();
                first.concat(&rest, axis as isize)
            }
            other => {
                return Err(unsupported(
                    format!("{who}: kiln does not import `{other}` yet"),
                    format!("supported: {}", SUPPORTED.join(", ")),
                ));
            }
        };
        let name = node.output.first().cloned().unwrap_or_default();
        self.values.insert(name, out);
        Ok(())
    }
}

/// A convolution's or pooling's spatial attributes (2-D only).
struct Window {
    kernel: Option<[usize; 2]>,
    strides: [usize; 2],
    /// top, left, bottom, right.
    pads: [usize; 4],
}

impl Importer {
    fn window(&self, node: &NodeProto, who: &str, rank: usize) -> Result<Window> {
        if rank != 4 {
            return Err(unsupported(
                format!("{who} has a rank-{rank} input"),
                "kiln imports 2-D convolutions and pooling (NCHW)",
            ));
        }
        let attr = |name: &str| node.attribute.iter().find(|a| a.name.as_deref() == Some(name));
        let pair = |name: &str, default: usize| -> Result<[usize; 2]> {
            match attr(name).map(|a| a.ints.as_slice()) {
                None | Some([]) => Ok([default; 2]),
                Some(&[a, b]) if a > 0 && b > 0 => Ok([a as usize, b as usize]),
                Some(v) => Err(invalid(format!("{who} has {name} {v:?}"), "give two positive values")),
            }
        };
        if let Some(d) = attr("dilations").map(|a| a.ints.as_slice()).filter(|d| d.iter().any(|&v| v != 1)) {
            return Err(unsupported(format!("{who} dilates by {d:?}"), "kiln convolves without dilation"));
        }
        let auto =
            attr("auto_pad").and_then(|a| a.s.as_deref()).map(|s| String::from_utf8_lossy(s).into_owned());
        if auto.as_deref().is_some_and(|a| a != "NOTSET" && a != "VALID") {
            return Err(unsupported(
                format!("{who} has auto_pad {}", auto.unwrap_or_default()),
                "export with explicit pads (auto_pad NOTSET)",
            ));
        }
        let pads = match attr("pads").map(|a| a.ints.as_slice()) {
            None | Some([]) => [0; 4],
            Some(&[t, l, b, r]) if [t, l, b, r].iter().all(|&v| v >= 0) => {
                [t as usize, l as usize, b as usize, r as usize]
            }
            Some(v) => return Err(invalid(format!("{who} has pads {v:?}"), "give four non-negative pads")),
        };
        let kernel = attr("kernel_shape").map(|_| pair("kernel_shape", 1)).transpose()?;
        Ok(Window { kernel, strides: pair("strides", 1)?, pads })
    }
}

/// The pads (top, left, bottom, right) TensorFlow's SAME gives an NCHW input: total
/// max((ceil(in / s) - 1)·s + k - in, 0), the extra one on the far side.
fn same_pads(dims: &[usize], k: [usize; 2], s: [usize; 2]) -> Option<[usize; 4]> {
    let total = |n: usize, k: usize, s: usize| (n.div_ceil(s).saturating_sub(1) * s + k).saturating_sub(n);
    let (h, w) = (*dims.get(2)?, *dims.get(3)?);
    let (th, tw) = (total(h, k[0], s[0]), total(w, k[1], s[1]));
    Some([th / 2, tw / 2, th - th / 2, tw - tw / 2])
}

/// Reshape's target: 0 copies the input's axis (unless `allowzero`), one -1 takes the rest.
fn reshape_target(input: &[usize], spec: &[i64], allowzero: bool) -> std::result::Result<Vec<usize>, String> {
    let total: usize = input.iter().product();
    let mut out = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &s) in spec.iter().enumerate() {
        match s {
            -1 if infer.is_none() => {
                infer = Some(i);
                out.push(1);
            }
            0 if !allowzero => {
                out.push(*input.get(i).ok_or_else(|| format!("0 at axis {i} copies no input axis"))?)
            }
            s if s >= 0 => out.push(s as usize),
            s => return Err(format!("the shape {spec:?} has {s} at axis {i}")),
        }
    }
    if let Some(i) = infer {
        let known = out.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(0);
        if known == 0 || !total.is_multiple_of(known) {
            return Err(format!("cannot infer -1 in {spec:?} for {total} elements"));
        }
        out[i] = total / known;
    }
    if out.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(total) {
        return Err(format!("the shape {out:?} does not hold the input's {total} elements ({input:?})"));
    }
    Ok(out)
}
