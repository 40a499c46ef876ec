"""Checks that a resumed run continues the run its checkpoint came from: the checkpoint to
resume (a checkpoint directory, or an output directory's latest), the data settings that
decide which records each step reads, the number of processes, and the training file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..engine import distributed as D
from ..errors import ConfigError, shown
from .checkpoint import MANIFEST, checkpoint_problem, list_checkpoints
from .config import TrainConfig
from .runid import RUN_FILE

__all__ = ["resume_path", "auto_resume", "check_resume_matches", "check_resumed_data", "check_resumed_step",
           "check_resumed_base"]

# settings that decide which records each step reads: a resume must keep them
# (train_data is compared by the resolved path the checkpoint's state records)
_DATA_KEYS = ("train_split", "batch_size", "num_hard_negatives", "seed")


def _newest_intact(folder: Path, skip: Path | None = None
                   ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest intact checkpoint of ``folder``'s run (:func:`checkpoint_problem`), other
    than ``skip``, and the damaged ones newer than it, each with what is wrong."""
    damaged: list[tuple[Path, str]] = []
    for _, ckpt in reversed(list_checkpoints(folder, complete=False) if folder.is_dir() else []):
        if skip is not None and ckpt.resolve() == skip.resolve():
            continue
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def auto_resume(output_dir: Path, announce: bool = True) -> tuple[str | None, bool]:
    """``--resume auto``: (what to resume, whether to start anew over a stopped run). The
    output folder itself when it holds a checkpoint of its run (:func:`resume_path` then
    takes the newest intact one); else None, a new run, and True when the folder holds a run
    that stopped before its first checkpoint (its files are moved aside, as --overwrite
    does: nothing is deleted). A job restarted with the same command so continues by itself.
    """
    out = Path(output_dir)
    if out.is_dir() and list_checkpoints(out, complete=False):
        if announce:
            print(f"bigbatch train: --resume auto: continuing the run in {out}", flush=True)
        return str(out), False
    stopped = out.is_dir() and (out / RUN_FILE).exists()
    if stopped and announce:
        print(f"bigbatch train: --resume auto: the run in {out} stopped before its first "
              f"checkpoint; starting it anew (what it wrote is moved aside)", flush=True)
    return None, stopped


def resume_path(resume: str, announce: bool = True) -> Path:
    """The checkpoint ``--resume`` names: the directory itself, or the newest intact
    checkpoint of an output directory (a damaged newer one is skipped, with a line saying
    so when ``announce``). Each is checked against its manifest before it is taken.

    Raises:
        ConfigError: there is no checkpoint there, or the one named is damaged (naming what
            is wrong and the newest intact one, to resume from instead).
    """
    p = Path(resume)
    if (p / "trainer_state.pt").exists() or (p / MANIFEST).exists():
        problem = checkpoint_problem(p)
        if problem is None:
            return p
        intact, _ = _newest_intact(p.parent, skip=p)
        offer = (f"the newest intact checkpoint there is {intact}: resume from it with "
                 f"--resume {intact} (or --resume {p.parent}, which takes it)"
                 if intact is not None else f"no other checkpoint of {p.parent} is intact")
        raise ConfigError(f"--resume: {p} is damaged: {problem}; {offer}")
    latest, damaged = _newest_intact(p)
    if damaged and announce:
        for ckpt, problem in damaged:
            print(f"bigbatch train: {ckpt} is damaged ({problem}); skipped", flush=True)
    if damaged and latest is not None:
        if announce:
            print(f"bigbatch train: resuming from {latest}, the newest intact checkpoint of "
                  f"{p}", flush=True)
        return latest
    if damaged:
        raise ConfigError(f"--resume: every checkpoint of {p} is damaged (the newest, "
                          f"{damaged[0][0].name}: {damaged[0][1]}); nothing intact to resume")
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
    from ..data.readers.yaml_file import load_yaml

    saved_file = ckpt / "config.yaml"
    saved = load_yaml(saved_file, "checkpoint configuration") if saved_file.exists() else {}
    if not isinstance(saved, dict):
        raise ConfigError(f"{saved_file}: expected a mapping of option: value; the checkpoint "
                          f"is damaged: resume from an earlier one")
    for key in _DATA_KEYS:
        now = getattr(config, key)
        if saved.get(key, now) != now:
            raise ConfigError(f"--resume: {ckpt} was written with {key}={shown(saved[key])}, this run "
                              f"has {shown(getattr(config, key))}; the saved data position would "
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


def check_resumed_base(ckpt: Path, saved: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """After loading: the checkpoint's run started from the model this run's ``--model``
    names (:func:`~bigbatch.encoders.source.model_identity`): the same fingerprint (its
    config and first weights) when both have one, else the same path. A checkpoint's
    weights (a LoRA adapter above all) mean nothing over another base model, however alike
    its shapes. A checkpoint from before this record is not compared.

    Raises:
        ConfigError: naming both models.
    """
    if not saved:
        return
    was, fp_was = saved.get("path"), saved.get("fingerprint")
    path, fp = now.get("path"), now.get("fingerprint")
    if (fp_was and fp and fp_was != fp) or (not (fp_was and fp) and was != path):
        what = f"fingerprint {fp_was} (its config.json and first weights)" if fp_was else "a hub name"
        raise ConfigError(f"--resume: {ckpt} was trained from the model {was} ({what}); this "
                          f"run's --model {path} is another model"
                          + (f" (fingerprint {fp})" if fp else "")
                          + ". Resume with the --model it was trained from")

