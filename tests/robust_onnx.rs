//! Malformed and hostile ONNX files (`kiln::onnx`): each class of input that onnx's checker
//! refuses is an error naming the file, the node, the value or attribute and the rule it
//! breaks, before anything is traced; external data is read only from inside the model's
//! directory, by the library and by the CLI; bool masks, `--batch` on a fixed-batch export and imported weights behave as the
//! file means. The models are built here with the schema's messages (no Python needed).

use kiln::onnx::proto::*;
use kiln::onnx::{import, import_file};
use kiln::prelude::*;
use prost::Message;
use std::path::{Path, PathBuf};

#[path = "common/onnx_proto.rs"]
mod onnx_proto;
use onnx_proto::*;

fn fixed(v: i64) -> Dimension {
    Dimension { dim_value: Some(v), dim_param: None }
}

fn value(name: &str, dims: &[Dimension]) -> ValueInfoProto {
    typed(name, FLOAT, dims)
}

/// The model proto of `nodes` whose one output is `y`, opset `opset`, IR version 8.
fn model_proto(
    nodes: Vec<NodeProto>,
    initializer: Vec<TensorProto>,
    input: Vec<ValueInfoProto>,
    opset: i64,
) -> ModelProto {
    ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: nodes,
            initializer,
            input,
            output: vec![value("y", &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(opset) }],
    }
}

fn graph(nodes: Vec<NodeProto>, initializer: Vec<TensorProto>, input: Vec<ValueInfoProto>) -> Vec<u8> {
    model_proto(nodes, initializer, input, 17).encode_to_vec()
}

