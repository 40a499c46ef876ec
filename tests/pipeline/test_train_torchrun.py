"""``bigbatch train`` under ``torchrun --nproc_per_node=2`` (gloo): cross-device negatives give
the single-process losses of the same global batch, evaluation (on rank 0) and ``best/`` run
in step on both ranks, and the run writes its outputs once."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

COMMON = ["--max-steps", "3", "--warmup-steps", "1", "--grad-cache-chunk", "3", "--lora-r", "0",
          "--lr", "1e-3", "--max-length", "48", "--save-steps", "2", "--seed", "5",
          "--no-eval-at-start"]


def run(prefix, args, out):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    proc = subprocess.run(prefix + ["train", *args, "--output-dir", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"], proc.stdout


def test_two_processes_match_one_process_on_the_global_batch(tmp_path):
    tiny = tiny_bert(tmp_path / "tiny", dropout=0.0)
    data = scifact_slice(tmp_path / "sf")
    common = ["--model", str(tiny), "--train-data", str(data), *COMMON]
    two, printed = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "-m", "bigbatch.cli"],
                       common + ["--batch-size", "8", "--eval-data", str(data), "--eval-steps",
                                 "2", "--eval-batch-size", "32"], tmp_path / "two")
    one, _ = run([sys.executable, "-m", "bigbatch.cli"], common + ["--batch-size", "16"],
                 tmp_path / "one")
    assert "global batch 16 (2 process(es) x 8)" in printed
    assert [r["step"] for r in two] == [r["step"] for r in one] == [1, 2, 3]
    # step 1 runs on identical weights: the global loss and its metrics agree to round-off
    assert abs(two[0]["loss"] - one[0]["loss"]) <= 1e-5 * abs(one[0]["loss"])
    assert abs(two[0]["grad_norm"] - one[0]["grad_norm"]) <= 1e-4 * one[0]["grad_norm"]
    assert two[0]["accuracy"] == one[0]["accuracy"]
    for r2, r1 in zip(two, one):  # later steps follow the same trajectory
        assert abs(r2["loss"] - r1["loss"]) <= 1e-3 * abs(r1["loss"])
    out = tmp_path / "two"
    assert (out / "final" / "model.safetensors").exists()
    # rank 0 evaluated at step 2 and at the end; both ranks joined best/'s save
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "eval"] == [2, 3]
    assert (out / "best" / "model" / "model.safetensors").exists()
    assert sorted(p.name for p in (out / "checkpoint-000003").glob("rng_state_rank*.pt")) == \
        ["rng_state_rank0.pt", "rng_state_rank1.pt"]


def _slow_main_rank_cases():
    """Rank 0 works alone (as when it evaluates) for longer than the collective timeout."""
    import time

    from bigbatch.engine.distributed import world_info
    from bigbatch.train.main_rank import barrier, from_main

    info = world_info()
    if info.rank == 0:
        time.sleep(5)
    barrier(info)
    if info.rank == 0:
        time.sleep(5)
    got = from_main({"ndcg@10": 0.5} if info.rank == 0 else None, info)
    return {"got": got}


def _wait_worker(rank, world, port, out_path):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dist_helpers import run_cases
    run_cases(rank, world, port, out_path, {"slow_main": _slow_main_rank_cases}, timeout_s=2)


@pytest.mark.slow
def test_other_ranks_wait_for_the_main_rank_beyond_the_collective_timeout(tmp_path):
    """``--dist-timeout`` bounds collectives; an evaluation on rank 0 may take longer (the
    other ranks used to die in their barrier after --dist-timeout seconds)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from dist_helpers import spawn_and_collect

    per_rank = spawn_and_collect(_wait_worker, tmp_path / "r.json")
    assert [r["slow_main"]["got"] for r in per_rank] == [{"ndcg@10": 0.5}] * 2


@pytest.mark.slow
def test_a_mix_under_two_processes_matches_one_process(tmp_path):
    """Several sources under torchrun (gloo): every step's global batch is one source on
    both ranks, and the run follows the one-process run of the same global batch."""
    tiny = tiny_bert(tmp_path / "tiny", dropout=0.0)
    data = scifact_slice(tmp_path / "sf")
    pairs = tmp_path / "titles.jsonl"
    subprocess.run([sys.executable, "-m", "bigbatch.cli", "make-pairs", str(data), str(pairs),
                    "--max-pairs", "48"], check=True, capture_output=True)
    config = tmp_path / "mix.yaml"
    config.write_text(f"train_data:\n  - {{path: {data}, name: scifact, weight: 1}}\n"
                      f"  - {{path: {pairs}, name: titles, weight: 1, query_prefix: 'title: '}}\n")
    common = ["--config", str(config), "--model", str(tiny), *COMMON, "--max-steps", "4"]
    two, printed = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "-m", "bigbatch.cli"],
                       common + ["--batch-size", "8"], tmp_path / "two")
    one, _ = run([sys.executable, "-m", "bigbatch.cli"], common + ["--batch-size", "16"],
                 tmp_path / "one")
    assert "global batch 16 (2 process(es) x 8)" in printed
    assert [r["source"] for r in two] == [r["source"] for r in one]
    assert {r["source"] for r in one} == {"scifact", "titles"}
    for r2, r1 in zip(two, one):
        assert abs(r2["loss"] - r1["loss"]) <= 1e-3 * abs(r1["loss"])


