"""Chunks sized for a memory budget (``GradCache(chunk_size="auto")``): a larger budget gives a
larger chunk, a budget above the plain step gives plain training with the unchunked gradient,
each tower is sized for its own lengths, a token budget likewise, and a budget too small for
one row is a clear error naming the smallest budget that works; measured in a process of its
own, a step never goes over its budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import (
    DT,
    grads_of,
    max_rel_err,
    reference_step,
    token_batch,
    trimmed_chunks,
    zero_grads,
)
from torch import nn

import bigbatch as bb
from bigbatch.engine import sizing
from bigbatch.engine.sizing import ActivationCost, StepMemory, choose_chunks
from bigbatch.errors import ConfigError


class TokenTower(nn.Module):
    """Token embeddings through a wide MLP with dropout, mean-pooled: activations of about
    7 KB a token in float64, so a chunk's dwarf its random state (5 KB)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.up = nn.Linear(64, 256)
        self.drop = nn.Dropout(0.2)
        self.down = nn.Linear(256, 16)

    def forward(self, input_ids, attention_mask):
        h = self.down(self.drop(nn.functional.gelu(self.up(self.emb(input_ids)))))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return nn.functional.normalize((h * m).sum(1) / m.sum(1), dim=-1)


def _setup(q_len=12, d_len=12, nq=8, nd=16):
    torch.manual_seed(0)
    tower = TokenTower().to(DT).train()
    loss_fn = bb.InfoNCE().to(DT)
    gen = torch.Generator().manual_seed(1)
    inputs = {"query": token_batch(nq, max_len=q_len, gen=gen),
              "doc": token_batch(nd, max_len=d_len, gen=gen)}
    return tower, loss_fn, inputs


def _plan(tower, loss_fn, inputs, budget, **kw):
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                         memory_budget=budget, **kw)
    return cache, cache.plan_chunks(inputs)


def _floor(tower, loss_fn, inputs):
    """The plan's fixed part (everything but activations and random states, with the
    documents' fixed activation cost: the step's overhead), in bytes."""
    _, plan = _plan(tower, loss_fn, inputs, 2 ** 40)
    return (plan.memory.floor - plan.memory.rng_states + plan.memory.loss_block
            + plan.costs["doc"].fixed), plan


def test_a_larger_budget_gives_a_larger_chunk_and_every_estimate_fits():
    tower, loss_fn, inputs = _setup()
    fixed, plain = _floor(tower, loss_fn, inputs)
    per_row = plain.costs["doc"].per_row
    sizes = []
    for rows in (2, 5, 9):  # budgets for about that many rows of activations
        budget = fixed + int(per_row * rows) + 16 * sizing.CPU_RNG_STATE_BYTES
        _, plan = _plan(tower, loss_fn, inputs, budget)
        assert plan.memory.total <= budget and not plan.plain
        sizes.append(plan.sizes["doc"])
    assert sizes[0] < sizes[1] < sizes[2] and sizes[0] >= 1


def test_a_negative_queue_is_counted_in_the_floor_and_the_loss_block():
    """A queue's documents (``queued_rows``) are held QUEUE_COPIES times and are columns of
    every loss block, so the same budget gives a smaller chunk with a queue than without."""
    tower, loss_fn, inputs = _setup()
    fixed, plain = _floor(tower, loss_fn, inputs)
    budget = fixed + int(plain.costs["doc"].per_row * 9) + 16 * sizing.CPU_RNG_STATE_BYTES
    queued = 400
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                         memory_budget=budget)
    without = cache.plan_chunks(inputs, use=False)
    with_queue = cache.plan_chunks(inputs, queued_rows=queued, use=False)
    row = plain.costs["doc"].row_bytes
    assert row == 16 * 8  # 16 float64 dims
    assert without.memory.negative_queue == 0
    assert with_queue.memory.negative_queue == sizing.QUEUE_COPIES * queued * (row + 2 * 8)  # ids
    assert with_queue.memory.loss_block == loss_fn.memory_hint(
        {"query": 8, "doc": 16, "queued": queued}) > without.memory.loss_block
    assert with_queue.memory.total <= budget and without.memory.total <= budget
    assert with_queue.sizes["doc"] < without.sizes["doc"]
    with pytest.raises(ConfigError, match="the negative queue 1 MB"):
        cache.plan_chunks(inputs, queued_rows=3000, use=False)