/// The error `import` gives `bytes`, as text (a panic if it imports).
fn refused(bytes: &[u8], what: &str) -> String {
    match import(bytes, &[]) {
        Ok(_) => panic!("{what}: imported"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(text: &str, parts: &[&str]) {
    for p in parts {
        assert!(text.contains(p), "`{p}` missing from:\n{text}");
    }
}

/// x [2, 3] -> Relu -> y: a valid model to break.
fn relu() -> ModelProto {
    model_proto(
        vec![node("Relu", "act", &["x"], &["y"], vec![])],
        vec![],
        vec![value("x", &[fixed(2), fixed(3)])],
        17,
    )
}

/// A model without `ir_version`, or of one outside `IR_VERSIONS`, is refused, as onnx's
/// checker does (it does not know which format the file follows).
#[test]
fn a_model_without_a_readable_ir_version_is_refused() {
    let mut m = relu();
    m.ir_version = None;
    let e = refused(&m.encode_to_vec(), "no ir_version");
    assert_has(&e, &["The model does not have an ir_version set properly.", "IR versions 3 to 11"]);
    m.ir_version = Some(2);
    let e = refused(&m.encode_to_vec(), "ir_version 2");
    assert_has(&e, &["ir_version is 2, below 3", "IR versions 3 to 11"]);
    m.ir_version = Some(12);
    let e = refused(&m.encode_to_vec(), "ir_version 12");
    assert_has(&e, &["Your model ir_version 12 is higher than kiln's (11)."]);
    assert_eq!(kiln::onnx::IR_VERSIONS, 3..=11);
    for v in kiln::onnx::IR_VERSIONS {
        m.ir_version = Some(v);
        import(&m.encode_to_vec(), &[]).unwrap_or_else(|e| panic!("ir_version {v}: {e}"));
    }
}

/// A model that imports no opset of the default domain is refused (it used to read as opset 1).
#[test]
fn a_model_without_a_default_domain_opset_is_refused() {
    let mut m = relu();
    m.opset_import.clear();
    let e = refused(&m.encode_to_vec(), "no opset_import");
    assert_has(&e, &["model with IR version >= 3 must specify opset_import for ONNX"]);
    m.opset_import = vec![OperatorSetIdProto { domain: Some("ai.onnx.ml".into()), version: Some(3) }];
    let e = refused(&m.encode_to_vec(), "only ai.onnx.ml");
    assert_has(&e, &["No opset import for domain ''", "`ai.onnx.ml`"]);
}

/// A value made twice — by two nodes, or by a node and a graph input or initializer — is
/// refused (the later producer used to win, unannounced); `import_file` names the file.
#[test]
fn a_value_produced_twice_is_refused() {
    let twice = graph(
        vec![
            node("Relu", "a", &["x"], &["h"], vec![]),
            node("Sigmoid", "b", &["x"], &["h"], vec![]),
            node("Neg", "c", &["h"], &["y"], vec![]),
        ],
        vec![],
        vec![value("x", &[fixed(2)])],
    );
    let e = refused(&twice, "two producers");
    assert_has(
        &e,
        &[
            "node `b` (Sigmoid)",
            "Graph must be in single static assignment (SSA) form, however 'h' has been used as output names multiple times.",
            "the output of node `a` (Relu)",
        ],
    );
    let shadows_input = graph(
        vec![node("Relu", "a", &["x"], &["x"], vec![]), node("Neg", "c", &["x"], &["y"], vec![])],
        vec![],
        vec![value("x", &[fixed(2)])],
    );
    let e = refused(&shadows_input, "an output named as the input");
    assert_has(&e, &["node `a` (Relu)", "however 'x' has been used as output names", "a graph input"]);
    let shadows_initializer = graph(
        vec![node("Relu", "", &["x"], &["w"], vec![]), node("Add", "sum", &["x", "w"], &["y"], vec![])],
        vec![tensor("w", &[2], &[1.0, 2.0])],
        vec![value("x", &[fixed(2)])],
    );
    let e = refused(&shadows_initializer, "an output named as an initializer");
    assert_has(&e, &["node #0 (Relu)", "however 'w' has been used as output names", "an initializer"]);
    let mut inputs_twice = relu();
    inputs_twice.graph.as_mut().unwrap().input.push(value("x", &[fixed(2), fixed(3)]));
    let e = refused(&inputs_twice.encode_to_vec(), "an input declared twice");
    assert_has(&e, &["'x' has been used as graph input names multiple times"]);
    // From a file, the error names it.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = dir.join("twice.onnx");
    std::fs::write(&path, &twice).unwrap();
    let e = import_file(&path, &[]).err().expect("two producers").to_string();
    assert_has(&e, &[&format!("{}: node `b` (Sigmoid)", path.display())]);
}

/// An input read before the node that makes it, or made by nothing, is refused naming the
/// rule and the later producer; an empty name (an omitted optional input) is allowed; a graph
/// output nothing makes is refused.
#[test]
fn nodes_out_of_topological_order_are_refused() {
    let unsorted = graph(
        vec![node("Neg", "late", &["h"], &["y"], vec![]), node("Relu", "early", &["x"], &["h"], vec![])],
        vec![],
        vec![value("x", &[fixed(2)])],
    );
    let e = refused(&unsorted, "unsorted");
    assert_has(
        &e,
        &[
            "node `late` (Neg): reads `h`",
            "Nodes in a graph must be topologically sorted, however input 'h' of node: name: late OpType: Neg is not output of any previous nodes.",
            "made by the later node `early` (Relu)",
        ],
    );
    let undefined =
        graph(vec![node("Neg", "n", &["nowhere"], &["y"], vec![])], vec![], vec![value("x", &[fixed(2)])]);
    let e = refused(&undefined, "undefined");
    assert_has(&e, &["reads `nowhere`", "neither a graph input, an initializer nor any node's output"]);
    // Clip with its min omitted (an empty name) and its max given.
    let optional = graph(
        vec![node("Clip", "clip", &["x", "", "hi"], &["y"], vec![])],
        vec![tensor("hi", &[], &[0.5])],
        vec![value("x", &[fixed(3)])],
    );
    let imported = import(&optional, &[]).expect("an omitted optional input is allowed");
    let x = HostTensor::new([3], vec![-1.0, 0.25, 2.0]).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = imported.load(&mut cpu, &CompileOptions::default()).unwrap();
    assert_eq!(cpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), &[-1.0, 0.25, 0.5]);
    let mut no_output = relu();
    no_output.graph.as_mut().unwrap().output.push(value("z", &[]));
    let e = refused(&no_output.encode_to_vec(), "an output nothing makes");
    assert_has(&e, &["Graph output 'z' is not an output of any node in graph."]);
}

/// Two initializers of one name are refused (which one the graph reads was the file's order).
#[test]
fn two_initializers_of_one_name_are_refused() {
    let bytes = graph(
        vec![node("Add", "add", &["x", "b"], &["y"], vec![])],
        vec![tensor("b", &[2], &[1.0, 2.0]), tensor("b", &[2], &[3.0, 4.0])],
        vec![value("x", &[fixed(2)])],
    );
    let e = refused(&bytes, "two initializers");
    assert_has(&e, &["b initializer name is not unique"]);
}

/// An initializer that gives a graph input its default must have the input's element type and
/// static shape (a symbolic axis takes any size).
#[test]
fn an_initializer_conflicting_with_its_graph_input_is_refused() {
    let add = |init: TensorProto, declared: ValueInfoProto| {
        graph(
            vec![node("Add", "add", &["x", "b"], &["y"], vec![])],
            vec![init],
            vec![value("x", &[fixed(2)]), declared],
        )
    };
    let e = refused(&add(tensor("b", &[2], &[1.0, 2.0]), typed("b", INT64, &[fixed(2)])), "type");
    assert_has(
        &e,
        &[
            "initializer `b` is tensor(float), but the graph input `b` is declared tensor(int64)",
            "Inferred elem type differs from existing elem type: (tensor(float)) vs (tensor(int64))",
        ],
    );
    let e = refused(&add(tensor("b", &[2], &[1.0, 2.0]), value("b", &[fixed(3)])), "shape");
    assert_has(&e, &["initializer `b` has shape [2]", "declared [3]", "differ in dimension 0: (2) vs (3)"]);
    let e = refused(&add(tensor("b", &[2], &[1.0, 2.0]), value("b", &[fixed(1), fixed(2)])), "rank");
    assert_has(&e, &["differ in rank: (1) vs (2)"]);
    // A symbolic axis, or the same type and shape: the initializer is the input's value.
    for declared in [value("b", &[named("n")]), value("b", &[fixed(2)])] {
        import(&add(tensor("b", &[2], &[1.0, 2.0]), declared), &[]).unwrap();
    }
}

/// Element types against the operators' type constraints, from declared types (inputs,
/// initializers, `value_info`) and types inferred through `Cast`, `Shape` and comparisons: what
/// ONNX refuses is invalid; what ONNX allows and kiln computes only in float is unsupported;
/// a value of unknown type is not checked.
#[test]
fn element_types_outside_the_operators_constraints_are_refused() {
    let x2 = || value("x", &[fixed(2), fixed(2)]);
    let w = || tensor("w", &[2, 2], &[1.0, 0.0, 0.0, 1.0]);
    let cases: Vec<(Vec<u8>, &[&str])> = vec![
        (
            graph(
                vec![node("MatMul", "fc", &["ids", "w"], &["y"], vec![])],
                vec![w()],
                vec![typed("ids", INT64, &[fixed(2), fixed(2)])],
            ),
            &[
                "not supported: ",
                "node `fc` (MatMul): input 0 `ids` is tensor(int64), and kiln computes MatMul in float only",
            ],
        ),
        (
            graph(
                vec![node("MatMul", "fc", &["k", "k"], &["y"], vec![])],
                vec![ints("k", &[1, 2])],
                vec![x2()],
            ),
            &[
                "not supported: ",
                "node `fc` (MatMul): input 0 `k` is tensor(int64), and kiln computes MatMul in float only",
            ],
        ),
        (
            graph(
                vec![node("MatMul", "fc", &["x", "k"], &["y"], vec![])],
                vec![ints("k", &[1, 2])],
                vec![x2()],
            ),
            &[
                "node `fc` (MatMul): input 1 `k` is tensor(int64) and input 0 `x` is tensor(float): B has inconsistent type tensor(int64)",
            ],
        ),
        (
            graph(
                vec![node("Conv", "conv", &["img", "f"], &["y"], vec![])],
                vec![tensor("f", &[1, 1, 1, 1], &[1.0])],
                vec![typed("img", INT64, &[fixed(1), fixed(1), fixed(2), fixed(2)])],
            ),
            &[
                "node `conv` (Conv): input 0 `img` is tensor(int64): X typestr: T, has unsupported type: tensor(int64)",
            ],
        ),
        (
            graph(
                vec![node("Gather", "embed", &["w", "pick"], &["y"], vec![])],
                vec![w(), tensor("pick", &[1], &[0.0])],
                vec![],
            ),
            &[
                "node `embed` (Gather): input 1 `pick` is tensor(float): indices typestr: Tind, has unsupported type: tensor(float)",
            ],
        ),
        (
            graph(vec![node("Where", "sel", &["x", "x", "x"], &["y"], vec![])], vec![], vec![x2()]),
            &[
                "node `sel` (Where): input 0 `x` is tensor(float): condition typestr: B, has unsupported type: tensor(float)",
            ],
        ),
        (
            graph(
                vec![node("Reshape", "flat", &["x", "shape"], &["y"], vec![])],
                vec![TensorProto {
                    name: Some("shape".into()),
                    dims: vec![1],
                    data_type: Some(INT32),
                    int32_data: vec![4],
                    ..Default::default()
                }],
                vec![x2()],
            ),
            &[
                "node `flat` (Reshape): input 1 `shape` is tensor(int32): shape typestr: tensor(int64), has unsupported type: tensor(int32)",
            ],
        ),
        (
            graph(
                vec![node("Relu", "act", &["b"], &["y"], vec![])],
                vec![],
                vec![typed("b", BOOL, &[fixed(2)])],
            ),
            &[
                "node `act` (Relu): input 0 `b` is tensor(bool): X typestr: T, has unsupported type: tensor(bool)",
            ],
        ),
        // Inferred: Cast's `to`, Shape's int64, a comparison's bool.
        (
            graph(
                vec![
                    node("Cast", "c", &["x"], &["xi"], vec![attr_int("to", 7)]),
                    node("MatMul", "fc", &["xi", "xi"], &["y"], vec![]),
                ],
                vec![],
                vec![x2()],
            ),
            &["node `fc` (MatMul): input 0 `xi` is tensor(int64), and kiln computes MatMul in float only"],
        ),
        (
            graph(
                vec![
                    node("Shape", "s", &["x"], &["sh"], vec![]),
                    node("Sigmoid", "act", &["sh"], &["y"], vec![]),
                ],
                vec![],
                vec![x2()],
            ),
            &["node `act` (Sigmoid): input 0 `sh` is tensor(int64)"],
        ),
        (
            graph(
                vec![
                    node("Less", "lt", &["x", "x"], &["m"], vec![]),
                    node("Add", "add", &["m", "x"], &["y"], vec![]),
                ],
                vec![],
                vec![x2()],
            ),
            &[
                "node `add` (Add): input 0 `m` is tensor(bool): A typestr: T, has unsupported type: tensor(bool)",
            ],
        ),
    ];
    for (bytes, want) in cases {
        let e = refused(&bytes, want[want.len() - 1]);
        assert_has(&e, want);
        // What ONNX refuses is invalid; what kiln does not compute, unsupported.
        assert_eq!(e.starts_with("not supported: "), e.contains("kiln computes"), "{e}");
    }
    // Declared in value_info (decoded beside the graph's fields): an intermediate of int64.
    let mut m = model_proto(
        vec![node("Foreign", "f", &["x"], &["h"], vec![]), node("Relu", "act", &["h"], &["y"], vec![])],
        vec![],
        vec![x2()],
        17,
    );
    m.graph.as_mut().unwrap().node[0].domain = Some("com.example".into());
    let mut bytes = m.encode_to_vec();
    // GraphProto.value_info (field 13) appended to the graph (field 7) as a second occurrence,
    // which protobuf merges into the first.
    let info = typed("h", INT64, &[fixed(2), fixed(2)]).encode_to_vec();
    let mut graph_part = Vec::new();
    prost::encoding::encode_key(13, prost::encoding::WireType::LengthDelimited, &mut graph_part);
    prost::encoding::encode_varint(info.len() as u64, &mut graph_part);
    graph_part.extend(&info);
    prost::encoding::encode_key(7, prost::encoding::WireType::LengthDelimited, &mut bytes);
    prost::encoding::encode_varint(graph_part.len() as u64, &mut bytes);
    bytes.extend(&graph_part);
    let e = refused(&bytes, "value_info int64 into Relu");
    assert_has(
        &e,
        &["node `act` (Relu): input 0 `h` is tensor(int64), and kiln computes Relu in float only"],
    );
    // Unknown: the foreign op's output has no declared type, so Relu is not checked (the
    // importer refuses the foreign domain instead).
    let e = refused(&m.encode_to_vec(), "a foreign domain");
    assert_has(&e, &["node `f` (Foreign) is in the domain `com.example`"]);
    // Within the constraints: a comparison's bool selects, int64 indices gather.
    let ok = graph(
        vec![
            node("Less", "lt", &["x", "zero"], &["neg"], vec![]),
            node("Where", "sel", &["neg", "zero", "x"], &["r"], vec![]),
            node("Gather", "g", &["r", "idx"], &["y"], vec![]),
        ],
        vec![tensor("zero", &[], &[0.0]), ints("idx", &[1, 0])],
        vec![x2()],
    );
    let imported = import(&ok, &[]).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = imported.load(&mut cpu, &CompileOptions::default()).unwrap();
    let x = HostTensor::new([2, 2], vec![-1.0, 2.0, 3.0, -4.0]).unwrap();
    assert_eq!(cpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), &[3.0, 0.0, 0.0, 2.0]);
}

/// Every attribute kiln reads must be of the type the operator declares, and its type field
/// must agree with its value field; an attribute appears once.
#[test]
fn attributes_of_the_wrong_type_are_refused() {
    let x4 = || vec![value("x", &[fixed(1), fixed(1), fixed(4), fixed(4)])];
    let f = || vec![tensor("f", &[1, 1, 1, 1], &[1.0])];
    let strides_text =
        graph(vec![node("Conv", "conv", &["x", "f"], &["y"], vec![attr_str("strides", "2,2")])], f(), x4());
    let e = refused(&strides_text, "string strides");
    assert_has(
        &e,
        &[
            "node `conv` (Conv): Mismatched attribute type in 'conv : strides'. Expected: 'INTS', actual: 'STRING'",
            "INTS",
        ],
    );
    let kernel_float = graph(
        vec![node("MaxPool", "pool", &["x"], &["y"], vec![attr_float("kernel_shape", 2.0)])],
        vec![],
        x4(),
    );
    let e = refused(&kernel_float, "float kernel_shape");
    assert_has(
        &e,
        &[
            "node `pool` (MaxPool): Mismatched attribute type in 'pool : kernel_shape'. Expected: 'INTS', actual: 'FLOAT'",
        ],
    );
    let axis_ints =
        graph(vec![node("Softmax", "sm", &["x"], &["y"], vec![attr_ints("axis", &[1])])], vec![], x4());
    let e = refused(&axis_ints, "INTS axis");
    assert_has(&e, &["Mismatched attribute type in 'sm : axis'. Expected: 'INT', actual: 'INTS'"]);
    // The type says INT, the value is a float.
    let lying =
        AttributeProto { name: Some("alpha".into()), f: Some(0.2), r#type: Some(2), ..Default::default() };
    let e =
        refused(&graph(vec![node("LeakyRelu", "lr", &["x"], &["y"], vec![lying])], vec![], x4()), "mismatch");
    assert_has(&e, &["node `lr` (LeakyRelu): type field and data field mismatch in attribute alpha."]);
    let twice = graph(
        vec![node("Softmax", "sm", &["x"], &["y"], vec![attr_int("axis", 1), attr_int("axis", 2)])],
        vec![],
        x4(),
    );
    let e = refused(&twice, "axis twice");
    assert_has(&e, &["node `sm` (Softmax): Attribute 'axis' appeared multiple times."]);
}

/// An attribute the operator requires, missing, is refused naming it; those ONNX gives
/// defaults (Transpose's perm, Gather's axis, Split's sizes) may be left out.
#[test]
fn required_attributes_missing_are_refused() {
    let x = || vec![value("x", &[fixed(1), fixed(4), fixed(2), fixed(2)])];
    let cases: Vec<(NodeProto, &str)> = vec![
        (node("Cast", "c", &["x"], &["y"], vec![]), "node `c` (Cast): Required attribute 'to' is missing."),
        (
            node("Concat", "cat", &["x", "x"], &["y"], vec![]),
            "node `cat` (Concat): Required attribute 'axis' is missing.",
        ),
        (
            node("LRN", "lrn", &["x"], &["y"], vec![attr_float("alpha", 1e-4)]),
            "node `lrn` (LRN): Required attribute 'size' is missing.",
        ),
        (
            node("AveragePool", "pool", &["x"], &["y"], vec![]),
            "node `pool` (AveragePool): Required attribute 'kernel_shape' is missing.",
        ),
        (
            node("DepthToSpace", "d2s", &["x"], &["y"], vec![]),
            "node `d2s` (DepthToSpace): Required attribute 'blocksize' is missing.",
        ),
        (
            node("Constant", "k", &[], &["y"], vec![]),
            "node `k` (Constant): One and only one of the attributes 'value', 'value_*' or 'sparse_value' must be specified for a Constant node. (it has none)",
        ),
        (
            node(
                "Constant",
                "k",
                &[],
                &["y"],
                vec![attr_int("value_int", 1), attr_float("value_float", 1.0)],
            ),
            "(it has value_int, value_float)",
        ),
    ];
    for (n, want) in cases {
        let e = refused(&graph(vec![n], vec![], x()), want);
        assert_has(&e, &[want, "help: "]);
    }
    let defaults = graph(
        vec![
            node("Transpose", "t", &["x"], &["xt"], vec![]),
            node("Split", "s", &["xt"], &["a", "b"], vec![]),
            node("Gather", "g", &["a", "i"], &["y"], vec![]),
        ],
        vec![ints("i", &[0])],
        vec![value("x", &[fixed(2), fixed(4)])],
    );
    import(&defaults, &[]).expect("Transpose, Split and Gather need no attribute");
}

/// A dimension over kiln's limit (1 TiB per tensor), or a shape whose element count overflows,
/// is named as such (it used to surface as "multiplies a scalar" at the MatMul it fed).
#[test]
fn dimensions_over_kilns_limit_are_named() {
    let matmul = |dims: Vec<Dimension>| {
        graph(
            vec![node("MatMul", "fc", &["x", "w"], &["y"], vec![])],
            vec![tensor("w", &[2, 1], &[1.0, 1.0])],
            vec![value("x", &dims)],
        )
    };
    let e = refused(&matmul(vec![fixed(2), fixed(1 << 41)]), "2^41");
    assert_has(
        &e,
        &["dimension 1 of graph input `x` is 2199023255552, larger than kiln's limit 274877906944"],
    );
    assert!(!e.contains("multiplies a scalar"), "{e}");
    let e = refused(&matmul(vec![fixed(1 << 30), fixed(1 << 30), fixed(2)]), "product");
    assert_has(
        &e,
        &["graph input `x` of shape [1073741824, 1073741824, 2] holds more elements than kiln's limit"],
    );
    // A symbolic size given too large.
    let e = import(&matmul(vec![named("N"), fixed(2)]), &[("N".into(), 1 << 40)]).err().unwrap().to_string();
    assert_has(&e, &["dimension 0 of graph input `x` is 1099511627776, larger than kiln's limit"]);
    // An initializer's dimension.
    let mut big = tensor("w", &[1 << 42, 1], &[]);
    big.raw_data = None;
    let e = refused(
        &graph(
            vec![node("MatMul", "fc", &["x", "w"], &["y"], vec![])],
            vec![big],
            vec![value("x", &[fixed(1), fixed(1)])],
        ),
        "initializer",
    );
    assert_has(&e, &["dimension 0 of initializer `w` is 4398046511104, larger than kiln's limit"]);
}

// External data.

const W: [f32; 6] = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5];
const B: [f32; 2] = [0.1, -0.2];

/// x [N, 3] -> MatMul w [3, 2] -> Add b [2] -> y, with `w` and `b` as given.
fn affine(w: TensorProto, b: TensorProto) -> ModelProto {
    model_proto(
        vec![
            node("MatMul", "fc", &["x", "w"], &["h"], vec![]),
            node("Add", "bias", &["h", "b"], &["y"], vec![]),
        ],
        vec![w, b],
        vec![value("x", &[named("N"), fixed(3)])],
        17,
    )
}

/// A float tensor of `dims` kept in `location` at `offset`, `length` bytes long (`None`: no
/// length entry).
fn external(name: &str, dims: &[i64], location: &str, offset: usize, length: Option<usize>) -> TensorProto {
    let entry = |k: &str, v: String| StringStringEntryProto { key: Some(k.into()), value: Some(v) };
    let mut external_data = vec![entry("location", location.into()), entry("offset", offset.to_string())];
    if let Some(l) = length {
        external_data.push(entry("length", l.to_string()));
    }
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(FLOAT),
        data_location: Some(EXTERNAL),
        external_data,
        ..Default::default()
    }
}

