//! Checkpoints from outside (`kiln::runtime::checkpoint::read`, `Trainer::load`,
//! `Trainer::load_weights`): a malformed safetensors file is refused with the tensor and the
//! rule it breaks named, and the trainer is left bit for bit as it was; a weights-only file
//! starts a fine-tuning run with fresh optimizer state; non-finite values are listed, and
//! `fit` can stop at the first non-finite loss.

use kiln::compiler::ir::VarRole;
use kiln::prelude::*;
use kiln::runtime::checkpoint;
use kiln::zoo;
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::{Path, PathBuf};

fn batch(seed: u64) -> (HostTensor, HostTensor) {
    zoo::by_name("seed-mlp").unwrap().batch_data(seed).unwrap()
}

fn trainer(seed: u64) -> Trainer {
    Trainer::new(zoo::seed_mlp(), zoo::seed_config(), Device::cpu().backend(seed).unwrap())
}

/// A seed-MLP trainer (Adam) that has taken one step: parameters, moments and counter set.
fn trained(seed: u64) -> Trainer {
    let (x, y) = batch(seed);
    let mut t = trainer(seed);
    t.train_step(&x, &y).unwrap();
    t
}

fn bits(t: &HostTensor) -> Vec<u32> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

/// Every variable the trainer's plans declare, by key, as bits.
fn snapshot(t: &Trainer) -> Vec<(String, Vec<u32>)> {
    let mut keys: Vec<String> =
        t.plans().iter().flat_map(|p| p.variables.iter().map(|v| v.key.clone())).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter().map(|k| (k.clone(), bits(&t.backend().read_variable(&k).unwrap()))).collect()
}

/// The keys of the trainer's variables of `role`.
fn keys_of(t: &Trainer, role: VarRole) -> Vec<String> {
    let mut keys: Vec<String> =
        t.plans()[0].variables.iter().filter(|v| v.role == role).map(|v| v.key.clone()).collect();
    keys.sort();
    keys
}

/// Asserts that both `load` and `load_weights` refuse `path` with a message holding every
/// one of `needles`, and that neither changed a bit of the trainer's variables.
fn refused(t: &mut Trainer, path: &PathBuf, needles: &[&str]) -> String {
    let before = snapshot(t);
    let e = t.load(path).unwrap_err().to_string();
    for n in needles {
        assert!(e.contains(n), "`load` error lacks {n:?}:\n{e}");
    }
    assert_eq!(snapshot(t), before, "a refused load changed the trainer");
    let w = t.load_weights(path).unwrap_err().to_string();
    for n in needles {
        assert!(w.contains(n), "`load_weights` error lacks {n:?}:\n{w}");
    }
    assert_eq!(snapshot(t), before, "a refused load_weights changed the trainer");
    e
}

