//! Every CUDA kernel the zoo uses compiles with NVRTC to PTX for sm_90 — no GPU needed, NVRTC
//! runs anywhere. `scripts/test.sh` installs NVRTC (PyPI `nvidia-cuda-nvrtc`, CUDA 13.0) and sets
//! KILN_REQUIRE_NVRTC=1, so in CI a missing NVRTC fails these tests; elsewhere they say why they
//! skip. The kernel list of every zoo plan is snapshot-tested (names and launch shapes).

use kiln::compare::{Mode, graph_of};
use kiln::prelude::*;
use kiln::runtime::cuda::{NvrtcCompiler, plan_kernels, probe};
use kiln::zoo;
use std::fmt::Write;

fn compiler() -> Option<NvrtcCompiler> {
    match probe::nvrtc() {
        Ok(info) => {
            eprintln!("NVRTC {}.{} from {}", info.version.0, info.version.1, info.location);
            Some(NvrtcCompiler::new((9, 0)).expect("NVRTC loads").with_disk_cache(None))
        }
        Err(e) => {
            if std::env::var("KILN_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
                panic!("KILN_REQUIRE_NVRTC=1 but NVRTC is missing: {e}");
            }
            eprintln!("skipped: no NVRTC ({e})");
            None
        }
    }
}

fn zoo_plans() -> Vec<(String, Plan)> {
    let mut plans = Vec::new();
    for m in zoo::all() {
        for mode in [Mode::Forward, Mode::Train] {
            let plan = compile(graph_of(&m, mode).unwrap(), &CompileOptions::default()).unwrap();
            plans.push((format!("{}-{}", m.name, mode.name()), plan));
        }
    }
    plans
}

#[test]
fn every_zoo_kernel_compiles_to_ptx_for_sm_90() {
    let Some(nvrtc) = compiler() else { return };
    assert_eq!(nvrtc.arch(), "compute_90");
    let mut total = 0;
    // The mixed-precision training steps too: half casts and rounding, and f16's loss scaling
    // (gated updates, the scale's update).
    let mut plans = zoo_plans();
    for m in zoo::all() {
        for precision in [Precision::BF16, Precision::F16] {
            let graph = kiln::compare::graph_at(&m, Mode::Train, precision).unwrap();
            // The CUDA kernels' half families on half values, the others' through f32 copies
            // (`kiln::compiler::widen`).
            let options = CompileOptions::default()
                .with_half_kernels(kiln::kernels::cuda::HALF_KERNELS)
                .with_scratch(Some(kiln::kernels::cuda::SCRATCH));
            plans.push((format!("{}-train-{precision}", m.name), compile(graph, &options).unwrap()));
        }
    }
    for (name, plan) in plans {
        let kernels = plan_kernels(&plan).unwrap_or_else(|e| panic!("{name}: {e}"));
        let sources: Vec<&str> = kernels.iter().map(|k| k.source.as_str()).collect();
        let ptx = nvrtc.compile_all(&sources).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (k, p) in kernels.iter().zip(&ptx) {
            assert!(p.contains(".target sm_90"), "{name}: PTX not for sm_90");
            for l in &k.launches {
                assert!(
                    p.contains(&format!(".entry {}", l.function)),
                    "{name}: no entry `{}` in the PTX",
                    l.function
                );
            }
        }
        total += kernels.len();
    }
    let stats = nvrtc.stats();
    eprintln!("{total} kernels, {} distinct compiled in {:.1} s", stats.compiled, stats.compile_seconds);
    assert!(stats.compiled > 0);
}

#[test]
fn compiled_kernels_are_cached_in_memory_and_on_disk() {
    let Some(_) = compiler() else { return };
    // A cache directory not yet made, in one removed when the test ends.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("kiln-ptx-cache-test");
    let source = "extern \"C\" __global__ void kiln_probe(float* out) { out[threadIdx.x] = 1.0f; }";
    let a = NvrtcCompiler::new((9, 0)).unwrap().with_disk_cache(Some(dir.clone()));
    let first = a.compile(source).unwrap();
    let again = a.compile(source).unwrap();
    assert_eq!(first, again);
    assert_eq!((a.stats().compiled, a.stats().from_memory), (1, 1));
    let b = NvrtcCompiler::new((9, 0)).unwrap().with_disk_cache(Some(dir.clone()));
    assert_eq!(b.compile(source).unwrap(), first);
    assert_eq!((b.stats().compiled, b.stats().from_disk), (0, 1), "a second process compiles nothing");
    let other_arch = NvrtcCompiler::new((8, 0)).unwrap();
    assert_ne!(other_arch.key(source), a.key(source), "the key includes the architecture");
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    let Some(nvrtc) = compiler() else { return };
    let e = nvrtc
        .compile("// broken\nextern \"C\" __global__ void k(float* o) { o[0] = undefined_name; }")
        .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("undefined_name") && msg.contains("// broken"), "{msg}");
}

