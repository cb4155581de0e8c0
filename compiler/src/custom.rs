//! Custom ops: a user's operation, registered once by name and used in the DSL like any op
//! (`Tensor::custom`). The graph holds only its name (`Op::Custom`), so graphs and plans stay
//! plain data; everything else comes from the registered definition (`CustomOp`):
//!
//! - `infer`: the output's shape and dtype from the operands' (a refusal is a trace error that
//!   names the op, the operands and the caller's line, as for built-in ops);
//! - `cpu`: the CPU kernel, on f32 slices (the CPU backend's kernel, the eager and reference
//!   executors' too, and the reference the CUDA source is tested against on the host);
//! - `cuda`: CUDA C source and launch geometry as a function of the shapes, following the
//!   generated kernels' conventions (`extern "C" __global__ void f(const float* in0, ...,
//!   float* out)`), compiled by NVRTC on a GPU and built for the host on the emulated device;
//! - optionally `gradient`, written with the DSL's ops (other custom ops included),
//!   `in_place`: an operand the output may be written over (the planner then may alias them),
//!   and `scratch`: bytes its kernels use during its step only, planned in the arena like any
//!   buffer (`crate::scratch`) on every backend, and taken from the allocator around the op by
//!   the eager executors.
//!
//! A custom op is opaque to the compiler: fusion stops at it, autodiff calls its gradient, the
//! planner sizes its output like any op's, and plan dumps, the SVG and the memory report show it
//! by its name. This is TensorFlow's and PyTorch's model (ops registered by name in a process-wide
//! registry), without their build step: the definition is Rust code in the user's crate.

use crate::ir::{DType, Shape};
use crate::trace::Tensor;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock, RwLock};

/// A CUDA kernel for one set of shapes: one launch of `function` from `source`, its operands
/// `in0..` then `out` as parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CustomCuda {
    /// The kernel's CUDA C source, compiled by NVRTC.
    pub source: String,
    /// The name of the `__global__` function in `source` to launch.
    pub function: String,
    /// The launch's grid: blocks along x, y and z.
    pub grid: [u32; 3],
    /// The launch's block: threads along x, y and z.
    pub block: [u32; 3],
}

/// A user's op. Implement it, `register` it, and call it with `Tensor::custom`.
pub trait CustomOp: Send + Sync {
    /// The name it is registered and shown under.
    fn name(&self) -> &str;

    /// The output's shape and dtype for these operands, or why they are refused.
    fn infer(&self, operands: &[(&Shape, DType)]) -> Result<(Shape, DType), String>;

    /// Computes the output from the operands (f32, row-major, of the shapes `infer` accepted).
    fn cpu(&self, inputs: &[&[f32]], shapes: &[&Shape], output: &mut [f32]);

    /// The CUDA kernel for these shapes; `None` when the op has none (it then runs on the CPU only).
    fn cuda(&self, shapes: &[&Shape], output: &Shape) -> Option<CustomCuda> {
        let _ = (shapes, output);
        None
    }

    /// The gradients of the operands given the output `y` and its gradient `g`, written with
    /// the DSL's ops; `None` when the op has no gradient (training through it is then an error).
    fn gradient(&self, x: &[Tensor], y: &Tensor, g: &Tensor) -> Option<Vec<Option<Tensor>>> {
        let _ = (x, y, g);
        None
    }

    /// An operand of the output's shape that the output may be written over (every element read
    /// before it is written), if any.
    fn in_place(&self) -> Option<usize> {
        None
    }

    /// Bytes of scratch the kernels use for these shapes (0: none). The CPU kernel then runs
    /// through `cpu_with_scratch`, and the CUDA kernel takes a last pointer parameter after
    /// `out` (`float* scratch`, 16-byte aligned, its contents undefined at entry).
    fn scratch(&self, shapes: &[&Shape], output: &Shape) -> usize {
        let _ = (shapes, output);
        0
    }

    /// `cpu` with the op's scratch (`scratch` bytes, 16-byte aligned, undefined at entry); the
    /// default ignores it.
    fn cpu_with_scratch(&self, inputs: &[&[f32]], shapes: &[&Shape], output: &mut [f32], scratch: &mut [u8]) {
        let _ = scratch;
        self.cpu(inputs, shapes, output)
    }
}

/// The scratch bytes custom op `op` declares for these operands (0 for every other op, an
/// unregistered name or shapes it refuses).
pub fn declared_scratch(op: &crate::ir::Op, operands: &[(&Shape, DType)], output: &Shape) -> usize {
    let crate::ir::Op::Custom { name } = op else { return 0 };
    let Some(def) = lookup(name) else { return 0 };
    if def.infer(operands).is_err() {
        return 0;
    }
    let shapes: Vec<&Shape> = operands.iter().map(|&(s, _)| s).collect();
    def.scratch(&shapes, output)
}

fn registry() -> &'static RwLock<HashMap<String, Arc<dyn CustomOp>>> {
    static REGISTRY: OnceLock<RwLock<HashMap<String, Arc<dyn CustomOp>>>> = OnceLock::new();
    REGISTRY.get_or_init(|| RwLock::new(HashMap::new()))
}

/// Registers `op` under its name. Registering the same definition again is a no-op; another
/// definition under a taken name is an error (two meanings for one name in one process).
pub fn register(op: Arc<dyn CustomOp>) -> Result<(), String> {
    let name = op.name().to_string();
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(format!("custom op name {name:?}: use letters, digits and '_'"));
    }
    let mut r = registry().write().unwrap_or_else(|e| e.into_inner());
    match r.get(&name) {
        Some(existing) if Arc::ptr_eq(existing, &op) => Ok(()),
        Some(_) => Err(format!("a custom op named `{name}` is already registered with another definition")),
        None => {
            r.insert(name, op);
            Ok(())
        }
    }
}

/// The definition registered under `name`.
pub fn lookup(name: &str) -> Option<Arc<dyn CustomOp>> {
    registry().read().unwrap_or_else(|e| e.into_inner()).get(name).cloned()
}

/// The names registered, sorted (for error messages).
pub fn registered() -> Vec<String> {
    let mut v: Vec<String> = registry().read().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
    v.sort();
    v
}
