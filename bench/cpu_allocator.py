"""Why a larger chunk can be slower on the CPU: the memory allocator's page faults.

A chunk's activations are a few tensors per layer of ``rows x tokens x width`` (and
``rows x heads x tokens x tokens`` for attention). glibc's malloc hands each allocation above
its mmap threshold (which adapts upwards, but never beyond 32 MiB on 64-bit Linux) a fresh
``mmap`` and returns it to the kernel when freed, so every such tensor is faulted in and
zeroed, page by page, each time it is made. A larger chunk makes more of its tensors cross
that line. This benchmark times one GradCache step at each chunk plan (``--plans``, queries
/ documents), in interleaved rounds, once per allocator setting (``--settings``), each
setting in a process of its own (the allocator reads its settings at start):

=========  ======================================================================
default    glibc as it comes
heap       ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<1 TiB>``: every block from the
           heap, kept when freed (resident memory stays at the step's peak)
hugepages  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``: glibc asks for transparent huge
           pages (2 MiB) for its blocks, where the kernel allows them (``madvise``)
=========  ======================================================================

and records each step's wall and CPU seconds and the minor page faults it took
(``getrusage``). The step is bench/chunk_auto.py's: all-MiniLM-L6-v2 (or a tiny random BERT)
in training mode on SciFact's first ``--batch`` training pairs, InfoNCE, length-sorted
chunks, AdamW.

    python bench/cpu_allocator.py --plans 16/16,16/36 --batch 128 --threads 2 --rounds 3
    python bench/cpu_allocator.py --dry     # a tiny BERT, 8 pairs, 1 round: that it runs

Writes bench/results/cpu-allocator.json (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import MODELS, RESULTS, machine, now, timed_rounds, weights

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "heap": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2 ** 40)},
    "hugepages": {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
}
ALLOCATOR_VARIABLES = sorted({k for env in SETTINGS.values() for k in env})


def plans_of(text: str) -> list[dict[str, int]]:
    """``16/16,16/36`` -> ``[{"query": 16, "doc": 16}, {"query": 16, "doc": 36}]``."""
    out = []
    for item in text.split(","):
        q, _, d = item.partition("/")
        out.append({"query": int(q), "doc": int(d or q)})
    return out


def point(args: argparse.Namespace) -> dict:
    """In this process (one allocator setting): every plan's steps, interleaved rounds."""
    import torch
    from chunk_auto import build, engine

    if args.threads:
        torch.set_num_threads(args.threads)
    tower, params, inputs = build(args.model, "cpu", args.max_length, args.batch)
    sizer, opt = engine(tower, params, "cpu", "auto", 2 ** 40)
    plan = sizer.plan_chunks(inputs, use=False)
    plans = {f"{p['query']}/{p['doc']}": p for p in plans_of(args.plans)}
    names = list(plans)
    caches = {n: engine(tower, params, "cpu", "auto", 2 ** 40, plan=plan.at(p))[0]
              for n, p in plans.items()}
    steps: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    start: dict[str, float] = {}

    def before() -> None:  # timed_rounds times what follows: the step, then AdamW's
        opt.zero_grad(set_to_none=True)
        start.update(faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt,
                     cpu=time.process_time())

    def step(name: str) -> None:
        caches[name].step(**inputs)
        opt.step()
        steps[name].append({"cpu_s": time.process_time() - start["cpu"], "minor_faults":
                            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start["faults"]})

    for name in names:  # the first step of each makes the optimizer's states: untimed
        before()
        step(name)
        steps[name].clear()
    wall = timed_rounds({n: (lambda n=n: step(n)) for n in names}, args.rounds, "cpu",
                        before=before, warmup=False)
    for name in names:
        for record, seconds in zip(steps[name], wall[name]):
            record["wall_s"] = seconds
    return {"steps": steps, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_setting(setting: str, args: argparse.Namespace) -> dict:
    """One allocator setting's point in a fresh process (its variables set, others cleared)."""
    env = {k: v for k, v in os.environ.items() if k not in ALLOCATOR_VARIABLES}
    env |= {"HF_HUB_OFFLINE": "1", **SETTINGS[setting]}
    cmd = [sys.executable, __file__, "--point", "--plans", args.plans, "--batch", str(args.batch),
           "--max-length", str(args.max_length), "--model", args.model, "--threads",
           str(args.threads), "--rounds", str(args.rounds)]
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=None, text=True,
                       timeout=args.timeout)
    if p.returncode != 0:
        return {"failed": f"exit {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def summary(steps: list[dict[str, float]]) -> dict[str, float]:
    return {"median_wall_s": statistics.median(s["wall_s"] for s in steps),
            "min_wall_s": min(s["wall_s"] for s in steps),
            "median_cpu_s": statistics.median(s["cpu_s"] for s in steps),
            "median_minor_faults": statistics.median(s["minor_faults"] for s in steps)}


def table(rows: dict[str, dict]) -> list[str]:
    lines = [f"{'setting':<11}{'chunks (q/d)':>14}{'median s':>10}{'fastest s':>11}"
             f"{'CPU s':>9}{'faults':>12}{'peak RSS MB':>13}"]
    for setting, r in rows.items():
        if "failed" in r:
            lines.append(f"{setting:<11} failed: {r['failed']}")
            continue
        for name, s in r["summary"].items():
            lines.append(f"{setting:<11}{name:>14}{s['median_wall_s']:>10.2f}"
                         f"{s['min_wall_s']:>11.2f}{s['median_cpu_s']:>9.2f}"
                         f"{s['median_minor_faults']:>12,.0f}{r['peak_rss_mb']:>13,.0f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plans", default="16/16,16/36",
                    help="chunk plans, queries/documents, comma-separated")
    ap.add_argument("--settings", default=",".join(SETTINGS),
                    help="allocator settings (" + ", ".join(SETTINGS) + ")")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--model", choices=sorted(MODELS), default="minilm")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per setting")
    ap.add_argument("--dry", action="store_true",
                    help="a tiny random BERT, 8 pairs, max length 32, 1 round, 1 thread (that it "
                         "runs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dry:
        args.model, args.batch, args.max_length, args.rounds, args.plans, args.threads = \
            "tiny-bert", 8, 32, 1, "2/2,4/4", 1
    if args.point:
        print(json.dumps(point(args)))
        return
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        sys.exit(f"--settings: no setting {unknown} ({', '.join(SETTINGS)})")
    rows = {}
    for setting in args.settings.split(","):
        r = run_setting(setting, args)
        if "steps" in r:
            r["summary"] = {n: summary(s) for n, s in r["steps"].items()}
        rows[setting] = {"variables": SETTINGS[setting], **r}
    result = {"benchmark": "cpu-allocator", "date": now(), "machine": machine("cpu"),
              "command": "python bench/cpu_allocator.py " + " ".join(sys.argv[1:]),
              "settings": {k: v for k, v in vars(args).items() if k != "point"}
              | {"model": MODELS[args.model], **weights(args.model), "data": "SciFact train pairs",
                 "loss": "InfoNCE (streamed), sort_by_length, AdamW",
                 "transparent_hugepages": _thp()},
              "rows": rows}
    out = Path(args.out or RESULTS / ("cpu-allocator-dry.json" if args.dry
                                      else "cpu-allocator.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(table(rows)))
    print(f"wrote {out}")


def _thp() -> str | None:
    """The kernel's transparent huge page mode (``[madvise]``: only where asked)."""
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return None


if __name__ == "__main__":
    main()