fn le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Writes `weights.bin` (16 bytes of padding, W, 8 bytes, B) and the model into `dir`.
fn write_external(dir: &Path, w: TensorProto, b: TensorProto) -> PathBuf {
    let mut data = vec![0xAB; 16];
    data.extend(le(&W));
    data.extend([0xCD; 8]);
    data.extend(le(&B));
    std::fs::write(dir.join("weights.bin"), data).unwrap();
    let path = dir.join("model.onnx");
    std::fs::write(&path, affine(w, b).encode_to_vec()).unwrap();
    path
}

fn run_affine(imported: kiln::onnx::Imported) -> Vec<f32> {
    let mut cpu = CpuBackend::new(0);
    let id = imported.load(&mut cpu, &CompileOptions::default()).unwrap();
    let x = HostTensor::new([2, 3], vec![1.0, 2.0, 3.0, -1.0, 0.5, 4.0]).unwrap();
    cpu.call(id, &[("x", &x)]).unwrap().remove(0).1.data().to_vec()
}

/// A model whose weights live in a file beside it imports from that file (mapped, each
/// tensor a view of its range) and computes what the same model with inline weights does;
/// the model's bytes alone are refused with a pointer to `import_file`.
#[test]
fn external_data_loads_from_the_model_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = write_external(
        dir,
        external("w", &[3, 2], "weights.bin", 16, Some(24)),
        external("b", &[2], "./weights.bin", 48, None),
    );
    let sizes = [("N".to_string(), 2)];
    let from_file = run_affine(import_file(&path, &sizes).unwrap());
    let inline = run_affine(
        import(&affine(tensor("w", &[3, 2], &W), tensor("b", &[2], &B)).encode_to_vec(), &sizes).unwrap(),
    );
    assert_eq!(from_file, inline);
    let want: Vec<f32> = (0..2)
        .flat_map(|r| {
            let x = [[1.0f32, 2.0, 3.0], [-1.0, 0.5, 4.0]][r];
            (0..2).map(move |c| (0..3).map(|k| x[k] * W[k * 2 + c]).sum::<f32>() + B[c])
        })
        .collect();
    assert_eq!(inline, want);
    // As a layer too.
    let layer = kiln::onnx::OnnxLayer::open(&path).unwrap();
    let w = layer.weights.iter().find(|(k, _)| k == "w").unwrap();
    assert_eq!(w.1.data(), &W);
    let e = import(&std::fs::read(&path).unwrap(), &sizes).err().unwrap().to_string();
    assert_has(&e, &["tensor `w` keeps its data in the external file `weights.bin`", "import_file"]);
}

