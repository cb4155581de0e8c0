//! Layout ONNX ops and folded integer tensors: constants, shapes, casts, reshapes, slicing,
//! gathering, splitting, padding, broadcasting and tiling. An op whose data is a folded integer
//! tensor is folded too (the subgraphs exporters write to compute a `Reshape`'s shape).
//!
//! kiln's `slice` takes a contiguous range along one axis; any other selection of indices along an
//! axis (`take`) is a gather by ids made from an iota (a strided or reversed slice), a concatenation
//! of a few contiguous slices, or a gather by a constant id tensor.

use super::elementwise::fold_count;
use super::{Importer, Ints, Node, Value, reshape_target, tensor_values};
use crate::error::Result;
use kiln_compiler::ir::DType;
use kiln_compiler::trace::Tensor;

/// NumPy broadcasting of two shapes.
pub(super) fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let x = if i + a.len() >= rank { a[i + a.len() - rank] } else { 1 };
            let y = if i + b.len() >= rank { b[i + b.len() - rank] } else { 1 };
            match (x, y) {
                (x, y) if x == y => Some(x),
                (1, y) => Some(y),
                (x, 1) => Some(x),
                _ => None,
            }
        })
        .collect()
}

/// The index into a tensor of shape `from` (broadcast to `to`) of element `i` of `to`.
pub(super) fn broadcast_index(mut i: usize, to: &[usize], from: &[usize]) -> usize {
    let (mut index, mut stride) = (0, 1);
    for (axis, &d) in to.iter().enumerate().rev() {
        let coord = i % d.max(1);
        i /= d.max(1);
        let offset = axis as isize - (to.len() as isize - from.len() as isize);
        if offset >= 0 {
            let f = from[offset as usize];
            if f != 1 {
                index += coord * stride;
            }
            stride *= f;
        }
    }
    index
}

/// The element count of `dims`, saturating.
fn product(dims: &[usize]) -> usize {
    dims.iter().fold(1usize, |a, &d| a.saturating_mul(d))
}

/// The elements `ids` along `axis` of a folded tensor.
fn take_ints(n: &Node, a: &Ints, axis: usize, ids: &[usize]) -> Result<Ints> {
    let mut dims = a.dims.clone();
    let (outer, d, inner) = (product(&dims[..axis]), dims[axis], product(&dims[axis + 1..]));
    dims[axis] = ids.len();
    let count = fold_count(n, &dims)?;
    let mut values = Vec::with_capacity(count);
    if count == 0 {
        return Ok(Ints::new(dims, values));
    }
    for o in 0..outer {
        for &i in ids {
            let start = (o * d + i) * inner;
            values.extend_from_slice(&a.values[start..start + inner]);
        }
    }
    Ok(Ints::new(dims, values))
}

/// The elements `ids` (each below the axis's length) along `axis` of `x`.
pub(super) fn take(imp: &mut Importer, n: &Node, x: &Tensor, axis: usize, ids: &[usize]) -> Result<Tensor> {
    let Some(&first) = ids.first() else {
        return Err(n.unsupported("selects no elements", "kiln's tensors have no empty axes"));
    };
    let mut runs: Vec<(usize, usize)> = vec![(first, 1)];
    for &i in &ids[1..] {
        match runs.last_mut() {
            Some((s, len)) if *s + *len == i => *len += 1,
            _ => runs.push((i, 1)),
        }
    }
    if runs.len() == 1 && first == 0 && ids.len() == x.dims().get(axis).copied().unwrap_or(0) {
        return Ok(x.clone());
    }
    if runs.len() <= 16 {
        let parts: Vec<Tensor> = runs.iter().map(|&(s, len)| x.slice(axis as isize, s, len)).collect();
        return Ok(match parts.split_first() {
            Some((one, [])) => one.clone(),
            Some((head, rest)) => head.concat(&rest.iter().collect::<Vec<_>>(), axis as isize),
            None => x.clone(),
        });
    }
    let step = ids[1] as i64 - ids[0] as i64;
    let arithmetic = ids.windows(2).all(|w| w[1] as i64 - w[0] as i64 == step);
    let id_tensor = if arithmetic {
        imp.t.iota([ids.len()], 0) * step as f32 + first as f32
    } else {
        let name = format!("{}:ids{axis}", n.proto.output.first().cloned().unwrap_or_default());
        imp.constant(&name, vec![ids.len()], ids.iter().map(|&i| i as f32).collect(), false)?
    };
    Ok(gather_axis(x, axis, &id_tensor))
}

/// Rows of `x` along `axis` picked by `ids` (whole numbers as f32, any shape): the ids' axes
/// take the place of `axis`.
pub(super) fn gather_axis(x: &Tensor, axis: usize, ids: &Tensor) -> Tensor {
    if axis == 0 {
        return x.gather(ids);
    }
    let r = x.rank();
    let mut front = vec![axis];
    front.extend((0..r).filter(|&a| a != axis));
    let g = x.permute(&front).gather(ids);
    let k = ids.rank();
    let mut back: Vec<usize> = (k..k + axis).collect();
    back.extend(0..k);
    back.extend(k + axis..k + r - 1);
    g.permute(&back)
}

