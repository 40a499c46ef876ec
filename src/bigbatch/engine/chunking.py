"""How the engine cuts one tower's inputs into chunks, and places a chunk for its tower.

A tower's inputs are a tensor (one row per example), a dict of tensors (keyword
arguments, e.g. a tokenizer's output), or a list of raw examples with a ``collate_fn``.
:func:`split_inputs` cuts them into chunks of at most ``chunk_size`` rows:

- tensors, and the batch-aligned values of a dict, are sliced on their first dimension;
  other dict values are passed to every chunk as they are;
- a tokenized dict (with a 2-d ``attention_mask``) is trimmed to each chunk's own longest
  row (:func:`token_spans`, :func:`trim_columns`), so a chunk of short texts does not carry
  the padding of the batch's longest one;
- a list of raw examples becomes :class:`RawChunk` pieces, collated only when the chunk is
  embedded (:func:`materialize`), so one chunk's collated tensors are in memory at a time.

:func:`length_order` orders examples by token count (``GradCache(sort_by_length=True)``)
and :func:`ordered_chunks` cuts the ordered rows into :class:`GatheredChunk` pieces, each
gathered from the inputs (:func:`index_rows`) only when it is embedded, so no reordered
copy of the whole batch is kept beside the inputs; :func:`to_device` and :func:`first_device` move a
chunk to the engine's device and find where it lives. :func:`token_bounds` cuts by a token
budget instead (``GradCache(chunk_tokens=...)``): a chunk holds as many rows as fit the
budget of padded tokens (rows x the chunk's longest row), so a chunk of long texts holds few
rows and one of short texts many. :func:`chunk_sizes` and
:func:`collate_fns` read the engine's per-tower options, and :func:`checked_split` checks
what an overridden ``split_inputs`` returned.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, InputError

__all__ = [
    "Chunk", "RawChunk", "GatheredChunk", "materialize", "rows_of", "chunk_bounds",
    "split_inputs", "token_spans", "trim_columns", "row_lengths", "length_order",
    "ordered_chunks",
    "index_rows", "to_device", "first_device", "token_bounds",
    "chunk_sizes", "collate_fns", "checked_split",
]

Chunk = Any  # a Tensor, a dict of tensors (keyword arguments), a RawChunk or a GatheredChunk


class RawChunk:
    """A chunk of raw examples, collated only when it is embedded (and again when it is
    replayed), so that one chunk's collated tensors (e.g. decoded page images) are in
    memory at a time, not the whole batch's."""

    __slots__ = ("items", "collate")

    def __init__(self, items: list, collate: Callable[[list], Any]) -> None:
        self.items = items
        self.collate = collate

    def __len__(self) -> int:
        return len(self.items)


class GatheredChunk:
    """Rows ``index`` of a tokenized dict of ``n`` rows, gathered from it only when the chunk
    is embedded (and again when it is replayed) and cut to the columns ``span`` (None: all),
    so that length ordering keeps no reordered copy of the batch (see :func:`ordered_chunks`)."""

    __slots__ = ("inputs", "index", "n", "span")

    def __init__(self, inputs: Mapping, index: Tensor, n: int,
                 span: tuple[int, int] | None) -> None:
        self.inputs, self.index, self.n, self.span = inputs, index, n, span

    def __len__(self) -> int:
        return len(self.index)

    def gather(self) -> dict:
        """The chunk's rows (and columns) as a dict of new tensors."""
        chunk = index_rows(self.inputs, self.index, self.n)
        if self.span is None:
            return chunk
        return trim_columns(chunk, self.span, self.inputs["attention_mask"].shape[1],
                            len(self.index))


def chunk_sizes(chunk_size: int | Mapping[str, int], towers: Iterable[str]) -> dict[str, int]:
    """``{tower: rows per chunk}`` from one int for all towers or a dict naming each tower.

    Raises:
        ConfigError: a dict that does not name every tower exactly, or a size that is not a
            positive integer.
    """
    towers = list(towers)
    if isinstance(chunk_size, Mapping):
        unknown = set(chunk_size) - set(towers)
        missing = set(towers) - set(chunk_size)
        if unknown or missing:
            raise ConfigError(f"chunk_size dict must name every tower exactly: towers are "
                              f"{towers}, chunk_size names {list(chunk_size)}")
        sizes = dict(chunk_size)
    else:
        sizes = {n: chunk_size for n in towers}
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ConfigError(f"chunk_size for tower {name!r} must be a positive integer, "
                              f"got {size!r}; it is the number of rows embedded at once")
    return sizes


