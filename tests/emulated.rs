//! The CUDA backend end to end on the emulated device (`kiln::runtime::cuda::emulator`): the same
//! backend code that runs on a GPU, over the driver seam, with generated kernels built for the
//! host. Runs everywhere a C++ compiler is (CI has one; elsewhere the tests say why they skip).

mod common;

use kiln::compiler::ir::DeviceId;
use kiln::compiler::placement::Placed;
use kiln::compiler::plan::Storage;
use kiln::kernels::cuda::{Arg, CudaKernel, Launch};
use kiln::prelude::*;
use kiln::runtime::alloc::{Allocator, BfcAllocator, HostSource};
use kiln::runtime::cuda::{self, CudaBackend, CudaEager, CudaSource, Driver, EmulatedDevice};
use kiln::runtime::devices::{DeviceConfig, GB, MB};
use kiln::runtime::eager::{CpuEager, EagerExecutor};
use kiln::runtime::memory::Tracker;
use kiln::zoo;
use std::sync::Arc;

#[path = "common/unseen.rs"]
mod unseen;

fn host_compiler() -> bool {
    match cuda::emulator::host::available() {
        Ok(()) => true,
        Err(why) => {
            assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
            eprintln!("skipped: {why}");
            false
        }
    }
}

fn train_plan(name: &str, batch: usize) -> Plan {
    let m = zoo::by_name(name).unwrap().with_batch(batch);
    compile(kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap(), &CompileOptions::default())
        .unwrap()
}

/// Losses and weights equal to the CPU's within the GPU tests' tolerance (2e-4 of the larger of
/// the value's scale and `floor`).
fn close(what: &str, cpu: &[f32], gpu: &[f32], floor: f32) {
    assert_eq!(cpu.len(), gpu.len(), "{what}");
    let scale = cpu.iter().fold(floor, |m, v| m.max(v.abs()));
    for (i, (a, b)) in cpu.iter().zip(gpu).enumerate() {
        assert!((a - b).abs() <= 2e-4 * scale && b.is_finite(), "{what}[{i}]: {a} on the CPU, {b} emulated");
    }
}

