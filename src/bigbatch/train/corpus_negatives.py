"""Query-side tuning's corpus negatives (``--doc-negatives corpus``): every document of the
corpus embedded once by the frozen document tower, kept in the corpus-embedding cache
between runs (and resumes), and the targets of each batch's queries among them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..engine import distributed as D
from .config import TrainConfig
from .main_rank import barrier

__all__ = ["FixedCorpus"]


class FixedCorpus:
    """Query-side tuning against the whole corpus: every document embedded once by the frozen
    document tower. The corpus is the BEIR directory's ``corpus.jsonl`` when training on one,
    else every distinct document of the training records.

    Attributes:
        ids: each corpus row's document id (a record's positive id, or a content key).
        rows: content key -> the corpus rows holding that content.
        positives: query id (else its text) -> the rows holding one of its positives.
        cache_file: where the embeddings are kept between runs.
        emb: ``(rows, dim)`` embeddings on ``device``.
    """

    def __init__(self, config: TrainConfig, records: list, encoder: Any, device: torch.device,
                 info: D.WorldInfo) -> None:
        items = self._collect(config, records)
        # every row holding a positive of the query (by query id, else by text) is masked out
        # of its negatives, so is a duplicate of it under another corpus id
        self.positives: dict[str, set[int]] = {}
        for r in records:
            self.positives.setdefault(r.query_id or r.query, set()).update(
                self.rows[r.positive_key])
        self._query_key = {r.query: r.query_id or r.query for r in records}
        self.emb = self._embed(config, encoder, items, device, info).to(device)

    def _collect(self, config: TrainConfig, records: list) -> list[Any]:
        """The corpus's documents (sets ``ids`` and ``rows``); each content once, except as
        the BEIR corpus itself holds it twice."""
        from ..data.formats import detect_format
        from ..data.records.image_checks import doc_key

        items: list[Any] = []
        self.ids: list[str] = []
        self.rows: dict[str, list[int]] = {}

        def add(did: str, doc: Any, key: str) -> None:
            self.rows.setdefault(key, []).append(len(items))
            self.ids.append(did)
            items.append(doc)

        root = Path(config.train_sources()[0].path)  # one source (config.validate)
        if root.is_dir() and detect_format(root) == "beir":  # not a datasets folder
            from ..data.readers.beir_dir import load_beir

            for did, doc in load_beir(root, config.train_split).corpus.items():
                add(did, doc, doc_key(doc))
        for r in records:
            if r.positive_key not in self.rows:
                add(r.positive_id, r.positive, r.positive_key)
            for doc in r.negatives:
                key = doc_key(doc)
                if key not in self.rows:
                    add(key, doc, key)
        return items

    def _embed(self, config: TrainConfig, encoder: Any, items: list[Any],
               device: torch.device, info: D.WorldInfo) -> torch.Tensor:
        """The documents' embeddings: the main rank embeds and caches them (or finds them
        cached), the others load its file, or embed themselves when they cannot."""
        from ..data.readers.files import default_cache_dir
        from ..retrieval.corpus_cache import (
            documents_key,
            embeddings_file,
            load_embeddings,
            save_embeddings,
        )

        # keyed by the encoder (files and settings) and every document (id, content key, and
        # an image's size and modification time)
        self.cache_file = embeddings_file(encoder, documents_key(self.ids, items),
                                          default_cache_dir())
        emb = None
        if not self.cache_file.exists() and info.is_main:
            emb = encoder.encode(items, side="doc", batch_size=config.eval_batch_size,
                                 device=device, progress="embed training corpus")
            save_embeddings(self.cache_file, self.ids, emb)
        elif self.cache_file.exists() and info.is_main:
            print(f"training corpus embeddings loaded from {self.cache_file}", flush=True)
        barrier(info)
        cached = load_embeddings(self.cache_file) if emb is None else None
        if cached is not None and cached[0] == self.ids:
            emb = cached[1]
        if emb is None:  # another node's cache, or a stale file: embed here
            emb = encoder.encode(items, side="doc", batch_size=config.eval_batch_size,
                                 device=device)
        return emb

    def targets(self, batch: Any, device: torch.device) -> dict[str, torch.Tensor]:
        """CorpusInfoNCE's targets for a batch: each query's positive row, and the (query,
        row) pairs of its other positives, masked out of its negatives."""
        pos = [self.rows[key][0] for key in batch.doc_ids]
        pairs = [(row, col) for row, q in enumerate(batch.queries)
                 for col in sorted(self.positives.get(self._query_key.get(q, q), ()))
                 if col != pos[row]]
        other = torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)
        return {"positive_index": torch.tensor(pos, dtype=torch.long, device=device),
                "other_positives": other.to(device)}
