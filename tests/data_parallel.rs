//! Data-parallel training (`kiln_compiler::data_parallel`, `kiln_comm`): N in-process ranks,
//! each a `CpuBackend` on its own thread with its shard of every batch, keep bitwise-identical
//! weights and train the weights one rank trains on the whole batch; plans that differ between
//! ranks, and a rank that leaves, are errors on every rank, never a hang.

use kiln::compiler::data_parallel::{BUCKET_BYTES, all_reduce_gradients_in_buckets};
use kiln::compiler::ir::Op;
use kiln::compiler::optim::{Optimizer, Sgd};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor, Trainer};
use kiln::zoo::{self, ZooModel};
use std::time::Duration;

fn step_plan(m: &ZooModel, batch: usize, cfg: &TrainConfig, ranks: usize) -> kiln::compiler::Plan {
    step_plan_in_buckets(m, batch, cfg, ranks, BUCKET_BYTES)
}

fn step_plan_in_buckets(
    m: &ZooModel,
    batch: usize,
    cfg: &TrainConfig,
    ranks: usize,
    bucket_bytes: usize,
) -> kiln::compiler::Plan {
    let m = m.clone().with_batch(batch);
    let mut graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), cfg).unwrap();
    if ranks > 1 {
        assert!(all_reduce_gradients_in_buckets(&mut graph, bucket_bytes).unwrap().gradients > 0);
    }
    compile(graph, &CompileOptions::default()).unwrap()
}

/// Every variable after `steps` steps on batches `batches`, for each of `ranks` ranks (1: the
/// plain step on the whole batch).
fn train(
    m: &ZooModel,
    cfg: &TrainConfig,
    ranks: usize,
    batches: &[(HostTensor, HostTensor)],
) -> Vec<Vec<Vec<f32>>> {
    train_in_buckets(m, cfg, ranks, batches, BUCKET_BYTES)
}

fn train_in_buckets(
    m: &ZooModel,
    cfg: &TrainConfig,
    ranks: usize,
    batches: &[(HostTensor, HostTensor)],
    bucket_bytes: usize,
) -> Vec<Vec<Vec<f32>>> {
    let batch = batches[0].0.shape().dims()[0];
    let shard = batch / ranks;
    let plan = step_plan_in_buckets(m, shard, cfg, ranks, bucket_bytes);
    kiln::comm::run_local_ranks(ranks, |r, comm| {
        let mut backend = CpuBackend::new(5);
        if ranks > 1 {
            backend = backend.with_communicator(comm);
        }
        let id = backend.load(plan.clone()).unwrap();
        for (x, y) in batches {
            let rows = r * shard..(r + 1) * shard;
            let (x, y) = (x.rows(rows.clone()).unwrap(), y.rows(rows).unwrap());
            backend.call(id, &[("x", &x), ("y", &y)]).unwrap();
        }
        let params = plan.variables.iter().filter(|v| !v.key.starts_with("optimizer/"));
        params.map(|v| backend.read_variable(&v.key).unwrap().data().to_vec()).collect::<Vec<_>>()
    })
}

fn batches(m: &ZooModel, batch: usize, n: u64) -> Vec<(HostTensor, HostTensor)> {
    (0..n).map(|i| m.clone().with_batch(batch).batch_data(10 + i).unwrap()).collect()
}

