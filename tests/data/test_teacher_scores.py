"""Teacher scores in the data (pos_score, neg_scores): read by every format that holds them,
kept by convert, checked by validate (file, line, field), aligned with sampled negatives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data import EpochBatches
from bigbatch.data.formats import read_records, write_records
from bigbatch.data.records.loader import check_teacher_scores, load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import DataError


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


ROWS = [{"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}a", f"n{i}b", f"n{i}c"],
         "pos_score": 0.9 - i / 100, "neg_scores": [0.5 + i / 100, 0.25, -0.125]}
        for i in range(4)]


def scores_of(records):
    return [(r.positive.score, [d.score for d in r.negatives]) for r in records]


@pytest.mark.parametrize("route", [("st", ".jsonl"), ("st", ".parquet"), ("st", ".csv"),
                                   ("swift", ".jsonl"), ("contrastors", ".jsonl")])
def test_convert_keeps_the_scores_through_every_format(tmp_path, route):
    src = jsonl(tmp_path / "src.jsonl", ROWS)
    fmt, suffix = route
    mid = tmp_path / f"mid{suffix}"
    assert main(["convert", "--to", fmt, str(src), str(mid)]) == 0
    back = tmp_path / "back.jsonl"
    assert main(["convert", "--to", "contrastors", str(mid), str(back)]) == 0
    want = [(r["pos_score"], r["neg_scores"]) for r in ROWS]
    for path in (mid, back):
        records, problems = read_records(path)
        assert problems == []
        assert scores_of(records) == want, path
        assert validate_file(path)[1] == []


def test_records_without_scores_convert_as_before(tmp_path):
    src = jsonl(tmp_path / "src.jsonl", [{k: v for k, v in r.items() if "score" not in k}
                                         for r in ROWS])
    out = tmp_path / "out.jsonl"
    assert main(["convert", "--to", "st", str(src), str(out)]) == 0
    assert "score" not in out.read_text()


def test_beir_cannot_hold_scores(tmp_path):
    records, _ = read_records(jsonl(tmp_path / "src.jsonl", [
        {"query": "q", "positive": "p", "pos_score": 0.5, "neg_scores": []}]))
    with pytest.raises(DataError, match="teacher scores"):
        write_records(records, tmp_path / "beir", "beir")


BAD = [
    ({"neg_scores": [0.1, 0.2]}, "neg_scores", "2 teacher score(s) for 3 negative(s)"),
    ({"neg_scores": [0.1, float("nan"), 0.3]}, "neg_scores[1]", "nan is not a finite number"),
    ({"neg_scores": [0.1, "high", 0.3]}, "neg_scores[1]", "must be a number"),
    ({"pos_score": None}, "pos_score", "missing, but neg_scores is given"),
    ({"pos_score": float("inf")}, "pos_score", "inf is not a finite number"),
    ({"neg_scores": 0.3}, "neg_scores", "must be a list of numbers"),
]


@pytest.mark.parametrize("change, field, text", BAD)
@pytest.mark.parametrize("fmt", ["contrastors", "swift"])
def test_validate_names_file_line_and_field_of_a_bad_score(tmp_path, change, field, text, fmt):
    rows = [dict(r) for r in ROWS]
    rows[2].update(change)
    rows = [{k: v for k, v in r.items() if v is not None} for r in rows]
    src = jsonl(tmp_path / "src.jsonl", rows)  # json.dumps writes NaN and Infinity
    if fmt == "swift":
        records, _ = read_records(jsonl(tmp_path / "ok.jsonl", ROWS))
        write_records(records, tmp_path / "sw.jsonl", "swift")
        sw = [json.loads(line) for line in (tmp_path / "sw.jsonl").read_text().splitlines()]
        for r, row in zip(sw, rows):
            r.pop("pos_score"), r.pop("neg_scores")
            r.update({k: v for k, v in row.items() if "score" in k})
        src = jsonl(tmp_path / "src.jsonl", sw)
    _, problems = validate_file(src)
    assert [(p.line, p.field) for p in problems] == [(3, field)], problems
    assert text in str(problems[0]) and f"{src}:3" in str(problems[0])
    with pytest.raises(DataError, match=f"{src}:3"):  # training stops before any step
        load_records(src, num_hard_negatives=3)


def test_st_columns_count_must_match(tmp_path):
    src = jsonl(tmp_path / "st.jsonl", [
        {"anchor": "q", "positive": "p", "negative_1": "a", "negative_2": "b",
         "pos_score": 0.9, "neg_score_1": 0.3}])
    _, problems = validate_file(src)
    assert len(problems) == 1 and "1 teacher score(s) for 2 negative(s)" in str(problems[0])
    assert f"{src}:1" in str(problems[0])


def test_distillation_needs_scores_on_every_record(tmp_path):
    rows = [dict(r) for r in ROWS]
    del rows[1]["pos_score"], rows[1]["neg_scores"]
    records = load_records(jsonl(tmp_path / "src.jsonl", rows), num_hard_negatives=2)
    with pytest.raises(DataError, match=r"src.jsonl, field 'pos_score': 1 record\(s\) have no "
                                        r"teacher scores \(lines 2\)"):
        check_teacher_scores(records)


def test_batches_carry_the_scores_of_the_sampled_negatives(tmp_path):
    """k = 2 of 3 negatives sampled per epoch: each score row follows the documents drawn."""
    records = load_records(jsonl(tmp_path / "src.jsonl", ROWS), num_hard_negatives=2)
    score = {}
    for r in ROWS:
        score[r["positive"]] = r["pos_score"]
        score.update(zip(r["negatives"], r["neg_scores"]))
    plain = EpochBatches(records, 2, 2, seed=3)
    batches = EpochBatches(records, 2, 2, seed=3, scores=True)
    drawn = set()
    for epoch in range(4):
        for index in range(len(batches)):
            b = batches.batch(epoch, index)
            assert b.docs == plain.batch(epoch, index).docs  # the same negatives as before
            assert b.teacher_scores == [[score[d] for d in b.docs[i * 3:(i + 1) * 3]]
                                        for i in range(2)]
            drawn.update(b.docs)
    assert len(drawn) > 8  # different negatives were sampled over the epochs
    assert plain.batch(0, 0).teacher_scores is None


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_tables_need_scores_in_every_record_or_none(tmp_path, suffix):
    rows = [dict(r) for r in ROWS]
    del rows[1]["pos_score"], rows[1]["neg_scores"]
    records, _ = read_records(jsonl(tmp_path / "src.jsonl", rows))
    with pytest.raises(DataError, match=r"src.jsonl:2 has none\); table columns need them"):
        write_records(records, tmp_path / f"out{suffix}", "st")
