#!/usr/bin/env python3
"""A real-scale model's forward pass's product FLOPs as PyTorch counts them.

`torch.utils.flop_counter.FlopCounterMode` over one forward call of `models.build(name)` (in
training mode, as exported) on `models.example(name, batch)`: matrix products, convolutions
(grouped and depthwise at their real cost) and attention, each 2 FLOPs a multiply-add;
elementwise ops are not counted. A product's backward pass is twice its forward (the input's
and the weight's gradients), so a training step's products are about 3x this figure; kiln's
real-scale bench compares its plan's product FLOPs with that. (The counter's backward of a
grouped convolution counts it as a dense one: 1,030 GFLOP for EfficientNet-B0's step at batch
32 against 3 x 24.6; the forward count is right.)

usage: flops.py OUT_JSON NAME BATCH
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    out, name, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = models.build(name)
    model.train(True)
    args, _ = models.example(torch, name, batch)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*args)
    with open(out, "w") as f:
        json.dump({"model": name, "batch": batch, "forward_flops": counter.get_total_flops()}, f)
    print(f"{name}: {counter.get_total_flops() / 1e9:.2f} GFLOP forward at batch {batch}")


if __name__ == "__main__":
    main()
