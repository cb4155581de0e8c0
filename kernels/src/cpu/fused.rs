//! Fused elementwise groups (`ir::fused`): one pass over the output in chunks of `CHUNK`
//! elements. Per chunk, an operand read with stride 1 is read where it lies, any other is loaded
//! into its slot (a broadcast fill or a strided gather; the output's own memory, in place, a
//! copy where the last instruction reads it), then each instruction is one loop over the chunk
//! from slots to a slot, the last one into the output. The slots are a per-thread buffer, in L1
//! for the programs of a few slots that most are (at most 16 slots and one for a half output, of
//! 512 floats: 34 KiB, zeroed once per thread), so a chain of n ops reads its operands and
//! writes its output once instead of making n - 1 intermediate tensors; each instruction's loop
//! is the scalar function of its op (`math::with_unary` and friends), inlined and vectorised, so
//! the results are bitwise those of the unfused kernels. The chunk evaluation is also compiled
//! for AVX2 and picked at run time, as the unary kernels are (no FMA: the same bits). Programs
//! of the shape most epilogues have (operands added, one unary op, a product by its input: bias
//! and ReLU, bias and SiLU) skip the slots: one loop with the values in registers (`Chain`).
//!
//! Periodic operands: an operand that is the output's trailing axes broadcast along the leading
//! ones (a bias of 32 channels over [64, 32, 32, 32]) would cut the walk into runs of its length,
//! each a chunk of its own: the cnn's bias + ReLU took 2.48 ms over 2M elements, four times the
//! unfused add and ReLU (0.57 ms). Such an operand of fewer than `CHUNK` elements is read instead
//! from its values repeated into a per-thread buffer (at the chunk's phase, stride 1), and the walk
//! runs as if it were not there.
//!
//! In place: the output may be the buffer of an operand of the output's shape. That operand is
//! read at the output's own offsets, copied into its slot before the chunk's output is written, so
//! each element is read before it is overwritten.
//!
//! Half values (a mixed-precision step's, `fused_typed`): an f16 or bf16 operand is widened into
//! its slot as it is loaded (never read where it lies), and an f16 or bf16 output is computed
//! into one more slot and rounded to its type as it is stored (ties to even, as `Op::Cast`):
//! f32 arithmetic inside, half in memory, the bits of the op widened (`kiln_compiler::widen`).
//! A half operand is not periodic (it walks with its strides).

use super::broadcast::{Strided, broadcast_strides};
use super::math::{with_binary, with_scalar, with_unary};
use super::mixed_gemm::Matrix;
use super::par::{SendPtr, par_ranges};
use super::simd::multiversion;
use super::{CpuKernel, shape_text};
use crate::KernelError;
use kiln_compiler::ir::fused::{Dest, Inst, MAX_FUSED_OPERANDS, MAX_FUSED_SLOTS, Registers};
use kiln_compiler::ir::{DType, Fused, FusedMatMul, FusedReduce, Shape};
use std::mem::MaybeUninit;
use std::slice;

/// Output elements per chunk. 512 rather than 256: each instruction's loop runs twice as long
/// per setup of the chunk's operands. Measured (`kiln run --threads 1 --bench 20`, four
/// interleaved rounds, one core of the 2-core AMD EPYC with AVX-512, batch-2 inference
/// exports): EfficientNet-B0 17.3-17.9 -> 16.4-16.6 ms (its SiLU epilogues),
/// MobileNetV3-small 3.53-3.63 -> 3.35-3.45 ms; ResNet-50 and BERT level.
const CHUNK: usize = 512;

