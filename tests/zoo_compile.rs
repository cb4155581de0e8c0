//! Every zoo model traces, differentiates and plans, for inference and for a training step.

use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::zoo;

#[test]
fn every_zoo_model_compiles_for_forward_and_training() {
    for m in zoo::all() {
        let model = m.model();
        let fwd = forward_graph(&model, &m.x_shape()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let fwd = compile(fwd, &CompileOptions::default()).unwrap_or_else(|e| panic!("{}: {e}", m.name));
        let train = train_step_graph(&model, &m.x_shape(), &m.y_shape(), &m.config())
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
        // Training updates every parameter: one apply_adam per parameter, one counter increment.
        let params =
            train.variables.iter().filter(|v| v.role == kiln::compiler::ir::VarRole::Parameter).count();
        let updates = train.steps.iter().filter(|s| s.op.name() == "apply_adam").count();
        assert_eq!(params, updates, "{}", m.name);
        eprintln!(
            "{:12} forward {:3} steps, train {:4} steps, {} parameters",
            m.name,
            fwd.steps.len(),
            train.steps.len(),
            params
        );
    }
}
