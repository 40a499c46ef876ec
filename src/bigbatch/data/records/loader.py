"""Training records and their validation.

A record is one query, one positive document and zero or more negatives. Files may be in any
file format of :mod:`bigbatch.data.formats` (detected); JSONL files usually use
Qwen3-VL-Embedding's training pipeline's keys (``query``; the positive as ``positive`` text or
``chunk_path``,
a path to a text file or a page image; negatives as ``negatives`` texts or
``neg_chunk_paths``). Relative paths resolve against the JSONL file's folder. Image paths
become :class:`~bigbatch.data.records.types.ImageDoc` documents, opened only when their chunk is
embedded; each one is checked to be a readable image here. Every problem in a file is
collected and reported with file, line and field before training starts.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError, DataError, shown
from ..formats import detect_format, format_of, instruction_problems, read_records
from ..readers.beir_dir import beir_training_records
from ..readers.files import MAX_TEXT_FILE_BYTES, outside_root, read_limited, text_too_long
from .image_checks import check_image
from .types import (
    IMAGE_SUFFIXES,
    Doc,
    ImageDoc,
    Problem,
    Record,
    TrainRecord,
    problem_lines,
    source_folder,
)

# TrainRecord is defined in bigbatch.data.records.types and stays importable from here
__all__ = ["TrainRecord", "load_jsonl_records", "load_records", "resolve_doc", "resolve_record",
           "train_record", "raise_problems", "short_negatives_error",
           "beir_hard_negatives_error", "RecordSummary", "summarize", "check_instructions",
           "check_teacher_scores", "document_file", "paths_outside"]


_IMAGE_MAGIC = (b"\x89PNG", b"\xff\xd8\xff", b"GIF8", b"RIFF", b"BM", b"II*\x00", b"MM\x00*")


def document_file(doc: Doc, base: Path) -> Path | None:
    """The file a document names (its image or text file; relative paths against ``base``,
    ``~`` as the home folder, as ms-swift), or None for a text document."""
    if doc.image is None and doc.path is None:
        return None
    ref = os.path.expanduser(doc.image or doc.path or "")  # "~/pages/p1.png", as ms-swift
    return Path(ref) if Path(ref).is_absolute() else base / ref


def paths_outside(records: list[Record], data_root: str | Path | None) -> list[Problem]:
    """A problem for each document file of ``records`` that resolves outside ``data_root``
    (none without a data root: :func:`~bigbatch.data.readers.files.outside_root`)."""
    problems = []
    for r in records if data_root else []:
        base = source_folder(r) or Path(".")
        for i, d in enumerate((r.positive, *r.negatives)):
            full = document_file(d, base)
            why = None if full is None else outside_root(full, data_root)
            if why is not None:
                field = d.key or ("positive" if i == 0 else f"negatives[{i - 1}]")
                problems.append(Problem(r.source, r.line, field, why))
    return problems


def resolve_doc(doc: Doc, base: Path, path: str | Path, line: int, problems: list[Problem],
                field: str | None = None, data_root: str | Path | None = None,
                check_image_file: bool = True) -> str | ImageDoc | None:
    """A parsed document as training input: its text, the text of its file (UTF-8, a regular
    file of at most :data:`~bigbatch.data.readers.files.MAX_TEXT_FILE_BYTES`), or an
    :class:`ImageDoc` for a readable image (relative paths resolve against ``base``; with
    ``data_root``, a file outside that folder is refused). Otherwise None, and a problem
    naming ``path:line`` and the document's field (its source key, else ``field``) is added
    to ``problems``. ``bigbatch validate`` and the training loader both check documents with
    this function; records read again after that check (by index, :mod:`.store`)
    skip the image check (``check_image_file=False``: the image is opened when embedded)."""
    field = doc.key or field
    if doc.text is not None and (why := text_too_long(doc.text)) is not None:
        problems.append(Problem(str(path), line, field, f"the text {why}"))
        return None
    if doc.image is None and doc.text is not None:
        return doc.text
    full = document_file(doc, base) or base
    ref = os.path.expanduser(doc.image or doc.path or "")
    why = outside_root(full, data_root)
    if why is not None:
        problems.append(Problem(str(path), line, field, why))
        return None
    if doc.image is not None and not check_image_file:
        return ImageDoc(str(full.resolve()), doc.text or "")
    if doc.image is not None:
        why = check_image(full)
        if why is not None:
            problems.append(Problem(str(path), line, field, why + _path_hint(ref, full, base)))
            return None
        return ImageDoc(str(full.resolve()), doc.text or "")
    at = "" if Path(ref).is_absolute() else f" (at {shown(str(full))})"
    try:
        data = read_limited(full, MAX_TEXT_FILE_BYTES)
    except OSError as e:
        problems.append(Problem(str(path), line, field,
                                f"cannot read {shown(ref)}{at}: {e.strerror or e}"))
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        hint = ("; it looks like an image: image paths must end in one of "
                f"{' '.join(sorted(IMAGE_SUFFIXES))}" if data.startswith(_IMAGE_MAGIC)
                else "; re-encode it as UTF-8")
        problems.append(Problem(str(path), line, field, f"{shown(ref)}{at} is not UTF-8 text "
                                f"({e.reason} at byte {e.start}){hint}"))
        return None
    if not text.strip():
        problems.append(Problem(str(path), line, field, f"{shown(ref)}{at} is empty"))
        return None
    return text


def _path_hint(ref: str, full: Path, base: Path) -> str:
    """Why an image another tool finds may be missing here (or "")."""
    if full.exists():
        return ""
    if ref.startswith(("http://", "https://", "data:")):
        return "; bigbatch reads local image files only: download the images and give paths"
    alt = Path.cwd() / ref
    if not Path(ref).is_absolute() and alt.exists():
        return (f"; {shown(ref)} exists relative to the working directory ({shown(str(alt))}), where "
                f"ms-swift looks: bigbatch resolves relative paths against the data file's "
                f"folder ({str(base)!r}): make them relative to it, or absolute")
    return ""


def resolve_record(r: Record, problems: list[Problem], data_root: str | Path | None = None,
                   check_image_file: bool = True
                   ) -> tuple[str | ImageDoc | None, list[str | ImageDoc]]:
    """(positive, negatives) of a parsed record as training input. A document that cannot be
    used (the positive as None, a negative left out; a file outside ``data_root`` when
    given) is reported in ``problems``, as is a negative that is the positive itself
    (compared as training compares them: resolved image paths, file contents and texts), and
    whatever the reader found in the record that it cannot hold (``r.lost``). The record is
    usable when nothing was reported. ``check_image_file``: as :func:`resolve_doc`."""
    for name, why in r.lost:
        problems.append(Problem(r.source, r.line, name, f"{why} cannot be represented; "
                                f"`bigbatch convert --allow-lossy` drops such records"))
    if isinstance(r.query, str) and (why := text_too_long(r.query)) is not None:
        problems.append(Problem(r.source, r.line, r.query_key, f"the query {why}"))
    base = source_folder(r) or Path(".")
    positive = resolve_doc(r.positive, base, r.source, r.line, problems, "positive", data_root,
                           check_image_file)
    negatives: list[str | ImageDoc] = []
    for i, d in enumerate(r.negatives):
        field = d.key or f"negatives[{i}]"
        neg = resolve_doc(d, base, r.source, r.line, problems, field, data_root,
                          check_image_file)
        if neg is not None and neg == positive:
            problems.append(Problem(r.source, r.line, field, "a negative equals the positive"))
        elif neg is not None:
            negatives.append(neg)
    return positive, negatives


def train_record(r: Record, problems: list[Problem], data_root: str | Path | None = None,
                 check_image_file: bool = True) -> TrainRecord | None:
    """The training example of a parsed record (:func:`resolve_record`), or None when a
    problem was found (added to ``problems``)."""
    before = len(problems)
    positive, negatives = resolve_record(r, problems, data_root, check_image_file)
    if positive is None or len(problems) > before:
        return None
    positive_id = r.positive.id or ""  # else its content key (TrainRecord decides)
    scored = r.positive.score is not None and all(d.score is not None for d in r.negatives)
    return TrainRecord(query=r.query, positive=positive, negatives=negatives,
                       positive_id=positive_id, source=r.source, line=r.line,
                       query_id="" if r.query_id is None else str(r.query_id),
                       query_system=r.query_system, doc_system=r.positive.system,
                       pos_score=r.positive.score if scored else None,
                       neg_scores=[d.score for d in r.negatives] if scored else None)


def raise_problems(problems: list[Problem], count: int, path: str | Path) -> None:
    """Stop with every problem found in training data (in file order, the first 20 shown,
    with the total), or when it holds no record (``count``).

    Raises:
        DataError: naming file, line and field of each problem shown.
    """
    problems.sort(key=lambda p: p.line or 0)  # file order (stable within a line)
    if problems:
        shown = "\n  ".join(problem_lines(problems))
        raise DataError(f"{len(problems)} problem(s) in the training data:\n  {shown}")
    if not count:
        raise DataError("no training records", path=str(path))


def load_jsonl_records(path: str | Path, split: str = "train",
                       data_root: str | Path | None = None) -> list[TrainRecord]:
    """Load and validate a file (or a folder of shards, or a ``datasets`` folder) of
    training records in any file format of :mod:`bigbatch.data.formats`
    (Qwen3-VL-Embedding's ``contrastors`` JSONL, ms-swift's ``swift`` JSONL,
    sentence-transformers ``st`` JSONL or Parquet; detected from the file), then read or
    check each document file (only inside ``data_root``, when given). Every record is held
    in memory: :func:`bigbatch.data.records.store.open_records` reads them by index instead.

    Raises:
        DataError: listing every problem (up to 20 shown, with the total) by file, line, field.
    """
    path = Path(path)
    if not path.exists():
        raise DataError("training data file not found", path=str(path))
    parsed, problems = read_records(path, format_of(path), split)
    problems.extend(instruction_problems(parsed))
    records = [t for r in parsed if (t := train_record(r, problems, data_root)) is not None]
    raise_problems(problems, len(records), path)
    return records


def short_negatives_error(lines: Sequence[int], count: int, num_hard_negatives: int,
                          source: str | Path) -> DataError:
    """The error for ``count`` records with fewer than ``num_hard_negatives`` negatives (the
    first of their ``lines`` named)."""
    shown = ", ".join(str(n) for n in lines[:10])
    return DataError(f"{count} record(s) have fewer than --num-hard-negatives="
                     f"{num_hard_negatives} negatives (lines {shown}"
                     f"{', ...' if count > 10 else ''})", path=str(source), field="negatives")


def beir_hard_negatives_error(source: str | Path, num_hard_negatives: int) -> DataError:
    """The error for hard negatives asked of a BEIR directory (it has none)."""
    return DataError(f"BEIR directory {source} has no hard negatives, but "
                     f"--num-hard-negatives is {num_hard_negatives}; mine negatives into "
                     f"a JSONL file first, or use 0")


def load_records(source: str | Path, split: str = "train", num_hard_negatives: int = 0,
                 data_root: str | Path | None = None) -> list[TrainRecord]:
    """Training records from a JSONL file or a BEIR directory, checked for ``k`` negatives;
    with ``data_root``, every file the data names must resolve inside that folder.

    Raises:
        DataError: bad records, or fewer than ``num_hard_negatives`` negatives on a record.
    """
    source = Path(source)
    if source.is_dir() and detect_format(source) == "beir":
        records = beir_training_records(source, split, data_root)
        if num_hard_negatives > 0:
            raise beir_hard_negatives_error(source, num_hard_negatives)
        return records
    records = load_jsonl_records(source, split, data_root)
    if num_hard_negatives > 0:
        short = [r.line for r in records if len(r.negatives) < num_hard_negatives]
        if short:
            raise short_negatives_error(short, len(short), num_hard_negatives, source)
    return records


def check_teacher_scores(records: Sequence[TrainRecord], option: str = "--distill") -> None:
    """Check that every record carries teacher scores (``pos_score`` and ``neg_scores``,
    already checked against its negatives by the reader), as distillation needs.

    Raises:
        DataError: naming the records (file and line) without them.
    """
    missing = [r for r in records if r.pos_score is None or r.neg_scores is None]
    if missing:
        lines = ", ".join(str(r.line) for r in missing[:10])
        raise DataError(f"{len(missing)} record(s) have no teacher scores (lines {lines}"
                        f"{', ...' if len(missing) > 10 else ''}), which {option} needs: give "
                        f"each record pos_score and neg_scores (one per negative), e.g. with "
                        f"`bigbatch mine --scores`", path=missing[0].source, field="pos_score")



@dataclass
class RecordSummary:
    """What training asks of all its records at once, found in one pass: the first system
    prompt each side carries (attribute ``query_system`` / ``doc_system`` -> (prompt,
    source, line)), and the first record with an image document (source, line), if any.
    An indexed source keeps it in its index (:mod:`.store`)."""

    systems: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    first_image: tuple[str, int] | None = None

    def add(self, r: TrainRecord) -> None:
        """Count one record in."""
        for attr in ("query_system", "doc_system"):
            v = getattr(r, attr)
            if v and attr not in self.systems:
                self.systems[attr] = (v, r.source, r.line)
        if self.first_image is None and any(isinstance(d, ImageDoc)
                                            for d in (r.positive, *r.negatives)):
            self.first_image = (r.source, r.line)


def summarize(records: Sequence[TrainRecord]) -> RecordSummary:
    """The :class:`RecordSummary` of ``records``: kept by an indexed source (its
    ``summary``), else found by reading them all."""
    kept = getattr(records, "summary", None)
    if isinstance(kept, RecordSummary):
        return kept
    summary = RecordSummary()
    for r in records:
        summary.add(r)
    return summary


def check_instructions(records: Sequence[TrainRecord], encoder: object) -> None:
    """Check that ``encoder`` gives queries and documents the system prompts the training
    data carries (ms-swift's system messages, one per side: :func:`load_jsonl_records`
    refuses records that differ). A vision-language encoder's instruction is the system turn
    of its prompt, as in ms-swift's Qwen-VL templates, so it must equal the data's; a text
    encoder's prefix must hold it (ms-swift's Qwen3-Embedding template embeds
    ``"{system} {text}"``, so ``--query-prefix "{system} "`` reproduces it). Records without
    a system prompt leave the encoder's settings as they are.

    Raises:
        ConfigError: naming the option to set and the value the data gives.
    """
    vision = hasattr(encoder, "query_instruction")
    systems = summarize(records).systems
    for side, attr in (("query", "query_system"), ("doc", "doc_system")):
        if attr not in systems:
            continue
        data, source, line = systems[attr]
        where = f"{source}:{line}"
        if vision:
            have = getattr(encoder, f"{side}_instruction")
            if have != data:
                raise ConfigError(
                    f"{where}: the training data's {side} system prompt is {shown(data)}, but the "
                    f"encoder's instruction is {shown(have)}; pass --{side}-instruction {shown(data)} "
                    f"(ms-swift applies the data's system prompt), or remove the system "
                    f"messages from the data")
        else:
            have = getattr(encoder, f"{side}_prefix", "")
            if data.strip() not in have:
                raise ConfigError(
                    f"{where}: the training data's {side} system prompt is {shown(data)}, but the "
                    f"encoder's --{side}-prefix is {shown(have)}; pass --{side}-prefix "
                    f"{shown(data + ' ')} (ms-swift's Qwen3-Embedding template puts the system "
                    f"prompt and a space before the text), or remove the system messages "
                    f"from the data")
