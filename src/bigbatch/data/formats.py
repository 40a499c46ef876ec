"""Reading and writing the training-data formats of the field, through one record type.

Formats (``--from`` / ``--to`` names):

- ``contrastors``: the seed pipeline's JSONL. Documents as files,
  ``{"query", "chunk_path", "neg_chunk_paths"}`` (page images or text files), or as text,
  ``{"query", "positive", "negatives"}``.
- ``swift``: ms-swift's embedding JSONL: ``messages`` (system instruction + user query),
  ``positive_messages`` / ``negative_messages`` (one conversation per document, the user
  turn holding the text, or ``<image>`` and the text that goes with the image) with
  ``positive_images`` / ``negative_images``, and the ids as ``query_id`` / ``positive_id`` /
  ``negative_ids``. A query image, several images in a document, text before ``<image>``,
  images without an ``<image>`` tag, video and audio, and conversations of more than one
  user turn (assistant or tool turns) cannot be held (reported, as below). Each
  conversation's system message is read as its instruction and written back as it was
  (records of other formats get the instruction options); bigbatch applies one instruction
  per side, so records whose system prompts differ are reported, and a format without an
  instruction field (``contrastors``, ``st``, ``beir``) takes the prompts only with
  ``--allow-lossy`` (a single prompt per side is named in the report instead).
- ``st``: sentence-transformers columns ``anchor``, ``positive``, ``negative_1..k``, as
  JSONL (``.jsonl``), Parquet (``.parquet``), CSV with a header (``.csv``), or a folder
  written by ``datasets``' ``save_to_disk`` (a DatasetDict's ``--split``); Parquet and
  Arrow are streamed a record batch at a time. Text only. Without an ``anchor`` column the
  columns are read by position, as sentence-transformers' losses take them (``query,
  positive, negative``, ``question, answer``); a ``label`` or ``score`` column cannot be
  held (reported). Detected for JSONL whose first record has ``anchor``, none of the
  contrastors keys, or ``negative`` / ``negative_N`` beside ``query`` and ``positive``.
- ``colpali``: colpali-engine / ViDoRe tables (Parquet or a ``datasets`` folder) with a
  ``query`` column and the page as a Hugging Face ``Image`` column: read only by
  conversion, which writes the images to files (:mod:`bigbatch.data.colpali`); validate
  and training say so, with the command.
- ``beir``: a BEIR directory (``corpus.jsonl``, ``queries.jsonl``, ``qrels/<split>.tsv``).
  Text documents and (query, positive) pairs only. A document's title is read joined to its
  text ("title text", what training and evaluation embed), since no other format has a title
  field; a BEIR directory written here has empty titles and the joined text.

What a target format cannot hold (an image in ``st``, negatives in ``beir``) is never
dropped silently: conversion stops with a report, or drops it and reports it when asked.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import DataError
from .images import ImageDoc

__all__ = ["Doc", "Record", "FORMATS", "read_records", "write_records", "detect_format",
           "SWIFT_QUERY_INSTRUCTION", "SWIFT_DOC_INSTRUCTION", "Problem", "instruction_problems",
           "system_prompts"]

# the seed's instructions (train_contrastors.py and convert_data_for_swift.py)
SWIFT_QUERY_INSTRUCTION = "Retrieve images or text relevant to the user's query."
SWIFT_DOC_INSTRUCTION = "Represent the user's input."
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
FORMATS = ("contrastors", "swift", "st", "beir")
# formats read only by `bigbatch convert` (written as one of FORMATS)
READ_ONLY_FORMATS = ("colpali",)


@dataclass(frozen=True)
class Doc:
    """A document: text, a text file, or an image (paths as written in the source)."""

    text: str | None = None
    image: str | None = None
    path: str | None = None  # a text file (contrastors chunk_path that is not an image)
    id: str | None = None
    # the source field ('chunk_path', 'negative_images[1][0]', 'negative_2'), for messages
    key: str | None = field(default=None, compare=False)
    # the document's system prompt (swift): None where the format has none, "" for a swift
    # conversation without a system message
    system: str | None = field(default=None, compare=False)

    @property
    def kind(self) -> str:
        return "image" if self.image else "file" if self.path else "text"


@dataclass
class Record:
    """One (query, positive, negatives) example as read from ``source`` (the file or BEIR
    directory it came from, line ``line``). Relative image and text-file paths of its
    documents are relative to ``source``'s folder; with ``source`` empty they are taken as
    already relative to wherever the record is written."""

    query: str
    positive: Doc
    negatives: list[Doc] = field(default_factory=list)
    query_id: str | None = None
    line: int = 0
    source: str = ""
    # (field, what) the reader found but a Record cannot hold (a query image, ...): writing
    # the record is lossy, and validate and training report it
    lost: list[tuple[str, str]] = field(default_factory=list)
    # the query's system prompt (swift): None where the format has none, "" for a swift
    # conversation without a system message
    query_system: str | None = None


@dataclass
class Problem:
    """A finding: file, line, field, message (``str()`` gives ``file:line, field 'f': msg``)."""

    path: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        return str(DataError(self.message, path=self.path, line=self.line, field=self.field))


def _is_image(p: str) -> bool:
    return Path(p).suffix.lower() in IMAGE_SUFFIXES


def detect_format(path: str | Path) -> str:
    """Guess the format from a directory (a Hugging Face ``datasets`` folder is st, any other
    BEIR), a .parquet or .csv file (st) or the first record's keys. Parquet or a ``datasets``
    folder with colpali-engine's columns (a ``query`` and a page-image column) is
    ``colpali``, which is only read by conversion (:mod:`bigbatch.data.colpali`)."""
    path = Path(path)
    if (path.is_dir() and _is_hf_dataset(path)) or path.suffix.lower() == ".parquet":
        from .colpali import is_colpali

        if is_colpali(path):
            return "colpali"
    if path.is_dir():
        return "st" if _is_hf_dataset(path) else "beir"
    if path.suffix.lower() in (".parquet", ".csv"):
        return "st"
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as f:  # the reader reports bad bytes
        for line in f:
            if line.strip():
                try:
                    keys = set(json.loads(line))
                except (json.JSONDecodeError, TypeError):
                    break
                if "messages" in keys:
                    return "swift"
                if "anchor" in keys or not keys & _CONTRASTORS_KEYS or (
                        not keys & {"chunk_path", "neg_chunk_paths", "negatives"}
                        and any(_ST_NEGATIVE.match(k) for k in keys)):
                    return "st"  # named or positional sentence-transformers columns
                return "contrastors"
    raise DataError("cannot tell the format (empty or malformed first line); pass --format",
                    path=str(path))


# ------------------------------------------------------------------ reading
_CONTRASTORS_KEYS = {"query", "query_id", "positive", "positive_id", "chunk_path", "negatives",
                     "neg_chunk_paths", "negative_ids"}
# a key the contrastors reader does not read but that looks like data: a document, several
# positives, an instruction (sentence-transformers' negative_1, FlagEmbedding's pos / neg /
# prompt, nomic's document, ...); metadata keys (source, score, ...) are left alone
_DATA_LIKE = re.compile(r"neg|pos|doc|passage|answer|image|instruct|prompt|system|anchor",
                        re.IGNORECASE)
_ID_KEY = re.compile(r"(^|_)ids?$", re.IGNORECASE)
_ST_NEGATIVE = re.compile(r"negative(_\d+)?$")
_ST_LABELS = ("label", "score")
def _jsonl(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict]]:
    from .jsonl import iter_jsonl

    for n, rec, problem in iter_jsonl(path):
        if problem is not None:
            problems.append(Problem(str(path), n, problem.field, str(problem)))
        else:
            yield n, rec


def _text(rec: dict, key: str, where: tuple[str, int], problems: list[Problem],
          required: bool = True) -> str | None:
    v = rec.get(key)
    if v is None:
        if required:
            problems.append(Problem(where[0], where[1], key, "missing"))
        return None
    if not isinstance(v, str) or not v.strip():
        problems.append(Problem(where[0], where[1], key, "must be non-empty text"))
        return None
    return v


def _contrastors_doc(v: Any, key: str, where: tuple[str, int], problems: list[Problem],
                     as_path: bool) -> Doc | None:
    if not isinstance(v, str) or not v.strip():
        problems.append(Problem(where[0], where[1], key, "must be non-empty " +
                                ("path" if as_path else "text")))
        return None
    if not as_path:
        return Doc(text=v, key=key)
    return Doc(image=v, key=key) if _is_image(v) else Doc(path=v, key=key)


def _read_contrastors(path: Path, problems: list[Problem]) -> list[Record]:
    out = []
    for n, rec in _jsonl(path, problems):
        w = (str(path), n)
        q = _text(rec, "query", w, problems)
        if "chunk_path" in rec:
            pos = _contrastors_doc(rec["chunk_path"], "chunk_path", w, problems, True)
        elif "positive" in rec:
            pos = _contrastors_doc(rec["positive"], "positive", w, problems, False)
        else:
            problems.append(Problem(str(path), n, "positive", "missing positive: give "
                                    "'positive' text or 'chunk_path'"))
            pos = None
        negs: list[Doc] = []
        for key, as_path in (("neg_chunk_paths", True), ("negatives", False)):
            if key not in rec:
                continue
            if not isinstance(rec[key], list):
                problems.append(Problem(str(path), n, key, "must be a list"))
                continue
            for i, v in enumerate(rec[key]):
                d = _contrastors_doc(v, f"{key}[{i}]", w, problems, as_path)
                if d is not None:
                    negs.append(d)
        for key in rec:
            if key not in _CONTRASTORS_KEYS and _DATA_LIKE.search(key) \
                    and not _ID_KEY.search(key):
                problems.append(Problem(str(path), n, key, "not read: the contrastors format "
                                        "takes 'query', the positive as 'positive' or "
                                        "'chunk_path', negatives as 'negatives' or "
                                        "'neg_chunk_paths' (sentence-transformers columns: "
                                        "--format st)"))
        if q is not None and pos is not None:
            qid = rec.get("query_id")
            pos, negs = _with_ids(rec, pos, negs)
            out.append(Record(q, pos, negs, None if qid is None else str(qid), n, str(path)))
    return out


def _with_ids(rec: dict, pos: Doc, negs: list[Doc]) -> tuple[Doc, list[Doc]]:
    """The documents with the corpus ids a record gives (``positive_id``, ``negative_ids``)."""
    pid = rec.get("positive_id")
    nids = rec.get("negative_ids")
    if pid is not None:
        pos = replace(pos, id=str(pid))
    if isinstance(nids, list) and len(nids) == len(negs):
        negs = [replace(d, id=None if i is None else str(i)) for d, i in zip(negs, nids)]
    return pos, negs


_IMAGE_TAG = "<image>"
_MEDIA_TAGS = ("<video>", "<audio>")


def _swift_turn(conv: Any, key: str, where: tuple[str, int], problems: list[Problem],
                lost: list[tuple[str, str]]) -> tuple[str, str] | None:
    """(system prompt, user content) of one swift conversation; the system prompt is "" when
    the conversation has none. A malformed conversation is a problem (and None). What one
    user turn cannot hold (assistant or tool turns, several user turns, several system
    messages, video or audio) is added to ``lost``: bigbatch embeds one user turn, where
    ms-swift would embed the whole conversation through its template."""
    if not isinstance(conv, list):
        problems.append(Problem(where[0], where[1], key, "must be a list of messages"))
        return None
    for i, m in enumerate(conv):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), str):
            problems.append(Problem(where[0], where[1], f"{key}[{i}]", "a message needs a "
                                    "'role' and a text 'content'"))
            return None
    roles = [m["role"] for m in conv]
    users = [m for m in conv if m["role"] == "user"]
    systems = [m for m in conv if m["role"] == "system"]
    if not users:
        problems.append(Problem(where[0], where[1], key, "needs a user message"))
        return None
    if len(users) > 1 or len(users) + len(systems) < len(conv):
        lost.append((key, f"a multi-turn conversation (roles {', '.join(roles)}; bigbatch "
                          f"embeds one user turn, with an optional system message)"))
    elif len(systems) > 1 or (systems and roles[0] != "system"):
        lost.append((key, "system messages other than one leading the conversation"))
    content = users[0]["content"]
    for tag in _MEDIA_TAGS:
        if tag in content:
            lost.append((key, f"a {tag} tag (bigbatch embeds text and images)"))
    return (systems[0]["content"] if systems else ""), content


def _swift_doc(conv: Any, images: Any, key: str, where: tuple[str, int],
               problems: list[Problem], lost: list[tuple[str, str]]) -> Doc | None:
    """One swift document conversation: text, or an image (``<image>`` leading the user turn,
    one path in ``images``) with the text that follows it, and its system prompt. What a
    :class:`Doc` cannot hold (several images, text before the image, images without an
    ``<image>`` tag, several turns) is added to ``lost`` as (field, what); a malformed
    document is a problem (and None)."""
    turn = _swift_turn(conv, key, where, problems, lost)
    if turn is None:
        return None
    system, content = turn
    images_key = key.replace("messages", "images")
    tags = content.count(_IMAGE_TAG)
    paths = [] if images is None else images if isinstance(images, list) else None
    if paths is None or not all(isinstance(p, str) and p for p in paths):
        problems.append(Problem(where[0], where[1], images_key, "must be a list of image paths"))
        return None
    if tags != len(paths) and tags:
        problems.append(Problem(where[0], where[1], images_key,
                                f"{len(paths)} image path(s) for {tags} <image> tag(s) in "
                                f"{key}; an <image> document needs exactly one image path"))
        return None
    if not tags:
        if paths:
            lost.append((images_key, f"{len(paths)} image(s) without an <image> tag in {key}"))
        if not content.strip():
            problems.append(Problem(where[0], where[1], key, "empty document text"))
            return None
        return Doc(text=content, key=key, system=system)
    if tags > 1:
        lost.append((images_key, f"{tags} images in one document (a document holds one)"))
    elif not content.lstrip().startswith(_IMAGE_TAG):
        lost.append((key, "text before <image> (an image document's text follows its image)"))
    text = content.replace(_IMAGE_TAG, " ").strip()
    return Doc(image=paths[0], text=text or None, key=f"{images_key}[0]", system=system)


# swift media fields bigbatch has no document kind for
_SWIFT_MEDIA_KEYS = tuple(f"{side}{kind}" for side in ("", "positive_", "negative_")
                          for kind in ("videos", "audios"))


def _read_swift(path: Path, problems: list[Problem]) -> list[Record]:
    out = []
    for n, rec in _jsonl(path, problems):
        w = (str(path), n)
        lost: list[tuple[str, str]] = []
        query = query_system = None
        turn = _swift_turn(rec.get("messages"), "messages", w, problems, lost) \
            if "messages" in rec else None
        if "messages" not in rec:
            problems.append(Problem(str(path), n, "messages", "missing"))
        elif turn is not None and not turn[1].strip():
            problems.append(Problem(str(path), n, "messages", "needs one non-empty user "
                                    "message (the query)"))
        elif turn is not None:
            query_system, query = turn
            if _IMAGE_TAG in query or rec.get("images"):
                lost.append(("images" if rec.get("images") else "messages",
                             "an image in the query (queries are text)"))
        for key in _SWIFT_MEDIA_KEYS:
            if rec.get(key):
                lost.append((key, f"{key.rsplit('_', 1)[-1]} (bigbatch embeds text and images)"))
        pos_convs = rec.get("positive_messages")
        pos = None
        pos_imgs = rec.get("positive_images")
        if not isinstance(pos_convs, list) or len(pos_convs) != 1:
            problems.append(Problem(str(path), n, "positive_messages", "must hold exactly one "
                                    "conversation"))
        elif pos_imgs is not None and (not isinstance(pos_imgs, list) or len(pos_imgs) != 1):
            problems.append(Problem(str(path), n, "positive_images", "must hold one list of "
                                    "image paths, for the one positive conversation"))
        else:
            imgs = (pos_imgs or [[]])[0]
            pos = _swift_doc(pos_convs[0], imgs, "positive_messages[0]", w, problems, lost)
        negs = []
        neg_convs = rec.get("negative_messages") or []
        neg_imgs = rec.get("negative_images") or [[] for _ in neg_convs]
        if not isinstance(neg_convs, list):
            problems.append(Problem(str(path), n, "negative_messages", "must be a list of "
                                    "conversations"))
        elif not isinstance(neg_imgs, list) or len(neg_imgs) != len(neg_convs):
            problems.append(Problem(str(path), n, "negative_images", "one list per negative "
                                    "conversation"))
        else:
            for i, (c, im) in enumerate(zip(neg_convs, neg_imgs)):
                d = _swift_doc(c, im, f"negative_messages[{i}]", w, problems, lost)
                if d is not None:
                    negs.append(d)
        if query is not None and pos is not None:
            pos, negs = _with_ids(rec, pos, negs)
            qid = rec.get("query_id")
            out.append(Record(query, pos, negs, None if qid is None else str(qid), n, str(path),
                              lost, query_system))
    return out


def _is_hf_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def _hf_dataset_files(path: Path, split: str) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder (of ``split`` for a DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"cannot read dataset_dict.json: {e}", path=str(path)) from e
        if split not in splits:
            raise DataError(f"no split {split!r} in this datasets folder (splits: "
                            f"{', '.join(map(str, splits))}); pass --split", path=str(path))
        path = path / split
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"cannot read state.json of a datasets folder: {e}",
                        path=str(path)) from e


def _arrow_rows(path: Path, split: str) -> Iterator[tuple[int, dict]]:
    """Rows of Parquet or ``datasets`` Arrow files, streamed a record batch at a time."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise DataError("reading Parquet or Arrow needs pyarrow: pip install 'bigbatch[data]'",
                        path=str(path)) from None
    n = 0
    files = _hf_dataset_files(path, split) if path.is_dir() else [path]
    for f in files:
        try:
            if f.suffix == ".parquet":
                batches = pq.ParquetFile(f).iter_batches(batch_size=1024)
            else:  # datasets writes the Arrow IPC stream format
                batches = pa.ipc.open_stream(pa.memory_map(str(f)))
            for batch in batches:
                for row in batch.to_pylist():
                    n += 1
                    yield n, row
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"cannot read as {'Parquet' if f.suffix == '.parquet' else 'Arrow'}:"
                            f" {e}", path=str(f)) from e