/// A file `name` in `dir` of an 8-byte header length `len` (the header's own length by
/// default), `header` and `data`.
fn raw(dir: &Path, name: &str, len: Option<u64>, header: &[u8], data: &[u8]) -> PathBuf {
    let mut bytes = len.unwrap_or(header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(data);
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// A file `name` in `dir` of the JSON header `header` followed by `data_len` zero bytes.
fn with_header(dir: &Path, name: &str, header: &str, data_len: usize) -> PathBuf {
    raw(dir, name, None, header.as_bytes(), &vec![0u8; data_len])
}

/// The seed MLP's `dense/kernel` ([100, 10]) and `dense/bias` ([10]) entries with these offsets.
fn two(kernel: [u64; 2], bias: [u64; 2]) -> String {
    format!(
        r#"{{"dense/kernel":{{"dtype":"F32","shape":[100,10],"data_offsets":[{},{}]}},"dense/bias":{{"dtype":"F32","shape":[10],"data_offsets":[{},{}]}}}}"#,
        kernel[0], kernel[1], bias[0], bias[1]
    )
}

#[test]
fn a_well_formed_pair_of_tensors_reads() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // The baseline of the cases below: the same layout, unbroken, reads.
    let path = with_header(dir, "good.safetensors", &two([0, 4000], [4000, 4040]), 4040);
    let file = checkpoint::read(&path).unwrap();
    assert_eq!(file.tensors["dense/kernel"].shape().dims(), [100, 10]);
    assert_eq!(file.tensors["dense/bias"].shape().dims(), [10]);
}

#[test]
fn truncated_data_names_the_tensor_and_the_missing_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(1);
    // Bias at the end, 20 of its 40 bytes absent.
    let path = with_header(dir, "truncated.safetensors", &two([0, 4000], [4000, 4040]), 4020);
    let e = refused(&mut t, &path, &["truncated", "`dense/bias`", "20 of its 40 bytes are missing"]);
    assert!(!e.contains("not fully covered"), "{e}");
    // The kernel cut, the bias wholly past the end.
    let path = with_header(dir, "truncated2.safetensors", &two([0, 4000], [4000, 4040]), 1000);
    refused(
        &mut t,
        &path,
        &["`dense/kernel`", "3000 of its 4000 bytes are missing", "1 more tensor (`dense/bias`)"],
    );
    // A checkpoint `save` wrote, cut short.
    let whole = dir.join("whole.safetensors");
    t.save(&whole).unwrap();
    let bytes = std::fs::read(&whole).unwrap();
    let cut = dir.join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() - 7]).unwrap();
    refused(&mut t, &cut, &["truncated", "bytes are missing", "7 bytes missing in all"]);
}

#[test]
fn a_range_that_disagrees_with_shape_and_dtype_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(2);
    let path = with_header(dir, "short_range.safetensors", &two([0, 4000], [4000, 4036]), 4036);
    refused(
        &mut t,
        &path,
        &["`dense/bias`", "span 36 bytes", "shape [10] of F32 takes 40 bytes", "disagrees"],
    );
}

#[test]
fn reversed_offsets_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(3);
    let path = with_header(dir, "reversed.safetensors", &two([0, 4000], [4040, 4000]), 4040);
    refused(&mut t, &path, &["`dense/bias`", "[4040, 4000]", "reversed"]);
}

#[test]
fn overlapping_offsets_name_both_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(4);
    // The bias begins 20 bytes inside the kernel.
    let path = with_header(dir, "overlap.safetensors", &two([0, 4000], [3980, 4020]), 4020);
    refused(&mut t, &path, &["`dense/kernel`", "`dense/bias`", "overlap", "3980..4020"]);
}

#[test]
fn gapped_offsets_name_the_gap() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(5);
    let path = with_header(dir, "gap.safetensors", &two([0, 4000], [4004, 4044]), 4044);
    refused(&mut t, &path, &["bytes 4000..4004", "`dense/kernel`", "`dense/bias`", "gap"]);
    // Data before the first tensor.
    let path = with_header(dir, "gap_first.safetensors", &two([8, 4008], [4008, 4048]), 4048);
    refused(&mut t, &path, &["bytes 0..8", "first tensor `dense/kernel`", "gap"]);
    // Data after the last one.
    let path = with_header(dir, "trailing.safetensors", &two([0, 4000], [4000, 4040]), 4050);
    refused(&mut t, &path, &["10 bytes", "after the last tensor `dense/bias`", "belong to no tensor"]);
}

#[test]
fn an_overflowing_shape_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(6);
    let header =
        r#"{"dense/kernel":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,0]}}"#;
    let path = with_header(dir, "overflow.safetensors", header, 0);
    refused(&mut t, &path, &["`dense/kernel`", "[4294967296, 4294967296, 16]", "overflows"]);
    // Elements that fit, bytes that do not.
    let header = r#"{"dense/kernel":{"dtype":"F64","shape":[2305843009213693952,1],"data_offsets":[0,0]}}"#;
    let path = with_header(dir, "overflow_bytes.safetensors", header, 0);
    refused(&mut t, &path, &["`dense/kernel`", "overflows"]);
    // An offset of more than 64 bits, a negative one, a fraction.
    for (i, (offsets, why)) in [
        ("[0,18446744073709551616]", "does not fit in 64 bits"),
        ("[-4,36]", "is negative"),
        ("[0,4e1]", "is not an integer"),
    ]
    .into_iter()
    .enumerate()
    {
        let header = format!(r#"{{"dense/bias":{{"dtype":"F32","shape":[10],"data_offsets":{offsets}}}}}"#);
        let path = with_header(dir, &format!("bad_offset{i}.safetensors"), &header, 40);
        refused(&mut t, &path, &["`dense/bias`", "`data_offsets` entry", why]);
    }
}

