"""The layout rules every bigbatch loss follows, in plain Python (no torch): the batch
layout's hard-negative count, document ids as codes, the extra in-batch terms, the starting
logit scale, and how the logits are cut into row blocks. The JAX losses
(:mod:`bigbatch.jax.losses`) share this module with the torch ones.

The batch layout: ``B`` queries and ``B * (1 + k)`` documents laid out
``[pos_0, neg_0_1 .. neg_0_k, pos_1, ...]``; query ``i``'s positive is document ``i * (1 + k)``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Sequence

from ..errors import ConfigError, ShapeError

__all__ = ["EXTRA_NEGATIVES", "extra_negatives_of", "initial_log_scale", "hard_negative_count",
           "id_codes", "MAX_BLOCK_LOGITS", "STATS", "check_blocking", "rows_per_block",
           "loss_block_bytes", "DENSE_COPIES"]

EXTRA_NEGATIVES = {
    "qq": "the other queries of the batch as negatives of a query (itself left out)",
    "dd": "the other documents of the batch as negatives of a query's positive document, in "
          "the query's denominator (the positive itself left out)",
}
"""The extra in-batch terms :class:`InfoNCE` can add (``extra_negatives``), as in
Qwen3-Embedding's training (ms-swift's ``INFONCE_INCLUDE_QQ`` / ``INFONCE_INCLUDE_DD``)."""


def extra_negatives_of(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``extra_negatives`` as a tuple of names of :data:`EXTRA_NEGATIVES` in their canonical
    order, from a sequence or a comma-separated string ("qq,dd"); empty for None or "".

    Raises:
        ConfigError: an unknown name or one given twice.
    """
    if value is None:
        return ()
    names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) \
        else list(value)
    unknown = [v for v in names if v not in EXTRA_NEGATIVES]
    if unknown:
        raise ConfigError(f"extra_negatives: unknown term(s) {unknown}; choose from "
                          f"{list(EXTRA_NEGATIVES)} (qq: other queries, dd: other documents)")
    if len(set(names)) != len(names):
        raise ConfigError(f"extra_negatives: {names} names a term twice")
    return tuple(k for k in EXTRA_NEGATIVES if k in names)


def initial_log_scale(temperature: float, max_scale: float = 100.0,
                      learnable: bool = True) -> float:
    """``ln(1 / temperature)``, the starting ``log_scale`` of a :class:`LogitScale` (and of
    :class:`bigbatch.jax.InfoNCE`'s temperature), after checking the temperature.

    Raises:
        ConfigError: temperature <= 0, max_scale < 1, or a learnable temperature outside
            ``[1/max_scale, 1]`` (the clamp would move it after the first step).
    """
    if not temperature > 0:
        raise ConfigError(f"temperature must be > 0, got {temperature!r}")
    if not max_scale >= 1:
        raise ConfigError(f"max_scale must be >= 1, got {max_scale!r}")
    log_scale = math.log(1.0 / temperature)
    if learnable and not -1e-12 <= log_scale <= math.log(max_scale) + 1e-12:
        raise ConfigError(
            f"a learnable temperature must lie in [1/max_scale, 1] = [{1 / max_scale:g}, 1] "
            f"(clamp_() keeps it there), got {temperature!r}; "
            + (f"raise max_scale to at least {1 / temperature:g}" if temperature < 1 else
               "give a temperature of at most 1") + " or make the temperature fixed")
    return log_scale


def hard_negative_count(num_queries: int, num_docs: int) -> int:
    """Return ``k`` for ``num_queries`` queries and ``num_queries * (1 + k)`` documents.

    Raises:
        ShapeError: when the document count is not a positive multiple of the query count.
    """
    if num_queries <= 0:
        raise ShapeError(f"expected at least one query, got {num_queries}")
    if num_docs < num_queries or num_docs % num_queries:
        raise ShapeError(
            f"got {num_docs} documents for {num_queries} queries: the document count must be "
            f"a multiple of the query count (B * (1 + k) with the layout [pos_0, neg_0_1..neg_0_k, "
            f"pos_1, ...]); check --num-hard-negatives and that every query has k negatives")
    return num_docs // num_queries - 1


def id_codes(ids: Iterable[Hashable]) -> list[int]:
    """Hashable ids (strings, numbers) as integer codes in order of first appearance, equal
    where the ids are equal."""
    codes: dict[Hashable, int] = {}
    return [codes.setdefault(x, len(codes)) for x in ids]


MAX_BLOCK_LOGITS = 2 ** 22
"""Default bound on the logits of one block (4,194,304: 16 MiB in float32)."""

STATS = ("pos_sum", "correct", "neg_sum", "neg_n", "inb_sum", "inb_n", "hard_sum", "hard_n")
"""Order of the metric sums :func:`~bigbatch.losses.blockwise.cross_entropy_sum` returns (sums and
counts over rows):
positive similarity, top-1 hits, unexcluded negatives (all, outside the row's own group of
columns, inside it: hard negatives), each as a similarity sum and a count."""


def check_blocking(block_size: int | None, dense: bool, max_block_logits: int) -> None:
    """Check a loss's block options.

    Raises:
        ConfigError: a negative or non-integer ``block_size``, ``dense=True`` together with
            a positive ``block_size``, or ``max_block_logits`` < 1.
    """
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int)
                                   or block_size < 0):
        raise ConfigError(f"block_size must be a non-negative integer or None (automatic), got "
                          f"{block_size!r}; 0 means the dense computation")
    if not isinstance(dense, bool):
        raise ConfigError(f"dense must be True or False, got {dense!r}")
    if dense and block_size:
        raise ConfigError(f"dense=True computes all rows at once; it cannot go with "
                          f"block_size={block_size} (give one or the other)")
    if isinstance(max_block_logits, bool) or not isinstance(max_block_logits, int) \
            or max_block_logits < 1:
        raise ConfigError(f"max_block_logits must be a positive integer, got {max_block_logits!r}")


def rows_per_block(n_cols: int, block_size: int | None, dense: bool = False,
                   max_block_logits: int = MAX_BLOCK_LOGITS) -> int | None:
    """Rows per block for ``n_cols`` columns; None for the dense computation.

    ``dense`` or ``block_size == 0``: dense. A positive ``block_size``: that many rows.
    ``block_size=None``: ``max(1, max_block_logits // n_cols)`` rows, so that a block holds
    at most ``max_block_logits`` logits (one row always, even when ``n_cols`` exceeds it).
    """
    if dense or block_size == 0:
        return None
    if block_size is not None:
        return block_size
    return max(1, max_block_logits // max(n_cols, 1))


DENSE_COPIES = 4
"""``B x N`` tensors alive in the dense loss's backward (similarities, logits, their
softmax, its gradient)."""


def loss_block_bytes(n_rows: int, n_cols: int, block_size: int | None, dense: bool = False,
                     max_block_logits: int = MAX_BLOCK_LOGITS, masked: bool = False,
                     element_size: int = 4) -> int:
    """Bytes one block of a streamed loss holds at its peak: ``rows_per_block x n_cols``
    logits of ``element_size`` bytes, plus one byte each for the mask of excluded columns
    when ``masked`` (``doc_ids`` or a margin); the dense loss (:func:`rows_per_block` says
    None) holds :data:`DENSE_COPIES` ``n_rows x n_cols`` tensors instead (and the mask)."""
    block = rows_per_block(n_cols, block_size, dense, max_block_logits)
    if block is None:
        return DENSE_COPIES * n_rows * n_cols * element_size + (n_rows * n_cols if masked else 0)
    return min(block, n_rows) * n_cols * (element_size + (1 if masked else 0))
