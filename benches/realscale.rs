//! `cargo bench --bench realscale`: kiln's plan of one training step of real architectures at
//! the batches they train at, beside PyTorch's own allocation stream for the same step.
//!
//! Each model of `scripts/realscale/models.py` (torchvision's ResNet-50, EfficientNet-B0,
//! MobileNetV3-small and ViT-B/16; transformers' GPT-2 small and BERT-base; random weights) is
//! exported to ONNX (opset 17, TorchScript, training mode, BatchNorm kept as a node, no
//! constant folding) and planned as `kiln memory MODEL --mode train` plans it: MSE against a
//! target of the output's shape, Adam. PyTorch trains the same module two steps with the same
//! loss and optimizer while `scripts/peers/torch_stream.py` records its ATen allocation stream
//! on the CPU (transformers with eager attention and with SDPA), replayed through kiln's model
//! of the CUDA caching allocator, with PyTorch's H100 cuBLAS workspaces
//! (`kiln::torch_stream`). Exports and recordings are kept under target/kiln/realscale.
//!
//! Assumptions beside the table: PyTorch's figure is its reserved peak on the replayed stream
//! (2 MiB/20 MiB segments, as a GPU run reserves), kiln's the bytes its plan asks of a device
//! (arena and persistent buffers rounded as a device allocates); both hold parameters,
//! gradients, Adam's moments, the batch and the target. PyTorch's inputs are fed as it runs
//! (two steps recorded, the peak over both); no cuDNN workspace on either side.
//!
//! XLA's column: the Flax versions of the same models (transformers' Flax GPT-2, BERT, ViT and
//! ResNet-50; EfficientNet-B0 and MobileNetV3-small in flax.linen), the same step (MSE, Adam,
//! parameters and optimizer state donated) in one `jax.jit`, compiled (never run) on jaxlib's
//! CPU backend by `scripts/realscale/xla.py`: argument + output + temp - alias of its buffer
//! assignment, with YNNPACK library fusion off (every intermediate an XLA buffer) and with the
//! default flags beside. kiln / XLA compares kiln's planned total, unrounded as XLA's is.
//!
//! The eager reference is PyTorch's replayed stream: kiln's own eager simulation runs kiln's op
//! stream (its kernels keep what they keep, not what ATen's do) and differs from it by 0.8-1.6x
//! at this scale; its ratio to the replay is shown in its own column, and
//! `kiln memory MODEL.onnx --pytorch-stream FILE` prints the replay beside any plan.
//!
//! Mixed precision beside it: kiln's step in bf16 (`--precision bf16`, `kiln_compiler::autocast`,
//! planned for kernels that read half values) and PyTorch's AMP bf16 step, its forward pass and
//! loss under the CUDA autocast lists (`torch_stream.py --amp bf16`, applied on the CPU by a
//! function mode, as CPU autocast's lists differ), parameters, gradients and Adam's state f32 on
//! both sides, replayed as above.
//!
//! `KILN_REALSCALE_MODELS=resnet50,gpt2` picks models; the interpreter is
//! `KILN_REALSCALE_PYTHON` or a virtual environment made under target/kiln on first use, and
//! XLA's `KILN_REALSCALE_XLA_PYTHON` or another such environment (`kiln::peers::realscale_xla_python`).

use kiln::compare::feeds_for;
use kiln::compiler::Precision;
use kiln::runtime::eager::{FrameworkExtras, WorkspacePolicy};
use kiln::torch_stream::{Recording, replay};
use serde::Serialize;
use std::path::Path;
use std::process::Command;
use std::time::Instant;

const MODELS: [(&str, usize, bool); 6] = [
    ("gpt2", 4, true),
    ("resnet50", 32, false),
    ("vit_b_16", 16, false),
    ("bert", 8, true),
    ("efficientnet_b0", 32, false),
    ("mobilenet_v3_small", 2, false),
];

