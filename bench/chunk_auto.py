"""Chunks sized for a memory budget (``GradCache(chunk_size="auto")``) against fixed chunks, on
all-MiniLM-L6-v2 (or a tiny random BERT) with real SciFact claim/abstract pairs.

For each budget (``--budgets``), in a process of its own: the engine sizes its chunks on the
step's batch (:meth:`bigbatch.GradCache.plan_chunks`), then one GradCache step runs under
:class:`bigbatch.engine.sizing.PeakMemory` and AdamW's step after it; the point records the
chosen chunks, the estimate, the measured peak (the step's above the memory before it:
resident memory on the CPU, with glibc returning freed blocks at once;
``torch.cuda.max_memory_allocated`` on CUDA; plus the optimizer's states it made, which every
later step holds beside its own peak) and what share of the budget it used. Each fixed
chunk (``--fixed``) is measured the same way. Then, in one process, the chosen and the fixed
chunks are timed in interleaved rounds (:func:`common.timed_rounds`, the fastest round of
each), and each budget's step time is set against the best fixed chunk (overall, and among
those whose measured peak fits the budget).

    python bench/chunk_auto.py --budgets 1GB,2GB,4GB --fixed 4,8,16,32 --batch 128

Writes bench/results/chunk-auto-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    MODELS,
    RESULTS,
    machine,
    minilm,
    now,
    run_point,
    scifact_pairs,
    timed_rounds,
    weights,
)


def build(model_name: str, device: str, max_length: int, batch: int):
    """(tower, parameters, the step's inputs) on SciFact's first ``batch`` training pairs."""
    import torch

    if model_name == "minilm":
        st = minilm(device)
    else:
        from common import tiny_sentence_model
        st = tiny_sentence_model(device)
    st.max_seq_length = max_length
    st.train()
    queries, docs = scifact_pairs(batch)

    def tok(texts: list[str]) -> dict:
        f = st.preprocess(texts)
        return {k: v.to(device) for k, v in f.items() if isinstance(v, torch.Tensor)}

    return (lambda **f: st(dict(f))["sentence_embedding"]), list(st.parameters()), \
        {"query": tok(queries), "doc": tok(docs)}


def engine(tower, params, device: str, chunk, budget: int | None = None, plan=None):
    import torch

    import bigbatch as bb

    loss_fn = bb.InfoNCE(temperature=0.05).to(device)
    opt = torch.optim.AdamW([*params, *loss_fn.parameters()], lr=1e-7)
    cache = bb.GradCache({"query": tower, "doc": tower}, loss_fn, chunk_size=chunk,
                         memory_budget=budget, optimizer=opt if chunk == "auto" else None,
                         sort_by_length=True, params=[*params, *loss_fn.parameters()])
    if plan is not None:
        cache.use_plan(plan)
    return cache, opt


def point(kind: str, value: str, args: argparse.Namespace) -> dict:
    """One budget (``auto``, ``value`` bytes) or one fixed chunk: sizes, estimate, peak."""
    import time

    import torch

    from bigbatch.engine.sizing import MiB, PeakMemory, optimizer_state_bytes

    if args.threads:
        torch.set_num_threads(args.threads)
    tower, params, inputs = build(args.model, args.device, args.max_length, args.batch)
    auto = kind == "auto"
    cache, opt = engine(tower, params, args.device, "auto", int(value) if auto else 2 ** 40)
    plan = cache.plan_chunks(inputs)  # a fixed chunk's estimate: the same plan at its size
    if not auto:
        size = int(value)
        plan = plan.at({"query": size, "doc": size})
        cache.use_plan(plan)
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    with PeakMemory(args.device) as meter:  # the step; then AdamW's, which makes its states
        cache.step(**inputs)
    opt.step()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # a later step holds the optimizer's states beside its own peak: both count
    peak = None if meter.peak is None else meter.peak + optimizer_state_bytes(opt)
    return {"kind": kind, "value": int(value), "sizes": plan.sizes, "plain": plan.plain,
            "estimate_mb": plan.memory.total / MiB, "parts_mb": plan.memory.as_mb(),
            "peak_mb": peak / MiB if peak is not None else None,
            "step_peak_mb": meter.peak / MiB if meter.peak is not None else None,
            "budget_mb": int(value) / MiB if auto else None, "first_step_seconds": seconds,
            "plan": {"sizes": plan.sizes, "tokens": plan.tokens, "plain": plan.plain}}


def speed(rows: list[dict], args: argparse.Namespace) -> dict[str, list[float]]:
    """Every measured size timed in interleaved rounds in this one process."""
    tower, params, inputs = build(args.model, args.device, args.max_length, args.batch)
    sizer, opt = engine(tower, params, args.device, "auto", 2 ** 40)
    plan = sizer.plan_chunks(inputs, use=False)  # each size's plan: this one at its sizes
    contenders, same = {}, {}  # one contender per distinct plan: a budget's auto sizes that
    for r in rows:             # are a fixed chunk's are the same computation, timed once
        if "failed" in r:
            continue
        key = json.dumps(r["plan"], sort_keys=True)
        if key in same:
            same[key].append(f"{r['kind']}_{r['value']}")
            continue
        same[key] = [f"{r['kind']}_{r['value']}"]
        cache, _ = engine(tower, params, args.device, "auto", 2 ** 40,
                          plan=plan.at(r["plan"]["sizes"], r["plan"]["tokens"],
                                       r["plan"]["plain"]))
        contenders[key] = (lambda c=cache: c.step(**inputs))
    times = timed_rounds(contenders, args.rounds, args.device,
                         before=lambda: opt.zero_grad(set_to_none=True), after=opt.step,
                         warmup=False, names={k: "=".join(v) for k, v in same.items()})
    return {name: times[key] for key, names in same.items() for name in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="1GB,2GB,4GB",
                    help="memory budgets (sizes, as --memory-budget reads them)")
    ap.add_argument("--fixed", default="4,8,16,32", help="fixed chunks to compare with")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per point")
    ap.add_argument("--out", default=None)
    ap.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        kind, value = args.point.split(":")
        print(json.dumps(point(kind, value, args)))
        return
    from bigbatch.train.option_values import memory_size

    budgets = [memory_size(b, "--budgets") for b in args.budgets.split(",")]
    common = ["--batch", str(args.batch), "--max-length", str(args.max_length), "--model",
              args.model, "--device", args.device, "--threads", str(args.threads)]
    rows = []
    for kind, value in [*(("auto", b) for b in budgets),
                        *(("fixed", int(c)) for c in args.fixed.split(",") if c)]:
        row = run_point(__file__, ["--point", f"{kind}:{value}", *common], args.timeout)
        row.setdefault("kind", kind)
        row.setdefault("value", value)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "parts_mb"}), flush=True)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    times = speed(rows, args)
    for r in rows:  # each size's fastest round
        name = f"{r['kind']}_{r['value']}"
        if name in times:
            r["step_seconds"] = min(times[name])
    fixed = [r for r in rows if r["kind"] == "fixed" and "step_seconds" in r]
    for r in rows:
        if r["kind"] != "auto" or "step_seconds" not in r:
            continue
        r["budget_used"] = r["peak_mb"] / r["budget_mb"] if r["peak_mb"] is not None else None
        fits = [f for f in fixed if f["peak_mb"] is not None and f["peak_mb"] <= r["budget_mb"]]
        overall = min(fixed, key=lambda f: f["step_seconds"], default=None)
        within = min(fits, key=lambda f: f["step_seconds"], default=None)
        for tag, f in (("best_fixed", overall), ("best_fixed_within_budget", within)):
            if f is not None:
                r[tag] = {"chunk": f["value"], "step_seconds": f["step_seconds"],
                          "peak_mb": f["peak_mb"],
                          "auto_over_it": r["step_seconds"] / f["step_seconds"]}
    result = {"benchmark": "chunk-auto", "date": now(), "machine": machine(args.device),
              "command": "python bench/chunk_auto.py " + " ".join(sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k != "point"}
              | {"model": MODELS[args.model], **weights(args.model), "data": "SciFact train pairs",
                 "loss": "InfoNCE (streamed), sort_by_length, AdamW"},
              "rows": rows, "all_seconds": times}
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or RESULTS / f"chunk-auto-{args.device.split(':')[0]}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n" + "\n".join(table(rows)))
    print(f"wrote {out}")


def table(rows: list[dict]) -> list[str]:
    """Budget or fixed chunk, the chunks, estimate, peak, share of the budget, step time."""
    lines = [f"{'point':<14}{'chunks (q/d)':>14}{'estimate MB':>13}{'peak MB':>10}"
             f"{'used':>7}{'step s':>9}{'vs best fixed':>15}{'(within)':>10}"]
    for r in rows:
        name = (f"auto {r['budget_mb'] / 1024:g} GB" if r.get("budget_mb") else
                f"{r['kind']} {r['value']}")
        if "failed" in r:
            lines.append(f"{name:<14} failed: {r['failed'][-80:]}")
            continue
        sizes = f"{r['sizes']['query']}/{r['sizes']['doc']}" + (" plain" if r["plain"] else "")
        used = f"{r['budget_used']:.0%}" if r.get("budget_used") is not None else ""
        vs = f"{r['best_fixed']['auto_over_it']:.3f}" if "best_fixed" in r else ""
        within = f"{r['best_fixed_within_budget']['auto_over_it']:.3f}" \
            if "best_fixed_within_budget" in r else ""
        lines.append(f"{name:<14}{sizes:>14}{r['estimate_mb']:>13,.0f}"
                     f"{r['peak_mb'] or 0:>10,.0f}{used:>7}{r.get('step_seconds', 0):>9.2f}"
                     f"{vs:>15}{within:>10}")
    return lines


if __name__ == "__main__":
    main()
