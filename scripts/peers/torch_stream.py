#!/usr/bin/env python3
"""PyTorch's real allocation stream for kiln's zoo training steps, for `kiln::torch_stream`.

Idiomatic PyTorch versions of the zoo models (same shapes, losses and Adam as kiln's; NCHW
convolutions; nn.MultiheadAttention), trained for two steps with `Adam(foreach=True)` and
`zero_grad(set_to_none=True)`, the model built after recording starts so that its parameters
are in the stream. On a CUDA device the stream is the caching allocator's own trace
(`torch.cuda.memory._record_memory_history`): every `alloc` and `free_completed` of a block
with its size and address, in order, together with PyTorch's real peaks
(`max_memory_allocated`, `max_memory_reserved`), with the cuBLAS workspace as PyTorch takes it.
kiln replays the stream through its caching-allocator model (`cargo run --release --
torch-stream FILE`) and sets it beside its own eager column.

Without a CUDA device (or with `--capture dispatch`) the stream is captured on the CPU below
autograd (`record_dispatch`): every storage an ATen op makes, allocated when the op returns and
freed when it dies, host-only scalars left out, matrix products marked. That is the op stream a
CUDA run allocates, less what ops take inside themselves (cuBLAS/cuDNN workspaces, which the
replay adds as the framework columns do). It was chosen over `torch.profiler`'s CPU memory
events because those carry oneDNN scratch, reorders and host scalars that a GPU run does not
have and that cannot be told apart by size. The recording for the committed
`benches/data/torch_stream.json` is made this way (PyTorch from PyPI, no GPU needed).

With `--amp bf16` (or f16) the forward pass and loss run under PyTorch's CUDA autocast lists
(`cuda_autocast`), the parameters and Adam's state f32: the stream of a `torch.autocast` step.

usage: torch_stream.py [--capture cuda|dispatch] [--amp bf16|f16] OUT.json [MODEL ...]
       (default: cuda where a device is present, else dispatch; models seed-mlp mlp cnn transformer,
       or the real-scale ones of scripts/realscale/models.py: resnet50 efficientnet_b0
       mobilenet_v3_small vit_b_16 gpt2 gpt2-sdpa bert bert-sdpa)
"""

import json
import os
import sys


def models(torch, nn):
    F = nn.functional

    class Transformer(nn.Module):
        def __init__(self, vocab=1000, d=256, heads=4, hidden=1024):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.ln1 = nn.LayerNorm(d, eps=1e-5)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d, eps=1e-5)
            self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            self.ln3 = nn.LayerNorm(d, eps=1e-5)
            self.head = nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.embed(ids)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            x = x + self.mlp(self.ln2(x))
            return self.head(self.ln3(x))

    def conv(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    # name: (builder, x maker, y maker, loss, learning rate)
    return {
        "seed-mlp": (
            lambda: nn.Sequential(nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 1), nn.Sigmoid()),
            lambda dev: torch.rand(32, 100, device=dev),
            lambda dev: (torch.rand(32, 1, device=dev) > 0.5).float(),
            lambda p, y: F.binary_cross_entropy(p.clamp(1e-7, 1 - 1e-7), y),
            0.01,
        ),
        "mlp": (
            lambda: nn.Sequential(
                nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
            ),
            lambda dev: torch.rand(256, 784, device=dev),
            lambda dev: F.one_hot(torch.randint(0, 10, (256,), device=dev), 10).float(),
            lambda p, y: F.cross_entropy(p, y),
            1e-3,
        ),
        "cnn": (
            lambda: nn.Sequential(
                *conv(3, 32), *conv(32, 32), nn.MaxPool2d(2),
                *conv(32, 64), *conv(64, 64), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
            ),
            lambda dev: torch.rand(64, 3, 32, 32, device=dev),
            lambda dev: F.one_hot(torch.randint(0, 10, (64,), device=dev), 10).float(),
            lambda p, y: F.cross_entropy(p, y),
            1e-3,
        ),
        "transformer": (
            Transformer,
            lambda dev: torch.randint(0, 1000, (8, 128), device=dev),
            lambda dev: F.one_hot(torch.randint(0, 1000, (8, 128), device=dev), 1000).float(),
            lambda p, y: F.cross_entropy(p.reshape(-1, 1000), y.reshape(-1, 1000)),
            1e-3,
        ),
    }


