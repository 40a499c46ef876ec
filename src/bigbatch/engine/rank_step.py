"""The cross-rank side of a GradCache step: what the ranks of ``torch.distributed`` agree
on, exchange and synchronise around the engine's three stages, and how a failure on one
rank ends the step on every rank.

:class:`RankStep` holds the engine's distributed options for one step. Around the stages
of :meth:`bigbatch.GradCache.step` the engine calls, in this order:

1. :meth:`RankStep.agree_on_sizes`: before any work, one all-gather of every rank's rows
   and chunk counts per tower, its loss arguments, and whether its inputs failed their
   checks; then (1) embedding without gradients;
2. :meth:`RankStep.agree_after_embedding`: one all-gather of the first pass's failure
   flag, finiteness, embedding widths and token counts (of token embeddings);
3. :meth:`RankStep.loss_and_backward`: the loss on every rank's embeddings
   (:meth:`RankStep.gather`, one all-gather with gradient, token embeddings padded to the
   longest row of all ranks and cut back to this rank's in the backward; see
   :mod:`bigbatch.engine.distributed` for the scaling) and its backward to them; then (3) the
   replay with gradients;
4. :meth:`RankStep.sync_gradients`: one coalesced all-reduce of the gradients.

DDP towers are called through their inner module and FSDP2 (``fully_shard``) towers
reduce-scatter only where the engine turns their sync on (:func:`no_sync`,
:func:`fsdp_sync_points`): once per step, on the last replay that reaches each module.

Failures across ranks
---------------------
An error that one rank's inputs cause before the first collective is raised on every rank
(the same class, naming the rank). A failure on one rank later in the step (a tower raising
or running out of memory, in the first pass or the replay; the loss or its backward) ends
the step on every rank at once instead of leaving the others waiting in the next collective
until the process group's timeout: the failing rank raises its own exception, the others
:class:`~bigbatch.errors.RankFailedError` (or the failing rank's bigbatch error class)
naming that rank, where it failed and its message. The flag travels in the collective the
step makes next anyway (:func:`bigbatch.engine.distributed.share_failure`), so a healthy step pays
nothing extra:

- first pass: the after-embedding exchange (no gradient written yet);
- the loss: a local loss's finiteness exchange; a cross-device loss's closing all-reduce
  (:class:`bigbatch.InfoNCE`, :class:`bigbatch.CorpusInfoNCE`); for a generic loss, or a
  failure in the loss's backward, the embedding gather's backward all-reduce, in which the
  failing rank takes part with zeros (:class:`bigbatch.engine.distributed.GatherState`);
- the replay, and a local loss without ``check_finite``: the gradient sync. With
  ``sync_gradients=False`` one small all-gather of the flags ends each step instead (that
  is its only cost in the normal path), and with FSDP towers one more precedes the replay
  (their replays are collective).

After such an error the gradients are incomplete (zero them) and the ranks are still in
step: the next step can run. Not covered, because the other ranks are then inside a
collective that the engine does not own: a failure inside an FSDP tower's replay, or in a
tower whose forward is itself collective (SyncBatchNorm, FSDP in the first pass); a
third-party ``cross_device_forward`` that fails before its own collectives (pass
``failure=`` to :meth:`bigbatch.engine.distributed.Gathered.all_reduce_sum` as InfoNCE does); a
rank that dies outright (killed, segfault) and never reaches the collective: the others
then wait for the process group's timeout.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, InputError, NonFiniteError, ShapeError
from . import distributed as D
from . import embeddings as E
from .embeddings import Embedding
from .loss_contract import scalar_loss

__all__ = ["RankStep", "LossOutcome", "fsdp_modules", "fsdp_sync_points", "set_fsdp_sync",
           "no_sync"]


# ----------------------------------------------------------------- DDP and FSDP towers
def fsdp_modules(towers: Mapping[str, Any]) -> list[nn.Module]:
    """Every FSDP2 module inside the towers, each once."""
    seen: dict[int, nn.Module] = {}
    for tower in towers.values():
        if isinstance(tower, nn.Module):
            for m in tower.modules():
                if D.is_fsdp(m):
                    seen.setdefault(id(m), m)
    return list(seen.values())


def fsdp_sync_points(job_towers: Sequence[Any],
                     fsdp: list[nn.Module]) -> dict[int, list[nn.Module]]:
    """For each backward job ``j`` (``job_towers[j]`` is the tower it runs), the FSDP modules
    whose gradient sync must be turned on just before it: each module's last job whose
    tower contains it.

    A module's reduce-scatter happens in the backward of its own root; separate towers
    (separate FSDP roots) therefore each need sync on before their own last job, not only
    before the last job of the step (whose backward never reaches the other towers)."""
    last: dict[int, int] = {}
    for j, tower in enumerate(job_towers):
        tower = D.unwrap_ddp(tower)
        if isinstance(tower, nn.Module):
            for m in tower.modules():
                last[id(m)] = j
    points: dict[int, list[nn.Module]] = {}
    for m in fsdp:
        if id(m) in last:
            points.setdefault(last[id(m)], []).append(m)
    return points


def set_fsdp_sync(fsdp: list[nn.Module], on: bool) -> None:
    """Turn the gradient reduce-scatter of these FSDP modules (not their children) on or off."""
    for m in fsdp:
        m.set_requires_gradient_sync(on, recurse=False)


@contextlib.contextmanager
def no_sync(towers: Mapping[str, Any], fsdp: list[nn.Module]) -> Iterator[None]:
    """No DDP or FSDP gradient synchronisation inside a step, but where the engine asks
    (:func:`set_fsdp_sync`); FSDP sums instead of averaging (the loss is already global).
    Everything is put back on exit."""
    from torch.nn.parallel import DistributedDataParallel

    with contextlib.ExitStack() as stack:
        for tower in {id(t): t for t in towers.values()}.values():
            if isinstance(tower, DistributedDataParallel):
                stack.enter_context(tower.no_sync())
        factors = [(m, _divide_factor(m)) for m in fsdp]
        for m in fsdp:
            m.set_gradient_divide_factor(1.0)  # the loss is already global: sum, not mean
        set_fsdp_sync(fsdp, False)
        try:
            yield
        finally:
            set_fsdp_sync(fsdp, True)
            for m, factor in factors:  # FSDP used outside the engine averages again
                m.set_gradient_divide_factor(factor)


def _divide_factor(module: nn.Module) -> float | None:
    """An FSDP2 module's gradient divide factor (None: FSDP's default, the world size).
    FSDP2 has a setter but no getter; it keeps the factor on each parameter group."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # older torch: one group per module
        groups = [getattr(state, "_fsdp_param_group", None)]
    groups = [g for g in groups if g is not None]
    return getattr(groups[0], "gradient_divide_factor", None) if groups else None


