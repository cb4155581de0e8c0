//! The memory report: every figure computed from a plan (DESIGN.md defines them), as a table.

use kiln_compiler::Plan;
use std::fmt::Write;

/// The memory figures of one plan, in bytes.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct PlanMemory {
    /// The plan's name: its traced graph's (`Graph::name`), as the table's first column shows.
    pub plan: String,
    /// The sum of every intermediate buffer's aligned bytes: the arena with no reuse.
    pub naive_bytes: usize,
    /// The most bytes live at any one step of the plan's schedule: no arena of that schedule is
    /// smaller.
    pub lower_bound_bytes: usize,
    /// The planned arena's bytes (slots aligned to 64 bytes by default).
    pub arena_bytes: usize,
    /// The parameters' bytes (the model's weights).
    pub parameter_bytes: usize,
    /// The optimizer state's bytes (Adam's m and v, SGD's momentum, counters; 0 for a forward pass).
    pub optimizer_state_bytes: usize,
    /// The io region's bytes: the plan's inputs and outputs.
    pub io_bytes: usize,
    /// parameters + optimizer state + constants + io: the bytes outside the arena.
    pub persistent_bytes: usize,
    /// persistent + arena: everything the plan holds, exact.
    pub planned_total_bytes: usize,
    /// The plan's allocations (variable region, io, arena) each rounded to the device's 2 MiB.
    pub device_bytes: usize,
    /// The placement heuristic whose arena won.
    pub algorithm: String,
}

impl PlanMemory {
    /// Reads `plan`'s memory figures (its totals over every device).
    pub fn of(plan: &Plan) -> Self {
        let m = &plan.memory;
        PlanMemory {
            plan: plan.name.clone(),
            naive_bytes: m.naive_bytes,
            lower_bound_bytes: m.lower_bound_bytes,
            arena_bytes: m.arena_bytes,
            parameter_bytes: m.parameter_bytes,
            optimizer_state_bytes: m.optimizer_state_bytes,
            io_bytes: m.io_bytes,
            persistent_bytes: m.persistent_bytes,
            planned_total_bytes: m.planned_total_bytes(),
            device_bytes: plan.device_bytes(kiln_compiler::plan::DEVICE_GRANULARITY),
            algorithm: m.algorithm.clone(),
        }
    }

    /// arena / lower bound (1.0 is optimal for this schedule).
    pub fn arena_over_bound(&self) -> f64 {
        ratio(self.arena_bytes, self.lower_bound_bytes)
    }

    /// naive / arena: how much reuse saved.
    pub fn naive_over_arena(&self) -> f64 {
        ratio(self.naive_bytes, self.arena_bytes)
    }
}

/// `a / b` as a float; 1.0 when both are 0 and infinity when only `b` is.
pub fn ratio(a: usize, b: usize) -> f64 {
    if b == 0 { if a == 0 { 1.0 } else { f64::INFINITY } } else { a as f64 / b as f64 }
}

/// Bytes with thousands separators: 1234567 -> "1,234,567".
pub fn bytes(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A table of plans' memory, one row a plan.
pub fn table(rows: &[PlanMemory]) -> String {
    let headers = [
        "plan",
        "persistent B",
        "params B",
        "opt state B",
        "io B",
        "arena B",
        "lower bound B",
        "naive B",
        "device B",
        "arena/bound",
        "naive/arena",
    ];
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.plan.clone(),
                bytes(r.persistent_bytes),
                bytes(r.parameter_bytes),
                bytes(r.optimizer_state_bytes),
                bytes(r.io_bytes),
                bytes(r.arena_bytes),
                bytes(r.lower_bound_bytes),
                bytes(r.naive_bytes),
                bytes(r.device_bytes),
                format!("{:.3}", r.arena_over_bound()),
                format!("{:.2}x", r.naive_over_arena()),
            ]
        })
        .collect();
    render_table(&headers, &cells)
}

/// Left-aligns the first column, right-aligns the rest.
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..headers.len())
        .map(|c| rows.iter().map(|r| r[c].len()).chain([headers[c].len()]).max().unwrap_or(0))
        .collect();
    let mut s = String::new();
    let line = |s: &mut String, cells: &[String]| {
        for (c, cell) in cells.iter().enumerate() {
            if c == 0 {
                let _ = write!(s, "{cell:<w$}", w = widths[c]);
            } else {
                let _ = write!(s, "  {cell:>w$}", w = widths[c]);
            }
        }
        s.push('\n');
    };
    line(&mut s, &headers.iter().map(|h| h.to_string()).collect::<Vec<_>>());
    let rule: Vec<String> = widths.iter().map(|&w| "-".repeat(w)).collect();
    line(&mut s, &rule);
    for r in rows {
        line(&mut s, r);
    }
    s
}

/// Where benchmarks and the CLI write machine-readable results: `KILN_OUT_DIR` if set, else
/// `<target dir>/kiln/`.
pub fn output_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("KILN_OUT_DIR") {
        return dir.into();
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("kiln")
}

/// The middle value of `values` (the upper of the two middle ones for an even count), NaN for
/// none: the figure every benchmark reports of its timed runs.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The positive count the environment variable `name` holds, else `default`: how benchmarks read
/// their rounds, runs and threads.
pub fn env_count(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).filter(|&n| n > 0).unwrap_or(default)
}
