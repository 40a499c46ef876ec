"""A checkpoint is data, never code: a crafted pickle in any ``.pt`` file of a checkpoint
(the trainer state, a rank's random state, the one in ``best/``) is refused on ``--resume``
with an error naming the file, and the code it carries never runs."""

from __future__ import annotations

import dataclasses
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
    from bigbatch.train.checkpoint import write_manifest
    write_manifest(victim.parent)  # a crafted checkpoint comes with a manifest that fits it
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


# ---------------------------------------------------------------- manifests (issue 29, item 3)
def test_each_checkpoint_lists_its_files_with_size_and_sha256(finished):
    import hashlib
    import json
    from pathlib import Path

    from bigbatch.train.checkpoint import checkpoint_problem

    ckpt = latest_checkpoint(finished.output_dir)
    manifest = json.loads((ckpt / "manifest.json").read_text())["files"]
    assert {"trainer_state.pt", "rng_state_rank0.pt", "config.yaml", "model/model.safetensors"} \
        <= set(manifest)
    for name, entry in manifest.items():
        data = (Path(ckpt) / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert checkpoint_problem(ckpt) is None


@pytest.mark.parametrize("damage", ["truncated", "altered"])
def test_a_damaged_checkpoint_is_named_and_the_newest_intact_one_taken(finished, tmp_path,
                                                                      capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(finished.output_dir, run)
    newest = run / "checkpoint-000004"
    victim = newest / ("model/model.safetensors" if damage == "truncated" else "trainer_state.pt")
    data = bytearray(victim.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF  # same size, one byte changed
    victim.write_bytes(bytes(data))
    why = "is .* bytes, .* when it was written" if damage == "truncated" else \
        "was altered since it was written"
    cfg = finished.__class__(**{**finished.__dict__, "output_dir": str(run),
                                "resume": str(newest), "max_steps": 6})
    with pytest.raises(ConfigError, match=rf"checkpoint-000004 is damaged: .*{why}.*the newest "
                                          rf"intact checkpoint there is .*checkpoint-000002"):
        train(cfg)
    cfg = dataclasses.replace(cfg, resume=str(run))  # the output folder: the newest intact
    assert train(cfg)["steps"] == 6  # checkpoint, with a line
    out = capsys.readouterr().out
    assert "checkpoint-000004 is damaged" in out and "resuming from" in out
    assert "checkpoint-000002, the newest intact checkpoint" in out
    assert list(run.glob("abandoned-*/checkpoint-000004"))  # set aside, not deleted
