use super::{Changes, Pass};
use crate::error::Result;
use crate::ir::{Graph, Node, OpClass};

/// Every graph output gets a buffer of its own, written by a step: an output that is an input, a
/// variable or a view (reshape) of another buffer is copied. The runtime then reads outputs from
/// the plan's io region only.
pub struct MaterializeOutputs;

impl Pass for MaterializeOutputs {
    fn name(&self) -> &'static str {
        "materialize_outputs"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        let mut copies = 0;
        let outputs = graph.outputs().to_vec();
        for (i, (name, id)) in outputs.into_iter().enumerate() {
            let node = graph.node(id);
            if !matches!(node.op.class(), OpClass::Source | OpClass::View) {
                continue;
            }
            let copy =
                Node { op: crate::ir::Op::Copy, name: Some(name.clone()), origin: None, ..node.clone() };
            let c = graph.add(copy, &[id]);
            graph.outputs_mut()[i].1 = c;
            copies += 1;
        }
        Ok(Changes::count(copies))
    }
}
