//! Shape and dtype inference: the one place that says which operands an op accepts and what it
//! produces. The tracer calls it for every op it records; `passes::verify` re-runs it over a graph.

use super::{BinaryOp, DType, Grad, Op, Shape, Window2d};

/// Why an op rejected its operands; the tracer adds the op, the operand shapes and the caller's line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpError {
    /// What is wrong with the operands, naming their shapes or dtypes, as in
    /// `operand dtypes differ: f32 and i64`.
    pub message: String,
    /// What the caller can do about it (`cast the operands to one dtype ...`).
    pub help: String,
}

fn err<T>(message: impl Into<String>, help: impl Into<String>) -> Result<T, OpError> {
    Err(OpError { message: message.into(), help: help.into() })
}

/// The largest tensor kiln accepts: 1 TiB. No device holds more, and with every tensor below it
/// the byte sums that liveness, the planner and lowering compute cannot overflow `usize` on any
/// graph that fits in memory (2^24 such tensors still sum below 2^64); `compile` checks the sums
/// anyway.
pub const MAX_TENSOR_BYTES: usize = 1 << 40;

/// The output shape and dtype of `op` applied to `operands`. Every size is computed with checked
/// arithmetic, and an output (or a source's shape) above `MAX_TENSOR_BYTES` is an error: this is
/// the one door through which shapes enter a graph.
pub fn infer(op: &Op, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), OpError> {
    let (shape, dtype) = infer_type(op, operands)?;
    match shape.checked_bytes(dtype) {
        Some(bytes) if bytes <= MAX_TENSOR_BYTES => Ok((shape, dtype)),
        bytes => {
            let size = match bytes {
                Some(b) => format!("{b} bytes"),
                None => "more bytes than a usize can count".into(),
            };
            err(
                format!(
                    "the result {dtype}{shape} would hold {size}, above kiln's limit of 1 TiB per tensor"
                ),
                "check the shape for a wrong or overflowing dimension (a batch size, a reshape, a broadcast)",
            )
        }
    }
}

