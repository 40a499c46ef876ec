"""examples/jax_example.py runs as written: the cached step equals plain value_and_grad on its
first step and the loss goes down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_jax_example_runs_and_loss_goes_down():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "jax_example.py")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    diff = float(re.search(r"largest gradient difference (\S+)", out.stdout).group(1))
    assert diff < 1e-4  # float32
    losses = [float(x) for x in re.findall(r"step \d: loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
