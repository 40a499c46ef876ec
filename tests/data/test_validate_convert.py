"""bigbatch validate and convert: every finding with its line; round trips between every pair
of formats, image records included, with lossy conversions reported, never silent."""

from __future__ import annotations

import itertools
import json
import struct
import zlib
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data.formats import FORMATS, Doc, Record, read_records, write_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import DataError


def png(path: Path) -> str:
    """A valid 1x1 PNG."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")
    path.write_bytes(raw)
    return path.name


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_each_validator_finding_with_its_line(tmp_path):
    png(tmp_path / "ok.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    f = jsonl(tmp_path / "bad.jsonl", [
        {"query": "fine", "chunk_path": "ok.png", "neg_chunk_paths": ["ok2.png"]},  # 1: missing neg file
        "{broken",                                                                # 2
        {"chunk_path": "ok.png", "neg_chunk_paths": []},                          # 3: no query
        {"query": "  ", "positive": "p", "negatives": ["n"]},                     # 4: empty query
        {"query": "q5", "chunk_path": "broken.png", "neg_chunk_paths": ["ok.png"]},  # 5
        {"query": "q6", "positive": "same", "negatives": ["same"]},               # 6
        {"query": "q6", "positive": "same", "negatives": ["other"]},              # 7: duplicate
        {"query": "q8", "positive": "p8", "negatives": ["a", "b"]},               # 8: count
    ])
    n, problems = validate_file(f)
    found = {(p.line, p.field, p.message.split(" (")[0].split(":")[0]) for p in problems}
    text = "\n".join(str(p) for p in problems)
    assert f"{f}:1, field 'neg_chunk_paths[0]': image file not found" in text
    assert f"{f}:2: malformed JSON" in text
    assert f"{f}:3, field 'query': missing" in text
    assert f"{f}:4, field 'query': must be non-empty text" in text
    assert f"{f}:5, field 'chunk_path': cannot read image" in text
    assert f"{f}:6, field 'negatives[0]': a negative equals the positive" in text
    assert f"{f}:7, field 'query': duplicate query with the same positive (first on line 6)" in text
    assert f"{f}:8, field 'negatives': 2 negatives where the file usually has 1" in text
    assert len(found) == len(problems) == 8


def test_clean_files_pass_and_cli_exit_codes(tmp_path, capsys):
    png(tmp_path / "a.png")
    png(tmp_path / "b.png")
    good = jsonl(tmp_path / "good.jsonl", [
        {"query": "q1", "chunk_path": "a.png", "neg_chunk_paths": ["b.png"]},
        {"query": "q2", "chunk_path": "b.png", "neg_chunk_paths": ["a.png"]}])
    assert validate_file(good) == (2, [])
    assert main(["validate", str(good)]) == 0
    assert "clean: 2 records in 1 file(s), 0 problem(s)" in capsys.readouterr().out
    bad = jsonl(tmp_path / "bad.jsonl", [{"query": "q"}, "{"])
    assert main(["validate", str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "NOT clean: 2 records in 2 file(s), 2 problem(s)" in out
    assert f"{bad}:1, field 'positive'" in out and f"{bad}:2: malformed JSON" in out


def text_records():
    return [Record(f"query {i}", Doc(text=f"positive {i}"),
                   [Doc(text=f"neg {i} {j}") for j in range(2)], None, i + 1, "x")
            for i in range(4)]


def image_records():  # no source: paths are taken as relative to where they are written
    return [Record(f"query {i}", Doc(image=f"pages/p{i}.png"),
                   [Doc(image=f"pages/n{i}{j}.png") for j in range(2)], None, i + 1, "")
            for i in range(3)]


def target(tmp_path: Path, fmt: str, name: str) -> Path:
    return tmp_path / name if fmt == "beir" else tmp_path / f"{name}.jsonl"


def content(records):
    return [(r.query, (r.positive.text, r.positive.image),
             [(d.text, d.image) for d in r.negatives]) for r in records]


@pytest.mark.parametrize("src,dst", list(itertools.permutations(FORMATS, 2)))
def test_round_trip_every_pair_of_formats(tmp_path, src, dst):
    recs = text_records()
    if "beir" in (src, dst):  # BEIR holds no negatives
        recs = [Record(r.query, r.positive, [], None, r.line, r.source) for r in recs]
    a = target(tmp_path, src, "a")
    write_records(recs, a, src)
    back_src, problems = read_records(a, src)
    assert problems == []
    b = target(tmp_path, dst, "b")
    write_records(back_src, b, dst)
    c = target(tmp_path, src, "c")
    mid, problems = read_records(b, dst)
    assert problems == []
    write_records(mid, c, src)
    final, _ = read_records(c, src)
    assert content(final) == content(recs)


@pytest.mark.parametrize("src,dst", [("contrastors", "swift"), ("swift", "contrastors")])
def test_image_records_round_trip(tmp_path, src, dst):
    recs = image_records()
    a, b, c = (tmp_path / f"{n}.jsonl" for n in "abc")
    write_records(recs, a, src)
    write_records(read_records(a, src)[0], b, dst)
    write_records(read_records(b, dst)[0], c, src)
    assert content(read_records(c, src)[0]) == content(recs)
    swift = json.loads((b if dst == "swift" else a).read_text().splitlines()[0])
    assert swift["positive_messages"][0][1]["content"] == "<image>"
    assert swift["positive_images"] == [["pages/p0.png"]]
    assert swift["messages"][0]["content"] == "Retrieve images or text relevant to the user's query."
    assert swift["positive_messages"][0][0]["content"] == "Represent the user's input."


@pytest.mark.parametrize("dst", ["st", "beir"])
def test_what_cannot_be_held_is_reported_never_dropped_silently(tmp_path, dst):
    recs = image_records() + text_records()
    out = target(tmp_path, dst, "out")
    lost = 7 if dst == "beir" else 3
    with pytest.raises(DataError, match=f"{lost} record.s. cannot be written as {dst} without loss"):
        write_records(recs, out, dst)
    if dst == "beir":  # text records still carry negatives BEIR cannot hold
        report = write_records(recs, out, dst, allow_lossy=True)
        assert report["dropped"] == 7 and report["written"] == 0
    else:
        report = write_records(recs, out, dst, allow_lossy=True)
        assert report["dropped"] == 3 and report["written"] == 4
        assert "text documents only" in report["dropped_reasons"][0]


def test_st_parquet_and_cli_convert(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    write_records(text_records(), src, "contrastors")
    pq = tmp_path / "out.parquet"
    assert main(["convert", "--to", "st", str(src), str(pq)]) == 0
    assert "converted 4 records -> 4 written as st" in capsys.readouterr().out
    back, problems = read_records(pq)
    assert problems == [] and content(back) == content(text_records())
    swift = tmp_path / "s.jsonl"
    assert main(["convert", "--from", "st", "--to", "swift", str(pq), str(swift)]) == 0
    assert content(read_records(swift)[0]) == content(text_records())


def _files(records, base: Path) -> list[list[Path]]:
    """Each record's document files, resolved as the readers resolve them."""
    return [[(base / (d.image or d.path)).resolve() for d in (r.positive, *r.negatives)]
            for r in records]


