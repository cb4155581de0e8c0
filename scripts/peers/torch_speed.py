#!/usr/bin/env python3
"""PyTorch's CPU training-step and forward-pass times for kiln's zoo models, for `cargo bench --bench speed`.

The models are the idiomatic PyTorch twins in torch_stream.py (same shapes, losses and Adam;
`Adam(foreach=True)`, `zero_grad(set_to_none=True)`), run eagerly and, with `--compile`, with
`torch.compile` on the model and on `opt.step` (inductor's C++ backend). Each mode runs 3 warm-up
steps (compilation included there), then STEPS steps each timed by the host clock around
zero_grad, forward, loss, backward and step; then as many forward passes (under no_grad) after 3
warm-up ones. f32 throughout, PyTorch's default thread count.

usage: torch_speed.py --models a,b,... --steps N [--compile]
prints {"torch": version, "threads": n, "models": {name: {"eager_ms": [...], "compile_ms": [...],
"forward_eager_ms": [...], "forward_compile_ms": [...]}}}
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def time_model(torch, spec, steps, compiled):
    """(training-step ms, forward-pass ms), `steps` of each after 3 warm-up calls."""
    import torch_stream

    torch.manual_seed(0)
    train, forward = torch_stream.training(torch, spec, "cpu", compiled)

    def timed(f):
        for _ in range(3):
            f()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            f()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    return timed(train), timed(forward)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()
    import torch
    from torch import nn

    import torch_stream

    zoo = torch_stream.models(torch, nn)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": {}}
    for name in args.models.split(","):
        if name not in zoo:
            print(f"no PyTorch twin of {name}", file=sys.stderr)
            return 2
        train, forward = time_model(torch, zoo[name], args.steps, False)
        row = {"eager_ms": train, "forward_eager_ms": forward}
        if args.compile:
            train, forward = time_model(torch, zoo[name], args.steps, True)
            row["compile_ms"], row["forward_compile_ms"] = train, forward
        out["models"][name] = row
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
