"""``make demo-jax`` in small: the Flax MiniLM fine-tuned for two cached steps on a SciFact
slice, evaluated before and after by bigbatch.retrieval.evaluate, the table printed."""

from __future__ import annotations

import math

import pytest
from pipeline_helpers import minilm_path, scifact_slice


@pytest.mark.slow  # compiles MiniLM's cached step (about a minute on 2 cores)
def test_demo_runs_and_trains(tmp_path, capsys):
    from bigbatch.jax.demo import main

    data = scifact_slice(tmp_path / "beir", n_train=16, n_test=6, n_extra_docs=20)
    assert main(["--model", str(minilm_path()), "--data", str(data), "--batch-size", "8",
                 "--chunk", "3", "--max-steps", "2", "--max-length", "32",
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
