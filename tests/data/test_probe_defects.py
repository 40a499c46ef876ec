"""Defects a probe of careless, hostile and flaky inputs found in the readers (issue 29): a
text inside a record as large as a text file may be, qrels in TREC's 4-column form, and a
message that printed an unbounded value (a YAML "billion laughs" file). Each test fails on
the code before the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data.readers.beir_dir import load_beir, load_qrels, read_beir
from bigbatch.data.readers.files import MAX_TEXT_FILE_BYTES
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.validate import validate_file
from bigbatch.errors import ConfigError, DataError, shown

BIG = "word " * (MAX_TEXT_FILE_BYTES // 5 + 2**18)  # 9.25 MiB of text


def jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def beir(root: Path, docs, queries, qrels_text: str, split: str = "train") -> Path:
    jsonl(root / "corpus.jsonl", docs)
    jsonl(root / "queries.jsonl", queries)
    (root / "qrels").mkdir(parents=True, exist_ok=True)
    (root / "qrels" / f"{split}.tsv").write_text(qrels_text)
    return root


# ---------------------------------------------------------------- a 50 MB record
def test_a_text_in_a_record_is_capped_like_a_text_file(tmp_path):
    """A record's text over 8 MiB (as a chunk_path file may hold) is a validate finding and
    a training error naming file, line and field, before any model loads."""
    data = jsonl(tmp_path / "train.jsonl", [{"query": "q1", "positive": "fine", "negatives": ["n"]},
                                            {"query": "q2", "positive": BIG, "negatives": ["n"]},
                                            {"query": BIG, "positive": "also fine", "negatives": ["n"]},
                                            {"query": "q4", "positive": "p", "negatives": [BIG]}])
    n, problems = validate_file(data)
    found = {(p.line, p.field): p.message for p in problems}
    assert set(found) == {(2, "positive"), (3, "query"), (4, "negatives[0]")}, found
    assert "the text is 9.2 MiB, over the 8 MiB bigbatch reads of a text" in found[(2, "positive")]
    assert "is 9.2 MiB, over the 8 MiB" in found[(3, "query")]
    with pytest.raises(DataError, match=r"train.jsonl:2, field 'positive': the text is 9.2 MiB"):
        load_records(data)


def test_a_beir_text_is_capped_too(tmp_path):
    root = beir(tmp_path / "b", [{"_id": "d1", "text": "ok"}, {"_id": "d2", "title": "t", "text": BIG}],
                [{"_id": "q1", "text": "a query"}, {"_id": "q2", "text": BIG}],
                "query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\t1\nq2\td1\t1\n")
    problems = []
    read_beir(root, "train", problems)
    found = {(Path(p.path).name, p.line, p.field) for p in problems}
    assert found == {("corpus.jsonl", 2, "text"), ("queries.jsonl", 2, "text")}, problems
    with pytest.raises(DataError, match="over the 8 MiB"):
        load_beir(root, "train")


def test_train_refuses_a_huge_record_before_step_one(tmp_path):
    from pipeline_helpers import tiny_bert

    from bigbatch.train import TrainConfig, train

    data = jsonl(tmp_path / "train.jsonl", [{"query": f"q{i}", "positive": f"p{i}"} for i in range(8)]
                 + [{"query": "q", "positive": BIG}])
    cfg = TrainConfig(model=str(tiny_bert(tmp_path / "tiny")), train_data=str(data),
                      output_dir=str(tmp_path / "run"), batch_size=4, grad_cache_chunk=4,
                      max_steps=2, lora_r=0, max_length=16, eval_at_start=False)
    with pytest.raises(DataError, match=r"train.jsonl:9, field 'positive': the text is 9.2 MiB"):
        train(cfg)
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_tokenizer_never_sees_more_than_the_max_length_needs(tmp_path):
    """Evaluation corpora are embedded as they are read: a text is cut to what --max-length
    tokens can cover before the tokenizer reads it, and the tokens kept are the same."""
    from pipeline_helpers import tiny_bert

    from bigbatch.encoders import TextEncoder

    enc = TextEncoder(str(tiny_bert(tmp_path / "tiny")), max_length=16)
    seen: list[int] = []
    tokenizer = enc.tokenizer

    class Spy:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, texts, **kw):
            seen.extend(len(t) for t in texts)
            return tokenizer(texts, **kw)

    huge = "retrieval " * 5_000_000  # 50 MB
    expected = tokenizer([huge[:1000]], truncation=True, max_length=16, return_tensors="pt")
    enc.tokenizer = Spy()
    got = enc.tokenize([huge], "doc")
    assert max(seen) <= 16 * 1000
    assert got["input_ids"].tolist() == expected["input_ids"].tolist()


# ---------------------------------------------------------------- qrels layouts
def test_trec_four_column_qrels_are_read_as_trec_reads_them(tmp_path):
    """MS MARCO's qid<TAB>0<TAB>pid<TAB>rel (no header) was read as document "0" with the
    pid as its relevance; with a document "0" in the corpus, validate called it clean."""
    docs = [{"_id": str(i), "text": f"document {i}"} for i in (0, 7, 9)]
    queries = [{"_id": "1", "text": "first"}, {"_id": "2", "text": "second"}]
    root = beir(tmp_path / "m", docs, queries, "1\t0\t7\t1\n2\t0\t9\t1\n")
    assert load_qrels(root / "qrels" / "train.tsv") == {"1": {"7": 1}, "2": {"9": 1}}
    pairs = sorted((r.query_id, r.positive.id) for r in read_beir(root, "train"))
    assert pairs == [("1", "7"), ("2", "9")]
    (root / "qrels" / "train.tsv").write_text("1 Q0 7 1\n2 Q0 9 2\n")  # trec_eval's spaces
    assert load_qrels(root / "qrels" / "train.tsv") == {"1": {"7": 1}, "2": {"9": 2}}


@pytest.mark.parametrize("text, message", [
    ("query-id\tcorpus-id\tscore\n1\t7\t1\n2\t0\t9\t1\n",
     r"train.tsv:3: 4 column\(s\), but line 1 has 3 \(BEIR's"),
    ("1\tQ0\t7\t1\t12.5\trun-a\n", r"train.tsv:1: 6 column\(s\); it looks like a TREC run file"),
    ("1\t7\n", r"train.tsv:1: 2 column\(s\); qrels hold BEIR's"),
])
def test_a_wrong_qrels_layout_is_refused(tmp_path, text, message):
    root = beir(tmp_path / "m", [{"_id": "7", "text": "d"}], [{"_id": "1", "text": "q"}], text)
    with pytest.raises(DataError, match=message):
        load_qrels(root / "qrels" / "train.tsv")
    n, problems = validate_file(root)
    assert n == 0 and len(problems) == 1 and "column(s)" in problems[0].message


# ---------------------------------------------------------------- unbounded values
def test_a_message_shows_a_bounded_value():
    assert shown("short") == "'short'"
    long = shown("x" * 10_000_000)
    assert len(long) < 300 and "(10,000,000 characters)" in long
    laughs = ["lol"] * 9
    for _ in range(8):
        laughs = [laughs] * 9  # 9**9 strings, shared
    assert len(shown(laughs)) < 300
    assert len(str(DataError("bad", path="f", field="k" * 10**6))) < 400


LAUGHS = "a: &a [" + ", ".join(["lol"] * 9) + "]\n" + "".join(
    f"{k}: &{k} [{', '.join([f'*{p}'] * 9)}]\n" for p, k in zip("abcdefgh", "bcdefghi"))


def test_a_billion_laughs_yaml_is_refused_at_once(tmp_path, capsys):
    """436 bytes of aliases used to expand in the refusal message: 88 s, 6.4 GB, MemoryError."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LAUGHS.replace("i: &i", "lr: &i"))
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "expand it to 490,329,064 values" in err
    assert "billion laughs" in err and len(err) < 1000


def test_a_source_list_of_aliases_is_refused_too(tmp_path, capsys):
    """The same through --train-data's list (data/mix.py's messages printed it too)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(LAUGHS + "train_data:\n  - {path: x.jsonl, weight: *i}\n")
    assert main(["train", "--config", str(cfg)]) == 2
    assert "billion laughs" in capsys.readouterr().err


def test_a_large_value_in_a_config_is_shown_cut(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: " + "9" * 3_000_000 + "x\n")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "lr must be a number" in err and len(err) < 1000


def test_yaml_nested_or_self_referring_is_refused(tmp_path):
    from bigbatch.data.readers.yaml_file import load_yaml

    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="deep.yaml: nested"):
        load_yaml(deep)
    loop = tmp_path / "loop.yaml"
    loop.write_text("a: &x [1, *x]\n")
    with pytest.raises(ConfigError, match="loop.yaml: an alias refers to a value that holds it"):
        load_yaml(loop)
    ok = tmp_path / "ok.yaml"
    ok.write_text("base: &b {lr: 0.1}\nother: *b\n")
    assert load_yaml(ok) == {"base": {"lr": 0.1}, "other": {"lr": 0.1}}