def _csv_rows(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict]]:
    """Rows of a CSV file with a header (the line number of the row's first line)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        try:
            reader.fieldnames  # reads the header
            line = reader.line_num
            for row in reader:
                start, line = line + 1, reader.line_num
                if None in row or None in row.values():
                    problems.append(Problem(str(path), start, None, f"{len(reader.fieldnames or [])}"
                                            f" columns in the header, another number here"))
                    continue
                yield start, row
        except (csv.Error, UnicodeDecodeError) as e:
            problems.append(Problem(str(path), reader.line_num + 1, None, f"cannot read as CSV"
                                    f" ({e}); write it as UTF-8 CSV with a header"))


def _st_rows(path: Path, problems: list[Problem], split: str = "train"
             ) -> Iterator[tuple[int, dict]]:
    if path.is_dir() or path.suffix.lower() == ".parquet":
        yield from _arrow_rows(path, split)
    elif path.suffix.lower() == ".csv":
        yield from _csv_rows(path, problems)
    else:
        yield from _jsonl(path, problems)


def _read_st(path: Path, problems: list[Problem], split: str = "train") -> list[Record]:
    """sentence-transformers columns. As sentence-transformers' losses take them: named
    ``anchor``, ``positive``, ``negative`` / ``negative_1..k`` (any other column is reported,
    not read), or, without an ``anchor`` column, by position: the first column is the
    anchor, the second the positive, the rest negatives (``query, positive, negative``;
    ``question, answer``). A ``label`` or ``score`` column cannot be held: such pairs are
    not all positives (reported)."""
    out = []
    for n, rec in _st_rows(path, problems, split):
        w = (str(path), n)
        lost = [(k, f"a {k!r} column (bigbatch trains on (anchor, positive, negatives); "
                    f"labelled or scored pairs are not all positives)")
                for k in _ST_LABELS if k in rec]
        cols = [k for k in rec if k not in _ST_LABELS]
        if "anchor" in rec:
            q = _text(rec, "anchor", w, problems)
            p = _text(rec, "positive", w, problems)
            neg_keys = [k for k in cols if _ST_NEGATIVE.match(k)]
            for k in cols:
                if k not in ("anchor", "positive") and k not in neg_keys:
                    problems.append(Problem(str(path), n, k, "not read: sentence-transformers "
                                            "columns are anchor, positive, negative_1..k"))
        elif len(cols) < 2:
            problems.append(Problem(str(path), n, "anchor", "needs an anchor and a positive "
                                    "column"))
            continue
        else:
            for k in [k for k in cols if _ID_KEY.search(k)]:
                problems.append(Problem(str(path), n, k, "not read: an id column among "
                                        "columns read by position (the first is the anchor, "
                                        "the second the positive, the rest negatives); "
                                        "remove it"))
                cols.remove(k)
            if len(cols) < 2:
                continue
            q = _text(rec, cols[0], w, problems)
            p = _text(rec, cols[1], w, problems)
            neg_keys = cols[2:]
        negs = []
        for key in neg_keys:
            t = _text(rec, key, w, problems)
            if t is not None:
                negs.append(Doc(text=t, key=key))
        if q is not None and p is not None:
            pkey = "positive" if "anchor" in rec else cols[1]
            out.append(Record(q, Doc(text=p, key=pkey), negs, None, n, str(path), lost))
    return out


def _read_beir(path: Path, problems: list[Problem], split: str) -> list[Record]:
    from .beir import load_beir

    data = load_beir(path, split)
    out = []
    for qid, rels in data.qrels.items():
        for did, score in rels.items():
            if score > 0:
                doc = data.corpus[did]
                doc = Doc(image=doc.path, id=did) if isinstance(doc, ImageDoc) else \
                    Doc(text=doc, id=did)
                out.append(Record(data.queries[qid], doc, [], qid,
                                  0, str(path)))
    return out


def read_records(path: str | Path, fmt: str | None = None, split: str = "train"
                 ) -> tuple[list[Record], list[Problem]]:
    """Records of ``path`` in format ``fmt`` (detected when None) and the problems found."""
    path = Path(path)
    if not path.exists():
        raise DataError("not found", path=str(path))
    fmt = fmt or detect_format(path)
    problems: list[Problem] = []
    if fmt in ("colpali", "st"):
        from .colpali import is_colpali, not_converted_problem

        if fmt == "colpali" or is_colpali(path, split):
            # images held in the rows: training reads image files, so convert first
            return [], [not_converted_problem(path)]
    if fmt == "contrastors":
        recs = _read_contrastors(path, problems)
    elif fmt == "swift":
        recs = _read_swift(path, problems)
    elif fmt == "st":
        recs = _read_st(path, problems, split)
    elif fmt == "beir":
        recs = _read_beir(path, problems, split)
    else:
        raise DataError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    return recs, problems


def _short(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


def _doc_system(r: Record) -> str | None:
    return r.positive.system


def _record_systems(r: Record) -> tuple[str | None, ...]:
    """The system prompts of a record's query and of each of its documents."""
    return (r.query_system, *(d.system for d in (r.positive, *r.negatives)))


