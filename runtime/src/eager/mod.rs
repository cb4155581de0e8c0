//! The eager baseline: the same graph run op by op, as TensorFlow's and PyTorch's eager modes
//! run it, with every byte on the device coming from a growth allocator.
//!
//! Each op's output is allocated when the op runs and freed as soon as its last reader has run
//! (reference counting, as both frameworks do; a view shares its operand's block). Variables
//! come when a framework makes them: every parameter when the model is built, in model order,
//! before the first call's inputs (`build`; a PyTorch module's constructor, Keras's `build`),
//! and all optimizer state together right before the first update reads any of it (PyTorch's
//! `Adam._init_group` in the first `step()`, Keras's `optimizer.build` in the first
//! `apply_gradients`), both kept for good. Inputs are allocated at the start of each call and
//! outputs freed when it returns. Nothing is written in place: eager frameworks allocate a new
//! tensor for every op result.
//!
//! The timing matters to a growth allocator: made lazily, interleaved with activations, the
//! parameters of the zoo's mlp forward pass left TensorFlow's BFC at 30 MiB reserved; made at
//! build, as frameworks do, 15 MiB.
//!
//! The executor runs on an `EagerDevice`: the CPU (kernels on memory from a `HostSource`), a
//! CUDA device (kernels on memory from `cudaMalloc`'d regions), or `Simulated`, which replays
//! the allocations only: the allocator sees the same sequence either way, since sizes and
//! lifetimes do not depend on values.

mod device;
pub mod framework;

pub use device::{CpuEager, EagerDevice, Simulated};
pub use framework::{FrameworkExtras, WorkspacePolicy};

use crate::alloc::{Allocator, AllocatorStats, Block};
use crate::error::{Result, RuntimeError};
use crate::init::node_values;
use crate::tensor::HostTensor;
use kiln_compiler::ir::{DType, Graph, NodeId, Op, OpClass, Shape, VarRole};
use std::collections::HashMap;

/// Memory after one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemorySample {
    /// Index among the ops of the eager run that ran a kernel (the eager op stream is unfused:
    /// its numbering is its own, not a plan's steps).
    pub step: usize,
    /// Bytes held by live blocks after the op (the allocator's `in_use`).
    pub in_use: usize,
    /// Bytes the allocator held from the device after the op (its `reserved`).
    pub reserved: usize,
}

/// What one eager call did.
#[derive(Clone, Debug)]
pub struct EagerRun {
    /// The graph's outputs by name, read back from the device, in the graph's output order.
    pub outputs: Vec<(String, HostTensor)>,
    /// Memory after each op that ran a kernel, in the order they ran.
    pub samples: Vec<MemorySample>,
    /// Statistics when the call returned (peaks since the executor was made or last reset).
    pub stats: AllocatorStats,
    /// Fragmentation (TensorFlow's formula) at the moment in-use memory peaked during the call.
    pub fragmentation_at_peak: f64,
}

struct Storage {
    block: Block,
    refs: usize,
}

/// Runs a graph op by op on an [`EagerDevice`], every tensor allocated from the growth allocator
/// `A` when its op runs and freed after its last reader: the eager baseline that plans are
/// compared with.
pub struct EagerExecutor<A: Allocator> {
    allocator: A,
    device: Box<dyn EagerDevice>,
    seed: u64,
    variables: HashMap<String, Block>,
    /// What the framework adds to the op stream (`framework`); none by default.
    extras: FrameworkExtras,
    /// Workspaces taken once and kept (cuBLASLt's; cuBLAS's when persistent).
    kept: Vec<Block>,
    /// Whether the kept cuBLAS workspace of the forward (0) and backward (1) thread's handle
    /// exists, and whether cuBLASLt's does.
    kept_handles: [bool; 2],
    kept_lt: bool,
}

impl<A: Allocator> EagerExecutor<A> {
    /// An executor whose tensors live in `allocator`'s blocks on `device`: the allocator's region
    /// source must hand out that device's memory (`HostSource` for `CpuEager`, `CudaSource` for
    /// the CUDA device; anything for `Simulated`).
    pub fn new(allocator: A, seed: u64, device: impl EagerDevice + 'static) -> Self {
        EagerExecutor {
            allocator,
            device: Box::new(device),
            seed,
            variables: HashMap::new(),
            extras: FrameworkExtras::default(),
            kept: Vec::new(),
            kept_handles: [false; 2],
            kept_lt: false,
        }
    }

