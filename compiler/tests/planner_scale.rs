//! Scale: 1k, 10k and 100k intervals from generated training steps and a random mix plan correctly.
//! Times are printed, never asserted: `cargo test --release --test planner_scale -- --nocapture`.

use std::time::{Duration, Instant};

use kiln_compiler::planner::timeline::Timeline;
use kiln_compiler::planner::workloads::{TransformerDims, mlp_training, random_mix, transformer_training};
use kiln_compiler::planner::{Heuristic, Interval, best_fit, lower_bound, place, verify};

const ALIGN: usize = 256;

/// A transformer training step with about `n` intervals (29 per block).
fn transformer(n: usize, deferred_updates: bool) -> Vec<Interval> {
    let layers = n.div_ceil(29);
    transformer_training(TransformerDims {
        batch: 4,
        seq: 128,
        model: 256,
        heads: 4,
        layers,
        deferred_updates,
    })
}

/// An MLP training step with about `n` intervals (7 per layer), widths cycling 512..2048.
fn mlp(n: usize) -> Vec<Interval> {
    let dims: Vec<usize> = (0..=n.div_ceil(7)).map(|i| [512, 1024, 2048, 768][i % 4]).collect();
    mlp_training(32, &dims)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn run(name: &str, intervals: &[Interval]) {
    let t0 = Instant::now();
    let placement = place(intervals, ALIGN);
    let placed = t0.elapsed();
    let t1 = Instant::now();
    verify(intervals, &placement, ALIGN).unwrap();
    let verified = t1.elapsed();
    let bound = lower_bound(intervals, ALIGN);
    assert!(placement.arena_bytes >= bound.bytes);

    // Each heuristic alone, one after the other, with the index's work per buffer.
    let timeline = Timeline::new(intervals, ALIGN);
    let mut each = Vec::new();
    for h in Heuristic::ALL {
        let t = Instant::now();
        let fit = best_fit::place_in_order(&timeline, &h.order(&timeline));
        each.push(format!(
            "{} {:.1} ms {:.0} s/b",
            h.name(),
            ms(t.elapsed()),
            fit.search_steps as f64 / intervals.len() as f64
        ));
        if h.name() == placement.algorithm {
            assert_eq!(fit.offsets, placement.offsets);
        }
    }
    println!(
        "{name:<22} {:>6} intervals: place {:>7.1} ms, verify {:>5.1} ms, arena/bound {:.4} ({}); alone: {}",
        intervals.len(),
        ms(placed),
        ms(verified),
        placement.arena_bytes as f64 / bound.bytes as f64,
        placement.algorithm,
        each.join(", "),
    );
}

#[test]
fn plans_100k_intervals() {
    println!("(s/b: search work per buffer, see BestFit::search_steps)");
    for n in [1_000, 10_000, 100_000] {
        run("transformer", &transformer(n, false));
        // Unoptimized test builds check the 100k case on one workload only, to stay quick.
        if n < 100_000 || !cfg!(debug_assertions) {
            run("transformer, deferred", &transformer(n, true));
            run("mlp", &mlp(n));
            run("random mix, long<1000", &random_mix(n, 1_000, 7));
        }
    }
}
