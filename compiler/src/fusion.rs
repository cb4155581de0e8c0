//! Fusion: chains of elementwise ops become one `Op::Fused` (`ir::fused`), so that the values
//! inside a chain are never materialised: the planner sees fewer and smaller buffers and each
//! backend runs one kernel (the CPU one loop over cache-sized chunks, CUDA one generated kernel)
//! where there were several.
//!
//! The pass is greedy from the consumers back, as XLA's producer-consumer fusion is: every
//! elementwise op not yet fused roots a group, and an elementwise operand joins the group when
//! every reader of its value is already in the group (so the value is needed nowhere else and
//! nothing is computed twice), it has the root's element count (so no instruction runs more often
//! than unfused), it is not a graph output, nothing must run before it, it lives on the root's
//! device, and the group stays within the kernels' limits (`ir::fused`: 8 operands, 64
//! instructions, 16 chunk slots). A `BroadcastTo` read only by the group joins as no instruction
//! at all: the fused op reads its operand with broadcast strides. A value that the backward pass
//! saves (a sigmoid's output read by its gradient) has readers outside the group and stays
//! materialised, so autodiff's choice of saved values is kept.
//!
//! Three heavier ops take part on the same rule (read only by the group): a reduction takes the
//! chain it alone reads as its prologue (the cross-entropy's `y * log_softmax` is summed as it is
//! computed) and the chain that alone reads it as its epilogue (`rsqrt(var + eps)`); a matrix
//! product or a convolution becomes its GEMM's epilogue's operand 0 (bias, activation;
//! `Fused::matmul`, `Fused::conv`). A convolution's epilogue costs no pass of its own: the CPU
//! applies it to each block of 8 output rows while the block is in cache, CUDA as the GEMM stores
//! (`cargo bench --bench speed`, the zoo cnn's forward pass over the whole batch, fused against
//! unfused: 24.55 against 21.36 ms with its bias and ReLU a pass of their own, 20.49 against
//! 21.58 ms with the convolutions' epilogues and periodic operands; the training step 57 -> 53
//! plan steps). Grouped, depthwise and dilated convolutions too: their direct loops
//! (`grouped_conv`) hand each block of rows to the epilogue, CUDA's apply it per element as they
//! store (a 3x3 depthwise convolution over 2x112x112x32 and its bias, one core, `kiln run
//! --profile 50`: 0.188 + 0.135 ms as two kernels, 0.286 ms as one). A group of one elementwise
//! op stays that op.
//!
//! Sources join too: an iota or a fill read only by the group is an instruction (`Inst::Iota`,
//! `Inst::Const`), and so is an elementwise chain of them (`constant_chain`: the causal mask
//! `(iota_j <= iota_i - 1) * 1e9`), whatever the group's element count, since it reads nothing and
//! costs a few instructions per element. Before groups are grown, every elementwise reader of a
//! cheap value (a source, or elementwise over cheap or broadcast operands) gets its own copy
//! (`split_cheap`), as XLA duplicates cheap producers into their consumers: the sparse
//! cross-entropy's label mask `ids == iota[1, classes]`, read by the loss and its gradient, was a
//! [rows, classes] buffer held from the forward pass to the backward; now each group compares as
//! it goes (a 2,000-class head at 64 rows: arena 1,041,472 -> 1,033,472 B, the one-hot version's
//! 1,545,216). Copies that meet in one group are one instruction.
//!
//! Fused results are bitwise the unfused ones on the CPU: each instruction is the op it replaces,
//! computed by the same scalar function (`kiln_kernels::cpu` has one definition per op), and a
//! fused reduction sums the same chunks in the same order.
//!
//! Runs in `compile` after the default passes and before the schedule search; the eager executor
//! (`optimize`) never fuses, as eager frameworks do not. Measured (`kiln memory MODEL --steps`):
//! the zoo's training steps go from 52/63/76/195 plan steps (seed-mlp, mlp, cnn, transformer) to
//! 27/47/59/117, the transformer's arena from 40.5 to 36.4 MB and its forward arena from 8.2 to
//! 6.3 MB; the other arenas are unchanged (their unfused chains already ran in place).

use crate::error::{CompileError, Result};
use crate::ir::fused::{Inst, MAX_FUSED_INSTS, MAX_FUSED_OPERANDS, MAX_FUSED_SLOTS, Ref};
use crate::ir::{DType, Fused, FusedMatMul, FusedReduce, Graph, Node, NodeId, Op, Shape};
use petgraph::algo::toposort;
use std::collections::{HashMap, HashSet};

/// What fusion did to a graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FusionFigures {
    /// Fused ops made.
    pub groups: usize,
    /// Ops they replaced.
    pub ops: usize,
    /// Updates folded with their gradient's product (`product_updates`).
    pub product_updates: usize,
    /// Products that, fused with the group that reads them, wait for a computed value the group
    /// reads: kept apart by `Products::All`, fused by `Products::Waiting`.
    pub waiting: usize,
}

