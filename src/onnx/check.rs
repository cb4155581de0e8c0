//! The ONNX checker inside the importer: what onnx's `onnx.checker.check_model` (and the type
//! checks of its shape inference) would refuse, refused before a node is traced, so that a
//! malformed file is an error naming the file, the node, the value or attribute and the rule of
//! the standard it breaks (in the words onnx's checker uses), never a different computation.
//! Before it, a value produced twice took the later producer without a word, an attribute of
//! the wrong type read as its default, an int64 tensor fed to `MatMul` computed in f32, and a
//! dimension over kiln's limit failed later as a misparse.
//!
//! What is checked, in order:
//! - the model: `ir_version` set and within [`IR_VERSIONS`], an opset imported for the default
//!   domain, within [`super::OPSETS`];
//! - the graph: graph inputs named once; initializers named, named once, of a known element
//!   type, of non-negative dimensions within kiln's per-tensor limit, and of the type and shape
//!   of the graph input they give a default to;
//! - every node, in order: each input a graph input, an initializer or an earlier node's output
//!   (empty names are omitted optional inputs), each output made once (single static assignment),
//!   attributes named once, of the type their value field says, of the type the operator declares
//!   and present where the operator requires them (`Constant`: exactly one value);
//! - element types against the operators' type constraints, for the ops kiln maps: from the
//!   declared types (graph inputs, initializers, `value_info`) and the types inferred through the
//!   nodes (`Cast`'s `to`, `Shape`'s int64, comparisons' bool, ops whose output has their input's
//!   type); a value of unknown type is not checked. Types ONNX allows but kiln computes only in
//!   float (an integer `MatMul`, `Relu`, reduction) are refused as unsupported. The reductions'
//!   `axes` input is left to the importer, which folds it (and says so where it cannot);
//! - the graph's outputs: each made by a node or given.
//!
//! Graph inputs' symbolic dimensions are checked against the limit once sized (`input_shape`).

use super::proto::{self, AttributeProto, GraphProto, ModelProto, NodeProto, TensorProto, ValueInfoProto};
use super::{OPSETS, invalid, unsupported, who};
use crate::error::{Error, Result};
use kiln_compiler::ir::MAX_TENSOR_BYTES;
use std::collections::{HashMap, HashSet};
use std::ops::RangeInclusive;
use std::path::Path;

/// The ONNX IR versions kiln reads: 3 (ONNX 1.1, the first with operator sets) to 11 (ONNX 1.18).
/// The fields kiln reads have not changed within them.
pub const IR_VERSIONS: RangeInclusive<i64> = 3..=11;

/// The declared types of a graph's intermediate values (`GraphProto.value_info`, which exporters
/// and shape inference write), decoded apart from `proto::GraphProto` so that its public fields
/// stay as they are: protobuf skips the fields a message does not name.
#[derive(Clone, PartialEq, prost::Message)]
struct ModelValueInfo {
    #[prost(message, optional, tag = "7")]
    graph: Option<GraphValueInfo>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct GraphValueInfo {
    #[prost(message, repeated, tag = "13")]
    value_info: Vec<ValueInfoProto>,
}

/// Checks `model` (decoded from `bytes`) as onnx's checker does; returns the default domain's
/// opset. `file` names the file in the errors, where the model came from one.
pub(crate) fn model(model: &ModelProto, bytes: &[u8], file: Option<&Path>) -> Result<i64> {
    let c = Checker { file };
    let (first, last) = (IR_VERSIONS.start(), IR_VERSIONS.end());
    match model.ir_version {
        None | Some(0) => {
            return Err(c.invalid(
                "The model does not have an ir_version set properly.",
                format!(
                    "kiln reads ONNX IR versions {first} to {last}: save the model with the onnx package \
                     (onnx.save_model sets ir_version)"
                ),
            ));
        }
        Some(v) if v < *first => {
            return Err(c.unsupported(
                format!("the model's ir_version is {v}, below {first} (a model with IR version < 3 has no opset_import)"),
                format!(
                    "kiln reads ONNX IR versions {first} to {last}: convert the model with a current onnx \
                     (onnx.version_converter.convert_version)"
                ),
            ));
        }
        Some(v) if v > *last => {
            return Err(c.unsupported(
                format!("Your model ir_version {v} is higher than kiln's ({last})."),
                format!(
                    "kiln reads ONNX IR versions {first} to {last}: save the model with ir_version {last} or \
                     lower (model.ir_version = {last} before onnx.save_model, where it uses nothing newer)"
                ),
            ));
        }
        Some(_) => {}
    }
    let opset =
        model.opset_import.iter().filter(|o| is_default(o.domain.as_deref())).filter_map(|o| o.version).max();
    let graph = model.graph.as_ref();
    let Some(opset) = opset else {
        let domains: Vec<String> =
            model.opset_import.iter().map(|o| format!("`{}`", o.domain.as_deref().unwrap_or(""))).collect();
        let uses_default = graph.is_none_or(|g| g.node.iter().any(|n| is_default(n.domain.as_deref())));
        if !uses_default {
            return Err(c.unsupported(
                format!(
                    "the model imports only the domains {} and no opset of the default ONNX domain",
                    domains.join(", ")
                ),
                "kiln imports models of the default ONNX domain",
            ));
        }
        let rule = if model.opset_import.is_empty() {
            "model with IR version >= 3 must specify opset_import for ONNX".to_string()
        } else {
            format!("No opset import for domain '' (the model imports {})", domains.join(", "))
        };
        return Err(c.invalid(
            rule,
            "export the model with the opset of its default-domain operators (an opset_import of domain \"\" \
             and its version, e.g. 17)",
        ));
    };
    if !OPSETS.contains(&opset) {
        return Err(c.unsupported(
            format!("the model imports ONNX opset {opset}"),
            format!(
                "kiln reads opsets {} to {}; convert the model (onnx.version_converter)",
                OPSETS.start(),
                OPSETS.end()
            ),
        ));
    }
    let Some(graph) = graph else {
        return Err(c.invalid("the model has no graph", "export the model with its graph"));
    };
    let value_info = <ModelValueInfo as prost::Message>::decode(bytes)
        .ok()
        .and_then(|m| m.graph)
        .map(|g| g.value_info)
        .unwrap_or_default();
    c.graph(graph, &value_info, opset)?;
    Ok(opset)
}

fn is_default(domain: Option<&str>) -> bool {
    matches!(domain.unwrap_or(""), "" | "ai.onnx")
}

struct Checker<'a> {
    file: Option<&'a Path>,
}