@pytest.mark.parametrize("src,dst", list(itertools.product(["contrastors", "swift"], repeat=2)))
def test_convert_into_another_folder_rebases_relative_paths(tmp_path, src, dst):
    """Paths are relative to the file that holds them: converting data/train.jsonl into out/
    must write paths that still name data/pages/*, so the output validates and trains."""
    from bigbatch.data.records.loader import load_records

    (tmp_path / "data" / "pages").mkdir(parents=True)
    for r in image_records():
        for d in (r.positive, *r.negatives):
            png(tmp_path / "data" / d.image)
    source = tmp_path / "data" / "train.jsonl"
    write_records(image_records(), source, src)
    assert validate_file(source) == (3, [])
    out = tmp_path / "out" / "converted.jsonl"
    assert main(["convert", "--from", src, "--to", dst, str(source), str(out)]) == 0
    assert validate_file(out) == (3, [])
    back, _ = read_records(out)
    assert _files(back, out.parent) == _files(image_records(), tmp_path / "data")
    if dst == "contrastors":
        assert len(load_records(out, num_hard_negatives=2)) == 3


def test_convert_rebases_text_file_paths_and_keeps_absolute_ones(tmp_path):
    from bigbatch.data.records.loader import load_records

    (tmp_path / "data" / "docs").mkdir(parents=True)
    (tmp_path / "data" / "docs" / "p.txt").write_text("the positive passage")
    (tmp_path / "n.txt").write_text("a negative passage")
    source = jsonl(tmp_path / "data" / "train.jsonl", [
        {"query": "q", "chunk_path": "docs/p.txt", "neg_chunk_paths": [str(tmp_path / "n.txt")]}])
    out = tmp_path / "out" / "deeper" / "train.jsonl"
    assert main(["convert", "--to", "contrastors", str(source), str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["neg_chunk_paths"] == [str(tmp_path / "n.txt")]
    assert (out.parent / rec["chunk_path"]).resolve() == tmp_path / "data" / "docs" / "p.txt"
    assert validate_file(out) == (1, [])
    assert load_records(out)[0].positive == "the positive passage"


@pytest.mark.parametrize("name", ["out.parquet", "out.jsonl", "beir_out"])
def test_convert_creates_the_output_folder(tmp_path, name):
    fmt = "beir" if name == "beir_out" else "st"
    recs = [Record(r.query, r.positive, [] if fmt == "beir" else r.negatives, None, r.line, "")
            for r in text_records()]
    out = tmp_path / "new" / "folder" / name
    assert write_records(recs, out, fmt)["written"] == 4
    assert content(read_records(out, fmt)[0]) == content(recs)
