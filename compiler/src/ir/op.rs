//! The operations of kiln's IR. An `Op` carries every attribute that its output shape depends
//! on, so that a node's shape can always be re-derived from its op and operands (`ir::infer`).

use super::{DType, Shape};
use serde::{Deserialize, Serialize};
use std::fmt::{self, Write};

/// What a variable holds; the memory report breaks persistent bytes down by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum VarRole {
    /// A trained weight: updated by the optimizer and saved in checkpoints.
    Parameter,
    /// An optimizer's per-variable state (SGD's velocity, Adam's m and v), of its variable's shape
    /// (or of the rank's shard under ZeRO).
    OptimizerState,
    /// A one-element step counter (Adam's iterations, dropout's step) that an `AssignAdd` advances;
    /// the memory report counts it with the optimizer state.
    Counter,
    /// A value computed at compile time (`const_fold`): the plan carries its data
    /// (`Plan::constants`), the backends write it at load; never trained or checkpointed.
    Constant,
}

/// How a variable is initialised the first time a runtime sees it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Init {
    /// Every element 0.
    Zeros,
    /// Every element this value.
    Constant(f32),
    /// Keras's default: U(-l, l) with l = sqrt(6 / (fan_in + fan_out)).
    GlorotUniform,
    /// Samples of a normal distribution.
    Normal {
        /// The distribution's mean.
        mean: f32,
        /// The distribution's standard deviation, at least 0.
        std: f32,
    },
    /// Samples uniform in `[low, high)`.
    Uniform {
        /// The lower end of the range, included.
        low: f32,
        /// The upper end of the range, excluded; above `low`.
        high: f32,
    },
}

impl Init {
    /// Keras's fan computation: the last two axes are (in, out); earlier axes form the
    /// receptive field (convolution kernels in HWIO layout).
    pub fn fans(shape: &Shape) -> (usize, usize) {
        match shape.dims() {
            [] => (1, 1),
            [n] => (*n, *n),
            dims => {
                // Saturating: a shape with a zero axis may have other axes whose product overflows.
                let receptive = dims[..dims.len() - 2].iter().fold(1usize, |a, &d| a.saturating_mul(d));
                (
                    receptive.saturating_mul(dims[dims.len() - 2]),
                    receptive.saturating_mul(dims[dims.len() - 1]),
                )
            }
        }
    }

    /// Checks the initialiser's parameters: every value finite, `low < high` with a finite width
    /// for `Uniform`, `std >= 0` for `Normal`. The error says what is wrong, for a message that
    /// names the variable.
    pub fn check(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() { Ok(()) } else { Err(format!("{self:?}: {name} is {v}, not a finite number")) }
        };
        match *self {
            Init::Zeros | Init::GlorotUniform => Ok(()),
            Init::Constant(c) => finite("the constant", c),
            Init::Normal { mean, std } => {
                finite("the mean", mean)?;
                finite("std", std)?;
                if std < 0.0 {
                    return Err(format!("{self:?}: std is {std}, below 0"));
                }
                Ok(())
            }
            Init::Uniform { low, high } => {
                finite("low", low)?;
                finite("high", high)?;
                if low >= high {
                    return Err(format!(
                        "{self:?}: the range {low}..{high} is empty (low must be below high)"
                    ));
                }
                if !(high - low).is_finite() {
                    return Err(format!("{self:?}: the range {low}..{high} is wider than an f32 can hold"));
                }
                Ok(())
            }
        }
    }
}

/// An elementwise function of one operand (`Op::Unary`, and the unary instruction of a fused
/// group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    /// -x.
    Neg,
    /// |x|.
    Abs,
    /// 1 where x > 0, -1 where x < 0, and x itself for ±0 and NaN.
    Sign,
    /// max(x, 0), keeping NaN.
    Relu,
    /// The logistic function 1 / (1 + e^-x), computed without overflow.
    Sigmoid,
    /// The hyperbolic tangent.
    Tanh,
    /// Exact GELU, x·Φ(x) with the error function (Keras `approximate=False`, PyTorch default).
    Gelu,
    /// GELU's tanh approximation, x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))/2 (JAX's default,
    /// PyTorch `approximate="tanh"`, GPT-2's `gelu_new`): one op, so that a training step keeps
    /// only its input for the gradient, where the expression kept its every intermediate.
    GeluTanh,
    /// e^x.
    Exp,
    /// The natural logarithm ln(x).
    Log,
    /// The square root √x.
    Sqrt,
    /// The reciprocal square root 1 / √x.
    Rsqrt,
    /// x·x.
    Square,
    /// 1 / x.
    Reciprocal,
    /// The error function, erf(x) = 2/√π ∫₀ˣ e^(-t²) dt (`jax.lax.erf`, `torch.erf`).
    Erf,
}

impl UnaryOp {
    /// Every unary op, in declaration order (tests and tables run over it; a test checks that
    /// it lists every variant).
    pub const ALL: [UnaryOp; 15] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Sign,
        UnaryOp::Relu,
        UnaryOp::Sigmoid,
        UnaryOp::Tanh,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Square,
        UnaryOp::Reciprocal,
        UnaryOp::Erf,
    ];

    /// The arithmetic of one element as the CPU kernels compute it (`kernels/src/cpu/vmath.rs`):
    /// a transcendental is a range reduction and a polynomial, 15-30 operations where relu is
    /// one. Measured (1M floats, 2 threads, AVX2, `benches/transcendentals.rs`): relu 0.05-0.09 ms,
    /// exp 0.22-0.28, tanh 0.48-0.55, GELU 0.55-0.64: counting these as one each, `cheap_remat`
    /// took a GELU's recomputation for free and it cost 0.55 ms of a 42 ms step.
    pub fn flops_per_element(self) -> u64 {
        match self {
            UnaryOp::Neg | UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Relu | UnaryOp::Square => 1,
            UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Reciprocal => 4,
            UnaryOp::Exp | UnaryOp::Log | UnaryOp::Sigmoid => 16,
            UnaryOp::Tanh | UnaryOp::Erf => 24,
            UnaryOp::Gelu => 32,
            UnaryOp::GeluTanh => 24,
        }
    }
}

impl BinaryOp {
    /// As `UnaryOp::flops_per_element`: GELU's gradient evaluates the Gaussian tail, a power an
    /// exp and a log.
    pub fn flops_per_element(self) -> u64 {
        match self {
            BinaryOp::GeluGrad => 36,
            BinaryOp::GeluTanhGrad => 28,
            BinaryOp::Pow => 32,
            BinaryOp::Div => 4,
            _ => 1,
        }
    }
}

