"""Evaluation on every rank: the texts an evaluation embeds (the corpus, block by block, and
the queries) split over the processes of ``torch.distributed``, each embedding its share,
the embeddings gathered in order on every rank, and the metrics computed there from them,
the same on every rank (and, to round-off, those of one process).

:class:`SplitEncoder` wraps an encoder so that :func:`~bigbatch.retrieval.evaluate.evaluate_sets`
(and the corpus cache, :mod:`bigbatch.retrieval.corpus_cache`) run unchanged on every rank.
Each rank embeds the same number of items (the last share padded with repeats of its last
item, dropped again), so every rank makes the same forward calls: sharded (FSDP) models,
whose forwards are collective, evaluate the same way. Everything else (prompts, settings,
the cache key) is the wrapped encoder's. A multi-vector model's token vectors are not
split: every rank embeds every item (still in step, without the speed-up).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..engine import distributed as D

__all__ = ["SplitEncoder", "split_over_ranks"]


class SplitEncoder:
    """``encoder`` with :meth:`encode` split over the ranks of ``group`` (see the module
    docstring); every other attribute is the encoder's."""

    def __init__(self, encoder: Any, group: Any = None) -> None:
        self._encoder = encoder
        self._group = group

    def __getattr__(self, name: str) -> Any:
        return getattr(self._encoder, name)

    def encode(self, items: Sequence[Any], side: str = "doc", batch_size: int = 64,
               device: torch.device | str | None = None, progress: str | None = None,
               autocast_dtype: torch.dtype | None = None) -> Any:
        """The embeddings of ``items`` in input order, on every rank (float32, CPU), each
        rank having embedded ``ceil(len(items) / world)`` of them."""
        enc = self._encoder
        info = D.world_info(self._group)
        n = len(items)
        if info.world_size == 1 or getattr(enc, "multi_vector", False) or n == 0:
            return enc.encode(items, side=side, batch_size=batch_size, device=device,
                              progress=progress if info.is_main else None,
                              autocast_dtype=autocast_dtype)
        share = -(-n // info.world_size)
        lo = min(n, info.rank * share)
        mine = list(items[lo:lo + share])
        real = len(mine)
        mine += [items[n - 1]] * (share - real)  # every rank the same calls
        emb = torch.as_tensor(enc.encode(mine, side=side, batch_size=batch_size, device=device,
                                         progress=progress if info.is_main else None,
                                         autocast_dtype=autocast_dtype))
        sizes = [max(0, min(share, n - r * share)) for r in range(info.world_size)]
        return D.all_gather_rows(emb[:real].contiguous(), self._group, sizes)


def split_over_ranks(encoder: Any, group: Any = None) -> Any:
    """``encoder`` evaluated on every rank of ``group`` (:class:`SplitEncoder`), or the
    encoder itself outside ``torch.distributed``."""
    return SplitEncoder(encoder, group) if D.is_distributed(group) else encoder