/// `kiln memory` and `kiln train` read a model with external data from its path (the data
/// beside it), as the library does through `OnnxModel::open`: the model is read once, and the
/// functions of `onnx::train` take it where they take bytes.
#[test]
fn the_cli_reads_external_data_beside_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut data = vec![0xAB; 16];
    data.extend(le(&W));
    data.extend([0xCD; 8]);
    data.extend(le(&B));
    std::fs::write(dir.join("weights.bin"), data).unwrap();
    // A batch-1 export (x [1, 3]): `memory` plans it as it is, `train --batch 2` re-batches it.
    let model = model_proto(
        vec![
            node("MatMul", "fc", &["x", "w"], &["h"], vec![]),
            node("Add", "bias", &["h", "b"], &["y"], vec![]),
        ],
        vec![
            external("w", &[3, 2], "weights.bin", 16, Some(24)),
            external("b", &[2], "weights.bin", 48, Some(8)),
        ],
        vec![value("x", &[fixed(1), fixed(3)])],
        17,
    );
    let path = dir.join("model.onnx");
    std::fs::write(&path, model.encode_to_vec()).unwrap();
    let kiln = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "kiln {}:\n{stdout}\n{stderr}", args.join(" "));
        stdout.into_owned()
    };
    let file = path.to_str().unwrap();
    let memory = kiln(&["memory", file, "--mode", "forward"]);
    assert!(!memory.contains("import_file"), "{memory}");
    let train = kiln(&["train", file, "--steps", "2", "--batch", "2", "--cpu"]);
    assert_has(&train, &["step    1: loss", "step    2: loss", "trained 2 steps (x [2, 3], y [2, 2])"]);
    // The library: the functions of `onnx::train` take the model read once.
    let model = kiln::onnx::OnnxModel::open(&path).unwrap();
    let sizes = kiln::onnx::train::sizes(&model, Some(2), &[]).unwrap();
    let (x, y) = kiln::onnx::train::shapes(&model, &sizes).unwrap();
    assert_eq!((x, y), (Shape::new([2, 3]), Shape::new([2, 2])));
    let w = model.layer().unwrap().weights.into_iter().find(|(k, _)| k == "w").unwrap().1;
    assert_eq!(w.data(), &W);
    // Its bytes alone are refused, pointing to the path.
    let e = kiln::onnx::train::shapes(&std::fs::read(&path).unwrap(), &sizes).err().unwrap().to_string();
    assert_has(&e, &["keeps its data in the external file `weights.bin`", "OnnxModel::open"]);
}

