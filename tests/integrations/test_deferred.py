"""gradcache_loss on toy towers, float64, dropout on: the returned loss's backward scales the
step's gradients by the gradient it receives and adds those of earlier micro-batches (as a
trainer's gradient accumulation and loss scaling ask); a failed step puts the earlier
gradients back; a DeepSpeed-wrapped tower is refused before any gradient; the evaluation
loss equals the loss of the step."""

from __future__ import annotations

import pytest
import torch
from helpers import DT, TokenTower, grads_of, token_batch, zero_grads
from torch import nn

import bigbatch as bb
from bigbatch.errors import ConfigError, InputError
from bigbatch.integrations.deferred import evaluation_loss, gradcache_loss


def setup(p: float = 0.1):
    tower = TokenTower(p=p).to(DT)
    loss_fn = bb.InfoNCE(temperature=0.1).to(DT)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3)
    return tower, loss_fn, cache


def batches(gen):
    return [dict(query=token_batch(7, gen=gen), doc=token_batch(7, gen=gen)) for _ in range(2)]


def test_scaled_accumulation_equals_the_engine_steps_scaled():
    gen = torch.Generator().manual_seed(0)
    data = batches(gen)
    tower, loss_fn, cache = setup()
    # reference: the engine's own steps, with a scaler that multiplies by the loop's factor
    factors = [0.5, 0.25]

    class Scale:
        def __init__(self, f):
            self.f = f

        def scale(self, t):
            return t * self.f

    torch.manual_seed(1)
    for batch, f in zip(data, factors):
        cache.scaler = Scale(f)
        cache.step(**batch)
    cache.scaler = None
    ref = grads_of(tower, loss_fn)
    zero_grads(tower, loss_fn)

    torch.manual_seed(1)
    losses = []
    for batch, f in zip(data, factors):
        loss = gradcache_loss(cache, **batch)
        (loss * f).backward()
        losses.append(loss.item())
    got = grads_of(tower, loss_fn)
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.allclose(got[k], ref[k], rtol=1e-10, atol=1e-14), k
    # without dropout, the evaluation loss is the step's loss
    tower.eval()
    with torch.no_grad():
        assert evaluation_loss(cache, **data[1]).item() == pytest.approx(
            gradcache_loss(cache, **data[1]).item(), rel=1e-12)


def test_a_failed_step_keeps_the_earlier_gradients():
    gen = torch.Generator().manual_seed(0)
    tower, loss_fn, cache = setup()
    gradcache_loss(cache, **batches(gen)[0]).backward()
    before = grads_of(tower, loss_fn)
    with pytest.raises(InputError):
        gradcache_loss(cache, query=token_batch(7, gen=gen))  # no documents
    after = grads_of(tower, loss_fn)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_a_deepspeed_engine_is_refused_before_any_gradient():
    engine_cls = type("DeepSpeedEngine", (nn.Module,), {"__module__": "deepspeed.runtime.engine"})

    class Engine(engine_cls):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kw):
            return self.module(**kw)

    tower = TokenTower().to(DT)
    cache = bb.GradCache({"query": Engine(tower), "doc": Engine(tower)}, bb.InfoNCE(), 3)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match="not under deepspeed"):
        gradcache_loss(cache, **batches(gen)[0])
    assert all(p.grad is None for p in tower.parameters())
