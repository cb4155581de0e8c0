//! Running an ONNX model on given inputs: `kiln::onnx::runner::Runner` from the library and
//! `kiln run` from the command line, on a model written here with the schema's messages (a
//! dense layer with ReLU on float features, and an embedding lookup of int64 ids), inputs and
//! outputs through .npz, .npy and safetensors files (`kiln::onnx::tensors`).

use kiln::onnx::proto::*;
use kiln::onnx::runner::{Runner, RunnerOptions};
use kiln::onnx::tensors;
use kiln::prelude::*;
use prost::Message;
use std::path::Path;

#[path = "common/onnx_proto.rs"]
mod onnx_proto;
use onnx_proto::*;

const W: [f32; 6] = [0.5, -1.0, 2.0, 0.25, -0.75, 1.5];
const B: [f32; 2] = [0.125, -0.5];
const TABLE: [f32; 8] = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];

/// `y = relu(x · W + b)` for x f32 [batch, 3], and `e = table[ids]` for ids int64 [batch].
fn model(dir: &Path) -> std::path::PathBuf {
    let fixed = |n: i64| Dimension { dim_value: Some(n), dim_param: None };
    let proto = ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some("two_heads".into()),
            node: vec![
                node("MatMul", "dense", &["x", "w"], &["xw"], vec![]),
                node("Add", "bias", &["xw", "b"], &["pre"], vec![]),
                node("Relu", "relu", &["pre"], &["y"], vec![]),
                node("Gather", "embed", &["table", "ids"], &["e"], vec![]),
            ],
            initializer: vec![
                tensor("w", &[3, 2], &W),
                tensor("b", &[2], &B),
                tensor("table", &[4, 2], &TABLE),
            ],
            input: vec![
                typed("x", FLOAT, &[named("batch"), fixed(3)]),
                typed("ids", INT64, &[named("batch")]),
            ],
            output: vec![typed("y", FLOAT, &[]), typed("e", FLOAT, &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(17) }],
    };
    let path = dir.join("two_heads.onnx");
    std::fs::write(&path, proto.encode_to_vec()).unwrap();
    path
}

/// The outputs the model means for `x` (rows of 3) and `ids`.
fn expected(x: &[f32], ids: &[i64]) -> (Vec<f32>, Vec<f32>) {
    let y = x
        .chunks(3)
        .flat_map(|r| (0..2).map(move |j| (r[0] * W[j] + r[1] * W[2 + j] + r[2] * W[4 + j] + B[j]).max(0.0)))
        .collect();
    let e = ids.iter().flat_map(|&i| TABLE[i as usize * 2..i as usize * 2 + 2].to_vec()).collect();
    (y, e)
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{what} element {i}: {g}, expected {w}");
    }
}

#[test]
fn a_runner_runs_the_model_on_named_inputs_and_converts_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let mut runner = Runner::open(model(tmp.path()), &RunnerOptions::default().batch(3)).unwrap();
    let declared: Vec<(String, DType, Shape)> =
        runner.inputs().iter().map(|i| (i.name.clone(), i.dtype, i.shape.clone())).collect();
    assert_eq!(
        declared,
        [("x".to_string(), DType::F32, Shape::new([3, 3])), ("ids".to_string(), DType::I64, Shape::new([3]))]
    );
    assert_eq!(runner.outputs(), ["y", "e"]);
    let xv = vec![1.0, -2.0, 0.5, 0.25, 0.75, -1.0, 3.0, 1.0, 2.0];
    let x = HostTensor::new([3, 3], xv.clone()).unwrap();
    // int32 ids for an int64 input: converted.
    let ids = HostTensor::from_i32([3], vec![3, 0, 2]).unwrap();
    let out = runner.run(&[("ids", &ids), ("x", &x)]).unwrap();
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["y", "e"], "outputs in the file's order");
    let (y, e) = expected(&xv, &[3, 0, 2]);
    close(out[0].1.data(), &y, "y");
    close(out[1].1.data(), &e, "e");
    // Twice: a runner runs as often as asked.
    let again = runner.run(&[("x", &x), ("ids", &ids)]).unwrap();
    assert_eq!(again, out);
    // A profile times every kernel of a run, in step order, and leaves the run's results.
    let rows = runner.profile(&[("x", &x), ("ids", &ids)], 3).unwrap();
    assert!(!rows.is_empty());
    assert!(rows.windows(2).all(|w| w[0].step < w[1].step), "{rows:?}");
    assert!(rows.iter().all(|r| r.ms >= 0.0 && !r.op.is_empty() && !r.kernel.is_empty()), "{rows:?}");
    assert_eq!(runner.run(&[("x", &x), ("ids", &ids)]).unwrap(), out);
}

