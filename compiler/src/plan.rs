//! The compiler's output: plain, serialisable data that a backend executes without re-planning.
//!
//! A plan names every buffer's storage (an offset in the device's one arena, an offset in the
//! io region for inputs and outputs, or a persistent variable), every value's buffer and shape,
//! and the ordered steps (op, operand values, output value). Its `memory` figures are computed
//! from the plan itself; DESIGN.md defines them.

use crate::ir::{DType, DeviceId, Init, Op, Shape, VarRole};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub name: String,
    pub device: DeviceId,
    pub alignment: usize,
    pub buffers: Vec<Buffer>,
    pub values: Vec<Value>,
    pub steps: Vec<Step>,
    pub variables: Vec<VariableSpec>,
    pub inputs: Vec<Binding>,
    pub outputs: Vec<Binding>,
    pub memory: MemoryFigures,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Storage {
    /// `offset` bytes into the device's arena.
    Arena { offset: usize },
    /// `offset` bytes into the plan's io region (inputs and outputs).
    Io { offset: usize },
    /// The persistent variable `plan.variables[index]`.
    Variable { index: usize },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Buffer {
    pub bytes: usize,
    pub storage: Storage,
    /// Live from `first_step` to `last_step` inclusive.
    pub first_step: usize,
    pub last_step: usize,
    /// The op (and name) whose value first occupies the buffer.
    pub label: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Value {
    pub buffer: usize,
    pub shape: Shape,
    pub dtype: DType,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    pub op: Op,
    /// Operand values in order.
    pub inputs: Vec<usize>,
    /// The value written; `None` for effects (which write their variable operands in place).
    pub output: Option<usize>,
    /// Whether the output shares an operand's buffer.
    pub in_place: bool,
    pub label: String,
    /// The user's source line that traced the op, when known.
    pub origin: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VariableSpec {
    pub key: String,
    pub shape: Shape,
    pub dtype: DType,
    pub role: VarRole,
    pub init: Init,
}

impl VariableSpec {
    pub fn bytes(&self) -> usize {
        self.shape.numel() * self.dtype.size_bytes()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    pub name: String,
    pub value: usize,
}

/// Every memory figure of a plan, in bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryFigures {
    /// The planned arena (slots aligned).
    pub arena_bytes: usize,
    /// Max over steps of the aligned bytes live at that step, and the first step at that peak.
    pub lower_bound_bytes: usize,
    pub lower_bound_step: usize,
    /// Sum of every intermediate value's aligned bytes: no reuse.
    pub naive_bytes: usize,
    /// Parameters, optimizer state (with counters), and the io region.
    pub parameter_bytes: usize,
    pub optimizer_state_bytes: usize,
    pub io_bytes: usize,
    /// parameters + optimizer state + io.
    pub persistent_bytes: usize,
    /// The placement heuristic that won, and every one tried with its arena.
    pub algorithm: String,
    pub tried: Vec<(String, usize)>,
}

impl MemoryFigures {
    /// persistent + arena: everything the plan holds on the device.
    pub fn planned_total_bytes(&self) -> usize {
        self.persistent_bytes + self.arena_bytes
    }
}

impl Plan {
    pub fn value(&self, i: usize) -> &Value {
        &self.values[i]
    }

    pub fn input(&self, name: &str) -> Option<&Binding> {
        self.inputs.iter().find(|b| b.name == name)
    }

    pub fn output(&self, name: &str) -> Option<&Binding> {
        self.outputs.iter().find(|b| b.name == name)
    }

    /// A readable listing of the plan (snapshot-tested): figures, variables, then one line a step
    /// with where its output lives and for how long.
    pub fn render(&self) -> String {
        let m = &self.memory;
        let mut s = String::new();
        let _ = writeln!(s, "plan {:?} on device {}: {} steps", self.name, self.device.0, self.steps.len());
        let _ = writeln!(
            s,
            "  arena {} B (lower bound {} B at step {}, naive {} B, {}), io {} B, parameters {} B, optimizer state {} B",
            m.arena_bytes,
            m.lower_bound_bytes,
            m.lower_bound_step,
            m.naive_bytes,
            m.algorithm,
            m.io_bytes,
            m.parameter_bytes,
            m.optimizer_state_bytes
        );
        for v in &self.variables {
            let _ = writeln!(s, "  var {} : {}{} ({:?})", v.key, v.dtype, v.shape, v.role);
        }
        let value = |i: usize| {
            let v = &self.values[i];
            let where_ = match self.buffers[v.buffer].storage {
                Storage::Arena { offset } => format!("arena@{offset}"),
                Storage::Io { offset } => format!("io@{offset}"),
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
