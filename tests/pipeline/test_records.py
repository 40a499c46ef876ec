"""Training records: the seed's JSONL keys, BEIR pairs, and bad records reported with file,
line and field before the first step."""

from __future__ import annotations

import json

import pytest

from bigbatch.data import EpochBatches, load_records
from bigbatch.errors import DataError


def write(path, lines):
    path.write_text("\n".join(l if isinstance(l, str) else json.dumps(l) for l in lines) + "\n")
    return path


def test_seed_format_with_chunk_paths(tmp_path):
    (tmp_path / "p.txt").write_text("positive passage")
    (tmp_path / "n1.txt").write_text("negative one")
    f = write(tmp_path / "t.jsonl", [
        {"query": "q1", "chunk_path": "p.txt", "neg_chunk_paths": ["n1.txt"]},
        {"query": "q2", "positive": "pos two", "negatives": ["neg a", "neg b"]},
    ])
    recs = load_records(f, num_hard_negatives=1)
    assert recs[0].positive == "positive passage" and recs[0].negatives == ["negative one"]
    from bigbatch.data.records.image_checks import doc_key
    assert recs[0].positive_id == doc_key("positive passage") == recs[0].positive_key
    assert recs[0].line == 1
    assert recs[1].negatives == ["neg a", "neg b"]


def test_one_passage_has_one_id_however_records_name_it(tmp_path):
    """A passage that is one record's positive (by corpus id, by file, or by text) and another
    record's hard negative carries the same id in a batch, so the loss masks it rather than
    pushing a query away from its own positive (mined data names positives by corpus id)."""
    (tmp_path / "p.txt").write_text("shared passage")
    f = write(tmp_path / "t.jsonl", [
        {"query": "q1", "positive": "shared passage", "positive_id": "d7",
         "negatives": ["other one"], "negative_ids": ["d9"]},
        {"query": "q2", "chunk_path": "p.txt", "negatives": ["another"]},
        {"query": "q3", "positive": "third passage", "negatives": ["shared passage"]},
    ])
    recs = load_records(f, num_hard_negatives=1)
    assert recs[0].positive_id == "d7"  # the corpus id is kept as the name
    batch = EpochBatches(recs, batch_size=3, num_hard_negatives=1).batch(0, 0)
    shared = [i for d, i in zip(batch.docs, batch.doc_ids) if d == "shared passage"]
    assert len(shared) == 3 and len(set(shared)) == 1  # q1's and q2's positive, q3's negative
    others = [i for d, i in zip(batch.docs, batch.doc_ids) if d != "shared passage"]
    assert shared[0] not in others


def test_every_problem_reported_with_file_line_field(tmp_path):
    f = write(tmp_path / "bad.jsonl", [
        {"query": "ok", "positive": "fine"},
        "{not json",
        {"query": "", "positive": "p"},
        {"query": "q"},
        {"query": "q", "chunk_path": "missing.txt"},
        {"query": "q", "positive": "same", "negatives": ["same"]},
        {"query": "q", "chunk_path": "page.png"},
    ])
    with pytest.raises(DataError) as e:
        load_records(f)
    msg = str(e.value)
    assert "6 problem(s)" in msg
    for expected in (f"{f}:2: malformed JSON", f"{f}:3, field 'query': must be non-empty text",
                     f"{f}:4, field 'positive': missing positive",
                     f"{f}:5, field 'chunk_path': cannot read",
                     f"{f}:6, field 'negatives[0]': a negative equals the positive",
                     f"{f}:7, field 'chunk_path': image file not found"):
        assert expected in msg, expected


def test_too_few_negatives_for_k(tmp_path):
    f = write(tmp_path / "t.jsonl", [{"query": "q", "positive": "p", "negatives": ["n"]}])
    with pytest.raises(DataError, match="fewer than --num-hard-negatives=2 negatives .lines 1"):
        load_records(f, num_hard_negatives=2)


def test_beir_pairs_and_no_negatives(tmp_path):
    from pipeline_helpers import scifact_slice
    root = scifact_slice(tmp_path / "sf")
    recs = load_records(root, "train")
    assert len(recs) == 64 and all(r.positive and r.query for r in recs)
    with pytest.raises(DataError, match="has no hard negatives"):
        load_records(root, "train", num_hard_negatives=1)


