"""Every input gets a clear answer: bad data is a bigbatch error (or a validate finding) that
names the file, the line and the field, never a clean report, a wrong metric, a traceback
from deep inside a library, a hang or an exhausted memory. docs/bad-inputs.md lists every
bad input the suite tries."""

from __future__ import annotations

import csv
import json
import os
import re
import threading
from pathlib import Path

import pytest
import torch

from bigbatch.cli import main
from bigbatch.data.readers.beir_dir import beir_training_records, load_beir
from bigbatch.data.records.image_checks import check_image
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import ConfigError, DataError
from bigbatch.retrieval.evaluate import evaluate_beir


def jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def beir(root: Path, docs, queries, qrels, split: str = "train") -> Path:
    """A BEIR directory; ``docs`` and ``queries`` are lists of JSON objects (or raw lines)."""
    jsonl(root / "corpus.jsonl", docs)
    jsonl(root / "queries.jsonl", queries)
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    with open(root / "qrels" / f"{split}.tsv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["query-id", "corpus-id", "score"])
        w.writerows(qrels)
    return root


def image(path: Path, size: tuple[int, int]) -> Path:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, "white").save(path)
    return path


def finishes(fn, seconds: float = 20.0):
    """``fn()``'s result, or a test failure when it has not returned within ``seconds`` (a
    daemon thread: a hang fails the test instead of blocking the suite)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s (it hangs)"
    if "error" in out:
        raise out["error"]
    return out["value"]


class OneHotEncoder:
    """Embeds each distinct text as its own axis; a query shares its document's axis."""

    def __init__(self, pairs: dict[str, str]) -> None:
        self.axis: dict[str, int] = {}
        self.pairs = pairs  # query text -> the text of its document

    def encode(self, texts, kind="doc", **kw):
        rows = []
        for t in texts:
            t = self.pairs.get(t, t) if kind == "query" else t
            rows.append(self.axis.setdefault(t, len(self.axis)))
        return torch.nn.functional.one_hot(torch.tensor(rows), 64).float()


# 4. a duplicate _id in a BEIR corpus ------------------------------------------------------

def test_duplicate_corpus_id_is_an_error_not_a_recall_above_one(tmp_path):
    """d1 twice gave recall@10 and nDCG@10 above 1, and validate called the set clean."""
    docs = [{"_id": "d1", "title": "", "text": "alpha"}, {"_id": "d2", "title": "", "text": "beta"},
            {"_id": "d1", "title": "", "text": "alpha"}]
    root = beir(tmp_path / "b", docs, [{"_id": "q1", "text": "find alpha"}], [("q1", "d1", 1)])
    where = f"{root / 'corpus.jsonl'}:3, field '_id': duplicate id 'd1' (first on line 1)"
    _, problems = validate_file(root)
    assert len(problems) == 1 and str(problems[0]).startswith(where)
    assert main(["validate", str(root)]) == 1
    for load in (lambda: load_beir(root, "train"), lambda: load_records(root)):
        with pytest.raises(DataError, match=re.escape(where)):
            load()
    with pytest.raises(DataError, match=re.escape(where)):  # the evaluation path
        evaluate_beir(OneHotEncoder({"find alpha": "alpha"}), root, "train", unseen_from=None,
                      progress=False)


# 5. an image the vision-language processors refuse ------------------------------------------

def test_an_image_the_vl_processors_refuse_is_found_before_training(tmp_path):
    """An 8000x20 page was clean, then stopped a Qwen3-VL run at step 1 with transformers'
    "absolute aspect ratio must be smaller than 200", naming no file or line."""
    image(tmp_path / "wide.png", (8000, 20))
    image(tmp_path / "ok.png", (64, 64))
    f = jsonl(tmp_path / "t.jsonl", [{"query": "q", "chunk_path": "wide.png",
                                      "neg_chunk_paths": ["ok.png"]}])
    _, problems = validate_file(f)
    assert [(p.line, p.field) for p in problems] == [(1, "chunk_path")]
    assert "8000x20 pixels, an aspect ratio of 400:1" in problems[0].message
    with pytest.raises(DataError, match=re.escape(f"{f}:1, field 'chunk_path': image")):
        load_records(f)


