"""Peak memory of full-corpus evaluation (``bigbatch.retrieval.evaluate.evaluate_beir``) against
corpus size.

A synthetic BEIR set (documents of SciFact words, 100 queries whose positives are spread over
the corpus) is written once per size; each point runs in its own process and records the
process's peak resident memory (VmHWM) and the peak of its anonymous memory (RssAnon, sampled
every 50 ms: what the process allocated, without the file pages of the memory-mapped corpus
embeddings, which the kernel can drop), beside the size of the embeddings matrix. The model is
all-MiniLM-L6-v2 (``--model minilm``) or a random 2-layer, 128-wide BERT with MiniLM's
tokenizer (``--model tiny-bert``, the same memory layout at a fraction of the time).

    python bench/eval_memory.py --model tiny-bert --docs 100000,1000000 --max-length 32
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, SCIFACT, machine, minilm_path, now, status_mb
from common import tiny_bert as tiny_bert_model

QUERIES = 100


def write_corpus(folder: Path, docs: int, seed: int = 0) -> Path:
    """A BEIR folder of ``docs`` documents of 30 SciFact words each, 100 queries, test qrels."""
    if (folder / "qrels" / "test.tsv").exists():
        return folder
    words = (SCIFACT / "corpus.jsonl").read_text()[:2_000_000].split()
    rng = random.Random(seed)
    (folder / "qrels").mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w") as f:
        for i in range(docs):
            f.write(json.dumps({"_id": f"d{i}", "title": "",
                                "text": " ".join(rng.choices(words, k=30))}) + "\n")
    with open(folder / "queries.jsonl", "w") as f, open(folder / "qrels" / "test.tsv", "w") as q:
        q.write("query-id\tcorpus-id\tscore\n")
        for i in range(QUERIES):
            f.write(json.dumps({"_id": f"q{i}", "text": " ".join(rng.choices(words, k=12))}) + "\n")
            q.write(f"q{i}\td{rng.randrange(docs)}\t1\n")
    return folder


def tiny_bert(folder: Path) -> str:
    """The benchmarks' tiny random BERT saved in ``folder`` (once), for load_encoder."""
    if not (folder / "config.json").exists():
        tok, bert = tiny_bert_model()
        bert.save_pretrained(folder)
        tok.save_pretrained(folder)
    return str(folder)


def point(model: str, data: Path, max_length: int, batch_size: int) -> dict:
    """One evaluation in this process: metrics, seconds, peak RSS and peak anonymous memory."""
    from bigbatch.encoders import load_encoder
    from bigbatch.retrieval.evaluate import evaluate_beir

    peak_anon, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], status_mb("RssAnon") or 0.0)
            time.sleep(0.05)

    encoder = load_encoder(model, max_length=max_length)
    base_rss, base_anon = status_mb("VmRSS"), status_mb("RssAnon")
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.time()
    metrics = evaluate_beir(encoder, data, "test", batch_size=batch_size, progress=False,
                            unseen_from=None)
    seconds = time.time() - t0
    done.set()
    watcher.join()
    return {"metrics": metrics, "seconds": seconds, "peak_rss_mb": status_mb("VmHWM"),
            "rss_before_mb": base_rss, "peak_anon_mb": peak_anon[0],
            "anon_before_mb": base_anon}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default="100000,1000000")
    ap.add_argument("--model", choices=["minilm", "tiny-bert"], default="tiny-bert")
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--work", default="runs/eval-memory", help="where the synthetic sets go")
    ap.add_argument("--out", default=None)
    ap.add_argument("--point", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    work = Path(args.work)
    model = minilm_path() if args.model == "minilm" else tiny_bert(work / "tiny-bert")
    if args.point:
        print(json.dumps(point(model, Path(args.point[1]), args.max_length, args.batch_size)))
        return
    rows = []
    for n in [int(x) for x in args.docs.split(",")]:
        data = write_corpus(work / f"corpus-{n}", n)
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--max-length",
                              str(args.max_length), "--batch-size", str(args.batch_size),
                              "--work", str(work), "--point", str(n), str(data)],
                             capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        dim = 384 if args.model == "minilm" else 128
        row.update(docs=n, embeddings_mb=n * dim * 4 / 2 ** 20)
        rows.append(row)
        print(f"{n:>10,} docs: {row['seconds']:7.1f} s, peak RSS {row['peak_rss_mb']:7,.0f} MB "
              f"(before {row['rss_before_mb']:,.0f}), peak anonymous {row['peak_anon_mb']:7,.0f} MB "
              f"(before {row['anon_before_mb']:,.0f}), embeddings {row['embeddings_mb']:,.0f} MB",
              flush=True)
    result = {"benchmark": "eval-memory", "date": now(), "machine": machine("cpu"),
              "command": "python bench/eval_memory.py " + " ".join(sys.argv[1:]),
              "settings": {"model": args.model, "max_length": args.max_length,
                           "batch_size": args.batch_size, "queries": QUERIES}, "rows": rows}
    path = Path(args.out) if args.out else RESULTS / f"eval-memory-cpu-{args.model}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