/// Every zoo model trains on the emulated device under one of the memory policies (two logical
/// devices, preallocation of everything, a fraction under a limit, growth): losses and weights
/// as on the CPU, no device allocation while steps run, an over-limit plan refused before
/// anything runs, preallocation sized from free memory, and one device's books shared by two
/// backends. One test, in order: the process's emulated device is one device for all of it.
#[test]
fn every_zoo_model_trains_on_the_emulated_device_under_every_policy() {
    if !host_compiler() {
        return;
    }
    cuda::emulate_in_process(4 * GB);
    let start = std::time::Instant::now();
    let detect = || DeviceConfig::detect();
    assert!(detect().has_gpu(), "the emulated device is detected");
    type Configure = fn(DeviceConfig) -> DeviceConfig;
    let policies: [(&str, Configure, &[&str]); 4] = [
        ("seed-mlp", |c| c.set_logical_devices("gpu:0", &[256 * MB, 256 * MB]), &["gpu:0", "gpu:1"]),
        ("mlp", |c| c.set_memory_growth("gpu:0", false), &["gpu:0"]),
        ("cnn", |c| c.set_memory_limit("gpu:0", GB).set_memory_fraction("gpu:0", 0.5), &["gpu:0"]),
        ("transformer", |c| c.set_memory_growth("gpu:0", true), &["gpu:0"]),
    ];
    for (name, configure, names) in policies {
        let devices = configure(detect()).build().unwrap();
        // Batch 1 for the transformer: its attention kernels are the emulator's slowest.
        let m = zoo::by_name(name).unwrap().with_batch(if name == "transformer" { 1 } else { 2 });
        let (x, y) = m.batch_data(4).unwrap();
        let last = DeviceId(names.len() as u32 - 1);
        let layers = m.model().len();
        let placed = Placed::new(m.model(), vec![(DeviceId(0), 0..1), (last, 1..layers)]);
        let mut gpu = Trainer::new(placed, m.config(), devices.backend(names, 11).unwrap())
            .with_options(devices.compile_options(names).unwrap());
        let mut cpu = Trainer::new(m.model(), m.config(), Device::cpu().backend(11).unwrap());
        let mut held = None;
        for step in 0..2 {
            let (a, b) = (cpu.train_step(&x, &y).unwrap().loss, gpu.train_step(&x, &y).unwrap().loss);
            close(&format!("{name} loss at step {step}"), &[a], &[b], 1e-3);
            let now: Vec<_> = names.iter().map(|n| devices.memory_info(n).unwrap()).collect();
            if step > 0 {
                assert_eq!(held.as_ref(), Some(&now), "{name}: steps allocated device memory");
            }
            held = Some(now);
        }
        for v in &cpu.plans()[0].variables {
            let (c, g) =
                (cpu.backend().read_variable(&v.key).unwrap(), gpu.backend().read_variable(&v.key).unwrap());
            close(&format!("{name} {}", v.key), c.data(), g.data(), 0.1);
        }
        let planned = devices.memory_info(names[0]).unwrap();
        assert!(planned.planned.current > 0 && planned.driver.is_some(), "{name}: {planned:?}");
        eprintln!("{name}: trained on {names:?} ({:.1} s so far)", start.elapsed().as_secs_f64());
    }

    // Growth off takes the free memory less the headroom, not the total (which cannot fit).
    let all = detect().set_memory_growth("gpu:0", false).build().unwrap();
    let pool = all.logical()[1].budget.pool_bytes().unwrap();
    let (free, total) = all.memory_info("gpu:0").unwrap().driver.unwrap();
    assert!(pool < free && total - pool >= cuda::headroom(total), "pool {pool}, free {free}, total {total}");
    let backend = all.backend(&["gpu:0"], 0).unwrap();
    drop(backend);
    drop(all);

    // A plan over the limit is refused when it compiles, before anything is allocated.
    let small = detect().set_memory_limit("gpu:0", 16 * 1024).build().unwrap();
    let mut trainer =
        Trainer::new(zoo::seed_mlp(), zoo::seed_config(), small.backend(&["gpu:0"], 0).unwrap())
            .with_options(small.compile_options(&["gpu:0"]).unwrap());
    let (x, y) = zoo::by_name("seed-mlp").unwrap().batch_data(1).unwrap();
    let e = trainer.train_step(&x, &y).unwrap_err().to_string();
    assert!(e.starts_with("out of memory on device gpu:0") && e.contains("help:"), "{e}");
    assert_eq!(small.memory_info("gpu:0").unwrap().planned.current, 0, "nothing was allocated");
    drop(trainer);
    drop(small);

    // Two backends on one device share its books: together they stay under its limit.
    let limited = detect().set_memory_limit("gpu:0", 40 * MB).build().unwrap();
    let options = limited.compile_options(&["gpu:0"]).unwrap();
    let mlp = zoo::by_name("mlp").unwrap();
    let plan = compile(kiln::compare::graph_of(&mlp, kiln::compare::Mode::Train).unwrap(), &options).unwrap();
    let mut first = limited.backend(&["gpu:0"], 0).unwrap();
    let mut second = limited.backend(&["gpu:0"], 0).unwrap();
    first.load(plan.clone()).unwrap();
    let e = second.load(plan).unwrap_err().to_string();
    assert!(e.contains("gpu:0 cannot hold") && e.contains("40.00 MiB limit"), "{e}");
    eprintln!("emulated policies: {:.1} s", start.elapsed().as_secs_f64());
}

/// The CUDA eager executor on the emulated device: results as the planned CPU backend's, and
/// its allocator's reserved and in-use peaks those of the same allocator on the host, beside
/// the plan's arena.
#[test]
fn cuda_eager_on_the_emulated_device_matches_the_cpu() {
    if !host_compiler() {
        return;
    }
    let gpu = CudaBackend::emulated(GB, 5).unwrap();
    for name in ["seed-mlp", "mlp"] {
        let m = zoo::by_name(name).unwrap().with_batch(2);
        let (x, y) = m.batch_data(3).unwrap();
        let graph = kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap();
        let plan = compile(graph.clone(), &CompileOptions::default()).unwrap();
        let s = kiln::compiler::optimize(graph).unwrap();
        let mut cuda =
            EagerExecutor::new(BfcAllocator::new(CudaSource::new(&gpu), GB), 5, CudaEager::new(&gpu));
        let mut host = EagerExecutor::new(BfcAllocator::new(HostSource::new(), GB), 5, CpuEager);
        for _ in 0..2 {
            let (c, h) = (
                cuda.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap(),
                host.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap(),
            );
            for ((n, a), (_, b)) in h.outputs.iter().zip(&c.outputs) {
                close(&format!("{name} eager {n}"), a.data(), b.data(), 1e-3);
            }
        }
        let (c, h) = (cuda.allocator().stats(), host.allocator().stats());
        assert_eq!((c.peak_reserved, c.peak_in_use), (h.peak_reserved, h.peak_in_use), "{name}");
        assert!(plan.memory.arena_bytes <= c.peak_in_use + plan.memory.persistent_bytes, "{name}");
        eprintln!(
            "{name}: eager reserved peak {} B, in use {} B; planned arena {} B",
            c.peak_reserved, c.peak_in_use, plan.memory.arena_bytes
        );
    }
}