#[derive(Serialize)]
struct Row {
    model: String,
    batch: usize,
    kiln_planned_total_bytes: usize,
    kiln_device_bytes: usize,
    kiln_arena_bytes: usize,
    kiln_lower_bound_bytes: usize,
    kiln_eager_caching_reserved_bytes: usize,
    kiln_plan_ms: f64,
    pytorch_reserved_bytes: Option<usize>,
    pytorch_sdpa_reserved_bytes: Option<usize>,
    kiln_over_pytorch: Option<f64>,
    kiln_over_pytorch_sdpa: Option<f64>,
    kiln_eager_over_pytorch: Option<f64>,
    step_gflop: f64,
    /// The plan's product FLOPs (matrix products, convolutions, attention and their gradients,
    /// recomputation included; what PyTorch's counter counts), in GFLOP.
    kiln_product_gflop: f64,
    /// PyTorch's `FlopCounterMode` over the same forward pass, 3x (the step's products), in GFLOP.
    pytorch_product_gflop: Option<f64>,
    /// XLA's buffer assignment for the Flax version's training step, argument + output + temp -
    /// alias, YNNPACK library fusion off (`scripts/realscale/xla.py`).
    xla_total_bytes: Option<usize>,
    /// XLA's temporaries in the same compilation.
    xla_temp_bytes: Option<usize>,
    /// XLA's total with jaxlib's default flags (YNNPACK library fusion on).
    xla_default_flags_total_bytes: Option<usize>,
    /// The Flax model's trainable elements (the same architecture as PyTorch's: the same count).
    xla_parameters: Option<usize>,
    /// kiln's planned total over XLA's total (both unrounded).
    kiln_over_xla: Option<f64>,
    /// The versions XLA's figures come from: `jax X, flax Y, transformers Z`.
    xla_versions: Option<String>,
    /// kiln's planned total of the step in bf16 mixed precision (`--precision bf16`), planned
    /// for kernels that read half values.
    kiln_bf16_planned_total_bytes: Option<usize>,
    /// The bytes that bf16 plan asks of a device.
    kiln_bf16_device_bytes: Option<usize>,
    /// PyTorch's AMP bf16 step (the CUDA autocast lists): reserved peak of its replayed stream.
    pytorch_amp_reserved_bytes: Option<usize>,
    /// kiln bf16 device bytes over PyTorch AMP's reserved peak.
    kiln_bf16_over_pytorch_amp: Option<f64>,
    /// kiln's bf16 planned total over its f32 planned total.
    kiln_bf16_over_f32: Option<f64>,
}

fn run(cmd: &mut Command, what: &str) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{what}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{what} failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(())
}

/// PyTorch's reserved peak for `name` on its recorded stream (recorded once into `dir`), with
/// `amp` (`bf16`) its autocast step's (`torch_stream.py --amp`: the CUDA autocast lists).
fn pytorch_reserved(python: &Path, dir: &Path, name: &str, amp: Option<&str>) -> Result<usize, String> {
    let path = match amp {
        None => dir.join(format!("{name}-stream.json")),
        Some(amp) => dir.join(format!("{name}-amp-{amp}-stream.json")),
    };
    if !path.exists() {
        let start = Instant::now();
        let script = "scripts/peers/torch_stream.py";
        let mut cmd = Command::new(python);
        cmd.args([script, "--capture", "dispatch"]);
        if let Some(amp) = amp {
            cmd.args(["--amp", amp]);
        }
        run(cmd.arg(&path).arg(name), &format!("recording {name}"))?;
        eprintln!("{name}: PyTorch's stream recorded in {:.0} s", start.elapsed().as_secs_f64());
    }
    let json = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let rec = Recording::parse(&json).map_err(|e| e.to_string())?;
    let stream = rec.models.get(name).ok_or_else(|| format!("{} has no {name}", path.display()))?;
    let stats =
        replay(stream, &FrameworkExtras::pytorch(WorkspacePolicy::Persistent)).map_err(|e| e.to_string())?;
    Ok(stats.peak_reserved)
}