fn infer_type(op: &Op, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), OpError> {
    let arity = expected_arity(op);
    if !arity.contains(&operands.len()) {
        return err(
            format!("expects {} operand(s), got {}", arity_text(arity.clone()), operands.len()),
            "pass the operands the op documents",
        );
    }
    let shape = |i: usize| operands[i].0;
    let dtype = |i: usize| operands[i].1;
    let same_dtype = |idx: &[usize]| -> Result<DType, OpError> {
        let d = dtype(idx[0]);
        match idx.iter().find(|&&i| dtype(i) != d) {
            Some(&i) => err(
                format!("operand dtypes differ: {} and {}", d, dtype(i)),
                "cast the operands to one dtype before combining them",
            ),
            None => Ok(d),
        }
    };

    // Exact dtypes (ids, masks) are stored, indexed with, cast and viewed, never computed on.
    let exact_allowed = |i: usize| match op {
        Op::Cast { .. } | Op::Reshape { .. } => true,
        Op::Gather => i == 1 && dtype(1) != DType::Bool,
        Op::GatherGrad { .. } => i == 0 && dtype(0) != DType::Bool,
        _ => false,
    };
    if let Some(i) = (0..operands.len()).find(|&i| dtype(i).is_exact() && !exact_allowed(i)) {
        let what = if matches!(op, Op::Gather | Op::GatherGrad { .. }) {
            "ids are i32, i64 or f32 integers; a bool cannot index"
        } else {
            "kiln computes in f32; i32, i64 and bool are stored, indexed with and cast"
        };
        return err(
            format!("operand {i} is {}: {what}", dtype(i)),
            "cast it first: `t.cast(DType::F32)` (a mask of 0.0 / 1.0, ids as exact f32 up to 2^24)",
        );
    }
    match op {
        Op::Input { shape, dtype, .. } | Op::Variable { shape, dtype, .. } => Ok((shape.clone(), *dtype)),
        Op::Fill { shape, .. } => Ok((shape.clone(), DType::F32)),
        Op::Iota { shape, axis } => {
            if *axis >= shape.rank() {
                return err(
                    format!("iota over axis {axis} of a tensor of shape {shape} (rank {})", shape.rank()),
                    "count along an axis the shape has",
                );
            }
            Ok((shape.clone(), DType::F32))
        }
        Op::RandomUniform { shape: out, .. } => {
            if shape(0).numel() != 1 {
                return err(
                    format!("the step operand has shape {}, not one element", shape(0)),
                    "pass the step counter (a one-element variable)",
                );
            }
            Ok((out.clone(), DType::F32))
        }
        Op::Unary(_) | Op::Copy | Op::Scalar { .. } => Ok((shape(0).clone(), dtype(0))),
        Op::Cast { to } => Ok((shape(0).clone(), *to)),
        Op::CastLike => {
            if !(dtype(0).is_float() && dtype(1).is_float()) {
                return err(
                    format!("cast_like of {} to the type of {}", dtype(0), dtype(1)),
                    "cast a float value like another float value",
                );
            }
            Ok((shape(0).clone(), dtype(1)))
        }
        Op::Custom { name } => match crate::custom::lookup(name) {
            Some(def) => def.infer(operands).map_err(|why| OpError {
                message: format!("custom op `{name}`: {why}"),
                help: "give the operands the custom op's definition accepts".into(),
            }),
            None => err(
                format!(
                    "no custom op named `{name}` is registered (registered: {:?})",
                    crate::custom::registered()
                ),
                "register it with kiln::compiler::custom::register before tracing or compiling",
            ),
        },
        Op::Binary(b) => {
            let d = same_dtype(&[0, 1])?;
            let grad_op = matches!(
                b,
                BinaryOp::ReluGrad
                    | BinaryOp::GeluGrad
                    | BinaryOp::GeluTanhGrad
                    | BinaryOp::SigmoidGrad
                    | BinaryOp::TanhGrad
            );
            if grad_op && shape(0) != shape(1) {
                return err(
                    format!("forward value {} and gradient {} differ in shape", shape(0), shape(1)),
                    "gradient helpers take operands of one shape",
                );
            }
            broadcast(shape(0), shape(1)).map(|s| (s, d))
        }
        Op::Fused(f) => {
            let all: Vec<usize> = (0..operands.len()).collect();
            // Operands of several float types are read by a program that stores its output in
            // the type its last cast names (`Inst::Cast`).
            let d = match f.stored_dtype() {
                Some(to) if to.is_float() && all.iter().all(|&i| dtype(i).is_float()) => to,
                Some(to) => {
                    return err(
                        format!("a fused program casts to {to} over operands of other than float types"),
                        "fused casts are between f32, f16 and bf16: compile the graph again",
                    );
                }
                // A product accumulates half factors in f32 (`DType::accumulated`).
                None if f.product().is_some() => same_dtype(&all)?.accumulated(),
                None => same_dtype(&all)?,
            };
            // With a product first, operands 0 and 1 are its factors and the program's operand
            // 0 is the product.
            let first = match f.product() {
                None => 0,
                Some(m) => {
                    if operands.len() < 2 || f.reduce.is_some() {
                        return err(
                            "a fused product needs its two factors first and no reduction",
                            "fused ops are made by kiln's fusion pass: compile the graph again",
                        );
                    }
                    if shape(0).numel() == 0 || shape(1).numel() == 0 {
                        return err(
                            "a fused product's factors are empty",
                            "empty products are not fused: compile the graph again",
                        );
                    }
                    if f.matmul.is_some() && f.conv.is_some() {
                        return err(
                            "a fused program computes a matmul or a convolution first, not both",
                            "fused ops are made by kiln's fusion pass: compile the graph again",
                        );
                    }
                    let (product, _) = infer_type(&m, &operands[..2])?;
                    if product != f.shape {
                        return err(
                            format!("the product is {product} but the fused shape is {}", f.shape),
                            "the program of a fused product runs over the product's shape",
                        );
                    }
                    2
                }
            };
            if let Err(e) = f.check(f.program_operands(operands.len())) {
                return err(e, "fused ops are made by kiln's fusion pass: compile the graph again");
            }
            if f.epilogue_operands > operands.len() {
                return err(
                    format!("{} epilogue operands of {}", f.epilogue_operands, operands.len()),
                    "fused ops are made by kiln's fusion pass: compile the graph again",
                );
            }
            let own = operands.len() - f.epilogue_operands;
            if let Some(i) =
                (first..own).find(|&i| Shape::broadcast(shape(i), &f.shape).as_ref() != Some(&f.shape))
            {
                return err(
                    format!(
                        "operand {i} of shape {} does not broadcast to the fused shape {}",
                        shape(i),
                        f.shape
                    ),
                    "every operand of a fused op broadcasts to its output",
                );
            }
            let (out, d) = match &f.reduce {
                None => (f.shape.clone(), d),
                Some(r) => infer_type(&r.op(), &[(&f.shape, d)])?,
            };
            if f.epilogue.is_empty() && f.epilogue_operands == 0 {
                return Ok((out, d));
            }
            // An epilogue: after a reduction that sums something, over non-empty operands.
            let summed =
                f.reduce.as_ref().is_some_and(|r| r.axes.iter().any(|&a| f.shape.dims().get(a) > Some(&1)));
            if !summed || f.has_product() || operands.iter().any(|(s, _)| s.numel() == 0) {
                return err(
                    "a fused epilogue follows a reduction over an axis longer than 1, of non-empty operands",
                    "fused ops are made by kiln's fusion pass: compile the graph again",
                );
            }
            if let Err(e) = f.epilogue_program(&out).check(f.epilogue_operands + 1) {
                return err(
                    format!("epilogue: {e}"),
                    "fused ops are made by kiln's fusion pass: compile the graph again",
                );
            }
            let extra = operands.len() - f.epilogue_operands;
            if let Some(i) =
                (extra..operands.len()).find(|&i| Shape::broadcast(shape(i), &out).as_ref() != Some(&out))
            {
                return err(
                    format!(
                        "epilogue operand {i} of shape {} does not broadcast to the output {out}",
                        shape(i)
                    ),
                    "every operand of a fused epilogue broadcasts to the output",
                );
            }
            Ok((out, d))
        }
        Op::Select => {
            let d = same_dtype(&[1, 2])?;
            let ab = broadcast(shape(1), shape(2))?;
            broadcast(shape(0), &ab).map(|s| (s, d))
        }
        Op::MatMul { transpose_a, transpose_b } => {
            let d = same_dtype(&[0, 1])?.accumulated();
            matmul(shape(0), shape(1), *transpose_a, *transpose_b).map(|s| (s, d))
        }
        Op::Reshape { shape: target } => {
            if target.numel() != shape(0).numel() {
                return err(
                    format!(
                        "cannot reshape {} ({} elements) to {} ({} elements)",
                        shape(0),
                        shape(0).numel(),
                        target,
                        target.numel()
                    ),
                    "the new shape must hold the same number of elements",
                );
            }
            Ok((target.clone(), dtype(0)))
        }
        Op::Permute { perm } => {
            let rank = shape(0).rank();
            let mut seen = vec![false; rank];
            let valid = perm.len() == rank
                && perm.iter().all(|&p| p < rank && !std::mem::replace(&mut seen[p], true));
            if !valid {
                return err(
                    format!("{perm:?} is not a permutation of the {rank} axes of {}", shape(0)),
                    format!("give each axis 0..{rank} exactly once"),
                );
            }
            let dims: Vec<usize> = perm.iter().map(|&p| shape(0).dims()[p]).collect();
            Ok((Shape::new(dims), dtype(0)))
        }
        Op::BroadcastTo { shape: target } => {
            if !shape(0).broadcasts_to(target) {
                return err(
                    format!("{} does not broadcast to {}", shape(0), target),
                    "each axis must equal the target's or be 1 (NumPy rules, aligned at the right)",
                );
            }
            Ok((target.clone(), dtype(0)))
        }
        Op::Concat { axis } => {
            let d = same_dtype(&(0..operands.len()).collect::<Vec<_>>())?;
            let first = shape(0);
            if *axis >= first.rank() {
                return err(
                    format!("axis {axis} is out of range for rank {}", first.rank()),
                    "concatenate along an existing axis",
                );
            }
            let mut dims = first.dims().to_vec();
            for (s, _) in &operands[1..] {
                let agree = s.rank() == first.rank()
                    && (0..first.rank()).all(|i| i == *axis || s.dims()[i] == first.dims()[i]);
                if !agree {
                    return err(
                        format!("{} and {} differ outside axis {axis}", first, s),
                        "all operands must have the same shape except along the concatenation axis",
                    );
                }
                dims[*axis] = dims[*axis].checked_add(s.dims()[*axis]).ok_or_else(|| OpError {
                    message: format!("the concatenated axis {axis} overflows"),
                    help: "check the operands' sizes".into(),
                })?;
            }
            Ok((Shape::new(dims), d))
        }
        Op::Slice { axis, start, len } => {
            let s = shape(0);
            let end = start.checked_add(*len);
            if *axis >= s.rank() || end.is_none_or(|e| e > s.dims()[*axis]) || *len == 0 {
                return err(
                    format!("slice of {len} elements from {start} along axis {axis} is outside {s}"),
                    "take a non-empty range inside the axis",
                );
            }
            let mut dims = s.dims().to_vec();
            dims[*axis] = *len;
            Ok((Shape::new(dims), dtype(0)))
        }
        Op::Pad { axis, before, after } => {
            let s = shape(0);
            if *axis >= s.rank() {
                return err(format!("axis {axis} is out of range for {s}"), "pad an existing axis");
            }
            let mut dims = s.dims().to_vec();
            let Some(d) = before.checked_add(*after).and_then(|p| p.checked_add(dims[*axis])) else {
                return err(format!("padding {before}+{after} of axis {axis} overflows"), "pad by less");
            };
            dims[*axis] = d;
            Ok((Shape::new(dims), dtype(0)))
        }
        Op::Reduce { axes, keepdims, .. } => {
            let s = shape(0);
            let sorted = axes.windows(2).all(|w| w[0] < w[1]);
            if !sorted || axes.iter().any(|&a| a >= s.rank()) {
                return err(
                    format!("axes {axes:?} are not distinct axes of {s}"),
                    "reduce over axes inside the rank, each once",
                );
            }
            let dims: Vec<usize> = (0..s.rank())
                .filter_map(|i| match (axes.contains(&i), keepdims) {
                    (false, _) => Some(s.dims()[i]),
                    (true, true) => Some(1),
                    (true, false) => None,
                })
                .collect();
            Ok((Shape::new(dims), dtype(0)))
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            if *axis >= shape(0).rank() {
                return err(
                    format!("axis {axis} is out of range for {}", shape(0)),
                    "normalise along an existing axis",
                );
            }
            Ok((shape(0).clone(), dtype(0)))
        }
        Op::Conv2d { window } => {
            let d = same_dtype(&[0, 1])?.accumulated();
            conv2d(shape(0), shape(1), window).map(|s| (s, d))
        }
        Op::Conv2dBackpropInput { window, input } => {
            let d = same_dtype(&[0, 1])?.accumulated();
            let expected = conv2d(input, shape(1), window)?;
            if &expected != shape(0) {
                return err(
                    format!("gradient {} does not match the convolution's output {}", shape(0), expected),
                    "pass the gradient of this convolution's output",
                );
            }
            Ok((input.clone(), d))
        }
        Op::Conv2dBackpropInputReluGrad { window, input } => {
            let residual = operands.len() == 4;
            let d = if residual { same_dtype(&[0, 1, 2, 3])? } else { same_dtype(&[0, 1, 2])? }.accumulated();
            let expected = conv2d(input, shape(1), window)?;
            if residual && shape(3) != input {
                return err(
                    format!("residual gradient {} does not match the convolution's input {input}", shape(3)),
                    "pass the gradient that reaches the ReLU's output by the other path, of its shape",
                );
            }
            if &expected != shape(0) || shape(2) != input {
                return err(
                    format!(
                        "gradient {} and activation {} do not match the convolution's output {expected} and input {input}",
                        shape(0),
                        shape(2)
                    ),
                    "pass the gradient of this convolution's output and the ReLU output it read",
                );
            }
            Ok((input.clone(), d))
        }
        Op::Conv2dBackpropFilter { window } => {
            let d = same_dtype(&[0, 1])?.accumulated();
            let (x, dy) = (shape(0), shape(1));
            rank_is(x, 4, "input (NHWC)")?;
            rank_is(dy, 4, "gradient (NHWC)")?;
            let w = Shape::new([
                window.size[0],
                window.size[1],
                x.dims()[3] / window.groups.max(1),
                dy.dims()[3],
            ]);
            let expected = conv2d(x, &w, window)?;
            if &expected != dy {
                return err(
                    format!("gradient {} does not match the convolution's output {}", dy, expected),
                    "pass the gradient of this convolution's output",
                );
            }
            Ok((w, d))
        }
        Op::Pool2d { window, .. } => pool2d(shape(0), window).map(|s| (s, dtype(0))),
        Op::Pool2dGrad { window, .. } => {
            let d = same_dtype(&[0, 1])?;
            let expected = pool2d(shape(0), window)?;
            if &expected != shape(1) {
                return err(
                    format!("gradient {} does not match the pooling output {}", shape(1), expected),
                    "pass the gradient of this pooling's output",
                );
            }
            Ok((shape(0).clone(), d))
        }
        Op::AvgPool2dGrad { window, input } => {
            let expected = pool2d(input, window)?;
            if &expected != shape(0) {
                return err(
                    format!("gradient {} does not match the pooling output {expected} of {input}", shape(0)),
                    "pass the gradient of this pooling's output",
                );
            }
            Ok((input.clone(), dtype(0)))
        }
        Op::Gather => {
            let (table, ids) = (shape(0), shape(1));
            if table.rank() == 0 {
                return err("the table is a scalar", "gather rows from a table of rank >= 1");
            }
            let mut dims = ids.dims().to_vec();
            dims.extend_from_slice(&table.dims()[1..]);
            Ok((Shape::new(dims), dtype(0)))
        }
        Op::AllReduce { op } => match op {
            crate::ir::ReduceOp::Sum | crate::ir::ReduceOp::Mean => Ok((shape(0).clone(), dtype(0))),
            crate::ir::ReduceOp::Max => err(
                "an all-reduce takes the sum or the mean over the ranks",
                "use ReduceOp::Sum or ReduceOp::Mean",
            ),
        },
        Op::ReduceScatter { op, shard } => {
            check_shard(shard)?;
            match op {
                crate::ir::ReduceOp::Sum | crate::ir::ReduceOp::Mean => {
                    Ok((Shape::new(vec![shard.padded(shape(0).numel())]), dtype(0)))
                }
                crate::ir::ReduceOp::Max => err(
                    "a reduce-scatter takes the sum or the mean over the ranks",
                    "use ReduceOp::Sum or ReduceOp::Mean",
                ),
            }
        }
        Op::AllGather { shard } => {
            check_shard(shard)?;
            Ok((Shape::scalar(), dtype(0)))
        }
        Op::Attention { scale, .. } | Op::AttentionGrad { scale, .. } => {
            let grad = matches!(op, Op::AttentionGrad { .. });
            let (q, k, v) = (shape(0), shape(1), shape(2));
            let d = same_dtype(&(0..operands.len()).collect::<Vec<_>>())?;
            if !d.is_float() || !scale.is_finite() {
                return err(
                    format!("{d} operands with scale {scale}"),
                    "attend over float values with a finite scale",
                );
            }
            let r = q.rank();
            let lead_ok = r >= 2 && k.rank() == r && v.rank() == r && q.dims()[..r - 2] == k.dims()[..r - 2];
            if !lead_ok
                || v.dims()[..r - 1] != k.dims()[..r - 1]
                || q.back(1) != k.back(1)
                || v.back(1) != q.back(1)
            {
                return err(
                    format!("q {q}, k {k} and v {v}"),
                    "pass q [.., S, D], k [.., T, D] and v [.., T, D] with the same leading axes",
                );
            }
            let (s_len, t_len) = (q.back(2), k.back(2));
            let rest = if grad { 5 } else { 3 };
            if grad && (shape(3) != q || shape(4) != q) {
                return err(
                    format!("output {} and its gradient {} for queries {q}", shape(3), shape(4)),
                    "pass the attention's output and the gradient of it, both of the queries' shape",
                );
            }
            if operands.len() == rest + 1 {
                let bias = shape(rest);
                let mut full = q.dims()[..r - 1].to_vec();
                full.push(t_len);
                let fits = bias.broadcasts_to(&Shape::new(full));
                if !fits {
                    return err(
                        format!("bias {bias} for scores [.., {s_len}, {t_len}]"),
                        "pass a bias that broadcasts to the scores' shape",
                    );
                }
            }
            if grad {
                let mut dims = q.dims().to_vec();
                dims[r - 2] = s_len + 2 * t_len;
                Ok((Shape::new(dims), d))
            } else {
                Ok((q.clone(), d))
            }
        }
        Op::GatherGrad { vocab } => {
            let (ids, dy) = (shape(0), shape(1));
            if dy.rank() < ids.rank() || dy.dims()[..ids.rank()] != *ids.dims() {
                return err(
                    format!("gradient {dy} does not start with the ids' shape {ids}"),
                    "pass the gradient of this gather's output",
                );
            }
            let mut dims = vec![*vocab];
            dims.extend_from_slice(&dy.dims()[ids.rank()..]);
            Ok((Shape::new(dims), dtype(1)))
        }
        Op::MatMulRows { rows } => {
            let d = same_dtype(&[0, 1])?.accumulated();
            let (a, b) = (shape(0), shape(1));
            if a.rank() != 2 || b.rank() != 2 || a.dims()[0] != b.dims()[0] {
                return err(
                    format!("operands {a} and {b} are not two matrices with the same number of rows"),
                    "pass a[M, K] and b[M, N]: the block is a row block of aᵀ·b",
                );
            }
            if rows.len == 0 || rows.end().is_none_or(|end| end > a.dims()[1]) {
                return err(
                    format!(
                        "rows {}+{} are not a non-empty block of the {} columns of {a}",
                        rows.start,
                        rows.len,
                        a.dims()[1]
                    ),
                    "take rows within aᵀ's rows",
                );
            }
            Ok((Shape::new(vec![rows.len, b.dims()[1]]), d))
        }
        Op::ApplySgd { rows, product, shard, .. } | Op::ApplyAdam { rows, product, shard, .. } => {
            let var = shape(0);
            if let Some(sh) = shard {
                return sharded_update(op, sh, operands, *rows, *product);
            }
            // A tiled update writes a block of rows: its gradient has just those rows.
            let grad_shape = match rows {
                None => var.clone(),
                Some(r) => {
                    if var.rank() == 0 || r.len == 0 || r.end().is_none_or(|end| end > var.dims()[0]) {
                        return err(
                            format!(
                                "rows {}+{} are not a non-empty block of the variable {var}",
                                r.start, r.len
                            ),
                            "update rows within the variable's first axis",
                        );
                    }
                    let mut dims = var.dims().to_vec();
                    dims[0] = r.len;
                    Shape::new(dims)
                }
            };
            check_gate(op, operands)?;
            let grad = op.update_grad().unwrap_or(Grad::Operand);
            let start = grad.state_start();
            let state: Vec<usize> = match op {
                Op::ApplyAdam { .. } => vec![start, start + 1],
                _ => (start..op.update_gate(operands.len()).unwrap_or(operands.len())).collect(),
            };
            if *product {
                let (a, b) = (shape(1), shape(2));
                let fits = a.rank() == 2
                    && b.rank() == 2
                    && a.dims()[0] == b.dims()[0]
                    && a.dims()[0] > 0
                    && rows.is_none()
                    && [a.dims()[1], b.dims()[1]] == *grad_shape.dims();
                if !fits {
                    return err(
                        format!("the gradient's factors {a} and {b} do not make aᵀ·b of shape {grad_shape}"),
                        "a product update takes a[M, R] and b[M, C] (M > 0) for a whole [R, C] variable",
                    );
                }
                // Half factors of an f32 variable: their product is rounded to their type
                // and widened, as the half copy's gradient is (`Grad::Product`).
                let factors = same_dtype(&[1, 2])?;
                if factors != dtype(0) && !(factors.is_half() && dtype(0) == DType::F32) {
                    return err(
                        format!("the gradient's factors are {factors} but the variable is {}", dtype(0)),
                        "a product update's factors have the variable's type, or a half type for an f32 variable",
                    );
                }
            } else if shape(1) != &grad_shape {
                return err(
                    format!("the gradient has shape {} but the update writes {grad_shape}", shape(1)),
                    "the gradient must have the variable's shape (or the updated rows')",
                );
            }
            let factors: &[usize] = if *product { &[1, 2] } else { &[] };
            let gate = op.update_gate(operands.len());
            if let Some(i) = (1..operands.len())
                .find(|&i| !factors.contains(&i) && Some(i) != gate && dtype(i) != dtype(0))
            {
                return err(
                    format!("operand {i} is {} but the variable is {}", dtype(i), dtype(0)),
                    "an update's gradient, state and counter have the variable's type",
                );
            }
            if let Some(&i) = state.iter().find(|&&i| shape(i) != var) {
                return err(
                    format!("operand {i} has shape {} but the variable has {}", shape(i), var),
                    "optimizer state must have the variable's shape",
                );
            }
            if let Op::ApplyAdam { .. } = op
                && shape(start + 2).numel() != 1
            {
                return err("the iteration counter must hold one element", "pass the counter variable");
            }
            Ok((Shape::scalar(), dtype(0)))
        }
        Op::AssignAdd { .. } => {
            check_gate(op, operands)?;
            Ok((Shape::scalar(), dtype(0)))
        }
        Op::UpdateLossScale { growth, backoff, interval } => {
            // The count of good steps is an f32: exact up to 2^24.
            if !(growth.is_finite()
                && *growth >= 1.0
                && *backoff > 0.0
                && *backoff < 1.0
                && (1..=1 << 24).contains(interval))
            {
                return err(
                    format!("growth {growth}, backoff {backoff} and interval {interval}"),
                    "grow by a finite factor of 1 or more, back off by a factor in (0, 1), after an interval of 1 to 2^24 steps (GradScaler's: 2, 0.5, 2000)",
                );
            }
            if let Some(i) = (0..3).find(|&i| shape(i).numel() != 1 || dtype(i) != DType::F32) {
                return err(
                    format!("operand {i} is {} {}", dtype(i), shape(i)),
                    "pass the scale and good-step variables and the gate, each one f32 element",
                );
            }
            Ok((Shape::scalar(), DType::F32))
        }
    }
}

