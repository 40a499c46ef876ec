"""Late interaction (multi-vector, ColBERT / ColPali-style) contrastive training:
:class:`MaxSimInfoNCE`, InfoNCE over MaxSim scores, and :func:`maxsim_scores`.

Both towers return :class:`bigbatch.TokenEmbeddings` (one vector per token and a mask). The
MaxSim score of query ``q`` and document ``d`` (Khattab and Zaharia 2020), over unmasked
tokens only::

    score(q, d) = sum_t max_s q_t . d_s           (divided by q's token count when
                                                   normalize_query=True)

Memory and blocks
-----------------
The similarities of every query token with every document token of every pair
(``B x N x Tq x Td`` numbers) never exist at once. :func:`maxsim_scores` computes the
``B x N`` scores in blocks of ``bq`` queries x ``bd`` documents, each block cut to the
tokens its rows use (the longest unmasked position among them); only the scores and the
inputs are kept, and the backward recomputes one block at a time
(:class:`BlockwiseMaxSim`), so no block's graph outlives the block. The block choice
(``block_size=None``), with ``Tq``, ``Td`` the longest query and document (the last
unmasked position) and
``E = max_block_elements`` (default 2**24, 64 MiB in float32)::

    bd = min(N, max(1, E // (Tq * Td)))       as many documents as fit with one query,
    bq = min(B, max(1, E // (bd * Tq * Td)))  then as many queries as fit with those,

so a block holds at most ``E`` similarities (about twice that at the peak of its
backward), unless a single pair is larger than ``E``; ``block_size=b`` or ``(bq, bd)``
fixes the block instead. Beyond the blocks the loss keeps ``B x N`` scores, as
:class:`bigbatch.InfoNCE` keeps ``B x N`` logits.

Layout, temperature, masking and metrics are :class:`bigbatch.InfoNCE`'s (queries ``B``,
documents ``B * (1 + k)`` as ``[pos_0, neg_0_1 .. neg_0_k, pos_1, ...]``), with the MaxSim
score in place of the dot product.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..engine.embeddings import TokenEmbeddings
from ..errors import ConfigError, InputError, ShapeError
from .base import LossOutput, PartialLoss, TemperatureLoss, ids_tensor
from .layout import hard_negative_count, loss_block_bytes

if TYPE_CHECKING:
    from ..engine.distributed import Gathered

__all__ = ["MaxSimInfoNCE", "maxsim_scores", "block_shape", "BlockwiseMaxSim",
           "MAX_BLOCK_ELEMENTS"]

MAX_BLOCK_ELEMENTS = 2 ** 24  # similarities in one automatic block: 64 MiB in float32

Span = tuple[int, int, int]  # rows [lo, hi) and the tokens they use


def block_shape(queries: int, docs: int, q_tokens: int, d_tokens: int,
                block_size: int | tuple[int, int] | None = None,
                max_block_elements: int = MAX_BLOCK_ELEMENTS) -> tuple[int, int]:
    """``(queries, documents)`` per block: ``block_size`` (one int for both) when given, else
    the rule of the module docstring."""
    if block_size is not None:
        bq, bd = (block_size, block_size) if isinstance(block_size, int) else block_size
        return min(bq, queries), min(bd, docs)
    pair = max(1, q_tokens * d_tokens)
    bd = min(docs, max(1, max_block_elements // pair))
    bq = min(queries, max(1, max_block_elements // (bd * pair)))
    return bq, bd


def _block_scores(q: Tensor, q_weight: Tensor, d: Tensor, d_mask: Tensor) -> Tensor:
    """MaxSim scores of queries ``q`` (b, tq, D) with token weights ``q_weight`` (b, tq)
    (0: masked) against documents ``d`` (n, td, D) with ``d_mask`` (n, td): (b, n)."""
    b, tq, dim = q.shape
    n, td = d_mask.shape
    q = q.masked_fill(q_weight[..., None] == 0, 0)  # a masked token's value never matters
    d = d.masked_fill(~d_mask[..., None], 0)
    sim = (q.reshape(b * tq, dim) @ d.reshape(n * td, dim).T).view(b, tq, n, td)
    sim.masked_fill_(~d_mask[None, None], float("-inf"))  # in place: one block-sized tensor
    return (sim.max(dim=3).values * q_weight[..., None]).sum(1)


class BlockwiseMaxSim(torch.autograd.Function):
    """MaxSim scores computed block by block; the backward recomputes each block with
    gradients and frees it before the next. Called as ``apply(q_values, q_weight, d_values,
    d_mask, q_spans, d_spans)``, ``*_spans`` the ``(lo, hi, tokens)`` row blocks."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, q_weight: Tensor, d: Tensor, d_mask: Tensor,
                q_spans: list[Span], d_spans: list[Span]) -> Tensor:
        out = q.new_empty(q.shape[0], d.shape[0])
        for i0, i1, tq in q_spans:
            for j0, j1, td in d_spans:
                out[i0:i1, j0:j1] = _block_scores(q[i0:i1, :tq], q_weight[i0:i1, :tq],
                                                  d[j0:j1, :td], d_mask[j0:j1, :td])
        ctx.save_for_backward(q, q_weight, d, d_mask)
        ctx.spans = (q_spans, d_spans)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, q_weight, d, d_mask = ctx.saved_tensors
        want_q, _, want_d = ctx.needs_input_grad[:3]
        grad_q = torch.zeros_like(q) if want_q else None
        grad_d = torch.zeros_like(d) if want_d else None
        for i0, i1, tq in ctx.spans[0]:
            for j0, j1, td in ctx.spans[1]:
                with torch.enable_grad():
                    qb = q[i0:i1, :tq].detach().requires_grad_(want_q)
                    db = d[j0:j1, :td].detach().requires_grad_(want_d)
                    scores = _block_scores(qb, q_weight[i0:i1, :tq], db, d_mask[j0:j1, :td])
                    wanted = [t for t in (qb, db) if t.requires_grad]
                    got = iter(torch.autograd.grad(scores, wanted, grad[i0:i1, j0:j1]))
                if want_q:
                    grad_q[i0:i1, :tq] += next(got)
                if want_d:
                    grad_d[j0:j1, :td] += next(got)
        return grad_q, None, grad_d, None, None, None


