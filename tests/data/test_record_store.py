"""Training records read by index (bigbatch.data.records.store): the same records and the same
errors as the eager loader for every format, the index kept until its data changes and
refused when it does not match, and memory that does not grow with the records."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from bigbatch.data.batches import EpochBatches
from bigbatch.data.records import store as record_store
from bigbatch.data.records.loader import load_records
from bigbatch.data.records.store import RecordStore, index_folder, open_records
from bigbatch.errors import DataError


def _png(path: Path) -> None:
    from PIL import Image

    Image.new("RGB", (4, 4), "white").save(path)


def _write_jsonl(path: Path, rows: list[dict], newline: str = "\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + newline for r in rows), encoding="utf-8")
    return path


def _text_rows(n: int, start: int = 0) -> list[dict]:
    return [{"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}", f"m{i}"]}
            for i in range(start, start + n)]


def _st_table(n: int, start: int = 0):
    pa = pytest.importorskip("pyarrow")
    return pa.table({"anchor": [f"q{i}" for i in range(start, start + n)],
                     "positive": [f"p{i}" for i in range(start, start + n)],
                     "negative_1": [f"n{i}" for i in range(start, start + n)]})


def _contrastors_mixed(tmp_path: Path) -> Path:
    """Text documents, text files and page images, blank lines, a BOM and CRLF endings."""
    (tmp_path / "docs").mkdir()
    for i in range(3):
        (tmp_path / "docs" / f"d{i}.txt").write_text(f"passage {i}")
        _png(tmp_path / "docs" / f"p{i}.png")
    f = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"query": "q0", "chunk_path": "docs/d0.txt",
                         "neg_chunk_paths": ["docs/d1.txt"]}),
             "",
             json.dumps({"query": "q1", "chunk_path": "docs/p0.png",
                         "neg_chunk_paths": ["docs/p1.png"], "query_id": 7,
                         "positive_id": "doc-p0"}),
             json.dumps({"query": "q2", "positive": "text \u00e9", "negatives": ["other"]})]
    f.write_bytes(("\ufeff" + "\r\n".join(lines) + "\r\n").encode("utf-8"))
    return f


def _swift(tmp_path: Path) -> Path:
    def conv(system: str, text: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": text}]

    rows = [{"messages": conv("Find.", f"q{i}"), "positive_messages": [conv("Doc.", f"p{i}")],
             "negative_messages": [conv("Doc.", f"n{i}")]} for i in range(4)]
    return _write_jsonl(tmp_path / "swift.jsonl", rows)


def _parquet(tmp_path: Path) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(_st_table(6), tmp_path / "st.parquet", row_group_size=4)
    return tmp_path / "st.parquet"


def _parquet_shards(tmp_path: Path) -> Path:
    import pyarrow.parquet as pq

    folder = tmp_path / "hub" / "data"
    folder.mkdir(parents=True)
    for i in range(2):
        pq.write_table(_st_table(3, 3 * i), folder / f"train-0000{i}-of-00002.parquet")
    pq.write_table(_st_table(2, 100), folder / "test-00000-of-00001.parquet")
    return tmp_path / "hub"


def _jsonl_shards(tmp_path: Path) -> Path:
    for i in range(3):
        _write_jsonl(tmp_path / "shards" / f"part-{i:03d}.jsonl", _text_rows(2, 2 * i))
    return tmp_path / "shards"


def _datasets_folder(tmp_path: Path) -> Path:
    """A DatasetDict written by datasets' save_to_disk, two Arrow files in its split."""
    datasets = pytest.importorskip("datasets")
    table = _st_table(7)
    dd = datasets.DatasetDict({"train": datasets.Dataset(table)})
    dd.save_to_disk(str(tmp_path / "dd"), max_shard_size=200)
    return tmp_path / "dd"


