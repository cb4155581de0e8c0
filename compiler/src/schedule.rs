//! Execution orders. Every order is a topological order of data and control edges; they differ in
//! which ready op runs next, and so in what is live at once. `compile` plans several and keeps
//! the one with the smallest plan (XLA's "choose best" scheduler idea); the eager baseline runs
//! program order, as eager frameworks do.
//!
//! - `program`: among the ready ops, the earliest traced: plans read like the model's source.
//! - `memory`: a list scheduler that runs the ready op that frees the most bytes net of what it
//!   allocates (ties in program order). An optimizer update frees its gradient and allocates
//!   nothing, so it runs as soon as its gradient is final and the old value's readers have run.
//! - `depth-first` and `depth-first-reversed`: post-order walks from the graph's sinks (outputs,
//!   updates), operands first or last first: each value is consumed soon after it is made.
//! - `depth-first-hoisted` and `depth-first-reversed-hoisted`: the walks with views next to
//!   their operands and each op that frees more than it allocates run as early as it frees it
//!   (`hoisted`), where that moves any: a walk reaches a sink (the loss) or a gradient summed
//!   at the end (a tied table's) only in its turn, which kept GPT-2 small's logits-sized values
//!   alive through the backward pass (planned total 2,355 -> 2,253 MB at 4 x 256 tokens); and
//!   the small readers of a value an op may overwrite run before that op (`writers_last`: the
//!   loss before its gradient, which then overwrites the logits' difference, 2,253 -> 2,202 MB).
//! - `depth-first-hoisted-late` and `depth-first-reversed-hoisted-late`: the hoisted walks with
//!   each op that allocates at least what it would keep alive run right before its first reader
//!   (`allocating_late`): values a cheap chain recomputes for a late reader are no longer made
//!   a whole layer's backward pass early (GPT-2 small's bf16 step at 4 x 256 tokens: 2,148 ->
//!   2,079 MB planned).
//! - `row-blocks`, for a graph computed in blocks of batch rows (`batch_blocks::split`, a
//!   training step from `step::train_step_graph_in_blocks`): program order among the ready ops
//!   of the lowest block, a node's block being the latest block of rows it reads (an axis-0
//!   slice's rank among the slices' starts): each block's forward and backward run before the
//!   next block's start, so that only one block's activations are live (what gradient
//!   accumulation over micro-batches does by hand). Tried only where such slices exist, and so
//!   is `row-blocks-memory`: the `memory` list scheduler among the ready ops of the lowest
//!   block (what a block computes only for its outputs, such as the loss value beside its
//!   gradient, runs when it frees the block's logits, not at the end of the step in program
//!   order: the GPT example's model, sparse loss, in 4 blocks: arena 5,530,176 -> 5,067,840 B).
//!
//! - `+overlap` (where the graph has all-reduces or reduce-scatters): each of the above with the
//!   steps that read a collective's result (a bucket's updates) deferred past the next
//!   collective (`overlapped`), so that the runtime runs each collective beside the next
//!   bucket's backward pass; tried first, so kept wherever it plans no larger.
//!
//! Each runs in O((nodes + edges) log nodes).

use crate::error::{CompileError, Result};
use crate::ir::{Graph, NodeId, Op, OpClass};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// A named order.
pub struct Candidate {
    /// The order's name (`program`, `memory`, ...), reported in `MemoryFigures::schedule`.
    pub name: &'static str,
    /// Every node of the graph, each after its operands and control predecessors.
    pub order: Vec<NodeId>,
}

/// The graph's edges as dense tables indexed by node index: built once, read by every order.
struct Tables {
    nodes: Vec<NodeId>,
    /// Predecessors (operands and control) and successors of each node index.
    preds: Vec<Vec<u32>>,
    succs: Vec<Vec<u32>>,
    /// Operands in order (data edges only).
    operands: Vec<Vec<u32>>,
    present: Vec<bool>,
}

impl Tables {
    fn new(graph: &Graph) -> Self {
        let bound = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
        let mut t = Tables {
            nodes: graph.node_ids().collect(),
            preds: vec![Vec::new(); bound],
            succs: vec![Vec::new(); bound],
            operands: vec![Vec::new(); bound],
            present: vec![false; bound],
        };
        for n in graph.node_ids() {
            let i = n.index();
            t.present[i] = true;
            t.preds[i] = graph.predecessors(n).map(|p| p.index() as u32).collect();
            t.succs[i] = graph.successors(n).map(|p| p.index() as u32).collect();
            t.operands[i] = graph.operands(n).into_iter().map(|p| p.index() as u32).collect();
        }
        t
    }

    fn pending(&self) -> Vec<usize> {
        self.preds.iter().map(Vec::len).collect()
    }

    fn id(i: u32) -> NodeId {
        NodeId::new(i as usize)
    }
}