/// `Constant`: a tensor, or one of the scalar and list forms.
pub(super) fn constant(imp: &mut Importer, n: &Node) -> Result<Vec<Value>> {
    let name = n.proto.output.first().cloned().unwrap_or_default();
    imp.store(&name);
    if let Some(a) = n.attr("value").and_then(|a| a.t.as_ref()) {
        if super::is_integer(a) {
            return Ok(vec![Value::Ints(super::folded(a)?)]);
        }
        let (dims, values) = tensor_values(a)?;
        imp.floats.insert(name.clone(), (dims.clone(), values.clone()));
        return Ok(vec![Value::Tensor(imp.constant(&name, dims, values, true)?)]);
    }
    if let Some(v) = n.attr("value_int").and_then(|a| a.i) {
        return Ok(vec![Value::Ints(Ints::scalar(v))]);
    }
    if let Some(a) = n.attr("value_ints") {
        return Ok(vec![Value::Ints(Ints::vector(a.ints.clone()))]);
    }
    let (dims, values) = if let Some(v) = n.attr("value_float").and_then(|a| a.f) {
        (vec![], vec![v])
    } else if let Some(a) = n.attr("value_floats") {
        (vec![a.floats.len()], a.floats.clone())
    } else {
        return Err(n.unsupported(
            "has no tensor, float or integer value",
            "kiln reads Constant's value, value_float(s) and value_int(s)",
        ));
    };
    if values.is_empty() {
        return Err(n.unsupported("is empty", "kiln's tensors have no empty axes"));
    }
    imp.floats.insert(name.clone(), (dims.clone(), values.clone()));
    Ok(vec![Value::Tensor(imp.constant(&name, dims, values, true)?)])
}

fn dims_of(v: &Value) -> Vec<usize> {
    match v {
        Value::Tensor(t) | Value::Ids(t) => t.dims().to_vec(),
        Value::Ints(i) => i.dims.clone(),
    }
}

/// A value with another shape (of as many elements).
fn reshaped(n: &Node, v: Value, dims: Vec<usize>) -> Result<Value> {
    Ok(match v {
        Value::Tensor(t) => Value::Tensor(t.reshape(dims)),
        Value::Ids(t) => Value::Ids(t.reshape(dims)),
        Value::Ints(i) => {
            if dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(i.values.len()) {
                return Err(
                    n.invalid(format!("cannot reshape {:?} to {dims:?}", i.dims), "keep the element count")
                );
            }
            Value::Ints(Ints::new(dims, i.values))
        }
    })
}

/// The float element types kiln computes in f32 without changing values (f32 itself, and f64
/// read as f32); f16 and bf16 round (`half_type`).
fn float_type(to: i64) -> Option<bool> {
    match to {
        1 | 11 => Some(true),
        10 | 16 => None,
        _ => Some(false),
    }
}

/// f16 (10) or bf16 (16) as kiln's type: a cast to it rounds the value to that type, which
/// the model then computes on in f32 (widened exactly), as a mixed-precision step does.
fn half_type(to: i64) -> Option<DType> {
    match to {
        10 => Some(DType::F16),
        16 => Some(DType::BF16),
        _ => None,
    }
}

fn integer_type(to: i64) -> bool {
    matches!(to, 2..=7 | 9 | 12 | 13)
}

/// An integer converted to element type `to` as a C cast does (wrapping), or `None` for a type
/// kiln does not fold.
fn int_cast(v: i64, to: i64) -> Option<i64> {
    Some(match to {
        2 => v as u8 as i64,
        3 => v as i8 as i64,
        4 => v as u16 as i64,
        5 => v as i16 as i64,
        6 => v as i32 as i64,
        7 => v,
        9 => i64::from(v != 0),
        12 => v as u32 as i64,
        13 => v as u64 as i64,
        _ => return None,
    })
}

fn cast(imp: &mut Importer, n: &Node, v: Value, to: i64, source: &str) -> Result<Value> {
    let unsupported_type = || {
        n.unsupported(
            format!("casts to element type {to}"),
            "kiln casts to float, double, float16, bfloat16, bool and integer types",
        )
    };
    if let Some(half) = half_type(to) {
        let t = match v {
            Value::Ints(i) => imp.ints_tensor(source, &i)?,
            Value::Ids(t) => t.cast(DType::F32),
            Value::Tensor(t) => t,
        };
        return Ok(Value::Tensor(t.cast(half).cast(DType::F32)));
    }
    Ok(match v {
        Value::Ints(i) if float_type(to) == Some(true) => Value::Tensor(imp.ints_tensor(source, &i)?),
        Value::Ints(i) if integer_type(to) => {
            let values = i.values.iter().map(|&v| int_cast(v, to).unwrap_or(v)).collect();
            Value::Ints(Ints::new(i.dims, values))
        }
        Value::Ids(t) if float_type(to) == Some(true) => Value::Tensor(t.cast(DType::F32)),
        Value::Ids(t) if matches!(to, 6 | 7) => Value::Ids(t),
        // An integer input as a mask (transformers 5's attention masks): kiln's booleans are
        // f32 zeros and ones, as comparisons give them.
        Value::Ids(t) if to == 9 => Value::Tensor(t.cast(DType::F32).ne(0.0)),
        Value::Tensor(t) if float_type(to) == Some(true) => Value::Tensor(t),
        Value::Tensor(t) if to == 9 => Value::Tensor(t.ne(0.0)),
        Value::Tensor(t) if integer_type(to) && imp.is_boolean(source) => Value::Tensor(t),
        Value::Tensor(_) if integer_type(to) => {
            return Err(n.unsupported(
                "casts a computed float tensor to an integer type",
                "kiln's tensors are f32: it casts comparisons' results (0 and 1) to integers, \
                 not other computed values",
            ));
        }
        _ => return Err(unsupported_type()),
    })
}

