//! Normalisations: BatchNormalization (running statistics, or the batch's in training mode),
//! LayerNormalization, InstanceNormalization, GroupNormalization and
//! MeanVarianceNormalization, composed from means and reciprocal square roots.

use super::{Importer, Node, Value};
use crate::error::Result;
use kiln_compiler::trace::Tensor;

pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    let out = match n.op {
        "BatchNormalization" => batch_norm(imp, n)?,
        "LayerNormalization" => {
            let x = imp.tensor(n, 0)?;
            let axis = n.axis(n.int("axis", -1), x.rank())?;
            let axes: Vec<usize> = (axis..x.rank()).collect();
            let (y, mean, inv) = normalise(&x, &axes, n.float("epsilon", 1e-5));
            let mut y = y * &imp.tensor(n, 1)?;
            if n.has(2) {
                y = y + &imp.tensor(n, 2)?;
            }
            vec![y, mean, inv]
        }
        "InstanceNormalization" => {
            let x = imp.tensor(n, 0)?;
            let axes: Vec<usize> = (2..x.rank()).collect();
            if axes.is_empty() {
                return Err(n.invalid(
                    format!("has a rank-{} input", x.rank()),
                    "normalise N, C, spatial... tensors",
                ));
            }
            let (y, _, _) = normalise(&x, &axes, n.float("epsilon", 1e-5));
            vec![y * &per_channel(&imp.tensor(n, 1)?, x.rank()) + &per_channel(&imp.tensor(n, 2)?, x.rank())]
        }
        "GroupNormalization" => {
            let x = imp.tensor(n, 0)?;
            let d = x.dims().to_vec();
            let g = usize::try_from(n.int("num_groups", 0)).unwrap_or(0);
            if d.len() < 3 || g == 0 || !d[1].is_multiple_of(g) {
                return Err(n.invalid(
                    format!("{g} groups of an input {}", x.shape()),
                    "group the channels of an N, C, spatial... tensor",
                ));
            }
            let grouped = x.reshape([d[0], g, d[1] / g * d[2..].iter().product::<usize>()]);
            let (y, _, _) = normalise(&grouped, &[2], n.float("epsilon", 1e-5));
            let (scale, bias) = (imp.tensor(n, 1)?, imp.tensor(n, 2)?);
            // Before opset 21 scale and bias are per group, from 21 on per channel.
            let y = if n.opset < 21 {
                (y * &scale.reshape([g, 1]) + &bias.reshape([g, 1])).reshape(d)
            } else {
                y.reshape(d.clone()) * &per_channel(&scale, d.len()) + &per_channel(&bias, d.len())
            };
            vec![y]
        }
        "MeanVarianceNormalization" => {
            let x = imp.tensor(n, 0)?;
            let axes = n.axes(&n.ints("axes").unwrap_or_else(|| vec![0, 2, 3]), x.rank())?;
            let centred = x.clone() - &x.mean(axes.as_slice(), true);
            let sd = centred.square().mean(axes.as_slice(), true).sqrt();
            vec![centred / &(sd + 1e-9)]
        }
        _ => return Ok(None),
    };
    Ok(Some(out.into_iter().map(Value::Tensor).collect()))
}

/// (x - mean) / √(var + ε) over `axes`, with the mean and 1/√(var + ε) (axes kept).
fn normalise(x: &Tensor, axes: &[usize], eps: f32) -> (Tensor, Tensor, Tensor) {
    let mean = x.mean(axes, true);
    let centred = x.clone() - &mean;
    let inv = (centred.square().mean(axes, true) + eps).rsqrt();
    (centred * &inv, mean, inv)
}

/// A [C] tensor as [C, 1, ...] against an N, C, spatial... tensor of `rank`.
fn per_channel(t: &Tensor, rank: usize) -> Tensor {
    let mut dims = t.dims().to_vec();
    dims.extend(std::iter::repeat_n(1, rank.saturating_sub(2)));
    t.reshape(dims)
}

