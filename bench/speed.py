"""Optimizer-step time on all-MiniLM-L6-v2 with real SciFact claim/abstract pairs:

(a) plain full-batch autograd with bigbatch's InfoNCE, (b) sentence-transformers'
CachedMultipleNegativesRankingLoss (mini_batch_size = chunk), (c) bigbatch GradCache,
(d) bigbatch GradCache with length-ordered chunking. Same model, batch, chunk, scale and
data for all; runs interleaved (a b c d a b c d ...); the fastest round of each (``--stat
min``, the default: on a shared machine interference only adds time, so the minimum is the
uncontended cost, as Python's ``timeit`` advises) or the median, and ratios reported. Also
F (forward without grad) and FB (forward + backward) over the same chunks, and the bound
of one extra forward pass: (2F + B) / (F + B) = (F + FB) / FB, to compare with the
measured bigbatch / FB.

Each engine's floor of model work is derived from those rows (F + FB - F_last for bigbatch,
which keeps the last chunk's graph; F + FB for sentence-transformers). A sum of separately
measured minima is biased low; ``--direct-floors`` also times each floor as one contender
(the same chunk forwards and backwards done by hand, no engine and no loss), so "x its
floor" is measured rather than summed.

    python bench/speed.py --batch 64 --chunk 16 --repeats 3 [--device cuda --dtype bf16]

Writes bench/results/speed-<device>-<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    MODELS,
    RESULTS,
    machine,
    minilm,
    now,
    scifact_pairs,
    timed_rounds,
    tiny_sentence_model,
    weights,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chunk", default="16",
                    help="rows per chunk, or auto: bigbatch sizes its chunks for "
                    "--memory-budget (GradCache(chunk_size='auto')) and the other contenders "
                    "use its document chunk")
    ap.add_argument("--memory-budget", default="0.8",
                    help="with --chunk auto: a fraction of the free memory or a size (20GB)")
    ap.add_argument("--model", choices=("minilm", "tiny-bert"), default="minilm",
                    help="all-MiniLM-L6-v2, or a 2-layer random BERT (the dry run's)")
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stat", choices=("min", "median"), default="min",
                    help="statistic over rounds the ratios use (both are written)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--equal-lengths", action="store_true",
                    help="make every text max-length real tokens (the bound's setting)")
    ap.add_argument("--direct-floors", action="store_true",
                    help="also time each engine's floor of model work as one contender")
    ap.add_argument("--out", default=None)
    ap.add_argument("--resummarize", metavar="RESULT_JSON", default=None,
                    help="recompute a result file's summary from its recorded rounds with "
                         "--stat, then exit (no timing)")
    args = ap.parse_args()
    if args.resummarize:
        path = Path(args.resummarize)
        result = json.loads(path.read_text())
        for k in ("median_seconds", "ratios", "bound_F_plus_FB_over_FB",
                  "ceiling_b_over_c_direct_floors"):
            result.pop(k, None)
        result |= summarize(result["all_seconds"], args.stat)
        result["settings"]["stat"] = args.stat
        path.write_text(json.dumps(result, indent=2) + "\n")
        report(result)
        return

    import torch
    from sentence_transformers.sentence_transformer.losses import CachedMultipleNegativesRankingLoss

    import bigbatch as bb

    torch.manual_seed(0)
    device = args.device
    model = minilm(device) if args.model == "minilm" else tiny_sentence_model(device)
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

    plan = None
    if args.chunk == "auto":  # bigbatch's sizes for the budget; the others take its chunk
        from bigbatch.train.option_values import memory_size

        sizer = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                             memory_budget=memory_size(args.memory_budget, "--memory-budget"),
                             optimizer=opt, autocast_dtype=amp, sort_by_length=True,
                             params=params)
        plan = sizer.plan_chunks({"query": q, "doc": d})
        args.chunk = plan.sizes["doc"]
        print(f"auto: {plan.describe()}", flush=True)
    args.chunk = int(args.chunk)
    cmnrl = CachedMultipleNegativesRankingLoss(model, scale=scale, mini_batch_size=args.chunk)

    def st_cached():
        with autocast():
            loss = cmnrl([dict(q), dict(d)], None)
        loss.backward()

    gc = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=args.chunk,
                      autocast_dtype=amp)
    gc_sorted = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=args.chunk,
                             autocast_dtype=amp, sort_by_length=True)
    if plan is not None:  # auto: as bigbatch train runs it (per-tower sizes, plain or not)
        gc = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size="auto",
                          autocast_dtype=amp, memory_budget=2 ** 62)
        gc_sorted = sizer
        gc.use_plan(plan)
    def trimmed(c):  # the chunks the engine runs: each cut to its own longest row
        width = int(c["attention_mask"].sum(1).max())
        return {k: v[:, :width] for k, v in c.items()}

    chunks = [trimmed({k: v[i:i + args.chunk] for k, v in x.items()})
              for x in (q, d) for i in range(0, args.batch, args.chunk)]

    def forward_only():
        with torch.no_grad(), autocast():
            for c in chunks:
                tower(**c)

    def forward_last_chunk():  # the chunk bigbatch keeps with its graph: never replayed
        with torch.no_grad(), autocast():
            tower(**chunks[-1])

    def forward_backward():
        for c in chunks:
            with autocast():
                out = tower(**c)
            out.float().sum().backward()

    def floor_bigbatch():  # bigbatch's model work: every chunk but the kept one twice
        with torch.no_grad(), autocast():
            for c in chunks[:-1]:
                tower(**c)
        forward_backward()

    def floor_st():  # sentence-transformers' model work: every chunk twice
        forward_only()
        forward_backward()

    contenders = {"a_plain_full_batch": plain, "b_st_cached_mnrl": st_cached,
                  "c_bigbatch": lambda: gc.step(query=q, doc=d),
                  "d_bigbatch_sorted": lambda: gc_sorted.step(query=q, doc=d),
                  "F_forward_no_grad": forward_only, "Bw_forward_backward": forward_backward,
                  "Flast_forward_kept_chunk": forward_last_chunk}
    if args.direct_floors:
        contenders |= {"Gc_floor_bigbatch_work": floor_bigbatch, "Gb_floor_st_work": floor_st}

    times = timed_rounds(contenders, args.repeats, device,
                         before=lambda: opt.zero_grad(set_to_none=True), after=opt.step)
    result = {
        "benchmark": "speed", "date": now(), "machine": machine(device),
        "command": "python bench/speed.py " + " ".join(sys.argv[1:]),
        "settings": vars(args) | weights(args.model) | {"scale": scale,
                                                         "model": MODELS[args.model],
                                  "data": "SciFact train claim/abstract pairs"}
        | ({"auto": {"sizes": plan.sizes, "plain": plan.plain, "budget_mb": plan.budget / 2**20,
                     "estimate_mb": plan.memory.total / 2**20}} if plan is not None else {}),
        "all_seconds": times,
    } | summarize(times, args.stat)
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "equal" if args.equal_lengths else "real"
    out = Path(args.out or RESULTS / f"speed-{device.split(':')[0]}-{args.dtype}-{tag}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    report(result)
    print(f"wrote {out}")


def summarize(times: dict[str, list[float]], stat: str) -> dict:
    """Medians, minima and the ratios (from the ``stat`` of each contender's rounds)."""
    medians = {k: statistics.median(v) for k, v in times.items()}
    minima = {k: min(v) for k, v in times.items()}
    med = minima if stat == "min" else medians  # what the ratios below use
    F, FB = med["F_forward_no_grad"], med["Bw_forward_backward"]
    # No exact GradCache that holds one chunk's activations can do less model work than
    # F + FB - F_last (every chunk but the kept one is embedded twice); sentence-transformers'
    # cached loss re-embeds every chunk, so its floor is F + FB. Their ratio is the most any
    # such engine can be faster than it, unless it carries overhead beyond that floor.
    floor_c, floor_b = F + FB - med["Flast_forward_kept_chunk"], F + FB
    out = {
        "stat": stat, "seconds": med, "median_seconds": medians, "min_seconds": minima,
        "bound_F_plus_FB_over_FB": (F + FB) / FB,
        "floor_seconds": {"bigbatch_F_plus_FB_minus_Flast": floor_c, "st_cached_F_plus_FB": floor_b},
        "ceiling_b_over_c_at_floors": floor_b / floor_c,
        "ratios": {
            "c_over_FB": med["c_bigbatch"] / FB,
            "c_over_a": med["c_bigbatch"] / med["a_plain_full_batch"],
            "d_over_a": med["d_bigbatch_sorted"] / med["a_plain_full_batch"],
            "b_over_c": med["b_st_cached_mnrl"] / med["c_bigbatch"],
            "b_over_a": med["b_st_cached_mnrl"] / med["a_plain_full_batch"],
            "c_over_its_floor": med["c_bigbatch"] / floor_c,
            "b_over_its_floor": med["b_st_cached_mnrl"] / floor_b,
        },
    }
    if "Gc_floor_bigbatch_work" in med:  # --direct-floors: each floor timed as one contender
        gc_, gb_ = med["Gc_floor_bigbatch_work"], med["Gb_floor_st_work"]
        out["ceiling_b_over_c_direct_floors"] = gb_ / gc_
        out["ratios"] |= {"c_over_its_direct_floor": med["c_bigbatch"] / gc_,
                          "b_over_its_direct_floor": med["b_st_cached_mnrl"] / gb_}
    return out


def report(result: dict) -> None:
    med, minima, medians = result["seconds"], result["min_seconds"], result["median_seconds"]
    print(f"\n{'contender':<26}{'min s':>8}{'median s':>10}{'x plain':>9} ({result['stat']})")
    for k, v in med.items():
        print(f"{k:<26}{minima[k]:>8.3f}{medians[k]:>10.3f}{v / med['a_plain_full_batch']:>9.2f}")
    r, fl = result["ratios"], result["floor_seconds"]
    print(f"\nbound (F+FB)/FB = {result['bound_F_plus_FB_over_FB']:.3f}; "
          f"bigbatch / FB = {r['c_over_FB']:.3f}; sorted / plain = {r['d_over_a']:.3f}; "
          f"ST cached / bigbatch = {r['b_over_c']:.3f}")
    print(f"floors (model work alone): bigbatch F+FB-Flast = "
          f"{fl['bigbatch_F_plus_FB_minus_Flast']:.3f}s (measured {r['c_over_its_floor']:.3f}x "
          f"it), ST F+FB = {fl['st_cached_F_plus_FB']:.3f}s (measured "
          f"{r['b_over_its_floor']:.3f}x it); ST / bigbatch if both ran at their floors = "
          f"{result['ceiling_b_over_c_at_floors']:.3f}")
    if "ceiling_b_over_c_direct_floors" in result:
        print(f"floors timed directly: bigbatch {r['c_over_its_direct_floor']:.3f}x its floor, "
              f"ST {r['b_over_its_direct_floor']:.3f}x its floor; ST / bigbatch at their floors "
              f"= {result['ceiling_b_over_c_direct_floors']:.3f}")


if __name__ == "__main__":
    main()
