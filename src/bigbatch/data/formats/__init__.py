"""Reading and writing the training-data formats of the field, through one record type
(:class:`~bigbatch.data.records.types.Record`).

Formats (``--from`` / ``--to`` names), one module each, registered in one table of how each
is detected, read and written:

- ``contrastors`` (:mod:`.contrastors`): Qwen3-VL-Embedding's training pipeline's JSONL, documents
as files
  (``chunk_path``, ``neg_chunk_paths``) or as text (``positive``, ``negatives``).
- ``swift`` (:mod:`.swift`): ms-swift's embedding JSONL (``messages``,
  ``positive_messages`` / ``negative_messages``, ``positive_images`` / ``negative_images``).
  Each conversation's system message is read as its instruction and written back as it was
  (records of other formats get the instruction options); bigbatch applies one instruction
  per side, so records whose system prompts differ are reported, and a format without an
  instruction field (``contrastors``, ``st``, ``beir``) takes the prompts only with
  ``--allow-lossy`` (a single prompt per side is named in the report instead).
- ``st`` (:mod:`.st`): sentence-transformers columns (``anchor``, ``positive``,
  ``negative_1..k``) as JSONL, Parquet, CSV or a ``datasets`` folder. Text only.
- ``colpali`` (:mod:`.colpali`): colpali-engine / ViDoRe tables with page images in the
  rows: read only by conversion, which writes the images to files
  (:mod:`bigbatch.data.tools.convert_colpali`); validate and training say so, with the command.
- ``beir`` (:mod:`.beir`): a BEIR directory. Text documents and (query, positive) pairs only.

A folder of JSONL or Parquet shards (:mod:`bigbatch.data.readers.shards`) is read as one source in
the format of its first shard, each shard naming itself in messages.

Teacher scores for distillation (a record's ``pos_score`` and ``neg_scores``, kept on each
document as :attr:`~bigbatch.data.records.types.Doc.score`) are read and written by ``contrastors``,
``swift`` (the same two keys) and ``st`` (columns ``pos_score``, ``neg_score_1..k``); each
reader checks them against the record's negatives (:func:`.common.with_scores`).

What a target format cannot hold (an image in ``st``, negatives in ``beir``) is never
dropped silently: conversion stops with a report, or drops it and reports it when asked.

Sources are read one record at a time (:func:`stream_records`: JSONL by line, Parquet and
Arrow by record batch, shard folders shard by shard; a BEIR directory whole, as training
reads it) and written as the records come (:func:`write_records`: JSONL line by line,
Parquet a row group at a time), so ``bigbatch validate`` and ``bigbatch convert`` hold no
list of records; :func:`read_records` is the list of the same stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ...errors import DataError
from ..readers.files import open_data_file
from ..readers.jsonl import open_jsonl, parse_json
from ..readers.shards import is_shard_folder, shard_files
from ..records.types import Doc, Problem, Record
from . import beir, colpali, contrastors, st, swift
from .common import Format, WriteOptions
from .instructions import instruction_problems, system_prompts
from .output import KeptRecords, staged
from .swift import SWIFT_DOC_INSTRUCTION, SWIFT_QUERY_INSTRUCTION

__all__ = ["Doc", "Record", "Problem", "Format", "FORMATS", "READ_ONLY_FORMATS", "read_records",
           "stream_records", "get_format",
           "write_records", "detect_format", "format_of", "check_output", "no_records_problem",
           "SWIFT_QUERY_INSTRUCTION", "SWIFT_DOC_INSTRUCTION", "instruction_problems",
           "system_prompts"]

# every format by name: those written, then those read only by conversion
_TABLE: dict[str, Format] = {f.name: f for f in (contrastors.FORMAT, swift.FORMAT, st.FORMAT,
                                                 beir.FORMAT, colpali.FORMAT)}
FORMATS = tuple(name for name, f in _TABLE.items() if f.write is not None)
# formats read only by `bigbatch convert` (written as one of FORMATS)
READ_ONLY_FORMATS = tuple(name for name, f in _TABLE.items() if f.write is None)
# the order detect_format asks the formats in, most specific first: a colpali table is also
# an st table, and a JSON object is contrastors once swift and st have declined it
_DETECTION_ORDER = ("colpali", "beir", "swift", "st", "contrastors")


def _first_keys(path: Path) -> tuple[set | None, int | None, str]:
    """(the keys of a JSONL file's first record, or None; the line it is on; why it holds
    none: "" for an empty file, else what is wrong with that line)."""
    with open_jsonl(path) as f:  # bad bytes are left to the reader to report
        for n, line in enumerate(f, 1):
            if line.strip():
                rec, why = parse_json(line)
                if why is not None:
                    return None, n, why
                if not isinstance(rec, dict):
                    return None, n, "expected a JSON object"
                return set(rec), n, ""
    return None, None, ""


def detect_format(path: str | Path) -> str:
    """Guess the format from a directory (a folder of shards has its first shard's format,
    a Hugging Face ``datasets`` folder is st, any other BEIR), a .parquet or .csv file (st)
    or the first record's keys. Parquet or a ``datasets``
    folder with colpali-engine's columns (a ``query`` and a page-image column) is
    ``colpali``, which is only read by conversion (:mod:`bigbatch.data.tools.convert_colpali`).

    Raises:
        DataError: an empty file, or a first record that is not a JSON object (naming its
            line and column), or a file that cannot be read.
    """
    path = Path(path)
    if is_shard_folder(path):  # the format of its first shard
        return detect_format(shard_files(path)[0])
    formats = [_TABLE[name] for name in _DETECTION_ORDER]
    for f in formats:
        if f.detect_path is not None and f.detect_path(path):
            return f.name
    keys, line, why = _first_keys(path)
    if keys is not None:
        for f in formats:
            if f.detect_keys is not None and f.detect_keys(keys):
                return f.name
    raise DataError(f"cannot tell the format: {why or 'the file is empty'}; "
                    f"{'fix the line or ' if why else ''}pass --format", path=str(path), line=line)


def format_of(path: str | Path) -> str:
    """The format of a training file (:func:`detect_format`); Qwen3-VL-Embedding's ``contrastors``
    keys when the first line cannot tell (its reader then reports what is wrong, with every
    other problem of the file). Training and ``bigbatch validate`` read files this way."""
    try:
        return detect_format(path)
    except DataError:
        return "contrastors"


def _unknown(fmt: str) -> DataError:
    return DataError(f"unknown format {fmt!r}; choose one of {FORMATS}")


def get_format(fmt: str) -> Format:
    """The table entry of format ``fmt``.

    Raises:
        DataError: an unknown format, naming those there are.
    """
    if fmt not in _TABLE:
        raise _unknown(fmt)
    return _TABLE[fmt]


def _parts(path: Path, split: str) -> list[Path]:
    """The files a source is read from: the shards of a shard folder, else itself."""
    return shard_files(path, split) if is_shard_folder(path) else [path]


def no_records_problem(path: str | Path, fmt: str) -> Problem:
    """The problem of a source without a single record (and nothing else wrong with it)."""
    return Problem(str(path), None, None, f"no records (read as {fmt}): nothing to train on; "
                   f"give a file with at least one record")


def stream_records(path: str | Path, fmt: str | None, split: str, problems: list[Problem]
                   ) -> Iterator[Record]:
    """The records of ``path`` (a file, a folder of shards, a ``datasets`` folder or a BEIR
    directory) in format ``fmt`` (detected when None), one at a time where the format
    streams (else read whole), adding the problems found to ``problems``. A source without a
    single record, and nothing else wrong with it, is a problem too (:func:`read_records`)."""
    path = Path(path)
    if not path.exists():
        raise DataError("not found", path=str(path))
    if not path.is_dir():  # a FIFO or a device is refused before any reader opens it
        open_data_file(path).close()
    fmt = fmt or detect_format(path)
    f = get_format(fmt)
    before, count = len(problems), 0
    for part in _parts(path, split):
        for r in (f.stream or f.read)(part, problems, split):
            count += 1
            yield r
    if not count and len(problems) == before:
        problems.append(no_records_problem(path, fmt))


def read_records(path: str | Path, fmt: str | None = None, split: str = "train"
                 ) -> tuple[list[Record], list[Problem]]:
    """Records of ``path`` (a file, a folder of shards, a ``datasets`` folder or a BEIR
    directory) in format ``fmt`` (detected when None) and the problems found. A source
    without a single record, and nothing else wrong with it (an empty file), is a problem
    too: there is nothing to train on or convert."""
    problems: list[Problem] = []
    records = list(stream_records(path, fmt, split, problems))
    return records, problems


def check_output(out: str | Path, fmt: str) -> None:
    """Refuse an output path whose suffix does not name what format ``fmt`` writes there (a
    ``.xlsx`` file of JSONL, a ``.parquet`` file of swift): checked before anything is
    written.

    Raises:
        DataError: naming the suffixes ``fmt`` writes.
    """
    f = _TABLE.get(fmt)
    if f is None or f.write is None:
        raise _unknown(fmt)
    out = Path(out)
    if f.writes_folder:
        if out.is_file():
            raise DataError(f"{fmt} writes a folder, and this is a file; give a folder path",
                            path=str(out))
        return
    if out.suffix.lower() not in f.suffixes:
        raise DataError(f"{fmt} is written as {' or '.join(f.suffixes)}, not "
                        f"{out.suffix or 'a name without a suffix'}; name the output "
                        f"{out.stem}{f.suffixes[0]}" +
                        (f" (or convert --to st for {out.suffix})"
                         if fmt != "st" and out.suffix.lower() in _TABLE["st"].suffixes else ""),
                        path=str(out))


def write_records(records: Iterable[Record], out: str | Path, fmt: str, *,
                  allow_lossy: bool = False,
                  query_instruction: str = SWIFT_QUERY_INSTRUCTION,
                  doc_instruction: str = SWIFT_DOC_INSTRUCTION, split: str = "train",
                  reread: Callable[[], Iterable[Record]] | None = None) -> dict[str, Any]:
    """Write ``records`` (a list, or any iterable: read once, one record at a time, and
    written as it comes) as ``fmt``; returns a report (``read``: the records given,
    ``written``, ``dropped``, ...). An output suffix ``fmt`` does not write is refused
    (:func:`check_output`). What ``fmt`` cannot hold raises :class:`DataError` listing the
    records, unless ``allow_lossy`` (then it is dropped and counted in the report). Relative
    image and text-file paths are rebased from each record's source folder to the output's
    folder, so they name the same files.

    The output is written under a temporary name beside ``out`` and takes its place only
    when no record was refused (:func:`~bigbatch.data.formats.output.staged`): an error,
    here or raised by ``records`` while it is read, leaves ``out`` as it was. ``reread``
    gives the records again, to name those whose system prompts differ when that refuses
    the conversion (default: ``records`` itself when it is a list or tuple)."""
    out = Path(out)
    check_output(out, fmt)
    f = _TABLE[fmt]
    if reread is None and isinstance(records, (list, tuple)):
        reread = lambda: records  # noqa: E731
    kept = KeptRecords(f, out if f.writes_folder else out.parent)
    with staged(out, f.writes_folder) as tmp:
        error = None
        try:
            f.write(kept(records), tmp, WriteOptions(query_instruction, doc_instruction, split))
        except DataError as e:  # a writer's refusal comes after those below
            if not kept.done:
                raise
            error = e if e.path != str(tmp) else \
                DataError(e.message, path=str(out), line=e.line, field=e.field)
        if kept.dropped_count and not allow_lossy:
            shown = "\n  ".join(kept.dropped)
            raise DataError(f"{kept.dropped_count} record(s) cannot be written as {fmt} without "
                            f"loss:\n  {shown}\nconvert to another format, or pass "
                            f"--allow-lossy to drop them (they are counted in the report)")
        report = kept.report(fmt)
        if f.instructions:  # the records' own system messages win over the instruction options
            report["system_prompts_kept"] = kept.with_system
        else:  # per-record system prompts have no field in the target
            differ = kept.prompt_problems()
            if differ and not allow_lossy:
                shown = "\n  ".join(str(p) for p in kept.shown_prompt_problems(reread))
                raise DataError(f"{differ} record(s) carry system prompts that differ, which "
                                f"{fmt} cannot hold (it has no instruction field):\n  {shown}\n"
                                f"convert to swift, split the file by instruction, or pass "
                                f"--allow-lossy to write the records without their system "
                                f"prompts (counted in the report)")
            report["system_prompts_dropped"] = kept.with_prompt if differ else 0
            report["system_prompts"] = {} if differ else kept.systems.prompts()
        if error is not None:
            raise error
    return report
