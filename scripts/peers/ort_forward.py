#!/usr/bin/env python3
"""onnxruntime's CPU provider on one ONNX model, for kiln's forward-pass comparison
(`cargo bench --bench forward`): the model's outputs on the inputs of an .npz file (arrays named
as the model's inputs, cast to the types it declares), written to an .npz, and the time of each
of RUNS runs after two warm-up runs, on THREADS intra-op threads (one inter-op thread, every
graph optimisation on, as onnxruntime runs by default).

usage: ort_forward.py MODEL.onnx INPUTS.npz OUTPUTS.npz --threads N --runs N

Prints one JSON line: {"version": onnxruntime's version, "ms": [each timed run]}.
"""

import json
import sys
import time


def main():
    argv = sys.argv[1:]
    opts = {}
    for flag in ("--threads", "--runs"):
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = int(argv[i + 1])
            del argv[i : i + 2]
    if len(argv) != 3:
        sys.exit(__doc__)
    model, inputs, outputs = argv
    import numpy as np
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = opts.get("--threads", 1)
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
             "tensor(bool)": np.bool_, "tensor(float16)": np.float16, "tensor(double)": np.float64}
    data = np.load(inputs)
    feeds = {i.name: data[i.name].astype(types.get(i.type, np.float32)) for i in sess.get_inputs()}
    names = [o.name for o in sess.get_outputs()]
    got = sess.run(names, feeds)
    np.savez(outputs, **dict(zip(names, got)))
    for _ in range(2):
        sess.run(names, feeds)
    ms = []
    for _ in range(opts.get("--runs", 5)):
        t = time.perf_counter()
        sess.run(names, feeds)
        ms.append((time.perf_counter() - t) * 1e3)
    print(json.dumps({"version": ort.__version__, "ms": ms}))


if __name__ == "__main__":
    main()