/// The eager executor runs the transformer's bf16 training step op by op on the emulated device
/// as on the host: its half attention gradient takes the f32 scratch it needs from the allocator
/// (`kiln::kernels::cuda::required_scratch`).
#[test]
fn cuda_eager_runs_a_half_attention_gradient() {
    if !host_compiler() {
        return;
    }
    let gpu = CudaBackend::emulated(GB, 5).unwrap();
    let m = zoo::by_name("transformer").unwrap().with_batch(2);
    let (x, y) = m.batch_data(3).unwrap();
    let graph =
        kiln::compare::graph_at(&m, kiln::compare::Mode::Train, kiln::compiler::Precision::BF16).unwrap();
    let s = kiln::compiler::optimize(graph).unwrap();
    use kiln::compiler::ir::{DType, Op};
    let half_grad = |is: fn(&Op) -> bool| {
        s.graph.node_ids().any(|n| is(&s.graph.node(n).op) && s.graph.node(n).dtype == DType::BF16)
    };
    assert!(half_grad(|op| matches!(op, Op::AttentionGrad { .. })), "no bf16 attention gradient");
    let mut cuda = EagerExecutor::new(BfcAllocator::new(CudaSource::new(&gpu), GB), 5, CudaEager::new(&gpu));
    let mut host = EagerExecutor::new(BfcAllocator::new(HostSource::new(), GB), 5, CpuEager);
    let feeds = [("x", &x), ("y", &y)];
    let (c, h) =
        (cuda.run(&s.graph, &s.order, &feeds).unwrap(), host.run(&s.graph, &s.order, &feeds).unwrap());
    for ((n, a), (_, b)) in h.outputs.iter().zip(&c.outputs) {
        close(&format!("transformer bf16 eager {n}"), a.data(), b.data(), 1e-2);
    }
}

fn kernel(source: &str, function: &str, grid: u32, block: u32) -> CudaKernel {
    CudaKernel {
        source: source.into(),
        launches: vec![Launch {
            function: function.into(),
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_bytes: 0,
            args: vec![Arg::Output],
        }],
        describe: function.into(),
    }
}

/// The sanitizer: a kernel writing past its allocation is reported, naming it; an argument
/// outside every allocation too; copies outside an allocation are refused.
#[test]
fn the_emulated_device_reports_writes_outside_an_allocation() {
    if !host_compiler() {
        return;
    }
    let fill = "extern \"C\" __global__ void kiln_fill(float* x) { x[blockIdx.x * blockDim.x + threadIdx.x] = 1.0f; }";
    let k = kernel(fill, "kiln_fill", 1, 32);
    let device = EmulatedDevice::new(GB).unwrap();
    let f = device.load(&[&k]).unwrap().remove(0).remove(0);
    let fits = device.alloc(128).unwrap();
    // SAFETY: 32 floats in a 128-byte allocation.
    unsafe { device.launch(&f, &k.launches[0], &[fits]) }.unwrap();
    device.synchronize().unwrap();
    let mut back = [0u8; 128];
    // SAFETY: inside the allocation.
    unsafe { device.dtoh(fits, &mut back) }.unwrap();
    assert!(back.chunks(4).all(|c| f32::from_ne_bytes(c.try_into().unwrap()) == 1.0));
    // SAFETY: one byte past the allocation: checked and refused, never copied.
    assert!(
        unsafe { device.dtoh(fits + 1, &mut back) }
            .unwrap_err()
            .to_string()
            .contains("not inside one allocation")
    );
    let short = device.alloc(100).unwrap();
    // SAFETY (deliberately broken): 32 floats into 25: the sanitizer's pads catch the overrun.
    unsafe { device.launch(&f, &k.launches[0], &[short]) }.unwrap();
    let e = device.synchronize().unwrap_err().to_string();
    assert!(e.contains("kernel `kiln_fill` wrote outside an allocation") && e.contains("100-byte"), "{e}");

    let other = EmulatedDevice::new(GB).unwrap();
    let f = other.load(&[&k]).unwrap().remove(0).remove(0);
    // SAFETY (deliberately broken): an address no allocation holds: refused before the kernel runs.
    unsafe { other.launch(&f, &k.launches[0], &[0x1000]) }.unwrap();
    let e = other.synchronize().unwrap_err().to_string();
    assert!(e.contains("kiln_fill") && e.contains("not inside any allocation"), "{e}");
}

