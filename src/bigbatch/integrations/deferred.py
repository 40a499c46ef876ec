"""A GradCache step as a loss tensor, for training loops that call ``loss.backward()``.

Loops such as ``transformers.Trainer``, ``SentenceTransformerTrainer`` and an ``accelerate``
loop own the backward call: they divide the loss by the gradient-accumulation steps, scale it
for float16 and call ``backward`` themselves. :func:`gradcache_loss` runs the whole
:meth:`bigbatch.GradCache.step` at once (all three stages, so no chunk's activations outlive
the call) and returns the full-batch loss as a leaf whose backward

1. multiplies the step's parameter gradients by the gradient it receives (the loop's
   ``1 / accumulation_steps`` and loss scale), adding them to the gradients of earlier
   micro-batches, which were set aside during the step;
2. under ``torch.distributed``, sums every gradient over the ranks in one coalesced
   all-reduce (:func:`bigbatch.engine.distributed.all_reduce_gradients`), unless the loop deferred
   synchronisation (a DDP ``no_sync()`` block, as gradient accumulation uses): then it
   happens on the micro-batch that synchronises, over the accumulated gradients.

So a step costs one gradient all-reduce however many chunks it has; DDP itself never
synchronises (the engine calls the towers through the module inside the DDP wrapper).

:func:`evaluation_loss` is the loss of a batch without gradients, embedded chunk by chunk
(the loops call their loss under ``torch.no_grad()`` to evaluate).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..engine import chunking
from ..engine import distributed as D
from ..engine import embeddings as E
from ..engine.gradcache import GradCache
from ..engine.loss_contract import scalar_loss
from ..errors import ConfigError

__all__ = ["gradcache_loss", "evaluation_loss", "trainable_params", "wants_sync",
           "check_wrappers"]

#: module prefixes of the training engines whose models the integrations refuse, with why
UNSUPPORTED_WRAPPERS = {
    "deepspeed": "DeepSpeed reduces and partitions gradients in its own engine.backward(), "
                 "which the cached step does not go through",
}


def check_wrappers(cache: GradCache) -> None:
    """Refuse a tower wrapped by a training engine the integrations do not support.

    Raises:
        ConfigError: a DeepSpeed engine, naming the tower and what to use instead."""
    for name, tower in cache.towers.items():
        modules = [cls.__module__ for cls in type(tower).__mro__]  # a subclass counts too
        for prefix, why in UNSUPPORTED_WRAPPERS.items():
            module = next((m for m in modules if m == prefix or m.startswith(prefix + ".")), None)
            if module is not None:
                raise ConfigError(
                    f"tower {name!r} is a {type(tower).__name__} ({module}): the bigbatch "
                    f"integrations run on one process or under DDP, not under {prefix} ({why}); "
                    f"train without the {prefix} config (DDP is the trainer's default), or run "
                    f"the step through bigbatch.integrations.deepspeed (deepspeed_cache and "
                    f"deepspeed_step: one reduction per step) or `bigbatch train --deepspeed`")


def trainable_params(cache: GradCache, params: Iterable[nn.Parameter] | None = None
                     ) -> list[nn.Parameter]:
    """The parameters a step of ``cache`` writes gradients to: ``params`` if given, else the
    towers' (inside any DDP wrapper) and the loss's, each once, those that require grad.

    Raises:
        ConfigError: a tower is a plain function and ``params`` is not given."""
    if params is None:
        found: list[nn.Parameter] = []
        for name, tower in cache.towers.items():
            inner = D.unwrap_ddp(tower)
            if not isinstance(inner, nn.Module):
                raise ConfigError(f"tower {name!r} is a plain function, so its parameters cannot "
                                  f"be found; pass params=model.parameters()")
            found.extend(inner.parameters())
        if isinstance(cache.loss_fn, nn.Module):
            found.extend(cache.loss_fn.parameters())
        params = found
    unique: dict[int, nn.Parameter] = {}
    for p in params:
        if p.requires_grad:
            unique.setdefault(id(p), p)
    return list(unique.values())


def wants_sync(cache: GradCache) -> bool:
    """False inside a DDP ``no_sync()`` block of any tower (a loop accumulating gradients over
    micro-batches), else True."""
    return all(getattr(t, "require_backward_grad_sync", True) for t in cache.towers.values())


def gradcache_loss(cache: GradCache, *, params: Iterable[nn.Parameter] | None = None,
                   sync: bool | None = None, **inputs: Any) -> Tensor:
    """Run one exact GradCache step now; return its loss for the loop's ``backward()``.

    Args:
        cache: the engine; its ``sync_gradients`` is honoured (False: no all-reduce here,
            the caller synchronises).
        params: the parameters the step trains (default: the towers' and the loss's).
        sync: synchronise over ranks in the backward (default: unless inside a DDP
            ``no_sync()`` block, see :func:`wants_sync`).

    Inputs:
        inputs: ``cache.step``'s keyword arguments: each tower's inputs and the loss's extras.

    Returns:
        the detached full-batch loss as a leaf that requires grad; call ``backward()`` on it
        (or on any function of it, e.g. divided by the accumulation steps) exactly once.
        Until then the step's gradients sit unscaled in ``.grad``.

    Example::

        loss = gradcache_loss(cache, query=q, doc=d)
        accelerator.backward(loss)
        optimizer.step(); optimizer.zero_grad(); loss_fn.clamp_()

    Raises:
        ConfigError: a tower wrapped by DeepSpeed (:func:`check_wrappers`).
        BigBatchError: what :meth:`bigbatch.GradCache.step` raises; the gradients of
            earlier micro-batches are then put back as they were.
    """
    check_wrappers(cache)
    plist = trainable_params(cache, params)
    sync = (wants_sync(cache) if sync is None else sync) and cache.sync_gradients
    earlier = [p.grad for p in plist]
    for p in plist:
        p.grad = None
    engine_sync, cache.sync_gradients = cache.sync_gradients, False
    try:
        result = cache.step(**inputs)
    except BaseException:
        for p, g in zip(plist, earlier):
            p.grad = g
        raise
    finally:
        cache.sync_gradients = engine_sync
    loss = result.loss.detach().clone().requires_grad_(True)
    loss.register_hook(partial(_finish, plist, earlier, sync, cache.process_group))
    return loss


def _finish(params: list[nn.Parameter], earlier: list[Tensor | None], sync: bool, group: Any,
            grad: Tensor) -> None:
    """The backward of :func:`gradcache_loss`'s loss: scale, accumulate, synchronise."""
    for p, old in zip(params, earlier):
        new = p.grad
        if new is not None:
            new.mul_(grad.to(device=new.device))
        if old is not None:
            p.grad = old if new is None else old.add_(new)
    if sync and D.is_distributed(group):
        D.all_reduce_gradients(params, group)


