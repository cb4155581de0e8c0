//! Checkpoints (`kiln::runtime::checkpoint`, `Trainer::save` / `load`): a resumed run trains on
//! with the very losses of the run it was saved from, the file is plain safetensors, and a file
//! that does not fit the model is refused with every difference named, before anything changes.

use kiln::prelude::*;
use kiln::runtime::checkpoint;
use kiln::zoo;

fn batch(seed: u64) -> (HostTensor, HostTensor) {
    zoo::by_name("seed-mlp").unwrap().batch_data(seed).unwrap()
}

fn trainer(seed: u64) -> Trainer {
    Trainer::new(zoo::seed_mlp(), zoo::seed_config(), Device::cpu().backend(seed).unwrap())
}

fn bits(t: &HostTensor) -> Vec<u32> {
    t.data().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_resumed_run_continues_bit_for_bit() {
    let (x, y) = batch(3);
    let mut a = trainer(1);
    for _ in 0..3 {
        a.train_step(&x, &y).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("resume.safetensors");
    a.save(&path).unwrap();
    let expected: Vec<u32> = (0..4).map(|_| a.train_step(&x, &y).unwrap().loss.to_bits()).collect();

    // Another initialisation, then the checkpoint: the same next losses and variables.
    let mut b = trainer(99);
    b.train_program(x.shape(), y.shape()).unwrap();
    b.load(&path).unwrap();
    let resumed: Vec<u32> = (0..4).map(|_| b.train_step(&x, &y).unwrap().loss.to_bits()).collect();
    assert_eq!(resumed, expected);
    for v in &a.plans()[0].variables {
        let (va, vb) =
            (a.backend().read_variable(&v.key).unwrap(), b.backend().read_variable(&v.key).unwrap());
        assert_eq!(bits(&va), bits(&vb), "{}", v.key);
    }
}

#[test]
fn the_file_is_safetensors_named_by_variable_keys() {
    let (x, y) = batch(4);
    let mut t = trainer(2);
    t.train_step(&x, &y).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("names.safetensors");
    t.save(&path).unwrap();
    let file = checkpoint::read(&path).unwrap();
    let kernel = &file.tensors["dense/kernel"];
    assert_eq!(kernel.shape().dims(), [100, 10]);
    assert_eq!(bits(kernel), bits(&t.backend().read_variable("dense/kernel").unwrap()));
    assert!(file.tensors.contains_key("optimizer/dense/kernel/m"));
    assert!(file.tensors.contains_key("optimizer/iterations"));
    assert_eq!(file.tensors.len(), t.plans()[0].variables.len());
}

#[test]
fn a_checkpoint_of_another_model_is_refused_with_every_difference() {
    let (x, y) = batch(5);
    let mut seed = trainer(3);
    seed.train_step(&x, &y).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("seed.safetensors");
    seed.save(&path).unwrap();

    // Wider hidden layer and SGD with momentum: other shapes, other optimizer state.
    let wider = Sequential::new()
        .add(Dense::new(16).activation(Activation::Relu))
        .add(Dense::new(1).activation(Activation::Sigmoid));
    let config = TrainConfig {
        loss: Loss::BinaryCrossEntropy,
        optimizer: Sgd::new(0.1).momentum(0.9).into(),
        metrics: vec![],
    };
    let mut other = Trainer::new(wider, config, Device::cpu().backend(0).unwrap());
    other.train_program(x.shape(), y.shape()).unwrap();
    let snapshot = |t: &Trainer| -> Vec<Vec<u32>> {
        t.plans()[0].variables.iter().map(|v| bits(&t.backend().read_variable(&v.key).unwrap())).collect()
    };
    let all_before = snapshot(&other);
    let before = other.backend().read_variable("dense/kernel").unwrap();
    let e = other.load(&path).unwrap_err().to_string();
    assert!(e.contains("does not fit the model"), "{e}");
    assert!(e.contains("`dense/kernel` is [100, 10] in the file, [100, 16] in the model"), "{e}");
    assert!(e.contains("`optimizer/dense/kernel/m` is in the file but not in the model"), "{e}");
    assert!(e.contains("`optimizer/dense/kernel/velocity` ([100, 16]) is missing from the file"), "{e}");
    // What a full load needs, and the weights-only alternative.
    assert!(e.contains("a full `load` needs every one of the 8 variables the trainer holds"), "{e}");
    assert!(e.contains("`Trainer::load_weights`"), "{e}");
    // The parameters differ too: not taken for a weights-only file.
    assert!(!e.contains("weights-only file (published weights?)"), "{e}");
    let after = other.backend().read_variable("dense/kernel").unwrap();
    assert_eq!(bits(&before), bits(&after), "a refused checkpoint changed nothing");
    assert_eq!(snapshot(&other), all_before, "nor any other variable");
}

#[test]
fn loading_without_variables_or_from_a_bad_file_is_an_error() {
    // This test's files, removed when it ends (passed or not).
    let tmp = tempfile::tempdir().unwrap();
    let temp = |name: &str| tmp.path().join(name);
    let mut t = trainer(4);
    let path = temp("early.safetensors");
    let e = t.save(&path).unwrap_err().to_string();
    assert!(e.contains("holds no variables yet"), "{e}");
    let e = t.load(&path).unwrap_err().to_string();
    assert!(e.contains("train_program"), "{e}");
    let (x, y) = batch(6);
    t.train_program(x.shape(), y.shape()).unwrap();
    let e = t.load(temp("absent.safetensors")).unwrap_err().to_string();
    assert!(e.contains("cannot read the checkpoint"), "{e}");
    let junk = temp("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint at all").unwrap();
    let e = t.load(&junk).unwrap_err().to_string();
    assert!(e.contains("is not a safetensors file"), "{e}");
    // A file of another dtype: named, not read as f32.
    let f64s = temp("f64.safetensors");
    let data = vec![0u8; 8 * 1000];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F64, vec![100, 10], &data).unwrap();
    safetensors::serialize_to_file([("dense/kernel", view)], None, &f64s).unwrap();
    let e = t.load(&f64s).unwrap_err().to_string();
    assert!(e.contains("`dense/kernel` is F64 in the file; kiln reads F32, F16 and BF16 variables"), "{e}");
}

/// Half values whose f32 widening is known: zeros, the smallest subnormal, ones, the largest
/// finite, infinities and NaN, as bits.
const F16_BITS: [u16; 9] = [0x0000, 0x8000, 0x0001, 0x3c00, 0xbc00, 0x7bff, 0x7c00, 0xfc00, 0x7e00];
const BF16_BITS: [u16; 9] = [0x0000, 0x8000, 0x0001, 0x3f80, 0xbf80, 0x7f7f, 0x7f80, 0xff80, 0x7fc0];

#[test]
fn half_tensors_are_read_as_f32_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("half.safetensors");
    let bytes = |b: &[u16]| b.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let (f16s, bf16s) = (bytes(&F16_BITS), bytes(&BF16_BITS));
    let f32s: Vec<u8> = [1.5f32, -2.0, 3.25].iter().flat_map(|v| v.to_le_bytes()).collect();
    let view =
        |dtype, shape: Vec<usize>, data| safetensors::tensor::TensorView::new(dtype, shape, data).unwrap();
    let views = [
        ("a", view(safetensors::Dtype::F16, vec![3, 3], &f16s)),
        ("b", view(safetensors::Dtype::BF16, vec![9], &bf16s)),
        ("c", view(safetensors::Dtype::F32, vec![3], &f32s)),
    ];
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let file = checkpoint::read(&path).unwrap();
    let want =
        |widen: &dyn Fn(u16) -> f32, b: &[u16]| b.iter().map(|&v| widen(v).to_bits()).collect::<Vec<u32>>();
    assert_eq!(file.tensors["a"].shape().dims(), [3, 3]);
    assert_eq!(bits(&file.tensors["a"]), want(&|v| half::f16::from_bits(v).to_f32(), &F16_BITS));
    assert_eq!(bits(&file.tensors["b"]), want(&|v| half::bf16::from_bits(v).to_f32(), &BF16_BITS));
    // Spot values, independent of the half crate: 1.0, f16's largest 65504, bf16's smallest subnormal.
    assert_eq!(file.tensors["a"].data()[3], 1.0);
    assert_eq!(file.tensors["a"].data()[5], 65504.0);
    assert_eq!(file.tensors["b"].data()[2], f32::from_bits(0x0001_0000));
    assert!(file.tensors["a"].data()[8].is_nan() && file.tensors["b"].data()[8].is_nan());
    assert_eq!(file.tensors["c"].data(), [1.5, -2.0, 3.25]);
    assert_eq!(file.widened.get("a").map(String::as_str), Some("F16"));
    assert_eq!(file.widened.get("b").map(String::as_str), Some("BF16"));
    assert!(!file.widened.contains_key("c") && file.other_dtypes.is_empty());
}

