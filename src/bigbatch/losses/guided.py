"""Guided false-negative filtering (GISTEmbed): a frozen guide model's similarities decide
which negatives are left out of a contrastive loss.

A guide (another embedding model, or the trained model's own starting weights) embeds the
batch once per step, without gradients; it is never replayed and never trained, and its
width may differ from the trained model's. For a row (query) ``i`` with positive ``p(i)``
and guide similarities ``g_ij`` (guide row embedding . guide column embedding), a column
``j`` other than the positive is masked out of row ``i``'s softmax when

- ``absolute`` margin ``m``: ``g_ij > g_{i,p(i)} - m``
- ``relative`` margin ``m``: ``g_ij > g_{i,p(i)} * (1 - m)``

so a negative the guide ranks above the positive (margin 0), or close below it (margin > 0),
is taken for an unlabelled positive. These are sentence-transformers' ``GISTEmbedLoss``
rules; every column counts, the in-batch negatives and the hard negatives of every row
alike, whatever the layout. The rule is applied block by block with the loss
(:class:`bigbatch.losses.blockwise.Exclusions`), so no ``B x N`` mask is ever held.

References:
    Solatorio 2024, "GISTEmbed: Guided In-sample Selection of Training Negatives for Text
    Embedding Fine-tuning"; sentence-transformers' ``GISTEmbedLoss`` and
    ``CachedGISTEmbedLoss``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError, ShapeError

__all__ = ["MARGIN_TYPES", "GuideRule", "check_guide", "guide_exceeds", "count_guided"]

MARGIN_TYPES = ("absolute", "relative")
"""How ``guide_margin`` lowers the positive's guide similarity into the masking threshold."""


@dataclass(frozen=True)
class GuideRule:
    """The masking rule: ``margin`` and its ``margin_type`` (``"absolute"`` or ``"relative"``).

    Raises:
        ConfigError: a margin that is not a finite number, or an unknown margin type.
    """

    margin: float = 0.0
    margin_type: str = "absolute"

    def __post_init__(self) -> None:
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) \
                or not math.isfinite(self.margin):
            raise ConfigError(f"guide_margin must be a finite number, got {self.margin!r}")
        if self.margin_type not in MARGIN_TYPES:
            raise ConfigError(f"guide_margin_type must be one of {MARGIN_TYPES}, got "
                              f"{self.margin_type!r}")

    def threshold(self, pos_sim: Tensor) -> Tensor:
        """The guide similarity above which a column is masked, per row."""
        if self.margin_type == "absolute":
            return pos_sim - self.margin
        return pos_sim * (1.0 - self.margin)


def check_guide(guide: Tensor, rows: int, name: str) -> Tensor:
    """``guide`` detached, checked to be ``(rows, width)`` (any width) and finite.

    Raises:
        ShapeError: another shape; NonFiniteError is left to the caller's finiteness check.
    """
    if not isinstance(guide, Tensor) or guide.dim() != 2 or guide.shape[0] != rows:
        shape = tuple(guide.shape) if isinstance(guide, Tensor) else type(guide).__name__
        raise ShapeError(f"{name} must be the guide model's (rows, width) embeddings with one "
                         f"row per {'query' if 'query' in name else 'document'} ({rows}), got "
                         f"{shape}")
    return guide.detach()


def guide_exceeds(guide_rows: Tensor, guide_cols: Tensor, pos: Tensor,
                  rule: GuideRule) -> Tensor:
    """The ``(rows, cols)`` boolean mask of the columns the guide masks for these rows
    (``pos``: each row's positive column, never masked)."""
    with torch.no_grad():
        g = guide_rows @ guide_cols.T
        over = g > rule.threshold(g.gather(1, pos[:, None]))
        over.scatter_(1, pos[:, None], False)
    return over


def count_guided(guide_rows: Tensor, guide_cols: Tensor, pos: Tensor, rule: GuideRule,
                 block: int | None) -> Tensor:
    """How many (row, column) pairs the guide masks, counted ``block`` rows at a time (all at
    once for None), as a 0-d float tensor for the metrics."""
    n = guide_rows.shape[0]
    step = n if block is None else max(1, block)
    total = torch.zeros((), dtype=torch.float64, device=guide_rows.device)
    for lo in range(0, n, max(step, 1)):
        hi = min(lo + step, n)
        total += guide_exceeds(guide_rows[lo:hi], guide_cols, pos[lo:hi], rule).count_nonzero()
    return total
