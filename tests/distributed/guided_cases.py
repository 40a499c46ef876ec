"""Guided filtering and distillation across 2 gloo ranks (spawned by
test_guided_distill_distributed.py): each case returns the cached step's error against the
single-process float64 reference on the concatenated global batch, with the dropout masks
the ranks drew."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from dist_cases import CHUNK, cross_rank_diff, global_batch, zero  # noqa: E402
from dist_helpers import run_cases  # noqa: E402
from helpers import DT, TokenTower, grads_of, max_rel_err, trimmed_chunks  # noqa: E402

import bigbatch as bb  # noqa: E402


def guided_case(*, k=2, sizes=(3, 4), symmetric=False, distill=None, guide=True, ids=False,
                block_size=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tower = TokenTower(p=0.1).to(DT)
    torch.manual_seed(3)
    guide_tower = TokenTower(out=5).to(DT).eval()  # another width than the model's 8
    for p in guide_tower.parameters():
        p.requires_grad_(False)
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=symmetric, block_size=block_size,
                         guide_margin=0.05, distill=distill, distill_weight=0.5,
                         teacher_temperature=0.2).to(DT)
    batches = global_batch(sizes, k)
    gen = torch.Generator().manual_seed(9)
    teachers = [torch.randn(b, 1 + k, generator=gen, dtype=DT) for b in sizes]
    with torch.no_grad():
        guides = [(guide_tower(**q), guide_tower(**d)) for q, d in batches]
    ids_all = [torch.arange(sum(sizes[:r]) * (1 + k), sum(sizes[:r + 1]) * (1 + k))
               for r in range(world)]
    ids_all[1][0] = ids_all[0][0]

    def kwargs_of(r):
        kw = {}
        if guide:
            kw.update(guide_query=guides[r][0], guide_doc=guides[r][1])
        if distill:
            kw["teacher_scores"] = teachers[r]
        if ids:
            kw["doc_ids"] = ids_all[r]
        return kw

    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=CHUNK)
    zero(tower, loss_fn)
    torch.manual_seed(100 + rank)
    res = cache.step(query=batches[rank][0], doc=batches[rank][1], **kwargs_of(rank))
    got = grads_of(tower, loss_fn)
    diff, _ = cross_rank_diff([tower, loss_fn])

    zero(tower, loss_fn)
    loss_fn.block_size, loss_fn.dense = None, True
    ref_q, ref_d = [], []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [tower(**c) for c in trimmed_chunks(batches[r][0], CHUNK)]
        ref_d += [tower(**c) for c in trimmed_chunks(batches[r][1], CHUNK)]
    every = [kwargs_of(r) for r in range(world)]
    ref_kwargs = {key: torch.cat([kw[key] for kw in every]) for key in every[0]}
    ref_loss, ref_metrics = loss_fn(query=torch.cat(ref_q), doc=torch.cat(ref_d), **ref_kwargs)
    ref_loss.backward()
    out = {"rel_err": max_rel_err(got, grads_of(tower, loss_fn)), "cross_rank_diff": diff,
           "loss_err": abs(res.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
           "guide_masked": res.metrics["guide_masked"].item() if guide else -1,
           "ref_guide_masked": ref_metrics["guide_masked"].item() if guide else -1,
           "masked": res.metrics["masked"].item(), "ref_masked": ref_metrics["masked"].item()}
    if distill:
        out["distill_err"] = abs(res.metrics["distill"].item() - ref_metrics["distill"].item())
    return out


def bad_teacher_case():
    """Rank 1's teacher scores have one column too few: every rank raises, no gradient."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    tower = TokenTower(p=0.1).to(DT)
    loss_fn = bb.InfoNCE(distill="margin-mse").to(DT)
    batches = global_batch((3, 3), 2)
    scores = torch.zeros(3, 3 if rank == 0 else 2, dtype=DT)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=CHUNK)
    try:
        cache.step(query=batches[rank][0], doc=batches[rank][1], teacher_scores=scores)
    except bb.BigBatchError as e:
        return {"error_class": type(e).__name__, "message": str(e),
                "no_grad": all(p.grad is None for p in tower.parameters())}
    return {"error_class": None}


CASES = {
    "guided_k2": lambda: guided_case(),
    "guided_k3_symmetric_ids": lambda: guided_case(k=3, symmetric=True, ids=True),
    "kl_k2": lambda: guided_case(distill="kl", guide=False),
    "margin_mse_k1_symmetric": lambda: guided_case(k=1, distill="margin-mse", guide=False,
                                                   symmetric=True),
    "guided_kl_k2_auto_blocks": lambda: guided_case(distill="kl", block_size=None),
    "bad_teacher_one_rank": bad_teacher_case,
}


def worker(rank, world, port, out_path, names):
    run_cases(rank, world, port, out_path, {n: CASES[n] for n in names})
