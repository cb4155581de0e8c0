//! The ops of the DSL as methods on `Tensor`. Every method is `#[track_caller]`, so a shape
//! mistake names the user's line.

use super::{IntoAxes, Tensor};
use crate::ir::{BinaryOp, DType, Op, Padding, PoolKind, ReduceOp, ScalarOp, Shape, UnaryOp, Window2d};
use std::panic::Location;

/// The right-hand side of a binary op: a tensor or an f32 constant.
pub enum Operand {
    /// A tensor of the same trace, broadcast against the left-hand side.
    Tensor(Tensor),
    /// A constant applied to every element (a scalar op where the op has one, else a broadcast fill).
    Scalar(f32),
}

impl From<&Tensor> for Operand {
    fn from(t: &Tensor) -> Self {
        Operand::Tensor(t.clone())
    }
}

impl From<Tensor> for Operand {
    fn from(t: Tensor) -> Self {
        Operand::Tensor(t)
    }
}

impl From<f32> for Operand {
    fn from(v: f32) -> Self {
        Operand::Scalar(v)
    }
}

macro_rules! unary {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[track_caller]
        pub fn $name(&self) -> Tensor {
            self.record(Op::Unary(UnaryOp::$op), &[self])
        }
    )*};
}

impl Tensor {
    unary! {
        /// `-x` elementwise.
        neg => Neg,
        /// `|x|` elementwise.
        abs => Abs,
        /// 1 where x > 0, -1 where x < 0, and x itself for ±0 and NaN, elementwise.
        sign => Sign,
        /// `max(x, 0)` elementwise, keeping NaN.
        relu => Relu,
        /// The logistic function 1 / (1 + e^-x) elementwise.
        sigmoid => Sigmoid,
        /// The hyperbolic tangent elementwise.
        tanh => Tanh,
        /// Exact GELU: x·Φ(x).
        gelu => Gelu,
        /// GELU's tanh approximation, x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))/2, as one op (JAX's
        /// `gelu(approximate=True)`, PyTorch's `gelu(approximate="tanh")`).
        gelu_tanh => GeluTanh,
        /// e^x elementwise.
        exp => Exp,
        /// The natural logarithm elementwise.
        log => Log,
        /// The square root elementwise.
        sqrt => Sqrt,
        /// The reciprocal square root 1 / √x elementwise.
        rsqrt => Rsqrt,
        /// `x · x` elementwise.
        square => Square,
        /// 1 / x elementwise.
        reciprocal => Reciprocal,
        /// The error function.
        erf => Erf,
    }

    #[track_caller]
    fn binary_or_scalar(&self, rhs: Operand, b: BinaryOp, s: Option<ScalarOp>) -> Tensor {
        match (rhs, s) {
            (Operand::Tensor(t), _) => self.record(Op::Binary(b), &[self, &t]),
            (Operand::Scalar(v), Some(op)) => self.record(Op::Scalar { op, value: v }, &[self]),
            (Operand::Scalar(v), None) => {
                let c = self.tracer().fill(v, Shape::scalar());
                self.record(Op::Binary(b), &[self, &c])
            }
        }
    }

