"""``bigbatch make-pairs``: training pairs made from a corpus alone, one field of each
document as the query and another as the positive (title -> abstract, question -> answer).

Such pairs adapt a model to a corpus without any labelled query (the unsupervised
"title-body" pairs of E5's and GTE's pre-training mixes); a run can mix them with labelled
pairs as a second source, with its own instruction (see docs/guides/multi-dataset.md).
Documents whose query field is missing, empty, or the same as the positive are skipped
and counted; a line that is not a JSON object is reported with file and line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import DataError, shown
from ..formats import write_records
from ..readers.jsonl import jsonl_rows
from ..records.types import Doc, Problem, Record, problem_lines

__all__ = ["make_pairs"]


def make_pairs(corpus: str | Path, output: str | Path, query_field: str = "title",
               doc_field: str = "text", id_field: str = "_id", max_pairs: int | None = None,
               fmt: str = "contrastors") -> dict[str, Any]:
    """Write ``(query_field, doc_field)`` pairs of a JSONL corpus (a BEIR ``corpus.jsonl``,
    or a BEIR directory: its corpus) to ``output`` as ``fmt`` training records, the
    document's ``id_field`` kept as the positive's id. ``max_pairs``: the first that many.

    Returns:
        a report: ``written``, ``skipped`` (by reason) and ``output``.

    Raises:
        DataError: the corpus is missing, has a malformed line (file and line named), or
            gives no pair.

    Example::

        make_pairs("scifact/corpus.jsonl", "titles.jsonl", query_field="title")
    """
    path = Path(corpus)
    if path.is_dir():
        path = path / "corpus.jsonl"
    if not path.is_file():
        raise DataError("corpus file not found (a JSONL file or a BEIR directory)",
                        path=str(path))
    problems: list[Problem] = []
    records: list[Record] = []
    skipped: dict[str, int] = {}
    for line, rec in jsonl_rows(path, problems):
        query, doc = rec.get(query_field), rec.get(doc_field)
        why = None
        if not isinstance(query, str) or not query.strip():
            why = f"no {query_field}"
        elif not isinstance(doc, str) or not doc.strip():
            why = f"no {doc_field}"
        elif query.strip() == doc.strip():
            why = f"{query_field} equals {doc_field}"
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        doc_id = rec.get(id_field)
        records.append(Record(query=query.strip(), line=line, source=str(path),
                              positive=Doc(text=doc, id=None if doc_id is None else str(doc_id))))
        if max_pairs is not None and len(records) >= max_pairs:
            break
    if problems:
        raise DataError(f"{len(problems)} problem(s) in the corpus:\n  "
                        + "\n  ".join(problem_lines(problems)))
    if not records:
        raise DataError(f"no document has both {shown(query_field)} and {shown(doc_field)} text",
                        path=str(path))
    report = write_records(records, output, fmt)
    return {"written": report["written"], "skipped": skipped, "output": str(output)}
