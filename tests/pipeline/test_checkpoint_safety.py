"""A checkpoint is data, never code: a crafted pickle in any ``.pt`` file of a checkpoint
(the trainer state, a rank's random state, the one in ``best/``) is refused on ``--resume``
with an error naming the file, and the code it carries never runs."""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import pytest
import torch
from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.errors import ConfigError
from bigbatch.train import train
from bigbatch.train.checkpoint import latest_checkpoint, rng_state, safe_load, set_rng_state


class _Payload:
    """Unpickling this calls ``os.system`` with a command that writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A short run with two checkpoints and a ``best/``."""
    root = tmp_path_factory.mktemp("safety")
    from bigbatch.train import TrainConfig
    data = scifact_slice(root / "sf")
    cfg = TrainConfig(model=str(tiny_bert(root / "tiny")), train_data=str(data), eval_data=str(data),
                      output_dir=str(root / "run"), batch_size=8, grad_cache_chunk=4, max_steps=4,
                      save_steps=2, eval_steps=2, eval_at_start=False, lora_r=0, lr=1e-3,
                      max_length=32, seed=1)
    train(cfg)
    return cfg


@pytest.mark.parametrize("target", ["trainer_state.pt", "rng_state_rank0.pt", "best"])
def test_a_crafted_pickle_in_a_checkpoint_is_refused_and_runs_nothing(finished, tmp_path, target):
    run = tmp_path / "run"
    shutil.copytree(finished.output_dir, run)
    marker = tmp_path / "pwned"
    ckpt = latest_checkpoint(run)
    victim = (run / "best" / "trainer_state.pt") if target == "best" else ckpt / target
    assert victim.exists()
    torch.save({"state": {"step": _Payload(marker)}, "x": _Payload(marker)}, victim)
    cfg = finished.__class__(**{**finished.__dict__, "output_dir": str(run), "resume": str(run),
                                "max_steps": 6})
    if target == "best":
        # best/ is read on every resume (is it from a later timeline?): unreadable, it is
        # left where it is and the run goes on from its checkpoint
        train(cfg)
    else:
        with pytest.raises(ConfigError, match=rf"{victim.name}: refused to load.*nothing in it was run"):
            train(cfg)
    assert not marker.exists(), "the crafted checkpoint ran code"


def test_random_states_round_trip_through_the_safe_loader(tmp_path):
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    set_rng_state(safe_load(tmp_path / "rng.pt"))
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_a_truncated_state_file_is_named(tmp_path):
    torch.save({"a": torch.ones(1000)}, tmp_path / "t.pt")
    data = (tmp_path / "t.pt").read_bytes()
    (tmp_path / "t.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="t.pt: cannot be read"):
        safe_load(tmp_path / "t.pt")