# ------------------------------------------------------------------------ one step
@dataclass
class LossOutcome:
    """What :meth:`RankStep.loss_and_backward` returns: the detached loss and its metrics,
    or this rank's ``failure`` (not yet shared: the gradient sync shares it) and ``where``
    it happened."""

    total: Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    failure: Exception | None = None
    where: str = ""
    embeddings: dict[str, Embedding] = field(default_factory=dict)  # keep_embeddings


class RankStep:
    """The cross-rank agreements of one GradCache step (see the module docstring).

    Args:
        towers, loss_fn: the engine's.
        group: the process group (None: the world).
        cross_device: gather every rank's embeddings for the loss.
        check_finite: agree on NaN/inf embeddings and loss before any gradient is written.
        sync_gradients: sum the gradients over ranks at the end of the step.
        params: the parameters to synchronise (None: the towers' and the loss's).
        scaler: a ``GradScaler`` that scales the loss before its backward, or None.
        keep_embeddings: towers whose detached embeddings the loss saw (the gathered global
            batch's when cross-device) the outcome of :meth:`loss_and_backward` carries.
    """

    def __init__(self, towers: Mapping[str, Any], loss_fn: Callable[..., Any], *,
                 group: Any = None, cross_device: bool = True, check_finite: bool = True,
                 sync_gradients: bool = True, params: list[nn.Parameter] | None = None,
                 scaler: Any = None, keep_embeddings: tuple[str, ...] = ()) -> None:
        self.towers = towers
        self.loss_fn = loss_fn
        self.group = group
        self.cross_device = cross_device
        self.check_finite = check_finite
        self.sync = sync_gradients
        self.params = params
        self.scaler = scaler
        self.keep_embeddings = keep_embeddings
        self.distributed = D.is_distributed(group)
        self.fsdp = fsdp_modules(towers)
        self.tokens: dict[str, int] = {}  # the longest token row of all ranks, per token tower

    def params_to_sync(self) -> list[nn.Parameter]:
        """The parameters whose gradients :meth:`sync_gradients` sums (none without it).

        Raises:
            ConfigError: a plain-function tower, without ``params``."""
        if not self.sync:
            return []
        if self.params is not None:
            params = list(self.params)
        else:
            params = []
            for name, tower in self.towers.items():
                inner = D.unwrap_ddp(tower)
                if not isinstance(inner, nn.Module):
                    raise ConfigError(f"tower {name!r} is a plain function, so the engine cannot "
                                      f"find the parameters to synchronise over ranks; pass "
                                      f"params=model.parameters() to GradCache")
                params.extend(inner.parameters())
        if isinstance(self.loss_fn, nn.Module):
            params.extend(self.loss_fn.parameters())
        return params

    def agree_on_sizes(self, rows: Mapping[str, Sequence[int]], loss_kwargs: Mapping[str, Any],
                       failure: Exception | None) -> dict[str, list[int]]:
        """Exchange, in one all-gather, whether this rank's inputs failed their checks
        (``failure``), the names of the loss's arguments, and rows and chunk counts per
        tower (``rows``: each tower's rows per chunk); every rank raises the same error.

        Returns:
            ``{tower: [rows on rank 0, rows on rank 1, ...]}``.
        """
        import torch.distributed as dist

        names = list(self.towers)
        sizes = ([sum(rows[n]) for n in names] + [len(rows[n]) for n in names]
                 if failure is None else [0] * (2 * len(names)))
        kwargs_key = zlib.crc32("\0".join(sorted(loss_kwargs)).encode())
        table = D.raise_together(failure, self.group, [kwargs_key, *sizes])
        protocol = self.cross_device and hasattr(self.loss_fn, "cross_device_forward")
        if protocol and len(set(table[:, 0].tolist())) > 1:  # its collectives would not match
            every: list[Any] = [None] * table.shape[0]
            dist.all_gather_object(every, sorted(loss_kwargs), group=self.group)
            raise InputError(f"the ranks passed different loss arguments to step() (per rank: "
                             f"{every}); every rank must pass the same ones")
        row_table = table[:, 1: 1 + len(names)]
        chunks = table[:, 1 + len(names):]
        counts = {n: row_table[:, i].tolist() for i, n in enumerate(names)}
        empty = [(r, n) for n in names for r, v in enumerate(counts[n]) if v == 0]
        if empty:
            raise InputError(f"rank {empty[0][0]} has no rows for tower {empty[0][1]!r}; every "
                             f"rank needs at least one example (use drop_last=True in the sampler)")
        if self.fsdp and not bool((chunks == chunks[0]).all()):
            raise ConfigError(f"FSDP towers need the same number of chunks on every rank (their "
                              f"forward passes are collective), got {chunks.tolist()} per rank; "
                              f"use equal local batches (drop_last=True) and the same chunk "
                              f"size on every rank")
        return counts

    def agree_after_embedding(self, reps: Mapping[str, Embedding | None],
                              failure: Exception | None = None, where: str = "") -> None:
        """Exchange whether embedding failed on this rank (``failure``: a tower raised, or
        returned a wrong shape, ``where``), finiteness, embedding width and token count
        (:attr:`tokens`: the longest of all ranks, kept for :meth:`gather`) per tower, in one
        all-gather, so that all ranks fail together."""
        n = len(reps)
        if failure is None:
            finite = [int(bool(E.all_finite(r))) if self.check_finite else 1
                      for r in reps.values()]
            dims = [E.dim_of(r) for r in reps.values()]
            tokens = [E.tokens_of(r) for r in reps.values()]
        else:
            finite, dims, tokens = [1] * n, [0] * n, [0] * n
        table = D.exchange_failure(failure, self.group, where, [*finite, *dims, *tokens])
        self.tokens = {name: int(table[:, 2 * n + i].max()) for i, name in enumerate(reps)
                       if tokens[i]}
        for i, name in enumerate(reps):
            bad = [r for r in range(table.shape[0]) if table[r, i] == 0]
            if bad:
                raise NonFiniteError(f"tower {name!r} produced NaN or inf embeddings on rank(s) "
                                     f"{bad}; no gradient was written")
            widths = table[:, len(reps) + i].tolist()
            if len(set(widths)) > 1:
                raise ShapeError(f"tower {name!r} embeds to different widths on the ranks: "
                                 f"{widths}; every rank must run the same model")

    def gather(self, reps: Mapping[str, Embedding], counts: dict[str, list[int]],
               state: D.GatherState | None = None) -> D.Gathered:
        """All towers' embeddings from all ranks, in one all-gather with gradient. Token
        embeddings are padded to :attr:`tokens` (set by :meth:`agree_after_embedding`; for
        a token tower it lacks, one small all-gather finds the longest row first)."""
        info = D.world_info(self.group)
        runs = list(reps.items())
        missing = [name for name, r in runs if E.tokens_of(r) and name not in self.tokens]
        if missing:
            table = D.raise_together(None, self.group, [E.tokens_of(reps[n]) for n in missing])
            self.tokens.update({n: int(table[:, i].max()) for i, n in enumerate(missing)})
        dtype = E.dtype_of(runs[0][1])
        for _, r in runs[1:]:
            dtype = torch.promote_types(dtype, E.dtype_of(r))
        shapes = [(E.dim_of(r), self.tokens.get(name, 0)) for name, r in runs]
        widths = [E.row_numel(d, t) for d, t in shapes]
        flat = torch.cat([E.pack(r, t, dtype).reshape(-1) for (_, r), (_, t) in zip(runs, shapes)])
        sizes = [sum(counts[name][rank] * w for (name, _), w in zip(runs, widths))
                 for rank in range(info.world_size)]
        every = D.gather_with_grad(flat, self.group, sizes, state).split(sizes)
        per_tower: dict[str, list[Tensor]] = {name: [] for name, _ in runs}
        for rank, part in enumerate(every):
            pieces = part.split([counts[name][rank] * w for (name, _), w in zip(runs, widths)])
            for (name, _), w, piece in zip(runs, widths, pieces):
                per_tower[name].append(piece.view(-1, w))
        gathered = {name: E.unpack(torch.cat(per_tower[name]), d, t)
                    for (name, _), (d, t) in zip(runs, shapes)}
        return D.Gathered(gathered, {name: counts[name] for name, _ in runs}, info.rank,
                          info.world_size, self.group)

    def loss_and_backward(self, reps: dict[str, Tensor], loss_kwargs: dict[str, Any],
                          counts: dict[str, list[int]],
                          compute_loss: Callable[..., tuple[Tensor, dict[str, Any]]]
                          ) -> LossOutcome:
        """The loss on the cached embeddings (gathered over ranks when cross-device) and its
        backward to them; ``compute_loss(reps, **loss_kwargs)`` is the engine's.

        A failure on some ranks is shared in the first collective the other ranks make next,
        so none of them waits there until the timeout: the cross-device protocol losses'
        closing all-reduce (:meth:`~bigbatch.engine.distributed.Gathered.all_reduce_sum`), the
        gather's backward (a rank whose loss or backward failed takes part in that all-reduce
        with zeros and a flag), or the finiteness exchange of a local loss; every rank then
        raises. A failure no collective follows before the gradient sync is returned instead,
        with where it happened, and shared there (with FSDP towers, whose replays are
        collective, it is shared before returning)."""
        outcome = self._loss_and_backward(reps, loss_kwargs, counts, compute_loss)
        if self.fsdp:  # FSDP towers' replays are collective: agree on the loss's outcome first
            D.exchange_failure(outcome.failure, self.group, outcome.where)
        return outcome

    def _loss_and_backward(self, reps: dict[str, Tensor], loss_kwargs: dict[str, Any],
                           counts: dict[str, list[int]],
                           compute_loss: Callable[..., tuple[Tensor, dict[str, Any]]]
                           ) -> LossOutcome:
        group = self.group
        world = D.world_info(group).world_size
        state = D.GatherState()
        where, total, metrics = "in the loss", None, {}
        seen = reps  # the embeddings the loss sees
        try:
            if self.cross_device:
                gathered = self.gather(reps, counts, state)
                seen = gathered.reps
                if hasattr(self.loss_fn, "cross_device_forward"):
                    part, total, metrics = self.loss_fn.cross_device_forward(gathered,
                                                                            **loss_kwargs)
                    self._check_global_loss(total)
                    backprop = part
                else:  # the global loss on every rank; the gather's backward sums W copies
                    total, metrics = compute_loss(gathered.reps, **loss_kwargs)
                    self._check_global_loss(total)
                    backprop = total / world
            else:  # a local loss: its finiteness exchange carries any failure
                failure = None
                try:
                    total, metrics = compute_loss(reps, **loss_kwargs)
                    scalar_loss(total)
                except Exception as e:  # noqa: BLE001 - shared below or in the sync
                    failure = e
                if self.check_finite:
                    ok = failure is not None or bool(torch.isfinite(total.detach()))
                    table = D.exchange_failure(failure, group, where, [int(ok)])
                    if not bool(table[:, 0].min()):
                        raise D.mark_shared(NonFiniteError("the loss is NaN or inf on at least "
                                                           "one rank; no gradient was written"))
                elif failure is not None:
                    return LossOutcome(failure=failure, where=where)
                backprop = total / world  # no cross-device: the mean over ranks, as DDP
            where = "in the loss's backward"
            if backprop.requires_grad:
                (self.scaler.scale(backprop) if self.scaler is not None else backprop).backward()
        except D.PeerFailed as e:  # another rank failed; it took part in the gather's backward
            D.share_failure(None, e.failed, group)
        except Exception as e:
            if D.is_shared(e):  # every rank raised it already
                raise
            if not state.pending:  # no collective before the sync: share it there
                return LossOutcome(failure=e, where=where)
            D.share_failure(e, state.fail_backward(), group, where)
        return LossOutcome(total.detach(), metrics,
                           embeddings={n: E.detached(seen[n]) for n in self.keep_embeddings})

    def _check_global_loss(self, total: Any) -> None:
        """A cross-device loss is the same on every rank: each can check it alone."""
        scalar_loss(total)
        if self.check_finite and not bool(torch.isfinite(total.detach())):
            raise NonFiniteError("the loss is NaN or inf on at least one rank; no gradient "
                                 "was written")

    def sync_gradients(self, params: list[nn.Parameter], failure: Exception | None,
                       where: str) -> int | None:
        """End the step: sum the gradients of ``params`` over ranks in one coalesced
        all-reduce that also carries this rank's ``failure`` flag (every rank raises if any
        failed); without gradient sync, the flags travel alone. Returns the number of
        collective calls the sync made (None without gradient sync)."""
        if self.sync:
            return D.all_reduce_gradients(params, self.group, failure, where)
        D.exchange_failure(failure, self.group, where)  # the caller syncs the gradients itself
        return None
