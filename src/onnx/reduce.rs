//! Products and reductions: Gemm, MatMul, the Reduce* family, Softmax, LogSoftmax and Hardmax.

use super::{Importer, Node, Value};
use crate::error::Result;
use kiln_compiler::trace::Tensor;

pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    let y = match n.op {
        "Gemm" => {
            let (a, b) = (imp.tensor(n, 0)?, imp.tensor(n, 1)?);
            let (alpha, beta) = (n.float("alpha", 1.0), n.float("beta", 1.0));
            let mut y = a.matmul_t(&b, n.int("transA", 0) != 0, n.int("transB", 0) != 0);
            if alpha != 1.0 {
                y = y * alpha;
            }
            if n.has(2) {
                let c = imp.tensor(n, 2)?;
                y = if beta == 1.0 { y + &c } else { y + &(c * beta) };
            }
            y
        }
        "MatMul" => {
            let (a, b) = (imp.tensor(n, 0)?, imp.tensor(n, 1)?);
            // NumPy's vectors: a [K] is a row, b [K] a column, and their axes are dropped after.
            let (ra, rb) = (a.rank(), b.rank());
            if ra == 0 || rb == 0 {
                return Err(n.invalid("multiplies a scalar", "MatMul takes tensors of rank 1 or more"));
            }
            let a2 = if ra == 1 { a.reshape([1, a.dims()[0]]) } else { a };
            let b2 = if rb == 1 { b.reshape([b.dims()[0], 1]) } else { b };
            let y = a2.matmul(&b2);
            let mut dims = y.dims().to_vec();
            if rb == 1 {
                dims.pop();
            }
            if ra == 1
                && let Some(at) = dims.len().checked_sub(if rb == 1 { 1 } else { 2 })
            {
                dims.remove(at);
            }
            if ra == 1 || rb == 1 { y.reshape(dims) } else { y }
        }
        "ReduceSum" | "ReduceMean" | "ReduceMax" | "ReduceMin" | "ReduceL1" | "ReduceL2"
        | "ReduceSumSquare" | "ReduceLogSum" | "ReduceLogSumExp" => reduce(imp, n)?,
        "Softmax" | "LogSoftmax" | "Hardmax" => {
            let x = imp.tensor(n, 0)?;
            let rank = x.rank();
            // Before opset 13 these flattened the axes from `axis` on (default 1) into one.
            let old = n.opset < 13;
            let axis = n.axis(n.int("axis", if old { 1 } else { -1 }), rank)?;
            let (input, along) = if old && axis + 1 != rank {
                let (lead, rest) =
                    (x.dims()[..axis].iter().product::<usize>(), x.dims()[axis..].iter().product());
                (x.reshape([lead, rest]), 1)
            } else {
                (x.clone(), axis)
            };
            let y = match n.op {
                "Softmax" => input.softmax(along as isize),
                "LogSoftmax" => input.log_softmax(along as isize),
                _ => hardmax(imp, &input, along),
            };
            if y.dims() == x.dims() { y } else { y.reshape(x.dims().to_vec()) }
        }
        "NegativeLogLikelihoodLoss" => {
            let log_prob = imp.tensor(n, 0)?;
            nll(imp, n, log_prob)?
        }
        "SoftmaxCrossEntropyLoss" => {
            let log_prob = imp.tensor(n, 0)?.log_softmax(1);
            let loss = nll(imp, n, log_prob.clone())?;
            return Ok(Some(vec![Value::Tensor(loss), Value::Tensor(log_prob)]));
        }
        _ => return Ok(None),
    };
    Ok(Some(vec![Value::Tensor(y)]))
}

