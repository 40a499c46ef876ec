"""Matryoshka, extra in-batch negatives (qq, dd) and token-budget chunks: float64 with
dropout against an unchunked reference drawing the same masks, against losses written by
hand, and their bad inputs (refused before any gradient)."""

from __future__ import annotations

import pytest
import torch
from helpers import DT, TokenTower, grads_of, max_rel_err, token_batch, zero_grads
from multivector_helpers import TokenVectors, naive_maxsim_loss
from objectives_helpers import (
    cut,
    engine_chunks,
    normalized,
    qq_dd_loss,
    run_chunks,
    separate_losses,
)

import bigbatch as bb
from bigbatch.engine import chunking
from bigbatch.errors import ConfigError, InputError, ShapeError
from bigbatch.losses.matryoshka import check_dims

TOL = 1e-10
B = 6


def engine_and_reference(towers, loss_fn, inputs, ref_loss, *, chunk_size=2, chunk_tokens=None,
                         sort=False, loss_kwargs=None, modules=None):
    """The engine's gradient and loss, and the reference's: ``ref_loss(reps)`` on the towers
    run with gradients over the engine's chunks, in its order, from the same seed."""
    loss_kwargs = loss_kwargs or {}
    modules = modules or list({id(t): t for t in towers.values()}.values())
    zero_grads(*modules, loss_fn)
    cache = bb.GradCache(towers, loss_fn, chunk_size=chunk_size, chunk_tokens=chunk_tokens,
                         sort_by_length=sort)
    torch.manual_seed(5)
    result = cache.step(**inputs, **loss_kwargs)
    got = grads_of(*modules, loss_fn)
    zero_grads(*modules, loss_fn)
    torch.manual_seed(5)
    reps = {}
    for name, tower in towers.items():
        tokens = chunk_tokens.get(name) if isinstance(chunk_tokens, dict) else chunk_tokens
        chunks, order = engine_chunks(inputs[name], chunk_size, tokens, sort)
        reps[name] = run_chunks(tower, chunks, order)
    ref = ref_loss(reps)
    ref.backward()
    return max_rel_err(got, grads_of(*modules, loss_fn)), result, ref.detach()


# ------------------------------------------------------------------ Matryoshka
@pytest.mark.parametrize("k,symmetric", [(0, False), (2, True)])
def test_matryoshka_equals_sum_of_separate_losses(k, symmetric):
    tower = TokenTower(p=0.1).to(DT).train()
    inner = bb.InfoNCE(temperature=0.1, symmetric=symmetric, block_size=2).to(DT)
    dims, weights = [8, 4, 2], [1.0, 0.5, 0.25]
    loss_fn = bb.Matryoshka(inner, dims=dims, weights=weights)
    inputs = {"query": token_batch(B), "doc": token_batch(B * (1 + k))}
    err, result, ref = engine_and_reference(
        {"query": tower, "doc": tower}, loss_fn, inputs,
        lambda r: separate_losses(inner, dims, weights, r["query"], r["doc"]), chunk_size=4)
    assert err <= TOL
    assert torch.allclose(result.loss, ref, rtol=1e-12, atol=0)
    assert inner.logit_scale.log_scale.grad.abs().item() > 0
    # per-width metrics; the plain names are the largest width's
    for d in dims:
        assert {f"loss@{d}", f"accuracy@{d}", f"pos_sim@{d}"} <= set(result.metrics)
    assert result.metrics["accuracy"] == result.metrics["accuracy@8"]
    summed = sum(w * result.metrics[f"loss@{d}"] for d, w in zip(dims, weights))
    assert torch.allclose(summed, result.loss, rtol=1e-12)
    assert result.metrics["loss@2"] != result.metrics["loss@8"]


def test_matryoshka_replays_once_not_once_per_width():
    tower = TokenTower().to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B)}
    bb.GradCache({"query": tower, "doc": tower}, bb.InfoNCE().to(DT), chunk_size=3).step(**inputs)
    plain = (tower.calls, tower.grad_calls)
    tower.calls = tower.grad_calls = 0
    loss_fn = bb.Matryoshka(bb.InfoNCE().to(DT), dims=[8, 4, 2, 1])
    bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3).step(**inputs)
    assert (tower.calls, tower.grad_calls) == plain == (7, 4)  # 4 chunks, 3 replayed


