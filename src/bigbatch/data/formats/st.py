"""The ``st`` format: sentence-transformers columns ``anchor``, ``positive``,
``negative_1..k``, as JSONL (``.jsonl``), Parquet (``.parquet``), CSV with a header
(``.csv``), or a folder written by ``datasets``' ``save_to_disk`` (a DatasetDict's
``--split``); Parquet and Arrow are streamed a record batch at a time, and Parquet is
written a row group at a time. Text only. Teacher scores (for distillation) are the columns
``pos_score`` and ``neg_score_1..k``, one per negative in the negatives' order.

Without an ``anchor`` column the columns are read by position, as sentence-transformers'
losses take them (``query, positive, negative``, ``question, answer``); a ``label`` or
``score`` column cannot be held (reported). Detected for Parquet, CSV and ``datasets``
folders (unless they hold colpali data), and for JSONL whose first record has ``anchor``,
none of the contrastors keys, or ``negative`` / ``negative_N`` beside ``query`` and
``positive``.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ...errors import DataError, shown
from ..readers.files import open_data_file
from ..readers.tables import is_hf_dataset, table_rows
from ..records.types import Doc, Problem, Record
from .colpali import is_colpali, not_converted_problem
from .common import (
    ID_KEY,
    Format,
    WriteOptions,
    jsonl_rows,
    read_all,
    text_field,
    text_only,
    with_scores,
    write_jsonl,
)
from .contrastors import CONTRASTORS_KEYS

__all__ = ["FORMAT"]

_NEGATIVE = re.compile(r"negative(_\d+)?$")
_LABELS = ("label", "score")
_NEG_SCORE = re.compile(r"neg_score_(\d+)$")


def _score_columns(rec: dict) -> list[str]:
    """The teacher-score columns of a row: ``pos_score``, then ``neg_score_N`` by ``N``."""
    negs = sorted((k for k in rec if _NEG_SCORE.match(k)),
                  key=lambda k: int(_NEG_SCORE.match(k).group(1)))
    return (["pos_score"] if "pos_score" in rec else []) + negs


def detect_path(path: Path) -> bool:
    """A ``datasets`` folder, or a Parquet or CSV file."""
    if path.is_dir():
        return is_hf_dataset(path)
    return path.suffix.lower() in (".parquet", ".csv")


def detect_keys(keys: set) -> bool:
    """A first record with named or positional sentence-transformers columns."""
    return "anchor" in keys or not keys & CONTRASTORS_KEYS or (
        not keys & {"chunk_path", "neg_chunk_paths", "negatives"}
        and any(_NEGATIVE.match(k) for k in keys))


def _csv_rows(path: Path, problems: list[Problem]) -> Iterator[tuple[int, dict]]:
    """Rows of a CSV file with a header (the line number of the row's first line)."""
    with open_data_file(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        try:
            reader.fieldnames  # reads the header
            line = reader.line_num
            for row in reader:
                start, line = line + 1, reader.line_num
                if None in row or None in row.values():
                    problems.append(Problem(str(path), start, None,
                                            f"{len(reader.fieldnames or [])} columns in the "
                                            f"header, another number here"))
                    continue
                yield start, row
        except (csv.Error, UnicodeDecodeError) as e:
            problems.append(Problem(str(path), reader.line_num + 1, None, f"cannot read as CSV"
                                    f" ({e}); write it as UTF-8 CSV with a header"))


def _rows(path: Path, problems: list[Problem], split: str) -> Iterator[tuple[int, dict]]:
    if path.is_dir() or path.suffix.lower() == ".parquet":
        yield from table_rows(path, split)
    elif path.suffix.lower() == ".csv":
        yield from _csv_rows(path, problems)
    else:
        yield from jsonl_rows(path, problems)


def parse(rec: dict, path: Path, n: int, problems: list[Problem]) -> Record | None:
    """The record of one row of sentence-transformers columns (``rec``, row or line ``n`` of
    ``path``), or None, with what is wrong added to ``problems`` (see :func:`stream`)."""
    w = (str(path), n)
    lost = [(k, f"a {shown(k)} column (bigbatch trains on (anchor, positive, negatives); "
                f"labelled or scored pairs are not all positives)")
            for k in _LABELS if k in rec]
    score_cols = _score_columns(rec)
    cols = [k for k in rec if k not in _LABELS and k not in score_cols]
    if "anchor" in rec:
        q = text_field(rec, "anchor", w, problems)
        p = text_field(rec, "positive", w, problems)
        neg_keys = [k for k in cols if _NEGATIVE.match(k)]
        for k in cols:
            if k not in ("anchor", "positive") and k not in neg_keys:
                problems.append(Problem(str(path), n, k, "not read: sentence-transformers "
                                        "columns are anchor, positive, negative_1..k"))
    elif len(cols) < 2:
        problems.append(Problem(str(path), n, None, f"{_columns(cols)} read by position "
                                f"(no 'anchor' column): needs a first column (the anchor) "
                                f"and a second (the positive), or columns named anchor, "
                                f"positive, negative_1..k"))
        return None
    else:
        for k in [k for k in cols if ID_KEY.search(k)]:
            problems.append(Problem(str(path), n, k, "not read: an id column among "
                                    "columns read by position (the first is the anchor, "
                                    "the second the positive, the rest negatives); "
                                    "remove it"))
            cols.remove(k)
        if len(cols) < 2:
            return None
        q = text_field(rec, cols[0], w, problems)
        p = text_field(rec, cols[1], w, problems)
        neg_keys = cols[2:]
    negs = []
    for key in neg_keys:
        t = text_field(rec, key, w, problems)
        if t is not None:
            negs.append(Doc(text=t, key=key))
    if q is None or p is None:
        return None
    qkey, pkey = ("anchor", "positive") if "anchor" in rec else (cols[0], cols[1])
    pos = Doc(text=p, key=pkey)
    if score_cols:
        neg_cols = [k for k in score_cols if k != "pos_score"]
        pos, negs = with_scores(rec.get("pos_score"), [rec[k] for k in neg_cols],
                                neg_cols, pos, negs, len(neg_keys), w, problems)
    return Record(q, pos, negs, None, n, str(path), lost,
                  unread_negatives=len(neg_keys) - len(negs), query_key=qkey)


def stream(path: Path, problems: list[Problem], split: str = "train") -> Iterator[Record]:
    """sentence-transformers columns, one record at a time. As sentence-transformers' losses
    take them: named ``anchor``, ``positive``, ``negative`` / ``negative_1..k`` (any other
    column is reported, not read), or, without an ``anchor`` column, by position: the first
    column is the anchor, the second the positive, the rest negatives (``query, positive,
    negative``; ``question, answer``). A ``label`` or ``score`` column cannot be held: such
    pairs are not all positives (reported). colpali data (page images held in the rows) is
    a problem saying how to convert it."""
    if is_colpali(path, split):  # training reads image files, so convert first
        problems.append(not_converted_problem(path))
        return
    for n, rec in _rows(path, problems, split):
        r = parse(rec, path, n, problems)
        if r is not None:
            yield r


read = read_all(stream)


def _columns(cols: list[str]) -> str:
    """The columns of a row as a message names them."""
    if not cols:
        return "no column"
    return f"{'one column' if len(cols) == 1 else 'columns'} {', '.join(map(repr, cols))}"


_ROW_GROUP = 4096  # rows of a Parquet row group, written as they come


class _Shape:
    """The shape of the table the records make, as they pass: the first record's negatives
    and teacher scores (the columns), and what the refusals name once all are seen (the
    first record of each number of negatives, the first without scores)."""

    def __init__(self) -> None:
        self.count = self.k = 0
        self.first: dict[int, tuple[int, Record]] = {}  # negatives -> (its first record)
        self.scored = self.fits = False
        self.any_scored = False
        self.unscored: Record | None = None

    def add(self, r: Record) -> bool:
        """Count ``r``; whether it fits the columns of the first record (and every record
        before it did): only then is it written."""
        k, scored = len(r.negatives), bool(_score_fields(r))
        self.first.setdefault(k, (self.count, r))
        self.any_scored |= scored
        if not scored and self.unscored is None:
            self.unscored = r
        if not self.count:
            self.k, self.scored, self.fits = k, scored, True
        self.fits = self.fits and k == self.k and scored == self.scored
        self.count += 1
        return self.fits

    def columns(self) -> int:
        """The number of negative columns (the most negatives a record has)."""
        return max(self.first, default=0)

    def scores_error(self, out: Path) -> DataError | None:
        """Some records have teacher scores and others not (a table needs all or none)."""
        if not (self.any_scored and self.unscored is not None):
            return None
        first = self.unscored
        return DataError(f"some records carry teacher scores and others not ({first.source}:"
                         f"{first.line} has none); table columns need them in every record or "
                         f"in none: write JSONL (.jsonl), or drop the scores", path=str(out))


def _write_parquet(records: Iterable[Record], out: Path) -> None:
    """Parquet, a row group of :data:`_ROW_GROUP` rows at a time (pyarrow's ParquetWriter)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shape, rows, writer = _Shape(), [], None
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        for r in records:
            if shape.add(r):
                rows.append(r)
            if len(rows) >= _ROW_GROUP:
                writer = _write_rows(rows, shape, out, writer)
        if len(shape.first) > 1:
            raise DataError("sentence-transformers columns need the same number of negatives "
                            "in every record", path=str(out))
        error = shape.scores_error(out)
        if error is not None:
            raise error
        if not shape.count:  # no column to type: the columns' names only
            pq.write_table(pa.table({"anchor": [], "positive": []}), out)
        elif rows:
            writer = _write_rows(rows, shape, out, writer)
    finally:
        if writer is not None:
            writer.close()


def _write_rows(rows: list[Record], shape: _Shape, out: Path, writer: Any) -> Any:
    """Write ``rows`` as one row group (opening the writer on the first); clears ``rows``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    k = shape.k
    cols: dict[str, list] = {"anchor": [r.query for r in rows],
                             "positive": [r.positive.text for r in rows]}
    for i in range(k):
        cols[f"negative_{i + 1}"] = [r.negatives[i].text for r in rows]
    if shape.scored:
        cols["pos_score"] = [r.positive.score for r in rows]
        for i in range(k):
            cols[f"neg_score_{i + 1}"] = [r.negatives[i].score for r in rows]
    schema = pa.schema([(name, pa.float64() if "score" in name else pa.string())
                        for name in cols])
    if writer is None:
        writer = pq.ParquetWriter(out, schema)
    writer.write_table(pa.table(cols, schema=schema))
    rows.clear()
    return writer


def _write_csv(records: Iterable[Record], out: Path) -> None:
    shape = _Shape()
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        for r in records:
            if not shape.add(r):
                continue
            if shape.count == 1:
                _csv_header(w, shape.k, shape.scored)
            w.writerow([r.query, r.positive.text, *(d.text for d in r.negatives)]
                       + ([r.positive.score, *(d.score for d in r.negatives)]
                          if shape.scored else []))
        if not shape.count:
            _csv_header(w, 0, False)
    error = shape.scores_error(out)
    if error is not None:
        raise error
    if len(shape.first) > 1:
        k = shape.columns()
        _, r = min(v for n, v in shape.first.items() if n != k)
        raise DataError("CSV columns need the same number of negatives in every "
                        f"record ({r.source}:{r.line} has {len(r.negatives)}, "
                        f"another {k})", path=str(out))


def _csv_header(w: Any, k: int, scored: bool) -> None:
    w.writerow(["anchor", "positive", *(f"negative_{i + 1}" for i in range(k))]
               + (["pos_score", *(f"neg_score_{i + 1}" for i in range(k))] if scored else []))


def write(records: Iterable[Record], out: Path, options: WriteOptions) -> None:
    """Write ``records`` as Parquet (``.parquet``), CSV (``.csv``) or JSONL (else), each
    record as it comes (Parquet a row group at a time).

    Raises:
        DataError: Parquet or CSV, and records with different numbers of negatives, or
            some with teacher scores and others not (once every record was read).
    """
    if out.suffix.lower() == ".parquet":
        _write_parquet(records, out)
    elif out.suffix.lower() == ".csv":
        _write_csv(records, out)
    else:
        write_jsonl(out, ({"anchor": r.query, "positive": r.positive.text,
                           **{f"negative_{i + 1}": d.text for i, d in enumerate(r.negatives)},
                           **_score_fields(r)}
                          for r in records))


def _score_fields(r: Record) -> dict[str, float]:
    """A record's teacher scores as st columns (none when it has none)."""
    if r.positive.score is None or any(d.score is None for d in r.negatives):
        return {}
    return {"pos_score": r.positive.score,
            **{f"neg_score_{i + 1}": d.score for i, d in enumerate(r.negatives)}}


FORMAT = Format("st", read, detect_path=detect_path, detect_keys=detect_keys, write=write,
                cannot_hold=lambda r: text_only("st", r),
                suffixes=(".jsonl", ".parquet", ".csv"), stream=stream, parse=parse)
