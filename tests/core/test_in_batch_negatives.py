"""InfoNCE without in-batch negatives (each query against its own positive and hard
negatives only), streamed and dense, against a hand-written reference in float64; and the
engine fed steps whose number of hard negatives differs (a mix's sources), each step's
gradient equal to the unchunked reference."""

from __future__ import annotations

import pytest
import torch

import bigbatch as bb
from bigbatch.losses import InfoNCE


def reference(q, d, k, scale):
    """Each query's softmax over its own group [pos, neg_1..neg_k] only."""
    losses = []
    for i in range(q.shape[0]):
        group = d[i * (k + 1):(i + 1) * (k + 1)]
        logits = scale * (group @ q[i])
        losses.append(torch.logsumexp(logits, 0) - logits[0])
    return torch.stack(losses).mean()


@pytest.mark.parametrize("block_size", [0, 2, None])
@pytest.mark.parametrize("k", [1, 3])
def test_own_group_only_matches_the_reference(block_size, k):
    g = torch.Generator().manual_seed(k)
    q = torch.randn(5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    d = torch.randn(5 * (k + 1), 8, generator=g, dtype=torch.float64, requires_grad=True)
    loss_fn = InfoNCE(temperature=0.1, learnable_temperature=False, block_size=block_size,
                      in_batch_negatives=False).double()
    loss, metrics = loss_fn(query=q, doc=d)
    ref = reference(q, d, k, loss_fn.logit_scale().detach().double())
    gq, gd = torch.autograd.grad(loss, (q, d))
    rq, rd = torch.autograd.grad(ref, (q, d))
    assert torch.allclose(loss, ref, rtol=1e-10, atol=0)
    assert torch.allclose(gq, rq, rtol=1e-10, atol=1e-14)
    assert torch.allclose(gd, rd, rtol=1e-10, atol=1e-14)
    assert metrics["inbatch_neg_sim"] == 0 and metrics["masked"] == 5 * (5 * (k + 1) - 1) - 5 * k
    # with in-batch negatives the loss differs: the option is what changes it
    loss_fn.in_batch_negatives = True
    assert not torch.allclose(loss_fn(query=q, doc=d)[0], ref)


def test_the_engine_takes_steps_of_different_hard_negative_counts():
    """A mix's steps differ in k (and in in-batch negatives); each step's gradient equals
    the unchunked reference (dropout replay is tested in test_dropout_replay.py)."""
    torch.manual_seed(0)
    enc = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh()).double()
    loss_fn = bb.InfoNCE(temperature=0.05, learnable_temperature=False)
    cache = bb.GradCache({"query": enc, "doc": enc}, loss_fn, chunk_size=3)
    for step, (k, in_batch) in enumerate([(2, True), (0, True), (1, False), (3, True)]):
        g = torch.Generator().manual_seed(step)
        q = torch.randn(4, 6, generator=g, dtype=torch.float64)
        d = torch.randn(4 * (1 + k), 6, generator=g, dtype=torch.float64)
        loss_fn.in_batch_negatives = in_batch
        enc.zero_grad()
        cache.step(query=q, doc=d)
        got = [p.grad.clone() for p in enc.parameters()]
        enc.zero_grad()
        ref, _ = loss_fn(query=enc(q), doc=enc(d))
        ref.backward()
        for a, b in zip(got, (p.grad for p in enc.parameters())):
            assert torch.allclose(a, b, rtol=1e-10, atol=1e-13), (k, in_batch)

