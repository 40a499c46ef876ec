"""``--negative-queue N`` in ``bigbatch train``: the documents of the last N steps as extra
negatives of each step's loss (:class:`~bigbatch.losses.queue.NegativeQueue`).

After each step the queue takes the step's detached document embeddings, as the loss saw
them (``GradCache(keep_embeddings=("doc",))``: under torchrun the global batch's, gathered
in rank order, so every rank's queue is the same), with each document's id (its content
key, as ``doc_ids``) and, for a positive, the id of its query (a hash of the query's text);
before the next step it gives the loss ``queued`` and this rank's ``query_ids``. A queued
document that is a query's positive, or was the positive of the same query in an earlier
step, is no negative of it (:class:`bigbatch.InfoNCE`). Checkpoints keep the queue
(:meth:`RunQueue.state_dict`, tensors and strings only), so a resumed run continues with
the queue it had.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..data.records.types import text_id
from ..engine import distributed as D
from ..errors import ConfigError
from ..losses.queue import NegativeQueue

__all__ = ["RunQueue", "STATE_KEY"]

STATE_KEY = "negative_queue"  # the queue's entry in a checkpoint's trainer state


class RunQueue:
    """A run's negative queue: :meth:`arguments` before a step, :meth:`push` after it.

    Args:
        steps: ``--negative-queue``.
        info: the run's processes.
        device: where the queued embeddings are kept.
        sources: the run's training sources, checked: every one scores a query against the
            whole batch (a queue adds other documents: not with ``in_batch_negatives:
            false``).

    Raises:
        ConfigError: a source with ``in_batch_negatives: false``.
    """

    def __init__(self, steps: int, info: D.WorldInfo, device: torch.device,
                 sources: Sequence[Any] = ()) -> None:
        alone = [s.name for s in sources if not s.spec.in_batch_negatives]
        if alone:
            raise ConfigError(f"--negative-queue adds earlier steps' documents as negatives; "
                              f"--train-data source(s) {alone} have in_batch_negatives false "
                              f"(a query against its own documents only): leave one out")
        self.queue = NegativeQueue(steps)
        self.info, self.device = info, device

    def arguments(self, batch: Any) -> dict[str, Any]:
        """The loss's ``queued`` and ``query_ids`` for ``batch`` (none while the queue is
        empty, at the first step)."""
        queued = self.queue.queued()
        if queued is None:
            return {}
        return {"queued": queued, "query_ids": [text_id(q) for q in batch.queries]}

    def push(self, result: Any, batch: Any) -> None:
        """Queue the step's documents (``result.embeddings["doc"]``, the step's
        :class:`~bigbatch.GradCache` result) with their ids, gathered from every rank."""
        group = len(batch.docs) // len(batch.queries)
        owners = [text_id(batch.queries[j // group]) if j % group == 0 else None
                  for j in range(len(batch.docs))]
        ids = list(batch.doc_ids)
        if self.info.world_size > 1:  # in rank order, as the engine gathers the embeddings
            import torch.distributed as dist
            every: list[Any] = [None] * self.info.world_size
            dist.all_gather_object(every, (ids, owners))
            ids = [i for part in every for i in part[0]]
            owners = [o for part in every for o in part[1]]
        self.queue.push(result.embeddings["doc"], ids, owners)

    def state_dict(self) -> dict[str, Any]:
        return self.queue.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The queue a checkpoint kept (None: from before the queue, an empty one)."""
        self.queue.load_state_dict(state, self.device)