#[test]
fn ranks_keep_identical_weights_and_match_one_rank_on_the_whole_batch() {
    let m = zoo::by_name("mlp").unwrap();
    let sgd = TrainConfig { optimizer: Optimizer::Sgd(Sgd::new(0.05)), ..m.config() };
    let data = batches(&m, 24, 3);
    let one = train(&m, &sgd, 1, &data).remove(0);
    for ranks in [2, 3] {
        let all = train(&m, &sgd, ranks, &data);
        for (r, w) in all.iter().enumerate().skip(1) {
            assert!(
                w.iter().zip(&all[0]).all(|(a, b)| a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())),
                "{ranks} ranks: rank {r}'s weights differ from rank 0's"
            );
        }
        for (k, (a, b)) in all[0].iter().zip(&one).enumerate() {
            let scale = b.iter().fold(1e-3f32, |s, v| s.max(v.abs()));
            for (i, (p, q)) in a.iter().zip(b).enumerate() {
                assert!(
                    (p - q).abs() <= 1e-5 * scale,
                    "{ranks} ranks: variable {k}[{i}] {p} vs {q} on one rank"
                );
            }
        }
    }
    // Adam: every rank applies the same update from the same averaged gradient.
    let all = train(&m, &m.config(), 2, &data);
    assert_eq!(
        all[0].iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>(),
        all[1].iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>()
    );
}

#[test]
fn the_all_reduces_are_planned_in_place_on_the_gradients() {
    let m = zoo::by_name("cnn").unwrap();
    // One collective per gradient (buckets of 0 bytes).
    let plan = step_plan_in_buckets(&m, 4, &m.config(), 2, 0);
    let reduces: Vec<_> = plan.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).collect();
    assert_eq!(
        reduces.len(),
        plan.variables.iter().filter(|v| v.key.starts_with("optimizer/") && v.key.ends_with("/m")).count()
    );
    assert!(reduces.iter().all(|s| s.in_place), "each gradient is reduced where it is");
    assert!(plan.render().contains("all_reduce[mean]"));
    // Every update reads a reduced gradient: none computes its own product or works by rows.
    for m in ["mlp", "cnn", "transformer"].map(|n| zoo::by_name(n).unwrap()) {
        for bucket_bytes in [0, BUCKET_BYTES] {
            let plan = step_plan_in_buckets(&m, 4, &m.config(), 2, bucket_bytes);
            for s in plan.steps.iter().filter(|s| matches!(s.op, Op::ApplyAdam { .. })) {
                assert!(
                    matches!(s.op, Op::ApplyAdam { product: false, rows: None, .. }),
                    "{}: {}",
                    m.name,
                    s.label
                );
                assert!(
                    reads_reduced(&plan, s.inputs[1]),
                    "{}: {} reads an unreduced gradient",
                    m.name,
                    s.label
                );
            }
        }
    }
}

/// Whether value `v` lies inside an all-reduce's output, or is a copy of a slice of one.
fn reads_reduced(plan: &kiln::compiler::Plan, v: usize) -> bool {
    let inside = |v: usize, o: usize| {
        let (a, b) = (&plan.values[v], &plan.values[o]);
        let end = |x: &kiln::compiler::plan::Value| x.offset + x.shape.numel() * x.dtype.size_bytes();
        a.buffer == b.buffer && b.offset <= a.offset && end(a) <= end(b)
    };
    let reduced: Vec<usize> =
        plan.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).filter_map(|s| s.output).collect();
    reduced.iter().any(|&o| inside(v, o))
        || plan.steps.iter().any(|s| {
            matches!(s.op, Op::Slice { .. })
                && s.output.is_some_and(|o| inside(v, o))
                && reduced.iter().any(|&r| inside(s.inputs[0], r))
        })
}

