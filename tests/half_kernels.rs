//! The kernels that compute on f16 and bf16 values give the bits of the same ops widened
//! (`kiln::compiler::widen`: f32 copies in, f32 out, one cast back), and a plan that uses them
//! needs fewer casts: the host's (`kiln::kernels::cpu::HALF_KERNELS`: every family, f32
//! arithmetic inside, half in memory) against the host's widened plan, and the CUDA kernels'
//! (`kiln::kernels::cuda::HALF_KERNELS`) on the emulated device against the same device's
//! widened plan.

use kiln::compiler::ir::{DType, Graph, Op, Shape};
use kiln::compiler::widen::HalfKernels;
use kiln::compiler::{CompileOptions, Precision, compile};
use kiln::kernels::cpu::HALF_KERNELS;
use kiln::runtime::{Backend, CpuBackend, HostTensor};

/// Every output and weight of two training steps of `plan`, as bits.
fn two_steps(plan: &kiln::compiler::Plan, m: &kiln::zoo::ZooModel) -> Vec<u32> {
    let mut cpu = CpuBackend::new(9);
    let id = cpu.load(plan.clone()).unwrap();
    let mut bits = Vec::new();
    for step in 0..2 {
        let (x, y) = m.batch_data(step).unwrap();
        let mut out = cpu.call(id, &[("x", &x), ("y", &y)]).unwrap();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        bits.extend(out.iter().flat_map(|(_, t)| t.data().iter().map(|v| v.to_bits())));
    }
    for v in &plan.variables {
        bits.extend(cpu.read_variable(&v.key).unwrap().data().iter().map(|w| w.to_bits()));
    }
    bits
}

/// The zoo's training steps in bf16 and f16, fused and unfused: the plan the host runs is the one
/// `kiln memory --precision` reports (planned for half kernels everywhere), with fewer casts
/// than the widened plan, and it computes the widened plan's bits.
#[test]
fn the_host_runs_the_reported_plan_with_the_widened_bits() {
    for name in ["mlp", "cnn", "transformer"] {
        let m = kiln::zoo::by_name(name).unwrap().with_batch(4);
        for precision in [Precision::BF16, Precision::F16] {
            let graph = kiln::compare::graph_at(&m, kiln::compare::Mode::Train, precision).unwrap();
            for fuse in [true, false] {
                let plan = |kernels: HalfKernels| {
                    let options = CompileOptions::default().with_half_kernels(kernels).with_fusion(fuse);
                    compile(graph.clone(), &options).unwrap()
                };
                let (wide, native, reported) =
                    (plan(HalfKernels::NONE), plan(HALF_KERNELS), plan(HalfKernels::ALL));
                let casts = |p: &kiln::compiler::Plan| {
                    p.steps.iter().filter(|s| matches!(s.op, Op::Cast { .. })).count()
                };
                let what = format!("{name} {precision} fuse {fuse}");
                let total = |p: &kiln::compiler::Plan| p.memory.planned_total_bytes();
                assert_eq!(
                    total(&native),
                    total(&reported),
                    "{what}: the host's plan is not the reported one"
                );
                assert!(
                    casts(&native) < casts(&wide),
                    "{what}: {} casts, widened {}",
                    casts(&native),
                    casts(&wide)
                );
                assert!(
                    two_steps(&native, &m) == two_steps(&wide, &m),
                    "{what}: half kernels and widened ops differ"
                );
            }
        }
    }
}

/// The families of the steps of `plan` that read or write a half value.
fn half_families(plan: &kiln::compiler::Plan) -> HalfKernels {
    let half = |v: usize| matches!(plan.values[v].dtype, DType::F16 | DType::BF16);
    plan.steps
        .iter()
        .filter(|s| s.inputs.iter().chain(&s.output).any(|&v| half(v)))
        .filter_map(|s| HalfKernels::family(&s.op))
        .fold(HalfKernels::NONE, |all, f| all | f)
}

