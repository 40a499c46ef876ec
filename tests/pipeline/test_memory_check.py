"""bigbatch train's memory guard rail: the start line states the step's estimated memory, a
step that cannot fit stops before step 1 with the numbers and what to lower, and the probe
chunk leaves the run's random draws as they were."""

from __future__ import annotations

import pytest
from test_train import assets, config, train_losses  # noqa: F401 - the module's fixture

from bigbatch.errors import ConfigError
from bigbatch.train import memory_check, train
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
