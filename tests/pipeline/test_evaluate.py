"""Retrieval metrics against values computed by hand on a crafted ranking."""

from __future__ import annotations

import math

import pytest
import torch

from bigbatch.errors import DataError
from bigbatch.retrieval.evaluate import (
    check_beir_split,
    evaluate_retrieval,
    retrieval_metrics,
    unseen_query_ids,
)


def test_metrics_by_hand():
    ranked = {
        "q1": ["d1", "d2", "d3"] + [f"x{i}" for i in range(7)],   # relevant d1 at rank 1
        "q2": ["x0", "x1", "d5"] + [f"x{i}" for i in range(2, 9)],  # relevant d5 at 3, d6 missing
        "q3": ["x0"] * 10,                                          # nothing found
    }
    qrels = {"q1": {"d1": 1}, "q2": {"d5": 1, "d6": 1}, "q3": {"d9": 1}, "q4": {"d1": 0}}
    m = retrieval_metrics(ranked, qrels)
    ndcg_q2 = (1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert m["queries"] == 3  # q4 has no positive judgement
    assert m["ndcg@10"] == pytest.approx((1 + ndcg_q2 + 0) / 3)
    assert m["recall@1"] == pytest.approx((1 + 0 + 0) / 3)
    assert m["recall@5"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["recall@10"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["mrr@10"] == pytest.approx((1 + 1 / 3 + 0) / 3)


def test_graded_relevance_uses_linear_gain():
    m = retrieval_metrics({"q": ["a", "b"]}, {"q": {"a": 1, "b": 2}})
    dcg = 1 / math.log2(2) + 2 / math.log2(3)
    idcg = 2 / math.log2(2) + 1 / math.log2(3)
    assert m["ndcg@10"] == pytest.approx(dcg / idcg)


def test_exact_search_and_similarities():
    docs = torch.eye(4)
    queries = torch.tensor([[1.0, 0, 0, 0], [0, 0.6, 0.8, 0]])
    m = evaluate_retrieval(queries, docs, ["q1", "q2"], ["a", "b", "c", "d"],
                           {"q1": {"a": 1}, "q2": {"b": 1}})
    # q2 ranks c (0.8) above b (0.6): rank 2
    assert m["recall@1"] == pytest.approx(0.5)
    assert m["mrr@10"] == pytest.approx((1 + 0.5) / 2)
    assert m["pos_sim"] == pytest.approx((1.0 + 0.6) / 2)
    assert m["neg_sim"] == pytest.approx((0.0 + 0.8 / 3) / 2)
    assert m["margin"] == pytest.approx(m["pos_sim"] - m["neg_sim"])


def test_unseen_queries_of_scifact():
    from pipeline_helpers import need_scifact
    assert len(unseen_query_ids(need_scifact(), "test", "train")) == 104


def test_check_beir_split_finds_what_evaluation_would_fail_on(tmp_path):
    """Checked before training, so a bad evaluation set is not found after the last step."""
    import shutil

    from pipeline_helpers import scifact_slice

    data = scifact_slice(tmp_path / "sf")
    check_beir_split(data, "test", "unseen/ndcg@10")  # fine as it is
    with pytest.raises(DataError, match="qrels file not found"):
        check_beir_split(data, "dev")
    with pytest.raises(DataError, match="BEIR directory"):
        check_beir_split(data / "corpus.jsonl", "test")
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    import json
    gone = (bad / "qrels" / "test.tsv").read_text().splitlines()[1].split("\t")[1]
    lines = (bad / "corpus.jsonl").read_text().splitlines(keepends=True)
    (bad / "corpus.jsonl").write_text("".join(l for l in lines if json.loads(l)["_id"] != gone))
    with pytest.raises(DataError, match="corpus ids of qrels/test.tsv are not in corpus.jsonl"):
        check_beir_split(bad, "test")
    (bad / "qrels" / "train.tsv").unlink()
    shutil.copy(data / "corpus.jsonl", bad / "corpus.jsonl")
    check_beir_split(bad, "test", "ndcg@10")
    with pytest.raises(DataError, match="unseen/ndcg@10"):
        check_beir_split(bad, "test", "unseen/ndcg@10")


def test_tied_scores_rank_as_pytrec_eval_ranks_them():
    """Duplicate documents score exactly alike; the top 10 and every metric must be those
    trec_eval gives (ties by document id, descending), also where a tie straddles rank 10."""
    pytrec_eval = pytest.importorskip("pytrec_eval")
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(-3, 4, (12, 8), generator=gen).double()
    docs = torch.cat([base, base[:6], base[:6]])          # 24 documents, many exact ties
    doc_ids = [f"d{i:02d}" for i in torch.randperm(24, generator=gen).tolist()]
    queries = torch.randint(-3, 4, (20, 8), generator=gen).double()
    query_ids = [f"q{i}" for i in range(20)]
    qrels = {q: {doc_ids[j]: 1 + (j % 2) for j in torch.randperm(24, generator=gen)[:3].tolist()}
             for q in query_ids}
    sims = queries @ docs.T
    assert (sims == sims[:, :1]).sum() > 20  # the data really has ties
    ours = evaluate_retrieval(queries, docs, query_ids, doc_ids, qrels)
    run = {q: {d: float(sims[i, j]) for j, d in enumerate(doc_ids)}
           for i, q in enumerate(query_ids)}
    ref = pytrec_eval.RelevanceEvaluator(
        qrels, {"ndcg_cut_10", "recall_1", "recall_5", "recall_10", "recip_rank"}).evaluate(run)
    mean = {m: sum(r[m] for r in ref.values()) / len(ref) for m in next(iter(ref.values()))}
    assert ours["ndcg@10"] == pytest.approx(mean["ndcg_cut_10"], abs=1e-12)
    for k in (1, 5, 10):
        assert ours[f"recall@{k}"] == pytest.approx(mean[f"recall_{k}"], abs=1e-12)
    mrr10 = sum(r["recip_rank"] if r["recip_rank"] >= 0.1 else 0.0 for r in ref.values()) / 20
    assert ours["mrr@10"] == pytest.approx(mrr10, abs=1e-12)


def test_top_ranked_orders_ties_by_descending_id_across_the_cutoff():
    from bigbatch.retrieval.evaluate import _top_ranked

    sims = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.1]])
    assert _top_ranked(sims, ["a", "b", "c", "d", "e"], 2) == [["b", "d"]]
    assert _top_ranked(sims, ["a", "b", "c", "d", "e"], 4) == [["b", "d", "c", "a"]]


def test_qrels_with_a_byte_order_mark_and_crlf_read(tmp_path):
    from bigbatch.data.readers.beir_dir import load_qrels

    p = tmp_path / "qrels.tsv"
    p.write_bytes(b"\xef\xbb\xbfquery-id\tcorpus-id\tscore\r\nq1\td1\t1\r\nq2\td2\t2.0\r\n")
    assert load_qrels(p) == {"q1": {"d1": 1}, "q2": {"d2": 2}}


def test_a_fractional_qrels_score_is_an_error_not_truncated(tmp_path):
    from bigbatch.data.readers.beir_dir import load_qrels

    p = tmp_path / "qrels.tsv"
    p.write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t0.5\n")
    with pytest.raises(DataError, match=r"qrels.tsv:3.*score.*not an integer"):
        load_qrels(p)
