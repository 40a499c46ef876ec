"""A corpus's token embeddings on disk, for late-interaction (MaxSim) retrieval: embedded once
per (encoder, corpus), memory-mapped, scored against queries in blocks of documents.

A store is a folder (written under a temporary name, then renamed into place, so a reader
never sees half of one):

- ``values.f16``: float16 ``(tokens, dim)``, the scored token vectors of every document, the
  documents one after another in the order they were embedded (longest first within each
  block of the corpus, so neighbours have similar lengths and a block pads little);
- ``docs.pt``: the corpus ids (corpus order), and per stored document its corpus index
  (``order``) and where its tokens start (``offsets``, one more than documents), and ``dim``.

Disk: 2 x dim bytes per scored token (128 dims: 256 bytes). Memory: the ids and two int64 per
document; the vectors are paged in by the operating system as blocks are scored.

The cache is the corpus-embedding cache's (:func:`bigbatch.retrieval.corpus_cache.embeddings_file`:
the
encoder's ``cache_key()`` and the corpus's identity), the folder named ``*.tokens``. Without a
cache folder the store lives in a temporary folder removed with the :class:`TokenStore`.
Under ``torch.distributed`` each rank can hold a part of the corpus (``part=(rank, world)``
of :func:`embed_corpus_tokens`: a share of every block): its store lists every corpus id
but holds only its documents, and scores the others as ``-inf``, so the ranks' scores
merge by an element-wise maximum (:class:`bigbatch.retrieval.distributed_eval.SplitTokenStore`).
The encoder is duck-typed: ``cache_key()`` and ``encode_tokens(texts, side=...)`` (see
:class:`bigbatch.encoders.MultiVectorTextEncoder`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..data.readers.beir_dir import count_records, iter_corpus
from ..data.readers.files import cache_errors
from ..engine.distributed import padded_share
from ..engine.embeddings import TokenEmbeddings, stack_rows
from ..losses.maxsim import maxsim_scores
from .corpus_cache import corpus_key, embeddings_file

__all__ = ["TokenStore", "TokenStoreWriter", "embed_corpus_tokens", "BLOCK_ELEMENTS",
           "SIMILARITY_ELEMENTS"]

BLOCK_ELEMENTS = 2 ** 24  # padded document values in one scored block: 64 MiB in float32
SIMILARITY_ELEMENTS = 2 ** 26  # token similarities at once: 256 MiB (4 times fewer passes
# over the documents than the loss's 64 MiB blocks, which also keep a backward's room)
_VALUES, _DOCS = "values.f16", "docs.pt"


class TokenStore:
    """A written store, memory-mapped (module docstring).

    Attributes:
        ids: the corpus ids, in corpus order (columns of :meth:`scores`).
        dim: the vectors' width.
    """

    def __init__(self, path: str | os.PathLike, cleanup: Any = None) -> None:
        import numpy as np

        self.path = Path(path)
        meta = torch.load(self.path / _DOCS, weights_only=True)
        self.ids: list[str] = meta["ids"]
        self.order: Tensor = meta["order"]
        self.offsets: Tensor = meta["offsets"]
        self.dim: int = int(meta["dim"])
        total = int(self.offsets[-1])
        self._values = np.memmap(self.path / _VALUES, dtype=np.float16, mode="r",
                                 shape=(total, self.dim)) if total else None
        self._cleanup = cleanup  # a TemporaryDirectory, removed with the store

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def held(self) -> int:
        """Documents this store holds (all of :attr:`ids`, or a rank's part of them)."""
        return len(self.order)

    def tokens(self) -> int:
        """Stored token vectors, over all documents."""
        return int(self.offsets[-1])

    def rows(self, lo: int, hi: int) -> tuple[Tensor, TokenEmbeddings]:
        """Stored documents ``lo:hi`` (storage order): their corpus indices and their vectors
        (float32, padded)."""
        import numpy as np

        start, ends = int(self.offsets[lo]), self.offsets[lo + 1:hi + 1].tolist()
        flat = torch.from_numpy(np.array(self._values[start:ends[-1]], dtype=np.float32))
        sizes = [e - s for s, e in zip([start] + ends[:-1], ends)]
        return self.order[lo:hi], stack_rows(list(flat.split(sizes)), self.dim)

    def scores(self, queries: TokenEmbeddings, normalize_query: bool = True,
               block_elements: int = BLOCK_ELEMENTS,
               similarity_elements: int = SIMILARITY_ELEMENTS) -> Tensor:
        """The MaxSim scores (float32, on the CPU) of ``queries`` with every document,
        ``(queries, documents)`` in corpus order, computed a block of stored documents at a
        time (at most ``block_elements`` padded values each), and within it at most
        ``similarity_elements`` token similarities at once
        (:func:`bigbatch.losses.maxsim.maxsim_scores`' blocks; no gradient is kept). A part
        of the corpus (:attr:`held` below the ids) scores the documents it does not hold
        ``-inf``."""
        n, held = len(self.ids), self.held
        out = torch.empty(len(queries.values), n) if held == n else \
            torch.full((len(queries.values), n), float("-inf"))
        if held == 0:
            return out
        longest = int((self.offsets[1:] - self.offsets[:-1]).max())
        per_block = max(1, block_elements // max(1, longest * self.dim))
        queries = TokenEmbeddings(queries.values.float(), queries.mask)
        for lo in range(0, held, per_block):
            cols, docs = self.rows(lo, min(lo + per_block, held))
            with torch.no_grad():
                out[:, cols] = maxsim_scores(queries, docs, normalize_query=normalize_query,
                                             max_block_elements=similarity_elements)
        return out


class TokenStoreWriter:
    """Writes a store: :meth:`add` documents as they are embedded, then :meth:`finish`.
    Everything goes to ``<path>.tmp<pid>`` until :meth:`finish` renames it to ``path``."""

    def __init__(self, path: str | os.PathLike, dim: int) -> None:
        self.path = Path(path)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.dim = dim
        self._file = open(self.tmp / _VALUES, "wb")
        self._order: list[int] = []
        self._offsets = [0]

    def add(self, indices: Sequence[int], rows: Sequence[Tensor]) -> None:
        """Append documents: their corpus indices and their ``(tokens, dim)`` vectors."""
        for i, r in zip(indices, rows, strict=True):
            self._file.write(r.to(torch.float16).numpy().tobytes())
            self._order.append(int(i))
            self._offsets.append(self._offsets[-1] + len(r))

    def finish(self, ids: list[str], cleanup: Any = None) -> TokenStore:
        """Close the files, move the store into place and open it."""
        self._file.close()
        torch.save({"ids": ids, "order": torch.tensor(self._order, dtype=torch.long),
                    "offsets": torch.tensor(self._offsets, dtype=torch.long),
                    "dim": self.dim}, self.tmp / _DOCS)
        try:
            self.tmp.replace(self.path)
        except OSError:  # another process put the same store there first
            if not (self.path / _DOCS).exists():
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
        return TokenStore(self.path, cleanup)


def embed_corpus_tokens(encoder: Any, corpus_path: str | Path, *, batch_size: int = 64,
                        device: Any = None, cache_dir: str | Path | None = None,
                        block: int = 4096, progress: bool = True,
                        part: tuple[int, int] = (0, 1)) -> TokenStore:
    """The token store of every document of ``corpus_path`` embedded by ``encoder``: from the
    cache in ``cache_dir`` when it is there, else embedded (a block of the corpus at a time)
    and written there (None: into a temporary folder, removed with the store).

    ``part=(rank, world)``: only this rank's share of each block (``ceil(block / world)``
    documents, the last share padded with repeats of the block's last document, embedded
    and dropped, so that every rank makes the same forward calls); cached under a name of
    its own (``*.<rank>of<world>.tokens``)."""
    from .._progress import progress_bar

    corpus_path = Path(corpus_path)
    rank, world = part
    cleanup = None
    if cache_dir is not None:
        path = embeddings_file(encoder, corpus_key(corpus_path), cache_dir).with_suffix(
            ".tokens" if world == 1 else f".{rank}of{world}.tokens")
        if (path / _DOCS).exists():
            return TokenStore(path)
    else:
        cleanup = tempfile.TemporaryDirectory(prefix="bigbatch-tokens-")
        path = Path(cleanup.name) / "store"
    writer = None
    ids: list[str] = []
    bar = progress_bar(total=count_records(corpus_path), desc="embed corpus tokens",
                       unit="doc") if progress else None
    for blk in iter_corpus(corpus_path, block):
        lo, mine, real = padded_share([t for _, t in blk], rank, world)
        for idx, rows in encoder.encode_tokens(mine, side="doc", batch_size=batch_size,
                                               device=device):
            with cache_errors(path.parent):  # a read-only or full cache folder, named
                if writer is None:
                    writer = TokenStoreWriter(path, rows[0].shape[1])
                kept = [(len(ids) + lo + i, r) for i, r in zip(idx, rows) if i < real]
                writer.add([i for i, _ in kept], [r for _, r in kept])
        ids.extend(d for d, _ in blk)
        if bar is not None:
            bar.update(len(blk))
    if bar is not None:
        bar.close()
    with cache_errors(path.parent):
        if writer is None:  # an empty corpus
            writer = TokenStoreWriter(path, 0)
        return writer.finish(ids, cleanup)
