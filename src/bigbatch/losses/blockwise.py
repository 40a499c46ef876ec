"""Softmax cross-entropy of row embeddings against column embeddings, dense or in row blocks.

For rows ``r_i``, columns ``c_j``, a positive column ``p(i)`` per row and a logit scale
``t``, the sum over rows of ``logsumexp_j(t r_i.c_j) - t r_i.c_{p(i)}``, where excluded
columns (:class:`Exclusions`: same ids, a false-negative margin, listed pairs, a guide
model's verdict) are left out of the log-sum-exp. Both contrastive losses of
:mod:`bigbatch.losses.infonce` are built on it.

Streamed (the default): the rows are cut into blocks of ``block`` rows. The forward pass
computes one block's ``block x N`` similarities at a time and keeps only the inputs and one
log-sum-exp per row; the backward pass recomputes each block's similarities, turns them
into that block's softmax in place and multiplies it out into the rows', columns' and
scale's gradients at once (a custom autograd function, no graph per block). Peak memory
is therefore one block's similarities (plus a boolean mask when columns are excluded),
not ``B x N``, whatever the batch. The metric sums are taken in the same pass, in place,
without further ``block x N`` tensors. Results equal the dense computation to round-off.

Dense (``block=None``): one autograd graph over all ``B x N`` logits, the reference.

Block size rule (:func:`~bigbatch.losses.layout.rows_per_block`): ``block_size`` rows when given;
otherwise as
many rows as keep a block within ``max_block_logits`` logits (default
:data:`~bigbatch.losses.layout.MAX_BLOCK_LOGITS` = 2**22, 16 MiB in float32), i.e. ``max(1,
max_block_logits // N)``
rows for ``N`` columns (a single row holds ``N`` logits even when that is more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .guided import GuideRule, guide_exceeds
from .layout import STATS

__all__ = ["Exclusions", "cross_entropy_sum"]

@dataclass(frozen=True)
class Exclusions:
    """Columns left out of a row's negatives (never its positive).

    Attributes:
        col_ids, row_ids: one id per column and per row: a column with its row's id is
            excluded (the same passage twice in a batch is no negative).
        margin: a column whose similarity exceeds the row's positive similarity plus
            ``margin`` is excluded (selected on detached similarities).
        pairs: ``(M, 2)`` long tensor of (row, column) pairs to exclude.
        margin_cols: the margin applies to the first ``margin_cols`` columns only (None:
            to all); InfoNCE's document-document columns are left out of it, as in
            Qwen3-Embedding.
        guide_rows, guide_cols: a guide model's embeddings of the rows and of the columns
            (any width, detached): a column the guide scores above the row's positive, by
            ``guide_rule`` (:mod:`bigbatch.losses.guided`), is excluded.
        own_group: when set (the group's width), every column outside the row's own group
            ``[pos_i, pos_i + own_group)`` is excluded: no in-batch negatives, only the
            row's own hard negatives (classification-style data, whose labels repeat).
        col_groups, row_groups: a second id per column and per row (a column's negative
            value matches no row): a column with its row's group is excluded (a queued
            document that was the positive of the row's query, :mod:`bigbatch.losses.queue`).
    """

    col_ids: Tensor | None = None
    row_ids: Tensor | None = None
    margin: float | None = None
    pairs: Tensor | None = None
    margin_cols: int | None = None
    guide_rows: Tensor | None = None
    guide_cols: Tensor | None = None
    guide_rule: GuideRule = GuideRule()
    own_group: int | None = None
    col_groups: Tensor | None = None
    row_groups: Tensor | None = None

    def mask(self, sim: Tensor, pos: Tensor, pos_sim: Tensor, lo: int, hi: int) -> Tensor | None:
        """The boolean ``(hi - lo, N)`` mask of excluded columns of rows ``lo:hi`` (whose
        similarities are ``sim``, positives ``pos`` and positive similarities ``pos_sim``),
        or None when nothing is excluded."""
        mask = None
        if self.col_ids is not None:
            mask = self.col_ids[None, :] == self.row_ids[lo:hi, None]
        if self.col_groups is not None:
            same = self.col_groups[None, :] == self.row_groups[lo:hi, None]
            mask = same if mask is None else mask.logical_or_(same)
        if self.margin is not None:
            over = sim > (pos_sim + self.margin)[:, None]
            if self.margin_cols is not None:
                over[:, self.margin_cols:] = False
            mask = over if mask is None else mask.logical_or_(over)
        if self.guide_rows is not None:
            over = guide_exceeds(self.guide_rows[lo:hi], self.guide_cols, pos, self.guide_rule)
            mask = over if mask is None else mask.logical_or_(over)
        if self.pairs is not None:
            if mask is None:
                mask = torch.zeros(sim.shape, dtype=torch.bool, device=sim.device)
            pick = (self.pairs[:, 0] >= lo) & (self.pairs[:, 0] < hi)
            mask[self.pairs[pick, 0] - lo, self.pairs[pick, 1]] = True
        if self.own_group is not None:
            cols = torch.arange(sim.shape[1], device=sim.device)[None]
            outside = (cols < pos[:, None]) | (cols >= pos[:, None] + self.own_group)
            mask = outside if mask is None else mask.logical_or_(outside)
        if mask is not None:
            mask.scatter_(1, pos[:, None], False)
        return mask


def _stats_(sim: Tensor, pos: Tensor, pos_sim: Tensor, group: int,
            mask: Tensor | None) -> Tensor:
    """The :data:`~bigbatch.losses.layout.STATS` sums of one block, in at least float32, but
    ``correct`` (left at
    zero: the caller takes the logits' argmax). Works in place on ``sim``, with no further
    ``block x N`` tensor: excluded entries are left at zero, the others restored."""
    acc = torch.promote_types(sim.dtype, torch.float32)
    b, n = sim.shape
    own_idx = pos[:, None] + torch.arange(group, device=sim.device)
    own = sim.gather(1, own_idx)
    own_keep = own_idx != pos[:, None]
    masked_out = 0
    if mask is not None:
        own_masked = mask.gather(1, own_idx)
        own_keep &= ~own_masked
        masked_out = mask.count_nonzero() - own_masked.count_nonzero()  # sum(): an int64 copy
    sim.scatter_(1, own_idx, 0.0)
    if mask is not None:
        sim.masked_fill_(mask, 0.0)
    inb_sum = sim.sum(dtype=acc)
    inb_n = torch.as_tensor(b * (n - group) - masked_out, dtype=acc, device=sim.device)
    hard_sum = torch.where(own_keep, own, 0.0).sum(dtype=acc)
    hard_n = own_keep.count_nonzero().to(acc)
    sim.scatter_(1, own_idx, own)
    return torch.stack([pos_sim.sum(dtype=acc), sim.new_zeros((), dtype=acc),
                        inb_sum + hard_sum, inb_n + hard_n, inb_sum, inb_n, hard_sum, hard_n])


def _correct(logits: Tensor, pos: Tensor, acc: torch.dtype) -> Tensor:
    return (logits.argmax(dim=1) == pos).sum().to(acc)


def _dense(rows: Tensor, cols: Tensor, pos: Tensor, scale: Tensor, group: int,
           exclude: Exclusions, with_stats: bool) -> tuple[Tensor, Tensor]:
    """All rows at once, through autograd."""
    sim = rows @ cols.T
    pos_sim = sim.gather(1, pos[:, None]).squeeze(1)
    with torch.no_grad():
        mask = exclude.mask(sim.detach(), pos, pos_sim.detach(), 0, rows.shape[0])
    logits = sim * scale
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    loss_sum = (torch.logsumexp(logits, dim=1) - pos_sim * scale).sum()
    acc = torch.promote_types(sim.dtype, torch.float32)
    if not with_stats:
        return loss_sum, sim.new_zeros(len(STATS), dtype=acc)
    with torch.no_grad():
        st = _stats_(sim.detach().clone(), pos, pos_sim.detach(), group, mask)
        st[1] = _correct(logits.detach(), pos, acc)
    return loss_sum, st


def _logits_(sim: Tensor, scale: Tensor, mask: Tensor | None) -> Tensor:
    """Similarities to logits in place: excluded entries -inf, times the scale."""
    if mask is not None:
        sim.masked_fill_(mask, float("-inf"))
    return sim.mul_(scale)


class _Streamed(torch.autograd.Function):
    """Cross-entropy sum over row blocks; the backward recomputes each block's softmax."""

    @staticmethod
    def forward(ctx, rows: Tensor, cols: Tensor, scale: Tensor, pos: Tensor,
                exclude: Exclusions, group: int, block: int,
                with_stats: bool) -> tuple[Tensor, Tensor]:
        n = rows.shape[0]
        acc = torch.promote_types(rows.dtype, torch.float32)
        lse = rows.new_empty(n)
        loss = rows.new_zeros(())
        stats = rows.new_zeros(len(STATS), dtype=acc)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            p = pos[lo:hi]
            sim = rows[lo:hi] @ cols.T
            pos_sim = sim.gather(1, p[:, None]).squeeze(1)
            mask = exclude.mask(sim, p, pos_sim, lo, hi)
            st = _stats_(sim, p, pos_sim, group, mask) if with_stats else None
            logits = _logits_(sim, scale, mask)
            if st is not None:
                st[1] = _correct(logits, p, acc)
                stats += st
            # log-sum-exp in place, as torch.logsumexp computes it
            top = logits.amax(dim=1)
            top = top.masked_fill(top.abs() == float("inf"), 0.0)
            part = logits.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top)
            lse[lo:hi] = part
            loss += (part - pos_sim * scale).sum()
            del sim, logits, mask
        ctx.save_for_backward(rows, cols, scale, pos, lse)
        ctx.exclude, ctx.block = exclude, block
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    @once_differentiable
    def backward(ctx, g_loss: Tensor, _g_stats: Tensor) -> tuple:
        rows, cols, scale, pos, lse = ctx.saved_tensors
        need_rows, need_cols, need_scale = ctx.needs_input_grad[:3]
        n, block, exclude = rows.shape[0], ctx.block, ctx.exclude
        g_rows = torch.empty_like(rows) if need_rows else None
        g_cols = torch.zeros_like(cols) if need_cols else None
        g_scale = rows.new_zeros(()) if need_scale else None
        factor = g_loss * scale  # d(loss)/d(similarity) = factor * (softmax - one-hot)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            p, r = pos[lo:hi], rows[lo:hi]
            sim = r @ cols.T
            pos_sim = sim.gather(1, p[:, None]).squeeze(1)
            mask = exclude.mask(sim, p, pos_sim, lo, hi)
            grad = _logits_(sim, scale, mask).sub_(lse[lo:hi, None]).exp_()  # softmax
            grad.scatter_add_(1, p[:, None], grad.new_full((hi - lo, 1), -1.0))
            del sim, mask
            if need_rows or need_scale:
                g_r = grad @ cols
                if need_scale:  # sum_ij grad_ij * sim_ij, as rows . (grad @ cols)
                    g_scale += (g_r * r).sum()
                if need_rows:
                    g_rows[lo:hi] = g_r.mul_(factor)
            if need_cols:
                g_cols.addmm_(grad.T, r)
            del grad
        if g_cols is not None:
            g_cols.mul_(factor)
        if g_scale is not None:
            g_scale = (g_scale * g_loss).to(scale.dtype)
        return g_rows, g_cols, g_scale, None, None, None, None, None


def cross_entropy_sum(rows: Tensor, cols: Tensor, pos: Tensor, scale: Tensor, *,
                      block: int | None, group: int = 1, exclude: Exclusions = Exclusions(),
                      with_stats: bool = True) -> tuple[Tensor, Tensor]:
    """Sum over rows of the cross-entropy of ``scale * rows @ cols.T`` with positives ``pos``.

    Args:
        rows: ``(B, D)``; cols: ``(N, D)``; pos: ``(B,)`` long, each row's positive column.
        scale: 0-d logit scale (may require grad).
        block: rows per block (streamed), or None (dense).
        group: row i's own group of columns is ``[pos_i, pos_i + group)`` (its positive and
            hard negatives), for the ``inb_*`` and ``hard_*`` sums.
        exclude: columns left out of each row's negatives.
        with_stats: compute the :data:`~bigbatch.losses.layout.STATS` sums (zeros otherwise).

    Returns:
        ``(loss_sum, stats)``: the differentiable sum and the detached
        :data:`~bigbatch.losses.layout.STATS` sums
        (in at least float32).
    """
    if block is None:
        return _dense(rows, cols, pos, scale, group, exclude, with_stats)
    return _Streamed.apply(rows, cols, scale, pos, exclude, group, block, with_stats)
