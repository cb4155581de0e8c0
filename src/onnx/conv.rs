//! Convolution, pooling and LRN over ONNX's NCHW (and 1-D NCL) tensors, on kiln's NHWC
//! `conv2d` and pooling.
//!
//! ONNX's `group`, `dilations` and `pads` map straight onto kiln's window (`Window2d`): a
//! grouped, depthwise or dilated convolution is one op over the file's own filter, and explicit
//! (asymmetric) pads are read inside the convolution or pooling, with no padded copy kept for
//! the gradient (an imported EfficientNet-B0 had held 16 block-diagonal filters, 632 MB at its
//! training peak, and 301 MB of padded copies). Composed where kiln's ops have no attribute for
//! it: pads of a whole window or more pad the input; average pooling that counts its pads
//! (`count_include_pad`) divides by a pooled count; ConvTranspose is the convolution's input
//! gradient; LRN sums squares across channels with an average pooling.

use super::{Importer, Node, Value};
use crate::error::Result;
use kiln_compiler::ir::{Op, Padding, PoolKind, Shape, Window2d};
use kiln_compiler::trace::Tensor;

pub(super) fn import(imp: &mut Importer, n: &Node) -> Result<Option<Vec<Value>>> {
    let y = match n.op {
        "Conv" => conv(imp, n)?,
        "ConvTranspose" => conv_transpose(imp, n)?,
        "MaxPool" | "AveragePool" | "LpPool" => pool(imp, n)?,
        "GlobalAveragePool" | "GlobalMaxPool" | "GlobalLpPool" => {
            let x = imp.tensor(n, 0)?;
            if x.rank() < 3 {
                return Err(
                    n.invalid(format!("has a rank-{} input", x.rank()), "pool an N, C, spatial... tensor")
                );
            }
            let axes: Vec<usize> = (2..x.rank()).collect();
            match n.op {
                "GlobalAveragePool" => x.mean(axes, true),
                "GlobalMaxPool" => x.max(axes, true),
                _ => {
                    let p = lp_order(n)?;
                    x.abs().pow(p).sum(axes, true).pow(1.0 / p)
                }
            }
        }
        "LRN" => lrn(imp, n)?,
        _ => return Ok(None),
    };
    Ok(Some(vec![Value::Tensor(y)]))
}

/// A window's attributes for two spatial axes (a 1-D op's as the second, under a first of 1).
struct Window {
    kernel: [usize; 2],
    strides: [usize; 2],
    dilations: [usize; 2],
    /// top, left, bottom, right.
    pads: [usize; 4],
}

/// The spatial rank of an N, C, spatial... input: 1 or 2.
fn spatial_rank(n: &Node, x: &Tensor) -> Result<usize> {
    match x.rank() {
        3 => Ok(1),
        4 => Ok(2),
        r => Err(n.unsupported(
            format!("has a rank-{r} input"),
            "kiln imports 1-D and 2-D convolutions and pooling",
        )),
    }
}

/// `x` [N, C, L] as [N, C, 1, L]; 4-D as it is.
fn as_2d(x: &Tensor) -> Tensor {
    match *x.dims() {
        [a, b, l] => x.reshape([a, b, 1, l]),
        _ => x.clone(),
    }
}

/// `y` [N, C, 1, L] as [N, C, L] (a tensor a failed op poisoned stays as it is).
fn as_1d(y: &Tensor) -> Tensor {
    match *y.dims() {
        [a, b, _, l] => y.reshape([a, b, l]),
        _ => y.clone(),
    }
}