def training(torch, spec, dev, compiled=False):
    """The zoo twin `spec` on `dev`, ready to run: its batch (made first), the model, Adam(foreach)
    and two closures, one training step (zero_grad(set_to_none=True), loss, backward, step) and
    one forward call under no_grad; with `compiled`, the model and opt.step are torch.compile'd.
    Shared by the CPU speed bench (torch_speed.py) and the GPU peers script (gpu/peers.py)."""
    build, make_x, make_y, loss_fn, lr = spec
    x, y = make_x(dev), make_y(dev)
    model = build().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7, foreach=True)
    fwd = torch.compile(model) if compiled else model
    opt_step = torch.compile(opt.step) if compiled else opt.step

    def train():
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(fwd(x), y)
        loss.backward()
        opt_step()

    def forward():
        with torch.no_grad():
            return fwd(x)

    return train, forward


def record_cuda(torch, nn, name, spec, dev):
    """The caching allocator's own trace of two training steps on a CUDA device."""
    build, make_x, make_y, loss_fn, lr = spec
    # Each model from an empty allocator: the cuBLAS workspaces an earlier model's products took
    # (kept by the handles) released, and the inputs made inside the recording, so that the
    # replayed stream is everything PyTorch's peaks count.
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base_allocated = torch.cuda.memory_allocated()
    reserved_before = torch.cuda.memory_reserved()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    x, y = make_x(dev), make_y(dev)
    model = build().to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7, foreach=True)
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    events = []
    for trace in snapshot.get("device_traces", []):
        for e in trace:
            if e["action"] == "alloc":
                events.append([e["addr"], e["size"]])
            elif e["action"] == "free_completed":
                events.append([e["addr"], -e["size"]])
    result = {
        "capture": "cuda",
        "events": events,
        "max_memory_allocated": torch.cuda.max_memory_allocated() - base_allocated,
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "inputs_bytes": 0,
        "allocated_before": base_allocated,
        "reserved_before": reserved_before,
    }
    del model, opt, x, y
    return result


# Matrix products a CUDA build runs through cuBLAS (which takes its workspace around each).
BLAS_OPS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_addmm_activation"}