/// Where a case runs: the host's kernels, or the CUDA kernels on the emulated device.
#[derive(Clone, Copy, Debug, PartialEq)]
enum On {
    Host,
    Emulated,
}

impl On {
    /// The backends a case runs on here: the host, and the emulated device where a host C++
    /// compiler is (CI has one).
    fn all() -> Vec<On> {
        match kiln::runtime::cuda::emulator::host::available() {
            Ok(()) => vec![On::Host, On::Emulated],
            Err(why) => {
                assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
                eprintln!("skipped the emulated device: {why}");
                vec![On::Host]
            }
        }
    }

    fn backend(self) -> Box<dyn Backend> {
        match self {
            On::Host => Box::new(CpuBackend::new(1)),
            On::Emulated => Box::new(kiln::runtime::cuda::CudaBackend::emulated(1 << 30, 1).unwrap()),
        }
    }
}

/// Runs `graph` on `on` with the backend's half kernels and widened, fused or not: the outputs'
/// bits. The plan for half kernels computes every family of `expected` the backend has on half
/// values.
fn both_ways(
    on: On,
    graph: &Graph,
    feeds: &[(&str, &HostTensor)],
    fuse: bool,
    expected: HalfKernels,
) -> [Vec<u32>; 2] {
    let mut backends = [on.backend(), on.backend()];
    let halves = backends[0].half_kernels();
    let mut backends = backends.iter_mut();
    [halves, HalfKernels::NONE].map(|kernels| {
        let backend = backends.next().expect("one backend a plan");
        let mut options = CompileOptions::default()
            .with_half_kernels(kernels)
            .with_fusion(fuse)
            .with_scratch(backend.scratch_rule());
        options.fold_constants = false;
        let plan = compile(graph.clone(), &options).unwrap();
        let families = half_families(&plan);
        assert!(kernels.contains(families), "{kernels} half kernels: {families} ops on half values");
        if kernels == halves {
            let wanted = expected & halves;
            assert!(families.contains(wanted), "{on:?}: {families} ops on half values, not {wanted}");
        }
        let id = backend.load(plan).unwrap();
        let mut out = backend.call(id, feeds).unwrap();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out.iter().flat_map(|(_, t)| t.data().iter().map(|v| v.to_bits())).collect()
    })
}

/// Holds `got` to `want` (bits of f32 values, half-rounded where the outputs are half): each
/// element within one rounding of `half` of the other, plus what an f32 sum in another order
/// may differ by (1e-6 of the largest magnitude: a sum that cancels keeps its terms' error),
/// and at most 1% of them apart.
fn one_rounding_apart(got: &[u32], want: &[u32], half: DType, what: &str) {
    let ulp = if half == DType::F16 { 2f32.powi(-10) } else { 2f32.powi(-7) };
    let scale = want.iter().map(|&w| f32::from_bits(w).abs()).filter(|w| w.is_finite()).fold(1f32, f32::max);
    let mut apart = 0;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if g == w {
            continue;
        }
        let (g, w) = (f32::from_bits(g), f32::from_bits(w));
        let tolerance = ulp * w.abs() + 1e-6 * scale;
        assert!((g - w).abs() <= tolerance, "{what}: element {i} is {g}, widened {w}");
        apart += 1;
    }
    assert!(apart * 100 <= got.len(), "{what}: {apart} of {} elements apart", got.len());
}

/// A tensor of `values` for each named shape, seeded from `seed` up.
fn inputs(shapes: &[(&str, &[usize])], seed: u32) -> Vec<HostTensor> {
    let tensor = |(i, d): (usize, &[usize])| {
        let shape = Shape::new(d.to_vec());
        HostTensor::new(shape.clone(), values(shape.numel(), seed + i as u32)).unwrap()
    };
    shapes.iter().map(|(_, d)| *d).enumerate().map(tensor).collect()
}