#[test]
fn gradients_are_reduced_in_buckets_that_train_the_same_bits() {
    let m = zoo::by_name("transformer").unwrap();
    let gradients = |plan: &kiln::compiler::Plan| {
        plan.steps.iter().filter(|s| matches!(s.op, Op::ApplyAdam { .. } | Op::ApplySgd { .. })).count()
    };
    let per_gradient = step_plan_in_buckets(&m, 4, &m.config(), 2, 0);
    let bucketed = step_plan(&m, 4, &m.config(), 2);
    let reduces = |plan: &kiln::compiler::Plan| {
        plan.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).count()
    };
    assert_eq!(reduces(&per_gradient), gradients(&per_gradient));
    assert!(reduces(&bucketed) * 2 < reduces(&per_gradient), "{} buckets", reduces(&bucketed));
    // A bucket is one buffer: its collective reduces it in place, and where the planner writes
    // its gradients inside it, no concatenation runs and they sit at increasing offsets.
    for s in bucketed.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })) {
        assert!(s.in_place);
    }
    let inside: Vec<_> = bucketed.values.iter().filter(|v| v.offset > 0).collect();
    assert!(!inside.is_empty(), "some gradients are written or read inside their bucket");
    assert!(inside.iter().all(|v| v.offset % kiln::compiler::liveness::VIEW_ALIGN == 0));
    assert!(bucketed.render().contains("(all_reduce `bucket 0/all_reduce`)"));
    // The mean of a bucket is the mean of each gradient in it: the same bits either way.
    let sgd = TrainConfig { optimizer: Optimizer::Sgd(Sgd::new(0.05)), ..m.config() };
    let data = batches(&m, 8, 2);
    let a = train_in_buckets(&m, &sgd, 2, &data, 0);
    let b = train_in_buckets(&m, &sgd, 2, &data, BUCKET_BYTES);
    let bits = |w: &Vec<Vec<Vec<f32>>>| w[0].iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&a), bits(&b));
}

