//! Element strides shared by both backends' strided loops.

/// Element strides of a row-major operand of shape `operand` read as a tensor of shape `out`
/// under NumPy broadcasting (aligned at the right; 0 on axes the operand does not have or has as 1).
pub(crate) fn broadcast_strides(operand: &[usize], out: &[usize]) -> Vec<isize> {
    debug_assert!(operand.len() <= out.len());
    let offset = out.len() - operand.len();
    let mut strides = vec![0isize; out.len()];
    let mut running = 1usize;
    for i in (0..operand.len()).rev() {
        if operand[i] != 1 {
            strides[offset + i] = running as isize;
        }
        running *= operand[i];
    }
    strides
}

/// Row-major (contiguous) element strides of `dims`.
pub(crate) fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}