SOURCES = {"contrastors": _contrastors_mixed, "swift": _swift, "parquet": _parquet,
           "parquet-shards": _parquet_shards, "jsonl-shards": _jsonl_shards,
           "datasets": _datasets_folder,
           "st-jsonl": lambda t: _write_jsonl(t / "st.jsonl", [
               {"anchor": f"q{i}", "positive": f"p{i}", "negative_1": f"n{i}"}
               for i in range(3)])}


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_records_read_by_index_equal_the_loaded_records(tmp_path, kind):
    source = SOURCES[kind](tmp_path)
    eager = load_records(source)
    lazy = open_records(source, cache_dir=tmp_path / "cache")
    assert isinstance(lazy, RecordStore)
    assert len(lazy) == len(eager) and list(lazy) == eager
    # every field training reads, including those equality leaves out
    for a, b in zip(lazy, eager):
        assert (a.positive_key, a.query_system, a.doc_system) == \
            (b.positive_key, b.query_system, b.doc_system)
    assert lazy[-1] == eager[-1] and lazy[1:3] == eager[1:3]
    with pytest.raises(IndexError):
        lazy[len(eager)]
    again = open_records(source, cache_dir=tmp_path / "cache")  # from the kept index
    assert list(again) == eager
    # batches made from the index are the batches made from the loaded records
    for b in range(2):
        x = EpochBatches(lazy, 2, 1, seed=3).batch(1, b)
        y = EpochBatches(eager, 2, 1, seed=3).batch(1, b)
        assert (x.queries, x.docs, x.doc_ids) == (y.queries, y.docs, y.doc_ids)


def test_hub_shards_are_read_by_split(tmp_path):
    hub = _parquet_shards(tmp_path)
    assert [r.query for r in open_records(hub, "test", cache_dir=tmp_path / "c")] == \
        ["q100", "q101"]
    assert len(open_records(hub, cache_dir=tmp_path / "c")) == 6
    with pytest.raises(DataError, match="no shard of split 'dev'.*test, train"):
        open_records(hub, "dev", cache_dir=tmp_path / "c")
    (hub / "data" / "extra.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match=".jsonl and .parquet"):
        open_records(hub, cache_dir=tmp_path / "c")


def test_beir_and_csv_are_read_whole(tmp_path):
    f = tmp_path / "st.csv"
    f.write_text("anchor,positive\nq,p\nq2,p2\n")
    records = open_records(f, cache_dir=tmp_path / "c")
    assert isinstance(records, list) and records == load_records(f)


def _counting_builds(monkeypatch) -> list[str]:
    built: list[str] = []
    real = record_store._build

    def build(source, *args):
        built.append(str(source))
        return real(source, *args)

    monkeypatch.setattr(record_store, "_build", build)
    return built


def test_the_index_is_kept_and_rebuilt_when_its_file_changes(tmp_path, monkeypatch):
    built = _counting_builds(monkeypatch)
    f = _write_jsonl(tmp_path / "t.jsonl", _text_rows(5))
    cache = tmp_path / "cache"
    assert len(open_records(f, cache_dir=cache)) == 5 and len(built) == 1
    assert len(open_records(f, cache_dir=cache)) == 5 and len(built) == 1  # kept
    with open(f, "a") as fh:  # appended to
        fh.write(json.dumps(_text_rows(1, 5)[0]) + "\n")
    assert [r.query for r in open_records(f, cache_dir=cache)][-1] == "q5" and len(built) == 2
    # the same size and modification time, other contents: the hash of its head tells
    st = os.stat(f)
    f.write_text(f.read_text().replace("q0", "x0"))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert open_records(f, cache_dir=cache)[0].query == "x0" and len(built) == 3
    # other settings (a data root) validate the data anew
    open_records(f, cache_dir=cache, data_root=tmp_path)
    assert len(built) == 4
    # a datasets folder written again is indexed again
    dd = _datasets_folder(tmp_path)
    assert len(open_records(dd, cache_dir=cache)) == 7 and len(built) == 5
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset(_st_table(4))}).save_to_disk(
        str(tmp_path / "d2"))
    os.replace(tmp_path / "dd", tmp_path / "old")
    os.replace(tmp_path / "d2", tmp_path / "dd")
    assert len(open_records(dd, cache_dir=cache)) == 4 and len(built) == 6


