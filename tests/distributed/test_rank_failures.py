"""A failure on one rank ends the step with an error on every rank at once, wherever in the
step it happens (a tower in the first or the second pass, the loss or its backward), instead
of leaving the other ranks waiting in the next collective until the timeout; 2 gloo ranks."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import failure_cases
from dist_helpers import spawn_and_collect


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("rank_failures") / "results.json"
    return spawn_and_collect(failure_cases.worker, out, list(failure_cases.CASES))


# (case, the failing rank's error and text, the other rank's error and text)
TOWER = ("RuntimeError", "tower failed on rank 1")


@pytest.mark.parametrize("case,failing,other", [
    ("tower_first_pass", TOWER, ("RankFailedError", "rank 1 failed while embedding tower "
                                 "'query' (chunk 0, first pass): RuntimeError: tower failed")),
    ("tower_first_pass_last_chunk", TOWER, ("RankFailedError", "tower 'doc' (chunk 1, first")),
    ("tower_rows_first_pass", ("ShapeError", "returned shape (1, 4) for chunk 0 of 2 rows"),
     ("ShapeError", "rank 1 failed while embedding tower 'query' (chunk 0, first pass): "
                    "tower 'query' returned shape (1, 4)")),
    ("tower_second_pass", TOWER, ("RankFailedError", "rank 1 failed while re-embedding tower "
                                  "'query' (chunk 1, second pass): RuntimeError")),
    ("tower_second_pass_no_sync", TOWER, ("RankFailedError", "second pass")),
    ("tower_second_pass_local_loss", TOWER, ("RankFailedError", "tower 'doc' (chunk 0, second")),
    ("loss_forward_cross_device", ("RuntimeError", "loss failed on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss: RuntimeError: loss failed on rank 1")),
    ("loss_nan_cross_device", ("NonFiniteError", "the loss is NaN or inf"),
     ("NonFiniteError", "rank 1 failed in the loss: the loss is NaN or inf")),
    ("loss_backward_cross_device", ("RuntimeError", "loss backward failed on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss's backward: RuntimeError: loss backward")),
    ("loss_forward_local", ("RuntimeError", "loss failed on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss: RuntimeError")),
    ("loss_forward_local_unchecked", ("RuntimeError", "loss failed on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss: RuntimeError")),
    ("loss_backward_local", ("RuntimeError", "loss backward failed on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss's backward")),
    ("infonce_compute", ("RuntimeError", "logits out of memory on rank 1"),
     ("RankFailedError", "rank 1 failed in the loss: RuntimeError: logits out of memory")),
    ("bad_layout_local", ("ShapeError", "4 documents"),
     ("ShapeError", "rank 1 failed in the loss: ")),
])
def test_a_failure_on_one_rank_ends_every_rank_at_once(results, case, failing, other):
    """Rank 1 raises its own exception, rank 0 a bigbatch error naming rank 1 and where it
    failed, both at once (long before the collective timeout); then both run the next step
    normally, with the same gradient (the ranks stayed in step)."""
    for rank, (error, text) in ((1, failing), (0, other)):
        res = results[rank][case]
        assert res["raised"] == error, (rank, res)
        assert text in res["message"], (rank, res)
        assert res["seconds"] < failure_cases.TIMEOUT_S, (rank, res)  # no timeout
        assert res["next_ok"] and res["next_agree"], (rank, res)
