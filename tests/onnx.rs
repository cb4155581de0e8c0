//! ONNX import (`kiln::onnx`): a model written as ONNX protobuf (built here with the schema's
//! messages, so no Python is needed) imports into a graph that plans and computes what the file
//! means; bad files and unsupported ops are errors that say what is wrong, never panics.

use kiln::onnx::proto::*;
use kiln::onnx::{SUPPORTED, import};
use kiln::prelude::*;
use prost::Message;

#[path = "common/onnx_proto.rs"]
mod onnx_proto;
use onnx_proto::*;

fn value(name: &str, dims: &[Dimension]) -> ValueInfoProto {
    typed(name, FLOAT, dims)
}

fn fixed(v: i64) -> Dimension {
    Dimension { dim_value: Some(v), dim_param: None }
}

fn model(
    nodes: Vec<NodeProto>,
    initializer: Vec<TensorProto>,
    input: Vec<ValueInfoProto>,
    opset: i64,
) -> Vec<u8> {
    named_model("mlp", "probs", nodes, initializer, input, opset)
}

/// A model named `name` of `nodes` whose one output is `output`.
fn named_model(
    name: &str,
    output: &str,
    nodes: Vec<NodeProto>,
    initializer: Vec<TensorProto>,
    input: Vec<ValueInfoProto>,
    opset: i64,
) -> Vec<u8> {
    ModelProto {
        ir_version: Some(8),
        producer_name: Some("kiln tests".into()),
        graph: Some(GraphProto {
            name: Some(name.into()),
            node: nodes,
            initializer,
            input,
            output: vec![value(output, &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(opset) }],
    }
    .encode_to_vec()
}

const W1: [f32; 12] = [0.5, -1.0, 0.25, 2.0, 1.5, -0.5, 0.0, 1.0, -2.0, 0.75, 1.25, -0.25];
const B1: [f32; 3] = [0.1, -0.2, 0.3];
const W2: [f32; 6] = [1.0, -1.0, 0.5, 2.0, -1.5, 0.25];

/// x[N, 4] -> Gemm(W1ᵀ stored [3, 4], transB) + b1 -> Relu -> Reshape [N, 3] (a folded shape) ->
/// MatMul W2 [3, 2] -> Softmax: the graph an exporter writes for a two-layer MLP.
fn mlp() -> Vec<u8> {
    model(
        vec![
            node("Gemm", "fc1", &["x", "w1", "b1"], &["h"], vec![attr_int("transB", 1)]),
            node("Relu", "act", &["h"], &["a"], vec![]),
            node("Reshape", "keep", &["a", "shape"], &["r"], vec![]),
            node("MatMul", "fc2", &["r", "w2"], &["logits"], vec![]),
            node("Softmax", "out", &["logits"], &["probs"], vec![attr_int("axis", -1)]),
        ],
        vec![
            tensor("w1", &[3, 4], &W1),
            tensor("b1", &[3], &B1),
            tensor("w2", &[3, 2], &W2),
            ints("shape", &[0, -1]),
        ],
        vec![value("x", &[named("N"), fixed(4)]), value("w1", &[fixed(3), fixed(4)])],
        17,
    )
}

#[test]
fn an_mlp_imports_plans_and_computes_what_the_file_means() {
    let imported = import(&mlp(), &[("N".into(), 5)]).unwrap();
    assert_eq!(imported.inputs, [("x".to_string(), Shape::new([5, 4]))]);
    assert_eq!(imported.weights.len(), 3, "the float initializers, not the folded shape");
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    for (key, value) in &imported.weights {
        cpu.write_variable(key, value).unwrap();
    }
    let x: Vec<f32> = (0..20).map(|i| (i as f32 - 9.0) / 4.0).collect();
    let xt = HostTensor::new(Shape::new([5, 4]), x.clone()).unwrap();
    let probs = cpu.call(id, &[("x", &xt)]).unwrap().remove(0).1;
    for r in 0..5 {
        let h: Vec<f32> = (0..3)
            .map(|j| ((0..4).map(|k| x[r * 4 + k] * W1[j * 4 + k]).sum::<f32>() + B1[j]).max(0.0))
            .collect();
        let logits: Vec<f32> = (0..2).map(|c| (0..3).map(|j| h[j] * W2[j * 2 + c]).sum()).collect();
        let top = logits[0].max(logits[1]);
        let e: Vec<f32> = logits.iter().map(|l| (l - top).exp()).collect();
        for c in 0..2 {
            let want = e[c] / (e[0] + e[1]);
            let got = probs.data()[r * 2 + c];
            assert!((got - want).abs() <= 1e-5, "row {r} class {c}: {got} vs {want}");
        }
    }
}

#[test]
fn bad_files_and_unsupported_ops_are_errors_that_say_why() {
    let e = import(b"not a model at all \xff\xff", &[]).err().expect("garbage is refused").to_string();
    assert!(e.contains("not an ONNX model"), "{e}");
    let e = import(&mlp(), &[]).err().expect("N has no size").to_string();
    assert!(e.contains("`N`") && e.contains("--dim N="), "{e}");
    let lstm = model(
        vec![node("LSTM", "rnn", &["x"], &["probs"], vec![])],
        vec![],
        vec![value("x", &[fixed(2), fixed(3)])],
        17,
    );
    let e = import(&lstm, &[]).err().expect("LSTM is not supported").to_string();
    assert!(e.contains("node `rnn` (LSTM)") && e.contains("Gemm"), "{e}");
    let old =
        model(vec![node("Relu", "r", &["x"], &["probs"], vec![])], vec![], vec![value("x", &[fixed(2)])], 3);
    let e = import(&old, &[]).err().expect("opset 3").to_string();
    assert!(e.contains("opset 3"), "{e}");
    let dangling =
        model(vec![node("Relu", "r", &["y"], &["probs"], vec![])], vec![], vec![value("x", &[fixed(2)])], 17);
    let e = import(&dangling, &[]).err().expect("y is undefined").to_string();
    assert!(e.contains("`y`"), "{e}");
    assert!(SUPPORTED.contains(&"MatMul"));
}

/// Every prefix and every single-byte corruption of a valid file imports or fails with an error,
/// never a panic.
#[test]
fn truncated_and_corrupted_files_never_panic() {
    let bytes = mlp();
    for cut in 0..bytes.len() {
        let _ = import(&bytes[..cut], &[("N".into(), 2)]);
    }
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x5A;
        let _ = import(&b, &[("N".into(), 2)]);
    }
}

/// `kiln memory model.onnx --batch N --mode forward|train` plans the file (or a training step of
/// it) and prints the table; a symbolic size left unset is an error saying how to set it; `kiln
/// train` trains it.
#[test]
fn the_cli_plans_an_onnx_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("kiln-test.onnx");
    std::fs::write(&path, mlp()).unwrap();
    let run =
        |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_kiln")).args(args).output().unwrap();
    let p = path.to_str().unwrap();
    let out = run(&["memory", p, "--batch", "4", "--mode", "forward"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("forward") && text.contains("planned total"), "{text}");
    let out = run(&["memory", p, "--batch", "4", "--mode", "train"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("train"), "{text}");
    let out = run(&["memory", p, "--mode", "train"]);
    assert!(!out.status.success(), "the batch has no size");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--dim N="));
    // `kiln train` trains it from the file's weights and prints the steps and the memory report.
    let out = run(&["train", p, "--batch", "8", "--steps", "5", "--cpu"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("step    5: loss") && text.contains("memory report"), "{text}");
    let losses: Vec<f32> =
        text.lines().filter_map(|l| l.split("loss ").nth(1)?.trim().parse().ok()).collect();
    assert!(losses.len() == 5 && losses[4] < losses[0], "{losses:?}");
    let out = run(&["train", p, "--batch", "0", "--cpu"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--batch 0"));
}

/// A small NCHW convnet as exporters write it — Conv (explicit pads, bias), Relu, MaxPool,
/// BatchNormalization with running statistics, GlobalAveragePool, Flatten — imports into kiln's
/// NHWC convolutions and computes what loops over the file's layout compute.
/// `plan` run once on the CPU with the file's `weights` written and `x` of `dims` fed as "x".
fn call_with_weights(
    plan: Plan,
    weights: &[(String, HostTensor)],
    dims: [usize; 4],
    x: &[f32],
) -> Vec<(String, HostTensor)> {
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    for (key, v) in weights {
        cpu.write_variable(key, v).unwrap();
    }
    cpu.call(id, &[("x", &HostTensor::new(Shape::new(dims), x.to_vec()).unwrap())]).unwrap()
}

#[test]
fn a_convnet_in_nchw_computes_what_the_file_means() {
    let (n, c, h, w, o) = (2usize, 3usize, 6usize, 6usize, 4usize);
    let wv: Vec<f32> = (0..o * c * 9).map(|i| ((i * 7 % 11) as f32 - 5.0) / 10.0).collect();
    let bv: Vec<f32> = (0..o).map(|i| i as f32 * 0.1 - 0.15).collect();
    let (scale, shift, mean, var) = (
        [1.0f32, 0.5, 2.0, 1.5],
        [0.1f32, -0.1, 0.0, 0.2],
        [0.2f32, 0.1, -0.1, 0.0],
        [1.0f32, 0.25, 4.0, 2.0],
    );
    let bytes = ModelProto {
        ir_version: Some(8),
        producer_name: None,
        graph: Some(GraphProto {
            name: Some("cnn".into()),
            node: vec![
                node(
                    "Conv",
                    "conv",
                    &["x", "w", "b"],
                    &["y"],
                    vec![attr_ints("kernel_shape", &[3, 3]), attr_ints("pads", &[1, 1, 1, 1])],
                ),
                node("Relu", "relu", &["y"], &["r"], vec![]),
                node(
                    "MaxPool",
                    "pool",
                    &["r"],
                    &["p"],
                    vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("strides", &[2, 2])],
                ),
                node("BatchNormalization", "bn", &["p", "scale", "shift", "mean", "var"], &["q"], vec![]),
                node("GlobalAveragePool", "gap", &["q"], &["g"], vec![]),
                node("Flatten", "flat", &["g"], &["probs"], vec![]),
            ],
            initializer: vec![
                tensor("w", &[o as i64, c as i64, 3, 3], &wv),
                tensor("b", &[o as i64], &bv),
                tensor("scale", &[4], &scale),
                tensor("shift", &[4], &shift),
                tensor("mean", &[4], &mean),
                tensor("var", &[4], &var),
            ],
            input: vec![value("x", &[named("batch"), fixed(3), fixed(6), fixed(6)])],
            output: vec![value("probs", &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: None, version: Some(13) }],
    }
    .encode_to_vec();
    let imported = import(&bytes, &[("batch".into(), n)]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let x: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0).collect();
    let got = call_with_weights(plan, &imported.weights, [n, c, h, w], &x);
    let got = &got[0].1;
    assert_eq!(got.shape(), &Shape::new([n, o]));
    for b in 0..n {
        for f in 0..o {
            let conv = |i: usize, j: usize| {
                let mut s = bv[f];
                for ch in 0..c {
                    for di in 0..3 {
                        for dj in 0..3 {
                            let (ii, jj) = (i as isize + di as isize - 1, j as isize + dj as isize - 1);
                            if (0..h as isize).contains(&ii) && (0..w as isize).contains(&jj) {
                                s += x[((b * c + ch) * h + ii as usize) * w + jj as usize]
                                    * wv[((f * c + ch) * 3 + di) * 3 + dj];
                            }
                        }
                    }
                }
                s.max(0.0)
            };
            let mut total = 0.0;
            for pi in 0..h / 2 {
                for pj in 0..w / 2 {
                    let m = [(0, 0), (0, 1), (1, 0), (1, 1)]
                        .iter()
                        .map(|&(a, d)| conv(2 * pi + a, 2 * pj + d))
                        .fold(f32::MIN, f32::max);
                    total += (m - mean[f]) / (var[f] + 1e-5).sqrt() * scale[f] + shift[f];
                }
            }
            let want = total / ((h / 2) * (w / 2)) as f32;
            let g = got.data()[b * o + f];
            assert!((g - want).abs() <= 1e-4 * want.abs().max(1.0), "batch {b} channel {f}: {g} vs {want}");
        }
    }
}

/// A residual block of an imported CNN runs channels-last between its convolutions
/// (`onnx::nhwc`): batch normalisation, ReLU, the residual sum and global pooling on the
/// convolutions' NHWC twins and the filters stored HWIO, so the plan permutes only the input,
/// and computes what the file means.
#[test]
fn a_residual_block_runs_channels_last_and_computes_what_the_file_means() {
    let (n, c, h, w) = (2usize, 4usize, 5usize, 6usize);
    let weights = |seed: usize| -> Vec<f32> {
        (0..c * c * 9).map(|i| (((i + seed) * 7 % 13) as f32 - 6.0) / 20.0).collect()
    };
    let (w1, w2) = (weights(1), weights(5));
    let b1: Vec<f32> = (0..c).map(|i| i as f32 * 0.05 - 0.1).collect();
    let (scale, shift, mean, var) = (
        [1.0f32, 0.5, 2.0, 1.5],
        [0.1f32, -0.1, 0.0, 0.2],
        [0.2f32, 0.1, -0.1, 0.0],
        [1.0f32, 0.25, 4.0, 2.0],
    );
    let pads = || vec![attr_ints("kernel_shape", &[3, 3]), attr_ints("pads", &[1, 1, 1, 1])];
    let bytes = named_model(
        "residual",
        "out",
        vec![
            node("Conv", "conv1", &["x", "w1", "b1"], &["y1"], pads()),
            node("BatchNormalization", "bn", &["y1", "scale", "shift", "mean", "var"], &["z"], vec![]),
            node("Relu", "relu1", &["z"], &["a"], vec![]),
            node("Conv", "conv2", &["a", "w2"], &["y2"], pads()),
            node("Add", "sum", &["y2", "a"], &["s"], vec![]),
            node("Relu", "relu2", &["s"], &["r"], vec![]),
            node("GlobalAveragePool", "gap", &["r"], &["g"], vec![]),
            node("Flatten", "flat", &["g"], &["out"], vec![]),
        ],
        vec![
            tensor("w1", &[c as i64, c as i64, 3, 3], &w1),
            tensor("b1", &[c as i64], &b1),
            tensor("w2", &[c as i64, c as i64, 3, 3], &w2),
            tensor("scale", &[4], &scale),
            tensor("shift", &[4], &shift),
            tensor("mean", &[4], &mean),
            tensor("var", &[4], &var),
        ],
        vec![value("x", &[fixed(n as i64), fixed(c as i64), fixed(h as i64), fixed(w as i64)])],
        13,
    );
    let imported = import(&bytes, &[]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let permutes: Vec<&str> = plan
        .steps
        .iter()
        .filter(|s| matches!(s.op, kiln::compiler::ir::Op::Permute { .. }))
        .map(|s| s.label.as_str())
        .collect();
    // The filters are parameters stored HWIO (`nhwc::filters`): only the input is permuted.
    assert_eq!(permutes.len(), 1, "the input only: {permutes:?}\n{}", plan.render());
    let filter = plan.variables.iter().find(|v| v.key.ends_with("w2")).expect("w2's parameter");
    assert_eq!(filter.shape, Shape::new([3, 3, c, c]), "HWIO");
    // conv1's batch norm is folded into it (`onnx::fold_norm`): a new filter, stored HWIO, and a
    // bias, and no statistics left.
    let folded = plan.variables.iter().find(|v| v.key.ends_with("z::weight")).expect("the folded filter");
    assert_eq!(folded.shape, Shape::new([3, 3, c, c]), "HWIO");
    assert!(plan.variables.iter().any(|v| v.key.ends_with("z::bias")));
    assert!(!plan.variables.iter().any(|v| v.key.ends_with("mean") || v.key.ends_with("var")));
    let x: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 13 % 17) as f32 - 8.0) / 8.0).collect();
    let got = call_with_weights(plan, &imported.weights, [n, c, h, w], &x);
    // The reference, NCHW loops.
    let conv = |x: &[f32], wt: &[f32], bias: Option<&[f32]>| -> Vec<f32> {
        let mut y = vec![0.0f32; n * c * h * w];
        for b in 0..n {
            for f in 0..c {
                for i in 0..h {
                    for j in 0..w {
                        let mut s = bias.map_or(0.0, |b| b[f]);
                        for ch in 0..c {
                            for di in 0..3 {
                                for dj in 0..3 {
                                    let (ii, jj) =
                                        (i as isize + di as isize - 1, j as isize + dj as isize - 1);
                                    if (0..h as isize).contains(&ii) && (0..w as isize).contains(&jj) {
                                        s += x[((b * c + ch) * h + ii as usize) * w + jj as usize]
                                            * wt[((f * c + ch) * 3 + di) * 3 + dj];
                                    }
                                }
                            }
                        }
                        y[((b * c + f) * h + i) * w + j] = s;
                    }
                }
            }
        }
        y
    };
    let channel = |k: usize| k / (h * w) % c;
    let a: Vec<f32> = conv(&x, &w1, Some(&b1))
        .iter()
        .enumerate()
        .map(|(k, &v)| {
            let f = channel(k);
            ((v - mean[f]) / (var[f] + 1e-5).sqrt() * scale[f] + shift[f]).max(0.0)
        })
        .collect();
    let r: Vec<f32> = conv(&a, &w2, None).iter().zip(&a).map(|(y, a)| (y + a).max(0.0)).collect();
    let out = &got[0].1;
    assert_eq!(out.shape(), &Shape::new([n, c]));
    for b in 0..n {
        for f in 0..c {
            let want = r[(b * c + f) * h * w..(b * c + f + 1) * h * w].iter().sum::<f32>() / (h * w) as f32;
            let g = out.data()[b * c + f];
            assert!((g - want).abs() <= 1e-4 * want.abs().max(1.0), "batch {b} channel {f}: {g} vs {want}");
        }
    }
}

/// A batch norm folds into the convolution before it only where nothing else reads the
/// convolution's output: here the residual sum reads it too, so the statistics stay parameters,
/// and the model still computes what the file means.
#[test]
fn a_batch_norm_over_a_shared_convolution_output_is_not_folded() {
    let (n, c, h, w) = (2usize, 3usize, 4usize, 5usize);
    let wv: Vec<f32> = (0..c * c).map(|i| ((i * 5 % 7) as f32 - 3.0) / 4.0).collect();
    let (scale, shift, mean, var) =
        ([1.5f32, 0.5, 2.0], [0.1f32, -0.2, 0.3], [0.2f32, -0.1, 0.05], [0.5f32, 2.0, 1.0]);
    let bytes = named_model(
        "shared",
        "out",
        vec![
            node("Conv", "conv", &["x", "w"], &["y"], vec![attr_ints("kernel_shape", &[1, 1])]),
            node("BatchNormalization", "bn", &["y", "scale", "shift", "mean", "var"], &["z"], vec![]),
            node("Add", "sum", &["z", "y"], &["out"], vec![]),
        ],
        vec![
            tensor("w", &[c as i64, c as i64, 1, 1], &wv),
            tensor("scale", &[3], &scale),
            tensor("shift", &[3], &shift),
            tensor("mean", &[3], &mean),
            tensor("var", &[3], &var),
        ],
        vec![value("x", &[fixed(n as i64), fixed(c as i64), fixed(h as i64), fixed(w as i64)])],
        13,
    );
    let imported = import(&bytes, &[]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    assert!(plan.variables.iter().any(|v| v.key.ends_with("mean")), "not folded");
    let x: Vec<f32> = (0..n * c * h * w).map(|i| ((i * 11 % 13) as f32 - 6.0) / 6.0).collect();
    let got = call_with_weights(plan, &imported.weights, [n, c, h, w], &x);
    let out = &got[0].1;
    for b in 0..n {
        for f in 0..c {
            for p in 0..h * w {
                let y: f32 = (0..c).map(|ch| x[(b * c + ch) * h * w + p] * wv[f * c + ch]).sum();
                let want = (y - mean[f]) / (var[f] + 1e-5).sqrt() * scale[f] + shift[f] + y;
                let g = out.data()[(b * c + f) * h * w + p];
                assert!(
                    (g - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "batch {b} channel {f} pixel {p}: {g} vs {want}"
                );
            }
        }
    }
}

/// An imported model trains like a traced one: as a layer (`OnnxLayer`), through autodiff and
/// Adam, starting from the file's weights, and its loss falls.
#[test]
fn an_imported_model_trains_from_its_weights() {
    use kiln::onnx::OnnxLayer;
    let layer = OnnxLayer::new(&mlp()).unwrap();
    let weights = layer.weights.clone();
    assert_eq!(weights.len(), 3);
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(5e-2).into(), metrics: vec![] };
    let mut trainer = Trainer::new(layer, config, Device::cpu().backend(0).unwrap());
    let x = HostTensor::new(Shape::new([8, 4]), (0..32).map(|i| ((i * 5 % 9) as f32 - 4.0) / 4.0).collect())
        .unwrap();
    let mut y = HostTensor::zeros(Shape::new([8, 2])).unwrap();
    for (r, row) in y.data_mut().chunks_mut(2).enumerate() {
        row[r % 2] = 1.0;
    }
    trainer.train_program(x.shape(), y.shape()).unwrap();
    for (key, value) in &weights {
        trainer.backend_mut().write_variable(key, value).unwrap();
    }
    assert_eq!(
        trainer.backend().read_variable("w1").unwrap().data(),
        weights[0].1.data(),
        "the file's weights"
    );
    let losses: Vec<f32> = (0..40).map(|_| trainer.train_step(&x, &y).unwrap().loss).collect();
    assert!(losses[39] < 0.5 * losses[0], "{losses:?}");
    // A model of two inputs is not a layer.
    let two = model(
        vec![node("Add", "add", &["a", "b"], &["probs"], vec![])],
        vec![],
        vec![value("a", &[fixed(2)]), value("b", &[fixed(2)])],
        17,
    );
    assert!(OnnxLayer::new(&two).err().unwrap().to_string().contains("2 inputs"));
}

/// A CNN whose filters are not uniform trains as a layer (`OnnxLayer`, as `kiln train` does)
/// from the file's weights: the layer's weights are in the layout its trace declares (plain
/// filters HWIO, `onnx::nhwc`), so its first loss is the imported forward pass's on them. The
/// filters are 3x3 from 3 channels to 3, where OIHW and HWIO have one shape and a layout mix-up
/// would pass silently. A convolution whose filter is computed (a cross-correlation of two
/// activations) reads it as computed.
#[test]
fn an_imported_cnn_trains_as_a_layer_from_its_filters() {
    use kiln::onnx::OnnxLayer;
    let filter =
        |seed: usize| -> Vec<f32> { (0..81).map(|i| (((i + seed) * 7 % 13) as f32 - 6.0) / 10.0).collect() };
    let pads = || vec![attr_ints("kernel_shape", &[3, 3]), attr_ints("pads", &[1, 1, 1, 1])];
    let bytes = named_model(
        "cnn",
        "out",
        vec![
            node("Conv", "conv1", &["x", "w1"], &["a"], pads()),
            node("Relu", "relu", &["a"], &["r"], vec![]),
            node("Conv", "conv2", &["r", "w2"], &["b"], pads()),
            node("GlobalAveragePool", "gap", &["b"], &["g"], vec![]),
            node("Flatten", "flat", &["g"], &["out"], vec![]),
        ],
        vec![tensor("w1", &[3, 3, 3, 3], &filter(1)), tensor("w2", &[3, 3, 3, 3], &filter(4))],
        vec![value("x", &[fixed(2), fixed(3), fixed(5), fixed(5)])],
        13,
    );
    let x: Vec<f32> = (0..150).map(|i| ((i * 11 % 19) as f32 - 9.0) / 9.0).collect();
    let y = HostTensor::new(Shape::new([2, 3]), vec![0.5, -0.25, 1.0, 0.0, 0.75, -0.5]).unwrap();
    // The imported forward pass on the file's weights, and its mean squared error.
    let imported = import(&bytes, &[]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let out = call_with_weights(plan, &imported.weights, [2, 3, 5, 5], &x);
    let want: f32 = out[0].1.data().iter().zip(y.data()).map(|(o, t)| (o - t) * (o - t)).sum::<f32>() / 6.0;
    let layer = OnnxLayer::new(&bytes).unwrap();
    let weights = layer.weights.clone();
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(1e-2).into(), metrics: vec![] };
    let mut trainer = Trainer::new(layer, config, Device::cpu().backend(0).unwrap());
    let x = HostTensor::new(Shape::new([2, 3, 5, 5]), x).unwrap();
    trainer.train_program(x.shape(), y.shape()).unwrap();
    for (key, value) in &weights {
        trainer.backend_mut().write_variable(key, value).unwrap();
    }
    let losses: Vec<f32> = (0..20).map(|_| trainer.train_step(&x, &y).unwrap().loss).collect();
    assert!((losses[0] - want).abs() <= 1e-5 * want.max(1.0), "first loss {} against {want}", losses[0]);
    assert!(losses[19] < losses[0], "{losses:?}");

    // y = Conv(x, Conv(x, w0)): the second filter [1, 3, 5, 5] is an activation.
    let w0 = [0.5f32, -1.0, 0.25, 1.0, 0.5, -0.5, -0.25, 0.75, 1.5];
    let bytes = named_model(
        "xcorr",
        "out",
        vec![
            node("Conv", "features", &["x", "w0"], &["f"], vec![attr_ints("kernel_shape", &[1, 1])]),
            node("Conv", "xcorr", &["x", "f"], &["out"], vec![attr_ints("kernel_shape", &[5, 5])]),
        ],
        vec![tensor("w0", &[3, 3, 1, 1], &w0)],
        vec![value("x", &[fixed(1), fixed(3), fixed(5), fixed(5)])],
        13,
    );
    let xs: Vec<f32> = (0..75).map(|i| ((i * 5 % 7) as f32 - 3.0) / 3.0).collect();
    let imported = import(&bytes, &[]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let got = call_with_weights(plan, &imported.weights, [1, 3, 5, 5], &xs);
    // out[f'] (one filter of 3 channels): Σ_c Σ_pixels x[c, p] · f[c, p], f[c, p] = Σ_k w0[c, k] x[k, p].
    let mut want = 0.0f32;
    for c in 0..3 {
        for p in 0..25 {
            let f: f32 = (0..3).map(|k| w0[c * 3 + k] * xs[k * 25 + p]).sum();
            want += xs[c * 25 + p] * f;
        }
    }
    let got = got[0].1.data()[0];
    assert!((got - want).abs() <= 1e-4 * want.abs().max(1.0), "{got} against {want}");
}

/// A model of `nodes` whose output is `y`, over the inputs `input` (fixed shapes).
fn graph(
    nodes: Vec<NodeProto>,
    initializer: Vec<TensorProto>,
    input: Vec<ValueInfoProto>,
    opset: i64,
) -> Vec<u8> {
    named_model("g", "y", nodes, initializer, input, opset)
}

/// Imports `bytes`, plans it and runs it on the CPU with `feeds`: output `y`.
fn run(bytes: &[u8], feeds: &[(&str, HostTensor)]) -> kiln::Result<HostTensor> {
    let imported = import(bytes, &[])?;
    let plan = compile(imported.graph, &CompileOptions::default())?;
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan)?;
    for (key, v) in &imported.weights {
        cpu.write_variable(key, v)?;
    }
    let feeds: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (*n, t)).collect();
    let mut out = cpu.call(id, &feeds)?;
    Ok(out.remove(0).1)
}

fn close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {} values for {}", got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{what}: element {i} is {g}, not {w}\n{got:?}");
    }
}

/// Grouped (including depthwise), dilated, strided and padded convolutions — none of which the
/// onnx package's node tests cover — compute what loops over the file's NCHW layout compute.
#[test]
fn grouped_and_dilated_convolutions_compute_what_the_file_means() {
    // (channels, filters, group, dilations, strides, pads [top, left, bottom, right])
    type Case = (usize, usize, usize, [usize; 2], [usize; 2], [usize; 4]);
    let cases: [Case; 4] = [
        (4, 6, 2, [2, 2], [1, 2], [1, 2, 0, 1]),
        (3, 3, 3, [1, 1], [1, 1], [1, 1, 1, 1]),
        (2, 4, 1, [2, 3], [2, 1], [0, 0, 0, 0]),
        (6, 6, 3, [3, 1], [1, 1], [2, 0, 2, 0]),
    ];
    let (h, w, k) = (7usize, 8usize, 3usize);
    for (c, f, g, dil, st, pads) in cases {
        let cg = c / g;
        let x: Vec<f32> = (0..c * h * w).map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0).collect();
        let wv: Vec<f32> = (0..f * cg * k * k).map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0).collect();
        let bv: Vec<f32> = (0..f).map(|i| i as f32 * 0.25 - 0.5).collect();
        let attrs = vec![
            attr_int("group", g as i64),
            attr_ints("dilations", &[dil[0] as i64, dil[1] as i64]),
            attr_ints("strides", &[st[0] as i64, st[1] as i64]),
            attr_ints("pads", &pads.map(|p| p as i64)),
            attr_ints("kernel_shape", &[k as i64, k as i64]),
        ];
        let bytes = graph(
            vec![node("Conv", "conv", &["x", "w", "b"], &["y"], attrs)],
            vec![tensor("w", &[f as i64, cg as i64, k as i64, k as i64], &wv), tensor("b", &[f as i64], &bv)],
            vec![value("x", &[fixed(1), fixed(c as i64), fixed(h as i64), fixed(w as i64)])],
            17,
        );
        let y = run(&bytes, &[("x", HostTensor::new(Shape::new([1, c, h, w]), x.clone()).unwrap())]).unwrap();
        let span = |n: usize, a: usize| (n + pads[a] + pads[a + 2] - ((k - 1) * dil[a] + 1)) / st[a] + 1;
        let (oh, ow) = (span(h, 0), span(w, 1));
        assert_eq!(y.shape(), &Shape::new([1, f, oh, ow]), "case {c}/{f}/{g}");
        let mut want = Vec::new();
        for fi in 0..f {
            let group = fi / (f / g);
            for i in 0..oh {
                for j in 0..ow {
                    let mut s = bv[fi];
                    for ci in 0..cg {
                        for a in 0..k {
                            for b in 0..k {
                                let r = (i * st[0] + a * dil[0]) as isize - pads[0] as isize;
                                let q = (j * st[1] + b * dil[1]) as isize - pads[1] as isize;
                                if (0..h as isize).contains(&r) && (0..w as isize).contains(&q) {
                                    let xc = group * cg + ci;
                                    s += x[(xc * h + r as usize) * w + q as usize]
                                        * wv[((fi * cg + ci) * k + a) * k + b];
                                }
                            }
                        }
                    }
                    want.push(s);
                }
            }
        }
        close(y.data(), &want, &format!("conv c {c} f {f} group {g} dilations {dil:?}"));
    }
}

