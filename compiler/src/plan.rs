//! The compiler's output: plain, serialisable data that a backend executes without re-planning.
//!
//! A plan names every buffer's storage (an offset in its device's one arena, an offset in that
//! device's io region for inputs and outputs, or a persistent variable), every value's buffer and
//! shape, and the ordered steps (op, operand values, output value, device). A plan may span several
//! devices: each has its own arena, io region and figures in `devices`; `memory` sums them. (Steps
//! of different devices interleave in one order, so the per-device parts live in one plan rather
//! than one plan per device.) Every figure is computed from the plan itself; DESIGN.md defines them.

use crate::ir::{DType, DeviceId, Init, Op, Shape, VarRole};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// A compiled graph ready to run: its devices' arenas and figures, every buffer and value, the
/// ordered steps, the variables, and the input and output bindings (all indices are into this plan).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The traced graph's name (`Graph::name`), used in listings and messages.
    pub name: String,
    /// The byte alignment of every arena slot, io slot and variable slot (64 by default).
    pub alignment: usize,
    /// Guard mode: the canary after every arena and io slot (`crate::guard`); 0 when off. The
    /// canary of a buffer at `offset` is `[offset + bytes, offset + bytes + guard_bytes)`.
    #[serde(default)]
    pub guard_bytes: usize,
    /// The devices the plan uses, each with its own arena; storage refers to them by index.
    pub devices: Vec<DevicePlan>,
    /// Every buffer of the plan; `Value::buffer` and `Step::scratch` index it.
    pub buffers: Vec<Buffer>,
    /// Every value a step reads or writes (index `i` is `v{i}` in `render`).
    pub values: Vec<Value>,
    /// The steps in execution order, across all devices.
    pub steps: Vec<Step>,
    /// The persistent variables (parameters, optimizer state, counters, constants);
    /// `Storage::Variable` indexes it.
    pub variables: Vec<VariableSpec>,
    /// The values of the constant variables (`VarRole::Constant`, from `const_fold`) by key,
    /// row-major f32: the backends write them when they make the variable.
    #[serde(default)]
    pub constants: std::collections::BTreeMap<String, Vec<f32>>,
    /// The graph's inputs by name, each bound to the value the caller writes before a run.
    pub inputs: Vec<Binding>,
    /// The graph's outputs by name, each bound to the value the caller reads after a run.
    pub outputs: Vec<Binding>,
    /// Totals over the devices.
    pub memory: MemoryFigures,
}

/// One device's part of a plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DevicePlan {
    /// The device's id (`DeviceSpec::id`), as the graph's ops name it.
    pub device: DeviceId,
    /// The device's name for messages ("cpu:0", "gpu:0", ...).
    pub name: String,
    /// Bytes the plan may hold on this device (`MemoryFigures::held_bytes` is checked against it);
    /// `None`: unlimited.
    pub memory_limit: Option<usize>,
    /// This device's figures alone.
    pub memory: MemoryFigures,
}

/// Where a buffer lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Storage {
    /// `offset` bytes into the arena of `plan.devices[device]`.
    Arena {
        /// The device's index in `plan.devices`.
        device: usize,
        /// Bytes from the start of that device's arena.
        offset: usize,
    },
    /// `offset` bytes into the io region (inputs and outputs) of `plan.devices[device]`.
    Io {
        /// The device's index in `plan.devices`.
        device: usize,
        /// Bytes from the start of that device's io region.
        offset: usize,
    },
    /// The persistent variable `plan.variables[index]`.
    Variable {
        /// Index into `plan.variables`.
        index: usize,
    },
}

/// One piece of memory: its size, where it lives and the steps it is live over. Several values
/// may share it (in-place results, views).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    /// Its size in bytes (unaligned; the arena slot is aligned to `Plan::alignment`).
    pub bytes: usize,
    /// Where it lives: an arena slot, an io slot or a variable.
    pub storage: Storage,
    /// Live from `first_step` to `last_step` inclusive.
    pub first_step: usize,
    /// The last step (inclusive) that reads or writes it.
    pub last_step: usize,
    /// The op (and name) whose value first occupies the buffer.
    pub label: String,
    /// The user's source line that traced that op, when known.
    pub origin: Option<String>,
}