/// Values spread over several binades with every low mantissa bit pattern, so that rounding to
/// half matters.
fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            let h = (i ^ seed).wrapping_mul(2_654_435_761).rotate_left(7);
            (h % 20_011) as f32 / 997.0 - 10.0 + (h >> 20) as f32 * 1e-6
        })
        .collect()
}

/// Each moving, elementwise and reducing op on half values, alone and in fused groups, over
/// broadcasts, strides and odd sizes: the widened bits.
#[test]
fn each_half_kernel_gives_the_widened_bits() {
    use kiln::compiler::trace::Tracer;
    for half in [DType::BF16, DType::F16] {
        let t = Tracer::new("half ops");
        let (a_shape, b_shape) = (Shape::new(vec![3, 37, 65]), Shape::new(vec![37, 1]));
        let a = t.input("a", a_shape.clone()).cast(half);
        let b = t.input("b", b_shape.clone()).cast(half);
        let outs = [
            // Layout: every moving kernel, the tiled transpose and zero padding among them.
            a.permute(&[2, 0, 1]),
            a.permute(&[0, 2, 1]),
            b.broadcast_to([3, 37, 5]),
            a.slice(2, 3, 40),
            a.pad(1, 2, 5),
            a.concat(&[&a], 1),
            a.copy(),
            // Elementwise: half in and out, a broadcast half operand, a scalar, a select.
            a.exp(),
            a.clone() * &b,
            b.clone() + &a,
            a.clone() * 0.3,
            a.relu().select(&a, &b),
            // Reductions (rows, columns, all), normalisers along the last and a middle axis,
            // and a reduction of an elementwise program with an epilogue (when fused).
            a.sum(2, true),
            a.mean(1, false),
            a.max(0, true),
            a.sum(.., false),
            a.softmax(-1),
            a.softmax(1),
            a.log_softmax(0),
            (a.clone() * &b).exp().sum(2, true).sqrt() + 1.0,
        ];
        for (i, o) in outs.iter().enumerate() {
            assert_eq!(o.dtype(), half);
            t.output(&format!("out{i:02}"), &o.cast(DType::F32));
        }
        let g = t.finish().unwrap();
        let (av, bv) = (values(a_shape.numel(), 1), values(b_shape.numel(), 2));
        let (at, bt) = (HostTensor::new(a_shape, av).unwrap(), HostTensor::new(b_shape, bv).unwrap());
        let families = HalfKernels::LAYOUT | HalfKernels::ELEMENTWISE | HalfKernels::REDUCTIONS;
        for (on, fuse) in On::all().into_iter().flat_map(|on| [(on, false), (on, true)]) {
            let [native, wide] = both_ways(on, &g, &[("a", &at), ("b", &bt)], fuse, families);
            assert!(native == wide, "{on:?} {half} fuse {fuse}: half kernels and widened ops differ");
        }
    }
}