#[test]
fn plans_that_differ_between_ranks_are_refused_on_every_rank() {
    let m = zoo::by_name("seed-mlp").unwrap();
    let plans = [step_plan(&m, 8, &m.config(), 2), step_plan(&m, 16, &m.config(), 2)];
    let comms = kiln::comm::local_group_with_timeout(2, Duration::from_secs(20));
    let errors: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(plans)
            .map(|(comm, plan)| {
                s.spawn(move || {
                    CpuBackend::new(1).with_communicator(comm).load(plan).unwrap_err().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for e in &errors {
        assert!(e.contains("did not load the same plan"), "{e}");
    }
}

#[test]
fn a_rank_that_leaves_is_an_error_for_the_others_not_a_hang() {
    let m = zoo::by_name("seed-mlp").unwrap();
    let plan = step_plan(&m, 8, &m.config(), 2);
    let mut comms = kiln::comm::local_group_with_timeout(2, Duration::from_secs(5));
    let leaver = comms.pop().unwrap();
    let t = std::time::Instant::now();
    let err = std::thread::scope(|s| {
        let h = s.spawn(|| {
            CpuBackend::new(1).with_communicator(comms.pop().unwrap()).load(plan).unwrap_err().to_string()
        });
        drop(leaver);
        h.join().unwrap()
    });
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    assert!(err.contains("rank 1"), "{err}");
}

#[test]
fn a_plan_with_collectives_needs_a_communicator() {
    let m = zoo::by_name("seed-mlp").unwrap();
    let err = CpuBackend::new(1).load(step_plan(&m, 8, &m.config(), 2)).unwrap_err().to_string();
    assert!(err.contains("no communicator"), "{err}");
}

/// The `Trainer` on a backend that is a rank trains data-parallel: every rank is given the whole
/// batch, trains on its shard, reports the whole batch's loss, and keeps the weights of the
/// others; a checkpoint one rank saves resumes on one rank, a different rank count.
#[test]
fn trainers_on_ranks_train_as_one_and_resume_on_another_rank_count() {
    let m = zoo::by_name("mlp").unwrap();
    let cfg = TrainConfig { optimizer: Optimizer::Sgd(Sgd::new(0.05)), ..m.config() };
    let data = batches(&m, 24, 3);
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("two-ranks.safetensors");
    let comms = kiln::comm::local_group(2);
    let runs: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (m, cfg, data, ckpt) = (m.clone(), cfg.clone(), &data, ckpt.clone());
                s.spawn(move || {
                    let backend = Box::new(CpuBackend::new(5).with_communicator(comm));
                    assert_eq!(backend.rank().map(|r| r.1), Some(2));
                    let mut t = Trainer::new(m.model(), cfg, backend);
                    let losses: Vec<f32> =
                        data[..2].iter().map(|(x, y)| t.train_step(x, y).unwrap().loss).collect();
                    if t.backend().rank() == Some((0, 2)) {
                        t.save(&ckpt).unwrap();
                    }
                    let w = t.backend().read_variable("dense/kernel").unwrap().data().to_vec();
                    (losses, w)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&runs[0].0), bits(&runs[1].0), "every rank reports the same loss");
    assert_eq!(bits(&runs[0].1), bits(&runs[1].1), "and holds the same weights");
    // One rank on the whole batch: the same losses within float tolerance.
    let mut one = Trainer::new(m.model(), cfg.clone(), Box::new(CpuBackend::new(5)));
    let losses: Vec<f32> = data.iter().map(|(x, y)| one.train_step(x, y).unwrap().loss).collect();
    for (a, b) in runs[0].0.iter().zip(&losses) {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "2 ranks {:?} vs 1 rank {losses:?}", runs[0].0);
    }
    // Resume the 2-rank run's checkpoint on one rank: its third step is the 1-rank run's.
    let mut resumed = Trainer::new(m.model(), cfg, Box::new(CpuBackend::new(9)));
    resumed.train_program(data[2].0.shape().clone(), data[2].1.shape().clone()).unwrap();
    resumed.load(&ckpt).unwrap();
    let third = resumed.train_step(&data[2].0, &data[2].1).unwrap().loss;
    assert!((third - losses[2]).abs() <= 1e-5 * losses[2].abs(), "resumed {third} vs {}", losses[2]);
}

/// A batch the rank count does not divide is padded by repeating its first rows, as PyTorch's
/// `DistributedSampler` pads: 3 ranks on 8 rows each train 3 of the rows 0..8, 0, the step one
/// rank takes on those 9 rows (within float summation), with identical weights on every rank.
/// `fit` shards each batch the same way (10 rows in batches of 4: 4, 4 and 2 rows).
#[test]
fn a_batch_the_rank_count_does_not_divide_is_padded_as_distributed_sampler_pads() {
    let m = zoo::by_name("mlp").unwrap();
    let cfg = TrainConfig { optimizer: Optimizer::Sgd(Sgd::new(0.05)), ..m.config() };
    let data = batches(&m, 8, 2);
    let padded: Vec<(HostTensor, HostTensor)> = data
        .iter()
        .map(|(x, y)| {
            let rows: Vec<usize> = (0..8).chain([0]).collect();
            (x.select_rows(&rows).unwrap(), y.select_rows(&rows).unwrap())
        })
        .collect();
    let (fit_x, fit_y) = m.clone().with_batch(10).batch_data(40).unwrap();
    let fit = |t: &mut Trainer| {
        let opts = kiln::runtime::FitOptions {
            batch_size: 4,
            epochs: 1,
            shuffle: false,
            verbose: false,
            ..Default::default()
        };
        t.fit(&fit_x, &fit_y, &opts).unwrap().epochs[0].loss
    };
    let runs = kiln::comm::run_local_ranks(3, |_, comm| {
        let mut t =
            Trainer::new(m.model(), cfg.clone(), Box::new(CpuBackend::new(5).with_communicator(comm)));
        let losses: Vec<f32> = data.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss).collect();
        let fitted = fit(&mut t);
        (losses, fitted, t.backend().read_variable("dense/kernel").unwrap().data().to_vec())
    });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for r in &runs[1..] {
        assert_eq!(bits(&r.2), bits(&runs[0].2), "every rank holds the same weights");
        assert_eq!(r.0, runs[0].0, "and reports the same losses");
    }
    let mut one = Trainer::new(m.model(), cfg, Box::new(CpuBackend::new(5)));
    let losses: Vec<f32> = padded.iter().map(|(x, y)| one.train_step(x, y).unwrap().loss).collect();
    for (a, b) in runs[0].0.iter().zip(&losses) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "3 ranks {:?} vs 1 rank on the padded rows {losses:?}",
            runs[0].0
        );
    }
    // fit, shuffle off: the batch of rows 0..4 is padded to 0, 1, 2, 3, 0, 1 (2 rows a rank),
    // the last one, 8 and 9, to 8, 9, 8; the epoch's loss weighs each batch by its own rows.
    let mut sum = 0.0;
    for (rows, weight) in [(vec![0, 1, 2, 3, 0, 1], 4.0), (vec![4, 5, 6, 7, 4, 5], 4.0), (vec![8, 9, 8], 2.0)]
    {
        let (x, y) = (fit_x.select_rows(&rows).unwrap(), fit_y.select_rows(&rows).unwrap());
        sum += weight * one.train_step(&x, &y).unwrap().loss;
    }
    let (fitted, want) = (runs[0].1, sum / 10.0);
    assert!((fitted - want).abs() <= 1e-5 * want.abs(), "fit on 3 ranks {fitted} vs {want}");
    let w = one.backend().read_variable("dense/kernel").unwrap().data().to_vec();
    let scale = w.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert!(runs[0].2.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 1e-5 * scale), "weights after fit");
}

