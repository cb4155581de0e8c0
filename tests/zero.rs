//! Sharded optimizer state (ZeRO stages 1 and 2, `kiln_compiler::zero`): N in-process ranks,
//! each keeping its shard of Adam's state, train the bits plain data parallelism trains, hold
//! identical weights, and plan a 1/N share of the optimizer state each.

use kiln::compiler::ir::{Op, Shard, VarRole};
use kiln::compiler::step::train_step_graph;
use kiln::compiler::zero::{ZeroStage, for_rank, shard_optimizer_state};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor, Trainer};
use kiln::zoo::{self, ZooModel};

fn batches(m: &ZooModel, batch: usize, n: u64) -> Vec<(HostTensor, HostTensor)> {
    (0..n).map(|i| m.clone().with_batch(batch).batch_data(20 + i).unwrap()).collect()
}

/// Every rank's parameters (key order) and losses after training on `data` with `stage`.
fn train(
    m: &ZooModel,
    stage: ZeroStage,
    ranks: usize,
    data: &[(HostTensor, HostTensor)],
) -> Vec<(Vec<Vec<f32>>, Vec<f32>)> {
    let keys: Vec<String> = plan(m, ZeroStage::Off, 1)
        .variables
        .iter()
        .filter(|v| v.role == VarRole::Parameter)
        .map(|v| v.key.clone())
        .collect();
    kiln::comm::run_local_ranks(ranks, |_, comm| {
        let backend = CpuBackend::new(3).with_communicator(comm);
        let mut t = Trainer::new(m.model(), m.config(), Box::new(backend)).with_zero_stage(stage);
        let losses: Vec<f32> = data.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss).collect();
        let params = keys.iter().map(|k| t.backend().read_variable(k).unwrap().data().to_vec()).collect();
        (params, losses)
    })
}

/// `ranks` in-process ranks with `stage`: load `from` (when given), train on `data`, save to
/// `to` (rank 0's file; every rank saves, a collective under ZeRO, the others beside it); every
/// rank's parameters (key order) and losses.
fn resume(
    m: &ZooModel,
    stage: ZeroStage,
    ranks: usize,
    from: Option<&std::path::Path>,
    data: &[(HostTensor, HostTensor)],
    to: &std::path::Path,
) -> Vec<(Vec<Vec<f32>>, Vec<f32>)> {
    let keys = parameter_keys(m);
    kiln::comm::run_local_ranks(ranks, |rank, comm| {
        let backend = CpuBackend::new(3).with_communicator(comm);
        let mut t = Trainer::new(m.model(), m.config(), Box::new(backend)).with_zero_stage(stage);
        // The step compiled first, so that the state a checkpoint loads into exists.
        let shard = |t: &HostTensor| {
            let mut dims = t.shape().dims().to_vec();
            dims[0] /= ranks;
            Shape::new(dims)
        };
        t.train_program(shard(&data[0].0), shard(&data[0].1)).unwrap();
        if let Some(from) = from {
            t.load(from).unwrap();
        }
        let losses: Vec<f32> = data.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss).collect();
        let name = to.file_name().unwrap().to_string_lossy();
        let mine = if rank == 0 { to.to_path_buf() } else { to.with_file_name(format!("rank{rank}-{name}")) };
        t.save(&mine).unwrap();
        let params = keys.iter().map(|k| t.backend().read_variable(k).unwrap().data().to_vec()).collect();
        (params, losses)
    })
}

fn parameter_keys(m: &ZooModel) -> Vec<String> {
    plan(m, ZeroStage::Off, 1)
        .variables
        .iter()
        .filter(|v| v.role == VarRole::Parameter)
        .map(|v| v.key.clone())
        .collect()
}

