"""``bigbatch train --fsdp``: the encoder's weights sharded over the processes with FSDP2
(``torch.distributed.fsdp.fully_shard``), and the gradient norm over sharded and plain
parameters.

What is sharded. Every transformer block of the model (the module classes the model names
in its ``_no_split_modules``, as Hugging Face's device maps and accelerate's FSDP wrapping
use them) is one FSDP unit, and the model itself (embeddings, final norm, whatever no block
holds) is the root unit. A vision-language model's vision tower stays in the root unit:
it runs only for batches with images, and units of its own would make collectives that a
text-only batch on another rank does not. With LoRA the base weights are sharded and frozen, the adapters
sharded and trained. Query-side tuning's frozen document copy (full fine-tuning) is sharded
the same way, as a root of its own; with LoRA the frozen tower is the model with its
adapter disabled, so nothing more is held. Parameters outside the model (a multi-vector
projection) stay whole on every rank and are summed over ranks by the engine's one
all-reduce, with the temperature.

Both towers call the one encoder, so the engine's GradCache step turns each unit's
reduce-scatter on for its last replay only (:func:`bigbatch.engine.rank_step.fsdp_sync_points`):
one reduce-scatter per unit and step, summing (not averaging: the loss is already global).

Precision (``--dtype``): ``bfloat16`` computes and all-gathers the weights in bfloat16
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), the sharded float32
weights and optimizer states stay float32; ``float32`` keeps float32 throughout. float16
needs a loss scaler over sharded gradients, which ``--fsdp`` does not run: refused.
``--fsdp-cpu-offload`` keeps the sharded weights, gradients and optimizer states in host
memory (``CPUOffloadPolicy``): the optimizer steps on the CPU.

The forward passes of sharded units are collective: every rank must make the same calls.
Training does (the engine agrees on chunk counts); evaluation and saving are made collective
by :mod:`bigbatch.retrieval.distributed_eval` and :mod:`bigbatch.train.sharded_checkpoint`.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..engine import distributed as D
from ..errors import ConfigError

__all__ = ["FSDP_PARAM_DTYPES", "check_fsdp_launch", "transformer_blocks",
           "shard_encoder", "is_sharded", "clip_gradients", "local_shards",
           "remember_whole", "whole_on_main"]

# --dtype under --fsdp (train.config.FSDP_DTYPES): the dtype the units compute and
# all-gather in (None: the weights')
FSDP_PARAM_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def check_fsdp_launch(info: D.WorldInfo) -> D.WorldInfo:
    """``--fsdp`` shards over the processes of ``torchrun``: refuse a run started without it,
    and give a ``torchrun --nproc_per_node=1`` run (one process: a resume onto fewer
    processes, say) the process group of one that FSDP needs. Returns the world.

    Raises:
        ConfigError: no ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
            ``MASTER_ADDR``) and no process group.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return D.world_info()
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        raise ConfigError("--fsdp shards the model over the processes of torchrun; start the "
                          "run with `torchrun --nproc_per_node=N -m bigbatch.cli train ...` "
                          "(N the number of GPUs), or leave --fsdp out for one process")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend)
    return D.world_info()


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or ``model``)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


# submodules whose blocks stay in the root unit: a vision tower runs only for batches with
# images, so its own units would make collectives that a text-only batch on another rank
# does not (the whole tower is gathered with the root instead; it is frozen by default)
_VISION_TOWERS = ("visual", "vision_tower", "vision_model")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, outermost first: the modules whose class the model
    names in ``_no_split_modules`` (Hugging Face's unit of device placement), not counting
    a block inside another, nor a vision tower's (which stays with the root).

    Raises:
        ConfigError: the model names no block classes, or none is found in it.
    """
    names = set(getattr(_base_model(model), "_no_split_modules", None) or ())
    kind = getattr(getattr(_base_model(model), "config", None), "model_type", type(model).__name__)
    if not names:
        raise ConfigError(f"--fsdp: the {kind} model does not name its transformer blocks "
                          f"(_no_split_modules), so they cannot be sharded one by one")
    found: list[nn.Module] = []
    inside: set[int] = set()
    for name, m in model.named_modules():
        if id(m) in inside:
            continue
        if name.rsplit(".", 1)[-1] in _VISION_TOWERS:
            inside.update(id(x) for x in m.modules())
            continue
        if any(c.__name__ in names for c in type(m).__mro__):  # (FSDP renames the class)
            found.append(m)
            inside.update(id(x) for x in m.modules())
    if not found:
        raise ConfigError(f"--fsdp: no module of the classes {sorted(names)} in the {kind} "
                          f"model")
    return found


def _policies(dtype: str, cpu_offload: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    param_dtype = FSDP_PARAM_DTYPES[dtype]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) \
        if param_dtype is not None else MixedPrecisionPolicy()
    return {"mp_policy": mp,
            # (pinned host memory needs an accelerator)
            "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if cpu_offload else OffloadPolicy()}


def _shard_model(model: nn.Module, mesh: Any, options: dict[str, Any]) -> int:
    """``fully_shard`` on each block, then the model as the root; returns the units."""
    from torch.distributed.fsdp import fully_shard

    blocks = transformer_blocks(model)
    for unit in [*blocks, model]:
        fully_shard(unit, mesh=mesh, **options)
        # the engine sums (divide factor 1): a plain SUM, never a pre-multiplied one (which
        # gloo lacks, and a factor of 1 does not need)
        unit.set_force_sum_reduction_for_comms(True)
    return len(blocks) + 1


def shard_encoder(encoder: nn.Module, device: torch.device, dtype: str = "float32",
                  cpu_offload: bool = False) -> int:
    """Shard ``encoder``'s model (and query-side tuning's frozen document copy) over the
    default process group, in place (call before the optimizer is built: the parameters
    become DTensors). Returns the number of FSDP units.

    Args:
        encoder: a bigbatch encoder (its ``model`` is sharded).
        device: this rank's device (the mesh's device type).
        dtype: ``--dtype`` (see :data:`FSDP_PARAM_DTYPES`).
        cpu_offload: keep shards, gradients and optimizer states in host memory.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    remember_whole(encoder, dist.get_rank() == 0)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = _policies(dtype, cpu_offload)
    units = _shard_model(encoder.model, mesh, options)
    doc_base = getattr(encoder, "_doc_base", None)
    if doc_base is not None:  # query-side tuning's frozen copy: sharded, never trained
        units += _shard_model(doc_base, mesh, options)
    return units


