//! Where a zoo model's training step (or forward pass) spends its time on the CPU: the wall time of a call, then
//! the 20 slowest steps (`CpuBackend::profile`, medians of 10 runs).
//! `cargo run --release --example profile_cpu -- cnn [ROWS] [forward]`
use kiln::compiler::step::{forward_graph, train_step_graph};
use kiln::prelude::*;
use kiln::runtime::CpuBackend;

fn main() -> Result<()> {
    let name = std::env::args().nth(1).unwrap_or_else(|| "cnn".into());
    let m = kiln::zoo::by_name(&name).expect("a zoo model");
    let forward = std::env::args().nth(3).is_some_and(|a| a == "forward");
    let graph = if forward {
        forward_graph(&m.model(), m.x_shape())?
    } else {
        train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config())?
    };
    let plan = compile(graph, &CompileOptions::default())?;
    let mut b = CpuBackend::new(0);
    let id = b.load(plan)?;
    let (x, y) = m.batch_data(1)?;
    let feeds: Vec<(&str, &kiln::runtime::HostTensor)> =
        if forward { vec![("x", &x)] } else { vec![("x", &x), ("y", &y)] };
    for _ in 0..3 {
        b.call(id, &feeds)?;
    }
    let start = std::time::Instant::now();
    for _ in 0..10 {
        b.call(id, &feeds)?;
    }
    println!("{name}: {:.2} ms per call (wall)", start.elapsed().as_secs_f64() * 100.0);
    let mut rows = b.profile(id, 10)?;
    let total: u64 = rows.iter().map(|r| r.1).sum();
    rows.sort_by_key(|r| std::cmp::Reverse(r.1));
    println!("{name}: {:.2} ms per step, kernels only (medians of 10 runs)", total as f64 / 1e6);
    for (what, ns) in rows.iter().take(std::env::args().nth(2).and_then(|n| n.parse().ok()).unwrap_or(20)) {
        println!("{:8.3} ms  {what}", *ns as f64 / 1e6);
    }
    Ok(())
}
