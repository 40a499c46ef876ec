"""What sharing a rank's failure costs a healthy step: 2 gloo processes on the CPU.

The failure flags travel inside collectives a step makes anyway (the after-embedding
exchange, the gather's backward, the loss's closing all-reduce, the gradient sync), so the
normal path should cost no more than before; ``sync_gradients=False`` adds one small
all-gather per step. This times, per configuration, the median wall time of a step (a small
MLP, batch 64 per rank, chunk 16, float32, InfoNCE with one hard negative), and one bare
8-byte all-gather, the price of that extra exchange, and counts the collectives of one step and the
elements
they move (deterministic, unlike the times on a shared machine). Compare two checkouts by running it
with each one's ``src`` first on PYTHONPATH:

    PYTHONPATH=src python bench/failure_flags.py --steps 60
    PYTHONPATH=/tmp/old/src python bench/failure_flags.py --steps 60

Prints one JSON line per configuration (and the machine and date).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = {
    "cross_device": {},
    "local_loss": {"cross_device": False},
    "no_sync": {"sync_gradients": False},
}


def worker(rank: int, world: int, port: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import bigbatch as bb
    from bigbatch.engine import distributed as D

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    gen = torch.Generator().manual_seed(rank)
    q, d = torch.randn(64, 128, generator=gen), torch.randn(128, 128, generator=gen)
    results = {}
    calls: list[tuple[str, int]] = []

    def counted(fn_name):
        fn = getattr(dist, fn_name)

        def wrapper(*args, **kwargs):
            t = args[0]
            n = (sum(x.numel() for x in t) if isinstance(t, list) and t
                 and isinstance(t[0], torch.Tensor) else t.numel()
                 if isinstance(t, torch.Tensor) else 0)
            calls.append((fn_name, n))
            return fn(*args, **kwargs)
        return fn, wrapper

    originals = {}
    for fn_name in ("all_gather", "all_reduce", "all_gather_object", "broadcast", "barrier"):
        originals[fn_name], wrapper = counted(fn_name)
        setattr(dist, fn_name, wrapper)
    for name, kwargs in CONFIGS.items():  # one step, counting its collectives
        cache = bb.GradCache({"query": model, "doc": model}, bb.InfoNCE(), chunk_size=16,
                             **kwargs)
        calls.clear()
        cache.step(query=q, doc=d)
        results[name] = {"collectives": len(calls),
                         "elements": sum(n for _, n in calls),
                         "calls": [f"{c}:{n}" for c, n in calls]}
    for fn_name, fn in originals.items():
        setattr(dist, fn_name, fn)
    model.zero_grad(set_to_none=True)
    for name, kwargs in CONFIGS.items():
        cache = bb.GradCache({"query": model, "doc": model}, bb.InfoNCE(), chunk_size=16,
                             **kwargs)
        times = []
        for i in range(steps + 5):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            cache.step(query=q, doc=d)
            if kwargs.get("sync_gradients") is False:  # the caller's own sync, as DDP would
                D.all_reduce_gradients(model.parameters())
            if i >= 5:
                times.append(time.perf_counter() - t0)
        results[name].update(median_ms=1e3 * statistics.median(times),
                             p10_ms=1e3 * statistics.quantiles(times, n=10)[0])
    times = []
    for i in range(200):
        dist.barrier()
        t0 = time.perf_counter()
        D.exchange_failure(None)  # one flag, alone in an all-gather
        times.append(time.perf_counter() - t0)
    results["one_flag_all_gather"] = {"median_ms": 1e3 * statistics.median(times[20:]),
                                      "p10_ms": 1e3 * statistics.quantiles(times[20:], n=10)[0]}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def checkout(package: Path) -> str:
    """The commit of the checkout holding the measured ``bigbatch`` (which one was measured,
    without the path it lies at), or ``"installed"`` outside a git checkout."""
    import subprocess

    p = subprocess.run(["git", "-C", str(package), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "installed"


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = f"/tmp/bigbatch-failure-flags-{os.getpid()}.json"
    mp.spawn(worker, args=(2, port, args.steps, out), nprocs=2, join=True)
    from common import machine, now

    import bigbatch

    print(json.dumps({"bigbatch": checkout(Path(bigbatch.__file__).parent), "date": now(),
                      "machine": machine("cpu"), "load_average": os.getloadavg(),
                      "steps": args.steps}))
    for name, res in json.loads(Path(out).read_text()).items():
        print(json.dumps({"config": name, **{k: round(v, 3) if isinstance(v, float) else v
                                             for k, v in res.items()}}))
    os.remove(out)


if __name__ == "__main__":
    main()
