//! Data-parallel training across processes: every MPI rank trains the zoo's mlp on its shard of
//! each batch, the gradients averaged over the ranks inside the plan (`Op::AllReduce`).
//!
//! ```text
//! bash scripts/setup-mpi.sh                      # Debian's OpenMPI, once
//! cargo build --release --features mpi --example mpi_train
//! mpirun -np 2 target/release/examples/mpi_train
//! ```
//!
//! With `--zero 1` or `--zero 2` the optimizer (SGD with momentum then) keeps its state sharded
//! over the ranks (`kiln_compiler::zero`: reduce-scatter or all-reduce, a sharded update, an
//! all-gather of the weights), every collective carried by MPI.
//!
//! With `--cuda` each rank trains on CUDA device `rank` (one rank per GPU; under
//! `KILN_CUDA_EMULATE=1`, an emulated device of its own): the collectives (all-reduces, and with
//! ZeRO reduce-scatters and all-gathers) run through host memory and MPI
//! (`CudaBackend::with_communicator`), the sharded updates on the device. `--nccl` runs them in
//! device memory through NCCL instead (`CudaBackend::with_nccl`; one GPU per rank, not on the
//! emulated device).
//!
//! Each rank checks that the ranks' weights are bitwise identical after every step
//! (`Communicator::agree` on a digest of them), and rank 0 trains the same steps on the whole
//! batch in one process and checks that the weights agree within float summation tolerance.
//! Exits non-zero on any failure.

use kiln::comm::{Communicator, MpiComm};
use kiln::compiler::ir::Shard;
use kiln::compiler::optim::{Optimizer, Sgd};
use kiln::compiler::step::{TrainConfig, train_step_graph};
use kiln::compiler::zero::{ZeroStage, for_rank, shard_optimizer_state};
use kiln::prelude::*;
use kiln::runtime::cuda::CudaBackend;
use kiln::runtime::{Backend, CpuBackend, HostTensor};
use std::time::Instant;

const PER_RANK: usize = 16;
const STEPS: u64 = 5;

fn params(backend: &dyn Backend, plan: &kiln::compiler::Plan) -> Vec<f32> {
    plan.variables
        .iter()
        .filter(|v| !v.key.starts_with("optimizer/"))
        .flat_map(|v| backend.read_variable(&v.key).expect("a variable of the plan").data().to_vec())
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let comm = MpiComm::world()?;
    let (rank, ranks) = (comm.rank(), comm.size());
    let args: Vec<String> = std::env::args().collect();
    let stage = match args.iter().position(|a| a == "--zero") {
        Some(i) => args
            .get(i + 1)
            .and_then(|n| n.parse().ok())
            .and_then(ZeroStage::from_number)
            .ok_or("--zero takes 0, 1 or 2")?,
        None => ZeroStage::Off,
    };
    let nccl = args.iter().any(|a| a == "--nccl");
    let cuda = nccl || args.iter().any(|a| a == "--cuda");
    let m = kiln::zoo::by_name("mlp").ok_or("no zoo mlp")?;
    // With ZeRO, an optimizer with state to shard (SGD's velocity).
    let sgd = if stage == ZeroStage::Off { Sgd::new(0.05) } else { Sgd::new(0.05).momentum(0.9) };
    let cfg = TrainConfig { optimizer: Optimizer::Sgd(sgd), ..m.config() };
    let batch = PER_RANK * ranks;
    let data: Vec<(HostTensor, HostTensor)> =
        (0..STEPS).map(|i| m.clone().with_batch(batch).batch_data(100 + i)).collect::<Result<_, _>>()?;

    let shard = m.clone().with_batch(PER_RANK);
    let mut graph = train_step_graph(&shard.model(), shard.x_shape(), shard.y_shape(), &cfg)?;
    shard_optimizer_state(&mut graph, stage, Shard { ranks, rank: 0 })?;
    let reduces = graph.node_ids().filter(|&n| graph.node(n).op.is_collective()).count();
    let mut backend: Box<dyn Backend> = if cuda {
        // One rank per GPU; each process's emulated device is ordinal 0 of its own.
        let ordinal = if kiln::runtime::cuda::probe().emulated { 0 } else { rank };
        let device = CudaBackend::new(ordinal, 7)?;
        Box::new(if nccl { device.with_nccl(comm)? } else { device.with_communicator(comm) })
    } else {
        Box::new(CpuBackend::new(7).with_communicator(comm))
    };
    let options = CompileOptions::default().with_scratch(backend.scratch_rule());
    let plan = for_rank(compile(graph, &options)?, rank)?;
    let shared = backend.communicator().ok_or("the backend has its communicator")?;
    let id = backend.load(plan.clone())?;
    let t = Instant::now();
    for (step, (x, y)) in data.iter().enumerate() {
        let rows = rank * PER_RANK..(rank + 1) * PER_RANK;
        let (x, y) = (x.rows(rows.clone())?, y.rows(rows)?);
        let out = backend.call(id, &[("x", &x), ("y", &y)])?;
        let bits: Vec<u8> = params(backend.as_ref(), &plan).iter().flat_map(|v| v.to_le_bytes()).collect();
        shared
            .lock()
            .map_err(|_| "communicator lock")?
            .agree(&format!("the weights after step {step}"), &bits)?;
        if rank == 0 {
            let loss = out.iter().find(|(n, _)| n == "loss").map_or(f32::NAN, |(_, t)| t.data()[0]);
            println!("step {step}: rank 0 loss {loss:.6}, weights identical on {ranks} ranks");
        }
    }
    let elapsed = t.elapsed();
    if rank == 0 {
        let whole = m.clone().with_batch(batch);
        let plan1 = compile(
            train_step_graph(&whole.model(), whole.x_shape(), whole.y_shape(), &cfg)?,
            &CompileOptions::default(),
        )?;
        let mut one = CpuBackend::new(7);
        let id1 = one.load(plan1.clone())?;
        for (x, y) in &data {
            one.call(id1, &[("x", x), ("y", y)])?;
        }
        let (a, b) = (params(backend.as_ref(), &plan), params(&one, &plan1));
        let scale = b.iter().fold(1e-3f32, |s, v| s.max(v.abs()));
        let worst = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0.0f32, f32::max);
        println!(
            "{ranks} ranks x batch {PER_RANK} on {} (ZeRO stage {}, {reduces} collectives a step, {STEPS} steps in {:.1} ms) vs 1 process x batch {batch}: largest weight difference {worst:e} (scale {scale:e})",
            backend.describe(),
            stage.number(),
            elapsed.as_secs_f64() * 1e3
        );
        // The CUDA kernels sum in other orders than the CPU's (`tests/gpu.rs`'s tolerance).
        let tolerance = if cuda { 2e-4 } else { 1e-5 };
        if worst > tolerance * scale {
            return Err(format!("the ranks' weights are {worst} from one process's").into());
        }
        println!("ok");
    }
    Ok(())
}
