"""``bigbatch validate`` and ``bigbatch convert`` stream: memory stays bounded whatever the
number of records (measured against what a list of the same records takes), and what they
report and write is what reading the whole file into a list gave (digests recorded from the
list-based implementation, commit c6d6649)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bigbatch.cli import main
from bigbatch.data.formats import format_of, read_records, write_records
from bigbatch.data.records.validate import validate_file, validate_records

SRC = Path(__file__).resolve().parents[2] / "src"

# the child: how far its resident high-water mark rises while it reads, validates or
# converts the file, once imports are done and the same work ran on a small file (what is
# loaded on first use is not counted). The mark is reset through /proc/self/clear_refs and
# read as VmHWM, what ru_maxrss reports; where it cannot be reset, ru_maxrss is taken as
# it stands (then only growth above the imports' own peak counts).
_CHILD = """
import contextlib, gc, io, json, re, resource, sys
from pathlib import Path
from bigbatch.cli import main
from bigbatch.data.formats import read_records
from bigbatch.data.records.validate import validate_file
mode, path, small, out = sys.argv[1:]
def run(path):
    if mode == "list":
        return len(read_records(path)[0])
    if mode == "validate":
        n, problems = validate_file(path)
        assert problems == [], problems[:3]
        return n
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["convert", "--to", mode, path, out]) == 0
    return sum(1 for _ in open(out, encoding="utf-8"))
def status(field):
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\\s+(\\d+) kB", text, flags=re.M).group(1)) * 1024
run(small)
gc.collect()
try:
    Path("/proc/self/clear_refs").write_text("5")
    base, peak = status("VmRSS"), lambda: status("VmHWM")