thread_local! {
    /// Each thread's slots for `FusedKernel::eval_range`.
    /// `MAX_FUSED_SLOTS` and one for a half output.
    static SLOTS: std::cell::RefCell<Vec<f32>> = std::cell::RefCell::new(vec![0.0; CHUNK * (MAX_FUSED_SLOTS + 1)]);
    /// Each thread's repeated values of the periodic operands (`FusedKernel::period`).
    static PATTERNS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(crate) struct FusedKernel {
    insts: Vec<Inst>,
    /// The program as one pass with its values in registers, where it has that shape (`Chain`).
    chain: Option<Chain>,
    /// Per instruction: for an iota, the stride and length of its axis in the program's shape.
    axes: Vec<(usize, usize)>,
    regs: Registers,
    operands: usize,
    walk: Strided<MAX_FUSED_OPERANDS>,
    inner: [isize; MAX_FUSED_OPERANDS],
    /// Per operand: its element count where it is periodic (the output's trailing axes,
    /// broadcast along the others, fewer than `CHUNK` elements), else 0.
    period: [usize; MAX_FUSED_OPERANDS],
    /// Per operand: its type where it is f16 or bf16 (widened as it is loaded), else `None`.
    half: [Option<DType>; MAX_FUSED_OPERANDS],
    /// The output's type where it is f16 or bf16 (computed into slot `regs.slots`, rounded
    /// as it is stored), else `None`.
    out_half: Option<DType>,
    /// Per operand: whether the last instruction (the one that writes the output) reads its
    /// slot. Only then is an operand that lies in the output's own memory copied into its slot.
    last_reads: [bool; MAX_FUSED_OPERANDS],
    desc: String,
}

/// `d` where it is f16 or bf16.
fn half_type(d: DType) -> Option<DType> {
    d.is_half().then_some(d)
}

/// The element count of `operand` where it is the trailing axes of `out` (contiguous there, 0
/// strides on the leading axes), fewer than `CHUNK` elements and repeated more than once.
fn period(operand: &Shape, out: &Shape) -> usize {
    let (dims, od) = (operand.dims(), out.dims());
    // The operand's leading axes of extent 1 are broadcast; the rest must be the output's.
    let lead = dims.iter().take_while(|&&d| d == 1).count();
    let trailing = &dims[lead..];
    let p: usize = trailing.iter().product();
    let matches = trailing.len() <= od.len() && od[od.len() - trailing.len()..] == *trailing;
    if !matches || p <= 1 || p >= CHUNK || out.numel() <= p { 0 } else { p }
}

/// Whether the last instruction of `regs` reads slot `j`.
fn regs_last_reads(regs: &Registers, j: usize) -> bool {
    regs.reads.last().is_some_and(|r| r.contains(&j))
}

/// The kernel of `program` (without a reduction) over `operands` (checked by `ir::infer`: valid
/// refs, at most `MAX_FUSED_OPERANDS` operands broadcasting to `out`, at most `MAX_FUSED_SLOTS`
/// slots).
pub(crate) fn fused(
    program: &Fused,
    operands: &[&Shape],
    out: &Shape,
) -> Result<Box<dyn CpuKernel>, KernelError> {
    Ok(Box::new(fused_kernel(program, operands, out)?))
}

/// The kernel of `program` (as `fused`) over operands of the given shapes and types (f32, f16
/// or bf16), writing an output of `out`'s shape and type.
pub(crate) fn fused_typed(
    program: &Fused,
    operands: &[(&Shape, DType)],
    out: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let shapes: Vec<&Shape> = operands.iter().map(|&(s, _)| s).collect();
    let half: [Option<DType>; MAX_FUSED_OPERANDS] =
        std::array::from_fn(|j| operands.get(j).and_then(|&(_, d)| half_type(d)));
    Ok(Box::new(kernel_of(program, &shapes, half, (out.0, half_type(out.1)))?))
}

fn fused_kernel(program: &Fused, operands: &[&Shape], out: &Shape) -> Result<FusedKernel, KernelError> {
    kernel_of(program, operands, [None; MAX_FUSED_OPERANDS], (out, None))
}

/// The kernel of `program` over `operands`, those with a `half` type widened as they are
/// loaded, the output rounded to `out.1` where it is a half type.
fn kernel_of(
    program: &Fused,
    operands: &[&Shape],
    half: [Option<DType>; MAX_FUSED_OPERANDS],
    (out, out_half): (&Shape, Option<DType>),
) -> Result<FusedKernel, KernelError> {
    let k = operands.len();
    let regs = program.registers(k);
    // The loops below borrow an instruction's destination slot mutably beside the slots it
    // reads: checked here rather than trusted.
    let disjoint = regs.dest.iter().zip(&regs.reads).all(|(d, r)| match d {
        Dest::Slot(s) => *s < regs.slots && !r.contains(s),
        Dest::Output => true,
    });
    let last_writes_output = regs.dest.iter().rposition(|d| *d == Dest::Output) == Some(regs.dest.len() - 1)
        && regs.dest.iter().filter(|d| **d == Dest::Output).count() == 1;
    if k > MAX_FUSED_OPERANDS
        || regs.slots > MAX_FUSED_SLOTS
        || !disjoint
        || !last_writes_output
        || regs.reads.iter().flatten().any(|&s| s >= regs.slots)
    {
        return Err(KernelError::Shape {
            op: format!("fused[{}]", program.text()),
            message: format!(
                "the program needs {} slots over {k} operands, beyond the CPU kernel's limits",
                regs.slots
            ),
        });
    }
    let zeros = vec![0isize; out.rank()];
    // A half operand walks with its strides: its repeated values are not widened.
    let period: [usize; MAX_FUSED_OPERANDS] =
        std::array::from_fn(|j| operands.get(j).filter(|_| half[j].is_none()).map_or(0, |s| period(s, out)));
    // A periodic operand walks as a scalar would (it does not cut runs); it is read at the
    // chunk's phase of its repeated values, with stride 1.
    let strides: Vec<Vec<isize>> = (0..MAX_FUSED_OPERANDS)
        .map(|j| match operands.get(j) {
            Some(s) if period[j] == 0 => broadcast_strides(s.dims(), out.dims()),
            _ => zeros.clone(),
        })
        .collect();
    let walk = Strided::new(out.dims(), std::array::from_fn(|j| strides[j].as_slice()));
    let mut inner = walk.inner_strides();
    for (i, &p) in inner.iter_mut().zip(&period) {
        if p > 0 {
            *i = 1;
        }
    }
    let shapes: Vec<String> = operands.iter().map(|s| shape_text(s)).collect();
    let desc = format!("fused({} ops) {} <- {}", program.insts.len(), shape_text(out), shapes.join(" "));
    let axes = program
        .insts
        .iter()
        .map(|inst| match *inst {
            // The axis was checked against the program's rank by `ir::infer`.
            Inst::Iota(axis) => {
                let a = (axis as usize).min(out.rank().saturating_sub(1));
                (out.dims()[a + 1..].iter().product(), out.dims().get(a).copied().unwrap_or(1).max(1))
            }
            _ => (1, 1),
        })
        .collect();
    let last_reads = std::array::from_fn(|j| regs_last_reads(&regs, j));
    let all_f32 = out_half.is_none() && half.iter().all(Option::is_none);
    Ok(FusedKernel {
        chain: if all_f32 { Chain::of(&program.insts) } else { None },
        insts: program.insts.clone(),
        axes,
        regs,
        operands: k,
        walk,
        inner,
        period,
        half,
        out_half,
        last_reads,
        desc,
    })
}

/// d[i] = f(sources at i) for one instruction over a chunk whose first element is element
/// `first` of the program's shape; an iota's axis has `axis` = (stride, length) there.
#[inline(always)]
fn eval(inst: &Inst, d: &mut [f32], src: [&[f32]; 3], first: usize, axis: (usize, usize)) {
    let [a, b, c] = src;
    match *inst {
        Inst::Const(value) => d.fill(value),
        Inst::Iota(_) => {
            let (stride, len) = axis;
            for (t, o) in d.iter_mut().enumerate() {
                *o = ((first + t) / stride % len) as f32;
            }
        }
        Inst::Uniform(seed, _) => {
            for (t, (o, &step)) in d.iter_mut().zip(a).enumerate() {
                *o = kiln_compiler::ir::uniform(seed, step, (first + t) as u64);
            }
        }
        Inst::Unary(op, _) => with_unary!(op, |f| {
            for (o, &x) in d.iter_mut().zip(a) {
                *o = f(x);
            }
        }),
        Inst::Scalar(op, value, _) => with_scalar!(op, value, |f| {
            for (o, &x) in d.iter_mut().zip(a) {
                *o = f(x);
            }
        }),
        // GELU's gradient through the unfused kernel's own loop (`gelu_grad_blocks`: the
        // derivative over a block, then the products), so the same bits and the same
        // vectorisation. As one two-input loop it stayed scalar: the transformer's GEMM with
        // this epilogue took 3.78 ms against 2.64 ms for the product and 0.69 ms unfused.
        Inst::Binary(op, _, _) if super::elementwise::is_gelu_grad(op) => {
            let n = d.len().min(a.len()).min(b.len());
            // SAFETY: a and b hold n elements each and d n, a distinct (mutable) slice.
            unsafe { super::elementwise::gelu_grad_blocks(op, a.as_ptr(), b.as_ptr(), d.as_mut_ptr(), n) }
        }
        Inst::Binary(op, _, _) => with_binary!(op, |f| {
            for ((o, &x), &y) in d.iter_mut().zip(a).zip(b) {
                *o = f(x, y);
            }
        }),
        Inst::Select(..) => {
            for (((o, &w), &x), &y) in d.iter_mut().zip(a).zip(b).zip(c) {
                *o = if w != 0.0 { x } else { y };
            }
        }
        Inst::Cast(to, _) => {
            for (o, &x) in d.iter_mut().zip(a) {
                *o = super::cast::round_to(to, x);
            }
        }
    }
}

/// The shape of most epilogues, evaluated in one pass (`Chain::run`): t = a + b1 + b2 (up to two
/// operands added), then y = u(t) for a unary op or a clamped affine map u (`Activation`; or
/// y = t), then t·y where the program multiplies by its activation's input (SiLU:
/// x·sigmoid(x), hardswish: x·hardsigmoid(x)). Bias + ReLU, bias + SiLU, bias + hardswish,
/// bias + GELU, bias + residual + ReLU, a bias alone.
///
/// Why: the interpreter runs each instruction as a loop over the chunk, from slots to a slot,
/// so every instruction stores the chunk once more. In one pass, each vector of elements is
/// loaded once, carried through every op in registers and stored once. Measured (`kiln run
/// --profile`, one core of the AMD EPYC build machine, AVX-512), interpreter -> chain: a bias
/// and a ReLU over 2x96x112x112 floats 0.61-0.64 -> 0.32-0.38 ms, a bias and a SiLU 0.70-0.81
/// -> 0.62-0.63 ms (its sigmoid is most of it), over 2x96x20x20 (in L2) 0.027 -> 0.022 ms;
/// with the clamp (hardswish's six instructions), MobileNetV3-small's forward pass 0.86-0.93 of
/// its time (`kiln run --bench 20`, six rounds, the order alternating). EfficientNet-B0's
/// whole pass moved within the machine's noise (0.97-1.01): its epilogues are SiLUs, whose
/// sigmoid is most of their time in either form. The blocks of 16 first tried as local arrays were vectorised across
/// blocks, with gathers, and ran 5 times slower: the loop is per element over slices, and an
/// operand in the output's memory is read through the output's own slice.
/// The same scalar ops on the same values as the instructions, so the same results (tests
/// below); only a NaN's payload may differ where an add or the product had its operands the
/// other way round (IEEE addition and multiplication are commutative in value).
#[derive(Clone, Copy, Debug)]
struct Chain {
    /// The operand the chain starts from.
    a: usize,
    /// The operands added to it, in order (`n_adds` of them).
    adds: [usize; 2],
    n_adds: usize,
    unary: Option<Activation>,
    /// Whether y is multiplied by t.
    times: bool,
}

/// A chain's activation: a unary op, or min(max(t·scale + shift, lo), hi) (hardsigmoid, the
/// factor of hardswish), four scalar instructions in that order, computed as they compute it.
#[derive(Clone, Copy, Debug)]
enum Activation {
    Unary(kiln_compiler::ir::UnaryOp),
    Clamp { scale: f32, shift: f32, lo: f32, hi: f32 },
}

impl Activation {
    /// The clamp that instructions `start..start + 4` compute from t, each reading the one
    /// before.
    fn clamp_at(insts: &[Inst], start: usize, t: kiln_compiler::ir::fused::Ref) -> Option<Activation> {
        use kiln_compiler::ir::ScalarOp::{Add, Max, Min, Mul};
        use kiln_compiler::ir::fused::Ref;
        let step = |k: usize, op, from: Ref| match insts.get(start + k) {
            Some(&Inst::Scalar(o, c, r)) if o == op && r == from => Some(c),
            _ => None,
        };
        let value = |k: usize| Ref::Value((start + k) as u32);
        Some(Activation::Clamp {
            scale: step(0, Mul, t)?,
            shift: step(1, Add, value(0))?,
            lo: step(2, Max, value(1))?,
            hi: step(3, Min, value(2))?,
        })
    }
}

impl Chain {
    /// The chain `insts` compute, if they have its shape: operands only where the chain reads
    /// them, each value read only by the next instruction (and t by the product).
    fn of(insts: &[Inst]) -> Option<Chain> {
        use kiln_compiler::ir::BinaryOp;
        use kiln_compiler::ir::fused::Ref;
        let operand = |r: Ref| match r {
            Ref::Operand(j) => Some(j as usize),
            Ref::Value(_) => None,
        };
        let mut it = insts.iter().enumerate().peekable();
        // The first add reads two operands; a later one the previous value and an operand.
        let mut prev: Option<Ref> = None;
        let mut a = None;
        let (mut adds, mut n_adds) = ([0; 2], 0);
        while let Some(&(i, &Inst::Binary(BinaryOp::Add, x, y))) = it.peek() {
            if n_adds == 2 {
                return None;
            }
            adds[n_adds] = match prev {
                None => {
                    a = Some(operand(x)?);
                    operand(y)?
                }
                Some(p) if x == p => operand(y)?,
                Some(p) if y == p => operand(x)?,
                Some(_) => return None,
            };
            n_adds += 1;
            prev = Some(Ref::Value(i as u32));
            it.next();
        }
        let t = match prev {
            Some(p) => p,
            None => match it.peek() {
                Some((_, Inst::Unary(_, r) | Inst::Scalar(_, _, r))) => {
                    a = Some(operand(*r)?);
                    *r
                }
                _ => return None,
            },
        };
        let mut unary = None;
        let mut y = t;
        if let Some(&(i, &Inst::Unary(u, r))) = it.peek() {
            if r != t {
                return None;
            }
            unary = Some(Activation::Unary(u));
            y = Ref::Value(i as u32);
            it.next();
        } else if let Some(clamp) = it.peek().and_then(|&(i, _)| Activation::clamp_at(insts, i, t)) {
            let first = it.peek().map_or(0, |&(i, _)| i);
            unary = Some(clamp);
            y = Ref::Value((first + 3) as u32);
            for _ in 0..4 {
                it.next();
            }
        }
        let mut times = false;
        if let Some(&(_, &Inst::Binary(BinaryOp::Mul, l, r))) = it.peek() {
            if unary.is_none() || !((l == t && r == y) || (l == y && r == t)) {
                return None;
            }
            times = true;
            it.next();
        }
        let useful = unary.is_some() || n_adds > 0;
        (it.next().is_none() && useful).then_some(Chain { a: a?, adds, n_adds, unary, times })
    }

    /// The chain over m elements, operand j read at `at[j]` (stride 1), into `out`.
    ///
    /// # Safety
    /// `at[j]` is valid for m reads for every operand the chain reads, `out` for m writes; `out`
    /// may be operand a's memory (read at the same offsets), and no added operand's.
    #[inline(always)]
    unsafe fn eval(&self, at: &[*const f32; MAX_FUSED_SLOTS], out: *mut f32, m: usize) {
        // SAFETY (each arm): forwarded contract.
        macro_rules! go {
            ($f:expr) => {
                match (self.n_adds, self.times) {
                    (0, false) => unsafe { self.run::<0, false>(at, out, m, $f) },
                    (0, true) => unsafe { self.run::<0, true>(at, out, m, $f) },
                    (1, false) => unsafe { self.run::<1, false>(at, out, m, $f) },
                    (1, true) => unsafe { self.run::<1, true>(at, out, m, $f) },
                    (_, false) => unsafe { self.run::<2, false>(at, out, m, $f) },
                    (_, true) => unsafe { self.run::<2, true>(at, out, m, $f) },
                }
            };
        }
        match self.unary {
            None => go!(|t: f32| t),
            Some(Activation::Unary(u)) => with_unary!(u, |f| go!(f)),
            Some(Activation::Clamp { scale, shift, lo, hi }) => {
                go!(move |t: f32| super::math::min_nan(super::math::max_nan(t * scale + shift, lo), hi))
            }
        }
    }

    /// `eval` with `ADDS` operands added and the product or not, one loop over the elements
    /// (which the compiler vectorises as the interpreter's); operand a read through `out`
    /// itself where it is `out`'s memory.
    ///
    /// # Safety
    /// As `eval`, and no added operand is `out`'s memory.
    #[inline(always)]
    unsafe fn run<const ADDS: usize, const TIMES: bool>(
        &self,
        at: &[*const f32; MAX_FUSED_SLOTS],
        out: *mut f32,
        m: usize,
        f: impl Fn(f32) -> f32 + Copy,
    ) {
        // SAFETY: the contract: m valid floats at each, the added operands disjoint from `out`.
        let b: [&[f32]; ADDS] =
            std::array::from_fn(|i| unsafe { slice::from_raw_parts(at[self.adds[i]], m) });
        let o = unsafe { slice::from_raw_parts_mut(out, m) };
        let element = |mut t: f32, i: usize| {
            for p in &b {
                t += p[i];
            }
            let y = f(t);
            if TIMES { y * t } else { y }
        };
        if std::ptr::eq(at[self.a], out) {
            for (i, o) in o.iter_mut().enumerate() {
                *o = element(*o, i);
            }
        } else {
            // SAFETY: the contract; a is not `out`'s memory, so disjoint from it.
            let a = unsafe { slice::from_raw_parts(at[self.a], m) };
            for (i, (o, &a)) in o.iter_mut().zip(a).enumerate() {
                *o = element(a, i);
            }
        }
    }
}

impl FusedKernel {
    /// One chunk of `m` output elements at `out`, operand j read from `ins[j]` with stride
    /// `inner[j]`; slot s is `slots[s * stride..][..m]`. An operand read with stride 1 that is not
    /// the output's own memory is read where it lies; the others are copied (a broadcast filled, a
    /// strided one gathered) into their slots first.
    ///
    /// A half operand (`half`) is widened into its slot whatever its stride; with a half output,
    /// the last instruction writes slot `regs.slots`, rounded into `out` at the end.
    ///
    /// # Safety
    /// `ins[j]` is valid for the `m` elements (of its type) read with its stride and `out` for `m`
    /// writes (of the output's type); an operand overlapping `out` is read with stride 1 at `out`
    /// itself; `m <= stride` and `slots` holds `self.slot_count() * stride` elements.
    #[inline(always)]
    unsafe fn chunk(
        &self,
        slots: &mut [f32],
        stride: usize,
        ins: &[*const f32; MAX_FUSED_OPERANDS],
        out: *mut f32,
        m: usize,
        first: usize,
    ) {
        let base = slots.as_mut_ptr();
        // Where each slot's values are read from: its own memory, or an operand's.
        // SAFETY (of every `add` below): slot indices are below `regs.slots` (checked in `fused`),
        // whose slots of `stride >= m` elements `slots` holds.
        let mut at: [*const f32; MAX_FUSED_SLOTS] = std::array::from_fn(|s| {
            if s < self.regs.slots { unsafe { base.add(s * stride) as *const f32 } } else { base }
        });
        for j in 0..self.operands {
            // SAFETY: per the contract; the slot is the kernel's own memory, disjoint from every
            // operand.
            unsafe {
                let slot = slice::from_raw_parts_mut(base.add(j * stride), m);
                if let Some(t) = self.half[j] {
                    let (src, s) = (ins[j] as *const u16, self.inner[j]);
                    let widen = |bits: u16| super::cast::widen_half(t, bits);
                    match s {
                        0 => slot.fill(widen(*src)),
                        1 => super::cast::widen_slice(t, slice::from_raw_parts(src, m), slot),
                        _ => slot
                            .iter_mut()
                            .enumerate()
                            .for_each(|(i, v)| *v = widen(*src.offset(i as isize * s))),
                    }
                    continue;
                }
                match self.inner[j] {
                    // The output's own memory is read where it lies by every instruction but
                    // the last, which writes it: read by the last, it is copied first, as the
                    // last instruction must not read it through a second, shared borrow. (An
                    // epilogue's operand 0 is the output; copying it every chunk took 19% of a
                    // bias-and-SiLU epilogue, perf.)
                    1 if !std::ptr::eq(ins[j], out) || !self.last_reads[j] => at[j] = ins[j],
                    1 => std::ptr::copy_nonoverlapping(ins[j], slot.as_mut_ptr(), m),
                    0 => slot.fill(*ins[j]),
                    s => slot.iter_mut().enumerate().for_each(|(i, v)| *v = *ins[j].offset(i as isize * s)),
                }
            }
        }
        if let Some(chain) =
            self.chain.filter(|c| c.adds[..c.n_adds].iter().all(|&j| !std::ptr::eq(at[j], out)))
        {
            // SAFETY: every operand the chain reads points at m valid floats (where it lies, or
            // its slot); `out` is valid for m writes, no added operand lies in it, and operand a
            // lies in it only where `Chain::run` reads it through `out`.
            return unsafe { chain.eval(&at, out, m) };
        }
        for (j, inst) in self.insts.iter().enumerate() {
            let reads = &self.regs.reads[j];
            // SAFETY: a read slot points at slot memory of `m` valid elements, or at an operand
            // valid for `m` elements (stride 1) that is not `out`. No instruction writes a slot
            // it reads (checked in `fused`), and a slot written is slot memory, never an
            // operand, so the shared borrows of what is read and the mutable borrow of the
            // destination never overlap. The output is written only by the last instruction,
            // which reads no operand where it lies in `out`, and `out` is valid for `m` writes.
            unsafe {
                let src = |i: usize| -> &[f32] {
                    match reads.get(i) {
                        Some(&s) => slice::from_raw_parts(at[s], m),
                        None => &[],
                    }
                };
                let srcs = [src(0), src(1), src(2)];
                let d: &mut [f32] = match self.regs.dest[j] {
                    Dest::Slot(s) => {
                        at[s] = base.add(s * stride);
                        slice::from_raw_parts_mut(base.add(s * stride), m)
                    }
                    Dest::Output if self.out_half.is_some() => {
                        slice::from_raw_parts_mut(base.add(self.regs.slots * stride), m)
                    }
                    Dest::Output => slice::from_raw_parts_mut(out, m),
                };
                eval(inst, d, srcs, first, self.axes[j]);
            }
        }
        if let Some(t) = self.out_half {
            // SAFETY: slot `regs.slots` holds the m values (the last instruction wrote it) and
            // `out` is valid for m elements of the half type.
            unsafe {
                let values = slice::from_raw_parts(base.add(self.regs.slots * stride), m);
                super::cast::narrow_slice(t, values, slice::from_raw_parts_mut(out as *mut u16, m));
            }
        }
    }

    /// The slots a chunk needs: the program's, and one for a half output.
    fn slot_count(&self) -> usize {
        self.regs.slots + usize::from(self.out_half.is_some())
    }

    /// The address of output element `i` from `base`, the output's element 0 (the output's
    /// type's size: 2 bytes for a half output).
    ///
    /// # Safety
    /// Element `i` lies inside (or one past) the output.
    #[inline(always)]
    unsafe fn out_at(&self, base: *mut f32, i: usize) -> *mut f32 {
        // SAFETY: the contract.
        unsafe {
            match self.out_half {
                Some(_) => (base as *mut u16).add(i) as *mut f32,
                None => base.add(i),
            }
        }
    }
}

multiversion! {
    /// `FusedKernel::chunk` on the widest vectors the CPU has (`simd`).
    unsafe fn chunk_dispatch / chunk_at(
        kernel: &FusedKernel,
        slots: &mut [f32],
        stride: usize,
        ins: &[*const f32; MAX_FUSED_OPERANDS],
        out: *mut f32,
        m: usize,
        first: usize,
    ) => FusedKernel::chunk;
}

impl FusedKernel {
    /// The program's values at positions `s..e` of its shape, written to `out[..e - s]`.
    ///
    /// # Safety
    /// `ins[j]` points at operand j (for j < operands), holding its shape's elements; `out` is
    /// valid for `e - s` writes and overlaps an operand only where that operand has the program's
    /// shape and `out` is its element `s` (in place).
    unsafe fn eval_range(&self, ins: &[SendPtr<f32>; MAX_FUSED_OPERANDS], s: usize, e: usize, out: *mut f32) {
        let stride = CHUNK.min(e - s);
        let len = self.slot_count() * stride;
        // The slots live in a per-thread buffer, zeroed once when the thread first needs it: a
        // reduction's prologue calls this once per row, and zeroing the slots every time cost
        // ~1% of the transformer's step (perf). A nested call on the same thread (none today)
        // gets a fresh buffer.
        let slots = |ins: &[SendPtr<f32>; MAX_FUSED_OPERANDS]| {
            SLOTS.with(|cell| match cell.try_borrow_mut() {
                // SAFETY: forwarded contract; `len <= (MAX_FUSED_SLOTS + 1) * CHUNK` (slots checked in
                // `fused`, stride <= CHUNK), the length of every slot buffer.
                Ok(mut slots) => unsafe { self.eval_in(&mut slots[..len], stride, ins, s, e, out) },
                Err(_) => unsafe { self.eval_in(&mut vec![0.0; len], stride, ins, s, e, out) },
            })
        };
        // A range within one period of every periodic operand (a reduction's prologue asks for
        // a row, or an element, at a time) reads each where it lies: phase + m <= p.
        if (0..self.operands).all(|j| self.period[j] == 0 || s % self.period[j] + (e - s) <= self.period[j]) {
            return slots(ins);
        }
        // Each periodic operand's values repeated over `p + stride` elements: a chunk of at most
        // `stride` elements at phase < p reads them with stride 1.
        let fill = |patterns: &mut Vec<f32>| {
            patterns.clear();
            let mut ins = *ins;
            let mut starts = [0usize; MAX_FUSED_OPERANDS];
            for j in 0..self.operands {
                let p = self.period[j];
                if p == 0 {
                    continue;
                }
                starts[j] = patterns.len();
                // SAFETY: operand j holds its shape's p elements (the contract).
                let values = unsafe { slice::from_raw_parts(ins[j].get() as *const f32, p) };
                // Whole copies of the values, then the first ones again: a remainder per
                // element took a division each, 10% of MobileNetV3-small's two-thread pass,
                // whose small epilogue blocks each refill the pattern (perf).
                let len = p + stride;
                while patterns.len() - starts[j] + p <= len {
                    patterns.extend_from_slice(values);
                }
                let rest = len - (patterns.len() - starts[j]);
                patterns.extend_from_slice(&values[..rest]);
            }
            for j in 0..self.operands {
                if self.period[j] > 0 {
                    // The buffer is complete: its addresses no longer move.
                    ins[j] = SendPtr::new(patterns[starts[j]..].as_ptr() as *mut f32);
                }
            }
            ins
        };
        PATTERNS.with(|cell| match cell.try_borrow_mut() {
            Ok(mut patterns) => slots(&fill(&mut patterns)),
            Err(_) => slots(&fill(&mut Vec::new())),
        })
    }

    /// `eval_range` with `slots` of `stride` elements each.
    ///
    /// # Safety
    /// As `eval_range`; `slots` holds `self.regs.slots * stride` elements, `stride >= min(CHUNK,
    /// e - s)`.
    unsafe fn eval_in(
        &self,
        slots: &mut [f32],
        stride: usize,
        ins: &[SendPtr<f32>; MAX_FUSED_OPERANDS],
        s: usize,
        e: usize,
        out: *mut f32,
    ) {
        self.walk.for_each_run(s, e, &mut |oo, offs, n| {
            let mut done = 0;
            while done < n {
                let m = (n - done).min(stride);
                let at: [*const f32; MAX_FUSED_OPERANDS] = std::array::from_fn(|j| {
                    if j < self.operands && self.period[j] > 0 {
                        // SAFETY: `ins[j]` is the operand's repeated values, `p + stride`
                        // elements (`eval_range`): the phase is below p and m <= stride; or the
                        // operand itself where the whole range lies within one period.
                        unsafe { ins[j].get().add((oo + done) % self.period[j]) as *const f32 }
                    } else if j < self.operands {
                        // SAFETY: the walk stays inside every operand (strides from their
                        // shapes, in elements of the operand's type); `done` elements of this
                        // run were consumed already.
                        unsafe {
                            let at = offs[j] + done as isize * self.inner[j];
                            match self.half[j] {
                                Some(_) => (ins[j].get() as *const u16).offset(at) as *const f32,
                                None => ins[j].get().offset(at) as *const f32,
                            }
                        }
                    } else {
                        std::ptr::null()
                    }
                });
                // SAFETY: the contract above; position oo + done is out's element oo + done - s.
                unsafe {
                    let out = self.out_at(out, oo + done - s);
                    chunk_dispatch(self, slots, stride, &at, out, m, oo + done);
                }
                done += m;
            }
        });
    }
}

fn operand_ptrs(inputs: &[*mut u8]) -> [SendPtr<f32>; MAX_FUSED_OPERANDS] {
    std::array::from_fn(|j| SendPtr::new(inputs.get(j).map_or(std::ptr::null_mut(), |&p| p as *mut f32)))
}

impl CpuKernel for FusedKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let ins = operand_ptrs(inputs);
        let o = SendPtr::new(output as *mut f32);
        par_ranges(self.walk.numel(), self.insts.len(), |s, e| {
            // SAFETY: run's contract: operands hold their shapes' elements and the output its
            // own; an operand that is the output has the output's shape (the plan is
            // validated), so it is read with stride 1 at the output's offsets; threads write
            // disjoint output ranges.
            unsafe { self.eval_range(&ins, s, e, self.out_at(o.get(), s)) }
        });
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

/// A reduction whose input is a fused program's values (`Fused::reduce`): the reduction kernel
/// (`reduce`) with the program as its source, evaluated a chunk at a time into a stack buffer
/// just before the chunk is summed. The chunks and their order are the reduction's own, so the
/// result is bitwise the unfused program followed by the unfused reduction.
pub(crate) struct FusedReduceKernel {
    program: FusedKernel,
    reduce: super::reduce::Reduce,
    /// The epilogue over the output (`Fused::epilogue`), and where its operands start.
    epilogue: Option<(FusedKernel, usize)>,
    /// With an f16 or bf16 output: its type and the reduction's f32 values (the output's
    /// element count, the kernel's own buffer), which the epilogue reads, or which are rounded
    /// into the output where there is none.
    wide_out: Option<(DType, usize)>,
    desc: String,
}

/// The program's values as a reduction's input.
struct Prologue<'a> {
    program: &'a FusedKernel,
    ins: [SendPtr<f32>; MAX_FUSED_OPERANDS],
}

