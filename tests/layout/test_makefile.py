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