    /// The same executor with a framework's workspaces and temporaries (`framework`).
    pub fn with_extras(mut self, extras: FrameworkExtras) -> Self {
        self.extras = extras;
        self
    }

    /// The allocator every tensor, variable and workspace comes from (for its statistics).
    pub fn allocator(&self) -> &A {
        &self.allocator
    }

    /// The allocator, mutably (e.g. to reset its peaks between calls).
    pub fn allocator_mut(&mut self) -> &mut A {
        &mut self.allocator
    }

    /// The current value of a variable (zeros when simulating).
    pub fn read_variable(&mut self, key: &str, shape: &Shape) -> Result<Option<HostTensor>> {
        let Some(block) = self.variables.get(key).copied() else { return Ok(None) };
        let data = self.device.read(block.addr, shape.numel())?;
        Ok(Some(HostTensor::new(shape.clone(), data)?))
    }

    fn alloc(&mut self, bytes: usize, what: &str) -> Result<Block> {
        self.allocator.allocate(bytes).map_err(|e| {
            RuntimeError::invalid(
                format!("eager `{what}`: {e}"),
                "give the device more memory or use graph mode",
            )
        })
    }

    /// Makes the variable `key` (kept for good) unless it exists, initialised as every executor
    /// initialises it.
    fn create_variable(&mut self, graph: &Graph, n: NodeId) -> Result<Block> {
        let node = graph.node(n);
        let Op::Variable { key, shape, init, .. } = &node.op else {
            return Err(RuntimeError::invalid("eager: a variable node that is not a variable", ""));
        };
        if let Some(b) = self.variables.get(key) {
            return Ok(*b);
        }
        let block = self.alloc(node.bytes(), key)?;
        self.device.write(block.addr, &node_values(graph, key, *init, shape, self.seed))?;
        self.variables.insert(key.clone(), block);
        Ok(block)
    }

    /// The variables of `graph` with a role in `roles` that do not exist yet, made in graph
    /// (model) order.
    fn create_variables(&mut self, graph: &Graph, roles: &[VarRole]) -> Result<()> {
        for v in graph.variables() {
            if matches!(&graph.node(v).op, Op::Variable { role, .. } if roles.contains(role)) {
                self.create_variable(graph, v)?;
            }
        }
        Ok(())
    }

    /// Builds the model: every parameter of `graph` that does not exist yet, in model order, as
    /// a framework makes them when the model is constructed. `run` builds first too.
    pub fn build(&mut self, graph: &Graph) -> Result<()> {
        self.create_variables(graph, &[VarRole::Parameter])
    }

