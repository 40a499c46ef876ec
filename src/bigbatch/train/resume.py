"""Checks that a resumed run continues the run its checkpoint came from: the checkpoint to
resume (a checkpoint directory, or an output directory's latest), the data settings that
decide which records each step reads, the number of processes, and the training file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import distributed as D
from ..errors import ConfigError
from .checkpoint import latest_checkpoint
from .config import TrainConfig
from .runid import RUN_FILE

__all__ = ["resume_path", "check_resume_matches", "check_resumed_data", "check_resumed_step"]

# settings that decide which records each step reads: a resume must keep them
# (train_data is compared by the resolved path the checkpoint's state records)
_DATA_KEYS = ("train_split", "batch_size", "num_hard_negatives", "seed")


def resume_path(resume: str) -> Path:
    """The checkpoint ``--resume`` names: the directory itself, or its latest checkpoint.

    Raises:
        ConfigError: there is no checkpoint there.
    """
    p = Path(resume)
    if (p / "trainer_state.pt").exists():
        return p
    latest = latest_checkpoint(p) if p.is_dir() else None
    if latest is None:
        if (p / RUN_FILE).exists():
            raise ConfigError(f"--resume: the run in {p} stopped before its first checkpoint "
                              f"(nothing to resume); start it again with --output-dir {p} "
                              f"--overwrite (moves its files aside), or give a new --output-dir")
        raise ConfigError(f"--resume: no checkpoint found at {p}")
    return latest


def check_resumed_step(ckpt: Path, step: int, max_steps: int) -> None:
    """A checkpoint beyond this run's last step cannot be continued to it.

    Raises:
        ConfigError: naming the checkpoint's step and ``--max-steps``.
    """
    if step > max_steps:
        raise ConfigError(f"--resume: {ckpt} is at step {step}, beyond this run's {max_steps} "
                          f"steps (--max-steps / --epochs); give at least {step} steps to "
                          f"continue it")


def check_resume_matches(ckpt: Path, config: TrainConfig, info: D.WorldInfo) -> None:
    """Refuse to resume from a checkpoint written with other data settings, another number of
    processes or other training records: its data position (epoch, batch index) would then
    name other records, and the run would silently skip or repeat some.

    Raises:
        ConfigError: naming the setting and both values.
    """
    import yaml

    saved_file = ckpt / "config.yaml"
    saved = yaml.safe_load(saved_file.read_text()) if saved_file.exists() else {}
    for key in _DATA_KEYS:
        now = getattr(config, key)
        if saved.get(key, now) != now:
            raise ConfigError(f"--resume: {ckpt} was written with {key}={saved[key]!r}, this run "
                              f"has {getattr(config, key)!r}; the saved data position would "
                              f"name other records. Resume with the same {key}")
    ranks = len(list(ckpt.glob("rng_state_rank*.pt")))
    if ranks and ranks != info.world_size:
        raise ConfigError(f"--resume: {ckpt} was written by {ranks} process(es), this run has "
                          f"{info.world_size}; resume with the same number of processes")


def check_resumed_data(ckpt: Path, train_data: Any, num_records: Any,
                       state: dict[str, Any], mix: dict[str, Any] | None = None) -> None:
    """After loading: the checkpoint's state must name the same training data (a resolved
    path, or each source's name and path), record counts and mix (sources, weights, hard
    negatives) as this run (:func:`~bigbatch.train.sources.data_identity`, ``mix_state``).

    Raises:
        ConfigError: the training data, its record counts or the mix changed.
    """
    saved_train_data, saved_num_records = state.get("train_data"), state.get("num_records")
    if saved_train_data is not None and saved_train_data != train_data:
        raise ConfigError(f"--resume: {ckpt} was trained on {saved_train_data}, this run reads "
                          f"{train_data}; resume with the same data")
    if saved_num_records is not None and saved_num_records != num_records:
        raise ConfigError(f"--resume: {ckpt} was trained on {saved_num_records} records, "
                          f"{train_data} now holds {num_records}; the data changed")
    saved_mix = state.get("mix")
    if mix is not None and saved_mix is not None and saved_mix != mix:
        raise ConfigError(f"--resume: {ckpt} was trained on the mix {saved_mix}, this run has "
                          f"{mix}; the saved positions would name other batches. Resume with "
                          f"the same sources, weights and hard negatives")