impl super::reduce::Source for Prologue<'_> {
    #[inline]
    fn with<T>(&self, off: usize, len: usize, f: impl FnOnce(&[f32]) -> T) -> T {
        let mut buf = [MaybeUninit::<f32>::uninit(); super::reduce::SOURCE_MAX];
        let len = len.min(super::reduce::SOURCE_MAX);
        let p = buf.as_mut_ptr() as *mut f32;
        // SAFETY: the reduction asks for at most SOURCE_MAX elements inside the program's shape
        // (offsets from that shape), and `Prologue` is made from `run`'s operand pointers; the
        // buffer is stack memory disjoint from every operand, fully written by `eval_range`
        // before the slice over it is made.
        unsafe {
            self.program.eval_range(&self.ins, off, off + len, p);
            f(slice::from_raw_parts(p, len))
        }
    }
}

/// The kernel of a fused reduction over `operands` of the given types (f32, f16 or bf16: the
/// program widens half operands as it loads them), writing an output of `out`'s shape and type
/// (a half one through the reduction's f32 values, `FusedReduceKernel::wide_out`).
pub(crate) fn fused_reduce(
    program: &Fused,
    reduce: &FusedReduce,
    typed: &[(&Shape, DType)],
    (out, out_type): (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let operands: Vec<&Shape> = typed.iter().map(|&(s, _)| s).collect();
    let half_of = |ds: &[(&Shape, DType)]| -> [Option<DType>; MAX_FUSED_OPERANDS] {
        std::array::from_fn(|j| ds.get(j).and_then(|&(_, d)| half_type(d)))
    };
    let shape = program.shape.clone();
    let split = operands.len() - program.epilogue_operands;
    let elementwise = Fused { reduce: None, epilogue: Vec::new(), epilogue_operands: 0, ..program.clone() };
    let before = kernel_of(&elementwise, &operands[..split], half_of(&typed[..split]), (&shape, None))?;
    let name = reduce.op().name();
    let mut desc = format!("{name}{:?} of {}", reduce.axes, before.desc);
    let epilogue = if program.epilogue.is_empty() {
        None
    } else {
        let mut shapes: Vec<&Shape> = vec![out];
        shapes.extend_from_slice(&operands[split..]);
        // Operand 0 is the reduced values, f32; the others are the op's last operands.
        let mut types = vec![(out, DType::F32)];
        types.extend_from_slice(&typed[split..]);
        let after =
            kernel_of(&program.epilogue_program(out), &shapes, half_of(&types), (out, half_type(out_type)))?;
        desc = format!("{desc} then {}", after.desc);
        Some((after, split))
    };
    let wide_out = half_type(out_type).map(|t| (t, out.numel()));
    Ok(Box::new(FusedReduceKernel {
        program: before,
        reduce: super::reduce::prepare(reduce.op, name, &shape, &reduce.axes),
        epilogue,
        wide_out,
        desc,
    }))
}

impl CpuKernel for FusedReduceKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let split = self.epilogue.as_ref().map_or(inputs.len(), |e| e.1);
        let source = Prologue { program: &self.program, ins: operand_ptrs(&inputs[..split]) };
        // SAFETY: run's contract: the operands hold their shapes' elements, the output the
        // reduction's; the reduction reads its source only inside the program's shape. The
        // epilogue then reads the output as its operand 0, of the output's shape, in place (the
        // elementwise contract), and the op's last operands beside it.
        // With a half output the reduction writes the kernel's f32 buffer (the output's
        // element count), which the epilogue reads or which is rounded into the output.
        super::buffers::with(|b| {
            let wide = self.wide_out.map(|(t, len)| {
                b.sums.resize(len, 0.0);
                (t, &mut b.sums)
            });
            // SAFETY: as stated above; the sums are the thread's (`buffers`).
            unsafe { self.run_into(&source, inputs, output, split, wide) }
        })
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

impl FusedReduceKernel {
    /// The reduction into the output, or into `wide` (a half output's f32 values), then the
    /// epilogue or the rounding.
    ///
    /// # Safety
    /// As `run`; `wide` holds the output's element count.
    unsafe fn run_into(
        &self,
        source: &Prologue,
        inputs: &[*mut u8],
        output: *mut u8,
        split: usize,
        wide: Option<(DType, &mut Vec<f32>)>,
    ) {
        let reduced = match &wide {
            Some((_, buf)) => buf.as_ptr() as *mut u8,
            None => output,
        };
        unsafe {
            self.reduce.run_from(source, reduced as *mut f32);
            if let Some((after, _)) = &self.epilogue {
                let mut ins = [std::ptr::null_mut(); MAX_FUSED_OPERANDS];
                let extra = (inputs.len() - split).min(MAX_FUSED_OPERANDS - 1);
                ins[0] = reduced;
                ins[1..=extra].copy_from_slice(&inputs[split..split + extra]);
                after.run(&ins[..=extra], output);
            } else if let Some((t, buf)) = &wide {
                super::cast::narrow_slice(*t, buf, slice::from_raw_parts_mut(output as *mut u16, buf.len()));
            }
        }
    }
}

/// A matrix product with an elementwise epilogue (`Fused::matmul`): the product is written to
/// the output by the matmul kernel, then the program runs over the output in place, reading it as
/// its operand 0 (the product) and the op's other operands beside it. Each element goes through
/// the same arithmetic as unfused, so the bits are the unfused ones.
pub(crate) struct FusedMatMulKernel {
    product: Box<dyn CpuKernel>,
    epilogue: FusedKernel,
    /// The path for a run that writes over an epilogue operand (`Op::may_write_over`), or
    /// that reads or writes half values.
    rows: RowBlocks,
    /// Whether an operand or the output is f16 or bf16 (every run takes `rows`).
    half: bool,
    desc: String,
}

/// Output elements in a row block's tile: 2 MiB, the thread's shared tile (`buffers`), outside
/// the arena like the GEMM's packing buffers. Each block's GEMM packs the right factor again, and the gemm crate runs
/// blocks of few rows far below its peak: with 256 KiB tiles (85-row blocks), ViT-B/16's MLP
/// down-projection written over its residual (394 x 3072 x 768) took 28 ms on one AVX-512 core,
/// with the whole product in one block 12 ms. 2 MiB holds the whole product of a transformer
/// layer at inference batch sizes, and blocks of 170 rows or more at any width up to 3,072.
const PRODUCT_TILE_FLOATS: usize = 1 << 19;

/// A fused product that writes over an operand of its epilogue, at any rank and with either
/// factor transposed. The output is seen as R rows of n (R the product of its leading axes) and
/// made in blocks of rows and columns: each block's product into the tile, then the epilogue
/// from the tile and the block's elements of every operand into the block's elements of the
/// output. Every element of a written-over operand that a block reads is one the block then
/// writes, and no later block reads it. A block's product is the same GEMM on fewer rows and
/// columns: its sums run over k in the same order (`Gemm::run`), and `tests/fusion.rs` holds the
/// fused plans bitwise to the unfused ones.
///
/// Blocks are whole rows where a tile holds at least 16 of them (the epilogue then runs once
/// per block); wider outputs (GPT-2's logits, n = 50,257) take 256 rows of 2,048 columns, the
/// epilogue a row at a time, so that a block's GEMM still reuses its packed panels (a block of
/// one row of 524,288 columns would stream the whole second factor once per output row).
struct RowBlocks {
    /// The product of a whole block (`gemm.m` rows of `gemm.n` columns) and, per output matrix
    /// of the batch, the element offsets of its factors (`matmul::layout`; a batch folded into
    /// the rows is one matrix of `rows` rows).
    gemm: super::matmul::Gemm,
    batches: Vec<(usize, usize)>,
    /// Rows of one output matrix and the output's columns.
    rows: usize,
    n: usize,
    parallel: bool,
    /// Whether every operand is read a whole block at a time (blocks of whole rows, each
    /// operand one row per output row or the same row for all); otherwise a row at a time.
    whole_rows: bool,
    /// Epilogue kernels by (rows, columns) of what they run over.
    kernels: Vec<((usize, usize), FusedKernel)>,
    /// The types of the op's operands (factors first) and of its output: f32, f16 or bf16
    /// (half factors are widened in panels, `Gemm::run_mixed`; the epilogue widens and rounds
    /// the others).
    types: Vec<DType>,
    out_type: DType,
    /// Per epilogue operand (after the factors): how an output row finds its elements.
    reads: Vec<RowRead>,
}

/// Where an epilogue operand's elements for output row `r` start: the row's index along the
/// output's leading axes dotted with the operand's broadcast strides, times `cols`, the
/// operand's last axis (the output's n, or 1 where it broadcasts along the row).
struct RowRead {
    lead: Vec<usize>,
    strides: Vec<usize>,
    cols: usize,
}

impl RowRead {
    fn new(operand: &Shape, out: &Shape) -> Self {
        let (od, d) = (out.dims(), operand.dims());
        let lead_out = &od[..od.len() - 1];
        let (lead, cols) = match d.split_last() {
            Some((&c, lead)) => (lead, c),
            None => (&[][..], 1),
        };
        let strides =
            super::broadcast::broadcast_strides(lead, lead_out).iter().map(|&s| s as usize).collect();
        RowRead { lead: lead_out.to_vec(), strides, cols }
    }

    /// The element offset of output row `r`'s elements.
    fn offset(&self, mut r: usize) -> usize {
        let mut at = 0;
        for (&dim, &stride) in self.lead.iter().zip(&self.strides).rev() {
            at += (r % dim) * stride;
            r /= dim;
        }
        at * self.cols
    }

    /// Row r's elements start at r * cols: one row of the operand per output row.
    fn per_row(&self) -> bool {
        let mut running = 1;
        self.lead.iter().zip(&self.strides).rev().all(|(&dim, &stride)| {
            let ok = dim == 1 || stride == running;
            running *= dim;
            ok
        })
    }

    /// Every output row reads the same elements.
    fn shared(&self) -> bool {
        self.strides.iter().all(|&s| s == 0)
    }
}

impl RowBlocks {
    /// The blocks of `program`'s product over `operands` of `types` (factors first), writing
    /// an output of `out_type`.
    fn new(
        program: &Fused,
        matmul: &FusedMatMul,
        operands: &[&Shape],
        types: &[DType],
        out_type: DType,
    ) -> Result<Self, KernelError> {
        let shape = &program.shape;
        let (gemm, batches) =
            super::matmul::layout(operands[0], operands[1], matmul.transpose_a, matmul.transpose_b, shape);
        let (rows, n) = (gemm.m, gemm.n);
        // Each block packs (and, for half factors, widens: `Gemm::run_mixed`) the right factor
        // again, so blocks are as large as the tile allows (the zoo mlp's bf16 step: 64-row
        // blocks took 3.5x the widened plan's products).
        let tile = PRODUCT_TILE_FLOATS;
        let block_rows = if n <= tile / 16 { tile / n.max(1) } else { 256 };
        let block_rows = block_rows.clamp(1, rows.max(1));
        let block_cols = (tile / block_rows).clamp(1, n.max(1));
        let reads: Vec<RowRead> = operands[2..].iter().map(|s| RowRead::new(s, shape)).collect();
        let whole_rows = block_cols == n && reads.iter().all(|r| r.per_row() || r.shared());
        let sizes: Vec<(usize, usize)> = if whole_rows {
            [block_rows, rows % block_rows].iter().filter(|&&r| r > 0).map(|&r| (r, n)).collect()
        } else {
            [block_cols, n % block_cols].iter().filter(|&&c| c > 0).map(|&c| (1, c)).collect()
        };
        let kernels = sizes
            .into_iter()
            .map(|(r, c)| {
                let out = Shape::from([r, c].as_slice());
                let shapes: Vec<Shape> = reads
                    .iter()
                    .map(|read| {
                        let cols = if read.cols == n { c } else { read.cols };
                        let r = if whole_rows && !read.shared() { r } else { 1 };
                        Shape::from([r, cols].as_slice())
                    })
                    .collect();
                let mut all: Vec<&Shape> = vec![&out];
                all.extend(shapes.iter());
                let program = Fused { matmul: None, shape: out.clone(), ..program.clone() };
                // Operand 0 is the f32 tile; the others are the op's operands after the factors.
                let half = std::array::from_fn(|j| {
                    j.checked_sub(1).and_then(|i| types.get(2 + i)).and_then(|&d| half_type(d))
                });
                Ok(((r, c), kernel_of(&program, &all, half, (&out, half_type(out_type)))?))
            })
            .collect::<Result<_, KernelError>>()?;
        Ok(RowBlocks {
            gemm: super::matmul::Gemm { m: block_rows, n: block_cols, out_rs: block_cols as isize, ..gemm },
            batches,
            rows,
            n,
            parallel: block_rows * block_cols * gemm.k >= super::matmul::SERIAL_MACS,
            whole_rows,
            kernels,
            types: types.to_vec(),
            out_type,
            reads,
        })
    }

    fn kernel(&self, rows: usize, cols: usize) -> &FusedKernel {
        let found = self.kernels.iter().find(|(size, _)| *size == (rows, cols));
        &found.expect("a kernel for every block size `new` makes").1
    }

    /// # Safety
    /// `inputs` are the op's operands (factors first), valid for their shapes; `output` is valid
    /// for the output's floats and overlaps no factor (`Op::may_write_over` never allows it).
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: forwarded contract; the tile is the thread's (`buffers`).
        super::buffers::with(|b| unsafe { self.run_in(inputs, output, &mut b.tile) })
    }

    /// `run` with `tile` for the blocks' products.
    ///
    /// # Safety
    /// As `run`.
    unsafe fn run_in(&self, inputs: &[*mut u8], output: *mut u8, tile: &mut Vec<f32>) {
        let (block_rows, block_cols, n) = (self.gemm.m, self.gemm.n, self.n);
        tile.resize(block_rows * block_cols, 0.0);
        let (a, b) = (Matrix::new(inputs[0], self.types[0]), Matrix::new(inputs[1], self.types[1]));
        // Element `i` of epilogue operand j and of the output, in bytes of their types (a
        // pointer arithmetic the SAFETY notes below vouch for).
        let operand = |j: usize, i: usize| inputs[2 + j].wrapping_add(i * self.types[2 + j].size_bytes());
        let out = |i: usize| output.wrapping_add(i * self.out_type.size_bytes());
        let mut ins = [std::ptr::null_mut(); MAX_FUSED_OPERANDS];
        let extra = self.reads.len();
        for (matrix, &(a_at, b_at)) in self.batches.iter().enumerate() {
            let mut r0 = 0;
            while r0 < self.rows {
                let rows = block_rows.min(self.rows - r0);
                let mut c0 = 0;
                while c0 < n {
                    let cols = block_cols.min(n - c0);
                    let gemm = super::matmul::Gemm { m: rows, n: cols, out_rs: cols as isize, ..self.gemm };
                    // SAFETY: `layout` gave the matrix's factor offsets for these shapes; rows
                    // r0.. of A and columns c0.. of B lie inside them (r0 + rows <= m, c0 +
                    // cols <= n); the tile holds rows x cols floats and is the kernel's own.
                    unsafe {
                        let a = a.at(a_at as isize + r0 as isize * self.gemm.a.0);
                        let b = b.at(b_at as isize + c0 as isize * self.gemm.b.1);
                        gemm.run_mixed(a, b, Matrix::F32(tile.as_mut_ptr()), false, self.parallel);
                    }
                    let first = matrix * self.rows + r0;
                    // SAFETY (both branches): each operand pointer is its elements for the
                    // block's output rows (`RowRead::offset`) and columns c0.. where it has n
                    // of them; the epilogue reads them and the tile, then writes the same
                    // output elements, each element read before it is written (the elementwise
                    // contract). A written-over operand has the output's shape, so it reads
                    // exactly the elements the block writes, which no later block reads.
                    if self.whole_rows {
                        ins[0] = tile.as_mut_ptr() as *mut u8;
                        for (j, read) in self.reads.iter().enumerate() {
                            ins[1 + j] = operand(j, read.offset(first));
                        }
                        let kernel = self.kernel(rows, n);
                        unsafe { kernel.run(&ins[..=extra], out(first * n)) };
                    } else {
                        let kernel = self.kernel(1, cols);
                        for i in 0..rows {
                            let row = first + i;
                            ins[0] = unsafe { tile.as_mut_ptr().add(i * cols) } as *mut u8;
                            for (j, read) in self.reads.iter().enumerate() {
                                let at = read.offset(row) + if read.cols == n { c0 } else { 0 };
                                ins[1 + j] = operand(j, at);
                            }
                            unsafe { kernel.run(&ins[..=extra], out(row * n + c0)) };
                        }
                    }
                    c0 += cols;
                }
                r0 += rows;
            }
        }
    }
}

