//! `cargo bench --bench peers`: kiln's planned memory beside XLA's buffer assignment (JAX, CPU
//! backend) for the zoo's four models and three it was not tuned for (marked *), forward and
//! training step. Prints the table, the geometric mean of kiln / XLA over training steps and the
//! assumptions; writes `target/kiln/peers.json`. Without JAX (no python3, no network, no wheel)
//! it prints kiln's side, says "skipped" and exits 0.

use kiln::compare::Mode;
use kiln::peers::{self, PeerRow};
use kiln::report::output_dir;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let models = peers::all();
    let names: Vec<&str> = models.iter().map(|m| m.name).collect();

    let start = Instant::now();
    let xla = peers::xla_figures(&names)?;
    let xla_s = start.elapsed().as_secs_f64();

    let start = Instant::now();
    let mut rows = Vec::new();
    let mut checks = Vec::new();
    for m in &models {
        let x = xla.as_ref().and_then(|r| r.models.get(m.name));
        for mode in [Mode::Forward, Mode::Train] {
            let k = peers::kiln_figures(m, mode)?;
            if let Some(x) = x {
                // The same architecture on both sides: the same parameter bytes.
                if x.parameter_bytes != k.parameter_bytes {
                    checks.push(format!(
                        "MISMATCH {} {}: kiln has {} parameter bytes, the script {}",
                        m.name,
                        mode.name(),
                        k.parameter_bytes,
                        x.parameter_bytes
                    ));
                }
                // A donated Adam step: params, m, v and the counter are arguments and all reused.
                if mode == Mode::Train {
                    let state = 3 * x.parameter_bytes + 4;
                    let t = &x.train;
                    if t.alias_bytes != state || t.argument_bytes < state {
                        checks.push(format!(
                            "CHECK {} train: params + m + v + counter = {state} B, XLA argument {} B, alias {} B",
                            m.name, t.argument_bytes, t.alias_bytes
                        ));
                    }
                }
            }
            rows.push(PeerRow::new(m, mode, k, x.map(|x| x.mode(mode).clone())));
        }
    }
    let kiln_ms = start.elapsed().as_secs_f64() * 1e3;

    println!("{}", peers::table(&rows));
    match &xla {
        Some(r) => {
            println!(
                "XLA: jax {} / jaxlib {} ({} backend), figures in {xla_s:.1} s (any venv install included); kiln's 14 plans in {kiln_ms:.0} ms",
                r.jax, r.jaxlib, r.backend
            );
            let geomean = |keep: fn(&PeerRow) -> bool| {
                peers::train_geomean(&rows, keep).map_or("-".to_string(), |g| format!("{g:.3}"))
            };
            println!(
                "kiln / XLA, geometric mean over training steps: {} (zoo: {}, the three others: {})",
                geomean(|_| true),
                geomean(|r| r.in_zoo),
                geomean(|r| !r.in_zoo)
            );
            if checks.is_empty() {
                println!(
                    "checks: parameter bytes equal on both sides for every model; every train step's alias = params + m + v + counter"
                );
            }
            for c in &checks {
                println!("{c}");
            }
        }
        None => println!("XLA: skipped (JAX could not be had); kiln's side only"),
    }
    println!("* not in kiln's zoo\n{}", peers::ASSUMPTIONS);

    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    let doc = serde_json::json!({
        "jax": xla.as_ref().map(|r| r.jax.clone()),
        "jaxlib": xla.as_ref().map(|r| r.jaxlib.clone()),
        "backend": xla.as_ref().map(|r| r.backend.clone()),
        "train_geomean_kiln_over_xla": peers::train_geomean(&rows, |_| true),
        "train_geomean_kiln_over_xla_zoo": peers::train_geomean(&rows, |r| r.in_zoo),
        "train_geomean_kiln_over_xla_others": peers::train_geomean(&rows, |r| !r.in_zoo),
        "checks": checks,
        "assumptions": peers::ASSUMPTIONS,
        "rows": rows,
    });
    kiln::results::write("peers", "cpu", &doc)?;
    Ok(())
}