def instruction_problems(records: list[Record]) -> list[Problem]:
    """System prompts (swift) that bigbatch cannot apply as they are: bigbatch gives every
    query one instruction and every document one (``--query-instruction`` /
    ``--doc-instruction``, or ``--query-prefix`` / ``--doc-prefix`` for text models), where
    ms-swift applies each conversation's own system message. So a record's documents must
    carry the same system prompt, and every record the file's usual one for each side; each
    record that does not is a problem naming its line and field."""
    problems = []
    for r in records:
        for d in r.negatives:
            if d.system is not None and d.system != r.positive.system:
                problems.append(Problem(r.source, r.line, d.key, f"system prompt "
                                        f"{_short(d.system)} differs from the positive's "
                                        f"{_short(r.positive.system or '')}; bigbatch gives "
                                        f"every document one instruction"))
    for side, get, field in (("query", lambda r: r.query_system, "messages"),
                             ("document", _doc_system, "positive_messages[0]")):
        counts = Counter(get(r) for r in records if get(r) is not None)
        if len(counts) < 2:
            continue
        usual = counts.most_common(1)[0][0]
        first = next(r.line for r in records if get(r) == usual)
        for r in records:
            v = get(r)
            if v is not None and v != usual:
                problems.append(Problem(r.source, r.line, field, (
                    f"{side} system prompt {_short(v)}" if v else f"no {side} system prompt") +
                    f" where the file's usual one is {_short(usual)} (line {first}); bigbatch "
                    f"applies one {side} instruction to every record: split the file by "
                    f"instruction (or fold the instruction into the {side} text)"))
    return problems


