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
