//! The part of ONNX's protobuf schema (`onnx/onnx.proto`, proto2) the importer reads, as `prost`
//! messages: field numbers and types as the schema publishes them, fields the importer does not
//! read left out (protobuf skips unknown fields when decoding).

/// `ModelProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ModelProto {
    /// The ONNX IR (file format) version the model was written with.
    #[prost(int64, optional, tag = "1")]
    pub ir_version: Option<i64>,
    /// The name of the tool that wrote the model (`pytorch`, `tf2onnx`, ...).
    #[prost(string, optional, tag = "2")]
    pub producer_name: Option<String>,
    /// The model's computation graph; `None` in a file that has none (the importer rejects it).
    #[prost(message, optional, tag = "7")]
    pub graph: Option<GraphProto>,
    /// The operator sets the graph uses, one per domain; the default domain's version is the opset
    /// the importer checks.
    #[prost(message, repeated, tag = "8")]
    pub opset_import: Vec<OperatorSetIdProto>,
}

/// `OperatorSetIdProto`: an empty domain is the default ONNX operator set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct OperatorSetIdProto {
    /// The operator set's domain; `None`, empty or `ai.onnx` is the default ONNX domain.
    #[prost(string, optional, tag = "1")]
    pub domain: Option<String>,
    /// The operator set's version (the opset number, e.g. 13).
    #[prost(int64, optional, tag = "2")]
    pub version: Option<i64>,
}

/// `GraphProto`: nodes in topological order.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GraphProto {
    /// The graph's nodes, in topological order.
    #[prost(message, repeated, tag = "1")]
    pub node: Vec<NodeProto>,
    /// The graph's name (the traced graph takes it; `onnx` when absent).
    #[prost(string, optional, tag = "2")]
    pub name: Option<String>,
    /// Stored tensors (weights and constants), each named after the graph value it gives.
    #[prost(message, repeated, tag = "5")]
    pub initializer: Vec<TensorProto>,
    /// The graph's inputs; those that an initializer names are parameters, not fed inputs.
    #[prost(message, repeated, tag = "11")]
    pub input: Vec<ValueInfoProto>,
    /// The graph's outputs: the values a run returns, by name, with their declared types.
    #[prost(message, repeated, tag = "12")]
    pub output: Vec<ValueInfoProto>,
}

/// `NodeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeProto {
    /// The names of the values the node reads, in the operator's argument order; an empty name is
    /// an omitted optional input.
    #[prost(string, repeated, tag = "1")]
    pub input: Vec<String>,
    /// The names of the values the node produces, in the operator's output order.
    #[prost(string, repeated, tag = "2")]
    pub output: Vec<String>,
    /// The node's name, for diagnostics only.
    #[prost(string, optional, tag = "3")]
    pub name: Option<String>,
    /// The operator's name (`Conv`, `MatMul`, ...) within its domain.
    #[prost(string, optional, tag = "4")]
    pub op_type: Option<String>,
    /// The node's named attribute values (`axis`, `strides`, a `Constant`'s `value`, ...).
    #[prost(message, repeated, tag = "5")]
    pub attribute: Vec<AttributeProto>,
    /// The operator's domain; `None` or empty is the default ONNX domain.
    #[prost(string, optional, tag = "7")]
    pub domain: Option<String>,
}

/// `AttributeProto` (graph-valued attributes are not read).
#[derive(Clone, PartialEq, prost::Message)]
pub struct AttributeProto {
    /// The attribute's name, unique within its node (`axis`, `kernel_shape`, ...).
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    /// The value of a `FLOAT` attribute.
    #[prost(float, optional, tag = "2")]
    pub f: Option<f32>,
    /// The value of an `INT` attribute.
    #[prost(int64, optional, tag = "3")]
    pub i: Option<i64>,
    /// The value of a `STRING` attribute, as bytes (UTF-8 in practice).
    #[prost(bytes = "vec", optional, tag = "4")]
    pub s: Option<Vec<u8>>,
    /// The value of a `TENSOR` attribute (a `Constant`'s `value`, for one).
    #[prost(message, optional, tag = "5")]
    pub t: Option<TensorProto>,
    /// The values of a `FLOATS` attribute.
    #[prost(float, repeated, packed = "false", tag = "7")]
    pub floats: Vec<f32>,
    /// The values of an `INTS` attribute (`kernel_shape`, `pads`, `perm`, ...).
    #[prost(int64, repeated, packed = "false", tag = "8")]
    pub ints: Vec<i64>,
    /// The `AttributeProto.AttributeType` that says which value field is set (1 `FLOAT`, 2 `INT`,
    /// 3 `STRING`, 4 `TENSOR`, 6 `FLOATS`, 7 `INTS`, ...).
    #[prost(int32, optional, tag = "20")]
    pub r#type: Option<i32>,
}