/// The negative log-likelihood of `log_prob` [N, C, d...] at the node's integer targets
/// [N, d...] (input 1), weighted by class (input 2) and skipping `ignore_index`, reduced as
/// `reduction` says (a weighted mean divides by the weights' sum).
fn nll(imp: &mut Importer, n: &Node, log_prob: Tensor) -> Result<Tensor> {
    let target = match imp.input(n, 1)? {
        super::Value::Ints(i) => imp.ints_tensor(&n.proto.input[1], &i)?,
        super::Value::Ids(t) | super::Value::Tensor(t) => t,
    };
    let d = log_prob.dims().to_vec();
    let mut expected = d.clone();
    if d.len() >= 2 {
        expected.remove(1);
    }
    if d.len() < 2 || target.dims() != expected.as_slice() {
        return Err(n.invalid(
            format!("targets {} for scores {}", target.shape(), log_prob.shape()),
            "the targets are [N, d...] for scores [N, C, d...]",
        ));
    }
    let mut column = expected.clone();
    column.insert(1, 1);
    let mut classes = vec![1; d.len()];
    classes[1] = d[1];
    let hit = target.reshape(column).eq(imp.t.iota(classes.clone(), 1));
    let zero = imp.t.fill(0.0, []);
    let picked = hit.select(&log_prob, &zero).sum(1, false);
    let mut weight = if n.has(2) {
        Some(hit.select(&imp.tensor(n, 2)?.reshape(classes), &zero).sum(1, false))
    } else {
        None
    };
    if let Some(ignore) = n.attr("ignore_index").and_then(|a| a.i) {
        let keep = target.ne(ignore.clamp(-(1 << 24), 1 << 24) as f32);
        weight = Some(match weight {
            Some(w) => w * &keep,
            None => keep,
        });
    }
    let loss = match &weight {
        Some(w) => picked.mul(w).neg(),
        None => picked.neg(),
    };
    Ok(match n.string("reduction").as_deref().unwrap_or("mean") {
        "none" => loss,
        "sum" => loss.sum(.., false),
        "mean" => match weight {
            Some(w) => loss.sum(.., false).div(w.sum(.., false)),
            None => loss.mean(.., false),
        },
        other => return Err(n.unsupported(format!("reduction {other:?}"), "reduction is none, sum or mean")),
    })
}

/// 1.0 at the first largest element along `axis`, 0.0 elsewhere.
fn hardmax(imp: &Importer, x: &Tensor, axis: usize) -> Tensor {
    let top = x.max([axis as isize], true);
    let index = imp.t.iota(x.dims().to_vec(), axis);
    let beyond = imp.t.fill(x.dims()[axis] as f32, []);
    let first = x.eq(&top).select(&index, &beyond).neg().max([axis as isize], true).neg();
    index.eq(&first)
}

fn reduce(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let x = imp.tensor(n, 0)?;
    let rank = x.rank();
    let from_input = (n.op == "ReduceSum" && n.opset >= 13) || n.opset >= 18;
    let axes = if from_input { imp.opt_ints(n, 1)?.map(|a| a.values) } else { n.ints("axes") };
    let keep = n.int("keepdims", 1) != 0;
    let axes: Vec<isize> = match axes.filter(|a| !a.is_empty()) {
        Some(a) => n.axes(&a, rank)?.into_iter().map(|a| a as isize).collect(),
        None if from_input && n.int("noop_with_empty_axes", 0) != 0 => return Ok(x),
        None => (0..rank as isize).collect(),
    };
    let axes = axes.as_slice();
    Ok(match n.op {
        "ReduceSum" => x.sum(axes, keep),
        "ReduceMean" => x.mean(axes, keep),
        "ReduceMax" => x.max(axes, keep),
        "ReduceMin" => x.neg().max(axes, keep).neg(),
        "ReduceL1" => x.abs().sum(axes, keep),
        "ReduceL2" => x.square().sum(axes, keep).sqrt(),
        "ReduceSumSquare" => x.square().sum(axes, keep),
        "ReduceLogSum" => x.sum(axes, keep).log(),
        _ => {
            // log Σ eˣ = m + log Σ e^(x - m), m the largest element (no overflow).
            let top = x.max(axes, true);
            let s = (x - &top).exp().sum(axes, keep).log();
            let top = if keep { top } else { top.reshape(s.dims().to_vec()) };
            s + &top
        }
    })
}
