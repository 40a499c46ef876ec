"""Full-corpus retrieval evaluation on a BEIR split: nDCG@10, Recall@1/5/10, MRR@10, and the
mean similarity of positives and negatives with their margin.

Exact search: every query against every document (a matrix product in blocks of queries,
or for a multi-vector model MaxSim against the corpus's stored token vectors), so the numbers
are reproducible and comparable to published BEIR/MTEB figures (for all-MiniLM-L6-v2 on
SciFact test, 0.6451 nDCG@10 at max length 256).

Definitions (as trec_eval / pytrec_eval, which BEIR and MTEB use):
    nDCG@k = DCG@k / IDCG@k, DCG@k = sum_{i<=k} rel_i / log2(i + 1) (linear gain),
    Recall@k = |relevant in top k| / |relevant|, MRR@k = 1 / rank of the first relevant
    document in the top k (0 if none), each averaged over queries. Documents of equal score
    are ranked as trec_eval ranks them: by document id in descending string order, so a run
    with tied scores (duplicate documents) gives the numbers pytrec_eval gives.
    pos_sim: mean similarity of (query, relevant document) pairs; neg_sim: mean over queries
    of the mean similarity to all non-relevant documents; margin = pos_sim - neg_sim.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["retrieval_metrics", "evaluate_retrieval", "evaluate_scores", "evaluate_beir",
           "evaluate_beir_dims", "evaluate_sets", "corpus_scorer",
           "unseen_query_ids", "check_beir_split", "METRIC_NAMES", "LOWER_IS_BETTER"]

METRIC_NAMES = ("ndcg@10", "recall@1", "recall@5", "recall@10", "mrr@10", "pos_sim", "neg_sim",
                "margin")
LOWER_IS_BETTER = ("neg_sim",)  # the mean similarity to non-relevant documents


def retrieval_metrics(ranked: Mapping[str, Sequence[str]],
                      qrels: Mapping[str, Mapping[str, int]]) -> dict[str, float]:
    """nDCG@10, Recall@1/5/10 and MRR@10 from ranked document ids per query.

    ``ranked[q]`` lists document ids best first (at least 10 when the corpus has them);
    queries without a positive relevance judgement are skipped.
    """
    sums = {"ndcg@10": 0.0, "recall@1": 0.0, "recall@5": 0.0, "recall@10": 0.0, "mrr@10": 0.0}
    n = 0
    for q, rels in qrels.items():
        relevant = {d: r for d, r in rels.items() if r > 0}
        if not relevant or q not in ranked:
            continue
        n += 1
        top = list(ranked[q])[:10]
        dcg = sum(relevant.get(d, 0) / math.log2(i + 2) for i, d in enumerate(top))
        ideal = sorted(relevant.values(), reverse=True)[:10]
        idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
        sums["ndcg@10"] += dcg / idcg
        for k in (1, 5, 10):
            sums[f"recall@{k}"] += sum(1 for d in top[:k] if d in relevant) / len(relevant)
        for i, d in enumerate(top):
            if d in relevant:
                sums["mrr@10"] += 1.0 / (i + 1)
                break
    return {k: v / n if n else float("nan") for k, v in sums.items()} | {"queries": float(n)}


def _top_ranked(sims: Tensor, doc_ids: Sequence[str], k: int) -> list[list[str]]:
    """The ``k`` best document ids of each row of ``sims`` (a block of queries x all
    documents), best first, with ties ordered as trec_eval orders them (score descending,
    then document id descending), including ties that straddle the k-th place."""
    vals, idx = sims.topk(k, dim=1)
    at_least_kth = sims >= vals[:, -1:]
    straddle = (at_least_kth.sum(1) > k).tolist()
    vals_l, idx_l = vals.tolist(), idx.tolist()
    out = []
    for row in range(sims.shape[0]):
        if straddle[row]:
            cols = at_least_kth[row].nonzero().squeeze(1)
            pairs = list(zip(sims[row, cols].tolist(), cols.tolist()))
        else:
            pairs = list(zip(vals_l[row], idx_l[row]))
        pairs.sort(key=lambda p: doc_ids[p[1]], reverse=True)
        pairs.sort(key=lambda p: p[0], reverse=True)  # stable: equal scores keep id order
        out.append([doc_ids[j] for _, j in pairs[:k]])
    return out


def evaluate_retrieval(query_emb: Tensor, doc_emb: Tensor, query_ids: Sequence[str],
                       doc_ids: Sequence[str], qrels: Mapping[str, Mapping[str, int]],
                       top_k: int = 10, block: int = 256) -> dict[str, float]:
    """Exact search of every query against every document, then :func:`retrieval_metrics`
    plus pos_sim, neg_sim and margin."""
    d = doc_emb.float()
    return evaluate_scores(lambda rows: query_emb[rows].float() @ d.T, query_ids, doc_ids,
                           qrels, top_k, block)


def evaluate_scores(scores: Callable[[list[int]], Tensor], query_ids: Sequence[str],
                    doc_ids: Sequence[str], qrels: Mapping[str, Mapping[str, int]],
                    top_k: int = 10, block: int = 256) -> dict[str, float]:
    """:func:`evaluate_retrieval` for any similarity: ``scores(rows)`` gives the
    ``(len(rows), documents)`` similarities of the queries ``rows`` (positions in
    ``query_ids``) with every document, asked for ``block`` queries at a time."""
    doc_index = {d: i for i, d in enumerate(doc_ids)}
    ranked: dict[str, list[str]] = {}
    pos_sum, pos_n, neg_means = 0.0, 0, []
    n_docs = len(doc_ids)
    k = min(top_k, n_docs)
    for lo in range(0, len(query_ids), block):
        sims = scores(list(range(lo, min(lo + block, len(query_ids)))))
        top = _top_ranked(sims, doc_ids, k) if k else [[] for _ in range(sims.shape[0])]
        totals = sims.sum(1).tolist()
        for row, qid in enumerate(query_ids[lo:lo + block]):
            ranked[qid] = top[row]
            rel = [doc_index[x] for x, r in qrels.get(qid, {}).items() if r > 0 and x in doc_index]
            if not rel:
                continue
            rel_sims = sims[row, rel]
            pos_sum += rel_sims.sum().item()
            pos_n += len(rel)
            if n_docs > len(rel):
                neg_means.append((totals[row] - rel_sims.sum().item()) / (n_docs - len(rel)))
    out = retrieval_metrics(ranked, qrels)
    out["pos_sim"] = pos_sum / pos_n if pos_n else float("nan")
    out["neg_sim"] = sum(neg_means) / len(neg_means) if neg_means else float("nan")
    out["margin"] = out["pos_sim"] - out["neg_sim"]
    return out


def unseen_query_ids(root: str | Path, split: str = "test", seen_split: str = "train") -> list[str]:
    """Queries of ``split`` none of whose relevant documents appear in ``qrels/<seen_split>.tsv``
    (SciFact: 104 of the 300 test claims). Empty when that qrels file does not exist."""
    from ..data.readers.beir_dir import load_qrels

    seen_path = Path(root) / "qrels" / f"{seen_split}.tsv"
    if not seen_path.exists():
        return []
    seen = {d for rels in load_qrels(seen_path).values() for d, r in rels.items() if r > 0}
    qrels = load_qrels(Path(root) / "qrels" / f"{split}.tsv")
    return sorted(q for q, rels in qrels.items()
                  if not any(d in seen for d, r in rels.items() if r > 0))


def _check_qrels_in_corpus(qrels: Mapping[str, Mapping[str, int]], corpus_ids: set[str],
                           split: str, corpus: Path) -> None:
    """DataError when a document the qrels judge is not in the corpus (its metrics would be
    silently wrong: a relevant document that can never be retrieved)."""
    missing = sorted({d for rel in qrels.values() for d in rel if d not in corpus_ids})
    if missing:
        from ..errors import DataError, shown

        raise DataError(f"{len(missing)} corpus ids of qrels/{split}.tsv are not in corpus.jsonl "
                        f"(first: {shown(missing[0])})", path=str(corpus))


def check_beir_split(root: str | Path, split: str = "test",
                     metric: str | None = None) -> None:
    """Check, without embedding anything, that :func:`evaluate_beir` can run on ``split`` of
    ``root`` (qrels, their queries and corpus ids present) and that ``metric`` will be among
    its results (an ``unseen/`` metric needs ``qrels/train.tsv`` and at least one unseen
    query), so a run finds a bad evaluation set before training, not after it.

    Raises:
        DataError: a missing file, a malformed line, no query with a relevant judgement, a
            qrels id missing from the corpus or queries, or a metric the split cannot give.
    """
    from ..data.readers.beir_dir import load_qrels, load_queries
    from ..data.readers.jsonl import iter_jsonl
    from ..errors import DataError

    root = Path(root)
    if not root.is_dir():
        raise DataError("evaluation data must be a BEIR directory (corpus.jsonl, "
                        "queries.jsonl, qrels/<split>.tsv)", path=str(root))
    qrels = load_qrels(root / "qrels" / f"{split}.tsv")
    if not any(r > 0 for rel in qrels.values() for r in rel.values()):
        raise DataError(f"no query has a relevant judgement (score > 0) among the "
                        f"{len(qrels)} of qrels/{split}.tsv: nothing to evaluate (every "
                        f"metric would be NaN)", path=str(root / "qrels" / f"{split}.tsv"))
    load_queries(root / "queries.jsonl", set(qrels))
    corpus = root / "corpus.jsonl"
    if not corpus.exists():
        raise DataError("file not found", path=str(corpus))
    ids = set()
    for n, rec, problem in iter_jsonl(corpus):
        if problem is not None or "_id" not in rec:
            raise DataError(problem or "missing key", path=str(corpus), line=n,
                            field=None if problem else "_id")
        ids.add(str(rec["_id"]))
    _check_qrels_in_corpus(qrels, ids, split, corpus)
    if metric is not None and metric.startswith("unseen/") and \
            not unseen_query_ids(root, split, "train"):
        raise DataError(f"the metric {metric!r} needs queries of {split} whose relevant "
                        f"documents are absent from qrels/train.tsv; there are none (or no "
                        f"qrels/train.tsv)", path=str(root / "qrels"))


Scorer = Callable[[list[int]], Tensor]  # query positions -> (rows, documents) similarities


def _dense_embeddings(encoder: Any, corpus: Path, texts: list[str], batch_size: int,
                      device: Any, cache_dir: Any, progress: bool
                      ) -> tuple[list[str], Tensor, Tensor, int]:
    """One vector per text: the corpus's ids and embeddings (cached), the queries' and the
    queries per block of scores."""
    from .corpus_cache import embed_corpus

    doc_ids, doc_emb = embed_corpus(encoder, corpus, batch_size=batch_size, device=device,
                                    cache_dir=cache_dir, progress=progress)
    query_emb = torch.as_tensor(encoder.encode(texts, side="query", batch_size=batch_size,
                                               device=device,
                                               progress="embed queries" if progress else None))
    d = doc_emb.float()  # no copy for the float32 (memory-mapped) corpus embeddings
    # queries per block: 256, or fewer so that one block's scores stay within 2**24 (64 MiB)
    block = min(256, max(1, 2 ** 24 // max(1, len(doc_ids))))
    return doc_ids, query_emb, d, block


def _dense_scorer(encoder: Any, corpus: Path, texts: list[str], batch_size: int, device: Any,
                  cache_dir: Any, progress: bool) -> tuple[list[str], Scorer, int]:
    """One vector per text: dot products with the corpus's embeddings (cached)."""
    doc_ids, query_emb, d, block = _dense_embeddings(encoder, corpus, texts, batch_size, device,
                                                     cache_dir, progress)
    return doc_ids, lambda rows: query_emb[rows].float() @ d.T, block


