//! Lowers a scheduled graph with its liveness and per-device arena placements into a `Plan`.

use crate::device::DeviceSpec;
use crate::ir::{Graph, NodeId, Op, VarRole};
use crate::liveness::{Liveness, StorageClass};
use crate::plan::{Binding, Buffer, DevicePlan, MemoryFigures, Plan, Step, Storage, Value, VariableSpec};
use crate::planner::{self, Interval, Placement};
use std::collections::HashMap;

/// One device's arena: the buffers placed in it (indices into `Liveness::buffers`), their
/// intervals, and where the planner put them.
pub struct DeviceArena {
    /// The device the arena belongs to.
    pub spec: DeviceSpec,
    /// The buffers placed in this arena, as indices into `Liveness::buffers`.
    pub buffers: Vec<usize>,
    /// Each of those buffers' lifetime and size, in the same order, as the planner saw them.
    pub intervals: Vec<Interval>,
    /// The planner's offsets for those buffers, in the same order, and the arena's size.
    pub placement: Placement,
}

/// Everything `plan` needs to turn a scheduled, planned graph into a `Plan`.
pub struct Lowering<'a> {
    /// The graph, after every pass.
    pub graph: &'a Graph,
    /// Its buffers and lifetimes in the schedule's order.
    pub live: &'a Liveness,
    /// One placed arena per device, in the plan's device order.
    pub arenas: &'a [DeviceArena],
    /// The slot alignment in bytes, for variable slots and the aligned figures.
    pub alignment: usize,
    /// Guard mode's canary after every io slot (the arena placement already includes it).
    pub guard_bytes: usize,
}

impl Lowering<'_> {
    /// Builds the plan: variables and their region offsets, buffers, values, steps, bindings and
    /// each device's memory figures with their totals.
    pub fn plan(&self) -> Plan {
        let (graph, live, align) = (self.graph, self.live, self.alignment);
        let device_index: HashMap<u32, usize> =
            self.arenas.iter().enumerate().map(|(i, a)| (a.spec.id.0, i)).collect();
        let mut variables = Vec::new();
        let mut var_index: HashMap<String, usize> = HashMap::new();
        for v in graph.variables() {
            let node = graph.node(v);
            if let Op::Variable { key, shape, dtype, role, init } = &node.op {
                var_index.insert(key.clone(), variables.len());
                variables.push(VariableSpec {
                    key: key.clone(),
                    device: device_index[&node.device.0],
                    shape: shape.clone(),
                    dtype: *dtype,
                    role: *role,
                    init: *init,
                    offset: 0,
                });
            }
        }
        // One variable region per device, slots in declaration order.
        let mut region = vec![0usize; self.arenas.len()];
        for v in &mut variables {
            v.offset = region[v.device];
            region[v.device] += planner::align(v.bytes(), align);
        }

        let mut arena_offset: HashMap<usize, usize> = HashMap::new();
        for a in self.arenas {
            arena_offset.extend(a.buffers.iter().zip(&a.placement.offsets).map(|(&b, &o)| (b, o)));
        }
        // Inputs and outputs are arena buffers like any other (see `liveness`): `compile` leaves
        // every io region empty. (`Storage::Io` stays in the plan format for plans made by hand.)
        let io_top = vec![0usize; self.arenas.len()];
        let buffers: Vec<Buffer> = live
            .buffers
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let device = device_index[&b.device.0];
                let storage = match &b.class {
                    StorageClass::Variable(key) => Storage::Variable { index: var_index[key] },
                    StorageClass::Arena
                    | StorageClass::Input(_)
                    | StorageClass::Output(_)
                    | StorageClass::Scratch => Storage::Arena { device, offset: arena_offset[&i] },
                };
                let producer = graph.node(b.producer);
                let label = match b.class {
                    StorageClass::Scratch => format!("scratch of {}", producer.describe()),
                    _ => producer.describe(),
                };
                Buffer {
                    bytes: b.bytes,
                    storage,
                    first_step: b.start,
                    last_step: b.end,
                    label,
                    origin: producer.origin.map(|o| o.to_string()),
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
                    offset: live.offset(n),
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
                    scratch: live.scratch_of.get(&n).copied(),
                    device: device_index[&node.device.0],
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

        let devices: Vec<DevicePlan> = self
            .arenas
            .iter()
            .enumerate()
            .map(|(d, a)| {
                let bound = planner::lower_bound(&a.intervals, align);
                let role_bytes = |roles: &[VarRole]| -> usize {
                    variables
                        .iter()
                        .filter(|v| v.device == d && roles.contains(&v.role))
                        .map(VariableSpec::bytes)
                        .sum()
                };
                let parameter_bytes = role_bytes(&[VarRole::Parameter]);
                let optimizer_state_bytes = role_bytes(&[VarRole::OptimizerState, VarRole::Counter]);
                let constant_bytes = role_bytes(&[VarRole::Constant]);
                let naive_bytes: usize = live
                    .naive_values(graph)
                    .filter(|(n, _)| graph.node(*n).device == a.spec.id)
                    .map(|(_, bytes)| planner::align(bytes, align))
                    .sum();
                DevicePlan {
                    device: a.spec.id,
                    name: a.spec.name.clone(),
                    memory_limit: a.spec.memory_limit,
                    memory: MemoryFigures {
                        arena_bytes: a.placement.arena_bytes,
                        lower_bound_bytes: bound.bytes,
                        lower_bound_step: bound.step,
                        naive_bytes,
                        parameter_bytes,
                        optimizer_state_bytes,
                        io_bytes: io_top[d],
                        constant_bytes,
                        persistent_bytes: parameter_bytes
                            + optimizer_state_bytes
                            + constant_bytes
                            + io_top[d],
                        variable_region_bytes: region[d],
                        algorithm: a.placement.algorithm.clone(),
                        tried: a.placement.tried.clone(),
                        ..Default::default()
                    },
                }
            })
            .collect();
        let memory = total(&devices);
        Plan {
            name: graph.name().to_string(),
            alignment: align,
            guard_bytes: self.guard_bytes,
            devices,
            buffers,
            values,
            steps,
            constants: variables
                .iter()
                .filter(|v| v.role == VarRole::Constant)
                .filter_map(|v| graph.constant(&v.key).map(|data| (v.key.clone(), data.to_vec())))
                .collect(),
            variables,
            inputs,
            outputs,
            memory,
        }
    }
}

/// The sum of the devices' figures (the lower bound too: each device's peak is its own).
fn total(devices: &[DevicePlan]) -> MemoryFigures {
    let mut m = MemoryFigures::default();
    for d in devices {
        let x = &d.memory;
        m.arena_bytes += x.arena_bytes;
        m.lower_bound_bytes += x.lower_bound_bytes;
        m.naive_bytes += x.naive_bytes;
        m.parameter_bytes += x.parameter_bytes;
        m.optimizer_state_bytes += x.optimizer_state_bytes;
        m.constant_bytes += x.constant_bytes;
        m.io_bytes += x.io_bytes;
        m.persistent_bytes += x.persistent_bytes;
        m.variable_region_bytes += x.variable_region_bytes;
    }
    if let [one] = devices {
        m.lower_bound_step = one.memory.lower_bound_step;
        m.algorithm = one.memory.algorithm.clone();
        m.tried = one.memory.tried.clone();
    } else {
        m.algorithm = devices
            .iter()
            .map(|d| format!("{}: {}", d.name, d.memory.algorithm))
            .collect::<Vec<_>>()
            .join(", ");
    }
    m
}
