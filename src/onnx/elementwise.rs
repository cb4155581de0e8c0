//! Elementwise ONNX ops: arithmetic (folded where every operand is a folded integer tensor),
//! activations composed from the DSL's ops, variadic Max/Min/Sum/Mean, comparisons and logic
//! (0.0/1.0 tensors), Where.

use super::layout::{broadcast_dims, broadcast_index};
use super::{Importer, Ints, MAX_FOLDED, Node, Value};
use crate::error::Result;
use kiln_compiler::trace::Tensor;

pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    let op = n.op;
    // Folded integer arithmetic and comparisons, for shape-computing subgraphs.
    if let Some(f) = int_binary(op)
        && n.inputs() == 2
        && let (Value::Ints(a), Value::Ints(b)) = (imp.input(n, 0)?, imp.input(n, 1)?)
    {
        return Ok(Some(vec![Value::Ints(fold2(n, &a, &b, f)?)]));
    }
    if op == "Mod" {
        // Folded integers only (shape arithmetic: an exporter's `size % heads`); ONNX's fmod 0
        // takes the divisor's sign (Python's %), fmod 1 the dividend's (C's fmod).
        let c_style = n.int("fmod", 0) != 0;
        let (Value::Ints(a), Value::Ints(b)) = (imp.input(n, 0)?, imp.input(n, 1)?) else {
            return Err(n.unsupported(
                "takes the remainder of computed values",
                "kiln folds Mod over constant integers (shape arithmetic)",
            ));
        };
        let f = |a: i64, b: i64| {
            if c_style {
                a.checked_rem(b)
            } else {
                a.checked_rem_euclid(b).map(|r| if r != 0 && b < 0 { r + b } else { r })
            }
        };
        return Ok(Some(vec![Value::Ints(fold2(n, &a, &b, f)?)]));
    }
    let x = |imp: &mut Importer| imp.tensor(n, 0);
    let y = match op {
        "Add" => x(imp)?.add(&imp.tensor(n, 1)?),
        "Sub" => x(imp)?.sub(&imp.tensor(n, 1)?),
        "Mul" => x(imp)?.mul(&imp.tensor(n, 1)?),
        "Div" => x(imp)?.div(&imp.tensor(n, 1)?),
        "Pow" => x(imp)?.pow(&imp.tensor(n, 1)?),
        "Equal" => x(imp)?.eq(&imp.tensor(n, 1)?),
        "Less" => x(imp)?.lt(&imp.tensor(n, 1)?),
        "LessOrEqual" => x(imp)?.le(&imp.tensor(n, 1)?),
        "Greater" => x(imp)?.gt(&imp.tensor(n, 1)?),
        "GreaterOrEqual" => x(imp)?.ge(&imp.tensor(n, 1)?),
        "And" => x(imp)?.ne(0.0).mul(imp.tensor(n, 1)?.ne(0.0)),
        "Or" => x(imp)?.ne(0.0).maximum(imp.tensor(n, 1)?.ne(0.0)),
        "Xor" => x(imp)?.ne(0.0).ne(imp.tensor(n, 1)?.ne(0.0)),
        "Not" => {
            if let Value::Ints(a) = imp.input(n, 0)? {
                let values = a.values.iter().map(|&v| i64::from(v == 0)).collect();
                return Ok(Some(vec![Value::Ints(Ints::new(a.dims, values))]));
            }
            x(imp)?.eq(0.0)
        }
        "Where" => {
            if let (Value::Ints(c), Value::Ints(a), Value::Ints(b)) =
                (imp.input(n, 0)?, imp.input(n, 1)?, imp.input(n, 2)?)
            {
                // The shape all three broadcast to, then each element picked.
                let dims = broadcast_dims(&c.dims, &a.dims).and_then(|d| broadcast_dims(&d, &b.dims));
                let dims = dims.ok_or_else(|| {
                    n.invalid("the operands do not broadcast", "give broadcastable operands")
                })?;
                let count = fold_count(n, &dims)?;
                let at = |t: &Ints, i: usize| t.values[broadcast_index(i, &dims, &t.dims)];
                let values = (0..count).map(|i| if at(&c, i) != 0 { at(&a, i) } else { at(&b, i) }).collect();
                let out = Ints::new(dims, values);
                return Ok(Some(vec![Value::Ints(out)]));
            }
            let (c, a, b) = (x(imp)?, imp.tensor(n, 1)?, imp.tensor(n, 2)?);
            c.select(&a, &b)
        }
        "Relu" => x(imp)?.relu(),
        "Sigmoid" => x(imp)?.sigmoid(),
        "Tanh" => x(imp)?.tanh(),
        "Erf" => x(imp)?.erf(),
        "Exp" => x(imp)?.exp(),
        "Log" => x(imp)?.log(),
        "Sqrt" => x(imp)?.sqrt(),
        "Neg" => {
            if let Value::Ints(a) = imp.input(n, 0)? {
                let values = a.values.iter().map(|&v| v.wrapping_neg()).collect();
                return Ok(Some(vec![Value::Ints(Ints::new(a.dims, values))]));
            }
            x(imp)?.neg()
        }
        "Abs" => x(imp)?.abs(),
        "Sign" => x(imp)?.sign(),
        "Reciprocal" => x(imp)?.reciprocal(),
        "Softsign" => {
            let x = x(imp)?;
            x.div(&(x.abs() + 1.0))
        }
        "Softplus" => softplus(&x(imp)?),
        "Mish" => {
            let x = x(imp)?;
            x.mul(softplus(&x).tanh())
        }
        "LeakyRelu" => {
            let (x, alpha) = (x(imp)?, n.float("alpha", 0.01));
            x.lt(0.0).select(&(x.clone() * alpha), &x)
        }
        "PRelu" => {
            let (x, slope) = (x(imp)?, imp.tensor(n, 1)?);
            if !slope.shape().broadcasts_to(x.shape()) {
                return Err(n.invalid(
                    format!("slope {} does not broadcast to the input {}", slope.shape(), x.shape()),
                    "give a slope that broadcasts to the input (unidirectional broadcasting)",
                ));
            }
            x.lt(0.0).select(&x.mul(&slope), &x)
        }
        "ThresholdedRelu" => {
            let (x, alpha) = (x(imp)?, n.float("alpha", 1.0));
            x.gt(alpha).select(&x, &imp.t.fill(0.0, []))
        }
        "Elu" => {
            let (x, alpha) = (x(imp)?, n.float("alpha", 1.0));
            x.lt(0.0).select(&(expm1_neg(&x) * alpha), &x)
        }
        "Selu" => {
            let (x, alpha, gamma) = (x(imp)?, n.float("alpha", 1.673_263_2), n.float("gamma", 1.050_701));
            x.le(0.0).select(&(expm1_neg(&x) * alpha), &x) * gamma
        }
        "Celu" => {
            let (x, alpha) = (x(imp)?, n.float("alpha", 1.0));
            if alpha == 0.0 {
                return Err(n.invalid("alpha is 0", "Celu divides by alpha: give a nonzero alpha"));
            }
            x.relu() + &(expm1_neg(&(x.clone() * (1.0 / alpha))) * alpha)
        }
        "HardSigmoid" => {
            let (x, alpha, beta) = (x(imp)?, n.float("alpha", 0.2), n.float("beta", 0.5));
            (x * alpha + beta).clamp(0.0, 1.0)
        }
        "HardSwish" => {
            let x = x(imp)?;
            x.mul((x.clone() * (1.0 / 6.0) + 0.5).clamp(0.0, 1.0))
        }
        "Gelu" => match n.string("approximate").as_deref().unwrap_or("none") {
            "none" => x(imp)?.gelu(),
            "tanh" => x(imp)?.gelu_tanh(),
            other => {
                return Err(
                    n.unsupported(format!("approximate = {other:?}"), "Gelu approximates with none or tanh")
                );
            }
        },
        "Shrink" => {
            let (x, bias, lambd) = (x(imp)?, n.float("bias", 0.0), n.float("lambd", 0.5));
            let zero = imp.t.fill(0.0, []);
            let above = x.gt(lambd).select(&(x.clone() - bias), &zero);
            x.lt(-lambd).select(&(x.clone() + bias), &above)
        }
        "Clip" => match clip(imp, n)? {
            Value::Tensor(t) => t,
            folded => return Ok(Some(vec![folded])),
        },
        "Max" | "Min" | "Sum" | "Mean" => {
            if n.inputs() == 0 {
                return Err(n.invalid("has no inputs", format!("{op} needs at least one input")));
            }
            let all: Vec<Value> = (0..n.inputs()).map(|i| imp.input(n, i)).collect::<Result<_>>()?;
            if op != "Mean" && all.iter().all(|v| matches!(v, Value::Ints(_))) {
                let f = match op {
                    "Max" => |a: i64, b: i64| Some(a.max(b)),
                    "Min" => |a: i64, b: i64| Some(a.min(b)),
                    _ => |a: i64, b: i64| a.checked_add(b),
                };
                let mut acc = match &all[0] {
                    Value::Ints(a) => a.clone(),
                    _ => unreachable!("all inputs are folded"),
                };
                for v in &all[1..] {
                    if let Value::Ints(b) = v {
                        acc = fold2(n, &acc, b, f)?;
                    }
                }
                return Ok(Some(vec![Value::Ints(acc)]));
            }
            let mut acc = imp.tensor(n, 0)?;
            for i in 1..n.inputs() {
                let b = imp.tensor(n, i)?;
                acc = match op {
                    "Max" => acc.maximum(&b),
                    "Min" => acc.minimum(&b),
                    _ => acc.add(&b),
                };
            }
            if op == "Mean" { acc * (1.0 / n.inputs() as f32) } else { acc }
        }
        _ => return Ok(None),
    };
    Ok(Some(vec![Value::Tensor(y)]))
}

