"""What one engine step adds to a process's peak memory, measured (peak resident memory of a
subprocess per configuration) against bigbatch.train.memory_estimate's estimate from the shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from bigbatch.train.memory_estimate import CPU_RNG_STATE_BYTES, estimate_step_memory

PROBE = Path(__file__).resolve().parent / "memory_probe.py"
BOUND = 2.0  # one step may add at most this multiple of (floor + one loss block + one chunk)


@cache
def measure(*args: str) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072",  # freed blocks go back at once
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[2] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(PROBE), *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    if "skipped" in out:
        pytest.skip(out["skipped"])
    return out


@pytest.mark.slow
def test_one_step_at_batch_4096_adds_at_most_twice_floor_block_and_chunk():
    """Cached embeddings, their gradients, random states, parameter gradients, one 1,024 x
    4,096 loss block and one chunk: 2x that bounds the step; the dense loss's B x N logits
    (64 MB a tensor) break the bound, so the test can tell them apart."""
    streamed = measure("4096", "--chunk", "32", "--dim", "64")
    assert streamed["loss_block"] == 16.0  # 1,024 rows x 4,096 columns x 4 bytes
    assert streamed["growth_mb"] <= BOUND * streamed["total"], streamed
    dense = measure("4096", "--chunk", "32", "--dim", "64", "--dense")
    assert dense["growth_mb"] > BOUND * streamed["total"], dense


@pytest.mark.parametrize("args", [("4096", "--chunk", "32", "--dim", "64"),
                                  ("2048", "--k", "1", "--chunk", "64", "--dim", "128",
                                   "--ids", "--sort")],
                         ids=["b4096-k0-chunk32-dim64", "b2048-k1-chunk64-dim128-ids-sorted"])
def test_estimate_is_within_2x_of_the_measured_growth(args):
    m = measure(*args)
    assert 0.5 <= m["total"] / m["growth_mb"] <= 2.0, m


def test_estimate_arithmetic():
    est = estimate_step_memory({"query": 1000, "doc": 3000}, 8, chunk_size=100,
                               chunk_activation_bytes=1234, parameter_bytes=4000, masked=True)
    assert est.embeddings == est.embedding_grads == 4000 * 8 * 4
    assert est.rng_states == (10 + 30 - 1) * CPU_RNG_STATE_BYTES  # the last chunk is kept
    assert est.loss_block == 1000 * 3000 * 5  # one block: every row fits in 2**22 logits
    assert est.total == est.floor + 1234 + est.loss_block
    assert est.floor == 2 * 4000 * 8 * 4 + est.rng_states + 4000
    small = estimate_step_memory({"query": 1000, "doc": 3000}, 8, chunk_size=100,
                                 chunk_activation_bytes=0, max_block_logits=30_000)
    assert small.loss_block == 10 * 3000 * 4
    dense = estimate_step_memory({"query": 1000, "doc": 3000}, 8, chunk_size=100,
                                 chunk_activation_bytes=0, dense=True)
    assert dense.loss_block == 4 * 1000 * 3000 * 4


def test_activation_bytes_counts_what_the_saved_tensors_span():
    import torch

    from bigbatch.train.memory_estimate import activation_bytes

    lin = torch.nn.Linear(16, 16)
    big = torch.randn(1000, 16)
    # linear saves its input (a 10-row view of a 1,000-row tensor: 640 bytes, not 64,000),
    # tanh saves its output (10 x 16 floats); the weight is a parameter, not counted
    assert activation_bytes(lambda: torch.tanh(lin(big[:10])), lin.parameters()) == 2 * 640
    x = torch.randn(10, 16, requires_grad=True)
    assert activation_bytes(lambda: (x * x).sum()) == 640  # one storage saved twice