/// Pad's four modes and negative pads (crops) on a float tensor (the node tests' edge, reflect
/// and wrap cases are int32): NumPy's `np.pad` results.
#[test]
fn pads_of_every_mode() {
    let x = HostTensor::new(Shape::new([2, 3]), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    type Case<'a> = (&'a str, [i64; 4], Option<f32>, &'a [f32]);
    let cases: [Case; 6] = [
        ("constant", [0, 2, 0, 1], Some(1.5), &[1.5, 1.5, 1., 2., 3., 1.5, 1.5, 1.5, 4., 5., 6., 1.5]),
        ("constant", [0, -1, 0, 1], None, &[2., 3., 0., 5., 6., 0.]),
        ("reflect", [0, 2, 0, 1], None, &[3., 2., 1., 2., 3., 2., 6., 5., 4., 5., 6., 5.]),
        ("edge", [0, 2, 0, 1], None, &[1., 1., 1., 2., 3., 3., 4., 4., 4., 5., 6., 6.]),
        ("wrap", [0, 2, 0, 1], None, &[2., 3., 1., 2., 3., 1., 5., 6., 4., 5., 6., 4.]),
        ("edge", [1, 0, 0, -2], None, &[1., 1., 4.]),
    ];
    for (mode, pads, constant, want) in cases {
        let mut inputs = vec!["x", "pads"];
        let mut init = vec![ints("pads", &pads)];
        if let Some(c) = constant {
            inputs.push("c");
            init.push(tensor("c", &[], &[c]));
        }
        let bytes = graph(
            vec![node("Pad", "pad", &inputs, &["y"], vec![attr_str("mode", mode)])],
            init,
            vec![value("x", &[fixed(2), fixed(3)])],
            18,
        );
        let y = run(&bytes, &[("x", x.clone())]).unwrap();
        close(y.data(), want, &format!("Pad {mode} {pads:?}"));
    }
}

/// An embedding as exporters write it: int64 ids (a graph input, fed as i64) gather rows of a
/// float table; a negative id counts from the end.
#[test]
fn an_embedding_gathers_rows_by_integer_ids() {
    let table: Vec<f32> = (0..20).map(|i| i as f32 * 0.5).collect();
    let bytes = graph(
        vec![node("Gather", "embed", &["table", "ids"], &["y"], vec![])],
        vec![tensor("table", &[5, 4], &table)],
        vec![typed("ids", INT64, &[fixed(2), fixed(3)])],
        17,
    );
    let ids = HostTensor::from_i64(Shape::new([2, 3]), vec![0, 4, 2, -1, 1, 1]).unwrap();
    let y = run(&bytes, &[("ids", ids)]).unwrap();
    assert_eq!(y.shape(), &Shape::new([2, 3, 4]));
    let want: Vec<f32> =
        [0usize, 4, 2, 4, 1, 1].iter().flat_map(|&r| table[r * 4..r * 4 + 4].to_vec()).collect();
    close(y.data(), &want, "embedding");
    // Ids are not values: arithmetic on them is refused, not computed in f32.
    let bytes = graph(
        vec![node("Add", "add", &["ids", "ids"], &["y"], vec![])],
        vec![],
        vec![typed("ids", INT64, &[fixed(2)])],
        17,
    );
    let e = import(&bytes, &[]).err().expect("ids are not float values").to_string();
    assert!(e.contains("node `add` (Add)") && e.contains("integer input `ids`"), "{e}");
}

/// An integer input cast to bool (transformers 5's BERT casts its attention mask so): any
/// non-zero value is true, and the mask selects through `Where` and `And` as a boolean.
#[test]
fn an_integer_input_casts_to_a_boolean_mask() {
    let bytes = graph(
        vec![
            node("Cast", "as_bool", &["mask"], &["b"], vec![attr_int("to", 9)]),
            node("And", "both", &["b", "b"], &["bb"], vec![]),
            node("Where", "pick", &["bb", "x", "low"], &["y"], vec![]),
        ],
        vec![tensor("x", &[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), tensor("low", &[1], &[-9.0])],
        vec![typed("mask", INT64, &[fixed(2), fixed(3)])],
        17,
    );
    let mask = HostTensor::from_i64(Shape::new([2, 3]), vec![1, 0, 2, 0, -1, 1]).unwrap();
    let y = run(&bytes, &[("mask", mask)]).unwrap();
    assert_eq!(y.data(), [1.0, -9.0, 3.0, -9.0, 5.0, 6.0]);
}

/// `GatherElements` with indices fed at run time (int64, a graph input; ONNX's node tests give
/// them as constants): out[i][j] = data[i][idx[i][j]] along axis 1, data[idx[i][j]][j] along
/// axis 0, negative indices counting from the end, indices shorter than the data on the other
/// axis; an index past its axis is refused at run time, an index tensor of another rank at
/// import, naming the node.
#[test]
fn gather_elements_picks_by_computed_indices() {
    let data: Vec<f32> = (0..12).map(|i| i as f32 * 1.5 - 4.0).collect(); // [3, 4]
    let at = |r: usize, c: usize| data[r * 4 + c];
    let one = |axis: i64, idims: [i64; 2], ids: Vec<i64>| {
        let bytes = graph(
            vec![node("GatherElements", "pick", &["x", "idx"], &["y"], vec![attr_int("axis", axis)])],
            vec![tensor("x", &[3, 4], &data)],
            vec![typed("idx", INT64, &[fixed(idims[0]), fixed(idims[1])])],
            17,
        );
        let shape = Shape::new([idims[0] as usize, idims[1] as usize]);
        run(&bytes, &[("idx", HostTensor::from_i64(shape, ids).unwrap())])
    };
    let y = one(1, [3, 2], vec![3, 0, -1, 1, 2, 2]).unwrap();
    assert_eq!(y.shape(), &Shape::new([3, 2]));
    close(y.data(), &[at(0, 3), at(0, 0), at(1, 3), at(1, 1), at(2, 2), at(2, 2)], "axis 1");
    let y = one(0, [2, 3], vec![2, 0, 1, -3, 2, 0]).unwrap();
    close(y.data(), &[at(2, 0), at(0, 1), at(1, 2), at(0, 0), at(2, 1), at(0, 2)], "axis 0");
    // An index past its axis (which flattened would land in the next row) is refused.
    for bad in [4, -5] {
        assert!(one(1, [3, 2], vec![0, bad, 0, 0, 0, 0]).is_err(), "index {bad} on an axis of 4");
    }
    let bytes = graph(
        vec![node("GatherElements", "pick", &["x", "idx"], &["y"], vec![])],
        vec![tensor("x", &[3, 4], &data)],
        vec![typed("idx", INT64, &[fixed(3)])],
        17,
    );
    let e = import(&bytes, &[]).err().expect("indices of another rank").to_string();
    assert!(e.contains("node `pick` (GatherElements)") && e.contains("indices of shape [3]"), "{e}");
}

/// The shape subgraph an exporter writes before a Reshape — Shape, Gather, Unsqueeze, Concat
/// with a constant — folds at import: the Reshape gets a constant shape.
#[test]
fn shape_subgraphs_fold_at_import() {
    let bytes = ModelProto {
        ir_version: Some(8),
        producer_name: None,
        graph: Some(GraphProto {
            name: Some("reshape".into()),
            node: vec![
                node("Shape", "shape", &["x"], &["s"], vec![]),
                node("Gather", "batch", &["s", "zero"], &["n"], vec![]),
                node("Unsqueeze", "n1", &["n", "axes"], &["n_1"], vec![]),
                node("Concat", "spec", &["n_1", "rest"], &["target"], vec![attr_int("axis", 0)]),
                node("Reshape", "flat", &["x", "target"], &["y"], vec![]),
            ],
            initializer: vec![
                TensorProto {
                    name: Some("zero".into()),
                    data_type: Some(INT64),
                    int64_data: vec![0],
                    ..Default::default()
                },
                ints("axes", &[0]),
                ints("rest", &[-1]),
            ],
            input: vec![value("x", &[named("N"), fixed(3), fixed(4)])],
            output: vec![value("y", &[])],
        }),
        opset_import: vec![OperatorSetIdProto { domain: None, version: Some(13) }],
    }
    .encode_to_vec();
    let imported = import(&bytes, &[("N".into(), 2)]).unwrap();
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    let x: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let y = cpu.call(id, &[("x", &HostTensor::new(Shape::new([2, 3, 4]), x.clone()).unwrap())]).unwrap();
    assert_eq!(y[0].1.shape(), &Shape::new([2, 12]));
    assert_eq!(y[0].1.data(), x.as_slice());
}

/// What the importer does not map — an attribute, mode or element type — is an error naming
/// the node and the op, and saying what is supported; never a different computation.
#[test]
fn unsupported_attributes_are_errors_naming_the_node() {
    let x4 = || vec![value("x", &[fixed(1), fixed(2), fixed(6), fixed(6)])];
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            graph(
                vec![node(
                    "MaxPool",
                    "pool",
                    &["x"],
                    &["y"],
                    vec![attr_ints("kernel_shape", &[2, 2]), attr_ints("dilations", &[2, 2])],
                )],
                vec![],
                x4(),
                17,
            ),
            "node `pool` (MaxPool): dilates by [2, 2]",
        ),
        (
            graph(
                vec![node("Dropout", "drop", &["x", "ratio", "train"], &["y"], vec![])],
                vec![
                    tensor("ratio", &[], &[0.5]),
                    TensorProto {
                        name: Some("train".into()),
                        data_type: Some(BOOL),
                        int32_data: vec![1],
                        ..Default::default()
                    },
                ],
                x4(),
                17,
            ),
            "node `drop` (Dropout): drops in training mode",
        ),
        (
            graph(vec![node("Cast", "fp8", &["x"], &["y"], vec![attr_int("to", 17)])], vec![], x4(), 19),
            "node `fp8` (Cast): casts to element type 17",
        ),
        (
            graph(
                vec![node("Gelu", "g", &["x"], &["y"], vec![attr_str("approximate", "erf")])],
                vec![],
                x4(),
                20,
            ),
            "node `g` (Gelu): approximate = \"erf\"",
        ),
        (
            graph(
                vec![node("Pad", "p", &["x", "pads"], &["y"], vec![attr_str("mode", "mirror")])],
                vec![ints("pads", &[0, 0, 1, 1, 0, 0, 1, 1])],
                x4(),
                18,
            ),
            "node `p` (Pad): mode \"mirror\"",
        ),
        (
            graph(
                vec![node("ReduceMean", "m", &["x", "axes"], &["y"], vec![])],
                vec![tensor("axes", &[1], &[1.0])],
                x4(),
                18,
            ),
            "node `m` (ReduceMean): takes its input 1 (`axes`) from a computed tensor",
        ),
        (
            graph(
                vec![node("Conv", "c3", &["x", "w"], &["y"], vec![])],
                vec![tensor("w", &[1, 2, 1, 1, 1], &[1.0, 1.0])],
                vec![value("x", &[fixed(1), fixed(2), fixed(3), fixed(3), fixed(3)])],
                17,
            ),
            "node `c3` (Conv): has a rank-5 input",
        ),
        (
            graph(vec![node("Resize", "up", &["x"], &["y"], vec![])], vec![], x4(), 17),
            "node `up` (Resize): kiln does not import `Resize` yet",
        ),
    ];
    for (bytes, want) in cases {
        let e = import(&bytes, &[]).err().unwrap_or_else(|| panic!("{want}: imported"));
        let text = e.to_string();
        assert!(text.starts_with("not supported: ") && text.contains(want), "{want}:\n{text}");
        assert!(text.contains("help: "), "{text}");
    }
}

