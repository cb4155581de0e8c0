//! Variable initialisers, as Keras computes them. Each variable draws from its own generator,
//! seeded by the backend's seed and the variable's key, so values do not depend on the order in
//! which variables are first seen.

use kiln_compiler::ir::{Init, Shape};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use rand_distr::{Distribution, Normal};

/// `shape.numel()` values of `init` for variable `key`, row-major, drawn from a generator seeded
/// by `seed` and a hash of `key` (the same seed and key always give the same values).
pub fn initial_values(init: Init, shape: &Shape, seed: u64, key: &str) -> Vec<f32> {
    let n = shape.numel();
    let mut rng = StdRng::seed_from_u64(seed ^ fnv1a(key));
    match init {
        Init::Zeros => vec![0.0; n],
        Init::Constant(c) => vec![c; n],
        Init::GlorotUniform => {
            let (fan_in, fan_out) = Init::fans(shape);
            let limit = (6.0 / fan_in.saturating_add(fan_out).max(1) as f32).sqrt();
            (0..n).map(|_| rng.random_range(-limit..limit)).collect()
        }
        // `Init::check` (run when the variable is traced) keeps the range non-empty and finite;
        // a plan built another way gets `low` rather than a panic.
        Init::Uniform { low, high } if init.check().is_ok() => {
            (0..n).map(|_| rng.random_range(low..high)).collect()
        }
        Init::Uniform { low, .. } => vec![low; n],
        Init::Normal { mean, std } => match Normal::new(mean, std) {
            Ok(d) => (0..n).map(|_| d.sample(&mut rng)).collect(),
            Err(_) => vec![mean; n],
        },
    }
}

/// A stable 64-bit hash of a key (FNV-1a), independent of the std hasher's per-process seed.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// The values a backend writes into a plan's new variable: a constant's from the plan
/// (`Plan::constants`, which `validate` checks), any other's from its initialiser.
pub fn variable_values(
    plan: &kiln_compiler::Plan,
    spec: &kiln_compiler::plan::VariableSpec,
    seed: u64,
) -> Vec<f32> {
    match plan.constants.get(&spec.key) {
        Some(data) if spec.role == kiln_compiler::ir::VarRole::Constant => data.clone(),
        _ => initial_values(spec.init, &spec.shape, seed, &spec.key),
    }
}

/// As `variable_values`, for a variable node of `graph`: a constant's values from the graph
/// (`Graph::constant`), any other's from its initialiser.
pub fn node_values(
    graph: &kiln_compiler::ir::Graph,
    key: &str,
    init: Init,
    shape: &Shape,
    seed: u64,
) -> Vec<f32> {
    match graph.constant(key) {
        Some(data) => data.to_vec(),
        None => initial_values(init, shape, seed, key),
    }
}