def evaluation_loss(cache: GradCache, **inputs: Any) -> Tensor:
    """The loss of ``cache``'s loss on one batch, without gradients: each tower embedded chunk
    by chunk (as the step would), on this process only (no cross-device negatives).

    Inputs:
        inputs: as for ``cache.step``.

    Returns:
        the detached scalar loss."""
    loss_kwargs = {k: v for k, v in inputs.items() if k not in cache.towers}
    token_inputs = frozenset(getattr(cache.loss_fn, "token_inputs", ()))
    reps = {}
    with torch.no_grad():
        for name in cache.towers:
            chunks, rows = chunking.checked_split(
                name, *cache.split_inputs(name, inputs[name], cache.chunk_sizes[name]))
            writer = E.CacheWriter(name, rows, None, False)
            for c, planned in enumerate(chunks):
                chunk = chunking.to_device(chunking.materialize(planned), cache.device)
                device = cache.device or chunking.first_device(chunk) or torch.device("cpu")
                autocast = (torch.autocast(device_type=device.type, dtype=cache.autocast_dtype)
                            if cache.autocast_dtype is not None else contextlib.nullcontext())
                with autocast:
                    writer.add(c, E.check_output(name, c, cache.embed(name, chunk), rows[c],
                                                 name in token_inputs))
            reps[name], _ = writer.finish()
        loss, _ = cache.compute_loss(reps, **loss_kwargs)
    return scalar_loss(loss).detach()
