"""CachedInfoNCELoss inside SentenceTransformerTrainer under torchrun, 2 processes (gloo):
after one step each rank holds the gradient of MultipleNegativesRankingLoss on the global
batch (both ranks' rows, every query against every document), float64 with dropout on (the
reference replays each rank's random state); and one gradient
all-reduce per step, counted beside sentence-transformers' CachedMultipleNegativesRankingLoss
at the same batch and mini-batch size (tests/integrations/st_ddp_script.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers")

from pipeline_helpers import tiny_bert
from st_ddp_script import B_LOCAL, CHUNK, make_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("st_ddp_script.py")


def test_two_ranks_in_the_trainer_equal_the_global_batch(tmp_path):
    from sentence_transformers.base.losses.gradcache import _create_minibatch
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    bert = tiny_bert(tmp_path / "bert", dropout=0.1)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node=2", str(SCRIPT), "--out", str(tmp_path),
                           "--model", str(bert)],
                          capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    print(proc.stdout[-500:])

    # the reference: one process, the two ranks' batches as one, MNRL with a tensor scale;
    # each rank's chunks embedded in the order the step embeds them, from the random state
    # the rank had, so that dropout draws the same masks
    model = make_model(str(bert), torch.float64).train()
    per_rank = []
    for r in range(2):
        saved = torch.load(tmp_path / f"exact_batch_rank{r}.pt")
        torch.set_rng_state(saved["rng"])
        per_rank.append([torch.cat([model(_create_minibatch(f, lo, lo + CHUNK))["sentence_embedding"]
                                    for lo in range(0, B_LOCAL, CHUNK)])
                         for f in saved["features"]])
    columns = [torch.cat([per_rank[r][c] for r in range(2)]) for c in range(3)]
    scale = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    loss = MultipleNegativesRankingLoss(model, scale=scale).compute_loss_from_embeddings(
        columns, None)
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    ref["loss.log_scale"] = 20.0 * scale.grad
    top = max(g.abs().max().item() for g in ref.values())
    for r in range(2):
        got = torch.load(tmp_path / f"exact_grads_rank{r}.pt")
        assert sorted(got) == sorted(ref)
        worst = max((got[n] - ref[n]).abs().max().item() for n in ref) / top
        assert worst <= 1e-10, (r, worst)

    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts["bigbatch"]["ddp_buckets"] == []  # DDP never synchronised on its own
    assert counts["bigbatch"]["gradient_all_reduces"] == 1
    assert counts["exact_run"]["gradient_all_reduces"] == 1
    assert counts["sentence_transformers"]["gradient_all_reduces"] >= 1
