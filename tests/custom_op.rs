//! Custom ops (`kiln::compiler::custom`): the example's hand-written RMSNorm normalisation trains
//! and is planned like a built-in op on the CPU and on the CUDA backend (the emulated device, and
//! the GPU where there is one), its CUDA source
//! compiles with NVRTC, and every mistake (an unregistered name, operands its shape function
//! refuses, a second definition under a taken name, training through an op without a gradient,
//! loading an op without a CUDA kernel on CUDA) is an error that names the op.

mod common;

use kiln::compiler::custom::{CustomOp, register};
use kiln::compiler::ir::{DType, Shape};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::cuda::{self, CudaBackend, EmulatedDevice, NvrtcCompiler, plan_kernels, probe};
use kiln::runtime::devices::GB;
use kiln::runtime::memory::Tracker;
use std::sync::Arc;

#[allow(dead_code)]
#[path = "../examples/custom_kernel.rs"]
mod example;

fn registered() {
    register(Arc::new(example::UnitRmsNorm)).unwrap_or_else(|e| {
        // Tests run in one process on several threads: the first registration wins, later ones
        // of another instance are refused by design.
        assert!(e.contains("already registered"), "{e}");
    });
}

fn model() -> Sequential {
    Sequential::new().add(Dense::new(16).relu()).add(example::HandRmsNorm).add(Dense::new(3))
}

fn config() -> TrainConfig {
    TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(1e-2).into(), metrics: vec![] }
}

fn losses(backend: Box<dyn Backend>) -> Vec<f32> {
    let mut t = Trainer::new(model(), config(), backend);
    let x = HostTensor::from_fn([32, 6], |i| ((i * 37 % 17) as f32 - 8.0) / 8.0).unwrap();
    let y = HostTensor::from_fn([32, 3], |i| ((i * 11 % 7) as f32 - 3.0) / 6.0).unwrap();
    (0..30).map(|_| t.train_step(&x, &y).unwrap().loss).collect()
}

