//! Collectives in a plan (`Op::AllReduce`, and ZeRO's `Op::ReduceScatter` and `Op::AllGather`,
//! `kiln_compiler::zero`), run by a communicator the backend holds (`kiln_comm::Communicator`:
//! in-process ranks, or MPI). The planner placed the buffers and the step; the kernel hands the
//! communicator those buffers and scales a mean.
//!
//! Before a plan with collectives runs, every rank must hold the same plan: `agree_on_plan`
//! compares a fingerprint of it (steps, shapes, variables, inputs, outputs and kiln's version)
//! across the ranks, so that a rank compiled for another model or batch is refused with the
//! ranks that differ, instead of exchanging mismatched buffers.

use crate::error::{Result, RuntimeError};
use kiln_comm::Communicator;
use kiln_compiler::Plan;
use kiln_compiler::ir::{Op, ReduceOp, Shape};
use kiln_kernels::cpu::CpuKernel;
use sha2::{Digest, Sha256};
use std::sync::{Arc, Mutex};

/// A communicator shared by a backend's collective steps.
pub type SharedComm = Arc<Mutex<Box<dyn Communicator>>>;

/// A digest of what every rank must agree on: the plan's steps (ops, operands, labels), values,
/// variables, inputs, outputs, and kiln's version; the rank a ZeRO plan was specialised to
/// (`zero::for_rank`) left out, since that is what differs between the ranks' plans.
pub fn plan_fingerprint(plan: &Plan) -> Vec<u8> {
    let neutral;
    let plan = if kiln_compiler::zero::sharded_ranks(plan).is_some() {
        neutral = kiln_compiler::zero::rank_neutral(plan);
        &neutral
    } else {
        plan
    };
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

/// The error of loading a plan with collectives (step `label`) on a backend that is no rank;
/// `how` names the call that makes it one.
pub fn no_communicator(plan: &Plan, label: &str, how: &str) -> RuntimeError {
    RuntimeError::invalid(
        format!("plan {:?} has collectives (step `{label}`) but this backend has no communicator", plan.name),
        format!("make the backend a rank of the run: {how}"),
    )
}

fn poisoned() -> RuntimeError {
    RuntimeError::invalid(
        "the communicator's lock is poisoned: a collective panicked on another thread",
        "restart the run from its last checkpoint",
    )
}

/// Refuses a step whose shard was made for another rank or another group size than `comm`'s.
pub fn check_shard(op: &Op, label: &str, comm: &SharedComm) -> Result<()> {
    let Some(shard) = op.shard() else { return Ok(()) };
    let c = comm.lock().map_err(|_| poisoned())?;
    if shard.ranks != c.size() || shard.rank != c.rank() {
        return Err(RuntimeError::invalid(
            format!(
                "step `{label}` ({}) is rank {}'s of {} ranks, but this backend is rank {} of {}",
                op.label(),
                shard.rank,
                shard.ranks,
                c.rank(),
                c.size()
            ),
            "shard the step for the run's rank count and specialise the plan to each rank (`zero::for_rank`)",
        ));
    }
    Ok(())
}

/// The CPU kernel of a collective step (`Op::is_collective`) over operand 0 of shape `input`,
/// writing `output`.
pub fn kernel(op: &Op, comm: SharedComm, input: &Shape, output: &Shape) -> Box<dyn CpuKernel> {
    match *op {
        Op::ReduceScatter { op, shard } => Box::new(ReduceScatterKernel {
            comm,
            n: input.numel(),
            part: output.numel(),
            range: shard.range(input.numel()),
            mean: op == ReduceOp::Mean,
            failure: Mutex::new(None),
        }),
        Op::AllGather { shard } => Box::new(AllGatherKernel {
            comm,
            n: input.numel(),
            range: shard.range(input.numel()),
            failure: Mutex::new(None),
        }),
        Op::AllReduce { op } => Box::new(AllReduceKernel::new(comm, op, output.numel())),
        _ => unreachable!("`kernel` is called for collectives only"),
    }
}

/// The CPU kernel of `Op::AllReduce` over `n` f32 elements.
pub struct AllReduceKernel {
    comm: SharedComm,
    n: usize,
    mean: bool,
    failure: Mutex<Option<String>>,
}

impl AllReduceKernel {
    /// The all-reduce of `n` f32 elements through `comm`: a sum, or for `ReduceOp::Mean` the sum
    /// scaled by one over the rank count.
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
        // not overlap it; no other step touches these bytes meanwhile (run in line, or on the
        // communication thread while only steps touching other bytes run: `cpu::overlap`), so
        // this is the only reference.
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

fn record(failure: &Mutex<Option<String>>, why: String) {
    if let Ok(mut f) = failure.lock() {
        *f = Some(why);
    }
}

/// The CPU kernel of `Op::ReduceScatter`: `n` elements in, this rank's shard (`range`) of their
/// reduction out, padded with zeros to `part` elements.
struct ReduceScatterKernel {
    comm: SharedComm,
    n: usize,
    part: usize,
    range: std::ops::Range<usize>,
    mean: bool,
    failure: Mutex<Option<String>>,
}

impl CpuKernel for ReduceScatterKernel {
    unsafe fn run(&self, inputs: &[*mut u8], output: *mut u8) {
        // SAFETY: the executor's contract (`CpuKernel::run`): the operand holds `n` f32s and the
        // output `part` (the op's shape rule: `Shard::padded(n)`, at least the shard's length),
        // distinct buffers (a reduce-scatter is never planned in place); no other step touches
        // them meanwhile (in line, or overlapped only with steps on other bytes: `cpu::overlap`).
        let (input, out) = unsafe {
            (
                std::slice::from_raw_parts(inputs[0] as *const f32, self.n),
                std::slice::from_raw_parts_mut(output as *mut f32, self.part),
            )
        };
        let (shard, padding) = out.split_at_mut(self.range.len());
        padding.fill(0.0);
        let mut comm = match self.comm.lock() {
            Ok(c) => c,
            Err(_) => return record(&self.failure, "the communicator's lock is poisoned".into()),
        };
        if let Err(e) = comm.reduce_scatter_sum(input, shard) {
            return record(&self.failure, e.to_string());
        }
        if self.mean {
            let scale = 1.0 / comm.size() as f32;
            shard.iter_mut().for_each(|v| *v *= scale);
        }
    }

    fn describe(&self) -> String {
        format!(
            "reduce_scatter[{}] {} -> {}..{}",
            if self.mean { "mean" } else { "sum" },
            self.n,
            self.range.start,
            self.range.end
        )
    }

    fn take_failure(&self) -> Option<String> {
        self.failure.lock().ok().and_then(|mut f| f.take())
    }
}

/// The CPU kernel of `Op::AllGather`: every rank's shard of a variable of `n` elements into
/// every rank's variable, this rank's (`range`) copied to the step's scratch first.
struct AllGatherKernel {
    comm: SharedComm,
    n: usize,
    range: std::ops::Range<usize>,
    failure: Mutex<Option<String>>,
}

impl CpuKernel for AllGatherKernel {
    unsafe fn run(&self, inputs: &[*mut u8], _output: *mut u8) {
        // SAFETY: the executor's contract (`CpuKernel::run`): operand 0 is the variable, `n`
        // f32s, and operand 1 the step's scratch (`scratch::declared`: `Shard::padded(n)` f32s,
        // at least the shard's length), an arena buffer live at this step alone, so distinct
        // from the variable; no other step runs meanwhile (an all-gather runs in line, after
        // every collective in flight: `cpu::overlap`).
        let var = unsafe { std::slice::from_raw_parts_mut(inputs[0] as *mut f32, self.n) };
        // An empty shard has no scratch (a variable of fewer elements than ranks).
        let mine: &mut [f32] = match self.range.len() {
            0 => &mut [],
            // SAFETY: as above.
            len => unsafe { std::slice::from_raw_parts_mut(inputs[1] as *mut f32, len) },
        };
        mine.copy_from_slice(&var[self.range.clone()]);
        let mut comm = match self.comm.lock() {
            Ok(c) => c,
            Err(_) => return record(&self.failure, "the communicator's lock is poisoned".into()),
        };
        if let Err(e) = comm.all_gather(mine, var) {
            record(&self.failure, e.to_string());
        }
    }

    fn describe(&self) -> String {
        format!("all_gather {} from {}..{}", self.n, self.range.start, self.range.end)
    }

    fn take_failure(&self) -> Option<String> {
        self.failure.lock().ok().and_then(|mut f| f.take())
    }
}
