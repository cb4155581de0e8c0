#!/usr/bin/env python3
"""Assembles one GPU run's results file from the logs of `scripts/gpu/checklist.sh` (the
folders the device tool brought back, unpacked from results.tgz) and prints the README's tables.

usage: results.py OUT.json DIR [DIR ...] [--gpu TEXT] [--method TEXT] [--date YYYY-MM-DD]

Each DIR is a checklist log folder; the later ones win where two hold the same file. Read:
gpu.json (kiln bench-gpu), torch.json, torch_compile.json, jax.json (peers.py), gemm.json (kiln
bench-gemm), gemm_torch.json (peers.py gemm). Figures are copied, never computed here, except
the ratios the tables print.
"""

import argparse
import json
import os
import sys


def load(dirs, name):
    found = None
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p) as f:
                found = json.load(f)
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--gpu", default="")
    ap.add_argument("--method", default="")
    ap.add_argument("--date", default="")
    a = ap.parse_args()
    kiln = load(a.dirs, "gpu.json") or []
    peers = {k: load(a.dirs, f"{k}.json") for k in ("torch", "torch_compile", "jax")}
    models = {}
    for row in kiln:
        m = models.setdefault(row["model"], {}).setdefault(row["mode"], {})
        m["kiln"] = {
            "step_ms": row["graph_step_ms"],
            "launches": row["launches_per_step"],
            "arena_bytes": row["arena_bytes"],
            "planned_total_bytes": row["planned_total_bytes"],
            "eager_bfc_step_ms": row.get("eager_step_ms"),
            "eager_bfc_peak_reserved_bytes": row.get("eager_bfc_peak_reserved_bytes"),
        }
    for peer, data in peers.items():
        for name, modes in ((data or {}).get("models") or {}).items():
            for mode, fig in modes.items():
                models.setdefault(name, {}).setdefault(mode, {})[peer] = fig
    gemm = []
    kiln_gemm = load(a.dirs, "gemm.json") or []
    torch_gemm = {(g["m"], g["k"], g["n"]): g for g in (load(a.dirs, "gemm_torch.json") or {}).get("gemm", [])}
    for g in kiln_gemm:
        t = torch_gemm.get((g["m"], g["k"], g["n"]), {})
        gemm.append({
            "m": g["m"], "k": g["k"], "n": g["n"],
            "kiln_tflops": g["tflops"], "kiln_ms": g["ms"], "kiln_rel_error": g["rel_error"],
            "kiln_kernel": g["kernel"],
            "torch_f32_tflops": t.get("f32_tflops"), "torch_tf32_tflops": t.get("tf32_tflops"),
        })
    versions = {k: (v or {}).get(k.split("_")[0]) for k, v in peers.items() if v}
    result = {"date": a.date, "gpu": a.gpu, "peers": versions, "method": a.method, "models": models, "gemm": gemm}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")

    def ms(fig, key="step_ms"):
        return f"{fig[key]:.3f}" if fig and fig.get(key) is not None else "-"

    print("| model | mode | kiln | PyTorch | torch.compile | JAX | kiln/JAX | kiln planned | PyTorch reserved "
          "| kiln/PyTorch | XLA total | kiln/XLA |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, modes in models.items():
        for mode in ("train", "forward"):
            r = modes.get(mode, {})
            k, t, c, j = (r.get(p) for p in ("kiln", "torch", "torch_compile", "jax"))
            if not k:
                continue
            ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"
            planned = k["planned_total_bytes"]
            reserved = (t or {}).get("max_memory_reserved")
            xla = (j or {}).get("xla_total_bytes")
            print(f"| {name} | {mode} | {ms(k)} | {ms(t)} | {ms(c)} | {ms(j)} "
                  f"| {ratio(k['step_ms'], (j or {}).get('step_ms'))} | {planned:,} "
                  f"| {reserved:,} | {planned / reserved:.3f} | {xla:,} | {planned / xla:.2f} |"
                  if reserved and xla else
                  f"| {name} | {mode} | {ms(k)} | {ms(t)} | {ms(c)} | {ms(j)} | - | {planned:,} | - | - | - | - |")
    print()
    print("| M x K x N | kiln | torch.matmul f32 | kiln/torch | torch TF32 |")
    print("|---|---|---|---|---|")
    for g in gemm:
        tf = g["torch_f32_tflops"]
        print(f"| {g['m']}x{g['k']}x{g['n']} | {g['kiln_tflops']:.2f} | {tf:.2f} | {g['kiln_tflops'] / tf:.2f} "
              f"| {g['torch_tf32_tflops']:.2f} |" if tf else f"| {g['m']}x{g['k']}x{g['n']} | {g['kiln_tflops']:.2f} | - | - | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