def _maxsim_scorer(encoder: Any, corpus: Path, texts: list[str], batch_size: int, device: Any,
                   cache_dir: Any, progress: bool) -> tuple[list[str], Scorer, int]:
    """One vector per token: MaxSim (divided by the query's token count) against the corpus's
    token store, a block of documents at a time; as many queries at once as keep the
    scores under 256 MiB. When every query's scores fit there, they are computed once (the
    ``unseen/`` subset takes its rows from them)."""
    from ..engine.embeddings import TokenEmbeddings
    from .token_store import embed_corpus_tokens

    # split over the ranks (retrieval.distributed_eval.SplitEncoder): each rank's part
    split = getattr(encoder, "corpus_token_store", None)
    store = split(corpus, batch_size=batch_size, device=device, cache_dir=cache_dir,
                  progress=progress) if split is not None else \
        embed_corpus_tokens(encoder, corpus, batch_size=batch_size, device=device,
                            cache_dir=cache_dir, progress=progress)
    q = encoder.encode(texts, side="query", batch_size=batch_size, device=device,
                       progress="embed queries" if progress else None)
    block = max(1, 2 ** 26 // max(1, len(store)))
    every: list[Tensor] = []

    def scores(rows: list[int]) -> Tensor:
        if len(texts) > block:
            return store.scores(TokenEmbeddings(q.values[rows], q.mask[rows]))
        if not every:
            every.append(store.scores(q))
        return every[0][rows]

    return store.ids, scores, block


_SCORERS = {False: _dense_scorer, True: _maxsim_scorer}  # by the encoder's multi_vector


def corpus_scorer(encoder: Any, corpus: str | Path, texts: list[str], *, batch_size: int = 64,
                  device: torch.device | str | None = None, cache_dir: str | Path | None = None,
                  progress: bool = True) -> tuple[list[str], Scorer, int]:
    """How an evaluation scores the queries ``texts`` against the corpus file ``corpus``:
    ``(corpus ids, scores, block)``, ``scores(positions)`` giving those queries'
    similarities with every document (``(rows, documents)``, float32) and ``block`` the
    most queries to ask for at once. One vector per text: inner products with the corpus's
    embeddings; a multi-vector encoder: MaxSim divided by the query's token count, against
    the corpus's token store (split over the ranks for a
    :class:`~bigbatch.retrieval.distributed_eval.SplitEncoder`)."""
    scorer = _SCORERS[bool(getattr(encoder, "multi_vector", False))]
    return scorer(encoder, Path(corpus), texts, batch_size, device, cache_dir, progress)


def evaluate_beir(encoder: Any, root: str | Path, split: str = "test", batch_size: int = 64,
                  device: torch.device | str | None = None, unseen_from: str | None = "train",
                  cache_dir: str | Path | None = None, progress: bool = True) -> dict[str, float]:
    """Embed the whole corpus (streamed in blocks; cached in ``cache_dir`` when given) and the
    split's queries with ``encoder`` (a :class:`bigbatch.encoders.TextEncoder`) and return the
    metrics; with ``unseen_from``, the same metrics on the queries whose relevant documents
    are not in that split's qrels are added with the prefix ``unseen/``.

    A multi-vector encoder (``encoder.multi_vector``) is scored by MaxSim, divided by the
    query's token count (so pos_sim and neg_sim stay in [-1, 1]; the ranking is MaxSim's):
    the documents' token vectors are stored once (float16, memory-mapped; in ``cache_dir``
    when given, else a temporary folder), see :mod:`bigbatch.retrieval.token_store`."""
    root = Path(root)
    check_beir_split(root, split)  # qrels, queries and corpus ids agree: before any embedding
    qrels, query_ids, texts = _split_queries(root, split)
    doc_ids, scores, block = corpus_scorer(encoder, root / "corpus.jsonl", texts,
                                           batch_size=batch_size, device=device,
                                           cache_dir=cache_dir, progress=progress)
    return _split_metrics(scores, root, split, qrels, query_ids, doc_ids, block, unseen_from)


def evaluate_beir_dims(encoder: Any, root: str | Path, dims: Sequence[int], split: str = "test",
                       batch_size: int = 64, device: torch.device | str | None = None,
                       unseen_from: str | None = "train", cache_dir: str | Path | None = None,
                       progress: bool = True) -> dict[int, dict[str, float]]:
    """:func:`evaluate_beir` at each Matryoshka width of ``dims``: the corpus and the queries
    are embedded once, then each width's metrics come from the embeddings' first ``dim``
    coordinates, L2-normalised again (as ``SentenceTransformer(..., truncate_dim=dim)``
    with cosine similarity ranks). Returns ``{dim: metrics}``.

    Raises:
        ConfigError: a multi-vector encoder, or a width larger than the embeddings'.
    """
    from ..errors import ConfigError

    if getattr(encoder, "multi_vector", False):
        raise ConfigError("--dims applies to one vector per text; this model is multi-vector")
    root = Path(root)
    check_beir_split(root, split)  # before any embedding
    qrels, query_ids, texts = _split_queries(root, split)
    width = encoder.encode(texts[:1], side="query", device=device).shape[1]  # before the corpus
    too_wide = [m for m in dims if m > width]
    if too_wide:
        raise ConfigError(f"--dims: {too_wide} larger than the model's embedding width {width}")
    doc_ids, query_emb, d, block = _dense_embeddings(encoder, root / "corpus.jsonl", texts,
                                                     batch_size, device, cache_dir, progress)
    out = {}
    for m in dims:
        q_m = torch.nn.functional.normalize(query_emb[:, :m].float(), dim=-1)
        d_m = torch.nn.functional.normalize(d[:, :m], dim=-1)
        out[m] = _split_metrics(lambda rows: q_m[rows] @ d_m.T, root, split, qrels, query_ids,
                                doc_ids, block, unseen_from)
    return out


def _split_queries(root: Path, split: str) -> tuple[dict, list[str], list[str]]:
    """The split's qrels, its query ids and their texts."""
    from ..data.readers.beir_dir import load_qrels, load_queries

    qrels = load_qrels(root / "qrels" / f"{split}.tsv")
    queries = load_queries(root / "queries.jsonl", set(qrels))
    query_ids = list(queries)
    return qrels, query_ids, [queries[q] for q in query_ids]


def _split_metrics(scores: Scorer, root: Path, split: str, qrels: dict, query_ids: list[str],
                   doc_ids: list[str], block: int, unseen_from: str | None) -> dict[str, float]:
    """The metrics of all the split's queries and, with ``unseen_from``, of its unseen ones."""
    from ..data.readers.beir_dir import check_corpus_ids

    check_corpus_ids(doc_ids, root / "corpus.jsonl")  # a repeated id: recall above 1
    _check_qrels_in_corpus(qrels, set(doc_ids), split, root / "corpus.jsonl")
    out = evaluate_scores(scores, query_ids, doc_ids, qrels, block=block)
    if unseen_from:
        unseen = set(unseen_query_ids(root, split, unseen_from))
        if unseen:
            idx = [i for i, q in enumerate(query_ids) if q in unseen]
            sub = evaluate_scores(lambda rows: scores([idx[r] for r in rows]),
                                  [query_ids[i] for i in idx], doc_ids,
                                  {q: qrels[q] for q in unseen}, block=block)
            out.update({f"unseen/{k}": v for k, v in sub.items()})
    return out


def evaluate_sets(encoder: Any, sets: Sequence[Any], split: str = "test", batch_size: int = 64,
                  device: torch.device | str | None = None, unseen_from: str | None = "train",
                  cache_dir: str | Path | None = None,
                  progress: bool = True) -> dict[str, float]:
    """:func:`evaluate_beir` on each evaluation set (anything with ``path`` and ``name``,
    such as :class:`~bigbatch.data.mix.SourceSpec`), each embedded with the prompts of the
    encoder's task of the same name (``encoder.tasks``; else its own prompts).

    One set: its metrics as they are. Several: each set's metrics prefixed by its name
    (``scifact/ndcg@10``) and, unprefixed, the mean over the sets of every metric they all
    report (what ``--best-metric`` selects ``best/`` by).

    Example::

        metrics = evaluate_sets(encoder, [SourceSpec("data/scifact", "scifact"),
                                          SourceSpec("data/nfcorpus", "nfcorpus")])
        metrics["ndcg@10"]  # the mean of the two
    """
    results = []
    for s in sets:
        with encoder.using_prompts(**encoder.task_prompts(s.name)):
            results.append(evaluate_beir(encoder, s.path, split, batch_size=batch_size,
                                         device=device, unseen_from=unseen_from,
                                         cache_dir=cache_dir, progress=progress))
    if len(results) == 1:
        return results[0]
    out: dict[str, float] = {}
    common = set.intersection(*(set(r) for r in results))
    for key in [k for k in results[0] if k in common]:
        out[key] = sum(r[key] for r in results) / len(results)
    for s, r in zip(sets, results):
        out.update({f"{s.name}/{k}": v for k, v in r.items()})
    return out
