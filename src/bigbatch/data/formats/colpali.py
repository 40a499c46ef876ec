"""The ``colpali`` format, read only by conversion: colpali-engine / ViDoRe tables (Parquet
or a ``datasets`` folder) with a ``query`` column and the page as a Hugging Face ``Image``
column. Recognising such a table and naming its columns by role lives here; converting it
(its images written to files) is :mod:`bigbatch.data.tools.convert_colpali`. Validate and training
say
it must be converted, with the command.

An ``Image`` feature is stored in Parquet and Arrow as a struct ``{bytes, path}``.
"""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path
from typing import Any

from ...errors import DataError
from ..readers.tables import has_split, is_hf_dataset, table_files, table_schema
from ..records.types import Problem, Record
from .common import Format

__all__ = ["FORMAT", "QUERY_COLUMN", "POSITIVE_COLUMNS", "NEGATIVE_COLUMNS", "CORPUS_ID_COLUMNS",
           "colpali_columns", "is_colpali", "convert_command", "not_converted_problem"]

QUERY_COLUMN = "query"
# positive page: vidore/colpali_train_set's ``image``; ColPaliEngineDataset's ``pos_target``
POSITIVE_COLUMNS = ("image", "pos_target")
# negative pages: the older collators' ``neg_image``; ColPaliEngineDataset's ``neg_target``
NEGATIVE_COLUMNS = ("neg_image", "neg_target")
# colpali-engine's ids into a separate corpus (manu/colpali-queries)
CORPUS_ID_COLUMNS = ("positive_passages", "negative_passages")


def _is_image_type(t: Any) -> bool:
    """A Hugging Face ``Image`` column (struct ``{bytes, path}``), or a list of them."""
    import pyarrow as pa

    if pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    if not pa.types.is_struct(t):
        return False
    names = {t.field(i).name for i in range(t.num_fields)}
    return "bytes" in names and names <= {"bytes", "path"}


def colpali_columns(path: str | Path, split: str = "train") -> dict[str, list[str]] | None:
    """The columns of a colpali-style table (``query`` beside a page-image column, or beside
    colpali-engine's corpus ids), by role: ``query``, ``positive``, ``negatives``,
    ``corpus_ids``, ``other``; None for a file or folder that is not one (not Parquet or a
    ``datasets`` folder, or without those columns)."""
    path = Path(path)
    if not ((path.is_dir() and is_hf_dataset(path)) or
            (path.is_file() and path.suffix.lower() == ".parquet")):
        return None
    if importlib.util.find_spec("pyarrow") is None:  # pragma: no cover
        return None
    files = table_files(path, split) if not path.is_dir() or has_split(path, split) else []
    if not files:
        return None
    schema = table_schema(files[0])
    names = list(schema.names)
    if QUERY_COLUMN not in names:
        return None
    pos = [c for c in POSITIVE_COLUMNS if c in names and _is_image_type(schema.field(c).type)]
    ids = [c for c in CORPUS_ID_COLUMNS if c in names]
    if not pos and not ids:
        return None
    negs = [c for c in NEGATIVE_COLUMNS if c in names and _is_image_type(schema.field(c).type)]
    used = {QUERY_COLUMN, *pos[:1], *negs}
    return {"query": [QUERY_COLUMN], "positive": pos[:1], "negatives": negs,
            "corpus_ids": ids, "other": [c for c in names if c not in used and c not in ids]}


def is_colpali(path: str | Path, split: str = "train") -> bool:
    """Whether ``path`` is colpali-engine / ViDoRe data (see :func:`colpali_columns`); a file
    that cannot be read is not (its reader reports it)."""
    try:
        return colpali_columns(path, split) is not None
    except DataError:
        return False


def convert_command(path: str | Path) -> str:
    """The command that converts colpali data at ``path`` (a suggested output beside it)."""
    path = Path(path)
    out = path.parent / ((path.stem if path.is_file() else path.name) + ".jsonl")
    return f"bigbatch convert --from colpali {shlex.quote(str(path))} {shlex.quote(str(out))}"


def not_converted_problem(path: str | Path) -> Problem:
    """What validate and train say about colpali data: convert it first, and how."""
    return Problem(str(path), None, None, "colpali-engine / ViDoRe data (page images held in "
                   "the rows): bigbatch trains on records whose images are files; convert it "
                   f"first: {convert_command(path)}")


def read(path: Path, problems: list[Problem], split: str = "train") -> list[Record]:
    """No records: colpali data is converted first (a problem says how)."""
    problems.append(not_converted_problem(path))
    return []


FORMAT = Format("colpali", read, detect_path=is_colpali)