/// A tensor the steps read or write: a shape and dtype at an offset in a buffer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Value {
    /// Index into `plan.buffers` of the buffer that holds it.
    pub buffer: usize,
    /// Its shape (elements per axis).
    pub shape: Shape,
    /// Its element type.
    pub dtype: DType,
    /// Bytes into its buffer where the value starts: 0 but for the members of a concatenation
    /// written in place and contiguous slices read in place (`liveness`), a multiple of
    /// `liveness::VIEW_ALIGN`.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub offset: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// One op the backend runs, on one device, in the plan's order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The op to run, with its attributes.
    pub op: Op,
    /// Operand values in order.
    pub inputs: Vec<usize>,
    /// The value written; `None` for effects (which write their variable operands in place).
    pub output: Option<usize>,
    /// Whether the output shares an operand's buffer.
    pub in_place: bool,
    /// The buffer of the step's scratch (`crate::scratch`): arena memory its kernel may use
    /// during this step only, of that buffer's size; `None` when the kernel uses none.
    #[serde(default)]
    pub scratch: Option<usize>,
    /// Index into `plan.devices`.
    pub device: usize,
    /// The op's description for messages and listings: its kind and the scope path that traced it
    /// (or the variable's key, the input's name).
    pub label: String,
    /// The user's source line that traced the op, when known.
    pub origin: Option<String>,
}

/// A persistent variable: allocated once, kept across runs, initialised at first use.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VariableSpec {
    /// The variable's unique key (its scope path, e.g. `dense/kernel`), which checkpoints use.
    pub key: String,
    /// Index into `plan.devices`.
    pub device: usize,
    /// Its shape (elements per axis).
    pub shape: Shape,
    /// Its element type.
    pub dtype: DType,
    /// What it holds: a parameter, optimizer state, a step counter or a folded constant.
    pub role: VarRole,
    /// How a backend fills it the first time it makes it.
    pub init: Init,
    /// Byte offset in its device's variable region: every variable the plan declares on a
    /// device lives in one allocation (`MemoryFigures::variable_region_bytes`), in declaration
    /// order, each slot aligned to `Plan::alignment`.
    #[serde(default)]
    pub offset: usize,
}

impl VariableSpec {
    /// Its size in bytes: elements × the dtype's size (unaligned).
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size_bytes()
    }
}

/// A named input or output of the plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// The name the caller uses for it (the traced input's name, or the output's).
    pub name: String,
    /// Index into `plan.values` of the value it is bound to.
    pub value: usize,
}

/// Every memory figure of a plan, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryFigures {
    /// The planned arena (slots aligned; in guard mode with every slot's canary).
    pub arena_bytes: usize,
    /// Max over steps of the aligned bytes live at that step, and the first step at that peak
    /// (canaries not counted, nor in `naive_bytes`: guard mode leaves both as they are).
    pub lower_bound_bytes: usize,
    /// The step of the plan's order at which `lower_bound_bytes` is first reached (on the totals of
    /// several devices, 0: each device's peak has its own step).
    pub lower_bound_step: usize,
    /// Sum of every intermediate value's aligned bytes: no reuse.
    pub naive_bytes: usize,
    /// Parameters, optimizer state (with counters), and the io region.
    pub parameter_bytes: usize,
    /// Optimizer state and step counters (`VarRole::OptimizerState`, `VarRole::Counter`).
    pub optimizer_state_bytes: usize,
    /// Constants computed at compile time (`const_fold`), in the variable region.
    #[serde(default)]
    pub constant_bytes: usize,
    /// The io region for inputs and outputs; 0 from `compile`, which plans them in the arena.
    pub io_bytes: usize,
    /// parameters + optimizer state + constants + io.
    pub persistent_bytes: usize,
    /// The variable region: parameters and optimizer state in one allocation, aligned slots.
    #[serde(default)]
    pub variable_region_bytes: usize,
    /// The placement heuristic that won, and every one tried with its arena.
    pub algorithm: String,
    /// Each placement heuristic tried, with the arena bytes it gave (empty on the totals of several
    /// devices).
    pub tried: Vec<(String, usize)>,
    /// The execution order that won (`schedule::candidates`), and every one tried with its
    /// planned total bytes (set on the plan's totals only; for an order not placed, because its
    /// lower bound could not beat the best plan or the graph has `SEARCH_PLACES_ALL_BELOW` nodes
    /// or more, persistent bytes plus the arena's lower bound).
    #[serde(default)]
    pub schedule: String,
    /// Each candidate order tried, with its planned total bytes (or bound, as above).
    #[serde(default)]
    pub schedules: Vec<(String, usize)>,
    /// How many optimizer updates run in blocks of rows (`tiled_updates`; set on the totals),
    /// 0 where the untiled graph planned smaller.
    #[serde(default)]
    pub tiled_updates: usize,
    /// What the graph rewrites did (`RewriteFigures`; set on the totals), its fields at this
    /// level in the JSON.
    #[serde(flatten)]
    pub rewrites: RewriteFigures,
    /// Optimizer updates that compute their own gradient product (`product_updates`; set on the
    /// totals): each replaces two ops, and the gradient is never stored.
    #[serde(default)]
    pub product_updates: usize,
    /// The blocks of batch rows the forward pass runs in (`batch_blocks`; set on the totals),
    /// 0 where the graph planned smaller whole.
    #[serde(default)]
    pub batch_blocks: usize,
    /// What rematerialization recomputed to fit a memory limit (set on the totals), if anything.
    #[serde(default)]
    pub remat: Option<RematFigures>,
}

