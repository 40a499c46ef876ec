"""``bigbatch train --deepspeed`` (ZeRO stages 1, 2 and 3, one process and under torchrun,
DeepSpeed's CPU accelerator over gloo) follows the plain run: the same losses step by step
and the same final weights (to float32 round-off, amplified a little by Adam), with the
run's outputs (final/, its card) written as usual; ZeRO-3 evaluates on every rank and saves
weights gathered whole; a DeepSpeed run resumed from a checkpoint ends as the uninterrupted
one."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("deepspeed")

from pipeline_helpers import scifact_slice, tiny_bert

from bigbatch.cli import main

ARGS = ["--batch-size", "8", "--grad-cache-chunk", "3", "--max-steps", "3", "--warmup-steps",
        "1", "--lora-r", "4", "--lora-alpha", "8", "--lr", "1e-3", "--max-length", "48",
        "--save-steps", "0", "--seed", "3", "--no-eval-at-start", "--report-to", "none"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    return tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")


def run(assets, out, *extra):
    tiny, data = assets
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    assert main(["train", "--model", str(tiny), "--train-data", str(data), "--output-dir",
                 str(out), *ARGS, *extra]) == 0
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def adapter(out):
    from safetensors.torch import load_file
    return load_file(out / "final" / "adapter" / "adapter_model.safetensors")


def check_follows(plain, ds, out_plain, out_ds):
    assert [r["step"] for r in ds] == [r["step"] for r in plain] == [1, 2, 3]
    for a, b in zip(ds, plain):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a, b)
        assert a["lr"] == b["lr"]
    wa, wb = adapter(out_ds), adapter(out_plain)
    for k in wb:
        assert (wa[k] - wb[k]).abs().max() <= 1e-3 * wb[k].abs().max(), k
    assert (out_ds / "final" / "README.md").exists()


@pytest.fixture(scope="module")
def plain(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("plain") / "run"
    return run(assets, out), out


@pytest.mark.slow  # ~40 s on 2 busy cores: two runs and DeepSpeed's import
def test_zero2_follows_the_plain_run(assets, plain, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    rows = run(assets, tmp_path / "run", "--deepspeed", str(ds))
    check_follows(plain[0], rows, plain[1], tmp_path / "run")


@pytest.mark.slow
def test_zero1_follows_the_plain_run(assets, plain, tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    rows = run(assets, tmp_path / "run", "--deepspeed", str(ds))
    check_follows(plain[0], rows, plain[1], tmp_path / "run")


def torchrun(args, out):
    import subprocess
    import sys

    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", "-m", "bigbatch.cli", "train", *args,
                           "--output-dir", str(out)], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


@pytest.mark.slow
def test_zero2_under_torchrun_follows_the_plain_two_process_run(assets, tmp_path):
    """2 processes x 4 queries, cross-device negatives: the DeepSpeed run's losses are the
    plain run's (measured: equal to 7 digits; weights to 2.5e-5)."""
    tiny, data = assets
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    args = ["--model", str(tiny), "--train-data", str(data), *ARGS, "--batch-size", "4"]
    plain = torchrun(args, tmp_path / "plain")
    ds_rows = torchrun([*args, "--deepspeed", str(ds)], tmp_path / "ds")
    check_follows(plain, ds_rows, tmp_path / "plain", tmp_path / "ds")


def _zero(tmp_path, stage):
    ds = tmp_path / f"zero{stage}.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    return ds


@pytest.mark.slow
def test_zero3_follows_the_plain_run_and_evaluates(assets, plain, tmp_path):
    """Stage 3 partitions the weights: the evaluation (every forward gathers them) and
    final/ (gathered a parameter at a time to the main rank) work as in the plain run."""
    from sentence_transformers import SentenceTransformer

    out = tmp_path / "run"
    rows = run(assets, out, "--deepspeed", str(_zero(tmp_path, 3)), "--eval-data",
               str(assets[1]), "--eval-batch-size", "16")
    check_follows(plain[0], rows, plain[1], out)
    evals = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(l)["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3]
    texts = ["cells divide", "x"]
    got = SentenceTransformer(str(out / "final"), device="cpu").encode(texts,
                                                                      convert_to_tensor=True)
    want = SentenceTransformer(str(plain[1] / "final"), device="cpu").encode(
        texts, convert_to_tensor=True)
    assert (got - want).abs().max().item() <= 1e-4


def _resumed(assets, tmp_path, out, stage):
    """The run's folder as a kill right after checkpoint 1 left it, resumed to the end."""
    import shutil

    again = tmp_path / f"resumed{stage}"
    shutil.copytree(out, again)
    for later in ("checkpoint-000002", "checkpoint-000003", "final", "summary.json"):
        p = again / later
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    run(assets, again, "--deepspeed", str(_zero(tmp_path, stage)), "--save-steps", "1",
        "--resume", str(again / "checkpoint-000001"))
    return again


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_run_resumes_exactly(assets, tmp_path, stage):
    out = tmp_path / "run"
    run(assets, out, "--deepspeed", str(_zero(tmp_path, stage)), "--save-steps", "1",
        "--save-total-limit", "5")
    ckpt = out / "checkpoint-000001"
    assert json.loads((ckpt / "sharding.json").read_text())["zero_stage"] == stage
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "model" / "adapter_model.safetensors").is_file()
    again = _resumed(assets, tmp_path, out, stage)
    for k, v in adapter(out).items():
        assert (adapter(again)[k] - v).abs().max().item() == 0.0, k


@pytest.mark.slow
def test_zero3_under_torchrun_follows_the_plain_two_process_run(assets, tmp_path):
    """2 processes x 4 queries under ZeRO-3: the weights partitioned over both, evaluation
    split over them, the losses the plain run's."""
    tiny, data = assets
    args = ["--model", str(tiny), "--train-data", str(data), *ARGS, "--batch-size", "4",
            "--eval-data", str(data), "--eval-batch-size", "16"]
    plain = torchrun(args, tmp_path / "plain")
    ds_rows = torchrun([*args, "--deepspeed", str(_zero(tmp_path, 3))], tmp_path / "ds")
    check_follows(plain, ds_rows, tmp_path / "plain", tmp_path / "ds")
    evals = [[json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text()
              .splitlines() if json.loads(l)["kind"] == "eval"] for name in ("plain", "ds")]
    assert abs(evals[0][-1]["ndcg@10"] - evals[1][-1]["ndcg@10"]) <= 1e-3
