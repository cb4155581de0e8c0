//! `cargo bench --bench remat`: zoo training steps under a memory limit of persistent + a fraction
//! of the unconstrained arena, recomputing values to fit (`kiln::remat`), beside the unconstrained
//! plans on the CPU backend. Goal: the transformer fits in 0.5 x its arena with a step time at
//! most 1.35x, bit-identical. The cnn is measured at 0.6 (its first max-pool gradient alone is
//! over half its arena) and every zoo training step at 0.75. Writes `target/kiln/remat.json`.

use kiln::report::{bytes, render_table};
use kiln::zoo;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runs = [
        ("transformer", 0.5),
        ("cnn", 0.6),
        ("seed-mlp", 0.75),
        ("mlp", 0.75),
        ("cnn", 0.75),
        ("transformer", 0.75),
    ];
    let mut results = Vec::new();
    for (name, fraction) in runs {
        let m = zoo::by_name(name).ok_or("zoo model missing")?;
        results.push(kiln::remat::run(&m, fraction, 21)?);
    }
    let headers = [
        "model",
        "limit",
        "arena",
        "under limit",
        "ratio",
        "values",
        "ops",
        "MFLOP/step",
        "compile ms",
        "step ms",
        "remat ms",
        "time",
        "identical",
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            let f = r.remat.clone().unwrap_or_default();
            let fits = r.limited_arena_bytes.is_some();
            vec![
                r.model.clone(),
                format!("{} x arena", r.fraction),
                bytes(r.free_arena_bytes),
                r.limited_arena_bytes.map_or("does not fit".into(), bytes),
                r.limited_arena_bytes
                    .map_or("-".into(), |a| format!("{:.2}", a as f64 / r.free_arena_bytes as f64)),
                if fits { f.recomputed.len().to_string() } else { "-".into() },
                if fits { f.recomputed_ops.to_string() } else { "-".into() },
                if fits { format!("{:.1}", f.recomputed_flops as f64 / 1e6) } else { "-".into() },
                format!("{:.1}", r.limited_compile_ms),
                if fits { format!("{:.2}", r.free_step_ms) } else { "-".into() },
                if fits { format!("{:.2}", r.limited_step_ms) } else { "-".into() },
                if fits { format!("{:.2}x", r.step_time_ratio) } else { "-".into() },
                if fits { r.bit_identical.to_string() } else { "-".into() },
            ]
        })
        .collect();
    println!("{}", render_table(&headers, &rows));
    let mut smallest = Vec::new();
    for m in zoo::all() {
        let found = kiln::remat::smallest_fraction(&m)?;
        match found {
            Some((f, arena, free)) => {
                println!(
                    "{}: fits down to {f:.2} x its arena ({} of {} B)",
                    m.name,
                    bytes(arena),
                    bytes(free)
                )
            }
            None => println!("{}: does not fit in 0.95 x its arena", m.name),
        }
        smallest.push(serde_json::json!({ "model": m.name, "smallest_fraction": found.map(|f| f.0), "arena_bytes": found.map(|f| f.1) }));
    }
    let goal = &results[0];
    let met = goal.limited_arena_bytes.is_some() && goal.bit_identical && goal.step_time_ratio <= 1.35;
    println!(
        "goal transformer fits in 0.5 x its arena, step time <= 1.35x, bit-identical: {:.2}x ({})",
        goal.step_time_ratio,
        if met { "met" } else { "MISSED" }
    );
    let all_identical = results.iter().all(|r| r.limited_arena_bytes.is_none() || r.bit_identical);
    println!("every plan that fits computes bit-identical losses and variables: {all_identical}");
    let dir = kiln::report::output_dir();
    std::fs::create_dir_all(&dir)?;
    let json = serde_json::json!({ "runs": results, "smallest_fractions": smallest });
    kiln::results::write("remat", "cpu", &json)?;
    Ok(())
}