/// A model using many of the mapped ops: every prefix and single-byte corruption imports (and
/// then plans) or fails with an error, never a panic.
#[test]
fn corrupted_models_of_many_ops_never_panic() {
    let bytes = graph(
        vec![
            node(
                "Conv",
                "conv",
                &["x", "w"],
                &["c"],
                vec![attr_int("group", 2), attr_ints("dilations", &[2, 1])],
            ),
            node("Pad", "pad", &["c", "pads"], &["p"], vec![attr_str("mode", "reflect")]),
            node("Slice", "slice", &["p", "starts", "ends", "axes", "steps"], &["s"], vec![]),
            node("Split", "split", &["s"], &["s0", "s1"], vec![attr_int("axis", 1)]),
            node("Add", "add", &["s0", "s1"], &["a"], vec![]),
            node(
                "MaxPool",
                "pool",
                &["a"],
                &["m"],
                vec![attr_ints("kernel_shape", &[2, 2]), attr_int("ceil_mode", 1)],
            ),
            node("LayerNormalization", "ln", &["m", "gamma"], &["l"], vec![attr_float("epsilon", 1e-3)]),
            node("ReduceMean", "mean", &["l", "raxes"], &["y"], vec![attr_int("keepdims", 0)]),
        ],
        vec![
            tensor("w", &[4, 1, 3, 3], &[0.5; 36]),
            ints("pads", &[0, 0, 1, 1, 0, 0, 1, 1]),
            ints("starts", &[-1]),
            ints("ends", &[i64::MIN]),
            ints("axes", &[3]),
            ints("steps", &[-2]),
            tensor("gamma", &[1], &[2.0]),
            ints("raxes", &[2, 3]),
        ],
        vec![value("x", &[fixed(1), fixed(2), fixed(9), fixed(8)])],
        18,
    );
    let x = HostTensor::new(Shape::new([1, 2, 9, 8]), (0..144).map(|i| (i % 7) as f32).collect()).unwrap();
    let y = run(&bytes, &[("x", x)]).unwrap();
    assert_eq!(y.shape(), &Shape::new([1, 2]));
    let try_all = |b: &[u8]| {
        if let Ok(imported) = import(b, &[]) {
            let _ = compile(imported.graph, &CompileOptions::default());
        }
    };
    for cut in 0..bytes.len() {
        try_all(&bytes[..cut]);
    }
    for i in 0..bytes.len() {
        for flip in [0x01, 0x5A, 0xFF] {
            let mut b = bytes.clone();
            b[i] ^= flip;
            try_all(&b);
        }
    }
}

