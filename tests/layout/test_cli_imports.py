"""``bigbatch --help`` and each subcommand's ``--help`` print without importing torch (or the
model libraries): the command line's parser is built from light modules only, and the heavy
ones are imported by the command that runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "peft")

PROBE = """
import json, sys
from bigbatch.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["eval", "--help"],
                                  ["mine", "--help"], ["convert", "--help"]])
def test_help_imports_no_torch(argv):
    out = _run("-c", PROBE, *argv)
    assert out.returncode == 0, out.stderr[-2000:]
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said == {"code": 0, "heavy": []}, said
    assert "usage: bigbatch" in out.stdout


def test_python_dash_m_runs_the_command():
    """``python -m bigbatch.cli`` (as ``torchrun -m bigbatch.cli train`` runs it)."""
    out = _run("-m", "bigbatch.cli", "train", "--help")
    assert out.returncode == 0 and "model options:" in out.stdout, out.stderr[-2000:]
    out = _run("-m", "bigbatch.cli", "validate", str(ROOT / "no-such-file.jsonl"))
    assert out.returncode != 0 and "no-such-file.jsonl" in out.stdout + out.stderr
