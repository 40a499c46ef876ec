"""Checkpoints of sharded runs, written by every process: ``--fsdp`` runs with
``torch.distributed.checkpoint`` (DCP), resumed on the same or another number of processes;
``--deepspeed`` runs (ZeRO 1, 2 or 3) with DeepSpeed's own ``save_checkpoint``, resumed on
the same number.

A sharded checkpoint holds what a whole one holds (see :mod:`bigbatch.train.checkpoint`),
with the model's trainable weights and the optimizer's states in a folder every process
writes its part of, instead of ``trainer_state.pt``:

- ``sharded/`` (``--fsdp``): DCP's files, one per process (its shards of the trainable
  weights and of AdamW's states, and the temperature) and ``.metadata``; a resume on
  another number of processes reads the slices it needs (resharding);
- ``deepspeed/`` (``--deepspeed``): DeepSpeed's (the module's weights, each rank's
  optimizer partition, the model's schedule); the temperature's optimizer and the loss's
  state go to ``trainer_state.pt``;
- ``sharding.json``: the scheme (``fsdp2`` or ``deepspeed``, with its ZeRO stage), the
  number of processes that wrote it, the model and the LoRA rank;
- ``model/``: the whole weights (or adapter) in the loadable layout, gathered to the main
  rank one tensor at a time (:func:`bigbatch.train.sharding.whole_on_main`);
- ``trainer_state.pt`` (the schedule, the loss's state, the run's position), one random
  state per process, ``config.yaml`` and ``run.json``, from the main rank.

Atomic as a whole checkpoint is: the main rank makes the temporary folder (through
:class:`~bigbatch.train.checkpoint.atomic_dir`) and names it to the others, every process
writes its part there, and after a barrier the main rank renames it into place; a kill at
any moment leaves the previous checkpoint as it was (the folder must be on a file system
every process sees).
"""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..engine import distributed as D
from ..errors import ConfigError
from .checkpoint import (
    MANIFEST,
    atomic_dir,
    safe_load,
    set_rng_state,
    write_errors,
    write_manifest,
)
from .main_rank import barrier, from_main
from .runid import write_run_file
from .sharding import whole_on_main

__all__ = ["SHARDING_FILE", "is_sharded_checkpoint", "run_scheme", "save_sharded_checkpoint",
           "load_sharded_checkpoint", "resume_view", "save_whole"]

SHARDING_FILE = "sharding.json"
_FSDP, _DEEPSPEED = "fsdp2", "deepspeed"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a checkpoint a sharded run wrote."""
    return (Path(path) / SHARDING_FILE).is_file()


def run_scheme(config: Any) -> str | None:
    """How a run's checkpoints are written: ``fsdp2``, ``deepspeed``, or None (whole)."""
    return _FSDP if config.fsdp else _DEEPSPEED if getattr(config, "deepspeed", None) else None


# what a resume of a checkpoint of one scheme (the key) by a run of another is told
_HOW = {_FSDP: "a sharded (--fsdp) run; resume it with --fsdp under torchrun (any number "
               "of processes with the same global batch)",
        _DEEPSPEED: "a --deepspeed run; resume it with --deepspeed (the same ZeRO "
                    "configuration and number of processes)",
        None: "a run without --fsdp or --deepspeed (whole weights); resume it so, or start "
              "a new run from its weights with --model {model}"}