/// A group: elementwise members in topological order and, when the group ends in a
/// reduction, that reduction (the group's root); otherwise the last member is the root.
struct Group {
    members: Vec<NodeId>,
    reduce: Option<NodeId>,
    /// A matrix product that only the members read, computed first (the program's operand 0).
    matmul: Option<NodeId>,
    /// After a reduction: elementwise members applied to its result, in topological order (the
    /// last is then the group's root).
    after: Vec<NodeId>,
}

impl Group {
    /// Every node the group replaces.
    fn nodes(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.members.iter().copied().chain(self.reduce).chain(self.matmul).chain(self.after.iter().copied())
    }
}

/// Fuses the graph's elementwise chains in place.
///
/// A member may be ordered before later ops by control edges (a reader of a variable's old value
/// runs before the variable's update, `passes::OrderEffects`): the fused op, which reads
/// everything its members read, takes those edges. Should that ever close a cycle, the graph is
/// fused again with such members left out.
///
/// Which matrix products may join a group as its GEMM (`products` of `fuse`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Products {
    /// Every product read only by a group joins it (a GEMM with an epilogue), except one that
    /// would wait for a computed value its epilogue reads (`waits_for_a_value`): counted in
    /// `FusionFigures::waiting`, so that `compile` can plan the graph with it fused as well.
    All,
    /// As `All`, and a product that would wait for a value joins its group too: its factors
    /// are then held until the value is made, and its epilogue writes over the value
    /// (`Op::may_write_over`) instead of a buffer of its own. Which is smaller depends on what
    /// else is live meanwhile, so `compile` plans both graphs and keeps the smaller.
    Waiting,
    /// Only a matrix product whose group also reads a computed value of the group's shape (a
    /// backward step: relu's gradient of the activation): the epilogue then may write over that
    /// value (`Op::may_write_over`). Forward products and convolutions (bias and activation over
    /// them) stay apart, so that rematerialization can recompute an activation from its pre-activation
    /// without redoing the GEMM (`compile` fuses this way when a limit needs recomputation).
    OverValues,
}

/// With `products`, a matrix product read only by a group joins it (a GEMM with an epilogue),
/// each or as `Products` says.
pub fn fuse(graph: &mut Graph, products: Products) -> Result<FusionFigures> {
    split_cheap(graph)?;
    let mut relaxed = graph.clone();
    let figures = fuse_with(&mut relaxed, true, products)?;
    if toposort(relaxed.petgraph(), None).is_ok() {
        *graph = relaxed;
        return Ok(figures);
    }
    fuse_with(graph, false, products)
}

/// Whether `members` read, from outside the group and besides the product `p`, a computed value
/// (no variable or input) of the group's shape.
fn reads_a_value_of_its_shape(graph: &Graph, members: &[NodeId], p: NodeId) -> bool {
    let shape = &graph.node(p).shape;
    members.iter().flat_map(|&m| graph.operands(m)).any(|o| {
        let node = graph.node(o);
        o != p
            && !members.contains(&o)
            && node.shape == *shape
            && !matches!(node.op, Op::Variable { .. } | Op::Input { .. })
    })
}

/// Whether the product `p` with a transposed first factor would wait, as the group's GEMM, for
/// a computed value of its shape that its epilogue reads: fused, the product runs only once the
/// value is made and holds its own factors until then (its epilogue writing over the value);
/// apart, it runs when its factors are ready, in a buffer of its own, and the sum is made
/// later. A tied table's gradient is one: gᵀ·h + the embedding's `gather_grad`, where g is the
/// [rows, vocab] logits' gradient. Neither is always smaller: `transpose_operands`' tied head
/// (vocab 512, width 64, 4 x 32 tokens) trains in 426,560 B apart and 459,328 B fused; GPT-2
/// small at 4 x 256 tokens plans 2,201,929,796 B apart (the [50257, 768] table gradient and the
/// logits' gradient meet at the start of the backward pass, beside every saved activation) and
/// 2,107,300,932 B fused (the logits' gradient is held through the backward pass instead, and
/// meets the table's gradient only at its end). `compile` plans both (`Products::Waiting`).
fn waits_for_a_value(graph: &Graph, members: &[NodeId], p: NodeId) -> bool {
    matches!(graph.node(p).op, Op::MatMul { transpose_a: true, .. })
        && reads_a_value_of_its_shape(graph, members, p)
}

/// Readers of `p` are all in `set`, and (unless `ordered_after` allows them) nothing else follows
/// it by a control edge.
fn read_only_by(graph: &Graph, p: NodeId, set: &HashSet<NodeId>, ordered_after: bool) -> bool {
    graph.users(p).iter().all(|u| set.contains(u))
        && (ordered_after || graph.successors(p).all(|s| set.contains(&s)))
}

