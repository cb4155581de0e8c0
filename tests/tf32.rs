//! Products on the TF32 tensor cores (`kiln::kernels::cuda::set_allow_tf32`) through the whole
//! CUDA backend, on the GPU where there is one and on the emulated device elsewhere: every
//! product within 2^-9 of its sum of |terms| of the CPU's f32 result, and exactly the CPU's
//! (to f32 rounding) on operands that TF32 holds exactly, which no wrong fragment layout could
//! give. Its own test binary: the switch is process-wide, like PyTorch's `allow_tf32`.

mod common;

use kiln::compiler::ir::Padding;
use kiln::kernels::cuda::{allow_tf32, set_allow_tf32};
use kiln::prelude::*;
use kiln::runtime::cuda::{CudaBackend, NvrtcCompiler, emulator, plan_kernels, probe};
use rand::SeedableRng;
use rand::rngs::StdRng;

type Product = (&'static str, Vec<Vec<usize>>, fn(&[Tensor]) -> Tensor);

fn products() -> Vec<Product> {
    vec![
        ("matmul", vec![vec![256, 300], vec![300, 257]], |x| x[0].matmul(&x[1])),
        ("matmul_tn_split", vec![vec![1536, 20], vec![1536, 12]], |x| x[0].matmul_t(&x[1], true, false)),
        ("matmul_batched_nt", vec![vec![3, 67, 129], vec![3, 33, 129]], |x| {
            x[0].matmul_t(&x[1], false, true)
        }),
        ("conv", vec![vec![2, 9, 11, 3], vec![3, 3, 3, 5]], |x| x[0].conv2d(&x[1], [1, 1], Padding::Same)),
    ]
}

/// The GPU, or the emulated device where there is none and a host compiler is.
fn backend() -> Option<CudaBackend> {
    match CudaBackend::new(0, 0) {
        Ok(b) => return Some(b),
        Err(e) if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("KILN_REQUIRE_GPU=1 but no CUDA device is usable: {e}")
        }
        Err(_) => {}
    }
    if let Err(why) = emulator::host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
        eprintln!("skipped: {why}");
        return None;
    }
    Some(CudaBackend::emulated(emulator::DEFAULT_MEMORY, 0).unwrap())
}

fn plan(name: &str, shapes: &[Vec<usize>], f: fn(&[Tensor]) -> Tensor, scratch: bool) -> Plan {
    let t = Tracer::new(name);
    let xs: Vec<Tensor> =
        shapes.iter().enumerate().map(|(i, s)| t.input(&format!("x{i}"), s.clone())).collect();
    t.output("y", &f(&xs));
    let rule = scratch.then_some(kiln::kernels::cuda::SCRATCH);
    compile(t.finish().unwrap(), &CompileOptions::default().with_scratch(rule)).unwrap()
}

fn call(b: &mut dyn Backend, plan: &Plan, feeds: &[HostTensor]) -> Vec<f32> {
    let id = b.load(plan.clone()).unwrap();
    let names: Vec<String> = (0..feeds.len()).map(|i| format!("x{i}")).collect();
    let inputs: Vec<(&str, &HostTensor)> = names.iter().map(|n| n.as_str()).zip(feeds).collect();
    b.call(id, &inputs).unwrap().remove(0).1.data().to_vec()
}

#[test]
fn tf32_products_match_the_cpu_within_tf32_rounding() {
    nvrtc_compiles_the_tensor_core_kernels();
    assert!(!allow_tf32() || std::env::var("KILN_TF32").is_ok(), "off unless asked for");
    let Some(mut gpu) = backend() else { return };
    set_allow_tf32(true);
    let mut rng = StdRng::seed_from_u64(32);
    for (name, shapes, f) in products() {
        let with_scratch = plan(name, &shapes, f, true);
        let kernels = plan_kernels(&with_scratch).unwrap();
        assert!(kernels.iter().any(|k| k.describe.contains("TF32 tensor cores")), "{name}");
        let plain = plan(name, &shapes, f, false);
        for exact in [false, true] {
            let feeds: Vec<HostTensor> = shapes
                .iter()
                .map(|s| {
                    let t = common::draw(&Shape::from(s.as_slice()), common::Draw::Normal, &mut rng);
                    let data =
                        t.data().iter().map(|v| if exact { (v * 8.0).round() / 8.0 } else { *v }).collect();
                    HostTensor::new(Shape::from(s.as_slice()), data).unwrap()
                })
                .collect();
            let abs: Vec<HostTensor> = feeds
                .iter()
                .map(|t| {
                    HostTensor::new(t.shape().clone(), t.data().iter().map(|v| v.abs()).collect()).unwrap()
                })
                .collect();
            let mut cpu = CpuBackend::new(0);
            let (want, terms) = (call(&mut cpu, &plain, &feeds), call(&mut cpu, &plain, &abs));
            let got = call(&mut gpu, &with_scratch, &feeds);
            for (j, ((g, w), s)) in got.iter().zip(&want).zip(&terms).enumerate() {
                let tol = if exact { 1e-6 * s } else { s / 512.0 } + 1e-30;
                assert!(
                    (g - w).abs() <= tol,
                    "{name}{}: element {j} is {g} with TF32, {w} on the CPU (tolerance {tol})",
                    if exact { " (exact operands)" } else { "" }
                );
            }
        }
    }
    set_allow_tf32(false);
    assert!(!allow_tf32());
}

/// NVRTC (no GPU needed) compiles every TF32 kernel for sm_90, the tensor-core instruction in
/// its PTX and a cubin of it: the inline PTX the host never sees.
fn nvrtc_compiles_the_tensor_core_kernels() {
    let nvrtc = match probe::nvrtc() {
        Ok(_) => NvrtcCompiler::new((9, 0)).expect("NVRTC loads").with_disk_cache(None),
        Err(e) if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") => {
            panic!("KILN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}")
        }
        Err(e) => return eprintln!("skipped the NVRTC compile: {e}"),
    };
    set_allow_tf32(true);
    for (name, shapes, f) in products() {
        let kernels = plan_kernels(&plan(name, &shapes, f, true)).unwrap();
        let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
        let ptx = nvrtc.compile_all(&sources).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            ptx.iter().any(|p| p.contains("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")),
            "{name}"
        );
        assert!(ptx.iter().any(|p| p.contains("cvt.rna.tf32.f32")), "{name}");
        for image in nvrtc.compile_images(&sources).unwrap_or_else(|e| panic!("{name}: {e}")) {
            assert!(matches!(&*image, kiln::runtime::cuda::Image::Cubin(_)), "{name}: {}", image.describe());
        }
    }
    set_allow_tf32(false);
}