/// ONNX's Slice of one axis of length `d`: the indices `start`, `start + step`, ... before `end`
/// after negative values count from the end and both are clamped.
fn slice_ids(d: usize, start: i64, end: i64, step: i64) -> Vec<usize> {
    if d == 0 {
        return Vec::new();
    }
    let d = d as i64;
    let norm = |v: i64| if v < 0 { v.saturating_add(d) } else { v };
    let (start, end) = (norm(start), norm(end));
    let (start, end) = if step > 0 {
        (start.clamp(0, d), end.clamp(0, d))
    } else {
        (start.clamp(0, d - 1), end.clamp(-1, d - 1))
    };
    let mut ids = Vec::new();
    let mut i = start;
    while (step > 0 && i < end) || (step < 0 && i > end) {
        ids.push(i as usize);
        i = match i.checked_add(step) {
            Some(v) => v,
            None => break,
        };
    }
    ids
}

/// The input's elements `ids` along `axis`, folded or traced.
fn take_value(imp: &mut Importer, n: &Node, v: Value, axis: usize, ids: &[usize]) -> Result<Value> {
    // (A folded tensor may be empty: shape arithmetic slices empty lists.)
    if ids.is_empty() && !matches!(v, Value::Ints(_)) {
        return Err(n.unsupported("selects no elements", "kiln's tensors have no empty axes"));
    }
    Ok(match v {
        Value::Ints(i) => Value::Ints(take_ints(n, &i, axis, ids)?),
        Value::Tensor(t) => Value::Tensor(take(imp, n, &t, axis, ids)?),
        // Ids are moved as f32 (exact below 2^24): kiln's layout kernels move f32.
        Value::Ids(t) => Value::Ids(take(imp, n, &t.cast(DType::F32), axis, ids)?),
    })
}

fn squeeze_unsqueeze(imp: &Importer, n: &Node, v: Value) -> Result<Value> {
    let axes = if n.opset >= 13 { imp.opt_ints(n, 1)?.map(|i| i.values) } else { n.ints("axes") };
    let mut dims = dims_of(&v);
    if n.op == "Unsqueeze" {
        let axes = axes.unwrap_or_default();
        let rank = dims.len() + axes.len();
        for a in n.axes(&axes, rank)? {
            dims.insert(a.min(dims.len()), 1);
        }
    } else {
        let rank = dims.len();
        let axes: Vec<usize> = match axes {
            Some(a) if !a.is_empty() => n.axes(&a, rank)?,
            _ => (0..rank).filter(|&a| dims[a] == 1).collect(),
        };
        if let Some(&a) = axes.iter().find(|&&a| dims[a] != 1) {
            return Err(
                n.invalid(format!("squeezes axis {a} of {dims:?}, not of size 1"), "squeeze axes of size 1")
            );
        }
        dims = dims.iter().enumerate().filter(|(a, _)| !axes.contains(a)).map(|(_, &d)| d).collect();
    }
    reshaped(n, v, dims)
}

pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    let out = match n.op {
        "Identity" => imp.input(n, 0)?,
        "Dropout" => {
            let training = if n.opset >= 12 && n.has(2) {
                imp.ints(n, 2)?.values.first().is_some_and(|&v| v != 0)
            } else {
                false
            };
            let ratio = match imp.float_const(n, 1) {
                Some((_, v)) => v.first().copied().unwrap_or(0.5),
                None if n.opset >= 12 && n.has(1) => 0.5,
                None => n.float("ratio", 0.5),
            };
            if imp.t.training() && ratio != 0.0 {
                // A training step of the model (`kiln train`, `OnnxLayer` in a `Trainer`): the
                // dropout is active, as in PyTorch's `model.train()`: kiln's own (a mask from the
                // plan's generator, recomputed in the gradient's group), seeded by the node.
                let x = imp.tensor(n, 0)?;
                let name = n.proto.output.first().cloned().unwrap_or_default();
                let dropped = imp.t.scope(&name, || {
                    kiln_compiler::nn::Layer::forward(&kiln_compiler::nn::Dropout::new(ratio), &x)
                });
                return Ok(Some(vec![Value::Tensor(dropped)]));
            }
            if training && ratio != 0.0 {
                return Err(n.unsupported(
                    "drops in training mode outside a training step",
                    "kiln imports Dropout for inference (training_mode false), and drops in the training steps of `kiln train` / `OnnxLayer`",
                ));
            }
            imp.input(n, 0)?
        }
        "Cast" => {
            let to = n.int("to", 0);
            let v = imp.input(n, 0)?;
            cast(imp, n, v, to, &n.proto.input[0])?
        }
        "CastLike" => {
            let to = match imp.input(n, 1)? {
                Value::Ints(_) | Value::Ids(_) => 7,
                Value::Tensor(_) if imp.is_boolean(&n.proto.input[1]) => 9,
                Value::Tensor(_) => 1,
            };
            let v = imp.input(n, 0)?;
            cast(imp, n, v, to, &n.proto.input[0])?
        }
        "Shape" => {
            let dims: Vec<i64> = dims_of(&imp.input(n, 0)?).iter().map(|&d| d as i64).collect();
            let r = dims.len() as i64;
            let clamp = |v: i64| (if v < 0 { v.saturating_add(r) } else { v }).clamp(0, r) as usize;
            let (start, end) = (clamp(n.int("start", 0)), clamp(n.int("end", r)));
            Value::Ints(Ints::vector(dims.get(start..end.max(start)).unwrap_or(&[]).to_vec()))
        }
        "Size" => Value::Ints(Ints::scalar(product(&dims_of(&imp.input(n, 0)?)) as i64)),
        "ConstantOfShape" => {
            let shape = imp.ints(n, 0)?;
            let dims = positive_dims(n, &shape.values, "has the shape")?;
            match n.attr("value").and_then(|a| a.t.as_ref()) {
                Some(t) if super::is_integer(t) => {
                    let v = super::folded(t)?.values.first().copied().unwrap_or(0);
                    let count = fold_count(n, &dims)?;
                    Value::Ints(Ints::new(dims, vec![v; count]))
                }
                // Of a shape the file stores, more than one value: model state written compactly
                // (ONNX's `light/` models hold every weight so), a parameter (`Importer::constant`).
                Some(t) => {
                    let (_, v) = tensor_values(t)?;
                    let v = v.first().copied().unwrap_or(0.0);
                    let name = n.proto.output.first().cloned().unwrap_or_default();
                    if imp.is_stored(&n.proto.input[0]) && product(&dims) > 1 {
                        Value::Tensor(imp.uniform_weight(&name, dims, v))
                    } else {
                        Value::Tensor(imp.t.fill(v, dims))
                    }
                }
                None => Value::Tensor(imp.t.fill(0.0, dims)),
            }
        }
        "Range" => {
            let scalar = |i: usize| -> Result<i64> {
                imp.ints(n, i)?
                    .values
                    .first()
                    .copied()
                    .ok_or_else(|| n.invalid(format!("input {i} is empty"), "give a scalar"))
            };
            match (imp.input(n, 0)?, imp.input(n, 1)?, imp.input(n, 2)?) {
                (Value::Ints(_), Value::Ints(_), Value::Ints(_)) => {
                    let (start, limit, delta) = (scalar(0)?, scalar(1)?, scalar(2)?);
                    if delta == 0 {
                        return Err(n.invalid("delta is 0", "give a nonzero delta"));
                    }
                    let span = (limit as i128 - start as i128) as f64 / delta as f64;
                    let count = span.ceil().max(0.0) as usize;
                    fold_count(n, &[count])?;
                    let values: Option<Vec<i64>> =
                        (0..count as i64).map(|i| i.checked_mul(delta)?.checked_add(start)).collect();
                    Value::Ints(Ints::vector(
                        values.ok_or_else(|| n.invalid("overflows", "give a smaller range"))?,
                    ))
                }
                _ => {
                    let consts: Option<Vec<f32>> =
                        (0..3).map(|i| imp.float_const(n, i).and_then(|(_, v)| v.first().copied())).collect();
                    let Some(c) = consts else {
                        return Err(n.unsupported(
                            "takes computed bounds",
                            "kiln folds Range over constant bounds (its length is a shape)",
                        ));
                    };
                    let count = ((c[1] - c[0]) / c[2]).ceil();
                    if !(count >= 1.0 && count <= (1 << 24) as f32) {
                        return Err(n.unsupported(
                            format!("makes {count} elements"),
                            "kiln makes ranges of 1 to 2^24 elements",
                        ));
                    }
                    Value::Tensor(imp.t.iota([count as usize], 0) * c[2] + c[0])
                }
            }
        }
        "Reshape" => {
            let v = imp.input(n, 0)?;
            let mut spec =
                if n.opset >= 5 { imp.ints(n, 1)?.values } else { n.ints("shape").unwrap_or_default() };
            // A target that carries the exported batch, on a re-batched tensor (`STATIC_BATCH`).
            if let (Some(to), Some(&first)) = (imp.rebatch, dims_of(&v).first())
                && first == to
                && spec.first() == Some(&1)
            {
                spec[0] = to as i64;
            }
            let dims = reshape_target(&dims_of(&v), &spec, n.int("allowzero", 0) != 0)
                .map_err(|why| n.invalid(why, "give a shape with the input's element count"))?;
            reshaped(n, v, dims)?
        }
        "Flatten" => {
            let v = imp.input(n, 0)?;
            let d = dims_of(&v);
            let (a, r) = (n.int("axis", 1), d.len() as i64);
            let axis = if a < 0 { a + r } else { a };
            if !(0..=r).contains(&axis) {
                return Err(
                    n.invalid(format!("axis {a} of a rank-{r} tensor"), "Flatten's axis runs from -r to r")
                );
            }
            let axis = axis as usize;
            reshaped(n, v, vec![product(&d[..axis]), product(&d[axis..])])?
        }
        "Squeeze" | "Unsqueeze" => {
            let v = imp.input(n, 0)?;
            squeeze_unsqueeze(imp, n, v)?
        }
        "Transpose" => {
            let x = imp.tensor(n, 0)?;
            let rank = x.rank();
            let perm: Vec<usize> = match n.ints("perm") {
                Some(p) if !p.is_empty() => p.iter().map(|&a| n.axis(a, rank)).collect::<Result<_>>()?,
                _ => (0..rank).rev().collect(),
            };
            Value::Tensor(x.permute(&perm))
        }
        "Concat" => {
            let parts: Vec<Value> = (0..n.inputs()).map(|i| imp.input(n, i)).collect::<Result<_>>()?;
            let Some(first) = parts.first() else {
                return Err(n.invalid("has no inputs", "concatenate at least one tensor"));
            };
            let rank = dims_of(first).len();
            let axis = n.axis(n.int("axis", 0), rank)?;
            if parts.iter().all(|p| matches!(p, Value::Ints(_))) {
                let ints: Vec<&Ints> = parts
                    .iter()
                    .filter_map(|p| if let Value::Ints(i) = p { Some(i) } else { None })
                    .collect();
                Value::Ints(concat_ints(n, &ints, axis)?)
            } else {
                let tensors: Vec<Tensor> =
                    (0..n.inputs()).map(|i| imp.tensor(n, i)).collect::<Result<_>>()?;
                let rest: Vec<&Tensor> = tensors[1..].iter().collect();
                Value::Tensor(tensors[0].concat(&rest, axis as isize))
            }
        }
        "Slice" => {
            let v = imp.input(n, 0)?;
            let dims = dims_of(&v);
            let (starts, ends, axes, steps) = if n.opset >= 10 {
                (
                    imp.ints(n, 1)?.values,
                    imp.ints(n, 2)?.values,
                    imp.opt_ints(n, 3)?.map(|a| a.values),
                    imp.opt_ints(n, 4)?.map(|a| a.values),
                )
            } else {
                (
                    n.ints("starts").unwrap_or_default(),
                    n.ints("ends").unwrap_or_default(),
                    n.ints("axes"),
                    None,
                )
            };
            let axes = axes.unwrap_or_else(|| (0..starts.len() as i64).collect());
            let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
            if ends.len() != starts.len() || axes.len() != starts.len() || steps.len() != starts.len() {
                return Err(n.invalid(
                    format!(
                        "starts {starts:?}, ends {ends:?}, axes {axes:?} and steps {steps:?} differ in length"
                    ),
                    "give one start, end, axis and step per sliced axis",
                ));
            }
            n.axes(&axes, dims.len())?;
            let mut v = v;
            for i in 0..starts.len() {
                let axis = n.axis(axes[i], dims.len())?;
                if steps[i] == 0 {
                    return Err(n.invalid("has step 0", "give nonzero steps"));
                }
                let ids = slice_ids(dims[axis], starts[i], ends[i], steps[i]);
                v = take_value(imp, n, v, axis, &ids)?;
            }
            v
        }
        "Gather" => gather(imp, n)?,
        "GatherElements" => gather_elements(imp, n)?,
        "Split" => return split(imp, n).map(Some),
        "Expand" => {
            let shape = imp.ints(n, 1)?;
            let v = imp.input(n, 0)?;
            let target = positive_dims(n, &shape.values, "expands to")?;
            let dims = broadcast_dims(&dims_of(&v), &target).ok_or_else(|| {
                n.invalid(
                    format!("{:?} does not broadcast with {target:?}", dims_of(&v)),
                    "give a broadcastable shape",
                )
            })?;
            match v {
                Value::Ints(i) => {
                    let count = fold_count(n, &dims)?;
                    let values = (0..count).map(|k| i.values[broadcast_index(k, &dims, &i.dims)]).collect();
                    Value::Ints(Ints::new(dims, values))
                }
                _ => Value::Tensor(imp.tensor(n, 0)?.broadcast_to(dims)),
            }
        }
        "Tile" => {
            let repeats = imp.ints(n, 1)?.values;
            let mut x = imp.tensor(n, 0)?;
            if repeats.len() != x.rank() || repeats.iter().any(|&r| r < 1) {
                return Err(n.invalid(
                    format!("repeats {repeats:?} for a rank-{} input", x.rank()),
                    "give one positive repeat count per axis",
                ));
            }
            for (axis, &r) in repeats.iter().enumerate() {
                if r > 1 {
                    let mut dims = x.dims().to_vec();
                    dims.insert(axis, 1);
                    let mut wide = dims.clone();
                    wide[axis] = r as usize;
                    let mut merged = x.dims().to_vec();
                    merged[axis] = merged[axis].saturating_mul(r as usize);
                    x = x.reshape(dims).broadcast_to(wide).reshape(merged);
                }
            }
            Value::Tensor(x)
        }
        "Pad" => Value::Tensor(pad(imp, n)?),
        "DepthToSpace" | "SpaceToDepth" => {
            let x = imp.tensor(n, 0)?;
            let b = usize::try_from(n.int("blocksize", 0)).unwrap_or(0);
            let &[batch, c, h, w] = x.dims() else {
                return Err(
                    n.unsupported(format!("has a rank-{} input", x.rank()), "kiln rearranges NCHW tensors")
                );
            };
            if b == 0 {
                return Err(n.invalid("has no positive blocksize", "give a blocksize"));
            }
            let y = if n.op == "DepthToSpace" {
                if b.checked_mul(b).is_none_or(|bb| !c.is_multiple_of(bb)) {
                    return Err(n.invalid(
                        format!("{c} channels for blocksize {b}"),
                        "channels must be a multiple of blocksize²",
                    ));
                }
                let cc = c / (b * b);
                let (dims, perm) = match n.string("mode").as_deref().unwrap_or("DCR") {
                    "DCR" => (vec![batch, b, b, cc, h, w], [0, 3, 4, 1, 5, 2]),
                    "CRD" => (vec![batch, cc, b, b, h, w], [0, 1, 4, 2, 5, 3]),
                    other => {
                        return Err(
                            n.unsupported(format!("mode {other:?}"), "DepthToSpace's modes are DCR and CRD")
                        );
                    }
                };
                x.reshape(dims).permute(&perm).reshape([batch, cc, h.saturating_mul(b), w.saturating_mul(b)])
            } else {
                if !h.is_multiple_of(b) || !w.is_multiple_of(b) {
                    return Err(n.invalid(
                        format!("{h}x{w} for blocksize {b}"),
                        "height and width must be multiples of blocksize",
                    ));
                }
                x.reshape([batch, c, h / b, b, w / b, b]).permute(&[0, 3, 5, 1, 2, 4]).reshape([
                    batch,
                    c * b * b,
                    h / b,
                    w / b,
                ])
            };
            Value::Tensor(y)
        }
        "Trilu" => {
            let x = imp.tensor(n, 0)?;
            let k = imp.opt_ints(n, 1)?.and_then(|k| k.values.first().copied()).unwrap_or(0);
            let &[.., r, c] = x.dims() else {
                return Err(
                    n.invalid(format!("has a rank-{} input", x.rank()), "Trilu takes matrices (rank >= 2)")
                );
            };
            let offset = imp.t.iota([r, c], 1) - &imp.t.iota([r, c], 0);
            let k = k.clamp(-(1 << 24), 1 << 24) as f32;
            let keep = if n.int("upper", 1) != 0 { offset.ge(k) } else { offset.le(k) };
            Value::Tensor(keep.select(&x, &imp.t.fill(0.0, [])))
        }
        "RandomUniformLike" => {
            // Uniform values in [low, high) of the input's shape (stochastic depth's draw in a
            // training export): kiln's generator, a pure function of the node's seed, the step
            // counter dropout reads and each element's index, so that the bits are the same on
            // every backend and new every step.
            let x = imp.tensor(n, 0)?;
            if n.attr("dtype").and_then(|a| a.i).is_some_and(|t| t != i64::from(super::proto::FLOAT)) {
                return Err(n.unsupported("draws a dtype other than float", "draw f32 values"));
            }
            let (low, high) = (n.float("low", 0.0), n.float("high", 1.0));
            let name = n.proto.output.first().cloned().unwrap_or_default();
            let u = kiln_compiler::nn::uniform_per_step(&imp.t, x.shape().clone(), &name);
            Value::Tensor(if (low, high) == (0.0, 1.0) { u } else { u * (high - low) + low })
        }
        "EyeLike" => {
            let d = dims_of(&imp.input(n, 0)?);
            let &[r, c] = d.as_slice() else {
                return Err(n.invalid(format!("has a rank-{} input", d.len()), "EyeLike takes a matrix"));
            };
            let k = n.int("k", 0);
            if n.attr("dtype").is_some_and(|a| a.i.is_some_and(integer_type)) {
                let count = fold_count(n, &d)?;
                let values = (0..count).map(|i| i64::from((i % c) as i64 - (i / c) as i64 == k)).collect();
                Value::Ints(Ints::new(d, values))
            } else {
                let offset = imp.t.iota([r, c], 1) - &imp.t.iota([r, c], 0);
                Value::Tensor(offset.eq(k.clamp(-(1 << 24), 1 << 24) as f32))
            }
        }
        _ => return Ok(None),
    };
    Ok(Some(vec![out]))
}

