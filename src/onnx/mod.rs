//! ONNX in: a model file becomes a kiln graph, so that the models people already have get
//! planned, checked against device limits and compared with eager execution like traced ones.
//!
//! The file is read with `prost` over the schema's messages (`proto`); the graph is then traced
//! node by node with kiln's DSL, so every op gets the same shape checks, error messages and
//! autodiff as a hand-written model. Graph inputs that are not initializers become inputs (a
//! symbolic dimension takes its size from `dims`, by name); float initializers become trainable
//! parameters (their values are returned beside the graph, for `Backend::write_variable`).
//!
//! Integer initializers, `Constant`s and whatever is computed from them and from static shapes
//! (`Shape`, `Size`, `ConstantOfShape`, `Range`, integer `Gather`/`Slice`/`Concat`/arithmetic,
//! the subgraphs exporters write around a `Reshape`) are folded at import (`Ints`); an integer
//! graph input becomes an i64 (or i32) input of kiln's, readable as `Gather` indices (an
//! embedding's ids), through reshapes and `Cast` (kiln stores integers, it computes in f32).
//! Comparisons and logical ops give 0.0/1.0 tensors, which `Where` selects with.
//!
//! The ops are mapped by family: `elementwise` (arithmetic, activations, comparisons, logic),
//! `layout` (reshapes, slicing, gathering, padding, folded integer tensors), `reduce`
//! (reductions, softmax), `conv` (convolution, pooling, LRN) and `norm` (batch, layer,
//! instance and group normalisation). ONNX's tensors are NCHW and kiln's convolutions and pooling
//! NHWC: a convolution's output is made channels-last and kept so as its twin, which the
//! elementwise ops, batch normalisation, global pooling and channel concatenations after it
//! compute on where every operand has one or broadcasts per channel (`nhwc`), so that the next
//! convolution reads it with no permuted copy; the NCHW value is a permute of the twin that
//! nothing reads where nothing but such ops does (dead code, removed). The OIHW filter is
//! permuted to HWIO. Where kiln has no op of its own, an ONNX op is composed from the DSL's
//! (a strided slice is a gather by iota-made ids, a grouped convolution one convolution with a
//! block-diagonal filter, a padded pooling a masked one), so each gets the DSL's gradients.
//! Anything else — an op, attribute, mode or dtype outside what is mapped — is an error naming
//! the op, the node and what is supported, never a different computation.
//!
//! Before anything is traced, the model is checked as onnx's checker would check it (`check`:
//! IR version and opset, single static assignment, topological order, initializers, attribute
//! types and required attributes, element types against the operators' constraints, sizes
//! against kiln's limit), and the data of tensors kept in external files is mapped from the
//! model's directory, never outside it (`external`; for a model read from its file:
//! `OnnxModel::open`, `import_file`). Both happen once, in [`OnnxModel`], which everything that
//! reads a model takes (bytes are read into one on each call). A bool graph input (a mask) is a
//! bool input of kiln's, read as the 0.0/1.0 tensor comparisons give. [`Imported::load`]
//! compiles, loads and writes the file's weights in one call: a plan loaded without them would
//! compute with zeros.
//!
//! `tests/onnx_conformance.rs` runs ONNX's own backend node tests (the `onnx` package's data)
//! against this importer; `tests/onnx.rs` holds the cases that data lacks.
//!
//! A model of one input and one output is also a layer (`OnnxLayer`): each trace replays its
//! nodes on the layer's input, so it goes through autodiff and trains like a traced model. A
//! model of several inputs (ids, masks, features) is a layer whose one input packs them, rows
//! kept together (`OnnxModel::into_packed_layer`, `PackedInput`), so that the `Trainer`, built
//! around one input and one target, trains it unchanged.

mod check;
mod conv;
mod elementwise;
mod external;
mod fold_norm;
mod layout;
mod nhwc;
mod norm;
pub mod npz;
pub mod proto;
mod reduce;
pub mod runner;
pub mod tensors;
pub mod train;

use crate::error::{Error, Result};
use kiln_compiler::CompileError;
use kiln_compiler::CompileOptions;
use kiln_compiler::ir::{DType, DeviceId, Graph, Init, Shape};
use kiln_compiler::passes::{DeadCode, Pass};
use kiln_compiler::trace::{Tensor, Tracer};
use kiln_runtime::{Backend, HostTensor, ProgramId};
use prost::Message;
use proto::{AttributeProto, ModelProto, NodeProto, TensorProto};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

pub use check::IR_VERSIONS;

/// The `dims` entry that re-batches a model exported with a fixed batch of 1 (`--batch N` on a
/// batch-1 export): every input whose static first axis is 1 takes this size there (another
/// static first axis is no batch to change: a [3, 224, 224] image), and a `Reshape` whose
/// target starts with the exported batch, applied to a tensor that starts with the new one,
/// starts with the new one (the exporter wrote the batch into it: `[1, 2048]` before a
/// classifier). Other shape arguments that carry the batch (`Expand`, `Tile`,
/// `ConstantOfShape` targets) are not rewritten: such a model needs a symbolic batch.
pub const STATIC_BATCH: &str = "<batch>";

/// The default domain's opsets this importer reads.
pub const OPSETS: std::ops::RangeInclusive<i64> = 7..=22;

/// The ops the importer maps, for error messages and the README.
pub const SUPPORTED: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "AveragePool",
    "BatchNormalization",
    "Cast",
    "CastLike",
    "Celu",
    "Clip",
    "Concat",
    "Constant",
    "ConstantOfShape",
    "Conv",
    "ConvTranspose",
    "DepthToSpace",
    "Div",
    "Dropout",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Expand",
    "EyeLike",
    "Flatten",
    "Gather",
    "GatherElements",
    "Gelu",
    "Gemm",
    "GlobalAveragePool",
    "GlobalLpPool",
    "GlobalMaxPool",
    "Greater",
    "GreaterOrEqual",
    "GroupNormalization",
    "HardSigmoid",
    "HardSwish",
    "Hardmax",
    "Identity",
    "InstanceNormalization",
    "LRN",
    "LayerNormalization",
    "LeakyRelu",
    "Less",
    "LessOrEqual",
    "Log",
    "LogSoftmax",
    "LpPool",
    "MatMul",
    "Max",
    "MaxPool",
    "Mean",
    "MeanVarianceNormalization",
    "Min",
    "Mod",
    "Mish",
    "Mul",
    "Neg",
    "NegativeLogLikelihoodLoss",
    "Not",
    "Or",
    "PRelu",
    "Pad",
    "Pow",
    "RandomUniformLike",
    "Range",
    "Reciprocal",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "Reshape",
    "Selu",
    "Shape",
    "Shrink",
    "Sigmoid",
    "Sign",
    "Size",
    "Slice",
    "Softmax",
    "SoftmaxCrossEntropyLoss",
    "Softplus",
    "Softsign",
    "SpaceToDepth",
    "Split",
    "Sqrt",
    "Squeeze",
    "Sub",
    "Sum",
    "Tanh",
    "ThresholdedRelu",
    "Tile",
    "Transpose",
    "Trilu",
    "Unsqueeze",
    "Where",
    "Xor",
];

/// An imported model: its forward graph (inputs and outputs named as in the file), the values
/// of its parameters by variable key, and its inputs' shapes. Run it with [`Imported::load`],
/// which writes the weights (a plan of `graph` loaded by hand computes with zeros until
/// [`Imported::load_into`] writes them).
pub struct Imported {
    /// The forward graph, traced from the file's nodes, with dead code removed.
    pub graph: Graph,
    /// The stored parameter values (initializers and non-uniform float `Constant`s) by variable
    /// key, each a variable of `graph`; a plain convolution's filter is stored HWIO, and a
    /// convolution whose batch norm was folded into it (`fold_norm`) has a new filter and bias
    /// keyed `<batch norm output>::weight` and `::bias` in place of the file's six tensors.
    pub weights: Vec<(String, HostTensor)>,
    /// The fed inputs (graph inputs that no initializer names), in the file's order, with their
    /// shapes after sizing the symbolic dimensions.
    pub inputs: Vec<(String, Shape)>,
    /// The default ONNX domain's opset version the model imports, within [`OPSETS`].
    pub opset: i64,
}

