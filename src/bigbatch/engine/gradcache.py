"""The GradCache engine: one optimizer step whose gradients equal those of the full
batch while only one chunk's activations are alive at a time.

For every step the engine:

1. embeds each chunk of each tower with gradients off, recording the random state
   of the chunk (:class:`bigbatch.engine.rng.RandContext`) before it is collated, so that
   dropout and a random ``collate_fn`` (augmentation) can be replayed;
2. computes the loss on all cached embeddings (detached leaves) and backpropagates
   to them, which yields ``dL/d(embedding)`` for every example (and the gradient of
   the loss's own parameters, such as a learnable temperature);
3. re-embeds each chunk with gradients on, under its recorded random state, and
   backpropagates ``dL/d(embedding)`` into the tower's parameters.

By the chain rule the parameter gradients are those of the full-batch loss. The last
chunk of the last trainable tower is embedded with gradients already in step 1 and
its graph kept, so it is not replayed (one forward saved per step, at the memory cost
of that single chunk's activations). A tower without trainable parameters is embedded
once and never replayed.

The engine is small and overridable, as luyug/GradCache's is: subclass and override
:meth:`GradCache.split_inputs` (how a tower's inputs become chunks), :meth:`GradCache.embed`
(how a tower is called on a chunk), or :meth:`GradCache.compute_loss`. How inputs are cut
into chunks is :mod:`bigbatch.engine.chunking`; what the ranks of ``torch.distributed`` agree on
and exchange around the three stages (and how a failure on one rank ends the step on all)
is :mod:`bigbatch.engine.rank_step`. A tower may return one vector per token
(:class:`bigbatch.TokenEmbeddings`) for a late-interaction loss; what the cache then holds,
and its memory, is :mod:`bigbatch.engine.embeddings`. With ``chunk_size="auto"`` (or
``chunk_tokens="auto"``) the chunks are sized for a memory budget from a measured probe
(:meth:`GradCache.plan_chunks`, the arithmetic in :mod:`bigbatch.engine.sizing`); when the
whole batch fits, the step is plain training: every tower embedded once, its graph kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import ConfigError, InputError, NonFiniteError
from . import chunking, rank_step, sizing
from . import distributed as D
from . import embeddings as E
from .chunking import Chunk
from .embeddings import Embedding, TokenEmbeddings
from .loss_contract import LossArguments, loss_and_metrics, scalar_loss
from .rng import RandContext
from .sizing import ActivationCost, ChunkPlan, StepMemory

AUTO = "auto"  # chunk_size / chunk_tokens: sized for the memory budget
DEFAULT_BUDGET = 0.8  # memory_budget when none is given: 80% of the device's free memory
PROBE_ROWS = (2, 4)  # rows of the two probe chunks whose activations give the cost per row
_UNCUT = 2 ** 31 - 1  # rows per chunk before the sizes are decided: one chunk per tower

__all__ = ["GradCache", "StepResult"]


@dataclass
class StepResult:
    """What :meth:`GradCache.step` returns.

    Attributes:
        loss: the detached full-batch loss (unscaled, even with a GradScaler).
        metrics: the loss's detached metrics (0-d tensors), e.g. ``pos_sim``, ``accuracy``;
            a metric given as a plain number becomes a tensor on the loss's device.
        embeddings: the detached embeddings the loss saw of the towers named in
            ``GradCache(keep_embeddings=...)`` (the global batch's, in rank order, under
            ``cross_device``), e.g. for a queue of earlier steps' documents; else empty.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    embeddings: dict[str, Embedding] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = self.loss.device
        self.metrics = {k: v.detach().to(dev) if isinstance(v, Tensor) else
                        torch.as_tensor(v, device=dev) for k, v in self.metrics.items()}

    def to_dict(self) -> dict[str, float]:
        """Loss and metrics as Python floats, with one host-device synchronisation."""
        keys = ["loss", *self.metrics]
        values = torch.stack([self.loss.float(), *(v.float() for v in self.metrics.values())])
        return dict(zip(keys, values.tolist()))


@dataclass
class _TowerRun:
    """Per-tower state kept between the three stages of one ``step()``."""

    name: str
    trainable: bool
    chunks: list[Chunk]
    rows: list[int]
    order: Tensor | None  # permutation applied before chunking (length ordering)
    contexts: list[RandContext] = field(default_factory=list)
    reps: Embedding | None = None
    kept: Embedding | None = None  # last chunk's embedding with its graph, not replayed
    spans: list[tuple[int, int]] | None = None  # token embeddings: each chunk's cached columns


def _is_trainable(tower: Callable) -> bool:
    params = getattr(tower, "parameters", None)
    if not callable(params):
        return True  # a plain function: we cannot know, so treat it as trainable
    return any(p.requires_grad for p in params())


