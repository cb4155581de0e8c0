//! f16 loss scaling inside the plan (`kiln_compiler::loss_scale`): an f16 step differentiates
//! the scaled loss, gates every update on the gradients being finite, skips the step and backs
//! the scale off where they are not, and counts the finite steps; bf16 and f32 steps have none
//! of it. The same sequence on the CPU and on the emulated CUDA device.

use kiln::compiler::ir::{Graph, Op};
use kiln::compiler::loss_scale::{GOOD_STEPS_KEY, SCALE_KEY};
use kiln::compiler::optim::ITERATIONS_KEY;
use kiln::compiler::step::train_step_graph_with;
use kiln::prelude::*;
use kiln::runtime::cuda::{CudaBackend, emulator};
use kiln::runtime::devices::MB;

fn model() -> Sequential {
    Sequential::new().add(Dense::new(16).activation(Activation::Relu)).add(Dense::new(1))
}

fn config() -> TrainConfig {
    TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(0.01).into(), metrics: vec![] }
}

/// Targets of 1000 against predictions near 0: the loss's gradient, about 250 a row, times the
/// first scale 2^16 is far beyond f16's 65,504.
fn batch() -> (HostTensor, HostTensor) {
    let x: Vec<f32> = (0..32).map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0).collect();
    (HostTensor::new(vec![8, 4], x).unwrap(), HostTensor::new(vec![8, 1], vec![1000.0; 8]).unwrap())
}

fn step_graph(precision: Precision) -> Graph {
    train_step_graph_with(&model(), Shape::from([8, 4]), Shape::from([8, 1]), &config(), 1, precision)
        .unwrap()
}

#[test]
fn only_f16_steps_are_scaled_and_gated() {
    for precision in [Precision::F32, Precision::BF16, Precision::F16] {
        let g = step_graph(precision);
        let f16 = precision == Precision::F16;
        let mut updates = 0;
        for n in g.node_ids() {
            let op = &g.node(n).op;
            if matches!(op, Op::ApplyAdam { .. } | Op::AssignAdd { .. }) {
                updates += 1;
                assert_eq!(op.update_gate(g.operands(n).len()).is_some(), f16, "{precision}: {}", op.label());
            }
        }
        assert_eq!(updates, 5, "four parameters and Adam's counter");
        let scales = g.node_ids().filter(|&n| matches!(g.node(n).op, Op::UpdateLossScale { .. })).count();
        assert_eq!(scales, usize::from(f16), "{precision}");
        if !f16 {
            let mut t =
                Trainer::new(model(), config(), Device::cpu().backend(0).unwrap()).with_precision(precision);
            let (x, y) = batch();
            t.train_step(&x, &y).unwrap();
            assert_eq!(t.loss_scale().unwrap(), None, "{precision}");
        }
    }
}

fn read(t: &Trainer, key: &str) -> Vec<f32> {
    t.backend().read_variable(key).unwrap().data().to_vec()
}

/// Trains `steps` steps and checks each against GradScaler's rule: a step that changed the
/// weights kept the scale, counted one more good step and advanced Adam's counter; a step that
/// left them bitwise as they were halved the scale and restarted the count. Returns whether
/// each step applied, and the losses.
fn scaled_run(mut t: Trainer, steps: usize) -> (Vec<bool>, Vec<f32>) {
    let (x, y) = batch();
    t.train_program(x.shape(), y.shape()).unwrap();
    let keys: Vec<String> = t.plans()[0]
        .variables
        .iter()
        .map(|v| v.key.clone())
        .filter(|k| !k.starts_with("optimizer/") && !k.starts_with("loss_scale/"))
        .collect();
    assert_eq!(keys.len(), 4, "{keys:?}");
    let weights = |t: &Trainer| keys.iter().flat_map(|k| read(t, k)).map(f32::to_bits).collect::<Vec<_>>();
    let (mut applied, mut losses) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let (before, scale, good, iterations) =
            (weights(&t), read(&t, SCALE_KEY)[0], read(&t, GOOD_STEPS_KEY)[0], read(&t, ITERATIONS_KEY)[0]);
        losses.push(t.train_step(&x, &y).unwrap().loss);
        let moved = weights(&t) != before;
        let after = (read(&t, SCALE_KEY)[0], read(&t, GOOD_STEPS_KEY)[0], read(&t, ITERATIONS_KEY)[0]);
        let expected =
            if moved { (scale, good + 1.0, iterations + 1.0) } else { (scale / 2.0, 0.0, iterations) };
        assert_eq!(after, expected, "step {step}: (scale, good steps, iterations) after, moved {moved}");
        applied.push(moved);
        assert_eq!(t.loss_scale().unwrap(), Some((after.0, after.1 as u32)));
    }
    (applied, losses)
}