def system_prompts(records: list[Record]) -> dict[str, str]:
    """The system prompts the records carry, per side ("query", "document"), when they carry
    one (non-empty) and :func:`instruction_problems` finds none."""
    out = {}
    for side, get in (("query", lambda r: r.query_system), ("document", _doc_system)):
        found = {get(r) for r in records} - {None, ""}
        if len(found) == 1:
            out[side] = found.pop()
    return out


# ------------------------------------------------------------------ writing
def _lossy(records: list[Record], fmt: str) -> list[tuple[Record, str]]:
    """What ``fmt`` cannot hold, per record."""
    out = []
    for r in records:
        docs = [r.positive, *r.negatives]
        if r.lost:
            out.append((r, "; ".join(f"{f}: {why} cannot be represented" for f, why in r.lost)))
        elif fmt in ("st", "beir") and any(d.kind != "text" for d in docs):
            out.append((r, f"{fmt} holds text documents only (this record has "
                           f"{', '.join(sorted({d.kind for d in docs if d.kind != 'text'}))})"))
        elif fmt == "beir" and r.negatives:
            out.append((r, f"beir holds no negatives ({len(r.negatives)} here)"))
        elif fmt == "contrastors" and any(d.image and d.text for d in docs):
            out.append((r, "contrastors holds no text beside an image"))
        elif fmt == "contrastors" and len({d.kind == 'text' for d in docs}) > 1:
            out.append((r, "contrastors keeps a record's documents all as files or all as text"))
        elif fmt == "swift" and any(d.kind == "file" for d in docs):
            out.append((r, "swift holds text or images; read text files into text first"))
    return out


