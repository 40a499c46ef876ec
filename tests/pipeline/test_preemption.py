"""Preemption (issue 29): SIGTERM and SIGUSR1 finish the current step, write its checkpoint
and stop with a message and exit status 75; the resumed run ends with the weights of a run
never stopped. ``--resume auto`` continues a run by itself. (Under torchrun:
tests/pipeline/test_train_torchrun.py.)"""

from __future__ import annotations

import os
import signal

import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.train import TrainConfig, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("preempt")
    return tiny_bert(root / "tiny"), scifact_slice(root / "sf")


def config(assets, out, **kw):
    tiny, data = assets
    base = dict(model=str(tiny), train_data=str(data), output_dir=str(out), batch_size=8,
                grad_cache_chunk=4, max_steps=5, warmup_steps=1, save_steps=0, eval_steps=0,
                eval_at_start=False, lora_r=0, lr=1e-3, max_length=32, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def weights(out):
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "run"
    train(config(assets, out))
    return weights(out)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_signal_finishes_the_step_writes_a_checkpoint_and_the_resume_is_exact(
        assets, tmp_path, uninterrupted, sig):
    from bigbatch.train.loop import RunPreempted

    out = tmp_path / "run"

    def at_step(step, state):
        if step == 2:
            os.kill(os.getpid(), getattr(signal, sig))  # noted, acted on after the step
        return False

    with pytest.raises(RunPreempted, match=rf"stopped by {sig} after step 2 of 5, its "
                                           rf"checkpoint written \(checkpoint-000002\); "
                                           rf"continue with --resume .*run"):
        train(config(assets, out), on_step_end=at_step)
    assert (out / "checkpoint-000002" / "manifest.json").exists()
    assert not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back
    summary = train(config(assets, out, resume="auto"))
    assert summary["steps"] == 5
    got = weights(out)
    assert all(torch.equal(got[k], uninterrupted[k]) for k in uninterrupted)


def test_the_command_exits_75_with_one_line(assets, tmp_path, capsys, monkeypatch):
    from bigbatch.train.loop import Trainer

    tiny, data = assets
    step = Trainer.step

    def step_then_signal(self, batch):
        values = step(self, batch)
        if self.state["step"] == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return values

    monkeypatch.setattr(Trainer, "step", step_then_signal)
    out = tmp_path / "run"
    code = main(["train", "--model", str(tiny), "--train-data", str(data), "--output-dir",
                 str(out), "--batch-size", "8", "--max-steps", "3", "--no-eval-at-start",
                 "--lora-r", "0", "--max-length", "32"])
    err = capsys.readouterr().err
    assert code == 75, err
    assert "bigbatch train: stopped by SIGTERM after step 1 of 3" in err
    assert (out / "checkpoint-000001").is_dir()


def test_resume_auto_starts_a_new_run_and_continues_a_stopped_one(assets, tmp_path, capsys):
    out = tmp_path / "run"
    stop = lambda step, state: step == 2  # noqa: E731 - ends the run there, as a kill would
    train(config(assets, out, resume="auto", save_steps=2), on_step_end=stop)
    assert (out / "checkpoint-000002").is_dir()
    summary = train(config(assets, out, resume="auto", save_steps=2))
    assert summary["steps"] == 5
    assert "--resume auto: continuing the run in" in capsys.readouterr().out
    # a run stopped before its first checkpoint starts anew (its files moved aside)
    fresh = tmp_path / "fresh"
    train(config(assets, fresh, save_steps=0, max_steps=3), on_step_end=lambda s, st: s == 1)
    assert train(config(assets, fresh, resume="auto", max_steps=2))["steps"] == 2
    assert list(fresh.glob("previous-*/run.json"))
