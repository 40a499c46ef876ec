"""Vision-language cases run inside 2 gloo ranks (spawned by tests/vision/test_vl_distributed.py):
text-query chunks skip the vision tower, image-document chunks use it, ranks hold images of
different sizes, and every rank compares its gradient with the single-process float64
reference on the global batch (each rank's chunks under that rank's seed, so the dropout
masks are the ones the ranks drew). The multi-vector cases (ColQwen-style towers, MaxSimInfoNCE)
gather token embeddings of different lengths from the two ranks."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import DT, grads_of, max_rel_err  # noqa: E402
from multivector_helpers import padded_cat  # noqa: E402

import bigbatch as bb  # noqa: E402
from bigbatch.data.records.image_checks import ImageDoc  # noqa: E402
from bigbatch.encoders.vision import VisionLanguageEncoder  # noqa: E402
from bigbatch.encoders.vision_multivector import MultiVectorVisionEncoder  # noqa: E402

CHUNK = 2
QUERIES = [["claim one about cells", "protein folding", "a third query", "ribosomes"],
           ["heat shock response", "the fourth claim", "gene expression in yeast", "x"]]


def zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _docs(pages, rank, k):
    # rank 0: the first pages, rank 1: the others (different sizes); one text document each
    pool = pages[:4] if rank == 0 else pages[4:]
    docs = [ImageDoc(pool[i % 4]) for i in range(4 * (1 + k))]
    docs[1 + k] = f"a text document on rank {rank}"
    return docs


def _chunks(items, size):
    return [items[i:i + size] for i in range(0, len(items), size)]


def _encoder(model_path, lora, multivector=False):
    torch.manual_seed(0)
    cls, extra = (MultiVectorVisionEncoder, {"dim": 16}) if multivector else \
        (VisionLanguageEncoder, {})
    enc = cls(model_path, max_num_visual_tokens=12, freeze_vision=bool(lora),
              lora_r=4 if lora else 0, lora_alpha=8, **extra)
    enc = enc.to(DT).train()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in enc.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    return enc


def run_standard(model_path, pages, *, k=1, lora=False, multivector=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    enc = _encoder(model_path, lora, multivector)
    loss_fn = (bb.MaxSimInfoNCE(temperature=0.1, symmetric=True, normalize_query=True,
                                block_size=3) if multivector else
               bb.InfoNCE(temperature=0.1, symmetric=True)).to(DT)
    cat = padded_cat if multivector else torch.cat
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=CHUNK,
                         collate_fn=enc.collate_fns())
    zero(enc, loss_fn)
    torch.manual_seed(100 + rank)
    result = cache.step(query=QUERIES[rank], doc=_docs(pages, rank, k))
    got = grads_of(enc, loss_fn)
    flat = torch.cat([got[key].reshape(-1) for key in sorted(got)])
    parts = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(parts, flat)
    diff = max((p - parts[0]).abs().max().item() for p in parts)

    zero(enc, loss_fn)
    ref_q, ref_d = [], []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [enc(**enc.collate(c, "query")) for c in _chunks(QUERIES[r], CHUNK)]
        ref_d += [enc(**enc.collate(c, "doc")) for c in _chunks(_docs(pages, r, k), CHUNK)]
    ref_loss, _ = loss_fn(cat(ref_q), cat(ref_d))
    ref_loss.backward()
    ref = grads_of(enc, loss_fn)
    vision = sum(1 for key in ref if ".visual." in key)
    return {"rel_err": max_rel_err(got, ref), "cross_rank_diff": diff,
            "loss_err": abs(result.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "sync_calls": cache.last_sync_calls, "vision_grads": vision}


def run_query_side(model_path, pages, *, negatives, backward):
    """Query-side tuning: documents by the frozen base tower (LoRA disabled)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    enc = _encoder(model_path, lora=True)
    enc.use_base_doc_tower()
    q_chunk = 4 if backward == "direct" else CHUNK
    if negatives == "corpus":
        corpus_docs = _docs(pages, 0, 0) + _docs(pages, 1, 0)
        corpus = enc.encode(corpus_docs, "doc", batch_size=3)
        loss_fn = bb.losses.CorpusInfoNCE(corpus.to(DT), temperature=0.1).to(DT)
        targets = [[0, 1, 2, 3], [4, 5, 6, 7]]
        cache = bb.GradCache({"query": enc}, loss_fn, chunk_size=q_chunk,
                             collate_fn={"query": enc.collate_query}, cross_device=False)
        zero(enc, loss_fn)
        torch.manual_seed(100 + rank)
        result = cache.step(query=QUERIES[rank], positive_index=torch.tensor(targets[rank]))
    else:
        loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
        cache = bb.GradCache({"query": enc, "doc": enc.frozen_doc_tower()}, loss_fn,
                             chunk_size={"query": q_chunk, "doc": CHUNK},
                             collate_fn=enc.collate_fns())
        zero(enc, loss_fn)
        torch.manual_seed(100 + rank)
        result = cache.step(query=QUERIES[rank], doc=_docs(pages, rank, 1))
    got = grads_of(enc, loss_fn)

    zero(enc, loss_fn)
    ref_q = []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [enc(**enc.collate(c, "query")) for c in _chunks(QUERIES[r], q_chunk)]
    q = torch.cat(ref_q)
    if negatives == "corpus":
        losses = [loss_fn(part, torch.tensor(t))[0] for part, t in zip(q.split(4), targets)]
        (sum(losses) / world).backward()
        ref_loss = losses[rank].detach()
    else:
        d = torch.cat([enc.embed_doc_frozen(**enc.collate(c, "doc"))
                       for r in range(world) for c in _chunks(_docs(pages, r, 1), CHUNK)])
        ref_loss, _ = loss_fn(q, d)
        ref_loss.backward()
    ref = grads_of(enc, loss_fn)
    base = [n for n, p in enc.named_parameters() if "lora" not in n and p.grad is not None]
    return {"rel_err": max_rel_err(got, ref),
            "loss_err": abs(result.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "frozen_with_grad": len(base), "n_grads": len(got)}


CASES = {
    "standard_full_k1": lambda m, p: run_standard(m, p, k=1, lora=False),
    "standard_lora_k0": lambda m, p: run_standard(m, p, k=0, lora=True),
    "multivector_full_k1": lambda m, p: run_standard(m, p, k=1, lora=False, multivector=True),
    "multivector_lora_k0": lambda m, p: run_standard(m, p, k=0, lora=True, multivector=True),
    "qst_batch_gradcache": lambda m, p: run_query_side(m, p, negatives="batch",
                                                       backward="gradcache"),
    "qst_batch_direct": lambda m, p: run_query_side(m, p, negatives="batch", backward="direct"),
    "qst_corpus_gradcache": lambda m, p: run_query_side(m, p, negatives="corpus",
                                                        backward="gradcache"),
}


def worker(rank, world, port, out_path, model_path, pages):
    run_cases(rank, world, port, out_path,
              {name: (lambda c=case: c(model_path, pages)) for name, case in CASES.items()},
              timeout_s=120)
