use super::{Changes, Pass};
use crate::error::Result;
use crate::ir::{Graph, NodeId, Op, OpClass};

/// An effect writes a variable in place, so it must run after every other reader of that
/// variable's storage — including the readers of views (reshapes) of it. This pass adds those
/// control edges (write-after-read ordering). Updates of disjoint blocks of rows of the same
/// variable (`tiled_updates`) touch different elements and are not ordered against each other.
pub struct OrderEffects;

impl Pass for OrderEffects {
    fn name(&self) -> &'static str {
        "order_effects"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let mut added = 0;
        for effect in graph.effects() {
            let operands = graph.operands(effect);
            let mutated: Vec<NodeId> =
                graph.node(effect).op.mutated_operands().iter().map(|&i| operands[i]).collect();
            for var in mutated {
                for reader in storage_readers(graph, var) {
                    if reader != effect
                        && !later_update(graph, reader, effect, var)
                        && !disjoint_blocks(graph, reader, effect)
                        && !gathers_after(graph, reader, effect)
                    {
                        added += usize::from(graph.add_control(reader, effect));
                    }
                }
            }
        }
        Ok(Changes::count(added))
    }
}

/// Whether `reader` is the all-gather that follows the sharded update `effect` of the same
/// variable (`zero`): it reads the shard the update writes, so it runs after it, not before.
fn gathers_after(graph: &Graph, reader: NodeId, effect: NodeId) -> bool {
    matches!(graph.node(reader).op, Op::AllGather { .. })
        && graph.node(effect).op.is_effect()
        && graph.node(effect).op.shard().is_some()
}

/// Whether `reader` is itself an update of `var` recorded after `effect`: two updates of one
/// variable each read what the other writes, and they run in the order they were recorded (an
/// edge each way would be a cycle). An imported model may update one stored tensor twice: an
/// exporter that merges equal initializers can make one tensor of ones both a batch norm's
/// scale (trained) and another's running variance (updated by the step).
fn later_update(graph: &Graph, reader: NodeId, effect: NodeId, var: NodeId) -> bool {
    let op = &graph.node(reader).op;
    op.is_effect()
        && reader.index() > effect.index()
        && op.mutated_operands().iter().any(|&i| graph.operands(reader).get(i) == Some(&var))
}

/// Whether `a` and `b` are updates of disjoint blocks of rows.
fn disjoint_blocks(graph: &Graph, a: NodeId, b: NodeId) -> bool {
    let rows = |n: NodeId| match graph.node(n).op {
        Op::ApplyAdam { rows, .. } | Op::ApplySgd { rows, .. } => rows,
        _ => None,
    };
    match (rows(a), rows(b)) {
        (Some(x), Some(y)) => {
            let (xe, ye) = (x.start.saturating_add(x.len), y.start.saturating_add(y.len));
            xe <= y.start || ye <= x.start
        }
        _ => false,
    }
}

/// Nodes that read `id`'s storage: its users, and through views the users of those.
fn storage_readers(graph: &Graph, id: NodeId) -> Vec<NodeId> {
    let mut out = Vec::new();
    let mut stack = vec![id];
    while let Some(n) = stack.pop() {
        for u in graph.users(n) {
            if graph.node(u).op.class() == OpClass::View {
                stack.push(u);
            } else {
                out.push(u);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Init;
    use crate::trace::Tracer;

    /// Two updates of one variable (an exporter's merged initializer: one batch norm's scale and
    /// another's running variance) run in the order recorded, after every other reader.
    #[test]
    fn two_updates_of_one_variable_are_ordered_without_a_cycle() {
        let t = Tracer::new("two updates");
        let v = t.param("shared", [4], Init::Constant(1.0));
        let x = t.input("x", [4]);
        t.output("y", &(&x * &v));
        let sgd = |lr: f32| Op::ApplySgd {
            lr,
            momentum: 0.0,
            nesterov: false,
            rows: None,
            product: false,
            shard: None,
        };
        let first = v.record(sgd(0.1), &[&v, &x]);
        let second = v.record(sgd(0.2), &[&v, &(&x * 2.0)]);
        let mut g = t.finish().unwrap();
        crate::passes::default_pipeline().run(&mut g).expect("no cycle");
        let order = petgraph::algo::toposort(g.petgraph(), None).unwrap();
        let at = |n: NodeId| order.iter().position(|&m| m == n).unwrap();
        let (first, second) = (first.id().unwrap(), second.id().unwrap());
        assert!(at(first) < at(second), "the updates run in the order they were recorded");
        let var = g.operands(first)[0];
        for reader in storage_readers(&g, var).into_iter().filter(|&r| !g.node(r).op.is_effect()) {
            assert!(
                at(reader) < at(first),
                "{} reads the variable before its updates",
                g.node(reader).describe()
            );
        }
    }
}
