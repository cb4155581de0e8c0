//! A plain reference interpreter: the graph run op by op with every value in a buffer of its own.
//!
//! No arena, no reuse, no in-place writes, no allocator: each node's value is a fresh buffer
//! of its own (8-byte aligned, any dtype) that lives until the call returns, a view (reshape) is a copy, and variables live in a map.
//! What it checks, run beside the planned and the eager executors on the same graph, is
//! everything those add on top of the kernels: buffer assignment, lifetimes, reuse, in-place
//! execution, views and the eager executor's bookkeeping. It runs the same CPU kernels (they are
//! checked against hand-written references in kiln-kernels' own tests), so the three executors
//! must agree exactly.

use crate::error::{Result, RuntimeError};
use crate::init::node_values;
use crate::tensor::HostTensor;
use kiln_compiler::ir::{DType, Graph, NodeId, Op, Shape};
use kiln_kernels::cpu;
use std::collections::HashMap;

/// A value's bytes, in 8-byte words so that every dtype's elements are aligned.
#[derive(Clone)]
struct Buf {
    words: Vec<u64>,
    bytes: usize,
}

impl Buf {
    fn zeroed(bytes: usize) -> Buf {
        Buf { words: vec![0; bytes.div_ceil(8)], bytes }
    }

    fn from_bytes(b: &[u8]) -> Buf {
        let mut buf = Buf::zeroed(b.len());
        buf.as_bytes_mut().copy_from_slice(b);
        buf
    }

    fn from_f32s(v: &[f32]) -> Buf {
        Buf::from_bytes(bytemuck::cast_slice(v))
    }

    fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.bytes]
    }

    fn as_bytes_mut(&mut self) -> &mut [u8] {
        let n = self.bytes;
        &mut bytemuck::cast_slice_mut(&mut self.words)[..n]
    }

    fn f32s(&self) -> Vec<f32> {
        self.as_bytes().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }

    fn ptr(&mut self) -> *mut u8 {
        self.words.as_mut_ptr() as *mut u8
    }
}

/// Runs a graph op by op with every value in a fresh buffer of its own and the CPU kernels (see
/// the module's doc): the reference the planned and eager executors must agree with exactly.
pub struct ReferenceInterpreter {
    seed: u64,
    variables: HashMap<String, Vec<f32>>,
}

impl ReferenceInterpreter {
    /// Variables are initialised as every executor initialises them (`init::initial_values`
    /// with this seed).
    pub fn new(seed: u64) -> Self {
        ReferenceInterpreter { seed, variables: HashMap::new() }
    }

    /// A variable's current value, if it has been created.
    pub fn read_variable(&self, key: &str, shape: &Shape) -> Option<HostTensor> {
        self.variables.get(key).and_then(|v| HostTensor::new(shape.clone(), v.clone()).ok())
    }

    /// Runs `graph` once in `order` (a topological order, e.g. from `kiln_compiler::optimize`)
    /// and returns its outputs by name.
    pub fn run(
        &mut self,
        graph: &Graph,
        order: &[NodeId],
        inputs: &[(&str, &HostTensor)],
    ) -> Result<Vec<(String, HostTensor)>> {
        let mut values: HashMap<NodeId, Buf> = HashMap::new();
        for &n in order {
            let node = graph.node(n);
            let operands = graph.operands(n);
            let value = match &node.op {
                Op::Input { name, .. } => {
                    let Some((_, t)) = inputs.iter().find(|(k, _)| k == name) else {
                        return Err(RuntimeError::invalid(
                            format!("no value fed for input `{name}`"),
                            "feed every input",
                        ));
                    };
                    if t.shape() != &node.shape || t.dtype() != node.dtype {
                        return Err(RuntimeError::invalid(
                            format!(
                                "input `{name}` is {}{} but the graph expects {}{}",
                                t.dtype(),
                                t.shape(),
                                node.dtype,
                                node.shape
                            ),
                            "feed the shape and dtype the graph was traced with",
                        ));
                    }
                    Some(Buf::from_bytes(&t.to_bytes()?))
                }
                Op::Variable { key, shape, init, .. } => {
                    let seed = self.seed;
                    let v = self
                        .variables
                        .entry(key.clone())
                        .or_insert_with(|| node_values(graph, key, *init, shape, seed));
                    Some(Buf::from_f32s(v))
                }
                Op::Reshape { .. } => Some(values[&operands[0]].clone()),
                op => {
                    // Fresh copies of the operands: no kernel sees another value's memory.
                    let mut ins: Vec<Buf> = operands.iter().map(|o| values[o].clone()).collect();
                    let types: Vec<_> =
                        operands.iter().map(|&o| (&graph.node(o).shape, graph.node(o).dtype)).collect();
                    let scalar = Shape::scalar();
                    let out_type =
                        if op.is_effect() { (&scalar, node.dtype) } else { (&node.shape, node.dtype) };
                    let kernel = cpu::prepare(op, &types, out_type)?;
                    let ptrs: Vec<*mut u8> = ins.iter_mut().map(Buf::ptr).collect();
                    let mut out = Buf::zeroed(if op.is_effect() { 0 } else { node.bytes() });
                    if kernel.checks_operands() {
                        // SAFETY: as for `run` below.
                        unsafe { kernel.check_operands(&ptrs) }
                            .map_err(|e| RuntimeError::invalid(format!("`{}`: {e}", op.name()), ""))?;
                    }
                    let output = if op.is_effect() { std::ptr::null_mut() } else { out.ptr() };
                    // SAFETY: every pointer addresses an 8-byte aligned buffer of exactly its
                    // tensor's bytes (made above from the operand's value, which has its node's
                    // shape and dtype), the output a fresh one of the output's bytes; no two of
                    // them overlap.
                    unsafe { kernel.run(&ptrs, output) };
                    if let Some(why) = kernel.take_failure() {
                        return Err(RuntimeError::invalid(format!("`{}`: {why}", op.name()), ""));
                    }
                    if op.is_effect() {
                        // Updates wrote their variable operands in place: store them back, and
                        // as the variable's value for what runs later in this call (the next
                        // block of a tiled update reads the rows the previous one wrote).
                        for &i in op.mutated_operands() {
                            if let Op::Variable { key, .. } = &graph.node(operands[i]).op {
                                self.variables.insert(key.clone(), ins[i].f32s());
                                values.insert(operands[i], ins[i].clone());
                            }
                        }
                        None
                    } else {
                        Some(out)
                    }
                }
            };
            if let Some(v) = value {
                values.insert(n, v);
            }
        }
        graph
            .outputs()
            .iter()
            .map(|(name, id)| {
                let node = graph.node(*id);
                let t = match node.dtype {
                    DType::F32 => HostTensor::new(node.shape.clone(), values[id].f32s())?,
                    d => HostTensor::from_bytes(node.shape.clone(), d, values[id].as_bytes())?,
                };
                Ok((name.clone(), t))
            })
            .collect()
    }
}
