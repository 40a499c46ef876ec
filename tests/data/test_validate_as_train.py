"""`bigbatch validate` checks documents as the training loader does: whatever validate calls
clean loads for training, and whatever the loader refuses, validate reports first, with the
same file, line, field and message (never a raw Unicode or Pillow exception)."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import DataError


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(path: Path, width: int = 1, height: int = 1) -> None:
    """A PNG header of the given size with a 1-pixel body (valid when 1x1)."""
    path.write_bytes(b"\x89PNG\r\n\x1a\n"
                     + _chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + _chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + _chunk(b"IEND", b""))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    png(tmp_path / "a.png")
    png(tmp_path / "b.png")
    png(tmp_path / "huge.png", 14000, 14000)                        # over 2x Pillow's bomb limit
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 10)  # magic only
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "page.jfif").write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)))
    (tmp_path / "neg.txt").write_text("a negative passage")
    return tmp_path


# (JSONL line, field, start of the message) of each input the loader once crashed on or refused
CASES = {
    "latin-1 text file": (
        json.dumps({"query": "q", "chunk_path": "latin1.txt", "neg_chunk_paths": ["neg.txt"]}),
        "chunk_path", "'latin1.txt' (at "),
    "image with a suffix not listed": (
        json.dumps({"query": "q", "chunk_path": "page.jfif", "neg_chunk_paths": ["neg.txt"]}),
        "chunk_path", "'page.jfif' (at "),
    "lone surrogate in a document": (
        '{"query": "q", "positive": "p \\udc80 x", "negatives": ["n"]}',
        "positive", "holds an unpaired UTF-16 surrogate"),
    "lone surrogate in the query": (
        '{"query": "q \\ud800", "positive": "p", "negatives": ["n"]}',
        "query", "holds an unpaired UTF-16 surrogate"),
    "lone surrogate in a negative": (
        '{"query": "q", "positive": "p", "negatives": ["n", "m\\udfff"]}',
        "negatives[1]", "holds an unpaired UTF-16 surrogate"),
    "image over the decompression-bomb limit": (
        json.dumps({"query": "q", "chunk_path": "huge.png", "neg_chunk_paths": ["a.png"]}),
        "chunk_path", "image "),
    "PNG with a corrupt body": (
        json.dumps({"query": "q", "chunk_path": "bad.png", "neg_chunk_paths": ["a.png"]}),
        "chunk_path", "cannot read image"),
    "negative ./a.png is positive a.png": (
        json.dumps({"query": "q", "chunk_path": "a.png", "neg_chunk_paths": ["./a.png"]}),
        "neg_chunk_paths[0]", "a negative equals the positive"),
    "negative text is the positive file's content": (
        json.dumps({"query": "q", "chunk_path": "neg.txt", "negatives": ["a negative passage"]}),
        "negatives[0]", "a negative equals the positive"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_validate_reports_what_training_refuses(folder, case):
    line, field, message = CASES[case]
    f = folder / "t.jsonl"
    f.write_text(line + "\n")
    _, problems = validate_file(f)
    assert [(p.line, p.field) for p in problems] == [(1, field)]
    assert problems[0].message.startswith(message), problems[0].message
    with pytest.raises(DataError) as e:  # a DataError naming the same place, nothing raw
        load_records(f, num_hard_negatives=1)
    assert str(problems[0]) in str(e.value)


def test_messages_say_what_to_do(folder):
    f = folder / "t.jsonl"
    f.write_text("\n".join(CASES[c][0] for c in ("latin-1 text file", "image with a suffix "
                                                 "not listed", "image over the decompression-bomb "
                                                 "limit")) + "\n")
    text = "\n".join(str(p) for p in validate_file(f)[1])
    assert "is not UTF-8 text (invalid continuation byte at byte 3); re-encode it as UTF-8" in text
    assert "it looks like an image: image paths must end in one of" in text
    assert "too large to open safely" in text


def test_a_file_that_is_not_utf8_is_reported_per_line(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_bytes(b'{"query": "q", "positive": "p", "negatives": ["n"]}\n'
                  b'{"query": "caf\xe9", "positive": "p2", "negatives": ["n2"]}\n')
    n, problems = validate_file(f)
    assert n == 1 and [str(p) for p in problems] == [
        f"{f}:2: not UTF-8 text (byte 0xe9 at column 15); re-encode the file as UTF-8"]
    with pytest.raises(DataError, match="t.jsonl:2: not UTF-8 text"):
        load_records(f)


def test_a_huge_page_is_a_data_error_when_embedded(tmp_path):
    from bigbatch.encoders.image_inputs import load_image  # where pages are opened to embed

    png(tmp_path / "huge.png", 14000, 14000)
    with pytest.raises(DataError, match="huge.png: image too large to open safely"):
        load_image(tmp_path / "huge.png")


def test_clean_for_validate_means_it_loads(folder):
    f = folder / "t.jsonl"
    f.write_text(json.dumps({"query": "q", "chunk_path": "a.png", "neg_chunk_paths": ["b.png"]})
                 + "\n" + json.dumps({"query": "q2", "chunk_path": "neg.txt",
                                      "neg_chunk_paths": ["./a.png"]}) + "\n")
    assert validate_file(f) == (2, [])
    assert len(load_records(f, num_hard_negatives=1)) == 2


def _loaded(path: Path) -> list[tuple]:
    return [(r.query, r.positive, r.negatives) for r in load_records(path, num_hard_negatives=1)]


@pytest.mark.parametrize("name,fmt", [("t.parquet", "st"), ("t_st.jsonl", "st"),
                                      ("t_swift.jsonl", "swift")])
def test_training_reads_every_file_format_validate_accepts(tmp_path, name, fmt):
    from bigbatch.data.formats import Doc, Record, write_records

    recs = [Record(f"q{i}", Doc(text=f"p{i}"), [Doc(text=f"n{i}")], None, i + 1, "")
            for i in range(3)]
    write_records(recs, tmp_path / "seed.jsonl", "contrastors")
    write_records(recs, tmp_path / name, fmt)
    assert validate_file(tmp_path / name) == (3, [])
    assert _loaded(tmp_path / name) == _loaded(tmp_path / "seed.jsonl")


def test_training_reads_swift_page_images_relative_to_the_file(folder):
    f = folder / "pages.jsonl"
    conv = [{"role": "system", "content": "Represent the user's input."},
            {"role": "user", "content": "<image>"}]
    f.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}],
                             "positive_messages": [conv], "positive_images": [["a.png"]],
                             "negative_messages": [conv], "negative_images": [["./b.png"]]}) + "\n")
    assert validate_file(f) == (1, [])
    (rec,) = load_records(f, num_hard_negatives=1)
    assert rec.positive.path == str((folder / "a.png").resolve())
    assert rec.negatives[0].path == str((folder / "b.png").resolve())


def test_a_broken_parquet_file_is_a_data_error(tmp_path):
    f = tmp_path / "t.parquet"
    f.write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match="t.parquet: cannot read as Parquet"):
        load_records(f)
    n, (problem,) = validate_file(f)  # a finding, so validate goes on to the next file
    assert n == 0 and "t.parquet: cannot read as Parquet" in str(problem)


def test_problems_name_the_formats_own_fields(folder):
    """A swift image is named by its *_images entry, an st negative by its column."""
    conv = [{"role": "user", "content": "<image>"}]
    swift = folder / "s.jsonl"
    swift.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}],
                                 "positive_messages": [conv], "positive_images": [["gone.png"]],
                                 "negative_messages": [conv, conv],
                                 "negative_images": [["a.png"], ["bad.png"]]}) + "\n")
    st = folder / "t_st.jsonl"
    st.write_text(json.dumps({"anchor": "q", "positive": "p", "negative_1": "n",
                              "negative_2": "p"}) + "\n")
    for f, fields in ((swift, ["positive_images[0][0]", "negative_images[1][0]"]),
                      (st, ["negative_2"])):
        _, problems = validate_file(f)
        assert [p.field for p in problems] == fields
        with pytest.raises(DataError) as e:
            load_records(f)
        assert all(f"field {x!r}" in str(e.value) for x in fields)
