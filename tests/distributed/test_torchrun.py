"""Launch from the command line: torchrun --nproc_per_node=2 on a script that uses the public
API gives the same losses and gradients as one process on the global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "torchrun_example.py"


def run(cmd, out):
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd + [str(SCRIPT), "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_torchrun_two_processes_equal_one_process(tmp_path):
    two, stdout = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2"], tmp_path / "two.json")
    one, _ = run([sys.executable], tmp_path / "one.json")
    assert two["world_size"] == 2 and one["world_size"] == 1
    assert "gradient all-reduces 1" in stdout
    for a, b in zip(two["steps"], one["steps"]):
        assert abs(a["loss"] - b["loss"]) <= 1e-10 * abs(b["loss"])
        ga, gb = torch.tensor(a["grad"]), torch.tensor(b["grad"])
        assert ga.shape == gb.shape
        assert (ga - gb).abs().max().item() <= 1e-10 * gb.abs().max().item()
