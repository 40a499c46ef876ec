"""A small JAX tower for the tests of bigbatch.jax: a two-layer perceptron with dropout, the
query and document towers sharing the first layer (shared parameters, different functions),
and the float64 reference: ``jax.value_and_grad`` of the loss on the whole batch embedded
in one pass (:func:`bigbatch.jax.embed_batch`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from helpers import ERRORS

from bigbatch.jax import embed_batch

DIM_IN, HIDDEN, DIM = 6, 16, 5
DROPOUT = 0.2


def init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {"shared": jax.random.normal(k[0], (DIM_IN, HIDDEN)) * 0.5,
            "query": jax.random.normal(k[1], (HIDDEN, DIM)) * 0.5,
            "doc": jax.random.normal(k[2], (HIDDEN, DIM)) * 0.5}


def _tower(head: str):
    def embed(params: dict, chunk: dict, rng: jax.Array) -> jax.Array:
        h = jnp.tanh(chunk["x"] @ params["model"]["shared"])
        keep = jax.random.bernoulli(rng, 1 - DROPOUT, h.shape)
        h = jnp.where(keep, h / (1 - DROPOUT), 0.0)
        out = h @ params["model"][head]
        return out / jnp.linalg.norm(out, axis=1, keepdims=True)
    return embed


EMBED = {"query": _tower("query"), "doc": _tower("doc")}


def batch(b: int, k: int, seed: int = 1) -> dict:
    kq, kd = jax.random.split(jax.random.key(seed))
    return {"query": {"x": jax.random.normal(kq, (b, DIM_IN))},
            "doc": {"x": jax.random.normal(kd, (b * (1 + k), DIM_IN))}}


def reference(loss, params, data, rng, chunk_size, **loss_inputs):
    """(loss, metrics, grads) of jax.value_and_grad on the unchunked graph."""
    def value(p):
        return loss(p, embed_batch(EMBED, p, data, rng, chunk_size), **loss_inputs)
    (val, metrics), grads = jax.jit(jax.value_and_grad(value, has_aux=True))(params)
    return val, metrics, grads


def max_rel_error(got, ref, record: bool = True) -> float:
    """Largest |got - ref| / max|ref| over the leaves (each reference leaf non-zero), recorded
    in the suite's float64 error summary."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    worst = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0, "a zero reference would not catch errors"
        worst = max(worst, float(jnp.max(jnp.abs(g - r))) / scale)
    if record and all(r.dtype == jnp.float64 for r in jax.tree_util.tree_leaves(ref)):
        ERRORS.append(worst)
    return worst