/// An update's gate operand (`Op::update_gate`), where it has one, holds one f32 element.
fn check_gate(op: &Op, operands: &[(&Shape, DType)]) -> Result<(), OpError> {
    match op.update_gate(operands.len()).map(|i| operands[i]) {
        Some(_) if op.update_grad() == Some(Grad::Product) => err(
            "a product update (its gradient computed in its kernel) has a gate operand",
            "gate updates from a stored gradient: the gate reads every gradient first",
        ),
        Some((shape, d)) if shape.numel() != 1 || d != DType::F32 => err(
            format!("the gate operand is {d} {shape}"),
            "gate an update with one f32 element (loss scaling's unscale factor)",
        ),
        _ => Ok(()),
    }
}

fn check_shard(shard: &crate::ir::Shard) -> Result<(), OpError> {
    if shard.ranks == 0 || shard.rank >= shard.ranks {
        return err(
            format!("rank {} of {} ranks is not a rank of the group", shard.rank, shard.ranks),
            "shard over one rank or more, with a rank below the rank count",
        );
    }
    Ok(())
}

/// A ZeRO update (`Op::ApplyAdam { shard: Some(_) }`, `ApplySgd`): (var, grad, state..) where
/// the state holds the rank's padded shard and the gradient either the shard or the variable.
fn sharded_update(
    op: &Op,
    shard: &crate::ir::Shard,
    operands: &[(&Shape, DType)],
    rows: Option<crate::ir::Rows>,
    product: bool,
) -> Result<(Shape, DType), OpError> {
    check_shard(shard)?;
    if rows.is_some() || product {
        return err(
            "a sharded update is also tiled or computes its gradient's product",
            "shard whole-variable updates from a stored gradient only",
        );
    }
    let (var, d) = operands[0];
    let part = Shape::new(vec![shard.padded(var.numel())]);
    let grad = operands[1].0;
    if grad != &part && grad != var {
        return err(
            format!("the gradient has shape {grad} but the shard is {part} of the variable {var}"),
            "pass the reduce-scattered shard of the gradient, or the whole all-reduced gradient",
        );
    }
    check_gate(op, operands)?;
    let state = match op {
        Op::ApplyAdam { .. } => 2..4,
        _ => 2..op.update_gate(operands.len()).unwrap_or(operands.len()),
    };
    if let Some(i) = state.clone().find(|&i| operands[i].0 != &part) {
        return err(
            format!("operand {i} has shape {} but the rank's shard of {var} is {part}", operands[i].0),
            "a sharded update's optimizer state holds just the rank's shard",
        );
    }
    if let Some(i) = (1..operands.len()).find(|&i| operands[i].1 != d) {
        return err(
            format!("operand dtypes differ: {d} and {}", operands[i].1),
            "cast the operands to one dtype before combining them",
        );
    }
    if let Op::ApplyAdam { .. } = op
        && operands[4].0.numel() != 1
    {
        return err("the iteration counter must hold one element", "pass the counter variable");
    }
    Ok((Shape::scalar(), d))
}

