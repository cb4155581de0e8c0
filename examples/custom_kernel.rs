//! Your own kernel as a planned op: `cargo run --release --example custom_kernel`.
//!
//! RMSNorm's normalisation, y = x / sqrt(mean(x², last axis) + ε), written by hand as a custom op
//! (`kiln::compiler::custom`): shape inference, a CPU kernel, a CUDA kernel (one thread per row)
//! and a gradient in kiln's own ops. A small model uses it between two dense layers; the example
//! checks the gradient against finite differences, trains the model on the CPU and, where a CUDA
//! device (or `KILN_CUDA_EMULATE=1`) is present, on it, and shows the op in the plan: planned,
//! sized and listed like a built-in op, by its name.

use kiln::compiler::custom::{CustomCuda, CustomOp, register};
use kiln::compiler::ir::{DType, Shape};
use kiln::compiler::nn::Layer;
use kiln::prelude::*;
use std::sync::Arc;

pub const EPS: f32 = 1e-6;

/// y = x / sqrt(mean(x², last axis) + EPS), row by row.
pub struct UnitRmsNorm;

impl CustomOp for UnitRmsNorm {
    fn name(&self) -> &str {
        "unit_rms_norm"
    }

    fn infer(&self, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String> {
        match operands {
            [(s, DType::F32)] if s.rank() >= 1 => Ok(((*s).clone(), DType::F32)),
            _ => Err("takes one f32 tensor of rank 1 or more".into()),
        }
    }

    fn cpu(&self, inputs: &[&[f32]], shapes: &[&Shape], output: &mut [f32]) {
        let d = shapes[0].dims().last().copied().unwrap_or(1).max(1);
        for (x, y) in inputs[0].chunks(d).zip(output.chunks_mut(d)) {
            let ms = x.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (ms + EPS).sqrt();
            y.iter_mut().zip(x).for_each(|(y, x)| *y = x * r);
        }
    }

    fn cuda(&self, shapes: &[&Shape], _output: &Shape) -> Option<CustomCuda> {
        let d = shapes[0].dims().last().copied().unwrap_or(1).max(1);
        let rows = shapes[0].numel() / d;
        // The same sums in the same order as the CPU kernel: one thread per row.
        let source = format!(
            "extern \"C\" __global__ void unit_rms_norm(const float* __restrict__ in0, float* __restrict__ out) {{
  const long long row = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= {rows}LL) return;
  const float* x = in0 + row * {d};
  float s = 0.0f;
  for (int i = 0; i < {d}; ++i) s = __fadd_rn(s, __fmul_rn(x[i], x[i]));
  const float r = 1.0f / sqrtf(__fadd_rn(s / (float){d}, {EPS:e}f));
  for (int i = 0; i < {d}; ++i) out[row * {d} + i] = __fmul_rn(x[i], r);
}}
"
        );
        let block = 128u32;
        Some(CustomCuda {
            source,
            function: "unit_rms_norm".into(),
            grid: [(rows as u32).div_ceil(block).max(1), 1, 1],
            block: [block, 1, 1],
        })
    }

    /// dx = r (g - y · mean(g y)), r = 1 / sqrt(mean(x²) + EPS).
    fn gradient(&self, x: &[Tensor], y: &Tensor, g: &Tensor) -> Option<Vec<Option<Tensor>>> {
        let r = ((&x[0] * &x[0]).mean(-1, true) + EPS).rsqrt();
        let dx = &r * &(g - &(y * &(g * y).mean(-1, true)));
        Some(vec![Some(dx)])
    }
}

/// The custom op as a layer with a learned scale, like `RmsNorm`.
pub struct HandRmsNorm;

impl Layer for HandRmsNorm {
    fn forward(&self, x: &Tensor) -> Tensor {
        let t = x.tracer();
        let d = x.dims().last().copied().unwrap_or(1);
        let scale = t.param("scale", [d], Init::Constant(1.0));
        t.custom("unit_rms_norm", &[x]) * scale
    }

    fn kind(&self) -> &'static str {
        "hand_rms_norm"
    }
}

fn model() -> Sequential {
    Sequential::new().add(Dense::new(32).relu()).add(HandRmsNorm).add(Dense::new(4))
}

fn config() -> TrainConfig {
    TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(1e-2).into(), metrics: vec![] }
}

fn data() -> Result<(HostTensor, HostTensor)> {
    let x = HostTensor::from_fn([64, 8], |i| ((i * 37 % 17) as f32 - 8.0) / 8.0)?;
    let y =
        HostTensor::from_fn([64, 4], |i| (((i / 4) * 37 % 17) as f32 - 8.0) / 16.0 + (i % 4) as f32 * 0.1)?;
    Ok((x, y))
}

