"""cached_value_and_grad against jax.value_and_grad of the unchunked loss, float64, dropout on:
chunk sizes (1, not dividing, larger than the batch), k = 0 and 2 hard negatives, symmetric,
streamed, ids; and the bad inputs it refuses before any gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from toy import EMBED, batch, init, max_rel_error, reference

from bigbatch.errors import ConfigError, InputError, ShapeError
from bigbatch.jax import InfoNCE, cached_value_and_grad, chunk_key, embed_batch

B = 7


def run(loss, chunk, k, symmetric=False, **loss_inputs):
    params = {"model": init(), **loss.init_params(jnp.float64)}
    data = batch(B, k)
    rng = jax.random.key(5)
    step = jax.jit(cached_value_and_grad(EMBED, loss, chunk))
    got = step(params, data, rng, **loss_inputs)
    ref = reference(loss, params, data, rng, chunk, **loss_inputs)
    return got, ref


@pytest.mark.parametrize("chunk", [1, 3, 100])
@pytest.mark.parametrize("k", [0, 2])
def test_equals_unchunked_value_and_grad(chunk, k):
    (loss, metrics, grads), (r_loss, r_metrics, r_grads) = run(InfoNCE(temperature=0.1), chunk, k)
    assert abs(float(loss) - float(r_loss)) <= 1e-12 * abs(float(r_loss))
    assert max_rel_error(grads, r_grads) < 1e-10
    assert grads["log_scale"] != 0  # the temperature's own gradient is in
    for name in r_metrics:
        assert float(metrics[name]) == pytest.approx(float(r_metrics[name]), rel=1e-10, abs=1e-14)


def test_symmetric_streamed_with_ids():
    ids = jnp.asarray([0, 1, 2, 0, 4, 5, 6, 7, 2, 9, 10, 11, 12, 13])  # B=7, k=1
    loss = InfoNCE(temperature=0.1, symmetric=True, block_size=2)
    (value, metrics, grads), (r_value, _, r_grads) = run(loss, 3, 1, doc_ids=ids)
    assert abs(float(value) - float(r_value)) <= 1e-12 * abs(float(r_value))
    assert max_rel_error(grads, r_grads) < 1e-10
    assert float(metrics["masked"]) > 0


def test_dropout_is_on_and_keys_differ_per_chunk_and_tower():
    loss = InfoNCE(temperature=0.1)
    params = {"model": init(), **loss.init_params(jnp.float64)}
    step = jax.jit(cached_value_and_grad(EMBED, loss, 3))
    a = step(params, batch(B, 1), jax.random.key(0))[0]
    b = step(params, batch(B, 1), jax.random.key(1))[0]
    assert float(a) != float(b)  # a different key, a different dropout mask
    keys = {str(jax.random.key_data(chunk_key(jax.random.key(0), t, i))) for t in (0, 1)
            for i in (0, 1)}
    assert len(keys) == 4


def test_a_plain_scalar_loss_and_one_embed_function():
    def loss(params, reps):
        return jnp.sum(reps["a"] * reps["b"]) + params["w"] ** 2

    def embed(params, x, rng):
        return jnp.tanh(x * params["w"]) * jax.random.uniform(rng, x.shape)

    params = {"w": jnp.asarray(0.7)}
    data = {"a": jnp.arange(10.0).reshape(5, 2), "b": jnp.ones((5, 2))}
    value, metrics, grads = jax.jit(cached_value_and_grad(embed, loss, 2))(
        params, data, jax.random.key(0))
    ref, ref_grads = jax.jit(jax.value_and_grad(
        lambda p: loss(p, embed_batch(embed, p, data, jax.random.key(0), 2))))(params)
    assert metrics == {}
    assert abs(float(value - ref)) < 1e-12
    assert max_rel_error(grads, ref_grads) < 1e-10


def test_bad_inputs_raise_before_any_gradient():
    loss = InfoNCE()
    params = {"model": init(), **loss.init_params(jnp.float64)}
    rng = jax.random.key(0)
    with pytest.raises(ConfigError, match="chunk_size"):
        cached_value_and_grad(EMBED, loss, 0)
    step = cached_value_and_grad(EMBED, loss, 3)
    with pytest.raises(InputError, match=r"\['doc'\]"):
        step(params, {"query": batch(B, 0)["query"]}, rng)
    bad = batch(B, 0)
    bad["doc"] = {"x": bad["doc"]["x"], "y": jnp.ones((B + 1, 2))}
    with pytest.raises(ShapeError, match="disagree on the number of rows"):
        step(params, bad, rng)
    narrow = {"query": EMBED["query"], "doc": lambda p, c, r: EMBED["doc"](p, c, r)[:, :3]}
    with pytest.raises(ShapeError, match="different widths"):
        cached_value_and_grad(narrow, loss, 3)(params, batch(B, 0), rng)
    flat = {"query": EMBED["query"], "doc": lambda p, c, r: EMBED["doc"](p, c, r)[0]}
    with pytest.raises(ShapeError, match=r"must return \(3, dim\)"):
        cached_value_and_grad(flat, loss, 3)(params, batch(B, 0), rng)
    with pytest.raises(ShapeError, match="multiple of the query count"):
        step(params, {"query": batch(B, 0)["query"], "doc": {"x": jnp.ones((B + 1, 6))}}, rng)