/// The refusal `import_file` gives a model whose `w` is `w`, in `dir`.
fn refused_external(dir: &Path, w: TensorProto) -> String {
    let path = write_external(dir, w, tensor("b", &[2], &B));
    let e = import_file(&path, &[("N".into(), 2)]).err().expect("refused").to_string();
    assert!(e.starts_with(&format!("{}: ", path.display())), "names the file: {e}");
    e
}

#[test]
fn external_data_at_an_absolute_path_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let target = dir.join("weights.bin");
    let e = refused_external(dir, external("w", &[3, 2], target.to_str().unwrap(), 16, Some(24)));
    assert_has(
        &e,
        &[
            "Location of external TensorProto ( tensor name: w) should be a relative path, but it is an absolute path",
        ],
    );
}

#[test]
fn external_data_outside_the_model_directory_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let inner = dir.join("model");
    std::fs::create_dir_all(&inner).unwrap();
    std::fs::write(dir.join("secret.bin"), le(&W)).unwrap();
    for location in ["../secret.bin", "sub/../../secret.bin"] {
        let e = refused_external(&inner, external("w", &[3, 2], location, 0, Some(24)));
        assert_has(&e, &[&format!("but the '{location}' points outside the directory")]);
    }
}

#[test]
#[cfg(unix)]
fn external_data_through_a_symbolic_link_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (inner, outside) = (dir.join("model"), dir.join("outside"));
    std::fs::create_dir_all(&inner).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join("secret.bin"), le(&W)).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.bin"), inner.join("link.bin")).unwrap();
    let e = refused_external(&inner, external("w", &[3, 2], "link.bin", 0, Some(24)));
    assert_has(
        &e,
        &["Data of TensorProto ( tensor name: w) should be stored in", "but it is not regular file."],
    );
    // A linked directory on the way: its canonical path is outside.
    std::os::unix::fs::symlink(&outside, inner.join("sub")).unwrap();
    let e = refused_external(&inner, external("w", &[3, 2], "sub/secret.bin", 0, Some(24)));
    assert_has(&e, &["but the 'sub/secret.bin' points outside the directory"]);
}

