//! `cargo bench --bench memory`: planned against eager memory for every zoo model, forward and
//! training step. Prints a table and the goals, writes `target/kiln/memory.json` and one SVG per
//! model and mode. `--simulate` replays the eager allocations without computing (same figures,
//! faster).

use kiln::compare::{Comparison, Goals, Mode, compare, framework_table, table};
use kiln::report::output_dir;
use kiln::{svg, zoo};
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let simulate = std::env::args().any(|a| a == "--simulate");
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    let mut rows: Vec<Comparison> = Vec::new();
    for m in zoo::all() {
        for mode in [Mode::Forward, Mode::Train] {
            let start = Instant::now();
            let row = compare(&m, mode, !simulate)?;
            eprintln!("{} {}: {:.1} s", m.name, mode.name(), start.elapsed().as_secs_f64());
            let title = format!("{} {} (batch {})", m.name, mode.name(), m.batch);
            let path = dir.join(format!("{}-{}.svg", m.name, mode.name()));
            std::fs::write(&path, svg::plan_svg(&row.plan, Some(&row.bfc_samples), &title))?;
            rows.push(row);
        }
    }
    // JAX/XLA's figures for the same steps (a venv under target/kiln; "skipped" without one).
    let names: Vec<&str> = zoo::all().iter().map(|m| m.name).collect();
    if let Some(xla) = kiln::peers::xla_figures(&names)? {
        for row in &mut rows {
            if let Some(m) = xla.models.get(&row.model) {
                row.xla_total_bytes = Some(m.mode(row.mode).total_bytes);
            }
        }
    }
    println!("{}", table(&rows));
    println!("framework columns (kiln's eager op stream with what each framework adds on a GPU):");
    println!("{}", framework_table(&rows));
    println!("{}", kiln::compare::FRAMEWORK_ASSUMPTIONS);
    print!("{}", Goals::of(&rows).render());
    kiln::results::write("memory", "cpu", &rows)?;
    println!("wrote {} SVGs in {}", rows.len(), dir.display());
    Ok(())
}