fn concat_ints(n: &Node, parts: &[&Ints], axis: usize) -> Result<Ints> {
    let first = parts[0];
    let mut dims = first.dims.clone();
    dims[axis] = 0;
    for p in parts {
        let agree = p.dims.len() == first.dims.len()
            && (0..dims.len()).all(|a| a == axis || p.dims[a] == first.dims[a]);
        if !agree {
            return Err(n.invalid(
                format!("{:?} and {:?} differ outside axis {axis}", first.dims, p.dims),
                "concatenate matching shapes",
            ));
        }
        dims[axis] = dims[axis].saturating_add(p.dims[axis]);
    }
    let count = fold_count(n, &dims)?;
    if count == 0 {
        return Ok(Ints::new(dims, Vec::new()));
    }
    let (outer, inner) = (product(&dims[..axis]), product(&dims[axis + 1..]));
    let mut values = Vec::with_capacity(count);
    for o in 0..outer {
        for p in parts {
            let block = p.dims[axis] * inner;
            values.extend_from_slice(&p.values[o * block..(o + 1) * block]);
        }
    }
    Ok(Ints::new(dims, values))
}

fn gather(imp: &mut Importer, n: &Node) -> Result<Value> {
    let data = imp.input(n, 0)?;
    let dims = dims_of(&data);
    let axis = n.axis(n.int("axis", 0), dims.len())?;
    let d = dims.get(axis).copied().unwrap_or(0);
    match imp.input(n, 1)? {
        Value::Ints(indices) => {
            let ids: Vec<usize> = indices
                .values
                .iter()
                .map(|&i| {
                    let j = if i < 0 { i + d as i64 } else { i };
                    usize::try_from(j).ok().filter(|&j| j < d).ok_or_else(|| {
                        n.invalid(
                            format!("index {i} is outside an axis of {d}"),
                            format!("indices run from -{d} to {}", d as i64 - 1),
                        )
                    })
                })
                .collect::<Result<_>>()?;
            let mut out = dims[..axis].to_vec();
            out.extend(&indices.dims);
            out.extend(&dims[axis + 1..]);
            let picked = take_value(imp, n, data, axis, &ids)?;
            reshaped(n, picked, out)
        }
        Value::Ids(ids) | Value::Tensor(ids) => {
            let x = imp.tensor(n, 0)?;
            // Negative ids count from the end of the axis (in f32: exact below 2^24).
            let ids = ids.cast(DType::F32);
            let ids = ids.add(&(ids.lt(0.0) * d as f32));
            Ok(Value::Tensor(gather_axis(&x, axis, &ids)))
        }
    }
}

