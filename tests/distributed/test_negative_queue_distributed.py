"""The negative queue across 2 gloo ranks (float64, dropout on): every step of the cached
engine fed by ``bigbatch train``'s queue equals one process on the global batch with the
same objective, and every rank holds the same queue (see queue_cases.py)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import queue_cases
from dist_helpers import spawn_and_collect

TOL = 1e-10


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_queue") / "results.json"
    return spawn_and_collect(queue_cases.worker, out)


@pytest.mark.parametrize("case", list(queue_cases.CASES))
def test_each_step_equals_the_global_batch_reference_on_every_rank(results, case):
    from helpers import ERRORS

    for rank, r in enumerate(results):
        res = r[case]
        ERRORS.append(res["rel_err"])
        assert res["rel_err"] <= TOL, (rank, res)
        assert res["loss_err"] <= 1e-12, (rank, res)
        assert res["cross_rank_diff"] == 0.0, (rank, res)
        assert res["ref_queue_diff"] <= 1e-13 and res["same_ids"], (rank, res)
        # step 1 masks a positive queued on the other rank (the same query), step 2 one
        # queued from the other rank by its id
        assert res["masked"] == [0, 1, 1], (rank, res)