/// The node's window over `input` ([H, W]) for a `kernel` (before dilation).
fn window(n: &Node, spatial: usize, input: [usize; 2], kernel: [usize; 2]) -> Result<Window> {
    let list = |name: &str, default: usize| -> Result<[usize; 2]> {
        match n.ints(name).as_deref() {
            None | Some([]) => Ok([default; 2]),
            Some(v) if v.len() == spatial && v.iter().all(|&x| x > 0) => {
                Ok(if spatial == 1 { [1, v[0] as usize] } else { [v[0] as usize, v[1] as usize] })
            }
            Some(v) => Err(n.invalid(format!("{name} {v:?}"), format!("give {spatial} positive values"))),
        }
    };
    let (strides, dilations) = (list("strides", 1)?, list("dilations", 1)?);
    let effective =
        [0, 1].map(|a| kernel[a].saturating_sub(1).saturating_mul(dilations[a]).saturating_add(1));
    let pads = match n.string("auto_pad").as_deref().unwrap_or("NOTSET") {
        "NOTSET" => match n.ints("pads").as_deref() {
            None | Some([]) => [0; 4],
            Some(v) if v.len() == 2 * spatial && v.iter().all(|&p| p >= 0) => {
                let v: Vec<usize> = v.iter().map(|&p| p as usize).collect();
                if spatial == 1 { [0, v[0], 0, v[1]] } else { [v[0], v[1], v[2], v[3]] }
            }
            Some(v) => {
                return Err(
                    n.invalid(format!("pads {v:?}"), format!("give {} non-negative pads", 2 * spatial))
                );
            }
        },
        "VALID" => [0; 4],
        mode @ ("SAME_UPPER" | "SAME_LOWER") => {
            let mut pads = [0; 4];
            for a in 0..2 {
                let out = input[a].div_ceil(strides[a]);
                let total = out
                    .saturating_sub(1)
                    .saturating_mul(strides[a])
                    .saturating_add(effective[a])
                    .saturating_sub(input[a]);
                let small = total / 2;
                let (before, after) =
                    if mode == "SAME_UPPER" { (small, total - small) } else { (total - small, small) };
                pads[a] = before;
                pads[a + 2] = after;
            }
            pads
        }
        other => {
            return Err(n.unsupported(
                format!("auto_pad {other:?}"),
                "auto_pad is NOTSET, VALID, SAME_UPPER or SAME_LOWER",
            ));
        }
    };
    Ok(Window { kernel, strides, dilations, pads })
}

fn groups(n: &Node, channels: usize, filters: usize) -> Result<usize> {
    let g = n.int("group", 1);
    usize::try_from(g)
        .ok()
        .filter(|&g| g > 0 && channels.is_multiple_of(g) && filters.is_multiple_of(g))
        .ok_or_else(|| {
            n.invalid(
                format!("group {g} for {channels} channels and {filters} filters"),
                "give a group dividing both",
            )
        })
}

fn conv(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let (x, w) = (imp.tensor(n, 0)?, imp.tensor(n, 1)?);
    let spatial = spatial_rank(n, &x)?;
    let (x4, w4) = (as_2d(&x), as_2d(&w));
    let (&[_, c, h, wd], &[f, cg, kh, kw]) = (x4.dims(), w4.dims()) else {
        return Err(n.invalid(
            format!("filter {} for input {}", w.shape(), x.shape()),
            "give a filter of the input's rank",
        ));
    };
    let g = groups(n, c, f)?;
    if cg.checked_mul(g) != Some(c) {
        return Err(n.invalid(
            format!("filter {} for {c} channels in {g} groups", w.shape()),
            "the filter's axis 1 is channels / group",
        ));
    }
    let win = window(n, spatial, [h, wd], [kh, kw])?;
    // A filter stored HWIO (`nhwc::filters`) is read as it is.
    let stored = imp.stored_filter(n).filter(|_| spatial == 2);
    let mut nhwc = channels_last(imp, n, &x4, spatial);
    let mut window = explicit(&win, [kh, kw]).grouped(g);
    if [h, wd].iter().enumerate().any(|(a, &e)| window.out_and_pad(a, e).is_none()) {
        // Pads of a window's extent or more (windows that read padding only): a padded copy.
        let [top, left, bottom, right] = win.pads;
        if top + bottom > 0 {
            nhwc = nhwc.pad(1, top, bottom);
        }
        if left + right > 0 {
            nhwc = nhwc.pad(2, left, right);
        }
        window.padding = Padding::Valid;
    }
    let hwio = stored.unwrap_or_else(|| w4.permute(&[2, 3, 1, 0]));
    let mut y = nhwc.conv2d_window(&hwio, window);
    if n.has(2) {
        y = y + &imp.tensor(n, 2)?;
    }
    Ok(if spatial == 1 { as_1d(&y.permute(&[0, 3, 1, 2])) } else { imp.nchw_of_twin(n, 0, y) })
}

