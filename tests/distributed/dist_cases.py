"""Cases run inside 2 gloo ranks (spawned by test_distributed.py); each returns numbers that
the pytest side asserts on. Every case computes, on each rank, the single-process float64
reference on the concatenated global batch, with the same dropout masks the ranks drew."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import DT, TokenTower, grads_of, max_rel_err, token_batch, trimmed_chunks  # noqa: E402

import bigbatch as bb  # noqa: E402
from bigbatch.engine import distributed as D  # noqa: E402

CHUNK = 3


def global_batch(sizes, k, seed=11):
    """Per-rank (queries, docs) for local query counts ``sizes``; the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [(token_batch(b, gen=gen), token_batch(b * (1 + k), gen=gen)) for b in sizes]


class TwoPath(nn.Module):
    """A shared trunk with a text path (queries) and an 'image' path (documents): the towers
    use different parameter subsets, as a vision-language model's text and image calls do."""

    def __init__(self):
        super().__init__()
        self.text = TokenTower(p=0.1)
        self.vision = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 8))

    def forward(self, input_ids, attention_mask, kind):
        y = self.text(input_ids, attention_mask)
        if kind == "image":
            y = nn.functional.normalize(self.vision(y), dim=-1)
        return y


def flat_grads(modules):
    g = grads_of(*modules)
    return torch.cat([g[k].reshape(-1) for k in sorted(g)]), sorted(g)


def cross_rank_diff(modules):
    flat, keys = flat_grads(modules)
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, flat)
    return max((p - parts[0]).abs().max().item() for p in parts), len(keys)


def zero(*modules):
    for m in modules:
        for p in m.parameters():
            p.grad = None


