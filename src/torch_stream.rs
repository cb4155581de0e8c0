//! PyTorch's real allocation stream for the zoo's training steps, replayed through kiln's model
//! of its caching allocator (`kiln_runtime::alloc::CachingAllocator`), beside kiln's own eager
//! column and the plan's device bytes.
//!
//! `scripts/peers/torch_stream.py` records a stream two ways:
//! - **cuda**: on a CUDA machine, the caching allocator's own trace (every block allocation and
//!   free, in order, workspaces included) with PyTorch's real peaks. The replay then checks the
//!   allocator model against PyTorch's own `max_memory_reserved` on the same stream.
//! - **dispatch**: anywhere PyTorch installs (no GPU), every storage an ATen op makes below
//!   autograd, allocated when the op returns and freed when it dies, host-only scalars left out,
//!   matrix products marked (`products`). That is the op stream a CUDA run allocates, without
//!   what ops take inside themselves; the replay adds cuBLAS's workspaces at the marks as the
//!   framework columns do (`FrameworkExtras`). The committed recording
//!   (`benches/data/torch_stream.json`, PyTorch 2.15 from PyPI) is of this kind, so the memory
//!   bench shows PyTorch's own op stream beside kiln's eager column on every machine.
//!
//! `benches/data/torch_stream_h100.json` is a cuda capture of the zoo's training steps on an H100
//! (PyTorch 2.11, each model from an empty allocator): its replay gives PyTorch's measured
//! reserved and allocated peaks to the byte on every model (`tests/torch_stream.rs`).
//!
//! Frees of blocks made before recording started (there are none when the script builds the
//! model after starting the trace) are ignored; in a cuda capture the inputs, made before
//! recording, are counted by PyTorch's peaks but not by the replay (`inputs_bytes` says how
//! much), a dispatch capture has them in the stream.

use crate::error::{Error, Result};
use kiln_runtime::RuntimeError;
use kiln_runtime::alloc::{Allocator, AllocatorStats, CachingAllocator, VirtualSource};
use kiln_runtime::eager::{FrameworkExtras, WorkspacePolicy};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};

/// One model's recorded stream.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelStream {
    /// (block id, +bytes) for an allocation, (block id, -bytes) for a free, in order.
    pub events: Vec<(u64, i64)>,
    /// Where a matrix product ran (dispatch captures): (position in `events`, 1 if in the
    /// backward pass else 0). A cuBLAS workspace taken there is taken after the product's output
    /// and before anything else; the backward pass has its own (`FrameworkExtras`).
    #[serde(default)]
    pub products: Vec<(usize, u8)>,
    /// PyTorch's allocated peak in bytes: `torch.cuda.max_memory_allocated()` less what was
    /// allocated before recording (cuda), or the stream's own peak of live bytes (dispatch).
    pub max_memory_allocated: usize,
    /// PyTorch's own reserved peak (cuda captures only).
    #[serde(default)]
    pub max_memory_reserved: Option<usize>,
    /// Bytes allocated before recording that PyTorch's peaks count but the stream lacks (the
    /// inputs of a cuda capture); 0 when the stream has everything.
    #[serde(default)]
    pub inputs_bytes: usize,
    /// "cuda" or "dispatch".
    #[serde(default)]
    pub capture: Option<String>,
}

/// What the script wrote: the streams, or why it skipped.
#[derive(Clone, Debug, Deserialize)]
pub struct Recording {
    /// The PyTorch version that recorded (`torch.__version__`); `None` in a skipped recording.
    #[serde(default)]
    pub torch: Option<String>,
    /// The CUDA device's name for a cuda capture, or a note that a dispatch capture ran on the
    /// CPU; `None` in a skipped recording.
    #[serde(default)]
    pub device: Option<String>,
    /// Each recorded zoo model's stream, by model name; empty when the script skipped.
    #[serde(default)]
    pub models: BTreeMap<String, ModelStream>,
    /// Why the script recorded nothing (no PyTorch, no CUDA device for a cuda capture); `None`
    /// when it recorded.
    #[serde(default)]
    pub skipped: Option<String>,
}

/// The recording in the repository: the zoo's training steps at their default batches, by
/// dispatch capture (`python3 scripts/peers/torch_stream.py --capture dispatch
/// benches/data/torch_stream.json` re-records it).
pub const COMMITTED: &str = include_str!("../benches/data/torch_stream.json");

