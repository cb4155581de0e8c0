//! The graphs kiln compiles for a model: an inference call, and a training step (forward, loss,
//! metrics, backward, optimizer updates), each traced for one set of input shapes.

use crate::activation_rewrite;
use crate::attention_rewrite;
use crate::autocast::{self, Precision};
use crate::autodiff;
use crate::batch_blocks;
use crate::error::{CompileError, Result};
use crate::ir::{DType, Graph, Op, Shape, VarRole};
use crate::loss_scale::LossScale;
use crate::losses::{Loss, Metric};
use crate::nn::Layer;
use crate::optim::Optimizer;
use crate::trace::Tracer;

/// An input's shape and dtype: a `Shape` alone is an f32 input; ids are `InputSpec::new(shape,
/// DType::I32)` (or i64).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct InputSpec {
    /// The input's shape.
    pub shape: Shape,
    /// The input's element type (f32 for features, i32, i64 or bool for ids and masks).
    pub dtype: DType,
}

impl InputSpec {
    /// An input of `shape` and `dtype`.
    pub fn new(shape: impl Into<Shape>, dtype: DType) -> Self {
        InputSpec { shape: shape.into(), dtype }
    }
}

impl From<Shape> for InputSpec {
    fn from(shape: Shape) -> Self {
        InputSpec { shape, dtype: DType::F32 }
    }
}

impl From<&Shape> for InputSpec {
    fn from(shape: &Shape) -> Self {
        InputSpec { shape: shape.clone(), dtype: DType::F32 }
    }
}

/// What every graph without gradients goes through before `compile` (a traced forward pass or
/// evaluation, an imported ONNX model): composed attention and GELU as one op each
/// (`attention_rewrite`, `activation_rewrite`), then the products cast to `precision`
/// (`autocast`). Imported models skipped the rewrites until they went through here: GPT-2's tanh
/// GELU ran as a fused program of 13 ops, 10 ms a layer at 2 x 256 tokens on one AVX-512 core,
/// and its attention as two products and a softmax per head; the forward pass took 819 ms
/// against 662 ms rewritten (`kiln run --bench 5`).
pub fn prepare_forward(graph: &mut Graph, precision: Precision) -> Result<()> {
    attention_rewrite::rewrite(graph)?;
    activation_rewrite::rewrite(graph)?;
    autocast::apply(graph, precision)?;
    Ok(())
}

/// The graph of `model` applied to an input `x` of `x_shape`; output `y`.
#[track_caller]
pub fn forward_graph(model: &dyn Layer, x_shape: impl Into<InputSpec>) -> Result<Graph> {
    forward_graph_with(model, x_shape, Precision::F32)
}

/// `forward_graph` computed in `precision` (`autocast`).
#[track_caller]
pub fn forward_graph_with(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    precision: Precision,
) -> Result<Graph> {
    let x_spec = x_shape.into();
    let t = Tracer::new(format!("forward{}", x_spec.shape));
    let x = t.input_typed("x", x_spec.shape, x_spec.dtype);
    let y = model.forward(&x);
    t.output("y", &y);
    let mut graph = t.finish()?;
    prepare_forward(&mut graph, precision)?;
    Ok(graph)
}

/// The graph of an evaluation on inputs `x` and targets `y`: the training step's `loss` and
/// metrics outputs, without gradients or updates (Keras's `evaluate`).
#[track_caller]
pub fn evaluate_graph(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    y_shape: impl Into<InputSpec>,
    cfg: &TrainConfig,
) -> Result<Graph> {
    evaluate_graph_with(model, x_shape, y_shape, cfg, Precision::F32)
}

/// `evaluate_graph` computed in `precision` (`autocast`).
#[track_caller]
pub fn evaluate_graph_with(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    y_shape: impl Into<InputSpec>,
    cfg: &TrainConfig,
    precision: Precision,
) -> Result<Graph> {
    let (x_spec, y_spec) = (x_shape.into(), y_shape.into());
    let t = Tracer::new(format!("evaluate{}", x_spec.shape));
    let x = t.input_typed("x", x_spec.shape, x_spec.dtype);
    let pred = model.forward(&x);
    let previous = t.set_device(pred.device());
    let y = t.input_typed("y", y_spec.shape, y_spec.dtype);
    t.output("loss", &cfg.loss.apply(&pred, &y));
    for m in &cfg.metrics {
        t.output(m.name(), &m.apply(&pred, &y));
    }
    t.set_device(previous);
    let mut graph = t.finish()?;
    prepare_forward(&mut graph, precision)?;
    Ok(graph)
}

/// What a training step computes besides the model.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// The loss the step minimises (output `loss`).
    pub loss: Loss,
    /// The optimizer whose updates the step appends.
    pub optimizer: Optimizer,
    /// The metrics the step also outputs, each under its name.
    pub metrics: Vec<Metric>,
}

/// The graph of one training step on inputs `x` and targets `y`: outputs `loss` and one per
/// metric; every parameter the loss depends on is updated in place by the optimizer. Mistakes
/// in the loss (targets of the wrong shape) name the caller's line.
#[track_caller]
pub fn train_step_graph(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    y_shape: impl Into<InputSpec>,
    cfg: &TrainConfig,
) -> Result<Graph> {
    train_step_graph_in_blocks(model, x_shape, y_shape, cfg, 1)
}