    /// Runs `graph` once in `order` (a schedule of it, e.g. from `kiln_compiler::optimize`).
    pub fn run(
        &mut self,
        graph: &Graph,
        order: &[NodeId],
        inputs: &[(&str, &HostTensor)],
    ) -> Result<EagerRun> {
        let outputs: HashMap<NodeId, &str> =
            graph.outputs().iter().map(|(n, id)| (*id, n.as_str())).collect();
        let mut uses: HashMap<NodeId, usize> = order.iter().map(|&n| (n, graph.users(n).len())).collect();
        let mut storage: Vec<Storage> = Vec::new();
        let mut storage_of: HashMap<NodeId, usize> = HashMap::new();
        let mut samples = Vec::new();
        let mut peak = (0usize, 0.0f64);
        let mut step = 0;
        self.build(graph)?;
        // Optimizer state seen before it exists: (storage, key), made together at the first
        // update that reads any of it.
        let mut pending: Vec<(usize, String)> = Vec::new();
        let placeholder = Block { addr: 0, size: 0, requested: 0 };
        // Foreach optimizers: one temporary per updated parameter, from the first update of the
        // call to its last.
        let effects = order.iter().filter(|&&n| graph.node(n).op.is_effect()).count();
        let mut effects_run = 0;
        let mut foreach_temps: Vec<Block> = Vec::new();
        // The forward pass: what the outputs (loss, metrics, predictions) are computed from. The
        // rest of a training step is its backward pass and updates. Only a backward thread's
        // workspace needs to know which is which.
        let forward = if self.extras.backward_thread_handle {
            graph.ancestors(&graph.outputs().iter().map(|(_, n)| *n).collect::<Vec<_>>())
        } else {
            std::collections::HashSet::new()
        };

        for &n in order {
            let node = graph.node(n);
            let operands = graph.operands(n);
            match &node.op {
                Op::Input { name, .. } => {
                    let Some((_, data)) = inputs.iter().find(|(k, _)| k == name) else {
                        return Err(RuntimeError::invalid(
                            format!("no value fed for input `{name}`"),
                            "feed every input",
                        ));
                    };
                    if data.shape() != &node.shape || data.dtype() != node.dtype {
                        return Err(RuntimeError::InputShape {
                            name: name.clone(),
                            expected: node.shape.clone(),
                            expected_dtype: node.dtype,
                            got: data.shape().clone(),
                            dtype: data.dtype(),
                            help: "feed the shape and dtype the graph was traced with".into(),
                        });
                    }
                    let block = self.alloc(node.bytes(), name)?;
                    if data.dtype() == DType::F32 && cfg!(target_endian = "little") {
                        // f32 values as the device holds them: no copy of a caller-sized input.
                        self.device.write_bytes(block.addr, bytemuck::cast_slice(data.data()))?;
                    } else {
                        self.device.write_bytes(block.addr, &data.to_bytes()?)?;
                    }
                    // The caller holds its inputs until the call returns: one extra reference.
                    storage_of.insert(n, storage.len());
                    storage.push(Storage { block, refs: 2 });
                }
                Op::Variable { key, role, .. } => {
                    let block = match self.variables.get(key) {
                        Some(b) => *b,
                        // The f16 loss scale (one element each) is read by the forward pass: made
                        // there, not with the optimizer's state at its first update.
                        None if matches!(role, VarRole::Parameter | VarRole::Constant)
                            || key.starts_with("loss_scale/") =>
                        {
                            self.create_variable(graph, n)?
                        }
                        None => {
                            pending.push((storage.len(), key.clone()));
                            placeholder
                        }
                    };
                    // Variables are never freed: one extra reference pins them.
                    storage_of.insert(n, storage.len());
                    storage.push(Storage { block, refs: 2 });
                }
                Op::Reshape { .. } => {
                    let s = storage_of[&operands[0]];
                    storage[s].refs += 1;
                    storage_of.insert(n, s);
                }
                op => {
                    if operands.iter().any(|o| pending.iter().any(|(s, _)| storage_of[o] == *s)) {
                        // The first update: all optimizer state, together.
                        self.create_variables(graph, &[VarRole::OptimizerState, VarRole::Counter])?;
                        for (s, key) in pending.drain(..) {
                            storage[s].block = self.variables[&key];
                        }
                    }
                    let output = if op.is_effect() {
                        None
                    } else {
                        let block = self.alloc(node.bytes(), op.name())?;
                        storage_of.insert(n, storage.len());
                        storage.push(Storage { block, refs: 1 });
                        Some(block)
                    };
                    let types: Vec<_> =
                        operands.iter().map(|&o| (&graph.node(o).shape, graph.node(o).dtype)).collect();
                    let scalar = Shape::scalar();
                    let out_type =
                        if op.is_effect() { (&scalar, node.dtype) } else { (&node.shape, node.dtype) };
                    if op.is_effect() && effects_run == 0 && self.extras.foreach_optimizer_temporaries {
                        foreach_temps = self.foreach_temporaries(graph, order)?;
                    }
                    let scratch = self.scratch_for(
                        op,
                        &types,
                        out_type.0,
                        self.extras.backward_thread_handle && !forward.contains(&n),
                    )?;
                    let mut ptrs: Vec<u64> =
                        operands.iter().map(|o| storage[storage_of[o]].block.addr).collect();
                    // A custom op's declared scratch, or what the device's kernel cannot run
                    // without: taken from the allocator around the op, as frameworks take
                    // workspaces, and passed after the operands.
                    let declared = kiln_compiler::custom::declared_scratch(op, &types, out_type.0)
                        .max(self.device.required_scratch(op, &types, out_type.0));
                    let custom_scratch =
                        if declared > 0 { Some(self.alloc(declared, "kernel scratch")?) } else { None };
                    ptrs.extend(custom_scratch.map(|b| b.addr));
                    self.device.run_op(op, &types, out_type, &ptrs, output.map_or(0, |b| b.addr))?;
                    debug_assert!(op.class() != OpClass::Source);
                    let stats = self.allocator.stats();
                    samples.push(MemorySample { step, in_use: stats.in_use, reserved: stats.reserved });
                    if stats.in_use >= peak.0 {
                        peak = (stats.in_use, stats.fragmentation());
                    }
                    step += 1;
                    for b in scratch.into_iter().chain(custom_scratch) {
                        self.allocator.deallocate(b.addr)?;
                    }
                    if op.is_effect() {
                        effects_run += 1;
                        if effects_run == effects {
                            for b in foreach_temps.drain(..) {
                                self.allocator.deallocate(b.addr)?;
                            }
                        }
                    }
                }
            }
            // Operands whose last reader this was are released. `uses` counts each reader once
            // (`Graph::users`), so an operand read twice by this op (`x * x`) is counted once here.
            let mut distinct = operands;
            distinct.sort_unstable();
            distinct.dedup();
            for o in distinct {
                let u = uses.get_mut(&o).expect("operand scheduled");
                *u -= 1;
                if *u == 0 && !outputs.contains_key(&o) {
                    self.release(&mut storage, storage_of[&o])?;
                }
            }
            // A value nobody reads (an effect, or an unused result) dies at once.
            if uses[&n] == 0 && !outputs.contains_key(&n) && !node.op.is_effect() {
                self.release(&mut storage, storage_of[&n])?;
            }
        }

        let mut result = Vec::new();
        for (name, id) in graph.outputs() {
            let node = graph.node(*id);
            let block = storage[storage_of[id]].block;
            let bytes = self.device.read_bytes(block.addr, node.bytes())?;
            result.push((name.clone(), HostTensor::from_bytes(node.shape.clone(), node.dtype, &bytes)?));
        }
        for (_, id) in graph.outputs() {
            self.release(&mut storage, storage_of[id])?;
        }
        for id in graph.inputs() {
            if let Some(&s) = storage_of.get(&id) {
                self.release(&mut storage, s)?;
            }
        }
        Ok(EagerRun {
            outputs: result,
            samples,
            stats: self.allocator.stats(),
            fragmentation_at_peak: peak.1,
        })
    }

