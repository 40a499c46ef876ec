"""Distillation from teacher scores: how close the student's scores of a query's positive
and hard negatives come to a teacher's scores of the same documents.

The teacher's scores come with the data (``pos_score`` and ``neg_scores`` in a record, a
cross-encoder's or a larger bi-encoder's, e.g. written by ``bigbatch mine --scores``); for
query ``i`` they form a row ``t_i = (t_{i,0}, t_{i,1} .. t_{i,k})`` aligned with its group of
documents ``[pos_i, neg_i_1 .. neg_i_k]``. The student's scores are its similarities
``s_ij = q_i . d_{i,j}`` of the same pairs. Two objectives (:data:`OBJECTIVES`):

- ``kl``: ``KL(p_t || p_s)`` with ``p_t = softmax(t_i / T)`` (``T`` the teacher temperature)
  and ``p_s = softmax(scale * s_i)`` (the contrastive loss's logit scale), as FlagEmbedding
  and tevatron distil;
- ``margin-mse``: the mean over the hard negatives of
  ``((s_{i,0} - s_{i,j}) - (t_{i,0} - t_{i,j}))^2`` (Hofstätter et al.), on raw scores.

Each is summed over queries here; :class:`bigbatch.InfoNCE` divides by the global query
count and adds it, times a weight, to the contrastive loss. The scores involve only cached
embeddings, so the result is exact under the cache and across ranks (each rank scores its
own queries' groups, which it embedded itself).

References:
    Hinton et al. 2015, "Distilling the Knowledge in a Neural Network"; Hofstätter et al.
    2020, "Improving Efficient Neural Ranking Models with Cross-Architecture Knowledge
    Distillation" (MarginMSE); FlagEmbedding and tevatron's ``train_distil``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError, NonFiniteError, ShapeError

__all__ = ["OBJECTIVES", "Distillation", "group_similarities", "teacher_tensor", "kl_sum",
           "margin_mse_sum"]


def group_similarities(query: Tensor, docs: Tensor) -> Tensor:
    """``(b, 1 + k)`` similarities of each query with its own group of documents (``docs``:
    ``(b * (1 + k), dim)`` laid out ``[pos_0, neg_0_1 .. neg_0_k, pos_1, ...]``)."""
    b = query.shape[0]
    return torch.einsum("bd,bgd->bg", query, docs.reshape(b, -1, docs.shape[-1]))


def teacher_tensor(scores: Tensor | Sequence[Sequence[float]], b: int, group: int,
                   device: torch.device, dtype: torch.dtype) -> Tensor:
    """The teacher scores as a ``(b, 1 + k)`` tensor: one row per query, its positive's score
    first, then its hard negatives' in the documents' order.

    Raises:
        ShapeError: another shape (scores not aligned with the negatives).
        NonFiniteError: a NaN or infinite score.
    """
    t = torch.as_tensor(scores, dtype=dtype, device=device).detach()
    if t.shape != (b, group):
        raise ShapeError(f"teacher_scores must be ({b}, {group}): one row per query, the "
                         f"positive's score then one per hard negative (k = {group - 1}), got "
                         f"shape {tuple(t.shape)}")
    if not bool(torch.isfinite(t).all()):
        rows = torch.nonzero(~torch.isfinite(t).all(dim=1)).flatten().tolist()
        raise NonFiniteError(f"teacher_scores has NaN or infinite values (query row(s) "
                             f"{rows[:10]}); no gradient was written")
    return t


def kl_sum(student: Tensor, teacher: Tensor, scale: Tensor, teacher_temperature: float) -> Tensor:
    """Sum over rows of ``KL(softmax(teacher / T) || softmax(scale * student))``."""
    log_ps = torch.log_softmax(student * scale, dim=1)
    log_pt = torch.log_softmax(teacher / teacher_temperature, dim=1)
    return (log_pt.exp() * (log_pt - log_ps)).sum()


def margin_mse_sum(student: Tensor, teacher: Tensor, scale: Tensor,
                   teacher_temperature: float) -> Tensor:
    """Sum over rows of the mean over hard negatives of the squared difference of margins
    (positive minus negative), student against teacher; scale and temperature unused."""
    s = student[:, :1] - student[:, 1:]
    t = teacher[:, :1] - teacher[:, 1:]
    return (s - t).pow(2).mean(dim=1).sum()


OBJECTIVES: dict[str, Callable[[Tensor, Tensor, Tensor, float], Tensor]] = {
    "kl": kl_sum, "margin-mse": margin_mse_sum}
"""Each objective by its name (``--distill``): ``f(student, teacher, scale, T)``, summed over
rows."""


@dataclass(frozen=True)
class Distillation:
    """A distillation term: ``objective`` (a name in :data:`OBJECTIVES`), its ``weight``
    beside the contrastive loss and the ``teacher_temperature`` (``kl`` only).

    Raises:
        ConfigError: an unknown objective, a negative or non-finite weight, a temperature
            that is not > 0.
    """

    objective: str
    weight: float = 1.0
    teacher_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"distill must be one of {sorted(OBJECTIVES)}, got "
                              f"{self.objective!r}")
        if not (isinstance(self.weight, (int, float)) and math.isfinite(self.weight)
                and self.weight >= 0):
            raise ConfigError(f"distill_weight must be a finite number >= 0, got {self.weight!r}")
        if not (isinstance(self.teacher_temperature, (int, float))
                and math.isfinite(self.teacher_temperature) and self.teacher_temperature > 0):
            raise ConfigError(f"teacher_temperature must be > 0, got "
                              f"{self.teacher_temperature!r}")

    def sum(self, query: Tensor, docs: Tensor, teacher: Tensor, scale: Tensor) -> Tensor:
        """The objective summed over ``query``'s rows (``docs``: their groups, in order)."""
        if teacher.shape[1] < 2:
            raise ShapeError("distillation compares a query's positive with its hard "
                             "negatives: give at least one hard negative per query "
                             "(--num-hard-negatives >= 1)")
        student = group_similarities(query, docs)
        return OBJECTIVES[self.objective](student, teacher, scale, self.teacher_temperature)
