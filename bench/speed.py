"""Optimizer-step time on all-MiniLM-L6-v2 with real SciFact claim/abstract pairs:

(a) plain full-batch autograd with bigbatch's InfoNCE, (b) sentence-transformers'
CachedMultipleNegativesRankingLoss (mini_batch_size = chunk), (c) bigbatch GradCache,
(d) bigbatch GradCache with length-ordered chunking. Same model, batch, chunk, scale and
data for all; runs interleaved (a b c d a b c d ...); medians and ratios reported. Also
F (forward without grad) and FB (forward + backward) over the same chunks, and the bound
of one extra forward pass: (2F + B) / (F + B) = (F + FB) / FB, to compare with the
measured bigbatch / FB.

    python bench/speed.py --batch 64 --chunk 16 --repeats 3 [--device cuda --dtype bf16]

Writes bench/results/speed-<device>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, machine, minilm, now, scifact_pairs  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="make every text max-length real tokens (the bound's setting)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    import bigbatch as bb

    torch.manual_seed(0)
    device = args.device
    model = minilm(device)
    model.max_seq_length = args.max_length
    model.train()
    scale = 20.0
    amp = torch.bfloat16 if args.dtype == "bf16" else None
    queries, docs = scifact_pairs(args.batch)

    def tok(texts):
        if args.equal_lengths:  # every row max_length real tokens: repeat, then truncate
            texts = [" ".join([t] * 64) for t in texts]
        f = model.preprocess(texts)
        return {k: v.to(device) for k, v in f.items() if isinstance(v, torch.Tensor)}

    q, d = tok(queries), tok(docs)

    def tower(**f):
        return model(dict(f))["sentence_embedding"]

    def autocast():
        return torch.autocast(torch.device(device).type, dtype=amp, enabled=amp is not None)

    loss_fn = bb.InfoNCE(temperature=1 / scale, learnable_temperature=False).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-7)

    def plain():
        with autocast():
            qe, de = tower(**q), tower(**d)
        loss, _ = loss_fn(query=qe.float(), doc=de.float())
        loss.backward()

    cmnrl = CachedMultipleNegativesRankingLoss(model, scale=scale, mini_batch_size=args.chunk)

    def st_cached():
        with autocast():
            loss = cmnrl([dict(q), dict(d)], None)
        loss.backward()

    gc = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=args.chunk,
                      autocast_dtype=amp)
    gc_sorted = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=args.chunk,
                             autocast_dtype=amp, sort_by_length=True)
    def trimmed(c):  # the chunks the engine runs: each cut to its own longest row
        width = int(c["attention_mask"].sum(1).max())
        return {k: v[:, :width] for k, v in c.items()}

    chunks = [trimmed({k: v[i:i + args.chunk] for k, v in x.items()})
              for x in (q, d) for i in range(0, args.batch, args.chunk)]

    def forward_only():
        with torch.no_grad(), autocast():
            for c in chunks:
                tower(**c)

    def forward_backward():
        for c in chunks:
            with autocast():
                out = tower(**c)
            out.float().sum().backward()

    contenders = {"a_plain_full_batch": plain, "b_st_cached_mnrl": st_cached,
                  "c_bigbatch": lambda: gc.step(query=q, doc=d),
                  "d_bigbatch_sorted": lambda: gc_sorted.step(query=q, doc=d),
                  "F_forward_no_grad": forward_only, "Bw_forward_backward": forward_backward}

    def timed(fn):
        opt.zero_grad(set_to_none=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        opt.step()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for fn in contenders.values():  # warm-up
        timed(fn)
    times = {k: [] for k in contenders}
    for r in range(args.repeats):
        for k, fn in contenders.items():
            times[k].append(timed(fn))
        print(f"round {r + 1}/{args.repeats}: " +
              ", ".join(f"{k.split('_')[0]} {v[-1]:.2f}s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    F, FB = med["F_forward_no_grad"], med["Bw_forward_backward"]
    result = {
        "benchmark": "speed", "date": now(), "machine": machine(device),
        "command": "python bench/speed.py " + " ".join(sys.argv[1:]),
        "settings": vars(args) | {"scale": scale, "model": "all-MiniLM-L6-v2 (train mode)",
                                  "data": "SciFact train claim/abstract pairs"},
        "median_seconds": med, "all_seconds": times,
        "bound_F_plus_FB_over_FB": (F + FB) / FB,
        "ratios": {
            "c_over_FB": med["c_bigbatch"] / FB,
            "c_over_a": med["c_bigbatch"] / med["a_plain_full_batch"],
            "d_over_a": med["d_bigbatch_sorted"] / med["a_plain_full_batch"],
            "b_over_c": med["b_st_cached_mnrl"] / med["c_bigbatch"],
            "b_over_a": med["b_st_cached_mnrl"] / med["a_plain_full_batch"],
        },
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "equal" if args.equal_lengths else "real"
    out = Path(args.out or RESULTS / f"speed-{device.split(':')[0]}-{args.dtype}-{tag}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'contender':<24}{'median s':>10}{'x plain':>9}")
    for k, v in med.items():
        print(f"{k:<24}{v:>10.3f}{v / med['a_plain_full_batch']:>9.2f}")
    r = result["ratios"]
    print(f"\nbound (F+FB)/FB = {result['bound_F_plus_FB_over_FB']:.3f}; "
          f"bigbatch / FB = {r['c_over_FB']:.3f}; sorted / plain = {r['d_over_a']:.3f}; "
          f"ST cached / bigbatch = {r['b_over_c']:.3f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
