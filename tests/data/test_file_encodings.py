"""Files as editors and other tools write them: a UTF-8 byte-order mark, CRLF line endings,
non-ASCII text. They read as the same records as a plain UTF-8 file."""

from __future__ import annotations

import json

import pytest

from bigbatch.data.formats import read_records
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file


@pytest.mark.parametrize("bom,newline", [(True, "\r\n"), (True, "\n"), (False, "\r\n")])
@pytest.mark.parametrize("fmt", ["contrastors", "swift", "st"])
def test_bom_and_crlf_read_like_plain_utf8(tmp_path, bom, newline, fmt):
    recs = {
        "contrastors": [{"query": "wie hoch ist der Eiffelturm? 🗼", "positive": "330 m.",
                         "negatives": ["東京タワー"]}, {"query": "q2", "positive": "p2",
                                                     "negatives": ["n2"]}],
        "swift": [{"messages": [{"role": "user", "content": "wie hoch? 🗼"}],
                   "positive_messages": [[{"role": "user", "content": "330 m."}]],
                   "negative_messages": [[{"role": "user", "content": "東京タワー"}]]},
                  {"messages": [{"role": "user", "content": "q2"}],
                   "positive_messages": [[{"role": "user", "content": "p2"}]],
                   "negative_messages": [[{"role": "user", "content": "n2"}]]}],
        "st": [{"anchor": "wie hoch? 🗼", "positive": "330 m.", "negative": "東京タワー"},
               {"anchor": "q2", "positive": "p2", "negative": "n2"}],
    }[fmt]
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs),
                     encoding="utf-8")
    odd = tmp_path / "odd.jsonl"
    odd.write_bytes((b"\xef\xbb\xbf" if bom else b"") + "".join(
        json.dumps(r, ensure_ascii=False) + newline for r in recs).encode("utf-8"))
    expected, problems = read_records(plain)
    assert problems == []
    got, problems = read_records(odd)  # format detected through the mark
    assert problems == [] and [(r.query, r.positive, r.negatives) for r in got] == \
        [(r.query, r.positive, r.negatives) for r in expected]
    assert validate_file(odd) == (2, [])
    assert [r.query for r in load_records(odd)] == [r.query for r in expected]


def test_a_mark_in_the_middle_of_concatenated_files_is_skipped(tmp_path):
    line = json.dumps({"query": "q", "positive": "p"}).encode()
    path = tmp_path / "cat.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + line + b"\n" + b"\xef\xbb\xbf" +
                     json.dumps({"query": "q2", "positive": "p2"}).encode() + b"\n")
    records, problems = read_records(path)
    assert problems == [] and [r.query for r in records] == ["q", "q2"]
