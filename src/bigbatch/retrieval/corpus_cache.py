"""Streaming a BEIR corpus and embedding it in batches, and the corpus-embedding cache.

The corpus file is read in blocks of ``block`` documents, each embedded and appended, so
only embeddings (not texts) stay in memory.

The cache (one for every corpus embedded: evaluation, mining, training's corpus negatives)
keeps a file per (encoder, corpus), named by :func:`embeddings_file` from the encoder's
``cache_key()`` (its files' names, sizes and modification times, and its settings: pooling,
prompts, length, document tower) and what identifies the documents: a corpus file's
identity and that of every page image it names (:func:`corpus_key`), or for documents in
memory, each id with its content (:func:`documents_key`). A changed model, corpus or image
is never served stale vectors. The encoder is duck-typed (``cache_key`` and ``encode``).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..data.readers.beir_dir import corpus_doc, count_records, iter_corpus
from ..data.readers.files import cache_errors
from ..data.readers.jsonl import iter_jsonl
from ..data.records.types import ImageDoc, doc_key

__all__ = ["embed_corpus", "EmbeddingFile", "corpus_key", "documents_key", "embeddings_file",
           "save_embeddings", "load_embeddings"]


def _stamp(path: str | Path) -> list[Any]:
    """A file's path, size and modification time (None, None when it does not exist)."""
    p = Path(path)
    stat = p.stat() if p.exists() else None
    return [str(path), stat and stat.st_size, stat and stat.st_mtime_ns]


def _names_images(path: Path, window: int = 1 << 20) -> bool:
    """Whether the file contains the key ``"image"`` at all (a byte scan: a text corpus needs
    no parsing pass for its cache key)."""
    needle = b'"image"'
    tail = b""
    with open(path, "rb") as f:
        while chunk := f.read(window):
            if needle in tail + chunk:
                return True
            tail = chunk[-(len(needle) - 1):]
    return False


def corpus_key(path: str | Path) -> list[Any]:
    """What identifies a corpus's documents: the corpus file (path, size, modification time)
    and, when its records name page images, a digest of each image's path, size and
    modification time (an image replaced in place changes the key)."""
    path = Path(path)
    key: list[Any] = [str(path.resolve()), _stamp(path)]
    if path.is_file() and _names_images(path):
        digest = hashlib.sha256()
        for _, rec, problem in iter_jsonl(path):
            if problem is not None:
                continue  # reported with file and line when the corpus is read
            doc = corpus_doc(rec, path.parent)
            if not isinstance(doc, str):
                digest.update(json.dumps(_stamp(doc.path)).encode())
        key.append(digest.hexdigest())
    return key


def documents_key(ids: Sequence[str], docs: Sequence[Any]) -> str:
    """What identifies documents held in memory: each id with its content key (a text's hash,
    an image's path) and, for a page image, its size and modification time."""
    digest = hashlib.sha256()
    for did, doc in zip(ids, docs, strict=True):
        image = _stamp(doc.path) if isinstance(doc, ImageDoc) else None
        digest.update(json.dumps([did, doc_key(doc), image]).encode())
    return digest.hexdigest()


def embeddings_file(encoder: Any, corpus: Any, cache_dir: str | Path) -> Path:
    """The cache file of ``encoder``'s embeddings of a corpus, under ``cache_dir``: named by a
    digest of the encoder's ``cache_key()`` and ``corpus``, what identifies the documents
    (:func:`corpus_key` or :func:`documents_key`)."""
    key = hashlib.sha256(json.dumps({"encoder": encoder.cache_key(), "corpus": corpus},
                                    sort_keys=True, default=str).encode()).hexdigest()[:24]
    return Path(cache_dir) / "embeddings" / f"corpus-{key}.pt"


