//! Losses and metrics, composed from DSL ops (so autodiff differentiates them like any model code).
//! Each reduces to the mean over the batch, as Keras's default `sum_over_batch_size` does.

use crate::trace::Tensor;

/// Keras's `backend.epsilon()`: the clamp of probabilities in binary cross-entropy.
pub const EPSILON: f32 = 1e-7;

/// The loss a training step minimises: the model's output against the targets, reduced to a
/// scalar (the mean over the batch).
#[derive(Clone, Debug, PartialEq)]
pub enum Loss {
    /// On probabilities (a sigmoid output), clamped to `[ε, 1-ε]` as Keras does.
    BinaryCrossEntropy,
    /// On logits with one-hot (or soft) labels over the last axis; stable through log_softmax.
    SoftmaxCrossEntropy,
    /// The mean over every element of `(prediction - target)²`.
    MeanSquaredError,
    /// On logits `[.., classes]` with integer class ids `[..]` (or `[.., 1]`) as targets, stored as
    /// f32 (exact up to 2^24): log-softmax and the negative log-likelihood of the label, with
    /// no one-hot tensor fed or materialised (Keras `SparseCategoricalCrossentropy(from_logits
    /// =True)`, PyTorch `cross_entropy` with class indices). Rows whose label is `ignore_index`
    /// count for nothing, and the mean is over the other rows (PyTorch's `ignore_index`).
    SparseSoftmaxCrossEntropy {
        /// A class id whose rows are left out of the loss and of its mean; `None`: every row counts.
        ignore_index: Option<usize>,
    },
    /// Any scalar the user computes from the model's output and the targets with the DSL's ops
    /// (`Loss::custom`): the training step differentiates it as it does the built-in ones.
    Custom(CustomLoss),
}

/// The closure of a custom loss: (prediction, targets) -> scalar.
type LossFn = dyn Fn(&Tensor, &Tensor) -> Tensor + Send + Sync;

/// A loss written as a closure of the model's output and the targets.
#[derive(Clone)]
pub struct CustomLoss {
    name: String,
    f: std::sync::Arc<LossFn>,
}

impl std::fmt::Debug for CustomLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomLoss({:?})", self.name)
    }
}

/// Two custom losses are equal when they are the same closure.
impl PartialEq for CustomLoss {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && std::sync::Arc::ptr_eq(&self.f, &other.f)
    }
}

impl Loss {
    /// A loss computed by `f(prediction, targets)`, which must return a scalar (reduce with
    /// `mean` or `sum`), e.g. a Huber loss:
    /// `Loss::custom("huber", |p, y| { let d = (p - y).abs(); d.minimum(1.0).square().mul(0.5).add(&(d - 1.0).relu()).mean(.., false) })`.
    pub fn custom(
        name: impl Into<String>,
        f: impl Fn(&Tensor, &Tensor) -> Tensor + Send + Sync + 'static,
    ) -> Self {
        Loss::Custom(CustomLoss { name: name.into(), f: std::sync::Arc::new(f) })
    }

    /// The loss's name in reports (Keras's: `binary_crossentropy`, ...; a custom loss's own).
    pub fn name(&self) -> &str {
        match self {
            Loss::BinaryCrossEntropy => "binary_crossentropy",
            Loss::SoftmaxCrossEntropy => "softmax_crossentropy",
            Loss::MeanSquaredError => "mean_squared_error",
            Loss::SparseSoftmaxCrossEntropy { .. } => "sparse_softmax_crossentropy",
            Loss::Custom(c) => &c.name,
        }
    }

    /// The scalar loss of `pred` against `target`. A custom loss that is not a scalar is an
    /// error naming the loss and the shape it returned.
    #[track_caller]
    pub fn apply(&self, pred: &Tensor, target: &Tensor) -> Tensor {
        match self {
            Loss::BinaryCrossEntropy => binary_crossentropy(pred, target),
            Loss::SoftmaxCrossEntropy => softmax_crossentropy(pred, target),
            Loss::MeanSquaredError => mean_squared_error(pred, target),
            Loss::SparseSoftmaxCrossEntropy { ignore_index } => {
                sparse_softmax_crossentropy(pred, target, *ignore_index)
            }
            Loss::Custom(c) => {
                let loss = (c.f)(pred, target);
                if loss.shape().numel() == 1 && loss.shape().rank() <= 1 {
                    loss.reshape(crate::ir::Shape::scalar())
                } else {
                    pred.tracer().report(
                        "loss",
                        format!("the custom loss `{}` returned {}, not a scalar", c.name, loss.shape()),
                        &[&loss],
                        "reduce it to one value, e.g. with `.mean(.., false)` or `.sum(.., false)`",
                    )
                }
            }
        }
    }
}

/// Predictions and targets must agree exactly: broadcasting [32, 1] against [32] would silently
/// build a [32, 32] loss.
#[track_caller]
fn same_shape(loss: &str, pred: &Tensor, target: &Tensor) -> Option<Tensor> {
    if pred.id().is_some() && target.id().is_some() && pred.shape() != target.shape() {
        return Some(pred.tracer().report(
            loss,
            format!("predictions {} and targets {} differ in shape", pred.shape(), target.shape()),
            &[pred, target],
            "give the targets the model output's shape (e.g. labels [batch, 1] for a Dense(1) output)",
        ));
    }
    None
}