/// What produced a value, for messages.
#[derive(Clone)]
enum Source {
    Input,
    Initializer,
    Node(String),
}

impl Source {
    fn describe(&self) -> String {
        match self {
            Source::Input => "a graph input".into(),
            Source::Initializer => "an initializer".into(),
            Source::Node(who) => format!("the output of {who}"),
        }
    }
}

impl Checker<'_> {
    fn prefix(&self) -> String {
        self.file.map(|p| format!("{}: ", p.display())).unwrap_or_default()
    }

    fn invalid(&self, what: impl std::fmt::Display, help: impl Into<String>) -> Error {
        invalid(format!("{}{what}", self.prefix()), help)
    }

    fn unsupported(&self, what: impl std::fmt::Display, help: impl Into<String>) -> Error {
        unsupported(format!("{}{what}", self.prefix()), help)
    }

    fn graph<'g>(&self, graph: &'g GraphProto, value_info: &'g [ValueInfoProto], opset: i64) -> Result<()> {
        let mut defined: HashMap<&str, Source> = HashMap::new();
        let mut types: HashMap<&str, i32> = HashMap::new();
        let mut declared: HashMap<&str, &ValueInfoProto> = HashMap::new();
        for input in &graph.input {
            let name = input.name.as_deref().unwrap_or("");
            if defined.insert(name, Source::Input).is_some() {
                return Err(self.invalid(
                    format!(
                        "Graph must be in single static assignment (SSA) form, however '{name}' has been used \
                         as graph input names multiple times."
                    ),
                    format!("give each graph input its own name (`{name}` is declared twice)"),
                ));
            }
            declared.insert(name, input);
            if let Some(t) = elem_type(input) {
                types.insert(name, t);
            }
            self.value_dims(input)?;
        }
        let mut initialized = HashSet::new();
        for init in &graph.initializer {
            let name = init.name.as_deref().unwrap_or("");
            if name.is_empty() {
                return Err(self.invalid(
                    "Tensor initializers must have a non-empty name",
                    "name every initializer after the graph value it gives",
                ));
            }
            if !initialized.insert(name) {
                return Err(self.invalid(
                    format!("{name} initializer name is not unique"),
                    format!("keep one initializer named `{name}`"),
                ));
            }
            self.tensor(init, &format!("initializer `{name}`"))?;
            let data_type = init.data_type.unwrap_or(0);
            if let Some(input) = declared.get(name) {
                self.initializer_matches_input(init, input)?;
            }
            defined.insert(name, Source::Initializer);
            types.insert(name, data_type);
        }
        for info in value_info {
            if let (Some(name), Some(t)) = (info.name.as_deref(), elem_type(info)) {
                declared.entry(name).or_insert(info);
                types.entry(name).or_insert(t);
            }
        }
        // Which later node makes a value, for "not topologically sorted" messages.
        let mut makers: HashMap<&str, usize> = HashMap::new();
        for (index, node) in graph.node.iter().enumerate() {
            for out in node.output.iter().filter(|o| !o.is_empty()) {
                makers.entry(out.as_str()).or_insert(index);
            }
        }
        for (index, node) in graph.node.iter().enumerate() {
            let op = node.op_type.as_deref().unwrap_or("");
            let who = who(index, node);
            if op.is_empty() {
                return Err(self.invalid(
                    format!("{who}: Field 'op_type' of 'node' is required to be non-empty."),
                    "give every node its operator",
                ));
            }
            for input in node.input.iter().filter(|i| !i.is_empty()) {
                if defined.contains_key(input.as_str()) {
                    continue;
                }
                let rule = format!(
                    "Nodes in a graph must be topologically sorted, however input '{input}' of node: name: {} \
                     OpType: {op} is not output of any previous nodes.",
                    node.name.as_deref().unwrap_or("")
                );
                let help = match makers.get(input.as_str()) {
                    Some(&later) => format!(
                        "`{input}` is made by the later {}: sort the nodes so that every producer comes before \
                         its readers",
                        who_at(graph, later)
                    ),
                    None => format!(
                        "`{input}` is neither a graph input, an initializer nor any node's output: define it, or \
                         leave the input's name empty where the operator's input is optional"
                    ),
                };
                return Err(self.invalid(format!("{who}: reads `{input}`: {rule}"), help));
            }
            self.attributes(node, &who, opset)?;
            if is_default(node.domain.as_deref()) {
                self.types(node, &who, opset, &mut types)?;
            }
            for out in node.output.iter().filter(|o| !o.is_empty()) {
                if let Some(first) = defined.get(out.as_str()) {
                    return Err(self.invalid(
                        format!(
                            "{who}: Graph must be in single static assignment (SSA) form, however '{out}' has been \
                             used as output names multiple times."
                        ),
                        format!(
                            "`{out}` is already {}: give every value one producer (rename this output and its \
                             readers)",
                            first.describe()
                        ),
                    ));
                }
                defined.insert(out.as_str(), Source::Node(who.clone()));
                if let (false, Some(t)) =
                    (types.contains_key(out.as_str()), declared.get(out.as_str()).and_then(|v| elem_type(v)))
                {
                    types.insert(out.as_str(), t);
                }
            }
        }
        for output in &graph.output {
            let name = output.name.as_deref().unwrap_or("");
            if !defined.contains_key(name) {
                return Err(self.invalid(
                    format!("Graph output '{name}' is not an output of any node in graph."),
                    format!("make `{name}` with a node, or drop it from the graph's outputs"),
                ));
            }
        }
        Ok(())
    }

    /// A stored tensor's element type and dimensions.
    fn tensor(&self, t: &TensorProto, what: &str) -> Result<()> {
        let name = t.name.as_deref().unwrap_or("");
        let data_type = t.data_type.unwrap_or(0);
        if data_type == 0 {
            return Err(self.invalid(
                format!("{what}: setting data_type field (tensor name: {name}) to UNDEFINED is not allowed"),
                "give the tensor its element type",
            ));
        }
        let dims: Vec<Option<i64>> = t.dims.iter().map(|&d| Some(d)).collect();
        self.dims(what, &dims, data_type)
    }

    /// A declared value's static dimensions.
    fn value_dims(&self, v: &ValueInfoProto) -> Result<()> {
        let Some(tensor) = v.r#type.as_ref().and_then(|t| t.tensor_type.as_ref()) else { return Ok(()) };
        let dims: Vec<Option<i64>> =
            tensor.shape.iter().flat_map(|s| &s.dim).map(|d| d.dim_value.filter(|_| !has_param(d))).collect();
        let name = v.name.as_deref().unwrap_or("");
        self.dims(&format!("graph input `{name}`"), &dims, tensor.elem_type.unwrap_or(proto::FLOAT))
    }

    /// Dimensions (`None`: symbolic) non-negative, and within kiln's limit of bytes per tensor.
    fn dims(&self, what: &str, dims: &[Option<i64>], data_type: i32) -> Result<()> {
        for (axis, d) in dims.iter().enumerate() {
            if let Some(d) = d.filter(|&d| d < 0) {
                return Err(self.invalid(
                    format!("{what}: dimension {axis} is {d}, and ONNX's dimensions are non-negative"),
                    "the file is damaged, or was written with a wrong shape",
                ));
            }
        }
        let sizes: Vec<usize> =
            dims.iter().map(|d| d.map_or(1, |d| usize::try_from(d).unwrap_or(usize::MAX))).collect();
        match over_limit(what, &sizes, element_bytes(data_type).unwrap_or(1)) {
            Some(why) => Err(self.invalid(why, SIZE_HELP)),
            None => Ok(()),
        }
    }

    /// An initializer that gives a graph input its default: of the input's element type and
    /// static dimensions.
    fn initializer_matches_input(&self, init: &TensorProto, input: &ValueInfoProto) -> Result<()> {
        let name = init.name.as_deref().unwrap_or("");
        let Some(tensor) = input.r#type.as_ref().and_then(|t| t.tensor_type.as_ref()) else { return Ok(()) };
        let data_type = init.data_type.unwrap_or(0);
        if let Some(declared) = tensor.elem_type.filter(|&t| t != 0)
            && declared != data_type
        {
            return Err(self.invalid(
                format!(
                    "initializer `{name}` is {}, but the graph input `{name}` is declared {}: Inferred elem type \
                     differs from existing elem type: ({}) vs ({})",
                    type_name(data_type),
                    type_name(declared),
                    type_name(data_type),
                    type_name(declared)
                ),
                "an initializer gives the graph input of its name a default value, of the input's type: make them \
                 agree (or rename one)",
            ));
        }
        if let Some(shape) = &tensor.shape {
            let conflict = if shape.dim.len() != init.dims.len() {
                Some(format!(
                    "Inferred shape and existing shape differ in rank: ({}) vs ({})",
                    init.dims.len(),
                    shape.dim.len()
                ))
            } else {
                shape.dim.iter().zip(&init.dims).enumerate().find_map(|(axis, (d, &v))| {
                    let declared = d.dim_value.filter(|_| !has_param(d))?;
                    (declared != v).then(|| {
                        format!(
                            "Inferred shape and existing shape differ in dimension {axis}: ({v}) vs ({declared})"
                        )
                    })
                })
            };
            if let Some(rule) = conflict {
                let declared: Vec<String> = shape
                    .dim
                    .iter()
                    .map(|d| match (&d.dim_param, d.dim_value) {
                        (Some(p), _) if !p.is_empty() => p.clone(),
                        (_, Some(v)) => v.to_string(),
                        _ => "?".into(),
                    })
                    .collect();
                return Err(self.invalid(
                    format!(
                        "initializer `{name}` has shape {:?}, but the graph input `{name}` is declared [{}]: {rule}",
                        init.dims,
                        declared.join(", ")
                    ),
                    "an initializer gives the graph input of its name a default value, of the input's shape: make \
                     them agree (or rename one)",
                ));
            }
        }
        Ok(())
    }

    fn attributes(&self, node: &NodeProto, who: &str, opset: i64) -> Result<()> {
        let op = node.op_type.as_deref().unwrap_or("");
        let default_domain = is_default(node.domain.as_deref());
        let schema = if default_domain { attribute_schema(op, opset) } else { Vec::new() };
        let node_name = node.name.as_deref().unwrap_or("");
        let mut seen = HashSet::new();
        for a in &node.attribute {
            let name = a.name.as_deref().unwrap_or("");
            if name.is_empty() {
                return Err(self.invalid(
                    format!("{who}: Field 'name' of 'attr' is required to be non-empty."),
                    "name every attribute",
                ));
            }
            if !seen.insert(name) {
                return Err(self.invalid(
                    format!("{who}: Attribute '{name}' appeared multiple times."),
                    format!("give `{name}` once"),
                ));
            }
            let fields = value_fields(a);
            if fields.len() > 1 {
                return Err(self.invalid(
                    format!("{who}: Attribute (name: {name}) should not contain more than one value field."),
                    format!("set one of `{name}`'s value fields, the one its type names"),
                ));
            }
            let given = a.r#type.filter(|&t| t != 0);
            if let (Some(t), Some(&field)) = (given, fields.first())
                && t != field
            {
                return Err(self.invalid(
                    format!(
                        "{who}: type field and data field mismatch in attribute {name}. (its type is {}, its value \
                         is {})",
                        attr_type_name(t),
                        attr_type_name(field)
                    ),
                    format!("write `{name}` with the value field of its type"),
                ));
            }
            // A file written without `type` (before IR version 2) is read by the field it sets.
            let Some(actual) = given.or(fields.first().copied()) else { continue };
            if let Some(&(_, expected, _)) = schema.iter().find(|(n, _, _)| *n == name)
                && actual != expected
            {
                return Err(self.invalid(
                    format!(
                        "{who}: Mismatched attribute type in '{node_name} : {name}'. Expected: '{}', actual: '{}'",
                        attr_type_name(expected),
                        attr_type_name(actual)
                    ),
                    format!(
                        "ONNX's {op} declares `{name}` {}: write it so (onnx.helper.make_node does)",
                        attr_type_name(expected)
                    ),
                ));
            }
        }
        for (name, expected, required) in &schema {
            if *required && !seen.contains(name) {
                return Err(self.invalid(
                    format!("{who}: Required attribute '{name}' is missing."),
                    format!("ONNX's {op} (opset {opset}) requires `{name}` ({})", attr_type_name(*expected)),
                ));
            }
        }
        if default_domain && op == "Constant" {
            const VALUES: [&str; 8] = [
                "value",
                "sparse_value",
                "value_int",
                "value_ints",
                "value_float",
                "value_floats",
                "value_string",
                "value_strings",
            ];
            let given: Vec<&str> = VALUES.iter().copied().filter(|v| seen.contains(v)).collect();
            if given.len() != 1 {
                return Err(self.invalid(
                    format!(
                        "{who}: One and only one of the attributes 'value', 'value_*' or 'sparse_value' must be \
                         specified for a Constant node. (it has {})",
                        if given.is_empty() { "none".to_string() } else { given.join(", ") }
                    ),
                    "give the Constant exactly one value attribute",
                ));
            }
        }
        Ok(())
    }

    /// The node's inputs' element types against its operator's constraints; its outputs' types
    /// recorded where they follow.
    fn types<'g>(
        &self,
        node: &'g NodeProto,
        who: &str,
        opset: i64,
        types: &mut HashMap<&'g str, i32>,
    ) -> Result<()> {
        let op = node.op_type.as_deref().unwrap_or("");
        let input_type = |i: usize| -> Option<i32> {
            node.input
                .get(i)
                .filter(|n| !n.is_empty())
                .and_then(|n| types.get(n.as_str()).copied())
                .filter(|&t| t != 0)
        };
        if let Some(sig) = signature(op, opset) {
            let mut bound: HashMap<&str, (i32, usize)> = HashMap::new();
            for i in 0..node.input.len() {
                let Some(param) = sig.params.get(i).or(if sig.variadic { sig.params.last() } else { None })
                else {
                    break;
                };
                let Some(t) = input_type(i) else { continue };
                let value = &node.input[i];
                if param.types != ANY && !in_set(param.types, t) {
                    return Err(self.invalid(
                        format!(
                            "{who}: input {i} `{value}` is {}: {} typestr: {}, has unsupported type: {}",
                            type_name(t),
                            param.name,
                            param.var,
                            type_name(t)
                        ),
                        format!("ONNX's {op} takes {} as {}", param.name, set_names(param.types)),
                    ));
                }
                match bound.get(param.var) {
                    Some(&(first, j)) if first != t => {
                        return Err(self.invalid(
                            format!(
                                "{who}: input {i} `{value}` is {} and input {j} `{}` is {}: {} has inconsistent type {}",
                                type_name(t),
                                node.input[j],
                                type_name(first),
                                param.name,
                                type_name(t)
                            ),
                            format!(
                                "ONNX's {op} takes its inputs of type {} of one element type: cast one of them (Cast)",
                                param.var
                            ),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        bound.insert(param.var, (t, i));
                    }
                }
                if sig.float_only.contains(&i) && !in_set(FLOATS, t) {
                    return Err(self.unsupported(
                        format!(
                            "{who}: input {i} `{value}` is {}, and kiln computes {op} in float only",
                            type_name(t)
                        ),
                        "kiln's tensors compute in f32: export the model in float, or cast the input to float \
                         (Cast to=1) before the node",
                    ));
                }
            }
        }
        let outputs: Vec<(&'g str, i32)> = node
            .output
            .iter()
            .enumerate()
            .filter(|(_, o)| !o.is_empty())
            .filter_map(|(i, out)| Some((out.as_str(), output_type(node, op, i, &input_type)?)))
            .collect();
        types.extend(outputs);
        Ok(())
    }
}

/// How the importer names node `index` in messages.
fn who_at(graph: &GraphProto, index: usize) -> String {
    graph.node.get(index).map_or_else(|| format!("node #{index}"), |n| who(index, n))
}

/// Whether a dimension is symbolic.
fn has_param(d: &proto::Dimension) -> bool {
    d.dim_param.as_deref().is_some_and(|p| !p.is_empty())
}

fn elem_type(v: &ValueInfoProto) -> Option<i32> {
    v.r#type.as_ref()?.tensor_type.as_ref()?.elem_type.filter(|&t| t != 0)
}

/// What to do about a dimension over kiln's limit.
pub(crate) const SIZE_HELP: &str = "kiln holds at most 1 TiB per tensor: check the dimension (a damaged file, \
     a symbolic size given a wrong value, an overflowing export)";

/// Why a tensor of `dims` of `element` bytes each is over kiln's limit of bytes per tensor
/// (`ir::MAX_TENSOR_BYTES`), a dimension or their product; `None` within it.
pub(crate) fn over_limit(what: &str, dims: &[usize], element: usize) -> Option<String> {
    let limit = MAX_TENSOR_BYTES / element.max(1);
    if let Some((axis, d)) = dims.iter().enumerate().find(|&(_, &d)| d > limit) {
        return Some(format!(
            "dimension {axis} of {what} is {d}, larger than kiln's limit {limit} (1 TiB per tensor of \
             {element}-byte elements)"
        ));
    }
    let total = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    match total {
        Some(n) if n <= limit => None,
        _ if dims.contains(&0) => None,
        _ => Some(format!(
            "{what} of shape {dims:?} holds more elements than kiln's limit {limit} (1 TiB per tensor of \
             {element}-byte elements)"
        )),
    }
}

/// Bytes per element of a `TensorProto.DataType`, where whole.
pub(crate) fn element_bytes(data_type: i32) -> Option<usize> {
    Some(match data_type {
        2 | 3 | 9 | 17..=20 => 1,
        4 | 5 | 10 | 16 => 2,
        1 | 6 | 12 => 4,
        7 | 11 | 13 | 14 => 8,
        15 => 16,
        _ => return None,
    })
}

/// `tensor(float)`, as onnx names types.
pub(crate) fn type_name(data_type: i32) -> String {
    let name = match data_type {
        0 => "undefined",
        1 => "float",
        2 => "uint8",
        3 => "int8",
        4 => "uint16",
        5 => "int16",
        6 => "int32",
        7 => "int64",
        8 => "string",
        9 => "bool",
        10 => "float16",
        11 => "double",
        12 => "uint32",
        13 => "uint64",
        14 => "complex64",
        15 => "complex128",
        16 => "bfloat16",
        17 => "float8e4m3fn",
        18 => "float8e4m3fnuz",
        19 => "float8e5m2",
        20 => "float8e5m2fnuz",
        21 => "uint4",
        22 => "int4",
        23 => "float4e2m1",
        other => return format!("tensor(data type {other})"),
    };
    format!("tensor({name})")
}

// `AttributeProto.AttributeType` values.
const A_FLOAT: i32 = 1;
const A_INT: i32 = 2;
const A_STRING: i32 = 3;
const A_TENSOR: i32 = 4;
const A_FLOATS: i32 = 6;
const A_INTS: i32 = 7;
const A_STRINGS: i32 = 8;
const A_SPARSE_TENSOR: i32 = 11;

fn attr_type_name(t: i32) -> String {
    let name = match t {
        0 => "UNDEFINED",
        1 => "FLOAT",
        2 => "INT",
        3 => "STRING",
        4 => "TENSOR",
        5 => "GRAPH",
        6 => "FLOATS",
        7 => "INTS",
        8 => "STRINGS",
        9 => "TENSORS",
        10 => "GRAPHS",
        11 => "SPARSE_TENSOR",
        12 => "SPARSE_TENSORS",
        13 => "TYPE_PROTO",
        14 => "TYPE_PROTOS",
        other => return format!("attribute type {other}"),
    };
    name.to_string()
}

/// The attribute types of the value fields an attribute sets (of those kiln's schema reads).
fn value_fields(a: &AttributeProto) -> Vec<i32> {
    let mut out = Vec::new();
    if a.f.is_some() {
        out.push(A_FLOAT);
    }
    if a.i.is_some() {
        out.push(A_INT);
    }
    if a.s.is_some() {
        out.push(A_STRING);
    }
    if a.t.is_some() {
        out.push(A_TENSOR);
    }
    if !a.floats.is_empty() {
        out.push(A_FLOATS);
    }
    if !a.ints.is_empty() {
        out.push(A_INTS);
    }
    out
}

/// The attributes an operator declares at `opset` that kiln reads (or that neighbour them): name,
/// type, whether required. Attributes not listed are not checked.
fn attribute_schema(op: &str, opset: i64) -> Vec<(&'static str, i32, bool)> {
    let window = [
        ("auto_pad", A_STRING, false),
        ("dilations", A_INTS, false),
        ("pads", A_INTS, false),
        ("strides", A_INTS, false),
    ];
    let mut v: Vec<(&'static str, i32, bool)> = Vec::new();
    let reduce_axes_attribute = match op {
        "ReduceSum" => opset < 13,
        _ => opset < 18,
    };
    match op {
        "Conv" | "ConvTranspose" => {
            v.extend(window);
            v.extend([("group", A_INT, false), ("kernel_shape", A_INTS, false)]);
            if op == "ConvTranspose" {
                v.extend([("output_padding", A_INTS, false), ("output_shape", A_INTS, false)]);
            }
        }
        "MaxPool" | "AveragePool" | "LpPool" => {
            v.extend(window);
            v.extend([("kernel_shape", A_INTS, true), ("ceil_mode", A_INT, false)]);
            match op {
                "MaxPool" => v.push(("storage_order", A_INT, false)),
                "AveragePool" => v.push(("count_include_pad", A_INT, false)),
                _ => v.push(("p", A_INT, false)),
            }
        }
        "GlobalLpPool" => v.push(("p", A_INT, false)),
        "LRN" => v.extend([
            ("alpha", A_FLOAT, false),
            ("beta", A_FLOAT, false),
            ("bias", A_FLOAT, false),
            ("size", A_INT, true),
        ]),
        "Gemm" => v.extend([
            ("alpha", A_FLOAT, false),
            ("beta", A_FLOAT, false),
            ("transA", A_INT, false),
            ("transB", A_INT, false),
        ]),
        "Softmax" | "LogSoftmax" | "Hardmax" | "Flatten" | "Gather" | "GatherElements" => {
            v.push(("axis", A_INT, false))
        }
        "Concat" => v.push(("axis", A_INT, true)),
        "Split" => {
            v.push(("axis", A_INT, false));
            if opset < 13 {
                v.push(("split", A_INTS, false));
            }
            if opset >= 18 {
                v.push(("num_outputs", A_INT, false));
            }
        }
        "Squeeze" | "Unsqueeze" if opset < 13 => v.push(("axes", A_INTS, op == "Unsqueeze")),
        "Transpose" => v.push(("perm", A_INTS, false)),
        "Cast" => v.extend([("to", A_INT, true), ("saturate", A_INT, false)]),
        "CastLike" => v.push(("saturate", A_INT, false)),
        "Reshape" => v.push(("allowzero", A_INT, false)),
        "Shape" => v.extend([("start", A_INT, false), ("end", A_INT, false)]),
        "ConstantOfShape" => v.push(("value", A_TENSOR, false)),
        "Constant" => v.extend([
            ("value", A_TENSOR, false),
            ("sparse_value", A_SPARSE_TENSOR, false),
            ("value_float", A_FLOAT, false),
            ("value_floats", A_FLOATS, false),
            ("value_int", A_INT, false),
            ("value_ints", A_INTS, false),
            ("value_string", A_STRING, false),
            ("value_strings", A_STRINGS, false),
        ]),
        "Dropout" if opset < 12 => v.push(("ratio", A_FLOAT, false)),
        "Dropout" => v.push(("seed", A_INT, false)),
        "Elu" | "LeakyRelu" | "ThresholdedRelu" | "Celu" => v.push(("alpha", A_FLOAT, false)),
        "Selu" => v.extend([("alpha", A_FLOAT, false), ("gamma", A_FLOAT, false)]),
        "HardSigmoid" => v.extend([("alpha", A_FLOAT, false), ("beta", A_FLOAT, false)]),
        "Shrink" => v.extend([("bias", A_FLOAT, false), ("lambd", A_FLOAT, false)]),
        "Gelu" => v.push(("approximate", A_STRING, false)),
        "Clip" if opset < 11 => v.extend([("min", A_FLOAT, false), ("max", A_FLOAT, false)]),
        "BatchNormalization" => {
            v.extend([("epsilon", A_FLOAT, false), ("momentum", A_FLOAT, false)]);
            if opset < 9 {
                v.push(("spatial", A_INT, false));
            }
            if opset >= 14 {
                v.push(("training_mode", A_INT, false));
            }
        }
        "InstanceNormalization" => v.push(("epsilon", A_FLOAT, false)),
        "LayerNormalization" => {
            v.extend([("axis", A_INT, false), ("epsilon", A_FLOAT, false), ("stash_type", A_INT, false)])
        }
        "GroupNormalization" => {
            v.extend([("epsilon", A_FLOAT, false), ("num_groups", A_INT, true), ("stash_type", A_INT, false)])
        }
        "MeanVarianceNormalization" => v.push(("axes", A_INTS, false)),
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
        | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => {
            v.push(("keepdims", A_INT, false));
            if reduce_axes_attribute {
                v.push(("axes", A_INTS, false));
            } else {
                v.push(("noop_with_empty_axes", A_INT, false));
            }
        }
        "Pad" if opset < 11 => {
            v.extend([("mode", A_STRING, false), ("pads", A_INTS, true), ("value", A_FLOAT, false)])
        }
        "Pad" => v.push(("mode", A_STRING, false)),
        "Slice" if opset < 10 => {
            v.extend([("starts", A_INTS, true), ("ends", A_INTS, true), ("axes", A_INTS, false)])
        }
        "DepthToSpace" => v.extend([("blocksize", A_INT, true), ("mode", A_STRING, false)]),
        "SpaceToDepth" => v.push(("blocksize", A_INT, true)),
        "Trilu" => v.push(("upper", A_INT, false)),
        "EyeLike" => v.extend([("dtype", A_INT, false), ("k", A_INT, false)]),
        "Mod" => v.push(("fmod", A_INT, false)),
        "RandomUniformLike" => v.extend([
            ("dtype", A_INT, false),
            ("high", A_FLOAT, false),
            ("low", A_FLOAT, false),
            ("seed", A_FLOAT, false),
        ]),
        "NegativeLogLikelihoodLoss" | "SoftmaxCrossEntropyLoss" => {
            v.extend([("ignore_index", A_INT, false), ("reduction", A_STRING, false)])
        }
        _ => {}
    }
    v
}

// Sets of element types, as bit masks over `TensorProto.DataType`.
const fn bits(types: &[i32]) -> u64 {
    let mut m = 0u64;
    let mut i = 0;
    while i < types.len() {
        m |= 1 << types[i];
        i += 1;
    }
    m
}

/// No constraint checked.
const ANY: u64 = 0;
/// float16, float, double, bfloat16.
const FLOATS: u64 = bits(&[1, 10, 11, 16]);
/// The integer types.
const INTEGERS: u64 = bits(&[2, 3, 4, 5, 6, 7, 12, 13]);
const NUMERIC: u64 = FLOATS | INTEGERS;
const BOOLEAN: u64 = bits(&[9]);
const INDICES: u64 = bits(&[6, 7]);
const INT64: u64 = bits(&[7]);
const SIGNED: u64 = bits(&[3, 5, 6, 7]);
const PRODUCT: u64 = FLOATS | bits(&[6, 7, 12, 13]);
const RANGE: u64 = bits(&[1, 11, 5, 6, 7]);
const COMPARABLE: u64 = NUMERIC | BOOLEAN | bits(&[8]);

fn in_set(set: u64, t: i32) -> bool {
    (0..64).contains(&t) && set & (1 << t) != 0
}

fn set_names(set: u64) -> String {
    let names: Vec<String> = (0..64).filter(|&t| in_set(set, t)).map(type_name).collect();
    names.join(", ")
}

/// An input of an operator: its name in the schema, its type variable and the types allowed.
struct Param {
    name: &'static str,
    var: &'static str,
    types: u64,
}

const fn p(name: &'static str, var: &'static str, types: u64) -> Param {
    Param { name, var, types }
}

/// An operator's inputs' type constraints (the last repeating where `variadic`), and the inputs
/// kiln computes only in float although ONNX allows integers there.
struct Signature {
    params: Vec<Param>,
    variadic: bool,
    float_only: &'static [usize],
}

fn signature(op: &str, opset: i64) -> Option<Signature> {
    let fixed =
        |params: Vec<Param>, float_only: &'static [usize]| Signature { params, variadic: false, float_only };
    Some(match op {
        "Add" | "Sub" | "Mul" | "Div" | "Mod" => fixed(vec![p("A", "T", NUMERIC), p("B", "T", NUMERIC)], &[]),
        "Pow" => fixed(vec![p("X", "T", NUMERIC), p("Y", "T1", NUMERIC)], &[0]),
        "Equal" => fixed(vec![p("A", "T", COMPARABLE), p("B", "T", COMPARABLE)], &[]),
        "Less" | "Greater" | "LessOrEqual" | "GreaterOrEqual" => {
            fixed(vec![p("A", "T", NUMERIC), p("B", "T", NUMERIC)], &[])
        }
        "And" | "Or" | "Xor" => fixed(vec![p("A", "T", BOOLEAN), p("B", "T", BOOLEAN)], &[]),
        "Not" => fixed(vec![p("X", "T", BOOLEAN)], &[]),
        "Where" => fixed(vec![p("condition", "B", BOOLEAN), p("X", "T", ANY), p("Y", "T", ANY)], &[]),
        "MatMul" => fixed(vec![p("A", "T", PRODUCT), p("B", "T", PRODUCT)], &[0, 1]),
        "Gemm" => fixed(vec![p("A", "T", PRODUCT), p("B", "T", PRODUCT), p("C", "T", PRODUCT)], &[0, 1, 2]),
        "Conv" | "ConvTranspose" => {
            fixed(vec![p("X", "T", FLOATS), p("W", "T", FLOATS), p("B", "T", FLOATS)], &[])
        }
        "MaxPool" => fixed(vec![p("X", "T", FLOATS | bits(&[2, 3]))], &[0]),
        "AveragePool"
        | "LpPool"
        | "GlobalAveragePool"
        | "GlobalMaxPool"
        | "GlobalLpPool"
        | "LRN"
        | "MeanVarianceNormalization" => fixed(vec![p("X", "T", FLOATS)], &[]),
        "BatchNormalization" => fixed(
            vec![
                p("X", "T", FLOATS),
                p("scale", "T1", FLOATS),
                p("B", "T1", FLOATS),
                p("input_mean", "T2", FLOATS),
                p("input_var", "T2", FLOATS),
            ],
            &[],
        ),
        "InstanceNormalization" => {
            fixed(vec![p("input", "T", FLOATS), p("scale", "T", FLOATS), p("B", "T", FLOATS)], &[])
        }
        "LayerNormalization" => {
            fixed(vec![p("X", "T", FLOATS), p("Scale", "T", FLOATS), p("B", "T", FLOATS)], &[])
        }
        "GroupNormalization" => {
            fixed(vec![p("X", "T", FLOATS), p("scale", "T", FLOATS), p("bias", "T", FLOATS)], &[])
        }
        "Sigmoid" | "Tanh" | "Exp" | "Log" | "Sqrt" | "Reciprocal" | "Softplus" | "Softsign" | "Elu"
        | "Selu" | "Celu" | "HardSigmoid" | "HardSwish" | "Mish" | "Gelu" | "ThresholdedRelu"
        | "LeakyRelu" => fixed(vec![p("X", "T", FLOATS)], &[]),
        "Softmax" | "LogSoftmax" | "Hardmax" => fixed(vec![p("input", "T", FLOATS)], &[]),
        "Relu" => fixed(vec![p("X", "T", FLOATS | SIGNED)], &[0]),
        "PRelu" => fixed(vec![p("X", "T", PRODUCT), p("slope", "T", PRODUCT)], &[0, 1]),
        "Abs" | "Sign" => fixed(vec![p("X", "T", NUMERIC)], &[0]),
        "Neg" => fixed(vec![p("X", "T", FLOATS | SIGNED)], &[]),
        "Erf" | "Shrink" => fixed(vec![p("input", "T", NUMERIC)], &[0]),
        "Clip" => fixed(vec![p("input", "T", NUMERIC), p("min", "T", NUMERIC), p("max", "T", NUMERIC)], &[]),
        "Max" | "Min" => {
            Signature { params: vec![p("data_0", "T", NUMERIC)], variadic: true, float_only: &[] }
        }
        "Sum" | "Mean" => {
            Signature { params: vec![p("data_0", "T", FLOATS)], variadic: true, float_only: &[] }
        }
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
        | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => {
            fixed(vec![p("data", "T", NUMERIC | BOOLEAN)], &[0])
        }
        "Gather" | "GatherElements" => fixed(vec![p("data", "T", ANY), p("indices", "Tind", INDICES)], &[]),
        "Reshape" => fixed(vec![p("data", "T", ANY), p("shape", "tensor(int64)", INT64)], &[]),
        "Expand" => fixed(vec![p("input", "T", ANY), p("shape", "tensor(int64)", INT64)], &[]),
        "Tile" => fixed(vec![p("input", "T", ANY), p("repeats", "T1", INT64)], &[]),
        "ConstantOfShape" => fixed(vec![p("input", "T1", INT64)], &[]),
        "Range" => fixed(vec![p("start", "T", RANGE), p("limit", "T", RANGE), p("delta", "T", RANGE)], &[]),
        "Slice" if opset >= 10 => fixed(
            vec![
                p("data", "T", ANY),
                p("starts", "Tind", INDICES),
                p("ends", "Tind", INDICES),
                p("axes", "Tind", INDICES),
                p("steps", "Tind", INDICES),
            ],
            &[],
        ),
        "Squeeze" | "Unsqueeze" if opset >= 13 => {
            fixed(vec![p("data", "T", ANY), p("axes", "tensor(int64)", INT64)], &[])
        }
        "Split" if opset >= 13 => fixed(vec![p("input", "T", ANY), p("split", "tensor(int64)", INT64)], &[]),
        "Pad" if opset >= 11 => fixed(
            vec![
                p("data", "T", ANY),
                p("pads", "tensor(int64)", INT64),
                p("constant_value", "T", ANY),
                p("axes", "Tind", INDICES),
            ],
            &[],
        ),
        "Trilu" => fixed(vec![p("input", "T", ANY), p("k", "tensor(int64)", INT64)], &[]),
        "RandomUniformLike" => fixed(vec![p("input", "T1", ANY)], &[]),
        "Dropout" if opset >= 12 => fixed(
            vec![p("data", "T", FLOATS), p("ratio", "T1", FLOATS), p("training_mode", "T2", BOOLEAN)],
            &[],
        ),
        "Dropout" => fixed(vec![p("data", "T", FLOATS)], &[]),
        "Concat" => Signature { params: vec![p("inputs", "T", ANY)], variadic: true, float_only: &[] },
        "NegativeLogLikelihoodLoss" => {
            fixed(vec![p("input", "T", FLOATS), p("target", "Tind", INDICES), p("weight", "T", FLOATS)], &[])
        }
        "SoftmaxCrossEntropyLoss" => fixed(
            vec![p("scores", "T", FLOATS), p("labels", "Tind", INDICES), p("weights", "T", FLOATS)],
            &[],
        ),
        _ => return None,
    })
}

/// The element type of output `i` of `node`, where it follows from the node and its inputs'
/// types.
fn output_type(node: &NodeProto, op: &str, i: usize, input: &dyn Fn(usize) -> Option<i32>) -> Option<i32> {
    let attr = |name: &str| node.attribute.iter().find(|a| a.name.as_deref() == Some(name));
    match (op, i) {
        (
            "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" | "And" | "Or" | "Xor" | "Not",
            0,
        ) => Some(proto::BOOL),
        ("Shape" | "Size", 0) => Some(proto::INT64),
        ("Cast", 0) => attr("to").and_then(|a| a.i).and_then(|t| i32::try_from(t).ok()).filter(|&t| t > 0),
        ("CastLike", 0) => input(1),
        ("Constant", 0) => {
            let a = node.attribute.first()?;
            match a.name.as_deref()? {
                "value" => a.t.as_ref()?.data_type.filter(|&t| t != 0),
                "value_float" | "value_floats" => Some(proto::FLOAT),
                "value_int" | "value_ints" => Some(proto::INT64),
                "value_string" | "value_strings" => Some(8),
                _ => None,
            }
        }
        ("ConstantOfShape", 0) => match attr("value").and_then(|a| a.t.as_ref()) {
            Some(t) => t.data_type.filter(|&t| t != 0),
            None => Some(proto::FLOAT),
        },
        ("EyeLike" | "RandomUniformLike", 0) => match attr("dtype").and_then(|a| a.i) {
            Some(t) => i32::try_from(t).ok().filter(|&t| t > 0),
            None => input(0),
        },
        ("Where", 0) => input(1).or_else(|| input(2)),
        ("Dropout", 1) => Some(proto::BOOL),
        ("MaxPool", 1) => Some(proto::INT64),
        ("Split", _) => input(0),
        ("SoftmaxCrossEntropyLoss", 1) => input(0),
        (_, 0) if super::SUPPORTED.contains(&op) => input(0),
        _ => None,
    }
}