impl Recording {
    /// Parses the JSON `scripts/peers/torch_stream.py` wrote; an error when it is not such a
    /// recording.
    pub fn parse(json: &str) -> Result<Self> {
        serde_json::from_str(json).map_err(|e| {
            Error::Runtime(RuntimeError::invalid(
                format!("not a torch_stream.py recording: {e}"),
                "pass the JSON file scripts/peers/torch_stream.py wrote",
            ))
        })
    }

    /// The committed recording (`COMMITTED`).
    pub fn committed() -> Result<Self> {
        Self::parse(COMMITTED)
    }
}

/// Replays `stream` through the caching-allocator model (no memory limit) and returns its
/// statistics (peaks over the whole stream). `extras` adds cuBLAS's workspaces at the
/// stream's product marks (kept from each thread's first product, or per call; cuBLASLt's kept
/// from the first product); its other extras are already in a recorded stream (foreach Adam's temporaries are ATen
/// outputs) or are not PyTorch's. A cuda capture has no marks: its workspaces are in it.
pub fn replay(stream: &ModelStream, extras: &FrameworkExtras) -> Result<AllocatorStats> {
    let invalid = |what: String| Error::Runtime(RuntimeError::invalid(what, "record the stream again"));
    let mut allocator = CachingAllocator::new(VirtualSource::new(), None);
    let take = |allocator: &mut CachingAllocator<VirtualSource>, bytes: usize, i: usize| {
        allocator.allocate(bytes).map_err(|e| invalid(format!("event {i}: allocating {bytes} bytes: {e}")))
    };
    let mut blocks: HashMap<u64, u64> = HashMap::new();
    let mut marks = stream.products.iter().copied().peekable();
    let (mut kept_lt, mut kept) = (false, [false; 2]);
    for i in 0..=stream.events.len() {
        while let Some((_, pass)) = marks.next_if(|&(p, _)| p == i) {
            if !kept_lt && extras.blas_lt_workspace > 0 {
                kept_lt = true;
                take(&mut allocator, extras.blas_lt_workspace, i)?;
            }
            let handle = usize::from(pass != 0 && extras.backward_thread_handle);
            match extras.blas_workspace {
                Some(w) if w.policy == WorkspacePolicy::Persistent && !kept[handle] => {
                    kept[handle] = true;
                    take(&mut allocator, w.bytes, i)?;
                }
                Some(w) if w.policy == WorkspacePolicy::PerCall => {
                    let b = take(&mut allocator, w.bytes, i)?;
                    allocator
                        .deallocate(b.addr)
                        .map_err(|e| invalid(format!("event {i}: workspace: {e}")))?;
                }
                _ => {}
            }
        }
        let Some(&(id, bytes)) = stream.events.get(i) else { break };
        if bytes >= 0 {
            let block = take(&mut allocator, bytes as usize, i)?;
            if blocks.insert(id, block.addr).is_some() {
                return Err(invalid(format!("event {i}: block {id:#x} allocated twice without a free")));
            }
        } else if let Some(block) = blocks.remove(&id) {
            allocator.deallocate(block).map_err(|e| invalid(format!("event {i}: freeing {id:#x}: {e}")))?;
        }
    }
    if let Some((p, _)) = marks.next() {
        return Err(invalid(format!(
            "a product mark at {p} lies past the stream's {} events",
            stream.events.len()
        )));
    }
    Ok(allocator.stats())
}

/// The committed recording's figures for one zoo training step (`None` for models it lacks).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct Replayed {
    /// The stream alone: peak bytes in live blocks, and reserved.
    pub peak_in_use: usize,
    /// The stream alone: the peak bytes the caching allocator model reserved (whole segments).
    pub peak_reserved: usize,
    /// With PyTorch's default workspaces on an H100 (cuBLAS's and cuBLASLt's, kept from the first
    /// product: `framework` says why that is the default).
    pub workspace_peak_reserved: usize,
}

/// Replays the committed recording of zoo model `name` without and with PyTorch's workspaces.
pub fn committed_figures(name: &str) -> Result<Option<Replayed>> {
    let rec = Recording::committed()?;
    rec.models.get(name).map(figures).transpose()
}

/// Replays `stream` without and with PyTorch's workspaces.
pub fn figures(stream: &ModelStream) -> Result<Replayed> {
    let plain = replay(stream, &FrameworkExtras::default())?;
    let with = replay(stream, &FrameworkExtras::pytorch(WorkspacePolicy::Persistent))?;
    Ok(Replayed {
        peak_in_use: plain.peak_in_use,
        peak_reserved: plain.peak_reserved,
        workspace_peak_reserved: with.peak_reserved,
    })
}

