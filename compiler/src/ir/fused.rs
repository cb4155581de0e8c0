//! A fused elementwise group: one op whose meaning is a small program of elementwise
//! instructions over its operands, computed element by element of the output.
//!
//! Semantics (what both backends implement): every operand is broadcast to the group's output
//! shape (NumPy rules, aligned at the right); for each output element the instructions run in
//! order, each reading operands (at that element's broadcast position) or earlier instructions'
//! values; the last instruction's value is the output element. Because every operand is read at
//! the output element's own position, a fused op may write its output over an operand of the
//! output's shape (in place), as a single elementwise op may.
//!
//! The fusion pass (`crate::fusion`) forms groups only of values with the output's element count,
//! so that no instruction is computed more often than it would be unfused, and the results are the
//! very bits of the unfused ops (each instruction is the op it replaces, on the same operands).
//!
//! `registers` assigns every instruction a slot of the CPU kernel's chunk buffers (operands first,
//! then values, a slot reused once its value is dead): the CPU backend evaluates a group over
//! chunks of the output, one vectorised loop per instruction, with every intermediate in cache.

use super::{BinaryOp, DType, ReduceOp, ScalarOp, Shape, UnaryOp, Window2d};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// The most operands a fused op takes (the CPU kernel walks them with fixed-size stride arrays).
pub const MAX_FUSED_OPERANDS: usize = 8;
/// The most instructions in one fused op.
pub const MAX_FUSED_INSTS: usize = 64;
/// The most chunk slots a fused op's program may need at once (`Fused::registers`).
pub const MAX_FUSED_SLOTS: usize = 16;

/// What an instruction reads: operand `i` of the fused op, or the value of instruction `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Ref {
    /// Operand `i` of the program, read at the element's broadcast position.
    Operand(u32),
    /// The value of instruction `i`, which comes before the reading instruction.
    Value(u32),
}

/// One elementwise op inside a fused group, with the same meaning as the op of that name.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Inst {
    /// The unary op of one ref (`Op::Unary`).
    Unary(UnaryOp, Ref),
    /// The binary op of two refs, in operand order (`Op::Binary`).
    Binary(BinaryOp, Ref, Ref),
    /// `x op c` of the ref x and the constant c (`Op::Scalar`).
    Scalar(ScalarOp, f32, Ref),
    /// where(cond != 0, a, b), refs (cond, a, b).
    Select(Ref, Ref, Ref),
    /// The element's index along this axis of the program's shape, as f32 (an `Op::Iota` that
    /// joined the group: no buffer, no operand).
    Iota(u32),
    /// A constant (an `Op::Fill` that joined the group).
    Const(f32),
    /// The ref's value converted to a float type (`Op::Cast` between f32, f16 and bf16): rounded
    /// to the nearest value of that type, ties to even, and held as f32 (exact, since both half
    /// types are subsets of f32). A half op in a group is its f32 arithmetic followed by this
    /// rounding, as the unfused op stores it; a program that ends with a cast stores its output
    /// in that type, and only such a program may read operands of several types (`ir::infer`).
    Cast(DType, Ref),
    /// `Op::RandomUniform`'s value at the element's linear index in the program's shape, for
    /// this seed and the step read from the ref (only joins a group of its own shape, so the
    /// index is the one the op would use).
    Uniform(u64, Ref),
}

impl Inst {
    /// The refs the instruction reads, in operand order.
    pub fn refs(&self) -> Vec<Ref> {
        match *self {
            Inst::Unary(_, a) | Inst::Scalar(_, _, a) | Inst::Cast(_, a) => vec![a],
            Inst::Binary(_, a, b) => vec![a, b],
            Inst::Select(c, a, b) => vec![c, a, b],
            Inst::Iota(_) | Inst::Const(_) => Vec::new(),
            Inst::Uniform(_, step) => vec![step],
        }
    }

    /// Its arithmetic per element (`UnaryOp::flops_per_element`).
    pub fn flops_per_element(&self) -> u64 {
        match *self {
            Inst::Unary(op, _) => op.flops_per_element(),
            Inst::Binary(op, _, _) => op.flops_per_element(),
            Inst::Uniform(..) => 8,
            _ => 1,
        }
    }

    /// Whether the instruction reads the element's index (iota, random values).
    pub fn reads_index(&self) -> bool {
        matches!(self, Inst::Iota(_) | Inst::Uniform(..))
    }

