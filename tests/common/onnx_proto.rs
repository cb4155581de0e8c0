//! Builders of ONNX protobuf messages for tests that make models in memory (no Python needed):
//! attributes of each type, float and int64 tensors, nodes, symbolic dimensions and typed values.

#![allow(dead_code)]

use kiln::onnx::proto::*;

pub fn attr_int(name: &str, i: i64) -> AttributeProto {
    AttributeProto { name: Some(name.into()), i: Some(i), r#type: Some(2), ..Default::default() }
}

pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto { name: Some(name.into()), ints: v.to_vec(), r#type: Some(7), ..Default::default() }
}

pub fn attr_str(name: &str, s: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        s: Some(s.as_bytes().to_vec()),
        r#type: Some(3),
        ..Default::default()
    }
}

pub fn attr_float(name: &str, f: f32) -> AttributeProto {
    AttributeProto { name: Some(name.into()), f: Some(f), r#type: Some(1), ..Default::default() }
}

pub fn tensor(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(FLOAT),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

pub fn ints(name: &str, values: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: vec![values.len() as i64],
        data_type: Some(INT64),
        int64_data: values.to_vec(),
        ..Default::default()
    }
}

pub fn node(
    op: &str,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    attribute: Vec<AttributeProto>,
) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(name.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute,
        ..Default::default()
    }
}

pub fn named(p: &str) -> Dimension {
    Dimension { dim_value: None, dim_param: Some(p.into()) }
}

/// A graph input or output `name` of element type `elem` and dimensions `dims`.
pub fn typed(name: &str, elem: i32, dims: &[Dimension]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            tensor_type: Some(TensorType {
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim: dims.to_vec() }),
            }),
        }),
    }
}
