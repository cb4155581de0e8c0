//! Memory placement (placeholder interface; the real planner replaces this file).

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Interval {
    pub bytes: usize,
    pub start: usize,
    pub end: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Placement {
    pub offsets: Vec<usize>,
    pub arena_bytes: usize,
    pub algorithm: String,
    pub tried: Vec<(String, usize)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bound {
    pub bytes: usize,
    pub step: usize,
}

pub fn align(bytes: usize, alignment: usize) -> usize {
    bytes.div_ceil(alignment) * alignment
}

pub fn place(intervals: &[Interval], alignment: usize) -> Placement {
    let mut offsets = Vec::new();
    let mut top = 0;
    for i in intervals {
        offsets.push(top);
        top += align(i.bytes, alignment);
    }
    Placement { offsets, arena_bytes: top, algorithm: "none".into(), tried: vec![("none".into(), top)] }
}

pub fn lower_bound(intervals: &[Interval], alignment: usize) -> Bound {
    let steps = intervals.iter().map(|i| i.end + 1).max().unwrap_or(0);
    let mut best = Bound { bytes: 0, step: 0 };
    for s in 0..steps {
        let live: usize =
            intervals.iter().filter(|i| i.start <= s && s <= i.end).map(|i| align(i.bytes, alignment)).sum();
        if live > best.bytes {
            best = Bound { bytes: live, step: s };
        }
    }
    best
}

pub fn naive_bytes(intervals: &[Interval], alignment: usize) -> usize {
    intervals.iter().map(|i| align(i.bytes, alignment)).sum()
}

pub fn verify(intervals: &[Interval], placement: &Placement, alignment: usize) -> Result<(), String> {
    for (i, a) in intervals.iter().enumerate() {
        let oa = placement.offsets[i];
        if !oa.is_multiple_of(alignment) || oa + a.bytes > placement.arena_bytes {
            return Err(format!("interval {i} misplaced"));
        }
        for (j, b) in intervals.iter().enumerate().skip(i + 1) {
            let ob = placement.offsets[j];
            let live = a.start <= b.end && b.start <= a.end;
            let bytes = oa < ob + b.bytes && ob < oa + a.bytes && a.bytes > 0 && b.bytes > 0;
            if live && bytes {
                return Err(format!("intervals {i} and {j} overlap"));
            }
        }
    }
    Ok(())
}