#[test]
fn a_half_copy_rounds_to_nearest_and_loads_back() {
    let (x, y) = batch(7);
    let mut t = trainer(5);
    for _ in 0..2 {
        t.train_step(&x, &y).unwrap();
    }
    let tmp = tempfile::tempdir().unwrap();
    let variables: Vec<(String, HostTensor)> = t.plans()[0]
        .variables
        .iter()
        .map(|v| (v.key.clone(), t.backend().read_variable(&v.key).unwrap()))
        .collect();
    for (dtype, name, ulp) in [(DType::BF16, "BF16", 2f32.powi(-7)), (DType::F16, "F16", 2f32.powi(-10))] {
        let path = tmp.path().join(format!("{name}.safetensors"));
        checkpoint::save_as(&path, &variables, dtype).unwrap();
        // Two bytes a value, plus the header.
        let values: usize = variables.iter().map(|(_, v)| v.data().len()).sum();
        let size = std::fs::metadata(&path).unwrap().len() as usize;
        assert!(size >= 2 * values && size < 2 * values + 4096, "{name}: {size} bytes for {values} values");
        let file = checkpoint::read(&path).unwrap();
        assert_eq!(file.widened.len(), variables.len(), "{name}");
        for (key, value) in &variables {
            for (&got, &v) in file.tensors[key].data().iter().zip(value.data()) {
                let rounded = match dtype {
                    DType::BF16 => half::bf16::from_f32(v).to_f32(),
                    _ => half::f16::from_f32(v).to_f32(),
                };
                assert_eq!(got.to_bits(), rounded.to_bits(), "{name} {key}: {v}");
                // Nearest: within half a unit in the last place (f16's normal range here).
                assert!((got - v).abs() <= v.abs() * ulp / 2.0 + 1e-7, "{name} {key}: {v} -> {got}");
            }
        }
        // A trainer loads the half copy as its f32 variables.
        let mut other = trainer(6);
        other.train_program(x.shape(), y.shape()).unwrap();
        other.load(&path).unwrap();
        let kernel = other.backend().read_variable("dense/kernel").unwrap();
        assert_eq!(bits(&kernel), bits(&file.tensors["dense/kernel"]), "{name}");
        other.train_step(&x, &y).unwrap();
    }
    let e = checkpoint::save_as(&tmp.path().join("ids.safetensors"), &variables, DType::I32).unwrap_err();
    assert!(e.to_string().contains("save as f32, f16 or bf16"), "{e}");
}

