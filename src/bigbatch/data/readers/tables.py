"""Tables on disk: Parquet files and folders written by ``datasets``' ``save_to_disk`` (Arrow
IPC streams), read a record batch at a time with 1-based row numbers.

Used by the sentence-transformers reader and by colpali detection and conversion. pyarrow
is imported lazily (it comes with the ``data`` extra).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ...errors import DataError, shown

__all__ = ["is_hf_dataset", "has_split", "hf_dataset_files", "table_files", "table_schema",
           "table_rows", "count_table_rows"]


def is_hf_dataset(path: Path) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def has_split(path: Path, split: str) -> bool:
    """Whether a ``datasets`` folder holds ``split`` (a Dataset, not a DatasetDict, holds any;
    an unreadable ``dataset_dict.json`` is reported by :func:`hf_dataset_files`)."""
    if not (path / "dataset_dict.json").is_file():
        return True
    try:
        return split in json.loads((path / "dataset_dict.json").read_text("utf-8"))["splits"]
    except (OSError, ValueError, KeyError, TypeError):
        return True  # hf_dataset_files reports it


def hf_dataset_files(path: Path, split: str) -> list[Path]:
    """The Arrow files of a ``save_to_disk`` folder (of ``split`` for a DatasetDict)."""
    if (path / "dataset_dict.json").is_file():
        try:
            splits = json.loads((path / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"cannot read dataset_dict.json: {e}", path=str(path)) from e
        if split not in splits:
            raise DataError(f"no split {shown(split)} in this datasets folder (splits: "
                            f"{', '.join(map(str, splits))}); pass --split", path=str(path))
        path = path / split
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
        return [path / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"cannot read state.json of a datasets folder: {e}",
                        path=str(path)) from e


def table_files(path: Path, split: str) -> list[Path]:
    """The files of a table: a ``datasets`` folder's Arrow files, or the Parquet file itself."""
    return hf_dataset_files(path, split) if path.is_dir() else [path]


def _unreadable(f: Path, e: Exception) -> DataError:
    return DataError(f"cannot read as {'Parquet' if f.suffix == '.parquet' else 'Arrow'}: {e}",
                     path=str(f))


def _pyarrow(path: Path) -> tuple[Any, Any]:
    """pyarrow and pyarrow.parquet, imported here (a DataError naming ``path`` without)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:  # pragma: no cover
        raise DataError("reading Parquet or Arrow needs pyarrow: pip install pyarrow (the data "
                        "extra: pip install -e '.[data]')", path=str(path)) from None
    return pa, pq


def table_schema(f: Path) -> Any:
    """The Arrow schema of one Parquet or Arrow file (reading no rows)."""
    pa, pq = _pyarrow(f)
    try:
        if f.suffix == ".parquet":
            return pq.ParquetFile(f).schema_arrow
        with pa.memory_map(str(f)) as src:
            return pa.ipc.open_stream(src).schema
    except (OSError, pa.ArrowException) as e:
        raise _unreadable(f, e) from e


def table_rows(path: Path, split: str, columns: list[str] | None = None,
               rows_per_slice: int = 1024) -> Iterator[tuple[int, dict]]:
    """(1-based row number, row) of a Parquet file or ``datasets`` folder (``columns`` only,
    when given), streamed a record batch at a time and turned into Python objects
    ``rows_per_slice`` rows at a time."""
    pa, pq = _pyarrow(path)
    n = 0
    for f in table_files(path, split):
        try:
            if f.suffix == ".parquet":
                batches = pq.ParquetFile(f).iter_batches(batch_size=rows_per_slice,
                                                         columns=columns)
            else:  # datasets writes the Arrow IPC stream format
                batches = (b if columns is None else b.select(columns)
                           for b in pa.ipc.open_stream(pa.memory_map(str(f))))
            for batch in batches:
                for start in range(0, batch.num_rows, rows_per_slice):
                    for row in batch.slice(start, rows_per_slice).to_pylist():
                        n += 1
                        yield n, row
        except (OSError, pa.ArrowException) as e:
            raise _unreadable(f, e) from e


def count_table_rows(path: Path, split: str) -> int | None:
    """The number of rows of a table (None when a file cannot be read), from Parquet
    metadata or memory-mapped Arrow batches: no cell is read."""
    pa, pq = _pyarrow(path)
    total = 0
    try:
        for f in table_files(path, split):
            if f.suffix == ".parquet":
                total += pq.ParquetFile(f).metadata.num_rows
            else:
                total += sum(b.num_rows for b in pa.ipc.open_stream(pa.memory_map(str(f))))
    except (OSError, pa.ArrowException):
        return None
    return total
