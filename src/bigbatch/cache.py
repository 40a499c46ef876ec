"""The GradCache engine: one optimizer step whose gradients equal those of the full
batch while only one chunk's activations are alive at a time.

For every step the engine:

1. embeds each chunk of each tower with gradients off, recording the random state
   of the chunk (:class:`bigbatch.rng.RandContext`) before it is collated, so that
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
(how a tower is called on a chunk), or :meth:`GradCache.compute_loss`.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import distributed as D
from .errors import ConfigError, InputError, NonFiniteError, ShapeError
from .rng import RandContext

__all__ = ["GradCache", "StepResult"]

Chunk = Any  # a Tensor, a dict of tensors (keyword arguments), or a collated raw chunk


class _RawChunk:
    """A chunk of raw examples, collated only when it is embedded (and again when it is
    replayed), so that one chunk's collated tensors (e.g. decoded page images) are in
    memory at a time, not the whole batch's."""

    __slots__ = ("items", "collate")

    def __init__(self, items: list, collate: Callable[[list], Any]) -> None:
        self.items = items
        self.collate = collate

    def __len__(self) -> int:
        return len(self.items)


def _materialize(chunk: Chunk) -> Any:
    return chunk.collate(chunk.items) if isinstance(chunk, _RawChunk) else chunk


@dataclass
class StepResult:
    """What :meth:`GradCache.step` returns.

    Attributes:
        loss: the detached full-batch loss (unscaled, even with a GradScaler).
        metrics: the loss's detached metrics (0-d tensors), e.g. ``pos_sim``, ``accuracy``;
            a metric given as a plain number becomes a tensor on the loss's device.
    """

    loss: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)

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
    """Per-tower state kept between the three steps of one ``step()``."""

    name: str
    trainable: bool
    chunks: list[Chunk]
    rows: list[int]
    order: Tensor | None  # permutation applied before chunking (length ordering)
    contexts: list[RandContext] = field(default_factory=list)
    reps: Tensor | None = None
    kept: Tensor | None = None  # last chunk's embedding with its graph, not replayed


def _loss_parameters(loss_fn: Callable) -> tuple[set[str], bool]:
    """Names the loss accepts as keywords, and whether it takes ``**kwargs``."""
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return set(), True
    names, var_kw = set(), False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names, var_kw


def _is_trainable(tower: Callable) -> bool:
    params = getattr(tower, "parameters", None)
    if not callable(params):
        return True  # a plain function: we cannot know, so treat it as trainable
    return any(p.requires_grad for p in params())


def _rows_of(inputs: Any, name: str) -> int:
    if isinstance(inputs, Tensor):
        if inputs.dim() == 0:
            raise InputError(f"input for tower {name!r} is a 0-d tensor; give one row per example")
        return inputs.shape[0]
    if isinstance(inputs, Mapping):
        rows = {k: v.shape[0] for k, v in inputs.items() if isinstance(v, Tensor) and v.dim() > 0}
        if not rows:
            raise InputError(f"input dict for tower {name!r} holds no tensor with a batch dimension")
        if len(set(rows.values())) > 1:
            raise InputError(f"input dict for tower {name!r} has tensors with different batch "
                             f"sizes {rows}; every tensor's first dimension must be the batch "
                             f"(override GradCache.split_inputs for other layouts)")
        return next(iter(rows.values()))
    if isinstance(inputs, Sequence) and not isinstance(inputs, (str, bytes)):
        return len(inputs)
    raise InputError(f"input for tower {name!r} must be a tensor, a dict of tensors or a list of "
                     f"raw examples (with collate_fn), got {type(inputs).__name__}")


def _index_rows(inputs: Any, index: Tensor, n: int) -> Any:
    """Select rows ``index`` from a tensor, from each batch-aligned value of a dict, or a list."""
    if isinstance(inputs, Tensor):
        return inputs.index_select(0, index.to(inputs.device))
    if isinstance(inputs, Mapping):
        return {k: _index_rows(v, index, n) if _batch_aligned(v, n) else v
                for k, v in inputs.items()}
    idx = index.tolist()
    return [inputs[i] for i in idx]


def _batch_aligned(value: Any, n: int) -> bool:
    if isinstance(value, Tensor):
        return value.dim() > 0 and value.shape[0] == n
    return isinstance(value, (list, tuple)) and len(value) == n


def _slice_rows(value: Any, lo: int, hi: int, n: int) -> Any:
    if isinstance(value, Tensor) or isinstance(value, (list, tuple)):
        return value[lo:hi] if _batch_aligned(value, n) else value
    return value


def _to_device(obj: Any, device: torch.device | None) -> Any:
    if device is None:
        return obj
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj


