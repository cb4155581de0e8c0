//! The CUDA backend against the CPU backend: every op forward and backward on odd sizes, every
//! zoo training step, and the memory promises (the arena is the only allocation a step makes;
//! what the device holds equals the plan). Where there is no CUDA device every test here says
//! "skipped: no CUDA device" and passes; with KILN_REQUIRE_GPU=1 they fail instead.

mod common;

use common::{Draw, cuda_backend, draw};
use kiln::compiler::autodiff::gradients;
use kiln::compiler::ir::{Padding, Shape};
use kiln::compiler::losses;
use kiln::prelude::*;
use kiln::runtime::cuda::CudaBackend;
use kiln::zoo;
use rand::SeedableRng;
use rand::rngs::StdRng;

/// Relative tolerance against the largest magnitude of the CPU result: f32 accumulation orders
/// differ between the backends (the CPU sums reductions in f64).
const RTOL: f32 = 2e-4;

fn close(name: &str, what: &str, cpu: &HostTensor, gpu: &HostTensor) {
    close_at(name, what, cpu, gpu, 1e-3)
}

/// `close` with the magnitude `floor` standing in for a result whose values are all smaller.
fn close_at(name: &str, what: &str, cpu: &HostTensor, gpu: &HostTensor, floor: f32) {
    assert_eq!(cpu.shape(), gpu.shape(), "{name}: {what} shape");
    let scale = cpu.data().iter().fold(floor, |m, v| m.max(v.abs()));
    let d = cpu.max_abs_diff(gpu);
    assert!(d <= RTOL * scale, "{name}: {what} differs by {d} (scale {scale}, tolerance {})", RTOL * scale);
}