/// log(1 + eˣ) as max(x, 0) + log(1 + e^-|x|), which neither overflows nor loses small values.
fn softplus(x: &Tensor) -> Tensor {
    x.relu() + &(x.abs().neg().exp() + 1.0).log()
}

/// eˣ - 1 for the negative part of x (min(x, 0)), so that the branch a select drops never
/// overflows (and its gradient stays finite).
fn expm1_neg(x: &Tensor) -> Tensor {
    x.minimum(0.0).exp() - 1.0
}

fn clip(imp: &mut Importer, n: &Node) -> Result<Value> {
    if n.opset < 11 {
        let x = imp.tensor(n, 0)?;
        return Ok(Value::Tensor(x.maximum(n.float("min", f32::MIN)).minimum(n.float("max", f32::MAX))));
    }
    if let Value::Ints(a) = imp.input(n, 0)? {
        let lo = imp.opt_ints(n, 1)?.and_then(|b| b.values.first().copied()).unwrap_or(i64::MIN);
        let hi = imp.opt_ints(n, 2)?.and_then(|b| b.values.first().copied()).unwrap_or(i64::MAX);
        let values = a.values.iter().map(|&v| v.max(lo).min(hi)).collect();
        return Ok(Value::Ints(Ints::new(a.dims, values)));
    }
    let mut x = imp.tensor(n, 0)?;
    for (i, lower) in [(1, true), (2, false)] {
        if !n.has(i) {
            continue;
        }
        let bound = imp.tensor(n, i)?;
        if bound.rank() != 0 && bound.shape().numel() != 1 {
            return Err(n.invalid(
                format!("bound {i} has shape {}", bound.shape()),
                "Clip's min and max are scalars",
            ));
        }
        x = if lower { x.maximum(&bound) } else { x.minimum(&bound) };
    }
    Ok(Value::Tensor(x))
}

