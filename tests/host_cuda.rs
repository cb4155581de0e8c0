//! Every CUDA kernel of every zoo training step (batch 1) runs on the host and matches the CPU
//! kernel of its step: the generated source compiled with the system C++ compiler against
//! `runtime/src/cuda/emulator/cuda_host.h` (CUDA's built-ins on host threads), launched with its
//! grid and block on random operands of the step's shapes. Kernels with identical source run
//! once; kernels of more than `MAX_THREADS` threads are left to a device (the test says how
//! many). What the host cannot see: timing, coalescing, occupancy, and races the host schedule
//! happens to order.

#[path = "../kernels/tests/cuda_host/mod.rs"]
mod cuda_host;
#[path = "common/unseen.rs"]
mod unseen;

use kiln::compare::{Mode, graph_of};
use kiln::compiler::ir::{DType, Op, Shape};
use kiln::compiler::step::train_step_graph;
use kiln::kernels::cpu;
use kiln::prelude::*;
use kiln::runtime::cuda::plan_kernels;
use kiln::zoo;
use std::collections::HashSet;

const MAX_THREADS: usize = 1 << 16;

/// Operands for a step: ids within the table for gathers, else uniform in [-1, 1).
fn operands(op: &Op, shapes: &[&Shape], seed: u64) -> Vec<Vec<f32>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 40) as f32 / (1u64 << 24) as f32
    };
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let ids = match op {
                Op::Gather if i == 1 => Some(shapes[0].dims()[0]),
                Op::GatherGrad { vocab } if i == 0 => Some(*vocab),
                _ => None,
            };
            // Adam's second moment is a mean of squares and its counter a step count: drawn so,
            // the update is well defined (a negative moment makes a NaN on both sides).
            let adam =
                op.update_grad().filter(|_| matches!(op, Op::ApplyAdam { .. })).map(|g| g.state_start());
            let (second_moment, counter) = (adam.map(|s| s + 1) == Some(i), adam.map(|s| s + 2) == Some(i));
            (0..s.numel())
                .map(|_| match ids {
                    Some(v) => (next() * v as f32).floor().min(v as f32 - 1.0),
                    None if second_moment => next() + 0.01,
                    None if counter => (next() * 8.0).floor(),
                    None => next() * 2.0 - 1.0,
                })
                .collect()
        })
        .collect()
}

/// With the CUDA kernels' scratch (split-K where a contraction is long), as on a device.
fn cuda_options() -> CompileOptions {
    CompileOptions::default().with_scratch(Some(kiln::kernels::cuda::SCRATCH))
}

#[test]
fn every_zoo_kernel_runs_on_the_host_and_matches_the_cpu() {
    let plans = zoo::all().into_iter().map(|m| {
        let m = m.with_batch(1);
        (m.name.to_string(), compile(graph_of(&m, Mode::Train).unwrap(), &cuda_options()).unwrap())
    });
    every_kernel_runs_on_the_host(plans.collect(), "zoo");
}

/// The same for the training steps of models the zoo does not have (`common/unseen.rs`), at
/// their odd sizes: a residual conv net's fused block input gradient, a GPT-style decoder's
/// tied embedding, RMSNorm, causal attention and sparse loss, an autoencoder, a narrow MLP.
#[test]
fn every_unseen_models_kernel_runs_on_the_host_and_matches_the_cpu() {
    let plans = unseen::all().into_iter().map(|m| {
        let graph = train_step_graph(&m.model, m.x.clone(), m.y.clone(), &m.config).unwrap();
        (m.name.to_string(), compile(graph, &cuda_options()).unwrap())
    });
    every_kernel_runs_on_the_host(plans.collect(), "unseen");
}

/// Every distinct kernel of `plans` (named) on the host against the CPU kernel of its step.
fn every_kernel_runs_on_the_host(plans: Vec<(String, Plan)>, what: &str) {
    if let Err(why) = cuda_host::available() {
        assert!(std::env::var("CI").is_err(), "CI runs the host CUDA tests: {why}");
        eprintln!("skipped: {why}");
        return;
    }
    let mut cases = Vec::new();
    let mut references = Vec::new();
    let (mut total, mut seen, mut too_big) = (0, HashSet::new(), Vec::new());
    for (model, plan) in &plans {
        for (s, (step, k)) in plan.steps.iter().zip(plan_kernels(plan).unwrap()).enumerate() {
            total += 1;
            let threads: usize = k
                .launches
                .iter()
                .map(|l| l.grid.iter().product::<u32>() as usize * l.block.iter().product::<u32>() as usize)
                .sum();
            if k.launches.is_empty() || !seen.insert(k.source.clone()) {
                continue;
            }
            if threads > MAX_THREADS {
                too_big.push(format!("{model} step {s} ({}, {threads} threads)", step.label));
                continue;
            }
            let shapes: Vec<&Shape> = step.inputs.iter().map(|&v| &plan.values[v].shape).collect();
            let inputs = operands(&step.op, &shapes, s as u64 + 1);
            let scalar = Shape::scalar();
            let out = step.output.map_or(&scalar, |o| &plan.values[o].shape);
            let types: Vec<(&Shape, DType)> = shapes.iter().map(|&s| (s, DType::F32)).collect();
            let kernel = cpu::prepare(&step.op, &types, (out, DType::F32)).unwrap();
            let before = inputs.clone();
            let mut after = inputs.clone();
            let mut o = vec![f32::NAN; if step.op.is_effect() { 0 } else { out.numel() }];
            let ptrs: Vec<*mut u8> = after.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
            let optr = if step.op.is_effect() { std::ptr::null_mut() } else { o.as_mut_ptr() as *mut u8 };
            // SAFETY: buffers sized from the step's shapes, distinct allocations; effects get a
            // null output.
            unsafe { kernel.run(&ptrs, optr) };
            let name = format!("{model} step {s} ({})", step.label);
            cases.push(cuda_host::HostCase {
                name: name.clone(),
                kernel: k,
                operands: inputs,
                output_len: o.len(),
                scratch_len: step.scratch.map_or(0, |b| plan.buffers[b].bytes / 4),
            });
            references.push((name, step.op.clone(), before, after, o));
        }
    }
    let ran = cases.len();
    let results = cuda_host::run(cases).unwrap_or_else(|e| panic!("{e}"));
    let mut failures = Vec::new();
    for (r, (name, op, before, after, out)) in results.iter().zip(&references) {
        let check = if op.is_effect() {
            cuda_host::check_effect(op, before, &r.operands, after)
        } else {
            cuda_host::close(&r.output, out, cuda_host::tolerance(op))
        };
        if let Err(e) = check {
            failures.push(format!("{name}: {e}"));
        }
    }
    eprintln!(
        "{total} {what} steps, {} distinct kernels: {ran} ran on the host, {} over {MAX_THREADS} threads left to a device",
        seen.len(),
        too_big.len()
    );
    assert!(failures.is_empty(), "{} kernels differ from the CPU:\n{}", failures.len(), failures.join("\n"));
    assert!(
        ran * 4 >= seen.len() * 3,
        "only {ran} of {} distinct {what} kernels ran on the host: {too_big:?}",
        seen.len()
    );
}
