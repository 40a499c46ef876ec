"""A training source's way to records, as ``bigbatch train`` takes it (``open_records``, one
call per ``--train-data`` source): its format detected once, and each file read once. A JSONL
file is opened three times: its first line for the format, its two ends for the signature
the index is kept under, and the one read that parses its records and counts where each
line's bytes are; an index made earlier is used without reading the records again."""

from __future__ import annotations

import builtins
import io
import json
import os
from collections import Counter
from pathlib import Path

import pytest

import bigbatch.data.formats as formats
import bigbatch.data.records.loader as loader
from bigbatch.data.records.store import open_records


class Counts:
    """Calls of ``detect_format`` (the outermost: a shard folder's asks its first shard) and
    opens of the files under ``root``, by name, while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.detections, self.opens, self._depth = 0, Counter(), 0
        detect = formats.detect_format

        def counted_detect(path):
            self.detections += self._depth == 0
            self._depth += 1
            try:
                return detect(path)
            finally:
                self._depth -= 1

        for module in (formats, loader):  # the two names it is called by
            monkeypatch.setattr(module, "detect_format", counted_detect)
        for module, name in ((os, "open"), (builtins, "open"), (io, "open")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, self._counting(real, root))

    def _counting(self, real, root: Path):
        def counted(path, *args, **kwargs):
            if isinstance(path, (str, Path)) and Path(path).is_relative_to(root):
                self.opens[Path(path).relative_to(root).as_posix()] += 1
            return real(path, *args, **kwargs)
        return counted


def _rows(n: int, start: int = 0) -> str:
    return "".join(json.dumps({"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}"]})
                   + "\r\n" for i in range(start, start + n))


def _beir(root: Path) -> Path:
    (root / "qrels").mkdir(parents=True)
    (root / "corpus.jsonl").write_text("".join(json.dumps({"_id": f"d{i}", "text": f"doc {i}"})
                                               + "\n" for i in range(6)))
    (root / "queries.jsonl").write_text("".join(json.dumps({"_id": f"q{i}", "text": f"q {i}"})
                                                + "\n" for i in range(6)))
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\n" +
                                              "".join(f"q{i}\td{i}\t1\n" for i in range(6)))
    return root


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("BIGBATCH_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "data"
    root.mkdir()
    return root


def test_a_jsonl_file_is_detected_once_and_read_once(data, monkeypatch):
    (data / "train.jsonl").write_text("\ufeff" + _rows(5))
    counts = Counts(monkeypatch, data)
    records = open_records(data / "train.jsonl")
    assert counts.detections == 1
    assert counts.opens == {"train.jsonl": 3}  # first line, signature, the read
    assert [r.query for r in records] == [f"q{i}" for i in range(5)]  # byte ranges right

    again = Counts(monkeypatch, data)
    assert len(open_records(data / "train.jsonl")) == 5  # the index: records not read again
    assert (again.detections, again.opens) == (1, {"train.jsonl": 2})


def test_a_shard_folder_is_detected_once_and_each_shard_read_once(data, monkeypatch):
    (data / "shards").mkdir()
    (data / "shards" / "train-00000-of-00002.jsonl").write_text(_rows(3))
    (data / "shards" / "train-00001-of-00002.jsonl").write_text(_rows(4, start=3))
    counts = Counts(monkeypatch, data)
    records = open_records(data / "shards")
    assert counts.detections == 1  # from the first shard's first line
    assert counts.opens == {"shards/train-00000-of-00002.jsonl": 3,
                            "shards/train-00001-of-00002.jsonl": 2}
    assert [r.query for r in records] == [f"q{i}" for i in range(7)]


def test_a_beir_directory_is_detected_once_and_each_file_read_once(data, monkeypatch):
    _beir(data / "beir")
    counts = Counts(monkeypatch, data)
    records = open_records(data / "beir")
    assert counts.detections == 1
    assert counts.opens == {"beir/corpus.jsonl": 1, "beir/queries.jsonl": 1,
                            "beir/qrels/train.tsv": 1}
    assert len(records) == 6


def test_the_counts_see_a_second_read(data, monkeypatch):
    """The counts can fail: reading the records again after the index is made counts."""
    (data / "train.jsonl").write_text(_rows(2))
    counts = Counts(monkeypatch, data)
    open_records(data / "train.jsonl")
    list(formats.stream_records(data / "train.jsonl", None, "train", []))
    assert counts.detections == 2 and counts.opens["train.jsonl"] > 3