/// A batch-1 export (static first axis, a `Reshape` to `[1, -1]` before its classifier, weights
/// as `ConstantOfShape` of a stored shape, as ONNX's `light/` models hold them): `--batch N`
/// (`onnx::STATIC_BATCH`) re-batches it, every row computing what batch 1 computes, and the
/// weights are parameters initialised to their value (persistent, not filled into the arena).
#[test]
fn a_batch_one_export_is_rebatched_and_its_constant_weights_are_parameters() {
    let bytes = graph(
        vec![
            node(
                "ConstantOfShape",
                "w_fill",
                &["w_shape"],
                &["w"],
                vec![AttributeProto {
                    name: Some("value".into()),
                    t: Some(tensor("", &[1], &[0.25])),
                    ..Default::default()
                }],
            ),
            node("MatMul", "fc", &["x", "w"], &["h"], vec![]),
            node("Relu", "act", &["h"], &["a"], vec![]),
            node("Reshape", "flat", &["a", "flat_shape"], &["r"], vec![]),
            node("Mul", "scale", &["r", "s"], &["y"], vec![]),
        ],
        vec![
            ints("w_shape", &[4, 3]),
            ints("flat_shape", &[1, 6]),
            tensor("s", &[6], &[1., 2., 3., 4., 5., 6.]),
        ],
        vec![value("x", &[fixed(1), fixed(2), fixed(4)])],
        17,
    );
    let rows = |x: &[f32]| -> Vec<f32> {
        // Per row: x[2, 4] . 0.25 -> relu -> [6] * s.
        (0..6)
            .map(|i| (x[(i / 3) * 4..(i / 3) * 4 + 4].iter().sum::<f32>() * 0.25).max(0.0) * (i + 1) as f32)
            .collect()
    };
    let imported = import(&bytes, &[(kiln::onnx::STATIC_BATCH.into(), 3)]).unwrap();
    assert_eq!(imported.inputs, [("x".to_string(), Shape::new([3, 2, 4]))]);
    let w = imported.graph.variable("w").expect("the ConstantOfShape weight is a variable");
    assert!(
        matches!(&imported.graph.node(w).op, kiln::compiler::ir::Op::Variable { init: Init::Constant(v), .. } if *v == 0.25)
    );
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    assert!(
        !plan.steps.iter().any(|s| matches!(s.op, kiln::compiler::ir::Op::Fill { .. })),
        "no weight filled per run"
    );
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    for (key, v) in &imported.weights {
        cpu.write_variable(key, v).unwrap();
    }
    let x: Vec<f32> = (0..24).map(|i| (i as f32 - 11.0) / 3.0).collect();
    let got = cpu
        .call(id, &[("x", &HostTensor::new(Shape::new([3, 2, 4]), x.clone()).unwrap())])
        .unwrap()
        .remove(0)
        .1;
    let want: Vec<f32> = (0..3).flat_map(|b| rows(&x[b * 8..b * 8 + 8])).collect();
    close(got.data(), &want, "re-batched");
    // Without the batch the export keeps its own.
    assert_eq!(import(&bytes, &[]).unwrap().inputs, [("x".to_string(), Shape::new([1, 2, 4]))]);
}

