"""Training records read by index: millions of records in bounded memory.

:func:`open_records` validates a training source once, as
:func:`~bigbatch.data.records.loader.load_records` does (every problem reported with file, line and
field before step 1), while streaming it one record at a time, and keeps an index of where
each record is. Training then reads a record when its batch is made (:class:`RecordStore`,
a ``Sequence`` of :class:`~bigbatch.data.records.types.TrainRecord`): no record is held as a Python
object.

- JSONL files, and folders of JSONL shards (:mod:`bigbatch.data.readers.shards`): the byte offset
  of each record's line, counted by the read that validates it (each file is read once),
  kept as NumPy arrays that are memory-mapped when read.
- ``datasets`` folders (``save_to_disk``: Arrow IPC files): memory-mapped as they are, a
  record being a row.
- Parquet files and folders of Parquet shards: Parquet is compressed and cannot be read by
  row cheaply, so each file is written once, uncompressed, as an Arrow IPC file in the
  index (a second read of the file, after the one that validates it), and memory-mapped.
- BEIR directories and CSV files are read whole
(:func:`~bigbatch.data.records.loader.load_records`).

The index is kept in ``$BIGBATCH_CACHE/records/`` (``~/.cache/bigbatch``), one folder per
source and ``--split``, beside a ``meta.json`` naming each file it indexes by size,
modification time and a hash of its first MiB and last 64 KiB, and the settings it was
validated with (format, ``--data-root``). A later run with the same files and settings
starts from the index without reading the data again; when a file changed, the source is
validated and indexed anew. An index that is there but does not agree with itself or with
its files (cut short, edited, a file changed under a running job) is refused, naming the
folder to delete. A document file (a ``chunk_path`` text, an image) is checked when the
source is indexed and read when its batch is made: a file removed since is reported then,
with file, line and field.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from ...errors import DataError
from ..formats import format_of, get_format, no_records_problem, stream_records
from ..formats.common import Format
from ..formats.instructions import SystemCounts
from ..readers.files import NotRegularFileError, cache_errors, open_regular
from ..readers.jsonl import jsonl_spans
from ..readers.shards import is_shard_folder, shard_files
from ..readers.tables import hf_dataset_files, is_hf_dataset
from .loader import RecordSummary, load_records, raise_problems, short_negatives_error, train_record
from .types import Problem, Record, TrainRecord, problem_lines

__all__ = ["open_records", "RecordStore", "index_folder", "INDEX_VERSION"]

INDEX_VERSION = 1
_HEAD, _TAIL = 2**20, 2**16  # bytes of a file hashed into its signature
_ARRAYS = ("part", "line", "pos", "end", "negs")  # per record, each a .npy file


def _default_cache() -> Path:
    from ..readers.files import default_cache_dir

    return default_cache_dir()


def _signature(path: Path) -> dict[str, Any]:
    """What identifies a file's contents: size, modification time, a hash of its ends."""
    try:  # (a FIFO or a device is refused without blocking on it)
        f = open_regular(path, "rb")
    except NotRegularFileError as e:
        raise DataError(e.strerror, path=str(path)) from None
    st = os.fstat(f.fileno())
    h = hashlib.sha1()
    with f:
        h.update(f.read(_HEAD))
        if st.st_size > _HEAD:
            f.seek(max(_HEAD, st.st_size - _TAIL))
            h.update(f.read(_TAIL))
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head": h.hexdigest()}


def _part_signature(path: Path, split: str) -> dict[str, Any]:
    """The signature of a file, or of each Arrow file of a ``datasets`` folder."""
    if path.is_dir():
        return {"path": str(path), "files": [_signature(f) for f in hf_dataset_files(path, split)]}
    return _signature(path)


def _parts(source: Path, split: str) -> tuple[str, list[Path]] | None:
    """(kind, files) of a source read by index: ``jsonl`` lines, ``table`` rows of
    memory-mapped Arrow (a ``datasets`` folder), ``parquet`` rows; None for a source read
    whole (a BEIR directory, CSV)."""
    if source.is_dir():
        if is_hf_dataset(source):
            return "table", [source]
        if is_shard_folder(source):
            files = shard_files(source, split)
            return ("parquet" if files[0].suffix.lower() == ".parquet" else "jsonl"), files
        return None
    suffix = source.suffix.lower()
    if suffix == ".csv":
        return None
    return ("parquet" if suffix == ".parquet" else "jsonl"), [source]


def index_folder(source: str | Path, split: str = "train",
                 cache_dir: str | Path | None = None) -> Path:
    """The folder holding the index of ``source`` (a file or folder) and ``split``."""
    key = hashlib.sha1(f"{os.path.realpath(source)}\0{split}".encode()).hexdigest()[:20]
    return Path(cache_dir or _default_cache()) / "records" / key


