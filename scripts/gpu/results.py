#!/usr/bin/env python3
"""Assembles one GPU run's results record from the logs of `scripts/gpu/checklist.sh` (the
folders brought back from the GPU machine, unpacked from results.tgz), in the form of
`kiln::results::Record` (bench "gpu-peers"), so that `kiln render-docs` renders the README's and
the book's GPU tables from it.

usage: results.py OUT.json DIR [DIR ...] --gpu TEXT --commit HASH [--machine TEXT] [--method TEXT]
       [--date YYYY-MM-DD] [--realscale]

OUT.json goes under benches/results/, named DATE-gpu-peers-COMMIT.json.

With --realscale the record is the checklist's realscale stage (bench "gpu-training", named
DATE-gpu-training-COMMIT.json): per model, kiln-train-NAME.log (`kiln train --bench`: the median
step and the batch) and torch-eager-NAME.log, torch-eager-tf32-NAME.log, torch-compile-NAME.log
(torch_speed.py's JSON, its last line); a run that failed keeps the last line of its error.

Each DIR is a checklist log folder; the later ones win where two hold the same file. Read:
gpu.json (kiln bench-gpu), torch.json, torch_compile.json, jax.json (peers.py), gemm.json (kiln
bench-gemm), gemm_torch.json (peers.py gemm). Figures are copied, never computed here, except
the ratios the tables print.
"""

import argparse
import json
import time
import os
import sys


def read(dirs, name):
    """The text of the last DIR's `name`, or None."""
    found = None
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.exists(p):
            with open(p) as f:
                found = f.read()
    return found


def load(dirs, name):
    """The JSON of the last DIR's `name`, or None."""
    text = read(dirs, name)
    return None if text is None else json.loads(text)


def failure(text):
    """The last error line of a log (a failed run's cause), or None."""
    lines = [l.strip() for l in (text or "").splitlines() if "rror" in l]
    return lines[-1] if lines else None


def last_object(text):
    """The last line of `text` that is a JSON object (what torch_speed.py prints, whatever
    warnings follow it); ValueError where none is."""
    for line in reversed(text.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    raise ValueError("no JSON object")


def realscale(dirs):
    """The realscale stage's figures: {model: {batch, kiln_ms, torch_eager_ms, ...}}."""
    import re
    import statistics

    names = set()
    for d in dirs:
        for f in os.listdir(d):
            m = re.match(r"kiln-train-(.+)\.log$", f)
            if m:
                names.add(m.group(1))
    models = {}
    for name in sorted(names):
        row = {}
        text = read(dirs, f"kiln-train-{name}.log")
        step = re.search(r"more steps: median ([0-9.]+) ms", text)
        batch = re.search(r"\(x \[(\d+)", text)
        if step:
            row["kiln_ms"] = float(step.group(1))
        else:
            exported = read(dirs, f"export-{name}.log")
            why = failure(text) or "no step timed"
            if "cannot read the model" in why and failure(exported):
                why = "the export failed: " + failure(exported)
            row["kiln_error"] = why
        batch = batch or re.search(r"\(batch (\d+)\)", read(dirs, f"export-{name}.log") or "")
        if batch:
            row["batch"] = int(batch.group(1))
        for peer, key in (("eager", "eager_ms"), ("eager-tf32", "eager_ms"), ("compile", "compile_ms")):
            text = read(dirs, f"torch-{peer}-{name}.log")
            if text is None:
                continue
            field = "torch_" + peer.replace("-", "_")
            try:
                data = last_object(text)
                ms = data["models"][name][key]
                row[field + "_ms"] = statistics.median(ms)
                row["torch"] = data.get("torch")
            except (ValueError, KeyError, IndexError, TypeError):
                row[field + "_error"] = failure(text) or "no step timed"
        models[name] = row
    return models


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--gpu", default="")
    ap.add_argument("--method", default="")
    ap.add_argument("--date", default="")
    ap.add_argument("--commit", required=True)
    ap.add_argument("--machine", default="GPU host")
    ap.add_argument("--realscale", action="store_true")
    a = ap.parse_args()
    if a.realscale:
        result = {
            "bench": "gpu-training", "commit": a.commit, "date": a.date,
            "time": time.strftime("%H:%M:%S", time.gmtime()), "machine": a.machine, "device": a.gpu,
            "data": {"method": a.method, "models": realscale(a.dirs)},
        }
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        print(f"wrote {a.out}: run `kiln render-docs` to render the book's tables")
        return 0
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
    result = {
        "bench": "gpu-peers", "commit": a.commit, "date": a.date,
        "time": time.strftime("%H:%M:%S", time.gmtime()), "machine": a.machine, "device": a.gpu,
        "data": {"peers": versions, "method": a.method, "models": models, "gemm": gemm},
    }
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")

    print(f"wrote {a.out}: run `kiln render-docs` to render the README's and the book's tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
