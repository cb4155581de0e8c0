//! `cargo bench --bench planner`: how compile time grows with graph size, from 1k to 100k nodes.
//! The graphs are training steps of deep MLPs (forward, backward, Adam), traced and
//! differentiated like any model; the figure held is the whole `compile` (passes, schedule,
//! liveness, placement, lowering, validation) of the 100k-node graph: goal under one second.
//! Writes `target/kiln/planner.json`.

use kiln::compiler::ir::Shape;
use kiln::compiler::liveness::{self, StorageClass};
use kiln::compiler::planner::{self, Interval};
use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::report::{output_dir, render_table};
use std::time::Instant;

#[derive(serde::Serialize)]
struct Row {
    layers: usize,
    nodes: usize,
    steps: usize,
    arena_buffers: usize,
    compile_ms: f64,
    optimize_ms: f64,
    liveness_ms: f64,
    place_ms: f64,
    arena_bytes: usize,
    lower_bound_bytes: usize,
}

fn deep_mlp(layers: usize) -> Sequential {
    let mut m = Sequential::new();
    for i in 0..layers {
        // Widths vary so that buffers come in several sizes.
        m.push(Dense::new(16 + 16 * (i % 4)).relu());
    }
    m.push(Dense::new(1).sigmoid());
    m
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = kiln::zoo::seed_config();
    let mut rows = Vec::new();
    for layers in [60, 120, 600, 1200, 6250] {
        let model = deep_mlp(layers);
        let graph = train_step_graph(&model, Shape::from([32, 64]), Shape::from([32, 1]), &config)?;
        let nodes = graph.len();
        let repeats = if nodes > 50_000 { 3 } else { 7 };
        let (mut total, mut opt, mut live, mut place) = (vec![], vec![], vec![], vec![]);
        let mut last = None;
        for _ in 0..repeats {
            let t = Instant::now();
            let plan = compile(graph.clone(), &CompileOptions::default())?;
            total.push(t.elapsed().as_secs_f64() * 1e3);

            let t = Instant::now();
            let s = kiln::compiler::optimize(graph.clone())?;
            opt.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let l = liveness::analyze(&s.graph, &s.order, &kiln::compiler::scratch::Scratch::none())?;
            live.push(t.elapsed().as_secs_f64() * 1e3);
            let intervals: Vec<Interval> = l
                .buffers
                .iter()
                .filter(|b| b.class == StorageClass::Arena)
                .map(|b| Interval { bytes: b.bytes, start: b.start, end: b.end })
                .collect();
            let t = Instant::now();
            planner::place(&intervals, 256);
            place.push(t.elapsed().as_secs_f64() * 1e3);
            last = Some((plan, intervals.len()));
        }
        let (plan, buffers) = last.expect("repeats > 0");
        rows.push(Row {
            layers,
            nodes,
            steps: plan.steps.len(),
            arena_buffers: buffers,
            compile_ms: median(total),
            optimize_ms: median(opt),
            liveness_ms: median(live),
            place_ms: median(place),
            arena_bytes: plan.memory.arena_bytes,
            lower_bound_bytes: plan.memory.lower_bound_bytes,
        });
    }
    let headers = [
        "layers",
        "nodes",
        "steps",
        "arena buffers",
        "compile ms",
        "passes+schedule ms",
        "liveness ms",
        "place ms",
        "arena/bound",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.layers.to_string(),
                r.nodes.to_string(),
                r.steps.to_string(),
                r.arena_buffers.to_string(),
                format!("{:.1}", r.compile_ms),
                format!("{:.1}", r.optimize_ms),
                format!("{:.1}", r.liveness_ms),
                format!("{:.1}", r.place_ms),
                format!("{:.3}", kiln::report::ratio(r.arena_bytes, r.lower_bound_bytes)),
            ]
        })
        .collect();
    println!("{}", render_table(&headers, &cells));
    let (first, last) = (&rows[0], &rows[rows.len() - 1]);
    let growth = (last.compile_ms / first.compile_ms).ln() / (last.nodes as f64 / first.nodes as f64).ln();
    println!(
        "compile of {} nodes: {:.0} ms (goal < 1000 ms: {}); time grows as nodes^{growth:.2} from {} to {} nodes",
        last.nodes,
        last.compile_ms,
        if last.compile_ms < 1000.0 { "met" } else { "MISSED" },
        first.nodes,
        last.nodes
    );
    let dir = output_dir();
    std::fs::create_dir_all(&dir)?;
    kiln::results::write("planner", "cpu", &rows)?;
    Ok(())
}