/// `KILN_CUDA_SYNC=1` (here `set_sync_every_launch`): a kernel failing on the device is named at
/// its step, with its op, shapes and kernel; without it the error surfaces at the next copy.
#[test]
fn a_failing_kernel_is_named_at_its_step_when_every_launch_synchronises() {
    if !host_compiler() {
        return;
    }
    let plan = train_plan("seed-mlp", 4);
    let kernels = cuda::plan_kernels(&plan).unwrap();
    // Step 3's kernel, injected at its first launch: the step that first launches it.
    let target = kernels[3].launches[0].function.clone();
    let step = kernels.iter().position(|k| k.launches.iter().any(|l| l.function == target)).unwrap();
    let (x, y) = zoo::by_name("seed-mlp").unwrap().with_batch(4).batch_data(1).unwrap();
    let run = |sync: bool| -> String {
        let device = EmulatedDevice::new(GB).unwrap();
        let mut b = CudaBackend::with_driver(device.clone(), 0, vec![], Tracker::default()).unwrap();
        b.set_sync_every_launch(sync);
        let id = b.load(plan.clone()).unwrap();
        device.inject_fault(&target);
        b.call(id, &[("x", &x), ("y", &y)]).unwrap_err().to_string()
    };
    let synced = run(true);
    let label = &plan.steps[step].label;
    assert!(
        synced.contains(&format!("kernel `{target}`")) && synced.contains("illegal memory access"),
        "{synced}"
    );
    assert!(synced.contains(&format!("`{label}`: op {}", plan.steps[step].op.name())), "{synced}");
    let later = run(false);
    assert!(later.contains("illegal memory access"), "{later}");
}

/// Plans the device cannot run are refused at load with a clear error: an alignment under 16
/// bytes, an arena larger than the device; and tampered plans, as on the CPU.
#[test]
fn bad_plans_are_refused_on_the_emulated_device() {
    if !host_compiler() {
        return;
    }
    let mut b = CudaBackend::emulated(16 * MB, 0).unwrap();
    let mut plan = train_plan("seed-mlp", 4);
    plan.alignment = 8;
    let e = b.load(plan).unwrap_err().to_string();
    assert!(e.contains("not a multiple of 16") && e.contains("help:"), "{e}");
    let e = b.load(train_plan("cnn", 64)).unwrap_err().to_string();
    assert!(e.contains("cannot allocate") && e.contains("arena") && e.contains("free of 16.00 MiB"), "{e}");

    let mut plan = train_plan("seed-mlp", 4);
    let arena = plan.devices[0].memory.arena_bytes;
    let b0 = plan.buffers.iter().position(|b| matches!(b.storage, Storage::Arena { .. })).unwrap();
    plan.buffers[b0].storage = Storage::Arena { device: 0, offset: arena + 4096 };
    let e = b.load(plan).unwrap_err().to_string();
    assert!(e.contains("is invalid"), "{e}");
    let mut plan = train_plan("seed-mlp", 4);
    plan.devices[0].memory.arena_bytes = usize::MAX / 2;
    assert!(b.load(plan).is_err());
    let e = DeviceConfig::cpu(GB).set_memory_limit("cpu:0", 0).build().err().unwrap().to_string();
    assert!(e.contains("0 bytes"), "{e}");
    // The backend still runs a good plan after refusing the bad ones.
    let id = b.load(train_plan("seed-mlp", 4)).unwrap();
    let (x, y) = zoo::by_name("seed-mlp").unwrap().with_batch(4).batch_data(1).unwrap();
    b.call(id, &[("x", &x), ("y", &y)]).unwrap();
    let wrong = HostTensor::zeros([3, 100]).unwrap();
    assert!(b.set_input(id, "x", wrong.shape(), wrong.data()).is_err());
}

#[test]
fn two_cache_writes_never_share_a_temporary_file() {
    let dir = std::env::temp_dir();
    let names: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|_| s.spawn(|| cuda::nvrtc::temp_path(&dir, "k.cubin"))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut unique = names.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), 4, "{names:?}");
    assert_ne!(cuda::nvrtc::temp_path(&dir, "k"), cuda::nvrtc::temp_path(&dir, "k"));
    let _: Option<Arc<dyn Driver>> = None;
}

