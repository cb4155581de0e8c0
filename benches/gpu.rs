//! `cargo bench --bench gpu`: see `kiln::gpu_bench`. Where there is no CUDA device it says so and
//! exits cleanly.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    kiln::gpu_bench::run()
}
