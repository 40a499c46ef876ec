"""A queue of earlier steps' documents as extra negatives (MoCo's memory bank, of the trained
model's own earlier embeddings): :class:`NegativeQueue` keeps the detached document
embeddings of the last ``steps`` steps with their ids, and :class:`QueuedDocs` is what a loss
takes as its ``queued`` argument (:class:`bigbatch.InfoNCE`).

The objective is not that of a larger batch: the queued embeddings were computed by the
weights of earlier steps (stale) and are constants of the loss (no gradient reaches them,
nor the model through them). A queued document is left out of a query's negatives where its
id is that of the query's positive, or where it was the positive of a query with the
query's own id (the same query with another relevant document, an earlier step's record).

The queue holds tensors, lists of strings and integers only (:meth:`NegativeQueue.state_dict`),
so a checkpoint keeps it and reads it back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError, InputError, ShapeError
from .layout import id_codes

__all__ = ["QueuedDocs", "NegativeQueue", "queue_codes"]

Ids = Tensor | Sequence[Hashable | None]


@dataclass(frozen=True)
class QueuedDocs:
    """Earlier steps' documents, as a loss's extra negatives.

    Attributes:
        doc: ``(M, D)`` document embeddings (detached; used as constants).
        ids: optional, one id per document (a tensor, or hashables such as strings), compared
            with the batch's ``doc_ids``: a queued document with the id of a query's positive
            is no negative of that query.
        query_ids: optional, per document the id of the query it was the positive of (None,
            or a negative number in a tensor, for a hard negative), compared with the loss's
            ``query_ids``: a document that was a positive of the same query is no negative.
    """

    doc: Tensor
    ids: Ids | None = None
    query_ids: Ids | None = None

    def __len__(self) -> int:
        return int(self.doc.shape[0])

    def with_doc(self, fn: Callable[[Tensor], Tensor]) -> "QueuedDocs":
        """The same documents with ``fn`` applied to their embeddings (Matryoshka's
        truncation to a width)."""
        return dataclasses.replace(self, doc=fn(self.doc))

    def check(self, width: int) -> None:
        """Raises ShapeError unless ``doc`` is ``(M, width)`` and the ids are ``M`` long."""
        if not isinstance(self.doc, Tensor) or self.doc.dim() != 2 \
                or self.doc.shape[1] != width:
            shape = tuple(self.doc.shape) if isinstance(self.doc, Tensor) else type(self.doc)
            raise ShapeError(f"queued documents must be (rows, {width}) embeddings like the "
                             f"batch's documents, got {shape}")
        for name in ("ids", "query_ids"):
            value = getattr(self, name)
            if value is not None and len(value) != len(self):
                raise ShapeError(f"queued {name} has {len(value)} entries for {len(self)} "
                                 f"queued documents; give one per document")


def queue_codes(batch: Ids | None, queued: Ids | None, n: int,
                device: torch.device, what: str) -> tuple[Tensor | None, Tensor | None]:
    """The batch's ids and the queue's as int64 codes of one numbering, equal where the ids
    are equal: tensors are used as they are (a negative value, like None, matches nothing),
    hashables numbered together. ``(None, None)`` when either side has none.

    Raises:
        InputError: one side a tensor and the other hashables.
        ShapeError: the batch side is not ``n`` long.
    """
    if batch is None or queued is None:
        return None, None
    if isinstance(batch, Tensor) != isinstance(queued, Tensor):
        raise InputError(f"{what}: the batch's ids and the queued documents' ids must be of "
                         f"one kind, both tensors or both hashables (such as strings)")
    if isinstance(batch, Tensor):
        b = batch.to(device=device, dtype=torch.long).reshape(-1)
        q = queued.to(device=device, dtype=torch.long).reshape(-1)
        if b.numel() != n:
            raise ShapeError(f"{what} has {b.numel()} entries for {n} rows; give one per row")
        if n and (b < 0).any():
            raise InputError(f"{what}: ids must be >= 0 (a negative id matches nothing)")
        return b, torch.where(q < 0, torch.full_like(q, -1), q)
    b_list, q_list = list(batch), list(queued)
    if len(b_list) != n:
        raise ShapeError(f"{what} has {len(b_list)} entries for {n} rows; give one per row")
    present = [x for x in q_list if x is not None]
    codes = id_codes([*b_list, *present])
    it = iter(codes[len(b_list):])
    q_codes = [-1 if x is None else next(it) for x in q_list]
    return (torch.tensor(codes[:len(b_list)], dtype=torch.long, device=device),
            torch.tensor(q_codes, dtype=torch.long, device=device))


class NegativeQueue:
    """The documents of the last ``steps`` steps, oldest first: :meth:`push` after each
    step, :meth:`queued` before the next (None while empty).

    Args:
        steps: how many earlier steps' documents to keep (> 0).
    """

    def __init__(self, steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0:
            raise ConfigError(f"a negative queue keeps the documents of at least one earlier "
                              f"step; got {steps!r}")
        self.steps = steps
        self._entries: list[tuple[Tensor, list[str], list[str | None]]] = []
        self._joined: QueuedDocs | None = None

    def __len__(self) -> int:
        """Documents queued now."""
        return sum(e[0].shape[0] for e in self._entries)

    def push(self, doc: Tensor, ids: Sequence[str], query_ids: Sequence[str | None]) -> None:
        """Add one step's documents (detached here), dropping the oldest step beyond
        :attr:`steps`.

        Raises:
            ShapeError: not one id and one query id per document, or another width than
                the queued documents'.
        """
        doc = doc.detach()
        if doc.dim() != 2 or len(ids) != doc.shape[0] or len(query_ids) != doc.shape[0]:
            raise ShapeError(f"push one id and one query id per document: {tuple(doc.shape)} "
                             f"embeddings, {len(ids)} ids, {len(query_ids)} query ids")
        if self._entries and self._entries[0][0].shape[1] != doc.shape[1]:
            raise ShapeError(f"queued documents are {self._entries[0][0].shape[1]} wide, "
                             f"these {doc.shape[1]}")
        self._entries.append((doc, list(ids), list(query_ids)))
        del self._entries[:-self.steps]
        self._joined = None

    def queued(self) -> QueuedDocs | None:
        """The queued documents as a loss's ``queued`` argument (None while empty)."""
        if not self._entries:
            return None
        if self._joined is None:
            self._joined = QueuedDocs(torch.cat([e[0] for e in self._entries]),
                                      [i for e in self._entries for i in e[1]],
                                      [i for e in self._entries for i in e[2]])
        return self._joined

    def state_dict(self) -> dict[str, Any]:
        """Tensors, lists and strings only (a checkpoint's ``weights_only`` load reads it):
        the steps kept, each step's embeddings (on the CPU), ids and query ids ("" for a
        hard negative's)."""
        return {"steps": self.steps,
                "doc": [e[0].cpu() for e in self._entries],
                "ids": [list(e[1]) for e in self._entries],
                "query_ids": [["" if x is None else x for x in e[2]] for e in self._entries]}

    def load_state_dict(self, state: dict[str, Any] | None,
                        device: torch.device | str | None = None) -> None:
        """Restore :meth:`state_dict` (None: an empty queue), the embeddings on ``device``;
        a queue saved with more steps keeps its newest :attr:`steps`.

        Raises:
            ConfigError: the state is not a queue's.
        """
        self._entries, self._joined = [], None
        if state is None:
            return
        try:
            docs, ids, owners = state["doc"], state["ids"], state["query_ids"]
            for d, i, o in zip(docs, ids, owners, strict=True):
                self.push(d.to(device) if device is not None else d, [str(x) for x in i],
                          [x or None for x in o])
        except (KeyError, TypeError, ValueError, ShapeError, AttributeError) as e:
            raise ConfigError(f"the checkpoint's negative queue cannot be read ({e}); resume "
                              f"from another checkpoint") from e
