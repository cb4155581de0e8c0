//! Forward passes in blocks of batch rows (`kiln_compiler::batch_blocks`): the plans compute what
//! the whole-batch plans compute, their arenas are smaller where blocks were chosen, blocks of
//! uneven rows work, a loss over the batch ends the region, and a memory limit that only a split
//! plan meets is met.

use kiln::compiler::Plan;
use kiln::compiler::ir::Op;
use kiln::compiler::step::forward_graph;
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use kiln::zoo;

fn whole() -> CompileOptions {
    CompileOptions::default().with_batch_blocks(false)
}

fn run(plan: &Plan, feeds: &[(&str, &HostTensor)]) -> Vec<(String, HostTensor)> {
    let mut backend = CpuBackend::new(2);
    let id = backend.load(plan.clone()).unwrap();
    let mut out = backend.call(id, feeds).unwrap();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Every element within 1e-6 of the larger magnitude (a block's GEMM may sum in another order).
fn assert_close(what: &str, a: &[(String, HostTensor)], b: &[(String, HostTensor)]) {
    assert_eq!(a.len(), b.len());
    for ((n, x), (_, y)) in a.iter().zip(b) {
        assert_eq!(x.shape(), y.shape(), "{what}: {n}");
        let scale = x.data().iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        for (i, (p, q)) in x.data().iter().zip(y.data()).enumerate() {
            assert!((p - q).abs() <= 1e-6 * scale, "{what}: {n}[{i}] is {p} in blocks and {q} whole");
        }
    }
}

#[test]
fn zoo_forward_passes_in_blocks_compute_the_whole_batch_results() {
    let mut blocked = Vec::new();
    for m in zoo::all() {
        let graph = forward_graph(&m.model(), m.x_shape()).unwrap();
        let plan = compile(graph.clone(), &CompileOptions::default()).unwrap();
        let plain = compile(graph.clone(), &whole()).unwrap();
        let unfused = compile(graph, &CompileOptions::default().with_fusion(false)).unwrap();
        assert!(plan.memory.planned_total_bytes() <= plain.memory.planned_total_bytes(), "{}", m.name);
        assert!(plan.memory.arena_bytes <= unfused.memory.arena_bytes, "{}", m.name);
        if plan.memory.batch_blocks == 0 {
            assert_eq!(plan.steps.len(), plain.steps.len(), "{}: no blocks, the same plan", m.name);
            continue;
        }
        blocked.push(m.name);
        assert!(plan.memory.arena_bytes < plain.memory.arena_bytes, "{}: blocks that save nothing", m.name);
        assert!(plan.memory.schedule.ends_with(&format!("+blocks{}", plan.memory.batch_blocks)));
        let slices = plan.steps.iter().filter(|s| matches!(s.op, Op::Slice { axis: 0, .. })).count();
        assert_eq!(slices, plan.memory.batch_blocks, "{}: the input is sliced once per block", m.name);
        let (x, _) = m.batch_data(3).unwrap();
        assert_close(m.name, &run(&plan, &[("x", &x)]), &run(&plain, &[("x", &x)]));
    }
    assert!(blocked.contains(&"cnn"), "the cnn's forward pass is planned in blocks: {blocked:?}");
}

#[test]
fn uneven_blocks_and_a_loss_over_the_batch() {
    // 61 images: blocks of 8 and 7 rows; the loss is a mean over the batch, outside the region.
    let m = zoo::by_name("cnn").unwrap().with_batch(61);
    let t = Tracer::new("cnn eval");
    let x = t.input("x", m.x_shape());
    let y = t.input("y", m.y_shape());
    let logits = m.model().forward(&x);
    let loss = kiln::compiler::losses::softmax_crossentropy(&logits, &y);
    t.output("logits", &logits);
    t.output("loss", &loss);
    let graph = t.finish().unwrap();
    let plan = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let plain = compile(graph, &whole()).unwrap();
    assert!(plan.memory.batch_blocks >= 2, "{}", plan.memory.schedule);
    assert!(plan.memory.arena_bytes < plain.memory.arena_bytes);
    let rows: Vec<usize> = plan
        .steps
        .iter()
        .filter_map(|s| match s.op {
            Op::Slice { axis: 0, len, .. } => Some(len),
            _ => None,
        })
        .collect();
    // x and y are both sliced: the loss's per-row terms run in the blocks, its mean after them.
    assert_eq!(rows.len(), 2 * plan.memory.batch_blocks, "{rows:?}");
    assert_eq!(rows.iter().sum::<usize>(), 2 * 61);
    assert_eq!(rows.iter().max().unwrap() - rows.iter().min().unwrap(), 1, "{rows:?}");
    let (xv, yv) = m.batch_data(5).unwrap();
    let feeds = [("x", &xv), ("y", &yv)];
    assert_close("cnn eval", &run(&plan, &feeds), &run(&plain, &feeds));
}

#[test]
fn a_memory_limit_only_blocks_meet_is_met() {
    let m = zoo::by_name("cnn").unwrap();
    let graph = forward_graph(&m.model(), m.x_shape()).unwrap();
    let plain = compile(graph.clone(), &whole()).unwrap();
    let blocked = compile(graph.clone(), &CompileOptions::default()).unwrap();
    assert!(blocked.memory.planned_total_bytes() < plain.memory.planned_total_bytes());
    // What limits are checked against: the variable region (aligned slots), io and arena.
    let limit = blocked.devices[0].memory.held_bytes();
    let tight = |o: CompileOptions| CompileOptions {
        devices: CompileOptions::device("cpu:0", Some(limit)).devices,
        ..o
    };
    assert!(compile(graph.clone(), &tight(whole())).is_err(), "the whole batch does not fit");
    let fit = compile(graph, &tight(CompileOptions::default())).unwrap_or_else(|e| panic!("{e}"));
    assert!(fit.memory.batch_blocks >= 2 && fit.devices[0].memory.held_bytes() <= limit);
}

/// A GPU target (the CUDA kernels' rule, `ScratchRule::blocks_only_to_fit`) keeps a forward pass
/// whole where it fits, since every split was slower there; blocks are still how it meets a limit
/// the whole batch misses. `forced_blocks` (`KILN_BATCH_BLOCKS=N`) plans exactly N blocks.
#[test]
fn a_gpu_target_splits_rows_only_to_fit() {
    let m = zoo::by_name("cnn").unwrap();
    let graph = forward_graph(&m.model(), m.x_shape()).unwrap();
    let gpu = || CompileOptions::default().with_scratch(Some(kiln::kernels::cuda::SCRATCH));
    let kept = compile(graph.clone(), &gpu()).unwrap();
    assert_eq!(kept.memory.batch_blocks, 0, "whole on a GPU where it fits");
    let cpu = compile(graph.clone(), &CompileOptions::default()).unwrap();
    assert!(cpu.memory.batch_blocks >= 2, "the CPU target still splits where that plans smaller");
    let whole_gpu = compile(graph.clone(), &gpu().with_batch_blocks(false)).unwrap();
    let limit = whole_gpu.devices[0].memory.held_bytes() - 1;
    let tight = CompileOptions { devices: CompileOptions::device("gpu:0", Some(limit)).devices, ..gpu() };
    let fit = compile(graph.clone(), &tight).unwrap_or_else(|e| panic!("{e}"));
    assert!(fit.memory.batch_blocks >= 2 && fit.devices[0].memory.held_bytes() <= limit);
    let forced = compile(graph, &CompileOptions { forced_blocks: Some(4), ..gpu() }).unwrap();
    assert_eq!(forced.memory.batch_blocks, 4);
}
