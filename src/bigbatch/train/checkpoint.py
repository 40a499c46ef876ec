"""Checkpoints written atomically: everything goes into a temporary directory next to the
target, which is renamed into place only when complete, so a kill at any moment leaves the
previous checkpoint usable. Each holds the model (weights or adapter, in the loadable
layout of :meth:`TextEncoder.save`), optimizer, scheduler, logit scale, grad scaler, every
random state (per rank), the data position and the id of the run that wrote it
(``run.json``): the latest checkpoint and the rotation consider the folder's own run only.
A write that fails (a full disk) raises :class:`~bigbatch.errors.OutputError` naming the
file and the free space, and leaves the previous checkpoint as it was.

Each checkpoint carries ``manifest.json``: every file it holds with its size and SHA-256,
written inside the atomic write, so that a checkpoint cut short or altered later (a copy
that stopped, a disk that lost blocks, a hand edit) is found before it is loaded
(:func:`checkpoint_problem`) and a resume can take the newest intact one instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .durable import free_space, fsync_dir, move_into_new_folder, write_errors
from .runid import belongs_to, run_id_of, write_run_file

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints",
           "rotate_checkpoints", "abandon_later_checkpoints", "recover_output_dir",
           "finished_run", "rng_state", "set_rng_state", "safe_load", "atomic_dir", "fsync_dir",
           "write_errors", "free_space", "MANIFEST", "write_manifest", "checkpoint_problem",
           "saved_state"]

_NAME = re.compile(r"^checkpoint-(\d+)$")
MANIFEST = "manifest.json"  # every file of a checkpoint: size and SHA-256


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**22), b""):
            h.update(block)
    return h.hexdigest()


def write_manifest(folder: str | Path) -> Path:
    """Write ``folder/manifest.json``: each file under ``folder`` (relative path) with its
    size and SHA-256 (called inside the atomic write of a checkpoint, before its rename)."""
    folder = Path(folder)
    files = {str(f.relative_to(folder)): {"size": f.stat().st_size, "sha256": _sha256(f)}
             for f in sorted(folder.rglob("*")) if f.is_file() and f.name != MANIFEST}
    path = folder / MANIFEST
    path.write_text(json.dumps({"version": 1, "files": files}, indent=1) + "\n")
    return path


def checkpoint_problem(folder: str | Path) -> str | None:
    """What is wrong with a checkpoint by its manifest (a file missing, of another size, or
    whose SHA-256 differs: cut short or altered since it was written), or None when it is
    intact. A checkpoint from before manifests is taken as it is (None) when it holds its
    trainer state."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.exists():
        return None if (folder / "trainer_state.pt").exists() else "no trainer_state.pt"
    try:
        files = json.loads(path.read_text())["files"]
        items = [(str(k), int(v["size"]), str(v["sha256"])) for k, v in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return f"its {MANIFEST} cannot be read (damaged)"
    for name, size, digest in items:
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size:,} bytes, {size:,} when it was written (cut short?)"
        if _sha256(f) != digest:
            return f"{name} was altered since it was written (its SHA-256 differs)"
    return None


