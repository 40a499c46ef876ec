"""Deterministic epoch batching for exact resume.

The order of epoch ``e`` is a permutation drawn from ``seed + e``, and each record's k
negatives (when it has more than k) are sampled from ``(seed, e, record index)``, so the
data position is just ``(epoch, batch index)``: a resumed run sees exactly the batches of
a run that never stopped. Under torchrun every rank draws the same permutation and takes
its contiguous share of each global batch; incomplete global batches are dropped.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .records.types import ImageDoc, TrainRecord, doc_key

__all__ = ["EpochBatches", "Batch"]


@dataclass
class Batch:
    """One local batch: queries, documents laid out [pos, neg_1..neg_k] per query, and each
    document's content key (text hash or image path) as its id, so a passage that is one
    record's positive and another's negative carries the same id in both places.
    ``teacher_scores``: with ``scores=True``, each query's row of teacher scores, its
    positive's then its negatives' (the negatives sampled for the batch), for distillation."""

    queries: list[str]
    docs: list[str | ImageDoc]
    doc_ids: list[str]
    epoch: int
    index: int
    teacher_scores: list[list[float]] | None = None
    source: str = ""  # the training source's name (a mix: bigbatch.data.mix)


class EpochBatches:
    """Batches of ``batch_size`` records per rank, ``batch_size * world_size`` per step; with
    ``scores``, each batch carries the records' teacher scores (every record must have them:
    :func:`bigbatch.data.records.loader.check_teacher_scores`). ``records``: any sequence of
    records (a list, or records read by index: :mod:`bigbatch.data.records.store`)."""

    def __init__(self, records: Sequence[TrainRecord], batch_size: int,
                 num_hard_negatives: int = 0, seed: int = 0, rank: int = 0,
                 world_size: int = 1, scores: bool = False) -> None:
        self.records = records
        self.batch_size = batch_size
        self.k = num_hard_negatives
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.global_batch = batch_size * world_size
        self.scores = scores
        self._perm: tuple[int | None, torch.Tensor] = (None, torch.empty(0, dtype=torch.long))

    def __len__(self) -> int:
        """Steps per epoch."""
        return len(self.records) // self.global_batch

    def _order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s permutation of the records, kept as a tensor for the epoch's
        batches (never a Python list: 8 bytes a record, drawn once per epoch)."""
        if self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(len(self.records), generator=g))
        return self._perm[1]

    def batch(self, epoch: int, index: int) -> Batch:
        lo = index * self.global_batch + self.rank * self.batch_size
        queries, docs, ids = [], [], []
        scores: list[list[float]] | None = [] if self.scores else None
        for i in self._order(epoch)[lo:lo + self.batch_size].tolist():
            r = self.records[i]
            queries.append(r.query)
            docs.append(r.positive)
            ids.append(r.positive_key)
            picked: list[int] = []
            if self.k:
                n = len(r.negatives)
                # the same draw as sampling the negatives themselves: random.sample picks by
                # position, whatever the population holds
                picked = (random.Random(f"{self.seed}-{epoch}-{i}").sample(range(n), self.k)
                          if n > self.k else list(range(min(n, self.k))))
                negs = [r.negatives[j] for j in picked]
                docs.extend(negs)
                ids.extend(doc_key(t) for t in negs)
            if scores is not None:
                scores.append([r.pos_score, *(r.neg_scores[j] for j in picked)])
        return Batch(queries, docs, ids, epoch, index, scores)

    def iterate(self, start_epoch: int = 0, start_index: int = 0) -> Iterator[Batch]:
        """Batches from (start_epoch, start_index) on, forever (the caller stops)."""
        epoch, index = start_epoch, start_index
        if len(self) == 0:
            return
        while True:
            if index >= len(self):
                epoch, index = epoch + 1, 0
            yield self.batch(epoch, index)
            index += 1

