"""Readers fuzzed until every failure is a bigbatch error (issue 29, item 6).

Property-based tests (hypothesis) generate malformed JSONL training files, BEIR folders,
qrels, Parquet tables and YAML configurations, and assert that every outcome is a set of
records (or findings, for ``validate``) or a :mod:`bigbatch.errors` error that names the
file: never another exception, never a hang (each case runs under an alarm), and within a
deadline per case. The examples are derandomized (the same cases on every run) and the
number run is counted and printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from bigbatch.data.readers.beir_dir import load_beir, load_qrels, read_beir
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import BigBatchError

CASES: Counter = Counter()  # cases run, by reader
CASE_SECONDS = 20  # a case still running after this is a hang

FUZZ = settings(max_examples=120, deadline=timedelta(seconds=5), derandomize=True,
                database=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])


@contextlib.contextmanager
def bounded(seconds: int = CASE_SECONDS):
    """Fail a case that has not finished within ``seconds`` (a hang), by SIGALRM."""
    def hang(signum, frame):
        raise AssertionError(f"still running after {seconds} s: it hangs")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def outcome(fn, names: str | Path, *more: str | Path):
    """``fn()``'s result, or the bigbatch error it raised, which must name the file (one of
    ``names``' paths or file names); any other exception fails the case."""
    with bounded():
        try:
            return fn()
        except BigBatchError as e:
            text = str(e)
            wanted = [str(n) for n in (names, *more)] + [Path(n).name for n in (names, *more)]
            assert any(w in text for w in wanted), f"error names no file: {text[:500]}"
            return e


# ---------------------------------------------------------------- values that go wrong
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12) | \
    st.sampled_from(["", " ", "\x00", "\ud800", "a\tb", "..", "/dev/zero", "~", "x" * 300,
                     "img.png", "nofile.txt", "\u202e", "null"])
LEAF = st.none() | st.booleans() | st.integers(-3, 2**70) | \
    st.floats(allow_nan=True, allow_infinity=True) | TEXT
VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) |
                     st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
KEYS = st.sampled_from(["query", "positive", "negatives", "chunk_path", "neg_chunk_paths",
                        "messages", "positive_messages", "negative_messages", "anchor",
                        "negative", "pos_score", "neg_scores", "_id", "text", "title",
                        "query_id", "positive_id", "images", "role", "content", "system"])
RECORD = st.dictionaries(KEYS, VALUE, max_size=6)
GOOD = st.builds(lambda q, p: {"query": q, "positive": p}, TEXT, TEXT)


