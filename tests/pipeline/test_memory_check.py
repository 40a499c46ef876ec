"""bigbatch train's memory guard rail: the start line states the step's estimated memory, a
step that cannot fit stops before step 1 with the numbers and what to lower, and the probe
chunk leaves the run's random draws as they were; with --grad-cache-chunk auto the chunks are
sized for --memory-budget, a step over it lowers them once, and a resumed run keeps them."""

from __future__ import annotations

import json

import pytest
from test_train import assets, config, train_losses  # noqa: F401 - the module's fixture

from bigbatch.errors import ConfigError
from bigbatch.train import TrainConfig, loop, memory_check, train
from bigbatch.train.memory_estimate import StepMemory


def test_the_start_line_states_the_step_memory(assets, tmp_path, capsys):  # noqa: F811
    train(config(assets, tmp_path / "r", max_steps=1, save_steps=0))
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("bigbatch train:"))
    assert "step memory ~" in line and "one chunk" in line and "one loss block" in line


def test_a_step_that_cannot_fit_stops_before_step_one(assets, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setattr(memory_check, "free_memory", lambda device: 1024)
    monkeypatch.setattr("bigbatch.train.loop.free_memory", lambda device: 1024)
    with pytest.raises(ConfigError, match=r"one training step needs about .* MB but cpu has 0 MB "
                                          r"free.*--grad-cache-chunk.*--loss-block-size"):
        train(config(assets, tmp_path / "r", max_steps=1, save_steps=0))
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_probe_leaves_the_runs_random_draws_unchanged(assets, tmp_path, monkeypatch):  # noqa: F811
    train(config(assets, tmp_path / "a", max_steps=2, save_steps=0))
    monkeypatch.setattr("bigbatch.train.loop.estimate_run_step", lambda *a, **k: None)
    train(config(assets, tmp_path / "b", max_steps=2, save_steps=0))
    assert train_losses(tmp_path / "a") == train_losses(tmp_path / "b")


def test_check_fits_names_each_part():
    est = StepMemory(embeddings=2 ** 30, embedding_grads=2 ** 30, rng_states=0,
                     parameter_grads=0, chunk_activations=2 ** 29, loss_block=2 ** 20)
    memory_check.check_fits(est, est.total, "cpu")  # exactly fits
    with pytest.raises(ConfigError, match=r"about 2,561 MB but cpu has 2,560 MB free: cached "
                                          r"embeddings and their gradients 2,048 MB"):
        memory_check.check_fits(est, est.total - 2 ** 20, "cpu")


def _start_line(capsys):
    return next(l for l in capsys.readouterr().out.splitlines()
                if l.startswith("bigbatch train:") and "records" in l)


def test_auto_chunks_are_sized_for_the_budget_and_the_start_line_says_so(assets, tmp_path,  # noqa: F811
                                                                        capsys):
    assert TrainConfig(model="m", train_data="d").grad_cache_chunk == "auto"  # the default
    train(config(assets, tmp_path / "a", grad_cache_chunk="auto", max_steps=1, save_steps=0))
    line = _start_line(capsys)
    assert "chunk 8: the whole batch in one pass (plain training), sized for a memory budget " \
           "of" in line and "step memory ~" in line and "optimizer states" in line
    small = 2 ** 20 * 20  # room for a few rows only
    train(config(assets, tmp_path / "b", grad_cache_chunk="auto", memory_budget=small,
                 max_steps=1, save_steps=0))
    out = capsys.readouterr().out
    assert "sized for a memory budget of 20 MB" in out and "step 1 peaked at" in out


def test_a_budget_too_small_for_one_row_stops_before_step_one(assets, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"--memory-budget: 1 MB cannot hold a training step "
                                          r"of even one row per chunk, which needs .* give a "
                                          r"budget of [\d,]+MB or more"):
        train(config(assets, tmp_path / "r", grad_cache_chunk="auto", memory_budget=2 ** 20,
                     lora_r=0))  # full fine-tuning: 12 MB of gradients and AdamW states
    assert not (tmp_path / "r").exists()


BUDGET = 64 * 2 ** 20  # the tiny model's plain step fits it


class _OverBudget:
    """A PeakMemory whose step always peaked at 1 GB (a simulated overrun of BUDGET)."""

    uses = 0

    def __init__(self, device):
        self.peak = None

    def __enter__(self):
        _OverBudget.uses += 1
        return self

    def __exit__(self, *exc):
        self.peak = 2 ** 30


def test_an_over_budget_first_step_lowers_the_chunks_once(assets, tmp_path, monkeypatch,  # noqa: F811
                                                          capsys):
    monkeypatch.setattr(loop, "PeakMemory", _OverBudget)
    _OverBudget.uses = 0
    chunks = {}
    train(config(assets, tmp_path / "r", grad_cache_chunk="auto", memory_budget=BUDGET,
                 max_steps=3, save_steps=0),
          on_step_end=lambda step, state: chunks.__setitem__(step, state["chunks"]) and False)
    out = capsys.readouterr().out
    assert _OverBudget.uses == 1  # the first step only
    assert "over the budget, so the chunks are lowered for the next steps from query 8, doc 8 " \
           "to query 7, doc 7" in out
    assert chunks[1] == chunks[2] == chunks[3] == {"sizes": {"query": 7, "doc": 7}, "tokens": {},
                                                   "plain": False, "checked": True}
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in rows if r["kind"] == "train" and r["step"] == 1)
    assert first["memory_peak_mb"] == 1024 and first["memory_estimate_mb"] > 0


def test_a_resumed_auto_run_keeps_its_chunk_sizes(assets, tmp_path, monkeypatch):  # noqa: F811
    """The sizes (here lowered after step 1) are saved with each checkpoint and taken again on
    resume, not chosen (or checked and lowered) anew: the resumed run draws what the
    uninterrupted one drew."""
    monkeypatch.setattr(loop, "PeakMemory", _OverBudget)
    auto = dict(grad_cache_chunk="auto", memory_budget=BUDGET, max_steps=4, save_steps=2)
    train(config(assets, tmp_path / "full", **auto))
    out = tmp_path / "cut"
    train(config(assets, out, **auto), on_step_end=lambda step, state: step >= 3)
    chunks = {}
    train(config(assets, out, **auto, resume=str(out)),
          on_step_end=lambda step, state: chunks.__setitem__(step, state["chunks"]) and False)
    assert chunks[3]["sizes"] == {"query": 7, "doc": 7}
    assert train_losses(out) == train_losses(tmp_path / "full")