/// `kiln memory model.onnx --device A=SIZE --device B=SIZE` (`onnx::train::fit`): a model that
/// fits the first device says so; one that does not is split over the devices in order, each
/// computing node range's plan within its device's limit, the weights on their readers' devices.
#[test]
#[allow(clippy::result_large_err)] // split_units takes the compiler's own error from its closure
fn an_imported_model_is_fitted_or_split_over_devices_of_different_sizes() {
    use kiln::compiler::device::DeviceSpec;
    // Two layers whose weights (and Adam's moments) outweigh the activations.
    let w1: Vec<f32> = (0..64 * 256).map(|i| ((i % 7) as f32 - 3.0) / 50.0).collect();
    let w2: Vec<f32> = (0..256 * 64).map(|i| ((i % 5) as f32 - 2.0) / 50.0).collect();
    let bytes = named_model(
        "two",
        "probs",
        vec![
            node("MatMul", "fc1", &["x", "w1"], &["h"], vec![]),
            node("Relu", "act", &["h"], &["a"], vec![]),
            node("MatMul", "fc2", &["a", "w2"], &["probs"], vec![]),
        ],
        vec![tensor("w1", &[64, 256], &w1), tensor("w2", &[256, 64], &w2)],
        vec![value("x", &[named("N"), fixed(64)])],
        17,
    );
    let sizes = [("N".to_string(), 4)];
    let layer = kiln::onnx::OnnxLayer::new(&bytes).unwrap();
    let (x, y) = kiln::onnx::train::shapes(&bytes, &sizes).unwrap();
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(1e-3).into(), metrics: vec![] };
    let whole = compile(
        kiln::compiler::step::train_step_graph(&layer, x.clone(), y.clone(), &config).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap();
    let need = whole.memory.held_bytes();
    let roomy = [DeviceSpec::new(0, "gpu:0").with_limit(need * 2)];
    let text = kiln::onnx::train::fit(&bytes, &sizes, true, &roomy).unwrap();
    assert!(text.contains("fits on gpu:0"), "{text}");
    // Too small alone (the weights and Adam's state of one layer fit, not all of them).
    let small =
        [DeviceSpec::new(0, "gpu:0").with_limit(need * 6 / 10), DeviceSpec::new(1, "gpu:1").with_limit(need)];
    let text = kiln::onnx::train::fit(&bytes, &sizes, true, &small).unwrap();
    assert!(text.contains("does not fit on gpu:0 alone"), "{text}");
    assert!(text.contains("split over gpu:0, gpu:1") && text.contains("gpu:1: nodes"), "{text}");
    // The split itself, from the API: both devices hold part of the model, within their limits.
    let split = kiln::compiler::placement::split_units(
        "test",
        "nodes",
        layer.nodes(),
        &small,
        64,
        |ranges| kiln::compiler::step::train_step_graph(&layer.placed(ranges), x.clone(), y.clone(), &config),
        |r| layer.describe_nodes(r),
    )
    .unwrap();
    assert_eq!(split.placement.len(), 2, "{}", split.describe());
    for d in &split.plan.devices {
        assert!(d.memory.held_bytes() <= d.memory_limit.unwrap(), "{}", split.describe());
        assert!(d.memory.parameter_bytes > 0, "{} holds weights: {}", d.name, split.describe());
    }
}