/// Products of half factors, plain and with a bias epilogue, transposed, batched and (on the
/// host) larger than the panels the host widens at a time (512 rows, 512 deep, 1,024 columns):
/// the bits of the widened factors' f32 product, rounded once where the output is half.
#[test]
fn half_products_give_the_widened_bits() {
    use kiln::compiler::trace::Tracer;
    use kiln::prelude::Init;
    for (on, half) in On::all().into_iter().flat_map(|on| [(on, DType::BF16), (on, DType::F16)]) {
        let t = Tracer::new("half products");
        // The emulated device runs every thread of every block on the host: smaller products,
        // odd sizes still crossing its tiles' edges.
        let [m, k, n] = if on == On::Host { [600, 700, 1100] } else { [60, 70, 110] };
        let (x_shape, w_shape) = (Shape::new(vec![m, k]), Shape::new(vec![k, n]));
        let x = t.input("x", x_shape.clone());
        let w = t.input("w", w_shape.clone());
        let bias = t.param("bias", [n], Init::Constant(0.37));
        let (xh, wh) = (x.cast(half), w.cast(half));
        let outs = [
            xh.matmul(&wh),
            (xh.matmul(&wh) + bias.cast(half)).relu(),
            xh.matmul_t(&xh.slice(0, 0, 33), false, true),
            xh.reshape([6, m / 6, k]).matmul(&wh.slice(1, 5, 40)),
            x.matmul(&wh.cast(DType::F32)) * 0.5,
        ];
        for (i, o) in outs.iter().enumerate() {
            t.output(&format!("out{i}"), &o.cast(DType::F32));
        }
        let g = t.finish().unwrap();
        let (xv, wv) = (values(x_shape.numel(), 3), values(w_shape.numel(), 4));
        let (xt, wt) = (HostTensor::new(x_shape, xv).unwrap(), HostTensor::new(w_shape, wv).unwrap());
        for fuse in [true, false] {
            let [native, wide] = both_ways(on, &g, &[("x", &xt), ("w", &wt)], fuse, HalfKernels::PRODUCTS);
            if on == On::Host {
                assert!(native == wide, "{half} fuse {fuse}: half products and widened ones differ");
            } else {
                // The tensor cores (here their host meaning) add in k order, the widened
                // product's kernel may split K within its blocks: a sum differing in its last
                // bits rounds to a neighbouring half now and then.
                one_rounding_apart(&native, &wide, half, &format!("{half} fuse {fuse}"));
            }
        }
    }
}

/// Attention and its gradient on half q, k, v and a learned bias (its gradient composed in
/// f32), causal or not, with more keys than queries, fused and unfused: the bits of the op
/// widened.
#[test]
fn half_attention_gives_the_widened_bits() {
    use kiln::compiler::trace::Tracer;
    let (qd, kd, bd) = ([2usize, 3, 40, 16], [2usize, 3, 50, 16], [1usize, 1, 40, 50]);
    for half in [DType::BF16, DType::F16] {
        for causal in [false, true] {
            let t = Tracer::new("half attention");
            let (q, k, v) = (t.input("q", qd), t.input("k", kd), t.input("v", kd));
            let (bias, w) = (t.input("bias", bd), t.input("w", qd));
            let (qh, kh, vh, bh) = (q.cast(half), k.cast(half), v.cast(half), bias.cast(half));
            let o = qh.attention(&kh, &vh, Some(&bh), 0.25, causal);
            assert_eq!(o.dtype(), half);
            let loss = (o.cast(DType::F32) * &w).sum(.., false);
            t.output("loss", &loss);
            let g = t.finish().unwrap();
            let ids: Vec<_> = ["q", "k", "v", "bias"].iter().map(|n| g.input(n).unwrap()).collect();
            let loss = g.output("loss").unwrap();
            let (mut g, grads) = kiln::compiler::autodiff::gradients(g, loss, &ids).unwrap();
            for (name, d) in ["dq", "dk", "dv", "dbias"].iter().zip(grads) {
                g.set_output(*name, d.unwrap());
            }
            let shapes = [("q", &qd[..]), ("k", &kd[..]), ("v", &kd[..]), ("bias", &bd[..]), ("w", &qd[..])];
            let tensors = inputs(&shapes, 10);
            let feeds: Vec<(&str, &HostTensor)> = shapes.iter().map(|(n, _)| *n).zip(&tensors).collect();
            for (on, fuse) in On::all().into_iter().flat_map(|on| [(on, true), (on, false)]) {
                let [native, wide] = both_ways(on, &g, &feeds, fuse, HalfKernels::ATTENTION);
                assert!(
                    native == wide,
                    "{on:?} {half} causal {causal} fuse {fuse}: half attention and widened differ"
                );
            }
        }
    }
}