/// A 2-D op's input `x4` ([N, C, H, W]) channels-last: its twin where one was made (`nhwc`),
/// else permuted.
fn channels_last(imp: &Importer, n: &Node, x4: &Tensor, spatial: usize) -> Tensor {
    match imp.twin(n, 0) {
        Some(t) if spatial == 2 => t,
        _ => x4.permute(&[0, 2, 3, 1]),
    }
}

fn conv_transpose(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let (x, w) = (imp.tensor(n, 0)?, imp.tensor(n, 1)?);
    let spatial = spatial_rank(n, &x)?;
    let (x4, w4) = (as_2d(&x), as_2d(&w));
    let (&[batch, c, h, wd], &[c2, fg, kh, kw]) = (x4.dims(), w4.dims()) else {
        return Err(n.invalid(
            format!("filter {} for input {}", w.shape(), x.shape()),
            "give a filter of the input's rank",
        ));
    };
    let g = usize::try_from(n.int("group", 1)).ok().filter(|&g| g > 0 && c.is_multiple_of(g)).unwrap_or(0);
    if g == 0 || c2 != c {
        return Err(n.invalid(
            format!("filter {} for {c} channels", w.shape()),
            "the filter is [C, F / group, k...]",
        ));
    }
    // Pads are resolved below (they depend on the output); the rest of the window as for Conv.
    let win = window(n, spatial, [h, wd], [kh, kw])?;
    let effective =
        [0, 1].map(|a| win.kernel[a].saturating_sub(1).saturating_mul(win.dilations[a]).saturating_add(1));
    let pair = |name: &str| -> Result<[usize; 2]> {
        match n.ints(name).as_deref() {
            None | Some([]) => Ok([0; 2]),
            Some(v) if v.len() == spatial && v.iter().all(|&x| x >= 0) => {
                Ok(if spatial == 1 { [0, v[0] as usize] } else { [v[0] as usize, v[1] as usize] })
            }
            Some(v) => Err(n.invalid(format!("{name} {v:?}"), format!("give {spatial} non-negative values"))),
        }
    };
    let extra = pair("output_padding")?;
    let full = [0, 1].map(|a| {
        [h, wd][a]
            .saturating_sub(1)
            .saturating_mul(win.strides[a])
            .saturating_add(effective[a])
            .saturating_add(extra[a])
    });
    let auto = n.string("auto_pad").unwrap_or_else(|| "NOTSET".into());
    let target = match n.ints("output_shape").filter(|s| !s.is_empty()) {
        Some(s) if s.len() == spatial && s.iter().all(|&v| v > 0) => {
            Some(if spatial == 1 { [1, s[0] as usize] } else { [s[0] as usize, s[1] as usize] })
        }
        Some(s) => {
            return Err(n.invalid(format!("output_shape {s:?}"), format!("give {spatial} positive sizes")));
        }
        None if auto.starts_with("SAME") => Some([0, 1].map(|a| [h, wd][a].saturating_mul(win.strides[a]))),
        None => None,
    };
    // Signed pads: a negative total (an output_shape past the full result) extends the output
    // with zeros, split as ONNX's floor division splits it.
    let mut signed = [0i64; 4];
    for a in 0..2 {
        signed[a] = win.pads[a] as i64;
        signed[a + 2] = win.pads[a + 2] as i64;
    }
    if let Some(out) = target {
        for a in 0..2 {
            let total = full[a] as i64 - out[a] as i64;
            let half = total.div_euclid(2);
            let (before, after) =
                if auto == "SAME_UPPER" { (half, total - half) } else { (total - half, half) };
            signed[a] = before;
            signed[a + 2] = after;
        }
    }
    let gradient_shape = Shape::new([batch, full[0] - extra[0], full[1] - extra[1], fg * g]);
    let window = Window2d::new(win.kernel, win.strides, Padding::Valid).dilated(win.dilations).grouped(g);
    let filter = w4.permute(&[2, 3, 1, 0]);
    let dy = x4.permute(&[0, 2, 3, 1]);
    let mut y = dy.record(Op::Conv2dBackpropInput { window, input: gradient_shape }, &[&dy, &filter]);
    for a in 0..2 {
        let axis = 1 + a as isize;
        let (before, after) = (signed[a], signed[a + 2] - extra[a] as i64);
        let grow = |v: i64| usize::try_from(-v).unwrap_or(0);
        if grow(before) + grow(after) > 0 {
            y = y.pad(axis, grow(before), grow(after));
        }
        let (crop_b, crop_e) = (before.max(0) as usize, after.max(0) as usize);
        let len = y.dims().get(1 + a).copied().unwrap_or(0);
        if crop_b + crop_e > 0 {
            if crop_b + crop_e >= len {
                return Err(n.unsupported(
                    format!("pads {signed:?} crop the whole output"),
                    "kiln's tensors have no empty axes",
                ));
            }
            y = y.slice(axis, crop_b, len - crop_b - crop_e);
        }
    }
    if n.has(2) {
        y = y + &imp.tensor(n, 2)?;
    }
    Ok(if spatial == 1 { as_1d(&y.permute(&[0, 3, 1, 2])) } else { imp.nchw_of_twin(n, 0, y) })
}