fn fuse_with(graph: &mut Graph, ordered_after: bool, products: Products) -> Result<FusionFigures> {
    let order = toposort(graph.petgraph(), None)
        .map_err(|c| CompileError::Internal(format!("fusion: the graph has a cycle at {:?}", c.node_id())))?;
    let position: HashMap<NodeId, usize> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let outputs: HashSet<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
    let mut taken: HashSet<NodeId> = HashSet::new();
    let mut groups: Vec<Group> = Vec::new();
    let mut figures = FusionFigures::default();
    for &root in order.iter().rev() {
        if taken.contains(&root) {
            continue;
        }
        let search = Search { graph, outputs: &outputs, taken: &taken, position: &position, ordered_after };
        let group = if matches!(graph.node(root).op, Op::Reduce { .. }) {
            let Some(members) = search.prologue(root) else {
                continue;
            };
            Group { members, reduce: Some(root), matmul: None, after: Vec::new() }
        } else if instruction(graph, root) {
            let members = search.grow(root, None);
            // A product's epilogue runs on blocks of rows (CPU), which an iota cannot see.
            let with_source = members
                .iter()
                .any(|&m| source(graph.node(m)) || matches!(graph.node(m).op, Op::RandomUniform { .. }));
            let matmul = search.product(&members).filter(|&p| {
                let waits = !with_source && waits_for_a_value(graph, &members, p);
                if waits && products != Products::OverValues {
                    figures.waiting += 1;
                }
                !with_source
                    && (!waits || products == Products::Waiting)
                    && match products {
                        Products::All | Products::Waiting => true,
                        // A convolution's epilogue never writes over its operands
                        // (`Op::may_write_over`): nothing to gain here.
                        Products::OverValues => {
                            matches!(graph.node(p).op, Op::MatMul { .. })
                                && reads_a_value_of_its_shape(graph, &members, p)
                        }
                    }
            });
            // A reduction only these members read, with its prologue, ahead of them.
            let head = if matmul.is_none() {
                search.reduction(&members).and_then(|r| {
                    let before = search.prologue(r)?;
                    Some(Group { members: before, reduce: Some(r), matmul: None, after: members.clone() })
                })
            } else {
                None
            };
            match head {
                Some(g) if operand_count(graph, &g) <= MAX_FUSED_OPERANDS => g,
                _ if members.len() < 2 && matmul.is_none() => continue,
                _ => Group { members, reduce: None, matmul, after: Vec::new() },
            }
        } else {
            continue;
        };
        taken.extend(group.nodes());
        groups.push(group);
    }
    for group in groups {
        figures.groups += 1;
        figures.ops += group.nodes().count();
        replace(graph, &group)?;
    }
    Ok(figures)
}

/// The operands a group's fused op takes.
fn operand_count(graph: &Graph, group: &Group) -> usize {
    let tip = *group.members.last().expect("a prologue");
    let shape = graph.node(tip).shape.clone();
    let before = program(graph, &group.members, &shape, None, None).1.len();
    let after = group.reduce.map_or(0, |r| program(graph, &group.after, &shape, None, Some(r)).1.len() - 1);
    before + after
}

/// Ops that can be instructions of a fused program.
fn fusable(node: &Node) -> bool {
    matches!(node.op, Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Select)
}

/// A cast between float types (mixed precision's, `autocast`): an instruction too
/// (`Inst::Cast`), so that no cast has a buffer of its own where its producer or reader fuses.
fn float_cast(graph: &Graph, n: NodeId) -> bool {
    let node = graph.node(n);
    matches!(node.op, Op::Cast { to } if to.is_float())
        && graph.operands(n).iter().all(|&o| graph.node(o).dtype.is_float())
}

/// `fusable`, or a float cast.
fn instruction(graph: &Graph, n: NodeId) -> bool {
    fusable(graph.node(n)) || float_cast(graph, n)
}

/// Whether an op of half values gives a value its half type holds exactly when computed in f32
/// (a sign, a choice or a comparison of its operands): no rounding after it in a program.
fn exact_in_half(op: &Op) -> bool {
    use crate::ir::{BinaryOp as B, UnaryOp as U};
    match op {
        Op::Unary(u) => matches!(u, U::Neg | U::Abs | U::Sign | U::Relu),
        Op::Binary(b) => matches!(
            b,
            B::Maximum
                | B::Minimum
                | B::Greater
                | B::GreaterEqual
                | B::Less
                | B::LessEqual
                | B::Equal
                | B::NotEqual
                | B::ReluGrad
        ),
        Op::Select => true,
        _ => false,
    }
}

