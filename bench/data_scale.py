"""Training records at scale: synthetic JSONL files of 100k, 1M and 10M records (a query, a
positive and 3 negatives of about 100 words each, ~3.9 KB a record) read by index
(:func:`bigbatch.data.records.store.open_records`).

For each size, each phase in a fresh process (its peak resident memory is that process's):

- ``index``: the first run, validating the file while streaming it and writing the index;
- ``cached``: a later start, from the kept index (the time of ``open_records`` and of the
  whole process, imports included);
- ``train``: the first 5 steps of a tiny-model run (``bigbatch.train.train``, a 2-layer
  32-wide BERT, batch 16 with 3 hard negatives, 32 tokens, the index cached): peak resident memory;
- ``datapath``: batches made from the records alone (``EpochBatches.batch``, batch 256 with
  3 negatives each: what a step reads, before tokenizing), per second;
- ``eager`` (100k records and fewer): the records loaded as Python objects
  (``load_records``, what training did before), for comparison.

The files are written under ``--dir`` (``/tmp/bigbatch-data-scale``), never in the
repository; ``--words`` shortens the texts where the disk is short. Results go to
``bench/results/data_scale.json`` (``--out``); ``python bench/report.py`` writes their table
into docs/benchmarks.md.

    python bench/data_scale.py --sizes 100000 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, ROOT, machine, now

_WORDS = ("retrieval contrastive embedding gradient cache batch query passage document model "
          "training negative positive encoder vector similarity corpus token layer attention "
          "protein cell gene clinical trial patient effect study result method analysis data "
          "evidence claim support risk dose response level expression pathway tissue").split()


def _rss_mb() -> float:
    """This process's peak resident memory since it started (``VmHWM``: unlike
    ``ru_maxrss``, it does not count the parent's memory, which Linux carries into a child
    started by fork and exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_file(path: Path, n: int, words: int, seed: int = 0) -> None:
    """``n`` contrastors records, each text ``words`` words (a pool of texts, each record's
    made distinct by its number)."""
    if path.exists() and path.stat().st_size > 0 and path.with_suffix(".done").exists():
        return
    rng = random.Random(seed)
    pool = [" ".join(rng.choice(_WORDS) for _ in range(words)) for _ in range(4096)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", buffering=2**24) as f:
        for i in range(n):
            t = [pool[(i * 5 + j) * 7919 % 4096] for j in range(5)]
            f.write(f'{{"query": "{i} {t[0]}", "positive": "{i} {t[1]}", "negatives": '
                    f'["{i} {t[2]}", "{i} {t[3]}", "{i} {t[4]}"]}}\n')
    path.with_suffix(".done").touch()


def _child(phase: str, args: argparse.Namespace, file: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", phase, "--file", str(file), "--cache",
           str(args.dir / "cache"), "--dir", str(args.dir)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child(phase: str, file: Path, cache: Path, work: Path) -> dict:
    t0 = time.perf_counter()
    from bigbatch.data.records.store import open_records
    if phase == "machine":  # imported here, not in the parent (whose memory would grow)
        return machine("cpu")
    if phase == "eager":
        from bigbatch.data.records.loader import load_records

        t = time.perf_counter()
        records = load_records(file, num_hard_negatives=3)
        return {"seconds": time.perf_counter() - t, "records": len(records),
                "peak_rss_mb": _rss_mb()}
    if phase in ("index", "cached"):
        t = time.perf_counter()
        store = open_records(file, num_hard_negatives=3, cache_dir=cache)
        took = time.perf_counter() - t
        return {"seconds": took, "process_seconds": time.perf_counter() - t0,
                "records": len(store), "peak_rss_mb": _rss_mb()}
    if phase == "datapath":
        from bigbatch.data.batches import EpochBatches

        store = open_records(file, num_hard_negatives=3, cache_dir=cache)
        batches = EpochBatches(store, 256, 3, seed=0)
        batches.batch(0, 0)  # the epoch's permutation drawn
        t, n = time.perf_counter(), 0
        while n < 40 and time.perf_counter() - t < 20:
            batches.batch(0, 1 + n)
            n += 1
        took = time.perf_counter() - t
        return {"batch_size": 256, "batches": n, "batches_per_s": n / took,
                "records_per_s": 256 * n / took, "peak_rss_mb": _rss_mb()}
    if phase == "train":
        os.environ["BIGBATCH_CACHE"] = str(cache)
        sys.path.insert(0, str(ROOT / "tests"))
        from pipeline_helpers import tiny_bert

        from bigbatch.train import TrainConfig, train

        tiny = tiny_bert(work / "tiny-bert")
        out = work / "run"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        train(TrainConfig(model=str(tiny), train_data=str(file), output_dir=str(out),
                          batch_size=16, grad_cache_chunk=16, num_hard_negatives=3,
                          max_steps=5, warmup_steps=1, save_steps=1000, eval_steps=0,
                          eval_at_start=False, max_length=32, lora_r=0,
                          lr=1e-4, seed=0))
        return {"seconds": time.perf_counter() - t, "steps": 5, "peak_rss_mb": _rss_mb()}
    raise SystemExit(f"unknown phase {phase}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000, 10_000_000])
    p.add_argument("--words", type=int, default=100, help="words per text")
    p.add_argument("--dir", type=Path, default=Path("/tmp/bigbatch-data-scale"))
    p.add_argument("--out", type=Path, default=RESULTS / "data_scale.json")
    p.add_argument("--keep", action="store_true", help="keep the files afterwards")
    p.add_argument("--child"), p.add_argument("--file", type=Path), p.add_argument("--cache",
                                                                                    type=Path)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.file, args.cache, args.dir)))
        return
    rows: list[dict] = []
    about: dict = {}
    for n in args.sizes:
        file = args.dir / f"records-{n}.jsonl"
        t = time.perf_counter()
        make_file(file, n, args.words)
        row = {"records": n, "file_gb": file.stat().st_size / 1e9,
               "bytes_per_record": file.stat().st_size / n,
               "write_seconds": time.perf_counter() - t}
        shutil.rmtree(args.dir / "cache", ignore_errors=True)
        for phase in ("index", "cached", "datapath", "train") + (
                ("eager",) if n <= 100_000 else ()):
            row[phase] = _child(phase, args, file)
            print(n, phase, row[phase], flush=True)
        rows.append(row)
        if not args.keep:
            file.unlink()
            file.with_suffix(".done").unlink()
        about = about or _child("machine", args, file)
        args.out.write_text(json.dumps({"when": now(), "machine": about,
                                        "words_per_text": args.words, "rows": rows}, indent=1))
    shutil.rmtree(args.dir / "cache", ignore_errors=True)
    from report import data_scale_section

    print("\n".join(data_scale_section([args.out])))


if __name__ == "__main__":
    main()
