"""Contrastive losses for embedding training: InfoNCE with hard negatives, a learnable
temperature, false-negative masking, streamed by default: the logits are computed in row
blocks of bounded size (:mod:`bigbatch.losses.blockwise`), so memory is O(block x N), not O(B x N).

Layout of a batch (the same everywhere in bigbatch): ``B`` queries and ``B * (1 + k)``
documents laid out ``[pos_0, neg_0_1 .. neg_0_k, pos_1, neg_1_1 .. neg_1_k, ...]``;
query ``i``'s positive is document ``i * (1 + k)`` and every other document in the
batch is one of its negatives. ``k`` is inferred from the sizes.

For query ``i`` with similarities ``s_ij = q_i . d_j`` (cosine similarity when the
towers L2-normalise) and logit scale ``t = 1 / temperature``::

    loss_i = -log( exp(t s_{i,p(i)}) / sum_{j not masked} exp(t s_ij) )

and the loss is the mean over queries. With ``symmetric=True`` the document-to-query
direction over the positives is added (each positive document against all queries)
and the two directions are averaged, as in CLIP. There is no hidden factor: the loss
is exactly the mean cross-entropy above, whatever the batch, block or chunk size.

``extra_negatives=("qq", "dd")`` adds, as Qwen3-Embedding trains, the similarities of query
``i`` to the other queries (``qq``) and of its positive to the other documents (``dd``) to
the denominator of row ``i``::

    loss_i = -log( exp(t s_{i,p(i)}) / (sum_j exp(t q_i.d_j) + sum_{j != i} exp(t q_i.q_j)
                                        + sum_{j != p(i)} exp(t d_{p(i)}.d_j)) )

Two optional terms ride on the same pass: a frozen guide model's embeddings
(``guide_query``, ``guide_doc``) mask the negatives it scores above the positive
(:mod:`bigbatch.losses.guided`, GISTEmbed), and teacher scores (``teacher_scores``) add a
distillation term by weight (:mod:`bigbatch.losses.distill`, KL or MarginMSE).

``queued`` (:class:`~bigbatch.losses.queue.QueuedDocs`, earlier steps' document embeddings)
adds columns to every query's denominator, as constants: no gradient flows into them. A
queued document is left out of query ``i``'s negatives where its id equals the id of ``i``'s
positive, or where it was the positive of a query whose id is ``query_ids[i]``.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..errors import ConfigError, InputError, ShapeError
from .base import LossOutput, PartialLoss, TemperatureLoss, ids_tensor
from .blockwise import Exclusions, cross_entropy_sum
from .distill import Distillation, teacher_tensor
from .guided import GuideRule, check_guide, count_guided
from .layout import (
    MAX_BLOCK_LOGITS,
    STATS,
    check_blocking,
    extra_negatives_of,
    hard_negative_count,
    loss_block_bytes,
    rows_per_block,
)
from .queue import QueuedDocs, queue_codes

if TYPE_CHECKING:
    from ..engine.distributed import Gathered

__all__ = ["InfoNCE"]


class _QueueColumns(NamedTuple):
    """The queued documents as columns of one step: embeddings, their id codes (in the
    batch's numbering; None: no ids), their query codes and this process's rows' query codes
    (None: no query ids)."""

    doc: Tensor
    ids: Tensor | None
    groups: Tensor | None
    row_groups: Tensor | None


_GUIDE_AND_QUEUE = ("a guide model (guided false-negative filtering) cannot be combined with a "
                    "negative queue yet (the queue keeps no guide embeddings); use one of them")

# the sums InfoNCE keeps beside the STATS of blockwise: negatives the guide masked (forward
# direction) and the distillation objective's sum over queries
EXTRA_STATS = ("guide_masked", "distill")

class InfoNCE(TemperatureLoss):
    """InfoNCE (multiple-negatives ranking) loss with in-batch and hard negatives.

    Args:
        temperature: initial (or fixed) temperature; the logit scale is ``1/temperature``.
        learnable_temperature: learn the temperature through a :class:`LogitScale`
            (the module's one trainable parameter); if False the module has none.
        symmetric: also score each positive document against all queries (document-to-query
            direction) and average the two directions.
        max_scale: upper bound on the logit scale applied by ``clamp_()``.
        false_negative_margin: if set, mask a negative whose similarity exceeds the
            positive's similarity plus this margin (ms-swift's fake-negative rule uses 0.1).
            The selection is made on detached similarities.
        block_size: rows per block of the streamed loss. None (the default): chosen so that
            a block holds at most ``max_block_logits`` logits, i.e.
            ``max(1, max_block_logits // N)`` rows against ``N`` columns. Each block's
            logits exist only while it is computed and are recomputed, one block at a time,
            in the backward pass, so peak memory is O(block x N), not O(B x N). 0: the
            dense computation (the same as ``dense=True``). Results equal the dense
            computation to round-off.
        dense: compute all ``B x N`` logits at once through autograd (the reference).
        max_block_logits: bound on one automatic block's logits (default 2**22 = 4,194,304,
            16 MiB in float32).
        extra_negatives: ``("qq",)``, ``("dd",)`` or ``("qq", "dd")`` (or "qq,dd"): add the
            query's similarities to the other queries (qq) and its positive's similarities
            to the other documents (dd, hard negatives included) to the query's softmax
            denominator, as Qwen3-Embedding trains (:data:`EXTRA_NEGATIVES`). Same-id
            documents are left out of dd as they are of the documents; the
            false-negative margin applies to the document and query columns, not to dd.
            Streamed, and across ranks, like the rest (the row is ``[q_i, d_{p(i)}]``
            against ``[d_j, 0]``, ``[q_j, 0]`` and ``[0, d_j]``). The symmetric direction
            is unchanged. The metrics then count these columns among the negatives.
        in_batch_negatives: score each query against every document of the (global) batch
            (the default); False: against its own positive and hard negatives only, for
            classification-style data whose labels repeat across a batch (with
            ``symmetric``, the document-to-query direction then has each positive's own
            query alone, and adds nothing). An attribute a training loop may change between
            steps (a source of a mix at a time). Not with ``extra_negatives``.
        guide_margin, guide_margin_type: with ``guide_query`` and ``guide_doc`` given, a
            negative whose guide similarity to the query exceeds the positive's minus
            ``guide_margin`` (``"absolute"``) or times ``1 - guide_margin`` (``"relative"``)
            is masked (GISTEmbed; :mod:`bigbatch.losses.guided`).
        distill: ``"kl"`` or ``"margin-mse"``: add a distillation term against the teacher
            scores given as ``teacher_scores`` (:mod:`bigbatch.losses.distill`); None: none.
        distill_weight: the loss is ``InfoNCE + distill_weight * distillation``.
        teacher_temperature: the teacher softmax's temperature (``kl``); None: ``temperature``.

    Inputs (``loss_fn(query=q, doc=d, doc_ids=None, guide_query=None, guide_doc=None,
    teacher_scores=None)``):
        query: ``(B, D)`` query embeddings.
        doc: ``(B * (1 + k), D)`` document embeddings, ``[pos_0, neg_0_1..neg_0_k, pos_1, ...]``.
        doc_ids: optional, one id per document (tensor or hashables). A document other
            than query i's positive that has the same id as that positive is masked out of
            query i's negatives (the same passage appearing twice in a batch is no negative).
        guide_query, guide_doc: optional, a frozen guide model's ``(B, G)`` and
            ``(B * (1 + k), G)`` embeddings of the same rows (any width ``G``, no gradient):
            guided false-negative filtering, by ``guide_margin``.
        teacher_scores: ``(B, 1 + k)`` teacher scores of each query's positive and hard
            negatives, in the documents' order; required with ``distill``.
        queued: optional :class:`~bigbatch.losses.queue.QueuedDocs`, earlier steps'
            document embeddings (``(M, D)``, with ids): extra negatives of every query, as
            constants (a queue: :class:`~bigbatch.losses.queue.NegativeQueue`). One whose id
            is a query's positive's id (``doc_ids``), or that was the positive of a query
            with the query's id (``query_ids``), is no negative of that query. The same on
            every rank under ``cross_device_forward``. Not with a guide, ``extra_negatives``
            or ``in_batch_negatives=False``.
        query_ids: optional, one id per query (this process's), compared with the queued
            documents' ``query_ids`` only.

    Returns:
        :class:`LossOutput` ``(loss, metrics)``; metrics are detached 0-d tensors:
        ``pos_sim`` (mean positive similarity), ``neg_sim`` (mean over all unmasked
        negatives), ``inbatch_neg_sim``, ``hard_neg_sim`` (only when k > 0), ``margin``
        (``pos_sim - neg_sim``), ``accuracy`` (top-1, query to document), ``temperature``,
        ``masked`` (number of negatives masked out, by any rule), ``guide_masked`` (those the
        guide masked, with a guide), ``distill`` (the distillation term, unweighted) and
        ``queued`` (the queued documents, with ``queued``; they count among the negatives
        of ``neg_sim`` and ``inbatch_neg_sim``).

    Example::

        loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=True)
        loss, metrics = loss_fn(query=q, doc=d)
        loss.backward(); optimizer.step(); loss_fn.clamp_()

    References:
        van den Oord et al. 2018, "Representation Learning with Contrastive Predictive Coding";
        Radford et al. 2021 (CLIP, learnable temperature and symmetric loss);
        Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup".
    """

    def __init__(self, temperature: float = 0.07, learnable_temperature: bool = True,
                 symmetric: bool = False, max_scale: float = 100.0,
                 false_negative_margin: float | None = None,
                 block_size: int | None = None, dense: bool = False,
                 max_block_logits: int = MAX_BLOCK_LOGITS,
                 extra_negatives: str | Sequence[str] | None = (),
                 in_batch_negatives: bool = True, *, guide_margin: float = 0.0,
                 guide_margin_type: str = "absolute", distill: str | None = None,
                 distill_weight: float = 1.0, teacher_temperature: float | None = None) -> None:
        check_blocking(block_size, dense, max_block_logits)
        super().__init__(temperature, learnable_temperature, max_scale, false_negative_margin)
        self.symmetric = symmetric
        self.in_batch_negatives = in_batch_negatives
        self.block_size = block_size
        self.dense = dense
        self.max_block_logits = max_block_logits
        self.extra_negatives = extra_negatives_of(extra_negatives)
        self.guide_rule = GuideRule(guide_margin, guide_margin_type)
        self.distillation = None if distill is None else Distillation(
            distill, distill_weight,
            temperature if teacher_temperature is None else teacher_temperature)

    def memory_hint(self, rows: Mapping[str, int], dims: Mapping[str, int] | None = None,
                    tokens: Mapping[str, int] | None = None) -> int:
        """Bytes the loss holds at its peak beyond its inputs and their gradients, for
        ``rows`` queries and documents (as the loss sees them: the global batch across
        ranks): one block of logits and its mask (:func:`~bigbatch.losses.layout.loss_block_bytes`;
        the symmetric direction's blocks come after the other's). ``GradCache(chunk_size=
        "auto")`` reads it; ``rows["queued"]``: a negative queue's documents, extra columns)."""
        b, n = rows["query"], rows["doc"]
        cols = n + (b if "qq" in self.extra_negatives else 0) + \
            (n if "dd" in self.extra_negatives else 0) + rows.get("queued", 0)
        blocks = dict(block_size=self.block_size, dense=self.dense,
                      max_block_logits=self.max_block_logits, masked=True)
        out = loss_block_bytes(b, cols, **blocks)
        if self.symmetric:
            out = max(out, loss_block_bytes(n, b, **blocks))
        return out

    def _direction(self, rows: Tensor, cols: Tensor, pos: Tensor, scale: Tensor, group: int,
                   col_ids: Tensor | None, row_ids: Tensor | None,
                   with_stats: bool, pairs: Tensor | None = None,
                   margin_cols: int | None = None,
                   guides: tuple[Tensor, Tensor] | None = None,
                   groups: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """Sum of the per-row losses and stats of one direction, streamed or dense
        (``guides``: the guide's embeddings of the rows and of the columns; ``groups``: the
        rows' and the columns' query codes, equal ones excluded)."""
        block = rows_per_block(cols.shape[0], self.block_size, self.dense, self.max_block_logits)
        g_rows, g_cols = guides if guides is not None else (None, None)
        exclude = Exclusions(col_ids=col_ids, row_ids=row_ids, margin=self.false_negative_margin,
                             pairs=pairs, margin_cols=margin_cols,
                             guide_rows=g_rows, guide_cols=g_cols, guide_rule=self.guide_rule,
                             own_group=None if self.in_batch_negatives else group,
                             row_groups=None if groups is None else groups[0],
                             col_groups=None if groups is None else groups[1])
        return cross_entropy_sum(rows, cols, pos, scale, block=block, group=group,
                                 exclude=exclude, with_stats=with_stats)

    def _extra_columns(self, q_all: Tensor, d_all: Tensor, q_lo: int, b_local: int,
                       pos: Tensor, ids_all: Tensor | None
                       ) -> tuple[Tensor, Tensor, Tensor | None, Tensor, int | None]:
        """This rank's rows and all columns with the :attr:`extra_negatives` terms: rows
        ``[q_i, d_{p(i)}]`` against ``[d_j, 0]``, ``[q_j, 0]`` (qq) and ``[0, d_j]`` (dd), so
        one product gives every term (without dd the rows stay ``q_i``, no zeros). Returns
        (rows, columns, column ids, the (row, column) pairs of each row's own query and own
        positive among the extra columns, the columns the margin applies to)."""
        qq, dd = "qq" in self.extra_negatives, "dd" in self.extra_negatives
        n, b_total = d_all.shape[0], q_all.shape[0]
        dev = q_all.device
        rows = q_all[q_lo:q_lo + b_local]
        cols = [d_all, q_all] if qq else [d_all]
        if dd:
            rows = torch.cat([rows, d_all[pos]], dim=1)
            cols = [torch.cat([c, torch.zeros_like(c)], dim=1) for c in cols]
            cols.append(torch.cat([torch.zeros_like(d_all), d_all], dim=1))
        local = torch.arange(b_local, device=dev)
        pairs, col_ids = [], None
        if ids_all is not None:  # queries get ids no document has; dd columns the documents'
            fresh = ids_all.max() + 1 + torch.arange(b_total, device=dev)
            col_ids = torch.cat([ids_all, fresh] if qq else [ids_all])
        if qq:
            pairs.append(torch.stack([local, n + q_lo + local], dim=1))
        if dd:
            pairs.append(torch.stack([local, n + b_total * qq + pos], dim=1))
            if col_ids is not None:
                col_ids = torch.cat([col_ids, ids_all])
        margin_cols = n + b_total * qq if dd else None
        return rows, torch.cat(cols), col_ids, torch.cat(pairs), margin_cols

    def _extra_count(self, b_total: int, n_total: int) -> int:
        """The extra columns of a row (its own query and positive among them)."""
        return b_total * ("qq" in self.extra_negatives) + n_total * ("dd" in self.extra_negatives)

    @staticmethod
    def _queue_columns(d_all: Tensor, ids_all: Tensor | None, queue: _QueueColumns,
                       dtype: torch.dtype
                       ) -> tuple[Tensor, Tensor | None, tuple[Tensor, Tensor] | None]:
        """The documents then the queued ones as columns, with their ids (queued documents
        without ids get ids no document has) and the rows' and columns' query codes (the
        batch's documents -1: matched by no row)."""
        cols = torch.cat([d_all, queue.doc.to(device=d_all.device, dtype=dtype)])
        col_ids = None
        if ids_all is not None:
            q_ids = queue.ids if queue.ids is not None else \
                ids_all.max() + 1 + torch.arange(len(queue.doc), device=d_all.device)
            col_ids = torch.cat([ids_all, q_ids])
        groups = None
        if queue.groups is not None:
            groups = (queue.row_groups, torch.cat([queue.groups.new_full((d_all.shape[0],), -1),
                                                   queue.groups]))
        return cols, col_ids, groups

    def _check_queue(self, queued: QueuedDocs | None, width: int) -> None:
        """Check ``queued`` against the loss's settings and the embeddings' ``width``.

        Raises:
            ConfigError: a queue with ``extra_negatives`` or ``in_batch_negatives=False``.
            ShapeError: queued documents of another width, or ids of another length.
        """
        if queued is None:
            return
        if not isinstance(queued, QueuedDocs):
            raise InputError(f"queued must be a bigbatch.losses.queue.QueuedDocs, got "
                             f"{type(queued).__name__}")
        if self.extra_negatives:
            raise ConfigError("a negative queue cannot be combined with extra_negatives "
                              "(qq/dd) yet; use one of them")
        if not self.in_batch_negatives:
            raise ConfigError("a negative queue adds other documents as negatives; it does not "
                              "apply with in_batch_negatives=False (a query scored against its "
                              "own documents only)")
        queued.check(width)

    @staticmethod
    def _coded_queue(queued: QueuedDocs, doc_ids: Tensor | Sequence[Hashable] | None, n: int,
                     query_ids: Tensor | Sequence[Hashable] | None, b: int,
                     device: torch.device) -> tuple[Tensor | None, _QueueColumns]:
        """The documents' id codes (``n`` of them, the gathered batch's under
        cross_device_forward) and the queue's columns, coded in one numbering with them;
        ``query_ids``: this process's ``b`` queries'."""
        ids_all, q_ids = queue_codes(doc_ids, queued.ids, n, device, "doc_ids")
        if ids_all is None and doc_ids is not None:  # the queue has no ids: none matches
            ids_all = ids_tensor(doc_ids, n, device, "doc_ids")
        rows, groups = queue_codes(query_ids, queued.query_ids, b, device, "query_ids")
        return ids_all, _QueueColumns(queued.doc.detach(), q_ids, groups, rows)

    def _compute(self, q_all: Tensor, d_all: Tensor, q_lo: int, b_local: int, d_lo: int,
                 b_total: int, k: int, ids_all: Tensor | None,
                 q_pos_all: Tensor, guides_all: tuple[Tensor, Tensor] | None = None,
                 teacher: Tensor | None = None, queue: _QueueColumns | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
        """This process's part of the loss: rows ``q_lo:q_lo+b_local`` of the queries against all
        documents (and, if symmetric, their positives against all queries), divided by the
        total query count; plus the distillation term of these queries' groups against
        ``teacher`` (this process's ``(b_local, 1 + k)`` scores). ``guides_all``: the guide's
        embeddings of all queries and all documents; ``queue``: the queued documents, extra
        columns of the forward direction. Returns (part, the :data:`STATS` sums then the
        :data:`EXTRA_STATS` sums, logit scale)."""
        group = k + 1
        dtype = torch.promote_types(torch.promote_types(q_all.dtype, d_all.dtype), torch.float32)
        q_all, d_all = q_all.to(dtype), d_all.to(dtype)
        scale = self.logit_scale().to(dtype)
        dev = q_all.device
        pos = d_lo + torch.arange(b_local, device=dev) * group
        row_ids = None if ids_all is None else ids_all[pos]
        g_q = g_d = None
        if guides_all is not None:
            if self.extra_negatives:
                raise ConfigError("a guide model (guided false-negative filtering) cannot be "
                                  "combined with extra_negatives (qq/dd) yet; use one of them")
            g_q, g_d = (g.to(device=dev, dtype=dtype) for g in guides_all)
        if self.extra_negatives:
            rows, cols, col_ids, pairs, margin_cols = self._extra_columns(
                q_all, d_all, q_lo, b_local, pos, ids_all)
            loss_sum, st = self._direction(rows, cols, pos, scale, group, col_ids, row_ids,
                                           True, pairs, margin_cols)
        elif queue is not None:
            cols, col_ids, groups = self._queue_columns(d_all, ids_all, queue, dtype)
            loss_sum, st = self._direction(q_all[q_lo:q_lo + b_local], cols, pos, scale, group,
                                           col_ids, row_ids, True, groups=groups)
        else:
            loss_sum, st = self._direction(q_all[q_lo:q_lo + b_local], d_all, pos, scale, group,
                                           ids_all, row_ids, True,
                                           guides=None if g_q is None
                                           else (g_q[q_lo:q_lo + b_local], g_d))
        if self.symmetric:
            back_pos = q_lo + torch.arange(b_local, device=dev)
            col_ids = None if ids_all is None else ids_all[q_pos_all]
            back_sum, _ = self._direction(d_all[pos], q_all, back_pos, scale, 1, col_ids,
                                          row_ids, False,
                                          guides=None if g_q is None else (g_d[pos], g_q))
            loss_sum = 0.5 * (loss_sum + back_sum)
        part = loss_sum / b_total
        extra = st.new_zeros(len(EXTRA_STATS))
        if g_q is not None:
            block = rows_per_block(d_all.shape[0], self.block_size, self.dense,
                                   self.max_block_logits)
            extra[0] = count_guided(g_q[q_lo:q_lo + b_local], g_d, pos, self.guide_rule, block)
        if self.distillation is not None:
            distill_sum = self.distillation.sum(q_all[q_lo:q_lo + b_local],
                                                d_all[d_lo:d_lo + b_local * group],
                                                teacher.to(dtype), scale)
            part = part + self.distillation.weight * distill_sum / b_total
            extra[1] = distill_sum.detach()
        return part, torch.cat([st, extra]), scale

    def _extra_metrics(self, extra: Tensor, b_total: int, guided: bool) -> dict[str, Tensor]:
        """The metrics of the guide and of distillation from the :data:`EXTRA_STATS` sums."""
        out = {}
        if guided:
            out["guide_masked"] = extra[0].detach()
        if self.distillation is not None:
            out["distill"] = (extra[1] / b_total).detach()
        return out

    def _local_extras(self, b: int, n: int, k: int, dtype: torch.dtype, device: torch.device,
                      guide_query: Tensor | None, guide_doc: Tensor | None,
                      teacher_scores: Tensor | Sequence[Sequence[float]] | None
                      ) -> tuple[tuple[Tensor, Tensor] | None, Tensor | None]:
        """This process's guide embeddings and teacher scores, checked: ``(guides, teacher)``.

        Raises:
            InputError: one guide without the other, teacher scores without ``distill`` or
                ``distill`` without them.
            ShapeError: guides or teacher scores of the wrong shape.
            NonFiniteError: NaN or infinite teacher scores.
        """
        guides = None
        if (guide_query is None) != (guide_doc is None):
            raise InputError("give both guide_query and guide_doc (the guide model's "
                             "embeddings of the queries and of the documents), or neither")
        if guide_query is not None:
            guides = (check_guide(guide_query, b, "guide_query"),
                      check_guide(guide_doc, n, "guide_doc"))
            if guides[0].shape[1] != guides[1].shape[1]:
                raise ShapeError(f"guide_query is {guides[0].shape[1]} wide and guide_doc "
                                 f"{guides[1].shape[1]}: the guide must embed both sides into "
                                 f"one space")
        teacher = None
        if self.distillation is None and teacher_scores is not None:
            raise InputError("teacher_scores were given but the loss does not distil: pass "
                             "distill='kl' or 'margin-mse' (--distill)")
        if self.distillation is not None:
            if teacher_scores is None:
                raise InputError(f"distill={self.distillation.objective!r} needs teacher_scores "
                                 f"(the records' pos_score and neg_scores)")
            teacher = teacher_tensor(teacher_scores, b, k + 1, device, dtype)
        return guides, teacher

    @staticmethod
    def _metrics(st: Tensor, scale: Tensor, b_total: int, n_total: int,
                 k: int, own: int = 0) -> dict[str, Tensor]:
        """The metrics from the summed stats; ``n_total`` columns per row, ``own`` of them
        the row's own query or positive among the extra columns (never negatives)."""
        stats = dict(zip(STATS, st.unbind()))
        pos_sim = stats["pos_sum"] / b_total
        neg_sim = stats["neg_sum"] / stats["neg_n"].clamp_min(1)
        metrics = {
            "pos_sim": pos_sim,
            "neg_sim": neg_sim,
            "inbatch_neg_sim": stats["inb_sum"] / stats["inb_n"].clamp_min(1),
            "margin": pos_sim - neg_sim,
            "accuracy": stats["correct"] / b_total,
            "temperature": 1.0 / scale,
            "masked": (b_total * (n_total - 1 - own)) - stats["neg_n"],
        }
        if k > 0:
            metrics["hard_neg_sim"] = stats["hard_sum"] / stats["hard_n"].clamp_min(1)
        return {key: v.detach() for key, v in metrics.items()}

    @staticmethod
    def _check(query: Tensor, doc: Tensor) -> None:
        for name, t in (("query", query), ("doc", doc)):
            if t.dim() != 2:
                raise ShapeError(f"InfoNCE input {name!r} must be 2-D (rows, dim), got shape "
                                 f"{tuple(t.shape)}")
        if query.shape[1] != doc.shape[1]:
            raise ShapeError(f"query dim {query.shape[1]} != doc dim {doc.shape[1]}: the two "
                             f"towers must embed into the same space")

    def forward(self, query: Tensor, doc: Tensor,
                doc_ids: Tensor | Sequence[Hashable] | None = None,
                guide_query: Tensor | None = None, guide_doc: Tensor | None = None,
                teacher_scores: Tensor | Sequence[Sequence[float]] | None = None,
                queued: QueuedDocs | None = None,
                query_ids: Tensor | Sequence[Hashable] | None = None) -> LossOutput:
        self._check(query, doc)
        self._check_queue(queued, doc.shape[1])
        b, n = query.shape[0], doc.shape[0]
        k = hard_negative_count(b, n)
        queue = None
        if queued is not None:
            ids, queue = self._coded_queue(queued, doc_ids, n, query_ids, b, query.device)
        else:
            ids = None if doc_ids is None else ids_tensor(doc_ids, n, query.device, "doc_ids")
        q_pos = torch.arange(b, device=query.device) * (k + 1)
        guides, teacher = self._local_extras(b, n, k, torch.float64, query.device, guide_query,
                                             guide_doc, teacher_scores)
        if guides is not None and queue is not None:
            raise ConfigError(_GUIDE_AND_QUEUE)
        loss, st, scale = self._compute(query, doc, 0, b, 0, b, k, ids, q_pos, guides, teacher,
                                        queue)
        m = 0 if queue is None else len(queue.doc)
        metrics = self._metrics(st[:len(STATS)], scale, b, n + m + self._extra_count(b, n), k,
                                len(self.extra_negatives))
        metrics.update(self._extra_metrics(st[len(STATS):], b, guides is not None))
        if queue is not None:
            metrics["queued"] = torch.tensor(float(m), device=loss.device)
        return LossOutput(loss, metrics)

    def cross_device_forward(self, gathered: "Gathered",
                             doc_ids: Tensor | Sequence[Hashable] | None = None,
                             guide_query: Tensor | None = None, guide_doc: Tensor | None = None,
                             teacher_scores: Tensor | Sequence[Sequence[float]] | None = None,
                             queued: QueuedDocs | None = None,
                             query_ids: Tensor | Sequence[Hashable] | None = None
                             ) -> PartialLoss:
        """This rank's part of the global-batch loss (see :mod:`bigbatch.engine.distributed`).

        ``gathered.reps`` holds the global ``query`` and ``doc`` embeddings; this rank scores
        its own queries against every document of every rank (labels offset by rank) and,
        if symmetric, its own positives against every query. Dividing by the global query
        count makes the parts sum to the global loss. Metrics and the total are summed over
        ranks in one all-reduce, so they are the global batch's, identical on every rank.
        ``guide_query`` and ``guide_doc`` are this rank's rows, gathered like the embeddings
        (without gradient); ``teacher_scores`` are this rank's queries'. ``queued`` is the
        same on every rank (the global batch's earlier documents), ``query_ids`` this rank's
        queries'.
        """
        q_all, d_all = gathered.reps["query"], gathered.reps["doc"]
        self._check(q_all, d_all)
        self._check_queue(queued, d_all.shape[1])
        bq, nd = gathered.counts["query"], gathered.counts["doc"]
        ks = {hard_negative_count(b, n) if b else -1 for b, n in zip(bq, nd)} - {-1}
        if len(ks) != 1:
            raise ShapeError(f"ranks disagree on the number of hard negatives: queries per rank "
                             f"{bq}, documents per rank {nd}; every rank needs B_r * (1 + k) "
                             f"documents with the same k")
        k = ks.pop()
        group = k + 1
        dev = q_all.device
        ids_all: Tensor | list | None = None
        if doc_ids is not None:
            local_n = nd[gathered.rank]
            local: Tensor | list = []
            failure = None
            try:  # checked on every rank before the gather, so that all ranks raise together
                if isinstance(doc_ids, Tensor):
                    local = ids_tensor(doc_ids, local_n, dev, "doc_ids")
                else:
                    local = list(doc_ids)
                    if len(local) != local_n:
                        raise ShapeError(f"doc_ids has {len(local)} entries but there are "
                                         f"{local_n} documents; give one id per document")
            except Exception as e:  # noqa: BLE001 - raised on every rank by raise_together
                failure = e
            kinds = gathered.raise_together(failure, [int(isinstance(local, Tensor))])
            if len(set(kinds[:, 0].tolist())) > 1:
                raise ShapeError(f"doc_ids is a tensor on rank(s) "
                                 f"{[r for r, k in enumerate(kinds[:, 0].tolist()) if k]} and a "
                                 f"list on the others; give the same kind on every rank")
            ids_all = gathered.gather_values("doc", local)
            if not isinstance(local, Tensor) and queued is None:  # (with a queue: coded below)
                ids_all = ids_tensor(ids_all, sum(nd), dev, "doc_ids")
        q_pos_all = torch.cat([d_off + torch.arange(b, device=dev) * group
                               for d_off, b in zip(gathered.offsets["doc"], bq)])
        rank = gathered.rank
        guides, teacher = self._gathered_extras(gathered, k, guide_query, guide_doc,
                                                teacher_scores)
        if guides is not None and queued is not None:
            raise ConfigError(_GUIDE_AND_QUEUE)
        failure, stats, queue = None, None, None
        try:  # an out-of-memory in the logits on one rank: all ranks raise in the all-reduce
            if queued is not None:  # bad query_ids on one rank: all ranks raise there too
                ids_all, queue = self._coded_queue(queued, ids_all, sum(nd), query_ids, bq[rank],
                                                   dev)
            part, st, scale = self._compute(q_all, d_all, gathered.offsets["query"][rank],
                                            bq[rank], gathered.offsets["doc"][rank], sum(bq), k,
                                            ids_all, q_pos_all, guides, teacher, queue)
            stats = torch.cat([part.detach().reshape(1), st])
        except Exception as e:  # noqa: BLE001 - shared by all_reduce_sum, which raises it
            failure = e
            dtype = torch.promote_types(torch.promote_types(q_all.dtype, d_all.dtype),
                                        torch.float32)
            stats = torch.zeros(1 + len(STATS) + len(EXTRA_STATS), dtype=dtype, device=dev)
        summed = gathered.all_reduce_sum(stats, failure)
        b_all, n_all = sum(bq), sum(nd)
        m = 0 if queued is None else len(queued)
        metrics = self._metrics(summed[1:1 + len(STATS)], scale, b_all,
                                n_all + m + self._extra_count(b_all, n_all), k,
                                len(self.extra_negatives))
        metrics.update(self._extra_metrics(summed[1 + len(STATS):], b_all, guides is not None))
        if queued is not None:
            metrics["queued"] = torch.tensor(float(m), device=dev)
        return PartialLoss(part, summed[0], metrics)

    def _gathered_extras(self, gathered: "Gathered", k: int, guide_query: Tensor | None,
                         guide_doc: Tensor | None,
                         teacher_scores: Tensor | Sequence[Sequence[float]] | None
                         ) -> tuple[tuple[Tensor, Tensor] | None, Tensor | None]:
        """Every rank's guide embeddings (gathered, no gradient) and this rank's teacher
        scores, checked on every rank first, so that all ranks raise together."""
        if guide_query is None and guide_doc is None and teacher_scores is None \
                and self.distillation is None:
            return None, None
        rank = gathered.rank
        b, n = gathered.counts["query"][rank], gathered.counts["doc"][rank]
        dev = gathered.reps["query"].device
        local, failure = (None, None), None
        try:
            local = self._local_extras(b, n, k, torch.float64, dev, guide_query, guide_doc,
                                       teacher_scores)
        except Exception as e:  # noqa: BLE001 - raised on every rank by raise_together
            failure = e
        widths = gathered.raise_together(failure, [-1 if local[0] is None else
                                                   local[0][0].shape[1]])[:, 0].tolist()
        if len(set(widths)) > 1:
            raise ShapeError(f"the guide embeddings differ in width on the ranks ({widths}); "
                             f"every rank must run the same guide model")
        guides, teacher = local
        if guides is not None:
            guides = (gathered.gather_values("query", guides[0].contiguous()),
                      gathered.gather_values("doc", guides[1].contiguous()))
        return guides, teacher