#[test]
fn weights_saved_in_bf16_fine_tune_a_fresh_trainer() {
    let (x, y) = batch(8);
    let mut t = trainer(9);
    t.train_step(&x, &y).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("weights-bf16.safetensors");
    t.save_weights(&path, DType::BF16).unwrap();
    let file = checkpoint::read(&path).unwrap();
    // The parameters alone: no optimizer state, no counter.
    let mut keys: Vec<&str> = file.tensors.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["dense/bias", "dense/kernel", "dense_1/bias", "dense_1/kernel"]);
    assert_eq!(file.widened.len(), 4);
    let mut fresh = trainer(10);
    fresh.train_program(x.shape(), y.shape()).unwrap();
    fresh.load_weights(&path).unwrap();
    for key in keys {
        let saved = t.backend().read_variable(key).unwrap();
        let rounded: Vec<u32> =
            saved.data().iter().map(|&v| half::bf16::from_f32(v).to_f32().to_bits()).collect();
        assert_eq!(bits(&fresh.backend().read_variable(key).unwrap()), rounded, "{key}");
    }
    fresh.train_step(&x, &y).unwrap();
    let early = trainer(11);
    let e = early.save_weights(tmp.path().join("none.safetensors"), DType::BF16).unwrap_err();
    assert!(e.to_string().contains("holds no parameters yet"), "{e}");
}
