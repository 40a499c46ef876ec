"""Writing converted records as they are read: what
:func:`~bigbatch.data.formats.write_records` needs to stream.

- :func:`staged`: the output is written beside its place under a temporary name and takes
  its place only once every record was read and written without a finding, so a
  conversion that stops (a problem in the input, a record the target cannot hold) leaves
  the output path as it was.
- :class:`KeptRecords`: the records a format writes, passed on one at a time, with what
  the report and the refusals need counted as they pass (what cannot be held, system
  prompts): no list of records is kept.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..records.types import Doc, Problem, Record, source_folder
from .common import Format
from .instructions import SystemCounts, record_systems

__all__ = ["staged", "KeptRecords", "lossy_reason", "rebase", "SHOWN"]

SHOWN = 10  # records named in a refusal


@contextmanager
def staged(out: Path, folder: bool) -> Iterator[Path]:
    """A temporary path beside ``out`` to write to (a folder when ``folder``). When the
    block ends normally it takes ``out``'s place (a folder's files are moved into ``out``,
    any other file there kept, as writing into it keeps them); on an exception it is
    removed and ``out`` is left as it was."""
    full = Path(os.path.abspath(out))
    tmp = full.with_name(f".{full.stem if not folder else full.name}.tmp-{os.getpid()}"
                         f"{'' if folder else full.suffix}")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
        raise
    if not folder:
        os.replace(tmp, full)
        return
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            dest = full / f.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(f, dest)
    shutil.rmtree(tmp, ignore_errors=True)


def lossy_reason(r: Record, f: Format) -> str | None:
    """Why format ``f`` cannot hold ``r`` (what its reader could not represent, or what
    ``f`` has no field for), or None."""
    if r.lost:
        return "; ".join(f"{k}: {what} cannot be represented" for k, what in r.lost)
    return f.cannot_hold(r)


def rebase(r: Record, out_dir: Path) -> Record:
    """``r`` with each relative image or text-file path resolved against its source's folder
    and written relative to ``out_dir`` (where readers of the output resolve it); absolute
    paths are kept as they are."""
    base = source_folder(r)
    if base is None:
        return r

    def doc(d: Doc) -> Doc:
        ref = d.image or d.path
        if ref is None or Path(os.path.expanduser(ref)).is_absolute():  # "~/x.png" is absolute
            return d
        new = os.path.relpath(os.path.abspath(base / ref), os.path.abspath(out_dir))
        return replace(d, image=new) if d.image else replace(d, path=new)

    return replace(r, positive=doc(r.positive), negatives=[doc(d) for d in r.negatives])


class KeptRecords:
    """The records of a conversion to format ``f`` whose output is ``out_dir``'s: calling it
    on the records read yields those ``f`` can hold (rebased to ``out_dir``), one at a
    time, and counts what the report and the refusals of
    :func:`~bigbatch.data.formats.write_records` need."""

    def __init__(self, f: Format, out_dir: Path) -> None:
        self.format, self.out_dir = f, out_dir
        self.read = self.written = 0
        self.dropped: list[str] = []  # the first SHOWN records not held, as "file:line: why"
        self.dropped_count = 0
        self.reasons: set[str] = set()
        self.systems = SystemCounts()
        self.document_prompts = 0  # documents whose prompt is not their positive's
        self.shown_prompts: list[Problem] = []  # the first SHOWN of those
        self.with_system = 0  # records with a system message (None: the format has none)
        self.with_prompt = 0  # records with a non-empty system prompt
        self.done = False  # every record was read

    def __call__(self, records: Iterable[Record]) -> Iterator[Record]:
        for r in records:
            self.read += 1
            why = lossy_reason(r, self.format)
            if why is not None:
                self.dropped_count += 1
                self.reasons.add(why)
                if len(self.dropped) < SHOWN:
                    self.dropped.append(f"{r.source}:{r.line}: {why}")
                continue
            r = rebase(r, self.out_dir)
            self.systems.add(r)
            found = self.systems.document_problems(r)
            self.document_prompts += len(found)
            self.shown_prompts.extend(found[:SHOWN - len(self.shown_prompts)])
            systems = record_systems(r)
            self.with_system += any(v is not None for v in systems)
            self.with_prompt += any(systems)
            self.written += 1
            yield r
        self.done = True

    def prompt_problems(self) -> int:
        """How many problems :func:`~.instructions.instruction_problems` finds in the records
        kept (their system prompts differ)."""
        return self.document_prompts + self.systems.side_problem_count()

    def shown_prompt_problems(self, reread: Callable[[], Iterable[Record]] | None
                              ) -> list[Problem]:
        """The first :data:`SHOWN` of those problems, in record order: from a second reading
        of the records (``reread``), or without one, those found in a record alone."""
        if reread is None:
            return self.shown_prompts
        shown: list[Problem] = []
        for r in reread():
            if lossy_reason(r, self.format) is None:
                shown.extend(self.systems.problems(r))
                if len(shown) >= SHOWN:
                    break
        return shown[:SHOWN]

    def report(self, fmt: str) -> dict[str, Any]:
        """The report's counts (what system prompts became is added by the caller)."""
        return {"format": fmt, "read": self.read, "written": self.written,
                "dropped": self.dropped_count, "dropped_reasons": sorted(self.reasons),
                "system_prompts": {}, "system_prompts_dropped": 0, "system_prompts_kept": 0}
