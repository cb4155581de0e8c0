//! The host kernels on f16 and bf16 values at their edges: an empty operand's output filled in
//! the output's own type (no f32 written past a half output's end), and an output declared in
//! another type than the operands give refused before any kernel runs.

use kiln_compiler::ir::{DType, Op, ReduceOp, Shape};
use kiln_kernels::KernelError;
use kiln_kernels::cpu::prepare;

/// Runs `op` on empty operands of `dtype` into an output of `n` half elements followed by a
/// sentinel: the output's bits, and whether the sentinel survived.
fn run_empty(op: &Op, inputs: &[&Shape], out: &Shape, dtype: DType) -> (Vec<u16>, bool) {
    let typed: Vec<(&Shape, DType)> = inputs.iter().map(|&s| (s, dtype)).collect();
    let kernel = prepare(op, &typed, (out, dtype)).unwrap();
    let n = out.numel();
    let mut buf = vec![0x5a5au16; n + 8];
    let mut empty = [0u8; 16];
    let ptrs: Vec<*mut u8> = inputs.iter().map(|_| empty.as_mut_ptr()).collect();
    // SAFETY: the operands have no element (nothing is read); the output holds n elements of 2
    // bytes, and 8 more of the buffer are the sentinel.
    unsafe { kernel.run(&ptrs, buf.as_mut_ptr() as *mut u8) };
    (buf[..n].to_vec(), buf[n..].iter().all(|&b| b == 0x5a5a))
}

#[test]
fn an_empty_operand_fills_a_half_output_in_its_type() {
    let (x, row) = (Shape::from([0, 4]), Shape::from([4]));
    let reduce = |op| Op::Reduce { op, axes: vec![0], keepdims: false };
    for dtype in [DType::F16, DType::BF16] {
        let widen = |b: u16| match dtype {
            DType::F16 => half::f16::from_bits(b).to_f32(),
            _ => half::bf16::from_bits(b).to_f32(),
        };
        let (sum, kept) = run_empty(&reduce(ReduceOp::Sum), &[&x], &row, dtype);
        assert!(kept && sum.iter().all(|&b| widen(b) == 0.0), "{dtype} sum {sum:?}");
        let (max, kept) = run_empty(&reduce(ReduceOp::Max), &[&x], &row, dtype);
        assert!(kept && max.iter().all(|&b| widen(b) == f32::NEG_INFINITY), "{dtype} max {max:?}");
        let (mean, kept) = run_empty(&reduce(ReduceOp::Mean), &[&x], &row, dtype);
        assert!(kept && mean.iter().all(|&b| widen(b).is_nan()), "{dtype} mean {mean:?}");
        let pad = Op::Pad { axis: 0, before: 2, after: 0 };
        let (padded, kept) = run_empty(&pad, &[&Shape::from([0, 3])], &Shape::from([2, 3]), dtype);
        assert!(kept && padded.iter().all(|&b| b == 0), "{dtype} pad {padded:?}");
    }
}

#[test]
fn an_output_declared_in_another_type_is_refused() {
    let s = Shape::from([2, 3]);
    for (op, inputs, out) in [
        (Op::Copy, vec![(&s, DType::F16)], DType::F32),
        (Op::Copy, vec![(&s, DType::F32)], DType::BF16),
        (
            Op::MatMul { transpose_a: false, transpose_b: true },
            vec![(&s, DType::F16), (&s, DType::F16)],
            DType::F16,
        ),
    ] {
        let shape = if matches!(op, Op::MatMul { .. }) { Shape::from([2, 2]) } else { s.clone() };
        let e = prepare(&op, &inputs, (&shape, out)).err().expect("a mismatched output type");
        assert!(matches!(e, KernelError::Shape { .. }), "{e}");
        assert!(e.to_string().contains(&format!("declared {out}")), "{e}");
    }
}