def cuda_autocast(torch, dtype):
    """PyTorch's CUDA autocast lists applied on any device, as a TorchFunctionMode (above
    autograd, where autocast itself sits): products, convolutions and attention cast their
    float operands to `dtype` (a parameter once per forward pass, as autocast's weight cache
    does); softmax, log-softmax, layer and group norm, exp, log, pow, rsqrt, sums and the losses
    cast theirs to f32 (softmax, log-softmax and the sums by their `dtype=float32` argument, as
    autocast's "fp32_set_opt_dtype" ops do, with no f32 copy of the input); every other op runs
    on what it is given (type promotion widens a sum of a half and an f32 value). CPU
    autocast's own lists differ (softmax and the norms stay in bf16 there), so a recording on
    the CPU uses these: the stream a CUDA AMP step allocates. A Python function that a function
    mode would pass through whole (`F.multi_head_attention_forward`) runs with the mode active
    inside, so that its projections and attention are cast as CUDA autocast casts them."""
    from torch.overrides import TorchFunctionMode

    F, T = torch.nn.functional, torch.Tensor
    lower = {
        F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d,
        torch.matmul, T.matmul, T.__matmul__, T.__rmatmul__, torch.mm, T.mm, torch.bmm, T.bmm,
        torch.addmm, T.addmm, torch.baddbmm, T.baddbmm, torch.addbmm, torch.einsum,
        F.scaled_dot_product_attention, F.prelu,
    }
    full = {
        F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax, T.log_softmax,
        F.layer_norm, torch.layer_norm, F.group_norm, F.mse_loss, F.cross_entropy, F.nll_loss,
        F.binary_cross_entropy_with_logits, F.l1_loss, F.smooth_l1_loss, F.kl_div, F.softplus,
        torch.exp, T.exp, torch.log, T.log, torch.pow, T.pow, T.__pow__, torch.rsqrt, T.rsqrt,
        torch.reciprocal, T.reciprocal, torch.sum, T.sum, torch.cumsum, T.cumsum, torch.prod,
        torch.norm, T.norm, torch.logsumexp, T.logsumexp,
    }

    # Ops that take the type to compute in as `dtype=`: autocast passes float32 instead of
    # casting their input.
    typed = {
        F.softmax, torch.softmax, T.softmax, F.log_softmax, torch.log_softmax, T.log_softmax,
        torch.sum, T.sum, torch.cumsum, T.cumsum, torch.prod,
    }
    # Python composites whose inner calls a mode would not see.
    composites = {F.multi_head_attention_forward}

    class Autocast(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.cache = {}

        def cast(self, t, to):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != to):
                return t
            if to != torch.float32 and t.is_leaf and t.requires_grad:
                if id(t) not in self.cache:
                    self.cache[id(t)] = t.to(to)
                return self.cache[id(t)]
            return t.to(to)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in composites:
                # Its `has_torch_function` check would hand the call back to this mode.
                check = F.has_torch_function
                F.has_torch_function = lambda *a: False
                try:
                    with self:
                        return func(*args, **kwargs)
                finally:
                    F.has_torch_function = check
            first = args[0] if args else None
            # dtype= only where it is not given positionally (softmax(x, dim, dtype) ...).
            if (
                func in typed
                and "dtype" not in kwargs
                and len(args) <= 2
                and isinstance(first, torch.Tensor)
                and first.dtype in (torch.float16, torch.bfloat16)
            ):
                return func(*args, dtype=torch.float32, **kwargs)
            to = dtype if func in lower else torch.float32 if func in full else None
            if to is not None:
                args = torch.utils._pytree.tree_map(lambda t: self.cast(t, to), args)
                kwargs = torch.utils._pytree.tree_map(lambda t: self.cast(t, to), kwargs)
            return func(*args, **kwargs)

    return Autocast()


