"""Cross-device negatives and one gradient synchronisation per step, on ``torch.distributed``.

World helpers (:func:`world_info`, :func:`init_distributed`), :func:`gather_with_grad` (an
all-gather whose backward hands each rank its slice of the summed gradient),
:func:`all_reduce_gradients` (one coalesced all-reduce of every gradient), and the sharing of
failures, with which a failure on one rank is raised on every rank instead of leaving the
others waiting in the next collective until the timeout (how the engine uses it is told in
:mod:`bigbatch.engine.rank_step`). Its verbs are one protocol, a failure flag per rank exchanged and
then, if any rank failed, one error raised on every rank:

- :func:`share_failure`: the flags were carried by a collective made anyway (the engine's
  gather backward, :meth:`Gathered.all_reduce_sum`, :func:`all_reduce_gradients`); the
  failing rank raises its own exception, the others one naming it;
- :func:`exchange_failure`: the same, with the flags (and a few ints) exchanged in a small
  all-gather of their own, where no collective made anyway can carry them;
- :func:`raise_together`: as :func:`exchange_failure`, for a check before any collective:
  every rank, the failing one included, raises the same error naming the failing rank.

An error raised on every rank by one of them is *shared* (:func:`mark_shared`,
:func:`is_shared`): a caller that catches it re-raises it as it is, instead of sharing it
again (the other ranks raised it too and wait in no collective).

The scaling argument (why there is no factor of world size anywhere)
--------------------------------------------------------------------
Let W ranks hold local batches; the global batch is their concatenation in rank order,
``B = sum_r B_r`` queries. The objective is the loss one process would compute on the global
batch, ``L = (1/B) sum_{i in global queries} CE_i``. Rank r computes only its own rows:

    L_r = (1/B) sum_{i in rank r's queries} CE_i        so that   L = sum_r L_r.

``L_r`` depends on every rank's embeddings through the gathered documents. Backward through
:func:`gather_with_grad` sums the gradients that all ranks computed for rank r's rows, so
rank r receives ``sum_s dL_s/de_r = dL/de_r``: the exact gradient of the global loss with
respect to its own embeddings. Its replay then produces ``sum over its own examples`` of
``dL/de * de/dtheta``, and one all-reduce **SUM** over ranks completes ``dL/dtheta``. A
learnable temperature gets ``dL_r/dt`` on each rank, summed by the same all-reduce. The
1/B is the global mean; nothing is multiplied by W and nothing is averaged over ranks.

A loss that does not implement the cross-device protocol (``cross_device_forward``, as
:class:`bigbatch.InfoNCE` does) is called on the gathered global embeddings and returns the
global ``L`` on every rank. Each rank then backpropagates ``L / W``: the gather's backward
sums W identical contributions, ``W * (1/W) dL/de_r = dL/de_r``. That 1/W undoes exactly
that sum and is the only place a world-size factor appears. With ``cross_device=False``
each rank backpropagates its local mean loss ``L_r / W``; the SUM all-reduce then yields the
mean over ranks of the local gradients, which is what DistributedDataParallel computes.

Uneven local batches (a ragged last batch) are exact: sizes are exchanged first, tensors
are padded to the largest rank for the all-gather, and the padding is dropped again.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor, nn

from .. import errors

__all__ = [
    "WorldInfo", "world_info", "is_distributed", "init_distributed", "gather_with_grad",
    "all_gather_rows", "all_reduce_max", "padded_share", "all_reduce_gradients", "Gathered",
    "unwrap_ddp", "is_fsdp",
    "raise_together", "share_failure", "exchange_failure", "mark_shared", "is_shared",
    "GatherState", "PeerFailed",
]

_SHARED = "_bigbatch_shared"  # the attribute that marks a shared error (see mark_shared)


@dataclass(frozen=True)
class WorldInfo:
    """Rank, world size and local rank of this process (0, 1, 0 when not distributed)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def is_distributed(group: Any = None) -> bool:
    """True when torch.distributed is initialised with more than one process in ``group``."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def world_info(group: Any = None) -> WorldInfo:
    """Rank and world size of ``group`` (default group), local rank from torchrun's env."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    if not (dist.is_available() and dist.is_initialized()):
        return WorldInfo(0, 1, local)
    return WorldInfo(dist.get_rank(group), dist.get_world_size(group), local)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> WorldInfo:
    """Initialise the default process group from torchrun's environment, if launched so.

    Picks NCCL when CUDA is available and gloo otherwise, sets the CUDA device to
    ``LOCAL_RANK``, and sets a collective ``timeout_s`` so that a rank that dies or disagrees
    ends the others with an error instead of a hang (NCCL: with async error handling, on by
    default in recent PyTorch). Without ``WORLD_SIZE`` in the environment it does nothing.
    """
    import torch.distributed as dist

    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return world_info()
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local)
    timeout = timedelta(seconds=timeout_s)
    store = _restart_store(timeout)
    if store is not None:
        dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)
    return world_info()


