//! Vector-Jacobian products: for each op, the gradient of every operand given the gradient `g`
//! of the op's output, written with the DSL's own ops.

use super::sum_to;
use crate::error::{CompileError, Result};
use crate::ir::{BinaryOp, DType, Op, PoolKind, ReduceOp, ScalarOp, Shape, UnaryOp};
use crate::trace::Tensor;

/// Gradients of `op`'s operands `x` (in order; `None` where there is none) given its output `y`
/// and the output's gradient `g`.
pub(super) fn vjp(op: &Op, x: &[Tensor], y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let one = |t: Tensor| Ok(vec![Some(t)]);
    match op {
        Op::Input { .. } | Op::Variable { .. } | Op::Fill { .. } | Op::Iota { .. } => Ok(vec![]),
        // Random values are constants of the step: no gradient reaches the counter.
        Op::RandomUniform { .. } => Ok(vec![None]),
        Op::Unary(u) => Ok(vec![unary(*u, &x[0], y, g)]),
        Op::Binary(b) => binary(*b, &x[0], &x[1], y, g),
        Op::Scalar { op, value } => Ok(vec![scalar(*op, *value, &x[0], y, g)]),
        Op::Select => {
            let zeros = g.tracer().fill(0.0, Shape::scalar());
            let ga = x[0].select(g, &zeros);
            let gb = x[0].select(&zeros, g);
            Ok(vec![None, Some(sum_to(&ga, x[1].shape())), Some(sum_to(&gb, x[2].shape()))])
        }
        Op::MatMul { transpose_a: ta, transpose_b: tb } => {
            let (a, b) = (&x[0], &x[1]);
            // A half product's output is its f32 accumulation: its gradient, read by the
            // backward products, in the factors' type.
            let g = &g.cast(a.dtype());
            if let Some(gb) = folded_weight_gradient(a, b, g, *ta, *tb) {
                let ga = if *tb { g.matmul(b) } else { g.matmul_t(b, false, true) };
                return Ok(vec![Some(sum_to(&ga, a.shape())), Some(gb)]);
            }
            let (ga, gb) = match (ta, tb) {
                (false, false) => (g.matmul_t(b, false, true), a.matmul_t(g, true, false)),
                (false, true) => (g.matmul(b), g.matmul_t(a, true, false)),
                (true, false) => (b.matmul_t(g, false, true), a.matmul(g)),
                (true, true) => (b.matmul_t(g, true, true), g.matmul_t(a, true, true)),
            };
            Ok(vec![Some(sum_to(&ga, a.shape())), Some(sum_to(&gb, b.shape()))])
        }
        Op::Reshape { .. } => one(g.reshape(x[0].shape().clone())),
        Op::Permute { perm } => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            one(g.permute(&inverse))
        }
        Op::BroadcastTo { .. } => one(sum_to(g, x[0].shape())),
        Op::Copy => one(g.clone()),
        // Only a float value carries a gradient: back to the operand's dtype, none into ids.
        Op::Cast { .. } if x[0].dtype().is_float() && y.dtype().is_float() => one(g.cast(x[0].dtype())),
        Op::Cast { .. } => Ok(vec![None]),
        // The value's gradient in its own type; `like` gives only a type.
        Op::CastLike => {
            Ok(vec![Some(if g.dtype() == x[0].dtype() { g.clone() } else { g.cast(x[0].dtype()) }), None])
        }
        Op::Custom { name } => {
            let def = crate::custom::lookup(name).ok_or_else(|| {
                CompileError::invalid(
                    format!("no custom op named `{name}` is registered"),
                    "register it before differentiating",
                )
            })?;
            match def.gradient(x, y, g) {
                Some(grads) if grads.len() == x.len() => Ok(grads),
                Some(grads) => Err(CompileError::invalid(
                    format!(
                        "custom op `{name}`'s gradient gave {} gradients for {} operands",
                        grads.len(),
                        x.len()
                    ),
                    "return one Option<Tensor> per operand (None where there is no gradient)",
                )),
                None => Err(CompileError::invalid(
                    format!(
                        "custom op `{name}` has no gradient, and the loss depends on its operands through it"
                    ),
                    "implement CustomOp::gradient (with the DSL's ops), or keep the op out of what is trained",
                )),
            }
        }
        Op::Concat { axis } => {
            let mut start = 0;
            Ok(x.iter()
                .map(|t| {
                    let len = t.dims()[*axis];
                    let s = g.slice(*axis as isize, start, len);
                    start += len;
                    Some(s)
                })
                .collect())
        }
        Op::Slice { axis, start, len } => {
            let after = x[0].dims()[*axis] - start - len;
            one(g.pad(*axis as isize, *start, after))
        }
        Op::Pad { axis, before, .. } => one(g.slice(*axis as isize, *before, x[0].dims()[*axis])),
        Op::Reduce { op, axes, keepdims } => {
            let kept = keepdims_shape(x[0].shape(), axes);
            let gk = if *keepdims { g.clone() } else { g.reshape(kept.clone()) };
            let gx = match op {
                ReduceOp::Sum => gk.broadcast_to(x[0].shape().clone()),
                ReduceOp::Mean => {
                    let count: usize = axes.iter().map(|&a| x[0].dims()[a]).product();
                    gk.broadcast_to(x[0].shape().clone()) * (1.0 / count as f32)
                }
                ReduceOp::Max => {
                    // Ties share the gradient equally, as TensorFlow's reduce_max gradient does.
                    let yk = if *keepdims { y.clone() } else { y.reshape(kept) };
                    let mask = x[0].eq(&yk);
                    let ties = mask.sum(axes.clone(), true);
                    mask * (gk / ties)
                }
            };
            one(gx)
        }
        Op::Attention { scale, causal } => {
            let (q, k, v) = (&x[0], &x[1], &x[2]);
            let (s, t) = (q.shape().back(2), k.shape().back(2));
            let op = Op::AttentionGrad { scale: *scale, causal: *causal };
            let mut operands = vec![q, k, v, y, g];
            operands.extend(x.get(3));
            let packed = g.record(op, &operands);
            let axis = q.rank() as isize - 2;
            let mut grads = vec![
                Some(packed.slice(axis, 0, s)),
                Some(packed.slice(axis, s, t)),
                Some(packed.slice(axis, s + t, t)),
            ];
            if let Some(bias) = x.get(3) {
                // A bias's gradient is the scores' (a learned bias's: a position bias); composed
                // from the probabilities, and dropped as dead code where the bias is a mask.
                // In f32 where the factors are half: their products' f32 accumulations
                // (`Op::MatMul` keeps them, `Tensor::matmul` would round them to half), and the
                // causal mask's -1e9 stays finite (in f16 it would round to -inf).
                let f32 = |t: &Tensor| t.cast(DType::F32);
                let product_t = |a: &Tensor, b: &Tensor| {
                    a.record(Op::MatMul { transpose_a: false, transpose_b: true }, &[a, b])
                };
                let mut scores = product_t(q, k) * *scale;
                scores = &scores + &f32(bias);
                if *causal {
                    let shift = t as f32 - s as f32;
                    let rows = g.tracer().iota([s, t], 0) + shift;
                    let allowed = g.tracer().iota([s, t], 1).le(&rows);
                    scores = scores + (allowed - 1.0).mul(1e9);
                }
                let p = scores.softmax(-1);
                let dp = product_t(g, v);
                let ds = &p * (&dp - (f32(g) * f32(y)).sum(-1, true));
                grads.push(Some(sum_to(&ds, bias.shape())));
            }
            Ok(grads)
        }
        Op::AttentionGrad { .. } => Err(second_order(op)),
        Op::Softmax { axis } => {
            let dot = (g * y).sum(*axis as isize, true);
            one(y * (g - dot))
        }
        Op::LogSoftmax { axis } => {
            let total = g.sum(*axis as isize, true);
            one(g - y.exp() * total)
        }
        Op::Conv2d { window } => {
            let (xs, w) = (&x[0], &x[1]);
            let g = &g.cast(xs.dtype());
            let dx =
                g.record(Op::Conv2dBackpropInput { window: *window, input: xs.shape().clone() }, &[g, w]);
            let dw = g.record(Op::Conv2dBackpropFilter { window: *window }, &[xs, g]);
            Ok(vec![Some(dx), Some(dw)])
        }
        // Average pooling's gradient needs the input's shape, not its values.
        Op::Pool2d { kind: PoolKind::Avg, window } => {
            one(g.record(Op::AvgPool2dGrad { window: *window, input: x[0].shape().clone() }, &[g]))
        }
        Op::Pool2d { kind, window } => {
            one(g.record(Op::Pool2dGrad { kind: *kind, window: *window }, &[&x[0], g]))
        }
        Op::Gather => {
            let vocab = x[0].dims()[0];
            Ok(vec![Some(g.record(Op::GatherGrad { vocab }, &[&x[1], g])), None])
        }
        Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropInputReluGrad { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::Pool2dGrad { .. }
        | Op::AvgPool2dGrad { .. }
        | Op::MatMulRows { .. }
        | Op::GatherGrad { .. } => Err(second_order(op)),
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => {
            Err(CompileError::unsupported(
                "the gradient of a collective (data parallelism inserts it after autodiff)",
                "differentiate the single-rank graph, then make it data-parallel (`data_parallel`)",
            ))
        }
        Op::Fused(_) => Err(CompileError::unsupported(
            "the gradient of a fused group (fusion runs after autodiff, at compile time)",
            "differentiate the traced graph, before `compile` fuses it",
        )),
        Op::ApplySgd { .. } | Op::ApplyAdam { .. } | Op::AssignAdd { .. } | Op::UpdateLossScale { .. } => {
            Err(CompileError::invalid(
                format!("`{}` updates a variable and has no gradient", op.name()),
                "differentiate the loss before adding optimizer updates",
            ))
        }
    }
}