def test_matryoshka_with_ids_and_the_step_arguments_checked():
    tower = TokenTower(p=0.1).to(DT).train()
    inner = bb.InfoNCE(temperature=0.1).to(DT)
    loss_fn = bb.Matryoshka(inner, dims=[8, 3])
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    ids = list(range(B * 2))
    ids[2] = 0
    err, result, _ = engine_and_reference(
        {"query": tower, "doc": tower}, loss_fn, inputs,
        lambda r: separate_losses(inner, [8, 3], [1, 1], r["query"], r["doc"], doc_ids=ids),
        loss_kwargs={"doc_ids": ids})
    assert err <= TOL and result.metrics["masked@3"].item() > 0
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(InputError, match="doc_idz"):  # the wrapped loss's arguments
        cache.step(**inputs, doc_idz=ids)


def test_matryoshka_over_maxsim_truncates_token_vectors():
    tower = TokenVectors(p=0.1).to(DT).train()
    inner = bb.MaxSimInfoNCE(temperature=0.1, normalize_query=True).to(DT)
    loss_fn = bb.Matryoshka(inner, dims=[8, 4])
    assert loss_fn.token_inputs == ("query", "doc")
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}

    def ref(r):
        return sum(naive_maxsim_loss(inner, cut(r["query"], d), cut(r["doc"], d)) for d in (8, 4))

    err, result, ref_loss = engine_and_reference({"query": tower, "doc": tower}, loss_fn, inputs,
                                                 ref, chunk_size=4)
    assert err <= TOL
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12)


def test_matryoshka_over_corpus_infonce_truncates_the_corpus():
    gen = torch.Generator().manual_seed(3)
    corpus = normalized(10, 8, gen)
    q = normalized(4, 8, gen).requires_grad_()
    target = torch.tensor([0, 3, 5, 9])
    inner = bb.CorpusInfoNCE(corpus, temperature=0.1).to(DT)
    held = inner.corpus
    loss, metrics = bb.Matryoshka(inner, dims=[8, 5], weights=[1.0, 2.0])(query=q,
                                                                          positive_index=target)
    assert inner.corpus is held  # put back after each width
    ref = 0
    for d, w in ((8, 1.0), (5, 2.0)):
        logits = inner.logit_scale() * cut(q, d) @ cut(corpus, d).T
        ref = ref + w * torch.nn.functional.cross_entropy(logits, target)
    assert torch.allclose(loss, ref, rtol=1e-12)
    g1, = torch.autograd.grad(loss, q)
    g2, = torch.autograd.grad(ref, q)
    assert torch.allclose(g1, g2, rtol=1e-10, atol=1e-14)
    assert "accuracy@5" in metrics


def test_matryoshka_over_a_plain_function_loss():
    def my_loss(query, doc):  # no metrics, no cross-device protocol
        return -(query * doc).sum(1).mean()

    loss_fn = bb.Matryoshka(my_loss, dims=[8, 2])
    assert hasattr(bb.Matryoshka(bb.InfoNCE(), dims=[8]), "cross_device_forward")
    assert not hasattr(loss_fn, "cross_device_forward")  # the engine gathers, then calls it
    tower = TokenTower(p=0.1).to(DT).train()
    inputs = {"query": token_batch(B), "doc": token_batch(B)}
    err, result, ref = engine_and_reference(
        {"query": tower, "doc": tower}, loss_fn, inputs,
        lambda r: separate_losses(my_loss, [8, 2], [1, 1], r["query"], r["doc"]))
    assert err <= TOL and torch.allclose(result.loss, ref, rtol=1e-12)
    assert set(result.metrics) == {"loss@8", "loss@2"}


@pytest.mark.parametrize("dims,weights,message", [
    ([], None, "at least one"),
    ([128, 256], None, "largest to smallest"),
    ([256, 128, 128], None, "more than once"),
    ([256, 0], None, "positive integer"),
    ([256, 128], [1.0], "one weight per dimension"),
    ([256, 128], [1.0, -1.0], "positive finite"),
])
def test_matryoshka_bad_options(dims, weights, message):
    with pytest.raises(ConfigError, match=message):
        bb.Matryoshka(bb.InfoNCE(), dims=dims, weights=weights)


def test_matryoshka_dim_above_the_width_refused_before_any_gradient():
    tower = TokenTower().to(DT)  # width 8
    loss_fn = bb.Matryoshka(bb.InfoNCE().to(DT), dims=[16, 4])
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    with pytest.raises(ShapeError, match="dimension 16 is larger than the width 8"):
        cache.step(query=token_batch(4), doc=token_batch(4))
    assert all(p.grad is None for p in [*tower.parameters(), *loss_fn.parameters()])
    with pytest.raises(ConfigError, match="larger than the model's embedding width 8"):
        check_dims([16, 4], width=8, what="--matryoshka-dims")