fn invalid(what: impl Into<String>, help: impl Into<String>) -> Error {
    Error::from(CompileError::invalid(what, help))
}

/// A mistake in what the caller feeds or names at run time (a data file, an input).
pub(crate) fn bad_input(what: impl Into<String>, help: impl Into<String>) -> Error {
    Error::Runtime(kiln_runtime::RuntimeError::invalid(what, help))
}

fn unsupported(what: impl Into<String>, help: impl Into<String>) -> Error {
    Error::from(CompileError::unsupported(what, help))
}

/// Reads an ONNX file; `dims` sizes its symbolic dimensions (`("batch", 32)`). Tensors whose
/// data the file keeps outside (external data, every model over 2 GB) are read from the file's
/// directory (`external`); errors of the checker name the file. Short for
/// `OnnxModel::open(path)?.import(dims)`.
pub fn import_file(path: impl AsRef<Path>, dims: &[(String, usize)]) -> Result<Imported> {
    OnnxModel::open(path)?.import(dims)
}

/// Imports an ONNX model from its bytes; `dims` sizes its symbolic dimensions. A model whose
/// tensors keep their data in external files is refused: import it with [`import_file`].
pub fn import(bytes: &[u8], dims: &[(String, usize)]) -> Result<Imported> {
    OnnxModel::from_bytes(bytes)?.import(dims)
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        invalid(format!("cannot read the ONNX file {}: {e}", path.display()), "pass the path of a .onnx file")
    })
}

/// An ONNX model read once: decoded, checked as onnx's checker does (`check`), and with the
/// data of the tensors it keeps in external files mapped from its directory (`external`).
/// Whatever reads a model takes one ([`OnnxModel::import`], [`OnnxModel::layer`], the functions
/// of [`train`]), so that a file with external data is read from its path once, and a model
/// held in memory from its bytes.
#[derive(Clone)]
pub struct OnnxModel {
    model: ModelProto,
    opset: i64,
    file: Option<PathBuf>,
}

impl OnnxModel {
    /// The model of the file at `path`; its external data is read from the file's directory,
    /// and the checker's errors name the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        Self::from_bytes_at(&read(path)?, path)
    }

    /// The model of `bytes`, whose tensors must hold their own data: one that keeps it in
    /// external files is refused (open it with [`OnnxModel::open`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let (model, opset) = decode(bytes, None)?;
        Ok(OnnxModel { model, opset, file: None })
    }

    /// The model of `bytes`, read from the file at `path`: its external data is read from that
    /// file's directory, and the checker's errors name the file.
    pub fn from_bytes_at(bytes: &[u8], path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (model, opset) = decode(bytes, Some(path))?;
        Ok(OnnxModel { model, opset, file: Some(path.to_path_buf()) })
    }

    /// The file the model was read from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// The default ONNX domain's opset version the model imports, within [`OPSETS`].
    pub fn opset(&self) -> i64 {
        self.opset
    }

    /// The model's messages, external data included (as `raw_data`).
    pub fn proto(&self) -> &ModelProto {
        &self.model
    }

    /// The model as a graph; `dims` sizes its symbolic dimensions (`("batch", 32)`).
    pub fn import(&self, dims: &[(String, usize)]) -> Result<Imported> {
        import_model(&self.model, self.opset, dims, false)
    }

    /// [`OnnxModel::import`] as a training step traces the model: dropout drops and batch
    /// norms normalise by the batch (a training-mode export imports so), for what a step needs
    /// to know of the model (its inputs' and output's shapes).
    pub(crate) fn import_for_training(&self, dims: &[(String, usize)]) -> Result<Imported> {
        import_model(&self.model, self.opset, dims, true)
    }

    /// The model as a layer ([`OnnxLayer`]): it must have one (non-initializer) input and one
    /// output.
    pub fn layer(&self) -> Result<OnnxLayer> {
        self.clone().into_layer()
    }

    /// [`OnnxModel::layer`], without copying the model's messages.
    pub fn into_layer(self) -> Result<OnnxLayer> {
        OnnxLayer::from_model(self.model, self.opset)
    }

    /// The model as a layer of all its inputs, sized by `sizes` (`("batch", 32)`): a model of
    /// one input is [`OnnxModel::into_layer`]'s layer, whose `x` is that input in its own dtype
    /// (f32 features, i32/i64 ids, a bool mask); a model of several (BERT's `input_ids`,
    /// `attention_mask`, `token_type_ids`) is a layer whose one input `x` packs them
    /// ([`OnnxLayer::packing`], [`OnnxLayer::pack`]). Every input then needs the batch as its
    /// first axis; the other axes are fixed at `sizes`. It must have one output.
    pub fn into_packed_layer(self, sizes: &[(String, usize)]) -> Result<OnnxLayer> {
        let graph = self.model.graph.as_ref().ok_or_else(no_graph)?;
        let fed: Vec<_> =
            graph.input.iter().filter(|i| !graph.initializer.iter().any(|t| t.name == i.name)).collect();
        if fed.len() < 2 {
            return self.into_layer();
        }
        let mut packing = Vec::with_capacity(fed.len());
        let mut batch: Option<(usize, String)> = None;
        for input in fed {
            let name = input.name.clone().unwrap_or_default();
            let (shape, dtype) = input_shape(input, sizes)?;
            let Some((&rows, row)) = shape.dims().split_first() else {
                return Err(unsupported(
                    format!("input `{name}` is a scalar, with no batch axis"),
                    "a model of several inputs trains with the batch as every input's first axis",
                ));
            };
            match &batch {
                Some((b, first)) if *b != rows => {
                    return Err(unsupported(
                        format!("input `{name}` has {rows} rows (its first axis) and input `{first}` {b}"),
                        "a model of several inputs trains with the batch as every input's first axis: \
                         size them alike with --batch / --dim",
                    ));
                }
                Some(_) => {}
                None => batch = Some((rows, name.clone())),
            }
            packing.push(PackedInput { name, row: row.to_vec(), dtype });
        }
        if graph.output.len() != 1 {
            return Err(unsupported(
                format!("the model has {} outputs", graph.output.len()),
                "a model trains as a layer with one output; plan others with `import`",
            ));
        }
        let mut layer = OnnxLayer::build(self.model, self.opset)?;
        layer.packing = Some(packing);
        Ok(layer)
    }

    /// The symbolic names of the model's inputs' first axes (what `--batch N` sizes).
    pub fn batch_dims(&self) -> Vec<String> {
        batch_names(&self.model)
    }
}

/// What reads a model accepts: an [`OnnxModel`] (read once, from a file or from bytes), or the
/// bytes of a model whose tensors hold their own data (`&[u8]`, `&Vec<u8>`), decoded and
/// checked on each call. A model with external data is given as an `OnnxModel::open`.
pub trait ModelSource {
    /// The model, read.
    fn model(&self) -> Result<Cow<'_, OnnxModel>>;
}

impl ModelSource for OnnxModel {
    fn model(&self) -> Result<Cow<'_, OnnxModel>> {
        Ok(Cow::Borrowed(self))
    }
}

impl ModelSource for [u8] {
    fn model(&self) -> Result<Cow<'_, OnnxModel>> {
        OnnxModel::from_bytes(self).map(Cow::Owned)
    }
}

impl ModelSource for Vec<u8> {
    fn model(&self) -> Result<Cow<'_, OnnxModel>> {
        self.as_slice().model()
    }
}

impl<const N: usize> ModelSource for [u8; N] {
    fn model(&self) -> Result<Cow<'_, OnnxModel>> {
        self.as_slice().model()
    }
}