/// An elementwise function of two operands (a, b), broadcast against each other by NumPy rules
/// (`Op::Binary`); the backward ops (`ReluGrad` to `TanhGrad`) take operands of one shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    /// a + b.
    Add,
    /// a - b.
    Sub,
    /// a·b.
    Mul,
    /// a / b.
    Div,
    /// a raised to the power b (`f32::powf`).
    Pow,
    /// The larger of a and b; NaN where either is NaN (NumPy's `maximum`).
    Maximum,
    /// The smaller of a and b; NaN where either is NaN (NumPy's `minimum`).
    Minimum,
    /// Comparisons produce 1.0 where true and 0.0 where false.
    Greater,
    /// 1.0 where a >= b, else 0.0.
    GreaterEqual,
    /// 1.0 where a < b, else 0.0.
    Less,
    /// 1.0 where a <= b, else 0.0.
    LessEqual,
    /// 1.0 where a == b, else 0.0.
    Equal,
    /// 1.0 where a != b, else 0.0 (1.0 where either is NaN).
    NotEqual,
    /// Backward helpers, operands (forward value, upstream gradient), as TensorFlow's ReluGrad etc.
    /// GeluGrad takes the forward input x; ReluGrad, SigmoidGrad and TanhGrad the forward output y
    /// (ReluGrad passes the gradient where its first operand is > 0: relu's input or output alike).
    ReluGrad,
    /// `UnaryOp::Gelu`'s: (forward input x, upstream gradient dy) -> dy·(Φ(x) + x·φ(x)).
    GeluGrad,
    /// `UnaryOp::GeluTanh`'s: (forward input x, upstream gradient).
    GeluTanhGrad,
    /// `UnaryOp::Sigmoid`'s: (forward output y, upstream gradient dy) -> dy·y·(1 - y).
    SigmoidGrad,
    /// `UnaryOp::Tanh`'s: (forward output y, upstream gradient dy) -> dy·(1 - y²).
    TanhGrad,
}

/// `x op c` for a compile-time constant `c`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ScalarOp {
    /// x + c.
    Add,
    /// x·c.
    Mul,
    /// c - x
    RSub,
    /// c / x
    RDiv,
    /// x ^ c
    Pow,
    /// max(x, c), keeping NaN.
    Max,
    /// min(x, c), keeping NaN.
    Min,
    /// 1.0 where x > c, else 0.0.
    Greater,
    /// 1.0 where x >= c, else 0.0.
    GreaterEqual,
    /// 1.0 where x < c, else 0.0.
    Less,
    /// 1.0 where x <= c, else 0.0.
    LessEqual,
    /// 1.0 where x == c, else 0.0.
    Equal,
}

/// How values are combined: by `Op::Reduce` and fused reductions over axes, by `Op::AllReduce` and
/// `Op::ReduceScatter` over ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ReduceOp {
    /// The sum of the combined values.
    Sum,
    /// The sum divided by the count of values combined (over ranks: the rank count).
    Mean,
    /// The largest value, NaN propagating; refused by the collectives.
    Max,
}

/// How a 2-D window (`Window2d`) treats the input's border, as TensorFlow's `padding` or ONNX's
/// `pads`: the padded elements are zeros for convolutions and left out of pooling (a maximum
/// never sees them, an average does not count them). The padding is read inside the op: no
/// padded copy of the input is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Padding {
    /// Output size ceil(in / stride); TensorFlow's split of the padding (extra on the far side).
    Same,
    /// Output size floor((in - window) / stride) + 1.
    Valid,
    /// Explicit, possibly asymmetric padding (ONNX's `pads`, PyTorch's `padding`): output size
    /// floor((before + in + after - window) / stride) + 1, the window's dilated extent.
    Explicit {
        /// Elements of padding before the first row and column `[top, left]`.
        before: [usize; 2],
        /// Elements of padding after the last row and column `[bottom, right]`.
        after: [usize; 2],
    },
}

/// What a pooling op computes over each window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum PoolKind {
    /// The window's largest element.
    Max,
    /// Average over the window's in-bounds elements (TensorFlow excludes padding from the count).
    Avg,
}

/// A block of rows (axis 0): the part of a variable a tiled update writes, and the rows of a
/// weight gradient `MatMulRows` computes (`tiled_updates`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rows {
    /// The first row of the block: its index along axis 0.
    pub start: usize,
    /// The number of rows in the block.
    pub len: usize,
}

impl Rows {
    /// The first row past the block, or None where it overflows.
    pub fn end(&self) -> Option<usize> {
        self.start.checked_add(self.len)
    }

    /// The elements an update of `rows` (or, None, the whole variable) touches in `var`: the
    /// offset of the first and the count, with the block as kernel descriptions name it.
    /// `rows` was checked against `var` by `ir::infer`.
    pub fn span(rows: Option<Rows>, var: &Shape) -> (usize, usize, String) {
        match rows {
            None => (0, var.numel(), String::new()),
            Some(r) => {
                let row = var.dims()[1..].iter().product::<usize>();
                (r.start * row, r.len * row, format!(" rows {}..{}", r.start, r.start + r.len))
            }
        }
    }
}

/// One rank's part of a tensor split over the ranks of a data-parallel run (ZeRO's partition,
/// `crate::zero`): the elements of a tensor of `n` elements, flattened, in `ranks` contiguous
/// shards in rank order, as equal as possible (the first `n % ranks` one element longer; the same
/// split as `kiln_comm::shard_range`). A sharded value is stored padded to the longest shard
/// (`padded`), so that every rank's plan has the same shapes; the padding is never read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shard {
    /// The number of ranks the tensor is split over.
    pub ranks: usize,
    /// This rank's index, below `ranks`.
    pub rank: usize,
}

impl Shard {
    /// The elements of a tensor of `n` elements this rank owns; empty if `ranks` is 0 or
    /// `rank` is not below it (`ir::infer` refuses such a shard).
    pub fn range(&self, n: usize) -> std::ops::Range<usize> {
        if self.rank >= self.ranks {
            return 0..0;
        }
        let (base, extra) = (n / self.ranks, n % self.ranks);
        let start = self.rank * base + self.rank.min(extra);
        start..start + base + usize::from(self.rank < extra)
    }

    /// The longest shard of a tensor of `n` elements: the length every rank stores.
    pub fn padded(&self, n: usize) -> usize {
        n.div_ceil(self.ranks.max(1))
    }
}

/// Attributes of a 2-D window (convolution or pooling) over NHWC tensors: what cuDNN's
/// convolution descriptor holds (size, stride, padding, dilation and group count), so that a
/// grouped, depthwise or dilated convolution is one op with its own kernels rather than a dense
/// convolution over a filter built with zeros (an imported EfficientNet-B0 spent 958.8 GFLOP
/// forward that way where the model has 2.2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Window2d {
    /// The window's height and width `[KH, KW]` in elements (a convolution's filter size).
    pub size: [usize; 2],
    /// The step between neighbouring windows along height and width `[SH, SW]`, in elements.
    pub stride: [usize; 2],
    /// How the input's border is padded.
    pub padding: Padding,
    /// The step between neighbouring taps of the window `[DH, DW]` (1: dense taps); a window of
    /// size k spans (k - 1)·d + 1 input elements. Convolutions only: pooling takes 1.
    #[serde(default = "Window2d::dense_taps")]
    pub dilation: [usize; 2],
    /// The number of channel groups G of a convolution (1: dense; the input's channels:
    /// depthwise). Input channel c of group c / (C/G) meets only output channels of the same
    /// group, and the filter is `[KH, KW, C/G, F]`. Pooling takes 1.
    #[serde(default = "Window2d::one_group")]
    pub groups: usize,
}

impl Window2d {
    /// The largest window side or stride accepted (2^20): far beyond any real window, and small
    /// enough that no index arithmetic over a window overflows.
    pub const MAX_SIDE: usize = 1 << 20;

    /// A dense, undilated window: one group, taps next to each other.
    pub fn new(size: [usize; 2], stride: [usize; 2], padding: Padding) -> Window2d {
        Window2d { size, stride, padding, dilation: [1, 1], groups: 1 }
    }

    /// The same window with taps `dilation` elements apart.
    pub fn dilated(self, dilation: [usize; 2]) -> Window2d {
        Window2d { dilation, ..self }
    }