/// The elementwise kernel of a product's epilogue: over the program's shape, its operand 0 the
/// product (the output's own memory), then the op's operands after the two factors.
fn epilogue_kernel(program: &Fused, operands: &[&Shape]) -> Result<FusedKernel, KernelError> {
    let shape = &program.shape;
    let mut epilogue_operands: Vec<&Shape> = vec![shape];
    epilogue_operands.extend_from_slice(&operands[2..]);
    fused_kernel(&Fused { matmul: None, conv: None, ..program.clone() }, &epilogue_operands, shape)
}

/// The kernel of a fused product over `operands` (factors first) of the given types (f32, f16
/// or bf16), writing an output of `output`'s shape and type.
pub(crate) fn fused_matmul(
    program: &Fused,
    matmul: &FusedMatMul,
    operands: &[(&Shape, DType)],
    output: (&Shape, DType),
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let shape = &program.shape;
    let (shapes, types): (Vec<&Shape>, Vec<DType>) = operands.iter().copied().unzip();
    let factors = [types[0], types[1], DType::F32];
    let transposed = (matmul.transpose_a, matmul.transpose_b);
    let product = super::matmul::matmul(shapes[0], shapes[1], transposed, shape, factors);
    let epilogue = epilogue_kernel(program, &shapes)?;
    let desc = format!("{} then {}", product.describe(), epilogue.desc);
    let rows = RowBlocks::new(program, matmul, &shapes, &types, output.1)?;
    // With half values anywhere, every run takes the row blocks (the product in an f32 tile).
    let half = types.iter().chain([&output.1]).any(|&d| half_type(d).is_some());
    Ok(Box::new(FusedMatMulKernel { product, epilogue, rows, half, desc }))
}

