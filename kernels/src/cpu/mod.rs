//! CPU kernels: one implementation of every computing op of the IR, f32 (and f16 and bf16 with
//! f32 arithmetic inside: `HALF_KERNELS`), contiguous row-major.
//!
//! `prepare` does all shape analysis once per plan step (broadcast strides, reduction blocks,
//! matmul batch offsets, convolution taps) and returns a `CpuKernel` whose `run` only computes:
//! no heap allocation of its own (the `gemm` crate allocates packing buffers for some shapes), no
//! shape logic, and no thread hand-off below `par::PAR_MIN` elements of work.
//! Kernels get no scratch memory: every byte they touch is an operand or the output, planned by the
//! compiler (convolutions therefore run as strided GEMMs per filter tap, without im2col buffers),
//! but for bounded working buffers like the GEMM's packing buffers (the half kernels' widened
//! panels, heads and image groups, `buffers`).
//!
//! Modules, one job each:
//! - `elementwise`: unary, binary, scalar and select ops, in place when the planner aliases.
//! - `fused`: fused elementwise groups, one chunked pass over the output.
//! - `broadcast`: strided loop nests (broadcasting, permutation) shared by the kernels.
//! - `layout`: fill, copy, permute, broadcast_to, concat, slice, pad.
//! - `reduce`, `softmax`: reductions and the normalisers along an axis.
//! - `matmul`, `conv`, `pool`: the GEMM-based ops and pooling.
//! - `grouped_conv`: grouped, depthwise and dilated convolutions and their gradients, direct loops.
//! - `gather`: embedding lookup and its gradient.
//! - `cast`: conversions between f32, f16, bf16, i32, i64 and bool, and half slices widened and
//!   rounded at once.
//! - `mixed_gemm`: products of f16 and bf16 factors, panels widened as they are packed.
//! - `per_image`: convolutions and pooling on half values, a group of images at a time.
//! - `buffers`: the half kernels' f32 working buffers, one set per thread.
//! - `optim`: the in-place training effects (SGD, Adam, assign_add).
//! - `math`, `vmath`, `par`: scalar definitions, the vectorisable transcendentals, parallel helpers.
//! - `peak`: one core's measured FMA peak, which the product bench holds kernels against.
//! - `simd`: the widest vector instructions of the CPU, chosen at run time, and `multiversion!`.
//!
//! Measured (release, one core of the 2-core Xeon build machine, which other jobs shared, so
//! +-30%): relu on 32x10 costs 0.03-0.07 us per call and a bias add 32x10 + 10 about 0.5 us; a
//! 1024x1024x1024 matmul 35 ms (60 GFLOP/s); a 3x3 SAME conv 64x32x32x16 -> 16 about 5 ms,
//! its input and filter gradients 1.5-2x that (their GEMMs contract over only 16 channels, see
//! `conv`).

mod attention;
mod broadcast;
mod buffers;
pub mod cast;
mod conv;
mod custom;
mod elementwise;
mod fused;
mod gather;
mod grouped_conv;
mod layout;
mod math;
mod matmul;
mod mixed_gemm;
mod narrow_conv;
mod optim;
mod par;
pub mod peak;
mod per_image;
mod pool;
mod reduce;
mod simd;
mod softmax;
pub(crate) mod vmath;

pub use crate::KernelError;
use kiln_compiler::ir::fused::{Inst, Ref};
use kiln_compiler::ir::{DType, Fused, Op, Shape};
use kiln_compiler::widen::HalfKernels;

/// The ops these kernels compute on f16 and bf16 values, f32 arithmetic inside and half in
/// memory: data movement (`layout`, by element size), elementwise ops and groups (`fused`,
/// widening as they load and rounding as they store), matrix products, fused or not
/// (`mixed_gemm`: panels widened as they are packed), attention (`attention`: a batch-head
/// widened at a time), reductions and softmax, convolutions and pooling (`per_image`: a group
/// of images at a time; filter gradients widen what their tasks read) and gathers. Custom ops
/// compute f32: a mixed-precision plan for these kernels gives them f32 copies of their half
/// operands (`kiln_compiler::widen`).
pub const HALF_KERNELS: HalfKernels = HalfKernels::LAYOUT
    .union(HalfKernels::ELEMENTWISE)
    .union(HalfKernels::PRODUCTS)
    .union(HalfKernels::ATTENTION)
    .union(HalfKernels::REDUCTIONS)
    .union(HalfKernels::CONVOLUTIONS)
    .union(HalfKernels::POOLING)
    .union(HalfKernels::GATHER)
    .union(HalfKernels::GROUPED_FILTER_GRADIENTS);

