"""Cases run inside 2 gloo ranks under DeepSpeed ZeRO (spawned by test_deepspeed.py): the
GradCache step through the DeepSpeed engine, against the single-process global-batch
reference with the same dropout masks, for two optimizer steps (the second from the weights
the first step's DeepSpeed update wrote), and the reductions each step makes."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.dirname(HERE))

from dist_helpers import run_cases  # noqa: E402
from helpers import TokenTower, max_rel_err, token_batch, trimmed_chunks  # noqa: E402

import bigbatch as bb  # noqa: E402

SIZES = (4, 4)  # queries per rank
K = 1  # hard negatives per query
# the collectives that reduce gradients (DeepSpeed calls them through torch.distributed)
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce_scatter_single",
              "all_reduce_coalesced", "reduce")


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": SIZES[0], "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": stage},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}}}


class CountReductions:
    """Counts calls of the reducing collectives of torch.distributed while active."""

    def __enter__(self):
        self.calls, self.saved = 0, {}
        for name in REDUCTIONS:
            if hasattr(dist, name):
                fn = self.saved[name] = getattr(dist, name)

                def counted(*a, _fn=fn, **kw):
                    self.calls += 1
                    return _fn(*a, **kw)
                setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def full_weights(engine, stage: int) -> dict:
    """The model's full weights on every rank (gathered under ZeRO-3)."""
    if stage == 3:
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def engine_case(stage: int, dtype: torch.dtype = torch.float64, chunk: int = 3,
                steps: int = 2) -> dict:
    import deepspeed

    from bigbatch.integrations.deepspeed import deepspeed_cache, deepspeed_step, full_gradients

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TokenTower(p=0.1).to(dtype)
    loss_fn = bb.InfoNCE(temperature=0.1, learnable_temperature=True).to(dtype)
    try:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage),
                                          model_parameters=list(model.parameters()))
    except AssertionError as e:  # ZeRO-3's zero.Init takes half, bfloat16 or float weights
        if stage == 3 and dtype == torch.float64:
            return {"refused": str(e), "dtype": str(dtype)}
        raise
    cache = deepspeed_cache(engine, loss_fn, chunk_size=chunk)
    engine.train()
    gen = torch.Generator().manual_seed(11)
    errors, loss_errs, reductions = [], [], []
    for step in range(steps):
        batches = [(token_batch(b, gen=gen), token_batch(b * (1 + K), gen=gen)) for b in SIZES]
        ref_model = TokenTower(p=0.1).to(dtype)
        ref_model.load_state_dict(full_weights(engine, stage))
        ref_loss = bb.InfoNCE(temperature=0.1, learnable_temperature=True, dense=True).to(dtype)
        ref_loss.load_state_dict(loss_fn.state_dict())
        loss_fn.zero_grad(set_to_none=True)
        torch.manual_seed(100 + 10 * step + rank)
        with CountReductions() as counter:
            result = deepspeed_step(engine, cache, query=batches[rank][0], doc=batches[rank][1])
        reductions.append(counter.calls)
        got = {f"m.{k}": v for k, v in full_gradients(engine).items()}
        got.update({f"l.{k}": p.grad.detach().clone() for k, p in loss_fn.named_parameters()})
        # the single-process reference: every rank's chunks in rank order, each rank's seed
        ref_q, ref_d = [], []
        for r in range(world):
            torch.manual_seed(100 + 10 * step + r)
            ref_q += [ref_model(**c) for c in trimmed_chunks(batches[r][0], chunk)]
            ref_d += [ref_model(**c) for c in trimmed_chunks(batches[r][1], chunk)]
        loss, _ = ref_loss(query=torch.cat(ref_q), doc=torch.cat(ref_d))
        loss.backward()
        ref = {f"m.{k}": p.grad for k, p in ref_model.named_parameters()}
        ref.update({f"l.{k}": p.grad for k, p in ref_loss.named_parameters()})
        errors.append(max_rel_err(got, ref, record=False))
        loss_errs.append(abs(result.loss.item() - loss.item()) / abs(loss.item()))
        engine.step()
        with torch.no_grad():  # the temperature: a plain SGD step, the same on every rank
            for p in loss_fn.parameters():
                p -= 1e-2 * p.grad
    return {"rel_err": max(errors), "loss_err": max(loss_errs), "reductions": reductions,
            "dtype": str(dtype),
            "n_grads": len(ref), "grad_dtype": str(got["m.emb.weight"].dtype),
            "weights_moved": float((full_weights(engine, stage)["emb.weight"]
                                    - ref_model.emb.weight.detach()).abs().max())}


CASES = {f"stage{s}_{name}": (lambda s=s, dt=dt: engine_case(s, dt))
         for s in (1, 2, 3) for name, dt in (("float64", torch.float64),
                                             ("float32", torch.float32))}
# the same step in chunks of 1 row (24 replays per rank) and of 12 (one chunk per tower);
# ZeRO-3 with float32 weights, the widest its zero.Init takes
CASES.update({f"stage{s}_chunk{c}": (lambda s=s, c=c: engine_case(
    s, torch.float32 if s == 3 else torch.float64, c, 1)) for s in (1, 2, 3) for c in (1, 12)})


def uncoalesced_case(stage: int = 2, chunk: int = 1) -> dict:
    """The control: the same step without coalescing (each replay's backward reduces, as
    DeepSpeed does by default): how many reductions that makes."""
    import deepspeed

    from bigbatch.integrations.deepspeed import deepspeed_cache

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TokenTower(p=0.1).to(torch.float64)
    engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage),
                                      model_parameters=list(model.parameters()))
    cache = deepspeed_cache(engine, bb.InfoNCE(temperature=0.1).to(torch.float64),
                            chunk_size=chunk)
    gen = torch.Generator().manual_seed(11)
    batches = [(token_batch(b, gen=gen), token_batch(b * (1 + K), gen=gen)) for b in SIZES]
    with CountReductions() as counter:
        cache.step(query=batches[rank][0], doc=batches[rank][1])
    return {"reductions": counter.calls}


CASES["stage2_chunk1_uncoalesced"] = uncoalesced_case


def refused_case() -> dict:
    """Gradient accumulation steps other than 1 are refused before any gradient."""
    import deepspeed

    from bigbatch.integrations.deepspeed import deepspeed_cache

    torch.manual_seed(0)
    model = TokenTower()
    config = dict(ds_config(2), gradient_accumulation_steps=2)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=list(model.parameters()))
    try:
        deepspeed_cache(engine, bb.InfoNCE(), chunk_size=2)
    except bb.ConfigError as e:
        return {"refused": str(e)}
    return {"refused": None}


CASES["refused_gas"] = refused_case


def worker(rank: int, world: int, port: int, out_path: str, names: list[str]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    run_cases(rank, world, port, out_path, {n: CASES[n] for n in names}, timeout_s=120)
