//! The graphs one model is planned as: what `search` chooses among, in one branch and bound.
//!
//! A graph reaches the planner in several forms, each smaller on some models and larger on
//! others, so none is chosen by rule: lowered with the products that would wait for a value
//! apart and fused (`lower`: GPT-2 small's tied head plans 95 MB smaller fused, the small tied
//! head of tests/transpose_operands.rs 33 KB smaller apart); a training step's updates as they
//! are, tiled, computing their own gradient products, or both (`updates`: which wins depends on
//! the layer's widths); a forward pass whole and in each count of batch-row blocks
//! (`batch_blocks`). Each is a `Variant` with the marks its plans' schedule names carry
//! ("+tiled", "+waiting", "+blocks2"), so that a schedule asked for by name
//! (`CompileOptions::schedule`) plans the graph it names (`Variants::named`).
//!
//! Building a variant is cheap beside planning it (a fold or a tiling is one pass over the
//! graph); `search` then plans them as one list, every order of every variant ranked by its
//! arena's lower bound, and places only what can beat the best plan so far.

use crate::error::Result;
use crate::ir;
use crate::passes::PassLog;
use crate::plan::RewriteFigures;
use crate::{CompileOptions, SEARCH_PLACES_ALL_BELOW, fusion, product_updates, rewrites, tiled_updates};

/// The schedule mark of a graph whose products that would wait for a value are fused
/// (`fusion::Products::Waiting`).
pub const WAITING: &str = "+waiting";

/// A graph after the rewrites every planned graph takes (`rewrites::before_fusion`, then
/// `rewrites::fusion`), with their figures.
#[derive(Clone)]
pub struct Lowered {
    /// The fused graph.
    pub graph: ir::Graph,
    /// The graph before fusion, kept where a memory limit may ask for recomputation.
    pub unfused: Option<ir::Graph>,
    /// What the rewrites before fusion did.
    pub before_fusion: PassLog,
    /// What fusion did.
    pub fusion: PassLog,
    /// What its plans' schedule names end with: `WAITING` for a graph fused with
    /// `fusion::Products::Waiting`, else nothing.
    pub mark: &'static str,
}

impl Lowered {
    /// The figures of its rewrites, those before fusion first.
    pub fn figures(&self) -> RewriteFigures {
        let mut figures = self.before_fusion.figures.clone();
        figures.merge(&self.fusion.figures);
        figures
    }
}

/// `graph` lowered for planning (with `refuse`, its unfused graph kept): fused with
/// `fusion::Products::All`, and where that kept products apart that would wait for a value,
/// fused again from the same graph with `fusion::Products::Waiting` (marked `WAITING`).
pub fn lower(
    mut graph: ir::Graph,
    options: &CompileOptions,
    refuse: bool,
) -> Result<(Lowered, Option<Lowered>)> {
    let before_fusion = rewrites::before_fusion(options).run(&mut graph)?;
    // Kept for recomputation, which only a memory limit asks for.
    let unfused = (refuse && options.devices.iter().any(|d| d.memory_limit.is_some())).then(|| graph.clone());
    let mut apart = graph.clone();
    let fusion = rewrites::fusion(options, fusion::Products::All).run(&mut apart)?;
    let fused = if fusion.figures.waiting_products > 0 {
        let fusion = rewrites::fusion(options, fusion::Products::Waiting).run(&mut graph)?;
        let before_fusion = before_fusion.clone();
        Some(Lowered { graph, unfused: unfused.clone(), before_fusion, fusion, mark: WAITING })
    } else {
        None
    };
    Ok((Lowered { graph: apart, unfused, before_fusion, fusion, mark: "" }, fused))
}

/// One graph the search may plan.
pub struct Variant {
    /// The graph, ready to schedule.
    pub graph: ir::Graph,
    /// What its plans' schedule names add to their order's name: "+tiled", "+product",
    /// "+waiting", "+blocks2", in that order.
    pub mark: String,
    /// Optimizer updates it runs in blocks of rows (`tiled_updates`).
    pub tiled_updates: usize,
    /// Optimizer updates that compute their own gradient product (`product_updates`).
    pub product_updates: usize,
    /// The blocks of batch rows its forward pass runs in (`batch_blocks`), 0 where whole.
    pub batch_blocks: usize,
    /// The `Variants::lowered` it was made from.
    pub source: usize,
}

/// The variants of one model, with the lowered graphs they were made from.
#[derive(Default)]
pub struct Variants {
    /// The lowered graphs: their figures, and for recomputation their unfused graphs.
    pub lowered: Vec<Lowered>,
    /// Every variant, in the order that wins ties: the whole graph before its blocks, products
    /// apart before waiting ones fused, updates as they are before rewritten ones.
    pub list: Vec<Variant>,
}

impl Variants {
    /// `graph` lowered both ways (`lower`), each with its update variants, marked as a forward
    /// pass in `blocks` blocks of batch rows (0: whole).
    pub fn of_graph(
        graph: ir::Graph,
        options: &CompileOptions,
        refuse: bool,
        blocks: usize,
    ) -> Result<Variants> {
        let (apart, waiting) = lower(graph, options, refuse)?;
        let mut all = Variants::default();
        for lowered in std::iter::once(apart).chain(waiting) {
            all.push(lowered, options, blocks)?;
        }
        Ok(all)
    }