def test_epoch_batches_deterministic_and_sharded():
    from bigbatch.data.records.loader import TrainRecord
    recs = [TrainRecord(f"q{i}", f"p{i}", [f"n{i}{j}" for j in range(5)]) for i in range(10)]
    full = EpochBatches(recs, 4, num_hard_negatives=2, seed=1)
    r0 = EpochBatches(recs, 2, num_hard_negatives=2, seed=1, rank=0, world_size=2)
    r1 = EpochBatches(recs, 2, num_hard_negatives=2, seed=1, rank=1, world_size=2)
    assert len(full) == 2
    b, b0, b1 = full.batch(3, 1), r0.batch(3, 1), r1.batch(3, 1)
    assert b.queries == b0.queries + b1.queries and b.docs == b0.docs + b1.docs
    assert len(b.docs) == 12 and b.docs[0].startswith("p") and b.docs[1].startswith("n")
    assert full.batch(3, 1).docs == b.docs                 # same epoch, same sample
    assert full.batch(4, 1).queries != b.queries or full.batch(4, 1).docs != b.docs
    it = full.iterate(0, 1)
    assert [(x.epoch, x.index) for x in (next(it), next(it), next(it))] == [(0, 1), (1, 0), (1, 1)]


def _fixed_corpus(tmp_path, data, recs):
    """Query-side tuning's whole-corpus negatives for ``recs`` (tiny BERT, corpus negatives)."""
    import torch
    from pipeline_helpers import tiny_bert

    from bigbatch.encoders import TextEncoder
    from bigbatch.engine.distributed import WorldInfo
    from bigbatch.train import TrainConfig
    from bigbatch.train.corpus_negatives import FixedCorpus

    config = TrainConfig(model="unused", train_data=str(data), output_dir=str(tmp_path / "o"),
                         mode="query-side-tune", doc_negatives="corpus")
    enc = TextEncoder(tiny_bert(tmp_path / "bert"), max_length=16).eval()
    return FixedCorpus(config, recs, enc, torch.device("cpu"), WorldInfo())


def test_query_side_corpus_holds_each_passage_once(tmp_path, monkeypatch):
    """Query-side tuning against the corpus: a passage named by corpus id as one record's
    positive and written out as another's negative is one corpus row, and the row is that
    record's positive (a second row would be a false negative in CorpusInfoNCE)."""
    import torch

    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    f = write(tmp_path / "t.jsonl", [
        {"query": "q1", "positive": "shared passage", "positive_id": "d7"},
        {"query": "q2", "positive": "second passage", "negatives": ["shared passage", "x y"]},
        {"query": "q1", "positive": "third passage"},  # q1 has two positives
    ])
    recs = load_records(f)
    corpus = _fixed_corpus(tmp_path, f, recs)
    assert len(corpus.ids) == 4 and corpus.emb.shape[0] == 4  # shared, second, x y, third
    batch = EpochBatches(recs, batch_size=3).batch(0, 0)
    t = corpus.targets(batch, torch.device("cpu"))
    pos_of = {d: int(i) for d, i in zip(batch.docs, t["positive_index"])}
    assert pos_of["shared passage"] == 0 and corpus.ids[0] == "d7"  # one row, named by id
    # each q1 row masks q1's other positive, and nothing else is masked
    other = sorted((batch.queries[r], c) for r, c in t["other_positives"].tolist())
    assert other == sorted([("q1", pos_of["third passage"]), ("q1", pos_of["shared passage"])])


def test_query_side_corpus_masks_a_duplicate_under_another_id(tmp_path, monkeypatch):
    """A BEIR corpus holding the positive's text twice, under two ids: the second row is
    masked for that query, not scored as a negative equal to its positive."""
    import torch

    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    write(beir / "corpus.jsonl", [{"_id": "d1", "title": "", "text": "same passage"},
                                  {"_id": "d2", "title": "", "text": "other passage"},
                                  {"_id": "d3", "title": "", "text": "same passage"}])
    write(beir / "queries.jsonl", [{"_id": "q1", "text": "first"}, {"_id": "q2", "text": "second"}])
    (beir / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td2\t1\n")
    recs = load_records(beir)
    corpus = _fixed_corpus(tmp_path, beir, recs)
    assert corpus.ids == ["d1", "d2", "d3"]
    batch = EpochBatches(recs, batch_size=2).batch(0, 0)
    t = corpus.targets(batch, torch.device("cpu"))
    row = batch.queries.index("first")
    assert int(t["positive_index"][row]) == 0
    assert t["other_positives"].tolist() == [[row, 2]]  # d3, the same text as d1