type Case = (&'static str, Vec<(Vec<usize>, Draw)>, fn(&[Tensor]) -> Tensor);

fn cases() -> Vec<Case> {
    vec![
        ("relu", vec![(vec![37, 19], Draw::AwayFromZero)], |x| x[0].relu()),
        ("gelu_tanh_sigmoid", vec![(vec![3, 5, 7], Draw::Normal)], |x| {
            x[0].gelu() + x[0].tanh() * x[0].sigmoid()
        }),
        ("exp_log_sqrt", vec![(vec![1001], Draw::Positive)], |x| {
            x[0].exp() + x[0].log() * x[0].sqrt() - x[0].rsqrt()
        }),
        ("broadcast_binary", vec![(vec![7, 1, 9], Draw::Normal), (vec![5, 1], Draw::Positive)], |x| {
            (&x[0] * &x[1] - &x[0] / &x[1]).maximum(&x[1])
        }),
        ("bias_add", vec![(vec![33, 65], Draw::Normal), (vec![65], Draw::Normal)], |x| &x[0] + &x[1]),
        ("select_compare", vec![(vec![17, 3], Draw::Normal), (vec![17, 3], Draw::Normal)], |x| {
            x[0].gt(&x[1]).select(&x[0], &x[1]) + x[0].clamp(-0.5, 0.5)
        }),
        ("matmul_odd", vec![(vec![67, 129], Draw::Normal), (vec![129, 33], Draw::Normal)], |x| {
            x[0].matmul(&x[1])
        }),
        ("matmul_tn", vec![(vec![129, 67], Draw::Normal), (vec![129, 33], Draw::Normal)], |x| {
            x[0].matmul_t(&x[1], true, false)
        }),
        ("matmul_nt", vec![(vec![67, 129], Draw::Normal), (vec![33, 129], Draw::Normal)], |x| {
            x[0].matmul_t(&x[1], false, true)
        }),
        ("matmul_batched", vec![(vec![3, 1, 17, 31], Draw::Normal), (vec![5, 31, 9], Draw::Normal)], |x| {
            x[0].matmul(&x[1])
        }),
        ("matmul_large", vec![(vec![256, 300], Draw::Normal), (vec![300, 257], Draw::Normal)], |x| {
            x[0].matmul(&x[1])
        }),
        // Long contractions into few outputs: split-K across blocks with planned scratch.
        ("matmul_tn_long", vec![(vec![1536, 20], Draw::Normal), (vec![1536, 12], Draw::Normal)], |x| {
            x[0].matmul_t(&x[1], true, false)
        }),
        (
            "conv_filter_long",
            vec![(vec![4, 16, 16, 3], Draw::Normal), (vec![3, 3, 3, 8], Draw::Normal)],
            |x| x[0].conv2d(&x[1], [1, 1], Padding::Same),
        ),
        ("permute", vec![(vec![5, 33, 17], Draw::Normal)], |x| x[0].permute(&[2, 0, 1]) * 2.0),
        ("transpose_big", vec![(vec![129, 257], Draw::Normal)], |x| x[0].t() * 1.5),
        ("concat_slice_pad", vec![(vec![4, 7], Draw::Normal), (vec![4, 3], Draw::Normal)], |x| {
            x[0].concat(&[&x[1]], 1).slice(1, 2, 6).pad(0, 1, 2)
        }),
        ("reduce_sum_mean", vec![(vec![6, 77, 5], Draw::Normal)], |x| {
            x[0].sum(1, false) + x[0].mean([0, 2], false).sum(.., false)
        }),
        ("reduce_max", vec![(vec![9, 1025], Draw::Distinct)], |x| x[0].max(-1, true) * 1.0),
        ("reduce_long_row", vec![(vec![3, 100_003], Draw::Normal)], |x| x[0].sum(-1, false)),
        ("softmax", vec![(vec![13, 1000], Draw::Normal)], |x| x[0].softmax(-1)),
        ("log_softmax_axis0", vec![(vec![31, 6], Draw::Normal)], |x| x[0].log_softmax(0)),
        ("conv_same", vec![(vec![2, 9, 11, 3], Draw::Normal), (vec![3, 3, 3, 5], Draw::Normal)], |x| {
            x[0].conv2d(&x[1], [1, 1], Padding::Same)
        }),
        (
            "conv_valid_stride2",
            vec![(vec![3, 13, 10, 4], Draw::Normal), (vec![3, 2, 4, 7], Draw::Normal)],
            |x| x[0].conv2d(&x[1], [2, 2], Padding::Valid),
        ),
        (
            "conv_same_stride2",
            vec![(vec![2, 12, 12, 16], Draw::Normal), (vec![3, 3, 16, 32], Draw::Normal)],
            |x| x[0].conv2d(&x[1], [2, 2], Padding::Same),
        ),
        ("max_pool", vec![(vec![2, 9, 9, 3], Draw::Distinct)], |x| {
            x[0].max_pool2d([3, 3], [2, 2], Padding::Same)
        }),
        ("avg_pool", vec![(vec![2, 7, 8, 5], Draw::Normal)], |x| {
            x[0].avg_pool2d([2, 2], [2, 2], Padding::Same)
        }),
        ("gather", vec![(vec![50, 7], Draw::Normal), (vec![3, 11], Draw::Ids(50))], |x| x[0].gather(&x[1])),
        ("bce", vec![(vec![33, 1], Draw::Positive), (vec![33, 1], Draw::Mask)], |x| {
            losses::binary_crossentropy(&(&x[0] * 0.4), &x[1])
        }),
        ("softmax_ce", vec![(vec![17, 10], Draw::Normal), (vec![17, 10], Draw::Mask)], |x| {
            losses::softmax_crossentropy(&x[0], &x[1])
        }),
    ]
}

/// The forward value and the gradient of sum(f(x) * r) for every float input, on `backend`.
fn run_case(backend: &mut dyn Backend, case: &Case) -> Vec<(String, HostTensor)> {
    let (name, inputs, f) = case;
    let t = Tracer::new(*name);
    let xs: Vec<Tensor> =
        inputs.iter().enumerate().map(|(i, (s, _))| t.input(&format!("x{i}"), s.clone())).collect();
    let out = f(&xs);
    let r = t.input("r", out.shape().clone());
    let loss = (&out * &r).sum(.., false);
    t.output("y", &out);
    t.output("loss", &loss);
    let graph = t.finish().unwrap();
    let wrt: Vec<_> = inputs
        .iter()
        .enumerate()
        .filter(|(_, (_, d))| !matches!(d, Draw::Ids(_) | Draw::Mask))
        .map(|(i, _)| xs[i].id().unwrap())
        .collect();
    let (mut graph, grads) = gradients(graph, loss.id().unwrap(), &wrt).unwrap();
    for (k, g) in grads.into_iter().enumerate() {
        if let Some(g) = g {
            graph.set_output(format!("grad{k}"), g);
        }
    }
    let mut rng = StdRng::seed_from_u64(name.len() as u64);
    let mut feed: Vec<(String, HostTensor)> = inputs
        .iter()
        .enumerate()
        .map(|(i, (s, d))| (format!("x{i}"), draw(&Shape::from(s.as_slice()), *d, &mut rng)))
        .collect();
    feed.push(("r".into(), draw(out.shape(), Draw::Normal, &mut rng)));
    common::run_graph(backend, graph, &feed).1
}

#[test]
fn gpu_every_op_forward_and_backward_matches_cpu() {
    let Some(mut gpu) = cuda_backend(0) else { return };
    for case in cases() {
        let cpu_out = run_case(&mut CpuBackend::new(0), &case);
        let gpu_out = run_case(&mut gpu, &case);
        for ((n, c), (_, g)) in cpu_out.iter().zip(&gpu_out) {
            close(case.0, n, c, g);
        }
    }
}

#[test]
fn gpu_every_zoo_training_step_matches_cpu() {
    if cuda_backend(3).is_none() {
        return;
    }
    for m in zoo::all() {
        let m = common::device_batch(m, 1);
        // One backend per model: the zoo's models share variable names with other shapes.
        let Some(mut gpu) = cuda_backend(3) else { return };
        let (x, y) = m.batch_data(2).unwrap();
        let graph = kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap();
        let plan = compile(graph, &CompileOptions::default().with_scratch(gpu.scratch_rule())).unwrap();
        let mut cpu = CpuBackend::new(3);
        let (c, g) = (cpu.load(plan.clone()).unwrap(), gpu.load(plan.clone()).unwrap());
        let co = cpu.call(c, &[("x", &x), ("y", &y)]).unwrap();
        let go = gpu.call(g, &[("x", &x), ("y", &y)]).unwrap();
        for ((n, a), (_, b)) in co.iter().zip(&go) {
            close(m.name, &format!("step 0 output {n}"), a, b);
        }
        // The variables after one step: the moments are then the gradients themselves (m =
        // (1 - beta1) g, v = (1 - beta2) g²). After two, the second gradient is taken at weights
        // that already differ by Adam's amplified rounding (below), and differs by more.
        let lr = match m.config().optimizer {
            kiln::compiler::optim::Optimizer::Adam(a) => a.learning_rate,
            kiln::compiler::optim::Optimizer::Sgd(s) => s.learning_rate,
        };
        let read = |b: &dyn Backend, key: &str| b.read_variable(key).unwrap();
        // A moment is compared against its own largest magnitude, or a thousandth of the
        // model's largest moment of its kind where that is more: a gradient that is rounding
        // noise throughout (the key bias's) has no scale of its own.
        let largest = |slot: &str| {
            plan.variables
                .iter()
                .filter(|v| v.key.starts_with("optimizer/") && v.key.ends_with(slot))
                .flat_map(|v| read(&cpu, &v.key).data().to_vec())
                .fold(f32::MIN_POSITIVE, |a, x| a.max(x.abs()))
        };
        let (m_floor, v_floor) = (1e-3 * largest("/m"), 1e-3 * largest("/v"));
        for v in &plan.variables {
            let (c, g) = (read(&cpu, &v.key), read(&gpu, &v.key));
            let moment = kiln::compiler::optim::slot_key(&v.key, "m");
            if v.key.starts_with("optimizer/") {
                let floor = if v.key.ends_with("/m") {
                    m_floor
                } else if v.key.ends_with("/v") {
                    v_floor
                } else {
                    1e-3
                };
                close_at(m.name, &v.key, &c, &g, floor);
                continue;
            }
            if !plan.variables.iter().any(|s| s.key == moment) {
                close_at(m.name, &v.key, &c, &g, 1e-3);
                continue;
            }
            // A weight updated by Adam (its moments are variables of their own, compared as
            // any other): Adam divides each gradient by its own running magnitude, so an
            // element's update is as sensitive to rounding as its first moment is relatively
            // uncertain. A gradient that is rounding noise (attention's key bias, to which
            // softmax is invariant) moves the weight by a whole normalised step (up to 2 lr
            // apart) in whatever direction the noise has, on either backend.
            let cm = read(&cpu, &moment);
            let m_tol = RTOL * cm.data().iter().fold(m_floor, |a, x| a.max(x.abs()));
            let scale = c.data().iter().fold(1e-3f32, |a, x| a.max(x.abs()));
            for (i, ((a, b), mi)) in c.data().iter().zip(g.data()).zip(cm.data()).enumerate() {
                let noise = (m_tol / mi.abs().max(1e-30)).min(1.0);
                let tol = RTOL * scale + 2.0 * lr * noise;
                assert!(
                    (a - b).abs() <= tol,
                    "{}: {}[{i}] is {a} on the CPU and {b} on the GPU (tolerance {tol}: first moment {mi})",
                    m.name,
                    v.key
                );
            }
        }
        let co = cpu.call(c, &[("x", &x), ("y", &y)]).unwrap();
        let go = gpu.call(g, &[("x", &x), ("y", &y)]).unwrap();
        for ((n, a), (_, b)) in co.iter().zip(&go) {
            close(m.name, &format!("step 1 output {n}"), a, b);
        }
    }
}

/// A constant folded at compile time (`const_fold`: a mask from fills, pads and a concat) is
/// written into the device's variable region at load and read like any variable.
#[test]
fn gpu_a_folded_constant_is_loaded_and_read() {
    let Some(mut gpu) = cuda_backend(3) else { return };
    let t = Tracer::new("folded mask");
    let x = t.input("x", [3, 6]);
    let ones = t.fill(1.0, [3, 2]).pad(1, 1, 3).concat(&[&t.fill(2.0, [3, 0]).pad(1, 0, 6)], 0);
    let y = (&x * &ones.slice(0, 0, 3)).softmax(-1);
    t.output("y", &y);
    let graph = t.finish().unwrap();
    let plan = compile(graph, &CompileOptions::default().with_scratch(gpu.scratch_rule())).unwrap();
    assert_eq!(plan.memory.rewrites.folded_constants, 1, "{}", plan.render());
    let xv = draw(&Shape::from([3, 6]), Draw::Normal, &mut StdRng::seed_from_u64(9));
    let mut cpu = CpuBackend::new(3);
    let (c, g) = (cpu.load(plan.clone()).unwrap(), gpu.load(plan).unwrap());
    let (co, go) = (cpu.call(c, &[("x", &xv)]).unwrap(), gpu.call(g, &[("x", &xv)]).unwrap());
    close("folded mask", "y", &co[0].1, &go[0].1);
}

/// Forward passes split into blocks of batch rows (`batch_blocks`: slices of the input, each
/// layer at a block's rows, one join) compute on the device what the CPU computes.
#[test]
fn gpu_forward_passes_in_blocks_match_cpu() {
    use kiln::compiler::batch_blocks;
    if cuda_backend(3).is_none() {
        return;
    }
    for name in ["mlp", "cnn"] {
        let m = common::device_batch(zoo::by_name(name).unwrap(), 5);
        let Some(mut gpu) = cuda_backend(3) else { return };
        let mut graph = kiln::compiler::step::forward_graph(&m.model(), m.x_shape()).unwrap();
        kiln::compiler::passes::default_pipeline().run(&mut graph).unwrap();
        let region = batch_blocks::region(&graph).expect("a row-separable region");
        let split = batch_blocks::split(&graph, &region, 2).unwrap();
        let options = CompileOptions::default().with_scratch(gpu.scratch_rule()).with_batch_blocks(false);
        let plan = compile(split, &options).unwrap();
        assert!(plan.steps.iter().any(|s| matches!(s.op, kiln::compiler::ir::Op::Concat { axis: 0 })));
        let (x, _) = m.batch_data(4).unwrap();
        let mut cpu = CpuBackend::new(3);
        let (c, g) = (cpu.load(plan.clone()).unwrap(), gpu.load(plan).unwrap());
        let (co, go) = (cpu.call(c, &[("x", &x)]).unwrap(), gpu.call(g, &[("x", &x)]).unwrap());
        for ((n, a), (_, b)) in co.iter().zip(&go) {
            close(m.name, &format!("forward output {n} in blocks"), a, b);
        }
    }
}

#[test]
fn gpu_steps_allocate_nothing_and_memory_equals_the_plan() {
    // Alone on its device where it can be (the emulated device): other tests allocate meanwhile.
    let Some(mut gpu) = cuda_backend(0) else { return };
    if common::emulated() {
        gpu = CudaBackend::emulated(kiln::runtime::cuda::emulator::DEFAULT_MEMORY, 0).unwrap();
    }
    let m = common::device_batch(zoo::by_name("mlp").unwrap(), 1);
    let (x, y) = m.batch_data(1).unwrap();
    let options = CompileOptions::default().with_scratch(gpu.scratch_rule());
    let plan = compile(kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap(), &options).unwrap();
    let id = gpu.load(plan.clone()).unwrap();
    gpu.call(id, &[("x", &x), ("y", &y)]).unwrap();
    let (count, bytes) = gpu.device_allocations();
    let free_before = gpu.mem_info().unwrap().0;
    let steps = if common::emulated() { 3 } else { 20 };
    for _ in 0..steps {
        gpu.set_input(id, "x", x.shape(), x.data()).unwrap();
        gpu.set_input(id, "y", y.shape(), y.data()).unwrap();
        gpu.run(id).unwrap();
    }
    gpu.output(id, "loss").unwrap();
    assert_eq!(gpu.device_allocations(), (count, bytes), "training steps allocated device memory");
    assert_eq!(gpu.mem_info().unwrap().0, free_before, "the device's free memory moved during steps");
    // One allocation: the variable region, the io region and the arena in one block.
    let m = &plan.memory;
    let block = kiln::compiler::plan::device_block(
        [m.variable_region_bytes, m.io_bytes, m.arena_bytes],
        plan.block_align(),
    );
    assert_eq!((count, bytes), (1, block.unwrap().1));
}

#[test]
fn gpu_a_second_load_compiles_nothing() {
    let Some(mut gpu) = cuda_backend(0) else { return };
    let m = zoo::by_name("seed-mlp").unwrap();
    let plan =
        compile(kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap(), &CompileOptions::default())
            .unwrap();
    gpu.load(plan.clone()).unwrap();
    let before = gpu.compile_stats();
    gpu.load(plan).unwrap();
    let after = gpu.compile_stats();
    assert_eq!(after.compiled, before.compiled, "the second load compiled kernels");
    assert!(after.from_memory > before.from_memory);
    let _: &CudaBackend = &gpu;
}

#[test]
fn gpu_eager_on_device_regions_matches_the_cpu_plan() {
    use kiln::runtime::alloc::BfcAllocator;
    use kiln::runtime::cuda::{CudaEager, CudaSource};
    use kiln::runtime::eager::EagerExecutor;
    let Some(gpu) = cuda_backend(5) else { return };
    for name in ["seed-mlp", "cnn"] {
        let m = common::device_batch(zoo::by_name(name).unwrap().with_batch(4), 2);
        let (x, y) = m.batch_data(3).unwrap();
        let graph = kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap();
        let mut cpu = CpuBackend::new(5);
        let id = cpu.load(compile(graph.clone(), &CompileOptions::default()).unwrap()).unwrap();
        let s = kiln::compiler::optimize(graph).unwrap();
        let mut eager =
            EagerExecutor::new(BfcAllocator::new(CudaSource::new(&gpu), 1 << 34), 5, CudaEager::new(&gpu));
        for step in 0..2 {
            let c = cpu.call(id, &[("x", &x), ("y", &y)]).unwrap();
            let e = eager.run(&s.graph, &s.order, &[("x", &x), ("y", &y)]).unwrap();
            for ((n, a), (_, b)) in c.iter().zip(&e.outputs) {
                close(name, &format!("eager step {step} {n}"), a, b);
            }
        }
    }
}

/// A CUDA backend for one rank of an in-process run: the emulated device under
/// `KILN_CUDA_EMULATE=1`, else GPU 0 (every rank shares it).
fn rank_device() -> CudaBackend {
    if common::emulated() {
        CudaBackend::emulated(kiln::runtime::cuda::emulator::DEFAULT_MEMORY, 5).unwrap()
    } else {
        CudaBackend::new(0, 5).unwrap()
    }
}

/// A trainer's parameters (its first plan's, key order) as they are on its backend.
fn parameters(t: &kiln::runtime::Trainer) -> Vec<(String, HostTensor)> {
    t.plans()[0]
        .variables
        .iter()
        .filter(|v| v.role == kiln::compiler::ir::VarRole::Parameter)
        .map(|v| (v.key.clone(), t.backend().read_variable(&v.key).unwrap()))
        .collect()
}

#[test]
fn gpu_data_parallel_ranks_reduce_through_the_host_and_train_as_cpu_ranks() {
    use kiln::compiler::data_parallel::all_reduce_gradients;
    use kiln::runtime::CpuBackend;
    let Some(gpu) = cuda_backend(0) else { return };
    let (ranks, per_rank) = (2, 4);
    let m = zoo::by_name("mlp").unwrap().with_batch(per_rank);
    let whole = m.clone().with_batch(ranks * per_rank);
    let batches: Vec<_> = (0..2).map(|i| whole.batch_data(20 + i).unwrap()).collect();
    let plan = |options: &CompileOptions| {
        let mut g = kiln::compiler::step::train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())
            .unwrap();
        assert!(all_reduce_gradients(&mut g).unwrap() > 0);
        compile(g, options).unwrap()
    };
    let gpu_plan = plan(&CompileOptions::default().with_scratch(gpu.scratch_rule()));
    drop(gpu);
    let cpu_plan = plan(&CompileOptions::default());
    let train = |backend: &mut dyn Backend, plan: &kiln::compiler::Plan, r: usize| {
        let id = backend.load(plan.clone()).unwrap();
        for (x, y) in &batches {
            let rows = r * per_rank..(r + 1) * per_rank;
            let (x, y) = (x.rows(rows.clone()).unwrap(), y.rows(rows).unwrap());
            backend.call(id, &[("x", &x), ("y", &y)]).unwrap();
        }
        let params = plan.variables.iter().filter(|v| !v.key.starts_with("optimizer/"));
        params.map(|v| (v.key.clone(), backend.read_variable(&v.key).unwrap())).collect::<Vec<_>>()
    };
    let on_gpu = kiln::comm::run_local_ranks(ranks, |r, comm| {
        train(&mut rank_device().with_communicator(comm), &gpu_plan, r)
    });
    let on_cpu = kiln::comm::run_local_ranks(ranks, |r, comm| {
        train(&mut CpuBackend::new(5).with_communicator(comm), &cpu_plan, r)
    });
    for (k, ((key, a), (_, b))) in on_gpu[0].iter().zip(&on_gpu[1]).enumerate() {
        assert_eq!(a.data(), b.data(), "variable {k} ({key}) differs between the CUDA ranks");
    }
    for ((key, g), (_, c)) in on_gpu[0].iter().zip(&on_cpu[0]) {
        close(m.name, &format!("{key} after 2 data-parallel steps"), c, g);
    }
}