# sharded encoder -> its copy on the meta device (no memory), on the main rank only
_WHOLE: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()


def _meta_copy(encoder: nn.Module) -> nn.Module:
    """A copy of ``encoder`` (its settings, tokenizer and module tree) whose parameters and
    buffers are on the meta device: it holds no weights. Query-side tuning's frozen copy is
    left out (saved folders name it, never hold it)."""
    memo: dict[int, Any] = {}
    for t in [*encoder.parameters(), *encoder.buffers()]:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else meta
    doc_base = getattr(encoder, "_doc_base", None)
    if doc_base is not None:
        memo[id(doc_base)] = None
    return copy.deepcopy(encoder, memo)


def remember_whole(encoder: nn.Module, is_main: bool) -> None:
    """Keep, on the main rank, the frame :func:`whole_on_main` saves ``encoder``'s whole
    weights through (a copy on the meta device: no memory); call while the weights are still
    whole, before sharding them (FSDP) or partitioning them (DeepSpeed ZeRO-3)."""
    if is_main:
        _WHOLE[encoder] = _meta_copy(encoder)


def _gathered_state(encoder: nn.Module, info: D.WorldInfo) -> dict[str, torch.Tensor]:
    """The whole weights of a sharded (FSDP) or partitioned (ZeRO-3) encoder in the main
    rank's host memory, gathered one tensor at a time (empty on the other ranks)."""
    if is_sharded(encoder):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(encoder, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    from ..integrations.deepspeed import gathered_parameters

    state = {name: t.to("cpu", copy=True) if info.is_main else None
             for name, t in gathered_parameters(encoder)}
    return state if info.is_main else {}


@contextlib.contextmanager
def whole_on_main(encoder: nn.Module, info: D.WorldInfo) -> Iterator[nn.Module | None]:
    """``with whole_on_main(encoder, info) as whole:`` on the main rank ``whole`` is the
    encoder with whole weights in host memory, to save (``whole.save(path)``: every saving
    feature of the encoder, LoRA merges included); on the other ranks None. An encoder whose
    weights are whole on every rank is itself (on the main rank).

    For a sharded (FSDP) or partitioned (ZeRO-3) one every rank must enter (a collective):
    the weights are gathered one tensor at a time to the main rank's host memory
    (FSDP: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)``; ZeRO-3:
    ``deepspeed.zero.GatheredParameters``, a parameter at a time), so no device holds more
    than one whole tensor at once; the main rank's host holds the model once (twice while a
    LoRA merge copies it). On leaving, the host copy is dropped."""
    from ..integrations.deepspeed import is_partitioned

    if not is_sharded(encoder) and not is_partitioned(encoder):
        yield encoder if info.is_main else None
        return
    state = _gathered_state(encoder, info)
    if not info.is_main:
        del state
        yield None
        return
    whole = _WHOLE[encoder]
    whole.load_state_dict(state, assign=True, strict=False)  # (ZeRO-3's: parameters only)
    del state
    if any(p.is_meta for p in whole.parameters()):  # pragma: no cover - a missed weight
        raise RuntimeError("whole_on_main: a weight was not gathered")
    buffers = dict(encoder.named_buffers())  # not in a state dict: rotary tables, position ids
    for name, b in whole.named_buffers():
        if b.is_meta:
            owner, _, leaf = name.rpartition(".")
            whole.get_submodule(owner)._buffers[leaf] = buffers[name].detach().cpu()
    try:
        yield whole
    finally:
        whole.to_empty(device="meta")  # the host copy goes


def is_sharded(module: nn.Module) -> bool:
    """Whether any part of ``module`` (an encoder) is an FSDP2 unit."""
    return any(D.is_fsdp(m) for m in module.modules())


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local_shards(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter as this rank holds it: an FSDP shard's local part, else itself (what
    the rank's memory holds of the parameters, their gradients and optimizer states)."""
    return [p.to_local() if _is_dtensor(p) else p for p in params]


def clip_gradients(params: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The total 2-norm of the gradients of ``params`` (sharded or not), and with
    ``max_norm > 0`` the gradients scaled by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does. Sharded gradients' norms are summed over ranks
    (every rank calls this: a collective when any parameter is sharded)."""
    params = [p for p in params if p.grad is not None]
    sharded = [p for p in params if _is_dtensor(p.grad)]
    if not sharded:  # all plain: torch's own
        if max_norm > 0:
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        return torch.nn.utils.get_total_norm([p.grad for p in params])
    plain = [p for p in params if not _is_dtensor(p.grad)]
    squares = 0.0
    for group in (sharded, plain):
        if group:
            norm = torch.nn.utils.get_total_norm([p.grad for p in group])
            norm = norm.full_tensor() if _is_dtensor(norm) else norm
            squares += float(norm.double()) ** 2
    total = math.sqrt(squares)
    if max_norm > 0:
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            with torch.no_grad():
                for p in params:
                    p.grad.mul_(coef)
    return torch.tensor(total, dtype=torch.float64)