# ---------------------------------------------------------------- preemption and restarts
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
PREEMPT = ["--max-steps", "12", "--warmup-steps", "1", "--grad-cache-chunk", "4", "--lora-r",
           "0", "--lr", "1e-3", "--max-length", "32", "--save-steps", "2", "--seed", "5",
           "--no-eval-at-start", "--batch-size", "8", "--resume", "auto"]


def _env():
    return dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")


def _workers(agent_pid):
    """{rank: pid} of the worker processes of a torchrun agent (its children, by RANK)."""
    from pathlib import Path

    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent_pid:
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            found[rank] = int(d.name)
    return found


def _launch(extra, args, out, when, sig):
    """Start ``bigbatch train`` under torchrun, send ``sig`` to rank 1 once ``when(out)``
    holds, and return the finished process's (return code, stdout + stderr)."""
    import signal
    import time

    proc = subprocess.Popen(TORCHRUN + extra + ["-m", "bigbatch.cli", "train", *args,
                                                "--output-dir", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env())
    deadline = time.monotonic() + 600
    sent = False
    while proc.poll() is None and time.monotonic() < deadline:
        if not sent and when(out):
            pid = _workers(proc.pid).get(1)
            if pid is not None:
                os.kill(pid, getattr(signal, sig))
                sent = True
        time.sleep(0.02)
    text, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    assert sent, text[-3000:]
    return proc.returncode, text


def _trained_rows(out):
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r for r in rows if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def preempt_setup(tmp_path_factory):
    """The model and data, and the final weights of a 2-rank run never stopped."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("preempt2")
    tiny, data = tiny_bert(root / "tiny", dropout=0.1), scifact_slice(root / "sf")
    args = ["--model", str(tiny), "--train-data", str(data), *PREEMPT]
    proc = subprocess.run(TORCHRUN + ["-m", "bigbatch.cli", "train", *args,
                                      "--output-dir", str(root / "whole")],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return args, load_file(str(root / "whole" / "final" / "model.safetensors"))


def _same_weights(out, reference):
    import torch
    from safetensors.torch import load_file

    got = load_file(str(out / "final" / "model.safetensors"))
    return all(torch.equal(got[k], reference[k]) for k in reference)


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_one_step_and_the_resume_is_exact(
        preempt_setup, tmp_path):
    """Rank 1 alone gets SIGTERM: both ranks finish the step, agree, write that step's
    checkpoint and exit 75; the run resumed with the same command ends with the weights of
    the run never stopped (dropout on: every rank's random state resumes too)."""
    import re

    args, reference = preempt_setup
    out = tmp_path / "run"
    code, text = _launch(["--max-restarts", "0"], args, out,
                         lambda o: (o / "metrics.jsonl").exists() and len(_trained_rows(o)) >= 3,
                         "SIGTERM")
    assert code != 0, text[-3000:]
    stops = re.findall(r"stopped by SIGTERM after step (\d+) of 12", text)
    assert len(stops) == 2 and stops[0] == stops[1], text[-3000:]  # both ranks, one step
    step = int(stops[0])
    assert 3 <= step < 12 and re.search(r"exitcode\s*:\s*75", text), text[-3000:]
    assert (out / f"checkpoint-{step:06d}" / "manifest.json").exists()
    proc = subprocess.run(TORCHRUN + ["-m", "bigbatch.cli", "train", *args,
                                      "--output-dir", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"step {step} of 12" in proc.stdout
    assert _same_weights(out, reference)


@pytest.mark.slow
def test_a_rank_killed_is_restarted_by_torchrun_and_continues_by_itself(preempt_setup,
                                                                         tmp_path):
    """SIGKILL on rank 1 (no handler runs): torchrun --max-restarts 1 starts both ranks again
    with the same command, and --resume auto continues from the newest intact checkpoint
    to the weights of the run never stopped."""
    args, reference = preempt_setup
    out = tmp_path / "run"
    code, text = _launch(["--max-restarts", "1"], args, out,
                         lambda o: (o / "checkpoint-000002").is_dir(), "SIGKILL")
    assert code == 0, text[-4000:]
    assert "--resume auto: continuing the run in" in text, text[-3000:]
    assert _same_weights(out, reference)
