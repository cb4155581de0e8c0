//! Collectives in a plan (`Op::AllReduce`), run by a communicator the backend holds
//! (`kiln_comm::Communicator`: in-process ranks, or MPI). The planner placed the buffer and the
//! step; the kernel hands the communicator that buffer, in place, and scales a mean.
//!
//! Before a plan with collectives runs, every rank must hold the same plan: `agree_on_plan`
//! compares a fingerprint of it (steps, shapes, variables, inputs, outputs and kiln's version)
//! across the ranks, so that a rank compiled for another model or batch is refused with the
//! ranks that differ, instead of exchanging mismatched buffers.

use crate::error::{Result, RuntimeError};
use kiln_comm::Communicator;
use kiln_compiler::Plan;
use kiln_compiler::ir::ReduceOp;
use kiln_kernels::cpu::CpuKernel;
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex};

/// A communicator shared by a backend's collective steps.
pub type SharedComm = Arc<Mutex<Box<dyn Communicator>>>;

/// A digest of what every rank must agree on: the plan's steps (ops, operands, labels), values,
/// variables, inputs, outputs, and kiln's version.
pub fn plan_fingerprint(plan: &Plan) -> Vec<u8> {
    let mut h = Sha256::new();
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(
        format!("{:?}", (&plan.steps, &plan.values, &plan.variables, &plan.inputs, &plan.outputs)).as_bytes(),
    );
    h.finalize().to_vec()
}

/// Checks with every rank that they loaded the same plan (`Communicator::agree`).
pub fn agree_on_plan(plan: &Plan, comm: &SharedComm) -> Result<()> {
    let mut c = comm.lock().map_err(|_| poisoned())?;
    c.agree(&format!("plan {:?}", plan.name), &plan_fingerprint(plan)).map_err(|e| {
        RuntimeError::invalid(
            format!("the ranks did not load the same plan: {e}"),
            "compile the same model, batch and options on every rank, with the same kiln",
        )
    })
}

fn poisoned() -> RuntimeError {
    RuntimeError::invalid(
        "the communicator's lock is poisoned: a collective panicked on another thread",
        "restart the run from its last checkpoint",
    )
}

/// The CPU kernel of `Op::AllReduce` over `n` f32 elements.
pub struct AllReduceKernel {
    comm: SharedComm,
    n: usize,
    mean: bool,
    failure: Mutex<Option<String>>,
}

impl AllReduceKernel {
    pub fn new(comm: SharedComm, op: ReduceOp, n: usize) -> Self {
        AllReduceKernel { comm, n, mean: op == ReduceOp::Mean, failure: Mutex::new(None) }
    }

    fn fail(&self, why: String) {
        if let Ok(mut f) = self.failure.lock() {
            *f = Some(why);
        }
    }
}

impl CpuKernel for AllReduceKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        let (input, out) = (inputs[0] as *const f32, output as *mut f32);
        // SAFETY: the executor's contract (`CpuKernel::run`): the operand and the output hold `n`
        // f32s each (the op's shape rule makes them one shape), and the output is either the
        // operand's own buffer (planned in place, `Op::may_write_over`) or a buffer that does
        // not overlap it; no other step runs meanwhile, so this is the only reference.
        let buf = unsafe {
            if !std::ptr::eq(input, out) {
                std::ptr::copy_nonoverlapping(input, out, self.n);
            }
            std::slice::from_raw_parts_mut(out, self.n)
        };
        let mut comm = match self.comm.lock() {
            Ok(c) => c,
            Err(_) => return self.fail("the communicator's lock is poisoned".into()),
        };
        if let Err(e) = comm.all_reduce_sum(buf) {
            return self.fail(e.to_string());
        }
        if self.mean {
            let scale = 1.0 / comm.size() as f32;
            buf.iter_mut().for_each(|v| *v *= scale);
        }
    }

    fn describe(&self) -> String {
        format!("all_reduce[{}] {}", if self.mean { "mean" } else { "sum" }, self.n)
    }

    fn take_failure(&self) -> Option<String> {
        self.failure.lock().ok().and_then(|mut f| f.take())
    }
}
