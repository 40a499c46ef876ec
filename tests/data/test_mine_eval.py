"""bigbatch mine (rank window, positives never negatives, positive-aware false-negative rule,
several positives per query) and bigbatch eval (slice in the default suite, the published
SciFact figure in a slow test)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from bigbatch.cli import main
from bigbatch.errors import ConfigError
from bigbatch.retrieval.mining import MiningOptions, mine_hard_negatives


class StubEncoder:
    """Embeds each text as a fixed 2-D direction: a query looks along the x axis and document
    'd{i}' sits at the angle that gives it cosine similarity ``score[i]`` with it."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def encode(self, texts, kind="doc", **kw):
        out = []
        for t in texts:
            if kind == "query":
                out.append([1.0, 0.0])
            else:
                s = self.scores[t]
                out.append([s, (1 - s * s) ** 0.5])
        return torch.tensor(out)


def beir_dir(root: Path, docs: dict[str, str], queries: dict[str, str], qrels) -> Path:
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": d, "title": "", "text": t}) + "\n"
                                               for d, t in docs.items()))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n"
                                                for q, t in queries.items()))
    with open(root / "qrels" / "train.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["query-id", "corpus-id", "score"])
        w.writerows(qrels)
    return root


@pytest.fixture
def corpus(tmp_path):
    # 20 documents with decreasing similarity to the query; d0 and d3 are its positives
    scores = {f"text {i}": 0.99 - 0.04 * i for i in range(20)}
    docs = {f"d{i}": f"text {i}" for i in range(20)}
    root = beir_dir(tmp_path / "beir", docs, {"q": "the query"}, [("q", "d0", 1), ("q", "d3", 1)])
    return root, StubEncoder(scores)


def mine(corpus, tmp_path, **kw):
    root, enc = corpus
    out = tmp_path / "hn.jsonl"
    report = mine_hard_negatives(enc, root, "train", out, MiningOptions(**kw), progress=False)
    return [json.loads(l) for l in out.read_text().splitlines()], report


def test_positives_never_negatives_and_rank_window(corpus, tmp_path):
    recs, report = mine(corpus, tmp_path, num_negatives=3, rank_start=2, rank_end=10,
                        max_score_ratio=None)
    assert len(recs) == 2                                # one record per positive
    for r in recs:
        assert not {"d0", "d3"} & set(r["negative_ids"])
        # non-positive ranking is d1 d2 d4 d5 d6 ...; window [2, 10) starts at d4
        assert r["negative_ids"] == ["d4", "d5", "d6"]
    assert report.dropped_as_positive == 2 and report.short_records == 0


def test_positive_aware_false_negative_rule(corpus, tmp_path):
    # positive d0 scores 0.99, d3 scores 0.87; ratio 0.9 drops candidates above 0.9 * score
    recs, report = mine(corpus, tmp_path, num_negatives=4, rank_start=0, rank_end=15,
                        max_score_ratio=0.9)
    by_pos = {r["positive_id"]: r["negative_ids"] for r in recs}
    score = {f"d{i}": 0.99 - 0.04 * i for i in range(20)}
    assert all(score[d] <= 0.9 * 0.99 for d in by_pos["d0"])
    assert all(score[d] <= 0.9 * 0.87 for d in by_pos["d3"])
    assert by_pos["d0"] == ["d4", "d5", "d6", "d7"]      # d1 (0.95), d2 (0.91) dropped
    assert by_pos["d3"][0] == "d6"      # 0.9 * 0.87 = 0.783: d5 (0.79) dropped, d6 (0.75) kept
    assert report.dropped_as_false_negative > 0
    recs, _ = mine(corpus, tmp_path, num_negatives=2, rank_start=0, rank_end=10,
                   max_score_ratio=None, margin=0.1)
    assert {r["positive_id"]: r["negative_ids"] for r in recs}["d3"] == ["d6", "d7"]


def test_queries_with_several_positives_get_the_requested_count(corpus, tmp_path):
    recs, report = mine(corpus, tmp_path, num_negatives=8, rank_start=0, rank_end=8,
                        max_score_ratio=None)
    assert [len(r["negatives"]) for r in recs] == [8, 8]
    assert report.negatives_written == 16
    assert recs[0]["positive"] == "text 0" and recs[0]["negatives"][0] == "text 1"


def test_pairs_with_too_few_negatives_are_skipped_and_reported(corpus, tmp_path):
    # positive d3 (0.87) with ratio 0.9 keeps only candidates <= 0.783: d6.. in window [0, 6)
    recs, report = mine(corpus, tmp_path, num_negatives=3, rank_start=0, rank_end=6,
                        max_score_ratio=0.9)
    assert [r["positive_id"] for r in recs] == ["d0"] and report.skipped_records == 1
    recs, report = mine(corpus, tmp_path, num_negatives=3, rank_start=0, rank_end=6,
                        max_score_ratio=0.9, min_negatives=1)
    assert len(recs) == 2 and report.short_records == 1 and report.skipped_records == 0


def test_mining_options_are_checked():
    with pytest.raises(ConfigError, match="rank-window"):
        MiningOptions(num_negatives=5, rank_start=0, rank_end=3).validate()
    with pytest.raises(ConfigError, match="index"):
        MiningOptions(index="ivf").validate()


@pytest.fixture(scope="module")
def sf_slice(tmp_path_factory):
    from pipeline_helpers import scifact_slice
    return scifact_slice(tmp_path_factory.mktemp("sf") / "sf", n_train=40, n_test=30,
                         n_extra_docs=200)


def test_mine_command_on_scifact_slice_with_real_model(sf_slice, tmp_path, capsys):
    from pipeline_helpers import minilm_path
    out = tmp_path / "hn.jsonl"
    rc = main(["mine", "--model", str(minilm_path()), "--data", str(sf_slice), "--output",
               str(out), "--num-negatives", "4", "--rank-window", "0:30",
               "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "candidates seen:" in printed and "dropped as likely false negatives:" in printed
    qrels = {}
    with open(sf_slice / "qrels" / "train.tsv") as f:
        for q, d, _ in list(csv.reader(f, delimiter="\t"))[1:]:
            qrels.setdefault(q, set()).add(d)
    report = json.loads(Path(str(out) + ".report.json").read_text())
    for line in out.read_text().splitlines():
        r = json.loads(line)
        assert not qrels[r["query_id"]] & set(r["negative_ids"])
        assert len(r["negatives"]) == 4
    # a weak positive can leave too few candidates below it in the window: not written, counted
    assert report["records"] + report["skipped_records"] == sum(len(v) for v in qrels.values())
    assert report["records"] > 0 and report["short_records"] == 0
    assert main(["validate", str(out)]) == 0
    assert list((tmp_path / "cache" / "embeddings").glob("*.pt"))  # corpus embeddings cached


@pytest.mark.slow
def test_eval_command_on_200_document_slice(sf_slice, tmp_path, capsys):
    from pipeline_helpers import minilm_path
    from sentence_transformers import SentenceTransformer

    from bigbatch.data.readers.beir_dir import load_beir
    from bigbatch.retrieval.evaluate import evaluate_retrieval
    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(minilm_path()), "--data", str(sf_slice), "--split", "test",
               "--output", str(out), "--no-cache"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ndcg@10" in printed and "[unseen]" in printed
    ours = json.loads(out.read_text())[0]["metrics"]
    # an independent embedding path: sentence-transformers' own encode of the same model
    st = SentenceTransformer(str(minilm_path()), device="cpu")
    st.max_seq_length = 256
    data = load_beir(sf_slice, "test")
    dids, qids = list(data.corpus), list(data.queries)
    ref = evaluate_retrieval(torch.tensor(st.encode([data.queries[q] for q in qids])),
                             torch.tensor(st.encode([data.corpus[d] for d in dids])),
                             qids, dids, data.qrels)
    for k in ("ndcg@10", "recall@1", "recall@10", "mrr@10"):
        assert ours[k] == pytest.approx(ref[k], abs=1e-3), k
    assert ours["queries"] == 30


@pytest.mark.slow
def test_eval_reproduces_published_scifact_ndcg(tmp_path, capsys):
    from pipeline_helpers import minilm_path, need_scifact
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(minilm_path()), "--data", str(need_scifact()), "--output",
                 str(out), "--no-cache"]) == 0
    m = json.loads(out.read_text())[0]["metrics"]
    assert m["ndcg@10"] == pytest.approx(0.6451, abs=0.002)
    assert m["unseen/queries"] == 104


def test_a_copy_of_the_positive_under_another_id_is_never_a_negative(tmp_path):
    """A corpus holding the positive's text twice (common in real corpora): the copy is a
    positive, not a negative, so the mined file trains (training refuses a negative equal to
    its positive)."""
    from bigbatch.data.records.loader import load_records

    scores = {"dup text": 0.8, "other1": 0.5, "other2": 0.4}
    docs = {"d1": "dup text", "d2": "dup text", "d3": "other1", "d4": "other2"}
    root = beir_dir(tmp_path / "beir", docs, {"q": "the query"}, [("q", "d1", 1)])
    out = tmp_path / "hn.jsonl"
    report = mine_hard_negatives(StubEncoder(scores), root, "train", out,
                                 MiningOptions(num_negatives=2, rank_start=0, rank_end=3,
                                               max_score_ratio=None), progress=False)
    (rec,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert rec["negative_ids"] == ["d3", "d4"]
    assert report.dropped_as_copy_of_positive == 1 and report.dropped_as_positive == 1
    assert "dropped as copies of a positive (same content, another id): 1" in report.lines()
    assert len(load_records(out, num_hard_negatives=2)) == 1


def test_ratio_rule_keeps_the_threshold_below_a_negative_positive_score(tmp_path):
    """With the positive at -0.20 and ratio 0.95, 0.95 * -0.20 = -0.19 lies ABOVE the positive;
    the threshold is -0.20 - 0.05 * 0.20 = -0.21: nothing scoring above it is a negative."""
    scores = {"pos": -0.20, "c1": -0.15, "c2": -0.16, "c3": -0.17, "c4": -0.195,
              "c5": -0.25, "c6": -0.30, "c7": -0.35}
    root = beir_dir(tmp_path / "beir", {k: k for k in scores}, {"q": "the query"},
                    [("q", "pos", 1)])
    out = tmp_path / "hn.jsonl"
    report = mine_hard_negatives(StubEncoder(scores), root, "train", out,
                                 MiningOptions(num_negatives=3, rank_start=0, rank_end=7,
                                               max_score_ratio=0.95), progress=False)
    assert json.loads(out.read_text())["negative_ids"] == ["c5", "c6", "c7"]
    assert report.dropped_as_false_negative == 4


def test_eval_table_tells_models_apart():
    """Every model name was cut by 10 characters (room for " [unseen]" taken from the name):
    runs/exp1/final and runs/exp2/final both printed as "final"."""
    from bigbatch.retrieval.report import format_eval_table

    m = {"ndcg@10": 0.5, "recall@1": 0.1, "recall@5": 0.2, "recall@10": 0.3, "mrr@10": 0.4,
         "pos_sim": 0.6, "margin": 0.1, "queries": 3.0}
    m = {**m, **{f"unseen/{k}": v for k, v in m.items()}}
    long = "/data/" + "x" * 80 + "/exp3/final"
    table = format_eval_table([{"model": n, "metrics": m} for n in
                               ("runs/exp1/final", "runs/exp2/final", long)])
    rows = table.splitlines()[1:]
    assert rows[0].startswith("runs/exp1/final ") and rows[1].startswith("runs/exp2/final ")
    assert rows[2].startswith("..." + "x" * 46 + "/exp3/final ")
    assert rows[3].startswith("runs/exp1/final [unseen] ")
    assert rows[5].startswith("...") and "/exp3/final [unseen] " in rows[5]
    assert len({len(r) for r in rows}) == 1  # the columns line up


def test_eval_output_folder_is_checked_before_evaluating(tmp_path, capsys):
    """--output into a folder that does not exist failed with a traceback after the whole
    evaluation had run; now it is refused first."""
    assert main(["eval", "--model", str(tmp_path / "no-model"), "--data", str(tmp_path),
                 "--output", str(tmp_path / "missing" / "out.json")]) == 2
    assert "--output: the folder" in capsys.readouterr().err
