"""The GradCache step for JAX on one device: ``cached_value_and_grad``.

A step of a contrastive batch too large to backpropagate at once, exact by the chain rule
(Gao et al. 2021), as three stages that jit into one program:

1. **Embed** every chunk of every tower without keeping its activations
   (:func:`bigbatch.jax.rows.map_chunks`, a ``jax.lax.map``): the embeddings of the whole
   batch, which are small.
2. **Loss**: ``jax.value_and_grad`` of the loss with respect to those embeddings (and the
   parameters the loss itself has, such as a learnable temperature): the loss, its metrics
   and ``dL/d(embedding)`` for every row.
3. **Replay** every chunk under ``jax.vjp`` with its rows of ``dL/d(embedding)``
   (:func:`bigbatch.jax.rows.fold_chunks`, a ``jax.lax.scan`` whose carry is the
   parameter gradient): the sum over chunks is the full-batch gradient.

The chunks of a tower are embedded with the same random keys in (1) and (3): tower ``t``
(its position among the towers' names in sorted order, ``doc`` before ``query``) and chunk
``i`` use ``jax.random.fold_in(jax.random.fold_in(rng, t), i)`` (:func:`chunk_key`), so the
replay's dropout equals the first pass's by construction. :func:`embed_batch` embeds a
batch with the very same keys in one differentiable pass: ``jax.value_and_grad`` of the loss
on its output is the reference the cached step equals.

Peak memory is one chunk's activations plus the batch's embeddings and the loss's own
(bounded by the streamed :class:`bigbatch.jax.InfoNCE`), not the batch's activations; the
compiled program's ``memory_analysis()`` shows it (``bench/jax_memory.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from ..errors import InputError, ShapeError
from .rows import check_chunk_size, fold_chunks, map_chunks, row_count

__all__ = ["EmbedFn", "LossFn", "cached_value_and_grad", "embed_batch", "chunk_key",
           "tower_functions", "embed_tower", "replay_tower", "loss_value_and_grad",
           "check_widths"]

EmbedFn = Callable[[Any, Any, jax.Array], jax.Array]
"""``embed_fn(params, chunk, rng) -> (rows, dim)``: pure; ``chunk`` is the tower's inputs
for some rows (a pytree whose leaves share their first axis), ``rng`` the chunk's key."""

LossFn = Callable[..., Any]
"""``loss_fn(params, reps, **loss_inputs) -> loss`` or ``(loss, metrics)``, where ``reps``
maps each tower's name to its ``(rows, dim)`` embeddings (for example
:class:`bigbatch.jax.InfoNCE`)."""


def chunk_key(rng: jax.Array, tower_index: int, chunk_index: Any) -> jax.Array:
    """The random key of chunk ``chunk_index`` of the tower at ``tower_index`` (its position
    among the towers' names, sorted)."""
    return jax.random.fold_in(jax.random.fold_in(rng, tower_index), chunk_index)


def tower_functions(embed_fn: EmbedFn | Mapping[str, EmbedFn],
                    batch: Mapping[str, Any]) -> dict[str, EmbedFn]:
    """``{tower: embed function}`` in sorted order of the names: ``embed_fn`` for every key of
    ``batch`` when it is one function, else the mapping's towers (which ``batch`` must hold).

    Raises:
        InputError: ``batch`` is not a mapping, is empty, or lacks a tower ``embed_fn``
            names.
    """
    if not isinstance(batch, Mapping) or not batch:
        raise InputError(f"the batch must be a dict of towers, for example {{'query': ..., "
                         f"'doc': ...}}, got {type(batch).__name__}")
    if isinstance(embed_fn, Mapping):
        missing = sorted(set(embed_fn) - set(batch))
        if missing:
            raise InputError(f"the batch has no inputs for the tower(s) {missing}; it holds "
                             f"{sorted(batch)}")
        names = sorted(embed_fn)
        return {t: embed_fn[t] for t in names}
    if not callable(embed_fn):
        raise InputError(f"embed_fn must be a function or a dict of functions per tower, got "
                         f"{type(embed_fn).__name__}")
    return {t: embed_fn for t in sorted(batch)}


