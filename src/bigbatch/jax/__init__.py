"""GradCache for JAX (``pip install -e ".[jax]"`` from a clone): the exact large-batch contrastive step
of bigbatch for Flax and Optax users, on one device or many.

Public names::

    cached_value_and_grad(embed_fn, loss_fn, chunk_size)   # the step on one device
    sharded_value_and_grad(embed_fn, loss_fn, chunk_size, mesh)   # under shard_map
    embed_batch(embed_fn, params, batch, rng, chunk_size)  # the unchunked reference
    chunk_key(rng, tower_index, chunk_index)               # a chunk's random key
    InfoNCE, cross_entropy_sum, id_codes                   # the loss (bigbatch.InfoNCE's)

The Flax all-MiniLM-L6-v2 encoder is in :mod:`bigbatch.jax.bert`, and
:mod:`bigbatch.jax.encode` puts a Flax model behind bigbatch's evaluation interface. A front
end beside the command line: nothing else in bigbatch imports this package, and it imports no
torch (an import-linter contract in ``pyproject.toml`` says so). It needs ``jax`` (and
``flax``, ``tokenizers`` and ``safetensors`` for the model). The SciFact demo, which trains on
bigbatch's batches and is scored by its evaluation, is ``examples/jax_demo.py`` (``make
demo-jax``).
"""

from .losses import InfoNCE, cross_entropy_sum, id_codes
from .sharded import sharded_value_and_grad
from .step import cached_value_and_grad, chunk_key, embed_batch

__all__ = ["cached_value_and_grad", "sharded_value_and_grad", "embed_batch", "chunk_key",
           "InfoNCE", "cross_entropy_sum", "id_codes"]
