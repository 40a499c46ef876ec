"""Matryoshka representation learning over any bigbatch loss: the loss is computed on the
embeddings truncated to each of several widths (and L2-normalised again), and the weighted
losses are summed, so that the first ``dim`` coordinates of an embedding are a usable
embedding on their own.

Under the engine it costs one replay, not one per width: the towers embed once, every
width's loss is computed on the same cached embeddings (:mod:`bigbatch.engine.gradcache`), and their
gradients add up in the cache before the single replay. Across ranks each width's loss is
the wrapped loss's own cross-device loss (:mod:`bigbatch.engine.distributed`) on the gathered
embeddings truncated to that width.

For widths ``m_1 > m_2 > ...`` with weights ``w_i``::

    loss = sum_i w_i * L(normalize(query[:, :m_i]), normalize(doc[:, :m_i]), ...)

Token embeddings (:class:`bigbatch.TokenEmbeddings`, late interaction) are truncated per
token. A negative queue's documents (:class:`~bigbatch.losses.queue.QueuedDocs`) are truncated
with the batch's. A loss that holds fixed embeddings of its own (``CorpusInfoNCE``'s corpus, named in
its ``fixed_embeddings`` attribute) has them truncated the same way, once, at construction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch.nn.functional as F
from torch import Tensor, nn

from ..engine.embeddings import TokenEmbeddings
from ..engine.loss_contract import loss_and_metrics
from ..errors import ConfigError, ShapeError
from .base import LossOutput, PartialLoss
from .queue import QueuedDocs

if TYPE_CHECKING:
    from ..engine.distributed import Gathered

__all__ = ["Matryoshka", "check_dims", "truncate"]


def check_dims(dims: Sequence[int], weights: Sequence[float] | None = None,
               width: int | None = None, what: str = "dims") -> tuple[list[int], list[float]]:
    """Matryoshka widths and weights, checked: widths positive integers, from largest to
    smallest, each once, none above ``width`` (when known); one positive finite weight per
    width (default: all 1). Returns ``(dims, weights)`` as lists.

    Raises:
        ConfigError: any of the above, naming ``what`` (the option the dims came from).
    """
    dims = list(dims)
    if not dims:
        raise ConfigError(f"{what}: give at least one dimension, e.g. 384,256,128,64")
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            raise ConfigError(f"{what}: every dimension must be a positive integer, got {d!r}")
    if len(set(dims)) != len(dims):
        dup = sorted({d for d in dims if dims.count(d) > 1})
        raise ConfigError(f"{what}: dimension(s) {dup} given more than once; give each once")
    if any(a <= b for a, b in zip(dims, dims[1:])):
        raise ConfigError(f"{what}: give the dimensions from largest to smallest (e.g. "
                          f"{','.join(map(str, sorted(dims, reverse=True)))}), got "
                          f"{','.join(map(str, dims))}")
    if width is not None and dims[0] > width:
        raise ConfigError(f"{what}: dimension {dims[0]} is larger than the model's embedding "
                          f"width {width}; the largest dimension can be at most {width}")
    if weights is None:
        weights = [1.0] * len(dims)
    weights = list(weights)
    if len(weights) != len(dims):
        raise ConfigError(f"{what}: {len(weights)} weight(s) for {len(dims)} dimension(s) "
                          f"{dims}; give one weight per dimension")
    for w in weights:
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) \
                or w <= 0:
            raise ConfigError(f"{what}: every weight must be a positive finite number, got {w!r}")
    return dims, [float(w) for w in weights]


def truncate(emb: Any, dim: int, normalize: bool = True, name: str = "embeddings") -> Any:
    """The first ``dim`` coordinates of a ``(rows, width)`` tensor or of every token of
    :class:`bigbatch.TokenEmbeddings` (L2-normalised again when ``normalize``); anything else
    is returned as it is.

    Raises:
        ShapeError: ``dim`` larger than the embeddings' width.
    """
    values = emb.values if isinstance(emb, TokenEmbeddings) else emb
    if not isinstance(values, Tensor) or not values.is_floating_point() or values.dim() < 2:
        return emb
    if dim > values.shape[-1]:
        raise ShapeError(f"Matryoshka dimension {dim} is larger than the width "
                         f"{values.shape[-1]} of {name}; the largest dimension can be at most "
                         f"{values.shape[-1]}")
    cut = values[..., :dim]
    if normalize:
        cut = F.normalize(cut, dim=-1)
    return TokenEmbeddings(cut, emb.mask) if isinstance(emb, TokenEmbeddings) else cut


class Matryoshka(nn.Module):
    """Wrap a bigbatch loss so that it trains every prefix width of the embeddings.

    Args:
        loss: the loss to wrap: :class:`bigbatch.InfoNCE`, :class:`bigbatch.CorpusInfoNCE`,
            :class:`bigbatch.MaxSimInfoNCE` (token vectors truncated) or any callable taking
            the towers' embeddings by keyword.
        dims: the widths, from largest to smallest, each once (e.g. ``[384, 256, 128, 64]``).
        weights: one positive weight per width (default: all 1).
        normalize: L2-normalise each truncated embedding (and token vector) again.
        inputs: the arguments holding embeddings to truncate (default: the loss's
            ``token_inputs`` when it has them, else ``("query", "doc")``); other arguments
            (ids, positive indices, scores) are passed through as they are.

    Inputs: those of the wrapped loss.

    Returns:
        :class:`bigbatch.LossOutput`: ``sum_i weights[i] * loss(truncated to dims[i])`` and
        metrics: ``loss@<dim>`` and ``<metric>@<dim>`` for each width, and the largest
        width's metrics also under their plain names (so ``accuracy``, ``temperature`` read
        as they do without Matryoshka).

    Raises:
        ConfigError: bad dims or weights (:func:`check_dims`), or a loss that is not callable.
        ShapeError: (at the first call, before any gradient) a width larger than the
            embeddings'.

    Example::

        loss_fn = bb.Matryoshka(bb.InfoNCE(temperature=0.05), dims=[384, 128, 64])
        cache = bb.GradCache({"query": model, "doc": model}, loss_fn, chunk_size=64)
        result = cache.step(query=q, doc=d)
        result.metrics["accuracy@64"]

    References:
        Kusupati et al. 2022, "Matryoshka Representation Learning";
        sentence-transformers' ``MatryoshkaLoss`` (here on the cached embeddings, one replay).
    """

    def __init__(self, loss: Callable[..., Any], dims: Sequence[int],
                 weights: Sequence[float] | None = None, normalize: bool = True,
                 inputs: Sequence[str] | None = None) -> None:
        super().__init__()
        if not callable(loss):
            raise ConfigError(f"Matryoshka wraps a loss; got {type(loss).__name__}")
        if isinstance(loss, Matryoshka):
            raise ConfigError("Matryoshka cannot wrap another Matryoshka; give all the "
                              "dimensions to one")
        self.dims, self.weights = check_dims(dims, weights)
        self.loss = loss
        self.normalize = normalize
        self.inputs = tuple(inputs) if inputs is not None else \
            tuple(getattr(loss, "token_inputs", ()) or ("query", "doc"))
        self._fixed = self._truncated_fixed()

    # the engine reads these of the loss it is given (bigbatch.engine.loss_contract)
    @property
    def wrapped_loss(self) -> Callable[..., Any]:
        """The wrapped loss: the engine checks the step's arguments against its signature."""
        return self.loss

    @property
    def token_inputs(self) -> tuple[str, ...]:
        return tuple(getattr(self.loss, "token_inputs", ()))

    @property
    def cross_device_forward(self) -> Callable[..., PartialLoss]:
        """The global-batch loss across ranks, present when the wrapped loss has one."""
        if not hasattr(self.loss, "cross_device_forward"):
            raise AttributeError("the wrapped loss has no cross_device_forward")
        return self._cross_device_forward

    def clamp_(self) -> "Matryoshka":
        """The wrapped loss's ``clamp_()`` (its temperature's bounds), if it has one."""
        clamp = getattr(self.loss, "clamp_", None)
        if clamp is not None:
            clamp()
        return self

    @property
    def temperature(self) -> float | None:
        return getattr(self.loss, "temperature", None)

    # ------------------------------------------------------------------ helpers
    def _truncated_fixed(self) -> dict[int, dict[str, Tensor]]:
        """The wrapped loss's own fixed embeddings (a corpus) truncated to each width."""
        out: dict[int, dict[str, Tensor]] = {d: {} for d in self.dims}
        for attr in getattr(self.loss, "fixed_embeddings", ()):
            full = getattr(self.loss, attr)
            for d in self.dims:
                out[d][attr] = truncate(full, d, self.normalize, f"the loss's {attr}")
        return out

    @contextlib.contextmanager
    def _at(self, dim: int) -> Iterator[None]:
        """The wrapped loss with its fixed embeddings truncated to ``dim``."""
        fixed = self._fixed[dim]
        saved = {attr: getattr(self.loss, attr) for attr in fixed}
        try:
            for attr, value in fixed.items():
                setattr(self.loss, attr, value)
            yield
        finally:
            for attr, value in saved.items():
                setattr(self.loss, attr, value)

    def _cut(self, reps: Mapping[str, Any], dim: int) -> dict[str, Any]:
        """The embeddings truncated to ``dim``, queued documents (a negative queue's) too."""
        def cut(k: str, v: Any) -> Any:
            if isinstance(v, QueuedDocs):
                return v.with_doc(lambda t: truncate(t, dim, self.normalize, "the queued "
                                                                                "documents"))
            return truncate(v, dim, self.normalize, f"{k!r}") if k in self.inputs else v
        return {k: cut(k, v) for k, v in reps.items()}

    def _check_width(self, reps: Mapping[str, Any]) -> None:
        """A width above the embeddings' is refused for every input, before any loss."""
        for k in self.inputs:
            if k in reps:
                truncate(reps[k], self.dims[0], False, f"{k!r}")

    def _combine(self, outs: list[tuple[Tensor, dict[str, Any]]]
                 ) -> tuple[Tensor, dict[str, Tensor]]:
        total = sum(w * loss for w, (loss, _) in zip(self.weights, outs))
        metrics: dict[str, Tensor] = {}
        for key, value in outs[0][1].items():
            metrics[key] = value
        for d, (loss, ms) in zip(self.dims, outs):
            metrics[f"loss@{d}"] = loss.detach()
            for key, value in ms.items():
                metrics[f"{key}@{d}"] = value
        return total, metrics

    def memory_hint(self, rows: Mapping[str, int], dims: Mapping[str, int],
                    tokens: Mapping[str, int] | None = None) -> int | None:
        """Bytes the loss holds at its peak beyond its inputs and their gradients: every
        width's truncated (and normalised) embeddings, kept for the one backward, and the
        wrapped loss's ``memory_hint`` at the largest width; None (measure it) when the
        wrapped loss has none. ``GradCache(chunk_size="auto")`` reads it."""
        inner = getattr(self.loss, "memory_hint", None)
        block = inner(rows, dims, tokens) if callable(inner) else None
        if block is None:
            return None
        tokens = tokens or {}
        cut = sum(2 * rows[k] * max(tokens.get(k, 0), 1) * d * 4
                  for k in self.inputs if k in rows for d in self.dims)
        return cut + int(block)

    # ------------------------------------------------------------------ forward
    def forward(self, **kwargs: Any) -> LossOutput:
        self._check_width(kwargs)
        outs = []
        for d in self.dims:
            with self._at(d):
                outs.append(loss_and_metrics(self.loss(**self._cut(kwargs, d))))
        return LossOutput(*self._combine(outs))

    def _cross_device_forward(self, gathered: "Gathered", **kwargs: Any) -> PartialLoss:
        """This rank's part of the global Matryoshka loss: the wrapped loss's part at each
        width, weighted and summed (and the totals and metrics likewise)."""
        self._check_width(gathered.reps)  # the same widths on every rank: all raise together
        parts, totals, outs = [], [], []
        for d in self.dims:
            at_d = dataclasses.replace(gathered, reps=self._cut(gathered.reps, d))
            with self._at(d):
                part, total, metrics = self.loss.cross_device_forward(at_d,
                                                                      **self._cut(kwargs, d))
            parts.append(part)
            totals.append(total)
            outs.append((total, metrics))
        part = sum(w * p for w, p in zip(self.weights, parts))
        total, metrics = self._combine(outs)
        return PartialLoss(part, total.detach(), metrics)

    def extra_repr(self) -> str:
        return f"dims={self.dims}, weights={self.weights}, normalize={self.normalize}"