def _doc_json_contrastors(d: Doc) -> str:
    return d.image or d.path or d.text or ""


def _swift_messages(system: str | None, instruction: str, content: str | None) -> list[dict]:
    """A swift conversation: the record's own system prompt (None: the format had none, so
    ``instruction``; "": none), then the user turn."""
    system = instruction if system is None else system
    return ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": content}]


def _swift_conv(d: Doc, instruction: str) -> tuple[list[dict], list[str]]:
    content = _IMAGE_TAG + (d.text or "") if d.image else d.text
    return _swift_messages(d.system, instruction, content), [d.image] if d.image else []


def _source_folder(r: Record) -> Path | None:
    """The folder ``r``'s relative paths resolve against (None: written as they are)."""
    if not r.source:
        return None
    src = Path(r.source)
    return src if src.is_dir() else src.parent


def _rebase(r: Record, out_dir: Path) -> Record:
    """``r`` with each relative image or text-file path resolved against its source's folder
    and written relative to ``out_dir`` (where readers of the output resolve it); absolute
    paths are kept as they are."""
    base = _source_folder(r)
    if base is None:
        return r

    def doc(d: Doc) -> Doc:
        ref = d.image or d.path
        if ref is None or Path(os.path.expanduser(ref)).is_absolute():  # "~/x.png" is absolute
            return d
        new = os.path.relpath(os.path.abspath(base / ref), os.path.abspath(out_dir))
        return replace(d, image=new) if d.image else replace(d, path=new)

    return replace(r, positive=doc(r.positive), negatives=[doc(d) for d in r.negatives])