/// The gradient of a 2-D weight `b` shared by every batch of `a[..., m, k]`: one product over all
/// rows, `a[N, k]^T @ g[N, n]` with N the batch axes times m, instead of a batched `[B, k, n]`
/// product summed over the batch (a temporary B times the weight's size). `None` where `a` is
/// transposed or has no batch axes.
fn folded_weight_gradient(a: &Tensor, b: &Tensor, g: &Tensor, ta: bool, tb: bool) -> Option<Tensor> {
    if ta || b.rank() != 2 || a.rank() <= 2 {
        return None;
    }
    let rows = a.shape().numel() / a.shape().back(1).max(1);
    let a2 = a.reshape([rows, a.shape().back(1)]);
    let g2 = g.reshape([rows, g.shape().back(1)]);
    Some(if tb { g2.matmul_t(&a2, true, false) } else { a2.matmul_t(&g2, true, false) })
}

fn second_order(op: &Op) -> CompileError {
    CompileError::unsupported(
        format!("the gradient of `{}` (second-order differentiation)", op.name()),
        "differentiate a graph that contains no gradient ops",
    )
}

fn keepdims_shape(s: &Shape, axes: &[usize]) -> Shape {
    Shape::new(
        s.dims().iter().enumerate().map(|(i, &d)| if axes.contains(&i) { 1 } else { d }).collect::<Vec<_>>(),
    )
}

