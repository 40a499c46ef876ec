"""The negative queue across 2 gloo ranks (spawned by test_negative_queue_distributed.py):
three cached steps with SGD between them, the queue fed by ``bigbatch train``'s
:class:`~bigbatch.train.negative_queue.RunQueue` (the global batch's documents, their ids
gathered from every rank), each step's gradient against the single-process float64 reference
on the concatenated global batch with the reference's own queue, dropout on."""

from __future__ import annotations

import copy
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from dist_cases import CHUNK, cross_rank_diff, global_batch, zero  # noqa: E402
from dist_helpers import run_cases  # noqa: E402
from helpers import DT, TokenTower, grads_of, max_rel_err, trimmed_chunks  # noqa: E402
from objectives_helpers import queue_objective  # noqa: E402

import bigbatch as bb  # noqa: E402
from bigbatch.engine import distributed as D  # noqa: E402
from bigbatch.train.negative_queue import RunQueue  # noqa: E402


def texts_and_ids(steps, sizes, k):
    """Per step and rank: query texts and document ids. Step 1's first query on rank 0 is
    step 0's second query of rank 1 (its positive there is queued: masked by query), and
    step 2's first positive on rank 1 has the id of step 1's third positive on rank 0
    (masked by id)."""
    g = k + 1
    out = [[([f"query {s}-{r}-{i}" for i in range(b)],
             [f"doc {s}-{r}-{j}" for j in range(b * g)]) for r, b in enumerate(sizes)]
           for s in range(steps)]
    out[1][0][0][0] = out[0][1][0][1]
    out[2][1][1][0] = out[1][0][1][2 * g]
    return out


def queue_case(*, k=2, sizes=(3, 4), steps=3, symmetric=False, block_size=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tower = TokenTower(p=0.1).to(DT)
    ref_tower = copy.deepcopy(tower)
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=symmetric, block_size=block_size).to(DT)
    ref_loss_fn = copy.deepcopy(loss_fn)
    opt = torch.optim.SGD(list(tower.parameters()) + list(loss_fn.parameters()), lr=0.5)
    ref_opt = torch.optim.SGD(list(ref_tower.parameters()) + list(ref_loss_fn.parameters()),
                              lr=0.5)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=CHUNK,
                         keep_embeddings=("doc",))
    queue = RunQueue(2, D.world_info(), torch.device("cpu"))
    ref_queue = []
    names = texts_and_ids(steps, sizes, k)
    out = {"rel_err": 0.0, "loss_err": 0.0, "cross_rank_diff": 0.0, "masked": [],
           "ref_queue_diff": 0.0}
    for s in range(steps):
        batches = global_batch(sizes, k, seed=11 + s)
        texts, ids = names[s][rank]
        batch = SimpleNamespace(queries=texts, docs=ids, doc_ids=ids)  # docs: only counted
        zero(tower, loss_fn)
        torch.manual_seed(100 + rank)
        res = cache.step(query=batches[rank][0], doc=batches[rank][1], doc_ids=ids,
                         **queue.arguments(batch))
        queue.push(res, batch)
        got = grads_of(tower, loss_fn)
        diff, _ = cross_rank_diff([tower, loss_fn])

        zero(ref_tower, ref_loss_fn)
        ref_q, ref_d = [], []
        for r in range(world):
            torch.manual_seed(100 + r)
            ref_q += [ref_tower(**c) for c in trimmed_chunks(batches[r][0], CHUNK)]
            ref_d += [ref_tower(**c) for c in trimmed_chunks(batches[r][1], CHUNK)]
        rq, rd = torch.cat(ref_q), torch.cat(ref_d)
        all_texts = [t for r in range(world) for t in names[s][r][0]]
        all_ids = [i for r in range(world) for i in names[s][r][1]]
        owners = [all_texts[j // (k + 1)] if j % (k + 1) == 0 else None
                  for j in range(len(all_ids))]
        kept = ref_queue[-2:]
        emb = torch.cat([e for e, _, _ in kept]) if kept else rd.new_zeros(0, rd.shape[1])
        ref = queue_objective(rq, rd, (emb, [i for _, x, _ in kept for i in x],
                                       [o for _, _, x in kept for o in x]),
                              ref_loss_fn.logit_scale(), k, all_ids, all_texts, symmetric)
        ref.backward()
        ref_queue.append((rd.detach(), all_ids, owners))
        out["rel_err"] = max(out["rel_err"], max_rel_err(got, grads_of(ref_tower, ref_loss_fn)))
        out["loss_err"] = max(out["loss_err"], abs(res.loss.item() - ref.item()) / ref.item())
        out["cross_rank_diff"] = max(out["cross_rank_diff"], diff)
        out["masked"].append(res.metrics["masked"].item())
        queued = queue.queue.queued()  # every rank's queue: the reference's documents
        want = torch.cat([e for e, _, _ in ref_queue[-2:]])
        out["ref_queue_diff"] = max(out["ref_queue_diff"],
                                    (queued.doc - want).abs().max().item())
        out["same_ids"] = queued.ids == [i for _, x, _ in ref_queue[-2:] for i in x]
        opt.step()
        ref_opt.step()
    return out


CASES = {
    "k2_blocks": lambda: queue_case(),
    "k1_symmetric_dense": lambda: queue_case(k=1, symmetric=True, block_size=0),
}


def worker(rank, world, port, out_path):
    run_cases(rank, world, port, out_path, CASES)
