"""What the engine expects of a loss function: the keyword arguments it takes (one per tower,
plus extras such as ``doc_ids``) and what it returns (a scalar loss and its metrics).

:class:`LossArguments` checks the towers against the loss's signature once and sorts each
step's arguments into tower inputs and loss arguments; :func:`loss_and_metrics` reads what a
loss returned; :func:`scalar_loss` checks that the loss is a 0-d tensor.

A loss that takes one embedding per token (:class:`bigbatch.TokenEmbeddings`) for some of
its arguments names them in a ``token_inputs`` attribute (e.g. ``("query", "doc")``, as
:class:`bigbatch.MaxSimInfoNCE` does); the towers of those arguments must return token
embeddings, every other tower a ``(rows, dim)`` tensor.

A loss that wraps another (:class:`bigbatch.Matryoshka`) names it in a ``wrapped_loss``
attribute: its keyword arguments are the wrapped loss's.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from torch import Tensor, nn

from ..errors import ConfigError, InputError, ShapeError

__all__ = ["LossArguments", "loss_and_metrics", "scalar_loss"]


class LossArguments:
    """The keyword arguments ``loss_fn`` accepts, checked against the tower names, and
    ``token_inputs``: the towers whose embeddings the loss takes as token embeddings.

    Raises:
        ConfigError: the loss takes no ``**kwargs`` and lacks a tower's name.
    """

    def __init__(self, loss_fn: Callable[..., Any], towers: Iterable[str]) -> None:
        self.towers = list(towers)
        self.names, self.var_kw = _keywords(_innermost(loss_fn))
        self.token_inputs = frozenset(getattr(loss_fn, "token_inputs", ()))
        if not self.var_kw:
            missing = [n for n in self.towers if n not in self.names]
            if missing:
                raise ConfigError(f"loss_fn does not accept the tower name(s) {missing} as "
                                  f"keyword arguments; it takes {sorted(self.names)}. "
                                  f"Name the towers after the loss's arguments")

    def of_step(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """The loss's keyword arguments among ``step()``'s: all but the towers' inputs.

        Raises:
            InputError: a tower's input is missing, or an argument is neither a tower nor
                accepted by the loss.
        """
        missing = [n for n in self.towers if n not in inputs]
        if missing:
            raise InputError(f"step() is missing input(s) for tower(s) {missing}; towers are "
                             f"{self.towers}")
        loss_kwargs = {k: v for k, v in inputs.items() if k not in self.towers}
        if not self.var_kw:
            extra = [k for k in loss_kwargs if k not in self.names]
            if extra:
                raise InputError(f"step() got argument(s) {extra} that are neither towers "
                                 f"{self.towers} nor arguments of the loss "
                                 f"{sorted(self.names - set(self.towers))}")
        return loss_kwargs


def _innermost(loss_fn: Callable) -> Callable:
    """The loss whose signature says what a (possibly wrapping) loss accepts."""
    while getattr(loss_fn, "wrapped_loss", None) is not None:
        loss_fn = loss_fn.wrapped_loss
    return loss_fn


def _keywords(loss_fn: Callable) -> tuple[set[str], bool]:
    """Names the loss accepts as keywords, and whether it takes ``**kwargs``."""
    target = loss_fn.forward if isinstance(loss_fn, nn.Module) else loss_fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return set(), True
    names, var_kw = set(), False
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
            names.add(p.name)
    return names, var_kw


def loss_and_metrics(out: Any) -> tuple[Tensor, dict[str, Any]]:
    """``(loss, metrics)`` from what a loss returned: a tensor, a ``(loss, metrics)`` pair
    (e.g. :class:`bigbatch.LossOutput`) or a dict with a ``"loss"`` key.

    Raises:
        ConfigError: anything else.
    """
    if isinstance(out, Tensor):
        return out, {}
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise ConfigError("loss_fn returned a dict without a 'loss' key")
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Tensor):
        return out[0], dict(out[1] or {})
    raise ConfigError(f"loss_fn must return a tensor, (loss, metrics) or a dict with 'loss'; "
                      f"got {type(out).__name__}")


def scalar_loss(loss: Any) -> Tensor:
    """``loss`` itself when it is a 0-d tensor, as the loss given to the engine must be.

    Raises:
        ShapeError: anything else (a tensor of another shape, or not a tensor).
    """
    if not isinstance(loss, Tensor) or loss.dim() != 0:
        raise ShapeError(f"loss_fn must return a scalar loss, got "
                         f"{tuple(loss.shape) if isinstance(loss, Tensor) else type(loss)}")
    return loss
