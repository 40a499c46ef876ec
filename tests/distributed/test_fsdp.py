"""``--fsdp``'s sharding on 2 gloo ranks (CPU, float64): an encoder sharded per transformer
block and at its root, trained 2 optimizer steps on each rank's half of the batch (both
towers one module, AdamW, gradient clipping over sharded and plain parameters), equals the
unsharded encoder on one process with the whole batch, full and LoRA, with and without
gradient checkpointing, a BERT and a Qwen3 decoder pooled by its last token, with one
reduce-scatter per unit and step; the whole weights
gathered to the main rank for saving are the reference's; evaluation split over the ranks
gives one process's metrics. All cases run in one pair of spawned processes
(fsdp_cases.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import fsdp_cases
from dist_helpers import spawn_and_collect
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.encoders.tiny import build_tiny_text

TOL = 1e-10  # float64: relative, of the weights after 2 steps, and of the losses
# full and LoRA, with and without gradient checkpointing (full with it on the decoder)
STEP_CASES = ["steps_full", "steps_lora", "steps_lora_gc", "steps_qwen3_lora_last",
              "steps_qwen3_full_gc_last"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    paths = {"bert": str(tiny_bert(root / "bert", dropout=0.0)),
             "qwen3": str(build_tiny_text(root / "qwen3")),
             "beir": str(scifact_slice(root / "sf", n_train=8, n_test=10, n_extra_docs=30))}
    return spawn_and_collect(fsdp_cases.worker, root / "results.json", json.dumps(paths))


@pytest.mark.parametrize("case", STEP_CASES)
def test_sharded_training_equals_one_process_on_the_global_batch(results, case):
    for r in results:
        res = r[case]
        for (loss, norm), (ref_loss, ref_norm) in zip(res["losses"], res["reference"]):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), res
            assert abs(norm - ref_norm) <= TOL * ref_norm, res
        # at most one reduce-scatter per FSDP unit and step (units without a gradient, such
        # as BERT's unused pooler at the root, have none), though each step replays 4 chunks
        per_step, rest = divmod(res["reduce_scatters"], fsdp_cases.STEPS)
        assert rest == 0 and 1 <= per_step <= res["units"], res
    main = results[0][case]
    assert main["same_keys"] and not main["buffers_meta"]
    assert main["weight_diff"] <= TOL * main["weight_scale"], main
    assert main["whole_dropped"]


def test_lora_trains_the_adapters_only(results):
    assert results[0]["steps_lora"]["trainable"] < results[0]["steps_full"]["trainable"]


def test_evaluation_split_over_ranks_equals_one_process(results):
    for r in results:
        got, want = r["eval"]["got"], r["eval"]["want"]
        assert sorted(got) == sorted(want)
        for k in want:
            assert abs(got[k] - want[k]) <= 1e-9, (k, got[k], want[k])