/// In a training step an imported model trains as PyTorch's `model.train()` would: an
/// inference-mode BatchNormalization normalises by the batch's statistics and moves its running
/// statistics towards them (ONNX's momentum), and Dropout drops (kiln's generator); its
/// forward pass keeps using the running statistics and drops nothing.
#[test]
fn an_imported_model_trains_with_batch_statistics_and_active_dropout() {
    use kiln::onnx::OnnxLayer;
    let (c, rm0, rv0) = (3usize, [0.5f32, -1.0, 2.0], [1.0f32, 4.0, 0.25]);
    let bytes = graph(
        vec![
            node("BatchNormalization", "bn", &["x", "scale", "bias", "rm", "rv"], &["h"], vec![]),
            node("Dropout", "drop", &["h"], &["y"], vec![attr_float("ratio", 0.5)]),
        ],
        vec![
            tensor("scale", &[3], &[1.0, 2.0, 0.5]),
            tensor("bias", &[3], &[0.0, 0.1, -0.1]),
            tensor("rm", &[3], &rm0),
            tensor("rv", &[3], &rv0),
        ],
        vec![value("x", &[named("N"), fixed(3), fixed(2), fixed(2)])],
        11,
    );
    let layer = OnnxLayer::new(&bytes).unwrap();
    let weights = layer.weights.clone();
    // The running statistics are no trainable weights: whatever the optimizer, only their own
    // update moves them.
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Sgd::new(0.1).into(), metrics: vec![] };
    let mut trainer = Trainer::new(layer, config, Device::cpu().backend(0).unwrap());
    let n = 4;
    let x = HostTensor::from_fn(Shape::new([n, c, 2, 2]), |i| ((i * 7 % 11) as f32 - 5.0) / 2.0).unwrap();
    let y = HostTensor::zeros(Shape::new([n, c, 2, 2])).unwrap();
    trainer.train_program(x.shape(), y.shape()).unwrap();
    for (key, value) in &weights {
        trainer.backend_mut().write_variable(key, value).unwrap();
    }
    let plan = trainer.plans()[0].clone();
    assert!(plan.variables.iter().any(|v| v.key == "dropout/step"), "dropout is active");
    trainer.train_step(&x, &y).unwrap();
    // The batch's per-channel mean and (biased) variance, by hand.
    let d = x.data();
    for ch in 0..c {
        let vals: Vec<f32> =
            (0..n).flat_map(|b| (0..4).map(move |k| (b, k))).map(|(b, k)| d[(b * c + ch) * 4 + k]).collect();
        let mean = vals.iter().sum::<f32>() / vals.len() as f32;
        let var = vals.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / vals.len() as f32;
        let rm = trainer.backend().read_variable("rm").unwrap().data()[ch];
        let rv = trainer.backend().read_variable("rv").unwrap().data()[ch];
        assert!((rm - (0.9 * rm0[ch] + 0.1 * mean)).abs() < 1e-5, "running mean {ch}: {rm}");
        assert!((rv - (0.9 * rv0[ch] + 0.1 * var)).abs() < 1e-5, "running variance {ch}: {rv}");
    }
    // Inference: the running statistics, no dropout.
    let forward = kiln::compiler::step::forward_graph(&OnnxLayer::new(&bytes).unwrap(), x.shape()).unwrap();
    assert!(forward.variable("dropout/step").is_none());
}

