"""``bigbatch mine``: hard negatives from a corpus, with positive-aware false-negative
filtering (NV-Retriever, Moreira et al. 2024).

1. Embed the corpus (streamed, cached) and the queries; L2-normalise both, so inner
   product is cosine similarity whatever the model's own normalisation (an unnormalised
   inner-product search is the classic way FAISS mining goes wrong).
2. Search with faiss-cpu: exact inner product (``IndexFlatIP``) by default, HNSW for large
   corpora (``index="hnsw"``). A multi-vector (late-interaction) model is searched exactly,
   by the MaxSim scores an evaluation ranks by (divided by the query's token count, so in
   [-1, 1] like a cosine), against the corpus's token store, a block of queries at a time.
3. For each (query, positive) pair: remove every known positive of the query from the
   ranking, and every copy of one (the same text or image under another corpus id, which
   training would refuse as "a negative equals the positive"), keep the candidates at ranks
   ``[rank_start, rank_end)`` of what remains, and drop likely false negatives: a candidate
   scoring above ``max_score_ratio`` times the positive's score (TopK-PercPos; for a
   negative score ``p``, above ``p - (1 - max_score_ratio) * |p|``, so the threshold stays
   below the positive), or within ``margin`` of it (TopK-MarginPos).
4. Take the first ``num_negatives`` survivors; the search widens until they are found or
   the window is exhausted. A (query, positive) left with fewer than ``min_negatives``
   (default: all ``num_negatives``) is not written, and counted in the report, so the
   output trains with ``--num-hard-negatives num_negatives`` as it is.

With ``scores``, each record also carries the mining model's cosine similarities of the
query with its positive and with each negative (``pos_score``, ``neg_scores``, in the
negatives' order), the teacher scores ``bigbatch train --distill`` learns from.

Writes training records (contrastors text JSONL with ids) and a report of candidates seen,
dropped as positives, dropped as copies of a positive, dropped as false negatives, and
records left short.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._progress import progress_bar
from ..data.readers.beir_dir import corpus_texts, iter_corpus, load_qrels, load_queries
from ..data.records.types import ImageDoc, doc_key
from ..errors import ConfigError, shown
from .corpus_cache import embed_corpus
from .evaluate import check_beir_split, corpus_scorer

__all__ = ["MiningOptions", "MiningReport", "mine_hard_negatives", "mine_pairs"]


@dataclass
class MiningOptions:
    num_negatives: int = 8
    rank_start: int = 0
    rank_end: int = 100
    max_score_ratio: float | None = 0.95
    margin: float | None = None
    index: str = "flat"
    batch_size: int = 64
    min_negatives: int | None = None
    scores: bool = False  # write pos_score and neg_scores (the mining model's similarities)

    @property
    def required(self) -> int:
        return self.num_negatives if self.min_negatives is None else self.min_negatives

    def validate(self) -> "MiningOptions":
        if self.num_negatives <= 0:
            raise ConfigError(f"--num-negatives must be > 0, got {self.num_negatives}")
        if not 0 <= self.rank_start < self.rank_end:
            raise ConfigError(f"--rank-window must satisfy 0 <= start < end, got "
                              f"{self.rank_start}:{self.rank_end}")
        if self.rank_end - self.rank_start < self.num_negatives:
            raise ConfigError(f"--rank-window {self.rank_start}:{self.rank_end} holds fewer than "
                              f"--num-negatives {self.num_negatives} candidates")
        if self.max_score_ratio is not None and not 0 < self.max_score_ratio:
            raise ConfigError(f"--max-score-ratio must be > 0, got {self.max_score_ratio}")
        if not 0 <= self.required <= self.num_negatives:
            raise ConfigError(f"--min-negatives must be in [0, --num-negatives], got "
                              f"{self.min_negatives}")
        if self.index not in ("flat", "hnsw"):
            raise ConfigError(f"--index must be 'flat' or 'hnsw', got {shown(self.index)}")
        return self


@dataclass
class MiningReport:
    queries: int = 0
    records: int = 0
    candidates_seen: int = 0
    dropped_as_positive: int = 0
    dropped_as_copy_of_positive: int = 0
    dropped_as_false_negative: int = 0
    short_records: int = 0
    skipped_records: int = 0
    negatives_written: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def lines(self) -> list[str]:
        return [f"queries: {self.queries}", f"records written: {self.records}",
                f"candidates seen: {self.candidates_seen}",
                f"dropped as known positives: {self.dropped_as_positive}",
                f"dropped as copies of a positive (same content, another id): "
                f"{self.dropped_as_copy_of_positive}",
                f"dropped as likely false negatives: {self.dropped_as_false_negative}",
                f"negatives written: {self.negatives_written}",
                f"records written with fewer than {self.options.get('num_negatives')} "
                f"negatives: {self.short_records}",
                f"(query, positive) pairs not written, too few negatives left after filtering: "
                f"{self.skipped_records}"]


def _index(emb: torch.Tensor, kind: str) -> Any:
    import faiss

    d = emb.shape[1]
    if kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = 256
    else:
        index = faiss.IndexFlatIP(d)
    index.add(emb.numpy().astype("float32"))
    return index


class _DenseSearch:
    """Cosine similarity through faiss: the corpus's and the queries' embeddings, each
    L2-normalised."""

    def __init__(self, encoder: Any, corpus_path: Path, texts: list[str],
                 options: MiningOptions, device: Any, cache_dir: Any, progress: bool) -> None:
        self.doc_ids, doc_emb = embed_corpus(encoder, corpus_path, batch_size=options.batch_size,
                                             device=device, cache_dir=cache_dir,
                                             progress=progress)
        self.docs = torch.nn.functional.normalize(doc_emb.float(), dim=-1)
        self.queries = torch.nn.functional.normalize(torch.as_tensor(encoder.encode(
            texts, "query", batch_size=options.batch_size, device=device,
            progress="embed queries" if progress else None)).float(), dim=-1)
        self.index = _index(self.docs, options.index)

    def ranked(self, qi: int, depth: int) -> list[tuple[int, float]]:
        """The ``depth`` best documents of query ``qi``: (corpus position, score)."""
        scores, idx = self.index.search(self.queries[qi:qi + 1].numpy(), depth)
        return [(int(j), float(s)) for j, s in zip(idx[0], scores[0]) if j >= 0]

    def score(self, qi: int, j: int) -> float:
        return float(self.queries[qi] @ self.docs[j])


class _ScoredSearch:
    """Exact search by an evaluation's scores (:func:`~bigbatch.retrieval.evaluate.corpus_scorer`:
    MaxSim against the token store for a multi-vector model), a block of queries at a time
    (the current block's scores kept)."""

    def __init__(self, encoder: Any, corpus_path: Path, texts: list[str],
                 options: MiningOptions, device: Any, cache_dir: Any, progress: bool) -> None:
        if options.index != "flat":
            raise ConfigError(f"--index {options.index}: a multi-vector model is searched "
                              f"exactly (MaxSim against its token store); use --index flat")
        self.doc_ids, self._scores, self._block = corpus_scorer(
            encoder, corpus_path, texts, batch_size=options.batch_size, device=device,
            cache_dir=cache_dir, progress=progress)
        self._n = len(texts)
        self._held: tuple[int, torch.Tensor] | None = None

    def _row(self, qi: int) -> torch.Tensor:
        start = qi - qi % self._block
        if self._held is None or self._held[0] != start:
            rows = list(range(start, min(self._n, start + self._block)))
            self._held = (start, self._scores(rows))
        return self._held[1][qi - start]

    def ranked(self, qi: int, depth: int) -> list[tuple[int, float]]:
        scores, idx = torch.topk(self._row(qi), min(depth, len(self.doc_ids)))
        return list(zip(idx.tolist(), scores.tolist()))

    def score(self, qi: int, j: int) -> float:
        return float(self._row(qi)[j])


_SEARCHES = {False: _DenseSearch, True: _ScoredSearch}  # by the encoder's multi_vector


def _too_close(score: float, pos_score: float, options: MiningOptions) -> bool:
    """Whether a candidate scoring ``score`` is a likely false negative of a positive scoring
    ``pos_score``: above the ratio threshold (``ratio * pos_score`` for a positive score,
    ``pos_score - (1 - ratio) * |pos_score|`` in general, which stays below the positive when
    its score is negative) or within ``margin`` of it."""
    ratio, margin = options.max_score_ratio, options.margin
    if ratio is not None:
        threshold = ratio * pos_score if pos_score >= 0 else pos_score - (1 - ratio) * -pos_score
        if score > threshold:
            return True
    return margin is not None and score > pos_score - margin


def _positive_copies(corpus_path: Path, positive_ids: set[str]) -> dict[str, str]:
    """``{doc id: content key}`` of every corpus document whose content (a text's hash, an
    image's path) is that of a positive, the positives included (two streaming passes)."""
    keys = {doc_key(d) for d in corpus_texts(corpus_path, positive_ids).values()}
    return {d: k for block in iter_corpus(corpus_path) for d, k in
            ((d, doc_key(doc)) for d, doc in block) if k in keys}


def _record(query: str, qid: str, pid: str, negs: list[str], docs: dict[str, Any],
            folder: Path, scores: dict[str, float] | None = None) -> dict[str, Any]:
    """One output line: texts as ``positive``/``negatives``, page images as Qwen3-VL-Embedding's
    ``chunk_path``/``neg_chunk_paths`` (relative to the output's folder, as the reader
    resolves them); ``negative_ids`` (and ``neg_scores``, with ``scores``: each document's
    score by id) in the order the reader lists negatives (image paths, then texts)."""
    def path(doc: ImageDoc) -> str:
        return os.path.relpath(doc.path, folder)

    rec: dict[str, Any] = {"query": query}
    pos = docs[pid]
    rec.update({"chunk_path": path(pos)} if isinstance(pos, ImageDoc) else {"positive": pos})
    image_ids = [d for d in negs if isinstance(docs[d], ImageDoc)]
    text_ids = [d for d in negs if not isinstance(docs[d], ImageDoc)]
    if image_ids:
        rec["neg_chunk_paths"] = [path(docs[d]) for d in image_ids]
    if text_ids or not image_ids:
        rec["negatives"] = [docs[d] for d in text_ids]
    rec.update({"query_id": qid, "positive_id": pid, "negative_ids": image_ids + text_ids})
    if scores is not None:
        rec["pos_score"] = scores[pid]
        rec["neg_scores"] = [scores[d] for d in image_ids + text_ids]
    return rec


def mine_pairs(encoder: Any, corpus_path: str | Path, queries: dict[str, str],
               qrels: dict[str, dict[str, int]], options: MiningOptions, *, device: Any = None,
               cache_dir: str | Path | None = None, progress: bool = True
               ) -> tuple[list[tuple[str, str, list[str], dict[str, float]]], MiningReport]:
    """Steps 1-4 of the module docstring for every (query, positive) of ``qrels`` (query id
    -> positive corpus ids; every query of it in ``queries``) against the corpus file
    ``corpus_path``: ``(chosen, report)``, ``chosen`` holding ``(query id, positive id,
    negative ids, scores by id)`` in query order, positives sorted, for each pair written.
    ``encoder`` embeds the corpus and the queries (``cache_dir``: the corpus cache, None for
    none: an encoder whose weights change, as in training, must not use it)."""
    options.validate()
    corpus_path = Path(corpus_path)
    qids = list(qrels)
    search = _SEARCHES[bool(getattr(encoder, "multi_vector", False))](
        encoder, corpus_path, [queries[q] for q in qids], options, device, cache_dir, progress)
    doc_ids = search.doc_ids
    row = {d: i for i, d in enumerate(doc_ids)}
    copies = _positive_copies(corpus_path, {d for rel in qrels.values() for d in rel})
    holding: dict[str, list[str]] = {}  # content key -> the ids holding it
    for d, k in copies.items():
        holding.setdefault(k, []).append(d)
    report = MiningReport(queries=len(qids), options=asdict(options))
    # (query id, positive id, negative ids, each one's score: the positive's and the negatives')
    chosen: list[tuple[str, str, list[str], dict[str, float]]] = []
    n_docs = len(doc_ids)
    bar = progress_bar(total=len(qids), desc="mine", unit="query") if progress else None
    for qi, qid in enumerate(qids):
        positives = qrels[qid]
        # documents holding a positive's content under another id are positives too
        copy = {d for k in {copies[p] for p in positives if p in copies}
                for d in holding[k]} - set(positives)
        depth = min(n_docs, options.rank_end + len(positives))
        while True:
            ranked = [(doc_ids[j], s) for j, s in search.ranked(qi, depth)]
            non_pos = [(d, s) for d, s in ranked if d not in positives and d not in copy]
            window = non_pos[options.rank_start:options.rank_end]
            enough = len(window) >= options.rank_end - options.rank_start
            if enough or depth >= n_docs:
                break
            depth = min(n_docs, depth * 2)
        # known positives met in the part of the ranking that was examined
        examined = len(ranked)
        if window:
            last = window[-1][0]
            examined = next(i for i, (d, _) in enumerate(ranked) if d == last) + 1
        report.dropped_as_positive += sum(1 for d, _ in ranked[:examined] if d in positives)
        report.dropped_as_copy_of_positive += sum(1 for d, _ in ranked[:examined] if d in copy)
        for pid in sorted(positives):
            if pid not in row:
                continue
            pos_score = search.score(qi, row[pid])
            negs, scored = [], {pid: pos_score}
            for d, s in window:
                report.candidates_seen += 1
                if _too_close(s, pos_score, options):
                    report.dropped_as_false_negative += 1
                    continue
                negs.append(d)
                scored[d] = s
                if len(negs) == options.num_negatives:
                    break
            if len(negs) < options.required:
                report.skipped_records += 1
                continue
            if len(negs) < options.num_negatives:
                report.short_records += 1
            chosen.append((qid, pid, negs, scored))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return chosen, report


def mine_hard_negatives(encoder: Any, root: str | Path, split: str, out: str | Path,
                        options: MiningOptions, *, device: Any = None,
                        cache_dir: str | Path | None = None, progress: bool = True) -> MiningReport:
    """Mine negatives for every (query, positive) of ``qrels/<split>.tsv`` in a BEIR directory
    and write them to ``out`` (JSONL); returns the report (also written as ``out``.report.json)."""
    options.validate()
    root = Path(root)
    check_beir_split(root, split)  # qrels, queries and corpus ids agree: before any embedding
    qrels = {q: {d: s for d, s in rel.items() if s > 0}
             for q, rel in load_qrels(root / "qrels" / f"{split}.tsv").items()}
    qrels = {q: rel for q, rel in qrels.items() if rel}
    queries = load_queries(root / "queries.jsonl", set(qrels))
    qrels = {q: qrels[q] for q in queries}  # in the queries file's order
    chosen, report = mine_pairs(encoder, root / "corpus.jsonl", queries, qrels, options,
                                device=device, cache_dir=cache_dir, progress=progress)
    docs = corpus_texts(root / "corpus.jsonl",
                        {d for _, p, n, _ in chosen for d in [p, *n]})  # texts or ImageDocs
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for qid, pid, negs, scored in chosen:
            f.write(json.dumps(_record(queries[qid], qid, pid, negs, docs, out.parent,
                                       scored if options.scores else None),
                               ensure_ascii=False) + "\n")
            report.records += 1
            report.negatives_written += len(negs)
    Path(str(out) + ".report.json").write_text(json.dumps(asdict(report), indent=2))
    return report
