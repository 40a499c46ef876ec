"""The luyug-style functional API gives the same float64 gradients as the full batch."""

from __future__ import annotations

import pytest
import torch
from helpers import DT, TokenTower, grads_of, max_rel_err, reference_step, token_batch, zero_grads

import bigbatch as bb
from bigbatch.errors import InputError


def test_cached_decorator_matches_reference_with_dropout():
    tower = TokenTower(p=0.2).to(DT).train()
    loss_fn = bb.InfoNCE(symmetric=True).to(DT)
    q, d = token_batch(6), token_batch(12)

    @bb.functional.cached
    def embed(model, batch):
        return model(**batch)

    @bb.functional.cat_input_tensor
    def loss(query, doc):
        return loss_fn(query=query, doc=doc)[0]

    def chunks(batch, size):
        return [{k: v[i:i + size] for k, v in batch.items()}
                for i in range(0, batch["input_ids"].shape[0], size)]

    torch.manual_seed(5)
    zero_grads(tower, loss_fn)
    q_out = [embed(tower, c) for c in chunks(q, 4)]
    d_out = [embed(tower, c) for c in chunks(d, 4)]
    value = loss([r for r, _ in q_out], [r for r, _ in d_out])
    value.backward()
    for _, replay in q_out + d_out:
        replay()
    got = grads_of(tower, loss_fn)

    torch.manual_seed(5)
    zero_grads(tower, loss_fn)
    ref = reference_step({"query": tower, "doc": tower}, loss_fn, {"query": q, "doc": d},
                         chunked={"query": chunks(q, 4), "doc": chunks(d, 4)})
    assert torch.allclose(value.detach(), ref, rtol=1e-12)
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= 1e-10


def test_replay_without_gradient_is_an_error():
    tower = TokenTower().to(DT)
    reps, replay = bb.functional.cached(lambda b: tower(**b))(token_batch(2))
    assert reps.requires_grad and reps.grad_fn is None
    with pytest.raises(InputError, match="no gradient yet"):
        replay()