fn import_model(
    model: &ModelProto,
    opset: i64,
    dims: &[(String, usize)],
    training: bool,
) -> Result<Imported> {
    let graph = model.graph.as_ref().ok_or_else(no_graph)?;
    // For inference, batch normalisations fold into the convolutions before them.
    let folded = if training || !fold_norm::enabled() { None } else { fold_norm::fold(graph, opset)? };
    let (graph, origin) = match &folded {
        Some((g, origin)) => (g, Some(origin.as_slice())),
        None => (graph, None),
    };
    let t = Tracer::new(graph.name.clone().unwrap_or_else(|| "onnx".into()));
    t.set_training(training);
    let mut inputs = Vec::new();
    let mut feeds = HashMap::new();
    let mut rebatch = None;
    for input in &graph.input {
        let name = input.name.clone().unwrap_or_default();
        if graph.initializer.iter().any(|i| i.name.as_deref() == Some(name.as_str())) {
            continue;
        }
        let (shape, dtype) = input_shape(input, dims)?;
        if let (true, Some(&to)) = (batch_of_one(input), shape.dims().first()) {
            rebatch = rebatch.or((to != 1).then_some(to));
        }
        let x = t.input_typed(&name, shape.clone(), dtype);
        if let Some(e) = t.error() {
            return Err(invalid(
                format!("graph input `{name}`: {e}"),
                "check the input's declared type and shape",
            ));
        }
        // A bool input (a mask) is read as the 0.0/1.0 tensor comparisons give (`booleans`).
        let value = match (dtype, half_input(input)) {
            (DType::Bool, _) => Value::Tensor(x.cast(DType::F32)),
            (d, _) if d.is_exact() => Value::Ids(x),
            (_, Some(half)) => Value::Tensor(x.cast(half).cast(DType::F32)),
            _ => Value::Tensor(x),
        };
        feeds.insert(name.clone(), value);
        inputs.push((name, shape));
    }
    let (outputs, weights) = trace(&t, graph, opset, feeds, rebatch, None, origin)?;
    for (name, value) in &outputs {
        t.output(name, value);
    }
    // Initializers read only as folded arguments (a Pad's constant, a Dropout's ratio) leave
    // parameters nothing reads: drop them, so that every weight returned is a variable of the graph.
    let mut graph = t.finish()?;
    DeadCode.run(&mut graph)?;
    let weights = weights.into_iter().filter(|(key, _)| graph.variable(key).is_some()).collect();
    Ok(Imported { graph, weights, inputs, opset })
}

impl Imported {
    /// Writes every imported weight into `backend` (`Backend::write_variable`), which must have
    /// loaded a plan of this model's graph: until they are written, the parameters hold zeros
    /// (or their fill), and the model computes something other than the file. [`Imported::load`]
    /// compiles, loads and writes in one call.
    pub fn load_into<B: Backend + ?Sized>(&self, backend: &mut B) -> Result<()> {
        write_weights(&self.weights, backend)
    }

    /// The documented way to run an imported model: compiles its graph with `options`, loads the
    /// plan into `backend` and writes every weight of the file into it, so that the program it
    /// returns computes what the file means (no parameter is left at zeros).
    pub fn load<B: Backend + ?Sized>(self, backend: &mut B, options: &CompileOptions) -> Result<ProgramId> {
        let plan = kiln_compiler::compile(self.graph, options)?;
        let id = backend.load(plan)?;
        write_weights(&self.weights, backend)?;
        Ok(id)
    }
}

fn write_weights<B: Backend + ?Sized>(weights: &[(String, HostTensor)], backend: &mut B) -> Result<()> {
    for (key, value) in weights {
        backend.write_variable(key, value).map_err(|e| {
            invalid(
                format!("cannot write the imported weight `{key}` ({}): {e}", value.shape()),
                "load a plan compiled from this import's graph into the backend first",
            )
        })?;
    }
    Ok(())
}

fn no_graph() -> Error {
    invalid("the model has no graph", "export the model with its graph")
}

/// The model, checked as onnx's checker does (`check`), with its external data read from the
/// directory of `file` (`external`), and the default domain's opset.
fn decode(bytes: &[u8], file: Option<&Path>) -> Result<(ModelProto, i64)> {
    let mut model = ModelProto::decode(bytes).map_err(|e| {
        let at = file.map(|p| format!("{}: ", p.display())).unwrap_or_default();
        invalid(
            format!("{at}the bytes are not an ONNX model: {e}"),
            "pass an ONNX file (a serialised ModelProto)",
        )
    })?;
    let opset = check::model(&model, bytes, file)?;
    external::resolve(&mut model, file)?;
    Ok((model, opset))
}

/// How messages name node `index`: by its name, or by its index where it has none.
pub(crate) fn who(index: usize, node: &NodeProto) -> String {
    let op = node.op_type.as_deref().unwrap_or("");
    match node.name.as_deref().filter(|n| !n.is_empty()) {
        Some(name) => format!("node `{name}` ({op})"),
        None => format!("node #{index} ({op})"),
    }
}

/// Named values: a graph's outputs, or its parameters' values.
type Named<T> = Vec<(String, T)>;

/// Traces `graph`'s nodes into `t` from the given input values: its outputs by name, in the
/// graph's order, and its parameters' values. `origin` gives, for a rewritten graph
/// (`fold_norm`), each node's index in the file, by which messages name unnamed nodes.
fn trace(
    t: &Tracer,
    graph: &proto::GraphProto,
    opset: i64,
    feeds: HashMap<String, Value>,
    rebatch: Option<usize>,
    placement: Option<&[DeviceId]>,
    origin: Option<&[usize]>,
) -> Result<(Named<Tensor>, Named<HostTensor>)> {
    let used = graph
        .node
        .iter()
        .flat_map(|n| &n.input)
        .chain(graph.output.iter().filter_map(|o| o.name.as_ref()))
        .cloned()
        .collect();
    let channels_last = nhwc::enabled();
    let mut importer = Importer {
        t: t.clone(),
        values: feeds,
        floats: HashMap::new(),
        converted: HashMap::new(),
        used,
        // Bool graph inputs (masks) are fed as 0.0/1.0 tensors.
        booleans: graph
            .input
            .iter()
            .filter(|i| {
                i.r#type.as_ref().and_then(|t| t.tensor_type.as_ref()).and_then(|t| t.elem_type)
                    == Some(proto::BOOL)
            })
            .filter_map(|i| i.name.clone())
            .collect(),
        stored: HashSet::new(),
        weights: Vec::new(),
        opset,
        rebatch,
        twins: HashMap::new(),
        worth_twin: if channels_last { nhwc::worth_it(graph) } else { HashSet::new() },
        filters: if channels_last { nhwc::filters(graph) } else { HashSet::new() },
        filter_params: HashMap::new(),
        channels_last,
    };
    let Some(devices) = placement else {
        for init in &graph.initializer {
            importer.initializer(init)?;
        }
        for (index, node) in graph.node.iter().enumerate() {
            importer.node(origin.and_then(|o| o.get(index).copied()).unwrap_or(index), node)?;
        }
        return importer.finish(graph);
    };
    {
        // Placed: each initializer's parameter lives on the device of the first node reading it.
        let first_reader = first_readers(graph);
        let mut pending: HashMap<usize, Vec<&TensorProto>> = HashMap::new();
        for init in &graph.initializer {
            importer.register(init)?;
            match first_reader.get(init.name.as_deref().unwrap_or("")) {
                Some(&index) => pending.entry(index).or_default().push(init),
                None => importer.parameter(init)?,
            }
        }
        for (index, node) in graph.node.iter().enumerate() {
            let device = devices.get(index).copied().unwrap_or_else(|| t.current_device());
            t.on_device(device, || -> Result<()> {
                for init in pending.remove(&index).unwrap_or_default() {
                    importer.parameter(init)?;
                }
                importer.node(index, node)
            })?;
        }
    }
    importer.finish(graph)
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
    /// How `x` carries several graph inputs (`OnnxModel::into_packed_layer`); `None`: `x` is
    /// the graph's one input.
    packing: Option<Vec<PackedInput>>,
}

/// One graph input of a layer of several ([`OnnxModel::into_packed_layer`]). Such a layer's
/// input `x` is f32 `[rows, columns]`: each row holds every input's row flattened, one input
/// after another in the file's order, ids and masks as exact f32 values (ids below 2^24, masks
/// 0 or 1). The layer slices each input back out of `x` and casts ids to their dtype, so the
/// `Trainer` (built around one `x`) feeds, shards and splits the rows of all of them at once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PackedInput {
    /// The graph input's name.
    pub name: String,
    /// Its dimensions after the batch axis.
    pub row: Vec<usize>,
    /// Its element type in the file: f32, i32 or i64 (ids) or bool (a mask).
    pub dtype: DType,
}

