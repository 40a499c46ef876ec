"""``make demo-jax`` (examples/jax_demo.py): its settings are ``make demo``'s, read from
configs/demo_scifact.yaml; in small, the Flax MiniLM fine-tuned for two cached steps on a
SciFact slice, evaluated before and after by bigbatch.retrieval.evaluate, the table printed."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import yaml
from pipeline_helpers import minilm_path, scifact_slice

from bigbatch.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _demo():
    spec = importlib.util.spec_from_file_location("jax_demo", ROOT / "examples" / "jax_demo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_are_read_from_make_demos_yaml():
    demo = _demo()
    args = demo.arguments(["--model", "m", "--data", "d"])
    values = yaml.safe_load((ROOT / "configs" / "demo_scifact.yaml").read_text())
    assert {k: getattr(args, k) for k in demo.SETTINGS} == {k: values[k] for k in demo.SETTINGS}
    assert (args.batch_size, args.grad_cache_chunk, args.max_length, args.temperature) == \
        (128, 32, 256, 0.05)


def test_another_file_and_a_flag_change_the_settings(tmp_path):
    demo = _demo()
    values = yaml.safe_load((ROOT / "configs" / "demo_scifact.yaml").read_text())
    (tmp_path / "small.yaml").write_text(yaml.safe_dump({**values, "batch_size": 8, "lr": 1}))
    args = demo.arguments(["--model", "m", "--data", "d", "--config", str(tmp_path / "small.yaml"),
                           "--grad-cache-chunk", "3"])
    assert (args.batch_size, args.lr, args.grad_cache_chunk) == (8, 1.0, 3)


@pytest.mark.parametrize("change,message", [({"scheduler": "constant"}, "cosine schedule"),
                                            ({"epochs": "two"}, "epochs must be int"),
                                            ({"seed": None}, "seed must be int")])
def test_a_setting_the_demo_cannot_run_is_refused(tmp_path, change, message):
    demo = _demo()
    values = yaml.safe_load((ROOT / "configs" / "demo_scifact.yaml").read_text())
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**values, **change}))
    with pytest.raises(ConfigError, match=message):
        demo.read_settings(tmp_path / "bad.yaml")


def test_a_missing_setting_is_named(tmp_path):
    demo = _demo()
    values = yaml.safe_load((ROOT / "configs" / "demo_scifact.yaml").read_text())
    del values["weight_decay"]
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError, match="reads weight_decay from this file"):
        demo.read_settings(tmp_path / "short.yaml")


@pytest.mark.slow  # compiles MiniLM's cached step (about a minute on 2 cores)
def test_demo_runs_and_trains(tmp_path, capsys):
    data = scifact_slice(tmp_path / "beir", n_train=16, n_test=6, n_extra_docs=20)
    assert _demo().main(["--model", str(minilm_path()), "--data", str(data), "--batch-size", "8",
                         "--grad-cache-chunk", "3", "--max-steps", "2", "--max-length", "32",
                         "--eval-batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "step 2/2: loss" in out
    rows = [line for line in out.splitlines() if line.startswith(("base", "fine-tuned"))]
    assert len(rows) >= 2
    ndcg = [float(r.split()[2]) for r in rows[:2]]
    assert all(0 < x <= 1 and math.isfinite(x) for x in ndcg)
    assert "done: 2 steps" in out


@pytest.mark.slow  # embeds the whole SciFact corpus (measured: 23 min on 2 shared cores)
def test_flax_minilm_reproduces_the_published_scifact_figure():
    from pipeline_helpers import need_scifact

    from bigbatch.jax.bert import load_bert
    from bigbatch.jax.encode import FlaxTextEncoder
    from bigbatch.retrieval.evaluate import evaluate_beir

    data = need_scifact()
    model, params = load_bert(minilm_path())
    encoder = FlaxTextEncoder(model, params, minilm_path(), max_length=256)
    metrics = evaluate_beir(encoder, data, "test", progress=False)
    assert round(metrics["ndcg@10"], 4) == 0.6451  # the PyTorch base row of make demo
