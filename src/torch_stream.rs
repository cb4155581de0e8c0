//! PyTorch's real allocation stream for the zoo's training steps, replayed through kiln's model
//! of its caching allocator (`kiln_runtime::alloc::CachingAllocator`), beside kiln's own eager
//! column and the plan's device bytes.
//!
//! `scripts/peers/torch_stream.py` records the stream on a CUDA machine (the caching
//! allocator's trace: every block allocation and free, in order, with PyTorch's real peaks);
//! `kiln torch-stream FILE` replays it. The replay checks two things at once: the allocator
//! model against PyTorch's own `max_memory_reserved` on the same stream, and kiln's eager op
//! stream (`compare`) against PyTorch's op stream through the same model. Frees of blocks made
//! before recording started (there are none when the script builds the model after starting the
//! trace) are ignored; the inputs, made before recording, are counted by PyTorch's peaks but not
//! by the replay (`inputs_bytes` says how much).

use crate::error::{Error, Result};
use kiln_runtime::RuntimeError;
use kiln_runtime::alloc::{Allocator, AllocatorStats, CachingAllocator, VirtualSource};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};

/// One model's recorded stream.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelStream {
    /// (address, +bytes) for an allocation, (address, -bytes) for a free, in order.
    pub events: Vec<(u64, i64)>,
    pub max_memory_allocated: usize,
    pub max_memory_reserved: usize,
    #[serde(default)]
    pub inputs_bytes: usize,
}

/// What the script wrote: the streams, or why it skipped.
#[derive(Clone, Debug, Deserialize)]
pub struct Recording {
    #[serde(default)]
    pub torch: Option<String>,
    #[serde(default)]
    pub device: Option<String>,
    #[serde(default)]
    pub models: BTreeMap<String, ModelStream>,
    #[serde(default)]
    pub skipped: Option<String>,
}

impl Recording {
    pub fn parse(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| {
            Error::Runtime(RuntimeError::invalid(
                format!("not a torch_stream.py recording: {e}"),
                "pass the JSON file scripts/peers/torch_stream.py wrote",
            ))
        })
    }
}

/// Replays `stream` through the caching-allocator model (no memory limit) and returns its
/// statistics (peaks over the whole stream).
pub fn replay(stream: &ModelStream) -> Result<AllocatorStats> {
    let mut allocator = CachingAllocator::new(VirtualSource::new(), None);
    let mut blocks: HashMap<u64, u64> = HashMap::new();
    for (i, &(addr, bytes)) in stream.events.iter().enumerate() {
        if bytes >= 0 {
            let block = allocator.allocate(bytes as usize).map_err(|e| {
                Error::Runtime(RuntimeError::invalid(format!("event {i}: allocating {bytes} bytes: {e}"), ""))
            })?;
            if blocks.insert(addr, block.addr).is_some() {
                return Err(Error::Runtime(RuntimeError::invalid(
                    format!("event {i}: address {addr:#x} allocated twice without a free"),
                    "the recording is corrupt: record it again",
                )));
            }
        } else if let Some(block) = blocks.remove(&addr) {
            allocator.deallocate(block).map_err(|e| {
                Error::Runtime(RuntimeError::invalid(format!("event {i}: freeing {addr:#x}: {e}"), ""))
            })?;
        }
    }
    Ok(allocator.stats())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_replays_as_the_allocator_runs_it() {
        // 1 MiB and 3 MiB blocks: one 2 MiB small-pool segment, one 20 MiB large segment; the
        // 3 MiB block freed and taken again from the cache.
        let json = r#"{"torch": "2.x", "models": {"m": {"events": [[16, 1048576], [32, 3145728],
            [32, -3145728], [48, 3145728], [7, -100]], "max_memory_allocated": 4194304,
            "max_memory_reserved": 23068672}}}"#;
        let r = Recording::parse(json).unwrap();
        let s = replay(&r.models["m"]).unwrap();
        assert_eq!(s.peak_reserved, (2 << 20) + (20 << 20));
        assert_eq!(s.peak_reserved, r.models["m"].max_memory_reserved);
        assert_eq!(s.in_use, (1 << 20) + (3 << 20));
        assert!(Recording::parse("{\"skipped\": \"no CUDA\"}").unwrap().skipped.is_some());
        assert!(Recording::parse("[1, 2]").is_err());
        let twice = r#"{"models": {"m": {"events": [[1, 8], [1, 8]], "max_memory_allocated": 0, "max_memory_reserved": 0}}}"#;
        assert!(replay(&Recording::parse(twice).unwrap().models["m"]).is_err());
    }
}
