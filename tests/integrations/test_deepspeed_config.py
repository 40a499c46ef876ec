"""``bigbatch train --deepspeed``'s configuration file: what it is completed with, and every
section or value the exact step cannot run with, refused before any data loads (no DeepSpeed
import needed)."""

from __future__ import annotations

import json

import pytest

from bigbatch.errors import ConfigError
from bigbatch.integrations.deepspeed import read_config
from bigbatch.train import TrainConfig


def write(tmp_path, cfg, name="ds.json"):
    p = tmp_path / name
    p.write_text(cfg if isinstance(cfg, str) else json.dumps(cfg, indent=2))
    return str(p)


def test_completed_from_the_runs_options(tmp_path):
    cfg = read_config(write(tmp_path, {"zero_optimization": {"stage": 2}}), batch_size=8,
                      max_grad_norm=1.0, world_size=2)
    assert cfg["train_micro_batch_size_per_gpu"] == 8
    assert cfg["train_batch_size"] == 16 and cfg["gradient_accumulation_steps"] == 1
    assert cfg["gradient_clipping"] == 1.0
    kept = read_config(write(tmp_path, {"zero_optimization": {"stage": 1},
                                        "gradient_clipping": 0.5}), batch_size=4,
                       max_grad_norm=1.0)
    assert kept["gradient_clipping"] == 0.5
    assert "gradient_clipping" not in read_config(
        write(tmp_path, {"zero_optimization": {"stage": 1}}), batch_size=4, max_grad_norm=0)


@pytest.mark.parametrize("cfg, words", [
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Adam"}}, "'optimizer' section"),
    ({"zero_optimization": {"stage": 2}, "scheduler": {"type": "WarmupLR"}}, "'scheduler'"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}, "fp16.enabled"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}, "--dtype bfloat16"),
    ({}, "stage is 0"),
    ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4},
     "gradient_accumulation_steps is 4"),
    ({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 2},
     "contradict --batch-size 8"),
    ([1, 2], "a JSON object"),
])
def test_refused_with_the_file_and_the_reason(tmp_path, cfg, words):
    path = write(tmp_path, cfg)
    with pytest.raises(ConfigError) as e:
        read_config(path, batch_size=8, max_grad_norm=1.0)
    assert path in str(e.value) and words in str(e.value)


def test_invalid_json_names_the_line(tmp_path):
    path = write(tmp_path, '{\n  "zero_optimization": {"stage": 2},\n  oops\n}')
    with pytest.raises(ConfigError, match=r"ds\.json:3: not valid JSON"):
        read_config(path, batch_size=8, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match="--deepspeed: file not found"):
        read_config(str(tmp_path / "missing.json"), batch_size=8, max_grad_norm=1.0)


def test_train_options_it_cannot_run_with(tmp_path):
    from pipeline_helpers import scifact_slice, tiny_bert

    tiny, data = tiny_bert(tmp_path / "tiny"), scifact_slice(tmp_path / "sf")
    ds = write(tmp_path, {"zero_optimization": {"stage": 2}})
    base = dict(model=str(tiny), train_data=str(data), deepspeed=ds, grad_cache_chunk=4)
    TrainConfig(**base).validate()
    for extra, words in ((dict(mode="query-side-tune"), "--mode"),
                         (dict(grad_cache_chunk="auto"), "auto chunk sizes come from a probe"),
                         (dict(dtype="float16"), "--dtype"),
                         (dict(fsdp=True), "--fsdp and --deepspeed")):
        with pytest.raises(ConfigError, match=words):
            TrainConfig(**{**base, **extra}).validate()


def test_zero3_is_a_training_stage(tmp_path):
    """ZeRO-3 runs through bigbatch train (evaluation on every rank, weights gathered a
    parameter at a time for saving), and a --deepspeed run may be resumed."""
    from pipeline_helpers import scifact_slice, tiny_bert

    cfg = read_config(write(tmp_path, {"zero_optimization": {"stage": 3}}), batch_size=8,
                      max_grad_norm=1.0)
    assert cfg["zero_optimization"]["stage"] == 3
    tiny, data = tiny_bert(tmp_path / "tiny"), scifact_slice(tmp_path / "sf")
    TrainConfig(model=str(tiny), train_data=str(data), resume=str(tmp_path), grad_cache_chunk=4,
                deepspeed=write(tmp_path, {"zero_optimization": {"stage": 3}})).validate()