/// Program order: the order eager execution and the default plans use.
pub fn schedule(graph: &Graph) -> Result<Vec<NodeId>> {
    program(graph, &Tables::new(graph))
}

fn program(graph: &Graph, t: &Tables) -> Result<Vec<NodeId>> {
    let mut pending = t.pending();
    let mut ready: BinaryHeap<Reverse<u32>> =
        t.nodes.iter().filter(|n| pending[n.index()] == 0).map(|n| Reverse(n.index() as u32)).collect();
    let mut order = Vec::with_capacity(t.nodes.len());
    while let Some(Reverse(n)) = ready.pop() {
        order.push(Tables::id(n));
        for &s in &t.succs[n as usize] {
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    complete(graph, order)
}

/// Every order `compile` tries, program order first (computed on two threads).
pub fn candidates(graph: &Graph) -> Result<Vec<Candidate>> {
    candidates_for(graph, None)
}

/// `candidates`, computing only the orders a plan's schedule name `wanted` can name
/// (`named` picks among them): a search that plans one order (`CompileOptions::schedule`, each
/// of `cheap_remat`'s tries and `remat`'s rounds) does not make the others.
pub fn candidates_for(graph: &Graph, wanted: Option<&str>) -> Result<Vec<Candidate>> {
    let want = |name: &str| wanted.is_none_or(|w| w.starts_with(name));
    let t = Tables::new(graph);
    let walk = |reversed: bool| {
        let name = if reversed { "depth-first-reversed" } else { "depth-first" };
        // "depth-first" is a prefix of the reversed walks' names: a reversed name wants only them.
        let only_reversed = !reversed && wanted.is_some_and(|w| w.starts_with("depth-first-reversed"));
        (want(name) && !only_reversed).then(|| depth_first(graph, &t, reversed)).transpose()
    };
    let memory = want("memory") || want("row-blocks-memory");
    // On rayon's pool, whose threads outlive the call: a search runs this once per plan it
    // makes, and starting a thread each time cost more than the walks on the zoo's graphs.
    let ((p, m), (d, r)) = rayon::join(
        || (program(graph, &t), memory.then(|| memory_greedy(graph, &t, None)).transpose()),
        || (walk(false), walk(true)),
    );
    let p = p?;
    let blocks = if want("row-blocks") { row_blocks_of(graph, &t, &p) } else { None };
    let mut all = vec![Candidate { name: "program", order: p }];
    if let Some(m) = m? {
        all.push(Candidate { name: "memory", order: m });
    }
    let mut walks = Vec::new();
    if let Some(d) = d? {
        walks.push(("depth-first-hoisted", "depth-first-hoisted-late", all.len()));
        all.push(Candidate { name: "depth-first", order: d });
    }
    if let Some(r) = r? {
        walks.push(("depth-first-reversed-hoisted", "depth-first-reversed-hoisted-late", all.len()));
        all.push(Candidate { name: "depth-first-reversed", order: r });
    }
    let life = if walks.is_empty() { None } else { Some(Lifetimes::new(graph, &t)) };
    // The walks with their freeing ops run early, where that moves any: a candidate beside
    // them, not in their place, since a step that frees sooner can cost a recomputation or an
    // in-place write elsewhere (the zoo transformer's cheap recomputation at 1% of its FLOPs
    // plans 10.4 MB from the walk as it is, 14.6 MB from it hoisted).
    // Each also with its allocating ops run late (`allocating_late`), a candidate of its own:
    // it plans GPT-2 small's bf16 step 68 MB smaller and BERT-base's 58 MB larger.
    for (name, late_name, walk) in walks {
        let Some(life) = life.as_ref() else { continue };
        for (name, late) in [(name, false), (late_name, true)] {
            if !want(name) {
                continue;
            }
            let order = hoisted(graph, &t, life, all[walk].order.clone(), late);
            if order != all[walk].order && all.iter().all(|c| c.order != order) {
                all.push(Candidate { name, order });
            }
        }
    }
    if let Some(block) = blocks {
        all.push(Candidate { name: "row-blocks", order: row_blocks(graph, &t, &block)? });
        if want("row-blocks-memory") {
            all.push(Candidate { name: "row-blocks-memory", order: memory_greedy(graph, &t, Some(&block))? });
        }
    }
    // Each order with its collectives' readers deferred, first: `compile` keeps the first of
    // equally small plans, so the overlap is taken wherever it costs no byte.
    let overlapped: Vec<Candidate> = all
        .iter()
        .filter_map(|c| {
            let name = match c.name {
                "program" => "program+overlap",
                "memory" => "memory+overlap",
                "depth-first" => "depth-first+overlap",
                "depth-first-reversed" => "depth-first-reversed+overlap",
                "depth-first-hoisted" => "depth-first-hoisted+overlap",
                "depth-first-reversed-hoisted" => "depth-first-reversed-hoisted+overlap",
                "depth-first-hoisted-late" => "depth-first-hoisted-late+overlap",
                "depth-first-reversed-hoisted-late" => "depth-first-reversed-hoisted-late+overlap",
                "row-blocks" => "row-blocks+overlap",
                _ => "row-blocks-memory+overlap",
            };
            overlapped(graph, &t, &c.order).map(|order| Candidate { name, order })
        })
        .collect();
    Ok(overlapped.into_iter().chain(all).collect())
}

/// The candidate whose name a plan's schedule name `wanted` starts with (the longest such: a
/// plan's name adds the search's marks, "+tiled", "+product", "+blocks2", to its order's), or
/// every candidate where `wanted` is `None` or names none of them.
pub fn named(candidates: Vec<Candidate>, wanted: Option<&str>) -> Vec<Candidate> {
    let Some(wanted) = wanted else { return candidates };
    let fits = |c: &Candidate| {
        wanted.strip_prefix(c.name).is_some_and(|rest| rest.is_empty() || rest.starts_with('+'))
    };
    let Some(best) = candidates.iter().filter(|c| fits(c)).map(|c| c.name.len()).max() else {
        return candidates;
    };
    candidates.into_iter().filter(|c| fits(c) && c.name.len() == best).take(1).collect()
}

/// Whether the runtime may run `op` while the steps after it run (`kiln_runtime`'s `overlap`):
/// an all-reduce or a reduce-scatter.
pub fn overlaps(op: &Op) -> bool {
    matches!(op, Op::AllReduce { .. } | Op::ReduceScatter { .. })
}

/// `order` with the steps that read each collective's result (and what depends on them: a
/// bucket's updates) moved after the next collective, or to the end after the last one: the
/// runtime runs a collective while the steps after it do and makes a step wait only when it
/// touches the collective's bytes, so a collective whose readers come right after it (what the
/// `memory` order does, to free each gradient at once) overlaps nothing, while deferred, it
/// overlaps the backward pass of the next bucket (XLA's latency-hiding scheduler moves the
/// "done" of an async collective the same way). Each reduced bucket then lives until after the
/// next collective: `compile` keeps such an order only where its plan is no larger. A
/// collective that depends on a deferred step releases the deferred steps first. `None` where
/// the graph has no such collective, or the order is unchanged.
fn overlapped(graph: &Graph, t: &Tables, order: &[NodeId]) -> Option<Vec<NodeId>> {
    if !order.iter().any(|&n| overlaps(&graph.node(n).op)) {
        return None;
    }
    let mut held = vec![false; t.preds.len()];
    // The last collective emitted: its readers are deferred.
    let mut source: Option<u32> = None;
    let mut waiting: Vec<NodeId> = Vec::new();
    let mut out = Vec::with_capacity(order.len());
    let release = |waiting: &mut Vec<NodeId>, held: &mut [bool], out: &mut Vec<NodeId>| {
        for n in waiting.drain(..) {
            held[n.index()] = false;
            out.push(n);
        }
    };
    for &n in order {
        let i = n.index();
        let preds = &t.preds[i];
        if overlaps(&graph.node(n).op) {
            if preds.iter().any(|&p| held[p as usize]) {
                release(&mut waiting, &mut held, &mut out);
            }
            out.push(n);
            release(&mut waiting, &mut held, &mut out);
            source = Some(i as u32);
        } else if preds.iter().any(|&p| held[p as usize] || source == Some(p)) {
            held[i] = true;
            waiting.push(n);
        } else {
            out.push(n);
        }
    }
    release(&mut waiting, &mut held, &mut out);
    (out != order).then_some(out)
}

/// Each node's block of rows (by node index), or `None` where the graph has fewer than two
/// blocks of axis-0 slices. `program` is the program order (a topological order to assign
/// blocks in).
fn row_blocks_of(graph: &Graph, t: &Tables, program: &[NodeId]) -> Option<Vec<u32>> {
    let slice_start = |n: NodeId| match graph.node(n).op {
        Op::Slice { axis: 0, start, .. } => Some(start),
        _ => None,
    };
    let mut starts: Vec<usize> = t.nodes.iter().filter_map(|&n| slice_start(n)).collect();
    starts.sort_unstable();
    starts.dedup();
    if starts.len() < 2 {
        return None;
    }
    // Each node's block, in program order (operands first).
    let mut block = vec![0u32; t.preds.len()];
    for &n in program {
        let from_preds = t.preds[n.index()].iter().map(|&p| block[p as usize]).max().unwrap_or(0);
        let own = slice_start(n).map_or(0, |s| starts.binary_search(&s).unwrap_or(0) as u32);
        block[n.index()] = from_preds.max(own);
    }
    Some(block)
}

/// The `row-blocks` order: program order among the ready ops of the lowest block.
fn row_blocks(graph: &Graph, t: &Tables, block: &[u32]) -> Result<Vec<NodeId>> {
    let mut pending = t.pending();
    let mut ready: BinaryHeap<Reverse<(u32, u32)>> = t
        .nodes
        .iter()
        .filter(|n| pending[n.index()] == 0)
        .map(|n| Reverse((block[n.index()], n.index() as u32)))
        .collect();
    let mut order = Vec::with_capacity(t.nodes.len());
    while let Some(Reverse((_, n))) = ready.pop() {
        order.push(Tables::id(n));
        for &s in &t.succs[n as usize] {
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                ready.push(Reverse((block[s as usize], s)));
            }
        }
    }
    complete(graph, order)
}

fn complete(graph: &Graph, order: Vec<NodeId>) -> Result<Vec<NodeId>> {
    if order.len() != graph.len() {
        return Err(CompileError::Internal(format!("graph {:?} has a cycle", graph.name())));
    }
    Ok(order)
}

/// The list scheduler: the ready op with the largest (bytes freed - bytes allocated) runs next;
/// with `block` (`row_blocks_of`), the one among the ready ops of the lowest block.
/// What a value's storage costs and who frees it: per node index the bytes it allocates when
/// it runs, the distinct roots (the node whose buffer a value lives in, through views) it reads,
/// each root's distinct non-view readers, and whether a root's buffer is freed after its last
/// reader (not a variable, an output or an update).
struct Lifetimes {
    allocates: Vec<i64>,
    bytes: Vec<i64>,
    roots_of: Vec<Vec<u32>>,
    readers: Vec<Vec<u32>>,
    freeable: Vec<bool>,
}

impl Lifetimes {
    fn new(graph: &Graph, t: &Tables) -> Self {
        let bound = t.present.len();
        let class = |i: usize| graph.node(Tables::id(i as u32)).op.class();
        let bytes: Vec<i64> = (0..bound)
            .map(|i| if t.present[i] { graph.node(Tables::id(i as u32)).bytes() as i64 } else { 0 })
            .collect();
        // Bytes an op's own storage takes when it runs: nothing for sources (persistent or fed),
        // views (their operand's buffer) and updates (they write variables).
        let allocates = (0..bound)
            .map(|i| match t.present[i].then(|| class(i)) {
                None | Some(OpClass::Source | OpClass::View | OpClass::Effect) => 0,
                _ => bytes[i],
            })
            .collect();
        let mut root: Vec<u32> = (0..bound as u32).collect();
        for n in &t.nodes {
            // Views come after their operand in index order for traced graphs; walk to be safe.
            let mut r = n.index();
            while t.present[r] && class(r) == OpClass::View {
                r = t.operands[r][0] as usize;
            }
            root[n.index()] = r as u32;
        }
        let mut outputs = vec![false; bound];
        for (_, n) in graph.outputs() {
            outputs[n.index()] = true;
        }
        let mut roots_of: Vec<Vec<u32>> = vec![Vec::new(); bound];
        let mut readers: Vec<Vec<u32>> = vec![Vec::new(); bound];
        for n in &t.nodes {
            let i = n.index();
            if class(i) == OpClass::View {
                continue;
            }
            let mut roots: Vec<u32> = t.operands[i].iter().map(|&o| root[o as usize]).collect();
            roots.sort_unstable();
            roots.dedup();
            for &r in &roots {
                readers[r as usize].push(i as u32);
            }
            roots_of[i] = roots;
        }
        let freeable = (0..bound)
            .map(|r| {
                t.present[r]
                    && !outputs[r]
                    && !matches!(graph.node(Tables::id(r as u32)).op, Op::Variable { .. })
                    && class(r) != OpClass::Effect
            })
            .collect();
        Lifetimes { allocates, bytes, roots_of, readers, freeable }
    }
}

fn memory_greedy(graph: &Graph, t: &Tables, block: Option<&[u32]>) -> Result<Vec<NodeId>> {
    let bound = t.present.len();
    let class = |i: usize| graph.node(Tables::id(i as u32)).op.class();
    let Lifetimes { allocates, bytes, roots_of, readers, freeable } = Lifetimes::new(graph, t);
    let mut remaining: Vec<usize> = readers.iter().map(Vec::len).collect();
    let score = |i: usize, remaining: &[usize]| -> i64 {
        let freed: i64 = roots_of[i]
            .iter()
            .filter(|&&r| remaining[r as usize] == 1 && freeable[r as usize])
            .map(|&r| bytes[r as usize])
            .sum();
        freed - allocates[i]
    };

    let mut pending = t.pending();
    let mut version = vec![0u32; bound];
    let mut done = vec![false; bound];
    // (lowest block, score, earliest index first, version); stale versions are skipped when
    // popped.
    let block_of = |i: usize| Reverse(block.map_or(0, |b| b[i]));
    let mut heap: BinaryHeap<(Reverse<u32>, i64, Reverse<u32>, u32)> = BinaryHeap::new();
    let mut free_now: Vec<u32> = Vec::new(); // ready views and sources: run at once
    macro_rules! push {
        ($n:expr) => {{
            let n: u32 = $n;
            let i = n as usize;
            if matches!(class(i), OpClass::View | OpClass::Source) {
                free_now.push(n);
            } else {
                version[i] += 1;
                heap.push((block_of(i), score(i, &remaining), Reverse(n), version[i]));
            }
        }};
    }
    let mut initial: Vec<u32> =
        t.nodes.iter().filter(|n| pending[n.index()] == 0).map(|n| n.index() as u32).collect();
    initial.sort_unstable();
    for n in initial.into_iter().rev() {
        push!(n);
    }
    let mut order = Vec::with_capacity(t.nodes.len());
    let mut newly_ready = Vec::new();
    loop {
        let n = if let Some(n) = free_now.pop() {
            n
        } else if let Some((_, _, Reverse(n), v)) = heap.pop() {
            if version[n as usize] != v || done[n as usize] {
                continue;
            }
            n
        } else {
            break;
        };
        let i = n as usize;
        done[i] = true;
        order.push(Tables::id(n));
        newly_ready.clear();
        for &s in &t.succs[i] {
            pending[s as usize] -= 1;
            if pending[s as usize] == 0 {
                newly_ready.push(s);
            }
        }
        // Reading `n`'s operands may leave one reader of a root: that reader now frees it.
        for &r in &roots_of[i] {
            let r = r as usize;
            remaining[r] -= 1;
            if remaining[r] == 1
                && let Some(&u) = readers[r].iter().find(|&&u| !done[u as usize])
                && pending[u as usize] == 0
                && !newly_ready.contains(&u)
            {
                push!(u);
            }
        }
        newly_ready.sort_unstable();
        while let Some(s) = newly_ready.pop() {
            push!(s);
        }
    }
    complete(graph, order)
}

/// `order` with each op that frees more than it allocates run as early as it can free it: right
/// after the last of its predecessors and of the other readers of the values it is the last
/// reader of. Between the two places each step then holds (freed - allocated) bytes fewer by
/// this count, which knows nothing of in-place writes and views placed at an offset: a
/// heuristic, offered beside the walk it starts from (`candidates_for`). Then the readers an
/// in-place write waits for run before it (`writers_last`). The walks from the sinks reach an
/// op only in its turn: in GPT-2 small's training step (4 x 256 tokens) `depth-first-reversed` ran the loss, which reads the difference
/// of the logits and the target, after the whole backward pass, and the tied token table's
/// head gradient (dlogitsᵀ·h, summed with the embedding's gradient at the end) there too,
/// keeping two [4, 256, 50257] values (412 MB) alive through it. An op is moved only after
/// ops that stay where they are (its new place is then after each of its predecessors).
fn hoisted(graph: &Graph, t: &Tables, life: &Lifetimes, given: Vec<NodeId>, late: bool) -> Vec<NodeId> {
    let order = views_first(graph, t, given.clone());
    let order = freeing_early(graph, t, life, order);
    let order = if late { allocating_late(graph, t, life, order) } else { order };
    let order = writers_last(graph, t, life, order);
    if order == given { given } else { order }
}

/// `hoisted`'s second move where asked (the `-late` candidates), `freeing_early`'s mirror: each op that allocates at least what it
/// keeps alive by running later runs right before its first reader. Taken from the last op
/// back, so that a chain moves whole (a recomputed batch norm's f32 copy of its saved input,
/// the difference from the mean and the product by the inverse deviation: each keeps its
/// operand alive as long as it holds its own output back). A walk from the sinks runs an
/// update's operands in turn, so a value that a cheap chain recomputes from a saved one for
/// a late reader was made before the whole backward pass of the layers between: ResNet-50's
/// bf16 step at batch 32 recomputed layer 2's [32, 28, 28, 512] f32 normalised inputs during
/// layer 3's backward pass, six of them (51 MB each) at its peak. An op moves only where what
/// it would keep alive longer (the values it becomes the last reader of) is at most what it
/// allocates, so no step holds more; effects, collectives, sources and outputs stay.
fn allocating_late(graph: &Graph, t: &Tables, life: &Lifetimes, order: Vec<NodeId>) -> Vec<NodeId> {
    let bound = t.present.len();
    let pos = positions(&order, bound);
    let mut moved = vec![false; bound];
    // The op that stays that a moved op runs right before.
    let mut anchor: Vec<u32> = (0..bound as u32).collect();
    let mut before_rev: Vec<Vec<u32>> = vec![Vec::new(); bound];
    // Where an op now runs, as the position of the op it runs before (just before it).
    let at =
        |i: usize, moved: &[bool], anchor: &[u32]| if moved[i] { pos[anchor[i] as usize] } else { pos[i] };
    for (p, n) in order.iter().enumerate().rev() {
        let i = n.index();
        let op = &graph.node(*n).op;
        if t.succs[i].is_empty()
            || !life.freeable[i]
            || matches!(op.class(), OpClass::Source | OpClass::Effect)
            || op.is_collective()
        {
            continue;
        }
        let Some(first) = t.succs[i].iter().map(|&u| u as usize).min_by_key(|&u| at(u, &moved, &anchor))
        else {
            continue;
        };
        let target = if moved[first] { anchor[first] as usize } else { first };
        let to = pos[target];
        if to <= p + 1 {
            continue;
        }
        // The values this op would now read last: their lifetimes grow to its new place.
        let extended: i64 = life.roots_of[i]
            .iter()
            .map(|&r| r as usize)
            .filter(|&r| {
                life.freeable[r]
                    && life.readers[r]
                        .iter()
                        .map(|&u| u as usize)
                        .filter(|&u| u != i)
                        .all(|u| at(u, &moved, &anchor) < to)
            })
            .map(|r| life.bytes[r])
            .sum();
        if extended > life.allocates[i] {
            continue;
        }
        moved[i] = true;
        anchor[i] = target as u32;
        before_rev[target].push(i as u32);
    }
    let mut m = Moves::new(bound);
    for (target, list) in before_rev.into_iter().enumerate() {
        m.before[target] = list.into_iter().rev().collect();
    }
    m.moved = moved;
    m.apply(order)
}

/// `hoisted`'s first move: each op that frees more than it allocates right after what it waits
/// for.
fn freeing_early(graph: &Graph, t: &Tables, life: &Lifetimes, order: Vec<NodeId>) -> Vec<NodeId> {
    let bound = t.present.len();
    let pos = positions(&order, bound);
    let mut m = Moves::new(bound);
    for (p, n) in order.iter().enumerate() {
        let i = n.index();
        if life.allocates[i] == 0 || matches!(graph.node(*n).op.class(), OpClass::Effect) {
            continue;
        }
        let mut anchor: Option<usize> = t.preds[i].iter().map(|&q| q as usize).max_by_key(|&q| pos[q]);
        let mut freed = 0;
        for &r in &life.roots_of[i] {
            let r = r as usize;
            let others = life.readers[r].iter().map(|&u| u as usize).filter(|&u| u != i);
            if !life.freeable[r] || others.clone().any(|u| pos[u] > p) {
                continue;
            }
            freed += life.bytes[r];
            if let Some(u) = others.max_by_key(|&u| pos[u])
                && anchor.is_none_or(|a| pos[u] > pos[a])
            {
                anchor = Some(u);
            }
        }
        let Some(a) = anchor else { continue };
        if freed > life.allocates[i] && pos[a] + 1 < p && !m.moved[a] {
            m.after[a].push(i as u32);
            m.moved[i] = true;
        }
    }
    m.apply(order)
}

/// Each node index's position in `order`.
fn positions(order: &[NodeId], bound: usize) -> Vec<usize> {
    let mut pos = vec![0usize; bound];
    for (p, n) in order.iter().enumerate() {
        pos[n.index()] = p;
    }
    pos
}

/// Ops moved in an order (`hoisted`'s moves): each to run right before or right after an op
/// that stays.
struct Moves {
    /// Per op that stays: the ops moved to run right before it, and right after it, in order.
    before: Vec<Vec<u32>>,
    after: Vec<Vec<u32>>,
    moved: Vec<bool>,
}

impl Moves {
    fn new(bound: usize) -> Self {
        Moves { before: vec![Vec::new(); bound], after: vec![Vec::new(); bound], moved: vec![false; bound] }
    }

    /// `order` with the moves made (`order` itself where none is, or where they lose an op).
    fn apply(&self, order: Vec<NodeId>) -> Vec<NodeId> {
        if !self.moved.iter().any(|&m| m) {
            return order;
        }
        let mut out = Vec::with_capacity(order.len());
        for n in &order {
            let i = n.index();
            if self.moved[i] {
                continue;
            }
            out.extend(self.before[i].iter().map(|&m| Tables::id(m)));
            out.push(*n);
            out.extend(self.after[i].iter().map(|&m| Tables::id(m)));
        }
        if out.len() == order.len() { out } else { order }
    }
}

/// `hoisted`'s last move: an op that may write its output over an operand
/// (`Op::may_write_over`, same bytes) can do so only as the operand's last reader, so the
/// operand's other readers that run after it move to right before it, where everything they
/// read is already made (a reader waiting on anything later stays, and so does every effect),
/// if each makes at most an eighth of the operand's bytes: a reader run earlier holds its
/// output longer. Moving readers as large as the operand too (elementwise products of the same
/// shape) gave ResNet-50 and ViT-B/16 smaller plans before cheap recomputation and larger ones
/// after it (1,625 -> 1,655 MB, 2,221 -> 2,240 MB at batch 32 and 16). In GPT-2 small's
/// training step the loss, sum((logits - target)²), ran after the gradient
/// 2·(logits - target)·dloss, which then needed a [4, 256, 50257] buffer of its own (206 MB)
/// beside the difference it could have overwritten: 2,254 -> 2,202 MB planned.
fn writers_last(graph: &Graph, t: &Tables, life: &Lifetimes, order: Vec<NodeId>) -> Vec<NodeId> {
    let bound = t.present.len();
    let pos = positions(&order, bound);
    let mut m = Moves::new(bound);
    for (p, n) in order.iter().enumerate() {
        let i = n.index();
        let node = graph.node(*n);
        if m.moved[i] || life.allocates[i] == 0 {
            continue;
        }
        for (j, &o) in t.operands[i].iter().enumerate() {
            let o = o as usize;
            if graph.node(Tables::id(o as u32)).op.class() == OpClass::View
                || !life.freeable[o]
                || life.bytes[o] != life.allocates[i]
                || !node.op.may_write_over(j, &node.shape)
            {
                continue;
            }
            let mut later: Vec<usize> =
                life.readers[o].iter().map(|&u| u as usize).filter(|&u| pos[u] > p).collect();
            let movable = |u: usize| {
                !m.moved[u]
                    && m.before[u].is_empty()
                    && !graph.node(Tables::id(u as u32)).op.is_effect()
                    && !graph.node(Tables::id(u as u32)).op.is_collective()
                    && life.allocates[u] * 8 <= life.bytes[o]
                    && t.preds[u].iter().all(|&q| pos[q as usize] < p && !m.moved[q as usize])
            };
            if later.is_empty() || !later.iter().all(|&u| movable(u)) {
                continue;
            }
            later.sort_unstable_by_key(|&u| pos[u]);
            for &u in &later {
                m.moved[u] = true;
            }
            m.before[i].extend(later.iter().map(|&u| u as u32));
        }
    }
    m.apply(order)
}

/// `order` with each view (it runs nothing and allocates nothing) right after its operand, so
/// that an op reading a value through a view can move as early as the value allows (`hoisted`).
fn views_first(graph: &Graph, t: &Tables, order: Vec<NodeId>) -> Vec<NodeId> {
    let bound = t.present.len();
    let is_view = |n: NodeId| graph.node(n).op.class() == OpClass::View && t.preds[n.index()].len() == 1;
    let mut after: Vec<Vec<u32>> = vec![Vec::new(); bound];
    for n in &order {
        if is_view(*n) {
            after[t.preds[n.index()][0] as usize].push(n.index() as u32);
        }
    }
    let mut out = Vec::with_capacity(order.len());
    for n in &order {
        if is_view(*n) {
            continue;
        }
        // A view of a view follows its operand, which follows its own.
        let mut stack = vec![n.index() as u32];
        while let Some(m) = stack.pop() {
            out.push(Tables::id(m));
            stack.extend(after[m as usize].iter().rev());
        }
    }
    if out.len() == order.len() { out } else { order }
}

/// Post-order from the sinks (nodes nothing runs after), in program order; each node's
/// predecessors (operands, then control) are visited first to last, or last to first.
fn depth_first(graph: &Graph, t: &Tables, reversed: bool) -> Result<Vec<NodeId>> {
    let preds = |i: usize| -> Vec<u32> {
        let mut p = t.operands[i].clone();
        let mut control: Vec<u32> =
            t.preds[i].iter().copied().filter(|q| !t.operands[i].contains(q)).collect();
        control.sort_unstable();
        p.extend(control);
        if reversed {
            p.reverse();
        }
        p
    };
    let mut visited = vec![false; t.present.len()];
    let mut order = Vec::with_capacity(t.nodes.len());
    let mut sinks: Vec<usize> =
        t.nodes.iter().map(|n| n.index()).filter(|&i| t.succs[i].is_empty()).collect();
    sinks.sort_unstable();
    for sink in sinks {
        if std::mem::replace(&mut visited[sink], true) {
            continue;
        }
        // Iterative post-order: (node, its predecessors, next index).
        let mut stack: Vec<(usize, Vec<u32>, usize)> = vec![(sink, preds(sink), 0)];
        while let Some((n, ps, k)) = stack.last_mut() {
            if let Some(&p) = ps.get(*k) {
                *k += 1;
                let p = p as usize;
                if !std::mem::replace(&mut visited[p], true) {
                    let pp = preds(p);
                    stack.push((p, pp, 0));
                }
            } else {
                order.push(Tables::id(*n as u32));
                stack.pop();
            }
        }
    }
    complete(graph, order)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;
    use std::collections::HashMap;

    fn is_topological(graph: &Graph, order: &[NodeId]) -> bool {
        let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        graph.node_ids().all(|n| graph.predecessors(n).all(|p| pos[&p] < pos[&n]))
    }

    #[test]
    fn every_candidate_is_a_topological_order() {
        let t = Tracer::new("g");
        let x = t.input("x", [4, 8]);
        let a = x.relu();
        let b = x.tanh();
        let c = (&a * &b).matmul(&t.param("w", [8, 3], crate::ir::Init::Zeros));
        t.output("y", &c.sum(-1, false));
        t.output("z", &a.reshape([32]));
        let g = t.finish().unwrap();
        for c in candidates(&g).unwrap() {
            assert_eq!(c.order.len(), g.len(), "{}", c.name);
            assert!(is_topological(&g, &c.order), "{}", c.name);
        }
        assert!(candidates(&g).unwrap().iter().all(|c| !c.name.ends_with("+overlap")), "no collectives");
    }

    /// An op that may overwrite its operand waits for the operand's small readers: the sum that
    /// a walk would run after it moves before it. Where a reader as large as the operand also
    /// runs after it (it stays: run earlier it would hold its output longer), nothing moves.
    #[test]
    fn small_readers_run_before_an_op_that_overwrites_their_operand() {
        for with_large in [false, true] {
            let t = Tracer::new("g");
            let (x, y) = (t.input("x", [64, 64]), t.input("y", [64, 64]));
            let d = &x - &y;
            let g = &d * &d;
            let loss = d.sum(-1, false);
            t.output("g", &g);
            t.output("loss", &loss);
            if with_large {
                t.output("large", &d.tanh());
            }
            let graph = t.finish().unwrap();
            let tables = Tables::new(&graph);
            let life = Lifetimes::new(&graph, &tables);
            let given: Vec<NodeId> = graph.node_ids().collect();
            let at = |order: &[NodeId], t: &crate::trace::Tensor| {
                let n = t.id().expect("a traced value");
                order.iter().position(|&m| m == n).unwrap()
            };
            assert!(at(&given, &g) < at(&given, &loss));
            let moved = writers_last(&graph, &tables, &life, given.clone());
            assert!(is_topological(&graph, &moved));
            if with_large {
                assert_eq!(moved, given, "the product cannot be the last reader: nothing moves");
            } else {
                assert!(at(&moved, &loss) < at(&moved, &g), "the sum runs before the overwriting product");
            }
        }
    }

    /// With one collective per gradient, every `+overlap` order is topological, and in it the
    /// readers of each collective but the last come after the next collective; the plain order
    /// it came from has them before.
    #[test]
    fn overlapped_orders_defer_each_collectives_readers_past_the_next() {
        use crate::losses::Loss;
        use crate::nn::{Dense, Sequential};
        use crate::optim::{Adam, Optimizer};
        use crate::step::{TrainConfig, train_step_graph};
        let model = Sequential::new().add(Dense::new(5)).add(Dense::new(4)).add(Dense::new(2));
        let cfg = TrainConfig {
            optimizer: Optimizer::Adam(Adam::new(1e-3)),
            loss: Loss::MeanSquaredError,
            metrics: Vec::new(),
        };
        let mut g =
            train_step_graph(&model, crate::ir::Shape::from([4, 3]), crate::ir::Shape::from([4, 2]), &cfg)
                .unwrap();
        crate::data_parallel::all_reduce_gradients_in_buckets(&mut g, 0).unwrap();
        let all = candidates(&g).unwrap();
        let readers_after_next = |order: &[NodeId]| -> (usize, usize) {
            let pos: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
            let mut collectives: Vec<usize> =
                order.iter().enumerate().filter(|(_, n)| overlaps(&g.node(**n).op)).map(|(i, _)| i).collect();
            collectives.sort_unstable();
            let (mut after, mut total) = (0, 0);
            for w in collectives.windows(2) {
                for r in g.successors(order[w[0]]) {
                    total += 1;
                    after += usize::from(pos[&r] > w[1]);
                }
            }
            (after, total)
        };
        let mut deferred = 0;
        for c in &all {
            assert!(is_topological(&g, &c.order), "{}", c.name);
            if let Some(base) = c.name.strip_suffix("+overlap") {
                let plain = all.iter().find(|p| p.name == base).expect("its plain order");
                let (after, total) = readers_after_next(&c.order);
                assert!(total > 0);
                assert_eq!(after, total, "{}: every reader past the next collective", c.name);
                assert!(readers_after_next(&plain.order).0 < total, "{base} read some at once");
                deferred += 1;
            }
        }
        assert!(deferred >= 4, "each plain order has its +overlap twin");
    }
}
