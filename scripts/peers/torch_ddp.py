#!/usr/bin/env python3
"""PyTorch DistributedDataParallel on the gloo backend (CPU) for kiln's zoo models, for
`cargo bench --bench data_parallel`.

For each model and each rank count N in --ranks, N processes (torch.multiprocessing, gloo over
127.0.0.1) train the idiomatic twin of torch_stream.py, each on its 1/N of the zoo's batch, with
DDP's default buckets (25 MiB) and Adam(foreach=True); N = 1 is the plain model, no DDP. Each
process uses cores / N threads. After 3 warm-up steps, STEPS steps are each timed on rank 0 by the
host clock (zero_grad, forward, loss, backward with DDP's all-reduces, step), a barrier before
each. Prints {"torch": version, "models": {name: {"N": {"step_ms": [...], "grad_bytes": n}}}}.

usage: torch_ddp.py --models a,b --ranks 1,2 --steps N
"""

import argparse
import json
import os
import socket
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(rank, n, name, steps, port, queue):
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from torch import nn

    import torch_stream

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    if n > 1:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=n)
    torch.manual_seed(0)
    build, make_x, make_y, loss_fn, lr = torch_stream.models(torch, nn)[name]
    x, y = make_x("cpu"), make_y("cpu")
    shard = x.shape[0] // n
    x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
    model = build()
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    net = nn.parallel.DistributedDataParallel(model) if n > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=lr, eps=1e-7, foreach=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        if n > 1:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append((time.perf_counter() - t0) * 1e3)
    if n > 1:
        dist.destroy_process_group()
    if rank == 0:
        queue.put({"step_ms": times, "grad_bytes": grad_bytes})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = {"torch": torch.__version__, "models": {}}
    for name in args.models.split(","):
        row = {}
        for n in [int(r) for r in args.ranks.split(",")]:
            queue = ctx.Queue()
            port = free_port()
            procs = [ctx.Process(target=worker, args=(r, n, name, args.steps, port, queue)) for r in range(n)]
            for p in procs:
                p.start()
            result = queue.get(timeout=600)
            for p in procs:
                p.join(timeout=60)
                if p.exitcode != 0:
                    print(f"{name} on {n} ranks: a process exited with {p.exitcode}", file=sys.stderr)
                    return 1
            row[str(n)] = result
        out["models"][name] = row
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