    /// The op the instruction stands for.
    pub fn op(&self) -> super::Op {
        match *self {
            Inst::Unary(u, _) => super::Op::Unary(u),
            Inst::Binary(b, _, _) => super::Op::Binary(b),
            Inst::Scalar(op, value, _) => super::Op::Scalar { op, value },
            Inst::Select(..) => super::Op::Select,
            Inst::Iota(axis) => super::Op::Iota { shape: Shape::scalar(), axis: axis as usize },
            Inst::Const(value) => super::Op::Fill { value, shape: Shape::scalar() },
            Inst::Uniform(seed, _) => super::Op::RandomUniform { shape: Shape::scalar(), seed },
            Inst::Cast(to, _) => super::Op::Cast { to },
        }
    }
}

/// Where an instruction's value goes in the CPU kernel's chunk buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dest {
    /// This chunk slot, from which later instructions read the value.
    Slot(usize),
    /// The last instruction writes the output.
    Output,
}

/// The slot plan of a program: operand `i` is loaded into slot `i`; `dest[j]` is where
/// instruction `j` writes and `reads[j]` the slots it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registers {
    /// Per instruction, where it writes its value.
    pub dest: Vec<Dest>,
    /// Per instruction, the slots it reads, in the order of its refs (an operand's slot is its
    /// index).
    pub reads: Vec<Vec<usize>>,
    /// Slots in use at the widest point.
    pub slots: usize,
}

/// A reduction applied to a fused program's values (`Op::Reduce`'s attributes): the group is
/// then a reduction with an elementwise prologue, and its values are never stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusedReduce {
    /// How the values are combined: sum, mean or maximum.
    pub op: ReduceOp,
    /// The reduced axes of the program's shape: distinct and ascending.
    pub axes: Vec<usize>,
    /// Whether the reduced axes stay in the output as length 1 (else they are removed).
    pub keepdims: bool,
}

/// A matrix product whose result is the program's operand 0 (a matmul with an elementwise
/// epilogue): the fused op's operands are then (a, b, x1, x2, ...), and the program's operand
/// `i >= 1` is the op's operand `i + 1`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FusedMatMul {
    /// Whether the product reads aᵀ: the first factor's last two axes swapped.
    pub transpose_a: bool,
    /// Whether the product reads bᵀ: the second factor's last two axes swapped.
    pub transpose_b: bool,
}

impl FusedMatMul {
    /// The `Op::MatMul` it stands for.
    pub fn op(&self) -> super::Op {
        super::Op::MatMul { transpose_a: self.transpose_a, transpose_b: self.transpose_b }
    }
}

/// The program of a fused group (`Op::Fused`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Fused {
    /// The shape the program computes over; every operand broadcasts to it. Without a
    /// reduction it is the output's shape.
    pub shape: Shape,
    /// The instructions in order; the last one's value is the output element (or, with `reduce`,
    /// what is reduced).
    pub insts: Vec<Inst>,
    /// A reduction of the program's values, whose result is the output.
    #[serde(default)]
    pub reduce: Option<FusedReduce>,
    /// A matrix product computed first, the program's operand 0 (`FusedMatMul`).
    #[serde(default)]
    pub matmul: Option<FusedMatMul>,
    /// A convolution computed first (`Op::Conv2d` with this window), the program's operand 0:
    /// the fused op's operands are then (input, filter, x1, x2, ...), as for a product. At most
    /// one of `matmul` and `conv`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conv: Option<Window2d>,
    /// With a reduction: instructions applied to the reduced values, over the output's shape.
    /// The epilogue's operand 0 is the reduced value and its operand `j >= 1` the op's operand
    /// `n - epilogue_operands + j - 1` (the last `epilogue_operands` operands are the
    /// epilogue's; the program before the reduction reads the others).
    #[serde(default)]
    pub epilogue: Vec<Inst>,
    /// How many of the op's operands, the last ones, the epilogue reads; 0 without an epilogue.
    #[serde(default)]
    pub epilogue_operands: usize,
}

impl FusedReduce {
    /// The `Op::Reduce` it stands for.
    pub fn op(&self) -> super::Op {
        super::Op::Reduce { op: self.op, axes: self.axes.clone(), keepdims: self.keepdims }
    }
}

impl Fused {
    /// A program of elementwise instructions alone over `shape` (no product, no reduction).
    pub fn elementwise(shape: Shape, insts: Vec<Inst>) -> Fused {
        Fused {
            shape,
            insts,
            reduce: None,
            matmul: None,
            conv: None,
            epilogue: Vec::new(),
            epilogue_operands: 0,
        }
    }

    /// The op computed first whose result is the program's operand 0: a matrix product or a
    /// convolution, of the fused op's first two operands.
    pub fn product(&self) -> Option<super::Op> {
        match (&self.matmul, &self.conv) {
            (Some(m), _) => Some(m.op()),
            (None, Some(window)) => Some(super::Op::Conv2d { window: *window }),
            (None, None) => None,
        }
    }

