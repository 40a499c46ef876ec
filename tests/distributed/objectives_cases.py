"""Objective cases run inside 2 gloo ranks (spawned by test_objectives_distributed.py):
Matryoshka, extra in-batch negatives (qq, dd) and token-budget chunks across ranks. Each
rank computes the single-process float64 reference on the concatenated global batch, every
rank's chunks (as the engine cut them) run in rank order under that rank's seed, so the
dropout masks are those the ranks drew."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import DT, TokenTower, grads_of, max_rel_err, token_batch  # noqa: E402
from multivector_helpers import TokenVectors, naive_maxsim_loss, padded_cat  # noqa: E402
from objectives_helpers import cut, engine_chunks, run_chunks, separate_losses  # noqa: E402

import bigbatch as bb  # noqa: E402

CHUNK = 3


def local_batches(sizes, k, seed=11):
    """Per rank (queries, docs) of mixed lengths, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [(token_batch(b, max_len=10, gen=gen), token_batch(b * (1 + k), max_len=12, gen=gen))
            for b in sizes]


def zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def run_case(make_loss, ref_loss, *, k=1, sizes=(4, 3), multivector=False, chunk_tokens=None,
             sort=False, ids=False):
    """``make_loss()`` -> (the loss given to the engine, the module holding its parameters);
    ``ref_loss(loss, query, doc, doc_ids)`` -> the reference loss on the global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tower = (TokenVectors(p=0.1) if multivector else TokenTower(p=0.1)).to(DT).train()
    loss_fn, params = make_loss()
    batches = local_batches(sizes, k)
    doc_ids = None
    if ids:  # duplicates within and across ranks
        doc_ids = [list(range(sum(sizes[:r]) * (1 + k), sum(sizes[:r + 1]) * (1 + k)))
                   for r in range(world)]
        doc_ids[1][0] = doc_ids[0][0]
        doc_ids[0][-1] = doc_ids[1][-1]
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=CHUNK,
                         chunk_tokens=chunk_tokens, sort_by_length=sort)
    zero(tower, params)
    torch.manual_seed(100 + rank)
    kwargs = {"doc_ids": doc_ids[rank]} if ids else {}
    result = cache.step(query=batches[rank][0], doc=batches[rank][1], **kwargs)
    got = grads_of(tower, params)
    flat = torch.cat([got[key].reshape(-1) for key in sorted(got)])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    diff = max((p - parts[0]).abs().max().item() for p in parts)

    zero(tower, params)
    ref_q, ref_d, n_chunks = [], [], []
    for r in range(world):  # each rank's chunks in rank order, under each rank's seed
        torch.manual_seed(100 + r)
        q_chunks, q_order = engine_chunks(batches[r][0], CHUNK, chunk_tokens, sort)
        d_chunks, d_order = engine_chunks(batches[r][1], CHUNK, chunk_tokens, sort)
        ref_q.append(run_chunks(tower, q_chunks, q_order))
        ref_d.append(run_chunks(tower, d_chunks, d_order))
        n_chunks.append((len(q_chunks), len(d_chunks)))
    cat = padded_cat if multivector else torch.cat
    ref = ref_loss(loss_fn, cat(ref_q), cat(ref_d), sum(doc_ids, []) if ids else None)
    ref.backward()
    want = grads_of(tower, params)
    return {"rel_err": max_rel_err(got, want), "cross_rank_diff": diff,
            "loss_err": abs(result.loss.item() - ref.item()) / abs(ref.item()),
            "sync_calls": cache.last_sync_calls, "chunks": n_chunks, "loss": result.loss.item(),
            "metrics": {name: v.item() for name, v in result.metrics.items()}}


DIMS, WEIGHTS = [8, 4, 2], [1.0, 0.5, 2.0]


def matryoshka_infonce():
    inner = bb.InfoNCE(temperature=0.1, symmetric=True, block_size=2).to(DT)
    return bb.Matryoshka(inner, dims=DIMS, weights=WEIGHTS), inner


def matryoshka_reference(loss_fn, q, d, ids):
    kwargs = {} if ids is None else {"doc_ids": ids}
    return separate_losses(loss_fn.loss, DIMS, WEIGHTS, q, d, **kwargs)


def extra_infonce():
    loss = bb.InfoNCE(temperature=0.1, extra_negatives=("qq", "dd"), block_size=2,
                      false_negative_margin=0.3, symmetric=True).to(DT)
    return loss, loss


def dense_reference(loss_fn, q, d, ids):
    """The same loss computed with all logits at once (its parameters shared)."""
    dense = bb.InfoNCE(temperature=0.1, extra_negatives=loss_fn.extra_negatives, dense=True,
                       symmetric=loss_fn.symmetric,
                       false_negative_margin=loss_fn.false_negative_margin).to(DT)
    dense.logit_scale = loss_fn.logit_scale
    return dense(query=q, doc=d, doc_ids=ids)[0]


def plain_infonce():
    loss = bb.InfoNCE(temperature=0.1, symmetric=True).to(DT)
    return loss, loss


def maxsim_matryoshka():
    inner = bb.MaxSimInfoNCE(temperature=0.1, normalize_query=True).to(DT)
    return bb.Matryoshka(inner, dims=[8, 3]), inner


def maxsim_matryoshka_reference(loss_fn, q, d, ids):
    return sum(naive_maxsim_loss(loss_fn.loss, cut(q, m), cut(d, m), ids) for m in (8, 3))


CASES = {
    "matryoshka_k1_ids": lambda: run_case(matryoshka_infonce, matryoshka_reference, ids=True),
    "extra_qq_dd_k2_ids_symmetric": lambda: run_case(extra_infonce, dense_reference, k=2, sizes=(3, 4),
                                           ids=True),
    "tokens_k2_symmetric_sorted": lambda: run_case(plain_infonce, dense_reference, k=2,
                                                   chunk_tokens=20, sort=True),
    "tokens_multivector_matryoshka": lambda: run_case(maxsim_matryoshka,
                                                      maxsim_matryoshka_reference,
                                                      multivector=True, chunk_tokens=24,
                                                      sort=True, ids=True),
}


def worker(rank, world, port, out_path):
    run_cases(rank, world, port, out_path, CASES)
