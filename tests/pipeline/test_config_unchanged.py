"""A run never changes its configuration: the chunk sizes GradCache uses are decided once, when
the engine is built, and read from the engine by the start line and the model card, while
config.yaml keeps what the user asked for (and resumes the run exactly); validation runs
once per run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from pipeline_helpers import scifact_slice, tiny_bert
from safetensors.torch import load_file

from bigbatch.cli import main
from bigbatch.train import TrainConfig, load_config, train


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny"), scifact_slice(root / "sf")


def argv(assets, out, *extra):
    tiny, data = assets
    return ["train", "--model", str(tiny), "--train-data", str(data), "--output-dir", str(out),
            "--batch-size", "8", "--grad-cache-chunk", "32", "--max-steps", "2",
            "--warmup-steps", "1", "--save-steps", "1", "--eval-steps", "0",
            "--no-eval-at-start", "--lora-r", "0", "--max-length", "32", "--seed", "4", *extra]


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def test_a_chunk_beyond_the_batch_is_kept_as_given_and_run_as_the_batch(assets, tmp_path,
                                                                        capsys):
    out = tmp_path / "run"
    assert main(argv(assets, out, "--query-grad-cache-chunk", "4")) == 0
    said = capsys.readouterr().out
    assert ", chunk 8 (queries 4), " in said                 # the engine's sizes
    assert yaml.safe_load((out / "config.yaml").read_text())["grad_cache_chunk"] == 32
    card = (out / "final" / "README.md").read_text()
    assert "computed in chunks of 8 (4 for queries) with the gradient" in card
    assert '"grad_cache_chunk": 8' in card and '"query_grad_cache_chunk": 4' in card
    assert "- `grad_cache_chunk`: 32" in card                # the hyperparameter, as given


def test_the_written_config_yaml_resumes_the_run_exactly(assets, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert main(argv(assets, straight)) == 0
    config = load_config(None, {"model": str(assets[0]), "train_data": str(assets[1]),
                                "output_dir": str(cut), "batch_size": 8,
                                "grad_cache_chunk": 32, "max_steps": 2, "warmup_steps": 1,
                                "save_steps": 1, "eval_steps": 0, "eval_at_start": False,
                                "lora_r": 0, "max_length": 32, "seed": 4})
    train(config, on_step_end=lambda step, state: step >= 1)  # stopped after step 1
    assert main(["train", "--config", str(cut / "config.yaml"), "--resume", str(cut)]) == 0
    assert losses(cut) == losses(straight)
    a, b = load_file(straight / "final" / "model.safetensors"), \
        load_file(cut / "final" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)


def test_validate_runs_once_per_run(assets, tmp_path, monkeypatch):
    calls = []
    original = TrainConfig.validate

    def counted(self):
        calls.append(self.output_dir)
        return original(self)

    monkeypatch.setattr(TrainConfig, "validate", counted)
    assert main(argv(assets, tmp_path / "a", "--max-steps", "1")) == 0
    assert len(calls) == 1                                   # load_config's; train trusts it
    tiny, data = assets
    train(TrainConfig(model=str(tiny), train_data=str(data), output_dir=str(tmp_path / "b"),
                      batch_size=8, max_steps=1, eval_at_start=False, lora_r=0,
                      max_length=32))                        # never validated: train does
    assert len(calls) == 2


def test_a_config_cannot_be_changed():
    config = TrainConfig(model="m", train_data="d").validate()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.grad_cache_chunk = 1
    other = dataclasses.replace(config, grad_cache_chunk=1)
    assert (config.grad_cache_chunk, other.grad_cache_chunk) == ("auto", 1) and other != config
