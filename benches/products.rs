//! `cargo bench --bench products`: kiln's CPU products, shape by shape, against the core's
//! measured FMA peak (`kiln::kernels::cpu::peak`).
//!
//! The shapes are the products of the real-scale models at inference batch 2: the linear
//! layers of BERT-base and GPT-2 small on 2 x 256 tokens and of ViT-B/16 on 2 x 197 (their
//! weights `[N, K]`, read transposed, as an ONNX `Gemm` or `MatMul` by a transposed initializer
//! imports), the classifiers of ResNet-50, EfficientNet-B0 and MobileNetV3-small on 2 images,
//! and ResNet-50's convolutions (NHWC, as kiln plans them). Each is one op compiled alone and
//! run on the CPU backend, its kernels timed alone (`CpuBackend::profile`: no input copied in,
//! no output copied out), the median of `KILN_PRODUCTS_RUNS` (20) runs after a warm-up, on
//! `KILN_PRODUCTS_THREADS` threads (1). A product counts its multiply-adds (M·N·K;
//! a convolution's output elements times its window times its input channels); the fraction
//! is of one core's peak times the threads. `KILN_PRODUCTS_ONLY=ResNet` times the products whose
//! name contains the text. The goal is ≥ 0.8 of the peak for the large products
//! (≥ 10^8 multiply-adds); the table marks each.

use kiln::compiler::ir::Padding;
use kiln::prelude::*;
use kiln::report::env_count;
use kiln::runtime::CpuBackend;
use serde::Serialize;

/// A product to time: a matrix product (`transposed`: the right factor `[N, K]`, read
/// transposed) or an NHWC convolution.
#[derive(Clone, Copy)]
enum Product {
    MatMul { m: usize, k: usize, n: usize, transposed: bool },
    Conv { batch: usize, size: usize, c: usize, f: usize, window: usize, stride: usize },
}

const SHAPES: &[(&str, Product)] = &[
    ("BERT / GPT-2 attention projection", Product::MatMul { m: 512, k: 768, n: 768, transposed: true }),
    ("BERT / GPT-2 MLP up", Product::MatMul { m: 512, k: 768, n: 3072, transposed: true }),
    ("BERT / GPT-2 MLP down", Product::MatMul { m: 512, k: 3072, n: 768, transposed: true }),
    ("ViT-B/16 MLP up", Product::MatMul { m: 394, k: 768, n: 3072, transposed: true }),
    ("GPT-2 logits", Product::MatMul { m: 512, k: 768, n: 50257, transposed: true }),
    ("ResNet-50 classifier", Product::MatMul { m: 2, k: 2048, n: 1000, transposed: true }),
    ("EfficientNet-B0 classifier", Product::MatMul { m: 2, k: 1280, n: 1000, transposed: true }),
    ("MobileNetV3-small classifier", Product::MatMul { m: 2, k: 1024, n: 1000, transposed: true }),
    ("ResNet-50 stem 7x7/2", Product::Conv { batch: 2, size: 224, c: 3, f: 64, window: 7, stride: 2 }),
    ("ResNet-50 3x3, 56x56x64", Product::Conv { batch: 2, size: 56, c: 64, f: 64, window: 3, stride: 1 }),
    ("ResNet-50 3x3, 28x28x128", Product::Conv { batch: 2, size: 28, c: 128, f: 128, window: 3, stride: 1 }),
    ("ResNet-50 3x3, 14x14x256", Product::Conv { batch: 2, size: 14, c: 256, f: 256, window: 3, stride: 1 }),
    ("ResNet-50 3x3, 7x7x512", Product::Conv { batch: 2, size: 7, c: 512, f: 512, window: 3, stride: 1 }),
    (
        "ResNet-50 1x1, 56x56 64->256",
        Product::Conv { batch: 2, size: 56, c: 64, f: 256, window: 1, stride: 1 },
    ),
    (
        "ResNet-50 1x1, 56x56 256->64",
        Product::Conv { batch: 2, size: 56, c: 256, f: 64, window: 1, stride: 1 },
    ),
    (
        "ResNet-50 1x1, 14x14 1024->256",
        Product::Conv { batch: 2, size: 14, c: 1024, f: 256, window: 1, stride: 1 },
    ),
];

/// Multiply-adds from which a product is large (the goal's 0.8 of the peak applies).
const LARGE: f64 = 1e8;

#[derive(Serialize)]
struct Row {
    product: String,
    shape: String,
    fmas: f64,
    ms: f64,
    gfma_per_s: f64,
    /// Of the peak of the cores used.
    fraction_of_peak: f64,
    large: bool,
}