/// What rematerialization (`remat`) did to a plan (`MemoryFigures::remat`, set on the plan's totals).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RematFigures {
    /// The recomputed values, as reports name them (op and layer), in the order chosen.
    pub recomputed: Vec<String>,
    /// Ops added to the step: the recomputed values and the operands recomputed with them.
    #[serde(default)]
    pub recomputed_ops: usize,
    /// FLOPs added per step (`Op::flops` estimates).
    pub recomputed_flops: u64,
    /// The planned total (persistent + arenas, every device) of the plan without
    /// rematerialization, and of the plan with it.
    pub bytes_before: usize,
    /// The planned total with rematerialization, in bytes.
    pub bytes_after: usize,
}

impl RematFigures {
    /// Bytes saved against the plan without rematerialization.
    pub fn bytes_saved(&self) -> usize {
        self.bytes_before.saturating_sub(self.bytes_after)
    }

    /// One line for reports: `3 values recomputed (5 ops, 237.0 MFLOP a step), 38.52 MiB -> ...`.
    pub fn summary(&self) -> String {
        format!(
            "{} values recomputed ({} ops, {} a step), planned total {} -> {} ({} saved)",
            self.recomputed.len(),
            self.recomputed_ops,
            human_flops(self.recomputed_flops),
            crate::device::human_bytes(self.bytes_before),
            crate::device::human_bytes(self.bytes_after),
            crate::device::human_bytes(self.bytes_saved())
        )
    }
}

/// FLOPs as reports print them: `237.0 MFLOP`.
pub fn human_flops(flops: u64) -> String {
    const UNITS: [&str; 5] = ["FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP"];
    let mut v = flops as f64;
    let mut u = 0;
    while v >= 1000.0 && u + 1 < UNITS.len() {
        v /= 1000.0;
        u += 1;
    }
    if u == 0 { format!("{flops} FLOP") } else { format!("{v:.1} {}", UNITS[u]) }
}

/// What the graph rewrites before the schedule search did (`passes::PassLog`, recorded once by
/// `compile` on the plan's totals): each counts what it replaced.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RewriteFigures {
    /// Each pass that changed the graph, with how many rewrites it made, in the order they ran
    /// (a pass run again in a fixed-point group is listed again).
    #[serde(default)]
    pub passes: Vec<(String, usize)>,
    /// Fused ops in the plan's graph and the elementwise ops they replaced (`fusion`).
    #[serde(default)]
    pub fused_groups: usize,
    /// The elementwise ops those fused groups replaced.
    #[serde(default)]
    pub fused_ops: usize,
    /// Products that, fused with the group that reads them, wait for a value of their shape
    /// (`fusion::Products`; a tied table's gradient): `compile` plans the graph with them apart
    /// and fused, and the plan's schedule name carries "+waiting" where they are fused.
    #[serde(default)]
    pub waiting_products: usize,
    /// Log-softmaxes split into their row statistics (`log_softmax_split`) and the ops that
    /// added before fusion (each split removes one op and adds the statistics' five and two per
    /// reader).
    #[serde(default)]
    pub log_softmax_splits: usize,
    /// The ops the splits added before fusion.
    #[serde(default)]
    pub split_added_ops: usize,
    /// Convolution input gradients fused with the ReLU gradient that read them
    /// (`conv_relu_grad`): each replaces two ops.
    #[serde(default)]
    pub conv_relu_grads: usize,
    /// Constants folded at compile time (`const_fold`) and the graph nodes they replaced.
    #[serde(default)]
    pub folded_constants: usize,
    /// The graph nodes those constants replaced.
    #[serde(default)]
    pub folded_ops: usize,
    /// What the training step recomputes in its backward pass instead of keeping
    /// (`saved_values`), if anything.
    #[serde(default)]
    pub saved_values: Option<SavedValuesFigures>,
}