/// The gradient the op declares, at x for an upstream gradient w (the gradient of sum(op(x) · w)),
/// computed by a plan, against central differences of the CPU kernel: the worst relative error.
fn gradient_check() -> Result<f32> {
    let shape = Shape::new([3, 5]);
    let xs: Vec<f32> = (0..15).map(|i| ((i * 7 % 11) as f32 - 5.0) / 4.0).collect();
    let ws: Vec<f32> = (0..15).map(|i| ((i * 5 % 13) as f32 - 6.0) / 6.0).collect();
    let f = |x: &[f32]| -> f32 {
        let mut y = vec![0.0; 15];
        UnitRmsNorm.cpu(&[x], &[&shape], &mut y);
        y.iter().zip(&ws).map(|(a, b)| a * b).sum()
    };
    let t = Tracer::new("gradient_check");
    let x = t.input("x", shape.clone());
    let w = t.input("w", shape.clone());
    let y = t.custom("unit_rms_norm", &[&x]);
    let grads = UnitRmsNorm.gradient(std::slice::from_ref(&x), &y, &w).unwrap_or_default();
    let Some(Some(dx)) = grads.into_iter().next() else {
        return Err(kiln::Error::Runtime(kiln::runtime::RuntimeError::invalid("no gradient", "")));
    };
    t.output("dx", &dx);
    let mut cpu = CpuBackend::new(0);
    let id = cpu.load(compile(t.finish()?, &CompileOptions::default())?)?;
    let feeds = [
        ("x", HostTensor::new(shape.clone(), xs.clone())?),
        ("w", HostTensor::new(shape.clone(), ws.clone())?),
    ];
    let out = cpu.call(id, &[("x", &feeds[0].1), ("w", &feeds[1].1)])?;
    let analytic = out[0].1.data().to_vec();
    let mut worst = 0.0f32;
    for i in 0..15 {
        let h = 1e-2;
        let (mut a, mut b) = (xs.clone(), xs.clone());
        a[i] += h;
        b[i] -= h;
        let numeric = (f(&a) - f(&b)) / (2.0 * h);
        worst = worst.max((numeric - analytic[i]).abs() / numeric.abs().max(1.0));
    }
    Ok(worst)
}

fn train(backend: Box<dyn Backend>, label: &str) -> Result<Vec<f32>> {
    let mut trainer = Trainer::new(model(), config(), backend);
    let (x, y) = data()?;
    let mut losses = Vec::new();
    for step in 0..60 {
        let loss = trainer.train_step(&x, &y)?.loss;
        if step % 20 == 0 || step == 59 {
            losses.push(loss);
        }
    }
    println!("{label}: loss {}", losses.iter().map(|l| format!("{l:.4}")).collect::<Vec<_>>().join(" -> "));
    Ok(losses)
}

fn main() -> Result<()> {
    register(Arc::new(UnitRmsNorm))
        .map_err(|e| kiln::Error::Runtime(kiln::runtime::RuntimeError::invalid(e, "")))?;
    let worst = gradient_check()?;
    println!("gradient of unit_rms_norm vs central differences: worst relative error {worst:.2e}");
    let cpu = train(Box::new(CpuBackend::new(0)), "cpu")?;
    match Device::best() {
        (device @ Device::Cuda(_), why) => {
            let gpu = train(device.backend(0)?, &format!("{device} ({why})"))?;
            let worst =
                cpu.iter().zip(&gpu).map(|(a, b)| (a - b).abs() / a.abs().max(1e-3)).fold(0.0, f32::max);
            println!("losses on {device} vs the CPU: worst relative difference {worst:.2e}");
        }
        (_, why) => println!("{why}: set KILN_CUDA_EMULATE=1 to run the CUDA kernel on the emulated device"),
    }
    let (x, y) = data()?;
    let plan = compile(
        kiln::compiler::step::train_step_graph(&model(), x.shape(), y.shape(), &config())?,
        &CompileOptions::default(),
    )?;
    println!("\nthe training step's plan lists it like any op:");
    for line in plan.render().lines().filter(|l| l.contains("unit_rms_norm") || l.starts_with("plan ")) {
        println!("  {line}");
    }
    println!("arena {} B (lower bound {} B)", plan.memory.arena_bytes, plan.memory.lower_bound_bytes);
    Ok(())
}