#[test]
fn an_overflowing_f16_step_is_skipped_and_the_scale_backs_off() {
    let trainer = || Trainer::new(model(), config(), Device::cpu().backend(3).unwrap());
    let (applied, losses) = scaled_run(trainer().with_precision(Precision::F16), 24);
    assert!(!applied[0], "2^16 times a gradient of 250 overflows f16: the first step is skipped");
    let first = applied.iter().position(|&a| a).expect("the scale backs off until a step applies");
    // As the model fits the targets its gradients grow, and a step may overflow again.
    let later = applied[first..].iter().filter(|&&a| a).count();
    assert!(later + 2 >= applied.len() - first, "once in range, steps apply: {applied:?}");
    // The loss printed is the unscaled loss: f32's on the first step, within f16's rounding.
    let (x, y) = batch();
    let f32_loss = trainer().train_step(&x, &y).unwrap().loss;
    assert!((losses[0] - f32_loss).abs() <= 0.01 * f32_loss, "{} against f32 {f32_loss}", losses[0]);
    assert!(losses.last().unwrap() < &losses[first], "the applied steps train: {losses:?}");
}

/// The CUDA backend skips the CPU's steps and backs off as it does: on the emulated device, and
/// on a GPU where there is one (required under KILN_REQUIRE_GPU=1).
#[test]
fn the_cuda_backend_skips_and_backs_off_as_the_cpu() {
    let same = |gpu: CudaBackend, what: &str| {
        let cpu =
            Trainer::new(model(), config(), Device::cpu().backend(3).unwrap()).with_precision(Precision::F16);
        let gpu = Trainer::new(model(), config(), Box::new(gpu)).with_precision(Precision::F16);
        let (cpu_applied, cpu_losses) = scaled_run(cpu, 12);
        let (gpu_applied, gpu_losses) = scaled_run(gpu, 12);
        assert_eq!(gpu_applied, cpu_applied, "{what}");
        for (a, b) in cpu_losses.iter().zip(&gpu_losses) {
            assert!(
                (a - b).abs() <= 1e-3 * a.abs(),
                "{cpu_losses:?} on the CPU, {gpu_losses:?} on the {what}"
            );
        }
    };
    match emulator::host::available() {
        Ok(()) => same(CudaBackend::emulated(64 * MB, 3).unwrap(), "emulated device"),
        Err(why) => {
            assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
            eprintln!("skipped the emulated device: {why}");
        }
    }
    match CudaBackend::new(0, 3) {
        Ok(gpu) => same(gpu, "GPU"),
        Err(e) if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("KILN_REQUIRE_GPU=1 but no CUDA device is usable: {e}")
        }
        Err(e) => eprintln!("skipped the GPU: {e}"),
    }
}

/// The scale is the precision's, not the model's: an f16 checkpoint resumes on in f16 with its
/// scale, in bf16 without it, and a bf16 checkpoint resumes in f16 from the first scale.
#[test]
fn checkpoints_carry_the_scale_between_f16_runs_and_leave_it_to_others() {
    let (x, y) = batch();
    let trainer = |precision| {
        let mut t =
            Trainer::new(model(), config(), Device::cpu().backend(3).unwrap()).with_precision(precision);
        t.train_program(x.shape(), y.shape()).unwrap();
        t
    };
    let tmp = tempfile::tempdir().unwrap();
    let (f16_file, bf16_file) = (tmp.path().join("f16.safetensors"), tmp.path().join("bf16.safetensors"));
    let mut a = trainer(Precision::F16);
    for _ in 0..3 {
        a.train_step(&x, &y).unwrap();
    }
    assert_eq!(a.loss_scale().unwrap(), Some((8192.0, 0)));
    a.save(&f16_file).unwrap();
    let mut b = trainer(Precision::BF16);
    b.train_step(&x, &y).unwrap();
    b.save(&bf16_file).unwrap();

    let mut resumed = trainer(Precision::F16);
    resumed.load(&f16_file).unwrap();
    assert_eq!(resumed.loss_scale().unwrap(), Some((8192.0, 0)));
    let mut other = trainer(Precision::BF16);
    other.load(&f16_file).unwrap();
    assert_eq!(read(&other, "dense/kernel"), read(&a, "dense/kernel"));
    // Weights alone, into a trainer of another precision: the scale is no parameter.
    let mut weights = trainer(Precision::F32);
    weights.load_weights(&f16_file).unwrap();
    assert_eq!(read(&weights, "dense/kernel"), read(&a, "dense/kernel"));
    let mut fresh = trainer(Precision::F16);
    fresh.load(&bf16_file).unwrap();
    assert_eq!(fresh.loss_scale().unwrap(), Some((65536.0, 0)));
    assert_eq!(read(&fresh, "dense/kernel"), read(&b, "dense/kernel"));
}