    /// The type the program stores its output in when its last instruction (the epilogue's,
    /// with one) is a float cast (`Inst::Cast`); `None`: its operands' common type.
    pub fn stored_dtype(&self) -> Option<DType> {
        let last = if self.epilogue.is_empty() { self.insts.last() } else { self.epilogue.last() };
        match last {
            Some(Inst::Cast(to, _)) => Some(*to),
            _ => None,
        }
    }

    /// Whether a product or convolution is computed first (`product`).
    pub fn has_product(&self) -> bool {
        self.matmul.is_some() || self.conv.is_some()
    }

    /// How many operands the program reads, for an op of `op_operands` operands: the product
    /// stands for the op's first two.
    pub fn program_operands(&self, op_operands: usize) -> usize {
        let own = op_operands.saturating_sub(self.epilogue_operands);
        if self.has_product() { own.saturating_sub(1) } else { own }
    }

    /// The epilogue as a program of its own over `shape` (the output's): operand 0 the reduced
    /// value, then the epilogue's operands.
    pub fn epilogue_program(&self, shape: &Shape) -> Fused {
        Fused::elementwise(shape.clone(), self.epilogue.clone())
    }

    /// Checks the program against `operands` operands: at least one instruction, every ref to
    /// an operand that exists or an earlier instruction, every operand read, the limits above
    /// kept. The error says what is wrong.
    pub fn check(&self, operands: usize) -> Result<(), String> {
        if self.insts.is_empty() {
            return Err("the fused program has no instruction".into());
        }
        if self.insts.len() > MAX_FUSED_INSTS {
            return Err(format!("{} instructions, above the limit of {MAX_FUSED_INSTS}", self.insts.len()));
        }
        if operands > MAX_FUSED_OPERANDS {
            return Err(format!("{operands} operands, above the limit of {MAX_FUSED_OPERANDS}"));
        }
        if let Some(j) = self
            .insts
            .iter()
            .chain(&self.epilogue)
            .position(|i| matches!(i, Inst::Cast(to, _) if !to.is_float()))
        {
            return Err(format!(
                "instruction {j} casts to an exact type: a fused cast is between f32, f16 and bf16"
            ));
        }
        let mut read = vec![false; operands];
        for (j, inst) in self.insts.iter().enumerate() {
            for r in inst.refs() {
                match r {
                    Ref::Operand(i) if (i as usize) < operands => read[i as usize] = true,
                    Ref::Value(v) if (v as usize) < j => {}
                    r => return Err(format!("instruction {j} reads {r:?}, which does not exist before it")),
                }
            }
        }
        if let Some(i) = read.iter().position(|r| !r) {
            return Err(format!("operand {i} is never read"));
        }
        for inst in &self.insts {
            if let Inst::Iota(axis) = inst
                && *axis as usize >= self.shape.rank()
            {
                return Err(format!("iota along axis {axis} of a program of rank {}", self.shape.rank()));
            }
        }
        // A product's epilogue runs on blocks of rows on the CPU, which do not know their row.
        if self.has_product() && self.insts.iter().any(|i| i.reads_index()) {
            return Err("a product's epilogue has no iota or random values".into());
        }
        if self.has_product() && (self.reduce.is_some() || !self.epilogue.is_empty()) {
            return Err("a product's epilogue has no reduction".into());
        }
        let slots = self.registers(operands).slots;
        if slots > MAX_FUSED_SLOTS {
            return Err(format!(
                "the program needs {slots} slots at once, above the limit of {MAX_FUSED_SLOTS}"
            ));
        }
        Ok(())
    }

    /// The slot plan: every operand loaded first (slots `0..operands`), each value in a free slot
    /// distinct from the slots its instruction reads (so that every instruction is a loop over
    /// disjoint buffers), a slot freed after the last read of what it holds; the last
    /// instruction writes the output. Refs must be valid (`check`).
    pub fn registers(&self, operands: usize) -> Registers {
        let n = self.insts.len();
        // Last instruction reading each operand and each value.
        let mut last_op = vec![0usize; operands];
        let mut last_val = vec![0usize; n];
        for (j, inst) in self.insts.iter().enumerate() {
            for r in inst.refs() {
                match r {
                    Ref::Operand(i) => last_op[i as usize] = j,
                    Ref::Value(v) => last_val[v as usize] = j,
                }
            }
        }
        let mut free: Vec<usize> = Vec::new();
        let mut used = operands;
        let mut slot_of_val = vec![usize::MAX; n];
        let mut dest = Vec::with_capacity(n);
        let mut reads = Vec::with_capacity(n);
        for (j, inst) in self.insts.iter().enumerate() {
            let refs = inst.refs();
            reads.push(
                refs.iter()
                    .map(|r| match *r {
                        Ref::Operand(i) => i as usize,
                        Ref::Value(v) => slot_of_val[v as usize],
                    })
                    .collect::<Vec<_>>(),
            );
            if j + 1 == n {
                dest.push(Dest::Output);
            } else {
                let slot = free.pop().unwrap_or_else(|| {
                    used += 1;
                    used - 1
                });
                slot_of_val[j] = slot;
                dest.push(Dest::Slot(slot));
            }
            // Free what this instruction read last (after choosing its slot: never in place).
            for r in refs {
                let (last, slot) = match r {
                    Ref::Operand(i) => (last_op[i as usize], i as usize),
                    Ref::Value(v) => (last_val[v as usize], slot_of_val[v as usize]),
                };
                if last == j && !free.contains(&slot) {
                    free.push(slot);
                }
            }
            // A value nobody reads frees its slot at once.
            if let Dest::Slot(s) = dest[j]
                && last_val[j] == 0
                && !free.contains(&s)
            {
                free.push(s);
            }
        }
        Registers { dest, reads, slots: used }
    }