/// `TensorProto` (segments are not read).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorProto {
    /// The tensor's shape, outermost axis first; empty for a scalar.
    #[prost(int64, repeated, packed = "false", tag = "1")]
    pub dims: Vec<i64>,
    /// The element type, a `TensorProto.DataType` value ([`FLOAT`], [`INT64`], ...).
    #[prost(int32, optional, tag = "2")]
    pub data_type: Option<i32>,
    /// The values of a `FLOAT` tensor when `raw_data` is not used.
    #[prost(float, repeated, tag = "4")]
    pub float_data: Vec<f32>,
    /// The values of an `INT32` or `BOOL` tensor (one per element) when `raw_data` is not used.
    #[prost(int32, repeated, tag = "5")]
    pub int32_data: Vec<i32>,
    /// The values of an `INT64` tensor when `raw_data` is not used.
    #[prost(int64, repeated, tag = "7")]
    pub int64_data: Vec<i64>,
    /// The tensor's name: for an initializer, the graph value it gives.
    #[prost(string, optional, tag = "8")]
    pub name: Option<String>,
    /// The values packed little-endian, `dims`'s product elements of the data type's size (one
    /// byte per `BOOL`); when present and non-empty the typed `*_data` fields are ignored. For a
    /// tensor read from external data, a view of the memory-mapped data file (`Bytes`, which
    /// keeps the map alive).
    #[prost(bytes = "bytes", optional, tag = "9")]
    pub raw_data: Option<prost::bytes::Bytes>,
    /// The values of a `DOUBLE` tensor when `raw_data` is not used.
    #[prost(double, repeated, tag = "10")]
    pub double_data: Vec<f64>,
    /// For a tensor stored outside the model (`data_location` [`EXTERNAL`]): the file that holds
    /// its values (`location`, relative to the model's directory), the `offset` and `length` of
    /// its bytes there, and an optional `checksum` (not read). `import_file` maps the file and
    /// makes `raw_data` a view of those bytes (`onnx::external`).
    #[prost(message, repeated, tag = "13")]
    pub external_data: Vec<StringStringEntryProto>,
    /// Where the values are kept: 0 (or `None`) inside this message ([`DEFAULT`]), 1 in an
    /// external file ([`EXTERNAL`], described by `external_data`).
    #[prost(int32, optional, tag = "14")]
    pub data_location: Option<i32>,
}

/// `TensorProto.DataLocation` `DEFAULT`: the values are inside the tensor's message.
pub const DEFAULT: i32 = 0;
/// `TensorProto.DataLocation` `EXTERNAL`: the values are in a file beside the model.
pub const EXTERNAL: i32 = 1;

/// `StringStringEntryProto`: a key and a value (a tensor's `external_data` entries).
#[derive(Clone, PartialEq, prost::Message)]
pub struct StringStringEntryProto {
    /// The entry's key (`location`, `offset`, `length`, `checksum`).
    #[prost(string, optional, tag = "1")]
    pub key: Option<String>,
    /// The entry's value, as text (offsets and lengths in decimal).
    #[prost(string, optional, tag = "2")]
    pub value: Option<String>,
}

// `TensorProto.DataType` values the importer reads.

/// `TensorProto.DataType` `FLOAT`: 32-bit IEEE float.
pub const FLOAT: i32 = 1;
/// `TensorProto.DataType` `INT32`: 32-bit signed integer.
pub const INT32: i32 = 6;
/// `TensorProto.DataType` `INT64`: 64-bit signed integer.
pub const INT64: i32 = 7;
/// `TensorProto.DataType` `BOOL`: a boolean, read as 0 or 1.
pub const BOOL: i32 = 9;
/// `TensorProto.DataType` `DOUBLE`: 64-bit IEEE float (converted to f32 on import).
pub const DOUBLE: i32 = 11;
/// `TensorProto.DataType` `FLOAT16`: IEEE half (widened to f32 on import, exactly).
pub const FLOAT16: i32 = 10;
/// `TensorProto.DataType` `BFLOAT16`: bfloat16 (widened to f32 on import, exactly).
pub const BFLOAT16: i32 = 16;

/// `ValueInfoProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ValueInfoProto {
    /// The name of the graph value described.
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    /// The value's type; `None` when the file does not give one.
    #[prost(message, optional, tag = "2")]
    pub r#type: Option<TypeProto>,
}

/// `TypeProto` (tensor types only).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TypeProto {
    /// The type of a tensor value; `None` for the sequence, map and optional types the importer
    /// does not read.
    #[prost(message, optional, tag = "1")]
    pub tensor_type: Option<TensorType>,
}

/// `TypeProto.Tensor`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorType {
    /// The element type, a `TensorProto.DataType` value ([`FLOAT`] when absent).
    #[prost(int32, optional, tag = "1")]
    pub elem_type: Option<i32>,
    /// The tensor's shape; `None` when unknown (read as a scalar's empty shape).
    #[prost(message, optional, tag = "2")]
    pub shape: Option<TensorShapeProto>,
}

/// `TensorShapeProto`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TensorShapeProto {
    /// The axes, outermost first.
    #[prost(message, repeated, tag = "1")]
    pub dim: Vec<Dimension>,
}

/// `TensorShapeProto.Dimension`: a size or a symbolic name (a oneof in the schema).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Dimension {
    /// The axis's size when known statically.
    #[prost(int64, optional, tag = "1")]
    pub dim_value: Option<i64>,
    /// The axis's symbolic name (`batch`, `seq`) when its size is given at import time.
    #[prost(string, optional, tag = "2")]
    pub dim_param: Option<String>,
}