#[test]
fn duplicate_tensor_names_are_called_duplicates() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(7);
    // Two entries for the bias, both well formed on their own: serde_json would keep the last.
    let header = r#"{"dense/bias":{"dtype":"F32","shape":[10],"data_offsets":[0,40]},"dense/bias":{"dtype":"F32","shape":[10],"data_offsets":[40,80]}}"#;
    let path = with_header(dir, "duplicate.safetensors", header, 80);
    refused(&mut t, &path, &["`dense/bias`", "appears twice", "duplicate"]);
    // A field given twice inside one entry.
    let header = r#"{"dense/bias":{"dtype":"F32","shape":[10],"shape":[5],"data_offsets":[0,40]}}"#;
    let path = with_header(dir, "duplicate_field.safetensors", header, 40);
    refused(&mut t, &path, &["`dense/bias`", "`shape` appears twice", "duplicate"]);
    // A metadata key given twice.
    let header = r#"{"__metadata__":{"format":"a","format":"b"}}"#;
    let path = with_header(dir, "duplicate_metadata.safetensors", header, 0);
    refused(&mut t, &path, &["`__metadata__`", "`format` appears twice", "duplicate"]);
}

#[test]
fn non_string_metadata_is_called_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(8);
    let header =
        r#"{"__metadata__":{"format":1},"dense/bias":{"dtype":"F32","shape":[10],"data_offsets":[0,40]}}"#;
    let path = with_header(dir, "metadata_number.safetensors", header, 40);
    refused(&mut t, &path, &["`__metadata__`", "`format`", "a number, not a string"]);
    let header = r#"{"__metadata__":["format"]}"#;
    let path = with_header(dir, "metadata_array.safetensors", header, 0);
    refused(&mut t, &path, &["`__metadata__` is an array", "strings to strings"]);
}