fn expected_arity(op: &Op) -> std::ops::RangeInclusive<usize> {
    match op {
        Op::Input { .. } | Op::Variable { .. } | Op::Fill { .. } | Op::Iota { .. } => 0..=0,
        Op::Unary(_)
        | Op::RandomUniform { .. }
        | Op::Scalar { .. }
        | Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::BroadcastTo { .. }
        | Op::Copy
        | Op::Cast { .. }
        | Op::Slice { .. }
        | Op::Pad { .. }
        | Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::Pool2d { .. }
        | Op::AvgPool2dGrad { .. } => 1..=1,
        // An update's last operand may be its gate (`Op::update_gate`).
        Op::AssignAdd { .. } => 1..=2,
        Op::UpdateLossScale { .. } => 3..=3,
        Op::Binary(_)
        | Op::MatMul { .. }
        | Op::MatMulRows { .. }
        | Op::Conv2d { .. }
        | Op::Conv2dBackpropInput { .. }
        | Op::Conv2dBackpropFilter { .. }
        | Op::Pool2dGrad { .. }
        | Op::Gather
        | Op::GatherGrad { .. }
        | Op::CastLike => 2..=2,
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => 1..=1,
        Op::Select => 3..=3,
        Op::Attention { .. } => 3..=4,
        Op::AttentionGrad { .. } => 5..=6,
        Op::Conv2dBackpropInputReluGrad { .. } => 3..=4,
        Op::Fused(_) => 1..=crate::ir::fused::MAX_FUSED_OPERANDS + 1,
        Op::Concat { .. } => 1..=usize::MAX,
        Op::Custom { .. } => 0..=usize::MAX,
        Op::ApplySgd { momentum, product, .. } if *momentum != 0.0 => {
            3 + usize::from(*product)..=4 + usize::from(*product)
        }
        Op::ApplySgd { product, .. } => 2 + usize::from(*product)..=3 + usize::from(*product),
        Op::ApplyAdam { product, .. } => 5 + usize::from(*product)..=6 + usize::from(*product),
    }
}