#[test]
fn a_runner_refuses_inputs_the_model_does_not_take_with_what_to_do() {
    let tmp = tempfile::tempdir().unwrap();
    let mut runner = Runner::open(model(tmp.path()), &RunnerOptions::default().batch(2)).unwrap();
    let x = HostTensor::zeros([2, 3]).unwrap();
    let ids = HostTensor::from_i64([2], vec![1, 2]).unwrap();
    let mut message = |feeds: &[(&str, &HostTensor)]| runner.run(feeds).unwrap_err().to_string();
    let wrong_shape = HostTensor::zeros([4, 3]).unwrap();
    let float_ids = HostTensor::new([2], vec![1.0, 2.0]).unwrap();
    type Case<'a> = (Vec<(&'a str, &'a HostTensor)>, &'a [&'a str]);
    let cases: [Case; 5] = [
        (vec![("x", &x), ("ids", &ids), ("z", &x)], &["no input `z`", "`x` f32 [2, 3]", "`ids` i64 [2]"]),
        (vec![("x", &x)], &["input `ids` is not fed", "--input"]),
        (vec![("x", &x), ("x", &x), ("ids", &ids)], &["input `x` is fed 2 times"]),
        (
            vec![("x", &wrong_shape), ("ids", &ids)],
            &["input `x` is [4, 3] but the model takes [2, 3]", "--batch"],
        ),
        (
            vec![("x", &x), ("ids", &float_ids)],
            &["input `ids` holds f32 values but the model takes i64", "store `ids` as i64"],
        ),
    ];
    for (feeds, wants) in cases {
        let m = message(&feeds);
        for want in wants {
            assert!(m.contains(want), "{m:?} lacks {want:?}");
        }
    }
}

#[test]
fn tensor_files_keep_names_shapes_and_types() {
    let tmp = tempfile::tempdir().unwrap();
    let tensors = vec![
        ("a".to_string(), HostTensor::new([2, 3], vec![1.5, -2.0, 0.0, 3.25, 1e-7, -1e7]).unwrap()),
        ("b".to_string(), HostTensor::from_i64([4], vec![-3, 0, 1 << 40, 7]).unwrap()),
        ("c".to_string(), HostTensor::from_i32([2, 1], vec![-5, 9]).unwrap()),
        ("d".to_string(), HostTensor::from_bool([3], vec![true, false, true]).unwrap()),
    ];
    let npz = tmp.path().join("t.npz");
    tensors::write(&npz, &tensors).unwrap();
    let back = tensors::read(&npz).unwrap();
    assert_eq!(back.into_iter().collect::<Vec<_>>(), tensors);
    let npy = tmp.path().join("ids.npy");
    tensors::write(&npy, &tensors[1..2]).unwrap();
    assert_eq!(
        tensors::read(&npy).unwrap().into_iter().collect::<Vec<_>>(),
        [("ids".to_string(), tensors[1].1.clone())]
    );
    let st = tmp.path().join("t.safetensors");
    tensors::write(&st, &tensors[..1]).unwrap();
    assert_eq!(tensors::read(&st).unwrap()["a"], tensors[0].1);
    let err = tensors::write(&tmp.path().join("ids.safetensors"), &tensors[1..2]).unwrap_err().to_string();
    assert!(err.contains("`b` is i64") && err.contains(".npz"), "{err}");
    let err = tensors::write(&tmp.path().join("two.npy"), &tensors).unwrap_err().to_string();
    assert!(err.contains("an .npy file holds one array") && err.contains(".npz"), "{err}");
    let err = tensors::write(&tmp.path().join("t.csv"), &tensors).unwrap_err().to_string();
    assert!(err.contains("no writer for the extension `.csv`"), "{err}");
}

#[test]
fn kiln_run_reads_inputs_writes_outputs_and_times_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let path = model(tmp.path());
    let xv = vec![0.5, 1.0, -1.5, 2.0, -0.25, 0.75];
    let inputs = tmp.path().join("x.npz");
    tensors::write(&inputs, &[("x".to_string(), HostTensor::new([2, 3], xv.clone()).unwrap())]).unwrap();
    let ids = tmp.path().join("ids.npy");
    tensors::write(&ids, &[("ids".to_string(), HostTensor::from_i64([2], vec![1, 3]).unwrap())]).unwrap();
    let outputs = tmp.path().join("out.npz");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kiln"))
        .arg("run")
        .arg(&path)
        .arg("--input")
        .arg(&inputs)
        .arg("--input")
        .arg(&ids)
        .arg("--output")
        .arg(&outputs)
        .args(["--batch", "2", "--bench", "3", "--profile", "2", "--threads", "1", "--device", "cpu"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let wants = [
        "input  x f32 [2, 3]",
        "input  ids i64 [2]",
        "output y f32 [2, 2]",
        "3 runs: median",
        "medians of 2 runs",
    ];
    for want in wants {
        assert!(stdout.contains(want), "{stdout} lacks {want:?}");
    }
    let got = tensors::read(&outputs).unwrap();
    let (y, e) = expected(&xv, &[1, 3]);
    close(got["y"].data(), &y, "y");
    close(got["e"].data(), &e, "e");
}

/// An `.npy` file of `descr` elements (`<f8`, `<f2`) of `shape` holding `data`, as NumPy writes it.
fn npy_bytes(descr: &str, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let mut dict =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({},), }}", dims.join(", "));
    while (10 + dict.len() + 1) % 64 != 0 {
        dict.push(' ');
    }
    dict.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((dict.len() as u16).to_le_bytes());
    out.extend(dict.as_bytes());
    out.extend(data);
    out
}