def _spans(lengths: list[int], rows_per_block: int) -> list[Span]:
    return [(lo, min(lo + rows_per_block, len(lengths)),
             max(lengths[lo:lo + rows_per_block])) for lo in range(0, len(lengths), rows_per_block)]


def maxsim_scores(query: TokenEmbeddings, doc: TokenEmbeddings, *, normalize_query: bool = False,
                  block_size: int | tuple[int, int] | None = None,
                  max_block_elements: int = MAX_BLOCK_ELEMENTS) -> Tensor:
    """The ``(queries, documents)`` MaxSim scores, differentiable, in blocks (module
    docstring); computed in float32 at least. One host-device synchronisation (the rows'
    token extents).

    Raises:
        InputError: a row with every token masked.
    """
    (qv, qm), (dv, dm) = query, doc
    dtype = torch.promote_types(torch.promote_types(qv.dtype, dv.dtype), torch.float32)
    qm, dm = qm != 0, dm != 0
    extents = []
    for m in (qm, dm):  # the last unmasked position + 1 of each row (0: none)
        extents.append((m * torch.arange(1, m.shape[1] + 1, device=m.device)).amax(1))
    q_len, d_len = (e.tolist() for e in torch.cat(extents).cpu().split([len(qm), len(dm)]))
    for side, lengths in (("query", q_len), ("doc", d_len)):
        if 0 in lengths:
            raise InputError(f"{side} row {lengths.index(0)} has every token masked; every row "
                             f"needs at least one unmasked token")
    weight = qm.to(dtype)
    if normalize_query:
        weight = weight / weight.sum(1, keepdim=True)
    bq, bd = block_shape(len(q_len), len(d_len), max(q_len), max(d_len), block_size,
                         max_block_elements)
    return BlockwiseMaxSim.apply(qv.to(dtype), weight, dv.to(dtype), dm, _spans(q_len, bq),
                                 _spans(d_len, bd))


def _take(emb: TokenEmbeddings, rows: Tensor | slice) -> TokenEmbeddings:
    return TokenEmbeddings(emb.values[rows], emb.mask[rows])


