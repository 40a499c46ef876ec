"""Running test cases inside spawned gloo ranks: a free port, a worker that runs named cases
in step on every rank and gathers their results, and the pytest side that spawns it.
At the root of tests/: the two-rank tests of distributed/, data/, integrations/, pipeline/ and
vision/ share it."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

SPAWN_ATTEMPTS = 4  # spawns of the 2 ranks before a start-up failure fails the test


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(rank: int, world: int, port: int, out_path: str,
              cases: dict[str, Callable[[], dict]], timeout_s: int = 60) -> None:
    """Inside a spawned rank: run every case, keep the ranks in step, write all results."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    results = {}
    for name, case in cases.items():
        try:
            results[name] = case()
        except Exception:  # noqa: BLE001 - reported, and the ranks kept in step for the next case
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    every = [None] * world
    dist.all_gather_object(every, results)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(every, f)
    dist.destroy_process_group()


def spawn_and_collect(worker: Callable, out_path, *args) -> list[dict]:
    """Spawn 2 ranks of ``worker(rank, 2, port, out_path, *args)``; fail the test on any
    case that raised on a rank; return the per-rank results."""
    import pytest
    import torch.multiprocessing as mp

    for attempt in range(1, SPAWN_ATTEMPTS + 1):
        try:
            mp.spawn(worker, args=(2, free_port(), str(out_path), *args), nprocs=2, join=True)
            break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            # seen under the full suite, on a loaded machine: a rank aborting while the gloo
            # group forms ("terminate called without an active exception"), twice in a row
            # once, or the picked port taken before the ranks bind it. Retry on a new port;
            # a case that fails is reported in the results (never raised), so a deterministic
            # failure still fails, and a rank that raises every time fails after the last try.
            if attempt == SPAWN_ATTEMPTS:
                raise
            print(f"spawn failed ({e}); attempt {attempt + 1} of {SPAWN_ATTEMPTS} on a new port")
            time.sleep(attempt)
    with open(out_path) as f:
        per_rank = json.load(f)
    for r in per_rank:
        for name, res in r.items():
            if "error" in res:
                pytest.fail(f"case {name} failed on a rank:\n{res['error']}")
    return per_rank