/// A convolution with an elementwise epilogue (`Fused::conv`): each block of output rows gets
/// the epilogue right after the convolution made it, on the same thread, while it is in cache
/// (the unfused pair wrote the whole output, then read and wrote it again). The epilogue reads
/// the block as its operand 0, in place, and the op's other operands beside it; none of them is
/// the output (`Op::may_write_over` allows no such plan).
pub(crate) struct FusedConvKernel {
    conv: ConvThen,
    epilogue: FusedKernel,
    desc: String,
}

/// The convolution a fused op computes first, each kind with its own loops and a `run_then`
/// that hands every block of output it finishes to the epilogue.
enum ConvThen {
    /// One group, no dilation: GEMMs (`conv`).
    Dense(super::conv::Conv2d),
    /// Grouped, depthwise or dilated: direct loops (`grouped_conv`), which an epilogue follows
    /// a block of rows at a time: EfficientNet-B0's and MobileNetV3-small's depthwise
    /// convolutions and their SiLU or hardswish, which were a pass of their own over outputs
    /// too large for L2.
    Grouped(super::grouped_conv::Conv2d),
}

pub(crate) fn fused_conv2d(
    program: &Fused,
    window: &kiln_compiler::ir::Window2d,
    operands: &[&Shape],
) -> Result<Box<dyn CpuKernel>, KernelError> {
    let conv = if window.is_dense() {
        let dense = super::conv::conv2d_kernel(operands[0], operands[1], window);
        ConvThen::Dense(dense)
    } else {
        ConvThen::Grouped(super::grouped_conv::conv2d_kernel(operands[0], operands[1], window))
    };
    let epilogue = epilogue_kernel(program, operands)?;
    let text = match &conv {
        ConvThen::Dense(c) => c.text(),
        ConvThen::Grouped(c) => c.text(),
    };
    let desc = format!("{text} then {}", epilogue.desc);
    Ok(Box::new(FusedConvKernel { conv, epilogue, desc }))
}

