//! Every zoo model traces, differentiates and plans, for inference and for a training step.

use kiln::compiler::ir::Op;
use kiln::compiler::plan::Storage;
use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::zoo;

#[test]
fn every_zoo_model_compiles_for_forward_and_training() {
    for m in zoo::all() {
        let model = m.model();
        let fwd = forward_graph(&model, m.x_shape()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let fwd = compile(fwd, &CompileOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let train = train_step_graph(&model, m.x_shape(), m.y_shape(), &m.config())
            .unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let train = compile(train, &CompileOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        for plan in [&fwd, &train] {
            let mem = &plan.memory;
            assert!(
                mem.lower_bound_bytes <= mem.arena_bytes && mem.arena_bytes <= mem.naive_bytes,
                "{}",
                m.name
            );
        }
        // Training updates every parameter: every row of every parameter exactly once, by one
        // apply_adam or by the blocks of a tiled one.
        let mut rows = vec![0usize; train.variables.len()];
        for s in train.steps.iter().filter(|s| s.op.name() == "apply_adam") {
            let Storage::Variable { index } = train.buffers[train.values[s.inputs[0]].buffer].storage else {
                panic!("{}: an update of a value that is not a variable", m.name)
            };
            let whole = train.variables[index].shape.dims().first().copied().unwrap_or(1);
            rows[index] += match s.op {
                Op::ApplyAdam { rows: Some(r), .. } => r.len,
                _ => whole.max(1),
            };
        }
        let mut params = 0;
        for (v, n) in train.variables.iter().zip(&rows) {
            if v.role == kiln::compiler::ir::VarRole::Parameter {
                params += 1;
                assert_eq!(*n, v.shape.dims().first().copied().unwrap_or(1).max(1), "{}: {}", m.name, v.key);
            }
        }
        eprintln!(
            "{:12} forward {:3} steps, train {:4} steps, {} parameters",
            m.name,
            fwd.steps.len(),
            train.steps.len(),
            params
        );
    }
}