fn arity_text(r: std::ops::RangeInclusive<usize>) -> String {
    match (r.start(), r.end()) {
        (a, b) if a == b => a.to_string(),
        (a, &usize::MAX) => format!("at least {a}"),
        (a, b) => format!("{a} to {b}"),
    }
}

fn rank_is(s: &Shape, rank: usize, what: &str) -> Result<(), OpError> {
    if s.rank() != rank {
        return err(
            format!("the {what} must have rank {rank}, got {s}"),
            "reshape it to the documented layout",
        );
    }
    Ok(())
}

fn broadcast(a: &Shape, b: &Shape) -> Result<Shape, OpError> {
    match Shape::broadcast(a, b) {
        Some(s) => Ok(s),
        None => err(
            format!("shapes {a} and {b} do not broadcast"),
            "aligned at the right, each axis pair must be equal or contain a 1 (NumPy rules); reshape or transpose an operand",
        ),
    }
}

fn matmul(a: &Shape, b: &Shape, ta: bool, tb: bool) -> Result<Shape, OpError> {
    if a.rank() < 2 || b.rank() < 2 {
        return err(
            format!("matmul needs operands of rank >= 2, got {a} and {b}"),
            "reshape a vector to [1, n] or [n, 1] first",
        );
    }
    let (m, k) = if ta { (a.back(1), a.back(2)) } else { (a.back(2), a.back(1)) };
    let (k2, n) = if tb { (b.back(1), b.back(2)) } else { (b.back(2), b.back(1)) };
    if k != k2 {
        return err(
            format!("inner dimensions differ: {a} · {b} contracts {k} with {k2}"),
            "the left operand's last axis must equal the right operand's second-to-last: check the layer's input size, or transpose an operand",
        );
    }
    let batch_a = Shape::from(&a.dims()[..a.rank() - 2]);
    let batch_b = Shape::from(&b.dims()[..b.rank() - 2]);
    let Some(batch) = Shape::broadcast(&batch_a, &batch_b) else {
        return err(
            format!("batch axes {batch_a} and {batch_b} do not broadcast"),
            "the axes before the last two must broadcast (NumPy rules)",
        );
    };
    let mut dims = batch.dims().to_vec();
    dims.extend([m, n]);
    Ok(Shape::new(dims))
}

