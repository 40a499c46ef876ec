"""A ``bigbatch train`` imports only what the run uses: a short run without ``--deepspeed``,
``--report-to wandb``, mining, page images or JAX imports none of DeepSpeed, W&B, faiss,
Pillow (beyond what transformers and matplotlib import by themselves) or JAX. Each is
checked in a fresh process, where ``sys.modules`` says what was imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import scifact_slice, tiny_bert

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("deepspeed", "wandb", "faiss", "PIL", "jax", "flax", "optax")

PROBE = """
import json, sys
from bigbatch.cli import main
code = main(sys.argv[1:])
print("IMPORTED " + json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
sys.exit(code)
"""


def imported(*argv: str) -> set[str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY), *argv], env=env,
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(l for l in run.stdout.splitlines() if l.startswith("IMPORTED "))
    return set(json.loads(line.removeprefix("IMPORTED ")))


def baseline() -> set[str]:
    """What transformers and matplotlib (the training curves) import by themselves."""
    code = ("import json, sys, transformers.utils, matplotlib.pyplot; "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_a_plain_run_imports_no_optional_library(tmp_path):
    """Full fine-tuning as ``make demo`` runs it: evaluation, a checkpoint, ``final/``."""
    tiny = tiny_bert(tmp_path / "tiny")
    data = scifact_slice(tmp_path / "sf", n_train=16, n_test=4, n_extra_docs=10)
    got = imported("train", "--model", str(tiny), "--train-data", str(data), "--eval-data",
                   str(data), "--output-dir", str(tmp_path / "out"), "--batch-size", "4",
                   "--grad-cache-chunk", "2", "--max-steps", "2", "--eval-steps", "0",
                   "--save-steps", "1", "--max-length", "16", "--lora-r", "0")
    assert (tmp_path / "out" / "final").is_dir()
    unexpected = got - baseline()
    assert not unexpected, f"bigbatch train imported {sorted(unexpected)}, which the run does not use"
    assert not got & {"deepspeed", "wandb", "faiss", "jax", "flax", "optax"}, got


def test_the_check_sees_an_import(tmp_path):
    """The probe reports a library that a command does import (``bigbatch --help`` imports
    none, so a module is imported by hand through the command's own interpreter)."""
    code = PROBE.replace("code = main(sys.argv[1:])", "import faiss; code = 0")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    pytest.importorskip("faiss")
    out = subprocess.run([sys.executable, "-c", code.format(heavy=HEAVY)], env=env,
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert '"faiss"' in out
