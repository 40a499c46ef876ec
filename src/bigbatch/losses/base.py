"""What every bigbatch loss shares: the temperature (:class:`LogitScale`, kept in log space,
and :class:`TemperatureLoss`, the base of the contrastive losses), what a loss returns
(:class:`LossOutput`; :class:`PartialLoss`, a rank's part of a global loss) and document ids
as a tensor."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..errors import ConfigError, ShapeError
from .layout import id_codes, initial_log_scale

__all__ = ["PartialLoss", "LossOutput", "LogitScale", "TemperatureLoss", "ids_tensor"]


class PartialLoss(NamedTuple):
    """A rank's part of a global loss: ``part`` (backpropagated on this rank; the parts of all
    ranks sum to the global loss), ``total`` (the detached global loss, identical on every
    rank) and the global metrics."""

    part: Tensor
    total: Tensor
    metrics: dict[str, Tensor]


class LossOutput(NamedTuple):
    """What a bigbatch loss returns: the scalar loss and detached 0-d metric tensors."""

    loss: Tensor
    metrics: dict[str, Tensor]


class LogitScale(nn.Module):
    """A temperature kept in log space: ``forward()`` returns ``exp(log_scale) = 1/temperature``.

    Args:
        temperature: initial temperature; ``log_scale`` starts at ``ln(1/temperature)``.
        max_scale: ``clamp_()`` keeps a learnable ``log_scale`` in ``[0, ln(max_scale)]``,
            i.e. the temperature in ``[1/max_scale, 1]``.
        learnable: a trainable parameter when True, a buffer (saved, not trained) when False.
            A fixed temperature may be any positive value and ``clamp_()`` leaves it alone.

    The forward pass does not clamp (a clamp there would give zero gradient at the
    bound and the scale could never come back); call :meth:`clamp_` after each
    optimizer step, as OpenCLIP and contrastors do.

    Raises:
        ConfigError: temperature <= 0, max_scale < 1, or a learnable temperature outside
            ``[1/max_scale, 1]`` (``clamp_()`` would move it after the first step).
    """

    def __init__(self, temperature: float = 0.07, max_scale: float = 100.0,
                 learnable: bool = True) -> None:
        super().__init__()
        log_scale = initial_log_scale(temperature, max_scale, learnable)
        self.max_scale = float(max_scale)
        init = torch.tensor(log_scale, dtype=torch.float32)
        if learnable:
            self.log_scale = nn.Parameter(init)
        else:
            self.register_buffer("log_scale", init)

    def forward(self) -> Tensor:
        return self.log_scale.exp()

    @torch.no_grad()
    def clamp_(self) -> "LogitScale":
        """Clamp a learnable ``log_scale`` into ``[0, ln(max_scale)]`` in place; call after
        ``optimizer.step()``. A fixed temperature is left as it was given."""
        if isinstance(self.log_scale, nn.Parameter):
            self.log_scale.clamp_(0.0, math.log(self.max_scale))
        return self

    @property
    def temperature(self) -> float:
        return float(torch.exp(-self.log_scale.detach()))

    def extra_repr(self) -> str:
        return f"temperature={self.temperature:.4g}, max_scale={self.max_scale:g}, " \
               f"learnable={isinstance(self.log_scale, nn.Parameter)}"


def ids_tensor(ids: Tensor | Sequence[Hashable], n: int, device: torch.device,
               name: str = "doc_ids") -> Tensor:
    """Ids (a tensor, or any hashables such as strings) as an int64 tensor of length ``n``,
    equal where the ids are equal; ShapeError naming ``name`` for another length."""
    if isinstance(ids, Tensor):
        out = ids.to(device=device, dtype=torch.long).reshape(-1)
    else:
        out = torch.tensor(id_codes(ids), dtype=torch.long, device=device)
    if out.numel() != n:
        raise ShapeError(f"{name} has {out.numel()} entries but there are {n} documents; "
                         f"give one id per document")
    return out


class TemperatureLoss(nn.Module):
    """What every bigbatch contrastive loss shares: a temperature held as a
    :class:`LogitScale` (learnable or fixed, clamped after each optimizer step by
    :meth:`clamp_`) and the check of a false-negative margin.

    Args:
        temperature: the initial temperature (logit scale ``1 / temperature``).
        learnable_temperature: train the logit scale with the model.
        max_scale: the logit scale's upper bound (CLIP's 100).
        false_negative_margin: optional; must be a finite number when given.
    """

    def __init__(self, temperature: float = 0.07, learnable_temperature: bool = True,
                 max_scale: float = 100.0, false_negative_margin: float | None = None) -> None:
        super().__init__()
        if false_negative_margin is not None and not math.isfinite(false_negative_margin):
            raise ConfigError(f"false_negative_margin must be a finite number, got "
                              f"{false_negative_margin!r}")
        self.logit_scale = LogitScale(temperature, max_scale=max_scale,
                                      learnable=learnable_temperature)
        self.false_negative_margin = false_negative_margin

    def clamp_(self) -> "TemperatureLoss":
        """Clamp the logit scale into its bounds; call after ``optimizer.step()``."""
        self.logit_scale.clamp_()
        return self

    @property
    def temperature(self) -> float:
        return self.logit_scale.temperature