def _restart_store(timeout: timedelta) -> Any:
    """For the workers of a restarted torchrun job (``--max-restarts``; its
    ``TORCHELASTIC_RESTART_COUNT`` above 0): the agent's store under a prefix of this
    attempt. The agent keeps one store across restarts, and without the prefix the new
    workers read the addresses the dead ones published there and fail to connect (gloo:
    "connectFullMesh failed ... Connection refused"), or wait in their first new group.
    None otherwise (the default rendezvous)."""
    import torch.distributed as dist

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt in ("", "0") or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), False, timeout=timeout)
    return dist.PrefixStore(f"bigbatch/attempt_{attempt}", store)


def _comm_device(t: Tensor | torch.device, group: Any) -> torch.device:
    """Where a collective's buffer must live: the current CUDA device for NCCL, else where
    ``t`` (a tensor or a device) already is."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device if isinstance(t, Tensor) else t


def all_gather_rows(t: Tensor, group: Any = None, sizes: Sequence[int] | None = None) -> Tensor:
    """All-gather ``t`` along dimension 0 without gradient; ranks may hold different row
    counts (``sizes``, exchanged first when not given). Returns the concatenation in rank order."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if sizes is None:
        sizes = _exchange_ints([t.shape[0]], group)[:, 0].tolist()
    longest = max(sizes)
    dev = _comm_device(t, group)
    local = t.to(dev)
    if local.shape[0] < longest:
        pad = local.new_zeros((longest - local.shape[0], *local.shape[1:]))
        local = torch.cat([local, pad])
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)]).to(t.device)


def padded_share(items: Sequence[Any], rank: int, world: int) -> tuple[int, list[Any], int]:
    """Rank ``rank``'s share of ``items`` when ``world`` ranks split them in order:
    ``(start, share, real)``, the share ``ceil(len / world)`` items long on every rank (the
    last ones padded with repeats of the last item, so that every rank makes the same calls;
    a sharded model's forwards are collective) of which the first ``real`` are its own."""
    n = len(items)
    size = -(-n // world)
    start = min(n, rank * size)
    share = list(items[start:start + size])
    real = len(share)
    return start, share + [items[n - 1]] * (size - real), real


def all_reduce_max(t: Tensor, group: Any = None) -> Tensor:
    """The element-wise maximum of ``t`` over the ranks of ``group`` (without gradient), on
    ``t``'s device."""
    import torch.distributed as dist

    merged = t.detach().to(_comm_device(t, group)).clone()
    dist.all_reduce(merged, op=dist.ReduceOp.MAX, group=group)
    return merged.to(t.device)


def _exchange_ints(values: Sequence[int], group: Any = None) -> Tensor:
    """All-gather a short vector of ints from every rank: returns (world, len(values)) on CPU."""
    import torch.distributed as dist

    dev = _comm_device(torch.device("cpu"), group)
    mine = torch.tensor(list(values), dtype=torch.long, device=dev)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts).cpu()


def mark_shared(error: BaseException) -> BaseException:
    """Mark ``error`` as shared: raised on every rank already, so that whoever catches it
    re-raises it as it is (see :func:`is_shared`). Returns ``error``.

    :func:`raise_together`, :func:`share_failure` and :func:`exchange_failure` mark what they
    raise; mark an error yourself when every rank raises it for a reason all ranks know
    (e.g. a check on values just exchanged)."""
    setattr(error, _SHARED, True)
    return error


def is_shared(error: BaseException) -> bool:
    """True when ``error`` is raised on every rank already (:func:`mark_shared`): then no rank
    waits in a collective for this one, and the error must not be shared again."""
    return bool(getattr(error, _SHARED, False))


