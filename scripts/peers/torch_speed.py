#!/usr/bin/env python3
"""PyTorch's CPU training-step and forward-pass times for kiln's zoo models, for `cargo bench --bench speed`.

The models are the idiomatic PyTorch twins in torch_stream.py (same shapes, losses and Adam;
`Adam(foreach=True)`, `zero_grad(set_to_none=True)`), run eagerly and, with `--compile`, with
`torch.compile` on the model and on `opt.step` (inductor's C++ backend). Each mode runs 3 warm-up
steps (compilation included there), then STEPS steps each timed by the host clock around
zero_grad, forward, loss, backward and step; then as many forward passes (under no_grad) after 3
warm-up ones. f32 throughout, PyTorch's default thread count. --device cuda times the same on
a GPU, each call synchronised, TF32 off unless --tf32.

With --realscale the models are the real-scale architectures (scripts/realscale/models.py) at
--batch (their training batches by default); --threads sets PyTorch's thread count, --train-only
skips the forward passes, --compile-only the eager steps.

usage: torch_speed.py --models a,b,... --steps N [--compile | --compile-only] [--realscale
       [--batch N]] [--threads N] [--train-only] [--device cpu|cuda] [--tf32]
prints {"torch": version, "threads": n, "models": {name: {"eager_ms": [...], "compile_ms": [...],
"forward_eager_ms": [...], "forward_compile_ms": [...]}}}
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def time_model(torch, spec, steps, compiled, forwards=True, dev="cpu"):
    """(training-step ms, forward-pass ms or None without `forwards`), `steps` of each after 3
    warm-up calls; on a CUDA device each call is timed to its end (synchronised)."""
    import torch_stream

    torch.manual_seed(0)
    train, forward = torch_stream.training(torch, spec, dev, compiled)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    def timed(f):
        for _ in range(3):
            f()
        times = []
        for _ in range(steps):
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    return timed(train), timed(forward) if forwards else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--realscale", action="store_true")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--train-only", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tf32", action="store_true")
    args = ap.parse_args()
    import torch
    from torch import nn

    import torch_stream

    if args.threads:
        torch.set_num_threads(args.threads)
    # f32 products in f32 unless --tf32 (PyTorch's default lets cuDNN's convolutions use TF32).
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    if args.realscale:
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path.insert(0, os.path.join(here, "..", "realscale"))
        import models as realscale

        zoo = realscale.specs(torch, nn, batch=args.batch)
    else:
        zoo = torch_stream.models(torch, nn)
    modes = ([] if args.compile_only else [False]) + ([True] if args.compile or args.compile_only else [])
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": args.device, "models": {}}
    for name in args.models.split(","):
        if name not in zoo:
            print(f"no PyTorch twin of {name}", file=sys.stderr)
            return 2
        row = {}
        for compiled in modes:
            train, forward = time_model(
                torch, zoo[name], args.steps, compiled, not args.train_only, args.device
            )
            key = "compile" if compiled else "eager"
            row[f"{key}_ms"] = train
            if forward is not None:
                row[f"forward_{key}_ms"] = forward
        out["models"][name] = row
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
