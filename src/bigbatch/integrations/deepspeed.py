"""GradCache under DeepSpeed ZeRO (stages 1, 2 and 3): the chunks' replays run through
DeepSpeed's engine, and the engine reduces the gradients once per step.

How. Every tower call goes through the DeepSpeed engine (``engine(**chunk)``), so ZeRO-3
gathers its partitioned parameters for each chunk and DeepSpeed's backward hooks see each
replay's backward. The whole GradCache step runs inside DeepSpeed's
``engine.coalesce_grad_reduction()``: each replay's backward leaves its gradient on the
parameters locally, and on leaving the block DeepSpeed makes one reduction pass (ZeRO-1:
one all-reduce; ZeRO-2: one reduce-scatter into the gradient partitions; ZeRO-3: one
reduce-scatter of the partitioned gradients), so no replay communicates. Then
``engine.step()`` steps the optimizer as usual.

The scaling. bigbatch's cross-device loss gives each rank the exact gradient of the global
loss for its own embeddings, so the model gradient is the **sum** over ranks of the replays'
gradients (see :mod:`bigbatch.engine.distributed`); DeepSpeed **averages** over its data-parallel
ranks. The tower (:class:`DeepSpeedTower`) therefore multiplies the gradient flowing back into
the engine by the data-parallel world size (exact for a power of two). The loss's own
parameters (a learnable temperature) live outside the engine: the GradCache engine sums
their gradient over ranks in its one end-of-step all-reduce, and a small torch optimizer
steps them (:func:`deepspeed_cache` passes ``params=[]``, so that all-reduce carries the
loss's parameters and the failure flags, never the model's).

Refused (:class:`~bigbatch.errors.ConfigError`, before any gradient, by
:func:`check_engine`): ``gradient_accumulation_steps`` other than 1 (a GradCache step is
already the whole batch; raise the batch size instead), ZeRO stage 0 (DeepSpeed's own data
parallelism reduces on every backward; use the plain engine with DDP), and a DeepSpeed
without ``coalesce_grad_reduction`` (deepspeedai/DeepSpeed#7992; tested with 0.19.8).
DeepSpeed itself raises ``NotImplementedError`` in ``coalesce_grad_reduction`` for its
fp16/bf16 optimizer wrappers: keep float32 master weights and autocast (``--dtype
bfloat16``); ``bigbatch train --deepspeed`` refuses them in :func:`read_config`.

Example::

    engine, *_ = deepspeed.initialize(model=encoder, optimizer=opt, config=ds_config)
    cache = deepspeed_cache(engine, loss_fn, chunk_size=32)
    for batch in batches:
        result = deepspeed_step(engine, cache, query=q, doc=d)
        engine.step()
        temperature_optimizer.step(); temperature_optimizer.zero_grad()

References:
    DeepSpeed ``DeepSpeedEngine.coalesce_grad_reduction`` (deepspeed/runtime/engine.py);
    sentence-transformers#3173 and #3531, luyug/GradCache#37 (GradCache under DeepSpeed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.embeddings import TokenEmbeddings
from ..engine.gradcache import GradCache, StepResult
from ..errors import ConfigError

__all__ = ["DeepSpeedTower", "deepspeed_cache", "deepspeed_step", "check_engine",
           "full_gradients", "read_config", "zero_stage", "ensure_process_group", "initialize",
           "is_partitioned", "gathered_parameters", "save_engine_state", "load_engine_state"]


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by ``factor`` in the backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.factor, None


class DeepSpeedTower(nn.Module):
    """A GradCache tower that calls a DeepSpeed engine, and multiplies the gradient flowing
    back into it by ``factor`` (the data-parallel world size: DeepSpeed averages over ranks,
    bigbatch's cross-device loss needs the sum).

    Args:
        engine: the ``DeepSpeedEngine`` (its module returns a ``(rows, dim)`` tensor or
            :class:`~bigbatch.TokenEmbeddings`).
        factor: the gradient multiplier; None: the engine's data-parallel world size.
    """

    def __init__(self, engine: Any, factor: float | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.factor = float(factor if factor is not None else _dp_world_size(engine))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.engine(*args, **kwargs)
        if not torch.is_grad_enabled() or self.factor == 1.0:
            return out
        if isinstance(out, TokenEmbeddings):
            return TokenEmbeddings(_ScaleGrad.apply(out.values, self.factor), out.mask)
        return _ScaleGrad.apply(out, self.factor)


def _dp_world_size(engine: Any) -> int:
    size = getattr(engine, "dp_world_size", None)
    if size is None:
        import torch.distributed as dist
        size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return int(size)


def check_engine(engine: Any) -> int:
    """Refuse a DeepSpeed engine the exact step cannot run under; returns its ZeRO stage.

    Raises:
        ConfigError: gradient accumulation steps other than 1, ZeRO stage 0, or a DeepSpeed
            without ``coalesce_grad_reduction``.
    """
    if not hasattr(engine, "coalesce_grad_reduction"):
        raise ConfigError("this DeepSpeed has no engine.coalesce_grad_reduction() (added by "
                          "deepspeedai/DeepSpeed#7992; tested with 0.19.8): upgrade it "
                          "(pip install -U 'deepspeed>=0.19.8')")
    gas = int(engine.gradient_accumulation_steps())
    if gas != 1:
        raise ConfigError(f"DeepSpeed config: gradient_accumulation_steps is {gas}; a GradCache "
                          f"step already takes the whole batch in chunks, so set it to 1 and "
                          f"raise the batch size instead (train_batch_size = "
                          f"train_micro_batch_size_per_gpu x processes)")
    stage = int(engine.zero_optimization_stage())
    if stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed config: zero_optimization.stage is {stage}; the exact "
                          f"GradCache step needs ZeRO stage 1, 2 or 3 (stage 0 reduces on every "
                          f"backward: use the plain engine with torch DDP instead)")
    return stage


def deepspeed_cache(engine: Any, loss_fn: Callable[..., Any],
                    chunk_size: int | Mapping[str, int],
                    towers: Iterable[str] = ("query", "doc"), **options: Any) -> GradCache:
    """A :class:`~bigbatch.GradCache` whose towers all call ``engine`` (one shared model), for
    :func:`deepspeed_step`.

    Args:
        engine: a ``DeepSpeedEngine`` with ZeRO stage 1, 2 or 3 and gradient accumulation 1.
        loss_fn, chunk_size: as for :class:`~bigbatch.GradCache`.
        towers: the tower names (each one calls the engine).
        options: other :class:`~bigbatch.GradCache` options (``collate_fn``, ``device``,
            ``sort_by_length``, ...); ``params`` and ``sync_gradients`` are set here.

    Raises:
        ConfigError: an engine :func:`check_engine` refuses, or ``params`` /
            ``sync_gradients`` given (DeepSpeed reduces the model's gradients itself).
    """
    check_engine(engine)
    for name in ("params", "sync_gradients"):
        if name in options:
            raise ConfigError(f"deepspeed_cache sets {name} itself (DeepSpeed reduces the "
                              f"model's gradients; the engine sums only the loss's)")
    tower = DeepSpeedTower(engine)
    return GradCache({name: tower for name in towers}, loss_fn, chunk_size, params=[],
                     **options)


def deepspeed_step(engine: Any, cache: GradCache, **inputs: Any) -> StepResult:
    """One exact GradCache step under DeepSpeed: every replay inside
    ``engine.coalesce_grad_reduction()``, so DeepSpeed reduces the gradients once, on leaving
    it. Call ``engine.step()`` afterwards (and step the loss's parameters, if any).

    Args:
        engine: the engine ``cache``'s towers call (see :func:`deepspeed_cache`).
        cache: the GradCache engine.
        inputs: :meth:`~bigbatch.GradCache.step`'s keyword arguments.
    """
    with engine.coalesce_grad_reduction():
        return cache.step(**inputs)


def full_gradients(engine: Any) -> dict[str, Tensor]:
    """Every trainable parameter's full (unpartitioned, reduced) gradient after a step, by
    name, on every rank (``deepspeed.utils.safe_get_full_grad``: a collective under ZeRO-3,
    so every rank calls it)."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            g = safe_get_full_grad(p)
            if g is not None:
                out[name] = g.detach().clone()
    return out


# ------------------------------------------------------------ bigbatch train --deepspeed
# ZeRO-3 partitions the weights: evaluation runs on every rank (each forward gathers them)
# and saving gathers them one at a time (gathered_parameters)
_TRAIN_STAGES = (1, 2, 3)


def read_config(path: str, *, batch_size: int, max_grad_norm: float,
                world_size: int = 1) -> dict[str, Any]:
    """The DeepSpeed JSON configuration of ``bigbatch train --deepspeed``, checked and
    completed from the run's options: the micro batch is ``--batch-size``, gradient
    accumulation 1, ``train_batch_size`` the global batch, and ``gradient_clipping``
    ``--max-grad-norm`` unless the file sets it.

    Args:
        path: the JSON file.
        batch_size: ``--batch-size`` (queries per process per step).
        max_grad_norm: ``--max-grad-norm`` (0: no clipping).
        world_size: the number of processes.

    Raises:
        ConfigError: a missing or invalid file (with the line), a section bigbatch train
            sets itself (``optimizer``, ``scheduler``), DeepSpeed's fp16/bf16 optimizer, a
            ZeRO stage other than 1, 2 or 3, gradient accumulation other than 1, or batch
            sizes that contradict ``--batch-size``.
    """
    import json
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--deepspeed: file not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except ValueError as e:
        line = getattr(e, "lineno", None)
        raise ConfigError(f"{p}{f':{line}' if line else ''}: not valid JSON: "
                          f"{getattr(e, 'msg', e)}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: a DeepSpeed configuration is a JSON object "
                          f"({{\"zero_optimization\": {{\"stage\": 2}}}})")
    for key, why in (("optimizer", "AdamW from --lr and --weight-decay"),
                     ("scheduler", "the schedule from --scheduler and --warmup-steps")):
        if key in cfg:
            raise ConfigError(f"{p}: remove the {key!r} section: bigbatch train builds {why}")
    for key in ("fp16", "bf16"):
        if isinstance(cfg.get(key), dict) and cfg[key].get("enabled", False):
            raise ConfigError(f"{p}: {key}.enabled: DeepSpeed's {key} optimizer cannot coalesce "
                              f"the chunks' gradients into one reduction; keep float32 weights "
                              f"and give --dtype bfloat16 (autocast) instead")
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in _TRAIN_STAGES:
        raise ConfigError(f"{p}: zero_optimization.stage is {stage!r}; bigbatch train runs "
                          f"ZeRO stage 1, 2 or 3 (stage 0 reduces the gradients on every "
                          f"backward: leave --deepspeed out for plain data parallelism)")
    gas = cfg.get("gradient_accumulation_steps", 1)
    if gas != 1:
        raise ConfigError(f"{p}: gradient_accumulation_steps is {gas!r}; a GradCache step "
                          f"already takes the whole batch in chunks: set it to 1 (or leave it "
                          f"out) and raise --batch-size instead")
    micro = cfg.get("train_micro_batch_size_per_gpu", batch_size)
    total = cfg.get("train_batch_size", batch_size * world_size)
    if micro != batch_size or total != batch_size * world_size:
        raise ConfigError(f"{p}: train_micro_batch_size_per_gpu {micro!r} / train_batch_size "
                          f"{total!r} contradict --batch-size {batch_size} x {world_size} "
                          f"process(es); leave them out (bigbatch fills them in)")
    out = dict(cfg, train_micro_batch_size_per_gpu=batch_size, gradient_accumulation_steps=1,
               train_batch_size=batch_size * world_size)
    if "gradient_clipping" not in out and max_grad_norm > 0:
        out["gradient_clipping"] = float(max_grad_norm)
    return out


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a configuration :func:`read_config` returned."""
    return int(config.get("zero_optimization", {}).get("stage", 0))


def is_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are partitioned by ZeRO-3 (each holds a slice)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_parameters(module: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """Each parameter of a ZeRO-3 ``module`` by name, gathered whole one at a time (every
    rank iterates: each gather is a collective); a yielded tensor is valid until the next
    (copy what is kept)."""
    import deepspeed

    for name, p in module.named_parameters():
        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            yield name, p.detach()


_TAG = "zero"  # the one tag of a bigbatch checkpoint's DeepSpeed folder


def save_engine_state(engine: Any, folder: Any) -> None:
    """DeepSpeed's part of a checkpoint (every rank calls it): the module's weights, each
    rank's optimizer partition and the schedule, in ``folder``."""
    engine.save_checkpoint(str(folder), tag=_TAG, save_latest=False)


def load_engine_state(engine: Any, folder: Any) -> None:
    """Restore what :func:`save_engine_state` wrote into ``engine`` (every rank).

    Raises:
        ConfigError: nothing of DeepSpeed's there, or it does not fit the engine.
    """
    try:
        path, _ = engine.load_checkpoint(str(folder), tag=_TAG, load_optimizer_states=True,
                                         load_lr_scheduler_states=True)
    except (RuntimeError, KeyError, ValueError, AssertionError) as e:
        raise ConfigError(f"--resume: {folder} does not fit this DeepSpeed engine (another "
                          f"model, ZeRO stage or number of processes?): {e}") from e
    if path is None:
        raise ConfigError(f"--resume: {folder} holds no DeepSpeed checkpoint")


def ensure_process_group() -> None:
    """DeepSpeed needs ``torch.distributed`` and torchrun's environment: a run started
    without torchrun gets a process group of one (gloo, or NCCL on a GPU) on a free local
    port, and the variables torchrun would set (``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``)."""
    import os
    import socket

    import torch.distributed as dist

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))


def initialize(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any],
               lr_scheduler: Any = None) -> Any:
    """``deepspeed.initialize`` over ``model`` with the client ``optimizer`` (and its
    ``lr_scheduler``, stepped by ``engine.step()``), after :func:`ensure_process_group`;
    the engine is checked by :func:`check_engine`.

    Raises:
        ConfigError: DeepSpeed is not installed (``pip install -e '.[deepspeed]'`` in a clone), or
            :func:`check_engine` refuses the engine.
    """
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError("--deepspeed needs DeepSpeed: pip install 'deepspeed>=0.19.8', or in a "
                          "bigbatch clone pip install -e '.[deepspeed]' (on a machine without "
                          "CUDA: DS_BUILD_OPS=0 pip install deepspeed)") from e
    ensure_process_group()
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                      lr_scheduler=lr_scheduler)
    check_engine(engine)
    return engine
