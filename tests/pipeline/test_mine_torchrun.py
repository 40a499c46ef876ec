"""``bigbatch mine`` under ``torchrun --nproc_per_node=2`` (gloo): each process embeds its
share of the corpus and the queries, and the records the main process writes are those one
process mines (slow: two torchrun launches)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pipeline_helpers import scifact_slice, tiny_bert


@pytest.mark.slow
def test_two_processes_mine_what_one_process_mines(tmp_path):
    tiny, data = tiny_bert(tmp_path / "tiny"), scifact_slice(tmp_path / "sf")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", BIGBATCH_NO_PROGRESS="1")
    args = ["mine", "--model", str(tiny), "--data", str(data), "--num-negatives", "3",
            "--min-negatives", "1", "--batch-size", "16", "--max-score-ratio", "0"]
    launches = {"one": [sys.executable, "-m", "bigbatch.cli"],
                "two": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", "-m", "bigbatch.cli"]}
    for name, prefix in launches.items():
        p = subprocess.run(prefix + args + ["--output", str(tmp_path / f"{name}.jsonl")],
                           capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
        if name == "two":
            assert p.stdout.count("wrote ") == 1  # the main process alone writes and reports
    one, two = ((tmp_path / f"{n}.jsonl").read_text() for n in launches)
    assert one and one == two
    assert not [f for f in tmp_path.iterdir() if ".tmp-" in f.name]