fn batch_norm(imp: &mut Importer, n: &Node) -> Result<Vec<Tensor>> {
    let x = imp.tensor(n, 0)?;
    batch_norm_of(imp, n, x, false)
}

/// BatchNormalization of `x`: NCHW (channels on axis 1), or `channels_last` (an NHWC twin,
/// `nhwc`: channels on the last axis, the [C] scale, bias and statistics broadcast along it).
pub(super) fn batch_norm_of(
    imp: &mut Importer,
    n: &Node,
    x: Tensor,
    channels_last: bool,
) -> Result<Vec<Tensor>> {
    if n.opset < 9 && n.int("spatial", 1) == 0 {
        return Err(n.unsupported("normalises per activation (spatial = 0)", "kiln normalises per channel"));
    }
    let file_training = if n.opset >= 14 { n.int("training_mode", 0) != 0 } else { false };
    // In a training step of the model (`kiln train`, `OnnxLayer` in a `Trainer`) an
    // inference-mode node normalises by the batch's statistics, as PyTorch's `model.train()`.
    let step = imp.t.training() && !file_training;
    let training = file_training || step;
    if !file_training && n.proto.output.iter().skip(1).any(|o| !o.is_empty()) && n.opset < 14 {
        return Err(n.unsupported(
            format!("computes the batch's statistics (opset {} training outputs)", n.opset),
            "export at opset 14+ (training_mode) or for inference",
        ));
    }
    let rank = x.rank();
    let channel = if channels_last { rank.saturating_sub(1) } else { 1 };
    let along = |t: &Tensor| if channels_last { t.clone() } else { per_channel(t, rank) };
    let (scale, bias) = (along(&imp.tensor(n, 1)?), along(&imp.tensor(n, 2)?));
    let (mean, var) = (imp.tensor(n, 3)?, imp.tensor(n, 4)?);
    let eps = n.float("epsilon", 1e-5);
    if !training {
        let (m, v) = (along(&mean), along(&var));
        return Ok(vec![(x - &m) * &(v + eps).rsqrt() * &scale + &bias]);
    }
    let axes: Vec<usize> = (0..rank).filter(|&a| a != channel).collect();
    let batch_mean = x.mean(axes.as_slice(), true);
    let centred = x.clone() - &batch_mean;
    let batch_var = centred.square().mean(axes.as_slice(), true);
    // Stored in its input's type, as PyTorch's batch norm under autocast stores it.
    let y = (centred * &(batch_var.clone() + eps).rsqrt() * &scale + &bias).cast_like(&x);
    let momentum = n.float("momentum", 0.9);
    let c = mean.dims().to_vec();
    if step {
        // The running statistics (variables of the model) follow the batch's, as ONNX's
        // training mode computes them: stat <- stat * momentum + batch * (1 - momentum), an
        // update written in place after the step (stat - (1 - momentum) * (stat - batch)).
        for (stat, batch) in [(&mean, batch_mean), (&var, batch_var)] {
            let is_variable = stat.id().is_some_and(|id| {
                imp.t.with_graph(|g| matches!(g.node(id).op, kiln_compiler::ir::Op::Variable { .. }))
            });
            if is_variable {
                let op = kiln_compiler::ir::Op::ApplySgd {
                    lr: 1.0 - momentum,
                    momentum: 0.0,
                    nesterov: false,
                    rows: None,
                    product: false,
                    shard: None,
                };
                let delta = stat.clone() - &batch.reshape(c.clone());
                stat.record(op, &[stat, &delta]);
            }
        }
        return Ok(vec![y]);
    }
    let running =
        |stat: Tensor, batch: Tensor| stat * momentum + &(batch.reshape(c.clone()) * (1.0 - momentum));
    Ok(vec![y, running(mean.clone(), batch_mean), running(var.clone(), batch_var)])
}
