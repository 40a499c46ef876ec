"""bigbatch inside transformers.Trainer (GradCacheTrainer) and inside an accelerate loop
(gradcache_loss + accelerator.backward), float64, tiny BERT with dropout on, gradient
accumulation over 2 micro-batches: the gradients before the optimizer step equal those of
the mean over the micro-batches of the full (global) batch's InfoNCE, written out by hand,
each rank's chunks embedded from the random state its step started from (the same dropout
masks); on one process, and
on 2 processes started by ``accelerate launch`` (gloo), where every query's negatives are
the documents of both ranks. The runs are tests/integrations/hf_script.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import hf_script
from pipeline_helpers import tiny_bert

ROOT = Path(__file__).resolve().parents[2]


def embed_as_the_step(encoder, seen: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's micro-batch embedded with a full graph, chunk by chunk in the order of the
    step's first pass (queries, then documents), from the random state the step started
    from: the same dropout masks."""
    from sentence_transformers.base.losses.gradcache import _create_minibatch

    torch.set_rng_state(seen["rng"])
    out = []
    for tower in ("query", "doc"):
        inputs = seen["batch"][tower]
        n = inputs["input_ids"].shape[0]
        out.append(torch.cat([encoder(**_create_minibatch(inputs, lo, lo + hf_script.CHUNK))
                              for lo in range(0, n, hf_script.CHUNK)]))
    return out[0], out[1]


def reference(model_path: Path, per_rank: list[list[dict]]) -> dict[str, torch.Tensor]:
    """The gradient of mean_m CE(s * q_m d_m^T), q_m and d_m micro-batch m of every rank."""
    encoder = hf_script.make_encoder(str(model_path)).train()
    log_scale = torch.tensor(math.log(1 / hf_script.TEMPERATURE), dtype=torch.float64,
                             requires_grad=True)
    micro = len(per_rank[0])
    total = 0.0
    for m in range(micro):
        pieces = [embed_as_the_step(encoder, seen[m]) for seen in per_rank]
        q = torch.cat([p[0] for p in pieces])
        d = torch.cat([p[1] for p in pieces])
        logits = log_scale.exp() * q @ d.T
        total = total + torch.nn.functional.cross_entropy(logits, torch.arange(len(q))) / micro
    total.backward()
    grads = {n: p.grad for n, p in encoder.named_parameters() if p.grad is not None}
    grads["loss.log_scale"] = log_scale.grad
    return grads


def check(model_path: Path, out: Path, run: str, world: int) -> None:
    saved = [torch.load(out / f"{run}_rank{r}.pt") for r in range(world)]
    assert all(len(s["batches"]) == hf_script.ACCUMULATE for s in saved)
    ref = reference(model_path, [s["batches"] for s in saved])
    top = max(g.abs().max().item() for g in ref.values())
    for r, s in enumerate(saved):
        assert sorted(s["grads"]) == sorted(ref), run
        worst = max((s["grads"][n] - ref[n]).abs().max().item() for n in ref) / top
        assert worst <= 1e-10, (run, r, worst)


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return tiny_bert(tmp_path_factory.mktemp("hf") / "bert", dropout=0.1)


def test_trainer_and_accelerate_loop_on_one_process(bert, tmp_path):
    from bigbatch.encoders import load_encoder

    hf_script.run_trainer(str(bert), tmp_path, 0)
    hf_script.run_accelerate(str(bert), tmp_path, 0)
    check(bert, tmp_path, "trainer", 1)
    check(bert, tmp_path, "accelerate", 1)
    assert math.isfinite(json.loads((tmp_path / "trainer_eval.json").read_text())["eval_loss"])
    saved = load_encoder(tmp_path / "trainer_saved")  # the encoder's own folder
    assert saved.encode(["a question"]).shape == (1, 32)


def test_accelerate_launch_two_processes_equal_the_global_batch(bert, tmp_path):
    launcher = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    assert launcher, "the accelerate command is missing next to the Python running the tests"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    # --multi_gpu picks accelerate's torchrun launcher; the processes run on the CPU (gloo)
    proc = subprocess.run([launcher, "launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no",
                           "--dynamo_backend", "no", str(Path(hf_script.__file__)),
                           "--out", str(tmp_path), "--model", str(bert)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "rank 1 of 2: done" in proc.stdout
    check(bert, tmp_path, "trainer", 2)
    check(bert, tmp_path, "accelerate", 2)
