"""Cross-device negatives and one gradient sync per step, on 2 gloo ranks (CPU, float64).

All cases run in one pair of spawned processes (see dist_cases.py) to keep the suite fast;
each test below asserts on one case's numbers."""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import dist_cases
from dist_helpers import free_port, spawn_and_collect

TOL = 1e-10


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist") / "results.json"
    return spawn_and_collect(dist_cases.worker, out, list(dist_cases.CASES))


def record(res):
    from helpers import ERRORS
    ERRORS.append(res["rel_err"])


EXACT = ["plain_k0_shared", "plain_k2_separate", "symmetric_k2_ids", "symmetric_k0_streamed",
         "auto_blocks_k2_symmetric_ids",
         "fixed_temperature_k2", "ddp_k2", "ddp_separate_k0_symmetric", "subsets_plain",
         "subsets_ddp", "ragged_k1", "ragged_ddp_k2", "generic_loss_k1", "no_cross_device_k1",
         "corpus_cross_device"]


@pytest.mark.parametrize("case", EXACT)
def test_gradient_equals_global_batch_reference_on_every_rank(results, case):
    for rank, r in enumerate(results):
        res = r[case]
        record(res)
        assert res["rel_err"] <= TOL, (rank, res)
        assert res["cross_rank_diff"] == 0.0, (rank, res)
        assert res["loss_err"] <= 1e-12, (rank, res)
        assert res["sync_calls"] == 1, (rank, res)  # one coalesced all-reduce per step


@pytest.mark.parametrize("case", ["ddp_k2", "ddp_separate_k0_symmetric", "subsets_ddp",
                                  "ragged_ddp_k2"])
def test_ddp_never_synchronises_on_its_own(results, case):
    for r in results:
        assert r[case]["ddp_hook_calls"] == 0


def test_learnable_temperature_gradient_is_global(results):
    # the temperature's gradient is part of every comparison above; check it was there
    assert results[0]["plain_k0_shared"]["n_grads"] == results[0]["fixed_temperature_k2"]["n_grads"] + 1


def test_corpus_loss_cross_device_metrics_are_the_global_batch_s(results):
    for r in results:
        assert r["corpus_cross_device"]["metric_keys"]
        assert r["corpus_cross_device"]["metrics_err"] <= 1e-12


def test_metrics_are_global_and_identical(results):
    accs = [r["symmetric_k2_ids"]["accuracy"] for r in results]
    assert accs[0] == accs[1]


@pytest.mark.parametrize("case,subsets,shared", [("fsdp_k1", False, True),
                                                 ("fsdp_subsets_k1", True, True),
                                                 ("fsdp_separate_k1", False, False)])
def test_fsdp2_fully_shard_matches_reference(results, case, subsets, shared):
    # separate query and doc models are separate FSDP roots: each must reduce-scatter on
    # its own last replay (the query model's grads were never reduced, and stayed None)
    ref, ref_loss = dist_cases.fsdp_reference(k=1, sizes=(4, 4), subsets=subsets, shared=shared)
    for rank, r in enumerate(results):
        res = r[case]
        # one reduce-scatter per FSDP module: only on the last replay, not per chunk
        assert res["reduce_scatters"] == res["fsdp_modules"], res["reduce_scatters"]
        got = {k: __import__("torch").tensor(v, dtype=dist_cases.DT)
               for k, v in res["fsdp_grads"].items()}
        from helpers import max_rel_err
        assert max_rel_err(got, ref) <= TOL, rank
        assert res["cross_rank_diff"] == 0.0
        assert abs(res["loss"] - ref_loss) <= 1e-12 * abs(ref_loss)


def test_gather_with_grad_backward_is_slice_of_summed_gradient(results):
    for r in results:
        assert r["gather_with_grad"]["forward_ok"]
        assert r["gather_with_grad"]["grad_err"] == 0.0


def test_shape_disagreement_raises_on_every_rank(results):
    for r in results:
        res = r["shape_disagreement"]
        assert res["raised"] == "ShapeError"
        assert "different widths on the ranks: [4, 5]" in res["message"]
        assert not res["grads_written"]


def test_non_finite_on_one_rank_raises_on_every_rank(results):
    for r in results:
        res = r["non_finite_one_rank"]
        assert res["raised"] == "NonFiniteError"
        assert "rank(s) [1]" in res["message"]
        assert not res["grads_written"]


def test_fsdp_with_unequal_chunk_counts_is_refused(results):
    for r in results:
        res = r["fsdp_ragged_refused"]
        assert res["raised"] == "ConfigError"
        assert "same number of chunks" in res["message"] and "drop_last" in res["message"]
        assert "cross_device" not in res["message"]  # the check holds with it too


def test_fsdp_divide_factor_is_restored_after_the_step(results):
    for r in results:
        res = r["fsdp_divide_factor_restored"]
        assert res["scale"] > 1e-3 and res["diff"] == 0.0, res


@pytest.fixture(scope="module")
def error_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_errors") / "results.json"
    return spawn_and_collect(dist_cases.error_worker, out)


@pytest.mark.parametrize("case,error,text", [
    ("empty_rank", "InputError", "rank 1 has no rows for tower 'query'"),
    ("bad_doc_ids_one_rank", "ShapeError", "rank 1: doc_ids has 2 entries but there are 3"),
    ("bad_doc_ids_list_one_rank", "ShapeError", "rank 1: doc_ids has 2 entries but there are 3"),
    ("bad_input_one_rank", "InputError", "rank 1: input dict for tower 'doc' has tensors with "
                                         "different batch sizes"),
    ("loss_args_differ", "InputError", "different loss arguments"),
    ("plain_function_without_params", "ConfigError", "tower 'query' is a plain function"),
    ("bad_positive_index_one_rank", "ShapeError", "rank 1: positive_index must have one entry "
                                                  "per query (3)"),
    ("bad_other_positives_one_rank", "ShapeError", "rank 1: other_positives out of range"),
])
def test_an_error_on_one_rank_is_raised_on_every_rank(error_results, case, error, text):
    """Every rank raises the same bigbatch error at once, before any gradient is written,
    instead of the other ranks waiting in a collective until the timeout."""
    for r in error_results:
        res = r[case]
        assert res["raised"] == error, res
        assert text in res["message"], res
        assert not res["grads_written"], res
        assert res["seconds"] < dist_cases.ERROR_TIMEOUT_S, res  # not after a timeout


def test_a_failing_rank_ends_the_other_with_an_error(tmp_path):
    out = tmp_path / "fail.json"
    t0 = time.monotonic()
    ctx = mp.start_processes(dist_cases.failing_rank_worker, args=(2, free_port(), str(out)),
                             nprocs=2, join=False, start_method="spawn")
    for p in ctx.processes:
        p.join(timeout=120)
    assert time.monotonic() - t0 < 120
    res = json.loads(out.read_text())
    assert res["outcome"] != "no error"
    assert res["seconds"] < 60  # bounded: the peer's exit or the 20 s collective timeout