    /// The same window over `groups` channel groups.
    pub fn grouped(self, groups: usize) -> Window2d {
        Window2d { groups, ..self }
    }

    fn dense_taps() -> [usize; 2] {
        [1, 1]
    }

    fn one_group() -> usize {
        1
    }

    /// Whether the window is a plain dense one: one group and no dilation (the kernels'
    /// GEMM-shaped path).
    pub fn is_dense(&self) -> bool {
        self.groups == 1 && self.dilation == [1, 1]
    }

    /// The input elements one window spans along `axis`: (size - 1)·dilation + 1, or None
    /// where a side, a dilation or the span is 0 or beyond `MAX_SIDE`.
    pub fn extent(&self, axis: usize) -> Option<usize> {
        let (k, d) = (self.size[axis], self.dilation[axis]);
        if k == 0 || d == 0 || k > Self::MAX_SIDE || d > Self::MAX_SIDE {
            return None;
        }
        let e = (k - 1).checked_mul(d)?.checked_add(1)?;
        (e <= Self::MAX_SIDE).then_some(e)
    }

    /// Whether the windows cover an NHWC input of this shape exactly once each element: stride
    /// equal to the window, every spatial extent a multiple of it, and so no padding.
    pub fn tiles(&self, input: &Shape) -> bool {
        let d = input.dims();
        d.len() == 4
            && self.dilation == [1, 1]
            && (0..2).all(|a| {
                let (k, extent) = (self.size[a], d[1 + a]);
                self.stride[a] == k
                    && k > 0
                    && extent % k == 0
                    && self.out_and_pad(a, extent) == Some((extent / k, 0))
            })
    }

    /// Output extent and the padding before the first element, for one spatial axis.
    pub fn out_and_pad(&self, axis: usize, input: usize) -> Option<(usize, usize)> {
        let s = self.stride[axis];
        let k = self.extent(axis)?;
        if s == 0 || input == 0 || s > Self::MAX_SIDE {
            return None;
        }
        match self.padding {
            Padding::Valid => (input >= k).then(|| ((input - k) / s + 1, 0)),
            Padding::Same => {
                let out = input.div_ceil(s);
                // Checked: window and stride come from the user and may be huge.
                let total = (out - 1).checked_mul(s)?.checked_add(k)?.saturating_sub(input);
                Some((out, total / 2))
            }
            Padding::Explicit { before, after } => {
                let (b, a) = (before[axis], after[axis]);
                // A pad of a window's extent or more would give windows that read only padding.
                if b >= k || a >= k {
                    return None;
                }
                let padded = input.checked_add(b)?.checked_add(a)?;
                (padded >= k).then(|| ((padded - k) / s + 1, b))
            }
        }
    }
}