class GradCache:
    """Exact gradient caching for contrastive losses over one or more towers.

    Args:
        towers: ``{name: tower}``; a tower is any callable from one chunk of inputs to a
            ``(rows, dim)`` tensor, or to :class:`bigbatch.TokenEmbeddings` ``(values
            (rows, tokens, dim), mask (rows, tokens))`` for the arguments a late-interaction
            loss names in its ``token_inputs`` (the cache then holds ``rows x tokens x dim``
            per tower, ``tokens`` the batch's longest row). A dict chunk is passed as keyword
            arguments (``tower(**chunk)``, as Hugging Face models expect), anything else as
            the one positional argument. The same module may serve several towers.
        loss_fn: called as ``loss_fn(**{name: embeddings}, **loss_kwargs)``; returns a scalar
            tensor, a ``(loss, metrics)`` pair (e.g. :class:`bigbatch.InfoNCE`) or a dict with
            a ``"loss"`` key. Any loss works, not only InfoNCE.
        chunk_size: rows per chunk, one int for all towers or ``{name: int}``; with
            ``chunk_tokens``, the most rows a chunk may hold. ``"auto"`` (for all towers, or
            as a tower's value): the largest chunk whose step fits ``memory_budget``, decided
            at the first step from a probe of its inputs (or by :meth:`plan_chunks`), at most
            the batch; when every tower's batch fits at once, the step is plain training
            (one pass, every graph kept, nothing replayed).
        chunk_tokens: a token budget per chunk, one int for all towers or ``{name: int}``
            (towers left out are cut by rows alone): a chunk holds as many rows as fit this
            many padded tokens (rows x the chunk's longest row, after ``trim_padding``), so
            one chunk's activations stay bounded when short and long texts mix. With
            ``sort_by_length`` the rows are packed longest first. A row longer than the budget
            is a chunk of its own. Needs tokenized inputs (a dict with a 2-d
            ``attention_mask``, or a ``(rows, tokens)`` tensor) and the default
            :meth:`split_inputs`. Exact, as row chunks are. ``"auto"`` (for all towers, or as
            a tower's value): the largest budget that fits ``memory_budget``.
        memory_budget: with ``"auto"`` sizes, what one step may hold at its peak: bytes (an
            int), or a fraction of the device's free memory when the sizes are decided (a
            float in (0, 1]; default 0.8). The step's parts: cached embeddings and their
            gradients, parameter gradients, the optimizer's states, one loss block (the loss's
            ``memory_hint`` if it has one, else measured) and one chunk's activations.
        optimizer: with ``"auto"`` sizes, the optimizer whose states the budget holds too
            (states it has not made yet are counted by
            :func:`bigbatch.engine.sizing.optimizer_state_bytes`).
        collate_fn: for towers fed lists of raw examples: a callable (all towers) or
            ``{name: callable}`` that turns a list of examples into a tensor or dict. It runs
            under the chunk's recorded random state, so random augmentation in it draws the
            same numbers when the chunk is replayed.
        device: if given, each chunk is moved there just before its tower runs, so a batch
            far larger than accelerator memory can be held on the host.
        autocast_dtype: run the towers under ``torch.autocast`` with this dtype
            (``torch.bfloat16`` or ``torch.float16``); loss and surrogate stay in float32.
        scaler: a ``torch.amp.GradScaler`` for float16: the loss is scaled before its
            backward, so the cached and parameter gradients come out scaled; call
            ``scaler.step(optimizer)`` and ``scaler.update()`` as usual.
        sort_by_length: order examples by token count (``attention_mask``) before chunking,
            so chunks hold similar lengths; embeddings are put back in the original order
            before the loss, so the result is that of the unordered run. Only with the
            default :meth:`split_inputs` (an override defines its own layout).
        trim_padding: cut each chunk of tokenized inputs to its own longest row (columns
            that are padding in every row of the chunk are dropped; both padding sides).
            Right padding is always exact. Dropping leading (left-padding) columns shifts
            absolute positions, which is exact for rotary (relative) position models, the
            ones that pad on the left, or when ``position_ids`` are given (they are cut
            too); set False for an absolute-position model fed left-padded inputs.
        reuse_last_chunk: embed the final chunk with gradients in step 1 and keep its graph,
            saving its replay.
        check_finite: raise :class:`NonFiniteError` on NaN/inf embeddings or loss, before
            any gradient is written (one host-device synchronisation per step).
        cross_device: under ``torch.distributed`` with more than one process, gather every
            rank's embeddings so each query sees the whole global batch as negatives, with
            gradients flowing back to the rank that embedded them (see
            :mod:`bigbatch.engine.distributed` for the exact scaling). False: each rank's loss is
            local.
        process_group: the group to gather over and synchronise in (default: the world).
        sync_gradients: under ``torch.distributed``, sum the gradients over ranks once per
            step (one coalesced all-reduce, which also carries the failure flags of the
            step's second pass; with False, a small all-gather of those flags ends the step).
            Towers wrapped in DistributedDataParallel are called through their inner module,
            so DDP never synchronises on its own; FSDP2 (``fully_shard``) towers
            reduce-scatter once, on the last replay that reaches them.
        params: the parameters to synchronise, when a tower is a plain function whose
            parameters the engine cannot find (default: the towers' and the loss's).
        keep_embeddings: towers whose detached embeddings, as the loss saw them, each
            step returns in :attr:`StepResult.embeddings` (default: none; they are kept
            until the caller lets the result go).

    Raises:
        ConfigError: bad options (chunk size <= 0, a loss that does not take a tower's name,
            a memory budget without an ``"auto"`` size).
    """

    def __init__(self, towers: Mapping[str, Callable[..., Tensor]], loss_fn: Callable[..., Any],
                 chunk_size: int | str | Mapping[str, int | str], *,
                 chunk_tokens: int | str | Mapping[str, int | str] | None = None,
                 memory_budget: int | float | None = None,
                 optimizer: Any = None,
                 collate_fn: Callable[[list], Any] | Mapping[str, Callable[[list], Any]] | None = None,
                 device: torch.device | str | None = None,
                 autocast_dtype: torch.dtype | None = None,
                 scaler: Any = None,
                 sort_by_length: bool = False,
                 trim_padding: bool = True,
                 reuse_last_chunk: bool = True,
                 check_finite: bool = True,
                 cross_device: bool = True,
                 process_group: Any = None,
                 sync_gradients: bool = True,
                 params: Any = None,
                 keep_embeddings: tuple[str, ...] = ()) -> None:
        if not isinstance(towers, Mapping) or not towers:
            raise ConfigError("towers must be a non-empty dict {name: callable}, e.g. "
                              "{'query': encoder, 'doc': encoder}")
        for name, tower in towers.items():
            if not callable(tower):
                raise ConfigError(f"tower {name!r} is not callable ({type(tower).__name__})")
        self.towers: dict[str, Callable[..., Tensor]] = dict(towers)
        self.loss_fn = loss_fn
        self._auto_rows = _auto_towers(chunk_size, self.towers)
        self._auto_tokens = _auto_towers(chunk_tokens, self.towers)
        # rows per chunk per tower; an "auto" tower's are decided by plan_chunks()
        self.chunk_sizes: dict[str, int] = chunking.chunk_sizes(
            _without_auto(chunk_size, self.towers, _UNCUT), self.towers)
        self.chunk_tokens = self._token_budgets(_without_auto(chunk_tokens, self.towers, None))
        if self._auto_tokens and type(self).split_inputs is not GradCache.split_inputs:
            raise ConfigError("chunk_tokens cuts the default layout of inputs; an overridden "
                              "split_inputs defines its own chunks (use chunk_size there)")
        if memory_budget is not None and not (self._auto_rows or self._auto_tokens):
            raise ConfigError("memory_budget sizes the chunks of chunk_size='auto' (or "
                              "chunk_tokens='auto'); with fixed sizes it has nothing to size")
        if memory_budget is not None:
            sizing.check_budget(memory_budget)
        self.memory_budget = DEFAULT_BUDGET if memory_budget is None else memory_budget
        self.optimizer = optimizer
        self.memory_plan: ChunkPlan | None = None  # the sizes chosen for the budget
        self._plain = False  # every tower one chunk, its graph kept: plain training
        self.collate_fns = chunking.collate_fns(collate_fn, self.towers)
        self.device = torch.device(device) if device is not None else None
        if autocast_dtype not in (None, torch.float16, torch.bfloat16, torch.float32):
            raise ConfigError(f"autocast_dtype must be torch.bfloat16, torch.float16 or None, "
                              f"got {autocast_dtype!r}")
        self.autocast_dtype = autocast_dtype
        self.scaler = scaler
        self.sort_by_length = sort_by_length
        self.trim_padding = trim_padding
        self.reuse_last_chunk = reuse_last_chunk
        self.check_finite = check_finite
        self.cross_device = cross_device
        self.process_group = process_group
        self.sync_gradients = sync_gradients
        self._explicit_params = None if params is None else list(params)
        unknown = [n for n in keep_embeddings if n not in self.towers]
        if unknown:
            raise ConfigError(f"keep_embeddings names unknown tower(s) {unknown}; towers are "
                              f"{list(self.towers)}")
        self.keep_embeddings = tuple(keep_embeddings)
        self.last_sync_calls = 0  # collectives the last step used to synchronise gradients
        self._where = ""  # where in the step this rank is, for a failure's message
        self._loss_args = LossArguments(loss_fn, self.towers)

    # ------------------------------------------------------------ overridables
    def split_inputs(self, name: str, inputs: Any, chunk_size: int) -> tuple[list[Chunk], list[int]]:
        """Cut one tower's inputs into chunks of at most ``chunk_size`` rows.

        Returns the chunks and their row counts. Tensors and batch-aligned dict values
        are sliced on their first dimension; other dict values are passed to every chunk.
        Tokenized dicts (with ``attention_mask``) are trimmed to each chunk's longest row.
        Lists of raw examples are split; each piece is collated with the tower's
        ``collate_fn`` when it is embedded and again when it is replayed, never all at once
        (see :func:`bigbatch.engine.chunking.split_inputs`).

        Override it for layouts whose first dimension is not the batch (e.g. a
        vision-language processor's patches of all images concatenated): the engine takes
        the tower's row count from the returned ``rows`` (one positive int per chunk; the
        tower must return that many embeddings for the chunk) and never inspects the inputs.
        """
        return chunking.split_inputs(inputs, chunk_size, name=name,
                                     collate=self.collate_fns.get(name),
                                     trim_padding=self.trim_padding)

    def embed(self, name: str, chunk: Chunk) -> Embedding:
        """Run tower ``name`` on one chunk: ``tower(**chunk)`` for a dict, else ``tower(chunk)``."""
        tower = D.unwrap_ddp(self.towers[name])  # DDP's own forward would sync buffers
        if isinstance(chunk, Mapping):
            return tower(**chunk)
        return tower(chunk)

    def compute_loss(self, reps: dict[str, Embedding],
                     **loss_kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Call the loss on the full-batch embeddings and return ``(loss, metrics)``."""
        return loss_and_metrics(self.loss_fn(**reps, **loss_kwargs))

    # -------------------------------------------------------------------- step
    def step(self, **inputs: Any) -> StepResult:
        """Run one GradCache step and accumulate the full-batch gradient into ``.grad``.

        Keyword arguments named after a tower are that tower's inputs; the others go to
        the loss (e.g. ``doc_ids``). Returns a :class:`StepResult`. The step runs with
        gradients enabled even when called under ``torch.no_grad()``. Under
        ``torch.distributed``, a failure on any rank is raised on every rank at once, and
        the ranks stay in step (see :mod:`bigbatch.engine.rank_step`).

        Raises:
            InputError: a tower's input is missing or empty, an argument is neither a
                tower nor accepted by the loss, or a token row with every token masked.
            ShapeError: a tower output is not ``(rows, dim)`` (or TokenEmbeddings of a
                wrong shape), a chunk's width is not the first chunk's, or an output is
                not the kind the loss takes for that tower.
            NonFiniteError: NaN/inf in an embedding or in the loss (nothing written yet).
            ConfigError: called under ``torch.inference_mode()``, which nothing can lift.
        """
        if torch.is_inference_mode_enabled():
            raise ConfigError("GradCache.step() computes gradients; it cannot run under "
                              "torch.inference_mode() (call it outside that block)")
        ranks = self._rank_step()
        if ranks.distributed:
            return self._step_across_ranks(ranks, inputs)
        loss_kwargs = self._loss_args.of_step(inputs)
        if self._unsized():
            self.plan_chunks({name: inputs[name] for name in self.towers},
                             loss_kwargs=loss_kwargs)
        runs = [self._plan(name, inputs[name]) for name in self.towers]
        self._where = ""
        with rank_step.no_sync(self.towers, ranks.fsdp), torch.enable_grad():
            self._embed_all(runs)                                        # (1) no gradients
            total, metrics = self._loss_and_backward(runs, loss_kwargs)  # (2) dL/d(embedding)
            self._replay_all(runs, ranks.fsdp)                           # (3) with gradients
        return StepResult(total, metrics, {r.name: E.detached(r.reps) for r in runs
                                           if r.name in self.keep_embeddings})

    def _step_across_ranks(self, ranks: rank_step.RankStep, inputs: dict[str, Any]) -> StepResult:
        """:meth:`step` under ``torch.distributed``: the same three stages, with the
        agreements of :class:`bigbatch.engine.rank_step.RankStep` between them."""
        runs: list[_TowerRun] = []
        loss_kwargs: dict[str, Any] = {}
        params: list[nn.Parameter] = []
        failure: Exception | None = None
        try:
            loss_kwargs = self._loss_args.of_step(inputs)
            runs = [self._plan(name, inputs[name], allow_empty=True) for name in self.towers]
            params = ranks.params_to_sync()  # refuses a plain-function tower without params=
        except Exception as e:  # noqa: BLE001 - raised on every rank by agree_on_sizes
            failure = e
        counts = ranks.agree_on_sizes({r.name: r.rows for r in runs}, loss_kwargs, failure)
        if self._unsized():  # every rank sizes its chunks, then all take the smallest
            self.plan_chunks({name: inputs[name] for name in self.towers},
                             loss_kwargs=loss_kwargs)
            runs = [self._plan(name, inputs[name], allow_empty=True) for name in self.towers]
        self._where = ""
        with rank_step.no_sync(self.towers, ranks.fsdp), torch.enable_grad():
            failure = None
            try:
                self._embed_all(runs)                                    # (1) no gradients
            except Exception as e:  # noqa: BLE001 - every rank raises in the exchange below
                failure = e
            ranks.agree_after_embedding({r.name: r.reps for r in runs}, failure, self._where)
            loss = ranks.loss_and_backward({r.name: r.reps for r in runs}, loss_kwargs,
                                           counts, self.compute_loss)    # (2) dL/d(embedding)
            failure, where = loss.failure, loss.where
            if failure is None:
                try:
                    self._replay_all(runs, ranks.fsdp)                   # (3) with gradients
                except Exception as e:
                    if D.is_shared(e):  # every rank raised it already
                        raise
                    failure, where = e, self._where
        calls = ranks.sync_gradients(params, failure, where)
        if calls is not None:
            self.last_sync_calls = calls
        return StepResult(loss.total, loss.metrics, loss.embeddings)

    # ------------------------------------------------------------ step stages
    def _embed_all(self, runs: list[_TowerRun]) -> None:
        """(1) Embed every chunk without gradients, remembering its random state."""
        last_trainable = max((i for i, r in enumerate(runs) if r.trainable), default=None)
        for i, run in enumerate(runs):
            cache = E.CacheWriter(run.name, run.rows, run.order, run.trainable)
            for c, planned in enumerate(run.chunks):
                keep = (self.reuse_last_chunk and c == len(run.chunks) - 1
                        and (i == last_trainable
                             or (self._plain and run.trainable and len(run.chunks) == 1)))
                self._where = f"while embedding tower {run.name!r} (chunk {c}, first pass)"
                ctx = None
                # the random state before collating, so that a random collate_fn is replayed too
                if run.trainable and not keep:
                    ctx = RandContext(planned, devices=[self.device] if self.device else [])
                chunk = chunking.to_device(chunking.materialize(planned), self.device)
                if ctx is not None:
                    ctx.include(chunk)  # a device only the collated chunk reveals
                    run.contexts.append(ctx)
                with torch.set_grad_enabled(keep), self._autocast(chunking.first_device(chunk)):
                    emb = E.check_output(run.name, c, self.embed(run.name, chunk), run.rows[c],
                                         run.name in self._loss_args.token_inputs)
                if keep:
                    run.kept = emb
                    emb = E.detached(emb)
                cache.add(c, emb)  # into one buffer per tower, in the original order
            run.reps, run.spans = cache.finish()

    def _loss_and_backward(self, runs: list[_TowerRun], loss_kwargs: dict[str, Any]
                           ) -> tuple[Tensor, dict[str, Any]]:
        """(2) One process: the loss on the cached embeddings and its backward to them.
        Returns (the detached loss, metrics)."""
        reps = {run.name: run.reps for run in runs}
        total, metrics = self.compute_loss(reps, **loss_kwargs)
        scalar_loss(total)
        if self.check_finite:
            self._check_finite(runs, total)
        if total.requires_grad:
            (self.scaler.scale(total) if self.scaler is not None else total).backward()
        return total.detach(), metrics

    def _replay_all(self, runs: list[_TowerRun], fsdp: list[nn.Module]) -> None:
        """(3) Replay each trainable chunk with gradients and backpropagate its cached gradient."""
        jobs: list[tuple[_TowerRun, int | None, Tensor]] = []
        for run in runs:
            if not run.trainable:
                continue
            grad = E.grad_of(run.reps)
            if grad is None:
                run.kept = None
                continue
            # length-ordered: each chunk's rows are gathered when it is replayed (below),
            # not a reordered copy of the whole gradient
            grads = (grad if run.order is None else run.order.to(grad.device)).split(run.rows)
            if run.kept is not None:  # before every replay: frees the kept graph first, so
                jobs.insert(0, (run, None, grads[-1]))  # one chunk's activations at a time
            jobs.extend((run, c, grads[c]) for c in range(len(run.contexts)))
        sync_at = rank_step.fsdp_sync_points([self.towers[run.name] for run, _, _ in jobs], fsdp)
        for j, (run, c, g) in enumerate(jobs):
            if run.order is not None:  # g: the chunk's rows of the cached gradient
                g = E.grad_of(run.reps).index_select(0, g)
            span = run.spans[-1 if c is None else c] if run.spans else None
            if j in sync_at:  # reduce-scatter on each FSDP module's last backward only
                rank_step.set_fsdp_sync(sync_at[j], True)
            self._where = (f"while re-embedding tower {run.name!r} (chunk {c}, second pass)"
                           if c is not None else f"in the backward of tower {run.name!r} "
                           f"(chunk {len(run.chunks) - 1}, kept from the first pass)")
            if c is None:
                E.surrogate_backward(run.kept, g, span)
                run.kept = None
                continue
            with run.contexts[c]:  # the collate_fn's random draws are replayed as well
                chunk = chunking.to_device(chunking.materialize(run.chunks[c]), self.device)
                with self._autocast(chunking.first_device(chunk)):
                    emb = self.embed(run.name, chunk)
            E.surrogate_backward(emb, g, span)

    # ------------------------------------------------------------------ sizing
    def plan_chunks(self, inputs: Mapping[str, Any], *, rows: Mapping[str, int] | None = None,
                    budget: int | float | None = None, parameter_bytes: int | None = None,
                    optimizer_bytes: int | None = None,
                    loss_kwargs: Mapping[str, Any] | None = None,
                    world_size: int | None = None, budget_name: str = "memory_budget",
                    lengths: Mapping[str, Sequence[int]] | None = None,
                    queued_rows: int = 0, use: bool = True) -> ChunkPlan:
        """Size the ``"auto"`` chunks for a memory budget, use the sizes (``use``), and return
        the :class:`~bigbatch.engine.sizing.ChunkPlan` (also kept as :attr:`memory_plan`).
        A step of an engine with ``"auto"`` sizes calls it on its first inputs; call it
        yourself to know the sizes before the first step.

        Each trainable tower's activations are measured on its longest rows, twice
        (:data:`PROBE_ROWS` rows, :meth:`activation_cost`), under a forked random state, so
        the step's dropout draws are those it would have drawn without the probe. The loss
        block is the loss's ``memory_hint(rows, dims, tokens)`` (bytes, for the rows per
        tower it sees, the embeddings' widths and tokens per row; None: measure it) where it
        has one, else
        measured on random embeddings of a step's shapes (twice what it keeps for its
        backward).

        Args:
            inputs: ``{tower: inputs}``: a step's, or rows as long as a step's longest.
            rows: rows per tower in a step (default: those of ``inputs``).
            budget: bytes, or a fraction of the free memory (default: ``memory_budget``).
            parameter_bytes: the gradients of the trainable parameters (default: every
                trainable parameter of the towers and the loss, once); a sharded model
                gives its own rank's.
            optimizer_bytes: the optimizer's states (default: those of ``optimizer``).
            loss_kwargs: the loss's other arguments, to measure a loss without a hint.
            world_size: processes whose rows the loss sees (default: the group's, with
                ``cross_device``).
            budget_name: how errors name the budget (``--memory-budget``).
            lengths: ``{tower: token counts}`` of a step's rows (or a sample of them), for
                weighing padding (:func:`~bigbatch.engine.sizing.padding_cap`; with
                ``sort_by_length``) where ``inputs`` are not a step's rows (copies of the
                longest, say); default: the lengths of ``inputs``.
            queued_rows: documents of earlier steps the loss scores beside the batch's (a
                negative queue, the same on every rank): their embeddings are counted in
                the floor (:attr:`~bigbatch.engine.sizing.StepMemory.negative_queue`) and
                their columns in the loss block (``rows["queued"]`` of the hint).
            use: use the sizes (False: only return the plan).

        Under ``torch.distributed`` every rank calls it (a step does): each measures its own
        inputs, and all take the smallest sizes of any rank, so FSDP towers run as many chunks
        on every rank; a failure on one rank is raised on all.

        Raises:
            ConfigError: not even one row per chunk fits (naming the smallest budget that
                does), a token budget for inputs without token columns, or no sizes to
                choose.
        """
        if not (self._auto_rows or self._auto_tokens):
            raise ConfigError("plan_chunks sizes chunk_size='auto' or chunk_tokens='auto'; "
                              "this engine's sizes are fixed")
        options = dict(rows=rows, budget=budget, parameter_bytes=parameter_bytes,
                       optimizer_bytes=optimizer_bytes, loss_kwargs=loss_kwargs,
                       world_size=world_size, budget_name=budget_name, lengths=lengths,
                       queued_rows=queued_rows)
        if not D.is_distributed(self.process_group):
            plan = self._local_plan(inputs, **options)
        else:
            plan = self._plan_across_ranks(inputs, options)
        if use:
            self.use_plan(plan)
        return plan

    def _local_plan(self, inputs: Mapping[str, Any], *, rows: Mapping[str, int] | None,
                    budget: int | float | None, parameter_bytes: int | None,
                    optimizer_bytes: int | None, loss_kwargs: Mapping[str, Any] | None,
                    world_size: int | None, budget_name: str,
                    lengths: Mapping[str, Sequence[int]] | None = None,
                    queued_rows: int = 0) -> ChunkPlan:
        """:meth:`plan_chunks` on this process's inputs alone."""
        device = self._sizing_device(inputs)
        if world_size is None:
            world_size = D.world_info(self.process_group).world_size \
                if self.cross_device and D.is_distributed(self.process_group) else 1
        costs = {name: self.activation_cost(name, inputs[name]) for name in self.towers}
        rows = dict(rows) if rows is not None else \
            {name: self._rows_of(name, inputs[name]) for name in self.towers}
        dims, tokens = {n: c.dim for n, c in costs.items()}, {n: c.tokens for n, c in costs.items()}
        loss = self._loss_bytes({n: rows[n] * world_size for n in rows}, dims, tokens,
                                loss_kwargs or {}, device, world_size, queued_rows)
        emb = sum(rows[n] * costs[n].cost.row_bytes for n in rows)
        docs = costs.get("doc") or list(costs.values())[-1]  # what a queue holds: documents
        queue = sizing.queue_bytes(queued_rows, docs.cost.row_bytes)
        if world_size > 1:  # the gathered embeddings of every rank, beside this rank's own
            emb += sum(rows[n] * world_size * costs[n].cost.row_bytes for n in rows)
        params = self._trainable_params()
        if parameter_bytes is None:
            parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        if optimizer_bytes is None:
            optimizer_bytes = sizing.optimizer_state_bytes(self.optimizer)
        base = StepMemory(embeddings=emb, embedding_grads=emb, rng_states=0,
                          parameter_grads=parameter_bytes, chunk_activations=0,
                          loss_block=loss, optimizer_states=optimizer_bytes,
                          negative_queue=queue)
        given = {n: s for n, s in self.chunk_sizes.items()
                 if n not in self._auto_rows and n not in self._auto_tokens}
        caps = {n: s for n, s in self.chunk_sizes.items() if n not in self._auto_rows}
        accelerators = int(device.type != "cpu")
        plan = sizing.choose_chunks(
            sizing.budget_bytes(self.memory_budget if budget is None else budget, device,
                                budget_name),
            rows, {n: c.cost for n, c in costs.items()}, base=base, given=given,
            token_towers=self._auto_tokens, row_caps=caps,
            allow_plain=self.reuse_last_chunk and not self.chunk_tokens,
            rng_state_bytes=sizing.CPU_RNG_STATE_BYTES
            + accelerators * sizing.DEVICE_RNG_STATE_BYTES,
            transient=max((p.numel() * p.element_size() for p in params), default=0),
            budget_name=budget_name)
        return self._capped_for_padding(plan, inputs, lengths or {})

    def _capped_for_padding(self, plan: ChunkPlan, inputs: Mapping[str, Any],
                            lengths: Mapping[str, Sequence[int]]) -> ChunkPlan:
        """``plan`` with each row-sized tower's chunk lowered where length-sorted smaller
        chunks pad its rows to fewer tokens (:func:`~bigbatch.engine.sizing.padding_cap`);
        only with ``sort_by_length`` and ``trim_padding`` (each chunk cut to its own
        longest row), and not for plain training (one pass, nothing replayed). A tower's
        token counts are ``lengths``' (a sample of fewer rows than a step's is read at the
        same fraction of the rows) or its inputs'."""
        if plan.plain or not (self.sort_by_length and self.trim_padding) or \
                type(self).split_inputs is not GradCache.split_inputs:
            return plan
        caps = {}
        for name in self._auto_rows:
            if name in plan.tokens:
                continue
            counts = lengths.get(name)
            if counts is None:
                measured = chunking.row_lengths(inputs[name])
                counts = [] if measured is None else measured.tolist()
            if not counts:
                continue
            ordered = sorted((int(c) for c in counts), reverse=True)
            size = plan.sizes[name]
            # a sample of fewer rows than a step's: the same fraction of its rows
            scale = min(1.0, len(ordered) / max(plan.rows[name], 1))
            cap = sizing.padding_cap(ordered, max(1, round(size * scale)))
            cap = min(size, max(1, round(cap / scale)))
            if cap < size:
                caps[name] = cap
        if not caps:
            return plan
        fits = {n: plan.sizes[n] for n in caps}
        return dataclasses.replace(plan.at({**plan.sizes, **caps}, plan.tokens), fits=fits)

    def use_plan(self, plan: ChunkPlan) -> None:
        """Cut chunks as ``plan`` says from the next step on (its sizes, token budgets and
        whether the step is plain training), e.g. a plan lowered after a step whose peak went
        over the budget (:meth:`~bigbatch.engine.sizing.ChunkPlan.lowered`)."""
        sizes = chunking.chunk_sizes(dict(plan.sizes), self.towers)
        tokens = {**self.chunk_tokens, **plan.tokens}
        self.chunk_tokens = self._token_budgets(tokens or None)
        self.chunk_sizes = sizes
        self._plain = plan.plain
        self.memory_plan = plan

    def activation_cost(self, name: str, inputs: Any,
                        rows: tuple[int, ...] = PROBE_ROWS) -> "TowerCost":
        """What one chunk of tower ``name`` keeps for its backward, per row: measured
        (:func:`~bigbatch.engine.sizing.activation_bytes`, counted
        :data:`~bigbatch.engine.sizing.ACTIVATION_MARGIN` larger for the backward's own
        gradients, plus :data:`~bigbatch.engine.sizing.STEP_OVERHEAD`) on the longest rows of
        ``inputs`` (in the default layout; otherwise the first ones), ``rows`` rows at a
        time, with the step's autocast and a forked random state; a tower without trainable
        parameters is measured as if it had them (an upper bound of its forward without gradients).
        Returns the cost with the embedding's width and tokens per row."""
        total = self._rows_of(name, inputs)
        counts = sorted({min(r, total) for r in rows})
        tower = D.unwrap_ddp(self.towers[name])
        params = list(tower.parameters()) if callable(getattr(tower, "parameters", None)) \
            else list(self._explicit_params or [])
        frozen = [p for p in params if not p.requires_grad]
        measured, out_shape = [], {}
        states = random.getstate()
        try:
            for p in frozen:
                p.requires_grad_(True)
            for r in counts:
                chunk = self._probe_chunk(name, inputs, r)
                width = _width_of(chunk)

                def run(chunk: Any = chunk) -> Any:
                    with self._autocast(chunking.first_device(chunk)):
                        out = self.embed(name, chunk)
                    out_shape.update(dim=E.dim_of(out), tokens=E.tokens_of(out),
                                     size=max(E.dtype_of(out).itemsize, 4))
                    return out

                with torch.random.fork_rng(devices=self._fork_devices(chunk)):
                    measured.append(sizing.activation_bytes(run, params))
        finally:
            for p in frozen:
                p.requires_grad_(False)
            random.setstate(states)
        per_row, fixed = _fit(counts, [m * sizing.ACTIVATION_MARGIN for m in measured])
        fixed += sizing.STEP_OVERHEAD
        row_bytes = E.row_numel(out_shape["dim"], out_shape["tokens"]) * out_shape["size"] \
            + out_shape["tokens"]  # a token tower's cache keeps a bool mask beside its values
        return TowerCost(ActivationCost(per_row, fixed, width, row_bytes), out_shape["dim"],
                         out_shape["tokens"])

    # ----------------------------------------------------------------- helpers
    def _unsized(self) -> bool:
        return bool(self._auto_rows or self._auto_tokens) and self.memory_plan is None

    def _plan_across_ranks(self, inputs: Mapping[str, Any], options: dict[str, Any]) -> ChunkPlan:
        """Every rank's :meth:`_local_plan`, then the smallest sizes of all ranks (a failure
        on one rank raised on all)."""
        plan, failure = None, None
        names = list(self.towers)
        try:
            plan = self._local_plan(inputs, **options)
        except Exception as e:  # noqa: BLE001 - raised on every rank by exchange_failure
            failure = e
        mine = [0] * (2 * len(names) + 1) if plan is None else \
            [plan.sizes[n] for n in names] + [plan.tokens.get(n, 0) for n in names] + \
            [int(plan.plain)]
        table = D.exchange_failure(failure, self.process_group, "while sizing the chunks",
                                   values=mine)
        low = table.min(0).values.tolist()
        sizes = dict(zip(names, low[:len(names)]))
        tokens = {n: v for n, v in zip(names, low[len(names):2 * len(names)]) if v}
        return plan.at(sizes, tokens, plain=bool(low[-1]))

    def _rows_of(self, name: str, inputs: Any) -> int:
        if type(self).split_inputs is GradCache.split_inputs:
            return chunking.rows_of(inputs, name)
        return sum(chunking.checked_split(name, *self.split_inputs(name, inputs, _UNCUT))[1])

    def _probe_chunk(self, name: str, inputs: Any, rows: int) -> Any:
        """A chunk of ``rows`` of a tower's longest rows (the default layout; an override's,
        or raw examples': its first chunk of that many rows), ready for the tower."""
        order = chunking.length_order(inputs) \
            if type(self).split_inputs is GradCache.split_inputs else None
        if order is not None:
            chunks, _ = chunking.ordered_chunks(inputs, order, rows,
                                                trim_padding=self.trim_padding)
        else:
            chunks, _ = chunking.checked_split(name, *self.split_inputs(name, inputs, rows))
        return chunking.to_device(chunking.materialize(chunks[0]), self.device)

    def _fork_devices(self, chunk: Any) -> list[int]:
        dev = self.device or chunking.first_device(chunk)
        if dev is not None and dev.type == "cuda":
            return [dev.index if dev.index is not None else torch.cuda.current_device()]
        return []

    def _sizing_device(self, inputs: Mapping[str, Any]) -> torch.device:
        if self.device is not None:
            return self.device
        for value in inputs.values():
            dev = chunking.first_device(value)
            if dev is not None:
                return dev
        params = self._trainable_params()
        return params[0].device if params else torch.device("cpu")

    def _trainable_params(self) -> list[nn.Parameter]:
        seen: dict[int, nn.Parameter] = {}
        for obj in [*(D.unwrap_ddp(t) for t in self.towers.values()), self.loss_fn]:
            if callable(getattr(obj, "parameters", None)):
                for p in obj.parameters():
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
        for p in self._explicit_params or []:
            if p.requires_grad:
                seen.setdefault(id(p), p)
        return list(seen.values())

    def _loss_bytes(self, rows: Mapping[str, int], dims: Mapping[str, int],
                    tokens: Mapping[str, int], loss_kwargs: Mapping[str, Any],
                    device: torch.device, world_size: int, queued_rows: int = 0) -> int:
        """One loss block: the loss's ``memory_hint`` where it has one (``queued_rows``, a
        negative queue's documents, as ``rows["queued"]``); else twice what the loss keeps
        for its backward on random embeddings of this rank's shapes (times the number of
        ranks squared across ranks: its pairs grow so)."""
        hint = getattr(self.loss_fn, "memory_hint", None)
        seen = {**rows, "queued": queued_rows} if queued_rows else dict(rows)
        value = hint(seen, dict(dims), dict(tokens)) if callable(hint) else None
        if value is not None:
            return int(value)
        local = {n: rows[n] // world_size for n in rows}
        reps: dict[str, Embedding] = {}
        for name, n in local.items():
            shape = (n, tokens[name], dims[name]) if tokens[name] else (n, dims[name])
            values = torch.nn.functional.normalize(torch.randn(shape, device=device), dim=-1)
            values.requires_grad_(True)
            reps[name] = TokenEmbeddings(values, torch.ones(shape[:2], dtype=torch.bool,
                                                            device=device)) \
                if tokens[name] else values
        leaves = [r.values if isinstance(r, TokenEmbeddings) else r for r in reps.values()]
        loss_params = list(self.loss_fn.parameters()) \
            if callable(getattr(self.loss_fn, "parameters", None)) else []
        kept = sizing.activation_bytes(lambda: self.compute_loss(reps, **loss_kwargs)[0],
                                       [*leaves, *loss_params])
        return 2 * kept * world_size ** 2

    def _plan(self, name: str, inputs: Any, allow_empty: bool = False) -> _TowerRun:
        """Chunk one tower's inputs. The row count is what :meth:`split_inputs` says, so an
        override handles layouts whose first dimension is not the batch; length ordering
        needs the default layout and is skipped for an override; its chunks are gathered from
        the inputs when they are embedded (no reordered copy of the batch)."""
        order = None
        if self.sort_by_length and type(self).split_inputs is GradCache.split_inputs:
            chunking.rows_of(inputs, name)  # the checks of the default layout
            order = chunking.length_order(inputs)
        bounds = None
        if name in self.chunk_tokens:  # a token budget: the default layout, checked at init
            bounds = chunking.token_bounds(inputs, self.chunk_tokens[name],
                                           self.chunk_sizes[name], name=name, order=order,
                                           trim_padding=self.trim_padding)
        if order is not None:
            chunks, rows = chunking.ordered_chunks(inputs, order, self.chunk_sizes[name],
                                                   trim_padding=self.trim_padding, bounds=bounds)
        elif bounds is not None:
            chunks, rows = chunking.split_inputs(inputs, self.chunk_sizes[name], name=name,
                                                 collate=self.collate_fns.get(name),
                                                 trim_padding=self.trim_padding, bounds=bounds)
        else:
            chunks, rows = chunking.checked_split(
                name, *self.split_inputs(name, inputs, self.chunk_sizes[name]))
        if not rows and not allow_empty:  # distributed: the ranks agree on it, all raise
            raise InputError(f"input for tower {name!r} has no rows")
        return _TowerRun(name, _is_trainable(D.unwrap_ddp(self.towers[name])), chunks, rows,
                         order)

    def _token_budgets(self, chunk_tokens: int | Mapping[str, int] | None) -> dict[str, int]:
        """``{tower: token budget}`` for the towers cut by tokens (none when None).

        Raises:
            ConfigError: a budget that is not a positive integer, a dict naming an unknown
                tower, or a budget with an overridden :meth:`split_inputs` (whose layout the
                engine does not know).
        """
        if chunk_tokens is None:
            return {}
        if isinstance(chunk_tokens, Mapping):
            unknown = set(chunk_tokens) - set(self.towers)
            if unknown:
                raise ConfigError(f"chunk_tokens names unknown towers {sorted(unknown)}; "
                                  f"towers are {list(self.towers)}")
            budgets = dict(chunk_tokens)
        else:
            budgets = {n: chunk_tokens for n in self.towers}
        for name, budget in budgets.items():
            if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
                raise ConfigError(f"chunk_tokens for tower {name!r} must be a positive integer "
                                  f"(padded tokens per chunk), got {budget!r}")
        if budgets and type(self).split_inputs is not GradCache.split_inputs:
            raise ConfigError("chunk_tokens cuts the default layout of inputs; an overridden "
                              "split_inputs defines its own chunks (use chunk_size there)")
        return budgets

    def _rank_step(self) -> rank_step.RankStep:
        """The cross-rank agreements of one step, with the options as they are now."""
        return rank_step.RankStep(self.towers, self.loss_fn, group=self.process_group,
                                  cross_device=self.cross_device,
                                  check_finite=self.check_finite,
                                  sync_gradients=self.sync_gradients,
                                  params=self._explicit_params, scaler=self.scaler,
                                  keep_embeddings=self.keep_embeddings)

    def _autocast(self, device: torch.device | None) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        dev_type = (self.device or device or torch.device("cpu")).type
        return torch.autocast(device_type=dev_type, dtype=self.autocast_dtype)

    def _check_finite(self, runs: list[_TowerRun], loss: Tensor) -> None:
        flags = [E.all_finite(r.reps) for r in runs]
        flags = torch.stack(flags + [torch.isfinite(loss.detach()).to(flags[0].device)])
        ok = flags.tolist()  # the one synchronisation of the step
        for run, fine in zip(runs, ok):
            if not fine:
                raise NonFiniteError(
                    f"tower {run.name!r} produced NaN or inf embeddings; no gradient was written. "
                    f"Check the inputs, the learning rate, or use bfloat16 instead of float16")
        if not ok[-1]:
            raise NonFiniteError("the loss is NaN or inf; no gradient was written. Check the "
                                 "temperature (logit scale) and the embeddings' scale")

    def __repr__(self) -> str:
        tokens = f", chunk_tokens={self.chunk_tokens}" if self.chunk_tokens else ""
        if self._unsized():
            return (f"GradCache(towers={list(self.towers)}, chunk_size='auto' (sized at the "
                    f"first step), loss_fn={type(self.loss_fn).__name__})")
        return (f"GradCache(towers={list(self.towers)}, chunk_size={self.chunk_sizes}{tokens}, "
                f"loss_fn={type(self.loss_fn).__name__})")


@dataclass(frozen=True)
class TowerCost:
    """What :meth:`GradCache.activation_cost` measured: one chunk's activations
    (:class:`~bigbatch.engine.sizing.ActivationCost`), the embedding's width and its tokens
    per row (0: one vector per row)."""

    cost: ActivationCost
    dim: int
    tokens: int


def _auto_towers(option: Any, towers: Mapping[str, Any]) -> set[str]:
    """The towers an option sizes automatically: all for ``"auto"``, or those a dict gives
    ``"auto"``."""
    if isinstance(option, str) and option == AUTO:
        return set(towers)
    if isinstance(option, Mapping):
        return {n for n, v in option.items() if isinstance(v, str) and v == AUTO}
    return set()


def _without_auto(option: Any, towers: Mapping[str, Any], placeholder: Any) -> Any:
    """The option with its ``"auto"`` values replaced by ``placeholder`` (towers whose
    placeholder is None are left out)."""
    if isinstance(option, str) and option == AUTO:
        return None if placeholder is None else placeholder
    if isinstance(option, Mapping):
        out = {n: placeholder if isinstance(v, str) and v == AUTO else v
               for n, v in option.items()}
        return {n: v for n, v in out.items() if v is not None}
    return option


def _width_of(chunk: Any) -> int:
    """Token columns of a tokenized chunk (a dict's ``attention_mask`` or a 2-d tensor); 0
    for anything else."""
    mask = chunk.get("attention_mask") if isinstance(chunk, Mapping) else chunk
    return int(mask.shape[1]) if isinstance(mask, Tensor) and mask.dim() >= 2 else 0


def _fit(rows: list[int], measured: list[float]) -> tuple[float, int]:
    """``(per_row, fixed)`` of a line through the measured ``(rows, bytes)`` points, never
    below any of them (one point: through the origin)."""
    if len(rows) == 1:
        return measured[0] / rows[0], 0
    (r1, b1), (r2, b2) = (rows[0], measured[0]), (rows[-1], measured[-1])
    per_row = (b2 - b1) / (r2 - r1)
    fixed = b1 - per_row * r1
    if per_row <= 0 or fixed < 0:
        return max(b1 / r1, b2 / r2), 0
    return per_row, int(fixed)