def write_records(records: list[Record], out: str | Path, fmt: str, *, allow_lossy: bool = False,
                  query_instruction: str = SWIFT_QUERY_INSTRUCTION,
                  doc_instruction: str = SWIFT_DOC_INSTRUCTION,
                  split: str = "train") -> dict[str, Any]:
    """Write ``records`` as ``fmt``; returns a report. What ``fmt`` cannot hold raises
    :class:`DataError` listing the records, unless ``allow_lossy`` (then it is dropped and
    counted in the report). Relative image and text-file paths are rebased from each
    record's source folder to the output's folder, so they name the same files."""
    out = Path(out)
    lossy = _lossy(records, fmt)
    if lossy and not allow_lossy:
        shown = "\n  ".join(f"{r.source}:{r.line}: {why}" for r, why in lossy[:10])
        raise DataError(f"{len(lossy)} record(s) cannot be written as {fmt} without loss:\n  "
                        f"{shown}\nconvert to another format, or pass --allow-lossy to drop "
                        f"them (they are counted in the report)")
    dropped = {id(r) for r, _ in lossy}
    out_dir = out if fmt == "beir" else out.parent
    keep = [_rebase(r, out_dir) for r in records if id(r) not in dropped]
    report = {"format": fmt, "written": len(keep), "dropped": len(lossy),
              "dropped_reasons": sorted({why for _, why in lossy}), "system_prompts": {},
              "system_prompts_dropped": 0, "system_prompts_kept": 0}
    if fmt == "swift":  # the records' own system messages win over the instruction options
        report["system_prompts_kept"] = sum(
            any(v is not None for v in _record_systems(r)) for r in keep)
    if fmt != "swift":  # per-record system prompts have no field in the target
        differ = instruction_problems(keep)
        if differ and not allow_lossy:
            shown = "\n  ".join(str(p) for p in differ[:10])
            raise DataError(f"{len(differ)} record(s) carry system prompts that differ, which "
                            f"{fmt} cannot hold (it has no instruction field):\n  {shown}\n"
                            f"convert to swift, split the file by instruction, or pass "
                            f"--allow-lossy to write the records without their system prompts "
                            f"(counted in the report)")
        report["system_prompts_dropped"] = sum(
            any(_record_systems(r)) for r in keep) if differ else 0
        report["system_prompts"] = {} if differ else system_prompts(keep)
    if fmt == "beir":
        _write_beir(keep, out, split)
        return report
    if fmt == "st" and out.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        k = max((len(r.negatives) for r in keep), default=0)
        if any(len(r.negatives) != k for r in keep):
            raise DataError("sentence-transformers columns need the same number of negatives "
                            "in every record", path=str(out))
        cols: dict[str, list] = {"anchor": [r.query for r in keep],
                                 "positive": [r.positive.text for r in keep]}
        for i in range(k):
            cols[f"negative_{i + 1}"] = [r.negatives[i].text for r in keep]
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(cols), out)
        return report
    if fmt == "st" and out.suffix.lower() == ".csv":
        k = max((len(r.negatives) for r in keep), default=0)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["anchor", "positive", *(f"negative_{i + 1}" for i in range(k))])
            for r in keep:
                if len(r.negatives) != k:
                    raise DataError("CSV columns need the same number of negatives in every "
                                    f"record ({r.source}:{r.line} has {len(r.negatives)}, "
                                    f"another {k})", path=str(out))
                w.writerow([r.query, r.positive.text, *(d.text for d in r.negatives)])
        return report
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        for r in keep:
            f.write(json.dumps(_to_json(r, fmt, query_instruction, doc_instruction),
                               ensure_ascii=False) + "\n")
    return report


