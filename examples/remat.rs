//! Rematerialization: a zoo training step compiled under a memory limit of its persistent bytes
//! plus half its unconstrained arena, trained beside the unconstrained plan on the CPU backend.
//! Prints both planned totals, what was recomputed, both runs' losses side by side (they must be
//! bit-identical) and the step-time overhead (median of the steps).
//!
//! `cargo run --release --example remat [-- MODEL [FRACTION [STEPS]]]` (default: transformer 0.5
//! 10). The transformer is the zoo model where half the arena can be reached: the cnn's first
//! max-pool gradient reads an activation and writes one of the same size, together over half its
//! arena (it fits from 0.6), and the mlp's first weight gradient with its operands is over half
//! of its (weight-sized buffers, nothing to recompute).

use kiln::compiler::device::human_bytes;
use kiln::report::bytes;
use kiln::zoo;

fn main() -> kiln::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("transformer", String::as_str);
    let fraction: f64 = args.get(1).and_then(|f| f.parse().ok()).unwrap_or(0.5);
    let steps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(10).max(1);
    let m = zoo::by_name(name).ok_or_else(|| {
        kiln::runtime::RuntimeError::invalid(
            format!("no zoo model {name:?}"),
            "name one of seed-mlp, mlp, cnn, transformer",
        )
    })?;
    let r = kiln::remat::run(&m, fraction, steps)?;
    println!(
        "{name} training step (batch {}), CPU backend; limit = persistent + {fraction} x unconstrained arena = {} B ({})",
        r.batch,
        bytes(r.limit_bytes),
        human_bytes(r.limit_bytes)
    );
    println!("{:<18} {:>14} {:>14} {:>15}", "", "persistent B", "arena B", "planned total B");
    println!(
        "{:<18} {:>14} {:>14} {:>15}   compiled in {:.1} ms",
        "unconstrained",
        bytes(r.persistent_bytes),
        bytes(r.free_arena_bytes),
        bytes(r.free_total_bytes),
        r.free_compile_ms
    );
    let (Some(arena), Some(total)) = (r.limited_arena_bytes, r.limited_total_bytes) else {
        println!("under the limit: does not fit\n{}", r.error.unwrap_or_default());
        return Ok(());
    };
    println!(
        "{:<18} {:>14} {:>14} {:>15}   compiled in {:.1} ms ({:.2}x the arena)",
        "under the limit",
        bytes(r.persistent_bytes),
        bytes(arena),
        bytes(total),
        r.limited_compile_ms,
        arena as f64 / r.free_arena_bytes as f64
    );
    if let Some(f) = &r.remat {
        println!("rematerialization: {}", f.summary());
        println!("  recomputed: {}", f.recomputed.join(", "));
    }
    println!("{:>4}  {:>20}  {:>20}", "step", "loss unconstrained", "loss under the limit");
    for (i, (a, b)) in r.free_losses.iter().zip(&r.limited_losses).enumerate() {
        println!("{:>4}  {a:>20}  {b:>20}", i + 1);
    }
    println!("losses and every variable bit-identical: {}", if r.bit_identical { "yes" } else { "NO" });
    println!(
        "median step time over {steps} steps: {:.2} ms unconstrained, {:.2} ms under the limit ({:.2}x)",
        r.free_step_ms, r.limited_step_ms, r.step_time_ratio
    );
    let met = r.bit_identical && fraction <= 0.5 && r.step_time_ratio <= 1.35;
    println!(
        "goal (fits in 0.5 x its arena, step time <= 1.35x, bit-identical): {}",
        if met {
            "met"
        } else if fraction > 0.5 {
            "not measured (fraction above 0.5)"
        } else {
            "MISSED"
        }
    );
    Ok(())
}
