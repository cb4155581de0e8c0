//! Custom ops (`kiln::compiler::custom`): the example's hand-written RMSNorm normalisation trains
//! and is planned like a built-in op on the CPU and on the CUDA backend (the emulated device, and
//! the GPU where there is one), its CUDA source
//! compiles with NVRTC, and every mistake (an unregistered name, operands its shape function
//! refuses, a second definition under a taken name, training through an op without a gradient,
//! loading an op without a CUDA kernel on CUDA) is an error that names the op.

mod common;

use kiln::compiler::custom::{CustomCuda, CustomOp, register};
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

/// Subtracts each row's mean, the means kept in the op's scratch (one f32 a row): a custom op
/// that declares scratch.
struct RowCenter;

impl CustomOp for RowCenter {
    fn name(&self) -> &str {
        "row_center"
    }
    fn infer(&self, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
        match operands {
            [(s, DType::F32)] if s.rank() == 2 => Ok(((*s).clone(), DType::F32)),
            _ => Err("takes one f32 matrix".into()),
        }
    }
    fn scratch(&self, shapes: &[&Shape], _: &Shape) -> usize {
        shapes[0].dims()[0] * 4
    }
    fn cpu(&self, _: &[&[f32]], _: &[&Shape], _: &mut [f32]) {
        unreachable!("an op with scratch runs through cpu_with_scratch")
    }
    fn cpu_with_scratch(&self, inputs: &[&[f32]], shapes: &[&Shape], output: &mut [f32], scratch: &mut [u8]) {
        let (rows, cols) = (shapes[0].dims()[0], shapes[0].dims()[1]);
        assert_eq!(scratch.len(), rows * 4, "the scratch the op declared");
        for r in 0..rows {
            let mean = inputs[0][r * cols..(r + 1) * cols].iter().sum::<f32>() / cols as f32;
            scratch[r * 4..r * 4 + 4].copy_from_slice(&mean.to_le_bytes());
        }
        for r in 0..rows {
            let mean = f32::from_le_bytes(scratch[r * 4..r * 4 + 4].try_into().unwrap());
            for c in 0..cols {
                output[r * cols + c] = inputs[0][r * cols + c] - mean;
            }
        }
    }
    fn cuda(&self, shapes: &[&Shape], _: &Shape) -> Option<CustomCuda> {
        let (rows, cols) = (shapes[0].dims()[0], shapes[0].dims()[1]);
        // Thread r sums row r in order into scratch[r], then writes the row: the CPU's sums.
        let source = format!(
            "extern \"C\" __global__ void row_center(const float* __restrict__ in0, float* __restrict__ out, float* __restrict__ scratch) {{
  const int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= {rows}) return;
  float s = 0.0f;
  for (int c = 0; c < {cols}; ++c) s = __fadd_rn(s, in0[r * {cols} + c]);
  scratch[r] = s / (float){cols};
  for (int c = 0; c < {cols}; ++c) out[r * {cols} + c] = in0[r * {cols} + c] - scratch[r];
}}
"
        );
        Some(CustomCuda {
            source,
            function: "row_center".into(),
            grid: [(rows as u32).div_ceil(64), 1, 1],
            block: [64, 1, 1],
        })
    }
}

#[test]
fn a_custom_ops_scratch_is_planned_and_given_to_its_kernels() {
    register(Arc::new(RowCenter)).ok();
    let graph = || {
        let t = Tracer::new("center");
        let x = t.input("x", [37, 5]);
        t.output("y", &(t.custom("row_center", &[&(&x * 2.0)]) + 1.0));
        t.finish().unwrap()
    };
    let x = HostTensor::from_fn([37, 5], |i| ((i * 7 % 11) as f32 - 5.0) / 3.0).unwrap();
    let want: Vec<f32> = (0..37)
        .flat_map(|r| {
            let row: Vec<f32> = (0..5).map(|c| 2.0 * x.data()[r * 5 + c]).collect();
            let mean = row.iter().sum::<f32>() / 5.0;
            row.into_iter().map(move |v| v - mean + 1.0)
        })
        .collect();
    // Planned on every backend, without any backend's rule: a buffer of the step alone.
    let plan = compile(graph(), &CompileOptions::default()).unwrap();
    let centers = |s: &kiln::compiler::plan::Step| matches!(&s.op, kiln::compiler::ir::Op::Custom { name } if name == "row_center");
    let step = plan.steps.iter().position(centers).unwrap();
    let b = &plan.buffers[plan.steps[step].scratch.expect("the declared scratch")];
    assert_eq!((b.bytes, b.first_step, b.last_step), (37 * 4, step, step));
    assert!(plan.render().contains("scratch 148 B"), "{}", plan.render());
    let close = |got: &[f32], on: &str| {
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{g} on {on}, {w} expected");
        }
    };
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(plan.clone()).unwrap();
    close(cpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), "the CPU");
    // The eager executor takes it from its allocator around the op.
    let s = kiln::compiler::optimize(graph()).unwrap();
    let mut eager = kiln::runtime::eager::EagerExecutor::new(
        kiln::runtime::alloc::BfcAllocator::new(kiln::runtime::alloc::HostSource::new(), 1 << 30),
        0,
        kiln::runtime::eager::CpuEager,
    );
    let out = eager.run(&s.graph, &s.order, &[("x", &x)]).unwrap();
    close(out.outputs[0].1.data(), "the CPU eager executor");
    for (name, device) in common::cuda_drivers() {
        let mut gpu = CudaBackend::with_driver(device, 0, vec![], Tracker::default()).unwrap();
        let id = gpu.load(plan.clone()).unwrap();
        close(gpu.call(id, &[("x", &x)]).unwrap()[0].1.data(), name);
        // And the CUDA eager executor, the scratch from its allocator on the device.
        let source = kiln::runtime::cuda::CudaSource::new(&gpu);
        let mut eager = kiln::runtime::eager::EagerExecutor::new(
            kiln::runtime::alloc::BfcAllocator::new(source, 1 << 30),
            0,
            kiln::runtime::cuda::CudaEager::new(&gpu),
        );
        close(eager.run(&s.graph, &s.order, &[("x", &x)]).unwrap().outputs[0].1.data(), name);
    }
    // A plan whose step lacks the scratch the op declares is refused by name, on every backend.
    let mut bad = plan.clone();
    bad.steps[step].scratch = None;
    let e = CpuBackend::new(0).load(bad.clone()).unwrap_err().to_string();
    assert!(
        e.contains("row_center") && e.contains("declares 148 bytes of scratch but the plan gives it 0"),
        "{e}"
    );
    if let Some((_, device)) = common::cuda_drivers().into_iter().next() {
        let mut gpu = CudaBackend::with_driver(device, 0, vec![], Tracker::default()).unwrap();
        let e = gpu.load(bad).unwrap_err().to_string();
        assert!(
            e.contains("row_center") && e.contains("declares 148 bytes of scratch but the plan gives it 0"),
            "{e}"
        );
    }
}