fn spatial(x: &Shape, window: &Window2d) -> Result<[usize; 2], OpError> {
    if window.dilation.iter().any(|&d| d == 0 || d > Window2d::MAX_SIDE) {
        return err(
            format!("a dilation of {}x{}", window.dilation[0], window.dilation[1]),
            format!("give dilations from 1 to {}", Window2d::MAX_SIDE),
        );
    }
    let mut out = [0; 2];
    for (axis, o) in out.iter_mut().enumerate() {
        let input = x.dims()[1 + axis];
        match window.out_and_pad(axis, input) {
            Some((n, _)) if n > 0 => *o = n,
            _ => {
                return err(
                    format!(
                        "a {}x{} window with stride {}x{} does not fit the input {x}",
                        window.size[0], window.size[1], window.stride[0], window.stride[1]
                    ),
                    "use 'same' padding, a smaller window or dilation, a larger input, or pads smaller than the window",
                );
            }
        }
    }
    Ok(out)
}

fn conv2d(x: &Shape, w: &Shape, window: &Window2d) -> Result<Shape, OpError> {
    rank_is(x, 4, "input (NHWC)")?;
    rank_is(w, 4, "filter (HWIO)")?;
    let (c, f, g) = (x.dims()[3], w.dims()[3], window.groups);
    if g == 0 || c % g != 0 || f % g != 0 {
        return err(
            format!("{g} groups over the input {x} and the filter {w}"),
            "give a group count that divides both the input's and the filter's channels",
        );
    }
    if w.dims()[2] != c / g {
        return err(
            format!(
                "the filter {w} expects {} input channels per group, the input {x} has {} in each of {g}",
                w.dims()[2],
                c / g
            ),
            "the filter's third axis must equal the input's channel count divided by the groups",
        );
    }
    if w.dims()[..2] != window.size {
        return err(
            format!("the filter {w} does not match the window {}x{}", window.size[0], window.size[1]),
            "build the window from the filter's first two axes",
        );
    }
    let [oh, ow] = spatial(x, window)?;
    Ok(Shape::new([x.dims()[0], oh, ow, w.dims()[3]]))
}