impl PackedInput {
    /// How many columns of the packed `x` the input takes: its row's element count.
    pub fn columns(&self) -> usize {
        self.row.iter().product()
    }
}

impl OnnxLayer {
    /// The model of `bytes`, which must have one (non-initializer) input and one output.
    /// A model with external data is refused: open it with [`OnnxLayer::open`].
    pub fn new(bytes: &[u8]) -> Result<Self> {
        OnnxModel::from_bytes(bytes)?.into_layer()
    }

    /// The model of the file at `path` (its external data read from the file's directory), which
    /// must have one (non-initializer) input and one output.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        OnnxModel::open(path)?.into_layer()
    }

    fn from_model(model: ModelProto, opset: i64) -> Result<Self> {
        let graph = model.graph.as_ref().ok_or_else(no_graph)?;
        let inputs =
            graph.input.iter().filter(|i| !graph.initializer.iter().any(|t| t.name == i.name)).count();
        if inputs != 1 || graph.output.len() != 1 {
            return Err(unsupported(
                format!("the model has {inputs} inputs and {} outputs", graph.output.len()),
                "a model trains as a layer with one input and one output; train one of several inputs \
                 with `OnnxModel::into_packed_layer`, plan others with `import`",
            ));
        }
        Self::build(model, opset)
    }

    fn build(model: ModelProto, opset: i64) -> Result<Self> {
        let graph = model.graph.as_ref().ok_or_else(no_graph)?;
        // Float initializers, and the float `Constant` nodes that become parameters holding
        // their values (`Importer::constant`; equal values need none: `Init::Constant`).
        let constants =
            graph.node.iter().filter(|n| n.op_type.as_deref() == Some("Constant")).filter_map(|n| {
                let t = n.attribute.iter().find(|a| a.name.as_deref() == Some("value"))?.t.as_ref()?;
                Some((n.output.first().cloned().unwrap_or_default(), t, false))
            });
        let mut weights = Vec::new();
        // Plain convolutions' filters are parameters stored HWIO, as each trace declares them
        // (`Importer::stored_parameter`).
        let filters = if nhwc::enabled() { nhwc::filters(graph) } else { HashSet::new() };
        for (name, t, from_initializer) in
            graph.initializer.iter().map(|i| (i.name.clone().unwrap_or_default(), i, true)).chain(constants)
        {
            if is_integer(t) {
                continue;
            }
            let (dims, values) = tensor_values(t)?;
            if from_initializer || !uniform(&values) {
                let (dims, values) =
                    match nhwc::hwio(&dims, Some(&values)).filter(|_| filters.contains(&name)) {
                        Some((hwio, Some(permuted))) => (hwio, permuted),
                        _ => (dims, values),
                    };
                weights.push((name, HostTensor::new(Shape::new(dims), values)?));
            }
        }
        Ok(OnnxLayer { model, opset, weights, packing: None })
    }

    /// How the layer's input `x` carries the graph's inputs: `None` for a model of one input
    /// (`x` is that input), else each input's place in the packed `x` ([`PackedInput`]).
    pub fn packing(&self) -> Option<&[PackedInput]> {
        self.packing.as_deref()
    }

    /// The layer's input `x` for a batch of the graph's inputs given by name: for a layer of
    /// one input, that tensor itself; for a packed layer, the f32 `[rows, columns]` tensor
    /// [`PackedInput`] describes. A missing input, a shape other than `[rows, ...row]` (rows
    /// alike for all), an f32 tensor for an id or mask input that is not integral, or an id
    /// of 2^24 or more (not exact in f32) is an error naming the input.
    pub fn pack(&self, inputs: &[(&str, &HostTensor)]) -> Result<HostTensor> {
        let Some(packing) = &self.packing else {
            return match inputs {
                [(_, t)] => Ok((*t).clone()),
                _ => Err(invalid(
                    format!("{} tensors given for a layer of one input", inputs.len()),
                    "give the layer's one input",
                )),
            };
        };
        let mut parts = Vec::with_capacity(packing.len());
        let mut rows: Option<usize> = None;
        for p in packing {
            let Some(&(_, t)) = inputs.iter().find(|(n, _)| *n == p.name) else {
                return Err(invalid(
                    format!("no tensor for the model's input `{}`", p.name),
                    "give a tensor for every input of the model, named as the model names it",
                ));
            };
            let n = *rows.get_or_insert(t.shape().dims().first().copied().unwrap_or(0));
            let mut want = vec![n];
            want.extend(&p.row);
            if t.shape().dims() != want.as_slice() {
                return Err(invalid(
                    format!("input `{}` is {}; the model takes {}", p.name, t.shape(), Shape::new(want)),
                    "give every input of the batch the model's shape at these sizes, with as many rows",
                ));
            }
            if p.dtype.is_exact() {
                const EXACT: f32 = (1u32 << 24) as f32;
                let bad = match t.ints() {
                    Some(ints) => ints.iter().find(|v| v.unsigned_abs() >= 1 << 24).map(|&v| v as f32),
                    None => t.data().iter().find(|v| v.fract() != 0.0 || v.abs() >= EXACT).copied(),
                };
                if let Some(v) = bad {
                    return Err(invalid(
                        format!("input `{}` ({}) holds {v}, not an integer below 2^24", p.name, p.dtype),
                        "give ids and masks as integers (ids below 2^24, masks 0 or 1)",
                    ));
                }
            }
            parts.push((t.data(), p.columns()));
        }
        let rows = rows.unwrap_or(0);
        let columns: usize = parts.iter().map(|(_, c)| c).sum();
        let mut data = Vec::with_capacity(rows.saturating_mul(columns));
        for r in 0..rows {
            for (values, c) in &parts {
                data.extend_from_slice(&values[r * c..(r + 1) * c]);
            }
        }
        Ok(HostTensor::new(Shape::new([rows, columns]), data)?)
    }

    /// The indices of the graph's computing nodes (every node but the `Constant`s and
    /// `ConstantOfShape`s that make stored tensors), in the file's topological order: the units
    /// `placed` ranges cover. A stored tensor goes where its first reader goes.
    fn units(&self) -> Vec<usize> {
        let Some(g) = self.model.graph.as_ref() else { return Vec::new() };
        (0..g.node.len()).filter(|&i| !makes_stored(&g.node[i])).collect()
    }

    /// How many units (computing nodes) `placed` ranges cover.
    pub fn nodes(&self) -> usize {
        self.units().len()
    }

    /// How units `range` are named in reports: the first and last node's name (or op).
    pub fn describe_nodes(&self, range: Range<usize>) -> Vec<String> {
        let (Some(g), units) = (self.model.graph.as_ref(), self.units()) else { return Vec::new() };
        let name = |u: usize| {
            units.get(u).and_then(|&i| g.node.get(i)).map_or_else(String::new, |n| {
                let op = n.op_type.clone().unwrap_or_default();
                match n.name.clone().filter(|s| !s.is_empty()) {
                    Some(name) => format!("{name} ({op})"),
                    None => op,
                }
            })
        };
        match range.len() {
            0 => Vec::new(),
            1 => vec![name(range.start)],
            k => vec![format!("{} .. {}, {k} nodes", name(range.start), name(range.end - 1))],
        }
    }

    /// Each node's device for unit ranges `placement`: a computing node its range's, a node
    /// making a stored tensor its first reader's (so weights live with the ops that read them).
    fn node_devices(&self, placement: &[(DeviceId, Range<usize>)], default: DeviceId) -> Vec<DeviceId> {
        let Some(g) = self.model.graph.as_ref() else { return Vec::new() };
        let units = self.units();
        let mut devices = vec![default; g.node.len()];
        for (d, r) in placement {
            for &i in units.get(r.clone()).unwrap_or(&[]) {
                devices[i] = *d;
            }
        }
        let first_reader = first_readers(g);
        // Readers come later in the file's order: from the back, a reader's device is final.
        for i in (0..g.node.len()).rev().filter(|&i| makes_stored(&g.node[i])) {
            let reader = g.node[i].output.first().and_then(|o| first_reader.get(o.as_str()));
            if let Some(&j) = reader.filter(|&&j| j > i) {
                devices[i] = devices[j];
            }
        }
        devices
    }

    /// The layer with its nodes `ranges` (contiguous, in order, covering every node) on the
    /// given devices: each initializer's parameter on the device of its first reader, the copies
    /// between devices inserted by the compiler (`Tracer::on_device`), as `Placed` does for a
    /// `Sequential`. What `placement::split_units` searches over (`onnx::train::fit`).
    pub fn placed<'a>(&'a self, ranges: &'a [(DeviceId, Range<usize>)]) -> PlacedOnnx<'a> {
        PlacedOnnx { layer: self, ranges }
    }

    fn forward_placed(&self, x: &Tensor, placement: &[(DeviceId, Range<usize>)]) -> Tensor {
        let t = x.tracer();
        if x.id().is_none() {
            return x.clone(); // poisoned by an earlier layer, whose error the trace reports
        }
        let Some(graph) = self.model.graph.as_ref() else {
            return t.report("onnx", "the model has no graph", &[x], "");
        };
        let fed: Vec<_> =
            graph.input.iter().filter(|i| !graph.initializer.iter().any(|t| t.name == i.name)).collect();
        // A batch-1 export applied to a batch of another size is re-batched (`STATIC_BATCH`).
        let rebatch = match (fed.iter().any(|i| batch_of_one(i)), x.dims().first()) {
            (true, Some(&to)) if to != 1 => Some(to),
            _ => None,
        };
        // An input as the importer reads it: a bool mask as its 0.0/1.0 tensor, ids as ids.
        let value = |t: Tensor, dtype: DType| match dtype {
            DType::Bool => Value::Tensor(t.cast(DType::F32)),
            d if d.is_exact() => Value::Ids(t.cast(d)),
            _ => Value::Tensor(t),
        };
        let feeds = match &self.packing {
            None => {
                let input = fed.first().and_then(|i| i.name.clone()).unwrap_or_default();
                HashMap::from([(input, value(x.clone(), x.dtype()))])
            }
            Some(packing) => {
                let columns: usize = packing.iter().map(PackedInput::columns).sum();
                if x.dtype() != DType::F32 || x.dims().len() != 2 || x.dims()[1] != columns {
                    return t.report(
                        "onnx",
                        format!(
                            "the packed input of a model of {} inputs is {}{}, not f32 [rows, {columns}]",
                            packing.len(),
                            x.dtype(),
                            x.shape()
                        ),
                        &[x],
                        "feed the layer `OnnxLayer::pack`'s tensor",
                    );
                }
                let rows = x.dims()[0];
                let mut start = 0;
                let mut feeds = HashMap::new();
                for p in packing {
                    let mut dims = vec![rows];
                    dims.extend(&p.row);
                    let part = x.slice(1, start, p.columns()).reshape(dims);
                    start += p.columns();
                    // Bools are packed as 0.0/1.0 already.
                    let dtype = if p.dtype == DType::Bool { DType::F32 } else { p.dtype };
                    feeds.insert(p.name.clone(), value(part, dtype));
                }
                feeds
            }
        };
        let devices = (!placement.is_empty()).then(|| self.node_devices(placement, t.current_device()));
        match trace(&t, graph, self.opset, feeds, rebatch, devices.as_deref(), None) {
            Ok((outputs, _)) => match outputs.into_iter().next() {
                Some((_, y)) => y,
                None => t.report("onnx", "the model has no output", &[x], "export the model with its output"),
            },
            Err(e) => t.report("onnx", e.to_string(), &[x], "see the message"),
        }
    }
}