/// One model's stream from the recording at `path` (a file `scripts/peers/torch_stream.py`
/// wrote, such as `cargo bench --bench realscale`'s `target/kiln/realscale/gpt2-stream.json`):
/// `model`'s, or the recording's only one where `model` is `None`; an error naming the models
/// it has otherwise.
pub fn load(path: &std::path::Path, model: Option<&str>) -> Result<(String, ModelStream)> {
    let json = std::fs::read_to_string(path).map_err(|e| {
        Error::Runtime(RuntimeError::invalid(
            format!("cannot read the recorded stream {}: {e}", path.display()),
            "pass a JSON file scripts/peers/torch_stream.py wrote",
        ))
    })?;
    let mut rec = Recording::parse(&json)?;
    let names: Vec<String> = rec.models.keys().cloned().collect();
    let name = match (model, names.as_slice()) {
        (Some(m), _) => m.to_string(),
        (None, [only]) => only.clone(),
        (None, _) => {
            return Err(Error::Runtime(RuntimeError::invalid(
                format!("{} records {} models: {names:?}", path.display(), names.len()),
                "name one: FILE:MODEL",
            )));
        }
    };
    match rec.models.remove(&name) {
        Some(stream) => Ok((name, stream)),
        None => Err(Error::Runtime(RuntimeError::invalid(
            format!("{} has no model `{name}`; it records {names:?}", path.display()),
            "name one of those: FILE:MODEL",
        ))),
    }
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
        let s = replay(&r.models["m"], &FrameworkExtras::default()).unwrap();
        assert_eq!(s.peak_reserved, (2 << 20) + (20 << 20));
        assert_eq!(Some(s.peak_reserved), r.models["m"].max_memory_reserved);
        assert_eq!(s.in_use, (1 << 20) + (3 << 20));
        assert!(Recording::parse("{\"skipped\": \"no CUDA\"}").unwrap().skipped.is_some());
        assert!(Recording::parse("[1, 2]").is_err());
        let twice = r#"{"models": {"m": {"events": [[1, 8], [1, 8]], "max_memory_allocated": 0, "max_memory_reserved": 0}}}"#;
        assert!(replay(&Recording::parse(twice).unwrap().models["m"], &FrameworkExtras::default()).is_err());
    }

    #[test]
    fn workspaces_are_taken_at_the_product_marks() {
        // A forward product after the first allocation, a backward one after the third event.
        let json = r#"{"models": {"m": {"events": [[1, 4096], [2, 4096], [1, -4096]],
            "products": [[1, 0], [3, 1]], "max_memory_allocated": 8192}}}"#;
        let r = Recording::parse(json).unwrap();
        let m = &r.models["m"];
        let plain = replay(m, &FrameworkExtras::default()).unwrap();
        assert_eq!((plain.peak_in_use, plain.peak_reserved), (8192, 2 << 20));
        let ws = kiln_runtime::eager::framework::CUBLAS_WORKSPACE_SM90;
        let lt = kiln_runtime::eager::framework::CUBLASLT_WORKSPACE;
        let per_call = replay(m, &FrameworkExtras::pytorch(WorkspacePolicy::PerCall)).unwrap();
        // The per-call workspace is freed at once and cached: both products reuse its segment;
        // cuBLASLt's 1 MiB lies in the small pool's 2 MiB segment beside the tensors.
        assert_eq!(per_call.peak_in_use, 4096 + lt + ws, "one block live at each product");
        assert_eq!(per_call.peak_reserved, (2 << 20) + ws);
        assert_eq!(per_call.in_use, 4096 + lt);
        // Kept: one per thread's handle, forward and backward.
        let kept = replay(m, &FrameworkExtras::pytorch(WorkspacePolicy::Persistent)).unwrap();
        assert_eq!(kept.in_use, 4096 + lt + 2 * ws);
        let one_thread = FrameworkExtras {
            backward_thread_handle: false,
            ..FrameworkExtras::pytorch(WorkspacePolicy::Persistent)
        };
        assert_eq!(replay(m, &one_thread).unwrap().in_use, 4096 + lt + ws);
        let past =
            r#"{"models": {"m": {"events": [[1, 8]], "products": [[2, 0]], "max_memory_allocated": 8}}}"#;
        assert!(replay(&Recording::parse(past).unwrap().models["m"], &FrameworkExtras::default()).is_err());
        // The committed recording parses and has every zoo model's training step.
        let committed = Recording::committed().unwrap();
        for name in ["seed-mlp", "mlp", "cnn", "transformer"] {
            assert!(committed.models.contains_key(name), "{name}");
            assert!(committed_figures(name).unwrap().is_some());
        }
    }
}
