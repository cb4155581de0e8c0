//! CUDA C source for every computing op of the IR: the CUDA backend compiles each `CudaKernel`'s
//! source with NVRTC (`--gpu-architecture=compute_90 --std=c++17`, no fast-math) and runs its
//! launches, in order, on pointers into the device arena. This module produces strings and launch
//! descriptions only; it does not touch a device (no cudarc).
//!
//! Conventions of every generated source:
//! - One translation unit, no `#include`: `extern "C" __global__` functions, CUDA builtins only.
//!   The first line is a comment naming the op, its attributes and shapes.
//! - Shapes, strides and attributes are baked in as literals (sources are per shape; NVRTC then
//!   folds the index math). f32 constants are printed exactly (`codegen::flt`).
//! - Tensors are contiguous row-major. Parameters point to their values' types, in the order of
//!   the launch's `args`: `Input(i)` is operand i, `Output` the step's output; f32 is `float*`,
//!   and the families of `HALF_KERNELS` take f16 and bf16 values as `kiln_f16*` and
//!   `kiln_bf16*` (`half`: converted at memory, f32 arithmetic inside). Read-only inputs are
//!   `const T* __restrict__`, except in elementwise kernels (Unary, Binary, Scalar, Select),
//!   whose output may be the same buffer as an input: those take plain pointers and read element
//!   i of every input before writing element i. Effect ops (ApplySgd, ApplyAdam, AssignAdd) have
//!   no `Output` argument and update `Op::mutated_operands` in place.
//! - Grids are 1-D (no 65535 limit applies), blocks at most 1024 threads, static shared memory
//!   within 48 KiB (`shared_bytes` is 0). Kernels over many elements use grid-stride loops; index
//!   arithmetic is `int` below 2^30 elements and `long long` above.
//! - Arithmetic follows the CPU kernels (`cpu`) operation for operation, with products that feed
//!   additions written `__fmul_rn` so NVRTC does not fuse them; see `math` for what remains
//!   different (CUDA's transcendental functions), `gemm` for summation order in products and
//!   convolutions, and `gather` for the atomics of gather_grad.
//!
//! Checked without a GPU (the build machines have none): `tests/cuda_ops.rs` generates 783
//! kernels (every op; fixed, random and >2^31-element shapes) and, with `KILN_DUMP_CUDA=DIR`,
//! writes their sources, launches, inputs and the CPU kernels' outputs. All of them compile with
//! NVRTC 13.0 (`compute_90`, and `sm_90` through ptxas: no register spills) without a warning, and
//! a host emulation of the kernels (blocks run one at a time, their threads as OS threads, with
//! barriers, shuffles and shared memory) reproduced the CPU results on all 772 runnable cases:
//! bitwise for everything but GELU (CUDA's `erff` vs libm's, 1e-8) and the GEMM-based ops
//! (summation order, within 1e-7 of the sum of |terms|), and again on 527 of them with 64-bit
//! indices forced.
//!
//! Modules, one job each:
//! - `codegen`: source builder, float literals, index types, grids, strided loop nests.
//! - `half`: the half value types and each step's parameter types.
//! - `math`: device scalar functions and each elementwise op's expression.
//! - `elementwise`: unary, binary, scalar, select, fused groups, and the strided map the layout
//!   ops share.
//! - `layout`: fill, copy, permute (tiled transposes), broadcast_to, concat, slice, pad.
//! - `reduce`, `softmax`: reductions and the normalisers along an axis.
//! - `gemm`: the tiled, register-blocked GEMM; `matmul` and `conv` (dense windows) build on it.
//! - `grouped_conv`: direct convolution kernels for non-dense windows (groups, dilation).
//! - `pool`: pooling and its gradients; `gather`: embedding lookup and its gradient.
//! - `attention`: fused (flash) attention and its gradient, no scores in global memory.
//! - `optim`: the in-place training effects.

mod attention;
mod cast;
mod codegen;
mod conv;
mod elementwise;
mod gather;
mod gemm;
mod grouped_conv;
mod half;
mod layout;
mod math;
mod matmul;
mod optim;
mod pool;
mod reduce;
mod softmax;

