"""A functional GradCache API for users who keep their own training loop (luyug-style).

``cached(func)`` wraps a function that embeds one sub-batch. Calling the wrapped
function runs it without gradients, under a recorded random state, and returns
``(reps, replay)``: ``reps`` is a detached leaf tensor that requires grad, and
``replay()`` re-runs the function with gradients (same dropout masks) and
backpropagates ``reps.grad`` into the parameters::

    @bb.functional.cached
    def embed(model, batch):
        return model(**batch)

    reps_q, replays_q = zip(*(embed(model, b) for b in query_chunks))
    reps_d, replays_d = zip(*(embed(model, b) for b in doc_chunks))
    loss, _ = loss_fn(query=torch.cat(reps_q), doc=torch.cat(reps_d))
    loss.backward()                      # fills reps.grad for every chunk
    for replay in replays_q + replays_d:
        replay()                         # parameter gradients of the full-batch loss
    optimizer.step()
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..errors import InputError, ShapeError
from .rng import RandContext

__all__ = ["cached", "cat_input_tensor"]


def cached(func: Callable[..., Tensor]) -> Callable[..., tuple[Tensor, Callable[[], None]]]:
    """Decorate an embedding function so it returns ``(reps, replay)`` (see module docstring).

    ``replay(grad=None)`` uses ``reps.grad`` unless a gradient is given; it raises
    :class:`bigbatch.errors.InputError` when there is no gradient to backpropagate.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> tuple[Tensor, Callable[[], None]]:
        ctx = RandContext(args, kwargs)
        with torch.no_grad():
            out = func(*args, **kwargs)
        if not isinstance(out, Tensor):
            raise ShapeError(f"{func.__name__} must return a tensor, got {type(out).__name__}")
        reps = out.detach()
        if reps.dtype in (torch.float16, torch.bfloat16):
            reps = reps.float()
        reps.requires_grad_()

        def replay(grad: Tensor | None = None) -> None:
            g = reps.grad if grad is None else grad
            if g is None:
                raise InputError(f"replay of {func.__name__}: its reps have no gradient yet; "
                                 f"call loss.backward() on a loss built from reps first")
            with ctx:
                y = func(*args, **kwargs)
            torch.autograd.backward(y.to(g.dtype), g)

        return reps, replay

    return wrapper


def cat_input_tensor(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a loss so that every list or tuple of tensors it is given is concatenated
    on dimension 0 first (lists of per-chunk ``reps`` become full-batch tensors)."""

    def cat(x: Any) -> Any:
        if isinstance(x, (list, tuple)) and x and all(isinstance(t, Tensor) for t in x):
            return torch.cat(list(x))
        return x

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*(cat(a) for a in args), **{k: cat(v) for k, v in kwargs.items()})

    return wrapper
