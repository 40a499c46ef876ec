"""Rows of a JAX batch and how they are cut into chunks: the one place that counts rows in a
pytree and maps or folds a function over fixed-size chunks of them.

A tower's inputs are a pytree of arrays (a dict of token ids and masks, one array...) whose
leaves share their first axis, the rows. :func:`map_chunks` and :func:`fold_chunks` run a
function over the full chunks of ``size`` rows under one ``jax.lax.map`` / ``jax.lax.scan``
(so a jitted step holds one chunk's intermediate values at a time and compiles the body
once) and over the last, shorter chunk, when the size does not divide the rows, as a second
call of the same function; nothing is padded, so no row is computed twice or thrown away.
Each call is given its chunk's index, from which the chunk's random key is derived.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ..errors import ConfigError, InputError, ShapeError

__all__ = ["row_count", "check_chunk_size", "chunk_count", "map_chunks", "fold_chunks"]


def check_chunk_size(chunk_size: Any, option: str = "chunk_size") -> int:
    """``chunk_size`` as an int.

    Raises:
        ConfigError: not a positive integer.
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"{option} must be a positive integer (rows per chunk), got "
                          f"{chunk_size!r}")
    return chunk_size


def row_count(tree: Any, name: str) -> int:
    """The rows of ``tree``: the first axis, shared by every leaf.

    Raises:
        InputError: ``tree`` holds no array.
        ShapeError: a leaf without a first axis, or leaves with different row counts
            (``name`` is the tower, named in the message).
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if not leaves:
        raise InputError(f"the inputs of {name!r} hold no array")
    counts = {}
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        where = f"{name}{jax.tree_util.keystr(path)}"
        if not shape:
            raise ShapeError(f"{where} is a scalar; every input array needs a first axis of rows")
        counts[where] = shape[0]
    if len(set(counts.values())) != 1:
        raise ShapeError(f"the inputs of {name!r} disagree on the number of rows: "
                         + ", ".join(f"{k} has {v}" for k, v in counts.items()))
    return next(iter(counts.values()))


def chunk_count(rows: int, size: int) -> int:
    """Chunks of ``size`` rows that ``rows`` rows make (the last one may be shorter)."""
    return -(-rows // size)


def _split(tree: Any, rows: int, size: int) -> tuple[Any, Any, int]:
    """(the full chunks stacked ``(chunks, size, ...)``, the remainder rows, chunks)."""
    full = rows // size
    head = jax.tree_util.tree_map(
        lambda x: x[:full * size].reshape(full, size, *x.shape[1:]), tree) if full else None
    tail = jax.tree_util.tree_map(lambda x: x[full * size:], tree) if rows % size else None
    return head, tail, full


def map_chunks(fn: Callable[[Any, Any], Any], tree: Any, rows: int, size: int,
               first_index: Any = 0) -> Any:
    """``fn(chunk, index)`` over the chunks of ``tree``, its outputs (pytrees of arrays with a
    first axis of the chunk's rows) concatenated back into ``rows`` rows. Chunk ``j`` has
    index ``first_index + j``."""
    head, tail, full = _split(tree, rows, size)
    parts = []
    if full:
        out = jax.lax.map(lambda a: fn(a[0], a[1]),
                          (head, first_index + jnp.arange(full)))
        parts.append(jax.tree_util.tree_map(lambda y: y.reshape(full * size, *y.shape[2:]), out))
    if tail is not None:
        parts.append(fn(tail, first_index + full))
    if len(parts) == 1:
        return parts[0]
    return jax.tree_util.tree_map(lambda *ys: jnp.concatenate(ys), *parts)


def fold_chunks(fn: Callable[[Any, Any, Any], Any], init: Any, tree: Any, rows: int, size: int,
                first_index: Any = 0) -> Any:
    """``carry = fn(carry, chunk, index)`` over the chunks of ``tree`` in order, from ``init``;
    returns the last carry. Chunk ``j`` has index ``first_index + j``."""
    head, tail, full = _split(tree, rows, size)
    carry = init
    if full:
        carry, _ = jax.lax.scan(lambda c, a: (fn(c, a[0], a[1]), None), carry,
                                (head, first_index + jnp.arange(full)))
    if tail is not None:
        carry = fn(carry, tail, first_index + full)
    return carry
