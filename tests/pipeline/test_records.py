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
    assert recs[0].positive_id == "p.txt" and recs[0].line == 1
    assert recs[1].negatives == ["neg a", "neg b"]


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
                     f"{f}:6, field 'negatives': a negative equals the positive",
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
    from bigbatch.data.records import TrainRecord
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
