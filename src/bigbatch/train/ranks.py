"""The main rank working alone while the others wait: evaluating, embedding a corpus or
writing a checkpoint can take far longer than ``--dist-timeout`` (which bounds
collectives), so the waiting ranks use a group of their own with a long timeout. Also the
gathering of every rank's random state for a checkpoint.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .. import distributed as D
from .checkpoint import rng_state

__all__ = ["MAIN_RANK_WAIT", "barrier", "from_main", "gather_rng_states"]

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


def from_main(obj: Any, info: D.WorldInfo) -> Any:
    """The main rank's ``obj`` on every rank (the others wait as in :func:`barrier`)."""
    if info.world_size == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_wait_group())
    return box[0]


def gather_rng_states(info: D.WorldInfo) -> list[dict[str, Any]]:
    """Every rank's random states (Python, NumPy, torch, accelerator), in rank order."""
    mine = rng_state()
    if info.world_size == 1:
        return [mine]
    import torch.distributed as dist

    states: list[Any] = [None] * info.world_size
    dist.all_gather_object(states, mine)
    return states
