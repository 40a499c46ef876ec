"""InfoNCE against a fixed corpus: each query scored against every document of a corpus
embedded beforehand (:class:`CorpusInfoNCE`), its positive given by index."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import ShapeError
from .base import LossOutput, PartialLoss, TemperatureLoss
from .blockwise import Exclusions, cross_entropy_sum
from .layout import MAX_BLOCK_LOGITS, check_blocking, loss_block_bytes, rows_per_block

if TYPE_CHECKING:
    from ..engine.distributed import Gathered

__all__ = ["CorpusInfoNCE"]


class CorpusInfoNCE(TemperatureLoss):
    """InfoNCE of each query against a fixed, precomputed corpus of document embeddings.

    For query-side tuning: the document tower is frozen, so the whole corpus is embedded
    once and every query sees every document as a negative (not only its batch's).

    Args:
        corpus: ``(N, dim)`` document embeddings (constant; kept as a plain attribute, not
            saved with the loss's state).
        temperature, learnable_temperature, max_scale: as in :class:`InfoNCE`.
        block_size, dense, max_block_logits: as in :class:`InfoNCE`; by default the queries
            are scored against the corpus in blocks of at most ``max_block_logits`` logits.

    Inputs:
        query: ``(B, dim)`` query embeddings.
        positive_index: ``(B,)`` row of each query's positive in ``corpus``.
        other_positives: optional ``(M, 2)`` pairs ``(query row, corpus row)`` of documents
            also relevant to that query: masked out of its negatives.

    Under ``torch.distributed`` with the engine's default ``cross_device=True``, each rank
    passes its own queries' ``positive_index`` (and ``other_positives``, local rows) and the
    loss is that of the global batch (:meth:`cross_device_forward`).

    Example::

        loss_fn = CorpusInfoNCE(doc_emb)
        cache = GradCache({"query": encoder}, loss_fn, chunk_size=32)
        cache.step(query=batch, positive_index=torch.tensor(pos_rows))

    References:
        van den Oord et al., "Representation Learning with Contrastive Predictive Coding"
        (2018); the query-side-tune mode of Qwen3-VL-Embedding's training pipeline.
    """

    fixed_embeddings = ("corpus",)  # truncated by bigbatch.Matryoshka, as the queries are

    def __init__(self, corpus: Tensor, temperature: float = 0.07,
                 learnable_temperature: bool = True, max_scale: float = 100.0,
                 block_size: int | None = None, dense: bool = False,
                 max_block_logits: int = MAX_BLOCK_LOGITS) -> None:
        check_blocking(block_size, dense, max_block_logits)
        if corpus.dim() != 2 or corpus.shape[0] == 0:
            raise ShapeError(f"corpus must be a non-empty (N, dim) tensor, got shape "
                             f"{tuple(corpus.shape)}")
        super().__init__(temperature, learnable_temperature, max_scale)
        self.corpus = corpus.detach()
        self.block_size = block_size
        self.dense = dense
        self.max_block_logits = max_block_logits

    def _target(self, query: Tensor, positive_index: Tensor | Sequence[int]) -> Tensor:
        """Check the query embeddings and the positives; return the positives as a tensor."""
        if query.dim() != 2 or query.shape[1] != self.corpus.shape[1]:
            raise ShapeError(f"query must be (B, {self.corpus.shape[1]}), got "
                             f"{tuple(query.shape)}")
        target = torch.as_tensor(positive_index, dtype=torch.long, device=query.device)
        if target.shape != (query.shape[0],):
            raise ShapeError(f"positive_index must have one entry per query ({query.shape[0]}), "
                             f"got shape {tuple(target.shape)}")
        n = self.corpus.shape[0]
        if bool(((target < 0) | (target >= n)).any()):
            raise ShapeError(f"positive_index out of range for a corpus of {n} documents")
        return target

    def _pairs(self, other_positives: Tensor | Sequence | None, b: int,
               device: torch.device) -> Tensor | None:
        """``other_positives`` as an ``(M, 2)`` long tensor of (query row, corpus row),
        checked against ``b`` queries and the corpus; None when there are none."""
        if other_positives is None or len(other_positives) == 0:
            return None
        pairs = torch.as_tensor(other_positives, dtype=torch.long, device=device)
        n = self.corpus.shape[0]
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ShapeError(f"other_positives must be (M, 2) pairs (query row, corpus row), "
                             f"got shape {tuple(pairs.shape)}")
        if bool(((pairs < 0) | (pairs[:, :1] >= b) | (pairs[:, 1:] >= n)).any()):
            raise ShapeError(f"other_positives out of range for {b} queries and a corpus of "
                             f"{n} documents")
        return pairs

    def _sums(self, query: Tensor, target: Tensor,
              other_positives: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """Sum over ``query``'s rows of the cross-entropy, the detached metric sums
        (positive similarity, correct, negative similarity, negatives, masked) and the scale."""
        corpus = self.corpus.to(device=query.device, dtype=query.dtype)
        scale = self.logit_scale()
        pairs = self._pairs(other_positives, query.shape[0], query.device)
        masked = 0
        if pairs is not None:
            pairs = pairs[pairs[:, 1] != target[pairs[:, 0]]]
            masked = pairs.shape[0]
        block = rows_per_block(corpus.shape[0], self.block_size, self.dense,
                               self.max_block_logits)
        loss_sum, st = cross_entropy_sum(query, corpus, target, scale, block=block,
                                         exclude=Exclusions(pairs=pairs))
        st = torch.cat([st[:4], st.new_full((1,), float(masked))])  # pos, correct, neg, n, masked
        return loss_sum, st, scale

    @staticmethod
    def _metrics(st: Tensor, scale: Tensor, b: int) -> dict[str, Tensor]:
        pos_sum, correct, neg_sum, neg_n, masked = st.unbind()
        pos_sim, neg_sim = pos_sum / b, neg_sum / neg_n.clamp_min(1)
        metrics = {"pos_sim": pos_sim, "neg_sim": neg_sim, "margin": pos_sim - neg_sim,
                   "accuracy": correct / b, "temperature": 1.0 / scale, "masked": masked}
        return {k: v.detach() for k, v in metrics.items()}

    def memory_hint(self, rows: Mapping[str, int], dims: Mapping[str, int] | None = None,
                    tokens: Mapping[str, int] | None = None) -> int:
        """Bytes the loss holds at its peak beyond its inputs and their gradients: one block
        of ``rows["query"]`` queries against the corpus (the corpus itself exists already).
        ``GradCache(chunk_size="auto")`` reads it."""
        return loss_block_bytes(rows["query"], self.corpus.shape[0], self.block_size,
                                self.dense, self.max_block_logits, masked=True)

    def forward(self, query: Tensor, positive_index: Tensor | Sequence[int],
                other_positives: Tensor | None = None) -> LossOutput:
        target = self._target(query, positive_index)
        loss_sum, st, scale = self._sums(query, target, other_positives)
        b = query.shape[0]
        return LossOutput(loss_sum / b, self._metrics(st, scale, b))

    def cross_device_forward(self, gathered: "Gathered", positive_index: Tensor | Sequence[int],
                             other_positives: Tensor | None = None) -> PartialLoss:
        """This rank's part of the global-batch loss: its own queries (``positive_index`` and
        ``other_positives`` are this rank's, with local query rows) against the corpus,
        divided by the global query count, so that the parts of all ranks sum to the loss of
        the concatenated batch. The total and the metrics are summed over ranks in one
        all-reduce, so they are the global batch's, identical on every rank.

        Raises:
            ShapeError: on every rank, when ``positive_index`` is wrong on any rank.
        """
        query = gathered.reps["query"][gathered.local("query")]
        target, failure = None, None
        try:  # every per-rank input checked before the first collective
            target = self._target(query, positive_index)
            self._pairs(other_positives, query.shape[0], query.device)
        except ShapeError as e:
            failure = e
        gathered.raise_together(failure)
        b_total = sum(gathered.counts["query"])
        failure = None
        try:  # a failure on one rank (out of memory): all ranks raise in the all-reduce
            loss_sum, st, scale = self._sums(query, target, other_positives)
            part = loss_sum / b_total
            stats = torch.cat([part.detach().to(st.dtype).reshape(1), st])
        except Exception as e:  # noqa: BLE001 - shared by all_reduce_sum, which raises it
            failure = e
            stats = torch.zeros(6, dtype=torch.promote_types(query.dtype, torch.float32),
                                device=query.device)  # the loss and the 5 sums of _sums
        summed = gathered.all_reduce_sum(stats, failure)
        return PartialLoss(part, summed[0], self._metrics(summed[1:], scale, b_total))