/// Ops a group takes in: instructions, broadcasts (read through broadcast strides) and random
/// values (an instruction where the group has their shape).
fn joins(node: &Node) -> bool {
    fusable(node) || matches!(node.op, Op::BroadcastTo { .. } | Op::RandomUniform { .. })
}

/// Sources that can be instructions of a fused program (`Inst::Iota`, `Inst::Const`): they read
/// nothing, so computing them once per element of a larger group costs one instruction, not a
/// repeated computation, and they (and elementwise chains of them, `constant_chain`) may join a
/// group of any element count they broadcast to.
fn source(node: &Node) -> bool {
    matches!(node.op, Op::Iota { .. } | Op::Fill { .. }) && node.dtype == crate::ir::DType::F32
}

/// Whether `n` is an elementwise function of sources alone (the causal mask
/// `(iota_j <= iota_i - 1) * 1e9`): a constant that a group of any larger shape it broadcasts to
/// computes with a few instructions per element instead of reading a buffer.
fn constant_chain(graph: &Graph, n: NodeId, depth: usize) -> bool {
    let node = graph.node(n);
    depth < 8
        && fusable(node)
        && node.dtype == crate::ir::DType::F32
        && graph.operands(n).iter().all(|&o| source(graph.node(o)) || constant_chain(graph, o, depth + 1))
}

/// Whether source `node` can be an instruction over `shape`: its shape broadcasts to it, and an
/// iota's axis is as long as the program's axis it lines up with (a length-1 iota axis is a
/// constant 0, which a coordinate of the program would not be).
fn source_fits(node: &Node, shape: &Shape) -> bool {
    if Shape::broadcast(&node.shape, shape).as_ref() != Some(shape) {
        return false;
    }
    match node.op {
        Op::Iota { axis, .. } => {
            let at = axis + shape.rank() - node.shape.rank();
            node.shape.dims().get(axis) == shape.dims().get(at)
        }
        _ => true,
    }
}

/// Gives every elementwise reader of a cheap value its own copy, so that each reader's group can
/// compute it instead of reading it. Cheap: a source (fill, iota), or an elementwise op whose
/// operands are cheap or broadcast (an eighth of its elements or fewer), as XLA duplicates a
/// cheap producer into several consumers. The sparse cross-entropy's label mask
/// `equal(iota[1, classes], ids[rows, 1])` is read by the loss and by its gradient: shared, it
/// was a [rows, classes] buffer (a one-hot, 512 KB on a 2,000-class head at 64 rows) held from
/// the forward pass to the backward; copied, each fused group compares as it goes. Readers that
/// are not elementwise keep sharing the original. Copies are made consumers first, so a cheap
/// value's own cheap operands are split for the copies too.
fn split_cheap(graph: &mut Graph) -> Result<()> {
    let outputs: HashSet<NodeId> = graph.outputs().iter().map(|(_, n)| *n).collect();
    let order = toposort(graph.petgraph(), None)
        .map_err(|c| CompileError::Internal(format!("fusion: the graph has a cycle at {:?}", c.node_id())))?;
    let mut cheap: HashSet<NodeId> = HashSet::new();
    for &n in &order {
        let node = graph.node(n);
        let is_cheap = !outputs.contains(&n)
            && graph.control_predecessors(n).is_empty()
            && (source(node)
                || (joins(node)
                    && graph.operands(n).iter().all(|o| {
                        cheap.contains(o) || graph.node(*o).shape.numel() * 8 <= node.shape.numel()
                    })));
        if is_cheap {
            cheap.insert(n);
        }
    }
    for &n in order.iter().rev().filter(|n| cheap.contains(n)) {
        let users = graph.users(n);
        if users.len() < 2 {
            continue;
        }
        let readers: Vec<NodeId> = users.iter().copied().filter(|&u| joins(graph.node(u))).collect();
        // The first elementwise reader keeps the original when nothing else reads it.
        let keep = usize::from(readers.len() == users.len());
        let operands = graph.operands(n);
        // A copy runs before what the original must precede (a random value before its step
        // counter advances).
        let later = graph.control_successors(n);
        for &u in &readers[keep.min(readers.len())..] {
            let copy = graph.add(graph.node(n).clone(), &operands);
            for &s in &later {
                graph.add_control(copy, s);
            }
            for (i, o) in graph.operands(u).into_iter().enumerate() {
                if o == n {
                    graph.replace_operand(u, i, copy);
                }
            }
        }
    }
    Ok(())
}

/// What one group is searched in: the graph, its outputs, the nodes earlier groups took, the
/// topological positions, and whether members may be ordered before other ops.
struct Search<'a> {
    graph: &'a Graph,
    outputs: &'a HashSet<NodeId>,
    taken: &'a HashSet<NodeId>,
    position: &'a HashMap<NodeId, usize>,
    ordered_after: bool,
}