def raise_together(error: BaseException | None, group: Any = None,
                   values: Sequence[int] = ()) -> Tensor:
    """Make every rank raise when any rank failed a local check before a collective.

    Each rank passes the error its own check raised (or None). One small all-gather tells
    every rank who failed; then all raise the same :mod:`bigbatch.errors` exception (an
    :class:`~bigbatch.errors.InputError` if the first failing rank's was not a bigbatch
    error), naming that rank, identical on every rank, with the original error as the failing
    rank's ``__cause__``, instead of the failing rank raising alone while the others wait in
    the next collective until the timeout. ``values`` (ints, as many on every rank) travel in
    the same all-gather.

    Returns:
        the ``(world, len(values))`` table of every rank's ``values`` when no rank failed.
    """
    table = _exchange_ints([int(error is not None), *values], group)
    found = _first_failure(error, table[:, 0].tolist(), group)
    if found is not None:
        ranks, name, message, _ = found
        raise _peer_error(ranks, name, message, errors.InputError) from error
    return table[:, 1:]


def _first_failure(error: BaseException | None, failed: Sequence[int], group: Any,
                   where: str = "") -> tuple[list[int], str, str, str] | None:
    """None when no rank failed (``failed[r]`` nonzero for those that did, already exchanged,
    the same on every rank); else, after one ``all_gather_object`` of the failing ranks'
    exceptions, (failing ranks, the first one's exception class name, message, ``where``)."""
    import torch.distributed as dist

    ranks = [r for r, f in enumerate(failed) if f]
    if not ranks:
        return None
    mine = None if error is None else (type(error).__name__, str(error), where)
    every: list[Any] = [None] * len(failed)
    dist.all_gather_object(every, mine, group=group)
    name, message, at = every[ranks[0]]
    return ranks, name, message, at


def _peer_error(ranks: list[int], name: str, message: str, fallback: type,
                text: str = "") -> BaseException:
    """The error a rank raises for the first failing rank's exception: its class ``name`` when
    that is a :mod:`bigbatch.errors` one, else ``fallback`` (the name then leads the
    message), worded "rank R (and rank(s) [...]){text}: {message}", and shared."""
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.BigBatchError)):
        cls, message = fallback, f"{name}: {message}"
    more = f" (and rank(s) {ranks[1:]})" if len(ranks) > 1 else ""
    return mark_shared(cls(f"rank {ranks[0]}{more}{text}: {message}"))


def share_failure(error: BaseException | None, failed: Sequence[int], group: Any = None,
                  where: str = "") -> None:
    """Every rank raises when any rank failed (``failed[r]`` nonzero, already exchanged in a
    collective the step made anyway, the same on every rank); nothing happens otherwise.

    The failing rank raises its own ``error`` unchanged (with its traceback). The others
    raise an error naming the first failing rank, ``where`` it failed and its exception: of
    the same class when it is a :mod:`bigbatch.errors` one, else
    :class:`~bigbatch.errors.RankFailedError`. Costs one ``all_gather_object`` of the
    messages, only when something failed. What it raises is shared (:func:`mark_shared`).
    """
    import torch.distributed as dist

    found = _first_failure(error, failed, group, where)
    if found is None:
        return
    if error is not None:
        mark_shared(error)
        if hasattr(error, "add_note"):
            error.add_note(f"bigbatch: raised on rank {dist.get_rank(group)}"
                           f"{' ' + where if where else ''}; the other ranks raised an error "
                           f"naming this rank")
        raise error
    ranks, name, message, at = found
    raise _peer_error(ranks, name, message + " (this rank stopped the step as well; zero the "
                      "gradients before another step)", errors.RankFailedError,
                      f" failed{' ' + at if at else ''}")


def exchange_failure(error: BaseException | None, group: Any = None, where: str = "",
                     values: Sequence[int] = ()) -> Tensor:
    """:func:`share_failure` with the flags exchanged here, in one small all-gather: for a
    point of the step where no collective made anyway could carry them. ``values`` (ints, as
    many on every rank) travel in the same all-gather.

    Returns:
        the ``(world, len(values))`` table of every rank's ``values`` when no rank failed.
    """
    table = _exchange_ints([int(error is not None), *values], group)
    share_failure(error, table[:, 0].tolist(), group, where)
    return table[:, 1:]


def _one_hot(failed: bool, group: Any) -> list[int]:
    """This rank's failure flag at its own index: summed over ranks, it says who failed."""
    import torch.distributed as dist

    flags = [0] * dist.get_world_size(group)
    flags[dist.get_rank(group)] = int(failed)
    return flags


class PeerFailed(Exception):
    """Raised in the backward of :func:`gather_with_grad` (given a :class:`GatherState`) when
    another rank flagged a failure there; ``failed`` holds every rank's flag. The catcher
    passes them to :func:`share_failure`, which raises the failing rank's error here too."""

    def __init__(self, failed: list[int]) -> None:
        super().__init__(f"rank(s) {[r for r, f in enumerate(failed) if f]} failed")
        self.failed = failed