/// One operation of the IR with every attribute its output's shape depends on. Operands are listed
/// in operand order, as `(a, b)`; what each op accepts and produces is checked by `ir::infer`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- sources
    /// A value the caller feeds at every run.
    Input {
        /// The name the caller feeds it under.
        name: String,
        /// The shape every fed value has.
        shape: Shape,
        /// The element type of the fed values.
        dtype: DType,
    },
    /// A persistent tensor (`VarRole`): the runtime initialises it once and keeps it from run to
    /// run.
    Variable {
        /// The scoped name (`dense_1/kernel`) the runtime, the plan and checkpoints know it by,
        /// unique in a trace; it also seeds its initial values.
        key: String,
        /// The stored tensor's shape.
        shape: Shape,
        /// The stored tensor's element type.
        dtype: DType,
        /// What the variable holds, for the memory report's breakdown.
        role: VarRole,
        /// How the runtime fills the variable the first time it sees its key.
        init: Init,
    },
    /// A tensor of `shape` filled with `value`.
    Fill {
        /// The value of every element.
        value: f32,
        /// The output's shape (an f32 tensor).
        shape: Shape,
    },
    /// A tensor of `shape` whose every element is its index along `axis`, as f32 (exact up to
    /// 2^24): the source of position ids, triangular and causal masks (`Tensor::tril`).
    Iota {
        /// The output's shape (an f32 tensor).
        shape: Shape,
        /// The axis whose index every element holds; below the shape's rank.
        axis: usize,
    },
    /// (step) -> a tensor of `shape` of uniform values in [0, 1), a pure function of `seed`,
    /// the step counter's value (operand 0, a one-element tensor) and the element's index
    /// (`uniform`): the same bits on every backend and every run, new ones every step. Dropout's
    /// generator.
    RandomUniform {
        /// The output's shape (an f32 tensor).
        shape: Shape,
        /// The seed that, with the step and each element's index, fixes every value.
        seed: u64,
    },

    // ---- elementwise (NumPy broadcasting between operands)
    /// The unary op applied to every element of operand 0; the output has the operand's shape and
    /// dtype.
    Unary(UnaryOp),
    /// The binary op of operands 0 and 1, which share a dtype; the output has their broadcast
    /// shape.
    Binary(BinaryOp),
    /// `x op value` for every element x of operand 0; the output has the operand's shape and dtype.
    Scalar {
        /// The function of x and the constant.
        op: ScalarOp,
        /// The compile-time constant `c`.
        value: f32,
    },
    /// where(cond != 0, a, b), operands (cond, a, b).
    Select,
    /// A fused elementwise group (`ir::fused`): a program of elementwise instructions over the
    /// operands, each broadcast to the program's shape. Formed by the fusion pass.
    Fused(super::Fused),

    // ---- linear algebra
    /// Batched matrix product over the last two axes, batch axes broadcast.
    MatMul {
        /// Whether the product reads aᵀ: operand 0's last two axes swapped.
        transpose_a: bool,
        /// Whether the product reads bᵀ: operand 1's last two axes swapped.
        transpose_b: bool,
    },
    /// (a[M, K], b[M, N]) -> a[:, rows]ᵀ · b, [rows.len, N]: a block of rows of the weight
    /// gradient aᵀ·b, read from `a` in place. Tiled updates (`tiled_updates`) compute a
    /// gradient block by block, each consumed by its update before the next is made.
    MatMulRows {
        /// The block of aᵀ's rows computed (columns of `a`): non-empty and within a's K columns.
        rows: Rows,
    },

    // ---- layout
    /// A view of the operand's buffer with another shape: no kernel, no copy.
    Reshape {
        /// The new shape, with the operand's element count.
        shape: Shape,
    },
    /// The operand's axes reordered (a transpose) into a buffer of its own.
    Permute {
        /// For each output axis, the operand's axis it takes (output axis i is axis `perm[i]`); a
        /// permutation of `0..rank`.
        perm: Vec<usize>,
    },
    /// The operand broadcast to `shape` (NumPy rules, aligned at the right) and written out in
    /// full.
    BroadcastTo {
        /// The target shape; every axis of the operand equals its axis or is 1.
        shape: Shape,
    },
    /// An identity copy into a buffer of its own.
    Copy,
    /// Each element converted to `to` (f32, i32, i64, bool): float -> integer truncates toward
    /// zero (NaN -> 0, out of range saturates, as Rust's `as`), anything -> bool is `!= 0`,
    /// bool -> number is 0 or 1. Never in place (the sizes may differ).
    Cast {
        /// The element type converted to.
        to: DType,
    },
    /// (value, like): `value` converted to `like`'s element type (ONNX's `CastLike`), both
    /// float; the identity where they share it. A layer whose framework kernel computes in f32
    /// and stores its output in its input's type (PyTorch's `batch_norm` under autocast) ends
    /// with one, naming its input as `like`: mixed precision (`autocast`) rounds the output
    /// where that input is stored in half, and the cleanup (`passes::ResolveCastLike`) makes
    /// every other one a `Cast` or nothing before planning.
    CastLike,
    /// The operands joined along `axis` in operand order; they share a dtype and agree on every
    /// other axis.
    Concat {
        /// The axis along which the operands are joined.
        axis: usize,
    },
    /// The `len` consecutive indices from `start` along `axis` of the operand, every other axis
    /// whole.
    Slice {
        /// The axis sliced.
        axis: usize,
        /// The first index taken along `axis`.
        start: usize,
        /// How many indices are taken: above 0, ending within the axis.
        len: usize,
    },
    /// Zero padding along one axis: the inverse of `Slice`, used by its gradient.
    Pad {
        /// The axis padded.
        axis: usize,
        /// The number of zeros inserted before index 0 along `axis`.
        before: usize,
        /// The number of zeros appended after the last index along `axis`.
        after: usize,
    },

    // ---- reductions and normalisers
    /// Operand 0 reduced over `axes` by `op`.
    Reduce {
        /// How the reduced elements are combined: sum, mean or maximum.
        op: ReduceOp,
        /// The reduced axes: distinct, ascending, below the rank.
        axes: Vec<usize>,
        /// Whether the reduced axes stay in the output as length 1 (else they are removed).
        keepdims: bool,
    },
    /// Softmax along `axis`, computed stably (the maximum subtracted first); the output has the
    /// operand's shape.
    Softmax {
        /// The axis normalised over.
        axis: usize,
    },
    /// The logarithm of the softmax along `axis`, computed stably in one op; the output has the
    /// operand's shape.
    LogSoftmax {
        /// The axis normalised over.
        axis: usize,
    },

    // ---- convolution and pooling, NHWC activations, HWIO filters
    /// (x `[N,H,W,C]`, w `[KH,KW,C,F]`) -> `[N,OH,OW,F]`; `window.size` equals (KH, KW).
    Conv2d {
        /// The filter's size `[KH, KW]`, the stride and the padding.
        window: Window2d,
    },
    /// (dy, w) -> dx of shape `input`.
    Conv2dBackpropInput {
        /// The forward convolution's window.
        window: Window2d,
        /// The forward convolution's input shape `[N, H, W, C]`: the output's shape.
        input: Shape,
    },
    /// (dy, w, y) -> relu_grad(y, conv2d_backprop_input(dy, w)): a convolution's input gradient
    /// through the ReLU whose output y the convolution read, as one op that may write over y
    /// (`conv_relu_grad`). With a fourth operand r of the input's shape (the gradient that
    /// reaches y by another path, a residual connection's): relu_grad(y, r + dx), which may
    /// write over y or r.
    Conv2dBackpropInputReluGrad {
        /// The forward convolution's window.
        window: Window2d,
        /// The forward convolution's input shape `[N, H, W, C]`: the shape of y, of r and of the
        /// output.
        input: Shape,
    },
    /// (x, dy) -> dw of shape [KH, KW, C, F].
    Conv2dBackpropFilter {
        /// The forward convolution's window; its `size` gives the filter's KH and KW.
        window: Window2d,
    },
    /// Pooling of an NHWC input over each window, per channel:
    /// x `[N, H, W, C]` -> `[N, OH, OW, C]`.
    Pool2d {
        /// Maximum or average over the window.
        kind: PoolKind,
        /// The window's size, stride and padding.
        window: Window2d,
    },
    /// (x, dy) -> dx.
    Pool2dGrad {
        /// The forward pooling's kind.
        kind: PoolKind,
        /// The forward pooling's window.
        window: Window2d,
    },
    /// (dy) -> dx of shape `input`: average pooling's gradient, which needs the pooled input's
    /// shape only, not its values (so autodiff does not keep the input alive for it).
    AvgPool2dGrad {
        /// The forward pooling's window.
        window: Window2d,
        /// The pooled input's shape `[N, H, W, C]`: the output's shape.
        input: Shape,
    },

    // ---- attention
    /// Scaled dot-product attention as one op (FlashAttention's algorithm): (q `[.., S, D]`,
    /// k `[.., T, D]`, v `[.., T, D]`, optionally a bias broadcastable to `[.., S, T]` added to
    /// the scores) -> softmax(scale · q·kᵀ + bias (+ the causal mask)) · v, `[.., S, D]`. The
    /// leading axes (batch, heads) are the operands' own, equal in all three. The probabilities
    /// are never stored: kernels go over the keys a tile at a time with a running maximum and
    /// sum per row, and the gradient (`AttentionGrad`) recomputes them, so no `[.., S, T]`
    /// value lives from the forward pass to the backward.
    Attention {
        /// The factor of the scores, 1/√D for scaled dot-product attention.
        scale: f32,
        /// Whether query i attends only to keys j ≤ i + (T - S) (a decoder's mask, aligned to the
        /// last query; S = T for self-attention).
        causal: bool,
    },
    /// The gradient of `Attention`: (q, k, v, o, do, optional bias) -> dq, dk and dv packed along
    /// the second-to-last axis, `[.., S + 2T, D]` (dq rows 0..S, dk S..S+T, dv S+T..S+2T), the
    /// bias getting none (a mask). It recomputes each row's log-sum-exp and the probabilities a
    /// tile at a time from q and k, and Dᵢ = Σ doᵢ·oᵢ from o and do.
    AttentionGrad {
        /// The forward op's scale.
        scale: f32,
        /// The forward op's mask.
        causal: bool,
    },

    // ---- embedding
    /// (table[V, ...], ids[...]) -> [ids..., table[1..]]: rows of the table, ids as f32 integers.
    Gather,
    /// (ids, dy) -> d table [vocab, ...]: rows scattered and summed.
    GatherGrad {
        /// The table's row count V: the output's first axis.
        vocab: usize,
    },

    // ---- collectives across the ranks of a data-parallel run (`crate::data_parallel`)
    /// The operand reduced elementwise over every rank (`Sum`, or `Mean`: the sum over the rank
    /// count), in rank order on every rank, so that every rank gets the same bits. The backend's
    /// communicator (`kiln_comm::Communicator`) carries the bytes; written over its operand.
    AllReduce {
        /// `Sum` or `Mean` over the ranks (`ir::infer` refuses `Max`).
        op: ReduceOp,
    },
    /// This rank's shard (`Shard::range`) of the operand's elementwise reduction over every rank,
    /// 1-D, padded to `Shard::padded` elements (the padding is zero): ZeRO's gradient
    /// partition. Each shard is summed in rank order by the rank that owns it.
    ReduceScatter {
        /// `Sum` or `Mean` over the ranks (`ir::infer` refuses `Max`).
        op: ReduceOp,
        /// Which shard of the reduction this rank receives.
        shard: Shard,
    },
    /// An effect on a variable: every rank's shard of it (`Shard::range`, as the rank's sharded
    /// update left it) copied into every rank's variable, so that the ranks hold the same
    /// whole variable again (ZeRO's parameter all-gather). Its step's scratch holds this
    /// rank's shard while the communicator writes the variable.
    AllGather {
        /// This rank and the rank count: which shard of the variable this rank sends.
        shard: Shard,
    },

    // ---- a user's op, by its registered name (`crate::custom`)
    /// A user's op: its operands, output type, kernels and gradient come from the definition
    /// registered under `name` (`crate::custom::register`).
    Custom {
        /// The name the op is registered under.
        name: String,
    },

    // ---- training effects: write their variable operands in place, produce no tensor
    /// (var, grad) or, with momentum, (var, grad, velocity). With `rows`, only those rows of
    /// the variable (and its state) are updated, from a gradient of just those rows. With
    /// `product`, the gradient is the product aᵀ·b of two operands in its place (`Grad`).
    ApplySgd {
        /// The learning rate.
        lr: f32,
        /// The velocity's decay: v = momentum·v - lr·g, then var += v; 0 for plain SGD (var -=
        /// lr·g), which takes no velocity operand.
        momentum: f32,
        /// Whether the step is Nesterov's: var += momentum·v - lr·g after updating v.
        nesterov: bool,
        /// The block of rows updated (a tiled update); None for the whole variable.
        #[serde(default)]
        rows: Option<Rows>,
        /// Whether the gradient is the product aᵀ·b of two operands (`Grad::Product`), which the
        /// update's kernel computes; false: one stored gradient operand.
        #[serde(default)]
        product: bool,
        /// ZeRO: the update covers this rank's shard of the variable (`Shard::range` of its
        /// elements); the state operands hold just the shard (`Shard::padded` elements), and
        /// the gradient either the shard too (reduce-scattered) or the whole variable's shape
        /// (all-reduced: the shard is read at its offset). Never with `rows` or `product`.
        #[serde(default)]
        shard: Option<Shard>,
    },
    /// (var, grad, m, v, iterations): Keras's Adam, t = iterations + 1. With `rows`, only those
    /// rows of the variable and its state are updated, from a gradient of just those rows. With
    /// `product`, (var, a, b, m, v, iterations): the gradient is aᵀ·b (`Grad`).
    ApplyAdam {
        /// The learning rate, scaled each step by √(1 - β2^t) / (1 - β1^t).
        lr: f32,
        /// The decay rate β1 of the first moment m.
        beta1: f32,
        /// The decay rate β2 of the second moment v.
        beta2: f32,
        /// ε, added to √v in the update's denominator: var -= α·m / (√v + ε).
        epsilon: f32,
        /// The block of rows updated (a tiled update); None for the whole variable.
        #[serde(default)]
        rows: Option<Rows>,
        /// Whether the gradient is the product aᵀ·b of two operands (`Grad::Product`), which the
        /// update's kernel computes; false: one stored gradient operand.
        #[serde(default)]
        product: bool,
        /// ZeRO: the update covers this rank's shard of the variable (`Shard::range` of its
        /// elements); the state operands hold just the shard (`Shard::padded` elements), and
        /// the gradient either the shard too (reduce-scattered) or the whole variable's shape
        /// (all-reduced: the shard is read at its offset). Never with `rows` or `product`.
        #[serde(default)]
        shard: Option<Shard>,
    },
    /// (var) += value; with a last gate operand (`Op::update_gate`), only where the gate is
    /// finite.
    AssignAdd {
        /// The constant added to every element of the variable (1 for a step counter).
        value: f32,
    },
    /// Dynamic loss scaling's bookkeeping after a step (`crate::loss_scale`), as PyTorch's
    /// GradScaler updates its scale: (scale, good_steps, gate), the first two one-element f32
    /// variables written in place, the gate the step's one-element unscale factor, not finite
    /// where a gradient was not. A finite gate counts a good step, and the `interval`-th in a
    /// row multiplies the scale by `growth` (where the product stays finite) and restarts the
    /// count; a gate that is not finite multiplies the scale by `backoff` and restarts it.
    UpdateLossScale {
        /// The factor the scale grows by after `interval` finite steps in a row (2).
        growth: f32,
        /// The factor the scale shrinks by after a step whose gradients were not finite (0.5).
        backoff: f32,
        /// The finite steps in a row after which the scale grows (2,000).
        interval: u32,
    },
}

