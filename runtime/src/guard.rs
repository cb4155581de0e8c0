//! Guard mode: canaries after every slot, checked after every step, so that a kernel writing out
//! of bounds is named (step, op, buffer) at the step that did it instead of corrupting a
//! neighbour and surfacing, if ever, as a wrong number many steps later.
//!
//! Why: every intermediate of a plan sits at a fixed offset in one arena, next to whatever the
//! planner put there. A kernel that writes one element past its output (a wrong bound in a tiled
//! loop, a launch grid rounded up) corrupts another live tensor, or nothing at all on some
//! shapes: the worst kind of bug to find. Guard mode turns it into an error.
//!
//! How: a plan compiled with `CompileOptions::with_guard(true)` (or under `KILN_GUARD=1`) has
//! `guard_bytes > 0` and a gap of that many bytes after every arena and io slot
//! (`kiln_compiler::guard`: the planner places each slot with its gap, so no canary overlaps a
//! buffer live at a common step, and validation checks it). A backend that loads such a plan
//! builds a [`Guard`]: each canary is filled with [`PATTERN`] before the first step at which its
//! buffer is live (io canaries before step 0 of every run: io slots are never reused), and after
//! every step the canaries of every buffer live at that step (every io canary, and the arena
//! canaries whose buffer's life covers the step) are compared with the pattern. Arena canaries
//! of dead buffers are not checked: the planner may reuse their bytes for later buffers, which
//! is why a canary is refilled when its buffer's life begins rather than once per allocation.
//! The first changed byte gives a [`RuntimeError::GuardOverrun`] naming the step, its op and
//! the buffer whose end was overrun. The pattern is the u32 `0x7FA5A5A5` (little-endian),
//! a signalling NaN as an f32: arithmetic only ever produces quiet NaNs, so a kernel that
//! overruns writes something else, even when it writes NaN. What it does not see: reads out of
//! bounds, and writes that skip past a canary onto another buffer's bytes.
//!
//! Both backends use this module: the CPU backend reads and writes the canary bytes in host
//! memory; the CUDA backend copies them with the driver (`cuMemcpyHtoD` / `cuMemcpyDtoH` of the
//! gap bytes, synchronising after every step). Plans without guard bytes build no `Guard` and
//! run the loop they ran before, with one predictable branch per step on the CPU (none on CUDA,
//! which picks the guarded loop once per run).
//!
//! Cost on the CPU (`cargo test --release --test guard -- --ignored --nocapture guard_overhead`,
//! on the 2-core build machine with other builds running; guarded and plain runs alternate and
//! the medians are compared): the zoo's `seed-mlp` training step (46 steps, 23 canaries, batch
//! 32) goes from 14 to 20 µs, about 6 µs of canaries per training step or 130 ns per plan step
//! (they are compared with `memcmp`: a byte-by-byte loop cost 80 µs); on `mlp` (batch 256, 30 ms), `cnn` (batch 64,
//! 320 ms) and `transformer` (batch 8, 220 ms) the difference is below the run-to-run noise
//! (-4% to +1%). Memory: one 256-byte canary per slot, rounded up to the alignment, in the
//! arena's and io region's figures (`mlp`: arena 6,368,512 -> 6,370,304 B). On CUDA every
//! checked canary is one synchronising copy, so a guarded step is much slower: guard mode is for
//! finding a bug, not for training.

use crate::error::RuntimeError;
use kiln_compiler::Plan;
use kiln_compiler::plan::Storage;
use std::ops::Range;

/// The fill pattern, repeated from each canary's first byte: the bytes of the u32 `0x7FA5A5A5`
/// (little-endian), a signalling NaN as an f32.
pub const PATTERN: [u8; 4] = 0x7FA5_A5A5u32.to_le_bytes();

/// Which region of a plan device a canary lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Region {
    /// The arena of `plan.devices[d]`.
    Arena(usize),
    /// The io region of `plan.devices[d]`.
    Io(usize),
}

/// The gap after one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Canary {
    /// The buffer (index into `plan.buffers`) whose end it guards.
    pub buffer: usize,
    /// The region the slot and its canary lie in.
    pub region: Region,
    /// Its bytes in the region: `[offset + bytes, offset + bytes + guard_bytes)`.
    pub range: Range<usize>,
}

/// Every canary of a plan, and which of them to fill before and check after each step.
#[derive(Clone, Debug)]
pub struct Guard {
    canaries: Vec<Canary>,
    /// Per step: the canaries to fill before it runs (their buffer's life begins there).
    fill: Vec<Vec<usize>>,
    /// Per step: the canaries to check after it ran (their buffer is live there).
    check: Vec<Vec<usize>>,
    /// One canary's bytes as filled: compared with `==` (memcmp), not byte by byte.
    pattern: Vec<u8>,
}

impl Guard {
    /// The guard of a plan compiled in guard mode, `None` when `plan.guard_bytes` is 0. The plan
    /// must have been validated (`kiln_compiler::validate`): that establishes that every canary
    /// lies inside its region and overlaps no buffer live while the canary is checked.
    pub fn new(plan: &Plan) -> Option<Guard> {
        let g = plan.guard_bytes;
        if g == 0 {
            return None;
        }
        let steps = plan.steps.len();
        let mut canaries = Vec::new();
        let (mut fill, mut check) = (vec![Vec::new(); steps], vec![Vec::new(); steps]);
        for (b, buf) in plan.buffers.iter().enumerate() {
            let (region, offset, life) = match buf.storage {
                // Io slots are never shared: live (and checked) through the whole run.
                Storage::Io { device, offset } => (Region::Io(device), offset, 0..steps),
                Storage::Arena { device, offset } => (
                    Region::Arena(device),
                    offset,
                    buf.first_step..buf.last_step.saturating_add(1).min(steps),
                ),
                Storage::Variable { .. } => continue,
            };
            let i = canaries.len();
            let start = offset + buf.bytes;
            canaries.push(Canary { buffer: b, region, range: start..start + g });
            if life.start < life.end {
                fill[life.start].push(i);
                for s in life {
                    check[s].push(i);
                }
            }
        }
        Some(Guard { canaries, fill, check, pattern: pattern(g) })
    }