#[test]
fn malformed_entries_name_the_tensor_and_the_field() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(9);
    let cases = [
        (r#"{"dense/bias":{"dtype":"F32","shape":[10]}}"#, "has no `data_offsets`"),
        (r#"{"dense/bias":{"dtype":32,"shape":[10],"data_offsets":[0,40]}}"#, "`dtype` is a number"),
        (
            r#"{"dense/bias":{"dtype":"F33","shape":[10],"data_offsets":[0,40]}}"#,
            "`F33`, which safetensors does not define",
        ),
        (r#"{"dense/bias":{"dtype":"F32","shape":"10","data_offsets":[0,40]}}"#, "`shape` is a string"),
        (r#"{"dense/bias":{"dtype":"F32","shape":[10],"data_offsets":[0,40,80]}}"#, "holds 3 numbers"),
        (r#"{"dense/bias":[0,40]}"#, "its entry is an array"),
    ];
    for (i, (header, why)) in cases.into_iter().enumerate() {
        let path = with_header(dir, &format!("entry{i}.safetensors"), header, 40);
        refused(&mut t, &path, &["`dense/bias`", why]);
    }
}

#[test]
fn a_huge_or_lying_header_length_is_an_error_not_an_abort() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(10);
    let header = two([0, 4000], [4000, 4040]);
    // 2^62: no allocation is attempted.
    let path = raw(dir, "huge.safetensors", Some(1 << 62), header.as_bytes(), &[0; 4040]);
    refused(&mut t, &path, &["header length", "4611686018427387904", "more than the 100000000 bytes"]);
    // Within the limit, past the end of the file.
    let path = raw(dir, "past_end.safetensors", Some(9000), header.as_bytes(), &[0; 40]);
    refused(&mut t, &path, &["header length", "9000 bytes", "only"]);
    // Fewer than 8 bytes in all.
    let path = dir.join("tiny.safetensors");
    std::fs::write(&path, [1u8, 2, 3]).unwrap();
    refused(&mut t, &path, &["holds 3 bytes", "fewer than the 8 bytes"]);
}

#[test]
fn a_header_that_is_not_json_names_the_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut t = trained(11);
    let path = with_header(dir, "not_json.safetensors", r#"{"dense/bias": nope}"#, 0);
    refused(&mut t, &path, &["not valid JSON", "byte 15 of the header (byte 23 of the file)"]);
    let path = with_header(dir, "trailing_comma.safetensors", r#"{"__metadata__":{"a":"b"},}"#, 0);
    refused(&mut t, &path, &["not valid JSON", "byte 26 of the header"]);
    let path = with_header(dir, "not_object.safetensors", "[1, 2]", 0);
    refused(&mut t, &path, &["must be a JSON object", "byte 0 of the header"]);
    let path = with_header(dir, "after.safetensors", "{} {}", 0);
    refused(&mut t, &path, &["after the header's JSON object", "byte 3 of the header"]);
    let path = raw(dir, "not_utf8.safetensors", None, b"{\"dense\xff\":1}", &[]);
    refused(&mut t, &path, &["not valid UTF-8", "byte 7 of the header (byte 15 of the file)", "0xff"]);
    // Deep nesting in a skipped field is bounded, not a stack overflow.
    let deep = format!(
        r#"{{"dense/bias":{{"dtype":"F32","shape":[10],"data_offsets":[0,40],"extra":{}{}}}}}"#,
        "[".repeat(100_000),
        "]".repeat(100_000)
    );
    let path = with_header(dir, "deep.safetensors", &deep, 40);
    refused(&mut t, &path, &["nested deeper than"]);
}

#[test]
fn a_weights_only_file_starts_fine_tuning_with_fresh_optimizer_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (x, y) = batch(12);
    let mut source = trained(12);
    for _ in 0..3 {
        source.train_step(&x, &y).unwrap();
    }
    let parameters = keys_of(&source, VarRole::Parameter);
    assert_eq!(parameters, ["dense/bias", "dense/kernel", "dense_1/bias", "dense_1/kernel"]);
    let values: Vec<(String, HostTensor)> =
        parameters.iter().map(|k| (k.clone(), source.backend().read_variable(k).unwrap())).collect();
    // Written by the safetensors crate, as published weights would be: parameters only.
    let weights = dir.join("weights.safetensors");
    let bytes: Vec<(&str, Vec<u8>)> = values
        .iter()
        .map(|(k, t)| (k.as_str(), t.data().iter().flat_map(|v| v.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(&str, TensorView<'_>)> = bytes
        .iter()
        .zip(&values)
        .map(|((k, data), (_, t))| {
            (*k, TensorView::new(Dtype::F32, t.shape().dims().to_vec(), data).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, &weights).unwrap();

    // A full load refuses it, says what a full load needs and points at `load_weights`.
    let mut tuned = trainer(99);
    tuned.train_program(x.shape(), y.shape()).unwrap();
    let before = snapshot(&tuned);
    let e = tuned.load(&weights).unwrap_err().to_string();
    assert!(e.contains("`optimizer/dense/bias/m` ([10]) is missing from the file"), "{e}");
    assert!(e.contains("weights-only file"), "{e}");
    assert!(e.contains("`Trainer::load_weights`"), "{e}");
    assert!(e.contains("a full `load` needs every one of the 13 variables"), "{e}");
    assert!(e.contains("4 parameters, the optimizer's 8 state variables"), "{e}");
    assert!(e.contains("the counter `optimizer/iterations`"), "{e}");
    assert_eq!(snapshot(&tuned), before);

    tuned.load_weights(&weights).unwrap();
    for (k, t) in &values {
        assert_eq!(bits(&tuned.backend().read_variable(k).unwrap()), bits(t), "{k}");
    }
    // The optimizer's state is as a fresh trainer's: untouched by the load.
    let state: Vec<_> = before.iter().filter(|(k, _)| !parameters.contains(k)).cloned().collect();
    let after: Vec<_> = snapshot(&tuned).into_iter().filter(|(k, _)| !parameters.contains(k)).collect();
    assert_eq!(after, state);

    // The reference: a fresh trainer whose parameters were set by hand.
    let mut by_hand = trainer(42);
    by_hand.train_program(x.shape(), y.shape()).unwrap();
    for (k, t) in &values {
        by_hand.backend_mut().write_variable(k, t).unwrap();
    }
    for step in 0..3 {
        let (a, b) = (tuned.train_step(&x, &y).unwrap(), by_hand.train_step(&x, &y).unwrap());
        assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "step {step}");
    }
    assert_eq!(snapshot(&tuned), snapshot(&by_hand));

    // A full checkpoint loads as weights too: its optimizer state is ignored.
    let full = dir.join("full.safetensors");
    source.save(&full).unwrap();
    let mut fresh = trainer(7);
    fresh.train_program(x.shape(), y.shape()).unwrap();
    let state_before: Vec<_> =
        snapshot(&fresh).into_iter().filter(|(k, _)| !parameters.contains(k)).collect();
    fresh.load_weights(&full).unwrap();
    let state_after: Vec<_> = snapshot(&fresh).into_iter().filter(|(k, _)| !parameters.contains(k)).collect();
    assert_eq!(state_after, state_before);
    assert_eq!(
        bits(&fresh.backend().read_variable("dense/kernel").unwrap()),
        bits(&source.backend().read_variable("dense/kernel").unwrap())
    );
}

#[test]
fn load_weights_refuses_missing_mismatched_and_foreign_parameters_naming_each() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (x, y) = batch(13);
    let mut t = trained(13);
    let kernel = vec![0u8; 4 * 100 * 12];
    let bias = vec![0u8; 4 * 10];
    let other = vec![0u8; 4 * 3];
    let path = dir.join("bad_weights.safetensors");
    safetensors::serialize_to_file(
        [
            ("dense/kernel", TensorView::new(Dtype::F32, vec![100, 12], &kernel).unwrap()),
            ("dense/bias", TensorView::new(Dtype::F32, vec![10], &bias).unwrap()),
            ("dense_7/bias", TensorView::new(Dtype::F32, vec![3], &other).unwrap()),
            ("optimizer/dense_7/bias/m", TensorView::new(Dtype::F32, vec![3], &other).unwrap()),
        ],
        None,
        &path,
    )
    .unwrap();
    let before = snapshot(&t);
    let e = t.load_weights(&path).unwrap_err().to_string();
    assert!(e.contains("4 differences"), "{e}");
    assert!(e.contains("`dense/kernel` is [100, 12] in the file, [100, 10] in the model"), "{e}");
    assert!(e.contains("`dense_1/kernel` ([10, 1]) is missing from the file"), "{e}");
    assert!(e.contains("`dense_1/bias` ([1]) is missing from the file"), "{e}");
    assert!(e.contains("`dense_7/bias` is in the file but not in the model"), "{e}");
    assert!(!e.contains("optimizer/dense_7"), "optimizer state is ignored: {e}");
    assert_eq!(snapshot(&t), before);
    // Before any program, there is nothing to load into.
    let e = trainer(1).load_weights(&path).unwrap_err().to_string();
    assert!(e.contains("holds no parameters yet"), "{e}");
    let _ = (x, y);
}

#[test]
fn non_finite_values_are_listed_and_load_with_a_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (x, y) = batch(14);
    let source = trained(14);
    let path = dir.join("finite.safetensors");
    source.save(&path).unwrap();
    assert!(checkpoint::read(&path).unwrap().non_finite().is_empty());

    // The same checkpoint with two NaNs in the kernel and an infinity in the bias.
    let mut file = checkpoint::read(&path).unwrap();
    let poison = |t: &HostTensor, at: &[usize], v: f32| {
        let mut data = t.data().to_vec();
        for &i in at {
            data[i] = v;
        }
        HostTensor::new(t.shape().clone(), data).unwrap()
    };
    let kernel = poison(&file.tensors["dense/kernel"], &[3, 17], f32::NAN);
    let bias = poison(&file.tensors["dense/bias"], &[0], f32::INFINITY);
    file.tensors.insert("dense/kernel".into(), kernel);
    file.tensors.insert("dense/bias".into(), bias);
    let values: Vec<(String, HostTensor)> = file.tensors.into_iter().collect();
    let nan = dir.join("nan.safetensors");
    checkpoint::save(&nan, &values).unwrap();

    let read = checkpoint::read(&nan).unwrap();
    assert_eq!(read.non_finite(), [("dense/bias".to_string(), 1), ("dense/kernel".to_string(), 2)]);

    // Both loads accept it (with a warning on stderr), and the trainer then lists the same.
    let mut t = trainer(3);
    t.train_program(x.shape(), y.shape()).unwrap();
    assert!(t.non_finite_variables().unwrap().is_empty());
    t.load(&nan).unwrap();
    assert_eq!(
        t.non_finite_variables().unwrap(),
        [("dense/bias".to_string(), 1), ("dense/kernel".to_string(), 2)]
    );
    assert!(t.train_step(&x, &y).unwrap().loss.is_nan());
    let mut w = trainer(4);
    w.train_program(x.shape(), y.shape()).unwrap();
    w.load_weights(&nan).unwrap();
    assert_eq!(w.non_finite_variables().unwrap().len(), 2);
}

fn quiet(epochs: usize, stop: bool) -> FitOptions {
    FitOptions { epochs, batch_size: 8, shuffle: false, seed: 0, verbose: false, stop_on_non_finite: stop }
}

#[test]
fn fit_stops_at_the_first_non_finite_loss_when_asked() {
    assert!(!FitOptions::default().stop_on_non_finite, "off by default, as Keras");
    let (x, y) = batch(15);
    let rows = x.shape().dims()[0];
    assert!(rows > 16, "three batches of 8 at least");
    // A NaN in the third batch's inputs.
    let mut data = x.data().to_vec();
    data[17 * 100 + 5] = f32::NAN;
    let bad = HostTensor::new(x.shape().clone(), data).unwrap();

    // Off: training goes on, and the epoch's loss reads NaN.
    let mut t = trainer(1);
    let history = t.fit(&bad, &y, &quiet(2, false)).unwrap();
    assert!(history.epochs[0].loss.is_nan());

    // On: an error naming the epoch and batch, and how to investigate.
    let mut t = trainer(1);
    let e = t.fit(&bad, &y, &quiet(2, true)).unwrap_err().to_string();
    let batches = rows.div_ceil(8);
    assert!(e.contains(&format!("became non-finite (NaN) at epoch 1 of 2, batch 3 of {batches}")), "{e}");
    assert!(e.contains("lower the learning rate"), "{e}");
    assert!(e.contains("check the inputs"), "{e}");
    assert!(e.contains("KILN_GUARD=1"), "{e}");
    assert!(e.contains("non_finite_variables"), "{e}");

    // Finite data with the option on trains as without it.
    let (mut a, mut b) = (trainer(2), trainer(2));
    let ha = a.fit(&x, &y, &quiet(2, true)).unwrap();
    let hb = b.fit(&x, &y, &quiet(2, false)).unwrap();
    assert_eq!(ha.epochs, hb.epochs);
}

#[test]
fn fit_stops_when_a_learning_rate_diverges() {
    let (x, y) = batch(16);
    let model = Sequential::new().add(Dense::new(16)).add(Dense::new(1));
    let config =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Sgd::new(1e6).into(), metrics: vec![] };
    let mut t = Trainer::new(model, config, Device::cpu().backend(0).unwrap());
    let e = t.fit(&x, &y, &quiet(50, true)).unwrap_err().to_string();
    assert!(e.contains("the loss became non-finite"), "{e}");
    assert!(e.contains("at epoch "), "{e}");
    assert!(e.contains("lower the learning rate"), "{e}");
    assert!(!t.non_finite_variables().unwrap().is_empty(), "the diverged weights are not finite");
}