#[test]
fn gpu_zero_ranks_shard_state_through_the_host_and_train_as_cpu_ranks() {
    use kiln::compiler::zero::ZeroStage;
    use kiln::runtime::{CpuBackend, Trainer};
    let Some(gpu) = cuda_backend(0) else { return };
    drop(gpu);
    // 3 ranks: uneven shards (the seed model's 100x10 kernel, 10-element bias), and empty
    // ones (its 1-element bias: ranks 1 and 2 hold none of it); per-rank batches of 4.
    let (ranks, per_rank) = (3, 4);
    let m = zoo::by_name("seed-mlp").unwrap();
    let whole = m.clone().with_batch(ranks * per_rank);
    let batches: Vec<_> = (0..2).map(|i| whole.batch_data(30 + i).unwrap()).collect();
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let train = |backend: Box<dyn Backend>, r: usize| {
            let mut t = Trainer::new(m.model(), m.config(), backend).with_zero_stage(stage);
            let mut losses = Vec::new();
            for (x, y) in &batches {
                let rows = r * per_rank..(r + 1) * per_rank;
                let (x, y) = (x.rows(rows.clone()).unwrap(), y.rows(rows).unwrap());
                losses.push(t.train_step(&x, &y).unwrap().loss);
            }
            let sharded = t.plans()[0].steps.iter().filter(|s| s.op.shard().is_some()).count();
            (parameters(&t), losses, sharded)
        };
        let on_gpu = kiln::comm::run_local_ranks(ranks, |r, comm| {
            train(Box::new(rank_device().with_communicator(comm)), r)
        });
        let on_cpu = kiln::comm::run_local_ranks(ranks, |r, comm| {
            train(Box::new(CpuBackend::new(5).with_communicator(comm)), r)
        });
        let (params, losses, sharded) = &on_gpu[0];
        assert!(*sharded > 0, "{stage:?}: the CUDA plan has sharded steps");
        for (r, (other, _, _)) in on_gpu.iter().enumerate().skip(1) {
            for ((key, a), (_, b)) in params.iter().zip(other) {
                assert_eq!(a.data(), b.data(), "{stage:?}: {key} differs between CUDA ranks 0 and {r}");
            }
        }
        for ((key, g), (_, c)) in params.iter().zip(&on_cpu[0].0) {
            close(m.name, &format!("{stage:?}: {key} after 2 ZeRO steps"), c, g);
        }
        for (g, c) in losses.iter().zip(&on_cpu[0].1) {
            assert!(
                (g - c).abs() <= 1e-4 * c.abs().max(1.0),
                "{stage:?}: loss {g} on CUDA ranks, {c} on CPU ranks"
            );
        }
    }
}