def test_a_budget_above_the_plain_step_trains_plainly_with_the_unchunked_gradient():
    """chunk = batch for every tower, one pass (no replay), and the float64 gradient of the
    unchunked reference with the same dropout draws."""
    tower, loss_fn, inputs = _setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                         memory_budget=2 ** 34)
    calls = []
    tower.register_forward_hook(lambda *a: calls.append(1))
    torch.manual_seed(7)  # the first step sizes its chunks (4 probe forwards), then steps
    zero_grads(tower, loss_fn)
    result = cache.step(**inputs)
    got = grads_of(tower, loss_fn)
    assert cache.chunk_sizes == {"query": 8, "doc": 16} and cache.memory_plan.plain
    assert len(calls) == 4 + 2  # one forward per tower, none replayed
    torch.manual_seed(7)  # the whole batch at once (cut to its longest row, as the engine)
    zero_grads(tower, loss_fn)
    ref = reference_step({"query": tower, "doc": tower}, loss_fn, inputs,
                         chunked={n: trimmed_chunks(x, len(x["input_ids"]))
                                  for n, x in inputs.items()})
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= 1e-12
    assert torch.allclose(result.loss, ref, rtol=1e-13)


def test_chunked_auto_steps_equal_the_reference_too():
    tower, loss_fn, inputs = _setup()
    fixed, plain = _floor(tower, loss_fn, inputs)
    budget = fixed + int(plain.costs["doc"].per_row * 5) + 16 * sizing.CPU_RNG_STATE_BYTES
    cache, plan = _plan(tower, loss_fn, inputs, budget)
    assert 1 < plan.sizes["doc"] < 16
    torch.manual_seed(5)
    zero_grads(tower, loss_fn)
    cache.step(**inputs)
    got = grads_of(tower, loss_fn)
    tower.eval()  # no dropout: the reference need not replay the engine's chunks
    torch.manual_seed(5)
    zero_grads(tower, loss_fn)
    cache.step(**inputs)
    got_eval = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)
    reference_step({"query": tower, "doc": tower}, loss_fn, inputs)
    assert max_rel_err(got_eval, grads_of(tower, loss_fn)) <= 1e-12
    assert max_rel_err(got, got_eval, record=False) > 1e-6  # dropout was on in the first


def test_each_tower_is_sized_for_its_own_lengths():
    """Short queries, long documents: the queries' chunk is larger."""
    tower, loss_fn, inputs = _setup(q_len=4, d_len=40, nq=32, nd=32)
    fixed, plain = _floor(tower, loss_fn, inputs)
    assert plain.costs["query"].width < plain.costs["doc"].width
    assert plain.costs["query"].per_row < plain.costs["doc"].per_row
    budget = fixed + int(plain.costs["doc"].per_row * 6) + 64 * sizing.CPU_RNG_STATE_BYTES
    _, plan = _plan(tower, loss_fn, inputs, budget)
    assert plan.sizes["query"] > plan.sizes["doc"] >= 1


def test_a_token_budget_is_sized_too():
    tower, loss_fn, inputs = _setup(nq=16, nd=32)
    fixed, plain = _floor(tower, loss_fn, inputs)
    tokens = []
    for rows in (3, 8):
        budget = fixed + int(plain.costs["doc"].per_row * rows) + 64 * sizing.CPU_RNG_STATE_BYTES
        cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                             chunk_tokens="auto", memory_budget=budget)
        plan = cache.plan_chunks(inputs)
        assert plan.memory.total <= budget
        assert cache.chunk_tokens == plan.tokens and plan.tokens["doc"] >= plain.costs["doc"].width
        tokens.append(plan.tokens["doc"])
        cache.step(**inputs)
    assert tokens[0] < tokens[1]


