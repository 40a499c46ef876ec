"""Dropout replay: the cached and the replayed forward draw bitwise-identical masks, and the
gradient equals the reference computed with those same masks."""

from __future__ import annotations

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


class RecordingDropout(nn.Module):
    """Dropout that records each mask it draws (as the zero pattern of its output)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.masks: list[torch.Tensor] = []

    def forward(self, x):
        y = nn.functional.dropout(x, self.p, self.training)
        self.masks.append((y != 0).detach().clone())
        return y


class DropoutTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.drop1 = RecordingDropout(0.3)
        self.lin = nn.Linear(16, 16)
        self.drop2 = RecordingDropout(0.3)
        self.out = nn.Linear(16, 8)

    def forward(self, input_ids, attention_mask):
        h = self.drop1(self.emb(input_ids))
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1)
        return nn.functional.normalize(self.out(self.drop2(torch.tanh(self.lin(pooled)))), dim=-1)


def test_replayed_masks_are_bitwise_identical():
    tower = DropoutTower().to(DT).train()
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": token_batch(7), "doc": token_batch(14)}
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3,
                         reuse_last_chunk=False)
    cache.step(**inputs)
    n_chunks = 3 + 5
    for layer in (tower.drop1, tower.drop2):
        first, replay = layer.masks[:n_chunks], layer.masks[n_chunks:]
        assert len(replay) == n_chunks
        for a, b in zip(first, replay):
            assert torch.equal(a, b)
    # dropout really drew different masks for different chunks of equal shape
    assert tower.drop2.masks[0].shape == tower.drop2.masks[1].shape
    assert not torch.equal(tower.drop2.masks[0], tower.drop2.masks[1])


@pytest.mark.parametrize("reuse_last_chunk", [False, True])
def test_gradient_equals_reference_with_same_masks(reuse_last_chunk):
    tower = DropoutTower().to(DT).train()
    loss_fn = bb.InfoNCE(symmetric=True).to(DT)
    inputs = {"query": token_batch(7), "doc": token_batch(14)}
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3,
                         reuse_last_chunk=reuse_last_chunk)
    torch.manual_seed(7)
    zero_grads(tower, loss_fn)
    result = cache.step(**inputs)
    got = grads_of(tower, loss_fn)

    # reference: the same chunks in the same order with gradients on, from the same seed,
    # so every chunk draws the masks the engine's first pass drew
    torch.manual_seed(7)
    zero_grads(tower, loss_fn)
    chunked = {"query": trimmed_chunks(inputs["query"], 3), "doc": trimmed_chunks(inputs["doc"], 3)}
    ref_loss = reference_step({"query": tower, "doc": tower}, loss_fn, inputs, chunked=chunked)
    assert max_rel_err(got, grads_of(tower, loss_fn)) <= 1e-10
    assert torch.allclose(result.loss, ref_loss, rtol=1e-12)

    # and the masks matter: a different seed gives a different gradient
    torch.manual_seed(8)
    zero_grads(tower, loss_fn)
    reference_step({"query": tower, "doc": tower}, loss_fn, inputs, chunked=chunked)
    assert max_rel_err(got, grads_of(tower, loss_fn), record=False) > 1e-3


def test_replay_leaves_the_outer_random_stream_untouched():
    tower = DropoutTower().to(DT).train()
    loss_fn = bb.InfoNCE().to(DT)
    inputs = {"query": token_batch(4), "doc": token_batch(4)}
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=2)
    torch.manual_seed(3)
    cache.step(**inputs)
    after_step = torch.rand(5)
    # the same first pass without replays consumes the same random numbers
    torch.manual_seed(3)
    with torch.no_grad():
        for c in trimmed_chunks(inputs["query"], 2) + trimmed_chunks(inputs["doc"], 2):
            tower(**c)
    assert torch.equal(after_step, torch.rand(5))