def _line(item) -> bytes:
    if isinstance(item, bytes):
        return item
    return json.dumps(item, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


RAW_LINE = st.sampled_from([b"{", b"[1, 2]", b"\xff\xfe garbage", b"\xef\xbb\xbf{}", b"nul\x00l",
                            b"{\"query\": \"a\\ud800\"}", b"[" * 2500 + b"]" * 2500, b"   ",
                            b"{\"query\": 1e999}", b'{"a": NaN}', b"\x1f\x8b\x08\x00"])
JSONL = st.lists(RECORD.map(_line) | GOOD.map(_line) | RAW_LINE, max_size=8)


def _write(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------- JSONL training files
@FUZZ
@given(lines=JSONL, fmt=st.sampled_from([None, "contrastors", "swift", "st"]))
# what the fuzzing found (each a traceback before its fix): JSON nested 2,500 deep (a
# RecursionError in the reader and in format detection), swift negatives that are no list
@example(lines=[b"[" * 2500 + b"]" * 2500], fmt=None)
@example(lines=[b'{"query": null, "positive": null, "negatives": null, "negative_messages": 1}'],
         fmt="swift")
def test_fuzzed_jsonl_gives_records_or_a_named_error(lines, fmt):
    CASES["jsonl"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "train.jsonl", b"\n".join(lines) + b"\n")
        n, problems = outcome(lambda: validate_file(path, fmt), path)
        assert all(str(path) in p.path or Path(p.path).name for p in problems)
        got = outcome(lambda: load_records(path), path)
        if fmt is None and not problems and n:  # what validate calls clean, training reads
            assert isinstance(got, list) and len(got) == n, got


# ---------------------------------------------------------------- qrels
QREL_FIELD = st.sampled_from(["q1", "d1", "0", "1", "2", "-1", "Q0", "1.5", "nan", "inf",
                              "1e3", "", "query-id", "corpus-id", "score", "x y", "9" * 40])
QREL_ROW = st.lists(QREL_FIELD, min_size=0, max_size=7).map(
    lambda r: "\t".join(r).encode()) | st.lists(QREL_FIELD, max_size=6).map(
    lambda r: " ".join(r).encode()) | st.binary(max_size=20)


@FUZZ
@given(rows=st.lists(QREL_ROW, max_size=8))
def test_fuzzed_qrels_give_judgements_or_a_named_error(rows):
    CASES["qrels"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "qrels/train.tsv", b"\n".join(rows) + b"\n")
        got = outcome(lambda: load_qrels(path), path)
        if isinstance(got, dict):
            assert all(isinstance(v, int) for rel in got.values() for v in rel.values())


# ---------------------------------------------------------------- BEIR folders
DOC = st.fixed_dictionaries({"_id": st.sampled_from(["d1", "d2", "q1", 1, "", None, True])},
                            optional={"text": VALUE, "title": VALUE, "image": VALUE})
BEIR_FILE = st.lists(DOC.map(_line) | RECORD.map(_line) | RAW_LINE, max_size=5)


@FUZZ
@given(corpus=BEIR_FILE, queries=BEIR_FILE, qrels=st.lists(QREL_ROW, max_size=5),
       header=st.booleans(), missing=st.sampled_from([None, "corpus.jsonl", "queries.jsonl"]))
def test_fuzzed_beir_folders_give_records_or_a_named_error(corpus, queries, qrels, header,
                                                           missing):
    CASES["beir"] += 1
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "beir"
        _write(root, "corpus.jsonl", b"\n".join(corpus))
        _write(root, "queries.jsonl", b"\n".join(queries))
        _write(root, "qrels/train.tsv",
               (b"query-id\tcorpus-id\tscore\n" if header else b"") + b"\n".join(qrels))
        if missing:
            (root / missing).unlink()
        n, problems = outcome(lambda: validate_file(root), root)
        got = outcome(lambda: read_beir(root, "train"), root)
        outcome(lambda: load_beir(root, "train"), root)
        if not problems and n:  # what validate calls clean, training reads
            assert isinstance(got, list) and len(got) == n, got


# ---------------------------------------------------------------- Parquet tables
COLUMN = st.sampled_from(["anchor", "positive", "negative", "negative_1", "query", "text",
                          "pos_score", "neg_score_1", "label", "score", "id", ""])
PLAIN = TEXT.filter(lambda t: not any("\ud800" <= c <= "\udfff" for c in t))  # Arrow: UTF-8
CELL = st.none() | PLAIN | st.integers(-5, 5) | st.floats(allow_nan=True) | \
    st.lists(PLAIN, max_size=3)


@FUZZ
@given(columns=st.lists(COLUMN, min_size=1, max_size=4, unique=True),
       cells=st.lists(CELL, min_size=0, max_size=12), rows=st.integers(0, 3))
def test_fuzzed_parquet_gives_records_or_a_named_error(columns, cells, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    CASES["parquet"] += 1
    table = {}
    for i, c in enumerate(columns):
        values = [cells[(i * rows + j) % len(cells)] if cells else None for j in range(rows)]
        kinds = {type(v) for v in values if v is not None}
        if len(kinds) > 1:  # a column holds one type: the rest become text
            values = [None if v is None else str(v) for v in values]
        try:
            table[c] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            table[c] = pa.array([None if v is None else str(v) for v in values])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "train.parquet"
        pq.write_table(pa.table(table), path)
        outcome(lambda: validate_file(path), path)
        outcome(lambda: load_records(path), path)


@FUZZ
@given(data=st.binary(max_size=64), head=st.sampled_from([b"", b"PAR1", b"PAR1\x00\x00"]))
def test_a_damaged_parquet_file_is_a_named_error(data, head):
    CASES["parquet-bytes"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "train.parquet", head + data + head)
        outcome(lambda: validate_file(path), path)
        outcome(lambda: load_records(path), path)


# ---------------------------------------------------------------- YAML configurations
YAML_KEY = st.sampled_from(["lr", "batch_size", "model", "train_data", "eval_data",
                            "matryoshka_dims", "report_to", "fixed_temperature", "seed",
                            "epochs", "extra", "unknown_key", "lr-", "max-steps"])
YAML_TEXT = st.recursive(
    st.sampled_from(["1", "-1", "2e-5", "nan", ".inf", "true", "~", "''", "x", "[]", "{}",
                     "*a", "&a 1", "!!python/object:os.system", "'unterminated", "{a: [",
                     "\t", "a: b: c", "- - -", "? x", "%YAML 9.9", "---", "...", "@x", "`"]),
    lambda inner: st.lists(inner, max_size=3).map(lambda v: "[" + ", ".join(v) + "]")
    | st.lists(st.tuples(YAML_KEY, inner), max_size=3).map(
        lambda kv: "{" + ", ".join(f"{k}: {v}" for k, v in kv) + "}"), max_leaves=8)
YAML_DOC = st.lists(st.tuples(YAML_KEY, YAML_TEXT), max_size=5).map(
    lambda kv: "".join(f"{k}: {v}\n" for k, v in kv)) | YAML_TEXT


@FUZZ
@given(text=YAML_DOC, aliases=st.integers(0, 9))
def test_fuzzed_yaml_gives_a_config_or_a_named_error(text, aliases):
    from bigbatch.data.readers.yaml_file import load_yaml
    from bigbatch.train.config import TrainConfig, load_config

    CASES["yaml"] += 1
    if aliases:  # a chain of aliases, each repeating the one before
        text = "a0: &a0 [x, x, x]\n" + "".join(
            f"a{i}: &a{i} [*a{i - 1}, *a{i - 1}, *a{i - 1}]\n" for i in range(1, aliases + 1)) \
            + f"lr: *a{aliases}\n" + text
    with tempfile.TemporaryDirectory() as d:
        path = _write(Path(d), "c.yaml", text.encode("utf-8", "surrogatepass"))
        outcome(lambda: load_yaml(path), path)
        with bounded():
            try:
                got = load_config(path, {"model": d, "train_data": d})
                assert isinstance(got, TrainConfig)
            except BigBatchError as e:  # the file, or the option and its value
                assert str(path) in str(e) or "--" in str(e), str(e)[:500]


def test_zz_the_fuzz_cases_run_are_counted(capsys):
    """(Runs after the fuzz tests of this module.) Every reader was fuzzed."""
    total = sum(CASES.values())
    with capsys.disabled():
        print(f"\nfuzzed readers: {total} cases ({', '.join(f'{k} {v}' for k, v in sorted(CASES.items()))})")
    if CASES:  # (a -k selection may run this test alone)
        assert total >= 100
