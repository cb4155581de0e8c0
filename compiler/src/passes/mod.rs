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

pub trait Pass {
    fn name(&self) -> &'static str;
    fn run(&self, graph: &mut Graph) -> Result<()>;
}

#[derive(Default)]
pub struct Pipeline {
    passes: Vec<Box<dyn Pass>>,
}

impl Pipeline {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn with(mut self, pass: impl Pass + 'static) -> Self {
        self.passes.push(Box::new(pass));
        self
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

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