use crate::KernelError;
use kiln_compiler::ir::{DType, Op, Shape};
use kiln_compiler::scratch::ScratchRule;
use kiln_compiler::widen::HalfKernels;

/// The families of ops whose CUDA kernels read and write f16 and bf16 values (f32 arithmetic
/// inside, one rounding on the way out: `half`): every family; a plan for the CUDA backend
/// widens the half values of the ops outside them (custom ops, collectives:
/// `kiln_compiler::widen`).
pub const HALF_KERNELS: HalfKernels = HalfKernels::LAYOUT
    .union(HalfKernels::ELEMENTWISE)
    .union(HalfKernels::REDUCTIONS)
    .union(HalfKernels::PRODUCTS)
    .union(HalfKernels::CONVOLUTIONS)
    .union(HalfKernels::POOLING)
    .union(HalfKernels::ATTENTION)
    .union(HalfKernels::GATHER)
    .union(HalfKernels::GROUPED_FILTER_GRADIENTS);

/// A kernel for one plan step: CUDA C source (one translation unit, `extern "C" __global__`
/// functions, no #include of CUDA headers — NVRTC compiles it standalone) and its launches, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CudaKernel {
    /// The CUDA C translation unit that NVRTC compiles (every function the launches name).
    pub source: String,
    /// The launches that compute the step, in the order they must run (empty when there is
    /// nothing to compute).
    pub launches: Vec<Launch>,
    /// Short description for profiles, e.g. "matmul 32x100x10 (... tile 16x16x16 ...)".
    pub describe: String,
}

/// One kernel launch: a function of the source, its geometry and its pointer arguments.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Launch {
    /// The name of the `extern "C" __global__` function of the source to launch.
    pub function: String,
    /// The grid's size in blocks, `[x, y, z]`.
    pub grid: [u32; 3],
    /// The block's size in threads, `[x, y, z]`.
    pub block: [u32; 3],
    /// Dynamic shared memory in bytes (the generated kernels use static shared memory: 0).
    pub shared_bytes: u32,
    /// The kernel's pointer parameters, in the function's parameter order.
    pub args: Vec<Arg>,
}

/// Kernel parameters are device pointers, in this order: `Input(i)` = operand i, `Output` = the
/// step's output, `Scratch` = the step's scratch (`kiln_compiler::scratch`; only in kernels
/// generated with scratch, which use at most the bytes they were given).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// The device address of the step's operand with this index (0-based).
    Input(usize),
    /// The device address of the step's output.
    Output,
    /// The device address of the step's scratch.
    Scratch,
}

/// Whether products run on the tensor cores in TF32 (`gemm::tf32`): 0 unset (then `KILN_TF32=1`
/// says), 1 off, 2 on.
static ALLOW_TF32: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Lets every matrix product and convolution generated from now on run on the tensor cores with
/// TF32 operands (10 mantissa bits, f32 accumulation: about 1e-3 relative to the sum of |terms|),
/// as PyTorch's `torch.backends.cuda.matmul.allow_tf32` does; off by default, where products are
/// f32 throughout. `KILN_TF32=1` turns it on for a process that does not call this. Kernels are
/// generated when a plan loads: set it before loading.
pub fn set_allow_tf32(on: bool) {
    ALLOW_TF32.store(if on { 2 } else { 1 }, std::sync::atomic::Ordering::Relaxed);
}

/// Whether products are generated for TF32 tensor cores (`set_allow_tf32`).
pub fn allow_tf32() -> bool {
    match ALLOW_TF32.load(std::sync::atomic::Ordering::Relaxed) {
        0 => std::env::var("KILN_TF32").is_ok_and(|v| v == "1"),
        v => v == 2,
    }
}

/// The scratch the CUDA kernels ask for: a product or convolution whose outputs are too few to
/// fill the GPU over a long K splits K across blocks (`gemm::Plan::SplitK`), and a column
/// reduction with few outputs its reduced extent (`reduce`), their partials in scratch. Compile with it (`CompileOptions::with_scratch`) for plans that run on a CUDA device: it also
/// keeps forward passes whole unless only blocks of rows fit (`ScratchRule::blocks_only_to_fit`).
pub const SCRATCH: ScratchRule = ScratchRule { name: "cuda", bytes: scratch_bytes, blocks_only_to_fit: true };

