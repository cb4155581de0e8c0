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

# name: (batch, builder, example inputs maker, input names)
DEFAULT_BATCH = {
    "resnet50": 32,
    "efficientnet_b0": 32,
    "mobilenet_v3_small": 2,
    "vit_b_16": 16,
    "gpt2": 4,
    "bert": 8,
}
SEQ = 256


def vision(name):
    import torchvision

    return getattr(torchvision.models, name)(weights=None)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_positions=1024, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, use_cache=False)
    model = GPT2LMHeadModel(cfg)
    model.config.return_dict = False
    return model


def bert():
    from transformers import BertConfig, BertModel

    cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertModel(cfg, add_pooling_layer=False)
    model.config.return_dict = False
    return model


class Logits:
    """Wraps a transformers model so that the export has one output (its first)."""

    def __new__(cls, inner):
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = inner

            def forward(self, *xs):
                return self.inner(*xs)[0]

        return M()


def export(name, out_dir, batch, train):
    import torch

    torch.manual_seed(0)
    if name in ("gpt2", "bert"):
        model = Logits(gpt2() if name == "gpt2" else bert())
        ids = torch.randint(0, 1000, (batch, SEQ), dtype=torch.int64)
        if name == "gpt2":
            args, names = (ids,), ["input_ids"]
        else:
            args, names = (ids, torch.ones(batch, SEQ, dtype=torch.int64)), ["input_ids", "attention_mask"]
    else:
        model = vision(name)
        size = 224
        args, names = (torch.randn(batch, 3, size, size),), ["x"]
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