    /// The workspaces `op` takes for its run and gives back after it (per-call cuBLAS, conv
    /// scratch); workspaces kept for good are taken at the first product (cuBLASLt's) and at the
    /// first product of each thread's cuBLAS handle (`backward`: the op is in the backward pass,
    /// which PyTorch runs on its autograd thread where the extras say so).
    fn scratch_for(
        &mut self,
        op: &Op,
        types: &[(&Shape, kiln_compiler::ir::DType)],
        out: &Shape,
        backward: bool,
    ) -> Result<Vec<Block>> {
        let mut taken = Vec::new();
        if framework::is_blas(op) {
            if !self.kept_lt && self.extras.blas_lt_workspace > 0 {
                self.kept_lt = true;
                let b = self.alloc(self.extras.blas_lt_workspace, "cuBLASLt workspace")?;
                self.kept.push(b);
            }
            let handle = usize::from(backward && self.extras.backward_thread_handle);
            if let Some(w) = self.extras.blas_workspace.filter(|w| w.policy == WorkspacePolicy::Persistent)
                && !self.kept_handles[handle]
            {
                self.kept_handles[handle] = true;
                let b = self.alloc(w.bytes, "cuBLAS workspace")?;
                self.kept.push(b);
            }
            if let Some(w) = self.extras.blas_workspace.filter(|w| w.policy == WorkspacePolicy::PerCall) {
                taken.push(self.alloc(w.bytes, "cuBLAS workspace")?);
            }
        }
        if self.extras.conv_scratch {
            let shapes: Vec<&Shape> = types.iter().map(|t| t.0).collect();
            let bytes = framework::conv_scratch_bytes(op, &shapes, out);
            if bytes > 0 {
                taken.push(self.alloc(bytes, "convolution scratch")?);
            }
        }
        Ok(taken)
    }

    /// One temporary the size of each parameter an Adam update of `order` writes (foreach
    /// Adam's square roots of the second moments; foreach SGD without Nesterov makes none).
    fn foreach_temporaries(&mut self, graph: &Graph, order: &[NodeId]) -> Result<Vec<Block>> {
        let mut temps = Vec::new();
        for &n in order {
            if matches!(graph.node(n).op, Op::ApplyAdam { .. })
                && let Some(&var) = graph.operands(n).first()
            {
                temps.push(self.alloc(graph.node(var).bytes(), "foreach optimizer temporary")?);
            }
        }
        Ok(temps)
    }

    fn release(&mut self, storage: &mut [Storage], s: usize) -> Result<()> {
        let st = &mut storage[s];
        if st.refs == 0 {
            return Ok(());
        }
        st.refs -= 1;
        if st.refs == 0 {
            self.allocator.deallocate(st.block.addr)?;
        }
        Ok(())
    }
}
