//! Lowers a scheduled graph with its liveness and arena placement into a `Plan`.

use crate::ir::{Graph, NodeId, Op, OpClass, VarRole};
use crate::liveness::{Liveness, StorageClass};
use crate::plan::{Binding, Buffer, MemoryFigures, Plan, Step, Storage, Value, VariableSpec};
use crate::planner::{self, Interval, Placement};
use std::collections::HashMap;

pub struct Lowering<'a> {
    pub graph: &'a Graph,
    pub live: &'a Liveness,
    pub intervals: &'a [Interval],
    /// Buffer index of each interval.
    pub arena_buffers: &'a [usize],
    pub placement: &'a Placement,
    pub alignment: usize,
}

impl Lowering<'_> {
    pub fn plan(&self) -> Plan {
        let (graph, live, align) = (self.graph, self.live, self.alignment);
        let mut variables = Vec::new();
        let mut var_index: HashMap<String, usize> = HashMap::new();
        for v in graph.variables() {
            if let Op::Variable { key, shape, dtype, role, init } = &graph.node(v).op {
                var_index.insert(key.clone(), variables.len());
                variables.push(VariableSpec {
                    key: key.clone(),
                    shape: shape.clone(),
                    dtype: *dtype,
                    role: *role,
                    init: *init,
                });
            }
        }

        let arena_offset: HashMap<usize, usize> =
            self.arena_buffers.iter().zip(&self.placement.offsets).map(|(&b, &o)| (b, o)).collect();
        // The io region: inputs first, then outputs, each slot aligned.
        let mut io_top = 0;
        let buffers: Vec<Buffer> = live
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let storage = match &b.class {
                    StorageClass::Arena => Storage::Arena { offset: arena_offset[&i] },
                    StorageClass::Variable(key) => Storage::Variable { index: var_index[key] },
                    StorageClass::Input(_) | StorageClass::Output(_) => {
                        let offset = io_top;
                        io_top += planner::align(b.bytes, align);
                        Storage::Io { offset }
                    }
                };
                Buffer {
                    bytes: b.bytes,
                    storage,
                    first_step: b.start,
                    last_step: b.end,
                    label: graph.node(b.producer).describe(),
                }
            })
            .collect();

        let mut values = Vec::new();
        let mut value_of: HashMap<NodeId, usize> = HashMap::new();
        let mut value = |n: NodeId| -> usize {
            *value_of.entry(n).or_insert_with(|| {
                let node = graph.node(n);
                values.push(Value {
                    buffer: live.buffer_of[&n],
                    shape: node.shape.clone(),
                    dtype: node.dtype,
                });
                values.len() - 1
            })
        };
        let steps: Vec<Step> = live
            .steps
            .iter()
            .map(|&n| {
                let node = graph.node(n);
                let inputs = graph.operands(n).into_iter().map(&mut value).collect();
                let output = (!node.op.is_effect()).then(|| value(n));
                Step {
                    op: node.op.clone(),
                    inputs,
                    output,
                    in_place: live.in_place.contains(&n),
                    label: node.describe(),
                    origin: node.origin.map(|o| o.to_string()),
                }
            })
            .collect();
        let inputs = graph
            .inputs()
            .into_iter()
            .filter_map(|n| match &graph.node(n).op {
                Op::Input { name, .. } => Some(Binding { name: name.clone(), value: value(n) }),
                _ => None,
            })
            .collect();
        let outputs = graph
            .outputs()
            .iter()
            .map(|(name, n)| Binding { name: name.clone(), value: value(*n) })
            .collect();

        let bound = planner::lower_bound(self.intervals, align);
        let role_bytes = |roles: &[VarRole]| -> usize {
            variables.iter().filter(|v| roles.contains(&v.role)).map(VariableSpec::bytes).sum()
        };
        let parameter_bytes = role_bytes(&[VarRole::Parameter]);
        let optimizer_state_bytes = role_bytes(&[VarRole::OptimizerState, VarRole::Counter]);
        let naive: Vec<Interval> =
            live.naive_values(graph).map(|bytes| Interval { bytes, start: 0, end: 0 }).collect();
        let memory = MemoryFigures {
            arena_bytes: self.placement.arena_bytes,
            lower_bound_bytes: bound.bytes,
            lower_bound_step: bound.step,
            naive_bytes: planner::naive_bytes(&naive, align),
            parameter_bytes,
            optimizer_state_bytes,
            io_bytes: io_top,
            persistent_bytes: parameter_bytes + optimizer_state_bytes + io_top,
            algorithm: self.placement.algorithm.clone(),
            tried: self.placement.tried.clone(),
        };
        let device = graph.node_ids().map(|n| graph.node(n).device).find(|_| true).unwrap_or_default();
        debug_assert!(steps.iter().all(|s| s.op.class() != OpClass::View));
        Plan {
            name: graph.name().to_string(),
            device,
            alignment: align,
            buffers,
            values,
            steps,
            variables,
            inputs,
            outputs,
            memory,
        }
    }
}