    /// The program as dumps print it: `v0 = sigmoid_grad(x0, x1); v1 = mul(v0, x2)`.
    pub fn text(&self) -> String {
        let name = |r: &Ref| match r {
            Ref::Operand(i) => format!("x{i}"),
            Ref::Value(v) => format!("v{v}"),
        };
        let mut s = String::new();
        if let Some(p) = self.product() {
            let _ = write!(s, "x0 = {}(a, b); ", p.label());
        }
        for (j, inst) in self.insts.iter().enumerate() {
            if j > 0 {
                s.push_str("; ");
            }
            let args: Vec<String> = inst.refs().iter().map(name).collect();
            let _ = write!(s, "v{j} = {}", inst.op().name());
            match inst {
                Inst::Scalar(_, c, _) | Inst::Const(c) => {
                    let _ = write!(s, "[{c}]");
                }
                Inst::Iota(axis) => {
                    let _ = write!(s, "[axis {axis}]");
                }
                Inst::Uniform(seed, _) => {
                    let _ = write!(s, "[seed {seed}]");
                }
                Inst::Cast(to, _) => {
                    let _ = write!(s, "[{to}]");
                }
                _ => {}
            }
            let _ = write!(s, "({})", args.join(", "));
        }
        if let Some(r) = &self.reduce {
            let _ = write!(s, "; {}{:?}(v{})", r.op().name(), r.axes, self.insts.len().saturating_sub(1));
        }
        if !self.epilogue.is_empty() {
            let _ = write!(s, "; then x0 = the reduction: {}", self.epilogue_program(&self.shape).text());
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain() -> Fused {
        // v0 = x0 * x1; v1 = relu(v0); v2 = v1 + x2; v3 = v2 * v0
        Fused {
            shape: Shape::new(vec![4]),
            reduce: None,
            matmul: None,
            conv: None,
            epilogue: Vec::new(),
            epilogue_operands: 0,
            insts: vec![
                Inst::Binary(BinaryOp::Mul, Ref::Operand(0), Ref::Operand(1)),
                Inst::Unary(UnaryOp::Relu, Ref::Value(0)),
                Inst::Binary(BinaryOp::Add, Ref::Value(1), Ref::Operand(2)),
                Inst::Binary(BinaryOp::Mul, Ref::Value(2), Ref::Value(0)),
            ],
        }
    }

    #[test]
    fn registers_never_write_a_slot_they_read_and_reuse_dead_ones() {
        let f = chain();
        assert_eq!(f.check(3), Ok(()));
        let r = f.registers(3);
        for (j, d) in r.dest.iter().enumerate() {
            if let Dest::Slot(s) = d {
                assert!(!r.reads[j].contains(s), "instruction {j} writes a slot it reads");
            }
        }
        assert_eq!(r.dest[3], Dest::Output);
        // x0 and x1 die at v0, so v1 reuses one of their slots: 3 operands + v0 = 4 slots at most.
        assert_eq!(r.slots, 4);
        assert_eq!(r.reads[3], vec![slot(&r, 2), slot(&r, 0)]);
    }

    fn slot(r: &Registers, j: usize) -> usize {
        match r.dest[j] {
            Dest::Slot(s) => s,
            Dest::Output => usize::MAX,
        }
    }

    #[test]
    fn check_refuses_bad_programs() {
        let mut f = chain();
        assert!(f.check(4).unwrap_err().contains("operand 3 is never read"));
        f.insts[1] = Inst::Unary(UnaryOp::Relu, Ref::Value(1));
        assert!(f.check(3).unwrap_err().contains("does not exist"));
        f.insts.clear();
        assert!(f.check(0).is_err());
        assert!(chain().check(9).is_err());
        assert_eq!(chain().text(), "v0 = mul(x0, x1); v1 = relu(v0); v2 = add(v1, x2); v3 = mul(v2, v0)");
    }
}