/// Convolutions (dense and depthwise, strided and padded, with a bias and ReLU epilogue when
/// fused), their input and filter gradients, and max and average pooling with their gradients,
/// on half values, over batches computed in one group of images and in several: the bits of
/// the ops widened.
#[test]
fn half_convolutions_and_pooling_give_the_widened_bits() {
    use kiln::compiler::ir::{Padding, Window2d};
    use kiln::compiler::trace::Tracer;
    let (wd, dd, bd) = ([3usize, 3, 8, 12], [3usize, 3, 1, 8], [12usize]);
    // Small images (one group of all of them) and, on the host, large ones (groups of 2, then
    // 1); the emulated device runs every thread on the host: the small ones.
    let cases = [
        (On::Host, [3usize, 9, 11, 8], DType::BF16),
        (On::Host, [3, 9, 11, 8], DType::F16),
        (On::Host, [5, 200, 300, 8], DType::BF16),
    ];
    let emulated = On::all().contains(&On::Emulated).then_some([
        (On::Emulated, [3usize, 9, 11, 8], DType::BF16),
        (On::Emulated, [3, 9, 11, 8], DType::F16),
    ]);
    for (on, xd, half) in cases.into_iter().chain(emulated.into_iter().flatten()) {
        let t = Tracer::new("half convolutions");
        let (x, w, dw, b) = (t.input("x", xd), t.input("w", wd), t.input("dw", dd), t.input("b", bd));
        let (xh, wh, dwh, bh) = (x.cast(half), w.cast(half), dw.cast(half), b.cast(half));
        let conv = (xh.conv2d(&wh, [2, 1], Padding::Same) + &bh).relu();
        let depthwise = xh.conv2d_window(&dwh, Window2d::new([3, 3], [1, 1], Padding::Same).grouped(8));
        let (max, avg) =
            (xh.max_pool2d([2, 2], [2, 2], Padding::Valid), xh.avg_pool2d([3, 3], [2, 2], Padding::Same));
        let loss = [conv, depthwise, max, avg]
            .iter()
            .map(|v| v.cast(DType::F32).square().sum(.., false))
            .reduce(|a, b| a + b)
            .unwrap();
        t.output("loss", &loss);
        let g = t.finish().unwrap();
        let ids: Vec<_> = ["x", "w", "dw"].iter().map(|n| g.input(n).unwrap()).collect();
        let loss = g.output("loss").unwrap();
        let (mut g, grads) = kiln::compiler::autodiff::gradients(g, loss, &ids).unwrap();
        for (name, d) in ["dx", "dw_dense", "dw_depthwise"].iter().zip(grads) {
            g.set_output(*name, d.unwrap());
        }
        let shapes = [("x", &xd[..]), ("w", &wd[..]), ("dw", &dd[..]), ("b", &bd[..])];
        let tensors = inputs(&shapes, 20);
        let feeds: Vec<(&str, &HostTensor)> = shapes.iter().map(|(n, _)| *n).zip(&tensors).collect();
        for fuse in [false, true] {
            let families =
                HalfKernels::CONVOLUTIONS | HalfKernels::POOLING | HalfKernels::GROUPED_FILTER_GRADIENTS;
            let [native, wide] = both_ways(on, &g, &feeds, fuse, families);
            if on == On::Host {
                assert!(native == wide, "{half} fuse {fuse}: half convolutions and widened differ");
            } else {
                // Dense convolutions run on the tensor cores, which add in k order (see the
                // products' test).
                one_rounding_apart(&native, &wide, half, &format!("{half} fuse {fuse} convolutions"));
            }
        }
    }
}

