"""Evaluation on every rank: the texts an evaluation embeds (the corpus, block by block, and
the queries) split over the processes of ``torch.distributed``, each embedding its share,
the embeddings gathered in order on every rank, and the metrics computed there from them,
the same on every rank (and, to round-off, those of one process).

:class:`SplitEncoder` wraps an encoder so that :func:`~bigbatch.retrieval.evaluate.evaluate_sets`
(and the corpus cache, :mod:`bigbatch.retrieval.corpus_cache`) run unchanged on every rank.
Each rank embeds the same number of items (the last share padded with repeats of its last
item, dropped again), so every rank makes the same forward calls: sharded (FSDP) models,
whose forwards are collective, evaluate the same way. Everything else (prompts, settings,
the cache key) is the wrapped encoder's.

A multi-vector (late-interaction) model's queries are split and gathered the same way, and
its corpus is split without gathering the token vectors (the largest thing an evaluation
makes): :meth:`SplitEncoder.corpus_token_store` has each rank embed and store its share of
every block of the corpus (:func:`~bigbatch.retrieval.token_store.embed_corpus_tokens` with
``part``), score the queries against its share (the others ``-inf``), and the ranks' scores
merge by an element-wise maximum (:class:`SplitTokenStore`): every rank holds the scores of
one process.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine import distributed as D
from ..engine.embeddings import TokenEmbeddings

__all__ = ["SplitEncoder", "SplitTokenStore", "split_over_ranks"]


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
        if info.world_size == 1 or n == 0:
            return enc.encode(items, side=side, batch_size=batch_size, device=device,
                              progress=progress if info.is_main else None,
                              autocast_dtype=autocast_dtype)
        _, mine, real = D.padded_share(items, info.rank, info.world_size)
        share = len(mine)
        emb = enc.encode(mine, side=side, batch_size=batch_size, device=device,
                         progress=progress if info.is_main else None,
                         autocast_dtype=autocast_dtype)
        sizes = [max(0, min(share, n - r * share)) for r in range(info.world_size)]
        if isinstance(emb, TokenEmbeddings):
            return self._gather_tokens(emb, real, sizes)
        return D.all_gather_rows(torch.as_tensor(emb)[:real].contiguous(), self._group, sizes)

    def _gather_tokens(self, emb: TokenEmbeddings, real: int,
                       sizes: list[int]) -> TokenEmbeddings:
        """Every rank's token embeddings (its first ``real`` rows), padded to the longest
        row of any rank, in rank order."""
        values, mask = emb.values[:real], emb.mask[:real]
        width = int(D.all_gather_rows(torch.tensor([[values.shape[1]]]), self._group).max())
        pad = width - values.shape[1]
        values = torch.nn.functional.pad(values, (0, 0, 0, pad))
        mask = torch.nn.functional.pad(mask, (0, pad))
        dim = values.shape[2]
        flat = D.all_gather_rows(values.reshape(real, width * dim).contiguous(), self._group,
                                 sizes)
        return TokenEmbeddings(flat.reshape(-1, width, dim),
                               D.all_gather_rows(mask.contiguous(), self._group, sizes))

    def corpus_token_store(self, corpus: str | Path, *, batch_size: int = 64,
                           device: torch.device | str | None = None,
                           cache_dir: str | Path | None = None,
                           progress: bool = True) -> "SplitTokenStore":
        """The multi-vector corpus split over the ranks: this rank's part of the token
        store (:func:`~bigbatch.retrieval.token_store.embed_corpus_tokens` with ``part``),
        whose scores merge over the ranks (:class:`SplitTokenStore`)."""
        from .token_store import embed_corpus_tokens

        info = D.world_info(self._group)
        store = embed_corpus_tokens(self._encoder, corpus, batch_size=batch_size,
                                    device=device, cache_dir=cache_dir,
                                    progress=progress and info.is_main,
                                    part=(info.rank, info.world_size))
        return SplitTokenStore(store, self._group)


class SplitTokenStore:
    """A rank's part of a token store whose :meth:`scores` are every rank's merged: each rank
    scores the documents it holds (``-inf`` the others) and the element-wise maximum over
    the ranks is the whole corpus's (every rank calls it with the same queries)."""

    def __init__(self, store: Any, group: Any = None) -> None:
        self.store = store
        self.ids: list[str] = store.ids
        self._group = group

    def __len__(self) -> int:
        return len(self.ids)

    def scores(self, queries: TokenEmbeddings, **options: Any) -> Tensor:
        """``(queries, documents)`` MaxSim scores of the whole corpus, on every rank."""
        return D.all_reduce_max(self.store.scores(queries, **options), self._group)


def split_over_ranks(encoder: Any, group: Any = None) -> Any:
    """``encoder`` evaluated on every rank of ``group`` (:class:`SplitEncoder`), or the
    encoder itself outside ``torch.distributed``."""
    return SplitEncoder(encoder, group) if D.is_distributed(group) else encoder