# ------------------------------------------------------------ extra negatives
@pytest.mark.parametrize("extra", ["qq", "dd", "qq,dd"])
@pytest.mark.parametrize("blocks", [{"block_size": 2}, {"dense": True}], ids=["streamed", "dense"])
def test_extra_negatives_equal_hand_computed_loss(extra, blocks):
    gen = torch.Generator().manual_seed(1)
    q = normalized(5, 8, gen).requires_grad_()
    d = normalized(15, 8, gen).requires_grad_()
    ids = list(range(15))
    ids[4] = ids[3]  # query 1's hard negative is its positive's passage
    loss_fn = bb.InfoNCE(temperature=0.1, extra_negatives=extra, **blocks).to(DT)
    for doc_ids in (None, ids):
        loss, metrics = loss_fn(query=q, doc=d, doc_ids=doc_ids)
        ref = qq_dd_loss(q, d, loss_fn.logit_scale().detach(), "qq" in extra, "dd" in extra,
                         doc_ids)
        assert torch.allclose(loss, ref, rtol=1e-12, atol=0)
        got = torch.autograd.grad(loss, [q, d])
        want = torch.autograd.grad(ref, [q, d])
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-13)
        assert metrics["masked"].item() == (0 if doc_ids is None else 1 + ("dd" in extra))
    plain = bb.InfoNCE(temperature=0.1).to(DT)(query=q, doc=d)[0]
    assert plain.item() < loss.item() - 1e-3  # more terms in the denominator


def test_extra_negatives_margin_leaves_dd_alone():
    gen = torch.Generator().manual_seed(2)
    q, d = normalized(4, 8, gen), normalized(8, 8, gen)
    loss_fn = bb.InfoNCE(temperature=0.1, extra_negatives="dd", false_negative_margin=-2.0,
                         learnable_temperature=False).to(DT)
    loss, metrics = loss_fn(query=q, doc=d)
    # a margin of -2 masks every query-document negative; the dd terms stay
    scale = loss_fn.logit_scale()
    ref = 0
    for i in range(4):
        p = 2 * i
        terms = [scale * q[i] @ d[p]] + [scale * d[p] @ d[j] for j in range(8) if j != p]
        ref = ref + torch.logsumexp(torch.stack(terms), 0) - scale * q[i] @ d[p]
    assert torch.allclose(loss, ref / 4, rtol=1e-12)
    assert metrics["masked"].item() == 4 * 7


@pytest.mark.parametrize("symmetric", [False, True])
def test_extra_negatives_exact_under_the_engine_with_dropout(symmetric):
    tower = TokenTower(p=0.1).to(DT).train()
    loss_fn = bb.InfoNCE(temperature=0.1, extra_negatives=("qq", "dd"), symmetric=symmetric,
                         block_size=3).to(DT)
    inputs = {"query": token_batch(B), "doc": token_batch(B * 2)}
    ids = list(range(B * 2))
    ids[5] = ids[0]
    err, result, ref = engine_and_reference(
        {"query": tower, "doc": tower}, loss_fn, inputs,
        lambda r: loss_fn(query=r["query"], doc=r["doc"], doc_ids=ids)[0], chunk_size=4,
        loss_kwargs={"doc_ids": ids})
    assert err <= TOL
    assert torch.allclose(result.loss, ref, rtol=1e-12)
    assert loss_fn.logit_scale.log_scale.grad.abs().item() > 0


def test_extra_negatives_bad_names():
    with pytest.raises(ConfigError, match="unknown term"):
        bb.InfoNCE(extra_negatives=("qd",))
    with pytest.raises(ConfigError, match="twice"):
        bb.InfoNCE(extra_negatives=["qq", "qq"])
    assert bb.InfoNCE(extra_negatives="dd, qq").extra_negatives == ("qq", "dd")


# ------------------------------------------------------------ token-budget chunks
def mixed_batch(n: int, seed: int, left: bool = False) -> dict[str, torch.Tensor]:
    """Short and long rows mixed (2 to 12 tokens)."""
    return token_batch(n, max_len=12, left=left, gen=torch.Generator().manual_seed(seed))


