"""Late-interaction cases run inside 2 gloo ranks (spawned by test_multivector_distributed.py):
towers returning TokenEmbeddings, MaxSimInfoNCE across ranks. Each rank computes the
single-process float64 reference on the concatenated global batch, with the same dropout
masks the ranks drew; the ranks' token counts differ, so the gather pads and strips."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import DT, grads_of, max_rel_err, token_batch  # noqa: E402
from multivector_helpers import TokenVectors, naive_maxsim_loss, padded_cat, run_chunked  # noqa: E402

import bigbatch as bb  # noqa: E402

CHUNK = 3


def local_batches(sizes, k, seed=11):
    """Per rank (queries, docs), the same on every rank; rank 1's longest rows are longer
    (queries of up to 5 tokens on rank 0, 8 to 11 on rank 1; documents up to 8 and 13 to
    16), so the ranks' token counts differ."""
    gen = torch.Generator().manual_seed(seed)
    return [(token_batch(b, max_len=5 + 6 * r, gen=gen),
             token_batch(b * (1 + k), max_len=8 + 8 * r, gen=gen)) for r, b in enumerate(sizes)]


def zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def run_case(*, k=1, sizes=(4, 4), shared=False, symmetric=False, ids=False, block_size=None,
             normalize=False, learnable=True, generic=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    q_tower = TokenVectors(p=0.1).to(DT)
    d_tower = q_tower if shared else TokenVectors(p=0.1).to(DT)
    modules = [q_tower] if shared else [q_tower, d_tower]
    loss_fn = bb.MaxSimInfoNCE(temperature=0.1, learnable_temperature=learnable,
                               symmetric=symmetric, normalize_query=normalize,
                               block_size=block_size).to(DT)
    if generic:  # a user's late-interaction loss without the cross-device protocol
        def loss_used(query, doc):
            return naive_maxsim_loss(loss_fn, query, doc)
        loss_used.token_inputs = ("query", "doc")
    else:
        loss_used = loss_fn
    batches = local_batches(sizes, k)
    doc_ids = None
    if ids:  # duplicates within and across ranks
        doc_ids = [[f"d{i}" for i in range(sum(sizes[:r]) * (1 + k), sum(sizes[:r + 1]) * (1 + k))]
                   for r in range(world)]
        doc_ids[1][0] = doc_ids[0][0]
        doc_ids[0][-1] = doc_ids[1][-1]
    cache = bb.GradCache({"query": q_tower, "doc": d_tower}, loss_used, chunk_size=CHUNK)
    zero(*modules, loss_fn)
    torch.manual_seed(100 + rank)
    kwargs = {"doc_ids": doc_ids[rank]} if ids else {}
    result = cache.step(query=batches[rank][0], doc=batches[rank][1], **kwargs)
    got = grads_of(*modules, loss_fn)
    flat = torch.cat([got[key].reshape(-1) for key in sorted(got)])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    diff = max((p - parts[0]).abs().max().item() for p in parts)

    zero(*modules, loss_fn)
    ref_q, ref_d = [], []
    for r in range(world):  # each rank's chunks in rank order, under each rank's seed
        torch.manual_seed(100 + r)
        ref_q.append(run_chunked(q_tower, batches[r][0], CHUNK))
        ref_d.append(run_chunked(d_tower, batches[r][1], CHUNK))
    ref_loss = naive_maxsim_loss(loss_fn, padded_cat(ref_q), padded_cat(ref_d),
                                 sum(doc_ids, []) if ids else None)
    ref_loss.backward()
    ref = grads_of(*modules, loss_fn)
    widths = [(q.values.shape[1], d.values.shape[1]) for q, d in zip(ref_q, ref_d)]
    return {"rel_err": max_rel_err(got, ref), "cross_rank_diff": diff,
            "loss_err": abs(result.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "sync_calls": cache.last_sync_calls, "widths": widths,
            "metrics": {name: v.item() for name, v in result.metrics.items()}}


def case_all_masked_row_on_one_rank():
    """Rank 1 has a document whose every token is masked: every rank raises, no gradient."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    tower = TokenVectors().to(DT)
    loss_fn = bb.MaxSimInfoNCE().to(DT)
    q, d = local_batches((3, 3), 0)[rank]
    if rank == 1:
        d["attention_mask"][2] = 0
    try:
        bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2).step(query=q, doc=d)
        raised, message = None, ""
    except bb.BigBatchError as e:
        raised, message = type(e).__name__, str(e)
    params = [*tower.parameters(), *loss_fn.parameters()]
    return {"raised": raised, "message": message,
            "grads_written": any(p.grad is not None for p in params)}


CASES = {
    "ragged_k1_symmetric_ids": lambda: run_case(k=1, sizes=(5, 2), symmetric=True, ids=True),
    "k0_shared_streamed": lambda: run_case(k=0, sizes=(4, 3), shared=True, block_size=(2, 3)),
    "k2_normalised_fixed_temperature": lambda: run_case(k=2, sizes=(3, 4), normalize=True,
                                                        learnable=False),
    "generic_loss_k1": lambda: run_case(k=1, sizes=(4, 2), generic=True, learnable=False),
    "all_masked_row_one_rank": case_all_masked_row_on_one_rank,
}


def worker(rank, world, port, out_path):
    run_cases(rank, world, port, out_path, CASES)