def _saved_world(ckpt: Path) -> dict[str, Any]:
    try:
        return json.loads((ckpt / SHARDING_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--resume: {ckpt / SHARDING_FILE} cannot be read ({e}); the "
                          f"checkpoint is incomplete: resume from an earlier one") from e


def resume_view(ckpt: Path, config: Any, info: D.WorldInfo) -> tuple[Any, D.WorldInfo]:
    """What :func:`~bigbatch.train.resume.check_resume_matches` compares a resume against,
    and the refusals of a sharded resume. A sharded checkpoint may continue on another
    number of processes when the global batch stays the same (``--batch-size`` x
    processes: the records each step reads are those of the global batch); then the
    configuration and world are seen as the saved run's, and a line says the run is
    resharded. Returns ``(config, info)`` to check.

    Raises:
        ConfigError: a sharded checkpoint without ``--fsdp`` or a whole one with it, another
            LoRA rank, or another global batch on another number of processes.
    """
    saved = _saved_world(ckpt) if is_sharded_checkpoint(ckpt) else {"scheme": None}
    scheme = run_scheme(config)
    if saved.get("scheme") != scheme:
        raise ConfigError(f"--resume: {ckpt} was written by "
                          + _HOW[saved.get("scheme")].format(model=ckpt / "model"))
    if scheme is None:
        return config, info
    lora = 0 if config.full_finetune else config.lora_r
    if saved.get("lora_r") != lora:
        raise ConfigError(f"--resume: {ckpt} was written by a {scheme} run with LoRA rank "
                          f"{saved.get('lora_r')}, this run has {lora}; resume with the same "
                          f"model settings")
    world = int(saved["world_size"])
    if world == info.world_size:
        return config, info
    if scheme == _DEEPSPEED:
        raise ConfigError(f"--resume: {ckpt} was written by {world} process(es) under "
                          f"--deepspeed, this run has {info.world_size}; DeepSpeed's "
                          f"optimizer partitions resume on the same number of processes")
    import dataclasses

    import yaml

    saved_batch = (yaml.safe_load((ckpt / "config.yaml").read_text()) or {}).get(
        "batch_size", config.batch_size)
    batch = saved_batch * world  # the global batch: it decides the records of each step
    if batch != config.batch_size * info.world_size:
        if batch % info.world_size:
            raise ConfigError(f"--resume: {ckpt} was written with a global batch of {batch}, "
                              f"which {info.world_size} process(es) cannot split evenly; "
                              f"resume on a number of processes dividing it")
        raise ConfigError(f"--resume: {ckpt} was written by {world} process(es) x "
                          f"--batch-size {saved_batch} (global batch {batch}); this run has "
                          f"{info.world_size} x {config.batch_size}. Resume with --batch-size "
                          f"{batch // info.world_size} so that the global batch stays {batch}")
    if info.is_main:
        print(f"bigbatch train: resharding {ckpt.name}: written by {world} process(es), "
              f"continued on {info.world_size} (global batch {batch} as "
              f"before; each process's dropout stream starts afresh)", flush=True)
    return (dataclasses.replace(config, batch_size=saved_batch),
            D.WorldInfo(info.rank, world, info.local_rank))


def _container(encoder: nn.Module, loss_fn: nn.Module) -> nn.Module:
    """One module naming the encoder's and the loss's parameters (the optimizer's groups)."""
    return nn.ModuleDict({"encoder": encoder, "loss": loss_fn})


def _dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The trainable weights and the optimizer's states, as this process holds them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(ignore_frozen_params=True)
    return {"model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}


def save_sharded_checkpoint(path: str | Path, *, encoder: nn.Module, loss_fn: nn.Module,
                            optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                            state: dict[str, Any], config: Any,
                            rank_states: list[dict[str, Any]], info: D.WorldInfo,
                            engine: Any = None) -> Path:
    """Write a sharded checkpoint atomically; every process calls it (see the module
    docstring). ``engine``: the run's DeepSpeed engine (``--deepspeed``), else the model is
    FSDP's.

    Raises:
        OutputError: a file could not be written (a full disk); the previous checkpoint of
            that name is left as it was.
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    hint = f"continue with --resume {path.parent}"
    with atomic_dir(path) if info.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(from_main(str(tmp) if tmp is not None else None, info))
        if engine is not None:
            from ..integrations.deepspeed import save_engine_state

            with write_errors(path / "deepspeed", hint):
                save_engine_state(engine, tmp / "deepspeed")
        else:
            with write_errors(path / "sharded", hint):
                dcp.save(_dcp_state(_container(encoder, loss_fn), optimizer),
                         checkpoint_id=str(tmp / "sharded"))
        with whole_on_main(encoder, info) as whole:
            if whole is not None:
                with write_errors(path / "model", hint):
                    whole.save(tmp / "model")
        if info.is_main:
            # (DeepSpeed: the run's own optimizer steps the temperature alone)
            own = {"optimizer": optimizer.state_dict(), "loss_fn": loss_fn.state_dict()} \
                if engine is not None else {}
            with write_errors(path / "trainer_state.pt", hint):
                torch.save({"scheduler": scheduler.state_dict(),
                            "scaler": scaler.state_dict() if scaler is not None else None,
                            "state": state, **own}, tmp / "trainer_state.pt")
            for r, s in enumerate(rank_states):
                with write_errors(path / f"rng_state_rank{r}.pt", hint):
                    torch.save(s, tmp / f"rng_state_rank{r}.pt")
            with write_errors(path / "config.yaml", hint):
                config.write(tmp / "config.yaml")
                if state.get("run_id"):
                    write_run_file(tmp, state["run_id"], step=state.get("step"))
                lora = 0 if config.full_finetune else config.lora_r
                scheme = {"scheme": run_scheme(config)}
                if engine is not None:
                    scheme["zero_stage"] = int(engine.zero_optimization_stage())
                (tmp / SHARDING_FILE).write_text(json.dumps(
                    {**scheme, "world_size": info.world_size, "model": config.model,
                     "lora_r": lora}, indent=2))
        barrier(info)  # every part written before the main rank lists them and renames
        if info.is_main:
            with write_errors(path / MANIFEST, hint):
                write_manifest(tmp)
    return path


def load_sharded_checkpoint(path: str | Path, *, encoder: nn.Module, loss_fn: nn.Module,
                            optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                            info: D.WorldInfo, seed: int, engine: Any = None) -> dict[str, Any]:
    """Restore what :func:`save_sharded_checkpoint` wrote (every process calls it); on
    another number of processes (FSDP) the shards are read resharded and each process's
    random state starts afresh from ``seed``, its rank and the step. Returns the saved
    state.

    Raises:
        ConfigError: not a sharded checkpoint, or one of another model.
    """
    path = Path(path)
    if not (path / "trainer_state.pt").exists() or not is_sharded_checkpoint(path):
        raise ConfigError(f"--resume: {path} is not a sharded bigbatch checkpoint")
    blob = safe_load(path / "trainer_state.pt")
    if engine is not None:
        from ..integrations.deepspeed import load_engine_state

        load_engine_state(engine, path / "deepspeed")
        optimizer.load_state_dict(blob["optimizer"])
        loss_fn.load_state_dict(blob["loss_fn"])
    else:
        _load_dcp(path, _container(encoder, loss_fn), optimizer)
    scheduler.load_state_dict(blob["scheduler"])
    if scaler is not None and blob.get("scaler") is not None:
        scaler.load_state_dict(blob["scaler"])
    state = blob["state"]
    world = int(_saved_world(path)["world_size"])
    if world == info.world_size:
        set_rng_state(safe_load(path / f"rng_state_rank{info.rank}.pt"))
    else:  # resharded: no saved stream belongs to this process
        fresh = seed * 1_000_003 + int(state["step"]) * 1_009 + info.rank
        random.seed(fresh)
        torch.manual_seed(fresh)
    return state


def _load_dcp(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The trainable weights and the optimizer's states from ``path/sharded``, resharded to
    this run's processes as needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    target = _dcp_state(model, optimizer)
    try:
        saved = set(dcp.FileSystemReader(str(path / "sharded")).read_metadata()
                    .state_dict_metadata)
        # a parameter that never had a gradient (BERT's pooler) has no optimizer state
        target["optimizer"]["state"] = {
            fqn: v for fqn, v in target["optimizer"]["state"].items()
            if any(f"optimizer.state.{fqn}.{k}" in saved for k in v)}
        dcp.load(target, checkpoint_id=str(path / "sharded"))
    except (CheckpointException, RuntimeError, KeyError, ValueError) as e:  # keys that differ
        text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"--resume: {path / 'sharded'} does not fit this model (written by "
                          f"a different model or LoRA setting, or damaged): {text}") from e
    options = StateDictOptions(ignore_frozen_params=True)
    set_model_state_dict(model, target["model"], options=options)
    set_optimizer_state_dict(model, optimizer, target["optimizer"],  # (states left out above)
                             options=StateDictOptions(ignore_frozen_params=True, strict=False))


def save_whole(encoder: nn.Module, path: str | Path, info: D.WorldInfo, hint: str,
               merge_lora: bool = False) -> None:
    """Write ``encoder``'s weights whole to ``path`` (``final/``), atomically, from the main
    rank; every process calls it (a sharded encoder is gathered there first)."""
    path = Path(path)
    with whole_on_main(encoder, info) as whole:
        if whole is not None:
            with atomic_dir(path) as tmp, write_errors(path, hint):
                # full weights every client loads alike; a LoRA run's adapter beside them in
                # final/adapter/ (none with --merge-lora)
                whole.save_final(tmp, keep_adapter=not merge_lora)
    barrier(info)