def _to_json(r: Record, fmt: str, qi: str, di: str) -> dict[str, Any]:
    if fmt == "contrastors":
        as_files = r.positive.kind != "text"
        rec: dict[str, Any] = {"query": r.query}
        if as_files:
            rec["chunk_path"] = _doc_json_contrastors(r.positive)
            rec["neg_chunk_paths"] = [_doc_json_contrastors(d) for d in r.negatives]
        else:
            rec["positive"] = r.positive.text
            rec["negatives"] = [d.text for d in r.negatives]
        _add_ids(rec, r)
        return rec
    if fmt == "swift":
        pm, pi = _swift_conv(r.positive, di)
        negs = [_swift_conv(d, di) for d in r.negatives]
        rec = {"messages": _swift_messages(r.query_system, qi, r.query),
               "positive_messages": [pm], "negative_messages": [m for m, _ in negs]}
        if r.positive.image or any(d.image for d in r.negatives):
            rec["positive_images"] = [pi]
            rec["negative_images"] = [i for _, i in negs]
        _add_ids(rec, r)
        return rec
    if fmt == "st":
        rec = {"anchor": r.query, "positive": r.positive.text}
        rec.update({f"negative_{i + 1}": d.text for i, d in enumerate(r.negatives)})
        return rec
    raise DataError(f"unknown format {fmt!r}; choose one of {FORMATS}")


