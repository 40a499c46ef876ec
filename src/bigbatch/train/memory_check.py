"""The memory guard rail of ``bigbatch train``: before the first step, estimate what one
GradCache step will add (:func:`bigbatch.train.memory_estimate.estimate_step_memory`: the cached
embeddings
and their gradients, per-chunk random states, the parameters' gradients, one loss block, and
one chunk's activations measured on a probe chunk of the training data), say so in the start
line, and stop with the numbers and what to lower when the estimate exceeds the memory the
device has free.

The probe runs the document tower once with gradients on the first ``--grad-cache-chunk``
positives, under a forked random state (so the run's dropout draws are those it would have
drawn without the probe: resuming and the demo's figures are unchanged), and keeps nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..engine import chunking
from ..errors import ConfigError
from .memory_estimate import StepMemory, activation_bytes, estimate_step_memory

__all__ = ["estimate_run_step", "free_memory", "check_fits", "describe"]

MiB = 2 ** 20


def estimate_run_step(cache: Any, encoder: Any, records: Sequence[Any], config: Any,
                      device: torch.device, world_size: int,
                      trainable: list[torch.nn.Parameter],
                      k: int | None = None) -> StepMemory | None:
    """The estimated peak one step of this run adds, or None where the towers return token
    embeddings (multi-vector) or the run trains against a fixed corpus (query-side tuning's
    corpus negatives), whose sizes this estimate does not model. ``k``: hard negatives per
    query (default ``--num-hard-negatives``; in a mix, the largest source's)."""
    if config.pooling == "multivector" or config.doc_negatives == "corpus":
        return None
    local = config.batch_size  # per process
    k = config.num_hard_negatives if k is None else k
    docs = [records[i].positive for i in range(min(cache.chunk_sizes["doc"], len(records)))]
    inputs = encoder.step_inputs(docs, "doc")
    chunks, _ = cache.split_inputs("doc", inputs, cache.chunk_sizes["doc"])
    probe = chunking.to_device(chunking.materialize(chunks[0]), cache.device or device)
    dim: list[int] = []

    def run() -> Any:
        out = cache.embed("doc", probe)
        dim.append(out.shape[-1])
        return out

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        acts = activation_bytes(run, trainable)
    params = sum(p.numel() * p.element_size() for p in trainable)
    global_docs = local * world_size * (1 + k)
    return estimate_step_memory({"query": local, "doc": local * (1 + k)}, dim[0],
                                chunk_size=cache.chunk_sizes, chunk_activation_bytes=acts,
                                parameter_bytes=params, loss_rows=local,
                                loss_columns=global_docs, block_size=config.loss_block_size
                                or None, dense=config.loss_block_size == 0, masked=True)


def free_memory(device: torch.device) -> int | None:
    """Bytes the device can still give: CUDA's free memory, or the host's available memory
    (``MemAvailable``) for the CPU; None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def describe(estimate: StepMemory) -> str:
    """The estimate as the start line shows it."""
    mb = estimate.as_mb()
    return (f"step memory ~{mb['total']:,.0f} MB (estimate: cached embeddings and their "
            f"gradients {mb['embeddings'] + mb['embedding_grads']:,.0f} MB, parameter gradients "
            f"{mb['parameter_grads']:,.0f} MB, one chunk {mb['chunk_activations']:,.0f} MB, "
            f"one loss block {mb['loss_block']:,.0f} MB)")


def check_fits(estimate: StepMemory, free: int | None, device: torch.device) -> None:
    """Raise ConfigError, with the numbers and what to lower, when ``estimate`` exceeds
    ``free`` bytes."""
    if free is None or estimate.total <= free:
        return
    mb = estimate.as_mb()
    raise ConfigError(
        f"one training step needs about {mb['total']:,.0f} MB but {device} has "
        f"{free / MiB:,.0f} MB free: cached embeddings and their gradients "
        f"{mb['embeddings'] + mb['embedding_grads']:,.0f} MB (lower --batch-size or "
        f"--num-hard-negatives), one chunk's activations {mb['chunk_activations']:,.0f} MB "
        f"(lower --grad-cache-chunk or --max-length), one loss block {mb['loss_block']:,.0f} "
        f"MB (lower --loss-block-size), parameter gradients {mb['parameter_grads']:,.0f} MB "
        f"(LoRA: --lora-r)")
