//! A picture of a plan: the arena as a chart (x = plan step, y = offset, one rectangle per
//! buffer, its op on hover), and beside it, over the eager run's own ops (unfused, so more of
//! them than the plan has steps), what the eager allocator held from the device (reserved) and
//! what live tensors held (in use), against the plan's total.

use crate::report::bytes;
use kiln_compiler::Plan;
use kiln_compiler::plan::Storage;
use kiln_runtime::eager::MemorySample;
use std::fmt::Write;

const W: f64 = 560.0;
const H: f64 = 420.0;
const PAD: f64 = 56.0;

/// 1536 -> "1.5 KiB".
fn human(v: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = v;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 { format!("{v:.0} B") } else { format!("{v:.1} {}", units[u]) }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// A colour per op family, stable across plans.
fn colour(label: &str) -> &'static str {
    const PALETTE: [&str; 8] =
        ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f"];
    let op = label.split([' ', '`']).next().unwrap_or(label);
    let h = op.bytes().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(b as usize));
    PALETTE[h % PALETTE.len()]
}

fn axes(s: &mut String, x0: f64, title: &str, x_label: &str, top: usize) {
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        x0 + PAD,
        escape(title)
    );
    let _ = writeln!(
        s,
        r##"<rect x="{}" y="{PAD}" width="{W}" height="{H}" fill="none" stroke="#333"/>"##,
        x0 + PAD
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" font-size="12" text-anchor="middle">{}</text>"#,
        x0 + PAD + W / 2.0,
        PAD + H + 28.0,
        escape(x_label)
    );
    for i in 0..=4 {
        let v = top as f64 * i as f64 / 4.0;
        let y = PAD + H - H * i as f64 / 4.0;
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{y}" font-size="10" text-anchor="end">{}</text>"#,
            x0 + PAD - 4.0,
            human(v)
        );
    }
}

/// The SVG document for `plan`, with the eager samples beside it when given.
pub fn plan_svg(plan: &Plan, eager: Option<&[MemorySample]>, title: &str) -> String {
    let steps = plan.steps.len().max(1);
    // The first device's arena (a single-device plan's only one).
    let Some(first) = plan.devices.first() else { return String::new() };
    let m = &first.memory;
    let panels = if eager.is_some() { 2.0 } else { 1.0 };
    let width = panels * (W + 2.0 * PAD) + 20.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{}" font-family="sans-serif">"#,
        H + 2.0 * PAD + 20.0
    );
    let _ = writeln!(s, "<title>{}</title>", escape(title));

    // The arena: one rectangle per buffer.
    let top = m.arena_bytes.max(1);
    axes(
        &mut s,
        0.0,
        &format!("{title}: arena {} B (lower bound {} B)", bytes(m.arena_bytes), bytes(m.lower_bound_bytes)),
        &format!("plan step (0..{steps})"),
        top,
    );
    let sx = W / steps as f64;
    let sy = H / top as f64;
    for b in &plan.buffers {
        let Storage::Arena { device: 0, offset } = b.storage else { continue };
        let x = PAD + b.first_step as f64 * sx;
        let w = ((b.last_step - b.first_step + 1) as f64 * sx).max(0.5);
        let y = PAD + H - (offset + b.bytes) as f64 * sy;
        let h = (b.bytes as f64 * sy).max(0.5);
        let _ = writeln!(
            s,
            r##"<rect x="{x:.2}" y="{y:.2}" width="{w:.2}" height="{h:.2}" fill="{}" fill-opacity="0.8" stroke="#222" stroke-width="0.2"><title>{}: {} B at offset {}, steps {}..{}</title></rect>"##,
            colour(&b.label),
            escape(&b.label),
            bytes(b.bytes),
            bytes(offset),
            b.first_step,
            b.last_step
        );
    }
    let bound_y = PAD + H - m.lower_bound_bytes as f64 * sy;
    let _ = writeln!(
        s,
        r##"<line x1="{PAD}" x2="{}" y1="{bound_y:.2}" y2="{bound_y:.2}" stroke="#000" stroke-dasharray="4 3"><title>lower bound {} B</title></line>"##,
        PAD + W,
        bytes(m.lower_bound_bytes)
    );

    // Beside it: the eager allocator over its own op stream (unfused, so it has more ops than
    // the plan has steps), against the planned total.
    if let Some(samples) = eager {
        let x0 = W + 2.0 * PAD + 20.0;
        let planned = m.planned_total_bytes();
        let top = samples.iter().map(|p| p.reserved).max().unwrap_or(0).max(planned).max(1);
        let ops = samples.iter().map(|p| p.step + 1).max().unwrap_or(1);
        axes(&mut s, x0, "eager (BFC, allow_growth) vs planned total", &format!("eager op (0..{ops})"), top);
        let sx = W / ops as f64;
        let sy = H / top as f64;
        let line = |pick: fn(&MemorySample) -> usize| -> String {
            samples
                .iter()
                .map(|p| {
                    format!(
                        "{:.2},{:.2}",
                        x0 + PAD + (p.step as f64 + 0.5) * sx,
                        PAD + H - pick(p) as f64 * sy
                    )
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = writeln!(
            s,
            r##"<polyline points="{}" fill="none" stroke="#e15759" stroke-width="2"><title>eager reserved</title></polyline>"##,
            line(|p| p.reserved)
        );
        let _ = writeln!(
            s,
            r##"<polyline points="{}" fill="none" stroke="#4e79a7" stroke-width="1.5"><title>eager in use</title></polyline>"##,
            line(|p| p.in_use)
        );
        let py = PAD + H - planned as f64 * sy;
        let _ = writeln!(
            s,
            r##"<line x1="{}" x2="{}" y1="{py:.2}" y2="{py:.2}" stroke="#59a14f" stroke-width="2"><title>planned total {} B</title></line>"##,
            x0 + PAD,
            x0 + PAD + W,
            bytes(planned)
        );
        for (i, (name, c)) in
            [("eager reserved", "#e15759"), ("eager in use", "#4e79a7"), ("planned total", "#59a14f")]
                .iter()
                .enumerate()
        {
            let y = PAD + 16.0 + 16.0 * i as f64;
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{y}" font-size="12" fill="{c}">{name}</text>"#,
                x0 + PAD + 8.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}
