"""bf16 and fp16 autocast paths (and fp16 with a GradScaler) run on the CPU and stay within a
stated tolerance of the float32 result.

Tolerance: the cosine similarity between the mixed-precision and the float32 gradient of
every parameter is at least 0.99, and the loss agrees to 2e-2 relative. Half-precision
towers carry ~3 significant digits (bf16: 8 mantissa bits), so element-wise equality is not
expected; the loss and surrogate themselves run in float32.
"""

from __future__ import annotations

import pytest
import torch
from helpers import TokenTower, grads_of, token_batch, zero_grads

import bigbatch as bb


def run(dtype, scaler=None):
    torch.manual_seed(0)
    tower = TokenTower(vocab=50, dim=32, out=16)
    loss_fn = bb.InfoNCE(temperature=0.05)
    gen = torch.Generator().manual_seed(1)
    inputs = {"query": token_batch(8, gen=gen), "doc": token_batch(16, gen=gen)}
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3,
                         autocast_dtype=dtype, scaler=scaler)
    zero_grads(tower, loss_fn)
    result = cache.step(**inputs)
    if scaler is not None:
        opt = torch.optim.SGD(list(tower.parameters()) + list(loss_fn.parameters()), lr=0.0)
        scaler.unscale_(opt)
    return result, grads_of(tower, loss_fn)


def cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_close_to_fp32(dtype):
    ref, ref_grads = run(None)
    got, grads = run(dtype)
    assert got.loss.dtype == torch.float32
    assert abs(got.loss.item() - ref.loss.item()) <= 2e-2 * abs(ref.loss.item())
    for name, g in ref_grads.items():
        assert grads[name].dtype == torch.float32
        assert cosine(grads[name], g) >= 0.99, name


def test_fp16_with_grad_scaler():
    ref, ref_grads = run(None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    got, grads = run(torch.float16, scaler=scaler)
    assert abs(got.loss.item() - ref.loss.item()) <= 2e-2 * abs(ref.loss.item())
    for name, g in ref_grads.items():  # unscaled: the same magnitude as float32
        assert cosine(grads[name], g) >= 0.99, name
        assert torch.allclose(grads[name].norm(), g.norm(), rtol=5e-2)


def test_scaler_scales_the_cached_gradient():
    _, plain = run(torch.float16)
    torch.manual_seed(0)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    tower = TokenTower(vocab=50, dim=32, out=16)
    loss_fn = bb.InfoNCE(temperature=0.05)
    gen = torch.Generator().manual_seed(1)
    inputs = {"query": token_batch(8, gen=gen), "doc": token_batch(16, gen=gen)}
    bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=3,
                 autocast_dtype=torch.float16, scaler=scaler).step(**inputs)
    scaled = grads_of(tower, loss_fn)
    for name in plain:
        assert torch.allclose(scaled[name] / 256.0, plain[name], rtol=1e-2, atol=1e-6)
