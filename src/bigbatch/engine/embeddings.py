"""What a tower returns, and what the engine keeps of it between the stages of a step.

A tower returns one vector per row, a ``(rows, dim)`` tensor, or one vector per token,
:class:`TokenEmbeddings` ``(values, mask)`` with ``values`` ``(rows, tokens, dim)`` and
``mask`` ``(rows, tokens)`` (nonzero: a real token), for late-interaction (multi-vector,
ColBERT / ColPali-style) losses such as :class:`bigbatch.MaxSimInfoNCE`. A loss takes
token embeddings for the arguments it names in its ``token_inputs`` attribute (read by
:class:`bigbatch.engine.loss_contract.LossArguments`); every other argument takes a tensor, and
:func:`check_output` refuses the other kind before any gradient is written.

The cache of a tower (:class:`CacheWriter`) is one buffer, the chunks written into it in
the original order. The cache of a token tower: each chunk is embedded at its own token
count (a tokenized chunk is trimmed to its longest row, see :mod:`bigbatch.engine.chunking`) and
cut to the columns holding an unmasked token of the chunk; the cache holds the whole batch
in one tensor, the chunks padded with zeros to the longest of them (the batch's longest
row), and no further. Its memory is ``rows x tokens x dim`` values (float32 at least)
plus a ``rows x tokens`` bool mask, per tower (``tokens`` the batch's longest row), where
a single-vector tower's is ``rows x dim``. Masked tokens are zeros in the cache and
receive no gradient: the cached gradient flows back to the unmasked tokens only
(:func:`surrogate_backward`, the backward of ``sum(values * grad)`` over unmasked
tokens). This is exact for a loss that ignores masked tokens and not the positions of
tokens, as a late-interaction loss does (columns masked in every row of a chunk, e.g. its
left padding, are not cached, so a row's tokens keep their order but not their column).

Across ranks (:func:`pack`, :func:`unpack`) token embeddings are padded to the longest
row of all ranks for the all-gather; the gradient that comes back is cut to this rank's
own token count again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Union

import torch
from torch import Tensor

from ..errors import InputError, ShapeError

__all__ = ["TokenEmbeddings", "Embedding", "check_output", "CacheWriter", "cache_of",
           "detached", "grad_of", "surrogate_backward", "all_finite", "dtype_of", "dim_of",
           "tokens_of", "row_numel", "pack", "unpack", "stack_rows"]


class TokenEmbeddings(NamedTuple):
    """One embedding per token: ``values`` ``(rows, tokens, dim)`` and ``mask``
    ``(rows, tokens)`` (nonzero or True: a real token; every row needs one). A named tuple,
    so ``torch.utils._pytree`` and ``torch.compile`` see a pair of tensors."""

    values: Tensor
    mask: Tensor


Embedding = Union[Tensor, TokenEmbeddings]


def check_output(name: str, index: int, emb: object, rows: int, tokens: bool) -> Embedding:
    """A tower's output for chunk ``index`` of ``rows`` rows, checked (a token mask comes back
    as bool); ``tokens``: the loss takes :class:`TokenEmbeddings` for this tower.

    Raises:
        ShapeError: not a tensor or TokenEmbeddings, a wrong shape, or the kind the loss
            does not take for this tower.
    """
    if isinstance(emb, TokenEmbeddings):
        if not tokens:
            raise ShapeError(f"tower {name!r} returned TokenEmbeddings (one vector per token) "
                             f"but the loss takes one (rows, dim) vector per row for {name!r}; "
                             f"use bb.MaxSimInfoNCE, or a loss whose token_inputs names {name!r}")
        values, mask = emb
        if not isinstance(values, Tensor) or not isinstance(mask, Tensor):
            raise ShapeError(f"tower {name!r} returned TokenEmbeddings of "
                             f"{type(values).__name__} and {type(mask).__name__}; both must "
                             f"be tensors")
        if values.dim() != 3 or values.shape[0] != rows:
            raise ShapeError(f"tower {name!r} returned token values of shape "
                             f"{tuple(values.shape)} for chunk {index} of {rows} rows; "
                             f"expected ({rows}, tokens, dim)")
        if tuple(mask.shape) != tuple(values.shape[:2]):
            raise ShapeError(f"tower {name!r} returned a token mask of shape "
                             f"{tuple(mask.shape)} for values of shape {tuple(values.shape)} "
                             f"(chunk {index}); the mask must be (rows, tokens) = "
                             f"{tuple(values.shape[:2])}")
        return TokenEmbeddings(values, mask if mask.dtype == torch.bool else mask != 0)
    if not isinstance(emb, Tensor):
        raise ShapeError(f"tower {name!r} returned {type(emb).__name__} for chunk {index}; a "
                         f"tower must return a (rows, dim) tensor (wrap a Hugging Face model "
                         f"so that it pools and returns the embedding)")
    if emb.dim() != 2 or emb.shape[0] != rows:
        raise ShapeError(f"tower {name!r} returned shape {tuple(emb.shape)} for chunk {index} "
                         f"of {rows} rows; expected ({rows}, dim)")
    if tokens:
        raise ShapeError(f"tower {name!r} returned a {tuple(emb.shape)} tensor (one vector per "
                         f"row) but the loss takes TokenEmbeddings for {name!r} (its "
                         f"token_inputs); return bb.TokenEmbeddings(values, mask) from the "
                         f"tower, for both towers of a late-interaction loss")
    return emb


def _at_least_float32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


class CacheWriter:
    """One tower's cache, written as each chunk is embedded (:meth:`add`) and finished once
    all are (:meth:`finish`); ``rows``: each chunk's row count, ``order``: the permutation
    applied before chunking (None: the given order).

    One vector per row: the chunks are written into one ``(rows, dim)`` buffer in the
    original order as they come (half precision raised to float32), so the step holds no
    list of chunk outputs and no reordered copy. Token embeddings: the chunks' outputs are
    kept until :meth:`finish` (each chunk's token span is known only then, with one
    host-device synchronisation), which writes them into one buffer in the original order.
    """

    def __init__(self, name: str, rows: Sequence[int], order: Tensor | None,
                 requires_grad: bool) -> None:
        self.name, self.rows, self.order = name, list(rows), order
        self.requires_grad = requires_grad
        self._values: Tensor | None = None
        self._tokens: list[TokenEmbeddings] = []
        self._lo = 0

    def add(self, index: int, emb: Embedding) -> None:
        """Write chunk ``index``'s (detached) output, checked by :func:`check_output`.

        Raises:
            ShapeError: a width other than the first chunk's.
        """
        hi = self._lo + self.rows[index]
        if isinstance(emb, TokenEmbeddings):
            self._tokens.append(emb)
        else:
            if self._values is None:
                self._values = emb.new_empty((sum(self.rows), emb.shape[1]),
                                             dtype=_at_least_float32(emb).dtype)
            elif emb.shape[1] != self._values.shape[1]:
                raise ShapeError(f"tower {self.name!r} returned width {emb.shape[1]} for chunk "
                                 f"{index} but {self._values.shape[1]} for chunk 0; every chunk "
                                 f"must embed to the same width")
            _write_rows(self._values, self._rows(self._lo, hi), emb.detach())
        self._lo = hi

    def finish(self) -> tuple[Embedding, list[tuple[int, int]] | None]:
        """The cache, a leaf, with for token embeddings each chunk's token span ``[a, b)``:
        the columns holding an unmasked token of the chunk, the only ones cached (padded with
        zeros to the longest span; masked tokens set to zero).

        Raises:
            InputError: a row with every token masked (one host-device synchronisation).
        """
        if not self._tokens:
            return self._values.requires_grad_(self.requires_grad), None
        outs, self._tokens = self._tokens, []
        info = []
        for o in outs:  # per chunk: first used column, one past the last, every row has a token
            used = o.mask.any(0).long()
            info.append(torch.stack([used.argmax(), len(used) - used.flip(0).argmax(),
                                     o.mask.any(1).all().long()]))
        info = torch.stack(info).tolist()
        spans = [(a, b) for a, b, _ in info]
        width = max(b - a for a, b in spans)
        first = outs[0].values
        values = first.new_zeros((sum(self.rows), width, first.shape[2]),
                                 dtype=_at_least_float32(first).dtype)
        mask = outs[0].mask.new_zeros((sum(self.rows), width))
        lo = 0
        for c, (o, (a, b)) in enumerate(zip(outs, spans)):
            rows = self._rows(lo, lo + len(o.mask))
            _write_rows(mask[:, :b - a], rows, o.mask[:, a:b])
            _write_rows(values[:, :b - a], rows, o.values.detach()[:, a:b])
            outs[c], lo = None, lo + len(o.mask)  # each chunk's output freed once written
        if not all(ok for _, _, ok in info):
            raise InputError(f"tower {self.name!r} returned a row with every token masked (row "
                             f"{int((~mask.any(1)).int().argmax())} of the batch); every row "
                             f"needs at least one unmasked token")
        values.masked_fill_(~mask[..., None], 0)
        return TokenEmbeddings(values.requires_grad_(self.requires_grad), mask), spans

    def _rows(self, lo: int, hi: int) -> slice | Tensor:
        """Where chunk rows ``[lo, hi)`` go in the cache."""
        return slice(lo, hi) if self.order is None else self.order[lo:hi]


def _write_rows(dest: Tensor, rows: slice | Tensor, src: Tensor) -> None:
    """``dest[rows] = src`` (cast to ``dest``'s dtype), in place."""
    if isinstance(rows, slice):
        dest[rows] = src
    else:
        dest.index_copy_(0, rows.to(dest.device), src.to(dest.dtype))


def cache_of(name: str, outs: list[Embedding], order: Tensor | None,
             requires_grad: bool) -> tuple[Embedding, list[tuple[int, int]] | None]:
    """The cache of one tower from all its chunks' outputs at once (:class:`CacheWriter`,
    which the engine feeds chunk by chunk): one leaf, half precision raised to float32, rows
    in the original order (``order``: the permutation applied before chunking), with each
    chunk's token span for token embeddings.

    Raises:
        ShapeError: chunks of different widths.
        InputError: a row with every token masked (one host-device synchronisation).
    """
    rows = [len(o.mask) if isinstance(o, TokenEmbeddings) else len(o) for o in outs]
    writer = CacheWriter(name, rows, order, requires_grad)
    for c, o in enumerate(outs):
        writer.add(c, o)
    return writer.finish()


def detached(emb: Embedding) -> Embedding:
    """``emb`` without its graph."""
    if isinstance(emb, TokenEmbeddings):
        return TokenEmbeddings(emb.values.detach(), emb.mask)
    return emb.detach()


def grad_of(reps: Embedding) -> Tensor | None:
    """The gradient the loss's backward left on a cache (None: the loss did not use it)."""
    return reps.values.grad if isinstance(reps, TokenEmbeddings) else reps.grad


def surrogate_backward(emb: Embedding, grad: Tensor,
                       span: tuple[int, int] | None = None) -> None:
    """Backpropagate a chunk's cached gradient: d/dθ sum(emb * grad), in the gradient's dtype;
    for token embeddings over the unmasked tokens of the chunk's ``span`` (from
    :func:`cache_of`; ``grad`` is padded to the tower's longest span).

    An embedding that does not require grad (a plain-function tower over frozen weights)
    has nothing to receive, which is the exact result.
    """
    if isinstance(emb, TokenEmbeddings):
        a, b = span if span is not None else (0, emb.values.shape[1])
        mask = emb.mask[:, a:b, None] != 0
        emb, grad = emb.values[:, a:b], grad[:, :b - a] * mask.to(grad.dtype)
    if emb.requires_grad:
        torch.autograd.backward(emb.to(grad.dtype), grad)


def all_finite(reps: Embedding) -> Tensor:
    """A 0-d bool tensor: no NaN or inf in the embeddings (no synchronisation)."""
    return torch.isfinite(reps.values if isinstance(reps, TokenEmbeddings) else reps).all()


def dtype_of(reps: Embedding) -> torch.dtype:
    """The embeddings' dtype (of the values, for token embeddings)."""
    return (reps.values if isinstance(reps, TokenEmbeddings) else reps).dtype


def dim_of(reps: Embedding) -> int:
    """The embedding width (``dim``)."""
    return (reps.values if isinstance(reps, TokenEmbeddings) else reps).shape[-1]


def tokens_of(reps: Embedding) -> int:
    """The token count of token embeddings; 0 for one vector per row."""
    return reps.values.shape[1] if isinstance(reps, TokenEmbeddings) else 0


def row_numel(dim: int, tokens: int) -> int:
    """Numbers per row in :func:`pack`'s layout: ``dim``, or ``tokens * (dim + 1)``."""
    return dim if tokens == 0 else tokens * (dim + 1)


def pack(reps: Embedding, tokens: int, dtype: torch.dtype) -> Tensor:
    """``(rows, row_numel)`` in ``dtype``, differentiable: a vector per row as it is; token
    embeddings padded to ``tokens`` (the longest of all ranks), then values and mask."""
    if not isinstance(reps, TokenEmbeddings):
        return reps.to(dtype)
    values, mask = reps
    pad = tokens - values.shape[1]
    values = torch.nn.functional.pad(values.to(dtype), (0, 0, 0, pad))
    mask = torch.nn.functional.pad(mask.to(dtype), (0, pad))
    return torch.cat([values.reshape(values.shape[0], -1), mask], 1)


def unpack(flat: Tensor, dim: int, tokens: int) -> Embedding:
    """The inverse of :func:`pack` for ``flat`` ``(rows, row_numel)``."""
    if tokens == 0:
        return flat
    values, mask = flat.split([tokens * dim, tokens], 1)
    return TokenEmbeddings(values.reshape(-1, tokens, dim), mask.detach() != 0)


def stack_rows(rows: Sequence[Tensor], dim: int = 0) -> TokenEmbeddings:
    """Rows of different token counts (each ``(tokens_i, dim)``) as one TokenEmbeddings,
    padded with zeros to the longest row; the mask marks each row's own tokens. ``dim``: the
    width of an empty result (no rows)."""
    if not rows:
        return TokenEmbeddings(torch.zeros(0, 0, dim), torch.zeros(0, 0, dtype=torch.bool))
    values = torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)
    lengths = torch.tensor([len(r) for r in rows], device=values.device)
    mask = torch.arange(values.shape[1], device=values.device)[None, :] < lengths[:, None]
    return TokenEmbeddings(values, mask)
