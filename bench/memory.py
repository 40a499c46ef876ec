"""Peak memory of one training step against batch size, at a fixed chunk, each point in its
own process: resident memory (ru_maxrss) on CPU, torch.cuda.max_memory_allocated on GPU.

Contenders: bigbatch GradCache with the streamed loss (block_size), bigbatch with the dense
loss, and plain full-batch training (until it no longer fits or --plain-max is reached).
all-MiniLM-L6-v2 on SciFact claim/abstract pairs cut to --max-length tokens.

    python bench/memory.py --batches 256,1024,4096,16384 --chunk 128 --max-length 32

Writes bench/results/memory-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, minilm, now, scifact_pairs  # noqa: E402


def point(mode: str, batch: int, chunk: int, max_length: int, device: str, block: int) -> dict:
    import torch

    import bigbatch as bb

    model = minilm(device)
    model.max_seq_length = max_length
    model.train()
    queries, docs = scifact_pairs(batch)
    def tokenize(texts: list[str]) -> dict:
        # in blocks, padded to max_length: one call on 32k texts would raise the process's
        # high-water mark above the step's own peak (the engine trims each chunk anyway)
        # dict(...): keep the tensors, drop the BatchEncoding and its per-token records
        # (for abstracts cut to 32 tokens they held ~70 KB a text, 1.1 GB at 16,384)
        parts = [dict(model.tokenizer(texts[i:i + 1024], padding="max_length",
                                      truncation=True, max_length=max_length,
                                      return_tensors="pt"))
                 for i in range(0, len(texts), 1024)]
        return {k: torch.cat([p[k] for p in parts]).to(device) for k in parts[0].keys()}

    q, d = tokenize(queries), tokenize(docs)

    def tower(**f):
        return model(dict(f))["sentence_embedding"]

    loss_fn = bb.InfoNCE(temperature=0.05, block_size=block if mode == "streamed" else None)
    loss_fn.to(device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.max_memory_allocated()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if mode == "plain":
        loss, _ = loss_fn(query=tower(**q), doc=tower(**d))
        loss.backward()
    else:
        bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=chunk).step(query=q, doc=d)
    seconds = time.perf_counter() - t0
    out = {"mode": mode, "batch": batch, "seconds": seconds,
           "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "rss_before_step_mb": base_rss / 1024}
    if device.startswith("cuda"):
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_before_step_mb"] = base / 2**20
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="256,1024,4096,16384")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=32)
    ap.add_argument("--block", type=int, default=1024, help="streamed loss block size")
    ap.add_argument("--plain-max", type=int, default=4096, help="largest plain full batch tried")
    ap.add_argument("--dense-max", type=int, default=4096, help="largest dense-loss batch tried")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    ap.add_argument("--out", default=None)
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        mode, batch = args.point.split(":")
        print(json.dumps(point(mode, int(batch), args.chunk, args.max_length, args.device,
                               args.block)))
        return
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for mode, limit in (("streamed", None), ("dense", args.dense_max), ("plain", args.plain_max)):
            if limit is not None and batch > limit:
                continue
            cmd = [sys.executable, __file__, "--point", f"{mode}:{batch}", "--chunk",
                   str(args.chunk), "--max-length", str(args.max_length), "--device",
                   args.device, "--block", str(args.block)]
            try:
                # a fixed mmap threshold makes glibc return freed blocks to the system, so
                # peak RSS follows live memory instead of allocator fragmentation
                env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="131072")
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                   env=env)
                if p.returncode != 0:
                    row = {"mode": mode, "batch": batch, "failed": p.stderr.strip()[-300:]}
                else:
                    row = json.loads(p.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                row = {"mode": mode, "batch": batch, "failed": f"over {args.timeout} s"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"benchmark": "memory", "date": now(), "machine": machine(args.device),
              "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k != "point"}
              | {"model": "all-MiniLM-L6-v2 (train mode)", "data": "SciFact train pairs"},
              "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or RESULTS / f"memory-{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    key = "peak_cuda_mb" if args.device.startswith("cuda") else "peak_rss_mb"
    print(f"\n{'batch':>7}" + "".join(f"{m:>12}" for m in ("streamed", "dense", "plain")))
    for b in sorted({r["batch"] for r in rows}):
        cells = []
        for m in ("streamed", "dense", "plain"):
            r = next((r for r in rows if r["batch"] == b and r["mode"] == m), None)
            cells.append("-" if r is None else "failed" if "failed" in r else f"{r[key]:.0f} MB")
        print(f"{b:>7}" + "".join(f"{c:>12}" for c in cells))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