/// An embedding lookup in a half table and its gradient (repeated ids summed): the bits of the
/// ops widened.
#[test]
fn half_gathers_give_the_widened_bits() {
    use kiln::compiler::trace::Tracer;
    for half in [DType::BF16, DType::F16] {
        let t = Tracer::new("half gather");
        let table = t.input("table", [50, 24]);
        let ids = t.input_typed("ids", [7, 5], DType::I32);
        let rows = table.cast(half).gather(&ids);
        assert_eq!(rows.dtype(), half);
        let loss = (rows.cast(DType::F32).square() * 0.5).sum(.., false);
        t.output("loss", &loss);
        let g = t.finish().unwrap();
        let (loss, wrt) = (g.output("loss").unwrap(), g.input("table").unwrap());
        let (mut g, grads) = kiln::compiler::autodiff::gradients(g, loss, &[wrt]).unwrap();
        g.set_output("dtable", grads[0].unwrap());
        let table = HostTensor::new(Shape::new(vec![50, 24]), values(50 * 24, 30)).unwrap();
        let ids = HostTensor::from_i32([7, 5], (0..35).map(|i| i * 13 % 50 % 17).collect()).unwrap();
        for (on, fuse) in On::all().into_iter().flat_map(|on| [(on, true), (on, false)]) {
            let [native, wide] =
                both_ways(on, &g, &[("table", &table), ("ids", &ids)], fuse, HalfKernels::GATHER);
            assert!(native == wide, "{on:?} {half} fuse {fuse}: half gathers and widened differ");
        }
    }
}

/// Half products on the emulated device's tensor cores with whole-number factors (every sum
/// exact in f32, so any order gives the same bits): the 128 x 128 tile (a batch of 132 blocks)
/// and split-K across blocks (a long contraction, partials in the scratch), each equal to the
/// exact product rounded once to the half type.
#[test]
fn half_tensor_core_products_are_exact_on_whole_numbers() {
    use kiln::compiler::trace::Tracer;
    if !On::all().contains(&On::Emulated) {
        return;
    }
    let whole = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * 7 + seed * 13) % 7) as f32 - 3.0).collect()
    };
    for half in [DType::BF16, DType::F16] {
        for (a_dims, b_dims, tiling) in [
            (vec![132usize, 128, 32], vec![132usize, 32, 128], "tile 128x128x32"),
            (vec![64, 1999], vec![1999, 64], "K split across"),
        ] {
            let t = Tracer::new("whole products");
            let (a, b) = (t.input("a", a_dims.clone()), t.input("b", b_dims.clone()));
            t.output("c", &a.cast(half).matmul(&b.cast(half)).cast(DType::F32));
            let g = t.finish().unwrap();
            let mut gpu = On::Emulated.backend();
            let options = CompileOptions::default()
                .with_half_kernels(gpu.half_kernels())
                .with_scratch(gpu.scratch_rule());
            let plan = compile(g, &options).unwrap();
            let kernels = kiln::runtime::cuda::plan_kernels(&plan).unwrap();
            let product = kernels.iter().find(|k| k.describe.starts_with("matmul")).unwrap();
            assert!(
                product.describe.contains("tensor cores") && product.describe.contains(tiling),
                "{}",
                product.describe
            );
            let (av, bv) = (whole(a_dims.iter().product(), 1), whole(b_dims.iter().product(), 2));
            let at = HostTensor::new(Shape::new(a_dims.clone()), av.clone()).unwrap();
            let bt = HostTensor::new(Shape::new(b_dims.clone()), bv.clone()).unwrap();
            let id = gpu.load(plan).unwrap();
            let out = gpu.call(id, &[("a", &at), ("b", &bt)]).unwrap().remove(0).1;
            // The exact product, rounded once to the half type.
            let r = a_dims.len();
            let (batch, m, k, n) = if r == 3 {
                (a_dims[0], a_dims[1], a_dims[2], b_dims[2])
            } else {
                (1, a_dims[0], a_dims[1], b_dims[1])
            };
            let round = |v: f32| {
                if half == DType::F16 {
                    half::f16::from_f32(v).to_f32()
                } else {
                    half::bf16::from_f32(v).to_f32()
                }
            };
            for bz in 0..batch {
                for i in 0..m {
                    for j in 0..n {
                        let exact: f32 =
                            (0..k).map(|p| av[(bz * m + i) * k + p] * bv[(bz * k + p) * n + j]).sum();
                        let got = out.data()[(bz * m + i) * n + j];
                        assert_eq!(got, round(exact), "{half} {tiling}: element ({bz}, {i}, {j})");
                    }
                }
            }
        }
    }
}