class _JsonlPart:
    """Lines of one JSONL file, read by byte range."""

    def __init__(self, path: Path, signature: dict[str, Any], folder: Path, i: int) -> None:
        self.path, self.signature = path, signature

    def check(self, fd: int) -> None:
        st = os.fstat(fd)
        if (st.st_size, st.st_mtime_ns) != (self.signature["size"], self.signature["mtime_ns"]):
            raise DataError("changed since it was indexed for this run (records are read "
                            "as batches are made): leave training data unchanged while a "
                            "run reads it, and start again to index it anew",
                            path=str(self.path))

    def row(self, pos: int, end: int, line: int) -> dict:
        # opened for each read: a folder may hold more shards than a process may keep open
        fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            self.check(fd)
            start = max(pos - 1, 0)
            data = os.pread(fd, end - start, start)
        finally:
            os.close(fd)
        if pos and data[:1] not in (b"\n", b"\r"):
            raise DataError("the record index does not match the file (an offset is not at "
                            "the start of a line)", path=str(self.path), line=line)
        try:
            rec = json.loads(data[1 if pos else 0:].decode("utf-8").lstrip("\ufeff"))
        except (ValueError, RecursionError) as e:
            raise DataError(f"the record index does not match the file ({e})",
                            path=str(self.path), line=line) from e
        return rec

    def close(self) -> None:
        return None


class _TablePart:
    """Rows of memory-mapped Arrow: a ``datasets`` folder's files, or the Arrow copy of a
    Parquet file kept in the index."""

    def __init__(self, path: Path, signature: dict[str, Any], folder: Path, i: int) -> None:
        import pyarrow as pa

        self.path = path
        if path.is_dir():  # a datasets folder: its Arrow IPC streams, as datasets maps them
            tables = [pa.ipc.open_stream(pa.memory_map(str(f))).read_all()
                      for f in hf_dataset_files(path, signature["split"])]
            self.table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        else:
            self.table = pa.ipc.open_file(pa.memory_map(str(_arrow_copy(folder, i)))).read_all()

    def row(self, pos: int, end: int, line: int) -> dict:
        if not 0 <= pos < self.table.num_rows:
            raise DataError(f"the record index does not match the table (row {pos + 1} of "
                            f"{self.table.num_rows})", path=str(self.path), line=line)
        return self.table.slice(pos, 1).to_pylist()[0]

    def close(self) -> None:
        self.table = None


# how each kind of part is read by index
_PART_READERS = {"jsonl": _JsonlPart, "table": _TablePart, "parquet": _TablePart}


def _arrow_copy(folder: Path, i: int) -> Path:
    return folder / f"part-{i:05d}.arrow"


