"""sentence-transformers columns as its losses take them, and keys the contrastors reader
does not read: reported, never dropped silently."""

from __future__ import annotations

import json

import pytest

from bigbatch.data.formats import detect_format, read_records, write_records
from bigbatch.data.records.loader import load_records
from bigbatch.errors import DataError


def write(path, *recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")
    return path


@pytest.mark.parametrize("line,expected", [
    ({"query": "q", "positive": "p", "negative": "n"}, ("q", "p", ["n"])),  # msmarco triplets
    ({"query": "q", "positive": "p", "negative_1": "n1", "negative_2": "n2"},
     ("q", "p", ["n1", "n2"])),
    ({"question": "q", "answer": "p"}, ("q", "p", [])),
    ({"sentence1": "q", "sentence2": "p", "sentence3": "n"}, ("q", "p", ["n"])),
])
def test_columns_by_position_as_sentence_transformers_reads_them(tmp_path, line, expected):
    src = write(tmp_path / "t.jsonl", line, line)
    assert detect_format(src) == "st"
    records, problems = read_records(src)
    assert problems == []
    assert [(r.query, r.positive.text, [d.text for d in r.negatives]) for r in records] == \
        [expected] * 2
    assert [r.query for r in load_records(src)] == ["q", "q"]


def test_parquet_columns_by_position(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"query": ["q"], "pos": ["p"], "neg": ["n"]}), tmp_path / "t.parquet")
    (r,), problems = read_records(tmp_path / "t.parquet")
    assert problems == [] and (r.query, r.positive.text, r.negatives[0].text) == ("q", "p", "n")


def test_a_label_column_is_reported_not_read_as_positive(tmp_path):
    src = write(tmp_path / "t.jsonl", {"anchor": "a", "positive": "not similar", "label": 0},
                {"sentence1": "a", "sentence2": "b", "score": 0.1})
    records, problems = read_records(src, "st")
    assert [r.lost[0][0] for r in records] == ["label", "score"]
    with pytest.raises(DataError, match="t.jsonl:1, field 'label': a 'label' column"):
        load_records(src)
    with pytest.raises(DataError, match="2 record\\(s\\) cannot be written as contrastors"):
        write_records(records, tmp_path / "o.jsonl", "contrastors")


def test_named_columns_that_are_not_read_are_reported(tmp_path):
    src = write(tmp_path / "t.jsonl", {"anchor": "a", "positive": "p", "negative_1": "n",
                                       "hard_negative": "h"})
    _, problems = read_records(src)
    assert [(p.line, p.field) for p in problems] == [(1, "hard_negative")]
    src = write(tmp_path / "u.jsonl", {"query_id": "7", "query": "q", "positive": "p",
                                       "negative": "n"})
    (r,), problems = read_records(src)  # an id column is not a text column
    assert [p.field for p in problems] == ["query_id"]
    assert (r.query, r.positive.text, r.negatives[0].text) == ("q", "p", "n")


@pytest.mark.parametrize("line,field", [
    ({"query": "q", "positive": "p", "negatives": ["n"], "hard_negatives": ["h"]},
     "hard_negatives"),
    ({"query": "q", "positive": "p", "positives": ["p2"]}, "positives"),  # several positives
    ({"query": "q", "pos": ["p"], "neg": ["n"], "prompt": "Represent"}, "pos"),  # FlagEmbedding
    ({"query": "q", "document": "d", "negatives": ["n"]}, "document"),  # nomic contrastors
])
def test_contrastors_keys_it_does_not_read_are_reported(tmp_path, line, field):
    src = write(tmp_path / "c.jsonl", line)
    assert detect_format(src) == "contrastors"
    _, problems = read_records(src)
    assert field in [p.field for p in problems]
    with pytest.raises(DataError, match=f"c.jsonl:1, field '{field}'"):
        load_records(src)


def test_metadata_keys_are_left_alone(tmp_path):
    src = write(tmp_path / "c.jsonl", {"query": "q", "positive": "p", "negatives": ["n"],
                                       "source": "msmarco", "doc_id": "d1", "score": 3})
    assert read_records(src)[1] == []


def _save_to_disk(folder, table, split=None):
    """What ``datasets``' save_to_disk writes: Arrow IPC stream files and state.json (a
    DatasetDict: one such folder per split and dataset_dict.json)."""
    import pyarrow as pa

    target = folder / split if split else folder
    target.mkdir(parents=True)
    half = table.num_rows // 2
    files = []
    for i, part in enumerate((table.slice(0, half), table.slice(half))):
        name = f"data-0000{i}-of-00002.arrow"
        with pa.ipc.new_stream(str(target / name), part.schema) as w:
            w.write_table(part, max_chunksize=2)
        files.append({"filename": name})
    (target / "dataset_info.json").write_text("{}")
    (target / "state.json").write_text(json.dumps({"_data_files": files, "_split": split}))
    if split:
        (folder / "dataset_dict.json").write_text(json.dumps({"splits": [split]}))


def test_hf_datasets_folders_read_and_train(tmp_path):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"anchor": [f"q{i}" for i in range(5)],
                      "positive": [f"p{i}" for i in range(5)]})
    _save_to_disk(tmp_path / "ds", table)
    _save_to_disk(tmp_path / "dd", table, split="train")
    for folder in ("ds", "dd"):
        assert detect_format(tmp_path / folder) == "st"
        records, problems = read_records(tmp_path / folder)
        assert problems == [] and [(r.query, r.line) for r in records] == \
            [(f"q{i}", i + 1) for i in range(5)]
        assert [r.query for r in load_records(tmp_path / folder)] == [f"q{i}" for i in range(5)]
    with pytest.raises(DataError, match="no split 'test'.*splits: train"):
        read_records(tmp_path / "dd", split="test")


def test_parquet_is_streamed_by_record_batch_with_row_numbers(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"anchor": [f"q{i}" for i in range(3000)], "positive":
                             ["p"] * 2999 + [""]}), tmp_path / "big.parquet", row_group_size=500)
    monkeypatch.setattr(pq, "read_table", None)  # never the whole table at once
    records, problems = read_records(tmp_path / "big.parquet")
    assert len(records) == 2999 and [(p.line, p.field) for p in problems] == [(3000, "positive")]


def test_csv_with_header_bom_crlf_and_quoted_newlines(tmp_path, capsys):
    src = tmp_path / "t.csv"
    src.write_bytes(b"\xef\xbb\xbfanchor,positive,negative\r\n"
                    + b"q1,\"a passage\r\non two lines\",n1\r\n"
                    + "q2 ünïcode,p2,n2\r\n".encode() + b"q3,p3\r\n")
    records, problems = read_records(src)
    assert [(r.query, r.line) for r in records] == [("q1", 2), ("q2 ünïcode", 4)]
    assert records[0].positive.text == "a passage\r\non two lines"
    assert [(p.line, p.message) for p in problems] == \
        [(5, "3 columns in the header, another number here")]
    out = tmp_path / "o.csv"
    write_records(records, out, "st")
    back, problems = read_records(out)
    assert problems == [] and [(r.query, r.positive.text, r.negatives[0].text) for r in back] \
        == [(r.query, r.positive.text, r.negatives[0].text) for r in records]
