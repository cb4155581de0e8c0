//! The all-reduce's cost: `cargo run --release -p kiln-comm --example bench` times 2 in-process
//! ranks; with `--features mpi`, `mpirun -np 2 target/release/examples/bench mpi` times 2 MPI
//! ranks. Median of 15 calls after 3 warm-up calls, for 1, 1M and 16M floats, with a plain copy of the
//! same buffer (one thread) and, under MPI, MPI's own `MPI_Allreduce(MPI_SUM)` for scale.

use std::time::{Duration, Instant};

use kiln_comm::{Communicator, local_group};

const LENGTHS: [usize; 3] = [1, 1 << 20, 16 << 20];
const CALLS: usize = 15;
const WARM_UP: usize = 3;

/// Median time of `CALLS` all-reduces of `len` floats on `comm` (after `WARM_UP` calls).
fn time_all_reduce(comm: &mut dyn Communicator, len: usize) -> Duration {
    let mut buf = vec![1.0f32; len];
    for _ in 0..WARM_UP {
        comm.all_reduce_sum(&mut buf).expect("warm-up all-reduce");
    }
    let mut times: Vec<Duration> = (0..CALLS)
        .map(|_| {
            comm.barrier().expect("barrier");
            let start = Instant::now();
            comm.all_reduce_sum(&mut buf).expect("all-reduce");
            start.elapsed()
        })
        .collect();
    times.sort();
    times[CALLS / 2]
}

fn copy_time(len: usize) -> Duration {
    let src = vec![1.0f32; len];
    let mut dst = vec![0.0f32; len];
    dst.copy_from_slice(&src);
    let mut times: Vec<Duration> = (0..CALLS)
        .map(|_| {
            let start = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&dst);
            start.elapsed()
        })
        .collect();
    times.sort();
    times[CALLS / 2]
}

fn report(engine: &str, size: usize, len: usize, t: Duration) {
    let gbs = (len * 4) as f64 / t.as_secs_f64() / 1e9;
    println!(
        "{engine:>7} {size} ranks {len:>9} floats ({:>5.1} MiB): {:>9.3} ms  ({gbs:.2} GB/s of buffer)",
        (len * 4) as f64 / (1 << 20) as f64,
        t.as_secs_f64() * 1e3
    );
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("mpi") {
        run_mpi();
        return;
    }
    for len in LENGTHS {
        let t = copy_time(len);
        report("copy", 1, len, t);
    }
    for len in LENGTHS {
        let times = std::thread::scope(|s| {
            let handles: Vec<_> = local_group(2)
                .into_iter()
                .map(|mut c| s.spawn(move || time_all_reduce(&mut c, len)))
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank panicked")).collect::<Vec<_>>()
        });
        report("local", 2, len, times.into_iter().max().unwrap_or_default());
    }
}

#[cfg(feature = "mpi")]
fn run_mpi() {
    let mut comm = kiln_comm::MpiComm::world().expect("MPI");
    for len in LENGTHS {
        let t = time_all_reduce(&mut comm, len);
        report_slowest(&mut comm, "mpi", len, t);
    }
    // For scale: MPI's own MPI_Allreduce with MPI_SUM, whose order of additions is not ours.
    use mpi::traits::*;
    let world = mpi::topology::SimpleCommunicator::world();
    for len in LENGTHS {
        let (send, mut recv) = (vec![1.0f32; len], vec![0.0f32; len]);
        let mut times: Vec<Duration> = (0..WARM_UP + CALLS)
            .map(|_| {
                world.barrier();
                let start = Instant::now();
                world.all_reduce_into(&send[..], &mut recv[..], mpi::collective::SystemOperation::sum());
                start.elapsed()
            })
            .skip(WARM_UP)
            .collect();
        times.sort();
        report_slowest(&mut comm, "MPI_SUM", len, times[CALLS / 2]);
    }
}

/// Reports, from rank 0, the slowest rank's time: the collective's.
#[cfg(feature = "mpi")]
fn report_slowest(comm: &mut kiln_comm::MpiComm, engine: &str, len: usize, t: Duration) {
    let mut all = vec![0.0f32; comm.size()];
    comm.all_gather(&[t.as_secs_f32()], &mut all).expect("gather times");
    let slowest = all.iter().copied().fold(0.0, f32::max);
    if comm.rank() == 0 {
        report(engine, comm.size(), len, Duration::from_secs_f32(slowest));
    }
}

#[cfg(not(feature = "mpi"))]
fn run_mpi() {
    eprintln!("bench: built without MPI: add --features mpi");
    std::process::exit(2);
}