/// `--batch N` changes only a first axis of 1 (a batch-1 export): an input whose static first
/// axis is anything else keeps it.
#[test]
fn only_a_batch_of_one_is_rebatched() {
    let bytes = graph(
        vec![node("Relu", "act", &["x"], &["y"], vec![])],
        vec![],
        vec![value("x", &[fixed(3), fixed(4)])],
        17,
    );
    let imported = import(&bytes, &[(kiln::onnx::STATIC_BATCH.into(), 8)]).unwrap();
    assert_eq!(imported.inputs, [("x".to_string(), Shape::new([3, 4]))]);
}

/// An integer tensor the file stores and reads as floats (a causal mask, as GPT-2's exports
/// store one) is a constant of the graph: computed with its values, never a trained weight.
#[test]
fn stored_integer_masks_are_constants_not_weights() {
    let mask = TensorProto {
        name: Some("mask".into()),
        dims: vec![1, 4],
        data_type: Some(INT64),
        int64_data: vec![1, 0, 1, 1],
        ..Default::default()
    };
    let nodes = vec![
        node("Cast", "as_float", &["mask"], &["m"], vec![attr_int("to", 1)]),
        node("Mul", "masked", &["x", "m"], &["probs"], vec![]),
    ];
    let bytes = model(nodes, vec![mask], vec![value("x", &[fixed(2), fixed(4)])], 17);
    let imported = import(&bytes, &[]).unwrap();
    assert!(imported.weights.is_empty(), "no weight for the mask: {:?}", imported.weights);
    let g = &imported.graph;
    let trained = g.node_ids().filter(|&n| {
        matches!(
            g.node(n).op,
            kiln::compiler::ir::Op::Variable { role: kiln::compiler::ir::VarRole::Parameter, .. }
        )
    });
    assert_eq!(trained.count(), 0);
    let plan = compile(imported.graph, &CompileOptions::default()).unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan).unwrap();
    let x = HostTensor::new(Shape::new([2, 4]), (1..=8).map(|v| v as f32).collect()).unwrap();
    let y = cpu.call(id, &[("x", &x)]).unwrap().remove(0).1;
    assert_eq!(y.data(), [1.0, 0.0, 3.0, 4.0, 5.0, 0.0, 7.0, 8.0]);
}

