//! Per-step scratch (`kiln::compiler::scratch`): planned like any buffer, live at its step alone,
//! counted in every figure, checked at every backend's door, and used by the CUDA kernels for
//! split-K across blocks. The CPU runs a plan with scratch exactly as without; the CUDA backend
//! (on the emulated device here, on a GPU in `tests/gpu.rs`) matches the CPU with it.

mod common;

use kiln::compiler::ir::Padding;
use kiln::compiler::plan::Storage;
use kiln::compiler::validate::validate;
use kiln::kernels::cuda::SCRATCH;
use kiln::prelude::*;
use kiln::runtime::cuda::{CudaBackend, emulator};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// A weight gradient over many rows and a filter gradient over many positions, with a third
/// step reading both: long contractions into few outputs.
fn long_contractions() -> (kiln::compiler::ir::Graph, Vec<(String, HostTensor)>) {
    let t = Tracer::new("long");
    let a = t.input("a", [1536, 20]);
    let b = t.input("b", [1536, 12]);
    let x = t.input("x", [4, 16, 16, 3]);
    let dy = t.input("dy", [4, 16, 16, 8]);
    let w = t.input("w", [3, 3, 3, 8]);
    let g = a.matmul_t(&b, true, false);
    let y = x.conv2d(&w, [1, 1], Padding::Same);
    let loss = (&y * &dy).sum(.., false);
    t.output("g", &(g.relu() * 2.0));
    t.output("loss", &loss);
    let graph = t.finish().unwrap();
    let wrt = [w.id().unwrap()];
    let (mut graph, grads) = kiln::compiler::autodiff::gradients(graph, loss.id().unwrap(), &wrt).unwrap();
    graph.set_output("dw", grads[0].unwrap());
    let mut rng = StdRng::seed_from_u64(7);
    let feeds =
        [("a", vec![1536, 20]), ("b", vec![1536, 12]), ("x", vec![4, 16, 16, 3]), ("dy", vec![4, 16, 16, 8])]
            .into_iter()
            .chain([("w", vec![3, 3, 3, 8])])
            .map(|(n, s)| {
                (n.to_string(), common::draw(&Shape::from(s.as_slice()), common::Draw::Normal, &mut rng))
            })
            .collect();
    (graph, feeds)
}

fn plans() -> (Plan, Plan) {
    let (graph, _) = long_contractions();
    let plain = compile(graph.clone(), &CompileOptions::default()).unwrap();
    let split = compile(graph, &CompileOptions::default().with_scratch(Some(SCRATCH))).unwrap();
    (plain, split)
}

#[test]
fn scratch_is_a_buffer_of_its_step_alone_counted_in_the_arena() {
    let (plain, split) = plans();
    assert!(plain.steps.iter().all(|s| s.scratch.is_none()), "no rule, no scratch");
    let with: Vec<usize> = (0..split.steps.len()).filter(|&s| split.steps[s].scratch.is_some()).collect();
    assert!(with.len() >= 2, "the weight and the filter gradient split: {}", split.render());
    for &s in &with {
        let b = &split.buffers[split.steps[s].scratch.unwrap()];
        assert_eq!((b.first_step, b.last_step), (s, s), "{}", b.label);
        assert!(matches!(b.storage, Storage::Arena { .. }));
        assert!(b.label.starts_with("scratch of"), "{}", b.label);
        assert!(split.values.iter().all(|v| v.buffer != split.steps[s].scratch.unwrap()));
    }
    // Scratch is memory like any other: the figures count it, and the arena stays at its bound.
    let scratch: usize = with.iter().map(|&s| split.buffers[split.steps[s].scratch.unwrap()].bytes).sum();
    assert!(split.memory.naive_bytes >= plain.memory.naive_bytes + scratch);
    assert!(split.memory.lower_bound_bytes >= plain.memory.lower_bound_bytes);
    assert_eq!(split.memory.arena_bytes, split.memory.lower_bound_bytes, "{}", split.render());
    assert!(split.render().contains(" scratch "), "the listing shows each step's scratch");
    // Plain data: a plan with scratch survives serialisation.
    let back: Plan = serde_json::from_str(&serde_json::to_string(&split).unwrap()).unwrap();
    assert_eq!(back, split);
}

#[test]
fn bad_scratch_is_refused_before_anything_runs() {
    let (_, split) = plans();
    let with: Vec<usize> = (0..split.steps.len()).filter(|&s| split.steps[s].scratch.is_some()).collect();
    let (s0, s1) = (with[0], with[1]);
    let mut bad = split.clone();
    bad.steps[s1].scratch = bad.steps[s0].scratch;
    assert!(validate(&bad).is_err(), "a scratch buffer of another step");
    let mut bad = split.clone();
    bad.steps[s0].scratch = Some(bad.values[bad.steps[s0].inputs[0]].buffer);
    assert!(validate(&bad).is_err(), "a value's buffer as scratch");
    let mut bad = split.clone();
    bad.steps[s0].scratch = Some(bad.buffers.len());
    let e = validate(&bad).unwrap_err();
    assert!(e.contains("scratch"), "{e}");
    let mut bad = split.clone();
    let b = bad.steps[s0].scratch.unwrap();
    bad.buffers[b].last_step += 1;
    assert!(validate(&bad).is_err(), "scratch live past its step");
    // Every backend's door is the same check.
    let mut cpu = CpuBackend::new(0);
    assert!(cpu.load(bad).is_err());
}

#[test]
fn the_cpu_runs_a_plan_with_scratch_as_without() {
    let (plain, split) = plans();
    let (_, feeds) = long_contractions();
    let feed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut cpu = CpuBackend::new(0);
    let (p, s) = (cpu.load(plain).unwrap(), cpu.load(split).unwrap());
    assert_eq!(cpu.call(p, &feed).unwrap(), cpu.call(s, &feed).unwrap());
}

#[test]
fn split_k_on_the_emulated_device_matches_the_cpu() {
    if let Err(why) = emulator::host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the emulated device: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let (plain, split) = plans();
    let (_, feeds) = long_contractions();
    let feed: Vec<(&str, &HostTensor)> = feeds.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut gpu = CudaBackend::emulated(emulator::DEFAULT_MEMORY, 0).unwrap();
    assert_eq!(gpu.scratch_rule(), Some(SCRATCH));
    let id = gpu.load(split).unwrap();
    let got = gpu.call(id, &feed).unwrap();
    let mut cpu = CpuBackend::new(0);
    let cid = cpu.load(plain).unwrap();
    let want = cpu.call(cid, &feed).unwrap();
    for ((name, w), (_, g)) in want.iter().zip(&got) {
        let scale = w.data().iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let d = w.max_abs_diff(g);
        assert!(d <= 2e-4 * scale, "{name} differs by {d} (scale {scale})");
    }
}
