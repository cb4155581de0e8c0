//! What a GPU framework takes from its allocator beyond the tensors of the op stream: the
//! columns of the memory bench that name a framework run kiln's eager op stream with these.
//!
//! - **PyTorch** (`FrameworkExtras::pytorch`): cuBLAS's workspace comes from the caching
//!   allocator, 32 MiB on Hopper (`:4096:8`, 8 MiB + 128 KiB before: `:4096:2:16:8`), one per
//!   (handle, stream); handles are per thread, and autograd runs the backward pass of CUDA
//!   tensors on its own device thread, so a training step holds two: the forward thread's and
//!   the backward thread's. Both are taken at their thread's first product and kept
//!   (`WorkspacePolicy::Persistent`, the default), or taken around every product (`PerCall`:
//!   what PyTorch 2.15's headers describe when its workspace cache is off). cuBLASLt's 1 MiB
//!   workspace is taken at the first product and kept. `Adam(foreach=True)`, the default on
//!   CUDA, makes one temporary per parameter (`_foreach_sqrt` of the second moments) that lives
//!   through the optimizer step: parameter-sized in all.
//!
//!   The default is what was measured: PyTorch's own op stream for the zoo's training steps
//!   (`kiln::torch_stream`) replayed with these workspaces gives PyTorch 2.11's figures on an
//!   H100 to the byte for the seed-mlp, the first model of its process (`max_memory_allocated`
//!   68,199,424 = the stream's 41,984 + 2 x 32 MiB + 1 MiB; `max_memory_reserved` 69,206,016 =
//!   one 2 MiB small-pool segment + 2 x 32 MiB), and for the mlp, measured after it with those
//!   workspaces already made and subtracted as its baseline, `max_memory_allocated` 38,089,728 =
//!   the stream's own peak.
//! - **TensorFlow** (`FrameworkExtras::tensorflow`): cuDNN's convolution scratch comes from the
//!   BFC allocator around every convolution and convolution gradient. Its size depends on the
//!   algorithm cuDNN's autotuner picks (up to `TF_CUDNN_WORKSPACE_LIMIT_IN_MB`, 4 GiB); the
//!   column assumes the explicit-GEMM algorithm's im2col buffer, N·OH·OW·KH·KW·C floats, an
//!   assumption the bench writes beside its table. With growth off TensorFlow reserves the
//!   device's free memory less 1,800 MiB (compute capability 9) or 1,536 MiB (8) up front,
//!   whatever the model (`tensorflow_preallocation`).

use kiln_compiler::ir::{Op, Shape};

/// When cuBLAS's workspace is taken from the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum WorkspacePolicy {
    /// Around every matrix product, freed after it.
    PerCall,
    /// At the first matrix product, kept (PyTorch's default, as measured: module doc).
    Persistent,
}

/// A workspace a library takes from the framework's allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Workspace {
    /// The workspace's size in bytes.
    pub bytes: usize,
    /// When it is taken and freed.
    pub policy: WorkspacePolicy,
}

/// cuBLAS's default workspace on compute capability 9 (Hopper): 4096 KiB x 8.
pub const CUBLAS_WORKSPACE_SM90: usize = 4096 * 1024 * 8;
/// cuBLAS's default workspace before Hopper: 4096 KiB x 2 + 16 KiB x 8.
pub const CUBLAS_WORKSPACE_PRE_SM90: usize = 4096 * 1024 * 2 + 16 * 1024 * 8;
/// cuBLASLt's workspace in PyTorch, taken once.
pub const CUBLASLT_WORKSPACE: usize = 1 << 20;

/// TensorFlow's headroom with growth off: the BFC region is the device's free memory less this.
pub fn tensorflow_reserved_headroom(compute_major: u32) -> usize {
    if compute_major >= 9 { 1800 << 20 } else { 1536 << 20 }
}

/// What TensorFlow's BFC allocator takes up front with growth off on a device with `free` bytes.
pub fn tensorflow_preallocation(free: usize, compute_major: u32) -> usize {
    free.saturating_sub(tensorflow_reserved_headroom(compute_major))
}

