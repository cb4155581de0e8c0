#!/usr/bin/env python3
"""PyTorch eager, torch.compile and JAX jit on a CUDA device, per kiln zoo model: the training step
and the forward pass at the zoo's batch, in f32, timed and measured as the GPU issue asks.

- Time: CUDA events around each call (torch.cuda.Event; for JAX a host clock around a call that
  ends in block_until_ready, the closest JAX offers), median of --steps (>= 50) calls after
  --warmup calls (compilation, autotuning and allocator growth stay out of the numbers).
  Inputs are random (never zeros), drawn once per model.
- PyTorch memory: max_memory_allocated and max_memory_reserved over the timed calls, minus nothing
  (the parameters, the optimizer state and the batch are inside, as kiln's planned total holds
  them), after torch.cuda.empty_cache() and reset_peak_memory_stats() before the model is built.
- JAX memory: XLA's GPU buffer assignment (compiled.memory_analysis(): argument + output + temp -
  alias), and the device's peak_bytes_in_use (XLA_PYTHON_CLIENT_PREALLOCATE=false, the BFC
  allocator's own peak).
- TF32 is off everywhere (torch.backends.*.allow_tf32 = False, JAX's default matmul precision
  "highest"): kiln computes in plain f32.

The models: scripts/peers/torch_stream.py (PyTorch) and scripts/peers/xla_memory.py (JAX), each the
twin of the kiln zoo model of that name.

usage: peers.py torch|compile|jax|gemm OUT.json [--models a,b] [--steps N] [--warmup N]
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "peers"))

MODELS = ["seed-mlp", "mlp", "cnn", "transformer"]


def torch_run(names, steps, warmup, compiled):
    import torch
    from torch import nn
    import torch_stream

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    zoo = torch_stream.models(torch, nn)
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "models": {}}
    for name in names:
        row = {}
        for mode in ("train", "forward"):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            train, forward = torch_stream.training(torch, zoo[name], dev, compiled)
            call = train if mode == "train" else forward
            t0 = time.perf_counter()
            for _ in range(warmup):
                call()
            torch.cuda.synchronize()
            warm_s = time.perf_counter() - t0
            torch.cuda.reset_peak_memory_stats()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
            for a, b in events:
                a.record()
                call()
                b.record()
            torch.cuda.synchronize()
            ms = [a.elapsed_time(b) for a, b in events]
            row[mode] = {
                "step_ms": statistics.median(ms),
                "step_ms_min": min(ms),
                "max_memory_allocated": torch.cuda.max_memory_allocated() - base,
                "max_memory_reserved": torch.cuda.max_memory_reserved(),
                "warmup_seconds": warm_s,
            }
            print(f"{'torch.compile' if compiled else 'torch'} {name} {mode}: {row[mode]['step_ms']:.3f} ms, "
                  f"allocated {row[mode]['max_memory_allocated']}, reserved {row[mode]['max_memory_reserved']}",
                  flush=True)
            del train, forward, call
            if compiled:
                torch._dynamo.reset()
        out["models"][name] = row
    return out


def jax_run(names, steps, warmup):
    os.environ["JAX_PLATFORMS"] = "cuda"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_default_matmul_precision", "highest")
    import xla_memory as xm

    out = {"jax": jax.__version__, "device": str(jax.devices()[0].device_kind), "models": {}}
    for name in names:
        b = xm.Builder()
        apply, x_shape, y_shape, loss_kind = xm.MODELS[name](b)
        lr = 0.01 if name == "seed-mlp" else 1e-3
        loss_fn = xm.binary_crossentropy if loss_kind == "bce" else xm.softmax_crossentropy
        key = jax.random.PRNGKey(0)
        params = {k: jax.random.uniform(jax.random.fold_in(key, i), s, xm.F32, -0.05, 0.05)
                  for i, (k, s) in enumerate(b.shapes.items())}
        if name.startswith("transformer"):
            x = jax.random.randint(jax.random.fold_in(key, 998), x_shape, 0, y_shape[-1]).astype(xm.F32)
        else:
            x = jax.random.uniform(jax.random.fold_in(key, 998), x_shape, xm.F32)
        if loss_kind == "bce":
            y = (jax.random.uniform(jax.random.fold_in(key, 999), y_shape) > 0.5).astype(xm.F32)
        else:
            labels = jax.random.randint(jax.random.fold_in(key, 999), y_shape[:-1], 0, y_shape[-1])
            y = jax.nn.one_hot(labels, y_shape[-1], dtype=xm.F32)

        def step(params, m, v, it, x, y):
            loss, grads = jax.value_and_grad(lambda p: loss_fn(apply(p, x), y))(params)
            new_p, new_m, new_v = {}, {}, {}
            for k in params:
                new_p[k], new_m[k], new_v[k] = xm.adam_update(lr, params[k], grads[k], m[k], v[k], it)
            return new_p, new_m, new_v, it + 1.0, loss

        row = {}
        dev = jax.devices()[0]
        for mode in ("train", "forward"):
            m = {k: jnp.zeros_like(p) for k, p in params.items()}
            v = {k: jnp.zeros_like(p) for k, p in params.items()}
            it = jnp.zeros((), xm.F32)
            # Fresh copies per mode: the training step donates (and so deletes) its arguments.
            state = [{k: jnp.array(p, copy=True) for k, p in params.items()}, m, v, it]
            if mode == "train":
                fn = jax.jit(step, donate_argnums=(0, 1, 2, 3))
                compiled = fn.lower(*state, x, y).compile()

                def call():
                    state[:] = list(fn(*state, x, y)[:4])
                    return state[3]
            else:
                fn = jax.jit(apply)
                compiled = fn.lower(state[0], x).compile()

                def call():
                    return fn(state[0], x)
            ma = compiled.memory_analysis()
            arg, outb, temp, alias = (int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes),
                                      int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes))
            for _ in range(warmup):
                call().block_until_ready()
            ms = []
            for _ in range(steps):
                t0 = time.perf_counter()
                call().block_until_ready()
                ms.append((time.perf_counter() - t0) * 1e3)
            stats = dev.memory_stats() or {}
            row[mode] = {
                "step_ms": statistics.median(ms),
                "step_ms_min": min(ms),
                "xla_argument_bytes": arg,
                "xla_output_bytes": outb,
                "xla_temp_bytes": temp,
                "xla_alias_bytes": alias,
                "xla_total_bytes": arg + outb + temp - alias,
                "peak_bytes_in_use": int(stats.get("peak_bytes_in_use", 0)),
            }
            print(f"jax {name} {mode}: {row[mode]['step_ms']:.3f} ms, xla total {row[mode]['xla_total_bytes']}",
                  flush=True)
        out["models"][name] = row
    return out


def gemm_run(steps, warmup, shapes):
    """torch.matmul in f32 (TF32 off, the cuBLAS SGEMM kiln's kernel is held against), with TF32
    on, and in bf16 (cuBLAS's tensor-core GEMM, f32 accumulation, kiln's `--dtype bf16` is held
    against) at each (m, k, n): TFLOP/s from the median of CUDA-event times, inputs rotated among
    4 sets so that small products do not run from L2."""
    import torch

    dev = torch.device("cuda")
    rows = []
    for (m, k, n) in shapes:
        sets = [(torch.randn(m, k, device=dev), torch.randn(k, n, device=dev)) for _ in range(4)]
        row = {"m": m, "k": k, "n": n}
        for mode in ("f32", "tf32", "bf16"):
            torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
            runs = [(a.bfloat16(), b.bfloat16()) for a, b in sets] if mode == "bf16" else sets
            for i in range(warmup):
                a, b = runs[i % 4]
                torch.matmul(a, b)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
            for i, (s, e) in enumerate(ev):
                a, b = runs[i % 4]
                s.record()
                torch.matmul(a, b)
                e.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in ev)
            row[f"{mode}_ms"] = ms
            row[f"{mode}_tflops"] = 2 * m * k * n / ms / 1e9
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"torch.matmul {m}x{k}x{n}: f32 {row['f32_tflops']:.2f} TFLOP/s, tf32 {row['tf32_tflops']:.2f}, "
              f"bf16 {row['bf16_tflops']:.2f}", flush=True)
        rows.append(row)
    return {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "gemm": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["torch", "compile", "jax", "gemm"])
    ap.add_argument("out")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--shapes", default="", help="m,k,n;m,k,n... for gemm")
    a = ap.parse_args()
    names = [n for n in a.models.split(",") if n]
    if a.what == "jax":
        res = jax_run(names, a.steps, a.warmup)
    elif a.what == "gemm":
        shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";") if s] or [(4096, 4096, 4096)]
        res = gemm_run(a.steps, a.warmup, shapes)
    else:
        res = torch_run(names, a.steps, a.warmup, a.what == "compile")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
