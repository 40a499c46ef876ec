"""``bigbatch train --negative-queue`` on a tiny model and a 64-pair SciFact slice: the queue
is used (logged, and the run differs from one without it), a checkpoint keeps it (read back
weights-only), a run resumed mid-way equals the run that never stopped, and the options it
cannot go with are refused before step 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.engine.sizing import QUEUE_COPIES
from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, train
from bigbatch.train.checkpoint import safe_load


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny model and the slice's pairs with one negative each, mined by that model."""
    root = tmp_path_factory.mktemp("assets")
    tiny, data = tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")
    mined = root / "mined.jsonl"
    assert main(["mine", "--model", str(tiny), "--data", str(data), "--output", str(mined),
                 "--num-negatives", "1", "--max-score-ratio", "0", "--device", "cpu",
                 "--max-length", "48"]) == 0
    return tiny, mined


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=3, max_steps=6, warmup_steps=2, save_steps=3, eval_steps=0,
                eval_at_start=False, lora_r=0, lr=1e-3, max_length=48, seed=3,
                save_total_limit=5, negative_queue=2, num_hard_negatives=1)
    base.update(kw)
    return TrainConfig(**base)


def train_rows(out):
    rows = [json.loads(l) for l in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def weights(out):
    return load_file(Path(out) / "final" / "model.safetensors")


@pytest.fixture(scope="module")
def straight(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    train(config(assets, out))
    return out


def test_the_queue_is_used_and_kept_in_checkpoints(assets, straight, tmp_path):
    rows = train_rows(straight)
    # 8 queries x (1 + 1) documents a step; the last 2 steps queued
    assert [rows[s].get("queued", 0) for s in range(1, 7)] == [0, 16, 32, 32, 32, 32]
    state = safe_load(straight / "checkpoint-000003" / "trainer_state.pt")["state"]
    queue = state["negative_queue"]
    assert queue["steps"] == 2 and [t.shape for t in queue["doc"]] == [(16, 32)] * 2
    assert all(len(ids) == 16 and all(isinstance(i, str) for i in ids) for ids in queue["ids"])
    # each step's positives carry the id of their query, the negatives none
    assert [bool(o) for o in queue["query_ids"][0]] == [True, False] * 8
    plain = tmp_path / "plain"
    train(config(assets, plain, negative_queue=0, max_steps=3))
    without = train_rows(plain)
    assert abs(without[1]["loss"] - rows[1]["loss"]) <= 1e-6  # step 1: nothing queued yet
    assert abs(without[2]["loss"] - rows[2]["loss"]) > 1e-4  # then the queue's negatives


def test_a_resume_mid_way_equals_the_run_that_never_stopped(assets, straight, tmp_path):
    out = tmp_path / "b"
    stopped = train(config(assets, out), on_step_end=lambda step, state: step >= 4)
    assert stopped["stopped"]
    train(config(assets, out, resume=str(out)))  # from checkpoint-000003, the queue of 2-3
    a, b = train_rows(straight), train_rows(out)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    for s in a:
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-6, (s, a[s]["loss"], b[s]["loss"])
        assert a[s].get("queued") == b[s].get("queued")
    wa, wb = weights(straight), weights(out)
    for k in wa:
        assert torch.allclose(wa[k], wb[k], atol=1e-6, rtol=0), k


@pytest.mark.parametrize("chunk", [3, "auto"])
def test_the_step_memory_counts_the_full_queue(assets, tmp_path, capsys, chunk):
    """The start line's estimate (fixed chunks) and the auto sizing's count the queue once
    full: 1,000 steps of 16 documents, 32 wide in float32 with two int64 ids, held 3 times:
    7 MB."""
    train(config(assets, tmp_path / "r", negative_queue=1000, max_steps=1, save_steps=0,
                 grad_cache_chunk=chunk))
    line = next(l for l in capsys.readouterr().out.splitlines()
                if l.startswith("bigbatch train:") and "records" in l)
    mb = QUEUE_COPIES * 1000 * 16 * (32 * 4 + 2 * 8) / 2 ** 20  # embeddings and two int64 ids
    assert f"negative queue {mb:,.0f} MB" in line, line


@pytest.mark.parametrize("extra,match", [
    ({"negative_queue": -1}, "must be >= 0"),
    ({"pooling": "multivector"}, "multivector"),
    ({"extra_negatives": ["qq"]}, "extra-negatives"),
])
def test_options_a_queue_cannot_go_with_are_refused_before_step_1(assets, tmp_path, extra,
                                                                   match):
    with pytest.raises(ConfigError, match=match) as e:
        config(assets, tmp_path / "x", **extra).validate()
    assert "--negative-queue" in str(e.value)
    assert not (tmp_path / "x").exists()


def test_the_command_line_takes_the_option(assets, tmp_path):
    tiny, data = assets
    out = tmp_path / "cli"
    rc = main(["train", "--model", str(tiny), "--train-data", str(data), "--output-dir",
               str(out), "--batch-size", "8", "--grad-cache-chunk", "4", "--max-steps", "2",
               "--warmup-steps", "1", "--no-eval-at-start", "--max-length", "32",
               "--num-hard-negatives", "1", "--negative-queue", "3"])
    assert rc == 0
    assert "negative_queue: 3" in (out / "config.yaml").read_text()
    assert train_rows(out)[2]["queued"] == 16