/// `GatherElements`: out[i..] = data[i.. with axis' coordinate replaced by indices[i..]], of the
/// indices' shape. One gather from the flattened data: each element's flat position is the
/// index times the axis' stride plus its other coordinates' offset (`Iota`s, or computed here
/// where the indices are constants). Its gradient is the gather's (a scatter-add).
fn gather_elements(imp: &mut Importer, n: &Node) -> Result<Value> {
    let data = imp.input(n, 0)?;
    let dims = dims_of(&data);
    let axis = n.axis(n.int("axis", 0), dims.len())?;
    let indices = imp.input(n, 1)?;
    let idims = dims_of(&indices);
    if idims.len() != dims.len()
        || idims.iter().zip(&dims).enumerate().any(|(a, (&i, &d))| a != axis && i > d)
    {
        return Err(n.invalid(
            format!("indices of shape {idims:?} for data of shape {dims:?}"),
            "give indices of the data's rank, no longer than the data on every axis but `axis`",
        ));
    }
    let total: usize = dims.iter().product();
    if total > 1 << 24 {
        return Err(n.unsupported(
            format!("gathers from {total} elements"),
            "kiln moves gather positions as f32, exact up to 2^24 elements",
        ));
    }
    let strides: Vec<usize> = (0..dims.len()).map(|a| dims[a + 1..].iter().product()).collect();
    let d = dims[axis];
    let flat_data = reshaped(n, data, vec![total])?;
    match indices {
        Value::Ints(ix) => {
            let mut flat = Vec::with_capacity(ix.values.len());
            let mut coord = vec![0usize; idims.len()];
            for &i in &ix.values {
                let j = if i < 0 { i + d as i64 } else { i };
                let j = usize::try_from(j).ok().filter(|&j| j < d).ok_or_else(|| {
                    n.invalid(
                        format!("index {i} is outside an axis of {d}"),
                        format!("indices run from -{d} to {}", d as i64 - 1),
                    )
                })?;
                let other: usize = coord
                    .iter()
                    .zip(&strides)
                    .enumerate()
                    .filter(|(a, _)| *a != axis)
                    .map(|(_, (c, s))| c * s)
                    .sum();
                flat.push(other + j * strides[axis]);
                for a in (0..coord.len()).rev() {
                    coord[a] += 1;
                    if coord[a] < idims[a] {
                        break;
                    }
                    coord[a] = 0;
                }
            }
            let picked = take_value(imp, n, flat_data, 0, &flat)?;
            reshaped(n, picked, idims)
        }
        Value::Ids(ids) | Value::Tensor(ids) => {
            let Value::Tensor(x) = flat_data else {
                return Err(n.unsupported(
                    "gathers from integer data by computed indices",
                    "kiln gathers computed indices from float tensors",
                ));
            };
            // Negative ids count from the end of the axis (in f32: exact below 2^24).
            let ids = ids.cast(DType::F32);
            let ids = ids.add(&(ids.lt(0.0) * d as f32));
            let mut flat = ids.clone() * strides[axis] as f32;
            // An index outside the axis (after counting from the end) would land in another row
            // of the flattened data: pushed past its end instead, so that the gather refuses it.
            let outside = ids.lt(0.0).add(ids.ge(d as f32));
            flat = flat.add(&(outside * (2 * total) as f32));
            for a in (0..dims.len()).filter(|&a| a != axis && idims[a] > 1) {
                flat = flat.add(&(imp.t.iota(idims.clone(), a) * strides[a] as f32));
            }
            Ok(Value::Tensor(x.gather(&flat)))
        }
    }
}