/// The operands of a product's epilogue: the output (the product, operand 0), then the op's
/// operands after its two factors; and how many of those follow.
fn epilogue_inputs(inputs: &[*mut u8], output: *mut u8) -> ([*mut u8; MAX_FUSED_OPERANDS], usize) {
    let mut epilogue_inputs = [std::ptr::null_mut(); MAX_FUSED_OPERANDS];
    epilogue_inputs[0] = output;
    let extra = inputs.len().saturating_sub(2).min(MAX_FUSED_OPERANDS - 1);
    epilogue_inputs[1..=extra].copy_from_slice(&inputs[2..2 + extra]);
    (epilogue_inputs, extra)
}

impl CpuKernel for FusedConvKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (epilogue_inputs, extra) = epilogue_inputs(inputs, output);
        let ins = operand_ptrs(&epilogue_inputs[..=extra]);
        let o = SendPtr::new(output as *mut f32);
        // SAFETY: run's contract: the factors and the output hold the convolution's tensors and
        // the output overlaps neither factor nor (validated plan, `may_write_over`) an epilogue
        // operand; each block's epilogue reads operand 0 (the output) at the block's own
        // offsets, in place, and writes only the block, which its task alone touches.
        unsafe {
            let (x, w, out) = (inputs[0] as *const f32, inputs[1] as *const f32, output as *mut f32);
            let then = |at, len| self.epilogue.eval_range(&ins, at, at + len, o.get().add(at));
            match &self.conv {
                ConvThen::Dense(c) => c.run_then(x, w, out, &then),
                ConvThen::Grouped(c) => c.run_then(x, w, out, &then),
            }
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

impl CpuKernel for FusedMatMulKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (epilogue_inputs, extra) = epilogue_inputs(inputs, output);
        if self.half || inputs[2..].contains(&output) {
            // SAFETY: run's contract; the output overlaps an epilogue operand only, planned so
            // by `Op::may_write_over`.
            return unsafe { self.rows.run(inputs, output) };
        }
        // SAFETY: run's contract: the factors and the output are valid and disjoint (a product
        // never writes over its factors), so the product kernel's contract holds; the epilogue
        // then reads the output as its operand 0, which has the output's shape, in place (the
        // elementwise contract), and the other operands are the op's own.
        unsafe {
            self.product.run(&inputs[..2], output);
            self.epilogue.run(&epilogue_inputs[..=extra], output);
        }
    }

    fn describe(&self) -> String {
        self.desc.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::super::elementwise::tests::{inputs, unary_ops};
    use super::super::simd::Width;
    use super::*;
    use kiln_compiler::ir::BinaryOp;
    use kiln_compiler::ir::fused::Ref;

    /// A fused program of every unary op (each on the first operand, summed in a chain with
    /// both GELU gradients and a select) computes the baseline's bits at every width.
    #[test]
    fn every_width_computes_the_baseline_bits() {
        let x = inputs();
        let n = x.len();
        let y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos()).collect();
        let mut insts = Vec::new();
        let mut acc = Ref::Operand(1);
        for op in unary_ops() {
            insts.push(Inst::Unary(op, Ref::Operand(0)));
            insts.push(Inst::Binary(BinaryOp::Add, acc, Ref::Value(insts.len() as u32 - 1)));
            acc = Ref::Value(insts.len() as u32 - 1);
        }
        for op in [BinaryOp::GeluGrad, BinaryOp::GeluTanhGrad] {
            insts.push(Inst::Binary(op, Ref::Operand(0), acc));
            acc = Ref::Value(insts.len() as u32 - 1);
        }
        insts.push(Inst::Select(Ref::Operand(1), acc, Ref::Operand(0)));
        let shape = Shape::new([n]);
        let program = Fused::elementwise(shape.clone(), insts);
        let kernel = fused_kernel(&program, &[&shape, &shape], &shape).expect("a valid program");
        let run = |w: Width| {
            let mut o = vec![0.0f32; n];
            let mut slots = vec![0.0f32; kernel.regs.slots * n];
            let mut ins = [std::ptr::null(); MAX_FUSED_OPERANDS];
            (ins[0], ins[1]) = (x.as_ptr(), y.as_ptr());
            // SAFETY: both operands hold n elements read with stride 1, disjoint from `o` (n
            // writes); slots holds regs.slots slots of n elements; `w` is available.
            unsafe { chunk_at(w, &kernel, &mut slots, n, &ins, o.as_mut_ptr(), n, 0) };
            o
        };
        let base = run(Width::Baseline);
        assert!(base.iter().any(|v| v.is_finite() && *v != 0.0));
        for w in Width::available() {
            assert!(
                run(w)
                    .iter()
                    .zip(&base)
                    .all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())),
                "{w:?}"
            );
        }
    }

    /// Operands that are the output's trailing axes (a bias over channels, a [1, 1, p] row) are
    /// read from their repeated values: every element of every sub-range, on one thread or
    /// split, is the element-by-element result, beside an iota that reads positions.
    #[test]
    fn periodic_operands_compute_every_element() {
        let out = Shape::new([5, 3, 7, 6]);
        let n = out.numel();
        let (bias, row, col) = (Shape::new([6]), Shape::new([1, 7, 6]), Shape::new([5, 3, 7, 1]));
        assert_eq!((period(&bias, &out), period(&row, &out), period(&col, &out)), (6, 42, 0));
        assert_eq!(period(&out, &out), 0, "an operand of the output's shape is not periodic");
        let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.13).sin()).collect();
        let b: Vec<f32> = (0..6).map(|i| i as f32 - 2.5).collect();
        let r: Vec<f32> = (0..42).map(|i| (i as f32 * 0.7).cos()).collect();
        let c: Vec<f32> = (0..n / 6).map(|i| i as f32 * 0.01).collect();
        // relu(x + b) * r + c + iota(axis 2)
        let insts = vec![
            Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
            Inst::Unary(kiln_compiler::ir::UnaryOp::Relu, Ref::Value(0)),
            Inst::Binary(BinaryOp::Mul, Ref::Value(1), Ref::Operand(2)),
            Inst::Binary(BinaryOp::Add, Ref::Value(2), Ref::Operand(3)),
            Inst::Iota(2),
            Inst::Binary(BinaryOp::Add, Ref::Value(3), Ref::Value(4)),
        ];
        let program = Fused::elementwise(out.clone(), insts);
        let kernel = fused_kernel(&program, &[&out, &bias, &row, &col], &out).expect("a valid program");
        assert_eq!(&kernel.period[..4], &[0, 6, 42, 0]);
        let want: Vec<f32> = (0..n)
            .map(|i| ((x[i] + b[i % 6]).max(0.0) * r[i % 42] + c[i / 6]) + ((i / 6) % 7) as f32)
            .collect();
        let ins = operand_ptrs(&[
            x.as_ptr() as *mut u8,
            b.as_ptr() as *mut u8,
            r.as_ptr() as *mut u8,
            c.as_ptr() as *mut u8,
        ]);
        for (s, e) in [(0, n), (1, n - 1), (5, 48), (41, 43), (100, 101), (36, 42), (200, n)] {
            let mut o = vec![f32::NAN; e - s];
            // SAFETY: the operands hold their shapes' elements; `o` holds e - s elements.
            unsafe { kernel.eval_range(&ins, s, e, o.as_mut_ptr()) };
            for (i, v) in o.iter().enumerate() {
                assert_eq!(v.to_bits(), want[s + i].to_bits(), "element {} of {s}..{e}", s + i);
            }
        }
        let mut o = vec![f32::NAN; n];
        // SAFETY: as above, the whole output.
        unsafe {
            kernel.run(
                &[x.as_ptr() as *mut u8, b.as_ptr() as *mut u8, r.as_ptr() as *mut u8, c.as_ptr() as *mut u8],
                o.as_mut_ptr() as *mut u8,
            )
        };
        assert!(o.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()));
    }

    /// Programs of `Chain`'s shape run in one pass with the interpreter's results (bitwise,
    /// NaN for NaN) for every unary op, over a periodic bias, a residual and a broadcast
    /// operand (gathered into its slot), into a separate output and in place over operand 0;
    /// programs of other shapes are left to the interpreter.
    #[test]
    fn chains_compute_the_interpreted_values() {
        use kiln_compiler::ir::{BinaryOp, UnaryOp};
        let x = inputs();
        let n = x.len();
        let out = Shape::new([n / 40, 40]);
        let n = out.numel();
        let x = &x[..n];
        let (bias, row) = (Shape::new([40]), Shape::new([n / 40, 1]));
        let values =
            |n: usize, k: f32| (0..n).map(|i| ((i as f32 + k) * 0.37).sin() * 4.0).collect::<Vec<f32>>();
        let (b, r, c) = (values(40, 1.0), values(n, 2.0), values(n / 40, 3.0));
        let (op, v) = (|j| Ref::Operand(j), |i| Ref::Value(i));
        let add = |l, r| Inst::Binary(BinaryOp::Add, l, r);
        let mul = |l, r| Inst::Binary(BinaryOp::Mul, l, r);
        let mut programs = Vec::new();
        for u in unary_ops() {
            programs.push(vec![add(op(0), op(1)), Inst::Unary(u, v(0))]);
            programs.push(vec![add(op(1), op(0)), Inst::Unary(u, v(0)), mul(v(0), v(1))]);
            programs.push(vec![add(op(0), op(1)), add(op(2), v(0)), Inst::Unary(u, v(1)), mul(v(2), v(1))]);
            programs.push(vec![add(op(0), op(3)), Inst::Unary(u, v(0))]);
            programs.push(vec![Inst::Unary(u, op(0)), mul(v(0), op(0))]);
            programs.push(vec![Inst::Unary(u, op(0))]);
        }
        programs.push(vec![add(op(0), op(1))]);
        programs.push(vec![add(op(0), op(1)), add(v(0), op(2))]);
        // Hardswish and hardsigmoid of a biased value, and hardswish of operand 0.
        let scalar = |o, c, r| Inst::Scalar(o, c, r);
        let clamp = |from, at: u32| {
            use kiln_compiler::ir::ScalarOp::{Add, Max, Min, Mul};
            [
                scalar(Mul, 1.0 / 6.0, from),
                scalar(Add, 0.5, v(at)),
                scalar(Max, 0.0, v(at + 1)),
                scalar(Min, 1.0, v(at + 2)),
            ]
        };
        programs.push([vec![add(op(0), op(1))], clamp(v(0), 1).to_vec(), vec![mul(v(0), v(4))]].concat());
        programs.push([vec![add(op(0), op(1))], clamp(v(0), 1).to_vec()].concat());
        programs.push([clamp(op(0), 0).to_vec(), vec![mul(op(0), v(3))]].concat());
        let shapes = [&out, &bias, &out, &row];
        let ptrs = |first: *const f32| [first, b.as_ptr(), r.as_ptr(), c.as_ptr()].map(|p| p as *mut u8);
        let same = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()))
        };
        for insts in programs {
            let program = Fused::elementwise(out.clone(), insts.clone());
            let chained = fused_kernel(&program, &shapes, &out).expect("a valid program");
            assert!(chained.chain.is_some(), "{insts:?} is a chain");
            let mut interpreted = fused_kernel(&program, &shapes, &out).expect("a valid program");
            interpreted.chain = None;
            let (mut got, mut want) = (vec![0.0f32; n], vec![0.0f32; n]);
            // SAFETY: every operand holds its shape's elements; the outputs hold n floats.
            unsafe {
                chained.run(&ptrs(x.as_ptr()), got.as_mut_ptr() as *mut u8);
                interpreted.run(&ptrs(x.as_ptr()), want.as_mut_ptr() as *mut u8);
            }
            assert!(same(&got, &want), "{insts:?}");
            // In place over operand 0.
            let (mut got, mut want) = (x.to_vec(), x.to_vec());
            // SAFETY: as above; the output is operand 0's own memory (in place).
            unsafe {
                chained.run(&ptrs(got.as_ptr()), got.as_mut_ptr() as *mut u8);
                interpreted.run(&ptrs(want.as_ptr()), want.as_mut_ptr() as *mut u8);
            }
            assert!(same(&got, &want), "{insts:?} in place");
            // Every vector width, one chunk over operands read where they lie.
            let m = CHUNK.min(n);
            let at_width = |w: Width| {
                let mut o = vec![0.0f32; m];
                let mut slots = vec![0.0f32; chained.regs.slots.max(1) * m];
                let mut ins = [std::ptr::null(); MAX_FUSED_OPERANDS];
                (ins[0], ins[1], ins[2]) = (x.as_ptr(), r.as_ptr(), r.as_ptr());
                ins[3] = r.as_ptr();
                // SAFETY: each operand pointer holds at least m elements, read with the
                // kernel's inner stride (1, or 0 for the broadcast row), disjoint from `o`;
                // slots holds regs.slots slots of m elements; `w` is available.
                unsafe { chunk_at(w, &chained, &mut slots, m, &ins, o.as_mut_ptr(), m, 0) };
                o
            };
            let base = at_width(Width::Baseline);
            for w in Width::available() {
                assert!(same(&at_width(w), &base), "{insts:?} at {w:?}");
            }
        }
        for insts in [
            vec![add(op(0), op(1)), Inst::Unary(UnaryOp::Relu, v(0)), add(v(1), op(2))],
            vec![mul(op(0), op(1))],
            vec![Inst::Unary(UnaryOp::Relu, op(0)), mul(v(0), op(1))],
            vec![add(op(0), op(1)), add(v(0), op(2)), add(v(1), op(3))],
            vec![add(op(0), op(1)), Inst::Unary(UnaryOp::Sigmoid, op(2))],
            vec![add(op(0), op(1)), mul(v(0), v(0))],
            {
                // A clamp whose second step reads t instead of the first step's value.
                let mut c = [vec![add(op(0), op(1))], clamp(v(0), 1).to_vec()].concat();
                c[2] = scalar(kiln_compiler::ir::ScalarOp::Add, 0.5, v(0));
                c
            },
        ] {
            assert!(Chain::of(&insts).is_none(), "{insts:?} is no chain");
        }
    }

    /// A convolution with its epilogue (`FusedConvKernel`: blocks of 8 output rows, or of pixels
    /// across the batch for a 1x1 window, each through the program as it is made) computes the
    /// bits of the convolution followed by the elementwise program: images of heights that
    /// blocks do not divide, stride 2 VALID and stride 1 SAME, 1x1 windows of stride 1 (blocks
    /// ending inside an image) and 2 (gathered pixels), a bias too long to be periodic and a
    /// short one, a residual operand; depthwise, grouped and dilated windows (`grouped_conv`,
    /// blocks of rows, several to an image); and a program whose last instruction reads the convolution's output
    /// itself (copied before it is overwritten) as well as one that does not (read in place).
    #[test]
    fn a_fused_convolution_computes_the_unfused_bits() {
        use kiln_compiler::ir::{DType, Op, Padding, UnaryOp, Window2d, infer};
        let cases = [
            ([3, 21, 9, 5], Window2d::new([3, 3], [2, 2], Padding::Valid), 520),
            ([2, 13, 10, 3], Window2d::new([3, 3], [1, 1], Padding::Same), 7),
            ([3, 9, 11, 6], Window2d::new([1, 1], [1, 1], Padding::Valid), 520),
            ([2, 9, 9, 4], Window2d::new([1, 1], [2, 2], Padding::Valid), 7),
            ([2, 37, 64, 96], Window2d::new([3, 3], [1, 1], Padding::Same).grouped(96), 96),
            ([3, 11, 13, 40], Window2d::new([5, 5], [2, 2], Padding::Same).grouped(40), 40),
            ([2, 9, 8, 8], Window2d::new([3, 3], [1, 1], Padding::Same).grouped(2), 12),
            ([2, 12, 10, 4], Window2d::new([3, 3], [1, 1], Padding::Same).dilated([2, 2]), 6),
        ];
        for ((x, window, f), last_reads_output) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
            let [kh, kw] = window.size;
            let (xs, ws, bs) =
                (Shape::new(x), Shape::new([kh, kw, x[3] / window.groups, f]), Shape::new([f]));
            let operands = [(&xs, DType::F32), (&ws, DType::F32)];
            let out = infer(&Op::Conv2d { window }, &operands).expect("a valid convolution").0;
            let values =
                |n: usize, k: f32| (0..n).map(|i| ((i as f32 + k) * 0.37).sin()).collect::<Vec<f32>>();
            let (xv, wv, bv, rv) =
                (values(xs.numel(), 0.0), values(ws.numel(), 1.0), values(f, 2.0), values(out.numel(), 3.0));
            // relu(conv + bias) + residual, or relu(conv + bias) · conv
            let last = if last_reads_output { Ref::Operand(0) } else { Ref::Operand(2) };
            let op = if last_reads_output { BinaryOp::Mul } else { BinaryOp::Add };
            let insts = vec![
                Inst::Binary(BinaryOp::Add, Ref::Operand(0), Ref::Operand(1)),
                Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
                Inst::Binary(op, Ref::Value(1), last),
            ];
            let program = Fused::elementwise(out.clone(), insts);
            let ptr = |v: &[f32]| v.as_ptr() as *mut u8;
            let mut conv_out = vec![f32::NAN; out.numel()];
            let mut want = vec![f32::NAN; out.numel()];
            let conv = match window.is_dense() {
                true => super::super::conv::conv2d(&xs, &ws, &window, &out),
                false => super::super::grouped_conv::conv2d(&xs, &ws, &window),
            };
            let then = fused_kernel(&program, &[&out, &bs, &out], &out).expect("a valid program");
            // SAFETY: every buffer holds its shape's elements; outputs are distinct allocations.
            unsafe {
                conv.run(&[ptr(&xv), ptr(&wv)], conv_out.as_mut_ptr() as *mut u8);
                then.run(&[ptr(&conv_out), ptr(&bv), ptr(&rv)], want.as_mut_ptr() as *mut u8);
            }
            let fused = Fused { conv: Some(window), ..program };
            let kernel = fused_conv2d(&fused, &window, &[&xs, &ws, &bs, &out]).expect("a valid program");
            let mut got = vec![f32::NAN; out.numel()];
            // SAFETY: as above.
            unsafe { kernel.run(&[ptr(&xv), ptr(&wv), ptr(&bv), ptr(&rv)], got.as_mut_ptr() as *mut u8) };
            assert!(want.iter().any(|v| *v != 0.0));
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{x:?} {window:?}: element {i} is {a} fused and {b} unfused"
                );
            }
        }
    }
}