/// NumPy's default float64 and float16 arrays are read as f32 (rounded; widened), and a float64
/// beyond f32's range is an error naming the array.
#[test]
fn float64_and_float16_arrays_are_read_as_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let f64s = [0.1f64, -2.5, 1e-3, 3.0];
    let path = tmp.path().join("x.npy");
    std::fs::write(
        &path,
        npy_bytes("<f8", &[2, 2], &f64s.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()),
    )
    .unwrap();
    let x = &tensors::read(&path).unwrap()["x"];
    assert_eq!(x.shape(), &Shape::new([2, 2]));
    assert_eq!(x.data(), f64s.map(|v| v as f32));
    let halves = [half::f16::from_f32(0.5), half::f16::from_f32(-1.25), half::f16::from_f32(65504.0)];
    let path = tmp.path().join("h.npy");
    std::fs::write(
        &path,
        npy_bytes("<f2", &[3], &halves.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<_>>()),
    )
    .unwrap();
    assert_eq!(tensors::read(&path).unwrap()["h"].data(), [0.5, -1.25, 65504.0]);
    let path = tmp.path().join("big.npy");
    std::fs::write(&path, npy_bytes("<f8", &[1], &1e300f64.to_le_bytes())).unwrap();
    let err = tensors::read(&path).unwrap_err().to_string();
    assert!(err.contains("beyond float32's range"), "{err}");
}