except OSError:
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
n = run(path)
print(json.dumps({"growth": peak() - base, "records": n}))
"""


def _growth(mode: str, path: Path, small: Path, out: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH",
                                                                                  "")]))
    p = subprocess.run([sys.executable, "-c", _CHILD, mode, str(path), str(small), str(out)],
                       env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB is Linux's")
def test_validate_and_convert_hold_no_list_of_records(tmp_path):
    n = 150_000
    path, small = tmp_path / "big.jsonl", tmp_path / "small.jsonl"
    rows = [json.dumps({"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}"]}) + "\n"
            for i in range(n)]
    path.write_text("".join(rows), encoding="utf-8")
    small.write_text("".join(rows[:1000]), encoding="utf-8")
    del rows
    listed = _growth("list", path, small, tmp_path / "unused")
    validated = _growth("validate", path, small, tmp_path / "unused")
    converted = _growth("swift", path, small, tmp_path / "out.jsonl")
    assert listed["records"] == validated["records"] == converted["records"] == n
    print(f"peak RSS growth over {n} records: list {listed['growth'] / 2**20:.1f} MiB, "
          f"validate {validated['growth'] / 2**20:.1f} MiB, "
          f"convert {converted['growth'] / 2**20:.1f} MiB")
    # a list of the records costs ~850 bytes each; streaming keeps 8 bytes a record (the
    # duplicate check's hashes) and a bounded rest
    assert listed["growth"] > 64 * 2**20
    assert validated["growth"] < listed["growth"] / 8
    assert converted["growth"] < listed["growth"] / 8


def test_parquet_is_written_a_row_group_at_a_time(tmp_path):
    import pyarrow.parquet as pq

    src = tmp_path / "src.jsonl"
    src.write_text("".join(json.dumps({"query": f"q{i}", "positive": f"p{i}",
                                       "negatives": [f"n{i}"], "pos_score": 1.0,
                                       "neg_scores": [i / 2]}) + "\n" for i in range(10_000)))
    out = tmp_path / "o.parquet"
    assert main(["convert", "--to", "st", str(src), str(out)]) == 0
    f = pq.ParquetFile(out)
    assert f.metadata.num_row_groups == 3 and f.metadata.row_group(0).num_rows == 4096
    rows = f.read().to_pylist()
    assert rows[9999] == {"anchor": "q9999", "positive": "p9999", "negative_1": "n9999",
                          "pos_score": 1.0, "neg_score_1": 4999.5}


def _jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows),
                    encoding="utf-8")
    return path


def _swift(q, p, negs, qs="Q", ps="D", neg_system=None):
    def conv(system, text):
        return ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": text}]
    return {"messages": conv(qs, q), "positive_messages": [conv(ps, p)],
            "negative_messages": [conv((neg_system or {}).get(i, ps), n)
                                  for i, n in enumerate(negs)]}


def _cross_record_sources(root: Path) -> dict[str, Path]:
    """Sources whose problems need the whole file: duplicates, negative counts, prompts."""
    swift = _jsonl(root / "sw.jsonl", [
        _swift("q1", "p1", ["n1"]), _swift("q2", "p2", ["n2"], qs="Other"),
        _swift("q3", "p3", ["n3"], neg_system={0: "Neg"}), _swift("q1", "p1", ["n4"]),
        _swift("q5", "p5", ["n5"], ps=None), _swift("q6", "p6", ["n6"]),
        _swift("q7", "p7", ["n7"], qs="")])
    counts = _jsonl(root / "counts.jsonl", ["{bad"] + [
        {"query": f"c{i % 25}", "positive": f"p{i % 25}", "negatives": ["n"] * (i % 3),
         **({"pos_score": 1} if i == 7 else {})} for i in range(40)])
    for i in range(3):
        _jsonl(root / "shards" / f"train-0000{i}-of-00003.jsonl", [
            {"query": f"q{j % 4}", "positive": f"p{j % 4}", "negatives": ["n"] * (1 + (j == 2))}
            for j in range(5)])
    return {"swift": swift, "counts": counts, "shards": root / "shards"}


# (records, problems, sha256 of the problems' lines with paths relative to the folder), as
# the list-based validate reported them
_VALIDATED = {
    "swift": (7, 5, "f43e4817cd891e145ab0c509509892c5a47f37ef44c752a93806aa30474efad0"),
    "counts": (40, 43, "a651abc1f728f0c7631242bf921cc688d1839ea6b222751e53da8e00fc2e038c"),
    "shards": (15, 14, "80fac0a1f5da691b542ef6d0f5d25c8bbb9a27abbd0deed6863028fff5d3382b"),
}


def _digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def test_streamed_validate_reports_what_the_list_did(tmp_path):
    found = {}
    for name, path in _cross_record_sources(tmp_path).items():
        n, problems = validate_file(path)
        lines = [str(p).replace(f"{tmp_path}/", "") for p in problems]
        found[name] = (n, len(problems), _digest(lines))
        records, read = read_records(path, format_of(path))  # the list API agrees
        assert [str(p) for p in validate_records(records, read)] == [str(p) for p in problems]
    assert found == _VALIDATED
    lines = [str(p) for p in validate_file(tmp_path / "counts.jsonl")[1]]
    assert lines[1].endswith(":3, field 'negatives': 1 negatives where the file usually has 0 "
                             "(14 record(s): lines 2, 5, 8, 11, 14, 17, 20, 23, 26, 29, ...); "
                             "give every record the same number")
    assert lines[-1].endswith(":41, field 'query': duplicate query with the same positive "
                              "(first on line 16)")


def _convert_source(root: Path, negatives: bool = True) -> Path:
    """Text records with non-ASCII text and ids, with negatives and teacher scores (BEIR
    holds neither)."""
    return _jsonl(root / f"src{'' if negatives else '_pairs'}.jsonl", [
        {"query": f"q{i % 45} é", "positive": f"p {i}", "positive_id": f"d{i}",
         **({"negatives": [f"n{i}", f"m{i}"], "pos_score": 0.5 + i, "neg_scores": [0.25, i / 3]}
            if negatives else {})}
        for i in range(50)])


# sha256 of each file convert wrote (of a Parquet file: of its schema and rows), as the
# list-based convert wrote them
_CONVERTED = {
    ("contrastors", "c.jsonl"): {
        "c.jsonl": "9dbbb8e680e4c70c2f5e210dcbae98e5c8ba3d180109eab69fe0f1593e16bf3a"},
    ("swift", "s.jsonl"): {
        "s.jsonl": "37950a9861fdca7310b91ce249da15d7c0a657c4a11e53ae860267fafb1b7d06"},
    ("st", "t.jsonl"): {
        "t.jsonl": "475dfdd82337fd3a1e024f47921243a86f90f6e3ac4f12d6c46d791ff344a840"},
    ("st", "t.csv"): {
        "t.csv": "3feb6ce59094b2635b236d6d441174445d49ea14ec9d2cd74e8671e0639188df"},
    ("st", "t.parquet"): {
        "t.parquet": "f6565c15b840e52e3e03104184567caf7b0f47ff32f01b91567158cc13a777e3"},
    ("beir", "b"): {
        "corpus.jsonl": "ccb9391e34456d2e6396bde6b52b33ba1d988a5465ef90e27e67c794be10956b",
        "qrels/train.tsv": "eb4f9607291a6bae028668db9c6d46d8d610def6691e7c876ce482ef30c07c1c",
        "queries.jsonl": "634942adce6fdf4c25db228e1c774b19e6fe856096981204857a8f3261af002c"},
}


@pytest.mark.parametrize("dst,name", list(_CONVERTED))
def test_streamed_convert_writes_what_the_list_did(tmp_path, capsys, dst, name):
    src = _convert_source(tmp_path, negatives=dst != "beir")
    out = tmp_path / "out" / name
    assert main(["convert", "--to", dst, str(src), str(out)]) == 0
    assert f"converted 50 records -> 50 written as {dst}" in capsys.readouterr().out
    files = [out] if out.is_file() else sorted(f for f in out.rglob("*") if f.is_file())
    digests = {}
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            t = pq.read_table(f)
            data = json.dumps([str(t.schema), t.to_pylist()]).encode()
        else:
            data = f.read_bytes()
        digests[f.name if f == out else f.relative_to(out).as_posix()] = \
            hashlib.sha256(data).hexdigest()
    assert digests == _CONVERTED[(dst, name)]
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]  # nothing left aside
    # the list API writes the same
    again = tmp_path / "again" / name
    report = write_records(read_records(src)[0], again, dst)
    assert report["read"] == report["written"] == 50


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_refused_conversion_leaves_the_output_as_it_was(tmp_path, suffix):
    src = _jsonl(tmp_path / "src.jsonl", [
        {"query": "q", "positive": "p", "negatives": ["a"]},
        {"query": "r", "positive": "p", "negatives": ["a", "b"]}])
    out = tmp_path / f"out{suffix}"
    out.write_text("before")
    assert main(["convert", "--to", "st", str(src), str(out)]) == 2
    assert out.read_text() == "before"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out" + suffix, "src.jsonl"]


def test_a_problem_found_while_streaming_stops_before_the_output(tmp_path, capsys):
    rows = [{"query": f"q{i}", "positive": f"p{i}", "negatives": [f"n{i}"]} for i in range(50)]
    src = _jsonl(tmp_path / "src.jsonl", rows + ["{broken"])
    out = tmp_path / "out.jsonl"
    assert main(["convert", "--to", "swift", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{src}:51: malformed JSON" in err and "1 problem(s)" in err
    assert not out.exists() and os.listdir(tmp_path) == ["src.jsonl"]