/// A sharded run's checkpoint holds the whole optimizer state (gathered from the ranks' shards):
/// the bits plain data parallelism saves, and it resumes on another rank count, sharded or not,
/// training the bits a plain run resumed from the same file trains.
#[test]
fn a_sharded_checkpoint_is_whole_and_resumes_on_another_rank_count() {
    let m = zoo::by_name("mlp").unwrap();
    let data = batches(&m, 12, 4);
    let (first, then) = data.split_at(2);
    // The checkpoints of this test, removed when it ends.
    let tmp = tempfile::tempdir().unwrap();
    let temp = |name: &str| tmp.path().join(name);
    let (zero_file, plain_file) = (temp("zero.safetensors"), temp("plain.safetensors"));
    resume(&m, ZeroStage::Two, 2, None, first, &zero_file);
    resume(&m, ZeroStage::Off, 2, None, first, &plain_file);
    let (z, p) = (
        kiln::runtime::checkpoint::read(&zero_file).unwrap(),
        kiln::runtime::checkpoint::read(&plain_file).unwrap(),
    );
    assert_eq!(z.tensors.keys().collect::<Vec<_>>(), p.tensors.keys().collect::<Vec<_>>());
    for (key, t) in &z.tensors {
        assert_eq!(t.shape(), p.tensors[key].shape(), "`{key}`: whole, not a shard");
        assert_eq!(bits(&[t.data().to_vec()]), bits(&[p.tensors[key].data().to_vec()]), "`{key}`");
    }
    // Saved on 2 ranks, resumed on 3 (uneven shards of every state variable) with ZeRO stage 1,
    // and without ZeRO: the same bits.
    let sharded = resume(&m, ZeroStage::One, 3, Some(&zero_file), then, &temp("again-zero.safetensors"));
    let plain = resume(&m, ZeroStage::Off, 3, Some(&plain_file), then, &temp("again-plain.safetensors"));
    for (r, (w, losses)) in sharded.iter().enumerate() {
        assert_eq!(bits(w), bits(&plain[0].0), "rank {r}'s weights");
        assert_eq!(losses, &plain[0].1, "rank {r}'s losses");
    }
}

fn bits(v: &[Vec<f32>]) -> Vec<u32> {
    v.iter().flatten().map(|x| x.to_bits()).collect()
}

#[test]
fn sharded_state_trains_the_bits_of_plain_data_parallelism() {
    for name in ["mlp", "transformer"] {
        let m = zoo::by_name(name).unwrap();
        let data = batches(&m, 6, 2);
        for ranks in [2, 3] {
            let plain = train(&m, ZeroStage::Off, ranks, &data);
            for stage in [ZeroStage::One, ZeroStage::Two] {
                let sharded = train(&m, stage, ranks, &data);
                for (r, (w, losses)) in sharded.iter().enumerate() {
                    assert_eq!(
                        bits(w),
                        bits(&plain[0].0),
                        "{name}, {ranks} ranks, {stage:?}: rank {r}'s weights"
                    );
                    assert_eq!(losses, &plain[0].1, "{name}, {ranks} ranks, {stage:?}: rank {r}'s losses");
                }
            }
        }
    }
}

fn plan(m: &ZooModel, stage: ZeroStage, ranks: usize) -> Plan {
    let mut g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
    shard_optimizer_state(&mut g, stage, Shard { ranks, rank: 0 }).unwrap();
    compile(g, &CompileOptions::default()).unwrap()
}

#[test]
fn each_rank_plans_its_share_of_the_optimizer_state() {
    let m = zoo::by_name("cnn").unwrap().with_batch(8);
    let whole = plan(&m, ZeroStage::Off, 4).memory;
    for stage in [ZeroStage::One, ZeroStage::Two] {
        for ranks in [2, 4, 8] {
            let p = plan(&m, stage, ranks);
            let mem = &p.memory;
            // Adam's m and v of every parameter, each padded to ceil(n / ranks) (plus the counter
            // and each slot's alignment): at most 1/ranks of the whole, plus that padding.
            let bound = whole.optimizer_state_bytes / ranks + 2 * p.variables.len() * p.alignment;
            assert!(
                mem.optimizer_state_bytes <= bound,
                "{stage:?} x{ranks}: {} > {bound}",
                mem.optimizer_state_bytes
            );
            assert_eq!(mem.parameter_bytes, whole.parameter_bytes, "parameters stay whole");
            let gathers = p.steps.iter().filter(|s| matches!(s.op, Op::AllGather { .. })).count();
            let updates =
                p.steps.iter().filter(|s| matches!(s.op, Op::ApplyAdam { shard: Some(_), .. })).count();
            let params = p.variables.iter().filter(|v| v.role == VarRole::Parameter).count();
            assert_eq!((gathers, updates), (params, params), "one sharded update and gather per parameter");
            // Stage 2 reduce-scatters: no whole gradient reaches an update.
            let scatters = p.steps.iter().filter(|s| matches!(s.op, Op::ReduceScatter { .. })).count();
            assert_eq!(scatters, if stage == ZeroStage::Two { params } else { 0 });
            // Each all-gather's scratch is the rank's padded shard.
            for s in p.steps.iter().filter(|s| matches!(s.op, Op::AllGather { .. })) {
                let var = &p.values[s.inputs[0]].shape;
                let b = s.scratch.map(|b| p.buffers[b].bytes).unwrap_or(0);
                assert_eq!(b, var.numel().div_ceil(ranks) * 4, "{}", s.label);
            }
        }
    }
    // Stage 2 frees each whole gradient at its reduce-scatter: never a larger arena than stage 1,
    // compared without recomputation (whose greedy search can take more from one than the other:
    // at 2% of the step, 2,589,952 B at stage 1 and 2,740,352 B at stage 2).
    let arena = |stage| {
        let mut g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        shard_optimizer_state(&mut g, stage, Shard { ranks: 4, rank: 0 }).unwrap();
        compile(g, &CompileOptions::default().with_recompute_budget(0.0)).unwrap().memory.arena_bytes
    };
    assert!(arena(ZeroStage::Two) <= arena(ZeroStage::One));
}

