"""Run by test_jax_sharded.py in a fresh process (XLA_FLAGS must be set before jax starts):
the sharded step on N host devices against the one-device cached step and the unchunked
reference, float64, dropout on. Prints the largest relative error; exits 1 on a failure."""

from __future__ import annotations

import os
import sys

DEVICES = int(sys.argv[1])
os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={DEVICES} "
                           "--xla_backend_optimization_level=0")
sys.path[:0] = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

jax.config.update("jax_enable_x64", True)

from toy import EMBED, batch, init, reference  # noqa: E402

from bigbatch.errors import ShapeError  # noqa: E402
from bigbatch.jax import InfoNCE, cached_value_and_grad, sharded_value_and_grad  # noqa: E402


def rel(got, ref) -> float:
    out = 0.0
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        out = max(out, float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r))))
    return out


def main() -> int:
    assert jax.device_count() == DEVICES, jax.devices()
    mesh = jax.make_mesh((DEVICES,), ("batch",))
    b, k, chunk = 8, 1, 2
    data = batch(b, k)
    ids = jnp.arange(b * (1 + k)).at[5].set(0)  # a duplicate of query 0's positive
    rng = jax.random.key(7)
    worst = 0.0
    info = InfoNCE(temperature=0.1, symmetric=True, block_size=3)

    def generic(params, reps, doc_ids):  # no sharded_part: computed whole on every device
        return info(params, reps, doc_ids=doc_ids)

    params = {"model": init(), **info.init_params(jnp.float64)}
    ref = reference(info, params, data, rng, chunk, doc_ids=ids)
    one = jax.jit(cached_value_and_grad(EMBED, info, chunk))(params, data, rng, doc_ids=ids)
    for loss, others in ((info, (one, ref)), (generic, (ref,))):
        step = sharded_value_and_grad(EMBED, loss, chunk, mesh)
        value, metrics, grads = step(params, data, rng, doc_ids=ids)
        for other in others:
            errors = {"loss": abs(float(value) - float(other[0])) / abs(float(other[0])),
                      "gradients": rel(grads, other[2]), "metrics": rel(metrics, other[1])}
            print({k: f"{v:.1e}" for k, v in errors.items()})
            worst = max(worst, *errors.values())
        assert float(metrics["masked"]) > 0
    print(f"devices {DEVICES}: largest relative error {worst:.3e}")
    try:
        sharded_value_and_grad(EMBED, info, chunk, mesh)(params, batch(DEVICES + 1, k), rng)
    except ShapeError as e:
        print(f"refused: {e}")
    else:
        print("a batch that does not split over the devices was accepted")
        return 1
    return 0 if worst < 1e-10 else 1


if __name__ == "__main__":
    raise SystemExit(main())
