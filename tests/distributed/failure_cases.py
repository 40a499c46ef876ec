"""Cases run inside 2 gloo ranks (spawned by test_rank_failures.py): something fails on rank 1
only, inside a tower, the loss or its backward, in the first or the second pass. Every rank
must end the step with an error at once (not wait in the next collective until the timeout),
and the ranks must stay in step: the next, healthy step works and agrees on both ranks."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import DT  # noqa: E402

import bigbatch as bb  # noqa: E402

TIMEOUT_S = 30  # collective timeout: a rank left waiting fails the case after this long


class Flaky(nn.Module):
    """A linear tower that raises on rank ``fail_rank`` at its ``fail_call``-th call.

    With 3 queries, 3 documents and chunk size 2, calls 1-4 are the first pass (query
    chunks 0, 1, doc chunks 0, 1; doc chunk 1 is kept) and calls 5-7 the replay."""

    def __init__(self, fail_call: int, fail_rank: int = 1, kind: str = "raise"):
        super().__init__()
        self.lin = nn.Linear(4, 4).to(DT)
        self.fail_call, self.fail_rank, self.kind, self.calls = fail_call, fail_rank, kind, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.fail_call and dist.get_rank() == self.fail_rank:
            if self.kind == "rows":
                return self.lin(x)[:1]  # a wrong row count: the engine's own ShapeError
            raise RuntimeError(f"tower failed on rank {dist.get_rank()}")
        return self.lin(x)


def failing_loss(when: str = "forward"):
    """A generic (non-protocol) InfoNCE-like loss that fails on rank 1: raises in its forward,
    returns NaN, or raises in its backward."""

    class _Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError(f"loss backward failed on rank {dist.get_rank()}")

    inner = bb.InfoNCE(learnable_temperature=False).to(DT)

    def loss(query, doc):
        if loss.armed and dist.get_rank() == 1:
            if when == "forward":
                raise RuntimeError("loss failed on rank 1")
            if when == "backward":
                query = _Boom.apply(query)
        out = inner(query, doc)
        if when == "nan" and loss.armed and dist.get_rank() == 1:
            return out[0] * float("nan")
        return out[0]

    loss.armed = True
    return loss


class FailingInfoNCE(bb.InfoNCE):
    """The protocol loss, failing inside its computation on rank 1 (as an out-of-memory in
    the logits would)."""

    armed = True

    def _compute(self, *args, **kwargs):
        if self.armed and dist.get_rank() == 1:
            raise RuntimeError("logits out of memory on rank 1")
        return super()._compute(*args, **kwargs)


def _rows(n, seed):
    return torch.randn(n, 4, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _case(tower: Flaky, loss_fn=None, docs=(3, 3), **engine_kwargs):
    """One failing step, then one healthy step; report the first step's error on this rank,
    how long it took, and whether the second step worked and agreed over the ranks."""
    rank = dist.get_rank()
    loss_fn = loss_fn if loss_fn is not None else bb.InfoNCE().to(DT)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2,
                         params=tower.parameters(), **engine_kwargs)
    t0 = time.monotonic()
    try:
        cache.step(query=_rows(3, rank), doc=_rows(docs[rank], 10 + rank))
        raised, message = None, ""
    except Exception as e:  # noqa: BLE001 - the test checks which one
        raised, message = type(e).__name__, str(e)
    seconds = time.monotonic() - t0
    # the ranks are still in step: a healthy step (no failure left) works on both
    tower.fail_call = -1
    if hasattr(loss_fn, "armed"):
        loss_fn.armed = False
    for p in tower.parameters():
        p.grad = None
    next_ok, next_agree = False, False
    try:
        res = cache.step(query=_rows(3, rank), doc=_rows(3, 10 + rank))
        flat = torch.cat([p.grad.reshape(-1) for p in tower.parameters()])
        if engine_kwargs.get("sync_gradients") is False:  # the caller's own sync
            dist.all_reduce(flat)
        parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, flat)
        next_ok = bool(torch.isfinite(res.loss))
        next_agree = all(torch.equal(p, parts[0]) for p in parts)
    except Exception as e:  # noqa: BLE001
        message += f" | next step: {type(e).__name__}: {e}"
    return {"raised": raised, "message": message, "seconds": seconds, "next_ok": next_ok,
            "next_agree": next_agree}


CASES = {
    "warm_up": lambda: {"barrier": dist.barrier() is None},
    "tower_first_pass": lambda: _case(Flaky(fail_call=1)),
    "tower_first_pass_last_chunk": lambda: _case(Flaky(fail_call=4)),  # the kept chunk
    "tower_rows_first_pass": lambda: _case(Flaky(fail_call=1, kind="rows")),
    "tower_second_pass": lambda: _case(Flaky(fail_call=6)),
    "tower_second_pass_no_sync": lambda: _case(Flaky(fail_call=5), sync_gradients=False),
    "tower_second_pass_local_loss": lambda: _case(Flaky(fail_call=7), cross_device=False),
    "loss_forward_cross_device": lambda: _case(Flaky(-1), failing_loss("forward")),
    "loss_nan_cross_device": lambda: _case(Flaky(-1), failing_loss("nan")),
    "loss_backward_cross_device": lambda: _case(Flaky(-1), failing_loss("backward")),
    "loss_forward_local": lambda: _case(Flaky(-1), failing_loss("forward"), cross_device=False),
    "loss_forward_local_unchecked": lambda: _case(Flaky(-1), failing_loss("forward"),
                                                  cross_device=False, check_finite=False),
    "loss_backward_local": lambda: _case(Flaky(-1), failing_loss("backward"),
                                         cross_device=False),
    "infonce_compute": lambda: _case(Flaky(-1), FailingInfoNCE().to(DT)),
    # a user's bad batch on rank 1 (4 documents for 3 queries) with rank-local losses
    "bad_layout_local": lambda: _case(Flaky(-1), docs=(3, 4), cross_device=False),
}


def worker(rank, world, port, out_path, names):
    run_cases(rank, world, port, out_path, {n: CASES[n] for n in names}, timeout_s=TIMEOUT_S)