/// Where an optimizer update's gradient comes from (`Op::update_grad`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grad {
    /// Operand 1 holds it.
    Operand,
    /// Operands 1 and 2 are a[M, R] and b[M, C] and the gradient is aᵀ·b, [R, C]: the update's
    /// kernel computes it block by block and applies each block as it goes, so the gradient is
    /// never stored (`product_updates`). The state follows from operand 3 on. Factors of a half
    /// type (an f32 variable's, in a mixed-precision step) are summed in f32 and each element
    /// rounded once to their type before it is applied: the gradient of the weight's half
    /// copy, widened to the master weight's type, as the unfolded step makes it.
    Product,
}

impl Grad {
    /// The first optimizer-state operand (velocity, m).
    pub fn state_start(self) -> usize {
        match self {
            Grad::Operand => 2,
            Grad::Product => 3,
        }
    }
}

/// Broad classes the passes and the planner reason about.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpClass {
    /// `Input` and `Variable`: no operands; their values are fed or persistent.
    Source,
    /// Each output element reads the operands at its own position only (unary, binary, scalar,
    /// select, a fused group without product or reduction), so the output may be written over an
    /// operand.
    Elementwise,
    /// A reshape: the output is the operand's buffer with another shape, no kernel.
    View,
    /// Every other op that produces a tensor: products, convolutions, reductions, normalisers,
    /// pooling, layout copies, fills, gathers, tensor-producing collectives, custom ops.
    Compute,
    /// Writes variable operands in place and produces no tensor: optimizer updates, `AssignAdd`,
    /// `AllGather`.
    Effect,
}

impl Op {
    /// The op's broad class (`OpClass`). A fused group with a product or a reduction is `Compute`.
    pub fn class(&self) -> OpClass {
        match self {
            Op::Input { .. } | Op::Variable { .. } => OpClass::Source,
            // A fused reduction writes fewer elements than it reads; a fused product may write
            // over its epilogue's operands only (`may_write_over`).
            Op::Fused(f) if f.reduce.is_some() || f.has_product() => OpClass::Compute,
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Select | Op::Fused(_) => {
                OpClass::Elementwise
            }
            Op::Reshape { .. } => OpClass::View,
            Op::ApplySgd { .. }
            | Op::ApplyAdam { .. }
            | Op::AssignAdd { .. }
            | Op::UpdateLossScale { .. }
            | Op::AllGather { .. } => OpClass::Effect,
            _ => OpClass::Compute,
        }
    }