#[test]
fn a_plan_for_another_rank_is_refused() {
    let m = zoo::by_name("mlp").unwrap().with_batch(4);
    let p = plan(&m, ZeroStage::Two, 2);
    assert!(for_rank(p.clone(), 2).is_err(), "rank 2 of 2");
    let errors = kiln::comm::run_local_ranks(2, |_, comm| {
        // Both ranks load rank 0's plan: rank 1 must refuse it before any collective runs.
        let mut b = CpuBackend::new(1).with_communicator(comm);
        b.load(p.clone()).err().map(|e| e.to_string())
    });
    assert!(
        errors[0].is_none() || errors[0].as_deref().is_some_and(|e| e.contains("same plan")),
        "{errors:?}"
    );
    let e = errors[1].as_deref().expect("rank 1 refuses rank 0's plan");
    assert!(e.contains("rank 0's of 2 ranks, but this backend is rank 1 of 2"), "{e}");
}

#[test]
fn the_zero_table_shards_state_and_moves_the_bytes_of_plain_data_parallelism() {
    let m = zoo::by_name("mlp").unwrap().with_batch(8);
    let rows = kiln::zero_table::rows(&m, &[1, 2, 4]).unwrap();
    assert_eq!(rows.len(), 1 + 3 + 3, "one row at N = 1, three stages beyond");
    let at = |n: usize, stage: usize| rows.iter().find(|r| r.ranks == n && r.stage == stage).unwrap();
    let whole = at(1, 0).optimizer_state_bytes;
    for n in [2, 4] {
        assert_eq!(at(n, 0).optimizer_state_bytes, whole);
        for stage in [1, 2] {
            let r = at(n, stage);
            assert!(r.optimizer_state_bytes * n <= whole + 4096 * n, "{n} ranks, stage {stage}");
            assert!(r.planned_total_bytes < at(n, 0).planned_total_bytes);
        }
        // Reduce-scatter + all-gather send what one all-reduce sends, up to the padding of
        // the shards (to a multiple of N elements) and of the buckets' gradients (to 16 bytes).
        let (two, zero) = (at(n, 2).ring_bytes_sent, at(n, 0).ring_bytes_sent);
        assert!(two.abs_diff(zero) * 1000 <= zero, "{n} ranks: {two} B against {zero} B");
        assert!(at(n, 1).ring_bytes_sent > at(n, 0).ring_bytes_sent);
    }
    assert_eq!(at(1, 0).ring_bytes_sent, 0);
    assert!(kiln::zero_table::render(&rows).contains("ZeRO model states/rank"));
}

/// f16 steps with loss scaling shard their state too, SGD's velocity as Adam's moments (the
/// gate is no state), and train the bits of plain data parallelism at every stage, the ranks
/// skipping the same steps.
#[test]
fn f16_steps_with_sgd_shard_their_state_and_train_as_plain_data_parallelism() {
    use kiln::compiler::loss_scale::SCALE_KEY;
    let m = zoo::by_name("mlp").unwrap();
    let cfg = TrainConfig { optimizer: Sgd::new(0.05).momentum(0.9).into(), ..m.config() };
    let data = batches(&m, 8, 2);
    let run = |stage: ZeroStage| {
        kiln::comm::run_local_ranks(2, |_, comm| {
            let backend = CpuBackend::new(3).with_communicator(comm);
            let mut t = Trainer::new(m.model(), cfg.clone(), Box::new(backend))
                .with_zero_stage(stage)
                .with_precision(Precision::F16);
            let losses: Vec<u32> =
                data.iter().map(|(x, y)| t.train_step(x, y).unwrap().loss.to_bits()).collect();
            let kernel = t
                .backend()
                .read_variable("dense/kernel")
                .unwrap()
                .data()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>();
            let scale = t.backend().read_variable(SCALE_KEY).unwrap().data()[0];
            (losses, kernel, scale)
        })
    };
    let plain = run(ZeroStage::Off);
    assert_eq!(plain[0], plain[1], "the ranks agree");
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let sharded = run(stage);
        assert_eq!(sharded[0], sharded[1], "{stage:?}: the ranks agree");
        assert_eq!(sharded[0].2, plain[0].2, "{stage:?}: the same scale");
        assert_eq!(sharded[0].1, plain[0].1, "{stage:?}: the weights of plain data parallelism");
    }
}
