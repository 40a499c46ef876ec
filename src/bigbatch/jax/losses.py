"""InfoNCE in JAX, with the semantics of :class:`bigbatch.InfoNCE` (``bigbatch.losses.infonce``):
the same layout, temperature, symmetric direction, id and margin masking, metrics and
block rule, written for ``jax.numpy`` and usable as the ``loss_fn`` of
:func:`bigbatch.jax.cached_value_and_grad`.

Layout: ``B`` queries and ``B * (1 + k)`` documents ``[pos_0, neg_0_1..neg_0_k, pos_1, ...]``;
query ``i``'s positive is document ``i * (1 + k)``, every other document is a negative::

    loss = mean_i ( logsumexp_{j not masked}(t q_i.d_j) - t q_i.d_{p(i)} ),  t = exp(log_scale)

Streamed (the default): the rows are scored in blocks of ``rows_per_block`` rows (the rule
of :mod:`bigbatch.losses.blockwise`) under ``jax.lax.scan``, each block under ``jax.checkpoint``, so
its ``block x N`` logits are recomputed in the backward pass instead of stored: peak memory
is one block's logits, not ``B x N``. ``dense=True`` (or ``block_size=0``) scores all rows
at once.

The temperature is a parameter of the step: ``params["log_scale"]`` (the name is an option),
``1/temperature = exp(log_scale)``. ``init_params()`` gives its starting value; call
``clamp(params)`` after each optimizer update to keep it in ``[0, ln(max_scale)]`` (a clamp
inside the loss would give zero gradient at the bound).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, InputError, ShapeError
from ..losses.layout import (
    MAX_BLOCK_LOGITS,
    STATS,
    check_blocking,
    hard_negative_count,
    initial_log_scale,
    rows_per_block,
)
from ..losses.layout import id_codes as _codes
from .rows import fold_chunks

__all__ = ["InfoNCE", "cross_entropy_sum", "id_codes"]


def id_codes(ids: Any, n: int, name: str = "doc_ids") -> jax.Array:
    """Document ids as an integer array of ``n`` entries, equal where the ids are equal: an
    array is taken as it is; a list of hashables (strings) is coded in order (outside a
    traced function: the strings are Python values).

    Raises:
        ShapeError: not ``n`` entries.
    """
    if isinstance(ids, (jax.Array, np.ndarray)):
        out = jnp.reshape(ids, (-1,))
        if out.shape[0] != n:
            raise ShapeError(f"{name} has {out.shape[0]} entries but there are {n} documents; "
                             f"give one id per document")
        return out
    codes = _codes(ids)
    if len(codes) != n:
        raise ShapeError(f"{name} has {len(codes)} entries but there are {n} documents; "
                         f"give one id per document")
    return jnp.asarray(np.asarray(codes, dtype=np.int64))


def _block_sums(rows: jax.Array, cols: jax.Array, pos: jax.Array, row_ids: jax.Array | None,
                col_ids: jax.Array | None, scale: jax.Array, group: int, margin: float | None,
                with_stats: bool) -> tuple[jax.Array, jax.Array]:
    """One block's loss sum and its :data:`~bigbatch.losses.layout.STATS` sums (no gradient)."""
    acc = jnp.promote_types(rows.dtype, jnp.float32)
    sim = rows @ cols.T
    b, n = sim.shape
    col = jnp.arange(n)[None, :]
    is_pos = col == pos[:, None]
    pos_sim = jnp.take_along_axis(sim, pos[:, None], axis=1)[:, 0]
    mask = None
    if col_ids is not None:
        mask = col_ids[None, :] == row_ids[:, None]
    if margin is not None:
        s = jax.lax.stop_gradient(sim)
        over = s > (jax.lax.stop_gradient(pos_sim) + margin)[:, None]
        mask = over if mask is None else mask | over
    logits = sim * scale
    if mask is not None:
        mask = mask & ~is_pos
        logits = jnp.where(mask, -jnp.inf, logits)
    loss_sum = jnp.sum(jax.nn.logsumexp(logits, axis=1) - pos_sim * scale)
    if not with_stats:
        return loss_sum, jnp.zeros(len(STATS), acc)
    s = jax.lax.stop_gradient(sim).astype(acc)
    keep = ~is_pos if mask is None else ~(is_pos | mask)
    own = (col >= pos[:, None]) & (col < pos[:, None] + group)
    inb, hard = keep & ~own, keep & own
    stats = jnp.stack([
        jnp.sum(jax.lax.stop_gradient(pos_sim).astype(acc)),
        jnp.sum(jnp.argmax(jax.lax.stop_gradient(logits), axis=1) == pos).astype(acc),
        jnp.sum(jnp.where(keep, s, 0)), jnp.sum(keep).astype(acc),
        jnp.sum(jnp.where(inb, s, 0)), jnp.sum(inb).astype(acc),
        jnp.sum(jnp.where(hard, s, 0)), jnp.sum(hard).astype(acc)])
    return loss_sum, stats