fn unary(u: UnaryOp, x: &Tensor, y: &Tensor, g: &Tensor) -> Option<Tensor> {
    let helper = |b: BinaryOp, v: &Tensor| v.record(Op::Binary(b), &[v, g]);
    Some(match u {
        UnaryOp::Neg => -g,
        UnaryOp::Abs => g * x.sign(),
        UnaryOp::Sign => return None,
        // From the output (y > 0 exactly where x > 0): the pre-activation can die at the relu.
        UnaryOp::Relu => helper(BinaryOp::ReluGrad, y),
        UnaryOp::Gelu => helper(BinaryOp::GeluGrad, x),
        UnaryOp::GeluTanh => helper(BinaryOp::GeluTanhGrad, x),
        UnaryOp::Sigmoid => helper(BinaryOp::SigmoidGrad, y),
        UnaryOp::Tanh => helper(BinaryOp::TanhGrad, y),
        UnaryOp::Exp => g * y,
        UnaryOp::Log => g / x,
        UnaryOp::Sqrt => (g / y) * 0.5,
        // y = x^-1/2: dy/dx = -y^3 / 2
        UnaryOp::Rsqrt => g * y.pow(3.0) * -0.5,
        UnaryOp::Square => g * x * 2.0,
        UnaryOp::Reciprocal => -(g * y.square()),
        // d/dx erf(x) = 2/√π e^(-x²)
        UnaryOp::Erf => g * (x.square() * -1.0).exp() * std::f32::consts::FRAC_2_SQRT_PI,
    })
}

fn binary(b: BinaryOp, x0: &Tensor, x1: &Tensor, y: &Tensor, g: &Tensor) -> Result<Vec<Option<Tensor>>> {
    let both =
        |ga: Tensor, gb: Tensor| Ok(vec![Some(sum_to(&ga, x0.shape())), Some(sum_to(&gb, x1.shape()))]);
    match b {
        BinaryOp::Add => both(g.clone(), g.clone()),
        BinaryOp::Sub => both(g.clone(), -g),
        BinaryOp::Mul => both(g * x1, g * x0),
        BinaryOp::Div => both(g / x1, -(g * y) / x1),
        BinaryOp::Pow => both(g * x1 * x0.pow(x1 - 1.0), g * y * x0.log()),
        BinaryOp::Maximum | BinaryOp::Minimum => {
            let mask = if b == BinaryOp::Maximum { x0.ge(x1) } else { x0.le(x1) };
            both(g * &mask, g * mask.rsub(1.0))
        }
        BinaryOp::Greater
        | BinaryOp::GreaterEqual
        | BinaryOp::Less
        | BinaryOp::LessEqual
        | BinaryOp::Equal
        | BinaryOp::NotEqual => Ok(vec![None, None]),
        BinaryOp::ReluGrad
        | BinaryOp::GeluGrad
        | BinaryOp::GeluTanhGrad
        | BinaryOp::SigmoidGrad
        | BinaryOp::TanhGrad => Err(second_order(&Op::Binary(b))),
    }
}

fn scalar(op: ScalarOp, c: f32, x: &Tensor, y: &Tensor, g: &Tensor) -> Option<Tensor> {
    Some(match op {
        ScalarOp::Add => g.clone(),
        ScalarOp::Mul => g * c,
        ScalarOp::RSub => -g,
        // y = c / x: dy/dx = -y / x
        ScalarOp::RDiv => -(g * y) / x,
        ScalarOp::Pow if c == 2.0 => g * x * 2.0,
        ScalarOp::Pow => g * x.pow(c - 1.0) * c,
        // Keras's clip passes the gradient where the input is inside the range, bounds included.
        ScalarOp::Max => g * x.ge(c),
        ScalarOp::Min => g * x.le(c),
        ScalarOp::Greater
        | ScalarOp::GreaterEqual
        | ScalarOp::Less
        | ScalarOp::LessEqual
        | ScalarOp::Equal => return None,
    })
}
