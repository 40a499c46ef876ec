"""bfloat16 autocast against float32 on the CPU: one GradCache optimizer step of
all-MiniLM-L6-v2 (train mode) on SciFact claim/abstract pairs, the same step with the
towers under ``torch.autocast("cpu", torch.bfloat16)`` (what ``bigbatch train --dtype
bfloat16`` runs), in interleaved rounds (float32 then bfloat16 in each, so both see the same load): each
round's ratio and their median, which a load that changes between rounds does not bias, and
the fastest round of each. Records
whether the CPU reports bfloat16 instructions (``avx512_bf16``, ``amx_bf16``), which decide
whether bf16 pays here::

    python bench/cpu_bf16.py --batch 8 --chunk 4 --max-length 256 --rounds 6

Writes bench/results/cpu-bf16.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, minilm_path, now, scifact_pairs


def cpu_flags() -> list[str]:
    """The bfloat16-related flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((l.split(":", 1)[1].split() for l in text.splitlines()
                      if l.startswith("flags")), []))
    return sorted(f for f in flags if "bf16" in f or f.startswith("amx"))


def main() -> None:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    import bigbatch as bb

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS / "cpu-bf16.json")
    ap.add_argument("--note", default="", help="what else ran on the machine")
    args = ap.parse_args()
    path = minilm_path()
    tok, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    model.train()

    def encode(input_ids, attention_mask, token_type_ids=None):
        hidden = model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1).float()

    queries, docs = scifact_pairs(args.batch)
    q = tok(queries, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")
    d = tok(docs, padding=True, truncation=True, max_length=args.max_length, return_tensors="pt")
    caches = {name: bb.GradCache({"query": encode, "doc": encode}, bb.InfoNCE(temperature=0.05),
                                 chunk_size=args.chunk, autocast_dtype=dtype)
              for name, dtype in (("float32", None), ("bfloat16", torch.bfloat16))}
    seconds: dict[str, list[float]] = {name: [] for name in caches}
    losses: dict[str, float] = {}
    for r in range(args.rounds + 1):  # round 0 warms up, not counted
        for name, cache in caches.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            losses[name] = float(cache.step(query=q, doc=d).loss)
            took = time.perf_counter() - start
            if r:
                seconds[name].append(took)
            print(f"round {r}: {name} {took:.2f} s", flush=True)
    import statistics

    fastest = {k: min(v) for k, v in seconds.items()}
    per_round = [b / f for f, b in zip(seconds["float32"], seconds["bfloat16"])]
    result = {"date": now(), "machine": machine("cpu") | {"cpu_bf16_flags": cpu_flags()},
              "command": "python bench/cpu_bf16.py " + " ".join(sys.argv[1:]),
              "note": args.note,
              "settings": vars(args) | {"out": None, "model": "all-MiniLM-L6-v2 (train mode)",
                                        "data": "SciFact train claim/abstract pairs"},
              "seconds": seconds, "fastest_seconds": fastest, "losses": losses,
              "per_round_bf16_over_fp32": per_round,
              "bf16_over_fp32": statistics.median(per_round),
              "bf16_over_fp32_fastest": fastest["bfloat16"] / fastest["float32"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"bfloat16 / float32 = {result['bf16_over_fp32']:.2f} (median of the rounds' ratios; "
          f"fastest rounds: {result['bf16_over_fp32_fastest']:.2f}); wrote {args.out}")


if __name__ == "__main__":
    main()
