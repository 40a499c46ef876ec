"""The README's engine example is examples/engine_example.py verbatim, and it runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_is_the_example_file():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "engine_example.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert example in blocks


def test_example_runs_as_written_and_loss_goes_down():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "engine_example.py")],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