/// A kernel prepared for one op on fixed shapes.
pub trait CpuKernel: Send + Sync {
    /// Runs the kernel. `inputs[i]` points at operand i's first byte, `output` at the output's first
    /// byte (null for effect ops, which produce no tensor).
    /// # Safety
    /// Every pointer is valid for its tensor's bytes (numel * dtype size) and 4-byte aligned (arena
    /// offsets are 256-aligned). Buffers do not overlap, EXCEPT: for elementwise ops
    /// (`op.class() == OpClass::Elementwise`: Unary, Binary, Scalar, Select, Fused) the output may be the very
    /// same buffer as one input whose shape equals the output shape (in-place execution). Effect ops
    /// (ApplySgd, ApplyAdam, AssignAdd) write their mutated operands (`Op::mutated_operands`) in place.
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8);
    /// Short description for profiles, e.g. "matmul 32x100x10".
    fn describe(&self) -> String;
    /// Whether the op's meaning restricts its operands' values (gather ids), so that the
    /// executor calls `check_operands` before `run`. Decided at `prepare`; false for most ops.
    fn checks_operands(&self) -> bool {
        false
    }
    /// Checks operand values that `run` would otherwise have to define its own way: `Err` says
    /// which operand and which element. Called only when `checks_operands` is true.
    /// # Safety
    /// As for `run`: every input pointer is valid for its tensor's bytes.
    unsafe fn check_operands(&self, _inputs: &[*mut u8]) -> Result<(), String> {
        Ok(())
    }
    /// Why the last `run` failed, for kernels that can (a custom op's user code, which may
    /// panic: caught, and reported here once); executors check it after every run.
    fn take_failure(&self) -> Option<String> {
        None
    }
}

