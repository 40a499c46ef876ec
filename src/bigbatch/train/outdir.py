"""Where a command writes, checked before any work starts; the run folder is the user's.

An output folder belongs to one run (its ``run.json`` names the run). A new run starts only
in a folder that does not exist yet or is empty; one that holds another run's files, or any
other files, is refused with the choices: continue that run (``--resume DIR``), give a new
``--output-dir``, or ``--overwrite``, which moves the folder's contents into
``previous-<timestamp>/`` inside it (nothing is deleted) before the new run starts. A resume
continues in the folder of the run it resumes (or in a new or empty one). ``--overwrite``
never moves an input of the run (its training or evaluation data, model, guide model,
``--config`` or DeepSpeed file): a folder that holds one is refused (:func:`run_inputs`).

An output that is an input of the same command (``eval --output D/corpus.jsonl``,
``make-pairs D D/corpus.jsonl``, a ``convert`` or ``mine`` output over its input) is refused
before the work by :func:`check_not_input`.

The folder is write-tested first (:func:`bigbatch.data.readers.files.check_writable_folder`),
so that an unwritable destination fails before the work, not after.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data.readers.files import check_writable_folder
from ..errors import ConfigError
from .config import config_file_of
from .durable import fsync_dir, move_into_new_folder
from .runid import RUN_FILE, run_id_of, write_run_file

__all__ = ["ARCHIVE_PREFIX", "OutputPlan", "check_output_dir", "claim_output_dir",
           "remove_created", "run_inputs", "check_not_input", "DATA_SUFFIXES"]

# --overwrite moves a folder's contents into <folder>/previous-<timestamp>/; such archives
# stay where they are (a later --overwrite does not nest them) and do not make a folder
# count as holding files
ARCHIVE_PREFIX = "previous-"
# what marks a folder as a bigbatch run's (rather than files of the user's own)
_RUN_MARKERS = (RUN_FILE, "metrics.jsonl", "final", "best")


@dataclass
class OutputPlan:
    """What starting a run in ``path`` does (decided by :func:`check_output_dir`, done by
    :func:`claim_output_dir` on the main rank)."""

    path: Path
    create: bool = False                    # the folder does not exist yet
    move_aside: list[Path] = field(default_factory=list)   # --overwrite: moved into an archive
    created_root: Path | None = None        # the highest folder the claim creates


def _entries(out: Path) -> list[Path]:
    """What ``out`` holds, except the archives of earlier ``--overwrite`` runs."""
    return sorted(p for p in out.iterdir()
                  if not (p.name.startswith(ARCHIVE_PREFIX) and p.is_dir()))


def _is_run(entries: list[Path]) -> bool:
    return any(p.name in _RUN_MARKERS or p.name.startswith("checkpoint-") for p in entries)


def _shown(entries: list[Path], n: int = 5) -> str:
    names = [p.name + ("/" if p.is_dir() else "") for p in entries[:n]]
    return ", ".join(names) + (f", ... ({len(entries)} entries)" if len(entries) > n else "")


def _within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (symbolic links followed)."""
    p, f = path.resolve(), folder.resolve()
    return p == f or f in p.parents


def run_inputs(config: Any) -> list[tuple[str, Path]]:
    """(option, path) of each local file or folder a training run reads: ``--model``,
    ``--guide-model``, every ``--train-data`` source and ``--eval-data`` set, the
    ``--negatives-corpus``, the ``--config`` file and the ``--deepspeed`` file (a hub name
    is none)."""
    items: list[tuple[str, Any]] = [("--model", config.model),
                                    ("--guide-model", config.guide_model),
                                    ("--negatives-corpus", config.negatives_corpus),
                                    ("--config", config_file_of(config)),
                                    ("--deepspeed", config.deepspeed)]
    items += [("--train-data", s.path) for s in config.train_sources()]
    items += [("--eval-data", s.path) for s in config.eval_sets()]
    return [(opt, Path(p)) for opt, p in items
            if isinstance(p, (str, Path)) and p and Path(p).exists()]