impl kiln_compiler::nn::Layer for OnnxLayer {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.forward_placed(x, &[])
    }

    fn kind(&self) -> &'static str {
        "onnx"
    }
}

/// An `OnnxLayer` whose node ranges run on given devices (`OnnxLayer::placed`).
pub struct PlacedOnnx<'a> {
    layer: &'a OnnxLayer,
    ranges: &'a [(DeviceId, Range<usize>)],
}

impl kiln_compiler::nn::Layer for PlacedOnnx<'_> {
    fn forward(&self, x: &Tensor) -> Tensor {
        self.layer.forward_placed(x, self.ranges)
    }

    fn kind(&self) -> &'static str {
        "onnx"
    }
}

/// The symbolic names of the models' inputs' first axes (what `--batch N` sizes); none where
/// `bytes` are no model ([`OnnxModel::batch_dims`] for a model read).
pub fn batch_dims(bytes: &[u8]) -> Vec<String> {
    ModelProto::decode(bytes).map(|m| batch_names(&m)).unwrap_or_default()
}

fn batch_names(model: &ModelProto) -> Vec<String> {
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

/// Whether `--batch batch` can apply to `model`: some fed input's first axis is
/// symbolic (sized by name) or a static 1 (re-batched, `STATIC_BATCH`), or every fed input
/// already has that batch. Otherwise the file was exported with a fixed batch, and planning it
/// would plan that batch under the requested one's name: an error naming it.
pub(crate) fn check_batch(model: &ModelProto, batch: usize) -> Result<()> {
    let Some(graph) = model.graph.as_ref() else { return Ok(()) };
    let fed = graph.input.iter().filter(|i| !graph.initializer.iter().any(|t| t.name == i.name));
    let mut fixed = Vec::new();
    for input in fed {
        let first = input
            .r#type
            .as_ref()
            .and_then(|t| t.tensor_type.as_ref())
            .and_then(|t| t.shape.as_ref())
            .and_then(|s| s.dim.first());
        let name = input.name.clone().unwrap_or_default();
        match first {
            // A symbolic first axis takes the batch; so does a batch-1 export.
            Some(d) if d.dim_param.as_deref().is_some_and(|p| !p.is_empty()) => return Ok(()),
            Some(d) if d.dim_value == Some(1) => return Ok(()),
            Some(d) => match d.dim_value {
                Some(v) => fixed.push((name, v)),
                None => return Ok(()),
            },
            None => fixed.push((name, 0)),
        }
    }
    if fixed.is_empty() || fixed.iter().all(|&(_, v)| v == batch as i64) {
        return Ok(());
    }
    let mut batches: Vec<i64> = fixed.iter().map(|&(_, v)| v).filter(|&v| v > 0).collect();
    batches.sort_unstable();
    batches.dedup();
    let inputs: Vec<String> = fixed.iter().map(|(n, v)| format!("`{n}` ({v})")).collect();
    let (what, pass) = match batches.as_slice() {
        [b] => (format!("a fixed batch of {b}"), format!(" or pass --batch {b}")),
        [] => ("no batch axis (rank-0 inputs)".to_string(), String::new()),
        many => (
            format!("fixed first axes of {}", many.iter().map(i64::to_string).collect::<Vec<_>>().join(", ")),
            String::new(),
        ),
    };
    Err(invalid(
        format!(
            "--batch {batch} cannot apply: the file's inputs have {what} (first axes: {}), neither symbolic nor 1",
            inputs.join(", ")
        ),
        format!(
            "re-export the model with a dynamic batch axis (torch.onnx.export(..., dynamic_axes={{\"{}\": {{0: \"batch\"}}}})){pass}",
            fixed[0].0
        ),
    ))
}

/// The half type an input is declared in (float16, bfloat16): it is fed as f32 and rounded to
/// that type where the model reads it, so the model computes on the values its file means.
fn half_input(input: &proto::ValueInfoProto) -> Option<DType> {
    match input.r#type.as_ref()?.tensor_type.as_ref()?.elem_type? {
        proto::FLOAT16 => Some(DType::F16),
        proto::BFLOAT16 => Some(DType::BF16),
        _ => None,
    }
}