/// `train_step_graph` with the forward pass and the loss computed `blocks` blocks of batch rows
/// at a time, each block's values block-sized: the forward graph is split where its ops keep
/// rows apart (`batch_blocks::region_with`, any f32 value with the batch's rows sliced per
/// block: the input, an embedding's rows, labels cast to f32) before autodiff, so that each
/// block's backward pass reads that block's values alone and each weight gradient is the sum of
/// the blocks' (gradient accumulation over micro-batches, planned as one step). Reductions over
/// the batch (the loss's mean, a batch norm's statistics) read the joined blocks, so the step
/// computes the whole batch's loss and gradients, in another summation order (results within
/// float rounding of the unsplit step). `blocks` 1, or a graph with nothing to split: the plain
/// step. Refused: 0 blocks, or more blocks than the batch has rows.
#[track_caller]
pub fn train_step_graph_in_blocks(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    y_shape: impl Into<InputSpec>,
    cfg: &TrainConfig,
    blocks: usize,
) -> Result<Graph> {
    train_step_graph_with(model, x_shape, y_shape, cfg, blocks, Precision::F32)
}

/// `train_step_graph_in_blocks` computed in `precision`: the policy (`autocast`) is applied to
/// the forward pass and the loss before autodiff, so the backward pass computes each gradient
/// in its value's type and every parameter's gradient reaches the optimizer in f32.
#[track_caller]
pub fn train_step_graph_with(
    model: &dyn Layer,
    x_shape: impl Into<InputSpec>,
    y_shape: impl Into<InputSpec>,
    cfg: &TrainConfig,
    blocks: usize,
    precision: Precision,
) -> Result<Graph> {
    let (x_spec, y_spec) = (x_shape.into(), y_shape.into());
    let batch = x_spec.shape.dims().first().copied().unwrap_or(1);
    if blocks == 0 || blocks > batch.max(1) {
        return Err(CompileError::invalid(
            format!(
                "train_step_graph_in_blocks: {blocks} blocks of a batch of {batch} rows (x {})",
                x_spec.shape
            ),
            "split the batch into 1 to batch blocks (1: the whole batch at once)",
        ));
    }
    if let Err(why) = cfg.optimizer.check() {
        return Err(CompileError::invalid(
            format!("TrainConfig::optimizer: {why}"),
            "use a positive learning rate, momentum and betas in [0, 1) and a positive epsilon (Keras's defaults: Adam::new(1e-3))",
        ));
    }
    let t = Tracer::new(format!("train{}", x_spec.shape));
    t.set_training(true);
    let x = t.input_typed("x", x_spec.shape, x_spec.dtype);
    let pred = model.forward(&x);
    // Targets, loss and metrics live where the model's output is computed.
    let previous = t.set_device(pred.device());
    let y = t.input_typed("y", y_spec.shape, y_spec.dtype);
    let loss = cfg.loss.apply(&pred, &y);
    t.output("loss", &loss);
    for m in &cfg.metrics {
        t.output(m.name(), &m.apply(&pred, &y));
    }
    t.set_device(previous);
    let mut graph = t.finish()?;
    // Composed attention as one op before autodiff, so that its gradient keeps no [.., S, T]
    // value from the forward pass.
    attention_rewrite::rewrite(&mut graph)?;
    activation_rewrite::rewrite(&mut graph)?;
    if blocks > 1
        && let Some(region) = batch_blocks::region_with(&graph, batch, batch_blocks::Sources::Values)
    {
        // Autodiff reads a traced graph: dense ids, operands before their users.
        graph = batch_blocks::split(&graph, &region, blocks)?
            .compacted()
            .ok_or_else(|| CompileError::Internal("batch_blocks::split made a cycle".into()))?;
    }
    autocast::apply(&mut graph, precision)?;

    let mut loss =
        graph.output("loss").ok_or_else(|| CompileError::Internal("loss output missing".into()))?;
    // f16 steps differentiate the loss times a dynamic scale (`loss_scale`); the loss output
    // stays unscaled.
    let loss_scale = (precision == Precision::F16).then(LossScale::default);
    let mut scale = None;
    if let Some(ls) = &loss_scale {
        let t = Tracer::resume(graph);
        let scaled = ls.scale(&t.tensor(loss));
        loss =
            scaled.loss.id().ok_or_else(|| CompileError::Internal("the scaled loss is poisoned".into()))?;
        scale = scaled.scale.id();
        graph = t.finish()?;
    }
    let params: Vec<_> = graph
        .variables()
        .into_iter()
        .filter(|&v| matches!(graph.node(v).op, Op::Variable { role: VarRole::Parameter, .. }))
        .collect();
    let (graph, grads) = autodiff::gradients(graph, loss, &params)?;
    let t = Tracer::resume(graph);
    let updates: Vec<_> = params
        .iter()
        .zip(&grads)
        .filter_map(|(&p, g)| {
            let key = match &t.with_graph(|gr| gr.node(p).op.clone()) {
                Op::Variable { key, .. } => key.clone(),
                _ => return None,
            };
            g.map(|g| (t.tensor(p), key, t.tensor(g)))
        })
        .collect();
    if updates.is_empty() {
        return Err(CompileError::invalid(
            "the loss does not depend on any trainable parameter",
            "train a model that declares parameters (e.g. a Dense layer) and feeds the loss",
        ));
    }
    let gate = match (&loss_scale, scale) {
        (Some(ls), Some(scale)) => {
            Some(ls.gate(&t.tensor(scale), &updates.iter().map(|(_, _, g)| g).collect::<Vec<_>>()))
        }
        _ => None,
    };
    cfg.optimizer.apply_gated(&updates, gate.as_ref());
    t.finish()
}