def test_a_budget_too_small_for_one_row_names_the_smallest_that_works():
    tower, loss_fn, inputs = _setup()
    fixed, _ = _floor(tower, loss_fn, inputs)
    with pytest.raises(bb.ConfigError, match=r"memory_budget: .* MB cannot hold a training step "
                                             r"of even one row per chunk, which needs .* give a "
                                             r"budget of (\d+)MB or more") as err:
        _plan(tower, loss_fn, inputs, fixed // 2)
    smallest = int(str(err.value).split("budget of ")[1].split("MB")[0].replace(",", ""))
    _, plan = _plan(tower, loss_fn, inputs, smallest * 2 ** 20)  # and that one works
    assert plan.sizes["doc"] >= 1


def test_the_arithmetic_of_choose_chunks():
    """floor + random states + the largest chunk's activations + one loss block <= budget."""
    base = StepMemory(embeddings=100, embedding_grads=100, rng_states=0, parameter_grads=300,
                      chunk_activations=0, loss_block=50, optimizer_states=600)
    costs = {"query": ActivationCost(per_row=10, fixed=5, width=4),
             "doc": ActivationCost(per_row=100, fixed=20, width=32)}
    rows = {"query": 64, "doc": 64}
    plan = choose_chunks(10_000_000, rows, costs, base=base, rng_state_bytes=1)
    assert plan.plain and plan.sizes == rows  # everything at once: plain training
    assert plan.memory.total == 1150 + 10 * 64 + 5 + 100 * 64 + 20
    budget = 1150 + 20 + 100 * 10 + 20  # room for 10 document rows and 20 random states
    plan = choose_chunks(budget, rows, costs, base=base, rng_state_bytes=1)
    assert not plan.plain and plan.memory.total <= budget
    assert plan.sizes == {"query": 64, "doc": 10}  # queries: the batch, it fits
    assert plan.memory.rng_states == 1 + 7 - 1
    tokens = choose_chunks(budget, rows, costs, base=base, rng_state_bytes=1,
                           token_towers={"doc"})
    assert tokens.tokens == {"doc": int((budget - 1150 - tokens.memory.rng_states - 20)
                                        // (100 / 32))}
    assert tokens.sizes["doc"] == 64 and tokens.memory.total <= budget
    lowered = plan.lowered(budget * 2)
    assert lowered.sizes["doc"] < plan.sizes["doc"] and lowered.sizes["query"] < 64
    assert lowered.memory.total <= budget
    with pytest.raises(bb.ConfigError, match="needs 1 MB"):
        choose_chunks(1000, rows, costs, base=base, rng_state_bytes=1)


def test_bad_options_are_clear_errors():
    tower, loss_fn, _ = _setup()
    towers = {"query": tower, "doc": tower}
    with pytest.raises(bb.ConfigError, match="memory_budget sizes the chunks of chunk_size='auto'"):
        bb.GradCache(towers, loss_fn, chunk_size=4, memory_budget=0.5)
    with pytest.raises(bb.ConfigError, match=r"fraction of the free memory must be in \(0, 1\]"):
        bb.GradCache(towers, loss_fn, chunk_size="auto", memory_budget=1.5)
    with pytest.raises(bb.ConfigError, match="positive integer"):
        bb.GradCache(towers, loss_fn, chunk_size="big")
    with pytest.raises(bb.ConfigError, match="this engine's sizes are fixed"):
        bb.GradCache(towers, loss_fn, chunk_size=4).plan_chunks({})


def test_one_tower_auto_the_other_fixed():
    tower, loss_fn, inputs = _setup()
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn,
                         chunk_size={"query": 3, "doc": "auto"}, memory_budget=2 ** 34)
    plan = cache.plan_chunks(inputs)
    assert cache.chunk_sizes == {"query": 3, "doc": 16} and not plan.plain


def test_an_optimizer_s_states_are_counted():
    tower, loss_fn, inputs = _setup()
    params = list(tower.parameters())
    adam = torch.optim.AdamW(params)
    sgd = torch.optim.SGD(params, lr=0.1)
    size = sum(p.numel() * p.element_size() for p in params)
    assert sizing.optimizer_state_bytes(adam) == 2 * size
    assert sizing.optimizer_state_bytes(sgd) == 0
    _, with_adam = _plan(tower, loss_fn, inputs, 2 ** 34, optimizer=adam)
    assert with_adam.memory.optimizer_states == 2 * size


BENCH = Path(__file__).resolve().parents[2] / "bench" / "chunk_auto.py"


def _measured(model: str, batch: int, length: int, budget: int) -> dict:
    """One step sized for ``budget`` in its own process (bench/chunk_auto.py's point): the
    chosen chunks, the estimate and the measured peak (resident memory above the memory
    before the step, with glibc returning freed blocks at once, plus AdamW's states)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(BENCH.parents[1] / "src"),
                                           os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, str(BENCH), "--point", f"auto:{budget}", "--model", model,
                        "--batch", str(batch), "--max-length", str(length), "--threads", "1"],
                       capture_output=True, text=True, env=env, timeout=3600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check_three_budgets(model: str, batch: int, length: int, budgets_mb: list[int]) -> None:
    points = [_measured(model, batch, length, mb * 2 ** 20) for mb in budgets_mb]
    docs = [p["sizes"]["doc"] for p in points]
    assert docs == sorted(docs) and docs[0] < docs[-1], points  # more budget, larger chunks
    for p, mb in zip(points, budgets_mb):
        assert p["estimate_mb"] <= mb
        assert p["peak_mb"] <= mb, p  # never over the budget, measured


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_a_tiny_bert_never_goes_over_its_budget_measured():
    _check_three_budgets("tiny-bert", 64, 128, [100, 130, 180])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's peak reset")
def test_minilm_at_256_tokens_never_goes_over_its_budget_measured():
    """all-MiniLM-L6-v2, batch 32, max length 256 (SciFact abstracts fill it): about 100 MB
    a document row of activations."""
    _check_three_budgets("minilm", 32, 256, [600, 1000, 1600])


def test_padding_cap_halves_a_chunk_while_that_saves_more_than_the_tolerance():
    # the token counts of 128 SciFact claims length-sorted under all-MiniLM-L6-v2 are like these:
    # a few long rows, most short; one chunk pads every row to the longest
    lengths = sorted([46] * 4 + [30] * 12 + [22] * 48 + [16] * 64, reverse=True)
    assert sizing.padded_tokens(lengths, 128) == 128 * 46
    assert sizing.padded_tokens(lengths, 4) == sum(lengths)
    cap = sizing.padding_cap(lengths, 128)
    assert cap < 128
    half = -(-cap // 2)
    assert sizing.padded_tokens(lengths, cap) <= 1.1 * sizing.padded_tokens(lengths, half)
    # every larger size was halved because halving saved more than 10%
    size = 128
    while size > cap:
        assert sizing.padded_tokens(lengths, size) > 1.1 * sizing.padded_tokens(lengths, -(-size // 2))
        size = -(-size // 2)
    assert size == cap
    assert sizing.padding_cap([256] * 128, 128) == 128  # one length: nothing to save
    assert sizing.padding_cap(lengths, 1) == 1 and sizing.padding_cap([5], 8) == 1


def test_auto_weighs_padding_where_chunks_are_length_sorted():
    """Short queries of mixed lengths that fit whole: with ``sort_by_length`` their chunk is
    capped where smaller sorted chunks pad less (the start line says so), the documents (one
    length) keep the size that fits, the estimate is the capped plan's, and the step still
    equals the unchunked reference."""
    torch.manual_seed(0)
    tower, loss_fn = TokenTower().to(DT).train(), bb.InfoNCE().to(DT)
    gen = torch.Generator().manual_seed(1)
    q = token_batch(32, max_len=12, gen=gen)
    q["attention_mask"][:2] = 1  # two long rows, the rest up to 12 tokens
    q["input_ids"][:2] = torch.randint(1, 50, (2, 12), generator=gen)
    d = {"input_ids": torch.randint(1, 50, (32, 20), generator=gen),
         "attention_mask": torch.ones(32, 20, dtype=torch.long)}
    inputs = {"query": q, "doc": d}
    _, unsorted = _plan(tower, loss_fn, inputs, 2 ** 40, reuse_last_chunk=False)
    _, plan = _plan(tower, loss_fn, inputs, 2 ** 40, reuse_last_chunk=False, sort_by_length=True)
    assert unsorted.sizes == {"query": 32, "doc": 32} and not unsorted.fits
    assert plan.sizes["doc"] == 32 and plan.sizes["query"] < 32
    assert plan.fits == {"query": 32}
    lengths = sorted(q["attention_mask"].sum(1).tolist(), reverse=True)
    assert plan.sizes["query"] == sizing.padding_cap(lengths, 32)
    assert "32 fit; fewer rows pad less" in plan.describe()
    assert plan.memory.total == plan.at(plan.sizes).memory.total
    assert plan.memory.rng_states > unsorted.memory.rng_states  # more chunks: more states
    cache, _ = _plan(tower, loss_fn, inputs, 2 ** 40, reuse_last_chunk=False, sort_by_length=True)
    tower.eval()
    zero_grads(tower, loss_fn)
    cache.step(**inputs)
    assert cache.chunk_sizes["query"] == plan.sizes["query"]
    got = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)
    reference_step({"query": tower, "doc": tower}, loss_fn, inputs)
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= 1e-12


def test_lengths_of_a_sample_weigh_padding_where_the_probe_rows_are_copies():
    """``bigbatch train`` probes copies of the longest text (all one length: nothing to
    weigh) and gives the token counts of a sample of the data: the cap is the one those
    counts give, read at the same fraction of the rows when the sample is smaller."""
    torch.manual_seed(0)
    tower, loss_fn = TokenTower().to(DT).train(), bb.InfoNCE().to(DT)
    gen = torch.Generator().manual_seed(1)
    long = {"input_ids": torch.randint(1, 50, (4, 12), generator=gen),
            "attention_mask": torch.ones(4, 12, dtype=torch.long)}
    probe = {"query": long, "doc": long}
    rows = {"query": 64, "doc": 64}
    counts = [12] * 4 + [6] * 12 + [3] * 48  # a step's rows: a few long, most short
    kw = dict(reuse_last_chunk=False, sort_by_length=True)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                         memory_budget=2 ** 40, **kw)
    copies = cache.plan_chunks(probe, rows=rows, use=False)
    assert copies.sizes == rows and not copies.fits
    weighed = cache.plan_chunks(probe, rows=rows, lengths={"query": counts}, use=False)
    assert weighed.sizes == {"query": sizing.padding_cap(sorted(counts, reverse=True), 64),
                             "doc": 64} and weighed.fits == {"query": 64}
    sample = counts[::4]  # a quarter of the rows, the same mix
    halved = cache.plan_chunks(probe, rows=rows, lengths={"query": sample}, use=False)
    cap = sizing.padding_cap(sorted(sample, reverse=True), 16)
    assert halved.sizes["query"] == min(64, cap * 4) < 64
    from bigbatch.train.memory_check import describe_sizes
    line = describe_sizes(weighed, weighed.sizes, {})
    assert f"(queries {weighed.sizes['query']}) (queries 64 fit: smaller length-sorted chunks " \
           f"pad less), sized for a memory budget of" in line