#[test]
fn kernel_list_of_every_zoo_plan() {
    let mut out = String::new();
    for (name, plan) in zoo_plans() {
        let kernels = plan_kernels(&plan).unwrap();
        let launches: usize = kernels.iter().map(|k| k.launches.len()).sum();
        let _ = writeln!(out, "{name}: {} steps, {launches} launches", kernels.len());
        for (step, k) in plan.steps.iter().zip(&kernels) {
            for l in &k.launches {
                let _ = writeln!(
                    out,
                    "  {:<24} {:<32} grid {:?} block {:?} smem {}",
                    step.op.name(),
                    l.function,
                    l.grid,
                    l.block,
                    l.shared_bytes
                );
            }
        }
    }
    insta::assert_snapshot!(out);
}

/// The backend loads a cubin for the device's own architecture (no driver JIT, so an NVRTC
/// newer than the driver works), cached like the PTX.
#[test]
fn kernels_compile_to_a_cubin_for_the_device_architecture() {
    let Some(nvrtc) = compiler() else { return };
    let source = "extern \"C\" __global__ void kiln_probe(float* out) { out[threadIdx.x] = 2.0f; }";
    let images = nvrtc.compile_images(&[source, source]).unwrap();
    match &*images[0] {
        kiln::runtime::cuda::Image::Cubin(bytes) => {
            assert_eq!(&bytes[..4], b"\x7fELF", "a cubin is an ELF file")
        }
        other => panic!("expected a cubin for sm_90, got {}", other.describe()),
    }
    assert_eq!(nvrtc.stats().compiled, 1, "the same source twice compiles once");
}

/// The half tensor-core products and convolutions of the mlp's and the cnn's mixed-precision
/// steps assemble into cubins (ptxas runs, so the inline PTX is checked, not only parsed): for
/// sm_90, where `mma.sync` m16n8k16 takes bf16 and f16 (as from sm_80), and for sm_75, where the
/// kernels compute the instruction's meaning through shuffles.
#[test]
fn half_tensor_core_kernels_assemble_for_each_architecture() {
    let Some(_) = compiler() else { return };
    let mut sources = Vec::new();
    for m in ["mlp", "cnn"].map(|name| zoo::by_name(name).unwrap()) {
        for precision in [Precision::BF16, Precision::F16] {
            let graph = kiln::compare::graph_at(&m, Mode::Train, precision).unwrap();
            let options = CompileOptions::default()
                .with_half_kernels(kiln::kernels::cuda::HALF_KERNELS)
                .with_scratch(Some(kiln::kernels::cuda::SCRATCH));
            let plan = compile(graph, &options).unwrap();
            let kernels = plan_kernels(&plan).unwrap();
            sources.extend(kernels.into_iter().map(|k| k.source).filter(|s| s.contains("kiln_mma_")));
        }
    }
    sources.sort();
    sources.dedup();
    assert!(sources.iter().any(|s| s.contains("kiln_mma_bf16(")), "no bf16 tensor-core kernel");
    assert!(sources.iter().any(|s| s.contains("kiln_mma_f16(")), "no f16 tensor-core kernel");
    let sources: Vec<&str> = sources.iter().map(String::as_str).collect();
    for arch in [(7, 5), (9, 0)] {
        let nvrtc = NvrtcCompiler::new(arch).expect("NVRTC loads").with_disk_cache(None);
        for (image, source) in nvrtc.compile_images(&sources).unwrap().iter().zip(&sources) {
            let head = source.lines().next().unwrap_or_default();
            assert!(
                matches!(**image, kiln::runtime::cuda::Image::Cubin(_)),
                "sm_{}{}: no cubin for {head}: {}",
                arch.0,
                arch.1,
                image.describe()
            );
        }
    }
}