def record_dispatch(torch, nn, name, spec, amp=None):
    """The op stream of two training steps as a CUDA device would allocate it, captured on
    the CPU below autograd: every storage an ATen op creates (its outputs, what autograd saves,
    gradients, optimizer state) is an allocation when the op returns, and a free when the
    storage dies (polled before every op, so a free lands between the same two ops as on a
    GPU). What a GPU run would not put on the device is left out: the Adam step counters and
    wrapped scalars (0-dim tensors made inside `optimizer.step`, which stay on the host on
    CUDA). Allocations inside an op that are not tensors (oneDNN scratch here, cuBLAS and
    cuDNN workspaces there) are not ATen storages and are not in the stream; `products` marks
    where each matrix product ran ([position, 1 if in the backward pass]), so a replay can add
    cuBLAS's workspaces as CUDA takes them."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    build, make_x, make_y, loss_fn, lr = spec

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.events, self.products, self.live, self.ids = [], [], {}, 0
            self.host_scalars = False
            # On CUDA autograd runs the backward pass on its own device thread, whose cuBLAS
            # handle has its own workspace: products are marked forward (0) or backward (1).
            self.backward = 0

        def track(self, t):
            s = t.untyped_storage()
            key = s._cdata
            if key in self.live or s.nbytes() == 0:
                return
            self.ids += 1
            self.live[key] = (StorageWeakRef(s), s.nbytes(), self.ids)
            self.events.append([self.ids, s.nbytes()])

        def poll(self):
            for key, (ref, size, i) in list(self.live.items()):
                if ref.expired():
                    self.events.append([i, -size])
                    del self.live[key]

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.poll()
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    if self.host_scalars and t.dim() == 0:
                        continue
                    self.track(t)
            if func.overloadpacket.__name__ in BLAS_OPS:
                self.products.append([len(self.events), self.backward])
            return out

    rec = Recorder()
    with rec:
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7, foreach=True)
        for _ in range(2):
            # A fresh batch per step (kiln's eager calls feed theirs the same way).
            with torch.utils._python_dispatch._disable_current_modes():
                x, y = make_x("cpu"), make_y("cpu")
            rec.poll()
            rec.track(x)
            rec.track(y)
            opt.zero_grad(set_to_none=True)
            if amp is None:
                loss = loss_fn(model(x), y)
            else:
                # The forward pass and the loss under autocast, the backward pass outside it.
                cast = cuda_autocast(torch, amp)
                with cast:
                    loss = loss_fn(model(x), y)
                cast.cache.clear()
            rec.backward = 1
            loss.backward()
            rec.backward = 0
            rec.host_scalars = True
            opt.step()
            rec.host_scalars = False
            del x, y, loss
        rec.poll()
    live, peak = 0, 0
    for _, size in rec.events:
        live += size
        peak = max(peak, live)
    return {
        "capture": "dispatch",
        "events": rec.events,
        "products": rec.products,
        "max_memory_allocated": peak,
        "max_memory_reserved": None,
        "inputs_bytes": 0,
    }


def main():
    args = sys.argv[1:]
    amp = None
    if "--amp" in args:
        i = args.index("--amp")
        amp = args[i + 1] if i + 1 < len(args) else None
        del args[i : i + 2]
        if amp not in ("bf16", "f16"):
            print("--amp takes bf16 or f16", file=sys.stderr)
            return 2
    capture = None
    if "--capture" in args:
        i = args.index("--capture")
        capture = args[i + 1] if i + 1 < len(args) else None
        del args[i : i + 2]
        if capture not in ("cuda", "dispatch"):
            print("--capture takes cuda or dispatch", file=sys.stderr)
            return 2
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    out = args[0]
    names = args[1:] or ["seed-mlp", "mlp", "cnn", "transformer"]
    try:
        import torch
        from torch import nn
    except ImportError as e:
        json.dump({"skipped": f"PyTorch is not installed ({e})"}, open(out, "w"))
        return 0
    capture = capture or ("cuda" if torch.cuda.is_available() else "dispatch")
    if capture == "cuda" and not torch.cuda.is_available():
        json.dump({"skipped": "no CUDA device: the caching allocator's trace needs one"}, open(out, "w"))
        return 0
    torch.manual_seed(0)
    zoo = models(torch, nn)
    if any(n not in zoo for n in names):
        # The real-scale architectures (scripts/realscale/models.py): torchvision, transformers.
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "realscale"))
        import models as realscale

        zoo.update(realscale.specs(torch, nn))
    if amp is not None:
        if capture == "cuda":
            print("--amp records by dispatch capture (--capture dispatch)", file=sys.stderr)
            return 2
        amp = {"bf16": torch.bfloat16, "f16": torch.float16}[amp]
    if capture == "cuda":
        device = torch.cuda.get_device_name()
        streams = {n: record_cuda(torch, nn, n, zoo[n], torch.device("cuda")) for n in names if n in zoo}
    else:
        device = "none (ATen op stream captured on the CPU)"
        streams = {n: record_dispatch(torch, nn, n, zoo[n], amp) for n in names if n in zoo}
    report = {"torch": torch.__version__, "device": device, "capture": capture, "models": streams}
    if amp is not None:
        report["amp"] = str(amp).removeprefix("torch.")
    with open(out, "w") as f:
        json.dump(report, f, separators=(",", ":"))
    print(f"wrote {out}: {', '.join(streams)} by {capture} capture (torch {report['torch']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
