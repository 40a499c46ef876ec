"""Helpers for the late-interaction tests: a tiny token tower returning TokenEmbeddings, the
padded concatenation of chunk outputs, and a naive dense MaxSim InfoNCE reference (the whole
B x N x Tq x Td similarity tensor, no blocks), independent of bigbatch.losses.maxsim.
At the root of tests/: the late-interaction tests of core/, distributed/, pipeline/ and
vision/ share it."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from helpers import trimmed_chunks
from torch import Tensor, nn

import bigbatch as bb


class TokenVectors(nn.Module):
    """Embedding + position (counted from the first real token) + dropout + linear over
    token ids; returns one L2-normalised vector per token and the attention mask."""

    def __init__(self, vocab: int = 50, dim: int = 16, out: int = 8, p: float = 0.1,
                 max_len: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.drop = nn.Dropout(p)
        self.lin = nn.Linear(dim, out)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> bb.TokenEmbeddings:
        pos = (attention_mask.cumsum(1) - 1).clamp_min(0)
        h = self.drop(self.emb(input_ids) + self.pos(pos))
        return bb.TokenEmbeddings(nn.functional.normalize(self.lin(torch.tanh(h)), dim=-1),
                                  attention_mask)


def padded_cat(outs: list[bb.TokenEmbeddings]) -> bb.TokenEmbeddings:
    """Token embeddings of several chunks as one batch, padded to the longest chunk."""
    width = max(o.values.shape[1] for o in outs)
    pad = nn.functional.pad
    return bb.TokenEmbeddings(
        torch.cat([pad(o.values, (0, 0, 0, width - o.values.shape[1])) for o in outs]),
        torch.cat([pad(o.mask, (0, width - o.mask.shape[1])) for o in outs]))


def run_chunked(tower: nn.Module, batch: dict[str, Tensor], size: int) -> bb.TokenEmbeddings:
    """The tower on the engine's chunks (trimmed, in order: the same dropout draws) with
    gradients, as one padded batch."""
    return padded_cat([tower(**c) for c in trimmed_chunks(batch, size)])


def naive_scores(q: bb.TokenEmbeddings, d: bb.TokenEmbeddings, normalize: bool = False) -> Tensor:
    sim = torch.einsum("itk,jsk->ijts", q.values, d.values)  # all B x N x Tq x Td at once
    sim = sim.masked_fill(~d.mask.bool()[None, :, None, :], float("-inf"))
    w = q.mask.to(sim.dtype)
    if normalize:
        w = w / w.sum(1, keepdim=True)
    return (sim.max(-1).values * w[:, None, :]).sum(-1)


def _cross_entropy(s: Tensor, labels: Tensor, scale: Tensor, same: Tensor | None,
                   margin: float | None) -> Tensor:
    rows = torch.arange(len(labels))
    drop = torch.zeros_like(s, dtype=torch.bool)
    if same is not None:
        drop |= same
    if margin is not None:
        drop |= s.detach() > s.detach()[rows, labels][:, None] + margin
    drop[rows, labels] = False
    return nn.functional.cross_entropy((s * scale).masked_fill(drop, float("-inf")), labels)


def naive_maxsim_loss(loss_fn: bb.MaxSimInfoNCE, query: bb.TokenEmbeddings,
                      doc: bb.TokenEmbeddings,
                      doc_ids: Tensor | Sequence[Hashable] | None = None) -> Tensor:
    """MaxSimInfoNCE's loss with its options, written densely and plainly."""
    s = naive_scores(query, doc, loss_fn.normalize_query)
    b, n = s.shape
    pos = torch.arange(b) * (n // b)
    scale = loss_fn.logit_scale()
    ids = None
    if doc_ids is not None:
        codes: dict = {}
        ids = torch.tensor([codes.setdefault(i, len(codes)) for i in
                            (doc_ids.tolist() if isinstance(doc_ids, Tensor) else doc_ids)])
    margin = loss_fn.false_negative_margin
    same = None if ids is None else ids[None, :] == ids[pos][:, None]
    loss = _cross_entropy(s, pos, scale, same, margin)
    if loss_fn.symmetric:
        back_same = None if ids is None else ids[pos][None, :] == ids[pos][:, None]
        loss = 0.5 * (loss + _cross_entropy(s[:, pos].T, torch.arange(b), scale, back_same,
                                            margin))
    return loss
