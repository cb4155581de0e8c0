//! The Rust DSL: a `Tracer` records ops on `Tensor` handles into a `Graph`.
//!
//! Ops never panic on user input. An op whose operands do not fit records a `CompileError` (the
//! op, the operand shapes, the caller's line from `#[track_caller]`) and returns a *poisoned*
//! tensor; ops on poisoned tensors record nothing more, and `Tracer::finish` returns the first
//! error. Operators (`a + b`, `x * 2.0`) therefore compose without `?` at every step.

mod axes;
mod operators;
mod ops;

pub use axes::IntoAxes;
pub use ops::Operand;

use crate::error::{CompileError, Result};
use crate::ir::{self, DType, DeviceId, Graph, Init, Node, NodeId, Op, Shape, SourceLoc, VarRole};
use std::cell::RefCell;
use std::collections::HashMap;
use std::panic::Location;
use std::rc::Rc;

#[derive(Default)]
struct TraceState {
    graph: Graph,
    error: Option<CompileError>,
    scopes: Vec<String>,
    device: DeviceId,
    variables: HashMap<String, NodeId>,
    /// Whether the model is traced for a training step (`Dropout` drops only then).
    training: bool,
    /// The line ops and errors are attributed to while a layer is traced
    /// (`Tracer::attributed_to`): the user's, where the layer was applied, rather than the line
    /// inside kiln that recorded them.
    attributed_to: Option<&'static Location<'static>>,
}

/// Records a graph. Cheap to clone: clones share one graph.
#[derive(Clone)]
pub struct Tracer {
    state: Rc<RefCell<TraceState>>,
}

/// A handle to a value in a trace. Cheap to clone.
#[derive(Clone)]
pub struct Tensor {
    state: Rc<RefCell<TraceState>>,
    id: Option<NodeId>,
    shape: Shape,
    dtype: DType,
}

impl Tracer {
    /// A tracer recording into a new empty graph named `name`.
    pub fn new(name: impl Into<String>) -> Self {
        Self::resume(Graph::new(name))
    }

    /// Continues recording into an existing graph (autodiff and optimizers append this way).
    pub fn resume(graph: Graph) -> Self {
        let variables = graph
            .variables()
            .into_iter()
            .filter_map(|n| match &graph.node(n).op {
                Op::Variable { key, .. } => Some((key.clone(), n)),
                _ => None,
            })
            .collect();
        Tracer { state: Rc::new(RefCell::new(TraceState { graph, variables, ..Default::default() })) }
    }

    /// A handle to an existing node; a node id this trace does not hold gives a poisoned tensor
    /// and records the error.
    #[track_caller]
    pub fn tensor(&self, id: NodeId) -> Tensor {
        let found = {
            let st = self.state.borrow();
            st.graph.contains(id).then(|| (st.graph.node(id).shape.clone(), st.graph.node(id).dtype))
        };
        match found {
            Some((shape, dtype)) => Tensor { state: self.state.clone(), id: Some(id), shape, dtype },
            None => self.fail(
                "tensor",
                Location::caller(),
                format!("node %{} is not in this trace", id.index()),
                &[],
                "take node ids from the graph this tracer records",
            ),
        }
    }

    /// A graph input of dtype f32.
    #[track_caller]
    pub fn input(&self, name: &str, shape: impl Into<Shape>) -> Tensor {
        self.input_typed(name, shape, DType::F32)
    }

    /// A graph input of `dtype` (f32, or i32, i64, bool for ids and masks; other dtypes are
    /// recorded errors, as is a second input of the same name).
    #[track_caller]
    pub fn input_typed(&self, name: &str, shape: impl Into<Shape>, dtype: DType) -> Tensor {
        let loc = Location::caller();
        if let Err(message) = supported_dtype(dtype, true) {
            return self.fail("input", loc, format!("input {name:?}: {message}"), &[], DTYPE_HELP);
        }
        let exists = self.state.borrow().graph.input(name).is_some();
        if exists {
            return self.fail(
                "input",
                loc,
                format!("an input named {name:?} already exists"),
                &[],
                "give every input its own name",
            );
        }
        self.record_at(Op::Input { name: name.to_string(), shape: shape.into(), dtype }, &[], loc)
    }