/// `kiln ranks` with `args`: whether it succeeded, its stdout and its stderr.
fn kiln_ranks(args: &[&str]) -> (bool, String, String) {
    let out =
        std::process::Command::new(env!("CARGO_BIN_EXE_kiln")).arg("ranks").args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn the_cli_trains_on_ranks_and_says_how_to_launch_processes() {
    let (ok, text, err) = kiln_ranks(&["--ranks", "2", "--model", "seed-mlp", "--steps", "2"]);
    assert!(ok, "{text}{err}");
    assert!(text.contains("weights bitwise identical on all 2 ranks: true"), "{text}");
    assert!(text.contains("mpirun -np 2"), "{text}");
    // 3 ranks on seed-mlp's 32 rows: padded to 33, 11 a rank.
    let (ok, text, err) = kiln_ranks(&["--ranks", "3", "--model", "seed-mlp", "--steps", "1"]);
    assert!(ok, "{text}{err}");
    assert!(text.contains("3 ranks x 11 rows of each batch of 32 (padded to 33)"), "{text}");
    assert!(text.contains("weights bitwise identical on all 3 ranks: true"), "{text}");
    let (ok, _, err) = kiln_ranks(&["--ranks", "33", "--model", "seed-mlp"]);
    assert!(!ok);
    assert!(err.contains("as many ranks as the batch has rows"), "{err}");
}

/// The main job on ranks (`kiln seed --ranks 2`): the seed model's fit on 2 in-process ranks
/// keeps their weights identical and trains what one process trains on the whole batches
/// (epoch losses within float summation tolerance; the last batch of each epoch, 8 rows, is 4 a
/// rank).
#[test]
fn the_seed_run_on_ranks_trains_as_one_process() {
    let one = kiln::seed::run(&kiln::Device::Cpu, false).unwrap();
    let (two, same) = kiln::seed::run_ranks(&kiln::Device::Cpu, 2, false).unwrap();
    assert!(same, "the ranks' weights are bitwise identical");
    assert_eq!(two.history.epochs.len(), 5);
    for (a, b) in one.history.epochs.iter().zip(&two.history.epochs) {
        let (la, lb) = (a.loss, b.loss);
        assert!(
            (la - lb).abs() <= 1e-5 * la.abs().max(1.0),
            "epoch loss {la} on one process, {lb} on 2 ranks"
        );
    }
    let plans = two.trainer.plans();
    assert!(plans.iter().all(|p| p.steps.iter().any(|s| s.op.is_collective())), "rank 0's plans reduce");
    assert!(
        plans.iter().any(|p| p.name.contains("16")),
        "a rank's batch is half the seed's 32: {:?}",
        plans.iter().map(|p| &p.name).collect::<Vec<_>>()
    );
}

/// Collectives overlapping the steps after them (`CpuBackend::set_overlap`, on by default)
/// train the bits of collectives run in line: the transformer, whose data-parallel plan defers
/// each bucket's updates past the next collective (`+overlap`), at ZeRO stages 0 and 2.
#[test]
fn overlapped_collectives_train_the_bits_of_collectives_in_line() {
    use kiln::compiler::zero::ZeroStage;
    let m = zoo::by_name("transformer").unwrap();
    let data = batches(&m, 4, 2);
    for stage in [ZeroStage::Off, ZeroStage::Two] {
        let run = |overlap: bool| {
            kiln::comm::run_local_ranks(2, |_, comm| {
                let mut backend = CpuBackend::new(3).with_communicator(comm);
                backend.set_overlap(overlap);
                // Without recomputation beyond 1/1000 of the step (`saved_values`,
                // `cheap_remat`), which makes another order the smallest: this step's smallest
                // order is then an overlapped one.
                let options = CompileOptions { save_minimal: false, ..CompileOptions::default() }
                    .with_recompute_budget(0.001);
                let mut t = Trainer::new(m.model(), m.config(), Box::new(backend))
                    .with_options(options)
                    .with_zero_stage(stage);
                let losses: Vec<u32> =
                    data.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss.to_bits()).collect();
                let plan = t.plans()[0].clone();
                let weights: Vec<u32> = plan
                    .variables
                    .iter()
                    .flat_map(|v| t.backend().read_variable(&v.key).unwrap().data().to_vec())
                    .map(f32::to_bits)
                    .collect();
                (losses, weights, plan.memory.schedule.clone())
            })
        };
        let (on, off) = (run(true), run(false));
        if stage == ZeroStage::Off {
            assert!(on[0].2.ends_with("+overlap"), "the transformer's step defers its updates: {}", on[0].2);
        }
        for r in 0..2 {
            assert_eq!(on[r].0, off[r].0, "{stage:?}: rank {r}'s losses");
            assert!(on[r].1 == off[r].1, "{stage:?}: rank {r}'s weights and optimizer state");
        }
    }
}