def check_output_dir(output_dir: str | Path, *, overwrite: bool = False,
                     resume: Path | None = None, resume_run: str | None = None,
                     inputs: Sequence[tuple[str, Path]] = ()) -> OutputPlan:
    """Decide whether a run may start in ``output_dir``, reading only (call on every rank,
    before anything loads). ``resume``: the checkpoint a resumed run continues, whose run
    id is ``resume_run`` (None for a checkpoint from before run ids); ``inputs``: the run's
    inputs (:func:`run_inputs`), which ``--overwrite`` may not move.

    A folder that does not exist or is empty is fine; so is, for a resume, the folder of
    the run it continues (its ``run.json`` names that run, or it holds the checkpoint). Any
    other content is refused, or with ``overwrite`` is to be moved aside.

    Raises:
        ConfigError: the folder is a file or cannot be written, or holds another run's (or
            any other) files and ``overwrite`` is off, spelling out the choices.
    """
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir: {out} is a file; give a folder (a new or empty one)")
    check_writable_folder(out, "--output-dir")
    if not out.exists():
        root = out.absolute()
        while not root.parent.exists():
            root = root.parent
        return OutputPlan(out, create=True, created_root=root)
    entries = _entries(out)
    if not entries:
        return OutputPlan(out)
    folder_run = run_id_of(out)
    inside = resume is not None and resume.resolve().parent == out.resolve()
    if resume is not None:
        if inside and (resume_run is None or folder_run is None or resume_run == folder_run):
            return OutputPlan(out)
        if not inside and resume_run is not None and resume_run == folder_run:
            return OutputPlan(out)
    archive = f"{out}/{ARCHIVE_PREFIX}<timestamp>/"
    if not overwrite:
        if _is_run(entries):
            whose = "another training run" if resume is not None else "a training run"
            raise ConfigError(
                f"--output-dir: {out} already holds {whose} ({_shown(entries)}); a new run "
                f"does not write over it. Continue that run with --resume {out}, give a new "
                f"--output-dir, or add --overwrite to move what it holds into {archive} "
                f"(nothing is deleted)")
        raise ConfigError(
            f"--output-dir: {out} is not empty ({_shown(entries)}) and holds no bigbatch run; "
            f"a run does not write over other files. Give a new or empty --output-dir, or "
            f"add --overwrite to move them into {archive} (nothing is deleted)")
    if inside:
        raise ConfigError(f"--overwrite: the checkpoint to resume, {resume}, is inside "
                          f"{out}, which holds another run; resume into a new --output-dir")
    held = [(opt, p) for opt, p in inputs if any(_within(p, e) for e in entries)
            or p.resolve() == out.resolve()]
    if held:
        names = ", ".join(f"{p} ({opt})" for opt, p in held[:3])
        raise ConfigError(f"--overwrite: {out} holds an input of this run: {names}; "
                          f"--overwrite would move it away into {archive}. Give a new "
                          f"--output-dir, or move the input out of {out} first")
    return OutputPlan(out, move_aside=entries)


def claim_output_dir(plan: OutputPlan, run_id: str) -> Path | None:
    """Make ``plan.path`` the folder of run ``run_id`` (main rank): create it, or move what
    ``--overwrite`` sets aside into ``previous-<timestamp>/`` (announced), and record the run
    in ``run.json`` (left untouched when it already names the run). Returns the archive
    folder, if one was made."""
    out = plan.path
    dest = None
    if plan.create:
        out.mkdir(parents=True, exist_ok=True)
    if plan.move_aside:
        dest = move_into_new_folder(out, ARCHIVE_PREFIX, plan.move_aside)
        fsync_dir(dest)
        print(f"bigbatch train: --overwrite: moved what {out} held ({_shown(plan.move_aside)}) "
              f"into {dest}; nothing was deleted", flush=True)
    if run_id_of(out) != run_id:
        write_run_file(out, run_id, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    fsync_dir(out)
    return dest


def remove_created(plan: OutputPlan) -> bool:
    """Remove the folder a claim created (with any folders above it it created), after a run
    that failed before writing anything worth keeping; returns whether it did."""
    if not plan.create or plan.created_root is None or not plan.created_root.exists():
        return False
    shutil.rmtree(plan.created_root, ignore_errors=True)
    return True


# files a data folder holds that a command reads (a BEIR corpus, queries and qrels, shards)
DATA_SUFFIXES = (".jsonl", ".tsv", ".csv", ".parquet", ".arrow")


def check_not_input(output: str | Path, option: str,
                    inputs: Iterable[tuple[str, str | Path | None]],
                    output_is_folder: bool = False) -> None:
    """Refuse an output that would replace what the same command reads, before the work:
    an input file itself (symbolic links followed), an input folder, an existing data file
    (:data:`DATA_SUFFIXES`) inside an input folder, any existing file inside an input model
    folder (an input named ``--model``), or, for an output folder (``output_is_folder``),
    one that holds an input. ``inputs``: (option, path) of what the command reads.

    Raises:
        ConfigError: naming ``option``, the output and the input it would replace.
    """
    out = Path(output)
    for opt, given in inputs:
        if not given or not Path(given).exists():
            continue
        src = Path(given)
        if src.is_dir():
            hit = out.resolve() == src.resolve() or (
                _within(out, src) and out.is_file()
                and (opt == "--model" or out.suffix.lower() in DATA_SUFFIXES))
        else:
            hit = out.exists() and out.resolve() == src.resolve()
        if hit or (output_is_folder and _within(src, out)):
            raise ConfigError(f"{option}: {out} is an input of this command ({opt} {src}); "
                              f"writing it would replace what is read. Give another "
                              f"{option}")
