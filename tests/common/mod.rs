//! Shared test helpers: run one test body on every backend, and check gradients against central
//! finite differences.

#![allow(dead_code)]

use kiln::compiler::autodiff::gradients;
use kiln::compiler::ir::Shape;
use kiln::compiler::widen::HalfKernels;
use kiln::prelude::*;
use kiln::runtime::ProgramId;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Defines `mod $name { fn cpu(); fn cuda() }` running `$body(&mut dyn Backend)` on each backend,
/// as candle's `test_device!` does. Where there is no CUDA device the `cuda` test says
/// "skipped: no CUDA device" on stderr and passes; with KILN_REQUIRE_GPU=1 it fails instead.
#[macro_export]
macro_rules! backend_test {
    ($name:ident, $body:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[test]
            fn cpu() {
                let mut backend = kiln::runtime::CpuBackend::new(0);
                ($body)(&mut backend as &mut dyn kiln::runtime::Backend);
            }
            #[test]
            fn cuda() {
                if let Some(mut backend) = $crate::common::cuda_backend(0) {
                    ($body)(&mut backend as &mut dyn kiln::runtime::Backend);
                }
            }
        }
    };
}

/// A CUDA backend on device 0, or None (after saying why) where there is none. With
/// KILN_REQUIRE_GPU=1 a missing device fails the test.
pub fn cuda_backend(seed: u64) -> Option<kiln::runtime::cuda::CudaBackend> {
    match kiln::runtime::cuda::CudaBackend::new(0, seed) {
        Ok(b) => Some(b),
        Err(e) => {
            if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_GPU=1 but no CUDA device is usable: {e}");
            }
            eprintln!("skipped: no CUDA device ({e})");
            None
        }
    }
}

/// The CUDA drivers a test body that needs the driver itself (memory the caller owns, tensors
/// another library holds) runs on: the emulated device (where a host C++ compiler is; CI has one)
/// and the GPU where there is one (with KILN_REQUIRE_GPU=1 a missing GPU fails the test), each
/// with its name.
pub fn cuda_drivers() -> Vec<(&'static str, std::sync::Arc<dyn kiln::runtime::cuda::Driver>)> {
    use kiln::runtime::cuda::{EmulatedDevice, driver::CudaDriver};
    let mut v: Vec<(&'static str, std::sync::Arc<dyn kiln::runtime::cuda::Driver>)> = Vec::new();
    match kiln::runtime::cuda::emulator::host::available() {
        Ok(()) => v.push(("the emulated device", EmulatedDevice::new(GB).unwrap())),
        Err(why) => {
            assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
            eprintln!("skipped the emulated device: {why}");
        }
    }
    match CudaDriver::new(0) {
        Ok(d) => v.push(("the GPU", std::sync::Arc::new(d))),
        Err(e) if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|x| x == "1") => {
            panic!("KILN_REQUIRE_GPU=1 but no CUDA device is usable: {e}")
        }
        Err(e) => eprintln!("skipped: no CUDA device ({e})"),
    }
    v
}

/// Whether CUDA devices are emulated (`KILN_CUDA_EMULATE=1`): the emulated device runs kernels
/// on the host, so GPU tests train the zoo at small batches there.
pub fn emulated() -> bool {
    kiln::runtime::cuda::probe().emulated
}

/// `m` at its own batch on a real device, at `small` on the emulated device.
pub fn device_batch(m: kiln::zoo::ZooModel, small: usize) -> kiln::zoo::ZooModel {
    if emulated() { m.with_batch(small) } else { m }
}

/// How a test input is drawn.
#[derive(Clone, Copy, Debug)]
pub enum Draw {
    /// Standard normal.
    Normal,
    /// Uniform in [0.5, 2): for log, sqrt, pow bases, divisors.
    Positive,
    /// Magnitude in [0.2, 1.5) with a random sign: away from the kinks of relu, abs, sign.
    AwayFromZero,
    /// A random permutation of evenly spaced values: no ties for max and max-pooling.
    Distinct,
    /// Integers in [0, n) stored as f32 (ids for gather).
    Ids(usize),
    /// 0.0 or 1.0.
    Mask,
}

pub fn draw(shape: &Shape, how: Draw, rng: &mut StdRng) -> HostTensor {
    let n = shape.numel();
    let data: Vec<f32> = match how {
        Draw::Normal => (0..n).map(|_| normal(rng)).collect(),
        Draw::Positive => (0..n).map(|_| rng.random_range(0.5..2.0)).collect(),
        Draw::AwayFromZero => (0..n)
            .map(|_| rng.random_range(0.2f32..1.5) * if rng.random::<bool>() { 1.0 } else { -1.0 })
            .collect(),
        Draw::Distinct => {
            let mut v: Vec<f32> = (0..n).map(|i| (i as f32 - n as f32 / 2.0) * 0.1).collect();
            for i in (1..n).rev() {
                v.swap(i, rng.random_range(0..=i));
            }
            v
        }
        Draw::Ids(k) => (0..n).map(|_| rng.random_range(0..k) as f32).collect(),
        Draw::Mask => (0..n).map(|_| if rng.random::<bool>() { 1.0 } else { 0.0 }).collect(),
    };
    HostTensor::new(shape.clone(), data).expect("shape and data agree")
}