    /// Whether the kernels of this op may write its output, of shape `output`, over its operand
    /// `i` (one of the output's shape, read last by this op: `liveness` plans that, `validate`
    /// checks it). Elementwise ops: any operand, each element is read before it is written. A
    /// fused matrix product (no reduction; a fused convolution never): an operand of its
    /// epilogue, never a factor, at any rank and with either factor transposed. The CPU then
    /// computes it in blocks of output rows and columns into a bounded tile, and each block's
    /// epilogue reads the operand's elements in the block before writing them; a CUDA thread
    /// reads an element's epilogue operands before it stores the element. Writing
    /// relu's gradient over the activation it reads saves one activation-sized buffer at a
    /// dense layer's backward step (seed-mlp's training arena 15,680 -> 14,400 B). Max pooling's
    /// gradient: over x (operand 0) where the windows tile it, each window's x read before its
    /// dx is written. A convolution's input gradient through a ReLU: over y (operand 2), or the
    /// residual gradient r (operand 3) where there is one, with stride 1.
    pub fn may_write_over(&self, i: usize, output: &super::Shape) -> bool {
        match self {
            // A convolution's epilogue (`Fused::conv`) never: the CPU stores each block of
            // rows before its epilogue reads the block's operands.
            Op::Fused(f) if f.has_product() || f.reduce.is_some() => {
                f.reduce.is_none() && f.matmul.is_some() && i >= 2
            }
            Op::Custom { name } => crate::custom::lookup(name).is_some_and(|c| c.in_place() == Some(i)),
            // Over x where the windows tile it: the kernels then work a window at a time, reading
            // the window's x before writing its dx (`pool_relu_grad`).
            Op::Pool2dGrad { kind: PoolKind::Max, window } => i == 0 && window.tiles(output),
            // The communicator reduces the operand's bytes where they are.
            Op::AllReduce { .. } => i == 0,
            // Over y, or a residual gradient r, where the CPU computes the gradient a block of
            // rows at a time (stride 1): each block's y and r are read before its dx is written
            // (`conv_relu_grad`).
            Op::Conv2dBackpropInputReluGrad { window, .. } => (i == 2 || i == 3) && window.stride == [1, 1],
            _ => self.class() == OpClass::Elementwise,
        }
    }

    /// Whether this op exchanges data with the other ranks: every rank must run it, once, in
    /// the same order (never recomputed, folded or moved across ranks' programs alone).
    pub fn is_collective(&self) -> bool {
        matches!(self, Op::AllReduce { .. } | Op::ReduceScatter { .. } | Op::AllGather { .. })
    }

    /// The rank's shard a ZeRO step works on (`crate::zero`): a reduce-scatter's, an
    /// all-gather's or a sharded update's; None for every other op.
    pub fn shard(&self) -> Option<Shard> {
        match self {
            Op::ReduceScatter { shard, .. } | Op::AllGather { shard } => Some(*shard),
            Op::ApplySgd { shard, .. } | Op::ApplyAdam { shard, .. } => *shard,
            _ => None,
        }
    }

    /// As `shard`, to change the rank (`zero::for_rank`).
    pub fn shard_mut(&mut self) -> Option<&mut Shard> {
        match self {
            Op::ReduceScatter { shard, .. } | Op::AllGather { shard } => Some(shard),
            Op::ApplySgd { shard, .. } | Op::ApplyAdam { shard, .. } => shard.as_mut(),
            _ => None,
        }
    }

    /// Whether the op is an effect (`OpClass::Effect`): it writes its variable operands in place
    /// and produces no tensor.
    pub fn is_effect(&self) -> bool {
        self.class() == OpClass::Effect
    }

    /// An estimate of the op's floating-point work from its operand and output shapes, as
    /// rematerialization weighs recomputation: 2·m·n·k per matrix product (batch included),
    /// 2·N·OH·OW·F·KH·KW·C per convolution and each of its gradients, one per element read for
    /// reductions, normalisers, pooling and updates, one per output element for elementwise,
    /// layout and fill ops (a transcendental's polynomial more: `UnaryOp::flops_per_element`),
    /// nothing for sources and views.
    pub fn flops(&self, operands: &[&Shape], output: &Shape) -> u64 {
        let n = |s: &Shape| s.numel() as u64;
        let read = || operands.iter().map(|s| n(s)).sum::<u64>().max(n(output));
        let operand = |i: usize| operands.get(i).copied();
        match self {
            Op::Input { .. } | Op::Variable { .. } | Op::Reshape { .. } => 0,
            // Per row of queries and key: q·k (2D) and p·v (2D).
            Op::Attention { .. } => {
                let t = operand(1).map_or(0, |k| k.back(2)) as u64;
                4 * n(output) * t
            }
            // Per query row and key: the log-sum-exp pass (2D), the scores again (2D), dv, dp,
            // dq and dk (2D each): 12·S·T·D.
            Op::AttentionGrad { .. } => {
                let q = operand(0).map_or(0, n);
                let t = operand(1).map_or(0, |k| k.back(2)) as u64;
                12 * q * t
            }
            Op::Unary(op) => op.flops_per_element() * n(output),
            Op::Binary(op) => op.flops_per_element() * n(output),
            Op::Fill { .. }
            | Op::Iota { .. }
            | Op::RandomUniform { .. }
            | Op::Scalar { .. }
            | Op::Select
            | Op::Permute { .. }
            | Op::BroadcastTo { .. }
            | Op::Copy
            | Op::Cast { .. }
            | Op::CastLike
            | Op::Custom { .. }
            | Op::Concat { .. }
            | Op::Slice { .. }
            | Op::Pad { .. }
            | Op::Gather
            | Op::AssignAdd { .. }
            | Op::UpdateLossScale { .. } => n(output),
            Op::Fused(f) => {
                let product =
                    f.product().map_or(0, |p| p.flops(&operands[..operands.len().min(2)], &f.shape));
                let per =
                    |insts: &[super::fused::Inst]| insts.iter().map(|i| i.flops_per_element()).sum::<u64>();
                product
                    + (per(&f.insts) + u64::from(f.reduce.is_some())) * n(&f.shape)
                    + per(&f.epilogue) * n(output)
            }
            Op::MatMul { transpose_a, .. } => {
                let k = operand(0).map_or(1, |a| if *transpose_a { a.back(2) } else { a.back(1) }) as u64;
                2 * n(output) * k
            }
            Op::MatMulRows { .. } => 2 * n(output) * operand(0).map_or(1, |a| a.back(2)) as u64,
            // Output elements x taps x input channels of the output's group.
            Op::Conv2d { window } => {
                let c = operand(0).map_or(1, |x| x.back(1) / window.groups.max(1)) as u64;
                2 * n(output) * (window.size[0] * window.size[1]) as u64 * c
            }
            // dx[N,H,W,C] from dy[N,OH,OW,F]: every dy element meets KH*KW*C/G filter taps.
            Op::Conv2dBackpropInput { window, .. } | Op::Conv2dBackpropInputReluGrad { window, .. } => {
                let c = (output.back(1) / window.groups.max(1)) as u64;
                2 * operand(0).map_or(0, n) * (window.size[0] * window.size[1]) as u64 * c
            }
            // dw[KH,KW,C,F] from x and dy: every dy element meets KH*KW*C inputs.
            Op::Conv2dBackpropFilter { .. } => {
                2 * operand(1).map_or(0, n) * (n(output) / output.back(1).max(1) as u64)
            }
            Op::Reduce { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::Pool2d { .. }
            | Op::Pool2dGrad { .. }
            | Op::AvgPool2dGrad { .. }
            | Op::GatherGrad { .. }
            | Op::AllReduce { .. }
            | Op::ReduceScatter { .. }
            | Op::AllGather { .. }
            | Op::ApplySgd { product: false, .. }
            | Op::ApplyAdam { product: false, .. } => read(),
            // The gradient's product, 2·R·C·M, then one per variable element per operand read.
            Op::ApplySgd { product: true, .. } | Op::ApplyAdam { product: true, .. } => {
                let m = operand(1).map_or(0, |a| a.dims().first().copied().unwrap_or(1)) as u64;
                let var = operand(0).map_or(0, n);
                2 * var * m + var * operands.len() as u64
            }
        }
    }

    /// Operands this op writes in place (effects only).
    pub fn mutated_operands(&self) -> &'static [usize] {
        match self {
            Op::ApplySgd { momentum, product: false, .. } if *momentum != 0.0 => &[0, 2],
            Op::ApplySgd { momentum, product: true, .. } if *momentum != 0.0 => &[0, 3],
            Op::ApplySgd { .. } => &[0],
            Op::ApplyAdam { product: false, .. } => &[0, 2, 3],
            Op::ApplyAdam { product: true, .. } => &[0, 3, 4],
            Op::AssignAdd { .. } | Op::AllGather { .. } => &[0],
            Op::UpdateLossScale { .. } => &[0, 1],
            _ => &[],
        }
    }

