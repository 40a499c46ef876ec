"""Reading ms-swift files keeps what a record can hold (an image document's text, ids) and
reports what it cannot (a query image, several images in a document, images without an
<image> tag): convert stops, or drops and counts the record with --allow-lossy, and validate
and training report it. Nothing is lost silently."""

from __future__ import annotations

import json
import re
import struct
import zlib
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data.formats import read_records, write_records
from bigbatch.data.records.image_checks import ImageDoc
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import DataError


def png(path: Path) -> None:
    """A valid 1x1 PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def conv(content: str, system: str = "Represent the user's input.") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def swift_line(query: str = "what is this?", positive: str = "<image>Figure 3 caption",
               positive_images=(["p.png"],), **extra) -> dict:
    rec = {"messages": conv(query, "Find the chart."), "positive_messages": [conv(positive)],
           "positive_images": list(positive_images), "negative_messages": [conv("<image>")],
           "negative_images": [["n.png"]]}
    rec.update(extra)
    return rec


def write_swift(path: Path, *recs: dict) -> Path:
    png(path.parent / "p.png")
    png(path.parent / "n.png")
    png(path.parent / "q.png")
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_an_image_document_keeps_its_text(tmp_path):
    src = write_swift(tmp_path / "s.jsonl", swift_line())
    (rec,), problems = read_records(src)
    assert problems == [] and (rec.positive.image, rec.positive.text) == ("p.png", "Figure 3 caption")
    assert validate_file(src) == (1, [])
    (train,) = load_records(src, num_hard_negatives=1)
    assert train.positive == ImageDoc(str(tmp_path / "p.png"), "Figure 3 caption")
    assert train.negatives == [ImageDoc(str(tmp_path / "n.png"), "")]
    out = tmp_path / "back.jsonl"
    assert write_records([rec], out, "swift")["written"] == 1
    back = json.loads(out.read_text())
    assert back["positive_messages"][0][1]["content"] == "<image>Figure 3 caption"
    assert back["positive_images"] == [["p.png"]]
    with pytest.raises(DataError, match="contrastors holds no text beside an image"):
        write_records([rec], tmp_path / "c.jsonl", "contrastors")
    report = write_records([rec], tmp_path / "c.jsonl", "contrastors", allow_lossy=True)
    assert (report["written"], report["dropped"]) == (0, 1)


@pytest.mark.parametrize("case,field,what", [
    ("query image", "images", "an image in the query (queries are text)"),
    ("query tag", "messages", "an image in the query (queries are text)"),
    ("images without a tag", "positive_images[0]", "1 image(s) without an <image> tag"),
    ("two images", "positive_images[0]", "2 images in one document"),
    ("text before the image", "positive_messages[0]", "text before <image>"),
])
def test_what_a_record_cannot_hold_is_reported(tmp_path, capsys, case, field, what):
    rec = {"query image": swift_line(images=["q.png"], query="<image>what is this?"),
           "query tag": swift_line(query="<image>what is this?"),
           "images without a tag": swift_line(positive="a caption"),
           "two images": swift_line(positive="<image><image>", positive_images=[["p.png", "q.png"]]),
           "text before the image": swift_line(positive="Figure 3: <image>"),
           }[case]
    src = write_swift(tmp_path / "s.jsonl", rec, swift_line(query="a second query"))
    n, problems = validate_file(src)
    assert n == 2 and [(p.line, p.field) for p in problems] == [(1, field)]
    assert problems[0].message.startswith(what) and "--allow-lossy" in problems[0].message
    with pytest.raises(DataError, match=re.escape(f"s.jsonl:1, field '{field}'")):
        load_records(src)
    out = tmp_path / "out.jsonl"
    assert main(["convert", "--to", "swift", str(src), str(out)]) == 2
    assert "1 record(s) cannot be written as swift without loss" in capsys.readouterr().err
    assert main(["convert", "--to", "swift", "--allow-lossy", str(src), str(out)]) == 0
    assert "2 records -> 1 written as swift" in capsys.readouterr().out
    assert validate_file(out) == (1, [])


def test_ids_survive_a_round_trip_through_swift(tmp_path):
    mined = tmp_path / "mined.jsonl"
    mined.write_text(json.dumps({"query": "q", "positive": "p", "negatives": ["n1", "n2"],
                                 "query_id": "7", "positive_id": "d1",
                                 "negative_ids": ["d2", "d3"]}) + "\n")
    write_records(read_records(mined)[0], tmp_path / "s.jsonl", "swift")
    write_records(read_records(tmp_path / "s.jsonl")[0], tmp_path / "back.jsonl", "contrastors")
    assert json.loads((tmp_path / "back.jsonl").read_text()) == json.loads(mined.read_text())


def test_null_image_lists_of_text_documents_are_fine(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text(json.dumps({"messages": conv("q"), "positive_messages": [conv("text")],
                               "positive_images": [None], "negative_messages": [conv("neg")],
                               "negative_images": [None]}) + "\n")
    assert validate_file(src) == (1, [])