impl Search<'_> {
    /// Whether `p` may join a group whose nodes are `set`, on `device`: not taken, no output,
    /// on that device, nothing that must run before it, read only by the group.
    fn free(&self, p: NodeId, set: &HashSet<NodeId>, device: crate::ir::DeviceId) -> bool {
        !self.taken.contains(&p)
            && !self.outputs.contains(&p)
            && self.graph.node(p).device == device
            && self.graph.control_predecessors(p).is_empty()
            && read_only_by(self.graph, p, set, self.ordered_after)
    }

    /// The elementwise members of the group whose last value is `root`, in topological order
    /// (the root last); `reduce`, when given, is the reduction that reads the root and counts as
    /// a member when the readers of a candidate are checked.
    fn grow(&self, root: NodeId, reduce: Option<NodeId>) -> Vec<NodeId> {
        let (graph, position) = (self.graph, self.position);
        let r = graph.node(root);
        let mut members: Vec<NodeId> = vec![root];
        let mut set: HashSet<NodeId> = HashSet::from([root]);
        set.extend(reduce);
        // Until nothing joins: an operand may qualify only once all its readers are in.
        loop {
            let mut joined = false;
            let mut candidates: Vec<NodeId> =
                members.iter().flat_map(|&m| graph.operands(m)).filter(|o| !set.contains(o)).collect();
            candidates.sort_unstable_by_key(|n| std::cmp::Reverse(position[n]));
            candidates.dedup();
            for p in candidates {
                let node = graph.node(p);
                // A broadcast joins when its operand broadcasts to the root's shape directly.
                let broadcast = matches!(node.op, Op::BroadcastTo { .. })
                    && graph.operands(p).first().is_some_and(|&x| {
                        Shape::broadcast(&graph.node(x).shape, &r.shape).as_ref() == Some(&r.shape)
                    });
                // Values of several float types meet in a group through casts (`Inst::Cast`).
                let same_type = node.dtype == r.dtype || (node.dtype.is_float() && r.dtype.is_float());
                let elementwise = (fusable(node) || broadcast || float_cast(graph, p))
                    && same_type
                    && node.shape.numel() == r.shape.numel();
                let constant = source(node) || constant_chain(graph, p, 0);
                // Random values are a function of their own index: only at the group's shape.
                let random = matches!(node.op, Op::RandomUniform { .. }) && node.shape == r.shape;
                let qualifies = (elementwise || random || (constant && source_fits(node, &r.shape)))
                    && self.free(p, &set, r.device);
                if !qualifies {
                    continue;
                }
                let mut trial = members.clone();
                trial.push(p);
                trial.sort_unstable_by_key(|n| position[n]);
                let (program, operands) = program(graph, &trial, &r.shape, None, None);
                // Room for the casts `program` (a half product's rounding), `replace` and
                // `widen` may add to a group of several types or of half values.
                let mixed = trial.iter().chain(&operands).any(|&n| {
                    let d = graph.node(n).dtype;
                    d != r.dtype || matches!(d, DType::F16 | DType::BF16)
                });
                let room = if mixed { 3 } else { 0 };
                // A group of constants alone is left as it is (for constant folding to take).
                if operands.is_empty()
                    || operands.len() > MAX_FUSED_OPERANDS
                    || program.insts.len() + room > MAX_FUSED_INSTS
                    || program.registers(operands.len()).slots + room > MAX_FUSED_SLOTS
                {
                    continue;
                }
                members = trial;
                set.insert(p);
                joined = true;
            }
            if !joined {
                break;
            }
        }
        members.sort_unstable_by_key(|n| position[n]);
        members
    }

    /// The elementwise chain that reduction `r` alone reads, grown from its operand, if that
    /// operand can be an instruction.
    fn prologue(&self, r: NodeId) -> Option<Vec<NodeId>> {
        let tip = self.graph.operands(r)[0];
        let alone =
            instruction(self.graph, tip) && self.free(tip, &HashSet::from([r]), self.graph.node(r).device);
        alone.then(|| self.grow(tip, Some(r)))
    }

    /// The first operand of a member that `kind` accepts, of the root's shape and free for the
    /// group: the op the group can start from (a product) or follow (a reduction).
    fn head(&self, members: &[NodeId], kind: impl Fn(NodeId, &Node) -> bool) -> Option<NodeId> {
        let g = self.graph;
        let root = g.node(*members.last()?);
        let set: HashSet<NodeId> = members.iter().copied().collect();
        let mut candidates: Vec<NodeId> = members.iter().flat_map(|&m| g.operands(m)).collect();
        candidates.dedup();
        candidates.into_iter().find(|&p| {
            let node = g.node(p);
            kind(p, node) && !set.contains(&p) && node.shape == root.shape && self.free(p, &set, root.device)
        })
    }

    /// A reduction over a non-empty axis longer than 1: the group becomes its epilogue (layer
    /// norm's `rsqrt(var + eps)`).
    fn reduction(&self, members: &[NodeId]) -> Option<NodeId> {
        self.head(members, |p, node| {
            let Op::Reduce { axes, .. } = &node.op else { return false };
            let input = &self.graph.node(self.graph.operands(p)[0]).shape;
            input.numel() > 0
                && node.shape.numel() > 0
                && axes.iter().any(|&a| input.dims().get(a) > Some(&1))
        })
    }

    /// A matrix product or a convolution of non-empty factors: the group becomes its GEMM's
    /// epilogue (a bias, an activation, a residual).
    fn product(&self, members: &[NodeId]) -> Option<NodeId> {
        self.head(members, |p, node| {
            // Grouped and dilated convolutions too: their direct loops hand each block of rows
            // to the epilogue (CPU) or apply it per element (CUDA).
            matches!(node.op, Op::MatMul { .. } | Op::Conv2d { .. })
                && self.graph.operands(p).iter().all(|&f| self.graph.node(f).shape.numel() > 0)
        })
    }
}