/// An input's shape, symbolic dimensions sized from `dims`, and its dtype: f32 (also for a half
/// input, fed as f32: `half_input`), i64 / i32 for an
/// integer input (ids, fed as `HostTensor::from_i64` / `from_i32`), or bool for a mask (fed as
/// `HostTensor::from_bool`).
fn input_shape(input: &proto::ValueInfoProto, dims: &[(String, usize)]) -> Result<(Shape, DType)> {
    let name = input.name.as_deref().unwrap_or("");
    let tensor = input.r#type.as_ref().and_then(|t| t.tensor_type.as_ref()).ok_or_else(|| {
        unsupported(format!("input `{name}` is not a tensor"), "kiln imports tensor inputs only")
    })?;
    let dtype = match tensor.elem_type.unwrap_or(proto::FLOAT) {
        // Half inputs are fed as f32 and rounded to their type inside (`half_input`).
        proto::FLOAT | proto::FLOAT16 | proto::BFLOAT16 => DType::F32,
        proto::INT64 => DType::I64,
        proto::INT32 => DType::I32,
        proto::BOOL => DType::Bool,
        other => {
            return Err(unsupported(
                format!(
                    "input `{name}` has element type {other} (not float, float16, bfloat16, int32, int64 or bool)"
                ),
                "kiln computes in f32 (half inputs fed as f32), takes integer inputs as ids and bool inputs as masks",
            ));
        }
    };
    let shape = tensor.shape.as_ref().map(|s| s.dim.as_slice()).unwrap_or(&[]);
    let mut out = Vec::with_capacity(shape.len());
    let batch = dims.iter().find(|(n, _)| n == STATIC_BATCH).map(|&(_, b)| b);
    for (axis, d) in shape.iter().enumerate() {
        match (d.dim_value, d.dim_param.as_deref()) {
            (Some(1), _) if axis == 0 && batch.is_some() => out.push(batch.unwrap_or(1)),
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
    if let Some(why) = check::over_limit(&format!("graph input `{name}`"), &out, dtype.size_bytes()) {
        return Err(invalid(why, check::SIZE_HELP));
    }
    Ok((Shape::new(out), dtype))
}

/// The index of the first node reading each value, by name.
fn first_readers(graph: &proto::GraphProto) -> HashMap<&str, usize> {
    let mut first = HashMap::new();
    for (index, node) in graph.node.iter().enumerate() {
        for input in &node.input {
            first.entry(input.as_str()).or_insert(index);
        }
    }
    first
}

/// Whether `node` makes a tensor the file stores: a `Constant`, or a `ConstantOfShape` (of a
/// stored shape or not: either reads no computed float).
fn makes_stored(node: &NodeProto) -> bool {
    matches!(node.op_type.as_deref(), Some("Constant" | "ConstantOfShape"))
}

/// Whether an input's first axis is a static 1: a batch-1 export, which `STATIC_BATCH`
/// re-batches.
fn batch_of_one(input: &proto::ValueInfoProto) -> bool {
    let first = || input.r#type.as_ref()?.tensor_type.as_ref()?.shape.as_ref()?.dim.first()?.dim_value;
    first() == Some(1)
}

/// The most elements a folded integer tensor may hold: shape arguments are small, and a damaged
/// file must not make the importer allocate without bound.
const MAX_FOLDED: usize = 1 << 20;

/// A folded integer (or boolean) tensor: a shape argument, axes, indices, a mask.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Ints {
    pub dims: Vec<usize>,
    pub values: Vec<i64>,
}

impl Ints {
    pub fn new(dims: Vec<usize>, values: Vec<i64>) -> Ints {
        Ints { dims, values }
    }

    pub fn vector(values: Vec<i64>) -> Ints {
        Ints { dims: vec![values.len()], values }
    }

    pub fn scalar(v: i64) -> Ints {
        Ints { dims: vec![], values: vec![v] }
    }
}

/// What a name in the ONNX graph stands for while importing.
#[derive(Clone)]
pub(crate) enum Value {
    /// An f32 tensor of the trace.
    Tensor(Tensor),
    /// An integer tensor folded at import.
    Ints(Ints),
    /// An integer graph input (i64 or i32 ids): gathered with, reshaped and cast, never
    /// computed on.
    Ids(Tensor),
}

/// One node while it is imported: its proto, attributes and a name for messages.
pub(crate) struct Node<'a> {
    pub proto: &'a NodeProto,
    pub op: &'a str,
    pub who: String,
    pub opset: i64,
}

impl Node<'_> {
    pub fn attr(&self, name: &str) -> Option<&AttributeProto> {
        self.proto.attribute.iter().find(|a| a.name.as_deref() == Some(name))
    }

    pub fn int(&self, name: &str, default: i64) -> i64 {
        self.attr(name).and_then(|a| a.i).unwrap_or(default)
    }

    pub fn float(&self, name: &str, default: f32) -> f32 {
        self.attr(name).and_then(|a| a.f).unwrap_or(default)
    }

    pub fn ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }

    pub fn string(&self, name: &str) -> Option<String> {
        self.attr(name).and_then(|a| a.s.as_deref()).map(|s| String::from_utf8_lossy(s).into_owned())
    }

    /// Whether input `i` is given (an empty name leaves an optional input out).
    pub fn has(&self, i: usize) -> bool {
        self.proto.input.get(i).is_some_and(|n| !n.is_empty())
    }

    pub fn inputs(&self) -> usize {
        self.proto.input.len()
    }

    pub fn unsupported(&self, what: impl std::fmt::Display, help: impl Into<String>) -> Error {
        unsupported(format!("{}: {what}", self.who), help)
    }

    pub fn invalid(&self, what: impl std::fmt::Display, help: impl Into<String>) -> Error {
        invalid(format!("{}: {what}", self.who), help)
    }

    /// `axis` (negative counts from the end) of a rank-`rank` tensor.
    pub fn axis(&self, axis: i64, rank: usize) -> Result<usize> {
        let a = if axis < 0 { axis.checked_add(rank as i64) } else { Some(axis) };
        a.and_then(|a| usize::try_from(a).ok()).filter(|&a| a < rank).ok_or_else(|| {
            self.invalid(format!("axis {axis} of a rank-{rank} tensor"), "use an axis the tensor has")
        })
    }

    /// Several axes, each once, sorted.
    pub fn axes(&self, axes: &[i64], rank: usize) -> Result<Vec<usize>> {
        let mut out: Vec<usize> = axes.iter().map(|&a| self.axis(a, rank)).collect::<Result<_>>()?;
        out.sort_unstable();
        if out.windows(2).any(|w| w[0] == w[1]) {
            return Err(self.invalid(format!("axes {axes:?} repeat an axis"), "name each axis once"));
        }
        Ok(out)
    }
}

