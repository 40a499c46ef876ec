"""GradCache for JAX (``pip install bigbatch[jax]``): the exact large-batch contrastive step
of bigbatch for Flax and Optax users, on one device or many.

Public names::

    cached_value_and_grad(embed_fn, loss_fn, chunk_size)   # the step on one device
    sharded_value_and_grad(embed_fn, loss_fn, chunk_size, mesh)   # under shard_map
    embed_batch(embed_fn, params, batch, rng, chunk_size)  # the unchunked reference
    chunk_key(rng, tower_index, chunk_index)               # a chunk's random key
    InfoNCE, cross_entropy_sum, id_codes                   # the loss (bigbatch.InfoNCE's)

The Flax all-MiniLM-L6-v2 encoder is in :mod:`bigbatch.jax.bert`, the SciFact demo in
:mod:`bigbatch.jax.demo` (``make demo-jax``). Nothing else in bigbatch imports this package;
it needs ``jax`` (and ``flax``, ``optax`` for the model and the demo).
"""

from .losses import InfoNCE, cross_entropy_sum, id_codes
from .sharded import sharded_value_and_grad
from .step import cached_value_and_grad, chunk_key, embed_batch

__all__ = ["cached_value_and_grad", "sharded_value_and_grad", "embed_batch", "chunk_key",
           "InfoNCE", "cross_entropy_sum", "id_codes"]