def embed_corpus(encoder: Any, corpus_path: str | Path, *, batch_size: int = 64,
                 device: Any = None, cache_dir: str | Path | None = None, block: int = 4096,
                 progress: bool = True) -> tuple[list[str], torch.Tensor]:
    """(doc ids, float32 embeddings) of every document, from the cache in ``cache_dir`` when
    it is there (None: no cache).

    Raises:
        ConfigError: a multi-vector encoder (one vector per token, not per document: see
            :func:`bigbatch.retrieval.token_store.embed_corpus_tokens`).
    """
    from .._progress import progress_bar

    if getattr(encoder, "multi_vector", False):
        from ..errors import ConfigError

        raise ConfigError("a multi-vector (ColBERT) model embeds a document as one vector per "
                          "token; this needs one vector per document (evaluation and mining "
                          "score multi-vector models by MaxSim against a token store)")
    corpus_path = Path(corpus_path)
    cache = embeddings_file(encoder, corpus_key(corpus_path), cache_dir) if cache_dir else None
    cached = load_embeddings(cache) if cache is not None else None
    if cached is not None:
        return cached
    ids: list[str] = []
    with cache_errors(cache_dir or tempfile.gettempdir()):  # read-only or full: named
        writer = EmbeddingFile(cache_dir)
    bar = progress_bar(total=count_records(corpus_path), desc="embed corpus", unit="doc") \
        if progress else None
    try:
        for blk in iter_corpus(corpus_path, block):
            ids.extend(d for d, _ in blk)
            emb = encoder.encode([t for _, t in blk], side="doc", batch_size=batch_size,
                                 device=device)
            with cache_errors(cache_dir or tempfile.gettempdir()):
                writer.append(emb)
            if bar is not None:
                bar.update(len(blk))
    finally:
        if bar is not None:
            bar.close()
        emb = writer.finish()
    if cache is not None:
        with cache_errors(cache_dir):
            save_embeddings(cache, ids, emb)
    return ids, emb


class EmbeddingFile:
    """A corpus's embeddings written to disk as they are made (float32, one block at a time)
    and handed back memory-mapped: embedding a corpus holds one block in memory, never a
    list of every block and their concatenation, and the operating system pages the matrix
    in as the scoring reads it.

    The file is a temporary one in ``folder`` (default: the system's temporary folder); it
    is unlinked once mapped, so nothing is left behind, whatever happens next.
    """

    def __init__(self, folder: str | Path | None = None) -> None:
        import tempfile

        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = tempfile.NamedTemporaryFile(prefix="corpus-", suffix=".f32", delete=False,
                                                 dir=folder)
        self.rows, self.dim = 0, None

    def append(self, emb: Any) -> None:
        """Write the next block's ``(rows, dim)`` embeddings (a tensor, or an array such as
        a JAX encoder's NumPy embeddings)."""
        emb = torch.as_tensor(emb)
        if self.dim is None:
            self.dim = emb.shape[1]
        self._file.write(emb.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        self.rows += emb.shape[0]

    def finish(self) -> torch.Tensor:
        """The ``(rows, dim)`` float32 embeddings written, mapped from the file (an empty
        ``(0, 0)`` tensor when nothing was written); the file is unlinked."""
        import os

        self._file.close()
        try:
            if not self.rows:
                return torch.empty(0, 0)
            return torch.from_file(self._file.name, shared=True, size=self.rows * self.dim,
                                   dtype=torch.float32).view(self.rows, self.dim)
        finally:
            os.unlink(self._file.name)  # the mapping stays valid; no file is left behind


def save_embeddings(path: Path, ids: list[str], emb: torch.Tensor) -> None:
    """Write (ids, embeddings) atomically: a temporary file of this process, renamed into
    place, so a reader (another rank, a later run) never sees half a file."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        torch.save({"ids": ids, "emb": emb}, tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half file left in the cache
        raise


def load_embeddings(path: Path) -> tuple[list[str], torch.Tensor] | None:
    """(ids, embeddings) written by :func:`save_embeddings`, or None when there is none."""
    if not path.exists():
        return None
    # ids and a tensor (no pickled code runs); the tensor memory-mapped, not read into memory
    blob = torch.load(path, weights_only=True, mmap=True)
    return blob["ids"], blob["emb"]