fn split(imp: &mut Importer, n: &Node) -> Result<Vec<Value>> {
    let v = imp.input(n, 0)?;
    let dims = dims_of(&v);
    let axis = n.axis(n.int("axis", 0), dims.len())?;
    let d = dims[axis.min(dims.len().saturating_sub(1))];
    let given = if n.opset >= 13 {
        imp.opt_ints(n, 1)?.map(|s| s.values)
    } else {
        n.ints("split").filter(|s| !s.is_empty())
    };
    let parts = n.proto.output.len();
    let sizes: Vec<usize> = match given {
        Some(s) => s.iter().map(|&v| usize::try_from(v).unwrap_or(0)).collect(),
        None => {
            let k = if n.opset >= 18 {
                usize::try_from(n.int("num_outputs", parts as i64)).unwrap_or(0)
            } else {
                parts
            };
            if k == 0 || k != parts {
                return Err(n.invalid(
                    format!("splits into {k} parts for {parts} outputs"),
                    "give one output per part",
                ));
            }
            let chunk = if n.opset >= 18 { d.div_ceil(k) } else { d / k };
            if n.opset < 18 && !d.is_multiple_of(k) {
                return Err(n.invalid(format!("splits {d} into {k} equal parts"), "give split sizes"));
            }
            (0..k).map(|i| chunk.min(d.saturating_sub(i * chunk))).collect()
        }
    };
    if sizes.iter().sum::<usize>() != d || sizes.len() != parts {
        return Err(n.invalid(
            format!("splits an axis of {d} into {sizes:?} for {parts} outputs"),
            "give sizes adding up to the axis, one per output",
        ));
    }
    let mut out = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for &s in &sizes {
        let ids: Vec<usize> = (start..start + s).collect();
        out.push(take_value(imp, n, v.clone(), axis, &ids)?);
        start += s;
    }
    Ok(out)
}

