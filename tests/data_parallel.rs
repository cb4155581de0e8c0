//! Data-parallel training (`kiln_compiler::data_parallel`, `kiln_comm`): N in-process ranks,
//! each a `CpuBackend` on its own thread with its shard of every batch, keep bitwise-identical
//! weights and train the weights one rank trains on the whole batch; plans that differ between
//! ranks, and a rank that leaves, are errors on every rank, never a hang.

use kiln::compiler::data_parallel::all_reduce_gradients;
use kiln::compiler::ir::{Op, Shape};
use kiln::compiler::optim::{Optimizer, Sgd};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo::{self, ZooModel};
use std::time::Duration;

/// Rows `start..start + len` of `t`.
fn rows(t: &HostTensor, start: usize, len: usize) -> HostTensor {
    let width: usize = t.shape().dims()[1..].iter().product();
    let mut dims = t.shape().dims().to_vec();
    dims[0] = len;
    HostTensor::new(Shape::new(dims), t.data()[start * width..(start + len) * width].to_vec()).unwrap()
}

fn step_plan(m: &ZooModel, batch: usize, cfg: &TrainConfig, ranks: usize) -> kiln::compiler::Plan {
    let m = m.clone().with_batch(batch);
    let mut graph = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), cfg).unwrap();
    if ranks > 1 {
        assert!(all_reduce_gradients(&mut graph).unwrap() > 0);
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
    let batch = batches[0].0.shape().dims()[0];
    let shard = batch / ranks;
    let plan = step_plan(m, shard, cfg, ranks);
    let comms = kiln::comm::local_group(ranks);
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(r, comm)| {
                let plan = plan.clone();
                s.spawn(move || {
                    let mut backend = CpuBackend::new(5);
                    if ranks > 1 {
                        backend = backend.with_communicator(comm);
                    }
                    let id = backend.load(plan.clone()).unwrap();
                    for (x, y) in batches {
                        let (x, y) = (rows(x, r * shard, shard), rows(y, r * shard, shard));
                        backend.call(id, &[("x", &x), ("y", &y)]).unwrap();
                    }
                    let params = plan.variables.iter().filter(|v| !v.key.starts_with("optimizer/"));
                    params.map(|v| backend.read_variable(&v.key).unwrap().data().to_vec()).collect::<Vec<_>>()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
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
    let plan = step_plan(&m, 4, &m.config(), 2);
    let reduces: Vec<_> = plan.steps.iter().filter(|s| matches!(s.op, Op::AllReduce { .. })).collect();
    assert_eq!(
        reduces.len(),
        plan.variables.iter().filter(|v| v.key.starts_with("optimizer/") && v.key.ends_with("/m")).count()
    );
    assert!(reduces.iter().all(|s| s.in_place), "each gradient is reduced where it is");
    assert!(plan.render().contains("all_reduce[mean]"));
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