def run_engine_case(*, k=0, sizes=(4, 4), symmetric=False, learnable=True, shared=True,
                    ddp=False, subsets=False, ids=False, generic_loss=False, cross_device=True,
                    fsdp=False, block_size=None, max_block_logits=None):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if subsets:
        model = TwoPath().to(DT)
        q_model = d_model = model
        extra = ({"kind": "text"}, {"kind": "image"})
    else:
        q_model = TokenTower(p=0.1).to(DT)
        d_model = q_model if shared else TokenTower(p=0.1).to(DT)
        extra = ({}, {})
    modules = [q_model] if q_model is d_model else [q_model, d_model]
    blocks = {} if max_block_logits is None else {"max_block_logits": max_block_logits}
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=learnable, symmetric=symmetric,
                         block_size=block_size, **blocks).to(DT)

    if generic_loss:
        def loss_used(query, doc):  # a user's loss without the cross-device protocol
            logits = query @ doc.T / 0.1
            labels = torch.arange(query.shape[0]) * (doc.shape[0] // query.shape[0])
            return nn.functional.cross_entropy(logits, labels)
    else:
        loss_used = loss_fn

    batches = global_batch(sizes, k)
    doc_ids = None
    if ids:  # duplicates within and across ranks
        all_ids = [torch.arange(sum(sizes[:r]) * (1 + k), sum(sizes[:r + 1]) * (1 + k))
                   for r in range(world)]
        all_ids[1][0] = all_ids[0][0]        # rank 1's first positive = rank 0's first positive
        all_ids[0][-1] = all_ids[1][-1]      # and a rank-0 document equal to a rank-1 one
        doc_ids = all_ids

    towers_mod = {"query": q_model, "doc": d_model}
    if ddp:
        wrapped = {id(m): nn.parallel.DistributedDataParallel(m) for m in modules}
        towers = {n: wrapped[id(m)] for n, m in towers_mod.items()}
        hook_calls = []
        for w in wrapped.values():
            def hook(state, bucket):
                hook_calls.append(1)
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
                return fut
            w.register_comm_hook(None, hook)
    elif fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        n_fsdp = 0  # FSDP modules that own parameters directly (each reduce-scatters once)
        for m in modules:
            units = ([m.text.mlp, m.text, m.vision] if subsets else [m.mlp]) + [m]
            claimed: set[int] = set()
            for unit in units:  # count before sharding: fully_shard replaces the parameters
                own = {id(p) for p in unit.parameters()} - claimed
                n_fsdp += bool(own)
                claimed |= own
            for unit in units:
                fully_shard(unit, mesh=mesh)
        towers = towers_mod
        rs_calls = []
        orig_rs = dist.reduce_scatter_single

        def counting_rs(*a, **kw):
            rs_calls.append(1)
            return orig_rs(*a, **kw)

        dist.reduce_scatter_single = counting_rs
    else:
        towers = towers_mod

    q_in = dict(batches[rank][0], **extra[0])
    d_in = dict(batches[rank][1], **extra[1])
    kwargs = {"doc_ids": doc_ids[rank]} if ids else {}
    cache = bb.GradCache(towers, loss_used, chunk_size=CHUNK, cross_device=cross_device)
    zero(*modules, loss_fn)
    torch.manual_seed(100 + rank)
    result = cache.step(query=q_in, doc=d_in, **kwargs)
    if fsdp:
        dist.reduce_scatter_single = orig_rs
        got = {}
        for i, m in enumerate(modules):
            for name, p in m.named_parameters():
                if p.grad is not None:
                    got[f"{i}.{name}"] = p.grad.full_tensor().detach().clone()
        for name, p in loss_fn.named_parameters():
            if p.grad is not None:
                got[f"{len(modules)}.{name}"] = p.grad.detach().clone()
        flat = torch.cat([got[key].reshape(-1) for key in sorted(got)])
        parts = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(parts, flat)
        diff = max((p - parts[0]).abs().max().item() for p in parts)
        for m in modules:  # the reference runs on plain parameters: unshard them
            m.unshard()
        ref_modules = None
    else:
        got = grads_of(*modules, loss_fn)
        diff, _ = cross_rank_diff(list(modules) + [loss_fn])
        ref_modules = modules

    # single-process reference: every rank's chunks in rank order, each rank's seed
    if fsdp:
        return {"cross_rank_diff": diff, "loss": result.loss.item(), "got_keys": len(got),
                "reduce_scatters": len(rs_calls), "fsdp_modules": n_fsdp,
                "fsdp_grads": {k: v.tolist() for k, v in got.items()}}
    zero(*modules, loss_fn)
    loss_fn.block_size, loss_fn.dense = None, True  # the reference: all logits at once
    ref_q, ref_d = [], []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [q_model(**c, **extra[0]) for c in trimmed_chunks(batches[r][0], CHUNK)]
        ref_d += [d_model(**c, **extra[1]) for c in trimmed_chunks(batches[r][1], CHUNK)]
    ref_kwargs = {"doc_ids": torch.cat(doc_ids)} if ids else {}
    if cross_device:
        out = loss_used(query=torch.cat(ref_q), doc=torch.cat(ref_d), **ref_kwargs)
        ref_loss = out[0] if isinstance(out, tuple) else out
        ref_loss.backward()
    else:  # the mean over ranks of each rank's local loss
        nq = [sum(c["input_ids"].shape[0] for c in trimmed_chunks(batches[r][0], CHUNK))
              for r in range(world)]
        nd = [n * (1 + k) for n in nq]
        qs, ds = torch.cat(ref_q).split(nq), torch.cat(ref_d).split(nd)
        local_losses = []
        for q, d in zip(qs, ds):
            out = loss_used(query=q, doc=d)
            local_losses.append(out[0] if isinstance(out, tuple) else out)
        (sum(local_losses) / world).backward()
        ref_loss = local_losses[rank].detach()
    ref = grads_of(*ref_modules, loss_fn)
    res = {"rel_err": max_rel_err(got, ref), "cross_rank_diff": diff,
           "loss_err": abs(result.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
           "sync_calls": cache.last_sync_calls, "n_grads": len(ref)}
    if ddp:
        res["ddp_hook_calls"] = len(hook_calls)
    if not generic_loss and "accuracy" in result.metrics:
        res["accuracy"] = result.metrics["accuracy"].item()
    return res


def fsdp_reference(k, sizes, subsets=False, shared=True):
    """Reference gradients for the FSDP case, computed without FSDP in this process."""
    world = len(sizes)
    torch.manual_seed(0)
    q_model = TwoPath().to(DT) if subsets else TokenTower(p=0.1).to(DT)
    d_model = q_model if shared else TokenTower(p=0.1).to(DT)
    modules = [q_model] if q_model is d_model else [q_model, d_model]
    extra = ({"kind": "text"}, {"kind": "image"}) if subsets else ({}, {})
    loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
    batches = global_batch(sizes, k)
    ref_q, ref_d = [], []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [q_model(**c, **extra[0]) for c in trimmed_chunks(batches[r][0], CHUNK)]
        ref_d += [d_model(**c, **extra[1]) for c in trimmed_chunks(batches[r][1], CHUNK)]
    loss, _ = loss_fn(query=torch.cat(ref_q), doc=torch.cat(ref_d))
    loss.backward()
    return grads_of(*modules, loss_fn), loss.item()


def case_corpus_cross_device():
    """CorpusInfoNCE under the default cross_device=True: each rank passes its own queries'
    positive_index and other_positives (local rows); the result is the global batch's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TokenTower(p=0.1).to(DT)
    corpus = nn.functional.normalize(torch.randn(10, 8, dtype=DT), dim=-1)
    loss_fn = bb.CorpusInfoNCE(corpus, temperature=0.1).to(DT)
    sizes = (4, 3)
    queries = [q for q, _ in global_batch(sizes, 0)]
    targets = [torch.tensor([0, 3, 5, 9]), torch.tensor([2, 3, 7])]
    others = [torch.tensor([[0, 1], [2, 4]]), torch.tensor([[1, 8]])]  # (local row, corpus row)
    cache = bb.GradCache({"query": model}, loss_fn, chunk_size=CHUNK)
    zero(model, loss_fn)
    torch.manual_seed(100 + rank)
    result = cache.step(query=queries[rank], positive_index=targets[rank],
                        other_positives=others[rank])
    got = grads_of(model, loss_fn)
    diff, _ = cross_rank_diff([model, loss_fn])
    zero(model, loss_fn)
    ref_q = []
    for r in range(world):
        torch.manual_seed(100 + r)
        ref_q += [model(**c) for c in trimmed_chunks(queries[r], CHUNK)]
    ref_others = torch.cat([others[0], others[1] + torch.tensor([sizes[0], 0])])
    loss_fn.dense = True  # the reference: all logits at once
    ref_loss, ref_metrics = loss_fn(torch.cat(ref_q), torch.cat(targets), ref_others)
    ref_loss.backward()
    ref = grads_of(model, loss_fn)
    return {"rel_err": max_rel_err(got, ref), "cross_rank_diff": diff,
            "loss_err": abs(result.loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "sync_calls": cache.last_sync_calls, "n_grads": len(ref),
            "metrics_err": max(abs(result.metrics[k].item() - v.item())
                               for k, v in ref_metrics.items()),
            "metric_keys": sorted(result.metrics) == sorted(ref_metrics)}


def case_fsdp_divide_factor_restored():
    """After a step, an FSDP model used outside the engine averages its gradients over the
    ranks again (FSDP's default), exactly as an identical model never given to the engine."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    used = TokenTower().to(DT)
    fresh = copy.deepcopy(used)
    for m in (used, fresh):
        fully_shard(m, mesh=mesh)
    q, d = global_batch((4, 4), 0)[rank]
    bb.GradCache({"query": used, "doc": used}, bb.InfoNCE().to(DT), chunk_size=2).step(
        query=q, doc=d)
    for m in (used, fresh):
        zero(m)
        m(**q)[:, 0].sum().backward()  # (the output is L2-normalised: not its norm)
    diff = max((a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
               for a, b in zip(used.parameters(), fresh.parameters()))
    scale = min(b.grad.full_tensor().abs().max().item() for b in fresh.parameters())
    return {"diff": diff, "scale": scale}


def case_gather_with_grad():
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.arange((rank + 2) * 3, dtype=DT).reshape(rank + 2, 3).requires_grad_()
    y = D.gather_with_grad(x)
    sizes = [r + 2 for r in range(world)]
    expect_rows = torch.cat([torch.arange((r + 2) * 3, dtype=DT).reshape(r + 2, 3)
                             for r in range(world)])
    w = [torch.full((sum(sizes), 3), float(s + 1), dtype=DT) * torch.arange(sum(sizes),
         dtype=DT)[:, None] for s in range(world)]
    (y * w[rank]).sum().backward()
    lo = sum(sizes[:rank])
    expected = sum(ws[lo:lo + sizes[rank]] for ws in w)
    return {"forward_ok": bool(torch.equal(y.detach(), expect_rows)),
            "grad_err": (x.grad - expected).abs().max().item()}


def case_shape_disagreement():
    rank = dist.get_rank()
    lin = nn.Linear(4, 4 + rank).to(DT)  # rank 1 embeds to a different width
    cache = bb.GradCache({"query": lin, "doc": lin}, bb.InfoNCE().to(DT), chunk_size=2)
    try:
        cache.step(query=torch.randn(3, 4, dtype=DT), doc=torch.randn(3, 4, dtype=DT))
    except bb.ShapeError as e:
        return {"raised": type(e).__name__, "message": str(e),
                "grads_written": any(p.grad is not None for p in lin.parameters())}
    return {"raised": None}


def case_non_finite_on_one_rank():
    rank = dist.get_rank()
    lin = nn.Linear(4, 4).to(DT)

    def doc(x):
        y = lin(x)
        return y * float("nan") if rank == 1 else y

    cache = bb.GradCache({"query": lin, "doc": doc}, bb.InfoNCE().to(DT), chunk_size=2,
                         params=lin.parameters())
    try:
        cache.step(query=torch.randn(3, 4, dtype=DT), doc=torch.randn(3, 4, dtype=DT))
    except bb.NonFiniteError as e:
        return {"raised": type(e).__name__, "message": str(e),
                "grads_written": any(p.grad is not None for p in lin.parameters())}
    return {"raised": None}


def case_ragged_chunks_refused_for_fsdp():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    model = TokenTower().to(DT)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    cache = bb.GradCache({"query": model, "doc": model}, bb.InfoNCE().to(DT), chunk_size=2)
    n = 4 if rank == 0 else 2
    try:
        cache.step(query=token_batch(n), doc=token_batch(n))
    except bb.ConfigError as e:
        return {"raised": type(e).__name__, "message": str(e)}
    return {"raised": None}


ERROR_TIMEOUT_S = 15  # collective timeout of the error cases: a hang fails fast


def _step_error(make_inputs, towers=None, loss_fn=None, **engine_kwargs):
    """One step on every rank with this rank's ``make_inputs(rank)``; report the error it
    raised, how long it took, and whether any gradient was written."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    lin = nn.Linear(4, 4).to(DT)
    towers = towers(lin) if towers else {"query": lin, "doc": lin}
    cache = bb.GradCache(towers, loss_fn or bb.InfoNCE().to(DT), chunk_size=2, **engine_kwargs)
    t0 = time.monotonic()
    try:
        cache.step(**make_inputs(rank))
        raised, message = None, ""
    except Exception as e:  # noqa: BLE001 - the test checks which one
        raised, message = type(e).__name__, str(e)
    return {"raised": raised, "message": message, "seconds": time.monotonic() - t0,
            "grads_written": any(p.grad is not None for p in lin.parameters())}


def _rows(n):
    return torch.randn(n, 4, dtype=DT)


ERROR_CASES = {
    "warm_up": lambda: {"barrier": dist.barrier() is None},  # the first collective connects
    # rank 1's local batch is empty: rank 0 used to wait in the size exchange until timeout
    "empty_rank": lambda: _step_error(
        lambda r: {"query": _rows(3 if r == 0 else 0), "doc": _rows(3 if r == 0 else 0)}),
    # rank 1 gives a wrong-length doc_ids: rank 0 used to wait in the ids' all-gather
    "bad_doc_ids_one_rank": lambda: _step_error(
        lambda r: {"query": _rows(3), "doc": _rows(3), "doc_ids": torch.arange(3 if r == 0 else 2)}),
    "bad_doc_ids_list_one_rank": lambda: _step_error(
        lambda r: {"query": _rows(3), "doc": _rows(3), "doc_ids": list("abc"[: 3 - r])}),
    # CorpusInfoNCE under cross_device=True: rank 1's positive_index is one entry short
    "bad_positive_index_one_rank": lambda: _step_error(
        lambda r: {"query": _rows(3), "positive_index": torch.arange(3 - r)},
        towers=lambda lin: {"query": lin},
        loss_fn=bb.CorpusInfoNCE(torch.randn(5, 4, dtype=DT))),
    # ... and rank 1's other_positives names a corpus row that does not exist
    "bad_other_positives_one_rank": lambda: _step_error(
        lambda r: {"query": _rows(3), "positive_index": torch.arange(3),
                   "other_positives": torch.tensor([[0, 4 if r == 0 else 50]])},
        towers=lambda lin: {"query": lin},
        loss_fn=bb.CorpusInfoNCE(torch.randn(5, 4, dtype=DT))),
    # plain-function towers without params=: refused before any gradient is written
    "plain_function_without_params": lambda: _step_error(
        lambda r: {"query": _rows(3), "doc": _rows(3)},
        towers=lambda lin: {"query": lambda x: lin(x), "doc": lambda x: lin(x)}),
    # rank 1's input dict is malformed (planning fails before the first collective)
    "bad_input_one_rank": lambda: _step_error(
        lambda r: {"query": _rows(3), "doc": {"x": _rows(3), "y": _rows(3 - r)}}),
    # only rank 0 passes doc_ids: the loss's all-gather of ids would never be matched
    "loss_args_differ": lambda: _step_error(
        lambda r: {"query": _rows(3), "doc": _rows(3),
                   **({"doc_ids": torch.arange(3)} if r == 0 else {})}),
}


def error_worker(rank, world, port, out_path):
    run_cases(rank, world, port, out_path, ERROR_CASES, timeout_s=ERROR_TIMEOUT_S)


CASES = {
    "plain_k0_shared": lambda: run_engine_case(k=0),
    "plain_k2_separate": lambda: run_engine_case(k=2, shared=False),
    "symmetric_k2_ids": lambda: run_engine_case(k=2, symmetric=True, ids=True),
    "symmetric_k0_streamed": lambda: run_engine_case(k=0, symmetric=True, block_size=2),
    # automatic blocks: 30 // 24 = 1 row against the documents, 30 // 8 = 3 against the queries
    "auto_blocks_k2_symmetric_ids": lambda: run_engine_case(k=2, sizes=(5, 3), symmetric=True,
                                                            ids=True, max_block_logits=30),
    "fixed_temperature_k2": lambda: run_engine_case(k=2, learnable=False),
    "ddp_k2": lambda: run_engine_case(k=2, ddp=True),
    "ddp_separate_k0_symmetric": lambda: run_engine_case(k=0, ddp=True, shared=False,
                                                         symmetric=True),
    "subsets_plain": lambda: run_engine_case(k=1, subsets=True),
    "subsets_ddp": lambda: run_engine_case(k=1, subsets=True, ddp=True),
    "ragged_k1": lambda: run_engine_case(k=1, sizes=(5, 2), symmetric=True),
    "ragged_ddp_k2": lambda: run_engine_case(k=2, sizes=(4, 1), ddp=True),
    "generic_loss_k1": lambda: run_engine_case(k=1, generic_loss=True, learnable=False),
    "no_cross_device_k1": lambda: run_engine_case(k=1, cross_device=False),
    "fsdp_k1": lambda: run_engine_case(k=1, fsdp=True),
    "fsdp_subsets_k1": lambda: run_engine_case(k=1, fsdp=True, subsets=True),
    "fsdp_separate_k1": lambda: run_engine_case(k=1, fsdp=True, shared=False),
    "corpus_cross_device": case_corpus_cross_device,
    "gather_with_grad": case_gather_with_grad,
    "shape_disagreement": case_shape_disagreement,
    "non_finite_one_rank": case_non_finite_on_one_rank,
    "fsdp_ragged_refused": case_ragged_chunks_refused_for_fsdp,
    "fsdp_divide_factor_restored": case_fsdp_divide_factor_restored,
}


def worker(rank, world, port, out_path, names):
    run_cases(rank, world, port, out_path, {n: CASES[n] for n in names})


def failing_rank_worker(rank, world, port, out_path):
    """Rank 1 dies inside its tower; rank 0 must get an error, not hang."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    lin = nn.Linear(4, 4)

    def tower(x):
        if rank == 1:
            raise RuntimeError("simulated failure on rank 1")
        return lin(x)

    cache = bb.GradCache({"query": tower, "doc": tower}, bb.InfoNCE(), chunk_size=2,
                         params=lin.parameters())
    t0 = time.monotonic()
    try:
        cache.step(query=torch.randn(3, 4), doc=torch.randn(3, 4))
        outcome = "no error"
    except Exception as e:  # noqa: BLE001 - we record whatever the backend raises
        outcome = type(e).__name__
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"outcome": outcome, "seconds": time.monotonic() - t0}, f)
    os._exit(0)