def test_token_bounds_fit_the_budget():
    batch = mixed_batch(20, 0)
    lengths = batch["attention_mask"].sum(1)
    for sort in (False, True):
        order = chunking.length_order(batch) if sort else None
        bounds = chunking.token_bounds(batch, 24, 100, name="doc", order=order)
        seq = lengths if order is None else lengths[order]
        assert bounds[0][0] == 0 and bounds[-1][1] == 20
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        for lo, hi in bounds:
            width = int(seq[lo:hi].max())
            assert (hi - lo) * width <= 24 or hi - lo == 1
            if hi < 20:  # the next row would not have fit
                assert (hi + 1 - lo) * int(seq[lo:hi + 1].max()) > 24 or hi - lo == 100
        sizes = {hi - lo for lo, hi in bounds}
        assert len(sizes) > 1  # rows per chunk vary with the lengths
    # a row cap still applies, and a row longer than the budget is alone
    assert all(hi - lo <= 2 for lo, hi in chunking.token_bounds(batch, 1000, 2, name="doc"))
    assert all(hi - lo == 1 for lo, hi in chunking.token_bounds(batch, 1, 100, name="doc"))
    # without trimming, every row counts the full width
    full = chunking.token_bounds(batch, 24, 100, name="doc", trim_padding=False)
    assert all(hi - lo == 2 for lo, hi in full)


@pytest.mark.parametrize("k,symmetric,sort", [(0, False, False), (2, True, True),
                                              (1, False, True)])
def test_token_chunks_exact_with_dropout(k, symmetric, sort):
    q_tower = TokenTower(p=0.1).to(DT).train()
    d_tower = TokenTower(p=0.1).to(DT).train()
    loss_fn = bb.InfoNCE(temperature=0.1, symmetric=symmetric).to(DT)
    inputs = {"query": mixed_batch(B, 1), "doc": mixed_batch(B * (1 + k), 2, left=True)}
    err, result, ref = engine_and_reference(
        {"query": q_tower, "doc": d_tower}, loss_fn, inputs,
        lambda r: loss_fn(query=r["query"], doc=r["doc"])[0], chunk_size=8,
        chunk_tokens={"query": 30, "doc": 20}, sort=sort)
    assert err <= TOL
    assert torch.allclose(result.loss, ref, rtol=1e-12)
    # the chunks really followed the budget: the reference used the same ones
    chunks, _ = engine_chunks(inputs["doc"], 8, 20, sort)
    assert len(chunks) > -(-B * (1 + k) // 8)
    assert all(c["input_ids"].numel() <= 20 or c["input_ids"].shape[0] == 1 for c in chunks)


def test_token_chunks_exact_multivector_and_matryoshka():
    tower = TokenVectors(p=0.1).to(DT).train()
    inner = bb.MaxSimInfoNCE(temperature=0.1, symmetric=True).to(DT)
    loss_fn = bb.Matryoshka(inner, dims=[8, 4])
    inputs = {"query": mixed_batch(B, 3), "doc": mixed_batch(B * 2, 4)}

    def ref(r):
        return sum(naive_maxsim_loss(inner, cut(r["query"], d), cut(r["doc"], d)) for d in (8, 4))

    err, result, ref_loss = engine_and_reference({"query": tower, "doc": tower}, loss_fn, inputs,
                                                 ref, chunk_size=6, chunk_tokens=25, sort=True)
    assert err <= TOL
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12)


def test_token_chunks_bad_inputs():
    tower = TokenTower().to(DT)
    with pytest.raises(ConfigError, match="positive integer"):
        bb.GradCache({"query": tower}, bb.InfoNCE(), chunk_size=2, chunk_tokens=0)
    with pytest.raises(ConfigError, match="unknown towers"):
        bb.GradCache({"query": tower}, bb.InfoNCE(), chunk_size=2, chunk_tokens={"dok": 8})

    class Custom(bb.GradCache):
        def split_inputs(self, name, inputs, chunk_size):
            return super().split_inputs(name, inputs, chunk_size)

    with pytest.raises(ConfigError, match="overridden split_inputs"):
        Custom({"query": tower}, bb.InfoNCE(), chunk_size=2, chunk_tokens=8)
    cache = bb.GradCache({"query": lambda x: x, "doc": lambda x: x}, bb.InfoNCE(),
                         chunk_size=2, chunk_tokens=8, collate_fn=torch.stack)
    with pytest.raises(InputError, match="raw examples"):
        cache.step(query=[torch.randn(4)] * 3, doc=[torch.randn(4)] * 3)
