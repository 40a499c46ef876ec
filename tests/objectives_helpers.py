"""Helpers for the objective tests (Matryoshka, extra in-batch negatives, token-budget
chunks): the engine's chunks of a tower rebuilt from the public chunking functions (so a
reference draws the same dropout masks in the same order), and losses written out by hand.
At the root of tests/: core/'s one-process tests and distributed/'s rank cases share it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from multivector_helpers import padded_cat
from torch import Tensor

import bigbatch as bb
from bigbatch.engine import chunking


def engine_chunks(inputs: dict[str, Tensor], chunk_size: int, chunk_tokens: int | None = None,
                  sort: bool = False) -> tuple[list[dict[str, Tensor]], Tensor | None]:
    """The chunks (materialised) and the row order the engine uses for one tower."""
    order = chunking.length_order(inputs) if sort else None
    bounds = None
    if chunk_tokens is not None:
        bounds = chunking.token_bounds(inputs, chunk_tokens, chunk_size, name="t", order=order)
    if order is not None:
        chunks, _ = chunking.ordered_chunks(inputs, order, chunk_size, bounds=bounds)
    else:
        chunks, _ = chunking.split_inputs(inputs, chunk_size, name="t", bounds=bounds)
    return [chunking.materialize(c) for c in chunks], order


def run_chunks(tower: Any, chunks: list[dict[str, Tensor]], order: Tensor | None) -> Any:
    """The tower on ``chunks`` in order, with gradients, put back in the original row order."""
    outs = [tower(**c) for c in chunks]
    tokens = isinstance(outs[0], bb.TokenEmbeddings)
    emb = padded_cat(outs) if tokens else torch.cat(outs)
    if order is None:
        return emb
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    if tokens:
        return bb.TokenEmbeddings(emb.values[inverse], emb.mask[inverse])
    return emb[inverse]


def cut(emb: Any, dim: int) -> Any:
    """Truncated to ``dim`` and normalised again, written plainly."""
    if isinstance(emb, bb.TokenEmbeddings):
        v = emb.values[..., :dim]
        return bb.TokenEmbeddings(v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12), emb.mask)
    v = emb[:, :dim]
    return v / v.norm(dim=-1, keepdim=True)


def separate_losses(loss_fn: Any, dims: list[int], weights: list[float], query: Any, doc: Any,
                    **kwargs: Any) -> Tensor:
    """The weighted sum of the loss called once per width (the Matryoshka reference)."""
    total = 0
    for d, w in zip(dims, weights):
        out = loss_fn(query=cut(query, d), doc=cut(doc, d), **kwargs)
        total = total + w * (out[0] if isinstance(out, tuple) else out)
    return total


def qq_dd_loss(q: Tensor, d: Tensor, scale: Tensor, qq: bool, dd: bool,
               ids: list | None = None) -> Tensor:
    """InfoNCE with Qwen3-Embedding's extra terms, one row and one term at a time."""
    b, n = q.shape[0], d.shape[0]
    group = n // b
    total = 0
    for i in range(b):
        p = i * group
        same = [ids is not None and j != p and ids[j] == ids[p] for j in range(n)]
        terms = [scale * (q[i] @ d[j]) for j in range(n) if not same[j]]
        if qq:
            terms += [scale * (q[i] @ q[j]) for j in range(b) if j != i]
        if dd:
            terms += [scale * (d[p] @ d[j]) for j in range(n) if j != p and not same[j]]
        total = total + torch.logsumexp(torch.stack(terms), 0) - scale * (q[i] @ d[p])
    return total / b


def normalized(rows: int, dim: int, gen: torch.Generator | None = None) -> Tensor:
    return F.normalize(torch.randn(rows, dim, dtype=torch.float64, generator=gen), dim=-1)


def queue_objective(q, d, queue, scale, k, doc_ids, query_ids, symmetric=False):
    """InfoNCE whose denominators also hold the queued documents, one row at a time: a
    document with the positive's id is left out, and a queued one that was the positive of
    the row's query. ``queue``: (embeddings, ids, query ids), the embeddings constants."""
    q_emb, q_ids, q_owners = queue
    b, n = q.shape[0], d.shape[0]
    g = k + 1
    total = 0
    for i in range(b):
        p = i * g
        terms = [scale * (q[i] @ d[j]) for j in range(n)
                 if j == p or doc_ids[j] != doc_ids[p]]
        terms += [scale * (q[i] @ q_emb[j]) for j in range(len(q_ids))
                  if q_ids[j] != doc_ids[p] and (q_owners[j] is None
                                                 or q_owners[j] != query_ids[i])]
        total = total + torch.logsumexp(torch.stack(terms), 0) - scale * (q[i] @ d[p])
    forward = total / b
    if not symmetric:
        return forward
    back = 0
    for i in range(b):  # each positive against the queries (same-id positives left out)
        p = i * g
        terms = [scale * (d[p] @ q[j]) for j in range(b)
                 if j == i or doc_ids[j * g] != doc_ids[p]]
        back = back + torch.logsumexp(torch.stack(terms), 0) - scale * (d[p] @ q[i])
    return 0.5 * (forward + back / b)
