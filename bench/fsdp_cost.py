"""What ``--fsdp`` saves and costs, measured under torchrun on a fixed tiny decoder (a random
Qwen3, 8 blocks 512 wide, float32, about 25M parameters): per rank, the bytes of the
model's state it holds after an optimizer step (its weights, gradients and AdamW moments,
counted from the tensors: a shard's local part), the process's resident memory before the
measured steps and its peak during them (Linux: freed memory handed back with
``malloc_trim``, the high-water mark reset through ``/proc/self/clear_refs``, then
``VmHWM``: what the steps hold, not the set-up's transient whole copies), and the time of
one training step (the GradCache step of ``bigbatch train``: both towers the
encoder, AdamW, clipping), for each of

- ``fsdp``: the encoder sharded by :func:`bigbatch.train.sharding.shard_encoder`;
- ``plain``: the encoder replicated, gradients summed by the engine's one all-reduce (what
  ``bigbatch train`` runs without ``--fsdp``);
- ``ddp``: the encoder wrapped in ``DistributedDataParallel`` (the engine calls the inner
  module and syncs once itself).

Several modes in one launch run in interleaved rounds (the time ratio comes from one run);
one mode per launch gives that mode's peak memory.

    torchrun --standalone --nproc_per_node=2 bench/fsdp_cost.py --modes fsdp,plain,ddp
    torchrun --standalone --nproc_per_node=4 bench/fsdp_cost.py --modes fsdp --rounds 1

Prints one JSON line per rank 0 with the numbers.
"""

from __future__ import annotations

import argparse
import copy
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist


def build(root: Path, hidden: int, layers: int):
    from bigbatch.encoders import TextEncoder
    from bigbatch.encoders.tiny import build_tiny_text

    path = build_tiny_text(root / f"qwen3-{hidden}-{layers}", hidden=hidden, layers=layers)
    torch.manual_seed(0)
    return TextEncoder(path, pooling="last", max_length=64).train()


def state_bytes(enc, optimizer) -> dict[str, int]:
    from bigbatch.train.sharding import local_shards

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    params = list(enc.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    moments = [v for s in optimizer.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step"]
    return {"weights": nbytes(local_shards(params)), "gradients": nbytes(local_shards(grads)),
            "optimizer_states": nbytes(local_shards(moments))}


def runner(mode: str, base, batch: list[str], docs: list[str]):
    import bigbatch as bb
    from bigbatch.train.sharding import clip_gradients, shard_encoder

    enc = copy.deepcopy(base)
    if mode == "fsdp":
        shard_encoder(enc, torch.device("cpu"))
        tower = enc
    elif mode == "ddp":
        tower = torch.nn.parallel.DistributedDataParallel(enc)
    else:
        tower = enc
    loss = bb.InfoNCE(temperature=0.05)
    params = enc.trainable_parameters()
    opt = torch.optim.AdamW([{"params": params}, {"params": list(loss.parameters())}], lr=1e-5)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss, chunk_size=8,
                         sort_by_length=True)
    q, d = enc.tokenize(batch, "query"), enc.tokenize(docs, "doc")

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        cache.step(query=q, doc=d)
        clip_gradients(params + list(loss.parameters()), 1.0)
        opt.step()
        dist.barrier()
        return time.perf_counter() - t0

    return enc, opt, step


def status_mb(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak() -> float | None:
    """Hand freed memory back, reset the high-water mark; returns the resident MB now."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return status_mb("VmRSS")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="fsdp,plain,ddp")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16, help="queries per rank")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--work", default=None, help="folder for the tiny model (default: a temp)")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    root = Path(a.work or tempfile.gettempdir()) / "bigbatch-fsdp-cost"
    if rank == 0:
        build(root, a.hidden, a.layers)
    dist.barrier()
    base = build(root, a.hidden, a.layers)
    words = "cells divide in tissue while proteins fold under stress and light".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(8 + i % 24))
             for i in range(a.batch * world * 2)]
    mine = texts[rank * a.batch:(rank + 1) * a.batch]
    docs = texts[(world + rank) * a.batch:(world + rank + 1) * a.batch]
    modes = a.modes.split(",")
    runs = {m: runner(m, base, mine, docs) for m in modes}
    del base
    for _, _, step in runs.values():  # a warm-up step each (and the optimizer's states)
        step()
    before = reset_peak()
    times = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            times[m].append(runs[m][2]())
    out = {"world": world, "modes": {}, "params": sum(p.numel() for p in runs[modes[0]][0]
                                                      .parameters()),
           "rss_before_steps_mb": before, "peak_during_steps_mb": status_mb("VmHWM"),
           "peak_rss_whole_run_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    for m in modes:
        enc, opt, _ = runs[m]
        out["modes"][m] = {"step_s": statistics.median(times[m]), **state_bytes(enc, opt)}
    if len(modes) > 1 and "fsdp" in modes:
        out["time_ratio_fsdp_over"] = {m: out["modes"]["fsdp"]["step_s"] / out["modes"][m]
                                       ["step_s"] for m in modes if m != "fsdp"}
    every = [None] * world
    dist.all_gather_object(every, out)
    if rank == 0:
        print(json.dumps({"per_rank": every}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
