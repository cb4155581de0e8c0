#!/usr/bin/env python3
"""PyTorch's real allocation stream for kiln's zoo training steps, for `kiln::torch_stream`.

Idiomatic PyTorch versions of the zoo models (same shapes, losses and Adam as kiln's; NCHW
convolutions; nn.MultiheadAttention), trained for two steps with `Adam(foreach=True)` and
`zero_grad(set_to_none=True)`, the model built after recording starts so that its parameters
are in the stream. On a CUDA device the stream is the caching allocator's own trace
(`torch.cuda.memory._record_memory_history`): every `alloc` and `free_completed` of a block
with its size and address, in order, together with PyTorch's real peaks
(`max_memory_allocated`, `max_memory_reserved`), with the cuBLAS workspace as PyTorch takes it.
kiln replays the stream through its caching-allocator model (`cargo run --release --
torch-stream FILE`) and sets it beside its own eager column.

Needs PyTorch with CUDA (the accelerator machine has it). Without CUDA it writes
{"skipped": why} and exits 0: PyTorch's CPU allocator has no trace of its own, and its
profiler's CPU stream carries oneDNN scratch and host scalars a GPU run does not have.

usage: torch_stream.py OUT.json [MODEL ...]   (default: seed-mlp mlp cnn transformer)
"""

import json
import sys


def models(torch, nn):
    F = nn.functional

    class Transformer(nn.Module):
        def __init__(self, vocab=1000, d=256, heads=4, hidden=1024):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.ln1 = nn.LayerNorm(d, eps=1e-5)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d, eps=1e-5)
            self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            self.ln3 = nn.LayerNorm(d, eps=1e-5)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            x = x + self.mlp(self.ln2(x))
            return self.head(self.ln3(x))

    def conv(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    # name: (builder, x maker, y maker, loss, learning rate)
    return {
        "seed-mlp": (
            lambda: nn.Sequential(nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 1), nn.Sigmoid()),
            lambda dev: torch.rand(32, 100, device=dev),
            lambda dev: (torch.rand(32, 1, device=dev) > 0.5).float(),
            lambda p, y: F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y),
            0.01,
        ),
        "mlp": (
            lambda: nn.Sequential(
                nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            ),
            lambda dev: torch.rand(256, 784, device=dev),
            lambda dev: F.one_hot(torch.randint(0, 10, (256,), device=dev), 10).float(),
            lambda p, y: F.cross_entropy(p, y),
            1e-3,
        ),
        "cnn": (
            lambda: nn.Sequential(
                *conv(3, 32), *conv(32, 32), nn.MaxPool2d(2),
                *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
            ),
            lambda dev: torch.rand(64, 3, 32, 32, device=dev),
            lambda dev: F.one_hot(torch.randint(0, 10, (64,), device=dev), 10).float(),
            lambda p, y: F.cross_entropy(p, y),
            1e-3,
        ),
        "transformer": (
            Transformer,
            lambda dev: torch.randint(0, 1000, (8, 128), device=dev),
            lambda dev: F.one_hot(torch.randint(0, 1000, (8, 128), device=dev), 1000).float(),
            lambda p, y: F.cross_entropy(p.reshape(-1, 1000), y.reshape(-1, 1000)),
            1e-3,
        ),
    }


def record(torch, nn, name, spec, dev):
    build, make_x, make_y, loss_fn, lr = spec
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    x, y = make_x(dev), make_y(dev)
    torch.cuda.synchronize()
    base_allocated = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    model = build().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7, foreach=True)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = []
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e["action"] == "alloc":
                events.append([e["addr"], e["size"]])
            elif e["action"] == "free_completed":
                events.append([e["addr"], -e["size"]])
    result = {
        "events": events,
        "max_memory_allocated": torch.cuda.max_memory_allocated() - base_allocated,
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "inputs_bytes": base_allocated,
    }
    del model, opt, x, y
    return result


def main():
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = sys.argv[1]
    names = sys.argv[2:] or ["seed-mlp", "mlp", "cnn", "transformer"]
    try:
        import torch
        from torch import nn
    except ImportError as e:
        json.dump({"skipped": f"PyTorch is not installed ({e})"}, open(out, "w"))
        return 0
    if not torch.cuda.is_available():
        json.dump({"skipped": "no CUDA device: the caching allocator's trace needs one"}, open(out, "w"))
        return 0
    torch.manual_seed(0)
    dev = torch.device("cuda")
    zoo = models(torch, nn)
    report = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "models": {n: record(torch, nn, n, zoo[n], dev) for n in names if n in zoo},
    }
    json.dump(report, open(out, "w"))
    print(f"wrote {out}: {', '.join(report['models'])} on {report['device']} (torch {report['torch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