def rng_state() -> dict[str, Any]:
    """Python, NumPy (if installed), torch CPU and accelerator random states, in forms that
    :func:`safe_load` reads back (tensors, numbers, strings, lists: no NumPy arrays)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss],
                             "torch": torch.get_rng_state()}
    try:
        import numpy as np
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos),
                          int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def safe_load(path: str | Path, *, mmap: bool = False) -> Any:
    """Read a ``.pt`` file of a checkpoint with ``torch.load(weights_only=True)``: tensors,
    numbers, strings and containers only, so a crafted pickle (one whose ``__reduce__``
    calls ``os.system``, say) is refused instead of run. Checkpoints travel between people
    and machines; nothing in one is trusted.

    Raises:
        ConfigError: the file holds anything else (a crafted or foreign file), or cannot be
            read (truncated).
    """
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: refused to load: it holds objects other than tensors, "
                          f"numbers and strings, which a bigbatch checkpoint never does "
                          f"(a crafted or foreign file?); nothing in it was run. "
                          f"({first})") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: cannot be read ({first}); the checkpoint is truncated "
                          f"or damaged: resume from an earlier one") from e


class atomic_dir:
    """``with atomic_dir(final) as tmp:`` write into ``tmp``; on success ``tmp`` replaces
    ``final`` (the old one is moved aside to ``.NAME.old-PID`` first, then deleted once the
    new one's rename is on disk); on failure ``tmp`` is removed and ``final`` is untouched.

    Replacing a directory takes two renames; a hard kill between them leaves only
    ``.NAME.old-PID``, and one during the write leaves ``.NAME.tmp-PID``:
    :func:`recover_output_dir` puts such a directory back and clears the rest."""

    def __init__(self, final: str | Path) -> None:
        self.final = Path(final)
        self.tmp = self.final.with_name(f".{self.final.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for f in self.tmp.rglob("*"):  # flush file contents before the rename
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        for d in [*(p for p in self.tmp.rglob("*") if p.is_dir()), self.tmp]:
            fsync_dir(d)  # and the directory entries naming them
        old = self.final.with_name(f".{self.final.name}.old-{os.getpid()}")
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)  # both renames on disk before the old copy goes
        if old.exists():
            shutil.rmtree(old)


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def recover_output_dir(output_dir: str | Path) -> list[str]:
    """Repair what a hard kill inside :class:`atomic_dir` left in ``output_dir``; call at the
    start of a run, on the main rank, before anything reads or writes there.

    * ``.X.old-PID`` whose ``X`` is missing (killed between the two renames of a replacement)
      is renamed back to ``X``: the replacement never completed, so the previous version is
      the consistent one (with several, the newest is restored);
    * ``.X.old-PID`` whose ``X`` exists (killed before the old copy was deleted) is removed;
    * ``.X.tmp-PID`` (a write that never completed) is removed.

    Returns one line per action (also printed).
    """
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found: dict[str, dict[str, list[Path]]] = {}
    for p in out.iterdir():
        m = _LEFTOVER.match(p.name)
        if m:
            found.setdefault(m["name"], {"tmp": [], "old": []})[m["kind"]].append(p)
    done: list[str] = []
    for name, kinds in sorted(found.items()):
        target = out / name
        olds = sorted(kinds["old"], key=lambda p: p.stat().st_mtime_ns)
        if olds and not target.exists():
            os.replace(olds[-1], target)
            fsync_dir(out)
            done.append(f"restored {target} from {olds[-1].name} (a kill interrupted its "
                        f"replacement)")
            olds = olds[:-1]
        for p in olds + kinds["tmp"]:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            done.append(f"removed {p} (left by an interrupted write)")
    for line in done:
        print(f"bigbatch train: {line}", flush=True)
    return done


def save_checkpoint(path: str | Path, *, encoder: Any, loss_fn: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                    state: dict[str, Any], config: Any, rank_states: list[dict[str, Any]]) -> Path:
    """Write a checkpoint atomically (call on the main rank, with every rank's RNG state).

    Raises:
        OutputError: a file could not be written (a full disk): the previous checkpoint of
            that name is left as it was.
    """
    path = Path(path)
    hint = f"continue with --resume {path.parent}"
    with atomic_dir(path) as tmp:
        with write_errors(path / "model", hint):
            encoder.save(tmp / "model")
        with write_errors(path / "trainer_state.pt", hint):
            torch.save({
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "loss_fn": loss_fn.state_dict(),
                "trainable": {n: p.detach().cpu() for n, p in encoder.named_parameters()
                              if p.requires_grad},
                "state": state,
            }, tmp / "trainer_state.pt")
        for r, s in enumerate(rank_states):
            with write_errors(path / f"rng_state_rank{r}.pt", hint):
                torch.save(s, tmp / f"rng_state_rank{r}.pt")
        with write_errors(path / "config.yaml", hint):
            config.write(tmp / "config.yaml")
            if state.get("run_id"):
                write_run_file(tmp, state["run_id"], step=state.get("step"))
        with write_errors(path / MANIFEST, hint):
            write_manifest(tmp)
    return path


def load_checkpoint(path: str | Path, *, encoder: Any, loss_fn: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any,
                    rank: int = 0) -> dict[str, Any]:
    """Restore everything :func:`save_checkpoint` wrote; returns the saved ``state`` dict.

    Raises:
        ConfigError: not a checkpoint, or saved with a different model or world size.
    """
    path = Path(path)
    f = path / "trainer_state.pt"
    if not f.exists():
        raise ConfigError(f"--resume: {path} is not a bigbatch checkpoint (no trainer_state.pt)")
    blob = safe_load(f)
    params = dict(encoder.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in blob["trainable"]]
    if missing:
        raise ConfigError(f"--resume: {path} was saved from a different model or LoRA setting "
                          f"(missing {missing[:3]}...)")
    other = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in blob["trainable"].items()
             if n in params and tuple(t.shape) != tuple(params[n].shape)]
    unknown = [n for n in blob["trainable"] if n not in params]
    if other or unknown:
        what = (f"{other[0][0]} is {other[0][1]} there, {other[0][2]} here" if other else
                f"{unknown[0]} is not a weight of this model")
        raise ConfigError(f"--resume: {path} was saved from a model of another shape ({what}; "
                          f"{len(other) + len(unknown)} weight(s) differ); resume with the "
                          f"--model and settings it was trained with")
    with torch.no_grad():
        for n, t in blob["trainable"].items():
            params[n].copy_(t)
    loss_fn.load_state_dict(blob["loss_fn"])
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    if scaler is not None and blob.get("scaler") is not None:
        scaler.load_state_dict(blob["scaler"])
    rng_file = path / f"rng_state_rank{rank}.pt"
    if not rng_file.exists():
        raise ConfigError(f"--resume: {path} has no random state for rank {rank}; resume with "
                          f"the world size it was saved with")
    set_rng_state(safe_load(rng_file))
    return blob["state"]


def _folder_run(out: Path) -> str | None:
    """The run ``out`` belongs to: its ``run.json``, else the run of the checkpoint written
    last (None: a folder from before run ids, where every checkpoint counts)."""
    own = run_id_of(out)
    if own is not None:
        return own
    found = [p for p in out.glob("checkpoint-*") if _NAME.match(p.name)
             and (p / "trainer_state.pt").exists()]
    if not found:
        return None
    return run_id_of(max(found, key=lambda p: (p / "trainer_state.pt").stat().st_mtime_ns))


def list_checkpoints(output_dir: str | Path, run_id: str | None = None,
                     complete: bool = True) -> list[tuple[int, Path]]:
    """``(step, path)`` of each ``checkpoint-N`` in ``output_dir`` written by run ``run_id``
    (default: the folder's run; see :func:`~bigbatch.train.runid.belongs_to`), by step;
    ``complete``: only those holding ``trainer_state.pt`` (temporary ones never count)."""
    out = Path(output_dir)
    if run_id is None:
        run_id = _folder_run(out)
    found = []
    for p in out.glob("checkpoint-*"):
        m = _NAME.match(p.name)
        if m and (not complete or (p / "trainer_state.pt").exists()) and belongs_to(p, run_id):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path, run_id: str | None = None) -> Path | None:
    """The complete checkpoint with the highest step among those of run ``run_id`` (default:
    the folder's run) in ``output_dir``; another run's checkpoints never outrank its own."""
    found = list_checkpoints(output_dir, run_id)
    return found[-1][1] if found else None


def rotate_checkpoints(output_dir: str | Path, keep: int, run_id: str | None = None) -> None:
    """Delete all but the ``keep`` newest ``checkpoint-N`` directories of run ``run_id``
    (default: the folder's run); another run's are never deleted (``best/`` is separate)."""
    if keep <= 0:
        return
    for _, p in list_checkpoints(output_dir, run_id, complete=False)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def saved_state(ckpt: str | Path) -> dict[str, Any]:
    """The training state a checkpoint holds (step, data position, base model, ...), read
    memory-mapped (the optimizer state is not read); empty when there is none.

    Raises:
        ConfigError: its trainer state cannot be read safely (:func:`safe_load`).
    """
    f = Path(ckpt) / "trainer_state.pt"
    if not f.exists():
        return {}
    blob = safe_load(f, mmap=True)
    state = blob.get("state") if isinstance(blob, dict) else None
    return state if isinstance(state, dict) else {}


def _saved_step(ckpt: Path) -> int | None:
    """The step a checkpoint-like folder (``checkpoint-N``, ``best/``) was saved at."""
    f = ckpt / "trainer_state.pt"
    if not f.exists():
        return None
    try:  # memory-mapped: the optimizer state is not read
        return int(safe_load(f, mmap=True)["state"]["step"])
    except (ConfigError, KeyError, TypeError, ValueError):  # unreadable: left where it is
        return None


def abandon_later_checkpoints(output_dir: str | Path, step: int) -> Path | None:
    """Move what ``output_dir`` holds from later than ``step`` into a new
    ``abandoned-<timestamp>/`` folder there: every ``checkpoint-N`` with ``N > step``,
    ``best/`` when it was saved after ``step``, and ``final/`` (and ``merged/``) with
    ``summary.json`` when the summary names a later step (or, without a summary, when
    later checkpoints were found).
    Call on the main rank when a run resumes from ``step``. Returns that folder, or None when
    there was nothing to move.

    Those belong to the timeline the resume branches away from: left in place, later
    checkpoints would outrank the resumed run's own (rotation would delete the new ones, and
    a later ``--resume output_dir`` would continue the old timeline), and ``best/`` would
    hold a model the resumed run's record of its best does not know. Nothing is deleted; a
    copy of ``metrics.jsonl`` goes along, as the resumed run keeps only its rows up to
    ``step``.
    """
    out = Path(output_dir)
    found = sorted((int(m.group(1)), p) for p in out.glob("checkpoint-*")
                   if (m := _NAME.match(p.name)) and int(m.group(1)) > step)
    later = [p for _, p in found]
    best = out / "best"
    if (best_step := _saved_step(best)) is not None and best_step > step:
        later.append(best)
    summary = out / "summary.json"
    try:
        summary_step = json.loads(summary.read_text()).get("steps") if summary.exists() else None
    except (OSError, ValueError):
        summary_step = None
    if (out / "final").is_dir() and (summary_step is not None and summary_step > step
                                     or summary_step is None and later):
        later.append(out / "final")
        if (out / "merged").is_dir():  # --merge-last's, made at that end
            later.append(out / "merged")
    if summary_step is not None and summary_step > step:
        later.append(summary)
    if not later:
        return None
    dest = move_into_new_folder(out, "abandoned-", later)
    if (out / "metrics.jsonl").exists():
        shutil.copy2(out / "metrics.jsonl", dest / "metrics.jsonl")
    fsync_dir(dest)
    fsync_dir(out)
    print(f"bigbatch train: resuming from step {step}, but {out} holds outputs of a later "
          f"point of the run ({', '.join(p.name for p in later)}); they belong to the "
          f"timeline this resume abandons and were moved to {dest}", flush=True)
    return dest


def finished_run(output_dir: str | Path, step: int, max_steps: int,
                 announce: bool = True, run_id: str | None = None) -> dict[str, Any] | None:
    """The saved ``summary.json`` of ``output_dir`` when a run resumed at ``step`` has nothing
    left to do, else None.

    Finished means: ``step`` reached ``max_steps``, ``final/`` exists and ``summary.json``
    (written last, after the final evaluation and ``final/``) is there and names ``step``.
    A run killed anywhere before that point is not finished and redoes only its end (final
    evaluation, checkpoint, ``final/``). ``announce`` prints a line saying so (main rank).
    A summary naming another run than ``run_id`` is not this run's.
    """
    out = Path(output_dir)
    if step < max_steps or not (out / "final").is_dir():
        return None
    try:
        summary = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("steps") != step:
        return None
    if run_id is not None and summary.get("run_id", run_id) != run_id:
        return None
    if announce:
        print(f"bigbatch train: the run in {out} already finished ({step} of {max_steps} "
              f"steps, final model in {out / 'final'}); nothing to resume", flush=True)
    return summary