fn pool2d(x: &Shape, window: &Window2d) -> Result<Shape, OpError> {
    rank_is(x, 4, "input (NHWC)")?;
    if window.dilation != [1, 1] || window.groups != 1 {
        return err(
            format!(
                "a pooling window with dilation {}x{} and {} groups",
                window.dilation[0], window.dilation[1], window.groups
            ),
            "pool with dilation 1x1 and one group",
        );
    }
    let [oh, ow] = spatial(x, window)?;
    Ok(Shape::new([x.dims()[0], oh, ow, x.dims()[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Padding, PoolKind};

    fn f32s(shapes: &[Shape]) -> Vec<(&Shape, DType)> {
        shapes.iter().map(|s| (s, DType::F32)).collect()
    }

    #[test]
    fn matmul_shapes() {
        let op = Op::MatMul { transpose_a: false, transpose_b: false };
        let ok = [Shape::from([2, 32, 100]), Shape::from([100, 10])];
        assert_eq!(infer(&op, &f32s(&ok)).unwrap().0, Shape::from([2, 32, 10]));
        let bad = [Shape::from([32, 100]), Shape::from([10, 1])];
        let e = infer(&op, &f32s(&bad)).unwrap_err();
        assert!(e.message.contains("100 with 10"), "{}", e.message);
        let t = Op::MatMul { transpose_a: true, transpose_b: true };
        let s = [Shape::from([100, 32]), Shape::from([10, 100])];
        assert_eq!(infer(&t, &f32s(&s)).unwrap().0, Shape::from([32, 10]));
    }

    #[test]
    fn conv_and_pool_shapes() {
        let w = Window2d::new([3, 3], [1, 1], Padding::Same);
        let s = [Shape::from([8, 32, 32, 3]), Shape::from([3, 3, 3, 16])];
        assert_eq!(infer(&Op::Conv2d { window: w }, &f32s(&s)).unwrap().0, Shape::from([8, 32, 32, 16]));
        let p = Window2d::new([2, 2], [2, 2], Padding::Valid);
        let x = [Shape::from([8, 31, 31, 16])];
        let pool = Op::Pool2d { kind: PoolKind::Max, window: p };
        assert_eq!(infer(&pool, &f32s(&x)).unwrap().0, Shape::from([8, 15, 15, 16]));
        let s2 = Window2d::new([3, 3], [2, 2], Padding::Same);
        assert_eq!(s2.out_and_pad(0, 7), Some((4, 1)));
        // The input gradient through ReLU: (dy, w, y), y of the input's shape.
        let input = Shape::from([8, 32, 32, 3]);
        let op = Op::Conv2dBackpropInputReluGrad { window: w, input: input.clone() };
        let ok = [Shape::from([8, 32, 32, 16]), Shape::from([3, 3, 3, 16]), input.clone()];
        assert_eq!(infer(&op, &f32s(&ok)).unwrap().0, input);
        let bad = [Shape::from([8, 32, 32, 16]), Shape::from([3, 3, 3, 16]), Shape::from([8, 32, 32, 4])];
        let e = infer(&op, &f32s(&bad)).unwrap_err();
        assert!(e.message.contains("activation [8, 32, 32, 4]"), "{}", e.message);
        assert!(infer(&op, &f32s(&ok[..2])).is_err(), "three operands");
        // With a residual gradient of the input's shape, (dy, w, y, r).
        let with_r = [ok[0].clone(), ok[1].clone(), input.clone(), input.clone()];
        assert_eq!(infer(&op, &f32s(&with_r)).unwrap().0, input);
        let bad_r = [ok[0].clone(), ok[1].clone(), input.clone(), Shape::from([8, 32, 32, 4])];
        let e = infer(&op, &f32s(&bad_r)).unwrap_err();
        assert!(e.message.contains("residual gradient [8, 32, 32, 4]"), "{}", e.message);
    }

    #[test]
    fn reduce_and_dtype_errors() {
        let r = Op::Reduce { op: crate::ir::ReduceOp::Sum, axes: vec![1], keepdims: true };
        let s = [Shape::from([4, 5, 6])];
        assert_eq!(infer(&r, &f32s(&s)).unwrap().0, Shape::from([4, 1, 6]));
        let a = Shape::from([2]);
        let e = infer(&Op::Binary(BinaryOp::Add), &[(&a, DType::F32), (&a, DType::F16)]).unwrap_err();
        assert!(e.message.contains("f32 and f16"));
    }
}