/// The extras of one framework (none: kiln's own eager column).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct FrameworkExtras {
    /// Taken around (or, persistent, once before) every matrix product.
    pub blas_workspace: Option<Workspace>,
    /// Taken at the first matrix product and kept.
    pub blas_lt_workspace: usize,
    /// The backward pass runs on its own thread with its own cuBLAS handle and so its own kept
    /// workspace (PyTorch's autograd engine on CUDA).
    pub backward_thread_handle: bool,
    /// One parameter-sized temporary per parameter Adam updates, from the first update of a
    /// call to its last (foreach Adam).
    pub foreach_optimizer_temporaries: bool,
    /// Convolution scratch (the im2col buffer) taken around every convolution and gradient.
    pub conv_scratch: bool,
}

impl FrameworkExtras {
    /// PyTorch on Hopper with the cuBLAS workspace `policy`: 32 MiB cuBLAS workspace per
    /// thread's handle (forward, backward), 1 MiB cuBLASLt, foreach Adam.
    pub fn pytorch(policy: WorkspacePolicy) -> Self {
        FrameworkExtras {
            blas_workspace: Some(Workspace { bytes: CUBLAS_WORKSPACE_SM90, policy }),
            blas_lt_workspace: CUBLASLT_WORKSPACE,
            backward_thread_handle: true,
            foreach_optimizer_temporaries: true,
            conv_scratch: false,
        }
    }

    /// TensorFlow with growth on: convolution scratch from the allocator.
    pub fn tensorflow() -> Self {
        FrameworkExtras { conv_scratch: true, ..Default::default() }
    }

    /// Whether these are no extras at all (kiln's own eager column).
    pub fn is_none(&self) -> bool {
        *self == FrameworkExtras::default()
    }
}

/// Whether `op` runs as a cuBLAS product.
pub fn is_blas(op: &Op) -> bool {
    matches!(op, Op::MatMul { .. } | Op::MatMulRows { .. })
}

/// The im2col scratch of a convolution op (0 for other ops): one row of KH·KW·C per output
/// pixel of the forward convolution, `operands` and `output` as the op sees them.
pub fn conv_scratch_bytes(op: &Op, operands: &[&Shape], output: &Shape) -> usize {
    let taps = |w: &kiln_compiler::ir::Window2d| w.size[0] * w.size[1];
    let f32s = match op {
        // x[N,H,W,C] -> y[N,OH,OW,F]
        Op::Conv2d { window } => {
            (output.numel() / output.back(1).max(1)) * taps(window) * operands[0].back(1)
        }
        // (dy[N,OH,OW,F], w) -> dx[N,H,W,C]
        Op::Conv2dBackpropInput { window, .. } => {
            (operands[0].numel() / operands[0].back(1).max(1)) * taps(window) * output.back(1)
        }
        // (x[N,H,W,C], dy[N,OH,OW,F]) -> dw
        Op::Conv2dBackpropFilter { window } => {
            (operands[1].numel() / operands[1].back(1).max(1)) * taps(window) * operands[0].back(1)
        }
        _ => 0,
    };
    f32s * 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_compiler::ir::{Padding, Window2d};

    #[test]
    fn workspace_sizes_and_headroom() {
        assert_eq!(CUBLAS_WORKSPACE_SM90, 32 << 20);
        assert_eq!(CUBLAS_WORKSPACE_PRE_SM90, (8 << 20) + (128 << 10));
        assert_eq!(tensorflow_preallocation(80 << 30, 9), (80 << 30) - (1800 << 20));
        assert_eq!(tensorflow_preallocation(1 << 30, 8), 0);
    }

    #[test]
    fn im2col_scratch_of_a_convolution_and_its_gradients() {
        let w = Window2d::new([3, 3], [1, 1], Padding::Same);
        let (x, dy, k) = (Shape::from([2, 8, 8, 3]), Shape::from([2, 8, 8, 5]), Shape::from([3, 3, 3, 5]));
        let rows = 2 * 8 * 8;
        let forward = conv_scratch_bytes(&Op::Conv2d { window: w }, &[&x, &k], &dy);
        assert_eq!(forward, rows * 9 * 3 * 4);
        let input = Op::Conv2dBackpropInput { window: w, input: x.clone() };
        assert_eq!(conv_scratch_bytes(&input, &[&dy, &k], &x), forward);
        assert_eq!(conv_scratch_bytes(&Op::Conv2dBackpropFilter { window: w }, &[&x, &dy], &k), forward);
        assert_eq!(conv_scratch_bytes(&Op::Copy, &[&x], &x), 0);
    }
}