fn normal(rng: &mut StdRng) -> f32 {
    // Box-Muller: enough for test data.
    let (u, v): (f32, f32) = (rng.random_range(1e-6..1.0), rng.random());
    (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
}

fn seed_of(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// Runs a compiled graph on `backend` with `inputs` fed by name.
pub fn run_graph(
    backend: &mut dyn Backend,
    graph: kiln::compiler::ir::Graph,
    inputs: &[(String, HostTensor)],
) -> (ProgramId, Vec<(String, HostTensor)>) {
    // With the scratch the backend's kernels ask for (split-K on CUDA), as a trainer compiles.
    let plan =
        compile(graph, &CompileOptions::default().with_scratch(backend.scratch_rule())).expect("compiles");
    let id = backend.load(plan).expect("loads");
    let feed: Vec<(&str, &HostTensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let out = backend.call(id, &feed).expect("runs");
    (id, out)
}

/// Checks d loss / d input for the inputs in `wrt`, where loss = sum(f(inputs) * r) for a fixed
/// random r, against central differences with step 1e-2. Tolerance: 1e-3 + 3e-3 |numeric|.
pub fn check_gradients(
    backend: &mut dyn Backend,
    name: &str,
    inputs: &[(Shape, Draw)],
    wrt: &[usize],
    f: impl Fn(&[Tensor]) -> Tensor,
) {
    let mut rng = StdRng::seed_from_u64(seed_of(name));
    let data: Vec<HostTensor> = inputs.iter().map(|(s, d)| draw(s, *d, &mut rng)).collect();
    let trace = |with_grads: bool| {
        let t = Tracer::new(name);
        let xs: Vec<Tensor> =
            inputs.iter().enumerate().map(|(i, (s, _))| t.input(&format!("x{i}"), s.clone())).collect();
        let out = f(&xs);
        let r = t.input("r", out.shape().clone());
        let loss = (&out * &r).sum(.., false);
        t.output("loss", &loss);
        let graph = t.finish().unwrap_or_else(|e| panic!("{name}: {e}"));
        if !with_grads {
            return (graph, vec![]);
        }
        let targets: Vec<_> = wrt.iter().map(|&i| xs[i].id().expect("traced")).collect();
        let (mut graph, grads) =
            gradients(graph, loss.id().expect("traced"), &targets).expect("differentiates");
        let mut names = vec![];
        for (k, g) in grads.into_iter().enumerate() {
            let g = g.unwrap_or_else(|| panic!("{name}: no gradient for input {}", wrt[k]));
            graph.set_output(format!("g{k}"), g);
            names.push(format!("g{k}"));
        }
        (graph, names)
    };
    let out_shape = {
        let t = Tracer::new("shape");
        let xs: Vec<Tensor> =
            inputs.iter().enumerate().map(|(i, (s, _))| t.input(&format!("x{i}"), s.clone())).collect();
        f(&xs).shape().clone()
    };
    let r = draw(&out_shape, Draw::Normal, &mut rng);
    let mut feed: Vec<(String, HostTensor)> =
        data.iter().enumerate().map(|(i, d)| (format!("x{i}"), d.clone())).collect();
    feed.push(("r".into(), r));

    let (graph, grad_names) = trace(true);
    let (_, outputs) = run_graph(backend, graph, &feed);
    let (fwd_graph, _) = trace(false);
    let plan = compile(fwd_graph, &CompileOptions::default()).expect("compiles");
    let fwd = backend.load(plan).expect("loads");
    for (k, &i) in wrt.iter().enumerate() {
        let analytic = &outputs.iter().find(|(n, _)| *n == grad_names[k]).expect("gradient output").1;
        assert_eq!(analytic.shape(), &inputs[i].0, "{name}: gradient shape of input {i}");
        let eps = 1e-2f32;
        for e in 0..data[i].data().len() {
            let mut loss_at = |delta: f32| {
                let mut x = feed[i].1.clone();
                x.data_mut()[e] += delta;
                for (n, t) in feed.iter().enumerate() {
                    let t = if n == i { &x } else { &t.1 };
                    backend.set_input(fwd, &feed[n].0, t.shape(), t.data()).expect("feeds");
                }
                backend.run(fwd).expect("runs");
                backend.output(fwd, "loss").expect("loss").item().expect("scalar")
            };
            let numeric = (loss_at(eps) - loss_at(-eps)) / (2.0 * eps);
            let a = analytic.data()[e];
            let tol = 1e-3 + 3e-3 * numeric.abs();
            assert!(
                (a - numeric).abs() <= tol,
                "{name}: d/dx{i}[{e}] analytic {a} vs numeric {numeric} (tolerance {tol})"
            );
        }
    }
}

/// A random dense classifier as the update tests draw them: 1-4 hidden layers of 1-400 units,
/// each with a random activation, and a head over 2-9 classes, with its batch and feature counts.
pub struct DenseCase {
    pub model: Sequential,
    pub depth: usize,
    pub batch: usize,
    pub features: usize,
    pub classes: usize,
}

pub fn random_dense(rng: &mut StdRng) -> DenseCase {
    let activations = [Activation::Relu, Activation::Tanh, Activation::Gelu, Activation::Sigmoid];
    let depth = rng.random_range(1..=4);
    let batch = rng.random_range(1..=96);
    let features = rng.random_range(1..=300);
    let classes = rng.random_range(2..=9);
    let mut model = Sequential::new();
    for _ in 0..depth {
        let act = activations[rng.random_range(0..activations.len())];
        model = model.add(Dense::new(rng.random_range(1..=400)).activation(act));
    }
    model = model.add(Dense::new(classes));
    DenseCase { model, depth, batch, features, classes }
}

/// Runs `graph` in `order` with the reference interpreter (every value in its own buffer) and
/// its `plan` on the CPU backend for `steps` calls on `feeds`: every output and, after them,
/// every variable bitwise equal.
pub fn assert_plan_matches_reference(
    graph: &kiln::compiler::ir::Graph,
    order: &[kiln::compiler::ir::NodeId],
    plan: &Plan,
    feeds: &[(&str, &HostTensor)],
    steps: usize,
) {
    use kiln::runtime::reference::ReferenceInterpreter;
    let mut reference = ReferenceInterpreter::new(7);
    let mut backend = CpuBackend::new(7);
    let id = backend.load(plan.clone()).unwrap();
    for step in 0..steps {
        let want = reference.run(graph, order, feeds).unwrap();
        let got = backend.call(id, feeds).unwrap();
        for (name, t) in &want {
            let g = &got.iter().find(|(n, _)| n == name).unwrap().1;
            assert_eq!(g.data(), t.data(), "step {step}: output {name}");
        }
    }
    for v in &plan.variables {
        let want = reference.read_variable(&v.key, &v.shape).unwrap();
        assert_eq!(backend.read_variable(&v.key).unwrap().data(), want.data(), "{}", v.key);
    }
}

/// Trains two bf16 and two f16 steps of each zoo model `names` (at batch 4) on the CPU (every
/// op widened) and on `gpu` (a fresh CUDA backend from `open`, planned with `scratch` for its
/// half kernels, `Backend::half_kernels`), and holds every output and
/// variable, the f16 loss scale included, to the CPU's within what one half rounding of a
/// slightly different f32 value makes: 1e-2 of the largest magnitude.
pub fn mixed_precision_steps_agree(
    names: &[&str],
    scratch: Option<kiln::compiler::scratch::ScratchRule>,
    open: impl Fn() -> kiln::runtime::cuda::CudaBackend,
    device: &str,
) {
    let near = |what: &str, cpu: &[f32], gpu: &[f32]| {
        let scale = cpu.iter().fold(1.0f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in cpu.iter().zip(gpu).enumerate() {
            assert!(
                (a - b).abs() <= 1e-2 * scale && b.is_finite(),
                "{what}[{i}]: {a} on the CPU, {b} on the {device}"
            );
        }
    };
    for &name in names {
        let m = kiln::zoo::by_name(name).unwrap().with_batch(4);
        for precision in [Precision::BF16, Precision::F16] {
            let graph = kiln::compare::graph_at(&m, kiln::compare::Mode::Train, precision).unwrap();
            let mut cpu = kiln::runtime::CpuBackend::new(5);
            let mut gpu = open();
            let options =
                |scratch, halves| CompileOptions::default().with_scratch(scratch).with_half_kernels(halves);
            let cpu_plan = compile(graph.clone(), &options(None, HalfKernels::NONE)).unwrap();
            let gpu_plan = compile(graph, &options(scratch, gpu.half_kernels())).unwrap();
            let (c, g) = (cpu.load(cpu_plan.clone()).unwrap(), gpu.load(gpu_plan).unwrap());
            for step in 0..2 {
                let (x, y) = m.batch_data(step).unwrap();
                let feeds = [("x", &x), ("y", &y)];
                let (mut a, mut b) = (cpu.call(c, &feeds).unwrap(), gpu.call(g, &feeds).unwrap());
                a.sort_by(|p, q| p.0.cmp(&q.0));
                b.sort_by(|p, q| p.0.cmp(&q.0));
                for ((n, a), (_, b)) in a.iter().zip(&b) {
                    near(&format!("{name} {precision} step {step} {n}"), a.data(), b.data());
                }
            }
            for v in &cpu_plan.variables {
                let (a, b) = (cpu.read_variable(&v.key).unwrap(), gpu.read_variable(&v.key).unwrap());
                near(&format!("{name} {precision} {}", v.key), a.data(), b.data());
            }
        }
    }
}