def _reduce_with_flags(t: Tensor, failed: bool, group: Any) -> tuple[Tensor, list[int]]:
    """All-reduce (SUM) ``t`` with one failure flag per rank appended to the same buffer;
    returns the summed ``t`` (on the communication device) and the per-rank flags."""
    import torch.distributed as dist

    dev = _comm_device(t, group)
    flags = torch.tensor(_one_hot(failed, group), dtype=t.dtype, device=dev)
    buf = torch.cat([t.detach().to(dev).reshape(-1), flags])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    n = t.numel()
    return buf[:n].view(t.shape), [int(f != 0) for f in buf[n:].tolist()]


class GatherState:
    """Passed to :func:`gather_with_grad`: what its backward's all-reduce needs, so that a
    rank that failed between the gather and that backward (its loss, the loss's backward)
    can still take part in it (:meth:`fail_backward`) and the other ranks learn of the
    failure there (they raise :class:`PeerFailed`) instead of waiting until the timeout."""

    def __init__(self) -> None:
        self.shape: tuple[int, ...] | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.group: Any = None
        self.reduced = False

    @property
    def pending(self) -> bool:
        """The gather ran with gradient, and its backward's all-reduce did not."""
        return self.shape is not None and not self.reduced

    def fail_backward(self) -> list[int]:
        """On a rank that failed while :attr:`pending`: the all-reduce that the other ranks'
        backward makes, with zeros and this rank's failure flag. Returns every rank's flag."""
        zeros = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        _, failed = _reduce_with_flags(zeros, True, self.group)
        self.reduced = True
        return failed


class _GatherWithGrad(torch.autograd.Function):
    """All-gather rows; backward all-reduces (SUM) the gathered gradient and returns this
    rank's rows. An all-reduce rather than a reduce-scatter: it handles uneven row counts
    and every backend (gloo has no reduce-scatter), and embedding gradients are small.
    The backward's buffer carries one failure flag per rank (see :meth:`GatherState.fail_backward`):
    a rank whose loss failed still takes part, and the others raise :class:`PeerFailed`."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: Any, sizes: tuple[int, ...],
                state: GatherState | None) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        rank = dist.get_rank(group)
        ctx.lo = sum(sizes[:rank])
        ctx.hi = ctx.lo + sizes[rank]
        ctx.state = state
        out = all_gather_rows(t, group, sizes)
        if state is not None and t.requires_grad:
            state.shape, state.dtype, state.device = tuple(out.shape), out.dtype, out.device
            state.group, state.reduced = group, False
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        total, failed = _reduce_with_flags(grad.contiguous(), False, ctx.group)
        if ctx.state is not None:
            ctx.state.reduced = True
        if any(failed):
            raise PeerFailed(failed)
        return total[ctx.lo:ctx.hi].to(grad.device), None, None, None


def gather_with_grad(t: Tensor, group: Any = None, sizes: Sequence[int] | None = None,
                     state: GatherState | None = None) -> Tensor:
    """All-gather ``t`` (rows may differ per rank) with gradient: the backward returns to each
    rank its slice of the gradient summed over all ranks. Identity when not distributed.

    ``state``: a :class:`GatherState`, with which a rank that fails before the backward still
    takes part in it (and the others raise :class:`PeerFailed` there)."""
    if not is_distributed(group):
        return t
    if sizes is None:
        sizes = _exchange_ints([t.shape[0]], group)[:, 0].tolist()
    return _GatherWithGrad.apply(t, group, tuple(int(s) for s in sizes), state)


@dataclass
class Gathered:
    """What a cross-device-aware loss receives from the engine.

    Attributes:
        reps: ``{tower: global embeddings}``, concatenated in rank order; gradients flow back
            to the rank that embedded each row.
        counts: ``{tower: [rows on rank 0, rows on rank 1, ...]}``.
        rank, world_size, group: this rank, the world size and the process group.
    """

    reps: dict[str, Tensor]
    counts: dict[str, list[int]]
    rank: int
    world_size: int
    group: Any = None
    offsets: dict[str, list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = {k: [sum(v[:r]) for r in range(len(v))] for k, v in self.counts.items()}

    def local(self, name: str) -> slice:
        """Rows of tower ``name`` embedded by this rank, as a slice of ``reps[name]``."""
        lo = self.offsets[name][self.rank]
        return slice(lo, lo + self.counts[name][self.rank])

    def gather_values(self, name: str, values: Tensor | Sequence[Any]) -> Tensor | list[Any]:
        """All-gather per-row extras of tower ``name`` (ids, labels) without gradient: a tensor
        with one row per example, or a list of picklable values."""
        import torch.distributed as dist

        if isinstance(values, Tensor):
            return all_gather_rows(values, self.group, self.counts[name])
        out: list[list[Any]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(out, list(values), group=self.group)
        return [v for part in out for v in part]

    def raise_together(self, error: BaseException | None, values: Sequence[int] = ()) -> Tensor:
        """Every rank raises the same error when a local check failed on any rank; else the
        table of every rank's ``values`` (see :func:`raise_together`). Call it before the
        next collective."""
        return raise_together(error, self.group, values)

    def all_reduce_sum(self, t: Tensor, failure: BaseException | None = None,
                       where: str = "in the loss") -> Tensor:
        """Sum ``t`` over ranks (no gradient), returned on ``t``'s device.

        A loss whose own computation failed on this rank passes the exception as ``failure``
        (and a ``t`` of zeros, shaped as on the other ranks): a flag per rank travels in the
        same all-reduce, and every rank raises (see :func:`share_failure`) instead of the
        others going on to the next collective alone."""
        summed, failed = _reduce_with_flags(t, failure is not None, self.group)
        share_failure(failure, failed, self.group, where)
        return summed.to(t.device)


def unwrap_ddp(module: Any) -> Any:
    """The module inside a DistributedDataParallel wrapper (or ``module`` itself)."""
    from torch.nn.parallel import DistributedDataParallel

    return module.module if isinstance(module, DistributedDataParallel) else module


def is_fsdp(module: Any) -> bool:
    """True for a module managed by FSDP2 ``fully_shard``."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(module, FSDPModule)