def collate_fns(collate_fn: Callable[[list], Any] | Mapping[str, Callable[[list], Any]] | None,
                towers: Iterable[str]) -> dict[str, Callable[[list], Any] | None]:
    """``{tower: collate_fn or None}`` from one callable (or None) for all towers or a dict
    naming some of them.

    Raises:
        ConfigError: a dict naming a tower that does not exist.
    """
    towers = list(towers)
    if collate_fn is None or callable(collate_fn):
        return {n: collate_fn for n in towers}
    unknown = set(collate_fn) - set(towers)
    if unknown:
        raise ConfigError(f"collate_fn names unknown towers {sorted(unknown)}; "
                          f"towers are {towers}")
    return {n: collate_fn.get(n) for n in towers}


def checked_split(name: str, chunks: Iterable[Chunk],
                  rows: Iterable[Any]) -> tuple[list[Chunk], list[int]]:
    """What a tower's ``split_inputs`` returned, as lists, once it is one positive integer
    row count per chunk (the engine trusts them: the tower must return that many rows).

    Raises:
        InputError: counts that are not positive integers, or not one per chunk.
    """
    chunks, given = list(chunks), list(rows)
    try:
        counts = [operator.index(r) for r in given]
    except TypeError:
        counts = []
    if len(counts) != len(given) or len(chunks) != len(counts) or not all(r > 0 for r in counts):
        raise InputError(f"split_inputs for tower {name!r} must return (chunks, rows) with "
                         f"one positive integer row count per chunk, got {len(chunks)} "
                         f"chunks and rows {given}")
    return chunks, counts


def materialize(chunk: Chunk) -> Any:
    """What the tower is called on: a :class:`RawChunk` collated, a :class:`GatheredChunk`
    gathered, any other chunk as it is."""
    if isinstance(chunk, RawChunk):
        return chunk.collate(chunk.items)
    return chunk.gather() if isinstance(chunk, GatheredChunk) else chunk


def rows_of(inputs: Any, name: str) -> int:
    """The number of examples in one tower's inputs (``name`` is the tower, for messages).

    Raises:
        InputError: a 0-d tensor, a dict without a batch-dimension tensor or whose tensors
            disagree on the batch size, or an input of another type.
    """
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


