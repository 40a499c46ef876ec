"""``make bench-gpu``'s script is known to run end to end before anyone spends GPU time on it:
its dry mode (``bash bench/gpu.sh --dry``) runs every step on the CPU with tiny shapes,
without the packaged all-MiniLM-L6-v2 (``BENCH_RANDOM_WEIGHTS=1``: what a machine without it
gets), and writes each result file and the GPU section of its page."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import SCIFACT

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not SCIFACT.exists() or shutil.which("bash") is None,
                    reason="needs SciFact and bash")
@pytest.mark.slow
def test_the_gpu_benchmark_runs_dry_and_writes_its_files(tmp_path):
    results = tmp_path / "results"
    env = dict(os.environ, PY=sys.executable, RESULTS_DIR=str(results),
               BIGBATCH_SCIFACT=str(SCIFACT), BENCH_CACHE=str(tmp_path / "cache"),
               BENCH_RANDOM_WEIGHTS="1")
    env.pop("BIGBATCH_MINILM", None)
    p = subprocess.run(["bash", str(ROOT / "bench" / "gpu.sh"), "--dry"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert sorted(f.name for f in results.glob("*.json")) == [
        "checks-cpu.json", "memory-cpu.json", "speed-8.json", "speed-auto.json",
        "train-demo.json"]
    checks = json.loads((results / "checks-cpu.json").read_text())
    assert checks["exactness"]["passed"] and len(checks["exactness"]["cases"]) == 5
    assert checks["bf16_vs_fp32"]["median"] > 0.99
    auto = json.loads((results / "speed-auto.json").read_text())["settings"]["auto"]
    assert auto["estimate_mb"] <= auto["budget_mb"]
    memory = json.loads((results / "memory-cpu.json").read_text())["rows"]
    assert all("failed" not in r for r in memory) and {r["batch"] for r in memory} == {64, 256}
    train = json.loads((results / "train-demo.json").read_text())
    assert train["train_steps"] == 2 and train["evals"][-1]["ndcg@10"] >= 0
    assert not (results / "demo-run").exists()  # the run folder is not kept
    page = (results / "benchmarks.md").read_text()
    for heading in ("## GPU", "### Checks", "### Step time", "### Peak memory against batch size",
                    "### `bigbatch train`, the demo's recipe"):
        assert heading in page
    assert page.count("<!-- bench-gpu: start -->") == page.count("<!-- bench-gpu: end -->") == 1
    assert (tmp_path / "cache" / "scifact-wordpiece" / "tokenizer.json").exists()