/// The mean binary cross-entropy of probabilities `pred` (clamped to `[ε, 1 - ε]`) against
/// targets of the same shape in `[0, 1]`.
#[track_caller]
pub fn binary_crossentropy(pred: &Tensor, target: &Tensor) -> Tensor {
    if let Some(e) = same_shape("binary_crossentropy", pred, target) {
        return e;
    }
    let p = pred.clamp(EPSILON, 1.0 - EPSILON);
    let bce = target * p.log() + target.rsub(1.0) * p.rsub(1.0).log();
    -bce.mean(.., false)
}

/// The mean over rows of the cross-entropy of `logits` (softmax over the last axis, through
/// log-softmax) against `labels` of the same shape (one-hot or soft).
#[track_caller]
pub fn softmax_crossentropy(logits: &Tensor, labels: &Tensor) -> Tensor {
    if let Some(e) = same_shape("softmax_crossentropy", logits, labels) {
        return e;
    }
    let per_example = -(labels * logits.log_softmax(-1)).sum(-1, false);
    per_example.mean(.., false)
}

/// For logits [.., classes] and class ids [..] or [.., 1]: the ids as [.., 1] and the
/// [1, .., classes] row of class indices they are compared with (so that the comparison, and
/// with it the one-hot, exists only inside a fused group). A mismatch is the error `Err` holds.
#[track_caller]
fn class_ids(op: &str, logits: &Tensor, ids: &Tensor) -> Result<(Tensor, Tensor), Tensor> {
    let dims = logits.dims().to_vec();
    let fail = |what: String, help: &str| Err(logits.tracer().report(op, what, &[logits, ids], help));
    let Some((&classes, rows)) = dims.split_last() else {
        return fail(
            format!("logits {} have no class axis", logits.shape()),
            "give the logits a last axis of classes",
        );
    };
    let l = ids.dims();
    let ids = if l == rows {
        let mut with_one = rows.to_vec();
        with_one.push(1);
        ids.reshape(with_one)
    } else if l.len() == dims.len() && l[..l.len() - 1] == *rows && l[l.len() - 1] == 1 {
        ids.clone()
    } else {
        return fail(
            format!("logits {} and class ids {} do not match", logits.shape(), ids.shape()),
            "give one class id per row of logits: shape [..] or [.., 1] for logits [.., classes]",
        );
    };
    let mut ones = vec![1; rows.len()];
    ones.push(classes);
    // Integer ids are compared as f32 (exact below 2^24 classes).
    Ok((ids.cast(crate::ir::DType::F32), logits.tracer().iota(ones, rows.len())))
}

/// Sparse softmax cross-entropy (`Loss::SparseSoftmaxCrossEntropy`): the label's column is
/// picked by comparing a `[1, .., classes]` iota with the labels, inside the fused reduction, so
/// the `[.., classes]` one-hot exists in no buffer.
#[track_caller]
pub fn sparse_softmax_crossentropy(logits: &Tensor, labels: &Tensor, ignore_index: Option<usize>) -> Tensor {
    let (labels, class) = match class_ids("sparse_softmax_crossentropy", logits, labels) {
        Ok(pair) => pair,
        Err(e) => return e,
    };
    let picked = (logits.log_softmax(-1) * class.eq(&labels)).sum(-1, true);
    match ignore_index {
        None => -picked.mean(.., false),
        Some(ignore) => {
            let counted = labels.ne(ignore as f32);
            let total = (picked * &counted).sum(.., false);
            -(total / counted.sum(.., false).maximum(1.0))
        }
    }
}

/// The mean over every element of `(pred - target)²`; the shapes must be equal.
#[track_caller]
pub fn mean_squared_error(pred: &Tensor, target: &Tensor) -> Tensor {
    if let Some(e) = same_shape("mean_squared_error", pred, target) {
        return e;
    }
    (pred - target).square().mean(.., false)
}

/// A metric reported beside the loss, as a scalar: the mean over the batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Metric {
    /// Fraction of predictions on the right side of 0.5 (Keras's `binary_accuracy`).
    BinaryAccuracy,
    /// Fraction of rows whose largest logit is at the label's one-hot position.
    CategoricalAccuracy,
    /// Fraction of rows whose largest logit is at the class id given as the target (`[..]` or
    /// `[.., 1]`, f32), the metric beside `Loss::SparseSoftmaxCrossEntropy`.
    SparseCategoricalAccuracy,
}

impl Metric {
    /// The metric's name in reports (`accuracy` for each, as Keras names them).
    pub fn name(self) -> &'static str {
        match self {
            Metric::BinaryAccuracy => "accuracy",
            Metric::CategoricalAccuracy => "accuracy",
            Metric::SparseCategoricalAccuracy => "accuracy",
        }
    }

    /// The scalar metric of `pred` against `target`.
    #[track_caller]
    pub fn apply(self, pred: &Tensor, target: &Tensor) -> Tensor {
        match self {
            Metric::BinaryAccuracy => pred.gt(0.5).eq(target).mean(.., false),
            Metric::CategoricalAccuracy => {
                let is_max = pred.eq(pred.max(-1, true));
                (target * is_max).sum(-1, false).mean(.., false)
            }
            Metric::SparseCategoricalAccuracy => match class_ids("sparse_categorical_accuracy", pred, target)
            {
                Ok((target, class)) => {
                    let is_max = pred.eq(pred.max(-1, true));
                    (is_max * class.eq(&target)).sum(-1, false).mean(.., false)
                }
                Err(e) => e,
            },
        }
    }
}
