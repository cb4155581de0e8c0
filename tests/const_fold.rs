//! Constant folding (`kiln_compiler::const_fold`): a mask built from fills and layout ops is a
//! constant of the plan, computed at compile time; plans with it compute the unfolded plans'
//! bits; the constant is counted, shared by key, written by the backends at load and never
//! checkpointed.

use kiln::compiler::Plan;
use kiln::compiler::ir::{Graph, Op, VarRole};
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend, HostTensor};

/// Attention-like scores [2, 8, 8] masked causally with a mask built the long way (as a user
/// without `causal_mask` wrote it): ones padded, sliced into a strictly-upper pattern, scaled by
/// -1e9, broadcast over the batch.
fn masked_softmax() -> Graph {
    let t = Tracer::new("masked");
    let x = t.input("x", [2, 8, 8]);
    let rows: Vec<Tensor> = (0..8).map(|i| t.fill(1.0, [1, 7 - i]).pad(1, i + 1, 0)).collect();
    let refs: Vec<&Tensor> = rows[1..].iter().collect();
    let upper = rows[0].concat(&refs, 0); // [8, 8]: 1.0 above the diagonal
    let mask = (&upper * -1e9).reshape([1, 8, 8]).broadcast_to([2, 8, 8]);
    let y = (&x + &mask).softmax(-1);
    t.output("y", &y);
    t.finish().unwrap()
}

fn run(plan: &Plan, x: &HostTensor) -> Vec<u32> {
    let mut b = CpuBackend::new(2);
    let id = b.load(plan.clone()).unwrap();
    let out = b.call(id, &[("x", x)]).unwrap();
    out[0].1.data().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn a_mask_built_from_fills_and_layouts_is_a_constant_of_the_plan() {
    let graph = masked_softmax();
    let x = HostTensor::from_fn([2, 8, 8], |i| (i as f32 * 0.37).sin()).unwrap();
    for fuse in [true, false] {
        let options = CompileOptions::default().with_fusion(fuse);
        let folded = compile(graph.clone(), &options).unwrap();
        let plain = compile(graph.clone(), &options.clone().with_constant_folding(false)).unwrap();
        assert_eq!(folded.memory.rewrites.folded_constants, 1, "fuse {fuse}: {}", folded.render());
        assert!(
            folded.memory.rewrites.folded_ops >= 16,
            "8 fills, 8 pads, the concat: {}",
            folded.memory.rewrites.folded_ops
        );
        let layout =
            |p: &Plan| p.steps.iter().filter(|s| matches!(s.op, Op::Pad { .. } | Op::Concat { .. })).count();
        assert_eq!(layout(&folded), 0, "no pad or concat runs");
        // Unfolded, the 8 pads run (their concatenation is written in place by them).
        assert!(layout(&plain) >= 8);
        assert!(folded.steps.len() < plain.steps.len());
        let constants: Vec<_> = folded.variables.iter().filter(|v| v.role == VarRole::Constant).collect();
        assert_eq!(constants.len(), 1);
        assert_eq!(
            folded.constants[&constants[0].key].len(),
            64,
            "the [8, 8] mask, scaled, before its broadcast"
        );
        assert_eq!(folded.memory.constant_bytes, 64 * 4);
        assert_eq!(
            folded.memory.persistent_bytes,
            folded.memory.parameter_bytes
                + folded.memory.optimizer_state_bytes
                + 256
                + folded.memory.io_bytes
        );
        assert!(folded.memory.arena_bytes <= plain.memory.arena_bytes);
        assert_eq!(run(&folded, &x), run(&plain, &x), "fuse {fuse}: folded and unfolded bits");
    }
}

#[test]
fn equal_constants_share_a_key_and_a_plan_without_its_values_is_refused() {
    let a = compile(masked_softmax(), &CompileOptions::default()).unwrap();
    let b = compile(masked_softmax(), &CompileOptions::default()).unwrap();
    let key = |p: &Plan| p.variables.iter().find(|v| v.role == VarRole::Constant).unwrap().key.clone();
    assert_eq!(key(&a), key(&b), "the key is the content's hash");
    assert!(key(&a).starts_with("constant/"));
    // Two plans with the constant on one backend: the second finds it in place.
    let mut backend = CpuBackend::new(2);
    let x = HostTensor::from_fn([2, 8, 8], |i| i as f32).unwrap();
    let (ia, ib) = (backend.load(a.clone()).unwrap(), backend.load(b).unwrap());
    let (ya, yb) = (backend.call(ia, &[("x", &x)]).unwrap(), backend.call(ib, &[("x", &x)]).unwrap());
    assert_eq!(ya[0].1.data(), yb[0].1.data());
    assert_eq!(backend.read_variable(&key(&a)).unwrap().data(), &a.constants[&key(&a)][..]);
    let mut broken = a.clone();
    broken.constants.clear();
    let err = CpuBackend::new(1).load(broken).unwrap_err().to_string();
    assert!(err.contains("has no values"), "{err}");
}
