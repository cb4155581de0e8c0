#!/usr/bin/env python3
"""Exports the real-scale architectures to ONNX for kiln's real-scale comparison.

Random weights, opset 17, TorchScript export (`dynamo=False`), the model in training mode with
BatchNorm kept as a node (`TrainingMode.TRAINING`), no constant folding (equal initializers are
not merged), tied weights kept tied. Batch and sequence sizes are the issue's "real" ones unless
`--batch` overrides them.

With `--eval` the model is exported for inference (`TrainingMode.EVAL`, dropout off, batch norm
with its running statistics) as NAME-eval.onnx, for forward-pass plans.

usage: export.py OUT_DIR [MODEL ...] [--batch N] [--eval]
models: resnet50 efficientnet_b0 mobilenet_v3_small vit_b_16 gpt2 bert
       (default: all of them)
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402

DEFAULT_BATCH = models.BATCH


def export(name, out_dir, batch, train):
    import torch

    torch.manual_seed(0)
    model = models.build(name)
    args, names = models.example(torch, name, batch)
    model.train(train)
    path = os.path.join(out_dir, f"{name}.onnx" if train else f"{name}-eval.onnx")
    torch.onnx.export(
        model,
        args,
        path,
        input_names=names,
        output_names=["y"],
        opset_version=17,
        training=torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL,
        do_constant_folding=False,
        dynamo=False,
    )
    print(f"{name}: {path} (batch {batch})")


def main():
    argv = sys.argv[1:]
    batch = None
    train = "--eval" not in argv
    argv = [a for a in argv if a != "--eval"]
    if "--batch" in argv:
        i = argv.index("--batch")
        batch = int(argv[i + 1])
        del argv[i : i + 2]
    if not argv:
        sys.exit(__doc__)
    out_dir, names = argv[0], argv[1:] or list(DEFAULT_BATCH)
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        if name not in DEFAULT_BATCH:
            sys.exit(f"unknown model {name}: {' '.join(DEFAULT_BATCH)}")
        export(name, out_dir, batch or DEFAULT_BATCH[name], train)


if __name__ == "__main__":
    main()
