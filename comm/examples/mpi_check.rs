//! The collectives' checks across the ranks of `MPI_COMM_WORLD` (run by `scripts/test-mpi.sh`):
//!
//! ```text
//! mpirun --allow-run-as-root --oversubscribe -np 3 target/debug/examples/mpi_check
//! ```
//!
//! Rank 0 prints one line per check (with the ranks where it failed); exits non-zero on any
//! failure. With `--die-rank R`, `--leave-rank R` or `--panic-rank R`, rank R instead exits with
//! status 3, returns normally from `main` or panics while the others wait in an all-reduce:
//! `mpirun` must then end the job, non-zero, instead of hanging.

#[path = "../tests/common/mod.rs"]
mod common;

use kiln_comm::{Communicator, MpiComm};

fn main() {
    let mut comm = match MpiComm::world() {
        Ok(comm) => comm,
        Err(e) => {
            eprintln!("mpi_check: {e}");
            std::process::exit(2);
        }
    };
    let args: Vec<String> = std::env::args().collect();
    if let [_, mode, doomed] = args.as_slice() {
        let doomed: usize =
            doomed.parse().expect("usage: mpi_check [--die-rank|--leave-rank|--panic-rank R]");
        if comm.rank() == doomed {
            match mode.as_str() {
                "--die-rank" => {
                    eprintln!("rank {doomed}: exiting with status 3 on purpose");
                    std::process::exit(3);
                }
                "--leave-rank" => {
                    eprintln!("rank {doomed}: returning from main on purpose");
                    return;
                }
                "--panic-rank" => panic!("rank {doomed}: panicking on purpose"),
                _ => panic!("unknown mode {mode}"),
            }
        }
        let res = comm.all_reduce_sum(&mut [1.0; 16]);
        eprintln!("rank {}: all_reduce_sum returned {res:?} although rank {doomed} is gone", comm.rank());
        comm.abort(4);
    }

    let (rank, size) = (comm.rank(), comm.size());
    let mut outcomes = common::check_collectives(&mut comm);
    outcomes.extend(common::check_mistakes(&mut comm));

    // Every rank ran the same checks: gather each check's pass/fail flags to rank 0's report.
    let mut failed = 0;
    for (name, res) in &outcomes {
        let mut flags = vec![0.0f32; size];
        let mine = [if res.is_ok() { 1.0 } else { 0.0 }];
        if let Err(e) = comm.all_gather(&mine, &mut flags) {
            eprintln!("rank {rank}: gathering the results failed: {e}");
            comm.abort(5);
        }
        if let Err(e) = res {
            eprintln!("rank {rank}: {name}: {e}");
        }
        let bad: Vec<usize> = (0..size).filter(|&r| flags[r] != 1.0).collect();
        if !bad.is_empty() {
            failed += 1;
        }
        if rank == 0 {
            if bad.is_empty() {
                println!("ok      {name} ({size} ranks)");
            } else {
                println!("FAILED  {name} on ranks {bad:?}");
            }
        }
    }
    if rank == 0 {
        println!("{} passed, {failed} failed", outcomes.len() - failed);
    }
    drop(comm);
    if failed > 0 {
        std::process::exit(1);
    }
}
