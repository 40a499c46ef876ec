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
  tensors instead.

Everything here is arithmetic on sizes except :func:`activation_bytes`, which runs the
given function once. The inputs are not counted: they exist before the step, and the engine
takes each chunk from them as a view (or, with ``sort_by_length``, gathers it when it is
embedded), never a copy of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..losses.layout import MAX_BLOCK_LOGITS, rows_per_block

__all__ = ["StepMemory", "estimate_step_memory", "activation_bytes", "CPU_RNG_STATE_BYTES"]

CPU_RNG_STATE_BYTES = 5056
"""Size of ``torch.get_rng_state()``: what each replayed chunk's CPU random state holds."""

_DEVICE_RNG_STATE_BYTES = 16  # a CUDA (Philox) generator: seed and offset
_DENSE_COPIES = 4  # B x N tensors alive in the dense loss's backward (similarities, logits,
#                    their softmax, its gradient)


@dataclass(frozen=True)
class StepMemory:
    """Bytes one step adds at its peak, by part (see the module docstring)."""

    embeddings: int
    embedding_grads: int
    rng_states: int
    parameter_grads: int
    chunk_activations: int
    loss_block: int

    @property
    def floor(self) -> int:
        """What grows with the batch and cannot be avoided (embeddings, their gradients,
        random states), plus the parameters' gradients."""
        return self.embeddings + self.embedding_grads + self.rng_states + self.parameter_grads

    @property
    def total(self) -> int:
        """The estimated peak: the floor plus one chunk's activations and one loss block."""
        return self.floor + self.chunk_activations + self.loss_block

    def as_mb(self) -> dict[str, float]:
        """Every part, the floor and the total in MiB."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out |= {"floor": self.floor, "total": self.total}
        return {k: v / 2 ** 20 for k, v in out.items()}


def estimate_step_memory(rows: Mapping[str, int], dims: int | Mapping[str, int], *,
                         chunk_size: int | Mapping[str, int], chunk_activation_bytes: int,
                         parameter_bytes: int = 0, loss_rows: int | None = None,
                         loss_columns: int | None = None, block_size: int | None = None,
                         dense: bool = False, max_block_logits: int = MAX_BLOCK_LOGITS,
                         masked: bool = False, element_size: int = 4,
                         accelerators: int = 0) -> StepMemory:
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

    Returns:
        :class:`StepMemory`; ``.total`` is the estimate in bytes.
    """
    names = list(rows)
    dim = {n: dims[n] if isinstance(dims, Mapping) else dims for n in names}
    chunk = {n: chunk_size[n] if isinstance(chunk_size, Mapping) else chunk_size for n in names}
    emb = sum(rows[n] * dim[n] for n in names) * element_size
    chunks = sum(-(-rows[n] // chunk[n]) for n in names) - 1
    rng = max(chunks, 0) * (CPU_RNG_STATE_BYTES + accelerators * _DEVICE_RNG_STATE_BYTES)
    b = rows[names[0]] if loss_rows is None else loss_rows
    n = rows[names[-1]] if loss_columns is None else loss_columns
    block = rows_per_block(n, block_size, dense, max_block_logits)
    if block is None:
        loss = _DENSE_COPIES * b * n * element_size + (b * n if masked else 0)
    else:
        loss = min(block, b) * n * (element_size + (1 if masked else 0))
    return StepMemory(embeddings=emb, embedding_grads=emb, rng_states=rng,
                      parameter_grads=parameter_bytes, chunk_activations=chunk_activation_bytes,
                      loss_block=loss)


def activation_bytes(fn: Callable[[], Any], params: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the tensors autograd keeps for the backward of ``fn()`` (e.g. a tower on a
    probe chunk): run it once with gradients, count the memory the saved tensors span (a
    storage saved several times, or through several views, is counted once; a view counts
    only the part of its storage it reaches, so a probe chunk sliced from a large batch is
    not charged for the batch), and drop the graph. Storages of ``params`` (the model's
    parameters) are not counted: they exist anyway."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    spans: dict[int, list[tuple[int, int]]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        # (a parameter saved for the backward is a weight: under FSDP the gathered one)
        if ptr not in skip and t.numel() and not isinstance(t, torch.nn.Parameter):
            reach = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
            lo = t.storage_offset() * t.element_size()
            spans.setdefault(ptr, []).append((lo, lo + reach * t.element_size()))
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    total = 0
    for parts in spans.values():  # the union of the byte ranges saved from each storage
        end = -1
        for lo, hi in sorted(parts):
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total