/// Prepares a kernel for `op` on operands of the given shapes/dtypes producing `output`. All shape
/// analysis (broadcast strides, reduction decomposition, matmul batch mapping, conv padding) happens
/// here once; `run` only computes. Called once per plan step, then `run` is called every training step.
pub fn prepare(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    crate::check::check(op, inputs, output, "the CPU kernels", HALF_KERNELS)?;
    let s: Vec<&Shape> = inputs.iter().map(|&(s, _)| s).collect();
    let out = output.0;
    let name = op.name();
    match crate::check::empty_case(op, &s, out) {
        crate::check::Empty::Compute => {}
        crate::check::Empty::Nothing => return Ok(Box::new(layout::Nothing(format!("{name} (empty)")))),
        crate::check::Empty::Fill(v) => return Ok(layout::fill_typed(v, out, output.1)),
    }
    let half = |d: DType| d.is_half();
    if HalfKernels::family(op) == Some(HalfKernels::ELEMENTWISE)
        && (half(output.1) || inputs.iter().any(|&(_, d)| half(d)))
    {
        return elementwise_in_half(op, inputs, output);
    }
    let touches_half = half(output.1) || inputs.iter().any(|&(_, d)| half(d));
    let family = HalfKernels::family(op);
    if touches_half && family == Some(HalfKernels::REDUCTIONS) {
        return reduction_in_half(op, inputs, output);
    }
    // Convolutions (but the dense filter gradient, which widens its own tiles) and pooling: an
    // image at a time.
    let per_image = matches!(family, Some(f) if f == HalfKernels::CONVOLUTIONS || f == HalfKernels::POOLING);
    if touches_half && per_image && !matches!(op, Op::Conv2dBackpropFilter { .. }) {
        return per_image::per_image(op, inputs, output);
    }
    let dt = output.1;
    Ok(match op {
        Op::Input { .. } | Op::Variable { .. } | Op::Reshape { .. } => unreachable!("rejected above"),
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => {
            return Err(KernelError::Unsupported {
                op: name.into(),
                dtype: output.1,
                help: "a collective is run by the backend's communicator (`CpuBackend::with_communicator`), not by a kernel".into(),
            });
        }
        Op::Attention { scale, causal } => attention::attention(inputs, dt, *scale, *causal, false),
        Op::AttentionGrad { scale, causal } => attention::attention(inputs, dt, *scale, *causal, true),
        Op::Fill { value, .. } => layout::fill(*value, out),
        Op::Iota { axis, .. } => layout::iota(*axis, out),
        Op::RandomUniform { seed, .. } => layout::random_uniform(*seed, out),
        Op::Unary(u) => elementwise::unary(*u, name, s[0]),
        Op::Binary(b) => elementwise::binary(*b, name, s[0], s[1], out),
        Op::Scalar { op: sop, value } => elementwise::scalar(*sop, *value, name, s[0]),
        Op::Select => elementwise::select(s[0], s[1], s[2], out),
        Op::Fused(f) => match (&f.reduce, &f.matmul, &f.conv) {
            (_, Some(m), _) => fused::fused_matmul(f, m, inputs, output)?,
            (_, None, Some(window)) => fused::fused_conv2d(f, window, &s)?,
            (Some(r), None, None) => fused::fused_reduce(f, r, inputs, output)?,
            (None, None, None) => fused::fused(f, &s, out)?,
        },
        Op::MatMul { transpose_a, transpose_b } => {
            matmul::matmul(s[0], s[1], (*transpose_a, *transpose_b), out, [inputs[0].1, inputs[1].1, dt])
        }
        Op::Permute { perm } => layout::permute(s[0], perm, out, dt),
        Op::BroadcastTo { .. } => layout::broadcast_to(s[0], out, dt),
        Op::Copy => layout::copy_kernel(s[0], dt),
        Op::Concat { axis } => layout::concat(&s, *axis, out, dt),
        Op::Slice { axis, start, len } => layout::slice(s[0], *axis, *start, *len, dt),
        Op::Pad { axis, before, after } => layout::pad(s[0], *axis, *before, *after, dt),
        Op::Reduce { op: rop, axes, keepdims: _ } => reduce::reduce(*rop, name, s[0], axes),
        Op::Softmax { axis } => softmax::softmax(s[0], *axis, false, [inputs[0].1, dt]),
        Op::LogSoftmax { axis } => softmax::softmax(s[0], *axis, true, [inputs[0].1, dt]),
        // Grouped, depthwise and dilated windows have their own direct kernels; the GEMM-shaped
        // ones of `conv` take dense windows only.
        Op::Conv2d { window } if !window.is_dense() => grouped_conv::conv2d(s[0], s[1], window),
        Op::Conv2dBackpropInput { window, .. } if !window.is_dense() => {
            grouped_conv::backprop_input(s[0], s[1], window, out)
        }
        Op::Conv2dBackpropInputReluGrad { window, .. } if !window.is_dense() => {
            grouped_conv::backprop_input_relu_grad(s[0], s[1], window, out, s.len() == 4)
        }
        Op::Conv2dBackpropFilter { window } if !window.is_dense() => {
            grouped_conv::backprop_filter(s[0], s[1], window, [inputs[0].1, inputs[1].1, dt])
        }
        Op::Conv2d { window } => conv::conv2d(s[0], s[1], window, out),
        Op::Conv2dBackpropInput { window, .. } => conv::backprop_input(s[0], s[1], window, out),
        Op::Conv2dBackpropInputReluGrad { window, .. } => {
            conv::backprop_input_relu_grad(s[0], s[1], window, out, s.len() == 4)
        }
        Op::Conv2dBackpropFilter { window } => {
            conv::backprop_filter(s[0], s[1], window, out, [inputs[0].1, inputs[1].1, dt])
        }
        Op::Pool2d { kind, window } => pool::pool2d(*kind, name, s[0], window, out),
        Op::Pool2dGrad { kind, window } => pool::pool2d_grad(*kind, name, s[0], window, s[1]),
        Op::AvgPool2dGrad { window, input } => pool::avg_pool2d_grad(name, input, window),
        Op::Gather => gather::gather(s[0], s[1], inputs[1].1, dt),
        Op::GatherGrad { vocab } => gather::gather_grad(s[0], inputs[0].1, *vocab, out, [inputs[1].1, dt]),
        Op::Cast { to } => cast::cast(s[0], inputs[0].1, *to),
        Op::CastLike => cast::cast(s[0], inputs[0].1, inputs[1].1),
        Op::Custom { name } => custom::custom(name, &s, out)?,
        Op::MatMulRows { rows } => {
            matmul::matmul_rows(s[0], s[1], *rows, out, [inputs[0].1, inputs[1].1, dt])
        }
        Op::ApplySgd { lr, momentum, nesterov, rows, product, shard } => {
            let factors = product.then(|| inputs[1].1);
            optim::sgd(*lr, *momentum, *nesterov, &s, (*rows, factors, *shard, op.update_gate(s.len())))
        }
        Op::ApplyAdam { lr, beta1, beta2, epsilon, rows, product, shard } => optim::adam(
            [*lr, *beta1, *beta2, *epsilon],
            &s,
            (*rows, product.then(|| inputs[1].1), *shard, op.update_gate(s.len())),
        ),
        Op::AssignAdd { value } => optim::assign_add(*value, s[0], op.update_gate(s.len())),
        Op::UpdateLossScale { growth, backoff, interval } => {
            optim::update_loss_scale(*growth, *backoff, *interval)
        }
    })
}

