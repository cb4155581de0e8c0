//! i32, i64 and bool tensors end to end: token ids and labels fed as integers train exactly as
//! the same ids as f32 (bit for bit on the CPU, within the GPU tolerance on the emulated CUDA
//! device), are planned at their own sizes, read back exactly, and every dtype mistake is an
//! error that names the op or input and the dtypes.

use kiln::compiler::ir::{DType, VarRole};
use kiln::compiler::nn::Embedding;
use kiln::compiler::step::{InputSpec, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::cuda::{self, CudaBackend, EmulatedDevice};
use kiln::runtime::devices::GB;
use kiln::runtime::memory::Tracker;

const VOCAB: usize = 40;
const SEQ: usize = 6;
const ROWS: usize = 5;

fn model() -> Sequential {
    Sequential::new().add(Embedding::new(VOCAB, 8)).add(Dense::new(VOCAB))
}

fn config() -> TrainConfig {
    TrainConfig {
        loss: Loss::SparseSoftmaxCrossEntropy { ignore_index: None },
        optimizer: Adam::new(1e-2).into(),
        metrics: vec![Metric::SparseCategoricalAccuracy],
    }
}

/// Ids and next ids (with repeats), as `dtype`.
fn batch(dtype: DType) -> (HostTensor, HostTensor) {
    let ids: Vec<i64> = (0..ROWS * SEQ).map(|i| ((i * 7 + i / 3) % VOCAB) as i64).collect();
    let next: Vec<i64> = (0..ROWS * SEQ).map(|i| ((i * 7 + i / 3 + 1) % VOCAB) as i64).collect();
    let shape = [ROWS, SEQ];
    let make = |v: &[i64]| match dtype {
        DType::I32 => HostTensor::from_i32(shape, v.iter().map(|&x| x as i32).collect()).unwrap(),
        DType::I64 => HostTensor::from_i64(shape, v.to_vec()).unwrap(),
        _ => HostTensor::new(shape, v.iter().map(|&x| x as f32).collect()).unwrap(),
    };
    (make(&ids), make(&next))
}

/// Three steps' losses and every variable after them.
fn train(backend: Box<dyn Backend>, dtype: DType) -> (Vec<f32>, Vec<(String, Vec<f32>)>) {
    let mut t = Trainer::new(model(), config(), backend);
    let (x, y) = batch(dtype);
    let losses = (0..3).map(|_| t.train_step(&x, &y).unwrap().loss).collect();
    let keys: Vec<String> = t.plans()[0].variables.iter().map(|v| v.key.clone()).collect();
    let mut vars: Vec<(String, Vec<f32>)> = keys
        .into_iter()
        .map(|k| (k.clone(), t.backend().read_variable(&k).unwrap().data().to_vec()))
        .collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    (losses, vars)
}

#[test]
fn integer_ids_train_bit_for_bit_as_float_ids() {
    let (losses, vars) = train(Box::new(CpuBackend::new(0)), DType::F32);
    assert!(losses[2] < losses[0], "it learns: {losses:?}");
    for d in [DType::I32, DType::I64] {
        let (l, v) = train(Box::new(CpuBackend::new(0)), d);
        assert_eq!(l, losses, "{d} losses");
        assert_eq!(v, vars, "{d} variables");
    }
    // predict and evaluate take integer ids too, in batches that keep their dtype.
    let mut t = Trainer::new(model(), config(), Box::new(CpuBackend::new(0)));
    let (x, y) = batch(DType::I32);
    let p = t.predict(&x).unwrap();
    assert_eq!(p.shape().dims(), &[ROWS, SEQ, VOCAB]);
    let whole = t.evaluate(&x, &y, ROWS).unwrap().loss;
    let batched = t.evaluate(&x, &y, 2).unwrap().loss;
    assert!((whole - batched).abs() < 1e-5, "{whole} vs {batched}");
    let h = t
        .fit(&x, &y, &FitOptions { epochs: 2, batch_size: 2, verbose: false, ..Default::default() })
        .unwrap();
    assert_eq!(h.epochs.len(), 2);
}

#[test]
fn integer_ids_train_on_the_emulated_cuda_device_as_on_the_cpu() {
    if let Err(why) = cuda::emulator::host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let (cpu_losses, cpu_vars) = train(Box::new(CpuBackend::new(0)), DType::I32);
    let device = EmulatedDevice::new(GB).unwrap();
    let gpu = CudaBackend::with_driver(device, 0, vec![], Tracker::default()).unwrap();
    let (losses, vars) = train(Box::new(gpu), DType::I32);
    for (a, b) in cpu_losses.iter().zip(&losses) {
        assert!((a - b).abs() <= 2e-4 * a.abs().max(1.0), "loss {a} on the CPU, {b} emulated");
    }
    for ((k, a), (_, b)) in cpu_vars.iter().zip(&vars) {
        let scale = a.iter().fold(1e-2f32, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() <= 2e-4 * scale, "{k}: {x} on the CPU, {y} emulated");
        }
    }
}