/// The program of `members` (in topological order, the root last) and its operands: the values
/// members read from outside the group, in order of first use. A `BroadcastTo` member is no
/// instruction: its readers read its operand, which the fused op broadcasts anyway.
fn program(
    graph: &Graph,
    members: &[NodeId],
    shape: &Shape,
    reduce: Option<FusedReduce>,
    product: Option<NodeId>,
) -> (Fused, Vec<NodeId>) {
    let mut value: HashMap<NodeId, Ref> = HashMap::new();
    // A product is operand 0 whether or not it is read first.
    let mut operands: Vec<NodeId> = product.into_iter().collect();
    let mut insts = Vec::with_capacity(members.len());
    // A half product is its f32 accumulation rounded to its type, as the unfused op stores it.
    if let Some(p) = product
        && matches!(graph.node(p).dtype, DType::F16 | DType::BF16)
    {
        insts.push(Inst::Cast(graph.node(p).dtype, Ref::Operand(0)));
        value.insert(p, Ref::Value(0));
    }
    // Each instruction made, with the ref its value is read by (its rounding, for a half op).
    let mut made: Vec<(Inst, Ref)> = Vec::new();
    for &m in members {
        let refs: Vec<Ref> = graph
            .operands(m)
            .into_iter()
            .map(|o| match value.get(&o) {
                Some(&r) => r,
                None => {
                    let i = operands.iter().position(|&x| x == o).unwrap_or_else(|| {
                        operands.push(o);
                        operands.len() - 1
                    });
                    Ref::Operand(i as u32)
                }
            })
            .collect();
        let inst = match graph.node(m).op {
            Op::BroadcastTo { .. } => {
                value.insert(m, refs[0]);
                continue;
            }
            Op::Unary(u) => Inst::Unary(u, refs[0]),
            Op::Binary(b) => Inst::Binary(b, refs[0], refs[1]),
            Op::Scalar { op, value } => Inst::Scalar(op, value, refs[0]),
            Op::Select => Inst::Select(refs[0], refs[1], refs[2]),
            Op::Fill { value, .. } => Inst::Const(value),
            Op::RandomUniform { seed, .. } => Inst::Uniform(seed, refs[0]),
            // Aligned at the right, as the iota broadcasts to the program's shape.
            Op::Iota { axis, .. } => {
                Inst::Iota((axis + shape.rank().saturating_sub(graph.node(m).shape.rank())) as u32)
            }
            Op::Cast { to } => Inst::Cast(to, refs[0]),
            ref op => unreachable!("fusion grows groups of elementwise ops only, not {}", op.name()),
        };
        // Copies of one cheap value (`split_cheap`) that met in one group are one instruction.
        if let Some(&(_, same)) = made.iter().find(|(i, _)| *i == inst) {
            value.insert(m, same);
            continue;
        }
        insts.push(inst);
        // A half op computes in f32 and stores its type's nearest value: so does its
        // instruction, for the unfused op's bits.
        let node = graph.node(m);
        if matches!(node.dtype, DType::F16 | DType::BF16)
            && !matches!(node.op, Op::Cast { .. })
            && !exact_in_half(&node.op)
        {
            insts.push(Inst::Cast(node.dtype, Ref::Value(insts.len() as u32 - 1)));
        }
        value.insert(m, Ref::Value(insts.len() as u32 - 1));
        made.push((inst, Ref::Value(insts.len() as u32 - 1)));
    }
    let matmul = product.and_then(|p| match graph.node(p).op {
        Op::MatMul { transpose_a, transpose_b } => Some(FusedMatMul { transpose_a, transpose_b }),
        _ => None,
    });
    let conv = product.and_then(|p| match graph.node(p).op {
        Op::Conv2d { window } => Some(window),
        _ => None,
    });
    (
        Fused {
            shape: shape.clone(),
            insts,
            reduce,
            matmul,
            conv,
            epilogue: Vec::new(),
            epilogue_operands: 0,
        },
        operands,
    )
}