/// The scratch bytes the kernel of `op` uses when given enough (`SCRATCH`); 0 for every op but
/// the GEMM-based ones (dense convolutions only: a non-dense window's direct kernels use none),
/// reductions, and the half outputs `required_scratch` names, and for invalid or empty operands
/// (whose kernel uses none).
pub fn scratch_bytes(op: &Op, inputs: &[(&Shape, DType)], output: &Shape) -> usize {
    let Ok((_, dtype)) = kiln_compiler::ir::infer(op, inputs) else {
        return 0;
    };
    if crate::check::check(op, inputs, (output, dtype), "the CUDA kernels", HALF_KERNELS).is_err() {
        return 0;
    }
    let s: Vec<&Shape> = inputs.iter().map(|&(s, _)| s).collect();
    if !matches!(crate::check::empty_case(op, &s, output), crate::check::Empty::Compute) {
        return 0;
    }
    let window_geom = |x: &Shape, window, filters| crate::geometry::Geom::new(x, window, filters);
    let (m, n, k, batch) = match op {
        Op::MatMul { transpose_a, .. } => matmul::dims(s[0], s[1], *transpose_a, output),
        Op::Fused(f) => match (&f.matmul, &f.conv, &f.reduce) {
            (Some(mm), _, _) => matmul::dims(s[0], s[1], mm.transpose_a, output),
            // A non-dense window's kernels (`grouped_conv`) use no scratch.
            (None, Some(window), _) if !window.is_dense() => return 0,
            (None, Some(window), _) => {
                let (m, n, k) = conv::forward_dims(&window_geom(s[0], window, s[1].dims()[3]));
                (m, n, k, 1)
            }
            (None, None, Some(r)) => return reduce::scratch_wanted(r.op, &f.shape, &r.axes),
            (None, None, None) => return 0,
        },
        Op::Reduce { op: rop, axes, .. } => return reduce::scratch_wanted(*rop, s[0], axes),
        Op::MatMulRows { rows } => (rows.len, s[1].dims()[1], s[0].dims()[0], 1),
        Op::GatherGrad { .. } | Op::Attention { .. } | Op::AttentionGrad { .. } => {
            return required_scratch(op, inputs, output);
        }
        Op::Conv2d { window }
        | Op::Conv2dBackpropInput { window, .. }
        | Op::Conv2dBackpropInputReluGrad { window, .. }
        | Op::Conv2dBackpropFilter { window }
            if !window.is_dense() =>
        {
            return 0;
        }
        Op::Conv2d { window } => {
            let (m, n, k) = conv::forward_dims(&window_geom(s[0], window, s[1].dims()[3]));
            (m, n, k, 1)
        }
        Op::Conv2dBackpropInput { window, .. } | Op::Conv2dBackpropInputReluGrad { window, .. } => {
            let (m, n, k) = conv::backprop_input_dims(&window_geom(output, window, s[1].dims()[3]));
            (m, n, k, 1)
        }
        Op::Conv2dBackpropFilter { window } => {
            let (m, n, k) = conv::backprop_filter_dims(&window_geom(s[0], window, s[1].dims()[3]));
            (m, n, k, 1)
        }
        Op::ApplySgd { product: true, .. } | Op::ApplyAdam { product: true, .. } => {
            let (m, n, k) = optim::product_dims(&s);
            (m, n, k, 1)
        }
        Op::Custom { .. } => return kiln_compiler::custom::declared_scratch(op, inputs, output),
        _ => return 0,
    };
    if m == 0 || n == 0 || k == 0 {
        return 0;
    }
    gemm::scratch_wanted(m, n, k, batch)
}