class MaxSimInfoNCE(TemperatureLoss):
    """InfoNCE over MaxSim (late-interaction) scores, for multi-vector retrievers (ColBERT,
    ColPali): :class:`bigbatch.InfoNCE` with ``score(q, d) = sum over q's tokens of the max
    over d's tokens of q_t . d_s`` in place of ``q . d``, computed in blocks (module
    docstring). Both towers return :class:`bigbatch.TokenEmbeddings` (``token_inputs``).

    Args:
        temperature, learnable_temperature, symmetric, max_scale, false_negative_margin: as
            in :class:`bigbatch.InfoNCE` (call :meth:`clamp_` after ``optimizer.step()``).
            Unnormalised scores grow with the query's token count; choose the temperature
            accordingly, or set ``normalize_query``.
        normalize_query: divide each score by the query's unmasked token count (ColPali's
            normalised scores).
        block_size: queries and documents per block (an int for both, or a pair); None: the
            automatic rule of the module docstring.
        max_block_elements: bound on one automatic block's similarities.

    Inputs (``loss_fn(query=q, doc=d, doc_ids=None)``):
        query: TokenEmbeddings of ``B`` rows; doc: of ``B * (1 + k)`` rows, laid out as for
        InfoNCE; the same embedding width, any token counts. doc_ids: as for InfoNCE.

    Returns:
        :class:`bigbatch.LossOutput` with InfoNCE's metrics (``pos_sim``, ``neg_sim``,
        ``inbatch_neg_sim``, ``hard_neg_sim`` for k > 0, ``margin``, ``accuracy``,
        ``temperature``, ``masked``), the similarities being MaxSim scores.

    Raises:
        ShapeError: an input that is not TokenEmbeddings of a consistent shape, a document
            count that is not a multiple of the query count.
        InputError: a row with every token masked.

    Example::

        loss_fn = bb.MaxSimInfoNCE(temperature=0.02, normalize_query=True)
        cache = bb.GradCache({"query": colbert, "doc": colbert}, loss_fn, chunk_size=32)

    References:
        Khattab and Zaharia 2020, "ColBERT: Efficient and Effective Passage Search via
        Contextualized Late Interaction over BERT"; Faysse et al. 2024, "ColPali".
    """

    token_inputs = ("query", "doc")

    def __init__(self, temperature: float = 0.07, learnable_temperature: bool = True,
                 symmetric: bool = False, max_scale: float = 100.0,
                 false_negative_margin: float | None = None, normalize_query: bool = False,
                 block_size: int | tuple[int, int] | None = None,
                 max_block_elements: int = MAX_BLOCK_ELEMENTS) -> None:
        pair = isinstance(block_size, (list, tuple))
        sizes = block_size if pair else [block_size]
        if block_size is not None and not (len(sizes) == 1 + pair and all(
                isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)):
            raise ConfigError(f"block_size must be a positive integer, a pair of them "
                              f"(queries, documents) or None, got {block_size!r}")
        if not (isinstance(max_block_elements, int) and max_block_elements > 0):
            raise ConfigError(f"max_block_elements must be a positive integer, got "
                              f"{max_block_elements!r}")
        super().__init__(temperature, learnable_temperature, max_scale, false_negative_margin)
        self.symmetric = symmetric
        self.normalize_query = normalize_query
        self.block_size = tuple(block_size) if pair else block_size
        self.max_block_elements = max_block_elements

    def memory_hint(self, rows: Mapping[str, int], dims: Mapping[str, int] | None = None,
                    tokens: Mapping[str, int] | None = None) -> int:
        """Bytes the loss holds at its peak beyond its inputs and their gradients, for
        ``rows`` queries and documents of ``tokens`` tokens each: one block of similarities,
        twice (its backward's peak, see the module docstring), and the dense loss over the
        ``B x N`` scores. ``GradCache(chunk_size="auto")`` reads it."""
        b, n = rows["query"], rows["doc"]
        tq, td = (tokens or {}).get("query", 1) or 1, (tokens or {}).get("doc", 1) or 1
        bq, bd = block_shape(b, n, tq, td, self.block_size, self.max_block_elements)
        return 2 * bq * bd * tq * td * 4 + loss_block_bytes(b, n, 0, masked=True)

    def scores(self, query: TokenEmbeddings, doc: TokenEmbeddings) -> Tensor:
        """The ``(queries, documents)`` MaxSim scores with this loss's options."""
        return maxsim_scores(query, doc, normalize_query=self.normalize_query,
                             block_size=self.block_size,
                             max_block_elements=self.max_block_elements)

    @staticmethod
    def _check(query: Any, doc: Any) -> None:
        for name, t in (("query", query), ("doc", doc)):
            if not isinstance(t, TokenEmbeddings):
                got = (f"a {tuple(t.shape)} tensor" if isinstance(t, Tensor)
                       else type(t).__name__)
                raise ShapeError(f"MaxSimInfoNCE input {name!r} must be TokenEmbeddings (one "
                                 f"vector per token), got {got}; both towers of a "
                                 f"late-interaction loss return bb.TokenEmbeddings")
            if t.values.dim() != 3 or tuple(t.mask.shape) != tuple(t.values.shape[:2]):
                raise ShapeError(f"MaxSimInfoNCE input {name!r} must have values (rows, "
                                 f"tokens, dim) and mask (rows, tokens), got "
                                 f"{tuple(t.values.shape)} and {tuple(t.mask.shape)}")
        if query.values.shape[2] != doc.values.shape[2]:
            raise ShapeError(f"query dim {query.values.shape[2]} != doc dim "
                             f"{doc.values.shape[2]}: the two towers must embed into the "
                             f"same space")

    def _ranked(self, scores: Tensor, pos: Tensor, scale: Tensor, col_ids: Tensor | None,
                row_ids: Tensor | None, group: int | None) -> tuple[Tensor, Tensor | None]:
        """Cross-entropy summed over the rows of ``scores`` (row r's positive is column
        ``pos[r]``), and, when ``group`` is given (row r's own documents are columns
        ``pos[r] .. pos[r] + group - 1``), the metric sums in the order of :meth:`_metrics`."""
        cols = torch.arange(scores.shape[1], device=scores.device)
        offset = cols[None, :] - pos[:, None]
        positive = scores.gather(1, pos[:, None])
        with torch.no_grad():
            drop = torch.zeros_like(offset, dtype=torch.bool)
            if col_ids is not None:
                drop |= col_ids[None, :] == row_ids[:, None]
            if self.false_negative_margin is not None:
                drop |= scores > positive + self.false_negative_margin
            drop &= offset != 0
        logits = (scores * scale).masked_fill(drop, float("-inf"))
        loss_sum = (logits.logsumexp(1) - positive.squeeze(1) * scale).sum()
        if group is None:
            return loss_sum, None
        with torch.no_grad():
            negative = (offset != 0) & ~drop
            hard = negative & (offset > 0) & (offset < group)
            sums = [positive.sum(), (logits.argmax(1) == pos).sum()]
            for kind in (negative, negative & ~hard, hard):
                sums += [scores.masked_fill(~kind, 0).sum(), kind.sum()]
            acc = torch.promote_types(scores.dtype, torch.float32)
            return loss_sum, torch.stack([v.to(acc) for v in sums])

    @staticmethod
    def _metrics(st: Tensor, scale: Tensor, queries: int, docs: int,
                 k: int) -> dict[str, Tensor]:
        pos, correct, neg, neg_n, inb, inb_n, hard, hard_n = st.unbind()
        metrics = {"pos_sim": pos / queries, "neg_sim": neg / neg_n.clamp_min(1),
                   "inbatch_neg_sim": inb / inb_n.clamp_min(1)}
        metrics["margin"] = metrics["pos_sim"] - metrics["neg_sim"]
        metrics.update(accuracy=correct / queries, temperature=1.0 / scale,
                       masked=queries * (docs - 1) - neg_n)
        if k > 0:
            metrics["hard_neg_sim"] = hard / hard_n.clamp_min(1)
        return {name: v.detach() for name, v in metrics.items()}

    def _compute(self, q_all: TokenEmbeddings, d_all: TokenEmbeddings, q_lo: int, b_local: int,
                 d_lo: int, b_total: int, k: int, ids: Tensor | None,
                 q_pos_all: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries ``q_lo:q_lo+b_local`` against every document (and, if symmetric, their
        positives against every query), divided by the total query count. Returns (part,
        metric sums, logit scale)."""
        dev = q_all.values.device
        pos = d_lo + torch.arange(b_local, device=dev) * (k + 1)
        scores = self.scores(_take(q_all, slice(q_lo, q_lo + b_local)), d_all)
        scale = self.logit_scale().to(scores.dtype)
        row_ids = None if ids is None else ids[pos]
        loss_sum, st = self._ranked(scores, pos, scale, ids, row_ids, k + 1)
        if self.symmetric:
            if b_local == len(q_all.values):  # every query is here: reuse the scores
                back = scores[:, pos].T
            else:
                back = self.scores(q_all, _take(d_all, pos)).T
            col_ids = None if ids is None else ids[q_pos_all]
            back_pos = q_lo + torch.arange(b_local, device=dev)
            back_sum, _ = self._ranked(back, back_pos, scale, col_ids, row_ids, None)
            loss_sum = 0.5 * (loss_sum + back_sum)
        return loss_sum / b_total, st, scale

    def forward(self, query: TokenEmbeddings, doc: TokenEmbeddings,
                doc_ids: Tensor | Sequence[Hashable] | None = None) -> LossOutput:
        self._check(query, doc)
        b, n = len(query.values), len(doc.values)
        k = hard_negative_count(b, n)
        dev = query.values.device
        ids = None if doc_ids is None else ids_tensor(doc_ids, n, dev)
        q_pos = torch.arange(b, device=dev) * (k + 1)
        loss, st, scale = self._compute(query, doc, 0, b, 0, b, k, ids, q_pos)
        return LossOutput(loss, self._metrics(st, scale, b, n, k))

    def cross_device_forward(self, gathered: "Gathered",
                             doc_ids: Tensor | Sequence[Hashable] | None = None) -> PartialLoss:
        """This rank's part of the global-batch loss, as in
        :meth:`bigbatch.InfoNCE.cross_device_forward`: its own queries against every rank's
        documents (and, if symmetric, its own positives against every query), divided by the
        global query count; the total and the metrics are the global batch's, summed in one
        all-reduce. ``doc_ids`` are this rank's."""
        q_all, d_all = gathered.reps["query"], gathered.reps["doc"]
        self._check(q_all, d_all)
        bq, nd = gathered.counts["query"], gathered.counts["doc"]
        ks = {hard_negative_count(b, n) for b, n in zip(bq, nd) if b}
        if len(ks) != 1:
            raise ShapeError(f"ranks disagree on the number of hard negatives: queries per rank "
                             f"{bq}, documents per rank {nd}; every rank needs B_r * (1 + k) "
                             f"documents with the same k")
        k = ks.pop()
        dev = q_all.values.device
        ids = None
        if doc_ids is not None:  # checked on every rank before the gather: all raise together
            local = (doc_ids.reshape(-1).tolist() if isinstance(doc_ids, Tensor)
                     else list(doc_ids))
            mine = nd[gathered.rank]
            gathered.raise_together(None if len(local) == mine else ShapeError(
                f"doc_ids has {len(local)} entries but there are {mine} documents; give one id "
                f"per document"))
            ids = ids_tensor(gathered.gather_values("doc", local), sum(nd), dev)
        q_pos_all = torch.cat([lo + torch.arange(b, device=dev) * (k + 1)
                               for lo, b in zip(gathered.offsets["doc"], bq)])
        rank, failure = gathered.rank, None
        try:  # an out-of-memory in a block on one rank: all ranks raise in the all-reduce
            part, st, scale = self._compute(q_all, d_all, gathered.offsets["query"][rank],
                                            bq[rank], gathered.offsets["doc"][rank], sum(bq),
                                            k, ids, q_pos_all)
            stats = torch.cat([part.detach().reshape(1).to(st.dtype), st])
        except Exception as e:  # noqa: BLE001 - shared by all_reduce_sum, which raises it
            failure = e
            dtype = torch.promote_types(q_all.values.dtype, torch.float32)
            stats = torch.zeros(9, dtype=dtype, device=dev)  # the loss and 8 metric sums
        summed = gathered.all_reduce_sum(stats, failure)
        return PartialLoss(part, summed[0], self._metrics(summed[1:], scale, sum(bq), sum(nd), k))