@pytest.mark.parametrize("size", [(8000, 20), (20, 4000), (20, 4001), (1, 1), (1, 200), (3, 5)])
def test_the_image_check_accepts_what_the_qwen_vl_processor_accepts(tmp_path, size):
    """check_image agrees with transformers' Qwen2-VL image processor (smart_resize: aspect
    ratio at most 200; no minimum side, small images are scaled up)."""
    pil = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    path = image(tmp_path / "p.png", size)
    proc = pil.Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2)
    from PIL import Image

    try:
        proc(images=[Image.open(path).convert("RGB")], return_tensors="pt",
             size={"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32})
        accepted = True
    except ValueError:
        accepted = False
    assert (check_image(path) is None) == accepted


# 6. files that are not regular, or too large -------------------------------------------------

def test_document_files_must_be_regular_files_of_bounded_size(tmp_path):
    """chunk_path /dev/zero read without limit (MemoryError); a FIFO hung validate."""
    os.mkfifo(tmp_path / "pipe.txt")
    os.mkfifo(tmp_path / "pipe.png")
    with open(tmp_path / "big.txt", "wb") as f:  # sparse: 9 MiB of NUL bytes, over the limit
        f.truncate(9 * 2**20)
    (tmp_path / "fine.txt").write_text("a passage")
    f = jsonl(tmp_path / "t.jsonl", [
        {"query": "q1", "chunk_path": "/dev/zero", "neg_chunk_paths": ["fine.txt"]},
        {"query": "q2", "chunk_path": "pipe.txt", "neg_chunk_paths": ["fine.txt"]},
        {"query": "q3", "chunk_path": "pipe.png", "neg_chunk_paths": ["fine.txt"]},
        {"query": "q4", "chunk_path": "big.txt", "neg_chunk_paths": ["fine.txt"]},
        {"query": "q5", "chunk_path": str(tmp_path), "neg_chunk_paths": ["fine.txt"]}])
    _, problems = finishes(lambda: validate_file(f))
    text = "\n".join(map(str, problems))
    assert [(p.line, p.field) for p in problems] == [(n, "chunk_path") for n in range(1, 6)]
    assert f"{f}:1, field 'chunk_path': cannot read '/dev/zero': is a character device" in text
    assert f"{f}:2, field 'chunk_path': cannot read 'pipe.txt'" in text and "FIFO" in text
    assert f"{f}:3, field 'chunk_path': cannot read image" in text
    assert "is 9 MiB, over the 8 MiB bigbatch reads of a text document" in text
    assert "is a folder, not a regular file" in text
    with pytest.raises(DataError, match="5 problem"):
        finishes(lambda: load_records(f))


def test_a_data_file_that_is_a_fifo_or_a_device_is_refused(tmp_path):
    os.mkfifo(tmp_path / "data.jsonl")
    os.mkfifo(tmp_path / "data.parquet")
    for path in (tmp_path / "data.jsonl", tmp_path / "data.parquet", Path("/dev/zero")):
        for fmt in (None, "contrastors"):
            _, problems = finishes(lambda: validate_file(path, fmt))
            assert len(problems) == 1 and "not a regular file" in str(problems[0])
        with pytest.raises(DataError, match="not a regular file"):
            finishes(lambda: load_records(path))
    from bigbatch.data.records.store import open_records

    for path in (tmp_path / "data.jsonl", tmp_path / "data.parquet"):  # (read by index)
        with pytest.raises(DataError, match="FIFO .*not a regular file"):
            finishes(lambda: open_records(path, cache_dir=tmp_path / "cache"))


# 7. BEIR texts by the rules of the JSONL records ---------------------------------------------

def test_beir_texts_are_checked_as_jsonl_records_are(tmp_path):
    """An empty query text trained; a corpus "text": null passed validate and train and was
    refused only by eval."""
    docs = [{"_id": "d1", "title": "", "text": None}, {"_id": "d2", "title": "", "text": "beta"},
            {"_id": "d3", "title": None, "text": "gamma"}, {"_id": "d4", "title": "", "text": ""}]
    queries = [{"_id": "q1", "text": ""}, {"_id": "q2", "text": "b?"}, {"_id": "q3", "text": "c?"},
               {"_id": "q4", "text": "d?"}, {"_id": "q5", "text": 7}]
    root = beir(tmp_path / "b", docs, queries, [("q1", "d2", 1), ("q2", "d1", 1), ("q3", "d3", 1),
                                                ("q4", "d4", 1)])
    corpus, qfile = root / "corpus.jsonl", root / "queries.jsonl"
    expected = [f"{corpus}:1, field 'text': must be text, not null",
                f"{corpus}:4, field 'text': must be non-empty text: document 'd4'",
                f"{qfile}:1, field 'text': must be non-empty text",
                f"{qfile}:5, field 'text': must be text, not int"]
    n, problems = validate_file(root)
    assert n == 1 and len(problems) == 4  # q3-d3: a null title is no title
    text = "\n".join(map(str, problems))
    assert all(e in text for e in expected), text
    with pytest.raises(DataError, match="4 problem") as e:
        load_records(root)
    assert all(x in str(e.value) for x in expected)


# confinement to a data root ------------------------------------------------------------------

def test_data_root_confines_the_files_data_may_name(tmp_path):
    """By default data names any file the user can read (as the seed pipeline); with a data
    root, a path resolving outside it (.., an absolute path, a symbolic link) is refused."""
    (tmp_path / "secret.txt").write_text("not for training")
    data = tmp_path / "data"
    (data / "docs").mkdir(parents=True)
    (data / "docs" / "p.txt").write_text("a passage")
    os.symlink(tmp_path / "secret.txt", data / "docs" / "link.txt")
    f = jsonl(data / "t.jsonl", [
        {"query": "q1", "chunk_path": "docs/p.txt", "neg_chunk_paths": ["../secret.txt"]},
        {"query": "q2", "chunk_path": str(tmp_path / "secret.txt"),
         "neg_chunk_paths": ["docs/p.txt"]},
        {"query": "q3", "chunk_path": "docs/link.txt", "neg_chunk_paths": ["docs/p.txt"]}])
    assert validate_file(f) == (3, [])  # the default: the user's own paths
    _, problems = validate_file(f, data_root=data)
    assert [(p.line, p.field) for p in problems] == [(1, "neg_chunk_paths[0]"),
                                                     (2, "chunk_path"), (3, "chunk_path")]
    assert all("outside the data root" in p.message for p in problems)
    with pytest.raises(DataError, match="outside the data root"):
        load_records(f, data_root=data)
    assert len(load_records(f, data_root=tmp_path)) == 3
    assert main(["validate", "--data-root", str(data), str(f)]) == 1
    assert main(["convert", "--to", "contrastors", "--data-root", str(data), str(f),
                 str(tmp_path / "out.jsonl")]) == 2
    with pytest.raises(ConfigError, match="--data-root: '.*nowhere' is not a folder"):
        load_records(f, data_root=tmp_path / "nowhere")
    from bigbatch.train.config import TrainConfig

    assert TrainConfig().data_root is None  # --data-root of bigbatch train


def test_data_root_confines_beir_page_images(tmp_path):
    image(tmp_path / "outside.png", (32, 32))
    root = beir(tmp_path / "data" / "b", [{"_id": "d1", "text": "", "image": "../../outside.png"}],
                [{"_id": "q1", "text": "q"}], [("q1", "d1", 1)])
    assert len(beir_training_records(root)) == 1
    with pytest.raises(DataError, match=re.escape(f"{root / 'corpus.jsonl'}:1, field 'image'")):
        beir_training_records(root, data_root=tmp_path / "data")


# the weak cases, one table -------------------------------------------------------------------

def _all_zero_qrels(tmp: Path) -> list[str]:
    root = beir(tmp / "b", [{"_id": "d1", "text": "a"}], [{"_id": "q1", "text": "q"}],
                [("q1", "d1", 0)])
    return ["validate", str(root)]


def _empty_contrastors(tmp: Path) -> list[str]:
    (tmp / "empty.jsonl").write_text("")
    return ["validate", "--format", "contrastors", str(tmp / "empty.jsonl")]


def _malformed_json(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", [{"query": "q", "positive": "p"}, '{"query": "q2" "positive": "p"}'])
    return ["validate", str(tmp / "t.jsonl")]


def _malformed_first_line_convert(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", ['{"query": "q",, "positive": "p"}'])
    return ["convert", "--to", "swift", str(tmp / "t.jsonl"), str(tmp / "o.jsonl")]


def _count_broken_by_other_lines(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", [{"query": "q1", "positive": "p1", "negatives": ["a", ""]},
                            {"query": "q2", "positive": "p2", "negatives": ["b", None]},
                            {"query": "q3", "positive": "p3", "negatives": ["c", "d"]}])
    return ["validate", str(tmp / "t.jsonl")]


def _count_differs(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", [{"query": "q1", "positive": "p1", "negatives": ["a"]},
                            {"query": "q2", "positive": "p2", "negatives": ["b"]},
                            {"query": "q3", "positive": "p3", "negatives": ["c", "d"]}])
    return ["validate", str(tmp / "t.jsonl")]


def _missing_middle_file(tmp: Path) -> list[str]:
    jsonl(tmp / "a.jsonl", [{"query": "q", "positive": "p"}])
    jsonl(tmp / "c.jsonl", [{"query": "q", "positive": ""}])
    return ["validate", str(tmp / "a.jsonl"), str(tmp / "b.jsonl"), str(tmp / "c.jsonl")]


def _positional_keys(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", [{"q": "hello", "pos": "world"}, {"q": "only"},
                            {"q": "hello", "pos": "world"}])
    return ["validate", str(tmp / "t.jsonl")]


def _xlsx_output(tmp: Path) -> list[str]:
    jsonl(tmp / "t.jsonl", [{"query": "q", "positive": "p"}])
    return ["convert", "--to", "contrastors", str(tmp / "t.jsonl"), str(tmp / "out.xlsx")]


def _unseen_from_missing_split(tmp: Path) -> list[str]:
    root = beir(tmp / "b", [{"_id": "d1", "text": "a"}], [{"_id": "q1", "text": "q"}],
                [("q1", "d1", 1)], split="test")
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
    return ["eval", "--model", str(tmp / "no-model"), "--data", str(root), "--unseen-from", "dev"]


# (case, argv builder, exit code, what the output must hold, what it must not: regexes)
WEAK_CASES = [
    ("qrels whose scores are all 0", _all_zero_qrels, 1,
     r"qrels/train.tsv, field 'score': no relevant judgement \(score > 0\) among 1 query: "
     r"nothing to train on", r"^clean"),
    ("an empty file under --format contrastors", _empty_contrastors, 1,
     r"empty.jsonl: no records \(read as contrastors\): nothing to train on", r"^clean"),
    ("malformed JSON keeps line and column", _malformed_json, 1,
     r"t.jsonl:2: malformed JSON at column 16 \(Expecting ',' delimiter\)", None),
    ("a malformed first line (format detection) keeps line and column",
     _malformed_first_line_convert, 2,
     r"t.jsonl:1: cannot tell the format: malformed JSON at column 15", None),
    ("a valid line is not flagged for a count other lines break", _count_broken_by_other_lines,
     1, r"t.jsonl:1, field 'negatives\[1\]': must be non-empty text", r"t.jsonl:3"),
    ("a differing negative count names the lines with the usual one", _count_differs, 1,
     r"t.jsonl:3, field 'negatives': 2 negatives where the file usually has 1 \(2 record\(s\): "
     r"lines 1, 2\)", None),
    ("validate a b c with b missing checks c too", _missing_middle_file, 1,
     r"b.jsonl: not found(.|\n)*c.jsonl:1, field 'positive': must be non-empty text", None),
    ("positional st columns are reported by their own keys", _positional_keys, 1,
     r"t.jsonl:2: one column 'q' read by position(.|\n)*t.jsonl:3, field 'q': duplicate query",
     r"field 'anchor'"),
    ("an output suffix the format does not write", _xlsx_output, 2,
     r"out.xlsx: contrastors is written as .jsonl, not .xlsx", None),
    ("--unseen-from a split without qrels", _unseen_from_missing_split, 2,
     r"--unseen-from 'dev': there is no qrels/dev.tsv \(splits there: test, train\)", None),
]


@pytest.mark.parametrize("case,build,code,expected,absent", WEAK_CASES,
                         ids=[c[0] for c in WEAK_CASES])
def test_weak_cases_get_a_clear_answer(tmp_path, capsys, case, build, code, expected, absent):
    argv = build(tmp_path)
    assert main(argv) == code
    out = capsys.readouterr()
    printed = out.out + out.err
    assert re.search(expected, printed), printed
    assert absent is None or not re.search(absent, printed, re.MULTILINE), printed
    assert not (tmp_path / "out.xlsx").exists()  # nothing written under a wrong suffix