/// The node's window as kiln's: its dilation, and its pads as the op's own (none: `Valid`),
/// read inside the convolution or pooling (no padded copy of the input).
fn explicit(win: &Window, kernel: [usize; 2]) -> Window2d {
    let [top, left, bottom, right] = win.pads;
    let padding = if win.pads == [0; 4] {
        Padding::Valid
    } else {
        Padding::Explicit { before: [top, left], after: [bottom, right] }
    };
    Window2d::new(kernel, win.strides, padding).dilated(win.dilations)
}

fn pool(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let x = imp.tensor(n, 0)?;
    let spatial = spatial_rank(n, &x)?;
    let x4 = as_2d(&x);
    let &[_, _, h, wd] = x4.dims() else {
        return Err(n.invalid(format!("has input {}", x.shape()), "pool an N, C, spatial... tensor"));
    };
    let kernel = match n.ints("kernel_shape").as_deref() {
        Some(v) if v.len() == spatial && v.iter().all(|&k| k > 0) => {
            if spatial == 1 {
                [1, v[0] as usize]
            } else {
                [v[0] as usize, v[1] as usize]
            }
        }
        _ => return Err(n.invalid("has no valid kernel_shape", format!("give {spatial} positive sizes"))),
    };
    let win = window(n, spatial, [h, wd], kernel)?;
    if win.dilations != [1, 1] {
        return Err(n.unsupported(format!("dilates by {:?}", win.dilations), "kiln pools without dilation"));
    }
    let (max, ceil) = (n.op == "MaxPool", n.int("ceil_mode", 0) != 0);
    let include = n.int("count_include_pad", 0) != 0;
    let input = [h, wd];
    // The extra pad at the far end that ceil_mode's last window reaches.
    let mut extra = [0; 2];
    for a in 0..2 {
        let padded = input[a].saturating_add(win.pads[a]).saturating_add(win.pads[a + 2]);
        if padded < kernel[a] {
            return Err(n.invalid(
                format!("a window of {kernel:?} over the padded {padded}"),
                "the window must fit the padded input",
            ));
        }
        let span = padded - kernel[a];
        let mut out = if ceil { span.div_ceil(win.strides[a]) + 1 } else { span / win.strides[a] + 1 };
        // A last window starting past the input and its leading pad is dropped.
        if ceil && (out - 1).saturating_mul(win.strides[a]) >= input[a].saturating_add(win.pads[a]) {
            out -= 1;
        }
        extra[a] = (out - 1).saturating_mul(win.strides[a]).saturating_add(kernel[a]).saturating_sub(padded);
    }
    let nhwc = channels_last(imp, n, &x4, spatial);
    let [top, left, bottom, right] = win.pads;
    let pooled = |t: &Tensor| {
        if max {
            t.max_pool2d(kernel, win.strides, Padding::Valid)
        } else {
            t.avg_pool2d(kernel, win.strides, Padding::Valid)
        }
    };
    let pad_all = |t: Tensor, far: [usize; 2]| {
        let mut t = t;
        if top + bottom + far[0] > 0 {
            t = t.pad(1, top, bottom + far[0]);
        }
        if left + right + far[1] > 0 {
            t = t.pad(2, left, right + far[1]);
        }
        t
    };
    let y = if n.op == "LpPool" {
        // (Σ |x|^p)^(1/p) over the window: zero pads add nothing to the sum.
        let p = lp_order(n)?;
        let powered = pad_all(nhwc.abs().pow(p), extra);
        let window = (kernel[0] * kernel[1]) as f32;
        (powered.avg_pool2d(kernel, win.strides, Padding::Valid) * window).pow(1.0 / p)
    } else if win.pads == [0; 4] && extra == [0, 0] {
        pooled(&nhwc)
    } else if let Some(window) = inside_pads(&win, kernel, extra, input).filter(|_| max || !include) {
        // A maximum never sees the pads and an average does not count them, ceil_mode's extra
        // included: the op's own padding, no padded copy.
        nhwc.pool2d_window(if max { PoolKind::Max } else { PoolKind::Avg }, window)
    } else if max {
        let inside = pad_all(imp.t.fill(1.0, [1, h, wd, 1]), extra);
        let padded = inside.select(&pad_all(nhwc, extra), &imp.t.fill(f32::NEG_INFINITY, []));
        pooled(&padded)
    } else {
        // The window's average of what it counts: the explicit pads too with count_include_pad,
        // never ceil_mode's extra.
        let counted = if include {
            let mut ones = imp.t.fill(
                1.0,
                [
                    1,
                    h.saturating_add(top).saturating_add(bottom),
                    wd.saturating_add(left).saturating_add(right),
                    1,
                ],
            );
            if extra[0] > 0 {
                ones = ones.pad(1, 0, extra[0]);
            }
            if extra[1] > 0 {
                ones = ones.pad(2, 0, extra[1]);
            }
            ones
        } else {
            pad_all(imp.t.fill(1.0, [1, h, wd, 1]), extra)
        };
        pooled(&pad_all(nhwc, extra)).div(pooled(&counted))
    };
    Ok(if spatial == 1 { as_1d(&y.permute(&[0, 3, 1, 2])) } else { imp.nchw_of_twin(n, 0, y) })
}

