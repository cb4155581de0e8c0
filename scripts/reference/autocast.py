"""PyTorch's side of the mixed-precision numerics check (kiln::autocast_reference).

For each case directory under DIR (`<model>-<seed>`, written by `autocast_reference inputs DIR`): reads the
starting weights (start.safetensors, kiln's keys and layouts: a dense kernel [in, out], a conv
kernel [kh, kw, in, out], NHWC images) and the batch (batch.safetensors), builds the same model
functionally in PyTorch, and trains it STEPS steps of SGD three ways: in f32; under
torch.autocast("cpu", torch.bfloat16) (PyTorch's CPU lists); and under PyTorch's CUDA autocast
lists applied on the CPU (scripts/peers/torch_stream.py's `cuda_autocast`, as the real-scale
recorder runs them). Writes each run's parameters after the steps (<run>.safetensors) and the
losses (torch.json). Usage: python autocast.py DIR STEPS LEARNING_RATE
"""
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
from torch_stream import cuda_autocast  # noqa: E402


def read(path):
    blob = open(path, "rb").read()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        assert info["dtype"] == "F32", (path, key, info["dtype"])
        a, b = info["data_offsets"]
        data = np.frombuffer(blob[8 + n + a:8 + n + b], dtype="<f4").reshape(info["shape"])
        out[key] = torch.tensor(data.copy())
    return out


def write(path, tensors):
    header, chunks, offset = {}, [], 0
    for key in sorted(tensors):
        data = tensors[key].detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[key] = {"dtype": "F32", "shape": list(tensors[key].shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def linear(p, name, x):
    return F.linear(x, p[name + "/kernel"].t(), p[name + "/bias"])


def layer_norm(p, name, x):
    return F.layer_norm(x, (x.shape[-1],), p[name + "/gamma"], p[name + "/beta"], eps=1e-5)


def attention(p, name, x, heads, causal):
    b, s, d = x.shape
    split = lambda t: t.reshape(b, s, heads, d // heads).transpose(1, 2)
    q, k, v = (split(linear(p, f"{name}/{w}", x)) for w in ("query", "key", "value"))
    context = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return linear(p, name + "/output", context.transpose(1, 2).reshape(b, s, d))


def blocks(p, h, layers, heads, causal, gelu):
    for i in range(layers):
        attn, mlp = f"residual{'_' + str(2 * i) if i else ''}", f"residual_{2 * i + 1}"
        h = h + attention(p, attn + "/multi_head_attention", layer_norm(p, attn + "/layer_normalization", h), heads, causal)
        inner = layer_norm(p, mlp + "/layer_normalization", h)
        h = h + linear(p, mlp + "/dense_1", F.gelu(linear(p, mlp + "/dense", inner), approximate=gelu))
    return layer_norm(p, "layer_normalization", h)


def soft_cross_entropy(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1, y.shape[-1]))


def seed_mlp(p, x, y):
    prob = torch.sigmoid(linear(p, "dense_1", F.relu(linear(p, "dense", x)))).clamp(1e-7, 1 - 1e-7)
    return -(y * torch.log(prob) + (1 - y) * torch.log(1 - prob)).mean()


def mlp(p, x, y):
    h = F.relu(linear(p, "dense_1", F.relu(linear(p, "dense", x))))
    return soft_cross_entropy(linear(p, "dense_2", h), y)


def cnn(p, x, y):
    h = x.permute(0, 3, 1, 2)
    conv = lambda h, name: F.relu(F.conv2d(h, p[name + "/kernel"].permute(3, 2, 0, 1), p[name + "/bias"], padding=1))
    h = F.max_pool2d(conv(conv(h, "conv2d"), "conv2d_1"), 2)
    h = F.max_pool2d(conv(conv(h, "conv2d_2"), "conv2d_3"), 2)
    h = h.permute(0, 2, 3, 1).reshape(h.shape[0], -1)
    return soft_cross_entropy(linear(p, "dense_1", F.relu(linear(p, "dense", h))), y)


def transformer(p, x, y):
    h = F.embedding(x.long(), p["embedding/embeddings"])
    return soft_cross_entropy(linear(p, "dense", blocks(p, h, 1, 4, False, "none")), y)


def gpt(p, x, y):
    h = F.embedding(x.long(), p["embedding/embeddings"]) + p["position_embedding/positions"][: x.shape[1]]
    logits = linear(p, "dense", blocks(p, h, 2, 4, True, "tanh"))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1).long())


MODELS = {"seed-mlp": seed_mlp, "mlp": mlp, "cnn": cnn, "transformer": transformer, "gpt": gpt}


def train(forward, start, x, y, steps, lr, mode):
    p = {k: v.clone().requires_grad_(True) for k, v in start.items()}
    losses = []
    for _ in range(steps):
        if mode == "f32":
            loss = forward(p, x, y)
        elif mode == "bf16-cpu":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = forward(p, x, y)
        else:
            with cuda_autocast(torch, torch.bfloat16):
                loss = forward(p, x, y)
        grads = torch.autograd.grad(loss.float(), list(p.values()))
        with torch.no_grad():
            for t, g in zip(p.values(), grads):
                t -= lr * g.float()
        losses.append(float(loss.detach()))
    return p, losses


def main():
    root, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    for case in sorted(os.listdir(root)):
        name, forward = case, MODELS[case.rsplit("-", 1)[0]]
        at = os.path.join(root, case)
        start, batch = read(os.path.join(at, "start.safetensors")), read(os.path.join(at, "batch.safetensors"))
        runs = {}
        for mode in ("f32", "bf16-cpu", "bf16-cuda-lists"):
            params, losses = train(forward, start, batch["x"], batch["y"], steps, lr, mode)
            write(os.path.join(at, mode + ".safetensors"), params)
            runs[mode] = losses
        json.dump({"torch": torch.__version__, "losses": runs}, open(os.path.join(at, "torch.json"), "w"))
        print(name, {k: [round(v, 5) for v in l] for k, l in runs.items()})


if __name__ == "__main__":
    main()
