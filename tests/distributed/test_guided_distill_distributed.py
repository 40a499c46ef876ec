"""Guided false-negative filtering and distillation across 2 gloo ranks (float64, dropout
on): the cached step equals the single-process reference on the global batch."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import guided_cases
from dist_helpers import spawn_and_collect

TOL = 1e-10


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("guided") / "results.json"
    return spawn_and_collect(guided_cases.worker, out, list(guided_cases.CASES))


@pytest.mark.parametrize("case", ["guided_k2", "guided_k3_symmetric_ids", "kl_k2",
                                  "margin_mse_k1_symmetric", "guided_kl_k2_auto_blocks"])
def test_equals_the_global_batch_reference_on_every_rank(results, case):
    from helpers import ERRORS
    for rank, r in enumerate(results):
        res = r[case]
        ERRORS.append(res["rel_err"])
        assert res["rel_err"] <= TOL, (rank, res)
        assert res["cross_rank_diff"] == 0.0, (rank, res)
        assert res["loss_err"] <= 1e-12, (rank, res)
        assert res["masked"] == res["ref_masked"], (rank, res)
        assert res["guide_masked"] == res["ref_guide_masked"], (rank, res)
        if case.startswith("guided"):
            assert res["guide_masked"] > 0, (rank, res)  # the guide masked something
        if "distill_err" in res:
            assert res["distill_err"] <= 1e-12, (rank, res)


def test_bad_teacher_scores_on_one_rank_raise_on_every_rank(results):
    for r in results:
        res = r["bad_teacher_one_rank"]
        assert res["error_class"] == "ShapeError", res
        assert "rank 1" in res["message"] and "teacher_scores must be (3, 3)" in res["message"]
        assert res["no_grad"]