def _checked(fn: EmbedFn, name: str) -> Callable[[Any, Any, jax.Array], jax.Array]:
    """``fn`` with its output checked against its chunk: ``(rows, dim)`` (at trace time)."""
    def embed(params: Any, chunk: Any, key: jax.Array) -> jax.Array:
        out = fn(params, chunk, key)
        rows = row_count(chunk, name)
        if not hasattr(out, "shape") or out.ndim != 2 or out.shape[0] != rows:
            raise ShapeError(f"the embed function of {name!r} must return ({rows}, dim) for a "
                             f"chunk of {rows} rows, got shape "
                             f"{getattr(out, 'shape', type(out).__name__)}")
        return out
    return embed


def embed_tower(fn: EmbedFn, params: Any, inputs: Any, rng: jax.Array, tower_index: int,
                chunk_size: int, name: str, first_chunk: Any = 0) -> jax.Array:
    """Stage 1 for one tower: its ``(rows, dim)`` embeddings, chunk by chunk under
    ``jax.lax.map``, without gradient (chunks numbered from ``first_chunk``)."""
    rows = row_count(inputs, name)
    embed = _checked(fn, name)
    out = map_chunks(lambda chunk, i: embed(params, chunk, chunk_key(rng, tower_index, i)),
                     inputs, rows, chunk_size, first_chunk)
    return jax.lax.stop_gradient(out)


def replay_tower(fn: EmbedFn, params: Any, inputs: Any, rng: jax.Array, tower_index: int,
                 chunk_size: int, name: str, cotangent: jax.Array, grads: Any,
                 first_chunk: Any = 0) -> Any:
    """Stage 3 for one tower: ``grads`` plus ``d(sum(cotangent * embeddings))/d(params)``,
    each chunk re-embedded under ``jax.vjp`` with the key of stage 1 (``jax.lax.scan``)."""
    rows = row_count(inputs, name)

    def step(acc: Any, chunk: tuple[Any, jax.Array], i: Any) -> Any:
        x, g = chunk
        out, vjp = jax.vjp(lambda p: fn(p, x, chunk_key(rng, tower_index, i)), params)
        (gp,) = vjp(g.astype(out.dtype))
        return jax.tree_util.tree_map(jnp.add, acc, gp)

    return fold_chunks(step, grads, (inputs, cotangent), rows, chunk_size, first_chunk)


def check_widths(reps: Mapping[str, jax.Array]) -> None:
    """Raises ShapeError when the towers embed into different widths."""
    widths = {t: r.shape[1] for t, r in reps.items()}
    if len(set(widths.values())) > 1:
        raise ShapeError(f"the towers embed into different widths ({widths}): they must embed "
                         f"into the same space")


def loss_value_and_grad(loss_fn: LossFn, params: Any, reps: Mapping[str, jax.Array],
                        loss_inputs: Mapping[str, Any]) -> tuple[Any, dict, Any, Any]:
    """Stage 2: ``(loss, metrics, dL/d(params), dL/d(reps))``; a loss returning a scalar has
    no metrics."""
    def value(p: Any, r: Any) -> tuple[jax.Array, dict]:
        out = loss_fn(p, r, **loss_inputs)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if jnp.shape(loss) != ():
            raise ShapeError(f"the loss function must return a scalar loss (or (loss, "
                             f"metrics)), got shape {jnp.shape(loss)}")
        return loss, metrics

    (loss, metrics), (g_params, g_reps) = jax.value_and_grad(value, argnums=(0, 1),
                                                             has_aux=True)(params, dict(reps))
    return loss, metrics, g_params, g_reps