impl RewriteFigures {
    /// Adds `other`'s counts to these (a pass run again adds to what it did before) and takes
    /// its saved values where it has them.
    pub fn merge(&mut self, other: &RewriteFigures) {
        self.passes.extend(other.passes.iter().cloned());
        self.fused_groups += other.fused_groups;
        self.fused_ops += other.fused_ops;
        self.waiting_products += other.waiting_products;
        self.log_softmax_splits += other.log_softmax_splits;
        self.split_added_ops += other.split_added_ops;
        self.conv_relu_grads += other.conv_relu_grads;
        self.folded_constants += other.folded_constants;
        self.folded_ops += other.folded_ops;
        if other.saved_values.is_some() {
            self.saved_values.clone_from(&other.saved_values);
        }
    }
}

/// The forward values a training step recomputes in its backward pass instead of keeping
/// (`saved_values`): what the minimum cut chose, and what it costs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedValuesFigures {
    /// Ops added to the backward pass (views aside).
    pub recomputed_ops: usize,
    /// FLOPs those ops add per step (`ir::Op::flops`).
    pub recomputed_flops: u64,
    /// The step's FLOPs before the rewrite.
    pub step_flops: u64,
    /// Bytes of the forward values the backward pass reads (sources aside), before the rewrite.
    pub kept_bytes_before: usize,
    /// The same after it: what is kept for the backward pass.
    pub kept_bytes_after: usize,
}

impl MemoryFigures {
    /// persistent + arena: everything the plan holds on the device.
    pub fn planned_total_bytes(&self) -> usize {
        self.persistent_bytes + self.arena_bytes
    }

    /// The bytes a backend takes for the plan on a device: its variable region (the variables'
    /// bytes with each slot aligned), io region and arena. What memory limits are checked against.
    pub fn held_bytes(&self) -> usize {
        let variables = self.variable_region_bytes.max(self.parameter_bytes + self.optimizer_state_bytes);
        variables + self.io_bytes + self.arena_bytes
    }

    /// One device's figures as the device hands them out: the plan's one allocation there (its
    /// variable region, io region and arena, `device_block`), rounded up to `granularity` bytes
    /// (the driver's: `DEVICE_GRANULARITY`). `align` is where each piece starts
    /// (`Plan::block_align`). On a plan's totals (several devices) use `Plan::device_bytes`.
    pub fn device_bytes(&self, granularity: usize, align: usize) -> usize {
        device_block([self.variable_region_bytes, self.io_bytes, self.arena_bytes], align)
            .map_or(usize::MAX, |(_, bytes)| bytes.next_multiple_of(granularity.max(1)))
    }
}

/// The granularity a CUDA driver maps device memory in (`cuMemGetAllocationGranularity` gives
/// 2 MiB on current GPUs): what an allocation of any size takes from the device.
pub const DEVICE_GRANULARITY: usize = 2 << 20;

/// The alignment of every allocation a backend makes (cuMemAlloc's and the host buffers'), and
/// so the least alignment of the pieces of a plan's block.
pub const BLOCK_ALIGN: usize = 256;

/// The one allocation a backend makes for a plan on one device under memory growth: the
/// variable region the plan adds (0 when its variables are held already), its io region and its
/// arena (0 when the caller owns it), one after another, each starting at a multiple of `align`.
/// Returns where each piece starts and the allocation's size (a multiple of `align`), or None
/// when the sizes overflow.
///
/// Why one allocation: a driver hands out whole granules (2 MiB), so three allocations of a
/// small plan take three granules where one holds them all: the seed model's training step
/// (27,232 bytes) took 4 MiB of the device as a variable region and an arena, 2 MiB as one block,
/// the same 2 MiB that TensorFlow's BFC allocator reserves for it eagerly; the zoo's transformer
/// step 50.3 MB as two allocations, 48.2 MB as one.
pub fn device_block(pieces: [usize; 3], align: usize) -> Option<([usize; 3], usize)> {
    let align = align.max(1);
    let mut offsets = [0; 3];
    let mut top = 0usize;
    for (offset, &bytes) in offsets.iter_mut().zip(&pieces) {
        *offset = top.checked_next_multiple_of(align)?;
        top = offset.checked_add(bytes)?;
    }
    Some((offsets, top.checked_next_multiple_of(align)?))
}

impl Plan {
    /// What the devices hand out for the plan loaded alone: on each device one allocation for
    /// its variable region, io region and arena (`device_block`), rounded up to `granularity`
    /// (`DEVICE_GRANULARITY` unless measured). Counted like an allocator's reserved bytes, which
    /// are whole segments.
    pub fn device_bytes(&self, granularity: usize) -> usize {
        self.devices.iter().map(|d| d.memory.device_bytes(granularity, self.block_align())).sum()
    }