/// The scratch bytes without which the kernel of `op` cannot run (`scratch_bytes` asks for them
/// with the rest): an f32 copy of a half output that attention's gradient, attention's fallback
/// for wide heads or a gather's gradient writes before narrowing it (`attention`, `gather`); 0
/// for every other op, and for invalid or empty operands. An executor without planned scratch
/// (the eager executor) gives a kernel this much.
pub fn required_scratch(op: &Op, inputs: &[(&Shape, DType)], output: &Shape) -> usize {
    let Ok((_, dtype)) = kiln_compiler::ir::infer(op, inputs) else {
        return 0;
    };
    let s: Vec<&Shape> = inputs.iter().map(|&(s, _)| s).collect();
    if !matches!(crate::check::empty_case(op, &s, output), crate::check::Empty::Compute) {
        return 0;
    }
    match op {
        Op::GatherGrad { .. } => gather::scratch_wanted(output, dtype.is_half()),
        Op::Attention { .. } => attention::scratch_wanted(&s, output, false, dtype.is_half()),
        Op::AttentionGrad { .. } => attention::scratch_wanted(&s, output, true, dtype.is_half()),
        _ => 0,
    }
}

/// Generates the CUDA kernel of `op` on operands of the given shapes and dtypes producing `output`
/// (for effect ops, the scalar shape that `infer` gives). Errors as `cpu::prepare`: sources and
/// views have no kernel, f32 everywhere but f16 and bf16 in the families of `HALF_KERNELS`
/// (and what casts and gathers' ids move), and the shapes must agree with `ir::infer`.
pub fn generate(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<CudaKernel, KernelError> {
    generate_with_scratch(op, inputs, output, 0)
}

/// `generate` for a step with `scratch` bytes of scratch (`Arg::Scratch`), of which the kernel
/// uses at most that many (`scratch_bytes` says how many it would use).
pub fn generate_with_scratch(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
    scratch: usize,
) -> Result<CudaKernel, KernelError> {
    crate::check::check(op, inputs, output, "the CUDA kernels", HALF_KERNELS)?;
    let e = &half::Elems::of(inputs, output.1);
    let mut kernel = generate_typed(op, inputs, output, scratch, e)?;
    kernel.source = half::with_types(kernel.source, e);
    Ok(kernel)
}

/// `generate_with_scratch` once the step is checked, its operands and output of types `e`.
fn generate_typed(
    op: &Op,
    inputs: &[(&Shape, DType)],
    output: (&Shape, DType),
    scratch: usize,
    e: &half::Elems,
) -> Result<CudaKernel, KernelError> {
    let s: Vec<&Shape> = inputs.iter().map(|&(s, _)| s).collect();
    let out = output.0;
    let name = op.name();
    let label = op.label();
    // Work that writes nothing launches nothing; an empty operand gives a filled output.
    match crate::check::empty_case(op, &s, out) {
        crate::check::Empty::Compute => {}
        crate::check::Empty::Nothing => {
            let head = codegen::header(&label, &s, (!op.is_effect()).then_some(out));
            return Ok(CudaKernel {
                source: format!("{head}\n// empty: nothing to compute, no launch\n"),
                launches: Vec::new(),
                describe: format!("{name} (empty)"),
            });
        }
        crate::check::Empty::Fill(v) => return Ok(layout::fill(&label, v, out, e)),
    }
    let l = label.as_str();
    Ok(match op {
        Op::Input { .. } | Op::Variable { .. } | Op::Reshape { .. } => unreachable!("rejected above"),
        Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. } => {
            return Err(KernelError::Unsupported {
                op: name.into(),
                dtype: output.1,
                help: "collectives have no CUDA kernel: the CUDA backend runs a data-parallel plan's all-reduces, reduce-scatters and all-gathers itself, through host memory and its communicator (`CudaBackend::with_communicator`) or through NCCL (`CudaBackend::with_nccl`)".into(),
            });
        }
        Op::Attention { scale, causal } => attention::attention(l, &s, out, (*scale, *causal), (scratch, e))
            .map_err(|help| KernelError::Unsupported { op: label.clone(), dtype: output.1, help })?,
        Op::AttentionGrad { scale, causal } => {
            attention::attention_grad(l, &s, out, (*scale, *causal), (scratch, e))
                .map_err(|help| KernelError::Unsupported { op: label.clone(), dtype: output.1, help })?
        }
        Op::Fill { value, .. } => layout::fill(l, *value, out, e),
        Op::Iota { axis, .. } => layout::iota(l, *axis, out),
        Op::RandomUniform { seed, .. } => elementwise::random_uniform(l, *seed, s[0], out),
        Op::Unary(u) => elementwise::unary(*u, name, l, s[0], e),
        Op::Binary(b) => elementwise::binary(*b, name, l, (s[0], s[1], out), e),
        Op::Scalar { op: sop, value } => elementwise::scalar(*sop, *value, name, l, s[0], e),
        Op::Select => elementwise::select(l, (s[0], s[1], s[2]), out, e),
        Op::Fused(f) => match (&f.reduce, &f.matmul, &f.conv) {
            (_, Some(m), _) => matmul::fused_matmul(l, f, m, &s, out, scratch, e),
            (_, None, Some(window)) if !window.is_dense() => {
                grouped_conv::conv2d(l, s[0], s[1], window, out, Some((f, &s[2..])), e)
            }
            (_, None, Some(window)) => conv::fused_conv2d(l, f, window, &s, out, (scratch, e)),
            (Some(r), None, None) => reduce::fused_reduce(l, f, r, &s, out, scratch, e),
            (None, None, None) => elementwise::fused(l, f, &s, out, e),
        },
        Op::MatMul { transpose_a, transpose_b } => {
            matmul::matmul(l, s[0], s[1], (*transpose_a, *transpose_b), out, scratch, e)
        }
        Op::Permute { perm } => layout::permute(l, s[0], perm, out, e),
        Op::BroadcastTo { .. } => layout::broadcast_to(l, s[0], out, e),
        Op::Copy => layout::copy(l, s[0], e),
        Op::Concat { axis } => layout::concat(l, &s, *axis, out, e),
        Op::Slice { axis, start, len } => layout::slice(l, s[0], (*axis, *start, *len), out, e),
        Op::Pad { axis, before, after } => layout::pad(l, s[0], (*axis, *before, *after), out, e),
        Op::Reduce { op: rop, axes, .. } => reduce::reduce(*rop, name, l, s[0], axes, out, (scratch, e)),
        Op::Softmax { axis } => softmax::softmax(l, s[0], *axis, false, e),
        Op::LogSoftmax { axis } => softmax::softmax(l, s[0], *axis, true, e),
        // Non-dense windows (groups, dilation): direct kernels, no scratch.
        Op::Conv2d { window } if !window.is_dense() => {
            grouped_conv::conv2d(l, s[0], s[1], window, out, None, e)
        }
        Op::Conv2dBackpropInput { window, .. } if !window.is_dense() => {
            grouped_conv::backprop_input(l, s[0], s[1], window, out, conv::InputGradient::Plain, e)
        }
        Op::Conv2dBackpropInputReluGrad { window, .. } if !window.is_dense() => {
            let then = if s.len() == 4 {
                conv::InputGradient::ResidualReluGrad
            } else {
                conv::InputGradient::ReluGrad
            };
            grouped_conv::backprop_input(l, s[0], s[1], window, out, then, e)
        }
        Op::Conv2dBackpropFilter { window } if !window.is_dense() => {
            grouped_conv::backprop_filter(l, s[0], s[1], window, out, e)
        }
        Op::Conv2d { window } => conv::conv2d(l, s[0], s[1], window, out, (scratch, e)),
        Op::Conv2dBackpropInput { window, .. } => {
            conv::backprop_input(l, s[0], s[1], window, out, (scratch, e), conv::InputGradient::Plain)
        }
        Op::Conv2dBackpropInputReluGrad { window, .. } => {
            // Where no tap reads dx (a stride beyond the window: `conv_relu_grad` fuses stride 1
            // only, where every tap reads), dx is 0 and the residual form is relu_grad(y, r):
            // left to the two ops apart rather than generated here.
            let (_, _, k) =
                conv::backprop_input_dims(&crate::geometry::Geom::new(out, window, s[1].dims()[3]));
            if s.len() == 4 && k == 0 {
                return Err(KernelError::Unsupported {
                    op: label.clone(),
                    dtype: output.1,
                    help: "no filter tap reads this input gradient: compute relu_grad(y, r) apart".into(),
                });
            }
            let then = if s.len() == 4 {
                conv::InputGradient::ResidualReluGrad
            } else {
                conv::InputGradient::ReluGrad
            };
            conv::backprop_input(l, s[0], s[1], window, out, (scratch, e), then)
        }
        Op::Conv2dBackpropFilter { window } => {
            conv::backprop_filter(l, s[0], s[1], window, out, (scratch, e))
        }
        Op::Pool2d { kind, window } => pool::pool2d(*kind, name, l, s[0], window, out, e),
        Op::Pool2dGrad { kind, window } => pool::pool2d_grad(*kind, name, l, s[0], window, s[1], e),
        Op::AvgPool2dGrad { window, input } => pool::avg_pool2d_grad(name, l, input, window, s[0], e),
        Op::Gather => gather::gather(l, s[0], (s[1], inputs[1].1), out, e),
        Op::GatherGrad { vocab } => {
            gather::gather_grad(l, (s[0], inputs[0].1), s[1], (*vocab, out), (scratch, e))
                .map_err(|help| KernelError::Unsupported { op: label.clone(), dtype: output.1, help })?
        }
        Op::Cast { to } => cast::cast(l, s[0], inputs[0].1, *to),
        Op::CastLike => cast::cast(l, s[0], inputs[0].1, inputs[1].1),
        Op::Custom { name } => {
            let def = kiln_compiler::custom::lookup(name).ok_or_else(|| KernelError::Unsupported {
                op: label.clone(),
                dtype: DType::F32,
                help: "register the custom op (kiln::compiler::custom::register) in this process before loading the plan".into(),
            })?;
            let k = def.cuda(&s, out).ok_or_else(|| KernelError::Unsupported {
                op: label.clone(),
                dtype: DType::F32,
                help: format!(
                    "custom op `{name}` has no CUDA kernel (CustomOp::cuda): run it on the CPU, or write one"
                ),
            })?;
            // Declared scratch comes after `out`: the step's planned scratch, at least as large.
            let declared = def.scratch(&s, out);
            if declared > scratch {
                return Err(KernelError::Unsupported {
                    op: label.clone(),
                    dtype: DType::F32,
                    help: format!(
                        "custom op `{name}` declares {declared} bytes of scratch but the plan gives it {scratch}: compile the plan in a process where the op is registered as it is now"
                    ),
                });
            }
            let with_scratch = (declared > 0).then_some(Arg::Scratch);
            CudaKernel {
                source: format!("{}\n{}", codegen::header(l, &s, Some(out)), k.source),
                launches: vec![Launch {
                    function: k.function,
                    grid: k.grid,
                    block: k.block,
                    shared_bytes: 0,
                    args: (0..s.len()).map(Arg::Input).chain([Arg::Output]).chain(with_scratch).collect(),
                }],
                describe: format!("custom {name}"),
            }
        }
        Op::MatMulRows { rows } => matmul::matmul_rows(l, s[0], s[1], *rows, out, scratch, e),
        Op::ApplySgd { lr, momentum, nesterov, rows, product, shard } => optim::sgd(
            l,
            (*lr, *momentum, *nesterov),
            (*rows, *product, *shard, op.update_gate(s.len()).is_some()),
            &s,
            (scratch, e),
        ),
        Op::ApplyAdam { lr, beta1, beta2, epsilon, rows, product, shard } => optim::adam(
            l,
            [*lr, *beta1, *beta2, *epsilon],
            (*rows, *product, *shard, op.update_gate(s.len()).is_some()),
            &s,
            (scratch, e),
        ),
        Op::AssignAdd { value } => optim::assign_add(l, *value, s[0], op.update_gate(s.len()).is_some()),
        Op::UpdateLossScale { growth, backoff, interval } => {
            optim::update_loss_scale(l, *growth, *backoff, *interval)
        }
    })
}
