"""The README's engine example is examples/quickstart.py verbatim, the getting-started page's
is examples/engine_example.py verbatim, and both run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


@pytest.mark.parametrize("page, example", [
    ("README.md", "quickstart.py"),
    ("docs/getting-started.md", "engine_example.py"),
])
def test_page_shows_the_example_file(page, example):
    assert (ROOT / "examples" / example).read_text() in _python_blocks(ROOT / page)


def _run(example: str) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / example)],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_readme_example_runs_and_scores_the_batch():
    out = _run("quickstart.py")
    accuracy = float(re.search(r"'accuracy': ([0-9.]+)", out).group(1))
    loss = float(re.search(r"'loss': ([0-9.e-]+)", out).group(1))
    assert accuracy == 1.0 and 0 <= loss < 1   # each query's own document ranks first


@pytest.mark.slow
def test_example_runs_as_written_and_loss_goes_down():
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", _run("engine_example.py"))]
    assert len(losses) == 3 and losses[-1] < losses[0]
