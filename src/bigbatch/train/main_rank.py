"""The main rank working alone while the others wait: evaluating, embedding a corpus,
indexing the training data or writing a checkpoint can take far longer than
``--dist-timeout`` (which bounds collectives), so the waiting ranks use a group of their own
with a long timeout. Also the gathering of every rank's random state for a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from ..engine import distributed as D
from ..errors import BigBatchError
from .checkpoint import rng_state

T = TypeVar("T")

__all__ = ["MAIN_RANK_WAIT", "barrier", "from_main", "main_first", "gather_rng_states",
           "any_rank"]

# how long the other ranks wait while the main rank evaluates, embeds a corpus or writes
# a checkpoint alone: --dist-timeout bounds collectives, not how long an evaluation may take
MAIN_RANK_WAIT = timedelta(days=2)
_wait: list[Any] = [None, None]  # [the default group it was made for, the wait group]


def _wait_group() -> Any:
    """A gloo group over all ranks with a :data:`MAIN_RANK_WAIT` timeout (created once per
    default group, on every rank at the same point: its first use)."""
    import torch.distributed as dist

    if _wait[0] is not dist.group.WORLD:  # holding the group keeps its identity unique
        _wait[:] = [dist.group.WORLD, dist.new_group(backend="gloo", timeout=MAIN_RANK_WAIT)]
    return _wait[1]


def barrier(info: D.WorldInfo) -> None:
    """Every rank waits here until all arrive, however long the main rank's work took."""
    if info.world_size > 1:
        import torch.distributed as dist
        dist.barrier(group=_wait_group())


def any_rank(flag: int, info: D.WorldInfo) -> int:
    """The largest of every rank's ``flag`` (a small integer), the same on every rank: one
    all-reduce on the wait group (gloo, CPU), whatever the training backend."""
    if info.world_size == 1:
        return flag
    import torch
    import torch.distributed as dist

    t = torch.tensor([flag], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_wait_group())
    return int(t.item())


def from_main(obj: Any, info: D.WorldInfo) -> Any:
    """The main rank's ``obj`` on every rank (the others wait as in :func:`barrier`)."""
    if info.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_wait_group())
    return box[0]


def main_first(fn: Callable[[], T], info: D.WorldInfo) -> T:
    """``fn()`` on the main rank first, while the others wait (however long it takes: the
    main rank indexing the training data), then on the others (which find its work done,
    an index kept on disk). A bigbatch error on the main rank (bad data) is raised on every
    rank, naming it, instead of the others running ``fn`` into the same error."""
    if info.world_size == 1:
        return fn()
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except BigBatchError as e:
            error = e
    barrier(info)
    D.raise_together(error)
    return result if info.is_main else fn()


def gather_rng_states(info: D.WorldInfo) -> list[dict[str, Any]]:
    """Every rank's random states (Python, NumPy, torch, accelerator), in rank order."""
    mine = rng_state()
    if info.world_size == 1:
        return [mine]
    import torch.distributed as dist

    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states
