"""The record types of bigbatch.data, their identities, and how problems with them are listed.

A leaf module: it imports nothing else of :mod:`bigbatch.data`, so every reader, writer and
loader can share these types without import cycles.

- :class:`Doc`, :class:`Record`: a (query, positive, negatives) example as a file format
  holds it (paths as written in the source).
- :class:`ImageDoc`, :class:`TrainRecord`: a training example, documents resolved to text or
  an image on disk.
- :class:`Problem`: a finding with file, line and field; :func:`problem_lines` lists the first
  :data:`MAX_REPORTED` of many, with how many more there are.
- :func:`text_id`, :func:`doc_key`: document identities; :data:`IMAGE_SUFFIXES` and
  :func:`is_image_path`: which paths name images.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ...errors import DataError

__all__ = ["Doc", "Record", "Problem", "ImageDoc", "TrainRecord", "text_id", "doc_key",
           "IMAGE_SUFFIXES", "is_image_path", "source_folder", "MAX_REPORTED", "problem_lines"]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
# problems listed in an error or report; the rest are counted ("... and N more")
MAX_REPORTED = 20


def is_image_path(value: str) -> bool:
    """Whether a path names an image (by its suffix, :data:`IMAGE_SUFFIXES`)."""
    return Path(value).suffix.lower() in IMAGE_SUFFIXES


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
    # a teacher's score of this document for the record's query (``pos_score`` /
    # ``neg_scores``), for distillation; None where the data gives none
    score: float | None = field(default=None, compare=False)

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
    # negatives the source gives that could not be read (each reported as a problem): the
    # record has len(negatives) + unread_negatives negatives as written
    unread_negatives: int = field(default=0, compare=False)
    # the key the query was read from ('query', 'messages', an st column), for messages
    query_key: str = field(default="query", compare=False)


def source_folder(r: Record) -> Path | None:
    """The folder ``r``'s relative paths resolve against (None: written as they are)."""
    return _folder(r.source) if r.source else None


@lru_cache(maxsize=256)
def _folder(source: str) -> Path:
    """A source's folder: itself when a folder (a BEIR directory), else the file's. Asked
    once per source, not once per record (millions of records share a few sources)."""
    src = Path(source)
    return src if src.is_dir() else src.parent


@dataclass
class Problem:
    """A finding: file, line, field, message (``str()`` gives ``file:line, field 'f': msg``)."""

    path: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        return str(DataError(self.message, path=self.path, line=self.line, field=self.field))


def problem_lines(items: Sequence[object], more: str = "",
                  limit: int = MAX_REPORTED) -> list[str]:
    """The first ``limit`` of ``items`` as lines (``str()`` of each), then ``"... and N
    more"`` (followed by ``more``) when there are more: every list of problems bigbatch
    shows is cut this way."""
    lines = [str(p) for p in items[:limit]]
    if len(items) > limit:
        lines.append(f"... and {len(items) - limit} more{more}")
    return lines


@dataclass(frozen=True)
class ImageDoc:
    """A document that is an image (``path``, absolute), optionally with text shown beside it."""

    path: str
    text: str = ""

    def __str__(self) -> str:  # what logs and errors show
        return self.path


def text_id(text: str) -> str:
    """A short stable hash of a text (its identity, and BEIR ids written for records without)."""
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def doc_key(doc: str | ImageDoc) -> str:
    """A stable identity for a document: the path of an image, a hash of a text."""
    if isinstance(doc, ImageDoc):
        return doc.path
    return text_id(doc)


@dataclass
class TrainRecord:
    """One training example. ``positive_id`` names the positive document (its corpus id when
    the data gives one, else its content key). ``positive_key`` is its content key (a text
    hash, or an image's path), the identity negatives are compared by: the same passage
    twice in a batch is never a negative, however each record named it."""

    query: str
    positive: str | ImageDoc
    negatives: list[str | ImageDoc] = field(default_factory=list)
    positive_id: str = ""
    source: str = ""
    line: int = 0
    query_id: str = ""
    positive_key: str = field(default="", compare=False)
    # the system prompts the data gives the query and the documents (ms-swift's system
    # messages): None where the format has none, "" for a conversation without one
    query_system: str | None = field(default=None, compare=False)
    doc_system: str | None = field(default=None, compare=False)
    # a teacher's scores of the positive and of each negative (in order), for distillation;
    # None where the data gives none
    pos_score: float | None = field(default=None, compare=False)
    neg_scores: list[float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        self.positive_key = doc_key(self.positive)
        if not self.positive_id:
            self.positive_id = self.positive_key