    /// Every canary of the plan: one per arena and io buffer, in `plan.buffers` order.
    pub fn canaries(&self) -> &[Canary] {
        &self.canaries
    }

    /// A canary's bytes as filled (every canary of a plan has `guard_bytes` bytes).
    pub fn pattern(&self) -> &[u8] {
        &self.pattern
    }

    /// Fills a canary's bytes.
    pub fn fill(&self, bytes: &mut [u8]) {
        bytes.copy_from_slice(&self.pattern[..bytes.len()]);
    }

    /// `None` when a canary is intact, else the index of its first changed byte.
    pub fn check(&self, bytes: &[u8]) -> Option<usize> {
        if bytes == &self.pattern[..bytes.len()] { None } else { check(bytes) }
    }

    /// The canaries to fill before `step` runs.
    pub fn to_fill(&self, step: usize) -> impl Iterator<Item = &Canary> {
        self.fill.get(step).into_iter().flatten().map(|&i| &self.canaries[i])
    }

    /// The canaries to check after `step` ran.
    pub fn to_check(&self, step: usize) -> impl Iterator<Item = &Canary> {
        self.check.get(step).into_iter().flatten().map(|&i| &self.canaries[i])
    }

    /// The error for `canary` found changed at its byte `at` (0-based) after `step`.
    pub fn overrun(plan: &Plan, step: usize, canary: &Canary, at: usize) -> RuntimeError {
        let s = &plan.steps[step];
        let buf = &plan.buffers[canary.buffer];
        let (region, slot_offset) = match (canary.region, buf.storage) {
            (Region::Arena(d), Storage::Arena { offset, .. }) => {
                (format!("arena of {}", plan.devices[d].name), offset)
            }
            (Region::Io(d), Storage::Io { offset, .. }) => {
                (format!("io region of {}", plan.devices[d].name), offset)
            }
            (r, _) => (format!("{r:?}"), canary.range.start - buf.bytes),
        };
        RuntimeError::GuardOverrun(Box::new(Overrun {
            step,
            kernel: s.label.clone(),
            origin: s.origin.as_ref().map(|o| format!(" at {o}")).unwrap_or_default(),
            buffer: canary.buffer,
            slot: buf.label.clone(),
            bytes: buf.bytes,
            slot_offset,
            region,
            canary_start: canary.range.start,
            canary_end: canary.range.end,
            offset: canary.range.start + at,
        }))
    }
}

/// What [`RuntimeError::GuardOverrun`] says: a step wrote into the canary after a slot.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "guard: step {step} ({kernel}{origin}) wrote past the end of buffer {buffer} ({slot}, {bytes} bytes at {slot_offset} in the {region}): its canary at bytes {canary_start}..{canary_end} was overwritten from byte {offset} on\n  help: the step's kernel writes out of bounds, so results computed without guard mode may be silently wrong; guard mode (KILN_GUARD=1 or CompileOptions::with_guard) checks every canary after every step, so this is the first step that overran: report it with the op, its shapes and the plan (Plan::render)"
)]
pub struct Overrun {
    /// The index of the step that overran (into `plan.steps`).
    pub step: usize,
    /// The step's label: its op and name.
    pub kernel: String,
    /// " at FILE:LINE" where the op was traced, or empty.
    pub origin: String,
    /// The overrun buffer (index into `plan.buffers`).
    pub buffer: usize,
    /// The buffer's label: the op and name that produced it.
    pub slot: String,
    /// The buffer's size in bytes.
    pub bytes: usize,
    /// The buffer's offset in its region, in bytes.
    pub slot_offset: usize,
    /// "arena of cpu:0", "io region of cpu:0".
    pub region: String,
    /// The canary's first byte, as an offset in the region.
    pub canary_start: usize,
    /// One past the canary's last byte, as an offset in the region.
    pub canary_end: usize,
    /// The first overwritten byte, in the region.
    pub offset: usize,
}

/// Fills a canary's bytes with [`PATTERN`].
pub fn fill(bytes: &mut [u8]) {
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = PATTERN[i % 4];
    }
}

/// The canary's bytes as [`fill`] leaves them (for backends that copy them to a device).
pub fn pattern(len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    fill(&mut v);
    v
}

/// `None` when the canary is intact, else the index of its first changed byte.
pub fn check(bytes: &[u8]) -> Option<usize> {
    bytes.iter().enumerate().position(|(i, &b)| b != PATTERN[i % 4])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_finds_the_first_changed_byte() {
        let mut b = vec![0u8; 10];
        assert_eq!(check(&b), Some(0));
        fill(&mut b);
        assert_eq!(check(&b), None);
        assert_eq!(b, pattern(10));
        b[6] ^= 1;
        assert_eq!(check(&b), Some(6));
        // The pattern as an f32 is a NaN that arithmetic does not produce.
        let f = f32::from_le_bytes(PATTERN);
        assert!(f.is_nan() && f.to_bits() != f32::NAN.to_bits());
    }
}