    /// The index of the gate operand of an update of `operands` operands, where it has one
    /// (loss scaling, `crate::loss_scale`): `ApplySgd`, `ApplyAdam` and `AssignAdd` take an
    /// optional last one-element f32 operand. Where the gate is not finite the op changes
    /// nothing; otherwise an optimizer update multiplies its gradient by the gate (the unscale
    /// factor 1/scale) before applying it. None for other ops and for ungated updates.
    pub fn update_gate(&self, operands: usize) -> Option<usize> {
        let base = match self {
            Op::ApplySgd { momentum, product, .. } => {
                2 + usize::from(*momentum != 0.0) + usize::from(*product)
            }
            Op::ApplyAdam { product, .. } => 5 + usize::from(*product),
            Op::AssignAdd { .. } => 1,
            _ => return None,
        };
        (operands == base + 1).then_some(base)
    }

    /// This optimizer update writing `rows` from a gradient of the given form (`Grad`); other
    /// ops unchanged.
    pub fn update_in(&self, rows: Option<Rows>, grad: Grad) -> Op {
        let mut op = self.clone();
        if let Op::ApplySgd { rows: r, product, .. } | Op::ApplyAdam { rows: r, product, .. } = &mut op {
            *r = rows;
            *product = grad == Grad::Product;
        }
        op
    }

    /// Where an optimizer update takes its gradient from, and where its state starts; None for
    /// other ops.
    pub fn update_grad(&self) -> Option<Grad> {
        match self {
            Op::ApplySgd { product, .. } | Op::ApplyAdam { product, .. } => {
                Some(if *product { Grad::Product } else { Grad::Operand })
            }
            _ => None,
        }
    }

    /// Short name: the kernel family and what error messages call the op.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Input { .. } => "input",
            Op::Variable { .. } => "variable",
            Op::Fill { .. } => "fill",
            Op::Iota { .. } => "iota",
            Op::RandomUniform { .. } => "random_uniform",
            Op::Unary(u) => match u {
                UnaryOp::Neg => "neg",
                UnaryOp::Abs => "abs",
                UnaryOp::Sign => "sign",
                UnaryOp::Relu => "relu",
                UnaryOp::Sigmoid => "sigmoid",
                UnaryOp::Tanh => "tanh",
                UnaryOp::Gelu => "gelu",
                UnaryOp::GeluTanh => "gelu_tanh",
                UnaryOp::Erf => "erf",
                UnaryOp::Exp => "exp",
                UnaryOp::Log => "log",
                UnaryOp::Sqrt => "sqrt",
                UnaryOp::Rsqrt => "rsqrt",
                UnaryOp::Square => "square",
                UnaryOp::Reciprocal => "reciprocal",
            },
            Op::Binary(b) => match b {
                BinaryOp::Add => "add",
                BinaryOp::Sub => "sub",
                BinaryOp::Mul => "mul",
                BinaryOp::Div => "div",
                BinaryOp::Pow => "pow",
                BinaryOp::Maximum => "maximum",
                BinaryOp::Minimum => "minimum",
                BinaryOp::Greater => "greater",
                BinaryOp::GreaterEqual => "greater_equal",
                BinaryOp::Less => "less",
                BinaryOp::LessEqual => "less_equal",
                BinaryOp::Equal => "equal",
                BinaryOp::NotEqual => "not_equal",
                BinaryOp::ReluGrad => "relu_grad",
                BinaryOp::GeluGrad => "gelu_grad",
                BinaryOp::GeluTanhGrad => "gelu_tanh_grad",
                BinaryOp::SigmoidGrad => "sigmoid_grad",
                BinaryOp::TanhGrad => "tanh_grad",
            },
            Op::Scalar { op, .. } => match op {
                ScalarOp::Add => "add_scalar",
                ScalarOp::Mul => "mul_scalar",
                ScalarOp::RSub => "rsub_scalar",
                ScalarOp::RDiv => "rdiv_scalar",
                ScalarOp::Pow => "pow_scalar",
                ScalarOp::Max => "max_scalar",
                ScalarOp::Min => "min_scalar",
                ScalarOp::Greater => "greater_scalar",
                ScalarOp::GreaterEqual => "greater_equal_scalar",
                ScalarOp::Less => "less_scalar",
                ScalarOp::LessEqual => "less_equal_scalar",
                ScalarOp::Equal => "equal_scalar",
            },
            Op::Select => "select",
            Op::Fused(_) => "fused",
            Op::MatMul { .. } => "matmul",
            Op::Reshape { .. } => "reshape",
            Op::Permute { .. } => "permute",
            Op::BroadcastTo { .. } => "broadcast_to",
            Op::Copy => "copy",
            Op::Cast { .. } => "cast",
            Op::CastLike => "cast_like",
            Op::Custom { .. } => "custom",
            Op::Concat { .. } => "concat",
            Op::Slice { .. } => "slice",
            Op::Pad { .. } => "pad",
            Op::Reduce { op, .. } => match op {
                ReduceOp::Sum => "reduce_sum",
                ReduceOp::Mean => "reduce_mean",
                ReduceOp::Max => "reduce_max",
            },
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::Conv2d { .. } => "conv2d",
            Op::Conv2dBackpropInput { .. } => "conv2d_backprop_input",
            Op::Conv2dBackpropInputReluGrad { .. } => "conv2d_backprop_input_relu_grad",
            Op::Conv2dBackpropFilter { .. } => "conv2d_backprop_filter",
            Op::Pool2d { kind: PoolKind::Max, .. } => "max_pool2d",
            Op::Pool2d { kind: PoolKind::Avg, .. } => "avg_pool2d",
            Op::Pool2dGrad { kind: PoolKind::Max, .. } => "max_pool2d_grad",
            Op::Pool2dGrad { kind: PoolKind::Avg, .. } | Op::AvgPool2dGrad { .. } => "avg_pool2d_grad",
            Op::Gather => "gather",
            Op::GatherGrad { .. } => "gather_grad",
            Op::Attention { .. } => "attention",
            Op::AttentionGrad { .. } => "attention_grad",
            Op::AllReduce { .. } => "all_reduce",
            Op::ReduceScatter { .. } => "reduce_scatter",
            Op::AllGather { .. } => "all_gather",
            Op::MatMulRows { .. } => "matmul_rows",
            Op::ApplySgd { .. } => "apply_sgd",
            Op::ApplyAdam { .. } => "apply_adam",
            Op::AssignAdd { .. } => "assign_add",
            Op::UpdateLossScale { .. } => "update_loss_scale",
        }
    }

    /// The op with its attributes, as the IR dump prints it.
    pub fn label(&self) -> String {
        let mut s = self.name().to_string();
        let window = |s: &mut String, w: &Window2d| {
            let pad = match w.padding {
                Padding::Same => "same".to_string(),
                Padding::Valid => "valid".to_string(),
                Padding::Explicit { before, after } => {
                    format!("pad {}+{}x{}+{}", before[0], after[0], before[1], after[1])
                }
            };
            let _ = write!(s, "[{}x{}, stride {}x{}, {pad}", w.size[0], w.size[1], w.stride[0], w.stride[1]);
            if w.dilation != [1, 1] {
                let _ = write!(s, ", dilation {}x{}", w.dilation[0], w.dilation[1]);
            }
            if w.groups != 1 {
                let _ = write!(s, ", groups {}", w.groups);
            }
            s.push(']');
        };
        match self {
            Op::Input { name, .. } => {
                let _ = write!(s, " {name:?}");
            }
            Op::Variable { key, role, init, .. } => {
                let role = match role {
                    VarRole::Parameter => "parameter",
                    VarRole::OptimizerState => "optimizer_state",
                    VarRole::Counter => "counter",
                    VarRole::Constant => "constant",
                };
                let _ = write!(s, " {key:?} ({role}, {})", init_label(init));
            }
            Op::Fill { value, .. } => {
                let _ = write!(s, "[{value}]");
            }
            Op::Iota { axis, .. } => {
                let _ = write!(s, "[axis {axis}]");
            }
            Op::RandomUniform { seed, .. } => {
                let _ = write!(s, "[seed {seed}]");
            }
            Op::Scalar { value, .. } => {
                let _ = write!(s, "[{value}]");
            }
            Op::MatMul { transpose_a, transpose_b } if *transpose_a || *transpose_b => {
                let _ = write!(
                    s,
                    "[{}{}]",
                    if *transpose_a { "ta" } else { "" },
                    if *transpose_b { "tb" } else { "" }
                );
            }
            Op::Permute { perm } => {
                let _ = write!(s, "{perm:?}");
            }
            Op::Concat { axis } | Op::Softmax { axis } | Op::LogSoftmax { axis } => {
                let _ = write!(s, "[axis {axis}]");
            }
            Op::Cast { to } => {
                let _ = write!(s, " to {to}");
            }
            Op::Custom { name } => {
                let _ = write!(s, " {name}");
            }
            Op::Slice { axis, start, len } => {
                let _ = write!(s, "[axis {axis}, {start}..{}]", start.saturating_add(*len));
            }
            Op::Pad { axis, before, after } => {
                let _ = write!(s, "[axis {axis}, {before}+{after}]");
            }
            Op::Reduce { axes, keepdims, .. } => {
                let _ = write!(s, "{axes:?}");
                if *keepdims {
                    s.push_str("[keepdims]");
                }
            }
            Op::Conv2d { window: w }
            | Op::Conv2dBackpropInput { window: w, .. }
            | Op::Conv2dBackpropInputReluGrad { window: w, .. }
            | Op::Conv2dBackpropFilter { window: w }
            | Op::Pool2d { window: w, .. }
            | Op::Pool2dGrad { window: w, .. }
            | Op::AvgPool2dGrad { window: w, .. } => window(&mut s, w),
            Op::Attention { scale, causal } | Op::AttentionGrad { scale, causal } => {
                let _ = write!(s, "[scale {scale}{}]", if *causal { ", causal" } else { "" });
            }
            Op::GatherGrad { vocab } => {
                let _ = write!(s, "[vocab {vocab}]");
            }
            Op::AllReduce { op } => {
                let _ = write!(s, "[{}]", if *op == ReduceOp::Mean { "mean" } else { "sum" });
            }
            Op::ReduceScatter { op, shard } => {
                let op = if *op == ReduceOp::Mean { "mean" } else { "sum" };
                let _ = write!(s, "[{op}, rank {} of {}]", shard.rank, shard.ranks);
            }
            Op::AllGather { shard } => {
                let _ = write!(s, "[rank {} of {}]", shard.rank, shard.ranks);
            }
            Op::MatMulRows { rows } => {
                let _ = write!(s, "[rows {}..{}]", rows.start, rows.start.saturating_add(rows.len));
            }
            Op::ApplySgd { lr, momentum, nesterov, rows, product, shard } => {
                let _ = write!(s, "[lr {lr}, momentum {momentum}");
                if *nesterov {
                    s.push_str(", nesterov");
                }
                rows_label(&mut s, rows);
                product_label(&mut s, *product);
                shard_label(&mut s, shard);
                s.push(']');
            }
            Op::ApplyAdam { lr, beta1, beta2, epsilon, rows, product, shard } => {
                let _ = write!(s, "[lr {lr}, beta1 {beta1}, beta2 {beta2}, epsilon {epsilon}");
                rows_label(&mut s, rows);
                product_label(&mut s, *product);
                shard_label(&mut s, shard);
                s.push(']');
            }
            Op::AssignAdd { value } => {
                let _ = write!(s, "[{value}]");
            }
            Op::UpdateLossScale { growth, backoff, interval } => {
                let _ = write!(s, "[growth {growth}, backoff {backoff}, interval {interval}]");
            }
            Op::Fused(f) => {
                let _ = write!(s, "[{}]", f.text());
            }
            _ => {}
        }
        s
    }
}

