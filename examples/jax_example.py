"""GradCache for JAX in a hand-written loop: a small two-tower model trained with the cached
step and Optax AdamW on random pairs; the step jits into one program and equals
jax.value_and_grad of the whole batch's loss (checked on the first step)."""

import jax
import jax.numpy as jnp
import optax

from bigbatch.jax import InfoNCE, cached_value_and_grad, embed_batch


def tower(head):
    """embed_fn(params, chunk, rng) -> (rows, dim): a shared layer, dropout, a tower's head."""
    def embed(params, chunk, rng):
        h = jax.nn.gelu(chunk @ params["shared"])
        keep = jax.random.bernoulli(rng, 0.9, h.shape)  # dropout from the chunk's own key
        out = jnp.where(keep, h / 0.9, 0.0) @ params[head]
        return out / jnp.linalg.norm(out, axis=1, keepdims=True)
    return embed


embed = {"query": tower("query"), "doc": tower("doc")}  # two towers sharing "shared"
k0, k1, k2, k3 = jax.random.split(jax.random.key(0), 4)
params = {"shared": jax.random.normal(k0, (32, 64)) / 6, "query": jax.random.normal(k1, (64, 16)) / 8,
          "doc": jax.random.normal(k2, (64, 16)) / 8}

loss = InfoNCE(temperature=0.05)                # its temperature is learnable: a parameter
params = {**params, **loss.init_params()}       # {"shared", "query", "doc", "log_scale"}
step = jax.jit(cached_value_and_grad(embed, loss, chunk_size=16))

# 64 queries, each with its positive and one hard negative: [pos_0, neg_0, pos_1, neg_1, ...]
x = jax.random.normal(k3, (64, 32))
noise = jax.random.normal(jax.random.key(1), (128, 32))
docs = jnp.repeat(x, 2, axis=0) + noise * jnp.tile(jnp.array([[0.3], [3.0]]), (64, 1))
batch = {"query": x, "doc": docs}

# the first step equals plain value_and_grad of the whole batch (the same dropout keys)
value, metrics, grads = step(params, batch, jax.random.key(0))
reference, ref_grads = jax.value_and_grad(
    lambda p: loss(p, embed_batch(embed, p, batch, jax.random.key(0), 16))[0])(params)
error = max(float(jnp.max(jnp.abs(a - b))) for a, b in
            zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads)))
print(f"cached vs plain: loss {float(value):.6f} vs {float(reference):.6f}, "
      f"largest gradient difference {error:.1e}")

optimizer = optax.adamw(1e-2)
state = optimizer.init(params)
for i in range(3):
    value, metrics, grads = step(params, batch, jax.random.key(i))
    updates, state = optimizer.update(grads, state, params)
    params = loss.clamp(optax.apply_updates(params, updates))  # keep the temperature in bounds
    print(f"step {i}: loss {float(value):.4f}, accuracy {float(metrics['accuracy']):.2f}")
