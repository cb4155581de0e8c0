//! Rematerialization: a training step over its memory limit recomputes forward values instead of
//! keeping them, fits, and computes bit-identical losses and variables.

use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::zoo;

fn train(plan: &Plan, x: &HostTensor, y: &HostTensor) -> (Vec<u32>, Vec<HostTensor>) {
    let mut backend = CpuBackend::new(3);
    let id = backend.load(plan.clone()).unwrap();
    let mut losses = Vec::new();
    for _ in 0..2 {
        let out = backend.call(id, &[("x", x), ("y", y)]).unwrap();
        losses.push(out.iter().find(|(n, _)| n == "loss").unwrap().1.item().unwrap().to_bits());
    }
    (losses, plan.variables.iter().map(|v| backend.read_variable(&v.key).unwrap()).collect())
}

#[test]
fn a_step_over_its_limit_recomputes_and_computes_the_same() {
    for (name, batch) in [("cnn", 8), ("transformer", 2)] {
        let m = zoo::by_name(name).unwrap().with_batch(batch);
        let graph = train_step_graph(&m.model(), &m.x_shape(), &m.y_shape(), &m.config()).unwrap();
        let free = compile(graph.clone(), &CompileOptions::default()).unwrap();
        assert!(free.memory.remat.is_none());
        let limit = free.memory.persistent_bytes + free.memory.arena_bytes * 3 / 4;
        let limited = compile(graph.clone(), &CompileOptions::device("device 0", Some(limit)))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(limited.memory.planned_total_bytes() <= limit, "{name}");
        let r = limited.memory.remat.as_ref().expect("remat figures");
        assert!(!r.recomputed.is_empty() && r.recomputed_flops > 0 && r.bytes_after < r.bytes_before);
        let (x, y) = m.batch_data(1).unwrap();
        assert_eq!(train(&free, &x, &y), train(&limited, &x, &y), "{name}: remat changed a result");

        // Below the persistent bytes nothing can fit: the report says what remat could do.
        let e = compile(graph, &CompileOptions::device("device 0", Some(free.memory.persistent_bytes / 2)))
            .unwrap_err()
            .to_string();
        assert!(e.contains("out of memory") && e.contains("rematerialization"), "{e}");
    }
}