#[test]
fn exact_dtypes_are_planned_at_their_own_size_and_read_back_exactly() {
    let t = Tracer::new("dtypes");
    let ids = t.input_typed("ids", [4, 6], DType::I64);
    let mask = t.input_typed("mask", [4, 6], DType::Bool);
    let x = t.input("x", [4, 6]);
    let kept = &x * &mask.cast(DType::F32);
    t.output("kept", &kept);
    t.output("truncated", &(&x * 10.0).cast(DType::I32));
    t.output("positive", &x.gt(0.5).cast(DType::Bool));
    t.output("ids_as_i32", &ids.cast(DType::I32));
    let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
    let bytes = |name: &str| {
        let b = plan.input(name).or_else(|| plan.output(name)).unwrap();
        let v = plan.value(b.value);
        v.shape.numel() * v.dtype.size_bytes()
    };
    assert_eq!((bytes("ids"), bytes("mask"), bytes("x")), (24 * 8, 24, 24 * 4));
    let mut b = CpuBackend::new(0);
    let id = b.load(plan).unwrap();
    let idv: Vec<i64> = (0..24).map(|i| (i - 12) * 1_000_000_007).collect();
    let maskv: Vec<bool> = (0..24).map(|i| i % 3 != 0).collect();
    let xv: Vec<f32> = (0..24).map(|i| i as f32 / 24.0 - 0.25).collect();
    let out = b
        .call(
            id,
            &[
                ("ids", &HostTensor::from_i64([4, 6], idv.clone()).unwrap()),
                ("mask", &HostTensor::from_bool([4, 6], maskv.clone()).unwrap()),
                ("x", &HostTensor::new([4, 6], xv.clone()).unwrap()),
            ],
        )
        .unwrap();
    let get = |n: &str| out.iter().find(|(k, _)| k == n).unwrap().1.clone();
    let kept: Vec<f32> = xv.iter().zip(&maskv).map(|(&v, &m)| if m { v } else { 0.0 }).collect();
    assert_eq!(get("kept").data(), kept.as_slice());
    let truncated = get("truncated");
    assert_eq!(truncated.dtype(), DType::I32);
    let want: Vec<i64> = xv.iter().map(|&v| i64::from((v * 10.0) as i32)).collect();
    assert_eq!(truncated.ints().unwrap(), want.as_slice());
    let positive: Vec<i64> = xv.iter().map(|&v| i64::from(v > 0.5)).collect();
    assert_eq!(get("positive").ints().unwrap(), positive.as_slice());
    assert_eq!(get("positive").dtype(), DType::Bool);
    let wrapped: Vec<i64> = idv.iter().map(|&v| i64::from(v as i32)).collect();
    assert_eq!(get("ids_as_i32").ints().unwrap(), wrapped.as_slice());
}

