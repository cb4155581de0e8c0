//! Graph-to-graph passes, as composable values (luminal's idea): a `Pipeline` is a list of passes
//! run in order, a pass followed by a cleanup where it changed the graph, and groups run to a
//! fixed point. Each pass says what it changed (`Changes`), and the pipeline records it
//! (`PassLog`), so that the plan's figures of the rewrites are set in one place.
//! `default_pipeline` is the cleanup every rewrite is followed by; `compile`'s rewrites before
//! the schedule search are `rewrites` (compiler/src/rewrites.rs).

pub(crate) mod cast_like;
mod cse;
mod dce;
mod effects;
mod outputs;
mod transfers;
mod verify;

pub use cast_like::ResolveCastLike;
pub use cse::CommonSubexpressions;
pub use dce::DeadCode;
pub use effects::OrderEffects;
pub use outputs::MaterializeOutputs;
pub use transfers::InsertTransfers;
pub use verify::Verify;

use crate::error::Result;
use crate::ir::Graph;
use crate::plan::RewriteFigures;

/// What one run of a pass did: how many rewrites it made (0: the graph is as it was) and the
/// figures the plan reports for them (the pass's own fields of `RewriteFigures`).
#[derive(Clone, Debug, Default)]
pub struct Changes {
    /// Rewrites made; 0 when the graph is unchanged.
    pub rewrites: usize,
    /// What the plan reports of them.
    pub figures: RewriteFigures,
}

impl Changes {
    /// `rewrites` rewrites with no figure of their own.
    pub fn count(rewrites: usize) -> Self {
        Changes { rewrites, figures: RewriteFigures::default() }
    }
}

/// One graph-to-graph rewrite (or check), run on the graph in place.
pub trait Pass {
    /// A short name for listings (`Pipeline::names`, `RewriteFigures::passes`).
    fn name(&self) -> &'static str;
    /// Rewrites or checks `graph` and says what it changed; an error stops the pipeline.
    fn run(&self, graph: &mut Graph) -> Result<Changes>;
}

/// One step of a pipeline.
enum Step {
    /// A pass, run once.
    Pass(Box<dyn Pass>),
    /// A pass, then the cleanup pipeline whenever the pass changed the graph (a rewrite leaves
    /// dead nodes and duplicates behind, and new outputs or effects to order).
    Cleaned(Box<dyn Pass>, Pipeline),
    /// A pipeline run again while a round changes the graph, at most this many rounds: one
    /// rewrite can make room for another (a transpose read in place leaves a constant to fold).
    FixedPoint(Pipeline, usize),
}

/// Passes run in order, each on the graph the one before left; what each changed is recorded
/// by the pipeline (`PassLog`), not by its caller.
#[derive(Default)]
pub struct Pipeline {
    steps: Vec<Step>,
}

/// What a pipeline's passes changed: the plan's figures of them, with every pass that changed
/// the graph listed (`RewriteFigures::passes`).
#[derive(Clone, Debug, Default)]
pub struct PassLog {
    /// Rewrites made by every pass, cleanups included.
    pub rewrites: usize,
    /// The figures, merged over the passes.
    pub figures: RewriteFigures,
}

impl PassLog {
    fn record(&mut self, name: &'static str, changes: Changes) {
        if changes.rewrites > 0 {
            self.rewrites += changes.rewrites;
            self.figures.passes.push((name.to_string(), changes.rewrites));
        }
        self.figures.merge(&changes.figures);
    }

    fn absorb(&mut self, other: PassLog) {
        self.rewrites += other.rewrites;
        self.figures.merge(&other.figures);
    }
}

impl Pipeline {
    /// A pipeline with no passes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `pass`: it runs after those added before it.
    pub fn with(mut self, pass: impl Pass + 'static) -> Self {
        self.steps.push(Step::Pass(Box::new(pass)));
        self
    }

    /// Appends `other`'s passes: they run after those added before.
    pub fn then(mut self, other: Pipeline) -> Self {
        self.steps.extend(other.steps);
        self
    }

    /// Appends `pass` followed, whenever it changed the graph, by `cleanup`.
    pub fn cleaned(mut self, pass: impl Pass + 'static, cleanup: Pipeline) -> Self {
        self.steps.push(Step::Cleaned(Box::new(pass), cleanup));
        self
    }

    /// Appends `group`, run again while a round of it changes the graph (at most `rounds`
    /// rounds; a group that still changes the graph then is left as it is, which is sound:
    /// every round leaves a valid graph).
    pub fn fixed_point(mut self, group: Pipeline, rounds: usize) -> Self {
        self.steps.push(Step::FixedPoint(group, rounds.max(1)));
        self
    }

    /// Appends `pass` when `on`.
    pub fn with_if(self, on: bool, pass: impl Pass + 'static) -> Self {
        if on { self.with(pass) } else { self }
    }

    /// Appends `pass` with its cleanup when `on`.
    pub fn cleaned_if(self, on: bool, pass: impl Pass + 'static, cleanup: Pipeline) -> Self {
        if on { self.cleaned(pass, cleanup) } else { self }
    }

    /// The passes' names, in the order they run (a group's once, a cleanup's after its pass).
    pub fn names(&self) -> Vec<&'static str> {
        self.steps
            .iter()
            .flat_map(|s| match s {
                Step::Pass(p) => vec![p.name()],
                Step::Cleaned(p, c) => std::iter::once(p.name()).chain(c.names()).collect(),
                Step::FixedPoint(g, _) => g.names(),
            })
            .collect()
    }

    /// Runs every pass on `graph` in order, stopping at the first error, and returns what they
    /// changed.
    pub fn run(&self, graph: &mut Graph) -> Result<PassLog> {
        let mut log = PassLog::default();
        for step in &self.steps {
            match step {
                Step::Pass(p) => log.record(p.name(), p.run(graph)?),
                Step::Cleaned(p, cleanup) => {
                    let changes = p.run(graph)?;
                    let changed = changes.rewrites > 0;
                    log.record(p.name(), changes);
                    if changed {
                        log.absorb(cleanup.run(graph)?);
                    }
                }
                Step::FixedPoint(group, rounds) => {
                    for _ in 0..*rounds {
                        let round = group.run(graph)?;
                        let changed = round.rewrites > 0;
                        log.absorb(round);
                        if !changed {
                            break;
                        }
                    }
                }
            }
        }
        Ok(log)
    }
}

/// verify, CSE, dead-code elimination, cross-device copies, output copies, effect ordering,
/// verify again.
pub fn default_pipeline() -> Pipeline {
    Pipeline::new()
        .with(Verify)
        .with(ResolveCastLike)
        .with(CommonSubexpressions)
        .with(DeadCode)
        .with(InsertTransfers)
        .with(MaterializeOutputs)
        .with(OrderEffects)
        .with(Verify)
}