/// NCCL (`CudaBackend::with_nccl`): on the emulated device it is refused, saying what to use;
/// on a GPU with the NCCL library one rank runs a ZeRO stage 2 training step, every all-reduce,
/// reduce-scatter and all-gather an NCCL call, as a host-staged rank does. The lent machines have
/// one GPU and NCCL refuses two ranks on one, and a `Trainer` on one rank has no collectives, so
/// the step is built as a `Trainer` builds a rank's (sharded over one rank) and loaded by hand.
#[test]
fn gpu_nccl_rank_trains_as_a_host_staged_rank() {
    use kiln::compiler::data_parallel::all_reduce_outputs;
    use kiln::compiler::ir::Op;
    use kiln::compiler::ir::Shard;
    use kiln::compiler::zero::{ZeroStage, for_rank, shard_optimizer_state};
    use kiln::runtime::cuda::nccl::Nccl;
    let Some(gpu) = cuda_backend(0) else { return };
    let scratch = gpu.scratch_rule();
    drop(gpu);
    let m = zoo::by_name("seed-mlp").unwrap();
    let mut graph = kiln::compare::graph_of(&m, kiln::compare::Mode::Train).unwrap();
    shard_optimizer_state(&mut graph, ZeroStage::Two, Shard { ranks: 1, rank: 0 }).unwrap();
    all_reduce_outputs(&mut graph, &["loss"]).unwrap();
    let plan =
        for_rank(compile(graph, &CompileOptions::default().with_scratch(scratch)).unwrap(), 0).unwrap();
    let has = |f: fn(&Op) -> bool| plan.steps.iter().any(|s| f(&s.op));
    assert!(has(|op| matches!(op, Op::AllReduce { .. })), "the step reduces its loss");
    assert!(has(|op| matches!(op, Op::ReduceScatter { .. })), "the step reduce-scatters its gradients");
    assert!(has(|op| matches!(op, Op::AllGather { .. })), "the step gathers its weights");
    let open = rank_device;
    let batches: Vec<_> = (0..2).map(|i| m.batch_data(40 + i).unwrap()).collect();
    let train = |mut backend: CudaBackend| {
        let id = backend.load(plan.clone()).unwrap();
        let mut losses = Vec::new();
        for (x, y) in &batches {
            let out = backend.call(id, &[("x", x), ("y", y)]).unwrap();
            losses.push(out.into_iter().find(|(n, _)| n == "loss").expect("a loss output").1);
        }
        let weights: Vec<_> =
            plan.variables.iter().map(|v| (v.key.clone(), backend.read_variable(&v.key).unwrap())).collect();
        (losses, weights)
    };
    let staged = kiln::comm::run_local_ranks(1, |_, comm| train(open().with_communicator(comm))).remove(0);
    if common::emulated() {
        let refused =
            kiln::comm::run_local_ranks(1, |_, comm| open().with_nccl(comm).err().map(|e| e.to_string()));
        let message = refused[0].as_deref().expect("NCCL is refused on the emulated device");
        assert!(message.contains("with_communicator"), "{message}");
        return;
    }
    if !Nccl::available() {
        eprintln!("skipped: the NCCL library is not found (LD_LIBRARY_PATH)");
        return;
    }
    let on_device = kiln::comm::run_local_ranks(1, |_, comm| {
        let backend = open().with_nccl(comm).unwrap();
        assert!(backend.uses_nccl());
        train(backend)
    })
    .remove(0);
    for (i, (a, b)) in staged.0.iter().zip(&on_device.0).enumerate() {
        close(m.name, &format!("loss of step {i} through NCCL"), a, b);
    }
    for ((key, a), (_, b)) in staged.1.iter().zip(&on_device.1) {
        close(m.name, &format!("{key} after 2 steps through NCCL"), a, b);
    }
}

/// Mixed-precision training steps on the device as on the CPU: bf16 and f16 (with its loss
/// scaling: the scale, its count and the skipped steps) over two steps of the zoo's mlp, cnn
/// and transformer, within what one half rounding of a slightly different f32 value makes
/// (1e-2 of the scale), as `tests/emulated.rs` holds the emulated device to.
#[test]
fn gpu_mixed_precision_steps_train_as_on_the_cpu() {
    let Some(gpu) = cuda_backend(5) else { return };
    let scratch = gpu.scratch_rule();
    drop(gpu);
    // The emulated device runs all three in `tests/emulated.rs`; here the mlp alone.
    let names: &[&str] = if common::emulated() { &["mlp"] } else { &["mlp", "cnn", "transformer"] };
    common::mixed_precision_steps_agree(names, scratch, || cuda_backend(5).unwrap(), "GPU");
}