/// A tensor's values as f32 and its shape; integers and doubles converted.
fn tensor_values(t: &TensorProto) -> Result<(Vec<usize>, Vec<f32>)> {
    let name = t.name.as_deref().unwrap_or("");
    if t.data_location == Some(proto::EXTERNAL) {
        return Err(invalid(
            format!("tensor `{name}` keeps its data in an external file that was not read"),
            "import the model with `import_file`, which reads external data from the model's directory",
        ));
    }
    let dims = tensor_dims(t)?;
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
        proto::INT64 | proto::INT32 | proto::BOOL => tensor_ints(t).iter().map(|&v| v as f32).collect(),
        // Half values widen to f32 exactly: from raw little-endian bits, or one value's bits in
        // each int32 (ONNX's layout for 16-bit types).
        proto::FLOAT16 | proto::BFLOAT16 => {
            let bits: Vec<u16> = if raw.is_empty() {
                t.int32_data.iter().map(|&v| v as u16).collect()
            } else {
                le(raw, u16::from_le_bytes)
            };
            let widen = |b: u16| match t.data_type {
                Some(proto::FLOAT16) => half::f16::from_bits(b).to_f32(),
                _ => half::bf16::from_bits(b).to_f32(),
            };
            bits.into_iter().map(widen).collect()
        }
        other => {
            return Err(unsupported(
                format!("tensor `{name}` has element type {other}"),
                "kiln reads float, double, float16, bfloat16, int32, int64 and bool tensors",
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

/// Whether every value has the same bits.
fn uniform(values: &[f32]) -> bool {
    values.first().is_some_and(|v| values.iter().all(|x| x.to_bits() == v.to_bits()))
}

fn tensor_dims(t: &TensorProto) -> Result<Vec<usize>> {
    t.dims
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| {
                invalid(
                    format!("tensor `{}` has a negative dimension {d}", t.name.as_deref().unwrap_or("")),
                    "the file is damaged",
                )
            })
        })
        .collect()
}

/// The elements of little-endian raw data, `N` bytes each (a trailing partial element is
/// dropped, and the element count then checked by the caller).
fn le<const N: usize, T>(raw: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
    raw.chunks_exact(N).filter_map(|c| c.try_into().ok()).map(f).collect()
}

/// An integer or boolean tensor's values; empty for other element types.
fn tensor_ints(t: &TensorProto) -> Vec<i64> {
    let raw = t.raw_data.as_deref().unwrap_or(&[]);
    match t.data_type.unwrap_or(0) {
        proto::INT64 if !raw.is_empty() => le(raw, i64::from_le_bytes),
        proto::INT64 => t.int64_data.clone(),
        proto::INT32 if !raw.is_empty() => le(raw, i32::from_le_bytes).into_iter().map(i64::from).collect(),
        proto::BOOL if !raw.is_empty() => raw.iter().map(|&b| i64::from(b != 0)).collect(),
        proto::INT32 | proto::BOOL => t.int32_data.iter().map(|&v| v as i64).collect(),
        _ => Vec::new(),
    }
}

fn is_integer(t: &TensorProto) -> bool {
    matches!(t.data_type, Some(proto::INT64) | Some(proto::INT32) | Some(proto::BOOL))
}

/// A folded integer tensor from its proto, its element count checked.
fn folded(t: &TensorProto) -> Result<Ints> {
    let name = t.name.as_deref().unwrap_or("");
    let dims = tensor_dims(t)?;
    let n = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
    let values = tensor_ints(t);
    if n != Some(values.len()) {
        return Err(invalid(
            format!("integer tensor `{name}` of shape {dims:?} holds {} values", values.len()),
            "the file is damaged or truncated",
        ));
    }
    Ok(Ints::new(dims, values))
}

pub(crate) struct Importer {
    pub t: Tracer,
    values: HashMap<String, Value>,
    /// Float constants' values (initializers and `Constant`s), for attributes given as inputs.
    floats: HashMap<String, (Vec<usize>, Vec<f32>)>,
    /// Folded integer tensors already made into constant tensors, by name.
    converted: HashMap<String, Tensor>,
    /// Names some node or the graph's outputs read.
    used: HashSet<String>,
    /// Tensors holding only 0.0 and 1.0 (comparisons', logical ops' results): ONNX bools.
    booleans: HashSet<String>,
    /// Tensors the file stores (initializers, `Constant` nodes), as opposed to computed ones.
    stored: HashSet<String>,
    weights: Vec<(String, HostTensor)>,
    pub opset: i64,
    /// The batch traced where the file's static batch is 1 and this is another (`STATIC_BATCH`).
    pub rebatch: Option<usize>,
    /// A 4-D NCHW value's channels-last twin ([N, H, W, C], the same elements), by name, where
    /// it was made (`nhwc`).
    twins: HashMap<String, Tensor>,
    /// The values worth computing channels-last (`nhwc::worth_it`).
    worth_twin: HashSet<String>,
    /// Stored tensors read only as plain 2-D convolutions' filters (`nhwc::filters`).
    filters: HashSet<String>,
    /// Their parameters, stored HWIO, by name.
    filter_params: HashMap<String, Tensor>,
    /// Whether twins are kept (`KILN_ONNX_CHANNELS_LAST=0`: never, and no value is worth one
    /// nor any filter stored HWIO: every convolution and pooling permutes its input, output and
    /// filter as before).
    channels_last: bool,
}

impl Importer {
    /// Input `i`'s channels-last twin, where one was made.
    pub(crate) fn twin(&self, n: &Node, i: usize) -> Option<Tensor> {
        self.twins.get(n.proto.input.get(i)?).cloned()
    }

    /// Output `i` made channels-last as `twin` ([N, H, W, C]): kept as the output's twin, and
    /// its NCHW value returned (a permute that only NCHW readers keep alive).
    pub(crate) fn nchw_of_twin(&mut self, n: &Node, i: usize, twin: Tensor) -> Tensor {
        if let Some(name) = n.proto.output.get(i).filter(|s| !s.is_empty() && self.channels_last) {
            self.twins.insert(name.clone(), twin.clone());
        }
        twin.permute(&[0, 3, 1, 2])
    }

    /// A float initializer becomes a parameter named after it; an integer one a folded constant.
    fn initializer(&mut self, init: &TensorProto) -> Result<()> {
        self.register(init)?;
        self.parameter(init)
    }

    /// Records an initializer: an integer one folded, a float one's values kept (for folded
    /// arguments); its parameter is made by `parameter`, on the device of its first reader.
    fn register(&mut self, init: &TensorProto) -> Result<()> {
        let name = init.name.clone().unwrap_or_default();
        self.stored.insert(name.clone());
        if is_integer(init) {
            let ints = folded(init)?;
            self.values.insert(name, Value::Ints(ints));
            return Ok(());
        }
        let (dims, values) = tensor_values(init)?;
        self.floats.insert(name, (dims, values));
        Ok(())
    }

    /// A registered float initializer's parameter, on the tracer's current device.
    fn parameter(&mut self, init: &TensorProto) -> Result<()> {
        let name = init.name.clone().unwrap_or_default();
        let Some((dims, values)) = self.floats.get(&name).cloned() else { return Ok(()) };
        if is_integer(init) || self.values.contains_key(&name) {
            return Ok(());
        }
        let p = self.stored_parameter(&name, dims, values)?;
        self.values.insert(name, Value::Tensor(p));
        Ok(())
    }

    /// A parameter `name` holding the file's `values` of `dims`; a plain convolution's filter
    /// (`nhwc::filters`) stored HWIO, kiln's layout (kept in `filter_params`), and returned as
    /// an OIHW view that only a reader of the file's layout keeps alive.
    fn stored_parameter(&mut self, name: &str, dims: Vec<usize>, values: Vec<f32>) -> Result<Tensor> {
        if let Some((hwio, values)) = self.hwio(name, &dims, Some(&values)) {
            let p = self.t.param(name, hwio.clone(), Init::Zeros);
            self.weights.push((name.to_string(), HostTensor::new(hwio, values.unwrap_or_default())?));
            self.filter_params.insert(name.to_string(), p.clone());
            return Ok(p.permute(&[3, 2, 0, 1]));
        }
        let shape = Shape::new(dims);
        let p = self.t.param(name, shape.clone(), Init::Zeros);
        self.weights.push((name.to_string(), HostTensor::new(shape, values)?));
        Ok(p)
    }

    /// Where `name` is a plain convolution's filter of `dims` [F, C, KH, KW]: its HWIO shape
    /// [KH, KW, C, F] and `values` in that order (`nhwc::hwio`).
    fn hwio(&self, name: &str, dims: &[usize], values: Option<&[f32]>) -> Option<(Shape, Option<Vec<f32>>)> {
        if !self.filters.contains(name) {
            return None;
        }
        nhwc::hwio(dims, values).map(|(d, v)| (Shape::new(d), v))
    }

    /// Input 1 of `n` where it is a filter parameter stored HWIO (`nhwc::filters`).
    pub(crate) fn stored_filter(&self, n: &Node) -> Option<Tensor> {
        self.filter_params.get(n.proto.input.get(1)?).cloned()
    }

    /// A constant tensor: a fill where every value is the same, else a parameter named `name`
    /// holding the values. With `weight` (a float `Constant` node of the file), more than one
    /// value is a parameter even when they are equal (`Init::Constant`, nothing to write): a
    /// tensor the file stores as a constant is model state (exporters and ONNX's `light/` models
    /// hold weights so), persistent rather than recomputed into the arena every step, and
    /// trained like an initializer.
    pub fn constant(
        &mut self,
        name: &str,
        dims: Vec<usize>,
        values: Vec<f32>,
        weight: bool,
    ) -> Result<Tensor> {
        if let Some(t) = self.converted.get(name) {
            return Ok(t.clone());
        }
        let t = match values.first() {
            Some(&v) if weight && values.len() > 1 && uniform(&values) => {
                return Ok(self.uniform_weight(name, dims, v));
            }
            Some(&v) if uniform(&values) => self.t.fill(v, dims),
            _ => self.stored_parameter(name, dims, values)?,
        };
        self.converted.insert(name.to_string(), t.clone());
        Ok(t)
    }

    /// A stored tensor of `dims` whose every value is `v`: a parameter named `name` initialised
    /// to `v` (nothing to write).
    pub fn uniform_weight(&mut self, name: &str, dims: Vec<usize>, v: f32) -> Tensor {
        if let Some(t) = self.converted.get(name) {
            return t.clone();
        }
        let t = match self.hwio(name, &dims, None) {
            Some((hwio, _)) => {
                let p = self.t.param(name, hwio, Init::Constant(v));
                self.filter_params.insert(name.to_string(), p.clone());
                p.permute(&[3, 2, 0, 1])
            }
            None => self.t.param(name, Shape::new(dims), Init::Constant(v)),
        };
        self.converted.insert(name.to_string(), t.clone());
        t
    }

    /// The graph's outputs by name, and the parameters' values.
    fn finish(mut self, graph: &proto::GraphProto) -> Result<(Named<Tensor>, Named<HostTensor>)> {
        let outputs = graph
            .output
            .iter()
            .map(|o| {
                let name = o.name.clone().unwrap_or_default();
                let value = match self.value(&name, "the graph's outputs")? {
                    Value::Tensor(t) | Value::Ids(t) => t,
                    Value::Ints(ints) => self.ints_tensor(&name, &ints)?,
                };
                Ok((name, value))
            })
            .collect::<Result<_>>()?;
        Ok((outputs, self.weights))
    }

    /// Whether `name` is a tensor the file stores (an initializer or a `Constant`'s output).
    pub fn is_stored(&self, name: &str) -> bool {
        self.stored.contains(name)
    }

    /// Marks `name` as a tensor the file stores.
    pub fn store(&mut self, name: &str) {
        self.stored.insert(name.to_string());
    }

    fn value(&self, name: &str, who: &str) -> Result<Value> {
        self.values.get(name).cloned().ok_or_else(|| {
            invalid(
                format!("{who} reads `{name}`, which no input, initializer or earlier node makes"),
                "the graph must be in topological order with every value defined",
            )
        })
    }

    /// Input `i` of `n`, whatever it holds.
    pub fn input(&self, n: &Node, i: usize) -> Result<Value> {
        let name = n
            .proto
            .input
            .get(i)
            .filter(|s| !s.is_empty())
            .ok_or_else(|| n.invalid(format!("has no input {i}"), format!("{} needs input {i}", n.op)))?;
        self.value(name, &n.who)
    }

    /// Input `i` as an f32 tensor: folded integers become a constant; ids are refused (an
    /// integer tensor's arithmetic is not float arithmetic).
    pub fn tensor(&mut self, n: &Node, i: usize) -> Result<Tensor> {
        match self.input(n, i)? {
            Value::Tensor(t) => Ok(t),
            Value::Ints(ints) => self.ints_tensor(&n.proto.input[i], &ints),
            Value::Ids(_) => Err(n.unsupported(
                format!("reads the integer input `{}` as a value", n.proto.input[i]),
                "kiln takes integer graph inputs as ids: Gather's indices, through reshapes and Cast",
            )),
        }
    }

    /// A folded integer tensor as a constant f32 tensor (exact up to 2^24).
    pub fn ints_tensor(&mut self, name: &str, ints: &Ints) -> Result<Tensor> {
        if ints.values.iter().any(|v| v.unsigned_abs() > 1 << 24) {
            return Err(unsupported(
                format!(
                    "the integer tensor `{name}` holds values beyond 2^24, which f32 cannot hold exactly"
                ),
                "kiln's tensors are f32",
            ));
        }
        let values: Vec<f32> = ints.values.iter().map(|&v| v as f32).collect();
        if let Some(t) = self.converted.get(name) {
            return Ok(t.clone());
        }
        // An integer tensor read as floats (a mask, an index table) is a constant of the graph,
        // not a weight: nothing trains it (a stored causal mask had been trained with Adam).
        if values.len() > 1 && !uniform(&values) {
            let t = self.t.constant_values(name, ints.dims.clone(), values);
            self.converted.insert(name.to_string(), t.clone());
            return Ok(t);
        }
        self.constant(name, ints.dims.clone(), values, false)
    }

    /// Input `i` as a folded integer tensor.
    pub fn ints(&self, n: &Node, i: usize) -> Result<Ints> {
        match self.input(n, i)? {
            Value::Ints(v) => Ok(v),
            _ => Err(n.unsupported(
                format!("takes its input {i} (`{}`) from a computed tensor", n.proto.input[i]),
                "kiln folds shape, axes and index arguments at import: they must be initializers, \
                 Constants or computed from them and from static shapes",
            )),
        }
    }

    /// Optional input `i` as a folded integer tensor.
    pub fn opt_ints(&self, n: &Node, i: usize) -> Result<Option<Ints>> {
        if n.has(i) { self.ints(n, i).map(Some) } else { Ok(None) }
    }

    /// A float constant's values, where input `i` is one (an initializer or `Constant`).
    pub fn float_const(&self, n: &Node, i: usize) -> Option<&(Vec<usize>, Vec<f32>)> {
        n.proto.input.get(i).and_then(|name| self.floats.get(name))
    }

    /// Whether `name` is a tensor of ONNX bools (0.0 and 1.0).
    pub fn is_boolean(&self, name: &str) -> bool {
        self.booleans.contains(name)
    }

    /// Whether a value named `name` is read later.
    fn is_used(&self, name: &str) -> bool {
        self.used.contains(name)
    }

    fn node(&mut self, index: usize, proto: &NodeProto) -> Result<()> {
        let op = proto.op_type.clone().unwrap_or_default();
        let who = who(index, proto);
        if let Some(d) = proto.domain.as_deref().filter(|d| !d.is_empty() && *d != "ai.onnx") {
            return Err(unsupported(
                format!("{who} is in the domain `{d}`"),
                "kiln imports the default ONNX domain",
            ));
        }
        let n = Node { proto, op: &op, who, opset: self.opset };
        let before = self.t.error().is_some();
        let outputs = match op.as_str() {
            "Constant" => layout::constant(self, &n)?,
            _ => {
                if let Some(out) = nhwc::import(self, &n)? {
                    out
                } else if let Some(out) = elementwise::import(self, &n)? {
                    out
                } else if let Some(out) = layout::import(self, &n)? {
                    out
                } else if let Some(out) = reduce::import(self, &n)? {
                    out
                } else if let Some(out) = conv::import(self, &n)? {
                    out
                } else if let Some(out) = norm::import(self, &n)? {
                    out
                } else {
                    return Err(n.unsupported(
                        format!("kiln does not import `{op}` yet"),
                        format!("supported: {}", SUPPORTED.join(", ")),
                    ));
                }
            }
        };
        // A shape the DSL refused: name the node (the tracer keeps the error too).
        if let Some(e) = self.t.error().filter(|_| !before) {
            return Err(invalid(
                format!("{}: {e}", n.who),
                "check the node's inputs' shapes against its attributes",
            ));
        }
        let boolean = matches!(
            op.as_str(),
            "Equal" | "Less" | "LessOrEqual" | "Greater" | "GreaterOrEqual" | "And" | "Or" | "Xor" | "Not"
        ) || (op == "Cast" && n.int("to", 0) == i64::from(proto::BOOL));
        for (i, name) in proto.output.iter().enumerate() {
            if name.is_empty() {
                continue;
            }
            if boolean {
                self.booleans.insert(name.clone());
            }
            match outputs.get(i) {
                Some(v) => {
                    self.values.insert(name.clone(), v.clone());
                }
                None if self.is_used(name) => {
                    return Err(n.unsupported(
                        format!(
                            "output {i} (`{name}`) is read, and kiln computes only the first {}",
                            outputs.len()
                        ),
                        format!("export without {op}'s optional output {i}"),
                    ));
                }
                None => {}
            }
        }
        Ok(())
    }
}

/// Reshape's target: 0 copies the input's axis (unless `allowzero`), one -1 takes the rest.
pub(crate) fn reshape_target(
    input: &[usize],
    spec: &[i64],
    allowzero: bool,
) -> std::result::Result<Vec<usize>, String> {
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
            s if s >= 0 => out.push(usize::try_from(s).map_err(|_| format!("{s} is too large"))?),
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