#[test]
fn external_data_past_the_end_of_its_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // weights.bin holds 56 bytes.
    let e = refused_external(dir, external("w", &[3, 2], "weights.bin", 40, Some(24)));
    assert_has(
        &e,
        &[
            "tensor `w`: its external data at offset 40, 24 bytes long, runs past the end of `weights.bin` (56 bytes)",
        ],
    );
    let e = refused_external(dir, external("w", &[3, 2], "weights.bin", usize::MAX, None));
    assert_has(&e, &["runs past the end"]);
}

#[test]
fn external_data_of_a_length_other_than_the_tensors_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let e = refused_external(dir, external("w", &[3, 2], "weights.bin", 16, Some(20)));
    assert_has(
        &e,
        &[
            "tensor `w`: its external data's length is 20 bytes, but its shape [3, 2] of tensor(float) (4 bytes each) holds 24",
        ],
    );
}

/// A bool graph input (an exported attention or padding mask) is a bool input of kiln's, fed
/// as bools, and selects with `Where`.
#[test]
fn a_bool_mask_input_selects_with_where() {
    let bytes = graph(
        vec![node("Where", "mask", &["keep", "x", "fill"], &["y"], vec![])],
        vec![tensor("fill", &[], &[-9.0])],
        vec![typed("keep", BOOL, &[fixed(2), fixed(3)]), value("x", &[fixed(2), fixed(3)])],
    );
    let imported = import(&bytes, &[]).unwrap();
    let keep = imported.graph.input("keep").expect("the mask is an input");
    assert_eq!(imported.graph.node(keep).dtype, DType::Bool);
    let mut cpu = CpuBackend::new(0);
    let id = imported.load(&mut cpu, &CompileOptions::default()).unwrap();
    let mask = HostTensor::from_bool([2, 3], vec![true, false, true, false, false, true]).unwrap();
    let x = HostTensor::new([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    let y = cpu.call(id, &[("keep", &mask), ("x", &x)]).unwrap().remove(0).1;
    assert_eq!(y.data(), &[1.0, -9.0, 3.0, -9.0, -9.0, 6.0]);
}

/// `--batch N` on a file exported with a fixed batch other than 1 (and not N) is an error
/// naming the file's batch and both ways out, from the library (`train::sizes`, where the CLI's
/// `--batch` reaches the importer) and from `kiln memory`; a symbolic or batch-1 export takes it.
#[test]
fn a_batch_that_cannot_apply_is_an_error() {
    let fixed_batch = graph(
        vec![node("Relu", "act", &["x"], &["y"], vec![])],
        vec![],
        vec![value("x", &[fixed(2), fixed(4)])],
    );
    let e = kiln::onnx::train::sizes(&fixed_batch, Some(8), &[])
        .expect_err("batch 8 on a batch-2 export")
        .to_string();
    assert_has(
        &e,
        &[
            "--batch 8 cannot apply: the file's inputs have a fixed batch of 2",
            "`x` (2)",
            "re-export the model with a dynamic batch axis",
            "or pass --batch 2",
        ],
    );
    kiln::onnx::train::sizes(&fixed_batch, Some(2), &[]).expect("its own batch applies");
    for first in [fixed(1), named("batch")] {
        let ok = graph(
            vec![node("Relu", "act", &["x"], &["y"], vec![])],
            vec![],
            vec![value("x", &[first, fixed(4)])],
        );
        let sizes = kiln::onnx::train::sizes(&ok, Some(8), &[]).unwrap();
        assert_eq!(import(&ok, &sizes).unwrap().inputs[0].1, Shape::new([8, 4]));
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let path = dir.join("fixed.onnx");
    std::fs::write(&path, &fixed_batch).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["memory", path.to_str().unwrap(), "--batch", "8"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stdout));
    assert_has(&String::from_utf8_lossy(&out.stderr), &["fixed batch of 2", "--batch 2"]);
}

/// `Imported::load` (compile, load, write every weight) is the documented way to run an
/// import: its program computes the file's values; a plan loaded by hand without the weights
/// computes with zeros, which `load_into` then fixes.
#[test]
fn an_imported_model_runs_with_its_weights_through_load() {
    let bytes = affine(tensor("w", &[3, 2], &W), tensor("b", &[2], &B)).encode_to_vec();
    let sizes = [("N".to_string(), 2)];
    // y = x · W + B, by hand.
    let x = [[1.0f32, 2.0, 3.0], [-1.0, 0.5, 4.0]];
    let want: Vec<f32> = x
        .iter()
        .flat_map(|r| (0..2).map(move |c| (0..3).map(|k| r[k] * W[k * 2 + c]).sum::<f32>() + B[c]))
        .collect();
    let got = run_affine(import(&bytes, &sizes).unwrap());
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
    // By hand: without the weights the program adds nothing and multiplies by zeros.
    let imported = import(&bytes, &sizes).unwrap();
    let plan = compile(imported.graph.clone(), &CompileOptions::default()).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    let x = HostTensor::new([2, 3], vec![1.0, 2.0, 3.0, -1.0, 0.5, 4.0]).unwrap();
    assert_eq!(cpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), &[0.0; 4]);
    imported.load_into(&mut cpu).unwrap();
    assert_eq!(cpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), got.as_slice());
    // Into a backend that never loaded the graph: an error naming the weight.
    let e = imported.load_into(&mut CpuBackend::new(0)).err().unwrap().to_string();
    assert_has(&e, &["cannot write the imported weight `w`"]);
}
