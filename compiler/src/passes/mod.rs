//! Graph-to-graph passes, as composable values (luminal's idea): a `Pipeline` is a list of passes
//! run in order. `default_pipeline` is what `compile` runs before scheduling.

mod cse;
mod dce;
mod effects;
mod outputs;
mod transfers;
mod verify;

pub use cse::CommonSubexpressions;
pub use dce::DeadCode;
pub use effects::OrderEffects;
pub use outputs::MaterializeOutputs;
pub use transfers::InsertTransfers;
pub use verify::Verify;

use crate::error::Result;
use crate::ir::Graph;

/// One graph-to-graph rewrite (or check), run on the graph in place.
pub trait Pass {
    /// A short name for listings (`Pipeline::names`).
    fn name(&self) -> &'static str;
    /// Rewrites or checks `graph`; an error stops the pipeline.
    fn run(&self, graph: &mut Graph) -> Result<()>;
}

/// Passes run in order, each on the graph the one before left.
#[derive(Default)]
pub struct Pipeline {
    passes: Vec<Box<dyn Pass>>,
}

impl Pipeline {
    /// A pipeline with no passes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `pass`: it runs after those added before it.
    pub fn with(mut self, pass: impl Pass + 'static) -> Self {
        self.passes.push(Box::new(pass));
        self
    }

    /// The passes' names, in the order they run.
    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Runs every pass on `graph` in order, stopping at the first error.
    pub fn run(&self, graph: &mut Graph) -> Result<()> {
        self.passes.iter().try_for_each(|p| p.run(graph))
    }
}

/// verify, CSE, dead-code elimination, cross-device copies, output copies, effect ordering,
/// verify again.
pub fn default_pipeline() -> Pipeline {
    Pipeline::new()
        .with(Verify)
        .with(CommonSubexpressions)
        .with(DeadCode)
        .with(InsertTransfers)
        .with(MaterializeOutputs)
        .with(OrderEffects)
        .with(Verify)
}