/// f16 loss scaling on ranks: one rank's gradients overflow (its rows' targets are 1000), the
/// other's do not; the finite checks are summed over the ranks, so both skip the step, back the
/// scale off together and keep identical weights.
#[test]
fn f16_loss_scaling_skips_a_step_on_every_rank_together() {
    use kiln::compiler::loss_scale::SCALE_KEY;
    let model = || Sequential::new().add(Dense::new(16).activation(Activation::Relu)).add(Dense::new(1));
    let cfg =
        TrainConfig { loss: Loss::MeanSquaredError, optimizer: Adam::new(0.01).into(), metrics: vec![] };
    let x: Vec<f32> = (0..32).map(|i| ((i * 7 % 11) as f32 - 5.0) / 5.0).collect();
    let x = HostTensor::new(vec![8, 4], x).unwrap();
    let y = HostTensor::new(vec![8, 1], [[1000.0f32; 4], [0.0; 4]].concat()).unwrap();
    let comms = kiln::comm::local_group(2);
    let runs: Vec<(Vec<f32>, Vec<u32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (cfg, x, y) = (cfg.clone(), &x, &y);
                s.spawn(move || {
                    let backend = Box::new(CpuBackend::new(5).with_communicator(comm));
                    let mut t = Trainer::new(model(), cfg, backend).with_precision(Precision::F16);
                    let mut scales = Vec::new();
                    for _ in 0..3 {
                        t.train_step(x, y).unwrap();
                        scales.push(t.backend().read_variable(SCALE_KEY).unwrap().data()[0]);
                    }
                    let w = t
                        .backend()
                        .read_variable("dense/kernel")
                        .unwrap()
                        .data()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect();
                    (scales, w)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(runs[0].0, [32768.0, 16384.0, 8192.0], "rank 0's gradients overflow: every step skipped");
    assert_eq!(runs[1], runs[0], "rank 1 skips with it and holds the same weights");
}
