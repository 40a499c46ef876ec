"""The memory each process holds for the model's state: its weights, the trainable weights'
gradients and AdamW's two moments, divided over the processes when the run is sharded
(``--fsdp``), plus, sharded, the one transformer block gathered whole while it computes
(and the next one, prefetched). The start line shows it beside the step's estimate
(:mod:`bigbatch.train.memory_check`); the distributed guide's table of the LLM-embedder
recipes is computed by the same arithmetic from the models' shapes, on the meta device
(``bench/llm_memory.py``).

Arithmetic on sizes only: the weights' own dtypes (float32 unless loaded otherwise), AdamW's
moments in the weights' dtype, shards of ``ceil(n / processes)`` elements, gradients of the
trainable weights only (LoRA: the adapters).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields

import torch
from torch import nn

__all__ = ["ModelMemory", "model_memory", "run_model_memory", "describe_model_memory",
           "lora_parameters"]

MiB = 2 ** 20
_ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, each the size of the weight


@dataclass(frozen=True)
class ModelMemory:
    """Bytes of the model's state on each process (see the module docstring)."""

    weights: int
    gradients: int
    optimizer_states: int
    gathered: int  # sharded: the blocks gathered whole at once (0 unsharded)
    processes: int = 1
    sharded: bool = False

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.gathered

    def as_mb(self) -> dict[str, float]:
        out = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("processes", "sharded")}
        return {k: v / MiB for k, v in (out | {"total": self.total}).items()}


def _bytes(params: Iterable[torch.Tensor], parts: int) -> int:
    """Bytes of ``params`` held by one of ``parts`` processes (each tensor split evenly,
    rounded up, as FSDP pads its shards)."""
    return sum(-(-_numel(p) // parts) * p.element_size() for p in params)


def _numel(p: torch.Tensor) -> int:
    """A parameter's whole size (a ZeRO-3 partitioned one keeps it in ``ds_numel``)."""
    return int(getattr(p, "ds_numel", p.numel()))


def model_memory(module: nn.Module, trainable: Sequence[nn.Parameter], *, processes: int = 1,
                 sharded: bool = False, blocks: Sequence[nn.Module] = (),
                 compute_bytes: int | None = None) -> ModelMemory:
    """The model state one process holds.

    Args:
        module: the model (or encoder); its parameters' global sizes are counted (a sharded
            parameter's ``numel`` is the whole tensor's).
        trainable: the parameters the optimizer steps.
        processes: the processes of the run.
        sharded: whether weights, gradients and optimizer states are split over them.
        blocks: the units gathered whole one at a time (sharded; e.g. the transformer blocks).
        compute_bytes: bytes per element of a gathered block (``--dtype``: 2 for bfloat16;
            None: the weights').
    """
    parts = processes if sharded else 1
    params = list({id(p): p for p in module.parameters()}.values())
    gathered = 0
    if sharded and blocks:
        sizes = sorted((sum(_numel(p) * (compute_bytes or p.element_size())
                            for p in b.parameters()) for b in blocks), reverse=True)
        gathered = sum(sizes[:2])  # the block computing and the next, prefetched
    return ModelMemory(weights=_bytes(params, parts), gradients=_bytes(trainable, parts),
                       optimizer_states=_ADAM_MOMENTS * _bytes(trainable, parts),
                       gathered=gathered, processes=processes, sharded=sharded)


def run_model_memory(encoder: nn.Module, trainable: Sequence[nn.Parameter], processes: int,
                     fsdp: bool, dtype: str) -> ModelMemory:
    """:func:`model_memory` of a run's encoder: sharded under ``--fsdp`` or ZeRO-3 (its
    transformer blocks gathered in ``--dtype``), else whole on every process (ZeRO 1 and 2's
    partitions of gradients and optimizer states are not counted as such)."""
    from ..integrations.deepspeed import is_partitioned
    from .sharding import transformer_blocks

    sharded = fsdp or is_partitioned(encoder)  # FSDP, or DeepSpeed ZeRO-3
    blocks = transformer_blocks(encoder.model) if sharded else ()
    return model_memory(encoder, trainable, processes=processes, sharded=sharded, blocks=blocks,
                        compute_bytes=2 if dtype in ("bfloat16", "float16") else None)


def describe_model_memory(m: ModelMemory) -> str:
    """The model state as the start line shows it."""
    mb = m.as_mb()
    text = (f"model state ~{mb['total']:,.0f} MB per process (weights {mb['weights']:,.0f} MB, "
            f"gradients {mb['gradients']:,.0f} MB, AdamW states "
            f"{mb['optimizer_states']:,.0f} MB")
    if m.sharded:
        text += (f", sharded over {m.processes} process(es); blocks gathered while they "
                 f"compute {mb['gathered']:,.0f} MB")
    return text + ")"


def lora_parameters(module: nn.Module, r: int, targets: Sequence[str]) -> int:
    """Parameters a rank-``r`` LoRA adapter adds on the linear layers whose name ends with
    one of ``targets`` (``r * (in + out)`` each), counted without applying it (a model on
    the meta device works)."""
    return sum(r * (m.in_features + m.out_features) for name, m in module.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in targets)
