"""A late-interaction (ColBERT-style) model's evaluation and mining on 2 gloo ranks: each rank
embeds and stores only its share of the corpus (the token vectors are never gathered), the
ranks' MaxSim scores merge, and the metrics and mined negatives are one process's; each
rank's part of the token store is cached under its own name. All cases run in one pair of
spawned processes (multivector_split_cases.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import multivector_split_cases
from dist_helpers import spawn_and_collect
from pipeline_helpers import scifact_slice, tiny_bert


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("mv-split")
    paths = {"bert": str(tiny_bert(root / "bert", dropout=0.0)),
             "beir": str(scifact_slice(root / "sf", n_train=12, n_test=10, n_extra_docs=30)),
             "cache": str(root / "cache")}
    return spawn_and_collect(multivector_split_cases.worker, root / "results.json",
                             json.dumps(paths))


def test_evaluation_split_over_ranks_equals_one_process(results):
    for r in results:
        got, want = r["eval"]["got"], r["eval"]["want"]
        assert set(got) == set(want) and "unseen/ndcg@10" in got
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-5, (k, got[k], want[k])
    # each rank embedded its half of the corpus, not all of it
    total = results[0]["eval"]["all_docs"]
    shares = [r["eval"]["split_docs"] for r in results]
    assert all(s <= -(-total // 2) for s in shares) and sum(shares) >= total


def test_mining_split_over_ranks_mines_what_one_process_mines(results):
    for r in results:
        assert r["mine"]["records"] > 0 and r["mine"]["same_negatives"], r["mine"]
        assert r["mine"]["score_diff"] <= 1e-5


def test_each_rank_caches_its_own_part_of_the_token_store(results):
    parts = [r["cache"] for r in results]
    assert [p["path"].split(".")[-2] for p in parts] == ["0of2", "1of2"]
    assert sum(p["held"] for p in parts) == parts[0]["docs"]
    for p in parts:
        assert p["embedded"] >= p["held"] > 0 and p["embedded_again"] == 0
        assert p["held_again"] == p["held"]