/// kiln's training step of the export, as `kiln memory --mode train` builds it, and the step's
/// floating-point work (`Op::flops` over its graph).
fn kiln_step(path: &Path, precision: Precision) -> kiln::Result<(kiln::compare::Comparison, u64)> {
    let model = kiln::onnx::OnnxModel::open(path)?;
    let sizes = kiln::onnx::train::sizes(&model, None, &[])?;
    let (x, y) = kiln::onnx::train::specs(&model, &sizes)?;
    let layer = model.clone().into_packed_layer(&sizes)?;
    let graph = kiln::compiler::step::train_step_graph_with(
        &layer,
        x,
        &y,
        &kiln::onnx::train::fine_tuning(),
        1,
        precision,
    )?;
    let flops = graph
        .node_ids()
        .map(|n| {
            let shapes: Vec<&kiln::compiler::ir::Shape> =
                graph.operands(n).iter().map(|&o| &graph.node(o).shape).collect();
            graph.node(n).op.flops(&shapes, &graph.node(n).shape)
        })
        .sum();
    let feeds = feeds_for(&graph, 1)?;
    let feed: Vec<(&str, &kiln::runtime::HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    Ok((kiln::compare::compare_graph(&path.display().to_string(), graph, &feed, false)?, flops))
}

/// The product FLOPs of a plan: matrix products, convolutions and their gradients, attention
/// and its gradient, a fused product's own (not its epilogue's), an update's gradient product.
fn product_flops(plan: &kiln::compiler::Plan) -> u64 {
    use kiln::compiler::ir::Op;
    plan.steps
        .iter()
        .map(|s| {
            let shapes: Vec<&kiln::compiler::ir::Shape> =
                s.inputs.iter().map(|&v| &plan.values[v].shape).collect();
            let scalar = kiln::compiler::ir::Shape::scalar();
            let out = s.output.map_or(&scalar, |o| &plan.values[o].shape);
            match &s.op {
                Op::Fused(f) => f.product().map_or(0, |p| p.flops(&shapes[..shapes.len().min(2)], &f.shape)),
                Op::ApplySgd { product: true, .. } | Op::ApplyAdam { product: true, .. } => {
                    let m = shapes.get(1).map_or(0, |a| a.dims().first().copied().unwrap_or(1)) as u64;
                    2 * shapes.first().map_or(0, |v| v.numel() as u64) * m
                }
                Op::MatMul { .. }
                | Op::MatMulRows { .. }
                | Op::Conv2d { .. }
                | Op::Conv2dBackpropInput { .. }
                | Op::Conv2dBackpropInputReluGrad { .. }
                | Op::Conv2dBackpropFilter { .. }
                | Op::Attention { .. }
                | Op::AttentionGrad { .. } => s.op.flops(&shapes, out),
                _ => 0,
            }
        })
        .sum()
}

/// PyTorch's count of the forward pass's products, 3x: a training step's, each product's
/// backward pass being twice its forward (`scripts/realscale/flops.py`, kept in `dir`).
fn pytorch_step_flops(python: &Path, dir: &Path, name: &str, batch: usize) -> Result<f64, String> {
    let path = dir.join(format!("{name}-flops-batch{batch}.json"));
    if !path.exists() {
        run(
            Command::new(python)
                .arg("scripts/realscale/flops.py")
                .arg(&path)
                .arg(name)
                .arg(batch.to_string()),
            &format!("counting {name}'s FLOPs"),
        )?;
    }
    let json = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
    let forward =
        v["forward_flops"].as_f64().ok_or_else(|| format!("{} has no forward_flops", path.display()))?;
    Ok(3.0 * forward)
}

fn mb(b: usize) -> String {
    let v = b as f64 / 1e6;
    let s = format!("{v:.0}");
    let digits: Vec<char> = s.chars().collect();
    let mut out = String::new();
    for (i, c) in digits.iter().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(*c);
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let python = match kiln::peers::realscale_python() {
        Ok(p) => p,
        Err(why) => {
            println!("skipped: {why}");
            return Ok(());
        }
    };
    let dir = kiln::report::output_dir().join("realscale");
    std::fs::create_dir_all(&dir)?;
    let pick = std::env::var("KILN_REALSCALE_MODELS").ok();
    let picked: Vec<&str> = MODELS
        .iter()
        .map(|m| m.0)
        .filter(|name| pick.as_deref().is_none_or(|p| p.split(',').any(|m| m == *name)))
        .collect();
    let start = Instant::now();
    let xla = match kiln::peers::realscale_xla_figures(&picked) {
        Ok(Some(report)) => {
            eprintln!(
                "XLA: the Flax versions compiled in {:.0} s (jax {}, flax {}, transformers {})",
                start.elapsed().as_secs_f64(),
                report.jax,
                report.flax,
                report.transformers
            );
            Some(report)
        }
        Ok(None) => {
            println!("XLA: skipped (its interpreter could not be had; reason above)");
            None
        }
        Err(e) => {
            println!("XLA: not measured: {e}");
            None
        }
    };
    let mut rows = Vec::new();
    for (name, batch, sdpa) in MODELS {
        if !picked.contains(&name) {
            continue;
        }
        let path = match kiln::peers::realscale_export(&python, &dir, name, batch, false) {
            Ok(p) => p,
            Err(why) => {
                println!("{name}: skipped: {why}");
                continue;
            }
        };
        let start = Instant::now();
        let (c, flops) = kiln_step(&path, Precision::F32)?;
        let half = match kiln_step(&path, Precision::BF16) {
            Ok((h, _)) => Some(h),
            Err(e) => {
                println!("{name}: kiln bf16 not planned: {e}");
                None
            }
        };
        eprintln!(
            "{name}: kiln planned in {:.1} s (compile {:.0} ms)",
            start.elapsed().as_secs_f64(),
            c.plan_ms
        );
        let recorded_as = |name: &str, amp: Option<&str>| match pytorch_reserved(&python, &dir, name, amp) {
            Ok(b) => Some(b),
            Err(why) => {
                println!("{name}: PyTorch not recorded: {why}");
                None
            }
        };
        let products = product_flops(&c.plan) as f64 / 1e9;
        let torch_products = match pytorch_step_flops(&python, &dir, name, batch) {
            Ok(f) => Some(f / 1e9),
            Err(why) => {
                println!("{name}: PyTorch's FLOPs not counted: {why}");
                None
            }
        };
        let recorded = |name: &str| recorded_as(name, None);
        let torch = recorded(name);
        let torch_sdpa = if sdpa { recorded(&format!("{name}-sdpa")) } else { None };
        let torch_amp = recorded_as(name, Some("bf16"));
        let ratio = |d: Option<usize>| d.map(|d| c.device_bytes as f64 / d as f64);
        let flax = xla.as_ref().and_then(|r| r.models.get(name));
        if let Some(f) = flax {
            eprintln!(
                "{name}: XLA {} MB (temp {} MB, default flags {} MB), {} parameters",
                mb(f.figures.total_bytes),
                mb(f.figures.temp_bytes),
                mb(f.figures.default_flags_total_bytes),
                f.parameters
            );
        }
        rows.push(Row {
            model: name.into(),
            batch,
            kiln_planned_total_bytes: c.planned_total_bytes,
            kiln_device_bytes: c.device_bytes,
            kiln_arena_bytes: c.arena_bytes,
            kiln_lower_bound_bytes: c.lower_bound_bytes,
            kiln_eager_caching_reserved_bytes: c.eager_caching_peak_reserved_bytes,
            kiln_plan_ms: c.plan_ms,
            pytorch_reserved_bytes: torch,
            pytorch_sdpa_reserved_bytes: torch_sdpa,
            kiln_over_pytorch: ratio(torch),
            kiln_over_pytorch_sdpa: ratio(torch_sdpa),
            kiln_eager_over_pytorch: torch.map(|t| c.eager_caching_peak_reserved_bytes as f64 / t as f64),
            step_gflop: flops as f64 / 1e9,
            kiln_product_gflop: products,
            pytorch_product_gflop: torch_products,
            xla_total_bytes: flax.map(|f| f.figures.total_bytes),
            xla_temp_bytes: flax.map(|f| f.figures.temp_bytes),
            xla_default_flags_total_bytes: flax.map(|f| f.figures.default_flags_total_bytes),
            xla_parameters: flax.map(|f| f.parameters),
            kiln_over_xla: flax.map(|f| c.planned_total_bytes as f64 / f.figures.total_bytes.max(1) as f64),
            xla_versions: xla
                .as_ref()
                .map(|r| format!("jax {}, flax {}, transformers {}", r.jax, r.flax, r.transformers)),
            kiln_bf16_planned_total_bytes: half.as_ref().map(|h| h.planned_total_bytes),
            kiln_bf16_device_bytes: half.as_ref().map(|h| h.device_bytes),
            pytorch_amp_reserved_bytes: torch_amp,
            kiln_bf16_over_pytorch_amp: half
                .as_ref()
                .zip(torch_amp)
                .map(|(h, t)| h.device_bytes as f64 / t as f64),
            kiln_bf16_over_f32: half
                .as_ref()
                .map(|h| h.planned_total_bytes as f64 / c.planned_total_bytes as f64),
        });
    }
    println!(
        "| model, batch | kiln device | PyTorch reserved | PyTorch SDPA | kiln / PyTorch | kiln / SDPA | kiln eager / PyTorch | XLA (Flax) | kiln planned / XLA | XLA default flags | arena / bound | GFLOP | product FLOPs / 3x PyTorch's forward | plan time |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let opt = |v: Option<usize>| v.map_or("-".to_string(), mb);
        let ratio = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "| {}, {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.3} | {:.1} | {} | {:.1} s |",
            r.model,
            r.batch,
            mb(r.kiln_device_bytes),
            opt(r.pytorch_reserved_bytes),
            opt(r.pytorch_sdpa_reserved_bytes),
            ratio(r.kiln_over_pytorch),
            ratio(r.kiln_over_pytorch_sdpa),
            ratio(r.kiln_eager_over_pytorch),
            opt(r.xla_total_bytes),
            ratio(r.kiln_over_xla),
            opt(r.xla_default_flags_total_bytes),
            r.kiln_arena_bytes as f64 / r.kiln_lower_bound_bytes.max(1) as f64,
            r.step_gflop,
            ratio(r.pytorch_product_gflop.map(|t| r.kiln_product_gflop / t)),
            r.kiln_plan_ms / 1e3,
        );
    }
    println!(
        "MB = 10^6 B. kiln: the bytes its plan asks of a device; PyTorch: reserved peak of its recorded"
    );
    println!("stream replayed through the caching-allocator model with cuBLAS's workspaces; XLA: buffer");
    println!(
        "assignment (argument + output + temp - alias) of the Flax version's jitted step on jaxlib's CPU backend,"
    );
    println!("YNNPACK library fusion off; default flags beside. The eager figure is PyTorch's replayed");
    println!("stream (`kiln memory MODEL.onnx --pytorch-stream target/kiln/realscale/NAME-stream.json`");
    println!("prints it beside the plan); kiln eager / PyTorch is kiln's own op stream under the same");
    println!("allocator against it: kiln's ops are not PyTorch's at this scale, so it is not the reference.");
    println!();
    println!(
        "| model, batch | kiln f32 device | kiln bf16 device | PyTorch AMP bf16 | kiln bf16 / AMP | kiln bf16 / f32 planned |"
    );
    println!("|---|---|---|---|---|---|");
    for r in &rows {
        let opt = |v: Option<usize>| v.map_or("-".to_string(), mb);
        let ratio = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        println!(
            "| {}, {} | {} | {} | {} | {} | {} |",
            r.model,
            r.batch,
            mb(r.kiln_device_bytes),
            opt(r.kiln_bf16_device_bytes),
            opt(r.pytorch_amp_reserved_bytes),
            ratio(r.kiln_bf16_over_pytorch_amp),
            ratio(r.kiln_bf16_over_f32),
        );
    }
    println!("bf16: kiln's plan for kernels that read half values; PyTorch AMP: its stream under the CUDA");
    println!("autocast lists (scripts/peers/torch_stream.py --amp bf16), replayed as above.");
    kiln::results::write("realscale", "cpu", &rows)?;
    Ok(())
}
