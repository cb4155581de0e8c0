//! `kiln train` on the inputs transformer exports have: int64 `input_ids` that index an
//! embedding table and an `attention_mask` (int64 or bool) beside them. The models are written
//! here with the schema's messages (no Python), trained through the library (`onnx::train`) and
//! through the `kiln` binary, on random data and on a `--data` safetensors batch.

use kiln::onnx::proto::*;
use kiln::prelude::*;
use prost::Message;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::Path;

#[path = "common/onnx_proto.rs"]
mod onnx_proto;
use onnx_proto::*;

/// Rows of the embedding table: every id lies in [0, VOCAB).
const VOCAB: i64 = 16;
const WIDTH: i64 = 4;
const OUT: i64 = 3;

fn values(n: i64, seed: i64) -> Vec<f32> {
    (0..n).map(|i| (((i + seed) * 7 % 11) as f32 - 5.0) / 10.0).collect()
}

/// A tiny BERT: `input_ids` int64 [batch, S] -> Gather from `embeddings` [VOCAB, WIDTH]; an
/// `attention_mask` (int64, or bool when `bool_mask`) [batch, S] -> Cast to float -> Unsqueeze
/// -> times a learned scale, added to the embeddings -> MatMul [WIDTH, OUT] -> `out`
/// [batch, S, OUT]. Without `mask`, the ids alone (a GPT-2 of one input).
fn tiny_bert(mask: bool, bool_mask: bool) -> Vec<u8> {
    let mut nodes = vec![node("Gather", "embed", &["embeddings", "input_ids"], &["h"], vec![])];
    let mut input = vec![typed("input_ids", INT64, &[named("batch"), named("S")])];
    let mut initializer = vec![
        tensor("embeddings", &[VOCAB, WIDTH], &values(VOCAB * WIDTH, 1)),
        tensor("head", &[WIDTH, OUT], &values(WIDTH * OUT, 3)),
    ];
    let hidden = if mask {
        input.push(typed(
            "attention_mask",
            if bool_mask { BOOL } else { INT64 },
            &[named("batch"), named("S")],
        ));
        initializer.push(ints("axes", &[2]));
        initializer.push(tensor("scale", &[WIDTH], &[0.5, -0.25, 1.0, 0.75]));
        nodes.extend([
            node("Cast", "mask_float", &["attention_mask"], &["m"], vec![attr_int("to", 1)]),
            node("Unsqueeze", "mask_axis", &["m", "axes"], &["m3"], vec![]),
            node("Mul", "mask_term", &["m3", "scale"], &["term"], vec![]),
            node("Add", "masked", &["h", "term"], &["h2"], vec![]),
        ]);
        "h2"
    } else {
        "h"
    };
    nodes.push(node("MatMul", "head", &[hidden, "head"], &["out"], vec![]));
    ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some("tiny_bert".into()),
            node: nodes,
            initializer,
            input,
            output: vec![typed("out", FLOAT, &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
    }
    .encode_to_vec()
}

fn sizes() -> Vec<(String, usize)> {
    vec![("batch".into(), 2), ("S".into(), 8)]
}

/// The `kiln` binary's status, stdout and stderr.
fn kiln(args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A safetensors batch of `input_ids` (int64), an int64 `attention_mask` and f32 targets `y`.
fn write_batch(path: &Path, ids: &[i64]) {
    let ids: Vec<u8> = ids.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mask: Vec<u8> = (0..16i64).flat_map(|i| i64::from(i % 8 < 6).to_le_bytes()).collect();
    let y: Vec<u8> = values(2 * 8 * OUT, 5).iter().flat_map(|v| v.to_le_bytes()).collect();
    let views = [
        ("input_ids", TensorView::new(Dtype::I64, vec![2, 8], &ids).unwrap()),
        ("attention_mask", TensorView::new(Dtype::I64, vec![2, 8], &mask).unwrap()),
        ("y", TensorView::new(Dtype::F32, vec![2, 8, OUT as usize], &y).unwrap()),
    ];
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// The library finds the table each id input indexes, draws ids inside it and masks of ones,
/// and trains a model of ids and a mask (int64 or bool) as one layer: finite losses that fall.
#[test]
fn a_model_of_ids_and_a_mask_trains_through_the_library() {
    let bytes = tiny_bert(true, false);
    let inputs = kiln::onnx::train::inputs(&bytes, &sizes()).unwrap();
    let summary: Vec<_> =
        inputs.iter().map(|i| (i.name.as_str(), i.dtype, i.table_rows, i.is_mask())).collect();
    assert_eq!(
        summary,
        [("input_ids", DType::I64, Some(VOCAB as usize), false), ("attention_mask", DType::I64, None, true)]
    );
    // The layer packs both inputs, rows together: 8 ids and 8 mask values a row.
    let (x, y) = kiln::onnx::train::shapes(&bytes, &sizes()).unwrap();
    assert_eq!((x, y), (Shape::new([2, 16]), Shape::new([2, 8, 3])));
    for bool_mask in [false, true] {
        let bytes = tiny_bert(true, bool_mask);
        let run = kiln::onnx::train::train(&bytes, &sizes(), 3, &Device::cpu(), None, |_, _| {}).unwrap();
        let l = &run.losses;
        assert!(l.iter().all(|v| v.is_finite()) && l[2] < l[0], "bool mask {bool_mask}: {l:?}");
        let text = kiln::onnx::train::summary(&run);
        assert!(text.contains("input_ids i64[2, 8], attention_mask"), "{text}");
    }
    // The ids alone (one integer input): the layer's input is the ids themselves.
    let bytes = tiny_bert(false, false);
    let (x, _) = kiln::onnx::train::specs(&bytes, &sizes()).unwrap();
    assert_eq!((x.shape, x.dtype), (Shape::new([2, 8]), DType::I64));
    let mut run = kiln::onnx::train::train(&bytes, &sizes(), 3, &Device::cpu(), None, |_, _| {}).unwrap();
    assert!(run.losses.iter().all(|v| v.is_finite()) && run.losses[2] < run.losses[0], "{:?}", run.losses);
    // More steps on the same batch go on lowering the loss.
    let loss = run.step().unwrap();
    assert_eq!(run.losses.len(), 4);
    assert!(loss.is_finite() && loss < run.losses[2], "{:?}", run.losses);
}

/// `kiln train` takes the model of ids and a mask, on random data and on a `--data` batch of
/// int64 tensors named as the model's inputs; an id outside the table is an error naming the
/// input, not a crash.
#[test]
fn the_cli_trains_a_model_of_ids_and_a_mask() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("tiny_bert.onnx");
    std::fs::write(&model, tiny_bert(true, false)).unwrap();
    let file = model.to_str().unwrap();
    let args = ["train", file, "--batch", "2", "--steps", "2", "--cpu", "--dim", "S=8"];
    let (ok, stdout, stderr) = kiln(&args);
    assert!(ok, "{stdout}\n{stderr}");
    for want in
        ["step    1: loss", "step    2: loss", "input_ids i64[2, 8], attention_mask i64[2, 8], y [2, 8, 3]"]
    {
        assert!(stdout.contains(want), "`{want}` in:\n{stdout}");
    }
    // A batch from a file.
    let data = tmp.path().join("batch.safetensors");
    let ids: Vec<i64> = (0..16).map(|i| (i * 5) % VOCAB).collect();
    write_batch(&data, &ids);
    let mut with_data = args.to_vec();
    with_data.extend(["--data", data.to_str().unwrap()]);
    let (ok, stdout, stderr) = kiln(&with_data);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("step    2: loss"), "{stdout}");
    // An id the table does not hold.
    let mut bad = ids.clone();
    bad[3] = 99;
    write_batch(&data, &bad);
    let (ok, stdout, stderr) = kiln(&with_data);
    assert!(!ok, "{stdout}");
    assert!(
        stderr.contains("error:") && stderr.contains("`input_ids` holds 99") && stderr.contains("16 rows"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// `kiln memory --mode train` plans the step `kiln train` runs, for models of ids and masks too.
#[test]
fn the_cli_plans_a_training_step_of_a_model_of_ids_and_a_mask() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, bool_mask) in [("tiny_bert_plan.onnx", false), ("tiny_bert_plan_bool.onnx", true)] {
        let model = tmp.path().join(name);
        std::fs::write(&model, tiny_bert(true, bool_mask)).unwrap();
        let file = model.to_str().unwrap();
        let (ok, stdout, stderr) = kiln(&["memory", file, "--mode", "train", "--batch", "2", "--dim", "S=8"]);
        assert!(ok, "{stdout}\n{stderr}");
        assert!(stdout.contains("train") && stdout.contains("arena"), "{stdout}");
    }
}

/// `--data` files hold I32 ids and BOOL masks as well, and `x` names the one input of a model
/// of one; a tensor that is no input of the model is an error naming it.
#[test]
fn data_files_of_int32_ids_bool_masks_and_x() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("int32_bool.safetensors");
    let ids: Vec<u8> = (0..16i32).flat_map(|i| (i % 16).to_le_bytes()).collect();
    let mask: Vec<u8> = (0..16).map(|i| u8::from(i % 8 < 5)).collect();
    let y: Vec<u8> = values(2 * 8 * OUT, 2).iter().flat_map(|v| v.to_le_bytes()).collect();
    let y_view = || TensorView::new(Dtype::F32, vec![2, 8, OUT as usize], &y).unwrap();
    let write = |names: [&str; 2]| {
        let views = [
            (names[0], TensorView::new(Dtype::I32, vec![2, 8], &ids).unwrap()),
            (names[1], TensorView::new(Dtype::BOOL, vec![2, 8], &mask).unwrap()),
            ("y", y_view()),
        ];
        safetensors::serialize_to_file(views, None, &path).unwrap();
    };
    write(["input_ids", "attention_mask"]);
    let batch = kiln::onnx::train::read_data(&path).unwrap();
    let dtypes: Vec<_> = batch.inputs.iter().map(|(n, t)| (n.as_str(), t.dtype())).collect();
    assert_eq!(dtypes, [("attention_mask", DType::Bool), ("input_ids", DType::I32)]);
    let run =
        kiln::onnx::train::train(&tiny_bert(true, true), &sizes(), 2, &Device::cpu(), Some(batch), |_, _| {})
            .unwrap();
    assert!(run.losses.iter().all(|v| v.is_finite()), "{:?}", run.losses);
    // A name the model does not have.
    write(["input_ids", "attention"]);
    let batch = kiln::onnx::train::read_data(&path).unwrap();
    let e =
        kiln::onnx::train::train(&tiny_bert(true, true), &sizes(), 1, &Device::cpu(), Some(batch), |_, _| {})
            .err()
            .unwrap()
            .to_string();
    assert!(e.contains("`attention`, which is no input of the model"), "{e}");
    // `x` for the ids of a model of one input.
    let views = [("x", TensorView::new(Dtype::I32, vec![2, 8], &ids).unwrap()), ("y", y_view())];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let batch = kiln::onnx::train::read_data(&path).unwrap();
    let run = kiln::onnx::train::train(
        &tiny_bert(false, false),
        &sizes(),
        2,
        &Device::cpu(),
        Some(batch),
        |_, _| {},
    )
    .unwrap();
    assert!(run.losses.iter().all(|v| v.is_finite()), "{:?}", run.losses);
}

/// A training-mode export's random ops: `Dropout` with `training_mode` true and stochastic
/// depth's `RandomUniformLike` -> `GreaterOrEqual` -> `Cast` -> `Div` -> `Mul` (torchvision's
/// EfficientNet), x [batch, 4] -> MatMul [4, 3] -> `out`.
fn training_export() -> Vec<u8> {
    let training_mode = TensorProto {
        name: Some("training_mode".into()),
        dims: vec![],
        data_type: Some(BOOL),
        int32_data: vec![1],
        ..Default::default()
    };
    let nodes = vec![
        node("MatMul", "dense", &["x", "w"], &["h"], vec![]),
        node("Dropout", "drop", &["h", "ratio", "training_mode"], &["d"], vec![]),
        node("RandomUniformLike", "draw", &["keep_shape"], &["u"], vec![]),
        node("GreaterOrEqual", "survives", &["u", "p"], &["s"], vec![]),
        node("Cast", "as_float", &["s"], &["sf"], vec![attr_int("to", 1)]),
        node("Div", "rescale", &["sf", "q"], &["scale"], vec![]),
        node("Mul", "depth", &["d", "scale"], &["out"], vec![]),
    ];
    let initializer = vec![
        tensor("w", &[4, 3], &values(12, 2)),
        tensor("ratio", &[], &[0.25]),
        training_mode,
        tensor("keep_shape", &[2, 1], &[0.0, 0.0]),
        tensor("p", &[], &[0.2]),
        tensor("q", &[], &[0.8]),
    ];
    ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some("training_export".into()),
            node: nodes,
            initializer,
            input: vec![typed(
                "x",
                FLOAT,
                &[named("batch"), Dimension { dim_value: Some(4), dim_param: None }],
            )],
            output: vec![typed("out", FLOAT, &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
    }
    .encode_to_vec()
}

/// `kiln memory --mode train` and `kiln train` take a training-mode export: its dropout drops
/// and its `RandomUniformLike` draws from kiln's generator in the step (an inference import
/// refuses a dropout in training mode).
#[test]
fn a_training_mode_export_with_dropout_and_stochastic_depth_plans_and_trains() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("training_export.onnx");
    std::fs::write(&model, training_export()).unwrap();
    let file = model.to_str().unwrap();
    let (ok, stdout, stderr) = kiln(&["memory", file, "--mode", "train", "--batch", "2"]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("train") && stdout.contains("arena"), "{stdout}");
    let (ok, stdout, stderr) = kiln(&["train", file, "--batch", "2", "--steps", "3", "--cpu"]);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(stdout.contains("step    3: loss"), "{stdout}");
    assert!(!stdout.contains("NaN") && !stdout.contains("inf"), "{stdout}");
}

/// One `.npy` array: version 1.0 header (`descr`, C or Fortran order, shape), then `data`.
fn npy(descr: &str, fortran: bool, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape = if dims.len() == 1 { format!("({},)", dims[0]) } else { format!("({})", dims.join(", ")) };
    let order = if fortran { "True" } else { "False" };
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': {order}, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// An `.npz` of `arrays` (name, .npy bytes), each stored or deflated as `np.savez` and
/// `np.savez_compressed` write them.
fn write_npz(path: &Path, arrays: &[(&str, Vec<u8>)], deflated: bool) {
    use std::io::Write;
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).unwrap());
    let method = if deflated { zip::CompressionMethod::Deflated } else { zip::CompressionMethod::Stored };
    let options = zip::write::SimpleFileOptions::default().compression_method(method);
    for (name, bytes) in arrays {
        zip.start_file(format!("{name}.npy"), options).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap();
}

/// `--data` takes NumPy's `.npz` as well (stored or deflated): int64 ids, a bool mask and f32
/// targets train the model of ids and a mask; an array of another dtype, in Fortran order,
/// big-endian or shorter than its shape is an error naming the array, not a crash.
#[test]
fn data_files_from_numpy_npz() {
    let tmp = tempfile::tempdir().unwrap();
    let ids: Vec<u8> = (0..16i64).flat_map(|i| ((i * 3) % VOCAB).to_le_bytes()).collect();
    let mask: Vec<u8> = (0..16).map(|i| u8::from(i % 8 < 6)).collect();
    let y: Vec<u8> = values(2 * 8 * OUT, 4).iter().flat_map(|v| v.to_le_bytes()).collect();
    let y_shape = [2, 8, OUT as usize];
    let path = tmp.path().join("batch.npz");
    for deflated in [false, true] {
        let arrays = [
            ("input_ids", npy("<i8", false, &[2, 8], &ids)),
            ("attention_mask", npy("|b1", false, &[2, 8], &mask)),
            ("y", npy("<f4", false, &y_shape, &y)),
        ];
        write_npz(&path, &arrays, deflated);
        let batch = kiln::onnx::train::read_data(&path).unwrap();
        let dtypes: Vec<_> = batch.inputs.iter().map(|(n, t)| (n.as_str(), t.dtype())).collect();
        assert_eq!(dtypes, [("attention_mask", DType::Bool), ("input_ids", DType::I64)]);
        assert_eq!(batch.y.shape(), &Shape::new(y_shape));
        let run = kiln::onnx::train::train(
            &tiny_bert(true, true),
            &sizes(),
            2,
            &Device::cpu(),
            Some(batch),
            |_, _| {},
        )
        .unwrap();
        assert!(run.losses.iter().all(|v| v.is_finite()), "deflated {deflated}: {:?}", run.losses);
    }
    let f64s: Vec<u8> = (0..16).flat_map(|i| f64::from(i).to_le_bytes()).collect();
    let big: Vec<u8> = (0..16i64).flat_map(|i| i.to_be_bytes()).collect();
    for (array, want) in [
        (npy("<c8", false, &[2, 8], &f64s), "is <c8"),
        (npy("<i8", true, &[2, 8], &ids), "Fortran order"),
        (npy(">i8", false, &[2, 8], &big), "big-endian"),
        (npy("<i8", false, &[2, 8, 1000000000000], &ids), "stores 128 bytes"),
        (b"not an array".to_vec(), "no .npy header"),
    ] {
        write_npz(&path, &[("input_ids", array), ("y", npy("<f4", false, &y_shape, &y))], false);
        let e = kiln::onnx::train::read_data(&path).err().unwrap().to_string();
        assert!(e.contains("array `input_ids`") && e.contains(want) && e.contains("np.savez"), "{e}");
    }
    // float64, NumPy's default, is read rounded to f32.
    write_npz(
        &path,
        &[("input_ids", npy("<i8", false, &[2, 8], &ids)), ("y", npy("<f8", false, &[2, 8], &f64s))],
        false,
    );
    let batch = kiln::onnx::train::read_data(&path).unwrap();
    assert_eq!(batch.y.data(), (0..16).map(|i| i as f32).collect::<Vec<_>>());
}