    /// `self + rhs` elementwise (a tensor broadcasts, as NumPy's; an f32 is a scalar op).
    #[track_caller]
    pub fn add(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Add, Some(ScalarOp::Add))
    }

    /// `self - rhs` elementwise, broadcasting.
    #[track_caller]
    pub fn sub(&self, rhs: impl Into<Operand>) -> Tensor {
        match rhs.into() {
            Operand::Scalar(v) => self.record(Op::Scalar { op: ScalarOp::Add, value: -v }, &[self]),
            t => self.binary_or_scalar(t, BinaryOp::Sub, None),
        }
    }

    /// `self · rhs` elementwise, broadcasting.
    #[track_caller]
    pub fn mul(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Mul, Some(ScalarOp::Mul))
    }

    /// `self / rhs` elementwise, broadcasting (an f32 divisor becomes a product by its reciprocal).
    #[track_caller]
    pub fn div(&self, rhs: impl Into<Operand>) -> Tensor {
        match rhs.into() {
            Operand::Scalar(v) => self.record(Op::Scalar { op: ScalarOp::Mul, value: 1.0 / v }, &[self]),
            t => self.binary_or_scalar(t, BinaryOp::Div, None),
        }
    }

    /// `self ^ rhs` elementwise.
    #[track_caller]
    pub fn pow(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Pow, Some(ScalarOp::Pow))
    }

    /// The larger of `self` and `rhs` elementwise, broadcasting; NaN where either is NaN.
    #[track_caller]
    pub fn maximum(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Maximum, Some(ScalarOp::Max))
    }

    /// The smaller of `self` and `rhs` elementwise, broadcasting; NaN where either is NaN.
    #[track_caller]
    pub fn minimum(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Minimum, Some(ScalarOp::Min))
    }

    /// The lower triangle of the last two axes: elements with column - row <= `k` kept, the
    /// others 0 (NumPy's and PyTorch's `tril`; `k = 0` keeps the diagonal).
    #[track_caller]
    pub fn tril(&self, k: isize) -> Tensor {
        let dims = self.dims().to_vec();
        if dims.len() < 2 {
            return self.tracer().report(
                "tril",
                format!("tril needs a matrix, got {}", self.shape()),
                &[self],
                "give it a tensor of rank 2 or more (the last two axes are the matrix)",
            );
        }
        let (r, c) = (dims[dims.len() - 2], dims[dims.len() - 1]);
        let t = self.tracer();
        let rows = t.iota([r, c], 0);
        let keep = t.iota([r, c], 1).le(&(rows + k as f32));
        self * &keep
    }

    /// Limits every element to `[low, high]` (the gradient passes inside the range, as Keras's clip).
    #[track_caller]
    pub fn clamp(&self, low: f32, high: f32) -> Tensor {
        self.maximum(low).minimum(high)
    }

    /// 1.0 where `self > rhs`, else 0.0.
    #[track_caller]
    pub fn gt(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Greater, Some(ScalarOp::Greater))
    }

    /// 1.0 where `self >= rhs`, else 0.0.
    #[track_caller]
    pub fn ge(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::GreaterEqual, Some(ScalarOp::GreaterEqual))
    }

    /// 1.0 where `self < rhs`, else 0.0.
    #[track_caller]
    pub fn lt(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Less, Some(ScalarOp::Less))
    }

    /// 1.0 where `self <= rhs`, else 0.0.
    #[track_caller]
    pub fn le(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::LessEqual, Some(ScalarOp::LessEqual))
    }

    /// 1.0 where equal, else 0.0.
    #[track_caller]
    pub fn eq(&self, rhs: impl Into<Operand>) -> Tensor {
        self.binary_or_scalar(rhs.into(), BinaryOp::Equal, Some(ScalarOp::Equal))
    }

    /// 1.0 where not equal, else 0.0 (1.0 where either is NaN).
    #[track_caller]
    pub fn ne(&self, rhs: impl Into<Operand>) -> Tensor {
        match rhs.into() {
            Operand::Scalar(v) => self.eq(v).rsub(1.0),
            t => self.binary_or_scalar(t, BinaryOp::NotEqual, None),
        }
    }

    /// `c - self`.
    #[track_caller]
    pub fn rsub(&self, c: f32) -> Tensor {
        self.record(Op::Scalar { op: ScalarOp::RSub, value: c }, &[self])
    }

    /// `c / self`.
    #[track_caller]
    pub fn rdiv(&self, c: f32) -> Tensor {
        self.record(Op::Scalar { op: ScalarOp::RDiv, value: c }, &[self])
    }

    /// `where(cond != 0, a, b)` with broadcasting; `self` is the condition.
    #[track_caller]
    pub fn select(&self, a: &Tensor, b: &Tensor) -> Tensor {
        self.record(Op::Select, &[self, a, b])
    }

    /// Matrix product over the last two axes; batch axes broadcast. Half factors give a value
    /// of their type: the product accumulates in f32 (`DType::accumulated`) and is rounded once,
    /// as PyTorch's product of bf16 tensors is bf16 (mixed precision's own products, made by
    /// `autocast`, keep the f32 sum until their bias add).
    #[track_caller]
    pub fn matmul(&self, rhs: &Tensor) -> Tensor {
        self.in_factor_type(self.record(Op::MatMul { transpose_a: false, transpose_b: false }, &[self, rhs]))
    }

    /// Matrix product with either operand's last two axes transposed, without a copy (half
    /// factors: a value of their type, as `matmul`).
    #[track_caller]
    pub fn matmul_t(&self, rhs: &Tensor, transpose_a: bool, transpose_b: bool) -> Tensor {
        self.in_factor_type(self.record(Op::MatMul { transpose_a, transpose_b }, &[self, rhs]))
    }

    /// `product` (of `self` and another factor) cast back to the factors' half type.
    #[track_caller]
    fn in_factor_type(&self, product: Tensor) -> Tensor {
        if product.dtype() != self.dtype() && matches!(self.dtype(), DType::F16 | DType::BF16) {
            product.cast(self.dtype())
        } else {
            product
        }
    }

    /// Scaled dot-product attention as one op (`Op::Attention`): `self` the queries `[.., S, D]`,
    /// `k` and `v` `[.., T, D]`, `bias` (a mask of 0 / -1e9, or a position bias) broadcast to
    /// `[.., S, T]`: softmax(scale · q·kᵀ + bias) · v, `[.., S, D]`. With `causal`, query i sees
    /// keys j <= i + (T - S) only (the others get -1e9 added to their scores).
    #[track_caller]
    pub fn attention(
        &self,
        k: &Tensor,
        v: &Tensor,
        bias: Option<&Tensor>,
        scale: f32,
        causal: bool,
    ) -> Tensor {
        let mut operands = vec![self, k, v];
        operands.extend(bias);
        self.record(Op::Attention { scale, causal }, &operands)
    }

    /// Class ids (f32, any shape) -> `[..., classes]` rows of 0.0 with a 1.0 at each id: the ids
    /// compared with an iota over the classes, which fusion computes inside whatever reads the
    /// result (`fusion`: no one-hot tensor is stored where its readers fuse). An id outside
    /// `[0, classes)` gives a row of zeros, as `jax.nn.one_hot` does.
    #[track_caller]
    pub fn one_hot(&self, classes: usize) -> Tensor {
        if classes == 0 {
            return self.tracer().report(
                "one_hot",
                format!("one_hot of {} over 0 classes", self.shape()),
                &[self],
                "give at least one class",
            );
        }
        let mut column = self.dims().to_vec();
        column.push(1);
        // Integer ids are compared as f32 (exact below 2^24 classes).
        self.reshape(column).cast(DType::F32).eq(self.tracer().iota([classes], 0))
    }

    /// A view with another shape of as many elements (no copy).
    #[track_caller]
    pub fn reshape(&self, shape: impl Into<Shape>) -> Tensor {
        self.record(Op::Reshape { shape: shape.into() }, &[self])
    }

    /// Collapses every axis after the first: `[N, ...]` -> `[N, rest]`.
    #[track_caller]
    pub fn flatten(&self) -> Tensor {
        let n = self.dims().first().copied().unwrap_or(1);
        // The product of the trailing axes, not numel / n: a batch of 0 rows keeps its feature
        // size ([0, 5, 3] -> [0, 15]).
        let rest =
            self.dims().iter().skip(1).try_fold(1usize, |a, &d| a.checked_mul(d)).unwrap_or(usize::MAX);
        self.reshape([n, rest])
    }

    /// The axes reordered: output axis `i` is input axis `perm[i]`.
    #[track_caller]
    pub fn permute(&self, perm: &[usize]) -> Tensor {
        self.record(Op::Permute { perm: perm.to_vec() }, &[self])
    }

    /// Swaps two axes (negative axes count from the end).
    #[track_caller]
    pub fn transpose(&self, a: isize, b: isize) -> Tensor {
        let loc = Location::caller();
        let (Some(a), Some(b)) = (self.shape.axis(a), self.shape.axis(b)) else {
            return self.axis_error("permute", loc, format!("axes ({a}, {b})"));
        };
        let mut perm: Vec<usize> = (0..self.rank()).collect();
        perm.swap(a, b);
        self.tracer().record_at(Op::Permute { perm }, &[self], loc)
    }

    /// Swaps the last two axes.
    #[track_caller]
    pub fn t(&self) -> Tensor {
        self.transpose(-2, -1)
    }

    /// The tensor repeated along new or size-1 axes to `shape` (NumPy's broadcasting rules).
    #[track_caller]
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Tensor {
        self.record(Op::BroadcastTo { shape: shape.into() }, &[self])
    }

    /// A copy into a buffer of its own.
    #[track_caller]
    pub fn copy(&self) -> Tensor {
        self.record(Op::Copy, &[self])
    }

    /// Each element converted to `to` (`Op::Cast`: f32, i32, i64, bool). Casting to the tensor's
    /// own dtype is the tensor itself. f32 -> integer truncates toward zero and saturates; any ->
    /// bool is `!= 0`; bool -> number is 0 or 1. Only float -> float carries a gradient.
    #[track_caller]
    pub fn cast(&self, to: DType) -> Tensor {
        if to == self.dtype {
            return self.clone();
        }
        self.record(Op::Cast { to }, &[self])
    }

    /// `self` in `like`'s element type (ONNX's `CastLike`; both float): what a layer whose
    /// framework kernel stores its output in its input's type ends with, so that mixed
    /// precision rounds it where that input is half (`Op::CastLike`).
    #[track_caller]
    pub fn cast_like(&self, like: &Tensor) -> Tensor {
        self.record(Op::CastLike, &[self, like])
    }

    #[track_caller]
    fn reduce(&self, op: ReduceOp, axes: Option<Vec<isize>>, keepdims: bool) -> Tensor {
        let loc = Location::caller();
        let axes = match axes {
            None => Some((0..self.rank()).collect::<Vec<_>>()),
            Some(list) => list.iter().map(|&a| self.shape.axis(a)).collect(),
        };
        let Some(mut axes) = axes else {
            return self.axis_error(Op::Reduce { op, axes: vec![], keepdims }.name(), loc, "the axes".into());
        };
        axes.sort_unstable();
        axes.dedup();
        self.tracer().record_at(Op::Reduce { op, axes, keepdims }, &[self], loc)
    }

    /// The sum over `axes` (`..` for all); `keepdims` keeps them as size-1 axes.
    #[track_caller]
    pub fn sum(&self, axes: impl IntoAxes, keepdims: bool) -> Tensor {
        self.reduce(ReduceOp::Sum, axes.axes(), keepdims)
    }

    /// The mean over `axes` (`..` for all); `keepdims` keeps them as size-1 axes.
    #[track_caller]
    pub fn mean(&self, axes: impl IntoAxes, keepdims: bool) -> Tensor {
        self.reduce(ReduceOp::Mean, axes.axes(), keepdims)
    }

    /// The largest value over `axes` (`..` for all), NaN propagating; `keepdims` keeps them as
    /// size-1 axes.
    #[track_caller]
    pub fn max(&self, axes: impl IntoAxes, keepdims: bool) -> Tensor {
        self.reduce(ReduceOp::Max, axes.axes(), keepdims)
    }

    #[track_caller]
    fn along(&self, axis: isize, make: impl FnOnce(usize) -> Op, name: &str) -> Tensor {
        let loc = Location::caller();
        match self.shape.axis(axis) {
            Some(a) => self.tracer().record_at(make(a), &[self], loc),
            None => self.axis_error(name, loc, format!("axis {axis}")),
        }
    }

    /// Softmax along `axis` (negative counts from the end): `exp(x - max) / sum(exp(x - max))`.
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Tensor {
        self.along(axis, |axis| Op::Softmax { axis }, "softmax")
    }

    /// Log-softmax along `axis` (negative counts from the end): `x - max - log(sum(exp(x - max)))`.
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Tensor {
        self.along(axis, |axis| Op::LogSoftmax { axis }, "log_softmax")
    }

    /// Elements `start..start + len` along `axis`.
    #[track_caller]
    pub fn slice(&self, axis: isize, start: usize, len: usize) -> Tensor {
        self.along(axis, |axis| Op::Slice { axis, start, len }, "slice")
    }

    /// Zeros added before and after along `axis`.
    #[track_caller]
    pub fn pad(&self, axis: isize, before: usize, after: usize) -> Tensor {
        self.along(axis, |axis| Op::Pad { axis, before, after }, "pad")
    }

    /// Joins `self` and `others` along `axis`.
    #[track_caller]
    pub fn concat(&self, others: &[&Tensor], axis: isize) -> Tensor {
        let loc = Location::caller();
        let mut all = vec![self];
        all.extend_from_slice(others);
        match self.shape.axis(axis) {
            Some(a) => self.tracer().record_at(Op::Concat { axis: a }, &all, loc),
            None => self.axis_error("concat", loc, format!("axis {axis}")),
        }
    }

    /// 2-D convolution: `self` is NHWC, `filter` is `[KH, KW, C, F]`.
    #[track_caller]
    pub fn conv2d(&self, filter: &Tensor, stride: [usize; 2], padding: Padding) -> Tensor {
        let size = match filter.dims() {
            [kh, kw, _, _] => [*kh, *kw],
            _ => [0, 0],
        };
        self.in_factor_type(
            self.record(Op::Conv2d { window: Window2d::new(size, stride, padding) }, &[self, filter]),
        )
    }

    /// 2-D convolution over a full window: `self` is NHWC `[N, H, W, C]`, `filter` is
    /// `[KH, KW, C / groups, F]` with `window.size == [KH, KW]`; grouped, depthwise
    /// (`groups == C`) and dilated convolutions and explicit, asymmetric padding are one op.
    #[track_caller]
    pub fn conv2d_window(&self, filter: &Tensor, window: Window2d) -> Tensor {
        self.in_factor_type(self.record(Op::Conv2d { window }, &[self, filter]))
    }

    /// Max (`PoolKind::Max`) or average pooling over NHWC `self` with a full window (explicit
    /// padding included: a maximum never sees the padding, an average does not count it).
    #[track_caller]
    pub fn pool2d_window(&self, kind: PoolKind, window: Window2d) -> Tensor {
        self.record(Op::Pool2d { kind, window }, &[self])
    }

    /// Max pooling over NHWC `self`: windows of `size` `[height, width]` every `stride`.
    #[track_caller]
    pub fn max_pool2d(&self, size: [usize; 2], stride: [usize; 2], padding: Padding) -> Tensor {
        self.record(Op::Pool2d { kind: PoolKind::Max, window: Window2d::new(size, stride, padding) }, &[self])
    }

    /// Average pooling over NHWC `self`: windows of `size` `[height, width]` every `stride`.
    #[track_caller]
    pub fn avg_pool2d(&self, size: [usize; 2], stride: [usize; 2], padding: Padding) -> Tensor {
        self.record(Op::Pool2d { kind: PoolKind::Avg, window: Window2d::new(size, stride, padding) }, &[self])
    }

    /// Rows of `self` (a `[V, ...]` table) picked by `ids` (integers stored as f32).
    #[track_caller]
    pub fn gather(&self, ids: &Tensor) -> Tensor {
        self.record(Op::Gather, &[self, ids])
    }

    fn axis_error(&self, op: &str, loc: &'static Location<'static>, what: String) -> Tensor {
        self.tracer().fail(
            op,
            loc,
            format!("{what} out of range for rank {}", self.rank()),
            &[self],
            &format!("axes run from {} to {}", -(self.rank() as isize), self.rank() as isize - 1),
        )
    }
}