/// An update computing its weight gradient from half factors (`ir::Grad::Product`, as a
/// mixed-precision step folds it: `kiln::compiler::product_updates`), on whole numbers: plain
/// SGD with a learning rate of 1 from zero leaves minus the exact product rounded once to the
/// half type, on the host and on the emulated device (its tensor cores, tiles of 64 x 64 and a
/// ragged edge).
#[test]
fn half_product_updates_round_the_exact_product_once() {
    use kiln::compiler::ir::{DeviceId, Grad, Init, Node, VarRole};
    let (m, r, c) = (300usize, 70usize, 45usize);
    let whole = |n: usize, seed: usize| -> Vec<f32> {
        (0..n).map(|i| ((i * 5 + seed * 11) % 7) as f32 + if i % 3 == 0 { -2.0 } else { 1.0 }).collect()
    };
    let (av, bv) = (whole(m * r, 1), whole(m * c, 2));
    for half in [DType::BF16, DType::F16] {
        let mut g = Graph::new("half product update");
        let node = |op: Op, shape: Shape, dtype: DType| Node {
            op,
            shape,
            dtype,
            device: DeviceId(0),
            name: None,
            origin: None,
        };
        let var = Op::Variable {
            key: "w".into(),
            shape: Shape::new([r, c]),
            dtype: DType::F32,
            role: VarRole::Parameter,
            init: Init::Zeros,
        };
        let w = g.add(node(var, Shape::new([r, c]), DType::F32), &[]);
        let mut factor = |name: &str, cols: usize| {
            let shape = Shape::new([m, cols]);
            let input = Op::Input { name: name.into(), shape: shape.clone(), dtype: DType::F32 };
            let x = g.add(node(input, shape.clone(), DType::F32), &[]);
            g.add(node(Op::Cast { to: half }, shape, half), &[x])
        };
        let (a, b) = (factor("a", r), factor("b", c));
        let sgd =
            Op::ApplySgd { lr: 1.0, momentum: 0.0, nesterov: false, rows: None, product: false, shard: None }
                .update_in(None, Grad::Product);
        g.add(node(sgd, Shape::scalar(), DType::F32), &[w, a, b]);
        let exact: Vec<f32> =
            (0..r * c).map(|e| (0..m).map(|k| av[k * r + e / c] * bv[k * c + e % c]).sum()).collect();
        let round = |v: f32| match half {
            DType::F16 => half::f16::from_f32(v).to_f32(),
            _ => half::bf16::from_f32(v).to_f32(),
        };
        assert!(exact.iter().any(|&v| round(v) != v), "{half}: some sums round");
        let at = HostTensor::new(Shape::new([m, r]), av.clone()).unwrap();
        let bt = HostTensor::new(Shape::new([m, c]), bv.clone()).unwrap();
        for on in On::all() {
            let mut backend = on.backend();
            let options = CompileOptions::default()
                .with_half_kernels(backend.half_kernels())
                .with_scratch(backend.scratch_rule());
            let plan = compile(g.clone(), &options).unwrap();
            if on == On::Emulated {
                let kernels = kiln::runtime::cuda::plan_kernels(&plan).unwrap();
                let update = kernels.iter().find(|k| k.describe.starts_with("apply_sgd")).unwrap();
                assert!(update.describe.contains("tensor cores"), "{}", update.describe);
            }
            let id = backend.load(plan).unwrap();
            backend.call(id, &[("a", &at), ("b", &bt)]).unwrap();
            let got = backend.read_variable("w").unwrap();
            for (e, (&v, &x)) in got.data().iter().zip(&exact).enumerate() {
                assert_eq!(v, -round(x), "{on:?} {half}: element ({}, {}) of -{x} rounded", e / c, e % c);
            }
        }
    }
}