    /// A trainable parameter named `name` inside the current scopes.
    #[track_caller]
    pub fn param(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Tensor {
        self.variable(name, shape, DType::F32, VarRole::Parameter, init)
    }

    /// A trainable parameter that may already exist: the first declaration of `name` (in the
    /// current scopes) creates it, later ones return the same variable. This is how weights are
    /// tied (shared between layers) on purpose; `param` reports a second declaration as an error.
    #[track_caller]
    pub fn shared_param(&self, name: &str, shape: impl Into<Shape>, init: Init) -> Tensor {
        self.declare(name, shape.into(), DType::F32, VarRole::Parameter, init, true, Location::caller())
    }

    /// A trainable parameter named `key` whatever the current scopes, shared by every layer
    /// that declares that key: how an embedding table and the output head that reads it
    /// transposed are tied (`Embedding::tied`, `TiedOutput`). Its gradient is the sum of every
    /// use's.
    #[track_caller]
    pub fn tied_param(&self, key: &str, shape: impl Into<Shape>, init: Init) -> Tensor {
        self.tied_variable(key, shape, DType::F32, VarRole::Parameter, init)
    }

    /// A variable named `key` whatever the current scopes, one for every declaration of the key
    /// (`tied_param`; dropout's step counter).
    #[track_caller]
    pub fn tied_variable(
        &self,
        key: &str,
        shape: impl Into<Shape>,
        dtype: DType,
        role: VarRole,
        init: Init,
    ) -> Tensor {
        let scopes = std::mem::take(&mut self.state.borrow_mut().scopes);
        let t = self.declare(key, shape.into(), dtype, role, init, true, Location::caller());
        self.state.borrow_mut().scopes = scopes;
        t
    }

    /// A persistent variable. Declaring the same key twice in one trace is an error (it would
    /// silently share one variable between two layers); `shared_param` ties weights explicitly.
    #[track_caller]
    pub fn variable(
        &self,
        name: &str,
        shape: impl Into<Shape>,
        dtype: DType,
        role: VarRole,
        init: Init,
    ) -> Tensor {
        self.declare(name, shape.into(), dtype, role, init, false, Location::caller())
    }

    /// A constant tensor of `values` (row-major f32): a variable of role `Constant` whose values
    /// the graph carries (`Graph::constant`), never trained or checkpointed (a mask or an index
    /// table an imported model stores). A mismatched value count poisons the trace.
    #[track_caller]
    pub fn constant_values(&self, name: &str, shape: impl Into<Shape>, values: Vec<f32>) -> Tensor {
        let shape = shape.into();
        let loc = Location::caller();
        if values.len() != shape.numel() {
            let why = format!("constant `{name}` of shape {shape} given {} values", values.len());
            return self.fail("variable", loc, why, &[], "give one value per element");
        }
        let t = self.declare(name, shape, DType::F32, VarRole::Constant, Init::Zeros, false, loc);
        if let Some(id) = t.id {
            let mut state = self.state.borrow_mut();
            if let Op::Variable { key, .. } = state.graph.node(id).op.clone() {
                state.graph.set_constant(key, values.into());
            }
        }
        t
    }

    #[allow(clippy::too_many_arguments)]
    fn declare(
        &self,
        name: &str,
        shape: Shape,
        dtype: DType,
        role: VarRole,
        init: Init,
        shared: bool,
        loc: &'static Location<'static>,
    ) -> Tensor {
        let loc = self.attribution(loc);
        let key = self.scoped(name);
        if let Err(message) = supported_dtype(dtype, false) {
            return self.fail("variable", loc, format!("variable `{key}`: {message}"), &[], DTYPE_HELP);
        }
        if let Err(why) = init.check() {
            let help =
                "give the initialiser finite values, low < high and std >= 0 (or use Init::GlorotUniform)";
            return self.fail("variable", loc, format!("variable `{key}`: {why}"), &[], help);
        }
        let existing = self.state.borrow().variables.get(&key).copied();
        if let Some(id) = existing {
            let t = self.tensor(id);
            if !shared {
                let at =
                    self.with_graph(|g| g.node(id).origin).map(|o| format!(" at {o}")).unwrap_or_default();
                return self.fail(
                    "variable",
                    loc,
                    format!("a variable `{key}` already exists (declared{at})"),
                    &[],
                    "give the new one another name or scope; to share (tie) one variable on purpose, declare it with `Tracer::shared_param`",
                );
            }
            if t.shape != shape {
                let e = CompileError::VariableShape {
                    key,
                    location: loc.into(),
                    shape: shape.to_string(),
                    existing: t.shape.to_string(),
                    help: "a variable keeps its shape; give the new one another name or scope".into(),
                };
                return self.poison_with(e);
            }
            return t;
        }
        let t = self.record_at(Op::Variable { key: key.clone(), shape, dtype, role, init }, &[], loc);
        if let Some(id) = t.id {
            self.state.borrow_mut().variables.insert(key, id);
        }
        t
    }

    /// Whether this trace is a training step's (set by `step::train_step_graph`); layers that
    /// behave differently at inference (`Dropout`) ask.
    pub fn training(&self) -> bool {
        self.state.borrow().training
    }

    /// Marks the trace as a training step's, or not.
    pub fn set_training(&self, training: bool) {
        self.state.borrow_mut().training = training;
    }

    /// Uniform values in [0, 1) of `shape`, a pure function of `seed`, the one-element `step`
    /// and each element's index (`ir::uniform`): identical on every backend and run, new each
    /// step the counter advances.
    #[track_caller]
    pub fn random_uniform(&self, shape: impl Into<Shape>, seed: u64, step: &Tensor) -> Tensor {
        self.record_at(Op::RandomUniform { shape: shape.into(), seed }, &[step], Location::caller())
    }

    /// A tensor of `shape` whose elements are their index along `axis` (0, 1, 2, ...), as f32.
    #[track_caller]
    pub fn iota(&self, shape: impl Into<Shape>, axis: usize) -> Tensor {
        self.record_at(Op::Iota { shape: shape.into(), axis }, &[], Location::caller())
    }

    /// The [seq, seq] causal mask: 1.0 where a position may attend (its column is at most its
    /// row), else 0.0. Built from two iotas and a comparison, recomputed every call (no constant
    /// folding yet); fusion makes it one kernel.
    #[track_caller]
    pub fn causal_mask(&self, seq: usize) -> Tensor {
        let rows = self.iota([seq, seq], 0);
        self.iota([seq, seq], 1).le(&rows)
    }

    /// The registered custom op `name` (`crate::custom`) applied to `operands`: its shape and
    /// dtype from the op's `infer`, a refusal (or an unregistered name) an error naming the op,
    /// the operands and the caller's line.
    #[track_caller]
    pub fn custom(&self, name: &str, operands: &[&Tensor]) -> Tensor {
        self.record_at(Op::Custom { name: name.to_string() }, operands, Location::caller())
    }

    /// A constant tensor of `shape` filled with `value`.
    #[track_caller]
    pub fn fill(&self, value: f32, shape: impl Into<Shape>) -> Tensor {
        self.record_at(Op::Fill { value, shape: shape.into() }, &[], Location::caller())
    }

    /// Runs `f` with `name` pushed on the scope stack: variables declared inside are keyed
    /// `outer/name/var`.
    pub fn scope<R>(&self, name: &str, f: impl FnOnce() -> R) -> R {
        self.state.borrow_mut().scopes.push(name.to_string());
        let r = f();
        self.state.borrow_mut().scopes.pop();
        r
    }

    /// Places every op recorded from now on `device`; returns the previous device.
    pub fn set_device(&self, device: DeviceId) -> DeviceId {
        std::mem::replace(&mut self.state.borrow_mut().device, device)
    }

    /// The device ops are placed on now (`on_device`, `set_device`).
    pub fn current_device(&self) -> DeviceId {
        self.state.borrow().device
    }

    /// Runs `f` with every op it records placed on `device`, then restores the previous device.
    pub fn on_device<R>(&self, device: DeviceId, f: impl FnOnce() -> R) -> R {
        let prev = std::mem::replace(&mut self.state.borrow_mut().device, device);
        let r = f();
        self.state.borrow_mut().device = prev;
        r
    }

    fn scoped(&self, name: &str) -> String {
        let st = self.state.borrow();
        if st.scopes.is_empty() { name.to_string() } else { format!("{}/{name}", st.scopes.join("/")) }
    }

    /// The current scopes joined by `/` (`dense_1`, `block/attention`), empty outside any scope:
    /// how layers name themselves in their errors.
    pub fn scope_path(&self) -> String {
        self.state.borrow().scopes.join("/")
    }

    /// Names `t` as a graph output. Each output has its own name: a second output with a name
    /// already taken is an error.
    #[track_caller]
    pub fn output(&self, name: &str, t: &Tensor) {
        let loc = Location::caller();
        if !self.owns(t) {
            self.fail(
                "output",
                loc,
                format!("output {name:?}: the tensor belongs to another trace"),
                &[t],
                "build every tensor of a model with one tracer",
            );
            return;
        }
        if self.state.borrow().graph.output(name).is_some() {
            self.fail(
                "output",
                loc,
                format!("an output named {name:?} already exists"),
                &[t],
                "give every output its own name",
            );
            return;
        }
        if let Some(id) = t.id {
            self.state.borrow_mut().graph.set_output(name, id);
        }
    }

    /// Records a user mistake found outside shape inference (a loss given mismatched shapes, say)
    /// and returns a poisoned tensor; `finish` reports the first such error.
    #[track_caller]
    pub fn report(&self, op: &str, message: impl Into<String>, operands: &[&Tensor], help: &str) -> Tensor {
        self.fail(op, Location::caller(), message.into(), operands, help)
    }

    /// Reads the graph recorded so far.
    pub fn with_graph<R>(&self, f: impl FnOnce(&Graph) -> R) -> R {
        f(&self.state.borrow().graph)
    }

    /// Gives every node with an index from `first` on the source line of `of` and the name
    /// "<of's name> grad": how autodiff attributes backward ops to the forward op they belong to.
    pub fn label_since(&self, first: usize, of: NodeId) {
        let mut st = self.state.borrow_mut();
        if !st.graph.contains(of) {
            return;
        }
        let (origin, name) = {
            let n = st.graph.node(of);
            (n.origin, n.name.clone().unwrap_or_else(|| n.op.name().to_string()))
        };
        let ids: Vec<NodeId> = st.graph.node_ids().filter(|id| id.index() >= first).collect();
        for id in ids {
            let node = st.graph.node_mut(id);
            node.origin = origin;
            node.name = Some(format!("{name} grad"));
        }
    }

    /// Adds a control dependency: `after` runs after `before`.
    #[track_caller]
    pub fn add_control(&self, before: &Tensor, after: &Tensor) {
        if !self.owns(before) || !self.owns(after) {
            self.fail(
                "add_control",
                Location::caller(),
                "the tensors come from different traces".into(),
                &[before, after],
                "build every tensor of a model with one tracer",
            );
            return;
        }
        if let (Some(b), Some(a)) = (before.id, after.id) {
            self.state.borrow_mut().graph.add_control(b, a);
        }
    }

    /// The first error recorded so far, if any.
    pub fn error(&self) -> Option<CompileError> {
        self.state.borrow().error.clone()
    }

    /// Ends the trace: the graph, or the first error recorded while tracing.
    pub fn finish(self) -> Result<Graph> {
        let mut st = self.state.borrow_mut();
        if let Some(e) = st.error.take() {
            return Err(e);
        }
        Ok(std::mem::take(&mut st.graph))
    }

    fn owns(&self, t: &Tensor) -> bool {
        Rc::ptr_eq(&self.state, &t.state)
    }

    /// Records `op` on `operands` at `loc`, checking shapes and dtypes.
    /// `loc`, or the line `attributed_to` set where `loc` is inside this crate (a layer's own
    /// op): an op the user wrote, in a closure layer say, keeps its own line.
    fn attribution(&self, loc: &'static Location<'static>) -> &'static Location<'static> {
        let src = file!().strip_suffix("trace/mod.rs").or_else(|| file!().strip_suffix("trace\\mod.rs"));
        let own = src.is_some_and(|src| loc.file().starts_with(src));
        match self.state.borrow().attributed_to {
            Some(at) if own => at,
            _ => loc,
        }
    }

    pub(crate) fn record_at(&self, op: Op, operands: &[&Tensor], loc: &'static Location<'static>) -> Tensor {
        let loc = self.attribution(loc);
        if operands.iter().any(|t| !self.owns(t)) {
            return self.fail(
                op.name(),
                loc,
                "the operands come from different traces".into(),
                operands,
                "build every tensor of a model with one tracer",
            );
        }
        let Some(ids) = operands.iter().map(|t| t.id).collect::<Option<Vec<_>>>() else {
            return self.poisoned();
        };
        let types: Vec<(&Shape, DType)> = operands.iter().map(|t| (&t.shape, t.dtype)).collect();
        match ir::infer(&op, &types) {
            Err(e) => self.fail(op.name(), loc, e.message, operands, &e.help),
            Ok((shape, dtype)) => {
                let mut st = self.state.borrow_mut();
                let device = st.device;
                // Ops traced inside a scope (a layer) carry the scope's path as their name.
                let sourced = op.class() == crate::ir::OpClass::Source;
                let name = (!st.scopes.is_empty() && !sourced).then(|| st.scopes.join("/"));
                let node = Node { op, shape: shape.clone(), dtype, device, name, origin: Some(loc.into()) };
                let id = st.graph.add(node, &ids);
                Tensor { state: self.state.clone(), id: Some(id), shape, dtype }
            }
        }
    }

    /// Runs `f` with every op it records inside kiln's layers, and their errors, attributed to
    /// `loc` (the outermost call wins): how a layer applied by `Sequential` or a training step
    /// names the caller's line in errors and memory reports, not the line inside kiln that
    /// recorded the op. Ops recorded by the caller's own code keep their lines.
    pub fn attributed_to<R>(&self, loc: &'static Location<'static>, f: impl FnOnce() -> R) -> R {
        let outer = self.state.borrow().attributed_to.is_some();
        if !outer {
            self.state.borrow_mut().attributed_to = Some(loc);
        }
        let r = f();
        if !outer {
            self.state.borrow_mut().attributed_to = None;
        }
        r
    }

    fn fail(
        &self,
        op: &str,
        loc: &'static Location<'static>,
        message: String,
        operands: &[&Tensor],
        help: &str,
    ) -> Tensor {
        let loc = self.attribution(loc);
        let list: Vec<String> = operands.iter().map(|t| format!("{}{}", t.dtype, t.shape)).collect();
        let e = CompileError::Op {
            op: op.to_string(),
            location: SourceLoc::from(loc),
            message,
            operands: if list.is_empty() { "none".into() } else { list.join(", ") },
            help: help.to_string(),
        };
        self.poison_with(e)
    }

    fn poison_with(&self, e: CompileError) -> Tensor {
        let mut st = self.state.borrow_mut();
        if st.error.is_none() {
            st.error = Some(e);
        }
        drop(st);
        self.poisoned()
    }

    fn poisoned(&self) -> Tensor {
        Tensor { state: self.state.clone(), id: None, shape: Shape::scalar(), dtype: DType::F32 }
    }
}

const DTYPE_HELP: &str = "declare variables as f32 (DType::F32), inputs as f32, i32, i64 or bool; f16 and \
     bf16 are carried by the IR but have no kernels yet";

/// kiln's kernels compute in f32: other float dtypes are refused where they enter a trace, so
/// that no plan sizes a buffer for one dtype while a kernel writes another. Inputs may also be
/// exact (i32, i64, bool: ids and masks, `DType::is_exact`); variables are trained, so f32.
fn supported_dtype(dtype: DType, input: bool) -> std::result::Result<(), String> {
    match dtype {
        DType::F32 => Ok(()),
        DType::I32 | DType::I64 | DType::Bool if input => Ok(()),
        DType::I32 | DType::I64 | DType::Bool => {
            Err(format!("dtype {dtype} is not supported for a variable: variables are trained, in f32"))
        }
        DType::F16 | DType::BF16 => Err(format!("dtype {dtype} is not supported: kiln computes in f32")),
    }
}

impl Tensor {
    /// The tensor's shape (as inferred when it was recorded; a scalar when poisoned).
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The size of every axis, outermost first.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// The number of axes (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.shape.rank()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the tensor's op is placed on (the default device for a poisoned tensor).
    pub fn device(&self) -> DeviceId {
        self.id.map(|id| self.state.borrow().graph.node(id).device).unwrap_or_default()
    }

    /// The node this tensor refers to; `None` when an earlier mistake poisoned it.
    pub fn id(&self) -> Option<NodeId> {
        self.id
    }

    /// The tracer that recorded the tensor, sharing its graph.
    pub fn tracer(&self) -> Tracer {
        Tracer { state: self.state.clone() }
    }

    /// Gives the node a name that dumps, plans and memory reports show.
    pub fn named(self, name: &str) -> Tensor {
        if let Some(id) = self.id {
            self.state.borrow_mut().graph.node_mut(id).name = Some(name.to_string());
        }
        self
    }

    /// Records any op of the IR on `self` and `operands` (an escape hatch below the DSL's named
    /// methods: autodiff and the optimizers use it for gradient and update ops). Shapes are
    /// checked as for every op.
    #[track_caller]
    pub fn record(&self, op: Op, operands: &[&Tensor]) -> Tensor {
        self.tracer().record_at(op, operands, Location::caller())
    }
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.id {
            Some(id) => write!(f, "Tensor(%{} {}{})", id.index(), self.dtype, self.shape),
            None => write!(f, "Tensor(poisoned)"),
        }
    }
}
