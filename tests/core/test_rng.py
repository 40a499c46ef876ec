"""RandContext captures and replays the CPU generator (and accelerators when present)."""

from __future__ import annotations

import torch

from bigbatch.engine.rng import RandContext, devices_of


def test_replays_cpu_random_numbers_and_restores_outer_state():
    torch.manual_seed(0)
    ctx = RandContext(torch.zeros(2))
    first = torch.rand(4)
    outer_next = torch.rand(3)
    torch.manual_seed(0)
    torch.rand(4)
    with ctx:
        replayed = torch.rand(4)
    # the outer stream continues as if the replay had not happened
    assert torch.equal(replayed, first)
    assert torch.equal(torch.rand(3), outer_next)


def test_nested_and_reused_contexts():
    torch.manual_seed(1)
    ctx = RandContext()
    a = torch.rand(2)
    with ctx:
        with ctx:
            b = torch.rand(2)
        c = torch.rand(2)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_devices_of_finds_no_accelerator_on_cpu_tensors():
    assert devices_of({"x": torch.zeros(1), "y": [torch.ones(2)]}) == []
    ctx = RandContext({"x": torch.zeros(1)})
    if not (hasattr(torch, "accelerator") and torch.accelerator.is_available()):
        assert ctx.devices == [] and ctx.device_states == []


def test_dropout_mask_replay():
    drop = torch.nn.Dropout(0.5)
    x = torch.ones(64)
    ctx = RandContext(x)
    y1 = drop(x)
    with ctx:
        y2 = drop(x)
    assert torch.equal(y1, y2)
    assert not torch.equal(y1, drop(x))