#[test]
fn dtype_mistakes_are_errors_that_name_the_op_and_the_dtypes() {
    // Arithmetic on ids.
    let t = Tracer::new("bad");
    let ids = t.input_typed("ids", [3], DType::I32);
    t.output("y", &(&ids + 1.0));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("i32") && e.contains("cast"), "{e}");
    // A bool cannot index.
    let t = Tracer::new("bad");
    let table = t.param("table", [4, 2], Init::Zeros);
    let ids = t.input_typed("ids", [3], DType::Bool);
    t.output("y", &table.gather(&ids));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("bool") && e.contains("gather"), "{e}");
    // Variables are trained: f32 only.
    let t = Tracer::new("bad");
    let v = t.variable("v", [2], DType::I32, VarRole::Parameter, Init::Zeros);
    t.output("v", &v);
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("i32") && e.contains("variable"), "{e}");
    // Feeding f32 where i32 ids are declared, and the other way round.
    let graph = train_step_graph(
        &model(),
        InputSpec::new([ROWS, SEQ], DType::I32),
        InputSpec::new([ROWS, SEQ], DType::I32),
        &config(),
    )
    .unwrap();
    let mut b = CpuBackend::new(0);
    let id = b.load(compile(graph, &CompileOptions::default()).unwrap()).unwrap();
    let (fx, fy) = batch(DType::F32);
    let e = b.call(id, &[("x", &fx), ("y", &fy)]).unwrap_err().to_string();
    assert!(e.contains("expects i32") && e.contains("from_i32"), "{e}");
    let (ix, iy) = batch(DType::I64);
    let e = b.call(id, &[("x", &ix), ("y", &iy)]).unwrap_err().to_string();
    assert!(e.contains("i64"), "{e}");
    // An id outside the vocabulary names the step and the id.
    let bad = HostTensor::from_i32(
        [ROWS, SEQ],
        (0..ROWS * SEQ).map(|i| if i == 4 { VOCAB as i32 } else { 1 }).collect(),
    )
    .unwrap();
    let (_, y) = batch(DType::I32);
    let e = b.call(id, &[("x", &bad), ("y", &y)]).unwrap_err().to_string();
    assert!(e.contains(&format!("id {VOCAB} at position 4")), "{e}");
    // Byte-level feeds must be whole elements of the declared dtype.
    let e =
        b.set_input_bytes(id, "x", &Shape::from([ROWS, SEQ]), DType::I32, &[0u8; 7]).unwrap_err().to_string();
    assert!(e.contains("i32"), "{e}");
}

/// A bool padding mask masks attention exactly as the same mask in f32.
#[test]
fn a_bool_padding_mask_is_the_f32_mask() {
    use kiln::compiler::nn::MultiHeadAttention;
    let (b, s, d) = (2, 5, 8);
    let keep = [true, true, true, false, false, true, true, true, true, false];
    let run = |dtype: DType| {
        let t = Tracer::new("padded");
        let x = t.input("x", [b, s, d]);
        let mask = t.input_typed("mask", [b, s], dtype);
        t.output("y", &MultiHeadAttention::new(2).attend(&x, Some(&mask)));
        let mut cpu = CpuBackend::new(0);
        let id = cpu.load(compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()).unwrap();
        let x =
            HostTensor::new([b, s, d], (0..b * s * d).map(|i| ((i * 29 % 13) as f32 - 6.0) / 6.0).collect())
                .unwrap();
        let mask = match dtype {
            DType::Bool => HostTensor::from_bool([b, s], keep.to_vec()).unwrap(),
            _ => HostTensor::new([b, s], keep.iter().map(|&k| f32::from(u8::from(k))).collect()).unwrap(),
        };
        cpu.call(id, &[("x", &x), ("mask", &mask)]).unwrap().remove(0).1
    };
    assert_eq!(run(DType::Bool), run(DType::F32));
}