def _write_arrow_copy(parquet: Path, out: Path) -> None:
    """A Parquet file written as an uncompressed Arrow IPC file (rows read by index)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(parquet)
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, pf.schema_arrow) as w:
        for batch in pf.iter_batches(batch_size=4096):
            w.write_batch(batch)


class RecordStore(Sequence[TrainRecord]):
    """The records of an indexed training source, each read (and its documents resolved)
    when it is asked for: ``len(store)``, ``store[i]`` (a
    :class:`~bigbatch.data.records.types.TrainRecord`, equal to what
    :func:`~bigbatch.data.records.loader.load_records` gives at ``i``), ``store[a:b]`` (a list).
    ``summary`` is what training asks of all records at once (system prompts, images).

    Made by :func:`open_records`.
    """

    def __init__(self, source: Path, folder: Path, meta: dict[str, Any],
                 arrays: dict[str, np.ndarray], data_root: str | Path | None) -> None:
        self.source, self.folder, self.meta = source, folder, meta
        self.format: Format = get_format(meta["format"])
        self.data_root = data_root
        self.part, self.line, self.pos, self.end, self.negs = (arrays[k] for k in _ARRAYS)
        reader = _PART_READERS[meta["kind"]]
        self.parts = [reader(Path(sig["path"]), {**sig, "split": meta["split"]}, folder, i)
                      for i, sig in enumerate(meta["files"])]
        s = meta["summary"]
        self.summary = RecordSummary({k: tuple(v) for k, v in s["systems"].items()},
                                     None if s["first_image"] is None
                                     else tuple(s["first_image"]))

    def __len__(self) -> int:
        return len(self.line)

    @overload
    def __getitem__(self, i: int) -> TrainRecord: ...

    @overload
    def __getitem__(self, i: slice) -> list[TrainRecord]: ...

    def __getitem__(self, i: int | slice) -> TrainRecord | list[TrainRecord]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of {n}")
        i %= n
        part = self.parts[int(self.part[i])]
        line = int(self.line[i])
        row = part.row(int(self.pos[i]), int(self.end[i]), line)
        problems: list[Problem] = []
        r = self.format.parse(row, part.path, line, problems)
        t = None if r is None else train_record(r, problems, self.data_root,
                                                check_image_file=False)
        if t is None:
            shown = "\n  ".join(problem_lines(problems))
            raise DataError(f"a record changed since its source was indexed:\n  {shown}")
        return t

    def __iter__(self) -> Iterator[TrainRecord]:
        for i in range(len(self)):
            yield self[i]

    def check_negatives(self, num_hard_negatives: int) -> None:
        """Refuse records with fewer than ``num_hard_negatives`` negatives, as
        :func:`~bigbatch.data.records.loader.load_records` does.

        Raises:
            DataError: naming how many and their first lines.
        """
        if num_hard_negatives <= self.meta["min_negatives"]:
            return
        short = np.flatnonzero(np.asarray(self.negs) < num_hard_negatives)
        if len(short):
            lines = [int(self.line[j]) for j in short[:10]]
            raise short_negatives_error(lines, len(short), num_hard_negatives, self.source)

    def close(self) -> None:
        """Close the files the store reads."""
        for p in self.parts:
            p.close()


def _settings(source: Path, split: str, fmt: str, kind: str,
              data_root: str | Path | None) -> dict[str, Any]:
    return {"version": INDEX_VERSION, "source": os.path.realpath(source), "split": split,
            "format": fmt, "kind": kind,
            "data_root": os.path.realpath(data_root) if data_root else None}


def _indexed_records(source: Path, fmt: str, kind: str, files: list[Path], split: str,
                     problems: list[Problem]) -> Iterator[tuple[int, Record, int, int]]:
    """(file, record, pos, end) of each record of ``source``, as
    :func:`~bigbatch.data.formats.stream_records` reads them: a JSONL line's byte offsets
    (``end`` the next line's), counted by the read that parses it, so each file is read
    once; a table's row (``pos`` and ``end`` both)."""
    if kind != "jsonl":
        where = {str(f): i for i, f in enumerate(files)}
        for r in stream_records(source, fmt, split, problems):
            yield where[r.source], r, r.line - 1, r.line - 1
        return
    parse = get_format(fmt).parse  # every format of JSONL records parses one line alone
    before, count = len(problems), 0
    for i, part in enumerate(files):
        for n, row, pos, end in jsonl_spans(part, problems):
            r = parse(row, part, n, problems)
            if r is not None:
                count += 1
                yield i, r, pos, end
    if not count and len(problems) == before:
        problems.append(no_records_problem(source, fmt))


def _build(source: Path, split: str, fmt: str, kind: str, files: list[Path],
           data_root: str | Path | None, folder: Path) -> None:
    """Validate ``source`` in one streaming pass (every problem raised as
    :func:`~bigbatch.data.records.loader.load_records` raises it) and write its index to
    ``folder`` (built aside, then renamed into place)."""
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        signatures = [_part_signature(f, split) for f in files]
        cols: dict[str, list[np.ndarray]] = {k: [] for k in _ARRAYS}
        block: dict[str, list[int]] = {k: [] for k in _ARRAYS}
        problems: list[Problem] = []
        counts, summary = SystemCounts(), RecordSummary()

        def flush() -> None:
            for k in _ARRAYS:
                cols[k].append(np.asarray(block[k], np.int64))
                block[k].clear()

        total = 0
        for i, r, pos, end in _indexed_records(source, fmt, kind, files, split, problems):
            counts.add(r)
            problems.extend(SystemCounts.document_problems(r))  # needs the record alone
            t = train_record(r, problems, data_root)
            if t is None:
                continue
            summary.add(t)
            for k, v in zip(_ARRAYS, (i, r.line, pos, end, len(t.negatives))):
                block[k].append(v)
            total += 1
            if len(block["line"]) >= 65536:
                flush()
        flush()
        if counts.differ():  # a second pass names every record whose prompt differs
            for r in stream_records(source, fmt, split, []):
                # counts.problems(r) begins with r's document problems, found in the first pass
                problems.extend(counts.problems(r)[len(SystemCounts.document_problems(r)):])
        raise_problems(problems, total, source)
        dtypes = {"part": np.int32, "line": np.int64, "pos": np.int64, "end": np.int64,
                  "negs": np.int32}
        for k in _ARRAYS:
            np.save(tmp / f"{k}.npy", np.concatenate(cols[k]).astype(dtypes[k]))
            cols[k].clear()
        negs = np.load(tmp / "negs.npy")
        if kind == "parquet":
            for i, f in enumerate(files):
                _write_arrow_copy(f, _arrow_copy(tmp, i))
        meta = {**_settings(source, split, fmt, kind, data_root), "files": signatures,
                "count": total, "min_negatives": int(negs.min()) if total else 0,
                "summary": {"systems": summary.systems, "first_image": summary.first_image}}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _stale(meta: dict[str, Any] | None, settings: dict[str, Any], files: list[Path],
           split: str) -> bool:
    """Whether an index was made of other files or settings (then it is made anew)."""
    if meta is None or any(meta.get(k) != v for k, v in settings.items()):
        return True
    if [s["path"] for s in meta.get("files", [])] != [str(f) for f in files]:
        return True
    return any(_part_signature(f, split) != s for f, s in zip(files, meta["files"]))


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _load(source: Path, folder: Path, meta: dict[str, Any],
          data_root: str | Path | None) -> RecordStore:
    """The store of an index that is up to date, refused when it does not agree with
    itself or its files."""
    def refuse(why: str) -> DataError:
        return DataError(f"the record index in {folder} does not match this data ({why}); "
                         f"delete that folder to index the data anew", path=str(source))

    arrays = {}
    for k in _ARRAYS:
        try:
            arrays[k] = np.load(folder / f"{k}.npy", mmap_mode="r")
        except (OSError, ValueError) as e:
            raise refuse(f"{k}.npy cannot be read: {e}") from e
        if arrays[k].shape != (meta["count"],):
            raise refuse(f"{k}.npy holds {arrays[k].shape[0]} entries, the index "
                         f"{meta['count']} records")
    n = meta["count"]
    if n:  # a sample of the entries (the first and last thousand, then one in n / 4096):
        # reading them all would bring the whole index into memory at every start
        at = np.unique(np.concatenate([np.arange(min(n, 1024)), np.arange(max(0, n - 1024), n),
                                       np.arange(0, n, max(1, n // 4096))]))
        part = np.asarray(arrays["part"][at])
        if int(part.max()) >= len(meta["files"]) or int(part.min()) < 0:
            raise refuse("a record names a file the index does not list")
        if meta["kind"] == "jsonl":
            sizes = np.array([s["size"] for s in meta["files"]], np.int64)
            pos, end = np.asarray(arrays["pos"][at]), np.asarray(arrays["end"][at])
            if (end > sizes[part]).any() or (pos >= end).any() or (pos < 0).any():
                raise refuse("a record's byte range lies outside its file")
        if meta["kind"] == "parquet":
            missing = [i for i in range(len(meta["files"])) if not _arrow_copy(folder, i).is_file()]
            if missing:
                raise refuse(f"the Arrow copy of {meta['files'][missing[0]]['path']} is missing")
    try:
        return RecordStore(source, folder, meta, arrays, data_root)
    except (OSError, ValueError) as e:
        raise refuse(str(e)) from e


def open_records(source: str | Path, split: str = "train", num_hard_negatives: int = 0,
                 data_root: str | Path | None = None,
                 cache_dir: str | Path | None = None) -> Sequence[TrainRecord]:
    """Training records of a source, as :func:`~bigbatch.data.records.loader.load_records` gives
    them (the same records, the same checks and errors), read by index rather than held in
    memory (see the module): a JSONL file, a folder of JSONL or Parquet shards, a Parquet
    file or a ``datasets`` folder. A BEIR directory or a CSV file is read whole.

    Args:
        source: the training data (``--train-data``).
        split: a ``datasets`` folder's split, the hub shards' split, a BEIR qrels split.
        num_hard_negatives: every record must have at least this many negatives.
        data_root: every file the data names must resolve inside this folder.
        cache_dir: where indexes are kept (``$BIGBATCH_CACHE``, else ``~/.cache/bigbatch``).

    Example:
        >>> records = open_records("train.jsonl", num_hard_negatives=3)  # doctest: +SKIP
        >>> len(records), records[0].query  # doctest: +SKIP

    Raises:
        DataError: every problem in the data (file, line, field), fewer negatives than
            ``num_hard_negatives``, or an index that does not match its data.
    """
    source = Path(source)
    if not source.exists():
        raise DataError("training data file not found", path=str(source))
    found = _parts(source, split)
    if found is None:
        return load_records(source, split, num_hard_negatives, data_root)
    kind, files = found
    fmt = format_of(source)
    folder = index_folder(source, split, cache_dir)
    settings = _settings(source, split, fmt, kind, data_root)
    meta = _read_meta(folder)
    if _stale(meta, settings, files, split):
        print(f"bigbatch: indexing {source} (once: kept in {folder} until it changes)",
              file=sys.stderr, flush=True)
        with cache_errors(folder.parent):  # a read-only or full $BIGBATCH_CACHE, named
            _build(source, split, fmt, kind, files, data_root, folder)
        meta = _read_meta(folder)
        if meta is None:  # pragma: no cover - written just above
            raise DataError(f"the record index in {folder} could not be written",
                            path=str(source))
    store = _load(source, folder, meta, data_root)
    store.check_negatives(num_hard_negatives)
    return store
