"""render-pages into an existing folder: a page is redrawn when its text or the settings
changed, and reused (not redrawn) when nothing did."""

from __future__ import annotations

import json
from pathlib import Path

from bigbatch.data.tools.pages import render_beir_pages


def _beir(src: Path, text: str) -> Path:
    (src / "qrels").mkdir(parents=True, exist_ok=True)
    (src / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "T", "text": text}) + "\n")
    (src / "queries.jsonl").write_text(json.dumps({"_id": "q1", "text": "q"}) + "\n")
    (src / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return src


def test_pages_are_redrawn_when_text_or_settings_change(tmp_path, monkeypatch):
    from PIL import Image

    import bigbatch.data.tools.pages as pages

    drawn = []
    real = pages.render_page
    monkeypatch.setattr(pages, "render_page", lambda *a: drawn.append(a) or real(*a))
    src, out = _beir(tmp_path / "src", "old text"), tmp_path / "out"
    page = out / "images" / "d1.png"
    render_beir_pages(src, out, size=(448, 448), progress=False)
    render_beir_pages(src, out, size=(224, 224), progress=False)        # new size
    assert Image.open(page).size == (224, 224) and len(drawn) == 2
    _beir(src, "a completely different text")                            # new text
    render_beir_pages(src, out, size=(224, 224), progress=False)
    assert len(drawn) == 3 and drawn[-1][1] == "a completely different text"
    render_beir_pages(src, out, size=(224, 224), progress=False)        # nothing changed
    assert len(drawn) == 3
    render_beir_pages(src, out, size=(224, 224), font_size=9, progress=False)
    assert len(drawn) == 4
    page.unlink()                                                        # a page went missing
    render_beir_pages(src, out, size=(224, 224), font_size=9, progress=False)
    assert len(drawn) == 5 and page.exists()


def test_bad_query_lines_and_missing_queries_are_errors(tmp_path):
    """They were skipped silently, leaving qrels that name queries the output lacks."""
    import pytest

    from bigbatch.errors import DataError

    src = _beir(tmp_path / "src", "text")
    (src / "queries.jsonl").write_text('{"_id": "q1", "text": "q"}\n{"text": "no id"}\n')
    with pytest.raises(DataError, match=r"queries.jsonl:2, field '_id': missing key"):
        render_beir_pages(src, tmp_path / "out", progress=False)
    (src / "queries.jsonl").write_text('{"_id": "q2", "text": "another"}\n')
    with pytest.raises(DataError, match="1 query ids of the qrels are not in queries.jsonl"):
        render_beir_pages(src, tmp_path / "out", progress=False)


def test_trec_qrels_are_read_as_eval_reads_them(tmp_path):
    """MS MARCO's 4-column qrels (``qid 0 pid rel``, no header) were read as document "0"
    with the pid as its relevance: now the pages of the right documents are rendered, the
    output's qrels in BEIR's columns; a malformed file is an error naming its line."""
    import pytest

    from bigbatch.errors import DataError

    src = _beir(tmp_path / "src", "text")
    with open(src / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "0", "title": "", "text": "a decoy"}) + "\n")
    (src / "qrels" / "train.tsv").write_text("q1\t0\td1\t1\n")
    render_beir_pages(src, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    assert (out / "qrels" / "train.tsv").read_text().splitlines()[1:] == ["q1\td1\t1"]
    assert [json.loads(line)["_id"] for line in (out / "corpus.jsonl").read_text().splitlines()
            ][0] == "d1"
    (src / "qrels" / "train.tsv").write_text("q1\td1\t0.5\n")
    with pytest.raises(DataError, match=r"train.tsv:1, field 'score': score '0.5' is not an "
                                        r"integer"):
        render_beir_pages(src, tmp_path / "out2", progress=False)