def _surrogate_backward(emb: Tensor, grad: Tensor) -> None:
    """Backpropagate the cached gradient: d/dθ sum(emb * grad), in the gradient's dtype.

    An embedding that does not require grad (a plain-function tower over frozen weights)
    has nothing to receive, which is the exact result."""
    if emb.requires_grad:
        torch.autograd.backward(emb.to(grad.dtype), grad)


def _shared(error: Exception) -> Exception:
    """Mark ``error`` as raised on every rank already (see :func:`_unshared`)."""
    error._bigbatch_shared = True  # type: ignore[attr-defined]
    return error


def _unshared(error: Exception) -> Exception:
    """``error`` if only this rank raised it; one that every rank raises already (shared by a
    collective, e.g. a loss's :func:`bigbatch.distributed.raise_together`) is re-raised."""
    if getattr(error, "_bigbatch_shared", False):
        raise error
    return error


def _first_device(obj: Any) -> torch.device | None:
    if isinstance(obj, Tensor):
        return obj.device
    if isinstance(obj, Mapping):
        for v in obj.values():
            dev = _first_device(v)
            if dev is not None:
                return dev
    return None


class GradCache:
    """Exact gradient caching for contrastive losses over one or more towers.

    Args:
        towers: ``{name: tower}``; a tower is any callable from one chunk of inputs to a
            ``(rows, dim)`` tensor. A dict chunk is passed as keyword arguments
            (``tower(**chunk)``, as Hugging Face models expect), anything else as the one
            positional argument. The same module may serve several towers.
        loss_fn: called as ``loss_fn(**{name: embeddings}, **loss_kwargs)``; returns a scalar
            tensor, a ``(loss, metrics)`` pair (e.g. :class:`bigbatch.InfoNCE`) or a dict with
            a ``"loss"`` key. Any loss works, not only InfoNCE.
        chunk_size: rows per chunk, one int for all towers or ``{name: int}``.
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
            :mod:`bigbatch.distributed` for the exact scaling). False: each rank's loss is local.
        process_group: the group to gather over and synchronise in (default: the world).
        sync_gradients: under ``torch.distributed``, sum the gradients over ranks once per
            step (one coalesced all-reduce, which also carries the failure flags of the
            step's second pass; with False, a small all-gather of those flags ends the step).
            Towers wrapped in DistributedDataParallel are called through their inner module,
            so DDP never synchronises on its own; FSDP2 (``fully_shard``) towers
            reduce-scatter once, on the last replay that reaches them.
        params: the parameters to synchronise, when a tower is a plain function whose
            parameters the engine cannot find (default: the towers' and the loss's).

    Raises:
        ConfigError: bad options (chunk size <= 0, a loss that does not take a tower's name).
    """

    def __init__(self, towers: Mapping[str, Callable[..., Tensor]], loss_fn: Callable[..., Any],
                 chunk_size: int | Mapping[str, int], *,
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
                 params: Any = None) -> None:
        if not isinstance(towers, Mapping) or not towers:
            raise ConfigError("towers must be a non-empty dict {name: callable}, e.g. "
                              "{'query': encoder, 'doc': encoder}")
        for name, tower in towers.items():
            if not callable(tower):
                raise ConfigError(f"tower {name!r} is not callable ({type(tower).__name__})")
        self.towers: dict[str, Callable[..., Tensor]] = dict(towers)
        self.loss_fn = loss_fn
        self.chunk_sizes = self._chunk_sizes(chunk_size)
        if collate_fn is None or callable(collate_fn):
            self.collate_fns = {n: collate_fn for n in self.towers}
        else:
            unknown = set(collate_fn) - set(self.towers)
            if unknown:
                raise ConfigError(f"collate_fn names unknown towers {sorted(unknown)}; "
                                  f"towers are {list(self.towers)}")
            self.collate_fns = {n: collate_fn.get(n) for n in self.towers}
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
        self.last_sync_calls = 0  # collectives the last step used to synchronise gradients
        self._where = ""  # where in the step this rank is, for a failure's message
        self._loss_names, self._loss_var_kw = _loss_parameters(loss_fn)
        if not self._loss_var_kw:
            missing = [n for n in self.towers if n not in self._loss_names]
            if missing:
                raise ConfigError(f"loss_fn does not accept the tower name(s) {missing} as "
                                  f"keyword arguments; it takes {sorted(self._loss_names)}. "
                                  f"Name the towers after the loss's arguments")

    # ------------------------------------------------------------------ options
    def _chunk_sizes(self, chunk_size: int | Mapping[str, int]) -> dict[str, int]:
        if isinstance(chunk_size, Mapping):
            unknown = set(chunk_size) - set(self.towers)
            missing = set(self.towers) - set(chunk_size)
            if unknown or missing:
                raise ConfigError(f"chunk_size dict must name every tower exactly: towers are "
                                  f"{list(self.towers)}, chunk_size names {list(chunk_size)}")
            sizes = dict(chunk_size)
        else:
            sizes = {n: chunk_size for n in self.towers}
        for name, size in sizes.items():
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ConfigError(f"chunk_size for tower {name!r} must be a positive integer, "
                                  f"got {size!r}; it is the number of rows embedded at once")
        return sizes

    # ------------------------------------------------------------ overridables
    def split_inputs(self, name: str, inputs: Any, chunk_size: int) -> tuple[list[Chunk], list[int]]:
        """Cut one tower's inputs into chunks of at most ``chunk_size`` rows.

        Returns the chunks and their row counts. Tensors and batch-aligned dict values
        are sliced on their first dimension; other dict values are passed to every chunk.
        Tokenized dicts (with ``attention_mask``) are trimmed to each chunk's longest row.
        Lists of raw examples are split; each piece is collated with the tower's
        ``collate_fn`` when it is embedded and again when it is replayed, never all at once.

        Override it for layouts whose first dimension is not the batch (e.g. a
        vision-language processor's patches of all images concatenated): the engine takes
        the tower's row count from the returned ``rows`` (one positive int per chunk; the
        tower must return that many embeddings for the chunk) and never inspects the inputs.
        """
        n = _rows_of(inputs, name)
        bounds = [(lo, min(lo + chunk_size, n)) for lo in range(0, n, chunk_size)]
        rows = [hi - lo for lo, hi in bounds]
        if isinstance(inputs, Tensor):
            return [inputs[lo:hi] for lo, hi in bounds], rows
        if isinstance(inputs, Mapping):
            spans = self._token_spans(inputs, bounds, n)
            chunks = []
            for (lo, hi), span in zip(bounds, spans):
                chunk = {k: _slice_rows(v, lo, hi, n) for k, v in inputs.items()}
                if span is not None:
                    chunk = self._trim(chunk, span, inputs["attention_mask"].shape[1], hi - lo)
                chunks.append(chunk)
            return chunks, rows
        collate = self.collate_fns.get(name)
        if collate is None:
            raise InputError(f"tower {name!r} was given a list of raw examples but no collate_fn; "
                             f"pass collate_fn=... (or {{{name!r}: ...}}) to GradCache")
        return [_RawChunk(list(inputs[lo:hi]), collate) for lo, hi in bounds], rows

    def embed(self, name: str, chunk: Chunk) -> Tensor:
        """Run tower ``name`` on one chunk: ``tower(**chunk)`` for a dict, else ``tower(chunk)``."""
        tower = D.unwrap_ddp(self.towers[name])  # DDP's own forward would sync buffers
        if isinstance(chunk, Mapping):
            return tower(**chunk)
        return tower(chunk)

    def compute_loss(self, reps: dict[str, Tensor], **loss_kwargs: Any) -> tuple[Tensor, dict[str, Tensor]]:
        """Call the loss on the full-batch embeddings and return ``(loss, metrics)``."""
        out = self.loss_fn(**reps, **loss_kwargs)
        if isinstance(out, Tensor):
            return out, {}
        if isinstance(out, Mapping):
            if "loss" not in out:
                raise ConfigError("loss_fn returned a dict without a 'loss' key")
            return out["loss"], {k: v for k, v in out.items() if k != "loss"}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor):
            return out[0], dict(out[1] or {})
        raise ConfigError(f"loss_fn must return a tensor, (loss, metrics) or a dict with 'loss'; "
                          f"got {type(out).__name__}")

    # ----------------------------------------------------------------- helpers
    def _token_spans(self, inputs: Mapping, bounds: list[tuple[int, int]],
                     n: int) -> list[tuple[int, int] | None]:
        """For each chunk, the column range holding any non-padding token (one sync per tower)."""
        mask = inputs.get("attention_mask") if self.trim_padding else None
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != n:
            return [None] * len(bounds)
        nz = mask != 0
        t = mask.shape[1]
        first = torch.where(nz.any(1), nz.int().argmax(1), t)
        last = torch.where(nz.any(1), t - 1 - nz.flip(1).int().argmax(1), -1)
        first_l, last_l = first.tolist(), last.tolist()
        spans = []
        for lo, hi in bounds:
            a, b = min(first_l[lo:hi]), max(last_l[lo:hi])
            spans.append((a, b + 1) if b >= a else (0, t))
        return spans

    @staticmethod
    def _trim(chunk: dict, span: tuple[int, int], t: int, rows: int) -> dict:
        a, b = span
        if (a, b) == (0, t):
            return chunk
        return {k: v[:, a:b] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == rows
                and v.shape[1] == t else v for k, v in chunk.items()}

    def _length_order(self, name: str, inputs: Any, n: int) -> Tensor | None:
        if isinstance(inputs, Mapping) and isinstance(inputs.get("attention_mask"), Tensor):
            lengths = (inputs["attention_mask"] != 0).sum(1)
            return torch.argsort(lengths.cpu(), descending=True, stable=True)
        return None  # nothing to measure: chunk in the given order

    def _autocast(self, device: torch.device | None) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        dev_type = (self.device or device or torch.device("cpu")).type
        return torch.autocast(device_type=dev_type, dtype=self.autocast_dtype)

    def _checked(self, name: str, index: int, emb: Any, rows: int) -> Tensor:
        if not isinstance(emb, Tensor):
            raise ShapeError(f"tower {name!r} returned {type(emb).__name__} for chunk {index}; a "
                             f"tower must return a (rows, dim) tensor (wrap a Hugging Face model "
                             f"so that it pools and returns the embedding)")
        if emb.dim() != 2 or emb.shape[0] != rows:
            raise ShapeError(f"tower {name!r} returned shape {tuple(emb.shape)} for chunk {index} "
                             f"of {rows} rows; expected ({rows}, dim)")
        return emb

    def _plan(self, name: str, inputs: Any, allow_empty: bool = False) -> _TowerRun:
        """Chunk one tower's inputs. The row count is what :meth:`split_inputs` says, so an
        override handles layouts whose first dimension is not the batch; length ordering
        needs the default layout and is skipped for an override."""
        order = None
        if self.sort_by_length and type(self).split_inputs is GradCache.split_inputs:
            n = _rows_of(inputs, name)
            order = self._length_order(name, inputs, n)
            if order is not None:
                inputs = _index_rows(inputs, order, n)
        chunks, rows = self.split_inputs(name, inputs, self.chunk_sizes[name])
        chunks, given = list(chunks), list(rows)
        try:
            rows = [operator.index(r) for r in given]
        except TypeError:
            rows = []
        if len(rows) != len(given) or len(chunks) != len(rows) or not all(r > 0 for r in rows):
            raise InputError(f"split_inputs for tower {name!r} must return (chunks, rows) with "
                             f"one positive integer row count per chunk, got {len(chunks)} "
                             f"chunks and rows {given}")
        if not rows and not allow_empty:  # distributed: the ranks agree on it, all raise
            raise InputError(f"input for tower {name!r} has no rows")
        return _TowerRun(name, _is_trainable(D.unwrap_ddp(self.towers[name])), chunks, rows,
                         order)

    # -------------------------------------------------------------------- step
    def step(self, **inputs: Any) -> StepResult:
        """Run one GradCache step and accumulate the full-batch gradient into ``.grad``.

        Keyword arguments named after a tower are that tower's inputs; the others go to
        the loss (e.g. ``doc_ids``). Returns a :class:`StepResult`.

        Raises:
            InputError: a tower's input is missing or empty, or an argument is neither a
                tower nor accepted by the loss.
            ShapeError: a tower output is not ``(rows, dim)``.
            NonFiniteError: NaN/inf in an embedding or in the loss (nothing written yet).

        Under ``torch.distributed``, an error that one rank's inputs cause before the first
        collective is raised on every rank (the same class, naming the rank). The step runs
        with gradients enabled even when called under ``torch.no_grad()``; under
        ``torch.inference_mode()``, which nothing can lift, it raises ConfigError.

        A failure on one rank later in the step (a tower raising or running out of memory,
        in the first pass or the replay; the loss or its backward) ends the step on every
        rank at once instead of leaving the others waiting in the next collective until the
        process group's timeout: the failing rank raises its own exception, the others
        :class:`~bigbatch.errors.RankFailedError` (or the failing rank's bigbatch error
        class) naming that rank, where it failed and its message. The flag travels in the
        collective the step makes next anyway, so a healthy step pays nothing extra:

        - first pass: the after-embedding exchange (no gradient written yet);
        - the loss: a local loss's finiteness exchange; a cross-device loss's closing
          all-reduce (:class:`bigbatch.InfoNCE`, :class:`bigbatch.CorpusInfoNCE`); for a
          generic loss, or a failure in the loss's backward, the embedding gather's backward
          all-reduce, in which the failing rank takes part with zeros;
        - the replay, and a local loss without ``check_finite``: the gradient sync. With
          ``sync_gradients=False`` one small all-gather of the flags ends each step instead
          (that is its only cost in the normal path), and with FSDP towers one more precedes
          the replay (their replays are collective).

        After such an error the gradients are incomplete (zero them) and the ranks are still
        in step: the next step can run. Not covered, because the other ranks are then
        inside a collective that the engine does not own: a failure inside an FSDP tower's
        replay, or in a tower whose forward is itself collective (SyncBatchNorm, FSDP in the
        first pass); a third-party ``cross_device_forward`` that fails before its own
        collectives (pass ``failure=`` to :meth:`Gathered.all_reduce_sum` as InfoNCE does);
        a rank that dies outright (killed, segfault) and never reaches the collective: the
        others then wait for the process group's timeout.
        """
        if torch.is_inference_mode_enabled():
            raise ConfigError("GradCache.step() computes gradients; it cannot run under "
                              "torch.inference_mode() (call it outside that block)")
        group = self.process_group
        distributed = D.is_distributed(group)
        runs: list[_TowerRun] = []
        loss_kwargs: dict[str, Any] = {}
        failure: Exception | None = None
        sync_params: list[nn.Parameter] = []
        try:
            loss_kwargs = self._check_arguments(inputs)
            runs = [self._plan(name, inputs[name], distributed) for name in self.towers]
            if distributed and self.sync_gradients:  # a plain-function tower without params=
                sync_params = self._sync_params()    # is refused before any gradient is written
        except Exception as e:  # noqa: BLE001 - re-raised on every rank by _agree_on_sizes
            if not distributed:
                raise
            failure = e
        fsdp = self._fsdp_modules()
        counts = self._agree_on_sizes(runs, loss_kwargs, failure) if distributed else None
        self._where = ""
        with self._no_sync(fsdp), torch.enable_grad():  # also when called under no_grad()
            if not distributed:
                self._embed_all(runs)
                total, metrics = self._loss_and_backward(runs, loss_kwargs)
                self._replay_all(runs, fsdp)
                return StepResult(total, metrics)
            failure = None
            try:
                self._embed_all(runs)
            except Exception as e:  # noqa: BLE001 - every rank raises in the exchange below
                failure = e
            self._agree_after_embedding(runs, failure, self._where)
            failure, where, total, metrics = self._distributed_loss(runs, loss_kwargs, counts)
            if fsdp:  # FSDP towers' replays are collective: agree on the loss's outcome first
                D.exchange_failure(failure, group, where)
            if failure is None:
                try:
                    self._replay_all(runs, fsdp)
                except Exception as e:  # noqa: BLE001 - shared in the gradient sync below
                    failure, where = _unshared(e), self._where
        if self.sync_gradients:
            self.last_sync_calls = D.all_reduce_gradients(sync_params, group, failure, where)
        else:  # the flags travel alone (the caller synchronises the gradients itself)
            D.exchange_failure(failure, group, where)
        return StepResult(total, metrics)

    def _check_arguments(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Check that every tower has an input and every other argument is the loss's;
        return the loss's keyword arguments."""
        missing = [n for n in self.towers if n not in inputs]
        if missing:
            raise InputError(f"step() is missing input(s) for tower(s) {missing}; towers are "
                             f"{list(self.towers)}")
        loss_kwargs = {k: v for k, v in inputs.items() if k not in self.towers}
        if not self._loss_var_kw:
            extra = [k for k in loss_kwargs if k not in self._loss_names]
            if extra:
                raise InputError(f"step() got argument(s) {extra} that are neither towers "
                                 f"{list(self.towers)} nor arguments of the loss "
                                 f"{sorted(self._loss_names - set(self.towers))}")
        return loss_kwargs

    # ------------------------------------------------------------ step stages
    def _embed_all(self, runs: list[_TowerRun]) -> None:
        """(1) Embed every chunk without gradients, remembering its random state."""
        last_trainable = max((i for i, r in enumerate(runs) if r.trainable), default=None)
        for i, run in enumerate(runs):
            outs = []
            for c, planned in enumerate(run.chunks):
                keep = (self.reuse_last_chunk and i == last_trainable
                        and c == len(run.chunks) - 1)
                self._where = f"while embedding tower {run.name!r} (chunk {c}, first pass)"
                ctx = None
                if run.trainable and not keep:  # before collating: a random collate_fn
                    ctx = RandContext(planned, devices=[self.device] if self.device else [])
                chunk = _to_device(_materialize(planned), self.device)  # is replayed too
                if ctx is not None:
                    ctx.include(chunk)  # a device only the collated chunk reveals
                    run.contexts.append(ctx)
                with torch.set_grad_enabled(keep), self._autocast(_first_device(chunk)):
                    emb = self._checked(run.name, c, self.embed(run.name, chunk), run.rows[c])
                if keep:
                    run.kept = emb
                    emb = emb.detach()
                outs.append(emb)
            reps = torch.cat(outs) if len(outs) > 1 else outs[0]
            if reps.dtype in (torch.float16, torch.bfloat16):
                reps = reps.float()
            if run.order is not None:
                reps = torch.empty_like(reps).index_copy_(0, run.order.to(reps.device), reps)
            run.reps = reps.detach().requires_grad_(run.trainable)

    def _loss_and_backward(self, runs: list[_TowerRun], loss_kwargs: dict[str, Any]
                           ) -> tuple[Tensor, dict[str, Any]]:
        """(2) One process: the loss on the cached embeddings and its backward to them.
        Returns (the detached loss, metrics)."""
        reps = {run.name: run.reps for run in runs}
        total, metrics = self.compute_loss(reps, **loss_kwargs)
        self._check_loss(runs, total, local=True)
        if total.requires_grad:
            (self.scaler.scale(total) if self.scaler is not None else total).backward()
        return total.detach(), metrics

    def _distributed_loss(self, runs: list[_TowerRun], loss_kwargs: dict[str, Any],
                          counts: dict[str, list[int]]
                          ) -> tuple[Exception | None, str, Tensor | None, dict[str, Any]]:
        """(2) Under ``torch.distributed``: the loss on the cached embeddings (gathered over
        ranks when cross-device) and its backward to them.

        A failure on some ranks is shared in the first collective the other ranks make next,
        so none of them waits there until the timeout: the cross-device protocol losses'
        closing all-reduce (:meth:`Gathered.all_reduce_sum`), the gather's backward (a rank
        whose loss or backward failed takes part in that all-reduce with zeros and a flag),
        or the finiteness exchange of a local loss; every rank then raises. A failure no
        collective follows before the gradient sync is returned instead, with where it
        happened, and shared there. Returns (that failure, where, reported loss, metrics).
        """
        group = self.process_group
        world = D.world_info(group).world_size
        state = D._GatherState()
        where, total, metrics = "in the loss", None, {}
        try:
            if self.cross_device:
                gathered = self._gather(runs, counts, state)
                if hasattr(self.loss_fn, "cross_device_forward"):
                    part, total, metrics = self.loss_fn.cross_device_forward(gathered,
                                                                            **loss_kwargs)
                    self._check_loss(runs, total, local=False)
                    backprop = part
                else:  # the global loss on every rank; the gather's backward sums W copies
                    total, metrics = self.compute_loss(gathered.reps, **loss_kwargs)
                    self._check_loss(runs, total, local=False)
                    backprop = total / world
            else:  # a local loss: its finiteness exchange carries any failure
                failure = None
                try:
                    total, metrics = self.compute_loss({r.name: r.reps for r in runs},
                                                       **loss_kwargs)
                    self._check_loss(runs, total, local=True)
                except Exception as e:  # noqa: BLE001 - shared below or in the sync
                    failure = e
                if self.check_finite:
                    ok = failure is not None or bool(torch.isfinite(total.detach()))
                    table = D._exchange_ints([int(failure is not None), int(ok)], group)
                    D.share_failure(failure, table[:, 0].tolist(), group, where)
                    if not bool(table[:, 1].min()):
                        raise _shared(NonFiniteError("the loss is NaN or inf on at least one "
                                                     "rank; no gradient was written"))
                elif failure is not None:
                    return failure, where, None, {}
                backprop = total / world  # no cross-device: the mean over ranks, as DDP
            where = "in the loss's backward"
            if backprop.requires_grad:
                (self.scaler.scale(backprop) if self.scaler is not None else backprop).backward()
        except D._PeerFailed as e:  # another rank failed; it took part in the gather's backward
            D.share_failure(None, e.failed, group)
        except Exception as e:  # noqa: BLE001 - this rank failed: tell the others
            failure = _unshared(e)
            if not state.pending:  # no collective before the sync: share it there
                return failure, where, None, {}
            D.share_failure(failure, D._fail_gather_backward(state), group, where)
        return None, "", total.detach(), metrics

    def _replay_all(self, runs: list[_TowerRun], fsdp: list[nn.Module]) -> None:
        """(3) Replay each trainable chunk with gradients and backpropagate its cached gradient."""
        jobs: list[tuple[_TowerRun, int | None, Tensor]] = []
        for run in runs:
            if not run.trainable:
                continue
            grad = run.reps.grad
            if grad is None:
                run.kept = None
                continue
            if run.order is not None:
                grad = grad.index_select(0, run.order.to(grad.device))
            grads = grad.split(run.rows)
            if run.kept is not None:  # before every replay: frees the kept graph first, so
                jobs.insert(0, (run, None, grads[-1]))  # one chunk's activations at a time
            jobs.extend((run, c, grads[c]) for c in range(len(run.contexts)))
        sync_at = self._fsdp_sync_points(jobs, fsdp)
        for j, (run, c, g) in enumerate(jobs):
            if j in sync_at:  # reduce-scatter on each FSDP module's last backward only
                self._set_fsdp_sync(sync_at[j], True)
            self._where = (f"while re-embedding tower {run.name!r} (chunk {c}, second pass)"
                           if c is not None else f"in the backward of tower {run.name!r} "
                           f"(chunk {len(run.chunks) - 1}, kept from the first pass)")
            if c is None:
                _surrogate_backward(run.kept, g)
                run.kept = None
                continue
            with run.contexts[c]:  # the collate_fn's random draws are replayed as well
                chunk = _to_device(_materialize(run.chunks[c]), self.device)
                with self._autocast(_first_device(chunk)):
                    emb = self.embed(run.name, chunk)
            _surrogate_backward(emb, g)

    # ------------------------------------------------------------ distributed
    def _agree_on_sizes(self, runs: list[_TowerRun], loss_kwargs: dict[str, Any],
                        failure: Exception | None) -> dict[str, list[int]]:
        """Exchange, in one all-gather, whether this rank's inputs failed their checks
        (``failure``), the names of the loss's arguments, and rows and chunk counts per
        tower; every rank raises the same error."""
        import torch.distributed as dist

        names = list(self.towers)
        sizes = ([sum(r.rows) for r in runs] + [len(r.chunks) for r in runs]
                 if failure is None else [0] * (2 * len(names)))
        kwargs_key = zlib.crc32("\0".join(sorted(loss_kwargs)).encode())
        table = D.raise_together(failure, self.process_group, [kwargs_key, *sizes])
        protocol = self.cross_device and hasattr(self.loss_fn, "cross_device_forward")
        if protocol and len(set(table[:, 0].tolist())) > 1:  # its collectives would not match
            every: list[Any] = [None] * table.shape[0]
            dist.all_gather_object(every, sorted(loss_kwargs), group=self.process_group)
            raise InputError(f"the ranks passed different loss arguments to step() (per rank: "
                             f"{every}); every rank must pass the same ones")
        rows = table[:, 1: 1 + len(names)]
        chunks = table[:, 1 + len(names):]
        counts = {n: rows[:, i].tolist() for i, n in enumerate(names)}
        empty = [(r, n) for n in names for r, v in enumerate(counts[n]) if v == 0]
        if empty:
            raise InputError(f"rank {empty[0][0]} has no rows for tower {empty[0][1]!r}; every "
                             f"rank needs at least one example (use drop_last=True in the sampler)")
        if self._fsdp_modules() and not bool((chunks == chunks[0]).all()):
            raise ConfigError(f"FSDP towers need the same number of chunks on every rank (their "
                              f"forward passes are collective), got {chunks.tolist()} per rank; "
                              f"use equal local batches (drop_last=True) and the same chunk "
                              f"size on every rank")
        return counts

    def _agree_after_embedding(self, runs: list[_TowerRun], failure: Exception | None = None,
                               where: str = "") -> None:
        """Exchange whether embedding failed on this rank (``failure``: a tower raised, or
        returned a wrong shape), finiteness and embedding width per tower, in one
        all-gather, so that all ranks fail together (see :func:`bigbatch.distributed.share_failure`)."""
        if failure is None:
            finite = [int(bool(torch.isfinite(r.reps).all())) if self.check_finite else 1
                      for r in runs]
            dims = [r.reps.shape[1] for r in runs]
        else:
            finite, dims = [1] * len(runs), [0] * len(runs)
        table = D._exchange_ints([int(failure is not None), *finite, *dims], self.process_group)
        D.share_failure(failure, table[:, 0].tolist(), self.process_group, where)
        table = table[:, 1:]
        for i, run in enumerate(runs):
            bad = [r for r in range(table.shape[0]) if table[r, i] == 0]
            if bad:
                raise NonFiniteError(f"tower {run.name!r} produced NaN or inf embeddings on rank(s) "
                                     f"{bad}; no gradient was written")
            widths = table[:, len(runs) + i].tolist()
            if len(set(widths)) > 1:
                raise ShapeError(f"tower {run.name!r} embeds to different widths on the ranks: "
                                 f"{widths}; every rank must run the same model")

    def _gather(self, runs: list[_TowerRun], counts: dict[str, list[int]],
                state: Any = None) -> D.Gathered:
        """All towers' embeddings from all ranks, in one all-gather with gradient."""
        info = D.world_info(self.process_group)
        dtype = runs[0].reps.dtype
        for run in runs[1:]:
            dtype = torch.promote_types(dtype, run.reps.dtype)
        dims = [run.reps.shape[1] for run in runs]
        flat = torch.cat([run.reps.to(dtype).reshape(-1) for run in runs])
        sizes = [sum(counts[run.name][r] * d for run, d in zip(runs, dims))
                 for r in range(info.world_size)]
        every = D.gather_with_grad(flat, self.process_group, sizes, state).split(sizes)
        per_tower: dict[str, list[Tensor]] = {run.name: [] for run in runs}
        for r, part in enumerate(every):
            pieces = part.split([counts[run.name][r] * d for run, d in zip(runs, dims)])
            for run, d, piece in zip(runs, dims, pieces):
                per_tower[run.name].append(piece.view(-1, d))
        reps = {name: torch.cat(parts) for name, parts in per_tower.items()}
        return D.Gathered(reps, {run.name: counts[run.name] for run in runs}, info.rank,
                          info.world_size, self.process_group)

    def _fsdp_modules(self) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for tower in self.towers.values():
            if isinstance(tower, nn.Module):
                for m in tower.modules():
                    if D.is_fsdp(m):
                        seen.setdefault(id(m), m)
        return list(seen.values())

    def _fsdp_sync_points(self, jobs: list[tuple[_TowerRun, int | None, Tensor]],
                          fsdp: list[nn.Module]) -> dict[int, list[nn.Module]]:
        """For each replay job, the FSDP modules whose gradient sync must be turned on just
        before it: each module's last job whose tower contains it.

        A module's reduce-scatter happens in the backward of its own root; separate towers
        (separate FSDP roots) therefore each need sync on before their own last job, not only
        before the last job of the step (whose backward never reaches the other towers)."""
        last: dict[int, int] = {}
        for j, (run, _, _) in enumerate(jobs):
            tower = D.unwrap_ddp(self.towers[run.name])
            if isinstance(tower, nn.Module):
                for m in tower.modules():
                    last[id(m)] = j
        points: dict[int, list[nn.Module]] = {}
        for m in fsdp:
            if id(m) in last:
                points.setdefault(last[id(m)], []).append(m)
        return points

    @staticmethod
    def _set_fsdp_sync(fsdp: list[nn.Module], on: bool) -> None:
        for m in fsdp:
            m.set_requires_gradient_sync(on, recurse=False)

    @contextlib.contextmanager
    def _no_sync(self, fsdp: list[nn.Module]):
        """No DDP or FSDP gradient synchronisation inside a step, but where the engine asks."""
        from torch.nn.parallel import DistributedDataParallel

        with contextlib.ExitStack() as stack:
            for tower in {id(t): t for t in self.towers.values()}.values():
                if isinstance(tower, DistributedDataParallel):
                    stack.enter_context(tower.no_sync())
            factors = [(m, self._divide_factor(m)) for m in fsdp]
            for m in fsdp:
                m.set_gradient_divide_factor(1.0)  # the loss is already global: sum, not mean
            self._set_fsdp_sync(fsdp, False)
            try:
                yield
            finally:
                self._set_fsdp_sync(fsdp, True)
                for m, factor in factors:  # FSDP used outside the engine averages again
                    m.set_gradient_divide_factor(factor)

    @staticmethod
    def _divide_factor(module: nn.Module) -> float | None:
        """An FSDP2 module's gradient divide factor (None: FSDP's default, the world size).
        FSDP2 has a setter but no getter; it keeps the factor on each parameter group."""
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # older torch: one group per module
            groups = [getattr(state, "_fsdp_param_group", None)]
        groups = [g for g in groups if g is not None]
        return getattr(groups[0], "gradient_divide_factor", None) if groups else None

    def _sync_params(self) -> list[nn.Parameter]:
        if self._explicit_params is not None:
            params = list(self._explicit_params)
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

    def _check_loss(self, runs: list[_TowerRun], loss: Any, local: bool) -> None:
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise ShapeError(f"loss_fn must return a scalar loss, got "
                             f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss)}")
        if not self.check_finite:
            return
        if D.is_distributed(self.process_group):
            # a rank-local loss's finiteness is exchanged by the caller (_distributed_loss),
            # with its failure flag; a cross-device loss is the same on every rank
            if not local and not bool(torch.isfinite(loss.detach())):
                raise NonFiniteError("the loss is NaN or inf on at least one rank; no gradient "
                                     "was written")
            return
        self._check_finite(runs, loss)

    def _check_finite(self, runs: list[_TowerRun], loss: Tensor) -> None:
        flags = torch.stack([torch.isfinite(r.reps).all() for r in runs]
                            + [torch.isfinite(loss.detach()).to(runs[0].reps.device)])
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
        return (f"GradCache(towers={list(self.towers)}, chunk_size={self.chunk_sizes}, "
                f"loss_fn={type(self.loss_fn).__name__})")
