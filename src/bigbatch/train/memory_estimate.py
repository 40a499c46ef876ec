"""Estimate the peak memory one GradCache step adds, from shapes and one measured probe chunk.

What a step must hold at its peak (the loss's backward, while the last chunk's graph is
kept for reuse) and nothing that grows faster with the batch:

- the cached embeddings of every tower and their gradients (``rows x dim`` each, float32
  or wider: the engine upcasts 16-bit embeddings);
- one random state per replayed chunk (the CPU generator's 5,056 bytes, plus 16 per
  accelerator);
- the parameters' gradients (a step writes them; not there before the first step);
- one chunk's activations (measured on a probe chunk with :func:`activation_bytes`);
- one block of the streamed loss: ``rows_per_block x N`` logits in the embeddings' dtype,
  plus one byte each for the mask of excluded columns (``doc_ids`` or a margin), under the
  block rule of :mod:`bigbatch.losses.blockwise`; the dense loss holds about four ``B x N``
  tensors instead;
- a negative queue's documents (``--negative-queue``), more columns of the loss and their
  embeddings and ids held a few times (:func:`~bigbatch.engine.sizing.queue_bytes`).

Everything here is arithmetic on sizes except :func:`activation_bytes`, which runs the
given function once. The inputs are not counted: they exist before the step, and the
engine takes each chunk from them as a view (or, with ``sort_by_length``, gathers it when it
is embedded), never a copy of the whole batch. :class:`StepMemory` and
:func:`activation_bytes` live in :mod:`bigbatch.engine.sizing` (which sizes the chunks of
``--grad-cache-chunk auto`` from them) and are named here too.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..engine.sizing import (
    CPU_RNG_STATE_BYTES,
    DEVICE_RNG_STATE_BYTES,
    StepMemory,
    activation_bytes,
    queue_bytes,
)
from ..losses.layout import MAX_BLOCK_LOGITS, loss_block_bytes

__all__ = ["StepMemory", "estimate_step_memory", "activation_bytes", "CPU_RNG_STATE_BYTES"]


def estimate_step_memory(rows: Mapping[str, int], dims: int | Mapping[str, int], *,
                         chunk_size: int | Mapping[str, int], chunk_activation_bytes: int,
                         parameter_bytes: int = 0, loss_rows: int | None = None,
                         loss_columns: int | None = None, block_size: int | None = None,
                         dense: bool = False, max_block_logits: int = MAX_BLOCK_LOGITS,
                         masked: bool = False, element_size: int = 4,
                         accelerators: int = 0, queued_rows: int = 0) -> StepMemory:
    """Estimate the memory one step adds at its peak.

    Args:
        rows: rows per tower in the step, e.g. ``{"query": B, "doc": B * (1 + k)}``.
        dims: embedding width, one for all towers or per tower.
        chunk_size: rows per chunk, one for all towers or per tower (random states are kept
            for every chunk but the last of the last tower).
        chunk_activation_bytes: one chunk's activations, e.g. from :func:`activation_bytes`.
        parameter_bytes: bytes of the trainable parameters (their gradients are written).
        loss_rows, loss_columns: the loss's rows and columns (default: the first and the
            last tower's row counts, as InfoNCE scores queries against documents).
        block_size, dense, max_block_logits: the loss's block options (as in
            :class:`bigbatch.InfoNCE`).
        masked: the loss excludes columns (``doc_ids`` or ``false_negative_margin``).
        element_size: bytes per embedding and logit element (4 for float32).
        accelerators: accelerator devices whose random state each chunk records.
        queued_rows: a negative queue's documents (``--negative-queue`` steps of the global
            batch's): extra columns of the loss, their embeddings and ids held
            :data:`~bigbatch.engine.sizing.QUEUE_COPIES` times
            (:func:`~bigbatch.engine.sizing.queue_bytes`).

    Returns:
        :class:`StepMemory`; ``.total`` is the estimate in bytes.
    """
    names = list(rows)
    dim = {n: dims[n] if isinstance(dims, Mapping) else dims for n in names}
    chunk = {n: chunk_size[n] if isinstance(chunk_size, Mapping) else chunk_size for n in names}
    emb = sum(rows[n] * dim[n] for n in names) * element_size
    chunks = sum(-(-rows[n] // chunk[n]) for n in names) - 1
    rng = max(chunks, 0) * (CPU_RNG_STATE_BYTES + accelerators * DEVICE_RNG_STATE_BYTES)
    b = rows[names[0]] if loss_rows is None else loss_rows
    n = rows[names[-1]] if loss_columns is None else loss_columns
    loss = loss_block_bytes(b, n + queued_rows, block_size, dense, max_block_logits, masked,
                            element_size)
    queue = queue_bytes(queued_rows, dim[names[-1]] * element_size)
    return StepMemory(embeddings=emb, embedding_grads=emb, rng_states=rng,
                      parameter_grads=parameter_bytes, chunk_activations=chunk_activation_bytes,
                      loss_block=loss, negative_queue=queue)

