//! Guard mode's layout: where the canaries go in a plan.
//!
//! In guard mode (`KILN_GUARD=1`, or `CompileOptions::with_guard(true)`) the planner leaves a gap
//! of `Plan::guard_bytes` bytes after every arena slot and every io slot: buffer `b` of
//! `bytes` bytes at `offset` owns `[offset, offset + bytes)` and its canary is
//! `[offset + bytes, offset + bytes + guard_bytes)` in the same region. The arena is placed with
//! each interval `guard_bytes` longer, so that no canary overlaps a buffer live at a common step,
//! and each io slot reserves `align(bytes + guard_bytes)`. A backend fills the canaries with a
//! pattern and checks them after every step (`kiln_runtime::guard`): a kernel that writes past
//! its output is named by step, op and buffer instead of silently corrupting a neighbour.
//!
//! The figures: `arena_bytes` and `io_bytes` include the canaries; `lower_bound_bytes` and
//! `naive_bytes` do not (they describe the graph's buffers, whatever the layout), so with guard
//! on the arena is above the lower bound by up to one canary per live buffer. With guard off
//! (the default) nothing changes: `guard_bytes` is 0 and plans are byte-for-byte what they were.

/// The canary after every slot in guard mode: one alignment unit (256 bytes, 64 f32s), which
/// catches an off-by-one row or tile, not only an off-by-one element.
pub const GUARD_BYTES: usize = 256;

/// The largest canary accepted (in options and in plans): 1 MiB, as for the alignment.
pub const MAX_GUARD_BYTES: usize = 1 << 20;

/// The environment variable that turns guard mode on for `CompileOptions::default()`.
pub const ENV: &str = "KILN_GUARD";

/// Whether `KILN_GUARD=1` is set (any other value, or none, leaves guard mode off).
pub fn enabled_by_env() -> bool {
    std::env::var(ENV).is_ok_and(|v| v.trim() == "1")
}

/// The canary bytes `CompileOptions::default()` uses: `GUARD_BYTES` under `KILN_GUARD=1`, else 0.
pub fn default_bytes() -> usize {
    if enabled_by_env() { GUARD_BYTES } else { 0 }
}
