//! `cargo bench --bench gpu`: see `kiln::gpu_bench`. Where there is no CUDA device it says
//! "skipped: no CUDA device (<reason>)" on stderr and exits 0, since benchmarks run on CI machines
//! without a GPU; with `KILN_REQUIRE_GPU=1` it fails instead. (`kiln bench-gpu`, asked for
//! explicitly, always fails with status 2 when it skips.)

use kiln::gpu_bench::{Outcome, run};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(Outcome::Ran) => ExitCode::SUCCESS,
        Ok(skipped) => {
            eprintln!("{}", skipped.skip_message().unwrap_or_default());
            if std::env::var("KILN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                eprintln!("KILN_REQUIRE_GPU=1: a skip is a failure");
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