    /// Where the pieces of this plan's block start (`device_block`): a multiple of the plan's
    /// alignment and of every allocation's.
    pub fn block_align(&self) -> usize {
        self.alignment.max(BLOCK_ALIGN)
    }

    /// The value at index `i` of `values` (`v{i}` in `render`); panics when out of range.
    pub fn value(&self, i: usize) -> &Value {
        &self.values[i]
    }

    /// The input bound to `name`, or `None` when the plan has no such input.
    pub fn input(&self, name: &str) -> Option<&Binding> {
        self.inputs.iter().find(|b| b.name == name)
    }

    /// The output bound to `name`, or `None` when the plan has no such output.
    pub fn output(&self, name: &str) -> Option<&Binding> {
        self.outputs.iter().find(|b| b.name == name)
    }

    /// A readable listing of the plan (snapshot-tested): figures, variables, then one line a step
    /// with where its output lives and for how long.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let names: Vec<&str> = self.devices.iter().map(|d| d.name.as_str()).collect();
        let _ = write!(s, "plan {:?} on {}: {} steps", self.name, names.join(", "), self.steps.len());
        if self.guard_bytes > 0 {
            let _ = write!(s, " (guard mode: {} B canary after every slot)", self.guard_bytes);
        }
        s.push('\n');
        for d in &self.devices {
            let m = &d.memory;
            let _ = writeln!(
                s,
                "  {}: arena {} B (lower bound {} B at step {}, naive {} B, {}), io {} B, parameters {} B, optimizer state {} B",
                d.name,
                m.arena_bytes,
                m.lower_bound_bytes,
                m.lower_bound_step,
                m.naive_bytes,
                m.algorithm,
                m.io_bytes,
                m.parameter_bytes,
                m.optimizer_state_bytes
            );
        }
        if !self.memory.rewrites.passes.is_empty() {
            let passes: Vec<String> =
                self.memory.rewrites.passes.iter().map(|(name, n)| format!("{name} {n}")).collect();
            let _ = writeln!(s, "  rewrites: {}", passes.join(", "));
        }
        if let Some(r) = &self.memory.remat {
            let _ = writeln!(s, "  rematerialization: {}", r.summary());
            let _ = writeln!(s, "    recomputed: {}", r.recomputed.join(", "));
        }
        let multi = self.devices.len() > 1;
        for v in &self.variables {
            let _ = writeln!(s, "  var {} : {}{} ({:?})", v.key, v.dtype, v.shape, v.role);
        }
        let value = |i: usize| {
            let v = &self.values[i];
            let dev = |d: usize| if multi { format!("{}:", self.devices[d].name) } else { String::new() };
            let where_ = match self.buffers[v.buffer].storage {
                Storage::Arena { device, offset } if v.offset > 0 => {
                    format!("{}arena@{offset}+{}", dev(device), v.offset)
                }
                Storage::Arena { device, offset } => format!("{}arena@{offset}", dev(device)),
                Storage::Io { device, offset } => format!("{}io@{offset}", dev(device)),
                Storage::Variable { index } => format!("var {}", self.variables[index].key),
            };
            format!("{}{} {where_}", v.dtype, v.shape)
        };
        for (i, step) in self.steps.iter().enumerate() {
            let ins: Vec<String> = step.inputs.iter().map(|&v| format!("v{v}")).collect();
            let _ = write!(s, "  {i:>3} {}({})", step.op.label(), ins.join(", "));
            if let Some(o) = step.output {
                let b = &self.buffers[self.values[o].buffer];
                let _ = write!(s, " -> v{o} {} live {}..{}", value(o), b.first_step, b.last_step);
                if step.in_place {
                    s.push_str(" in-place");
                } else if b.label != step.label {
                    // A piece written inside a concatenation's buffer (a gradient bucket's).
                    let _ = write!(s, " in {}", b.label);
                }
            }
            if step.op.is_collective() {
                let _ = write!(s, " ({})", step.label);
            }
            if let Some(b) = step.scratch {
                let buf = &self.buffers[b];
                if let Storage::Arena { offset, .. } = buf.storage {
                    let _ = write!(s, " scratch {} B arena@{offset}", buf.bytes);
                }
            }
            s.push('\n');
        }
        for (kind, list) in [("input", &self.inputs), ("output", &self.outputs)] {
            for b in list {
                let _ = writeln!(s, "  {kind} {} = v{} {}", b.name, b.value, value(b.value));
            }
        }
        s
    }
}