def _add_ids(rec: dict[str, Any], r: Record) -> None:
    """The record's ids as ``query_id``, ``positive_id``, ``negative_ids`` (when known)."""
    if r.query_id is not None:
        rec["query_id"] = r.query_id
    if r.positive.id is not None:
        rec["positive_id"] = r.positive.id
    if r.negatives and all(d.id is not None for d in r.negatives):
        rec["negative_ids"] = [d.id for d in r.negatives]


def _write_beir(records: list[Record], out: Path, split: str) -> None:
    from .records import text_id

    (out / "qrels").mkdir(parents=True, exist_ok=True)
    corpus: dict[str, str] = {}
    queries: dict[str, str] = {}
    qrels: list[tuple[str, str]] = []
    for r in records:
        qid = r.query_id or "q" + text_id(r.query)
        did = r.positive.id or "d" + text_id(r.positive.text or "")
        queries[qid] = r.query
        corpus[did] = r.positive.text or ""
        qrels.append((qid, did))
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for did, text in corpus.items():
            f.write(json.dumps({"_id": did, "title": "", "text": text}, ensure_ascii=False) + "\n")
    with open(out / "queries.jsonl", "w", encoding="utf-8") as f:
        for qid, text in queries.items():
            f.write(json.dumps({"_id": qid, "text": text}, ensure_ascii=False) + "\n")
    with open(out / "qrels" / f"{split}.tsv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["query-id", "corpus-id", "score"])
        w.writerows((q, d, 1) for q, d in dict.fromkeys(qrels))