/// `timed_run` runs a call and times it, `profile` times each launch of one call: both leave the
/// same results as a plain run, and the profile names every launch.
#[test]
fn timed_runs_and_profiles_compute_what_runs_compute() {
    if !host_compiler() {
        return;
    }
    let plan = train_plan("seed-mlp", 4);
    let m = zoo::by_name("seed-mlp").unwrap().with_batch(4);
    let (x, y) = m.batch_data(1).unwrap();
    let mut outs = Vec::new();
    for how in 0..3 {
        let mut gpu = CudaBackend::emulated(256 * MB, 7).unwrap();
        let id = gpu.load(plan.clone()).unwrap();
        for _ in 0..2 {
            gpu.set_input(id, "x", x.shape(), x.data()).unwrap();
            gpu.set_input(id, "y", y.shape(), y.data()).unwrap();
            match how {
                0 => gpu.run(id).unwrap(),
                1 => assert!(gpu.timed_run(id).unwrap() >= 0.0),
                _ => {
                    let profile = gpu.profile(id).unwrap();
                    assert_eq!(profile.len(), gpu.launches(id));
                    assert!(
                        profile
                            .iter()
                            .all(|(label, kernel, ms)| !label.is_empty() && !kernel.is_empty() && *ms >= 0.0)
                    );
                }
            }
        }
        outs.push(gpu.output(id, "loss").unwrap());
        // A run without its inputs fed is refused, timed or profiled alike.
        assert!(gpu.timed_run(id).is_err() && gpu.profile(id).is_err());
    }
    assert_eq!(outs[0].data(), outs[1].data());
    assert_eq!(outs[0].data(), outs[2].data());
}

/// Models the zoo does not have (`common/unseen.rs`) train on the emulated device as on the
/// CPU: the CUDA backend's plans, kernels and launches on shapes nobody tuned for (odd image
/// sizes, a residual block's fused input gradient, a GPT-style decoder with a sparse loss).
#[test]
fn unseen_models_train_on_the_emulated_device_as_on_the_cpu() {
    if !host_compiler() {
        return;
    }
    for m in unseen::all() {
        let graph =
            kiln::compiler::step::train_step_graph(&m.model, m.x.clone(), m.y.clone(), &m.config).unwrap();
        let on = |scratch| compile(graph.clone(), &CompileOptions::default().with_scratch(scratch)).unwrap();
        let (cpu_plan, gpu_plan) = (on(None), on(Some(kiln::kernels::cuda::SCRATCH)));
        let mut cpu = kiln::runtime::CpuBackend::new(3);
        let mut gpu = CudaBackend::emulated(256 * MB, 3).unwrap();
        let (c, g) = (cpu.load(cpu_plan.clone()).unwrap(), gpu.load(gpu_plan).unwrap());
        for step in 0..2 {
            let (x, y) = m.batch(step);
            let feeds = [("x", &x), ("y", &y)];
            let (mut a, mut b) = (cpu.call(c, &feeds).unwrap(), gpu.call(g, &feeds).unwrap());
            a.sort_by(|p, q| p.0.cmp(&q.0));
            b.sort_by(|p, q| p.0.cmp(&q.0));
            assert_eq!(a.len(), b.len(), "{}", m.name);
            for ((name, a), (other, b)) in a.iter().zip(&b) {
                assert_eq!(name, other, "{}", m.name);
                close(&format!("{} step {step} {name}", m.name), a.data(), b.data(), 1.0);
            }
        }
        for v in &cpu_plan.variables {
            let (a, b) = (cpu.read_variable(&v.key).unwrap(), gpu.read_variable(&v.key).unwrap());
            close(&format!("{} {}", m.name, v.key), a.data(), b.data(), 1.0);
        }
    }
}

/// Mixed-precision training steps (bf16 and f16, the plan reading half values through f32
/// copies, `kiln::compiler::widen`) on the emulated device as on the CPU: the half casts and
/// the rounding inside fused groups agree, so the losses and master weights after two steps
/// differ by what one half rounding of a slightly different f32 value can make (1e-2 of the
/// scale).
#[test]
fn mixed_precision_steps_train_on_the_emulated_device_as_on_the_cpu() {
    if !host_compiler() {
        return;
    }
    common::mixed_precision_steps_agree(
        &["mlp", "cnn", "transformer"],
        Some(kiln::kernels::cuda::SCRATCH),
        || CudaBackend::emulated(512 * MB, 5).unwrap(),
        "emulated device",
    );
}