def chunk_bounds(n: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` row ranges of at most ``chunk_size`` rows covering ``n`` rows, in order."""
    return [(lo, min(lo + chunk_size, n)) for lo in range(0, n, chunk_size)]


def token_bounds(inputs: Any, chunk_tokens: int, max_rows: int, *, name: str,
                 order: Tensor | None = None,
                 trim_padding: bool = True) -> list[tuple[int, int]]:
    """``[lo, hi)`` row ranges (of the rows taken in ``order``, when given) each holding as
    many rows as fit ``chunk_tokens`` padded tokens and at most ``max_rows`` rows, in order.

    A chunk's padded tokens are its rows times its width: with ``trim_padding``, the columns
    from its rows' first to last real token (:func:`token_spans`); without, every column. A
    row longer than the budget is a chunk of its own.

    Raises:
        InputError: inputs without token columns: a tokenized dict needs a 2-d
            ``attention_mask``, a tensor at least 2 dimensions; raw examples are collated
            per chunk, so their token counts are not known beforehand.
    """
    n = rows_of(inputs, name)
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape[0] == n:
        t = mask.shape[1]
        first_l, last_l = _extents(mask)
        if not trim_padding:
            first_l, last_l = [0] * n, [t - 1] * n
    elif isinstance(inputs, Tensor) and inputs.dim() >= 2:
        t = inputs.shape[1]
        first_l, last_l = [0] * n, [t - 1] * n
    else:
        raise InputError(f"chunk_tokens needs token counts for tower {name!r}: give a tokenized "
                         f"dict with a 2-d attention_mask or a (rows, tokens) tensor; raw "
                         f"examples are collated per chunk, so their lengths are unknown "
                         f"beforehand (use chunk_size alone for them)")
    if order is not None:
        idx = order.tolist()
        first_l, last_l = [first_l[i] for i in idx], [last_l[i] for i in idx]
    bounds: list[tuple[int, int]] = []
    lo = 0
    while lo < n:
        a, b = first_l[lo], last_l[lo]
        hi = lo + 1
        while hi < n and hi - lo < max_rows:
            a2, b2 = min(a, first_l[hi]), max(b, last_l[hi])
            if (hi + 1 - lo) * max(b2 - a2 + 1, 1) > chunk_tokens:
                break
            a, b, hi = a2, b2, hi + 1
        bounds.append((lo, hi))
        lo = hi
    return bounds


def split_inputs(inputs: Any, chunk_size: int, *, name: str,
                 collate: Callable[[list], Any] | None = None,
                 trim_padding: bool = True,
                 bounds: list[tuple[int, int]] | None = None) -> tuple[list[Chunk], list[int]]:
    """Cut one tower's inputs into chunks of at most ``chunk_size`` rows (the layout of
    :meth:`bigbatch.GradCache.split_inputs`, described in the module docstring).

    Args:
        inputs: a tensor, a dict of tensors, or a list of raw examples.
        chunk_size: rows per chunk.
        name: the tower, for messages.
        collate: the tower's ``collate_fn``, needed for a list of raw examples.
        trim_padding: cut a tokenized dict's chunks to their own longest row.
        bounds: the chunks' row ranges (from :func:`token_bounds`) instead of ``chunk_size``
            rows each.

    Returns:
        the chunks and their row counts.

    Raises:
        InputError: inputs of no known layout, or raw examples without ``collate``.
    """
    n = rows_of(inputs, name)
    bounds = chunk_bounds(n, chunk_size) if bounds is None else bounds
    rows = [hi - lo for lo, hi in bounds]
    if isinstance(inputs, Tensor):
        return [inputs[lo:hi] for lo, hi in bounds], rows
    if isinstance(inputs, Mapping):
        spans = (token_spans(inputs, bounds, n) if trim_padding else [None] * len(bounds))
        chunks = []
        for (lo, hi), span in zip(bounds, spans):
            chunk = {k: _slice_rows(v, lo, hi, n) for k, v in inputs.items()}
            if span is not None:
                chunk = trim_columns(chunk, span, inputs["attention_mask"].shape[1], hi - lo)
            chunks.append(chunk)
        return chunks, rows
    if collate is None:
        raise InputError(f"tower {name!r} was given a list of raw examples but no collate_fn; "
                         f"pass collate_fn=... (or {{{name!r}: ...}}) to GradCache")
    return [RawChunk(list(inputs[lo:hi]), collate) for lo, hi in bounds], rows


def _batch_aligned(value: Any, n: int) -> bool:
    if isinstance(value, Tensor):
        return value.dim() > 0 and value.shape[0] == n
    return isinstance(value, (list, tuple)) and len(value) == n


def _slice_rows(value: Any, lo: int, hi: int, n: int) -> Any:
    if isinstance(value, Tensor) or isinstance(value, (list, tuple)):
        return value[lo:hi] if _batch_aligned(value, n) else value
    return value


def token_spans(inputs: Mapping, bounds: list[tuple[int, int]], n: int,
                order: Tensor | None = None) -> list[tuple[int, int] | None]:
    """For each chunk ``bounds[i]`` of a tokenized dict of ``n`` rows (of its rows taken in
    ``order``, when given), the column range ``[a, b)`` holding any non-padding token (one
    host-device synchronisation per tower); all None when the dict has no 2-d
    ``attention_mask`` of ``n`` rows."""
    mask = inputs.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != n:
        return [None] * len(bounds)
    t = mask.shape[1]
    first_l, last_l = _extents(mask)
    if order is not None:
        idx = order.tolist()
        first_l, last_l = [first_l[i] for i in idx], [last_l[i] for i in idx]
    spans = []
    for lo, hi in bounds:
        a, b = min(first_l[lo:hi]), max(last_l[lo:hi])
        spans.append((a, b + 1) if b >= a else (0, t))
    return spans


def _extents(mask: Tensor) -> tuple[list[int], list[int]]:
    """Each row's first and last real token column of a 2-d attention mask (``t`` and -1
    for a row without any), with one host-device synchronisation."""
    nz = mask != 0
    t = mask.shape[1]
    first = torch.where(nz.any(1), nz.int().argmax(1), t)
    last = torch.where(nz.any(1), t - 1 - nz.flip(1).int().argmax(1), -1)
    return first.tolist(), last.tolist()


def trim_columns(chunk: dict, span: tuple[int, int], t: int, rows: int) -> dict:
    """Cut every ``(rows, t, ...)`` tensor of a chunk to the columns ``span``; other values
    (and every value when ``span`` is all ``t`` columns) are kept as they are."""
    a, b = span
    if (a, b) == (0, t):
        return chunk
    return {k: v[:, a:b] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[0] == rows
            and v.shape[1] == t else v for k, v in chunk.items()}


def row_lengths(inputs: Any) -> Tensor | None:
    """Each row's token count of a tokenized dict (its ``attention_mask``'s unmasked
    positions, on the CPU), or None when there is no ``attention_mask`` to measure."""
    if isinstance(inputs, Mapping) and isinstance(inputs.get("attention_mask"), Tensor):
        return (inputs["attention_mask"] != 0).sum(1).cpu()
    return None


def length_order(inputs: Any) -> Tensor | None:
    """The permutation putting a tokenized dict's rows in descending token count (stable, on
    the CPU), or None when there is no ``attention_mask`` to measure."""
    lengths = row_lengths(inputs)
    if lengths is None:
        return None  # nothing to measure: chunk in the given order
    return torch.argsort(lengths, descending=True, stable=True)


def ordered_chunks(inputs: Mapping, order: Tensor, chunk_size: int, *,
                   trim_padding: bool = True,
                   bounds: list[tuple[int, int]] | None = None) -> tuple[list[Chunk], list[int]]:
    """The chunks :func:`split_inputs` makes of a tokenized dict's rows taken in ``order``
    (from :func:`length_order`), as :class:`GatheredChunk` pieces: each is gathered from
    ``inputs`` when it is embedded, never a reordered copy of the whole batch; ``bounds``
    (from :func:`token_bounds`, in the ordered rows) instead of ``chunk_size`` rows each.
    Returns the chunks and their row counts."""
    n = len(order)
    bounds = chunk_bounds(n, chunk_size) if bounds is None else bounds
    spans = token_spans(inputs, bounds, n, order) if trim_padding else [None] * len(bounds)
    return ([GatheredChunk(inputs, order[lo:hi], n, span) for (lo, hi), span in zip(bounds, spans)],
            [hi - lo for lo, hi in bounds])


def index_rows(inputs: Any, index: Tensor, n: int) -> Any:
    """Select rows ``index`` from a tensor, from each batch-aligned value of a dict (``n``
    rows), or from a list."""
    if isinstance(inputs, Tensor):
        return inputs.index_select(0, index.to(inputs.device))
    if isinstance(inputs, Mapping):
        return {k: index_rows(v, index, n) if _batch_aligned(v, n) else v
                for k, v in inputs.items()}
    idx = index.tolist()
    return [inputs[i] for i in idx]


def to_device(obj: Any, device: torch.device | None) -> Any:
    """A tensor, or the tensors of a dict, moved to ``device`` (non-blocking); anything else,
    and everything when ``device`` is None, as it is."""
    if device is None:
        return obj
    if isinstance(obj, Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def first_device(obj: Any) -> torch.device | None:
    """The device of a tensor, or of the first tensor found in a (nested) dict; else None."""
    if isinstance(obj, Tensor):
        return obj.device
    if isinstance(obj, Mapping):
        for v in obj.values():
            dev = first_device(v)
            if dev is not None:
                return dev
    return None
