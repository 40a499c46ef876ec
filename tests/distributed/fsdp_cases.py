"""Cases run inside 2 spawned gloo ranks (float64) for test_fsdp.py: an encoder sharded by
``bigbatch.train.sharding`` trained 2 optimizer steps on each rank's half of the batch (the
GradCache step ``bigbatch train`` runs: both towers one encoder, AdamW, clipping), against
the same encoder unsharded on one process with the whole batch; the whole weights gathered
for saving; and evaluation split over the ranks against one process's."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

QUERIES = [f"query {i}: which cells divide {'fast ' * (i % 3)}?" for i in range(8)]
DOCS = [f"document {i} says that cells divide {'slowly ' * (i % 4)}in tissue" for i in range(8)]
STEPS = 2


def _encoder(path, lora, gc, pooling="mean"):
    from bigbatch.encoders import TextEncoder

    torch.manual_seed(0)
    enc = TextEncoder(path, pooling=pooling, max_length=32, lora_r=4 if lora else 0,
                      lora_alpha=8, gradient_checkpointing=gc, dtype=torch.float64)
    return enc.double().train()


def _train(enc, queries, docs, group, steps=STEPS):
    """``steps`` GradCache steps as ``bigbatch train`` runs them; returns the step losses
    and gradient norms."""
    import bigbatch as bb
    from bigbatch.train.sharding import clip_gradients

    loss_fn = bb.InfoNCE(temperature=0.1).double()
    params = enc.trainable_parameters()
    opt = torch.optim.AdamW([{"params": params, "weight_decay": 0.01},
                             {"params": list(loss_fn.parameters()), "weight_decay": 0.0}],
                            lr=1e-2)
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=3,
                         sort_by_length=True, process_group=group)
    out = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        r = cache.step(query=enc.tokenize(queries, "query"), doc=enc.tokenize(docs, "doc"))
        norm = clip_gradients(params + list(loss_fn.parameters()), 1.0)
        opt.step()
        loss_fn.clamp_()
        out.append([r.loss.item(), float(norm)])
    return out


def _solo_groups():
    """A group of one process per rank (made on every rank, in the same order): the
    reference runs there, outside the 2-rank world."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]


def _counting_reduce_scatters():
    calls = []
    orig = dist.reduce_scatter_single

    def counting(*a, **kw):
        calls.append(1)
        return orig(*a, **kw)

    dist.reduce_scatter_single = counting
    return calls, lambda: setattr(dist, "reduce_scatter_single", orig)


def steps_case(model_path, lora, gc, pooling="mean"):
    from bigbatch.engine.distributed import WorldInfo
    from bigbatch.train.sharding import shard_encoder, whole_on_main

    rank, world = dist.get_rank(), dist.get_world_size()
    solo = _solo_groups()
    enc = _encoder(model_path, lora, gc, pooling)
    ref = copy.deepcopy(enc)
    units = shard_encoder(enc, torch.device("cpu"))
    half = len(QUERIES) // world
    calls, restore = _counting_reduce_scatters()
    try:
        got = _train(enc, QUERIES[rank * half:(rank + 1) * half],
                     DOCS[rank * half:(rank + 1) * half], None)
    finally:
        restore()
    want = _train(ref, QUERIES, DOCS, solo)
    info = WorldInfo(rank, world, rank)
    res = {"losses": got, "reference": want, "reduce_scatters": len(calls), "units": units,
           "trainable": sum(p.requires_grad for p in enc.parameters())}
    frame = None
    with whole_on_main(enc, info) as whole:
        if whole is not None:
            frame = whole
            mine, theirs = whole.state_dict(), ref.state_dict()
            res.update(same_keys=sorted(mine) == sorted(theirs),
                       weight_diff=max((mine[k] - theirs[k]).abs().max().item() for k in theirs),
                       weight_scale=max(theirs[k].abs().max().item() for k in theirs),
                       buffers_meta=any(b.is_meta for b in whole.buffers()))
    if frame is not None:  # the host copy is dropped on leaving
        res["whole_dropped"] = all(p.is_meta for p in frame.parameters())
    return res


def eval_case(model_path, beir_dir):
    """A sharded encoder evaluated on both ranks (each its share of the texts) against the
    unsharded one on one process."""
    from bigbatch.data.mix import SourceSpec
    from bigbatch.retrieval.distributed_eval import split_over_ranks
    from bigbatch.retrieval.evaluate import evaluate_sets
    from bigbatch.train.sharding import shard_encoder

    enc = _encoder(model_path, lora=False, gc=False)
    ref = copy.deepcopy(enc)
    shard_encoder(enc, torch.device("cpu"))
    sets = [SourceSpec(str(beir_dir), "sf")]
    got = evaluate_sets(split_over_ranks(enc), sets, batch_size=7, progress=False)
    want = evaluate_sets(ref, sets, batch_size=7, progress=False)
    return {"got": got, "want": want}


def worker(rank, world, port, out_path, paths):
    from dist_helpers import run_cases

    paths = json.loads(paths)
    cases = {f"steps_{name}": (lambda a=args: steps_case(paths["bert"], *a))
             for name, args in {"full": (False, False), "lora": (True, False),
                                "lora_gc": (True, True)}.items()}
    # a decoder (Qwen3: rotary positions, grouped-query attention) pooled by its last
    # token, left padded, each text ending with the end-of-text token
    cases["steps_qwen3_lora_last"] = lambda: steps_case(paths["qwen3"], True, False, "last")
    cases["steps_qwen3_full_gc_last"] = lambda: steps_case(paths["qwen3"], False, True, "last")
    cases["eval"] = lambda: eval_case(paths["bert"], Path(paths["beir"]))
    run_cases(rank, world, port, out_path, cases, timeout_s=120)