/// A half-precision export: float16 and bfloat16 inputs (fed as f32, rounded to their type
/// where the model reads them), initializers (widened to f32 exactly) and casts to the half
/// types (rounding), computed in f32 between them.
#[test]
fn half_precision_models_import_and_compute_what_the_file_means() {
    let half_tensor = |name: &str, dims: &[i64], values: &[f32], bf16: bool| TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(if bf16 { BFLOAT16 } else { FLOAT16 }),
        raw_data: Some(
            values
                .iter()
                .flat_map(|&v| {
                    let bits = if bf16 {
                        half::bf16::from_f32(v).to_bits()
                    } else {
                        half::f16::from_f32(v).to_bits()
                    };
                    bits.to_le_bytes()
                })
                .collect(),
        ),
        ..Default::default()
    };
    let w = [0.5f32, -1.25, 2.0, 0.75, -0.125, 3.0];
    for (elem, bf16, to) in [(FLOAT16, false, 10), (BFLOAT16, true, 16)] {
        let bytes = graph(
            vec![
                node("MatMul", "mm", &["x", "w"], &["p"], vec![]),
                node("Cast", "narrow", &["p"], &["h"], vec![attr_int("to", to)]),
                node("Relu", "act", &["h"], &["y"], vec![]),
            ],
            vec![half_tensor("w", &[3, 2], &w, bf16)],
            vec![typed("x", elem, &[fixed(2), fixed(3)])],
            17,
        );
        let x = [0.1f32, 0.2, 0.3, -0.7, 1.1, 2.3];
        let round =
            |v: f32| if bf16 { half::bf16::from_f32(v).to_f32() } else { half::f16::from_f32(v).to_f32() };
        let y = run(&bytes, &[("x", HostTensor::new(Shape::new([2, 3]), x.to_vec()).unwrap())]).unwrap();
        let want: Vec<f32> = (0..2)
            .flat_map(|r| (0..2).map(move |c| (r, c)))
            .map(|(r, c)| round((0..3).map(|k| round(x[r * 3 + k]) * w[k * 2 + c]).sum::<f32>()).max(0.0))
            .collect();
        assert_eq!(y.data(), want.as_slice(), "{}", if bf16 { "bf16" } else { "f16" });
    }
}