#[test]
fn a_custom_op_trains_and_is_planned_like_a_built_in_op() {
    registered();
    let cpu = losses(Box::new(CpuBackend::new(0)));
    assert!(cpu[29] < cpu[0] * 0.5, "it learns: {cpu:?}");
    let plan = compile(
        train_step_graph(&model(), Shape::new([32, 6]), Shape::new([32, 3]), &config()).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap();
    let dump = plan.render();
    assert!(dump.contains("custom unit_rms_norm"), "{dump}");
    assert_eq!(plan.memory.arena_bytes, plan.memory.lower_bound_bytes);
    // Its kernel on the emulated CUDA device and on the GPU where there is one: the same losses.
    for (name, device) in common::cuda_drivers() {
        let gpu = losses(Box::new(CudaBackend::with_driver(device, 0, vec![], Tracker::default()).unwrap()));
        for (a, b) in cpu.iter().zip(&gpu) {
            assert!((a - b).abs() <= 2e-4 * a.abs().max(1e-2), "{a} on the CPU, {b} on {name}");
        }
    }
}

#[test]
fn the_custom_cuda_source_compiles_with_nvrtc() {
    registered();
    let info = match probe::nvrtc() {
        Ok(info) => info,
        Err(e) => {
            assert!(
                std::env::var("KILN_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "KILN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}"
            );
            eprintln!("skipped: no NVRTC ({e})");
            return;
        }
    };
    let nvrtc = NvrtcCompiler::new((9, 0)).expect("NVRTC loads").with_disk_cache(None);
    let plan = compile(
        train_step_graph(&model(), Shape::new([32, 6]), Shape::new([32, 3]), &config()).unwrap(),
        &CompileOptions::default(),
    )
    .unwrap();
    let kernels = plan_kernels(&plan).unwrap();
    let custom: Vec<&str> =
        kernels.iter().filter(|k| k.describe.contains("unit_rms_norm")).map(|k| k.source.as_str()).collect();
    assert_eq!(custom.len(), 1);
    let ptx = nvrtc
        .compile_all(&custom)
        .unwrap_or_else(|e| panic!("NVRTC {}.{}: {e}", info.version.0, info.version.1));
    assert!(ptx[0].contains(".entry unit_rms_norm"), "{}", ptx[0]);
}

/// An op whose only definition is a shape rule and a CPU kernel (no CUDA, no gradient).
struct Doubler;

impl CustomOp for Doubler {
    fn name(&self) -> &str {
        "doubler"
    }
    fn infer(&self, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
        match operands {
            [(s, DType::F32)] => Ok(((*s).clone(), DType::F32)),
            _ => Err(format!("takes one f32 tensor, got {} operands", operands.len())),
        }
    }
    fn cpu(&self, inputs: &[&[f32]], _: &[&Shape], output: &mut [f32]) {
        output.iter_mut().zip(inputs[0]).for_each(|(o, x)| *o = 2.0 * x);
    }
    fn in_place(&self) -> Option<usize> {
        Some(0)
    }
}

#[test]
fn custom_op_mistakes_are_errors_that_name_the_op() {
    registered();
    register(Arc::new(Doubler)).ok();
    // Computes, in place where the planner chooses.
    let t = Tracer::new("double");
    let x = t.input("x", [4]);
    t.output("y", &(t.custom("doubler", &[&(&x + 1.0)]) + 0.5));
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(t.finish().unwrap(), &CompileOptions::default()).unwrap()).unwrap();
    let out = cpu.call(id, &[("x", &HostTensor::new([4], vec![0.0, 1.0, 2.0, 3.0]).unwrap())]).unwrap();
    assert_eq!(out[0].1.data(), &[2.5, 4.5, 6.5, 8.5]);
    // Unregistered.
    let t = Tracer::new("bad");
    let x = t.input("x", [4]);
    t.output("y", &t.custom("no_such_op", &[&x]));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("no custom op named `no_such_op`") && e.contains("doubler"), "{e}");
    // Refused by its shape function.
    let t = Tracer::new("bad");
    let x = t.input("x", [4]);
    t.output("y", &t.custom("doubler", &[&x, &x]));
    let e = t.finish().unwrap_err().to_string();
    assert!(e.contains("custom op `doubler`: takes one f32 tensor, got 2 operands"), "{e}");
    // Another definition under a taken name.
    let e = register(Arc::new(Doubler)).unwrap_err();
    assert!(e.contains("`doubler` is already registered"), "{e}");
    assert!(register(Arc::new(Doubler) as Arc<dyn CustomOp>).is_err());
    // Training through an op without a gradient.
    let model = Sequential::new().add(Dense::new(4)).add(|x: &Tensor| x.tracer().custom("doubler", &[x]));
    let e =
        train_step_graph(&model, Shape::new([2, 3]), Shape::new([2, 4]), &config()).unwrap_err().to_string();
    assert!(e.contains("custom op `doubler` has no gradient"), "{e}");
    // No CUDA kernel: refused when a CUDA backend loads the plan, naming the op, before any
    // variable of the plan is created.
    if cuda::emulator::host::available().is_ok() {
        let t = Tracer::new("double");
        let x = t.input("x", [4]);
        let w = t.param("w", [4], Init::Zeros);
        t.output("y", &t.custom("doubler", &[&(&x + &w)]));
        let plan = compile(t.finish().unwrap(), &CompileOptions::default()).unwrap();
        let mut gpu =
            CudaBackend::with_driver(EmulatedDevice::new(GB).unwrap(), 0, vec![], Tracker::default())
                .unwrap();
        let e = gpu.load(plan).unwrap_err().to_string();
        assert!(e.contains("doubler") && e.contains("no CUDA kernel"), "{e}");
        assert!(gpu.read_variable("w").is_err(), "nothing half-loaded");
    }
}

/// A kernel that writes more than its shape function said: a clear error, not a crash.
struct Liar;

impl CustomOp for Liar {
    fn name(&self) -> &str {
        "liar"
    }
    fn infer(&self, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
        Ok((Shape::new([2]), operands[0].1))
    }
    fn cpu(&self, inputs: &[&[f32]], _: &[&Shape], output: &mut [f32]) {
        for (i, x) in inputs[0].iter().enumerate() {
            output[i] = *x; // four elements into an output of two
        }
    }
}

#[test]
fn a_kernel_that_disagrees_with_its_shape_function_is_an_error() {
    register(Arc::new(Liar)).ok();
    let t = Tracer::new("liar");
    let x = t.input("x", [4]);
    t.output("y", &(t.custom("liar", &[&x]) + 1.0));
    let graph = t.finish().unwrap();
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(graph.clone(), &CompileOptions::default()).unwrap()).unwrap();
    let x = HostTensor::new([4], vec![1.0; 4]).unwrap();
    let e = cpu.call(id, &[("x", &x)]).unwrap_err().to_string();
    assert!(e.contains("custom op `liar`'s CPU kernel panicked") && e.contains("f32[2]"), "{e}");
    // The reference interpreter says the same.
    let s = kiln::compiler::optimize(graph).unwrap();
    let mut reference = kiln::runtime::reference::ReferenceInterpreter::new(0);
    let e = reference.run(&s.graph, &s.order, &[("x", &x)]).unwrap_err().to_string();
    assert!(e.contains("panicked"), "{e}");
}
