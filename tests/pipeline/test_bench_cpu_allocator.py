"""``bench/cpu_allocator.py`` runs end to end in its dry mode (a tiny BERT, 8 SciFact pairs):
each allocator setting in a process of its own, every plan timed with its page faults, and
the settings reach the process (glibc kept to its heap takes fewer faults than as it comes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pipeline_helpers import need_scifact

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_allocator_benchmark_runs_dry_and_writes_its_file(tmp_path):
    need_scifact()
    out = tmp_path / "cpu-allocator.json"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "cpu_allocator.py"), "--dry",
                        "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert list(r["rows"]) == ["default", "heap", "hugepages"]
    for row in r["rows"].values():
        assert sorted(row["steps"]) == ["2/2", "4/4"]
        for steps in row["steps"].values():
            assert len(steps) == 1 and steps[0]["wall_s"] > 0 and steps[0]["minor_faults"] >= 0
    faults = {s: r["rows"][s]["summary"]["4/4"]["median_minor_faults"] for s in r["rows"]}
    assert faults["heap"] < faults["default"], faults
    assert r["rows"]["heap"]["variables"]["MALLOC_MMAP_MAX_"] == "0"
    assert "heap" in p.stdout and f"wrote {out}" in p.stdout