/// Replaces the group by one fused node in the root's place: it takes the root's readers,
/// control edges, name and origin.
fn replace(graph: &mut Graph, group: &Group) -> Result<()> {
    let members = &group.members;
    let tip = *members.last().expect("a group has an elementwise member");
    let root = group.after.last().copied().or(group.reduce).unwrap_or(tip);
    let r = graph.node(root).clone();
    let reduce = group.reduce.and_then(|n| match &graph.node(n).op {
        Op::Reduce { op, axes, keepdims } => {
            Some(FusedReduce { op: *op, axes: axes.clone(), keepdims: *keepdims })
        }
        _ => None,
    });
    let (mut program, mut operands) =
        program(graph, members, &graph.node(tip).shape.clone(), reduce, group.matmul);
    // The product's factors stand in its place.
    if let Some(p) = group.matmul {
        let factors = graph.operands(p);
        operands.splice(0..1, factors);
    }
    // An epilogue reads the reduction as its operand 0, then operands of its own, last.
    if let (Some(red), false) = (group.reduce, group.after.is_empty()) {
        let (epilogue, extra) = self::program(graph, &group.after, &r.shape, None, Some(red));
        program.epilogue = epilogue.insts;
        program.epilogue_operands = extra.len() - 1;
        operands.extend_from_slice(&extra[1..]);
    }
    // Operands of several types, or casts inside: the program stores the root's type by a
    // last cast (`Fused::stored_dtype`).
    let casts = program.insts.iter().chain(&program.epilogue).any(|i| matches!(i, Inst::Cast(..)));
    if casts || operands.iter().any(|&o| graph.node(o).dtype != r.dtype) {
        let last = if program.epilogue.is_empty() { &mut program.insts } else { &mut program.epilogue };
        if !matches!(last.last(), Some(Inst::Cast(to, _)) if *to == r.dtype) {
            let at = Ref::Value(last.len() as u32 - 1);
            last.push(Inst::Cast(r.dtype, at));
        }
    }
    let fused = graph.add(Node { op: Op::Fused(program), ..r }, &operands);
    graph.replace_uses(root, fused);
    // Every reader now reads the fused node: what follows the root is ordered by control edges.
    let before = graph.control_predecessors(root);
    // In a fixed order: node ids freed here are reused by later nodes, and orders read ids, so a
    // hash set's order would make plans differ from run to run.
    let mut removed: Vec<NodeId> = group.nodes().collect();
    removed.sort_unstable();
    let mut after: Vec<NodeId> =
        removed.iter().flat_map(|&m| graph.successors(m).collect::<Vec<_>>()).collect();
    after.sort_unstable();
    after.dedup();
    after.retain(|a| removed.binary_search(a).is_err() && *a != fused);
    for b in before {
        graph.add_control(b, fused);
    }
    for a in after {
        graph.add_control(fused, a);
    }
    for m in removed {
        graph.remove(m);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Init;
    use crate::passes;
    use crate::trace::Tracer;

    fn fused_ops(g: &Graph) -> Vec<(Fused, usize)> {
        g.node_ids()
            .filter_map(|n| match &g.node(n).op {
                Op::Fused(f) => Some((f.clone(), g.operands(n).len())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_chain_becomes_one_op_and_shared_values_stay() {
        let t = Tracer::new("chain");
        let x = t.input("x", [4, 8]);
        let b = t.param("b", [8], Init::Zeros);
        let h = (&x + &b).sigmoid(); // read by the reduction too: it stays a tensor
        let y = (&h * 2.0 + 1.0).tanh();
        let z = &h - &y;
        t.output("z", &z);
        t.output("total", &h.sum(vec![0, 1], false));
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        let before = g.len();
        let figures = fuse(&mut g, Products::All).unwrap();
        // sigmoid(x + b), then z = h - tanh(h * 2 + 1): two groups of 2 and 4 ops.
        assert_eq!(figures, FusionFigures { groups: 2, ops: 6, product_updates: 0, waiting: 0 });
        assert_eq!(g.len(), before - 6 + 2);
        let ops = fused_ops(&g);
        let texts: Vec<String> = ops.iter().map(|(f, _)| f.text()).collect();
        assert!(texts.contains(&"v0 = add(x0, x1); v1 = sigmoid(v0)".to_string()), "{texts:?}");
        assert!(
            texts.contains(
                &"v0 = mul_scalar[2](x0); v1 = add_scalar[1](v0); v2 = tanh(v1); v3 = sub(x0, v2)"
                    .to_string()
            ),
            "{texts:?}"
        );
        for (f, operands) in &ops {
            assert_eq!(f.check(*operands), Ok(()));
        }
    }

    #[test]
    fn outputs_broadcasts_and_smaller_values() {
        let t = Tracer::new("edges");
        let x = t.input("x", [4, 8]);
        let s = t.input("s", [4, 1]);
        let scaled = (&s * 3.0).exp(); // [4, 1]: fewer elements than the root, so not fused with it
        let wide = scaled.broadcast_to([4, 8]); // read by the root only: joins as no instruction
        let a = (&x * &wide).relu();
        t.output("a", &a);
        let out = (&x + 1.0).named("kept");
        t.output("kept", &out); // an output is never an inner value
        t.output("k2", &(&out * 2.0));
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        fuse(&mut g, Products::All).unwrap();
        let texts: Vec<String> = fused_ops(&g).iter().map(|(f, _)| f.text()).collect();
        assert!(texts.contains(&"v0 = mul(x1, x0); v1 = relu(v0)".to_string()), "{texts:?}");
        assert!(texts.contains(&"v0 = mul_scalar[3](x0); v1 = exp(v0)".to_string()), "{texts:?}");
        assert!(!g.node_ids().any(|n| matches!(g.node(n).op, Op::BroadcastTo { .. })));
        assert!(g.node_ids().any(|n| matches!(g.node(n).op, Op::Scalar { value, .. } if value == 1.0)));
    }

    #[test]
    fn a_reduction_takes_the_chain_it_alone_reads() {
        // The cross-entropy pattern: -sum(y * log_softmax(z)) keeps no [.., vocab] product.
        let t = Tracer::new("ce");
        let z = t.input("z", [4, 10]);
        let y = t.input("y", [4, 10]);
        let loss = (&y * &z.log_softmax(-1)).sum(vec![-1], false).mean(vec![0], false);
        t.output("loss", &-loss);
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        fuse(&mut g, Products::All).unwrap();
        let reducing: Vec<Fused> =
            fused_ops(&g).into_iter().map(|(f, _)| f).filter(|f| f.reduce.is_some()).collect();
        assert_eq!(reducing.len(), 1, "{:?}", fused_ops(&g));
        assert_eq!(reducing[0].text(), "v0 = mul(x0, x1); reduce_sum[1](v0)");
        assert!(!g.node_ids().any(|n| matches!(g.node(n).op, Op::Binary(_))));
        // A chain read by something else too stays unfused with the reduction.
        let t = Tracer::new("shared");
        let x = t.input("x", [4, 10]);
        let e = x.exp();
        t.output("s", &e.sum(vec![-1], false));
        t.output("e2", &(&e * 2.0));
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        fuse(&mut g, Products::All).unwrap();
        assert!(fused_ops(&g).iter().all(|(f, _)| f.reduce.is_none()));
    }

    #[test]
    fn a_reduction_with_prologue_and_epilogue_is_one_op() {
        // Layer norm's deviation: rsqrt(mean((x - m)^2) + eps), the centred input read twice.
        let t = Tracer::new("ln");
        let x = t.input("x", [4, 16]);
        let centred = &x - &x.mean(vec![-1], true);
        let rstd = ((&centred * &centred).mean(vec![-1], true) + 1e-5).rsqrt();
        t.output("y", &(&centred * &rstd));
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        fuse(&mut g, Products::All).unwrap();
        let with_epilogue: Vec<Fused> =
            fused_ops(&g).into_iter().map(|(f, _)| f).filter(|f| !f.epilogue.is_empty()).collect();
        assert_eq!(with_epilogue.len(), 1, "{:?}", fused_ops(&g));
        let f = &with_epilogue[0];
        assert_eq!(
            f.text(),
            "v0 = mul(x0, x0); reduce_mean[1](v0); then x0 = the reduction: v0 = add_scalar[0.00001](x0); v1 = rsqrt(v0)"
        );
        assert_eq!(f.epilogue_operands, 0);
    }

    #[test]
    fn limits_split_long_chains() {
        let t = Tracer::new("long");
        let x = t.input("x", [16]);
        let mut y = x.clone();
        for _ in 0..150 {
            y = (&y * 1.5).tanh();
        }
        t.output("y", &y);
        let mut g = t.finish().unwrap();
        passes::default_pipeline().run(&mut g).unwrap();
        fuse(&mut g, Products::All).unwrap();
        let ops = fused_ops(&g);
        assert!(ops.len() >= 5, "300 ops in groups of at most {MAX_FUSED_INSTS}");
        assert_eq!(ops.iter().map(|(f, _)| f.insts.len()).sum::<usize>(), 300);
        assert!(ops.iter().all(|(f, n)| f.check(*n).is_ok()));
    }
}
