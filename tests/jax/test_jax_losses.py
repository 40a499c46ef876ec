"""bigbatch.jax.InfoNCE against torch's bigbatch.InfoNCE: the same numbers in, the same loss,
gradients (queries, documents, temperature) and metrics out, in float64; and its options."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from toy import max_rel_error

import bigbatch as bb
from bigbatch.errors import ConfigError, InputError, ShapeError
from bigbatch.jax import InfoNCE

CASES = [  # (k, symmetric, with ids, margin, block_size)
    (0, False, False, None, None),
    (2, False, False, None, 3),
    (2, True, False, None, 2),
    (1, True, True, None, 3),
    (2, False, True, 0.05, 0),
    (0, True, True, 0.1, 1),
]


def numbers(b: int, k: int, seed: int = 0):
    g = np.random.default_rng(seed)
    q = g.standard_normal((b, 8))
    d = g.standard_normal((b * (1 + k), 8))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    d /= np.linalg.norm(d, axis=1, keepdims=True)
    d[5] = d[0]  # a passage twice in the batch: masked by ids, and a margin case
    ids = np.arange(b * (1 + k))
    ids[5] = 0
    return q, d, ids


@pytest.mark.parametrize("k,symmetric,with_ids,margin,block", CASES)
def test_same_loss_gradients_and_metrics_as_torch(k, symmetric, with_ids, margin, block):
    q, d, ids = numbers(7, k)
    kw = dict(temperature=0.05, symmetric=symmetric, false_negative_margin=margin,
              block_size=block)
    t_loss = bb.InfoNCE(**kw).double()
    tq = torch.tensor(q, requires_grad=True)
    td = torch.tensor(d, requires_grad=True)
    t_out = t_loss(query=tq, doc=td, doc_ids=torch.tensor(ids) if with_ids else None)
    t_out.loss.backward()

    j_loss = InfoNCE(**kw)
    # torch keeps the log scale in float32 (then .double()): start from the same number
    params = {"log_scale": jnp.asarray(t_loss.logit_scale.log_scale.item())}

    def value(p, qq, dd):
        return j_loss(p, {"query": qq, "doc": dd}, doc_ids=jnp.asarray(ids) if with_ids else None)

    (loss, metrics), (g_p, g_q, g_d) = jax.jit(jax.value_and_grad(
        value, argnums=(0, 1, 2), has_aux=True))(params, q, d)
    assert abs(float(loss) - t_out.loss.item()) <= 1e-12 * abs(t_out.loss.item())
    err = max_rel_error({"q": g_q, "d": g_d, "s": g_p["log_scale"]},
                        {"q": jnp.asarray(tq.grad.numpy()), "d": jnp.asarray(td.grad.numpy()),
                         "s": jnp.asarray(t_loss.logit_scale.log_scale.grad.numpy())})
    assert err < 1e-10
    assert sorted(metrics) == sorted(t_out.metrics)
    for name, v in t_out.metrics.items():
        assert float(metrics[name]) == pytest.approx(v.item(), rel=1e-10, abs=1e-12), name
    if with_ids:
        assert float(metrics["masked"]) > 0  # the duplicate really was masked


def test_string_ids_are_coded_like_integer_ids():
    q, d, ids = numbers(4, 1)
    names = [f"p{i}" for i in ids]
    loss = InfoNCE(temperature=0.1)
    params = loss.init_params(jnp.float64)
    by_names = loss(params, {"query": q, "doc": d}, doc_ids=names)
    by_ints = loss(params, {"query": q, "doc": d}, doc_ids=jnp.asarray(ids))
    plain = loss(params, {"query": q, "doc": d})
    assert float(by_names[0]) == float(by_ints[0]) != float(plain[0])
    assert float(by_names[1]["masked"]) == 1


def test_streamed_equals_dense_and_fixed_temperature():
    q, d, _ = numbers(9, 2)
    reps = {"query": q, "doc": d}
    dense = InfoNCE(dense=True, learnable_temperature=False, temperature=2.0)
    assert dense.init_params() == {}
    streamed = InfoNCE(block_size=4, learnable_temperature=False, temperature=2.0)
    (a, _), ga = jax.jit(jax.value_and_grad(lambda r: dense({}, r), has_aux=True))(reps)
    (b, _), gb = jax.jit(jax.value_and_grad(lambda r: streamed({}, r), has_aux=True))(reps)
    assert abs(float(a) - float(b)) < 1e-12
    assert max_rel_error(gb, ga) < 1e-10


def test_clamp_keeps_the_temperature_in_bounds():
    loss = InfoNCE(temperature=0.05, max_scale=100.0)
    params = {"w": jnp.ones(2), "log_scale": jnp.asarray(9.0)}
    assert float(loss.clamp(params)["log_scale"]) == pytest.approx(math.log(100.0))
    assert float(loss.clamp({**params, "log_scale": jnp.asarray(-1.0)})["log_scale"]) == 0.0
    assert float(loss.init_params()["log_scale"]) == pytest.approx(math.log(20.0))


def test_bad_inputs():
    q, d, _ = numbers(4, 1)
    loss = InfoNCE()
    params = loss.init_params()
    with pytest.raises(ShapeError, match="multiple of the query count"):
        loss(params, {"query": q, "doc": d[:7]})
    with pytest.raises(ShapeError, match="same space"):
        loss(params, {"query": q, "doc": d[:, :5]})
    with pytest.raises(InputError, match="log_scale"):
        loss({}, {"query": q, "doc": d})
    with pytest.raises(InputError, match="'query' and 'doc'"):
        loss(params, {"doc": d})
    with pytest.raises(ShapeError, match="doc_ids has 3 entries"):
        loss(params, {"query": q, "doc": d}, doc_ids=jnp.arange(3))
    with pytest.raises(ConfigError, match="learnable temperature"):
        InfoNCE(temperature=0.001)
    with pytest.raises(ConfigError, match="block_size"):
        InfoNCE(block_size=-1)
    with pytest.raises(ConfigError, match="false_negative_margin"):
        InfoNCE(false_negative_margin=float("nan"))