fn product_label(s: &mut String, product: bool) {
    if product {
        s.push_str(", gradient aᵀ·b");
    }
}

fn shard_label(s: &mut String, shard: &Option<Shard>) {
    if let Some(sh) = shard {
        let _ = write!(s, ", shard {} of {}", sh.rank, sh.ranks);
    }
}

fn rows_label(s: &mut String, rows: &Option<Rows>) {
    if let Some(r) = rows {
        let _ = write!(s, ", rows {}..{}", r.start, r.start.saturating_add(r.len));
    }
}

fn init_label(init: &Init) -> String {
    match init {
        Init::Zeros => "zeros".into(),
        Init::Constant(c) => format!("constant {c}"),
        Init::GlorotUniform => "glorot_uniform".into(),
        Init::Normal { mean, std } => format!("normal {mean}±{std}"),
        Init::Uniform { low, high } => format!("uniform {low}..{high}"),
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label())
    }
}

/// The uniform value in [0, 1) of `Op::RandomUniform` at element `index` for `seed` and step
/// `step`: SplitMix64's finaliser over the three mixed together, its top 24 bits over 2^24 (so
/// exactly representable in f32). The step is truncated to an integer, saturating (negative and
/// NaN are 0). Every backend computes this function (CUDA with 64-bit integer arithmetic, the
/// same bits).
pub fn uniform(seed: u64, step: f32, index: u64) -> f32 {
    let mut x =
        seed ^ (step as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03);
    x ^= x >> 30;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    (x >> 40) as f32 / (1u64 << 24) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `UnaryOp::ALL` holds every variant once: the match below stops compiling when a variant
    /// is added, and its index must find the op in `ALL`.
    #[test]
    fn all_unary_ops_are_listed() {
        let index = |op: UnaryOp| match op {
            UnaryOp::Neg => 0,
            UnaryOp::Abs => 1,
            UnaryOp::Sign => 2,
            UnaryOp::Relu => 3,
            UnaryOp::Sigmoid => 4,
            UnaryOp::Tanh => 5,
            UnaryOp::Gelu => 6,
            UnaryOp::GeluTanh => 7,
            UnaryOp::Exp => 8,
            UnaryOp::Log => 9,
            UnaryOp::Sqrt => 10,
            UnaryOp::Rsqrt => 11,
            UnaryOp::Square => 12,
            UnaryOp::Reciprocal => 13,
            UnaryOp::Erf => 14,
        };
        for (i, op) in UnaryOp::ALL.into_iter().enumerate() {
            assert_eq!(index(op), i, "{op:?}");
        }
    }
}