def cached_value_and_grad(embed_fn: EmbedFn | Mapping[str, EmbedFn], loss_fn: LossFn,
                          chunk_size: int) -> Callable[..., tuple[jax.Array, dict, Any]]:
    """GradCache for JAX: a step ``(params, batch, rng, **loss_inputs) -> (loss, metrics,
    grads)`` that equals ``jax.value_and_grad`` of the loss on the whole batch, with the
    memory of ``chunk_size`` rows of activations.

    Args:
        embed_fn: ``embed_fn(params, chunk, rng) -> (rows, dim)``, pure (dropout from
            ``rng``); or a dict of such functions per tower (``{"query": f, "doc": g}``:
            the towers may differ and share parameters).
        loss_fn: ``loss_fn(params, reps, **loss_inputs)`` returning the scalar loss or
            ``(loss, metrics)``; ``reps`` maps each tower to its embeddings. It may use
            ``params`` itself (a learnable temperature), e.g. :class:`bigbatch.jax.InfoNCE`.
        chunk_size: rows embedded at once; any positive size (the last chunk of a tower may
            be shorter; one larger than the batch embeds it whole).

    Inputs of the step:
        params: the parameters (any pytree); ``grads`` has the same structure.
        batch: ``{tower: inputs}``, each a pytree of arrays with a first axis of rows; with
            one ``embed_fn`` every key is a tower.
        rng: a ``jax.random`` key; chunk ``i`` of tower ``t`` uses :func:`chunk_key`.
        loss_inputs: keyword arguments passed on to ``loss_fn`` (``doc_ids=...``).

    Example::

        loss = bigbatch.jax.InfoNCE(temperature=0.05)
        params = {"model": model_params, **loss.init_params()}
        step = jax.jit(cached_value_and_grad(embed, loss, chunk_size=32))
        value, metrics, grads = step(params, {"query": q, "doc": d}, rng)

    Raises (while tracing, before any gradient):
        ConfigError: ``chunk_size`` is not a positive integer.
        InputError: a tower of ``embed_fn`` missing from the batch.
        ShapeError: a tower's arrays disagree on rows, an embedding is not ``(rows, dim)``,
            or the towers' widths differ.

    References:
        Gao, Zhang, Han, Callan 2021, "Scaling Deep Contrastive Learning Batch Size under
        Memory Limited Setup" (and its JAX implementation in luyug/GradCache).
    """
    chunk_size = check_chunk_size(chunk_size)

    def step(params: Any, batch: Mapping[str, Any], rng: jax.Array,
             **loss_inputs: Any) -> tuple[jax.Array, dict, Any]:
        fns = tower_functions(embed_fn, batch)
        reps = {t: embed_tower(f, params, batch[t], rng, i, chunk_size, t)
                for i, (t, f) in enumerate(fns.items())}
        check_widths(reps)
        loss, metrics, grads, g_reps = loss_value_and_grad(loss_fn, params, reps, loss_inputs)
        for i, (t, f) in enumerate(fns.items()):
            grads = replay_tower(f, params, batch[t], rng, i, chunk_size, t, g_reps[t], grads)
        return loss, metrics, grads

    return step


def embed_batch(embed_fn: EmbedFn | Mapping[str, EmbedFn], params: Any,
                batch: Mapping[str, Any], rng: jax.Array, chunk_size: int) -> dict[str, jax.Array]:
    """Every tower's embeddings in one differentiable pass (a Python loop over the chunks),
    with the random keys of :func:`cached_value_and_grad`'s step: ``jax.value_and_grad`` of
    the loss on them is the unchunked reference the cached step equals (it keeps every
    chunk's activations for the backward pass).

    Example::

        def reference(params):
            return loss(params, embed_batch(embed, params, batch, rng, 32))
        value, grads = jax.value_and_grad(reference, has_aux=True)(params)
    """
    chunk_size = check_chunk_size(chunk_size)
    fns = tower_functions(embed_fn, batch)
    reps = {}
    for i, (t, f) in enumerate(fns.items()):
        rows = row_count(batch[t], t)
        parts = []
        for c, lo in enumerate(range(0, rows, chunk_size)):
            chunk = jax.tree_util.tree_map(lambda x: x[lo:lo + chunk_size], batch[t])
            parts.append(_checked(f, t)(params, chunk, chunk_key(rng, i, c)))
        reps[t] = jnp.concatenate(parts)
    check_widths(reps)
    return reps