def _is_dtensor(t: Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, DTensor)


def all_reduce_gradients(params: Iterable[nn.Parameter], group: Any = None,
                         failure: BaseException | None = None, where: str = "") -> int:
    """Sum the ``.grad`` of ``params`` over ranks in one coalesced all-reduce per dtype.

    A parameter whose gradient is ``None`` on a rank contributes zeros; its gradient stays
    ``None`` only if it is ``None`` on every rank (a flag per parameter travels in the same
    buffer), so ranks that used different parameter subsets neither hang nor drop gradients.
    Parameters that are FSDP2 DTensors are skipped (FSDP reduces them). Returns the number
    of collective calls made (one per dtype, normally 1).

    ``failure``: this rank's step failed before its gradients were complete; a flag per rank
    travels in the same buffer and, if any rank flagged one, every rank raises (see
    :func:`share_failure`; ``where`` says where it failed) and no gradient is changed. With no
    parameter to reduce, the flags travel alone (one small all-gather).
    """
    import torch.distributed as dist

    unique: dict[int, nn.Parameter] = {}
    for p in params:
        if p.requires_grad and not _is_dtensor(p):
            unique.setdefault(id(p), p)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in unique.values():
        by_dtype.setdefault((p.dtype, p.device), []).append(p)
    calls = 0
    world = dist.get_world_size(group)
    reduced = []
    failed = [0] * world
    for (dtype, device), plist in sorted(by_dtype.items(), key=lambda kv: str(kv[0])):
        dev = _comm_device(device, group)
        numels = [p.numel() for p in plist]
        n = sum(numels)
        flat = torch.zeros(n + len(plist) + world, dtype=dtype, device=dev)
        views = flat[:n].split(numels)
        flags = flat[n:n + len(plist)]
        flat[n + len(plist):] = torch.tensor(_one_hot(failure is not None, group), dtype=dtype)
        for i, (p, v) in enumerate(zip(plist, views)):
            if p.grad is not None:
                v.copy_(p.grad.reshape(-1))
                flags[i] = 1
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        calls += 1
        failed = [int(f != 0) for f in flat[n + len(plist):].tolist()]
        reduced.append((plist, views, flags))
    if not reduced:  # nothing to reduce: the failure flags travel alone
        exchange_failure(failure, group, where)
    else:
        share_failure(failure, failed, group, where)
    for plist, views, flags in reduced:
        present = (flags > 0).tolist()
        for p, v, has in zip(plist, views, present):
            if not has:
                p.grad = None
            elif p.grad is None:
                p.grad = v.view_as(p).to(p.device).clone()
            else:
                p.grad.copy_(v.view_as(p))
    return calls