/// The pooling window with the node's pads and ceil_mode's `extra` as the op's own padding, or
/// None where a pad reaches a whole window (kiln's windows always overlap the input).
fn inside_pads(win: &Window, kernel: [usize; 2], extra: [usize; 2], input: [usize; 2]) -> Option<Window2d> {
    let [top, left, bottom, right] = win.pads;
    let padding = Padding::Explicit { before: [top, left], after: [bottom + extra[0], right + extra[1]] };
    let window = Window2d::new(kernel, win.strides, padding);
    (0..2).all(|a| window.out_and_pad(a, input[a]).is_some()).then_some(window)
}

/// LpPool's p: a positive integer.
fn lp_order(n: &Node) -> Result<f32> {
    let p = n.int("p", 2);
    if !(1..=64).contains(&p) {
        return Err(n.unsupported(format!("has p = {p}"), "kiln pools with p from 1 to 64"));
    }
    Ok(p as f32)
}

fn lrn(imp: &mut Importer, n: &Node) -> Result<Tensor> {
    let x = imp.tensor(n, 0)?;
    let size = usize::try_from(n.int("size", 0))
        .ok()
        .filter(|&s| s > 0)
        .ok_or_else(|| n.invalid("has no positive size", "give LRN its size"))?;
    let (alpha, beta, bias) = (n.float("alpha", 1e-4), n.float("beta", 0.75), n.float("bias", 1.0));
    let d = x.dims().to_vec();
    if d.len() < 3 {
        return Err(n.invalid(format!("has a rank-{} input", d.len()), "LRN takes N, C, spatial... tensors"));
    }
    let (batch, c, rest) = (d[0], d[1], d[2..].iter().product::<usize>());
    // Σ over channels c - ⌊(size-1)/2⌋ ..= c + ⌈(size-1)/2⌉ of x², as an average pooling of
    // [N, C, rest, 1] read as NHWC (H = channels) times the window.
    let (before, after) = ((size - 1) / 2, (size - 1).div_ceil(2));
    let squares = x.square().reshape([batch, c, rest, 1]).pad(1, before, after);
    let sums = squares.avg_pool2d([size, 1], [1, 1], Padding::Valid) * size as f32;
    let scale = (sums * (alpha / size as f32) + bias).pow(-beta).reshape(d);
    Ok(x * &scale)
}