/// The source index along an axis of length `d` of output position `i` (counted from the
/// first padded element, `before` of them) for Pad's edge, reflect and wrap modes.
fn pad_source(mode: &str, i: i64, before: i64, d: i64) -> usize {
    let j = i - before;
    (match mode {
        "edge" => j.clamp(0, d - 1),
        "wrap" => j.rem_euclid(d),
        _ if d == 1 => 0,
        _ => {
            let m = j.rem_euclid(2 * (d - 1));
            if m >= d { 2 * (d - 1) - m } else { m }
        }
    }) as usize
}

fn pad(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let x = imp.tensor(n, 0)?;
    let rank = x.rank();
    let mode = n.string("mode").unwrap_or_else(|| "constant".into());
    let (pads, axes) = if n.opset >= 11 {
        let axes = match imp.opt_ints(n, 3)? {
            Some(a) => n.axes(&a.values, rank)?,
            None => (0..rank).collect(),
        };
        (imp.ints(n, 1)?.values, axes)
    } else {
        (n.ints("pads").unwrap_or_default(), (0..rank).collect())
    };
    if pads.len() != 2 * axes.len() {
        return Err(n.invalid(
            format!("pads {pads:?} for {} axes", axes.len()),
            "give a begin and an end pad per axis",
        ));
    }
    if !["constant", "edge", "reflect", "wrap"].contains(&mode.as_str()) {
        return Err(
            n.unsupported(format!("mode {mode:?}"), "Pad's modes are constant, edge, reflect and wrap")
        );
    }
    // Negative pads crop first.
    let mut y = x;
    let mut grow = Vec::new();
    for (k, &axis) in axes.iter().enumerate() {
        let (b, e) = (pads[k], pads[k + axes.len()]);
        let d = y.dims().get(axis).copied().unwrap_or(0) as i64;
        let (cb, ce) = ((-b).max(0), (-e).max(0));
        if cb + ce >= d {
            return Err(n.unsupported(
                format!("crops axis {axis} of {d} by {cb}+{ce}"),
                "kiln's tensors have no empty axes",
            ));
        }
        if cb + ce > 0 {
            y = y.slice(axis as isize, cb as usize, (d - cb - ce) as usize);
        }
        grow.push((axis, b.max(0) as usize, e.max(0) as usize));
    }
    if grow.iter().all(|&(_, b, e)| b + e == 0) {
        return Ok(y);
    }
    if mode == "constant" {
        let ones = imp.t.fill(1.0, y.dims().to_vec());
        let (mut padded, mut mask) = (y, ones);
        for &(axis, b, e) in &grow {
            if b + e > 0 {
                padded = padded.pad(axis as isize, b, e);
                mask = mask.pad(axis as isize, b, e);
            }
        }
        let value = if n.opset >= 11 {
            if !n.has(2) {
                None
            } else if let Some((_, v)) = imp.float_const(n, 2) {
                v.first().copied().filter(|&v| v != 0.0).map(|v| imp.t.fill(v, []))
            } else {
                Some(imp.tensor(n, 2)?)
            }
        } else {
            Some(n.float("value", 0.0)).filter(|&v| v != 0.0).map(|v| imp.t.fill(v, []))
        };
        return Ok(match value {
            None => padded,
            Some(c) => mask.select(&padded, &c),
        });
    }
    for &(axis, b, e) in &grow {
        let d = y.dims().get(axis).copied().unwrap_or(0);
        if d == 0 {
            return Ok(y);
        }
        if mode == "reflect" && (b >= d.max(2) || e >= d.max(2)) && d > 1 {
            return Err(n.unsupported(
                format!("reflects {b}+{e} elements of an axis of {d}"),
                "reflect pads below the axis's length",
            ));
        }
        let ids: Vec<usize> =
            (0..(b + d + e) as i64).map(|i| pad_source(&mode, i, b as i64, d as i64)).collect();
        y = take(imp, n, &y, axis, &ids)?;
    }
    Ok(y)
}

/// Sizes given as a folded integer tensor, each positive (kiln has no empty axes); else an error
/// saying what the node `does` with them.
fn positive_dims(n: &Node, values: &[i64], does: &str) -> Result<Vec<usize>> {
    values
        .iter()
        .map(|&d| usize::try_from(d).ok().filter(|&d| d > 0))
        .collect::<Option<_>>()
        .ok_or_else(|| n.unsupported(format!("{does} {values:?}"), "kiln's tensors have positive sizes"))
}
