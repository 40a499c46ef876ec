"""The GradCache step for JAX across devices: ``sharded_value_and_grad``, the step of
:mod:`bigbatch.jax.step` under ``jax.shard_map`` over one axis of a device mesh.

The batch is split by rows over the axis: device ``r`` holds rows ``r*n/P : (r+1)*n/P`` of
every tower (for InfoNCE its ``B/P`` queries and their ``B/P * (1 + k)`` documents, so the
concatenation of the devices' rows is the global batch). Each device

1. embeds its own chunks (chunk ``j`` of device ``r`` is chunk ``r * chunks_per_device + j``
   of the tower: with a chunk size that divides the rows per device these are the keys of
   the one-device step, which the sharded step then equals);
2. gathers every device's embeddings with ``jax.lax.all_gather`` and differentiates its
   part of the loss with respect to its own embeddings *through* the gather (whose
   transpose, a reduce-scatter, sums every device's contribution to its rows):
   :class:`bigbatch.jax.InfoNCE` scores only this device's queries
   (``sharded_part``); any other loss is computed whole on every device and divided by the
   device count;
3. replays its chunks into a local parameter gradient, then adds the loss's own parameter
   gradient and sums over devices once (``jax.lax.psum``).

Loss inputs (``doc_ids=...``) are split by rows like the batch and gathered for the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..errors import ConfigError, ShapeError
from .rows import check_chunk_size, chunk_count, row_count
from .step import EmbedFn, LossFn, check_widths, embed_tower, replay_tower, tower_functions

__all__ = ["sharded_value_and_grad"]


def _check_rows(batch: Mapping[str, Any], loss_inputs: Mapping[str, Any], devices: int,
                axis_name: str) -> None:
    """ShapeError when a tower's (or a loss input's) rows do not split evenly."""
    for name, tree in [*batch.items(), *loss_inputs.items()]:
        rows = row_count(tree, name)
        if rows % devices:
            raise ShapeError(f"{name!r} has {rows} rows, which do not split over the "
                             f"{devices} devices of mesh axis {axis_name!r}: give a multiple "
                             f"of {devices} rows (for InfoNCE, queries and documents both)")


def sharded_value_and_grad(embed_fn: EmbedFn | Mapping[str, EmbedFn], loss_fn: LossFn,
                           chunk_size: int, mesh: Mesh,
                           axis_name: str | None = None) -> Callable[..., tuple]:
    """:func:`bigbatch.jax.cached_value_and_grad` over the devices of ``mesh``: a jitted step
    ``(params, batch, rng, **loss_inputs) -> (loss, metrics, grads)`` with the batch split by
    rows over ``axis_name``, the parameters replicated, and the loss, metrics and gradients
    those of the global batch (the same on every device).

    Args:
        embed_fn, loss_fn, chunk_size: as :func:`~bigbatch.jax.cached_value_and_grad`;
            ``chunk_size`` counts rows of one device.
        mesh: a ``jax.sharding.Mesh``.
        axis_name: the mesh axis the batch is split over (default: the mesh's only axis).

    Example::

        mesh = jax.make_mesh((jax.device_count(),), ("batch",))
        step = sharded_value_and_grad(embed, loss, chunk_size=32, mesh=mesh)
        value, metrics, grads = step(params, {"query": q, "doc": d}, rng)

    Raises (while tracing):
        ConfigError: ``axis_name`` is not an axis of ``mesh`` (or the mesh has several and
            none is named).
        ShapeError: a tower's rows are not a multiple of the device count; and the errors of
            :func:`~bigbatch.jax.cached_value_and_grad`.
    """
    chunk_size = check_chunk_size(chunk_size)
    names = tuple(mesh.axis_names)
    if axis_name is None:
        if len(names) != 1:
            raise ConfigError(f"the mesh has the axes {names}: name the one the batch is split "
                              f"over with axis_name=")
        axis_name = names[0]
    if axis_name not in names:
        raise ConfigError(f"axis_name {axis_name!r} is not an axis of the mesh {names}")
    devices = mesh.shape[axis_name]
    part_of = getattr(loss_fn, "sharded_part", None)

    def local(params: Any, batch: Mapping[str, Any], rng: jax.Array,
              loss_inputs: Mapping[str, Any]) -> tuple:
        fns = tower_functions(embed_fn, batch)
        rank = jax.lax.axis_index(axis_name)
        firsts = {t: rank * chunk_count(row_count(batch[t], t), chunk_size) for t in fns}
        reps = {t: embed_tower(f, params, batch[t], rng, i, chunk_size, t, firsts[t])
                for i, (t, f) in enumerate(fns.items())}
        check_widths(reps)
        gathered_inputs = {k: jax.tree_util.tree_map(
            lambda x: jax.lax.all_gather(x, axis_name, tiled=True), v)
            for k, v in loss_inputs.items()}

        def part(p: Any, r: Any) -> tuple:
            full = {t: jax.lax.all_gather(x, axis_name, tiled=True) for t, x in r.items()}
            if part_of is not None:
                return part_of(p, full, axis_name, **gathered_inputs)
            out = loss_fn(p, full, **gathered_inputs)
            loss, metrics = out if isinstance(out, tuple) else (out, {})
            return loss / devices, (loss, metrics)

        (_, (loss, metrics)), (grads, g_reps) = jax.value_and_grad(
            part, argnums=(0, 1), has_aux=True)(params, reps)
        for i, (t, f) in enumerate(fns.items()):
            grads = replay_tower(f, params, batch[t], rng, i, chunk_size, t, g_reps[t], grads,
                                 firsts[t])
        return loss, metrics, jax.lax.psum(grads, axis_name)

    rows = PartitionSpec(axis_name)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), rows, PartitionSpec(),
                                                       rows),
                           out_specs=PartitionSpec(), check_vma=False)
    jitted = jax.jit(mapped)

    def step(params: Any, batch: Mapping[str, Any], rng: jax.Array,
             **loss_inputs: Any) -> tuple:
        tower_functions(embed_fn, batch)
        _check_rows(batch, loss_inputs, devices, axis_name)
        split, whole = NamedSharding(mesh, rows), NamedSharding(mesh, PartitionSpec())
        return jitted(jax.device_put(params, whole), jax.device_put(dict(batch), split),
                      jax.device_put(rng, whole), jax.device_put(dict(loss_inputs), split))

    return step
