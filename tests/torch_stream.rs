//! PyTorch's own op stream (the committed recording, `kiln::torch_stream`) against a real GPU
//! measurement and against kiln's eager and planned figures for the same training steps.

use kiln::compare::{Mode, compare};
use kiln::runtime::eager::{FrameworkExtras, WorkspacePolicy};
use kiln::torch_stream::{Recording, replay};
use kiln::zoo;

/// PyTorch 2.11's figures on an H100 (benches/results/2026-11-25-h100.json, `scripts/gpu/peers.py`):
/// the seed-mlp's training step was the first model of its process, so its peaks include the
/// workspaces PyTorch made for it. Replaying PyTorch's op stream with the framework model's
/// workspaces must give both figures to the byte: this holds the caching-allocator model and the
/// workspace model to a measurement.
#[test]
fn the_replayed_stream_reproduces_pytorchs_measured_peaks_on_an_h100() {
    let results: serde_json::Value =
        serde_json::from_str(include_str!("../benches/results/2026-11-25-h100.json")).unwrap();
    let measured = &results["models"]["seed-mlp"]["train"]["torch"];
    let rec = Recording::committed().unwrap();
    let s = replay(&rec.models["seed-mlp"], &FrameworkExtras::pytorch(WorkspacePolicy::Persistent)).unwrap();
    assert_eq!(s.peak_in_use as u64, measured["max_memory_allocated"].as_u64().unwrap());
    assert_eq!(s.peak_reserved as u64, measured["max_memory_reserved"].as_u64().unwrap());
    // The mlp ran after it with those workspaces alive, subtracted as the baseline: what is left
    // is the stream's own peak.
    let measured = &results["models"]["mlp"]["train"]["torch"];
    let s = replay(&rec.models["mlp"], &FrameworkExtras::default()).unwrap();
    assert_eq!(s.peak_in_use as u64, measured["max_memory_allocated"].as_u64().unwrap());
    // Without the backward thread's workspace (one handle) the seed-mlp would be 32 MiB short.
    let one = FrameworkExtras {
        backward_thread_handle: false,
        ..FrameworkExtras::pytorch(WorkspacePolicy::Persistent)
    };
    assert!(replay(&rec.models["seed-mlp"], &one).unwrap().peak_reserved < s.peak_reserved);
}

/// The goals on every zoo training step: kiln's eager caching column within 10% of
/// PyTorch's replayed stream, and the plan's device bytes at most 0.6x PyTorch's reserved peak
/// (replayed, default workspaces).
#[test]
fn kilns_eager_column_follows_pytorchs_stream_and_the_plan_stays_under_it() {
    for m in zoo::all() {
        let row = compare(&m, Mode::Train, false).unwrap();
        let (reserved, in_use) = row.eager_over_replayed().expect("every zoo training step is recorded");
        assert!((reserved - 1.0).abs() <= 0.10, "{}: kiln eager / PyTorch replayed {reserved:.3}", m.name);
        assert!((in_use - 1.0).abs() <= 0.20, "{}: in use {in_use:.3}", m.name);
        let device = row.device_over_replayed().unwrap();
        assert!(device <= 0.6, "{}: device bytes / PyTorch replayed {device:.3}", m.name);
    }
    // Another batch than the recording's has no replayed figures rather than wrong ones.
    let other = zoo::by_name("mlp").unwrap().with_batch(3);
    assert!(compare(&other, Mode::Train, false).unwrap().pytorch_replayed.is_none());
}

/// PyTorch's own caching-allocator trace on an H100 (`scripts/peers/torch_stream.py` on the GPU,
/// each model from an empty allocator with its inputs made inside the recording:
/// `benches/data/torch_stream_h100.json`), replayed through kiln's model of that allocator, gives
/// PyTorch's measured peaks to the byte on every zoo training step: reserved (segments, with the
/// cuBLAS and cuDNN workspaces that are in the trace) and in use.
#[test]
fn pytorchs_cuda_trace_replays_to_its_measured_peaks_on_every_zoo_model() {
    let rec = Recording::parse(include_str!("../benches/data/torch_stream_h100.json")).unwrap();
    assert_eq!(rec.models.len(), 4);
    for (name, stream) in &rec.models {
        assert_eq!(stream.capture.as_deref(), Some("cuda"));
        let s = replay(stream, &FrameworkExtras::default()).unwrap();
        assert_eq!(Some(s.peak_reserved), stream.max_memory_reserved, "{name}: reserved");
        assert_eq!(s.peak_in_use, stream.max_memory_allocated, "{name}: in use");
    }
}