def test_an_index_that_does_not_match_is_refused(tmp_path):
    f = _write_jsonl(tmp_path / "t.jsonl", _text_rows(5))
    cache = tmp_path / "cache"
    store = open_records(f, cache_dir=cache)
    folder = index_folder(f, "train", cache)
    assert store.folder == folder
    np.save(folder / "pos.npy", np.zeros(3, np.int64))  # cut short
    with pytest.raises(DataError, match=r"index in .* does not match.*pos.npy holds 3.*"
                                        r"delete that folder"):
        open_records(f, cache_dir=cache)
    np.save(folder / "pos.npy", np.full(5, 10**9, np.int64))  # offsets beyond the file
    with pytest.raises(DataError, match="byte range lies outside its file"):
        open_records(f, cache_dir=cache)
    (folder / "line.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="line.npy cannot be read"):
        open_records(f, cache_dir=cache)


def test_a_file_changed_under_a_running_store_is_refused(tmp_path):
    f = _write_jsonl(tmp_path / "t.jsonl", _text_rows(5))
    store = open_records(f, cache_dir=tmp_path / "cache")
    assert store[2].query == "q2"
    with open(f, "a") as fh:
        fh.write(json.dumps(_text_rows(1, 5)[0]) + "\n")
    with pytest.raises(DataError, match=r"t.jsonl: changed since it was indexed"):
        store[2]


def _error(load) -> str:
    with pytest.raises(DataError) as e:
        load()
    return str(e.value)


def test_bad_records_are_reported_as_the_loader_reports_them(tmp_path):
    rows = _text_rows(12)
    rows[6]["negatives"] = ["n6", ""]
    del rows[9]["query"]
    f = _write_jsonl(tmp_path / "t.jsonl", rows)
    lazy = _error(lambda: open_records(f, cache_dir=tmp_path / "c"))
    assert lazy == _error(lambda: load_records(f))
    assert f"{f}:7, field 'negatives[1]'" in lazy and f"{f}:10, field 'query'" in lazy
    assert not index_folder(f, "train", tmp_path / "c").exists()  # nothing kept
    # a shard names its own file
    shards = _jsonl_shards(tmp_path)
    bad = shards / "part-001.jsonl"
    bad.write_text(bad.read_text() + "{not json\n")
    msg = _error(lambda: open_records(shards, cache_dir=tmp_path / "c"))
    assert f"{bad}:3" in msg and "malformed JSON" in msg
    # fewer negatives than asked, from the index as from the loader
    g = _write_jsonl(tmp_path / "g.jsonl", _text_rows(3))
    open_records(g, cache_dir=tmp_path / "c")
    assert _error(lambda: open_records(g, num_hard_negatives=3, cache_dir=tmp_path / "c")) == \
        _error(lambda: load_records(g, num_hard_negatives=3))
    # a missing image is found when the data is indexed, with its line and field
    _png(tmp_path / "p.png")
    h = _write_jsonl(tmp_path / "img.jsonl", [
        {"query": "q", "chunk_path": "p.png", "neg_chunk_paths": ["gone.png"]}])
    msg = _error(lambda: open_records(h, cache_dir=tmp_path / "c"))
    assert f"{h}:1, field 'neg_chunk_paths[0]'" in msg and msg == _error(lambda: load_records(h))


def test_swift_prompts_that_differ_are_named_in_a_second_pass(tmp_path):
    f = _swift(tmp_path)
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    rows[2]["messages"][0]["content"] = "Other."
    _write_jsonl(f, rows)
    msg = _error(lambda: open_records(f, cache_dir=tmp_path / "c"))
    assert msg == _error(lambda: load_records(f)) and f"{f}:3, field 'messages'" in msg


def test_the_store_holds_no_record_in_memory(tmp_path):
    """100,000 records: opening the kept index and reading a batch allocates a few hundred
    kB of Python objects (a list of the records would take tens of MB)."""
    f = tmp_path / "big.jsonl"
    with open(f, "w") as fh:
        for i in range(100_000):
            fh.write(f'{{"query": "q{i}", "positive": "p{i}", "negatives": ["n{i}"]}}\n')
    cache = tmp_path / "cache"
    open_records(f, cache_dir=cache)
    tracemalloc.start()
    try:
        store = open_records(f, cache_dir=cache)
        batch = EpochBatches(store, 256, 1, seed=0).batch(0, 5)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(store) == 100_000 and len(batch.queries) == 256
    assert peak < 3 * 2**20, peak


def _index_on_main_cases(good: str, bad: str, cache: str) -> dict:
    def cases() -> dict:
        from bigbatch.engine.distributed import world_info
        from bigbatch.train.main_rank import main_first

        built: list[str] = []
        real = record_store._build
        record_store._build = lambda source, *a: (built.append(str(source)), real(source, *a))[1]
        info = world_info()
        records = main_first(lambda: open_records(good, cache_dir=cache), info)
        try:
            main_first(lambda: open_records(bad, cache_dir=cache), info)
            stopped = None
        except DataError as e:
            stopped = str(e)
        return {"queries": [r.query for r in records], "built": len(built), "stopped": stopped}
    return {"index": cases}


def _index_worker(rank, world, port, out_path, good, bad, cache):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dist_helpers import run_cases

    run_cases(rank, world, port, out_path, _index_on_main_cases(good, bad, cache))


@pytest.mark.slow  # two spawned gloo ranks: about 30 s on 2 cores
def test_across_two_ranks_the_main_rank_indexes_and_a_bad_record_stops_both(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from dist_helpers import spawn_and_collect

    good = _write_jsonl(tmp_path / "good.jsonl", _text_rows(6))
    rows = _text_rows(6)
    rows[3]["query"] = ""
    bad = _write_jsonl(tmp_path / "bad.jsonl", rows)
    per_rank = spawn_and_collect(_index_worker, tmp_path / "r.json", str(good), str(bad),
                                 str(tmp_path / "cache"))
    index = [r["index"] for r in per_rank]
    assert [r["queries"] for r in index] == [[f"q{i}" for i in range(6)]] * 2
    assert [r["built"] for r in index] == [2, 0]  # rank 1 opened rank 0's index
    for r in index:  # both ranks stop, with the main rank's report
        assert f"{bad}:4, field 'query'" in r["stopped"] and "rank 0" in r["stopped"]


@pytest.mark.slow  # four short training runs of a tiny model
def test_training_from_the_index_resumes_exactly_and_equals_training_from_memory(
        tmp_path, monkeypatch):
    from pipeline_helpers import tiny_bert

    from bigbatch.train import TrainConfig, train

    tiny = tiny_bert(tmp_path / "tiny", dropout=0.1)
    rows = [{"query": f"what is item {i}", "positive": f"item {i} is thing {i * 7}",
             "negatives": [f"item {i + 1} is other {i}", f"nothing about {i}"]}
            for i in range(24)]
    data = _write_jsonl(tmp_path / "train.jsonl", rows)

    def run(out: str, **kw) -> TrainConfig:
        return TrainConfig(model=str(tiny), train_data=str(data), output_dir=str(tmp_path / out),
                          batch_size=4, grad_cache_chunk=3, num_hard_negatives=1, max_steps=5,
                          warmup_steps=1, save_steps=2, eval_steps=0, eval_at_start=False,
                          lora_r=4, lora_alpha=8, max_length=24, seed=5, **kw)

    def losses(out: str) -> dict[int, float]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"}

    train(run("straight"))
    train(run("resumed"), on_step_end=lambda step, state: step >= 3)
    train(run("resumed", resume=str(tmp_path / "resumed")))
    assert losses("straight") == losses("resumed") and len(losses("straight")) == 5
    monkeypatch.setattr(record_store, "open_records", lambda source, split, k, root:
                        load_records(source, split, k, root))
    train(run("from-memory"))
    assert losses("from-memory") == losses("straight")


def test_a_negative_whose_swift_prompt_differs_is_refused_by_the_index_as_by_the_loader(tmp_path):
    """Only the negative's system prompt differs (every side's prompts agree otherwise): the
    index refuses it in its first pass, with the same message as the loader."""
    f = _swift(tmp_path)
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    rows[1]["negative_messages"][0][0]["content"] = "Other."
    _write_jsonl(f, rows)
    msg = _error(lambda: open_records(f, cache_dir=tmp_path / "c"))
    assert msg == _error(lambda: load_records(f)) and f"{f}:2" in msg and "differs" in msg