type IntFn = fn(i64, i64) -> Option<i64>;

/// The integer meaning of a binary op, where it has one (None: overflow or division by zero).
fn int_binary(op: &str) -> Option<IntFn> {
    Some(match op {
        "Add" => |a, b| a.checked_add(b),
        "Sub" => |a, b| a.checked_sub(b),
        "Mul" => |a, b| a.checked_mul(b),
        // Integer division truncates toward zero (the reference casts the quotient).
        "Div" => |a, b| a.checked_div(b),
        "Equal" => |a, b| Some(i64::from(a == b)),
        "Less" => |a, b| Some(i64::from(a < b)),
        "LessOrEqual" => |a, b| Some(i64::from(a <= b)),
        "Greater" => |a, b| Some(i64::from(a > b)),
        "GreaterOrEqual" => |a, b| Some(i64::from(a >= b)),
        "And" => |a, b| Some(i64::from(a != 0 && b != 0)),
        "Or" => |a, b| Some(i64::from(a != 0 || b != 0)),
        "Xor" => |a, b| Some(i64::from((a != 0) != (b != 0))),
        "Max" => |a, b| Some(a.max(b)),
        "Min" => |a, b| Some(a.min(b)),
        _ => return None,
    })
}

/// `f` over two folded tensors with NumPy broadcasting.
pub(super) fn fold2(n: &Node, a: &Ints, b: &Ints, f: impl Fn(i64, i64) -> Option<i64>) -> Result<Ints> {
    let dims = broadcast_dims(&a.dims, &b.dims).ok_or_else(|| {
        n.invalid(
            format!("shapes {:?} and {:?} do not broadcast", a.dims, b.dims),
            "give broadcastable operands",
        )
    })?;
    let count = fold_count(n, &dims)?;
    let mut values = Vec::with_capacity(count);
    for i in 0..count {
        let (x, y) =
            (a.values[broadcast_index(i, &dims, &a.dims)], b.values[broadcast_index(i, &dims, &b.dims)]);
        values.push(f(x, y).ok_or_else(|| {
            n.invalid(format!("{x} {} {y} overflows or divides by zero", n.op), "check the integer operands")
        })?);
    }
    Ok(Ints::new(dims, values))
}

/// The element count of a folded tensor of `dims`, at most `MAX_FOLDED`.
pub(super) fn fold_count(n: &Node, dims: &[usize]) -> Result<usize> {
    let count = dims.iter().try_fold(1usize, |c, &d| c.checked_mul(d)).filter(|&c| c <= MAX_FOLDED);
    count.ok_or_else(|| {
        n.unsupported(
            format!("folds an integer tensor of shape {dims:?}"),
            "kiln folds at most 2^20 integers",
        )
    })
}