#[derive(Serialize)]
struct Report {
    isa: String,
    threads: usize,
    peak_gfma_per_s_per_core: f64,
    rows: Vec<Row>,
}

/// The one-op graph of `p`, its shape in words and its multiply-adds.
fn graph(p: Product) -> Result<(kiln::compiler::ir::Graph, String, f64)> {
    let t = Tracer::new("product");
    let (y, shape, fmas) = match p {
        Product::MatMul { m, k, n, transposed } => {
            let a = t.input("a", [m, k]);
            let y = if transposed {
                a.matmul_t(&t.input("b", [n, k]), false, true)
            } else {
                a.matmul(&t.input("b", [k, n]))
            };
            let shape =
                format!("{m}x{k} @ {}", if transposed { format!("{n}x{k}ᵀ") } else { format!("{k}x{n}") });
            (y, shape, (m * k * n) as f64)
        }
        Product::Conv { batch, size, c, f, window, stride } => {
            let x = t.input("a", [batch, size, size, c]);
            let w = t.input("b", [window, window, c, f]);
            let y = x.conv2d(&w, [stride, stride], Padding::Same);
            let out = size.div_ceil(stride);
            let shape = format!("{batch}x{size}x{size}x{c} * {window}x{window}x{c}x{f} /{stride}");
            (y, shape, (batch * out * out * f * window * window * c) as f64)
        }
    };
    t.output("y", &y);
    Ok((t.finish()?, shape, fmas))
}

/// Median milliseconds of `p`'s kernels over `runs` runs of its plan on the CPU backend.
fn time(p: Product, runs: usize) -> Result<(String, f64, f64)> {
    let (g, shape, fmas) = graph(p)?;
    let feeds = kiln::compare::feeds_for(&g, 1)?;
    let plan = compile(g, &CompileOptions::default())?;
    let mut backend = CpuBackend::new(0);
    let id = backend.load(plan)?;
    let fed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    // Fed and run once (the warm-up); the profile's runs read the inputs where they are.
    backend.call(id, &fed)?;
    let ns: u64 = backend.profile(id, runs)?.iter().map(|(_, ns)| ns).sum();
    Ok((shape, fmas, ns as f64 / 1e6))
}

fn main() -> Result<()> {
    let threads = env_count("KILN_PRODUCTS_THREADS", 1);
    let runs = env_count("KILN_PRODUCTS_RUNS", 20);
    rayon::ThreadPoolBuilder::new().num_threads(threads).build_global().ok();
    // Measured before the products and after them, the higher kept: the clock a core holds
    // varies from one moment to the next.
    let peak = kiln::kernels::cpu::peak::measure();
    let mut rows = Vec::new();
    let only = std::env::var("KILN_PRODUCTS_ONLY").unwrap_or_default();
    for &(name, p) in SHAPES.iter().filter(|(name, _)| name.contains(only.as_str())) {
        let (shape, fmas, ms) = time(p, runs)?;
        let rate = fmas / ms / 1e6;
        eprintln!("{name}: {ms:.3} ms, {rate:.1} GFMA/s");
        let (product, large) = (name.to_string(), fmas >= LARGE);
        rows.push(Row { product, shape, fmas, ms, gfma_per_s: rate, fraction_of_peak: 0.0, large });
    }
    let per_core = peak.fma_per_second.max(kiln::kernels::cpu::peak::measure().fma_per_second) / 1e9;
    println!(
        "one core's FMA peak: {per_core:.1} GFMA/s ({}, {} lanes); {threads} thread(s), median of {runs} runs",
        peak.isa, peak.lanes
    );
    println!("| product | shape | multiply-adds | ms | GFMA/s | of peak | goal (large: >= 0.8) |");
    println!("|---|---|---|---|---|---|---|");
    for r in &mut rows {
        r.fraction_of_peak = r.gfma_per_s / (per_core * threads as f64);
        let goal = match (r.large, r.fraction_of_peak >= 0.8) {
            (false, _) => "-",
            (true, true) => "met",
            (true, false) => "below",
        };
        println!(
            "| {} | {} | {:.0}M | {:.3} | {:.1} | {:.2} | {goal} |",
            r.product,
            r.shape,
            r.fmas / 1e6,
            r.ms,
            r.gfma_per_s,
            r.fraction_of_peak
        );
    }
    let report = Report { isa: peak.isa.to_string(), threads, peak_gfma_per_s_per_core: per_core, rows };
    kiln::results::write("products", "cpu", &report)?;
    Ok(())
}