    /// Adds `lowered` with its update variants (`updates`).
    pub fn push(&mut self, lowered: Lowered, options: &CompileOptions, blocks: usize) -> Result<()> {
        let source = self.lowered.len();
        let suffix = if blocks > 0 { format!("+blocks{blocks}") } else { String::new() };
        for (updates, graph, tiled_updates, product_updates) in updates(&lowered.graph, options)? {
            self.list.push(Variant {
                graph,
                mark: format!("{updates}{}{suffix}", lowered.mark),
                tiled_updates,
                product_updates,
                batch_blocks: blocks,
                source,
            });
        }
        self.lowered.push(lowered);
        Ok(())
    }

    /// Appends `other`'s lowered graphs and variants.
    pub fn extend(&mut self, other: Variants) {
        let base = self.lowered.len();
        self.lowered.extend(other.lowered);
        self.list.extend(other.list.into_iter().map(|v| Variant { source: v.source + base, ..v }));
    }

    /// The variants a schedule asked for by name can be (`CompileOptions::schedule`): those
    /// whose marks are all in the name, the most marks first; every one where no name is
    /// asked for. A name made from another graph (its mark absent here) falls back to the
    /// variant with most of its marks, the graph as it is at worst.
    pub fn named(&self, wanted: Option<&str>) -> Vec<usize> {
        let Some(wanted) = wanted else { return (0..self.list.len()).collect() };
        let asked: Vec<&str> = wanted.split('+').skip(1).collect();
        let marks = |v: &Variant| -> Option<usize> {
            let own: Vec<&str> = v.mark.split('+').skip(1).collect();
            own.iter().all(|m| asked.contains(m)).then_some(own.len())
        };
        let most = self.list.iter().filter_map(marks).max();
        (0..self.list.len()).filter(|&i| most.is_some() && marks(&self.list[i]) == most).take(1).collect()
    }
}

/// The ways a training step's updates can take their gradients, each with its mark, graph and
/// counts of tiled and product updates: the graph as it is, with its weight-gradient updates
/// tiled (`tiled_updates`: a block of rows at a time) and, with fusion on, with updates that
/// compute their own gradient products (`product_updates`: never stored), all of them or
/// those that pay (`Selection::Paying`), the rest tiled or not. Which wins depends on the
/// model: a product update keeps its factors (an activation, a delta) until every reader of
/// the old weight has run, which can cost more than the gradient on a narrow layer. Above
/// `SEARCH_PLACES_ALL_BELOW` nodes only one graph: with the product updates that pay when
/// fusion is on, else as it is.
fn updates(
    graph: &ir::Graph,
    options: &CompileOptions,
) -> Result<Vec<(&'static str, ir::Graph, usize, usize)>> {
    let folded = |graph: &ir::Graph, selection| -> Result<Option<(ir::Graph, usize)>> {
        if !options.fuse {
            return Ok(None);
        }
        let mut g = graph.clone();
        let n = product_updates::fold(&mut g, selection, options.half_kernels)?;
        Ok((n > 0).then_some((g, n)))
    };
    if graph.len() >= SEARCH_PLACES_ALL_BELOW {
        return Ok(vec![match folded(graph, product_updates::Selection::Paying)? {
            Some((g, n)) => ("", g, 0, n),
            None => ("", graph.clone(), 0, 0),
        }]);
    }
    // A schedule asked for by name (each of `cheap_remat`'s tries) builds the graph it names
    // alone, or the graph as it is where that cannot be built.
    if let Some(wanted) = options.schedule.as_deref() {
        let marks: Vec<&str> = wanted.split('+').skip(1).collect();
        let tiled = |g: &ir::Graph| -> Result<Option<tiled_updates::Tiled>> {
            if options.tile_updates { tiled_updates::tile(g, options.alignment) } else { Ok(None) }
        };
        let named = if marks.contains(&"some-product") {
            folded(graph, product_updates::Selection::Paying)?.map(|(g, n)| ("+some-product", g, 0, n))
        } else if marks.contains(&"product") && marks.contains(&"tiled") {
            match folded(graph, product_updates::Selection::Paying)? {
                Some((g, n)) => tiled(&g)?.map(|t| ("+product+tiled", t.graph, t.updates, n)),
                None => None,
            }
        } else if marks.contains(&"product") {
            folded(graph, product_updates::Selection::All)?.map(|(g, n)| ("+product", g, 0, n))
        } else if marks.contains(&"tiled") {
            tiled(graph)?.map(|t| ("+tiled", t.graph, t.updates, 0))
        } else {
            None
        };
        return Ok(vec![named.unwrap_or_else(|| ("", graph.clone(), 0, 0))]);
    }
    let mut graphs = vec![("", graph.clone(), 0, 0)];
    if options.tile_updates
        && let Some(t) = tiled_updates::tile(graph, options.alignment)?
    {
        graphs.push(("+tiled", t.graph, t.updates, 0));
    }
    let all = folded(graph, product_updates::Selection::All)?;
    let paying = folded(graph, product_updates::Selection::Paying)?;
    if let Some((g, n)) = paying
        && all.as_ref().is_some_and(|(_, every)| *every > n)
    {
        // The updates left, tiled where that is allowed, and as they are: tiling is not always
        // smaller (an unseen 37-53-7-1 MLP at batch 13 planned 8,128 B with its last updates
        // tiled against 6,848 B without, when only the tiled graph was tried).
        // As they are first, so that a tie keeps the untiled graph.
        let tiled = if options.tile_updates { tiled_updates::tile(&g, options.alignment)? } else { None };
        graphs.push(("+some-product", g, 0, n));
        if let Some(t) = tiled {
            graphs.push(("+product+tiled", t.graph, t.updates, n));
        }
    }
    if let Some((g, n)) = all {
        graphs.push(("+product", g, 0, n));
    }
    Ok(graphs)
}