def cross_entropy_sum(rows: jax.Array, cols: jax.Array, pos: jax.Array, scale: jax.Array, *,
                      block: int | None, group: int = 1, col_ids: jax.Array | None = None,
                      row_ids: jax.Array | None = None, margin: float | None = None,
                      with_stats: bool = True) -> tuple[jax.Array, jax.Array]:
    """Sum over rows of the cross-entropy of ``scale * rows @ cols.T`` with positives ``pos``
    (as :func:`bigbatch.losses.blockwise.cross_entropy_sum`): ``(loss_sum, STATS sums)``.

    ``block`` rows at a time under ``jax.lax.scan`` and ``jax.checkpoint`` (the last block may
    be shorter), or all at once when ``block`` is None. A column with its row's id
    (``col_ids``, ``row_ids``) or more similar than the row's positive plus ``margin`` is left
    out of the row's negatives.
    """
    def sums(r: jax.Array, p: jax.Array, ri: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        return _block_sums(r, cols, p, ri, col_ids, scale, group, margin, with_stats)

    if block is None or block >= rows.shape[0]:
        return sums(rows, pos, row_ids)
    per_block = jax.checkpoint(lambda r, p, ri: sums(r, p, ri))

    def add(carry: tuple, blk: tuple, _index: Any) -> tuple:
        loss, stats = per_block(blk[0], blk[1], blk[2] if len(blk) > 2 else None)
        return carry[0] + loss, carry[1] + stats

    acc = jnp.promote_types(rows.dtype, jnp.float32)
    init = (jnp.zeros((), jnp.result_type(rows.dtype, cols.dtype, scale.dtype)),
            jnp.zeros(len(STATS), acc))
    tree = (rows, pos) if row_ids is None else (rows, pos, row_ids)
    return fold_chunks(add, init, tree, rows.shape[0], block)


class InfoNCE:
    """InfoNCE with in-batch and hard negatives, for :func:`bigbatch.jax.cached_value_and_grad`.

    Args (as :class:`bigbatch.InfoNCE`):
        temperature: initial (or fixed) temperature; the logit scale is ``1/temperature``.
        learnable_temperature: the temperature is ``params[param]`` (a log scale, trained
            with the model; :meth:`init_params` gives its start); if False it is fixed.
        symmetric: also score each positive document against all queries and average the
            two directions.
        max_scale: :meth:`clamp` keeps the log scale in ``[0, ln(max_scale)]``.
        false_negative_margin: mask a negative more similar than the positive plus this.
        block_size, dense, max_block_logits: rows per streamed block (None: at most
            ``max_block_logits`` logits per block; 0 or ``dense=True``: all at once).
        param: the key of the log scale in ``params``.

    Inputs (``loss(params, reps, doc_ids=None)``):
        params: a dict holding ``params[param]`` when the temperature is learnable.
        reps: ``{"query": (B, D), "doc": (B * (1 + k), D)}``.
        doc_ids: optional, one id per document (an integer array; or hashables outside
            ``jit``): a document with the id of a query's positive is masked out of that
            query's negatives.

    Returns:
        ``(loss, metrics)``; the metrics of :class:`bigbatch.InfoNCE` (``pos_sim``,
        ``neg_sim``, ``inbatch_neg_sim``, ``hard_neg_sim`` when k > 0, ``margin``,
        ``accuracy``, ``temperature``, ``masked``), without gradient.

    Example::

        loss = InfoNCE(temperature=0.05)
        params = {"model": model_params, **loss.init_params()}
        value, metrics = loss(params, {"query": q, "doc": d})
        params = loss.clamp(optax.apply_updates(params, updates))

    References:
        van den Oord et al. 2018 (InfoNCE); Radford et al. 2021 (CLIP: learnable
        temperature, symmetric loss).
    """

    def __init__(self, temperature: float = 0.07, learnable_temperature: bool = True,
                 symmetric: bool = False, max_scale: float = 100.0,
                 false_negative_margin: float | None = None, block_size: int | None = None,
                 dense: bool = False, max_block_logits: int = MAX_BLOCK_LOGITS,
                 param: str = "log_scale") -> None:
        check_blocking(block_size, dense, max_block_logits)
        if false_negative_margin is not None and not math.isfinite(false_negative_margin):
            raise ConfigError(f"false_negative_margin must be a finite number, got "
                              f"{false_negative_margin!r}")
        self.log_scale = initial_log_scale(temperature, max_scale, learnable_temperature)
        self.learnable = learnable_temperature
        self.max_scale = float(max_scale)
        self.symmetric = symmetric
        self.margin = false_negative_margin
        self.block_size, self.dense, self.max_block_logits = block_size, dense, max_block_logits
        self.param = param

    def init_params(self, dtype: Any = jnp.float32) -> dict[str, jax.Array]:
        """``{param: ln(1/temperature)}`` to merge into the step's params; empty when the
        temperature is fixed."""
        return {self.param: jnp.asarray(self.log_scale, dtype)} if self.learnable else {}

    def clamp(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with the log scale clipped into ``[0, ln(max_scale)]``; call after each
        optimizer update. A fixed temperature: ``params`` unchanged."""
        if not self.learnable:
            return dict(params)
        return {**params, self.param: jnp.clip(params[self.param], 0.0,
                                               math.log(self.max_scale))}

    def scale(self, params: Mapping[str, Any]) -> jax.Array:
        """The logit scale ``1/temperature``."""
        if not self.learnable:
            return jnp.exp(jnp.asarray(self.log_scale))
        if not isinstance(params, Mapping) or self.param not in params:
            raise InputError(f"the temperature is learnable, so params must hold "
                             f"params[{self.param!r}] (merge loss.init_params() into them)")
        return jnp.exp(params[self.param])

    def _direction(self, rows: jax.Array, cols: jax.Array, pos: jax.Array, scale: jax.Array,
                   group: int, col_ids: jax.Array | None, row_ids: jax.Array | None,
                   with_stats: bool) -> tuple[jax.Array, jax.Array]:
        block = rows_per_block(cols.shape[0], self.block_size, self.dense,
                               self.max_block_logits)
        return cross_entropy_sum(rows, cols, pos, scale, block=block, group=group,
                                 col_ids=col_ids, row_ids=row_ids, margin=self.margin,
                                 with_stats=with_stats)

    def sums(self, params: Mapping[str, Any], q_all: jax.Array, d_all: jax.Array,
             q_lo: Any, b_local: int, d_lo: Any, k: int,
             ids: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries ``q_lo:q_lo+b_local`` against every document (and, if symmetric, their
        positives against every query): ``(loss sum, STATS sums, scale)``. The offsets may be
        traced (a device's part of a sharded batch)."""
        group = k + 1
        dtype = jnp.promote_types(jnp.promote_types(q_all.dtype, d_all.dtype), jnp.float32)
        q_all, d_all = q_all.astype(dtype), d_all.astype(dtype)
        scale = self.scale(params).astype(dtype)
        pos = d_lo + jnp.arange(b_local) * group
        row_ids = None if ids is None else ids[pos]
        rows = jax.lax.dynamic_slice_in_dim(q_all, q_lo, b_local)
        loss_sum, st = self._direction(rows, d_all, pos, scale, group, ids, row_ids, True)
        if self.symmetric:
            back_pos = q_lo + jnp.arange(b_local)
            col_ids = None if ids is None else ids[jnp.arange(q_all.shape[0]) * group]
            back, _ = self._direction(d_all[pos], q_all, back_pos, scale, 1, col_ids, row_ids,
                                      False)
            loss_sum = 0.5 * (loss_sum + back)
        return loss_sum, st, scale

    @staticmethod
    def metrics(st: jax.Array, scale: jax.Array, b: int, n: int, k: int) -> dict[str, jax.Array]:
        """The metrics from the STATS sums of ``b`` queries and ``n`` documents."""
        stats = dict(zip(STATS, st))
        pos_sim = stats["pos_sum"] / b
        neg_sim = stats["neg_sum"] / jnp.maximum(stats["neg_n"], 1)
        out = {"pos_sim": pos_sim, "neg_sim": neg_sim,
               "inbatch_neg_sim": stats["inb_sum"] / jnp.maximum(stats["inb_n"], 1),
               "margin": pos_sim - neg_sim, "accuracy": stats["correct"] / b,
               "temperature": 1.0 / scale, "masked": b * (n - 1) - stats["neg_n"]}
        if k > 0:
            out["hard_neg_sim"] = stats["hard_sum"] / jnp.maximum(stats["hard_n"], 1)
        return {key: jax.lax.stop_gradient(v) for key, v in out.items()}

    @staticmethod
    def check(reps: Mapping[str, jax.Array]) -> tuple[jax.Array, jax.Array, int]:
        """``(query, doc, k)`` from ``reps``.

        Raises:
            InputError: ``reps`` lacks ``query`` or ``doc``.
            ShapeError: not 2-D, different widths, or not ``B * (1 + k)`` documents.
        """
        missing = [t for t in ("query", "doc") if t not in reps]
        if missing:
            raise InputError(f"InfoNCE needs the towers 'query' and 'doc'; missing {missing} "
                             f"(got {sorted(reps)})")
        q, d = reps["query"], reps["doc"]
        for name, t in (("query", q), ("doc", d)):
            if t.ndim != 2:
                raise ShapeError(f"InfoNCE input {name!r} must be 2-D (rows, dim), got shape "
                                 f"{tuple(t.shape)}")
        if q.shape[1] != d.shape[1]:
            raise ShapeError(f"query dim {q.shape[1]} != doc dim {d.shape[1]}: the two towers "
                             f"must embed into the same space")
        return q, d, hard_negative_count(q.shape[0], d.shape[0])

    def __call__(self, params: Mapping[str, Any], reps: Mapping[str, jax.Array],
                 doc_ids: Any = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        q, d, k = self.check(reps)
        b, n = q.shape[0], d.shape[0]
        ids = None if doc_ids is None else id_codes(doc_ids, n)
        loss_sum, st, scale = self.sums(params, q, d, 0, b, 0, k, ids)
        return loss_sum / b, self.metrics(st, scale, b, n, k)

    def sharded_part(self, params: Mapping[str, Any], reps: Mapping[str, jax.Array],
                     axis_name: str, doc_ids: Any = None) -> tuple[jax.Array, tuple]:
        """Inside ``shard_map``: this device's part of the global loss, for
        :func:`bigbatch.jax.sharded_value_and_grad`. ``reps`` (and ``doc_ids``) are the
        gathered global batch, laid out device after device; this device scores its own
        queries against every document and divides by the global query count, so the parts
        sum to the global loss. Returns ``(part, (loss, metrics))``, the loss and metrics
        summed over devices (the same on every device)."""
        q, d, k = self.check(reps)
        devices = jax.lax.axis_size(axis_name)
        b, n = q.shape[0], d.shape[0]
        b_local, n_local = b // devices, n // devices
        rank = jax.lax.axis_index(axis_name)
        ids = None if doc_ids is None else id_codes(doc_ids, n)
        loss_sum, st, scale = self.sums(params, q, d, rank * b_local, b_local, rank * n_local,
                                        k, ids)
        part = loss_sum / b
        total, st = jax.lax.psum((jax.lax.stop_gradient(part), st), axis_name)
        return part, (total, self.metrics(st, scale, b, n, k))
