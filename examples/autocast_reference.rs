//! Writes the inputs of the mixed-precision numerics check for PyTorch, and turns PyTorch's runs
//! into the committed references (`kiln::autocast_reference`); `scripts/reference/autocast.sh`
//! runs it: `cargo run --release --example autocast_reference -- inputs DIR`, then
//! `... -- references DIR` once `scripts/reference/autocast.py DIR` has run.

use kiln::autocast_reference::{write_inputs, write_references};
use kiln::runtime::RuntimeError;

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [what, dir] if what == "inputs" => write_inputs(dir.as_ref()),
        [what, dir] if what == "references" => write_references(dir.as_ref()),
        _ => Err(RuntimeError::invalid(
            format!("autocast_reference {}", args.join(" ")),
            "pass `inputs DIR` or `references DIR`",
        )
        .into()),
    }
}
