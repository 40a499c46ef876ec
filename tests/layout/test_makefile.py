"""The Makefile's demo targets expand to the commands the README promises.

``make`` keeps the spaces between a variable's value and a comment on the same line
(``X := a  # note`` is ``"a  "``), which once turned ``make demo-mix``'s data folder into
``runs/demo-mix-data  /scifact``. These checks read the Makefile and dry-run the targets
(``make -n``: nothing is installed or trained).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASSIGNMENT = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*(?::=|\?=|\+=|=)")


def _assignments_with_comments(text: str) -> list[str]:
    """Variable assignments with a comment after their value, where make keeps the spaces."""
    return [
        line
        for line in text.splitlines()
        if ASSIGNMENT.match(line) and "#" in line and not line.lstrip().startswith("#")
    ]


def test_no_variable_has_a_comment_after_its_value():
    assert _assignments_with_comments((ROOT / "Makefile").read_text()) == []


def test_the_check_sees_a_comment_after_a_value():
    assert _assignments_with_comments("A := b  # c\n# D := e\nF := g\n") == ["A := b  # c"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_mix_links_scifact_into_its_data_folder(tmp_path):
    out = subprocess.run(
        ["make", "-n", "demo-mix", "SCIFACT=/data/scifact"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert 'ln -sfn "/data/scifact" runs/demo-mix-data/scifact' in out, out


def _clone_without_shared(tmp_path: Path) -> Path:
    """The Makefile and pyproject.toml in a folder with no ../shared beside it (a user's
    clone); nothing else is needed for ``make -n``."""
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, clone / name)
    return clone


def _dry_run(cwd: Path, *args: str) -> str:
    return subprocess.run(["make", "-n", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_without_scifact_fetches_it_into_data(tmp_path):
    out = _dry_run(_clone_without_shared(tmp_path), "demo")
    assert ".venv/bin/bigbatch data fetch scifact --to data" in out, out
    assert '--train-data "data/scifact" --eval-data "data/scifact"' in out, out
    assert out.index("data fetch scifact") < out.index("bigbatch train"), out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_demo_reads_scifact_beside_the_clone_or_where_it_is_told(tmp_path):
    clone = _clone_without_shared(tmp_path)
    shared = tmp_path / "shared" / "data" / "scifact"
    shared.mkdir(parents=True)
    (shared / "corpus.jsonl").write_text("{}\n")
    out = _dry_run(clone, "demo")
    assert '--train-data "../shared/data/scifact"' in out and "data fetch" not in out, out
    out = _dry_run(clone, "demo", "SCIFACT=/data/sets/scifact")
    assert '--train-data "/data/sets/scifact"' in out and "data fetch" not in out, out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_data_takes_a_mirror_and_its_checksum(tmp_path):
    out = _dry_run(_clone_without_shared(tmp_path), "data",
                   "SCIFACT_URL=http://127.0.0.1:8000/scifact.zip", "SCIFACT_SHA256=" + "a" * 64)
    assert (f'bigbatch data fetch scifact --to data --url "http://127.0.0.1:8000/scifact.zip" '
            f'--sha256 {"a" * 64}') in out, out


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_torch_comes_from_the_cpu_index_only_where_pip_has_no_source_of_its_own(tmp_path):
    clone = _clone_without_shared(tmp_path)  # no .venv: pip's configuration is not read
    out = _dry_run(clone, "install")
    if shutil.which("nvidia-smi") is None:
        assert '--index-url "https://download.pytorch.org/whl/cpu"' in out, out
        assert 'from pip\'s configured index"; .venv/bin/python -m pip install --quiet "torch==' in out
    assert '--index-url "https://mirror.example/whl"' in _dry_run(
        clone, "install", "TORCH_INDEX=https://mirror.example/whl")
    assert 'if [ -n "" ]' in _dry_run(clone, "install", "TORCH_INDEX=")


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_bench_writes_to_a_scratch_folder(tmp_path):
    out = _dry_run(_clone_without_shared(tmp_path), "bench")
    assert "a quick check" in out and "BIGBATCH_RESULTS=runs/bench-quick/results" in out, out
    assert "bench/report.py --results runs/bench-quick/results --docs runs/bench-quick" in out