/// An elementwise op (or group) that reads or writes f16 or bf16 values: the fused kernel, which
/// widens half operands as it loads them and rounds a half output as it stores it; a single op
/// runs as a program of its one instruction (the same loop over the same f32 values as its own
/// kernel).
fn elementwise_in_half(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let r = |i: u32| Ref::Operand(i);
    let inst = match op {
        Op::Fused(f) => return fused::fused_typed(f, inputs, output),
        Op::Unary(u) => Inst::Unary(*u, r(0)),
        Op::Binary(b) => Inst::Binary(*b, r(0), r(1)),
        Op::Scalar { op, value } => Inst::Scalar(*op, *value, r(0)),
        Op::Select => Inst::Select(r(0), r(1), r(2)),
        _ => unreachable!("`HalfKernels::family` names these ops alone ELEMENTWISE"),
    };
    fused::fused_typed(&Fused::elementwise(output.0.clone(), vec![inst]), inputs, output)
}

/// A reduction, softmax or log-softmax that reads or writes f16 or bf16 values: a reduction as
/// a fused one whose program is its operand widened (`Inst::Cast` to f32: the reduction's own
/// chunks and order, so its bits), a softmax a slab at a time (`softmax`).
fn reduction_in_half(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    match op {
        Op::Reduce { op: r, axes, keepdims } => {
            let reduce = kiln_compiler::ir::FusedReduce { op: *r, axes: axes.clone(), keepdims: *keepdims };
            let program = Fused {
                reduce: Some(reduce.clone()),
                ..Fused::elementwise(inputs[0].0.clone(), vec![Inst::Cast(DType::F32, Ref::Operand(0))])
            };
            fused::fused_reduce(&program, &reduce, inputs, output)
        }
        Op::Fused(f) => match &f.reduce {
            Some(r) => fused::fused_reduce(f, r, inputs, output),
            None => unreachable!("`HalfKernels::family` names a fused op REDUCTIONS when it reduces"),
        },
        Op::Softmax { axis } => Ok(softmax::softmax(inputs[0].0, *axis, false, [inputs[0].1, output.1])),
        Op::LogSoftmax { axis } => Ok(softmax::softmax(inputs[0].0, *axis, true, [inputs[0].1, output.1])),
        _ => unreachable!("`HalfKernels::family` names these ops alone REDUCTIONS"),
    }
}

/// A shape as profiles print it: "32x10", "scalar" for rank 0.
pub(crate) fn shape_text(s: &Shape) -> String {
    if s.rank() == 0 {
        return "scalar".into();
    }
    s.dims().iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

/// Deterministic values in [-1, 1) for the kernels' unit tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            (s >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}
